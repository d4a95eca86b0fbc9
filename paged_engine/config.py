"""Engine configuration, validated at construction: a bad setting fails before anything
is allocated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash-attn"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton", "flash-attn")
DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
PrefixCacheHash = Literal["xxh64", "sha256"]
PREFIX_CACHE_HASHES: tuple[str, ...] = ("xxh64", "sha256")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduling limits, the KV pool, and how the model runs.

    ``num_kvcache_blocks`` fixes the pool size; when None the model runner sizes the pool
    from ``kv_cache_memory`` bytes on CPU, or from ``gpu_memory_utilization`` of the device
    memory left after a warm-up pass on CUDA.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 4096
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_hash: PrefixCacheHash = "xxh64"
    """The prefix cache's block hash (R4): "xxh64" is the seed's formula and the fastest;
    "sha256" keys the cache by full 256-bit digests, so a crafted collision (one block
    served in place of another, see R10) is out of reach."""
    # model path
    attention_backend: AttentionBackendName = "auto"
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    num_threads: int | None = None
    """torch's intra-op CPU threads (process-wide: ``torch.set_num_threads``); None leaves
    torch's own setting. Small models run fastest on one thread, and on a machine shared
    with other work OpenMP's spin-waiting can make several threads many times slower."""

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        _positive_int("kvcache_block_size", self.kvcache_block_size)
        if self.num_kvcache_blocks is not None:
            _positive_int("num_kvcache_blocks", self.num_kvcache_blocks)
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
        _positive_int("kv_cache_memory", self.kv_cache_memory)
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)

    def max_blocks_per_seq(self) -> int:
        """Blocks one ``max_model_len`` sequence needs."""
        return -(-self.max_model_len // self.kvcache_block_size)
