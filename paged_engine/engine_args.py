"""``EngineArgs``: everything that builds an engine, under vLLM's names.

vLLM scripts build their engine from an ``EngineArgs`` (``LLMEngine.from_engine_args``)
or pass the same names to ``LLM(...)``; both land here, so a name means one thing in both
and is refused in one place. Why a record apart from ``EngineConfig``: the config holds
what the engine runs with, under the engine's own names and with every value checked;
the arguments also carry the model's paths, vLLM's spellings (``block_size``,
``num_gpu_blocks_override``, ``kv_cache_memory_bytes``), and vLLM arguments that choose
something this engine does one way only (``kv_cache_dtype``, ``quantization``, ...): each
is accepted where its value means what the engine does, and otherwise refused with a
one-line reason that names it (``VLLM_ONLY``).

Torch-free: importing the package imports this module.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from paged_engine.config import EngineConfig, default_num_threads
from paged_engine.cpu_bind import check_cpu_bind, default_cpu_bind

logger = logging.getLogger(__name__)


def _default(name: str) -> Any:
    """``EngineConfig``'s default for ``name``: one source for both records (a slots
    dataclass keeps no class-level default to read)."""
    f = EngineConfig.__dataclass_fields__[name]
    assert f.default is not MISSING, name
    return f.default


CONFIG_NAMES = {
    "block_size": "kvcache_block_size",
    "num_gpu_blocks_override": "num_kvcache_blocks",
    "kv_cache_memory_bytes": "kv_cache_memory",
}
"""vLLM's name -> ``EngineConfig``'s, where they differ. ``LLM(...)`` accepts either."""

VLLM_ONLY: dict[str, tuple[tuple[object, ...], str]] = {
    "pipeline_parallel_size": ((None, 1), "pipeline parallelism is not supported: use 1"),
    "enable_chunked_prefill": (
        (None, True),
        "the scheduler always splits a prompt longer than the step's token budget "
        "(max_num_batched_tokens) into chunks, which changes no output: use True",
    ),
    "revision": (
        (None,),
        "only local directories and .gguf files load, and they have no revisions "
        "(nothing is downloaded): use None",
    ),
    "runner": (
        ("auto", "generate", "pooling"),
        "the one runner generates and pools (LLM.generate/chat and LLM.embed/encode/score "
        "work on any model): use 'auto', 'generate' or 'pooling'",
    ),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model's dtype: use 'auto'"),
    "load_format": (
        ("auto", "safetensors", "gguf"),
        "the loaders read safetensors directories and .gguf files: use 'auto', "
        "'safetensors' or 'gguf'",
    ),
    "trust_remote_code": (
        (False,),
        "no remote code runs here: only the built-in architectures load "
        "(paged_engine/models/registry.py)",
    ),
    "quantization": (
        (None,),
        "weights are dequantized when loaded (GGUF's Q8_0, Q4_0, Q4_1) and no quantized "
        "matmul runs: use None",
    ),
}
"""vLLM arguments with the values that mean what this engine does, and why the others
cannot; a refusal reads ``"{name}={value!r}: {reason}"``."""


def _one_of(value: object, allowed: tuple[object, ...]) -> bool:
    """``value`` is one of ``allowed`` by type too: ``True`` is not ``1``."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


@dataclass(slots=True)
class EngineArgs:
    """The arguments of ``LLMEngine.from_engine_args`` and ``LLM(...)`` (vLLM's names).

    The engine's settings (documented on ``EngineConfig``, whose defaults these are):
    ``block_size``, ``max_model_len`` (None: 4096, capped at the model's
    ``max_position_embeddings``), ``max_num_seqs``, ``max_num_batched_tokens`` (None:
    chosen per device), ``enable_prefix_caching``, ``num_gpu_blocks_override`` (the KV
    pool in blocks), ``kv_cache_memory_bytes`` (the pool in bytes, CPU),
    ``gpu_memory_utilization``, ``max_logprobs``, ``dtype``, ``seed`` (None: 0, as vLLM
    V1), ``tensor_parallel_size``, ``enforce_eager``; this engine's own
    ``attention_backend``, ``device``, ``num_threads``, ``cpu_bind`` (vLLM has only its
    ``VLLM_CPU_OMP_THREADS_BIND`` variable, whose syntax it takes), ``max_n``,
    ``prefix_cache_hash``, ``mixed_steps``.

    vLLM's other arguments (``VLLM_ONLY`` says which values are refused, and why):
    ``pipeline_parallel_size`` (1), ``enable_chunked_prefill`` (None or True: prompts
    are always chunked), ``revision`` (None), ``kv_cache_dtype`` ("auto"),
    ``load_format`` ("auto", "safetensors" for a Hugging Face directory, "gguf" for a
    .gguf file), ``trust_remote_code`` (False), ``quantization`` (None), ``runner``
    ("auto", "generate", "pooling": one runner does both);
    ``disable_log_stats`` is accepted and changes nothing (the offline engine logs no
    periodic stats; ``last_run_stats`` is kept either way), ``swap_space`` (GiB) is
    accepted and ignored with a log line, as vLLM V1 ignores it: a preempted sequence is
    recomputed, never swapped out.

    Mutable and checked when used (``create_engine_config``), as vLLM's: scripts set
    fields after construction.
    """

    model: str | Path
    tokenizer: str | Path | None = None
    block_size: int = _default("kvcache_block_size")
    max_model_len: int | None = None
    max_num_seqs: int = _default("max_num_seqs")
    max_num_batched_tokens: int | None = _default("max_num_batched_tokens")
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    mixed_steps: bool = _default("mixed_steps")
    num_gpu_blocks_override: int | None = _default("num_kvcache_blocks")
    kv_cache_memory_bytes: int | None = _default("kv_cache_memory")
    gpu_memory_utilization: float = _default("gpu_memory_utilization")
    max_logprobs: int = _default("max_logprobs")
    dtype: str = _default("dtype")
    seed: int | None = _default("seed")
    tensor_parallel_size: int = _default("tensor_parallel_size")
    distributed_executor_backend: str = _default("distributed_executor_backend")
    enforce_eager: bool = _default("enforce_eager")
    attention_backend: str = _default("attention_backend")
    device: str = _default("device")
    num_threads: int | None = field(default_factory=default_num_threads)
    cpu_bind: str = field(default_factory=default_cpu_bind)
    max_n: int = _default("max_n")
    prefix_cache_hash: str = _default("prefix_cache_hash")
    pipeline_parallel_size: int = 1
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = False
    revision: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    trust_remote_code: bool = False
    quantization: str | None = None
    swap_space: float | None = None
    runner: str = "auto"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's: ``--model``, ``--tokenizer`` and the engine flags the CLI's commands
        share (``entrypoints/cli_args.py``, vLLM's flag names), added to ``parser``. Every
        dest is a name ``LLM(...)`` takes, with ``LLM``'s default, so ``LLM(**vars(args))``
        works; ``--model`` may come from ``parser.set_defaults(model=...)``."""
        from paged_engine.entrypoints.cli_args import add_engine_args

        parser.add_argument("--model", default=None, help="a model directory or .gguf file")
        parser.add_argument("--tokenizer", default=None, help="another tokenizer directory")
        parser.add_argument(
            "--runner", default="auto", help="vLLM's: auto, generate or pooling (one runner)"
        )
        add_engine_args(parser)
        parser.set_defaults(num_threads=default_num_threads(), cpu_bind=default_cpu_bind())
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """vLLM's: the arguments ``add_cli_args``' flags parsed into ``args``."""
        from paged_engine.entrypoints.cli_args import engine_fields

        fields = engine_fields(args) | {"runner": getattr(args, "runner", "auto")}
        return engine_args_from_kwargs(args.model, args.tokenizer, fields)

    def create_engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` these arguments ask for (``max_model_len`` as given: the
        default, capped by the model, is applied once the model is read). Refuses, naming
        the argument, a value this engine cannot honour (``VLLM_ONLY``) or that the
        config refuses; logs the ignored ``swap_space``."""
        for name, (allowed, reason) in VLLM_ONLY.items():
            value = getattr(self, name)
            if not _one_of(value, allowed):
                raise ValueError(f"{name}={value!r}: {reason}")
        if not isinstance(self.disable_log_stats, bool):
            raise ValueError(f"disable_log_stats must be a bool, got {self.disable_log_stats!r}")
        swap = self.swap_space
        if swap is not None:
            if isinstance(swap, bool) or not isinstance(swap, int | float) or not swap >= 0:
                raise ValueError(f"swap_space must be None or a number of GiB >= 0, got {swap!r}")
            logger.info(
                "swap_space=%s is ignored: a preempted sequence is recomputed, never "
                "swapped to CPU memory (as in vLLM V1)",
                swap,
            )
        values: dict[str, Any] = {}
        for f in fields(EngineConfig):
            arg = next((a for a, c in CONFIG_NAMES.items() if c == f.name), f.name)
            value = getattr(self, arg)
            if value is None and arg in ("max_model_len", "seed"):
                continue  # the config's default (max_model_len is capped later)
            values[f.name] = value
        config = EngineConfig(**values)
        check_cpu_bind(config.cpu_bind, config.tensor_parallel_size)
        return config

    def check_load_format(self) -> None:
        """``load_format`` "gguf" names a .gguf file (or a directory holding one and no
        config.json), "safetensors" a Hugging Face directory; a path that does not exist
        is left to the loader, which says so."""
        fmt, model = self.load_format, self.model
        if fmt == "auto" or not isinstance(model, str | Path) or not Path(model).exists():
            return
        path = Path(model)
        hf_dir = path.is_dir() and (path / "config.json").is_file()
        if fmt == "gguf" and hf_dir:
            raise ValueError(
                f"load_format='gguf': {path} is a Hugging Face directory (config.json), "
                "not a .gguf file: use 'auto' or 'safetensors'"
            )
        if fmt == "safetensors" and not hf_dir:
            raise ValueError(
                f"load_format='safetensors': {path} is not a Hugging Face directory with a "
                "config.json: use 'auto', or 'gguf' for a .gguf file"
            )


ENGINE_ALIASES = {config: vllm for vllm, config in CONFIG_NAMES.items()}
"""``EngineConfig``'s names that ``LLM(...)`` takes for vLLM's (what it took before)."""


def engine_args_from_kwargs(
    model: str | Path, tokenizer: str | Path | None, kwargs: dict[str, Any]
) -> EngineArgs:
    """``LLM(model, tokenizer=..., **kwargs)``'s arguments as ``EngineArgs``: vLLM's names
    or the engine's (``ENGINE_ALIASES``), not both; an unknown name is a TypeError listing
    the known ones."""
    if not isinstance(model, str | Path) or not str(model):
        raise ValueError(f"model must be a model directory or .gguf file (--model), got {model!r}")
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = ENGINE_ALIASES.get(key, key)
        if name in values:
            raise TypeError(f"both {name!r} and {CONFIG_NAMES[name]!r} given")
        values[name] = value
    known = {f.name for f in fields(EngineArgs)} - {"model"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(
            f"unknown LLM argument(s) {unknown}; known: {sorted(known | set(ENGINE_ALIASES))}"
        )
    return EngineArgs(model=model, tokenizer=tokenizer, **values)


__all__ = ["CONFIG_NAMES", "VLLM_ONLY", "EngineArgs", "engine_args_from_kwargs"]
