"""The vLLM-shaped ``LLM`` on the tiny Qwen3: construction with vLLM's names, one prompt or
many, streamed text equal to the final text, stop strings through the real tokenizer,
seeded ``n``, logprob dictionaries, chat, and the README's snippet."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from paged_engine import LLM, SamplingParams
from paged_engine.engine.detokenizer import IncrementalDetokenizer

SMALL = dict(num_kvcache_blocks=64, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=tiny_model_dir, block_size=8, **SMALL)


def test_vllm_names_and_refusals(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), block_size=4, **SMALL)
    assert llm.config.kvcache_block_size == 4
    assert llm.engine is llm.llm_engine and llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(TypeError, match=r"unknown LLM argument.*'block_sise'"):
        LLM(tiny_model_dir, block_sise=4)
    with pytest.raises(TypeError, match="both 'block_size' and 'kvcache_block_size'"):
        LLM(tiny_model_dir, block_size=4, kvcache_block_size=4)
    # tensor_parallel_size is vLLM's name and accepted; a model it cannot shard evenly is
    # refused naming the field (tests/test_tp_lifecycle.py: before any worker starts)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by "):
        LLM(tiny_model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: pipeline parallelism"):
        LLM(tiny_model_dir, pipeline_parallel_size=2)
    with pytest.raises(FileNotFoundError, match=r"only local Hugging Face directories.*download"):
        LLM("Qwen/Qwen3-0.6B")


def test_one_prompt_or_a_list(llm: LLM) -> None:
    (one,) = llm.generate("The KV cache is", GREEDY, use_tqdm=False)
    many = llm.generate(["The KV cache is", "Hello, world!"], sampling_params=GREEDY)
    assert one.outputs[0].token_ids == many[0].outputs[0].token_ids
    assert one.prompt == "The KV cache is" and len(one.outputs[0].token_ids) == 24
    ids = llm.tokenizer.encode("Hello, world!")  # type: ignore[union-attr]
    (by_ids,) = llm.generate(ids, GREEDY, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == many[1].outputs[0].token_ids
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids


def _stream(llm: LLM, prompt: str, params: SamplingParams) -> list[Any]:
    engine = llm.llm_engine
    engine.add_request("s", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_streamed_text_grows_to_the_text_generate_returns(llm: LLM) -> None:
    """Two code paths: step-by-step detokenisation while streaming, one decode at the end
    in ``generate``; they must agree, and streamed text only ever grows."""
    for prompt in ("Once upon a time", "Computers store numbers in binary. A byte"):
        (final,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        outs = _stream(llm, prompt, GREEDY)
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
        assert texts[-1] == final.outputs[0].text
        assert outs[-1].outputs[0].token_ids == final.outputs[0].token_ids


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 767), min_size=1, max_size=30), cut=st.integers(0, 6))
# The prompt ends in a UTF-8 lead byte (129) that the completion's first token (97)
# would complete: found by CI's examples, once the context carried it over.
@example(ids=[0, 0, 129, 97], cut=3)
def test_incremental_detokenisation_equals_one_decode(ids: list[int], cut: int) -> None:
    """Any token ids (byte fragments included) decode step by step to the same text as
    at once (the prompt, ``ids[:cut]``, is no decoding context)."""
    from paged_engine.utils.tiny_model import train_tokenizer

    tok = _TOKENIZER.setdefault("t", train_tokenizer())
    completion = ids[cut:]
    detok = IncrementalDetokenizer(skip_special_tokens=True)
    for t in completion:
        detok.add(tok, [t])
    whole = tok.decode(completion, skip_special_tokens=True)
    # Held back at the end only while a character is incomplete (U+FFFD in the full text);
    # flushed when the completion ends, the text is exactly one decode's.
    assert whole.startswith(detok.text)
    assert detok.text == whole or whole.endswith("\ufffd")
    detok.flush(tok)
    assert detok.text == whole


_TOKENIZER: dict[str, Any] = {}


def test_a_stop_string_across_a_token_boundary(llm: LLM) -> None:
    tok = llm.tokenizer
    assert tok is not None
    (free,) = llm.generate("Once upon a time", GREEDY, use_tqdm=False)
    ids = free.outputs[0].token_ids
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    # A stop string made of the last 2 characters of token 5's text and the first of 6's.
    j = next(j for j in range(5, len(ids)) if len(pieces[j]) - len(pieces[j - 1]) >= 2)
    stop = pieces[j + 1][len(pieces[j]) - 2 : len(pieces[j]) + 1]
    k = next(k for k in range(1, len(ids) + 1) if stop in pieces[k])  # first completes here
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
            include_stop_str_in_output=include,
        )  # fmt: skip
        (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
        c = out.outputs[0]
        at = pieces[k].index(stop)
        assert c.text == pieces[k][: at + (len(stop) if include else 0)]
        assert c.token_ids == ids[:k] and (c.finish_reason, c.stop_reason) == ("stop", stop)


def test_seeded_n_is_reproducible_and_independent_of_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=7, ignore_eos=True)
    (alone,) = llm.generate("The weather today", params, use_tqdm=False)
    crowd = llm.generate(
        ["Hello", "The weather today", "Music can"],
        [SamplingParams(temperature=0.8, max_tokens=9), params, GREEDY],
        use_tqdm=False,
    )
    got = [c.token_ids for c in alone.outputs]
    assert [c.token_ids for c in crowd[1].outputs] == got
    assert len({tuple(t) for t in got}) > 1, "the four completions should differ"
    (other_seed,) = llm.generate("The weather today", SamplingParams(
        temperature=1.0, max_tokens=12, n=4, seed=8, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in other_seed.outputs] != got


def test_logprob_dictionaries(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3, ignore_eos=True)
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 6
    total = 0.0
    for token, position in zip(c.token_ids, c.logprobs, strict=True):
        assert token in position and 3 <= len(position) <= 4
        tops = sorted((lp for t, lp in position.items()), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in tops[:3]] == [1, 2, 3] or token in [
            t for t, lp in position.items() if lp.rank not in (1, 2, 3)
        ]
        assert all(lp.logprob <= 0 for lp in position.values())
        assert position[token].decoded_token == llm.tokenizer.decode([token])  # type: ignore[union-attr]
        total += position[token].logprob
    assert c.cumulative_logprob == pytest.approx(total)
    (plain,) = llm.generate("Once upon a time", GREEDY, use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_chat_renders_the_template(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = llm.tokenizer
    assert tok is not None
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    monkeypatch.setattr(tok, "chat_template", None)  # the tiny model's own: test_vllm_surface
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(conv, GREEDY)
    (out,) = llm.chat(conv, GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    rendered = "<|bos|>user: What is the capital of France?\nassistant:"
    (direct,) = llm.generate(rendered, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == tok.encode(rendered)
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    both = llm.chat([conv, [*conv, {"role": "user", "content": "Why?"}]], GREEDY,
                    chat_template=TEMPLATE, use_tqdm=False)  # fmt: skip
    assert len(both) == 2 and both[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(TypeError, match="conversation 1"):
        llm.chat([conv, "hello"], GREEDY, chat_template=TEMPLATE)


def test_the_readme_snippet_runs_on_a_tiny_model(tiny_model_dir: Path) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet is not None
    code = snippet.group(1).replace('"path/to/model-dir"', repr(str(tiny_model_dir)))
    assert repr(str(tiny_model_dir)) in code, "the snippet's model path changed"
    exec(compile(code, "README.md", "exec"), {})
