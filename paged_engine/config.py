"""Engine configuration, validated at construction: a bad setting fails before anything
is allocated."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from paged_engine.cpu_bind import default_cpu_bind, parse_cpu_bind

# The machine's probes live in platform.py (torch-free at import, like this module); the
# names stay importable from here.
from paged_engine.platform import available_memory_bytes as available_memory_bytes
from paged_engine.platform import default_num_threads as default_num_threads
from paged_engine.platform import openmp_runtime_loaded as openmp_runtime_loaded
from paged_engine.platform import openmp_waits_passively as openmp_waits_passively
from paged_engine.platform import prepare_openmp as prepare_openmp
from paged_engine.platform import usable_physical_cores as usable_physical_cores

AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash-attn"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton", "flash-attn")
DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
PrefixCacheHash = Literal["xxh64", "sha256"]
PREFIX_CACHE_HASHES: tuple[PrefixCacheHash, ...] = get_args(PrefixCacheHash)
"""R4's block hashes by name, the default first: the one list (``engine/hashing.py``
imports it; the engine depends on its configuration, never the other way)."""

CPU_MAX_NUM_BATCHED_TOKENS = 1024
"""``EngineConfig.max_num_batched_tokens``' default on CPU (see there)."""
EXECUTOR_BACKENDS = ("mp", "ray")
"""``EngineConfig.distributed_executor_backend``'s values."""
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
"""``EngineConfig.max_num_batched_tokens``' default on CUDA."""


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduling limits, the KV pool, and how the model runs.

    ``num_kvcache_blocks`` fixes the pool size; when None the model runner sizes the pool
    from ``kv_cache_memory`` bytes on CPU, or from ``gpu_memory_utilization`` of the device
    memory left after a warm-up pass on CUDA. With neither on CPU ("auto") the pool holds
    ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at half the memory
    available when the engine starts (``worker/kv_cache.pool_size``).
    """

    max_num_batched_tokens: int | None = None
    """vLLM's name: the tokens one step may compute, prefill chunks and decodes alike.
    None picks one for the device once it is known (``for_device``, which the model runner
    calls): 8192 on CUDA, 1024 on CPU.

    Why smaller on CPU: under prefill-first scheduling a request's first token comes with
    the step that finishes its prompt, so one large step holds every first token of the
    batch behind it. On CPU a 1,024-token step already keeps the GEMMs at their full rate,
    so the smaller budget brings first tokens earlier at no cost in throughput
    (``bench/test_budget_bench.py`` measures both budgets; figures in the README)."""
    max_num_seqs: int = 256
    max_model_len: int = 4096
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    mixed_steps: bool = False
    """Every step decodes the running requests, then fills its token budget with prefill
    chunks (vLLM V1's steps; docs/design.md, S2m), instead of a step being all-prefill or
    all-decode. Off by default: mixing shortens the inter-token tail while prompts arrive,
    but on an offline batch it delays first tokens (docs/performance.md, "Mixed steps")."""
    prefix_cache_hash: PrefixCacheHash = "xxh64"
    """The prefix cache's block hash (R4): "xxh64" is R4's formula and the fastest;
    "sha256" keys the cache by full 256-bit digests, so a crafted collision (one block
    served in place of another, see R10) is out of reach."""
    # model path
    attention_backend: AttentionBackendName = "auto"
    dtype: str = "auto"
    """vLLM's name. "auto": on CUDA the checkpoint's 16-bit dtype, else bfloat16; on CPU
    bfloat16 for a 16-bit checkpoint where the CPU has AMX-BF16 or AVX512-BF16, else float32
    (a float32 checkpoint stays float32; ``paged_decode_cpu.auto_cpu_dtype``, logged)."""
    device: str = "auto"
    kv_cache_memory: int | None = None
    """KV pool bytes on CPU; None sizes the pool automatically (see the class docstring)."""
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    """vLLM's name: True runs every decode step eagerly; False (the default) captures decode
    into CUDA graphs per batch-size bucket on CUDA with the Triton or flash-attn backend
    (``worker/cuda_graphs.py``). Elsewhere decode is eager either way."""
    seed: int = 0
    num_threads: int | None = field(default_factory=default_num_threads)
    """torch's intra-op CPU threads (process-wide: ``torch.set_num_threads``, when the
    model runner starts); None leaves torch's own setting. The ranks of a tensor-parallel
    group on the CPU share one machine: each takes at most its share of the usable physical
    cores (``platform.threads_per_rank``: cores // ranks, at least 1).

    The default (``default_num_threads``): ``OMP_NUM_THREADS`` when set; else, when
    OpenMP waits passively, the physical cores this process may use (affinity, SMT
    siblings once, cgroup quota) but one, at least 1; else 1. One core is left to other
    work because a thread that shares its core with another process stalls every parallel
    region. ``import paged_engine`` sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set) while no
    OpenMP runtime is loaded: torch's libgomp reads it once, when torch is imported, so
    ``torch.set_num_threads`` later changes the count but never the waiting. Import
    paged_engine before torch, or export the variable, for more than one default thread.

    Why passive waiting and a core left free: spin-waiting threads gain little on an idle
    machine and lose many times over as soon as another process wants a core (each
    parallel region waits for the thread whose core was taken); short spins
    (``GOMP_SPINCOUNT``) fare no better than passive waiting under load. Hence one thread
    on two cores. ``bench/test_threads_bench.py`` measures the choices, idle and under
    load (figures in the README)."""
    cpu_bind: str = field(default_factory=default_cpu_bind)
    """Which CPUs the process that runs the model (each tensor-parallel rank) may use:
    "auto" (each rank its own physical cores, the last ones, so that the first stay free
    for other work, e.g. the API process), "off", or CPU lists, one per rank, split by
    "|" ("0-3|4-7"); a bound rank takes one torch thread per CPU (``cpu_bind.py`` has
    the rules). With ``num_threads=None`` nothing is bound either. The default:
    ``$PAGED_ENGINE_CPU_BIND``, else vLLM's ``$VLLM_CPU_OMP_THREADS_BIND``, else
    ``cpu_bind.DEFAULT``: "off", as binding lost or tied on a 2-vCPU machine but for two
    tensor-parallel ranks under a competing process per CPU (the README, "CPU binding").
    Only the syntax is checked here; the lists against the ranks and the machine's CPUs
    when an engine is built (``EngineArgs.create_engine_config``)."""
    max_n: int = 128
    """The most completions one request may ask for (``SamplingParams.n``): every completion
    is a sequence built at admission, on the engine's thread, so an unbounded ``n`` would
    stall every other request while it is built."""
    max_logprobs: int = 20
    """vLLM's name and default: the most ``logprobs`` / ``prompt_logprobs`` a request may
    ask for, checked when it is added (never more than the vocabulary); -1 bounds them by
    the vocabulary alone. Why a bound: every asked-for top-k is computed, decoded and
    carried per token, for every step of the request."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (vLLM's name): rank 0 in this process, the others in
    spawned workers, one device each (``worker/tp_worker.py``). The model's heads, KV
    heads, intermediate size and vocabulary must divide (checked before any worker starts)."""
    distributed_executor_backend: str = "mp"
    """vLLM's name: what runs ranks 1..N-1. "mp": processes spawned on this machine
    (``worker/tp_worker.py``); "ray": Ray actors placed by a placement group, on any node
    of the cluster (``worker/ray_executor.py``, extra ``paged_engine[ray]``)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        _positive_int("kvcache_block_size", self.kvcache_block_size)
        if self.num_kvcache_blocks is not None:
            _positive_int("num_kvcache_blocks", self.num_kvcache_blocks)
        if not isinstance(self.mixed_steps, bool):
            raise ValueError(f"mixed_steps must be a bool, got {self.mixed_steps!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if self.prefix_cache_hash not in PREFIX_CACHE_HASHES:
            raise ValueError(
                f"prefix_cache_hash must be one of {PREFIX_CACHE_HASHES}, "
                f"got {self.prefix_cache_hash!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.kv_cache_memory is not None:
            _positive_int("kv_cache_memory", self.kv_cache_memory)
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        parse_cpu_bind(self.cpu_bind)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        _positive_int("max_n", self.max_n)
        m = self.max_logprobs
        if not isinstance(m, int) or isinstance(m, bool) or m < -1:
            raise ValueError(f"max_logprobs must be an int >= 0, or -1 (no bound), got {m!r}")

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with its per-device defaults filled in (``max_num_batched_tokens``
        when None): the CUDA ones for ``device_type`` "cuda", the CPU ones otherwise."""
        if self.max_num_batched_tokens is not None:
            return self
        cuda = device_type == "cuda"
        budget = CUDA_MAX_NUM_BATCHED_TOKENS if cuda else CPU_MAX_NUM_BATCHED_TOKENS
        return replace(self, max_num_batched_tokens=budget)

    def max_blocks_per_seq(self) -> int:
        """Blocks one ``max_model_len`` sequence needs."""
        return -(-self.max_model_len // self.kvcache_block_size)
