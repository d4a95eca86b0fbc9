"""Command line: ``python -m paged_engine {make-tiny-model,generate,demo}``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from paged_engine.config import ATTENTION_BACKENDS

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


def default_cache_dir() -> Path:
    root = os.environ.get("PAGED_ENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "paged_engine"
    )
    return Path(root)


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes (CPU)")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (default: 4096, capped at the model's max_position_embeddings)",
    )
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _engine_config(a: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(
        kvcache_block_size=a.block_size,
        num_kvcache_blocks=a.num_kv_blocks,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        attention_backend=a.attention_backend,
        device=a.device,
        dtype=a.dtype,
        enable_prefix_caching=not a.no_prefix_caching,
        num_threads=a.threads,
    )
    if a.kv_cache_memory is not None:
        cfg["kv_cache_memory"] = a.kv_cache_memory
    if a.max_model_len is not None:
        cfg["max_model_len"] = a.max_model_len
    return cfg


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from paged_engine.utils.tiny_model import make_tiny_model

    path = make_tiny_model(
        a.dir, seed=a.seed, num_layers=a.layers, hidden_size=a.hidden_size, num_shards=a.shards
    )
    print(f"wrote a tiny random Qwen3 (and its tokenizer) to {path}")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from paged_engine import LLM, SamplingParams

    llm = LLM(a.model, **_engine_config(a))
    params = SamplingParams(
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        max_tokens=a.max_tokens,
        ignore_eos=a.ignore_eos,
        seed=a.seed,
    )
    prompts: list[Any] = list(a.prompt)
    for out in llm.generate(prompts, params, use_tqdm=not a.quiet):
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from paged_engine import LLM, SamplingParams
    from paged_engine.utils.tiny_model import make_tiny_model

    model_dir = Path(a.cache_dir) / "tiny-qwen3"
    if not (model_dir / "config.json").is_file():
        print(f"building the tiny demo model once, into {model_dir}")
        make_tiny_model(
            model_dir, num_layers=4, hidden_size=128, head_dim=32, intermediate_size=384
        )
    t0 = time.perf_counter()
    llm = LLM(model_dir, **_engine_config(a))
    print(f"loaded {model_dir} in {time.perf_counter() - t0:.1f}s")
    prompts = [s + " " + q for s in DEMO_SYSTEM_PROMPTS for q in DEMO_QUESTIONS][: a.requests]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    stats = llm.last_run_stats
    assert stats is not None
    print(f"\nfirst answer: {outs[0].text!r}")
    print(f"requests:              {stats.num_requests}")
    print(f"output tokens/s:       {stats.output_tokens_per_s:,.0f}")
    print(f"prefix-cache hit rate: {stats.prefix_cache_hit_rate:.1%} of prompt tokens")
    print(f"preemptions:           {stats.preemptions}")
    print(
        f"KV pool use:           peak {stats.peak_blocks_in_use} of {stats.num_blocks} blocks "
        f"({stats.peak_blocks_in_use / stats.num_blocks:.0%})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a tiny random Qwen3 in Hugging Face format")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--shards", type=int, default=1)
    p.set_defaults(fn=cmd_make_tiny_model)

    p = sub.add_parser("generate", help="generate from a model directory")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("demo", help="build the tiny model once and serve a shared-prefix batch")
    p.add_argument("--cache-dir", default=str(default_cache_dir()))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    _engine_args(p)
    # The tiny model's matrices are too small to share between threads (see num_threads).
    # A pool of 160 blocks is tight for 32 requests, so preemption shows up in the figures.
    p.set_defaults(fn=cmd_demo, num_kv_blocks=160, max_model_len=1024, threads=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return int(args.fn(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
