"""The engine flags every command shares (vLLM's names), their help, and error messages
that name flags instead of ``EngineConfig`` fields.

One table (``ENGINE_FLAGS``) maps each field to its flag, so ``generate``, ``demo`` and
``serve`` accept the same engine flags and refuse a bad value by the flag's name.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from paged_engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    PREFIX_CACHE_HASHES,
    default_num_threads,
)
from paged_engine.cpu_bind import DEFAULT as CPU_BIND
from paged_engine.errors import InvalidRequestError

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
    "mixed_steps": "--mixed-steps",
    "prefix_cache_hash": "--prefix-cache-hash",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "seed": "--seed",
    "num_threads": "--threads",
    "cpu_bind": "--cpu-bind",
    "tensor_parallel_size": "--tensor-parallel-size",
    "distributed_executor_backend": "--distributed-executor-backend",
    "enforce_eager": "--enforce-eager",
}
"""The flag of each EngineConfig field the CLI sets (its argparse dest is the flag's name
in snake case, or ``ENGINE_DESTS``'); errors name the flag."""
ENGINE_DESTS: dict[str, str] = {
    "num_kvcache_blocks": "num_gpu_blocks_override",
    "num_threads": "num_threads",
}
"""Dests that differ from the flag's name: each is a name ``LLM(...)`` accepts, so a vLLM
script's ``LLM(**vars(args))`` takes what ``EngineArgs.add_cli_args`` parsed."""
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "ignore_eos")
FLAGS = ENGINE_FLAGS | {f: "--" + f.replace("_", "-") for f in SAMPLING_FIELDS}
"""Every field the CLI sets, to its flag."""

_FIELD = re.compile(r"\b(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")\b")


def flag_message(error: BaseException | str) -> str:
    """The error's message with field names replaced by their flags: every one with an
    underscore, and a one-word name (``device``, ``seed``, which prose may use too) only
    where it is the error's own field (``InvalidRequestError.field``) or, for an error that
    names none (a bare message), where the message starts with it."""
    message = str(error)
    field = error.field if isinstance(error, InvalidRequestError) else None

    def swap(m: re.Match[str]) -> str:
        name = m[1]
        own = name == field if field is not None else m.start() == 0
        return FLAGS[name] if "_" in name or own else m[0]

    return _FIELD.sub(swap, message)


NONE_MEANS: dict[str, str] = {
    "num_gpu_blocks_override": "auto: from --kv-cache-memory",
    "kv_cache_memory": "auto: --max-num-seqs sequences of --max-model-len tokens, at most "
    "half the available memory",
    "max_num_batched_tokens": "per device: 1024 on CPU, 8192 on CUDA",
    "max_model_len": "4096, capped at the model's max_position_embeddings",
    "num_threads": f"auto, {default_num_threads()} here: the physical cores this process may "
    "use but one when OpenMP waits passively, else 1",
    "cpu_bind": f"$PAGED_ENGINE_CPU_BIND, else $VLLM_CPU_OMP_THREADS_BIND, else {CPU_BIND}",
    "top_k": "None: every token",
    "api_key": "$PAGED_ENGINE_API_KEY if set, else none: every route is open",
    "served_model_name": "the model argument as given",
    "chat_template": "the tokenizer's, if it has one",
    "data_parallel_size_local": "--data-parallel-size: every replica on this node",
}
"""What a flag left at None stands for, shown in ``--help`` as its default."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after every optional flag's help; for None, what None stands for."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return action.help
        if action.default is None and action.dest in NONE_MEANS:
            return f"{action.help} (default: {NONE_MEANS[action.dest]})"
        return super()._get_help_string(action)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (EngineConfig; vLLM's flag names where it has one)")
    add = g.add_argument
    add("--block-size", type=int, default=16, metavar="N", help="KV block size in tokens")
    add(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks_override",
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
    add(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="tokens per step",
    )
    backends = list(ATTENTION_BACKENDS)
    add("--attention-backend", default="auto", choices=backends, help="see README")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="auto: on CPU bfloat16 for a 16-bit checkpoint when the CPU has AVX512-BF16 "
        "or AMX-BF16, else float32; on CUDA the checkpoint's 16-bit dtype, else bfloat16",
    )
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
        "--mixed-steps",
        action="store_true",
        help="each step decodes the running requests, then prefills in the budget left "
        "(vLLM V1's steps; default: a step prefills, or else decodes)",
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
    add(
        "--threads",
        dest="num_threads",
        type=int,
        metavar="N",
        help="torch CPU threads (process-wide)",
    )
    add(
        "--cpu-bind",
        metavar="CPUS",
        help="the CPUs the engine's threads run on: auto (each rank its own cores, the "
        "last ones), off, or one list per rank split by '|', e.g. 0-3|4-7",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N ranks (N - 1 worker processes), one device each",
    )
    add(
        "--distributed-executor-backend",
        default="mp",
        metavar="NAME",
        help="what runs ranks 1..N-1: mp (spawned processes, the default) or ray (Ray "
        "actors on the cluster that ray.init() finds; extra paged_engine[ray])",
    )
    add(
        "--enforce-eager",
        action="store_true",
        help="run decode eagerly instead of replaying CUDA graphs (CUDA only; eager elsewhere)",
    )


def dest(field: str) -> str:
    """The argparse dest of ``EngineConfig`` field ``field``'s flag."""
    return ENGINE_DESTS.get(field, ENGINE_FLAGS[field][2:].replace("-", "_"))


def engine_fields(a: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from the flags; ``max_model_len`` and
    ``num_threads`` and ``cpu_bind`` only when given, so that ``LLM`` applies its
    defaults."""
    values = {f: getattr(a, dest(f)) for f in ENGINE_FLAGS}
    return {
        f: v
        for f, v in values.items()
        if v is not None or f not in ("max_model_len", "num_threads", "cpu_bind")
    }


def positive(text: str) -> int:
    """argparse type for counts that no config checks (it names the flag on error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value
