"""Command line: ``python -m paged_engine {make-tiny-model,generate,demo}``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from paged_engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    PREFIX_CACHE_HASHES,
    EngineConfig,
    default_num_threads,
)
from paged_engine.sampling_params import SamplingParams

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


ENGINE_FLAGS: dict[str, str] = {
    "kvcache_block_size": "--block-size",
    "num_kvcache_blocks": "--num-kv-blocks",
    "kv_cache_memory": "--kv-cache-memory",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "attention_backend": "--attention-backend",
    "device": "--device",
    "dtype": "--dtype",
    "enable_prefix_caching": "--enable-prefix-caching",
    "prefix_cache_hash": "--prefix-cache-hash",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "seed": "--seed",
    "num_threads": "--threads",
}
"""The flag of each EngineConfig field the CLI sets (its argparse dest is the flag's name
in snake case); errors name the flag."""
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "ignore_eos")
FLAGS = ENGINE_FLAGS | {f: "--" + f.replace("_", "-") for f in SAMPLING_FIELDS}
"""Every field the CLI sets, to its flag."""

_FIELD = re.compile(r"\b(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")\b")


def flag_message(message: str) -> str:
    """``message`` with field names replaced by their flags: every one with an underscore,
    a one-word name (``device``, ``seed``) only where the message starts with it."""

    def swap(m: re.Match[str]) -> str:
        return FLAGS[m[1]] if "_" in m[1] or m.start() == 0 else m[0]

    return _FIELD.sub(swap, message)


NONE_MEANS: dict[str, str] = {
    "num_kv_blocks": "auto: from --kv-cache-memory",
    "kv_cache_memory": "auto: --max-num-seqs sequences of --max-model-len tokens, at most "
    "half the available memory",
    "max_model_len": "4096, capped at the model's max_position_embeddings",
    "threads": f"auto, {default_num_threads()} here: the physical cores this process may "
    "use but one when OpenMP waits passively, else 1",
    "top_k": "None: every token",
}
"""What a flag left at None stands for, shown in ``--help`` as its default."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after every optional flag's help; for None, what None stands for."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return action.help
        if action.default is None and action.dest in NONE_MEANS:
            return f"{action.help} (default: {NONE_MEANS[action.dest]})"
        return super()._get_help_string(action)


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (EngineConfig; vLLM's flag names where it has one)")
    add = g.add_argument
    add("--block-size", type=int, default=16, metavar="N", help="KV block size in tokens")
    add(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=int,
        metavar="N",
        help="KV pool size in blocks, overrides --kv-cache-memory",
    )
    add(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        type=int,
        metavar="BYTES",
        help="KV pool bytes on CPU",
    )
    add("--max-model-len", type=int, metavar="N", help="longest sequence, prompt and output")
    add("--max-num-seqs", type=int, default=256, metavar="N", help="sequences per step")
    add("--max-num-batched-tokens", type=int, default=8192, metavar="N", help="tokens per step")
    backends = list(ATTENTION_BACKENDS)
    add("--attention-backend", default="auto", choices=backends, help="see README")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--dtype", default="auto", choices=list(DTYPES), help="auto: float32 on CPU")
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks between requests with a common prefix",
    )
    add(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=argparse.SUPPRESS,
        help="the same as --no-enable-prefix-caching",
    )
    add(
        "--prefix-cache-hash",
        default="xxh64",
        choices=list(PREFIX_CACHE_HASHES),
        help="block hash of the prefix cache; sha256 resists crafted collisions",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of GPU memory for the model and the KV pool (CUDA)",
    )
    add(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seeds the engine; in generate also every request, so a prompt samples the "
        "same tokens whatever else is in the batch",
    )
    add("--threads", type=int, metavar="N", help="torch CPU threads (process-wide)")


def _engine_fields(a: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from the flags; ``max_model_len`` and
    ``num_threads`` only when given, so that ``LLM`` applies its defaults."""
    values = {f: getattr(a, flag[2:].replace("-", "_")) for f, flag in ENGINE_FLAGS.items()}
    return {
        f: v
        for f, v in values.items()
        if v is not None or f not in ("max_model_len", "num_threads")
    }


def _positive(text: str) -> int:
    """argparse type for counts that no config checks (it names the flag on error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def _sampling(a: argparse.Namespace) -> SamplingParams:
    if a.command == "demo":
        return SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    return SamplingParams(
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        max_tokens=a.max_tokens,
        ignore_eos=a.ignore_eos,
        seed=a.seed,
    )


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from paged_engine.utils.tiny_model import make_tiny_model

    path = make_tiny_model(
        a.dir, seed=a.seed, num_layers=a.layers, hidden_size=a.hidden_size, num_shards=a.shards
    )
    print(f"wrote a tiny random Qwen3 (and its tokenizer) to {path}")
    return 0


def cmd_generate(a: argparse.Namespace, fields: dict[str, Any], params: SamplingParams) -> int:
    from paged_engine import LLM

    llm = LLM(a.model, **fields)
    prompts: list[Any] = list(a.prompt)
    for out in llm.generate(prompts, params, use_tqdm=not a.quiet):
        c = out.outputs[0]
        print(c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids)))
    return 0


def cmd_demo(a: argparse.Namespace, fields: dict[str, Any], params: SamplingParams) -> int:
    from paged_engine import LLM
    from paged_engine.utils.tiny_model import make_tiny_model

    model_dir = Path(a.cache_dir) / "tiny-qwen3"
    if not (model_dir / "config.json").is_file():
        print(f"building the tiny demo model once, into {model_dir}")
        make_tiny_model(
            model_dir, num_layers=4, hidden_size=128, head_dim=32, intermediate_size=384
        )
    t0 = time.perf_counter()
    llm = LLM(model_dir, **fields)
    print(f"loaded {model_dir} in {time.perf_counter() - t0:.1f}s")
    prompts = [s + " " + q for s in DEMO_SYSTEM_PROMPTS for q in DEMO_QUESTIONS][: a.requests]
    outs = llm.generate(prompts, params)
    stats = llm.last_run_stats
    assert stats is not None
    print(f"\nfirst answer: {outs[0].outputs[0].text!r}")
    print(f"requests:              {stats.num_requests}")
    print(f"output tokens/s:       {stats.output_tokens_per_s:,.0f}")
    print(f"prefix-cache hit rate: {stats.prefix_cache_hit_rate:.1%} of prompt tokens")
    print(f"preemptions:           {stats.preemptions}")
    print(
        f"KV pool use:           peak {stats.peak_blocks_in_use} of {stats.num_blocks} blocks "
        f"({stats.peak_blocks_in_use / stats.num_blocks:.0%})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paged_engine", description=__doc__, formatter_class=_HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random Qwen3 in Hugging Face format",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--layers", type=_positive, default=2, help="decoder layers")
    p.add_argument("--hidden-size", type=_positive, default=64, help="hidden size")
    p.add_argument("--shards", type=_positive, default=1, help="safetensors files")
    p.set_defaults(fn=cmd_make_tiny_model, parser=p)

    p = sub.add_parser(
        "generate", help="generate from a model directory", formatter_class=_HelpFormatter
    )
    p.add_argument("--model", required=True, help="Hugging Face-format Qwen3 directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    g = p.add_argument_group("sampling (SamplingParams; seeded by --seed)")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy")
    g.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="keep the K most likely tokens"
    )
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass")
    g.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_args(p)
    p.set_defaults(fn=cmd_generate, parser=p)

    p = sub.add_parser(
        "demo",
        help="build the tiny model once and serve a shared-prefix batch",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--cache-dir", default=str(default_cache_dir()), help="where the model goes")
    p.add_argument("--requests", type=_positive, default=32, help="requests (at most 32)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens each")
    _engine_args(p)
    # The tiny model's matrices are too small to share between threads (see num_threads).
    # A pool of 160 blocks is tight for 32 requests, so preemption shows up in the figures.
    p.set_defaults(fn=cmd_demo, parser=p, num_kv_blocks=160, max_model_len=1024, threads=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. Bad flags, including engine and sampling settings (checked by
    building ``EngineConfig`` and ``SamplingParams`` before any model loads), exit through
    argparse (``SystemExit(2)``, the message naming the flag); an error found later, by
    the model or a request, is printed and returns 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.command == "make-tiny-model":
        return int(args.fn(args))
    try:
        fields = _engine_fields(args)
        EngineConfig(**fields)
        params = _sampling(args)
    except (ValueError, TypeError) as e:
        args.parser.error(flag_message(str(e)))
    try:
        return int(args.fn(args, fields, params))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {flag_message(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
