"""The model runner: turns a scheduled batch into tensors, runs the model over the paged
KV cache, samples.

It lives in ``worker/``, beside the KV cache it owns, so that ``engine/`` stays torch-free
(a test imports every ``engine/`` module in a fresh interpreter and checks). What it needs
from the engine is the ``Sequence`` record and index arithmetic: the slots of a token
range through a block table come from ``engine.indexing.slot_mapping`` (through
``make_attention_metadata``), the helper that CrossHair checks against its spec twin.

One KV tensor ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` holds
the whole pool; each attention layer gets its ``[num_blocks, block_size, kv_heads,
head_dim]`` views. Its size is ``num_kvcache_blocks`` when given, else a byte budget:
``kv_cache_memory`` on CPU, ``gpu_memory_utilization`` of the memory a warm-up pass leaves
on CUDA (nano-vllm's approach).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.scheduler import FailedSample
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
    make_attention_metadata,
)
from paged_engine.layers.context import forward_context
from paged_engine.layers.sampler import Sampler
from paged_engine.sampling_params import SEED_MODULUS
from paged_engine.utils.loader import load_model
from paged_engine.utils.model_config import head_dim, load_config

logger = logging.getLogger("paged_engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a torch device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: only cpu and cuda are supported")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: object) -> torch.dtype:
    """'auto' is float32 on CPU (exact, and CPUs have no fast half maths), and the
    checkpoint's half dtype (else bfloat16) on CUDA."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
    if checkpoint_dtype is torch.float16 or checkpoint_dtype is torch.bfloat16:
        return checkpoint_dtype
    return torch.bfloat16


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's model inputs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    """Row of the last token of each sequence that samples in this step."""
    sampling: tuple[int, ...]
    """Indices (into the step's sequences) of those sequences."""


class ModelRunner:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        """Everything that can be refused is refused before a weight is read or the model
        or pool allocated: the device, config.json (``load_config``), ``max_model_len``
        against the model's ``max_position_embeddings``, the attention backend, the pool
        size, then the checkpoint's files and tensors (by the loader). Only a pool sized
        from CUDA memory is checked after the weights load: its budget is what a warm-up
        pass of the loaded model leaves."""
        self.device = resolve_device(config.device)
        path = Path(model_dir)
        self.hf_config = load_config(path)
        self._check_max_model_len(config, path)
        self.config = config
        self.dtype = resolve_dtype(
            config.dtype, self.device, getattr(self.hf_config, "dtype", None)
        )
        self.backend: AttentionBackend = get_attention_backend(
            config.attention_backend, self.device, config.kvcache_block_size, self.dtype
        )
        self.block_size = config.kvcache_block_size
        self.layout = KVCacheLayout(
            num_layers=int(self.hf_config.num_hidden_layers),
            num_kv_heads=int(self.hf_config.num_key_value_heads),
            head_dim=head_dim(self.hf_config),
            block_size=self.block_size,
            dtype=self.dtype,
        )
        measured_pool = config.num_kvcache_blocks is None and self.device.type == "cuda"
        if not measured_pool:
            self.num_kvcache_blocks = self._pool_size()
        if config.num_threads is not None:  # process-wide: only once nothing is refused
            torch.set_num_threads(config.num_threads)
        self.model, _ = load_model(
            path, device=self.device, dtype=self.dtype, backend=self.backend, config=self.hf_config
        )
        self.sampler = Sampler()
        # any int seeds the engine: s and s + 2**64 are the same seed
        self.rng = torch.Generator(device=self.device).manual_seed(config.seed % SEED_MODULUS)
        self.kv_cache = torch.empty(0)  # the CUDA warm-up pass runs before the pool exists
        if measured_pool:
            self.num_kvcache_blocks = self._pool_size()
        self.kv_cache = self._allocate_kv_cache(self.num_kvcache_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %d bytes per token, %.1f MiB, "
            "attention backend %s, %s on %s",
            self.num_kvcache_blocks,
            self.block_size,
            self.num_kvcache_blocks * self.block_size,
            self.layout.bytes_per_token,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.backend.name,
            str(self.dtype).removeprefix("torch."),
            self.device,
        )

    def _check_max_model_len(self, config: EngineConfig, path: Path) -> None:
        """vLLM refuses the same: a longer context than the model was built for."""
        max_pos = int(self.hf_config.max_position_embeddings)
        if config.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={config.max_model_len} is larger than the model's "
                f"max_position_embeddings={max_pos} (in {path / 'config.json'}): "
                f"lower max_model_len to at most {max_pos}"
            )

    # ---- the KV pool -------------------------------------------------------------------------

    def _pool_size(self) -> int:
        """Blocks for the pool, refused when it cannot hold one ``max_model_len`` sequence.

        Needs only the layout, so ``__init__`` calls it before the weights load, except
        for a pool sized from CUDA memory: that budget is measured with the loaded model."""
        cfg, per_block = self.config, self.layout.bytes_per_block
        if cfg.num_kvcache_blocks is not None:
            blocks = cfg.num_kvcache_blocks
        elif self.device.type == "cuda":
            blocks = self._cuda_budget() // per_block
        else:
            blocks = cfg.kv_cache_memory // per_block
        needed = cfg.max_blocks_per_seq()
        if blocks < needed:
            raise ValueError(
                f"the KV pool ({blocks} blocks of {self.block_size} tokens, "
                f"{per_block} bytes each) cannot hold one max_model_len={cfg.max_model_len} "
                f"sequence ({needed} blocks): raise kv_cache_memory / num_kvcache_blocks "
                "or lower max_model_len"
            )
        return blocks

    def _cuda_budget(self) -> int:
        """Bytes for the pool: the utilisation target minus a warm-up pass's peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        cfg = self.config
        n = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        lens = []
        while n > 0:
            lens.append(min(n, cfg.max_model_len))
            n -= lens[-1]
        seqs = [Sequence([0] * m, block_size=self.block_size) for m in lens]
        for s in seqs:
            s.num_scheduled_tokens = len(s)
        self._forward(seqs, is_prefill=True)  # the cache is still empty: nothing is stored
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(0, int(total * cfg.gpu_memory_utilization) - used_by_others - peak)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        lay = self.layout
        # torch.empty: pages are committed as blocks are first used; backends never read a
        # slot before it is written (the torch backend points padded positions it gathers
        # at a written slot of the same sequence).
        cache = torch.empty(
            2,
            lay.num_layers,
            num_blocks,
            lay.block_size,
            lay.num_kv_heads,
            lay.head_dim,
            dtype=lay.dtype,
            device=self.device,
        )
        layers = [
            m for m in self.model.modules() if hasattr(m, "k_cache") and hasattr(m, "backend")
        ]
        for i, layer in enumerate(layers):
            layer.k_cache = cache[0, i]
            layer.v_cache = cache[1, i]
        return cache

    # ---- one step -----------------------------------------------------------------------------

    def prepare(self, seqs: SequenceABC[Sequence], is_prefill: bool) -> Batch:
        """Inputs for the tokens ``[num_cached, num_cached + num_scheduled)`` of each
        sequence; only the uncached ones are computed."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[int] = []
        for i, seq in enumerate(seqs):
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens
            if is_prefill:
                input_ids.extend(seq.token_ids[start:end])
            else:
                input_ids.append(seq.last_token)  # a pickled decoding sequence has no token_ids
            positions.extend(range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the prompt is complete, or a decode step
                sample_rows.append(len(input_ids) - 1)
                sampling.append(i)
        tables = [s.block_table for s in seqs] if self.kv_cache.numel() else []
        dev = self.device
        meta = make_attention_metadata(
            query_lens, seq_lens, tables, self.block_size, dev, is_prefill=is_prefill
        )
        return Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64).to(dev, non_blocking=True),
            sampling=tuple(sampling),
        )

    @torch.inference_mode()
    def _forward(self, seqs: SequenceABC[Sequence], is_prefill: bool) -> tuple[Batch, torch.Tensor]:
        batch = self.prepare(seqs, is_prefill)
        with forward_context(batch.meta):
            hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        return batch, logits

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int | FailedSample | None]:
        """One token per sequence that samples in this step; None for a prefill chunk that
        does not finish its prompt (nothing is sampled for it); ``FailedSample`` for a
        sequence whose logits are not all finite (NaN or inf: the model broke down), so
        that one request fails and the rest of the batch goes on."""
        batch, logits = self._forward(seqs, is_prefill)
        out: list[int | FailedSample | None] = [None] * len(seqs)
        if not batch.sampling:
            return out
        picked = [seqs[i] for i in batch.sampling]
        generators = [self._generator(s) for s in picked]
        tokens = self.sampler(logits, [s.sampling_params for s in picked], generators)
        for i, seq, t in zip(batch.sampling, picked, tokens, strict=True):
            out[i] = t
            if t is None:
                out[i] = FailedSample(
                    f"the model's logits for the token at position {seq.num_tokens} are "
                    "not finite (NaN or inf); nothing was sampled"
                )
        return out

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """Seeded requests draw position by position from their own seed, so the token
        at each position is the same whatever the batch, chunking or preemption.

        Any int is a seed, taken modulo ``2**64``: ``seed * 1_000_003`` is a bijection
        there (the factor is odd), so distinct seeds modulo ``2**64`` get distinct
        generator seeds at each position, and ``s`` and ``s + 2**64`` the same ones."""
        params = seq.sampling_params
        if params.greedy:
            return None
        if params.seed is None:
            return self.rng
        g = torch.Generator(device=self.device)
        return g.manual_seed((params.seed * 1_000_003 + seq.num_tokens) % SEED_MODULUS)
