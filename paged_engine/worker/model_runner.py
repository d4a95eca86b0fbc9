"""The model runner: turns a scheduled batch into tensors, runs the model over the paged
KV cache, samples.

It lives in ``worker/``, beside the KV cache it owns, so that ``engine/`` stays torch-free
(a test imports every ``engine/`` module in a fresh interpreter and checks). What it needs
from the engine is the ``Sequence`` record and index arithmetic: the slots of a token
range through a block table come from ``engine.indexing.slot_mapping`` (through
``make_attention_metadata``), the helper that CrossHair checks against its spec twin.

The KV pool (``kv_cache.py``) is sized before the weights load whenever it can be: from
``num_kvcache_blocks``, ``kv_cache_memory``, or room for ``max_num_seqs`` full-length
sequences capped by free memory; on CUDA without a block count, from the memory a warm-up
pass of the loaded model leaves (``cuda_memory.py``). The device and dtype come from
``devices.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.outputs import FailedSample, SampleOutput, TokenLogprobs
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    HostMetadata,
    HostStaging,
    get_attention_backend,
)
from paged_engine.layers.context import forward_context
from paged_engine.layers.logprobs import prompt_logprobs, sampled_logprobs
from paged_engine.layers.parallel import SINGLE, TPGroup, kv_head_split
from paged_engine.layers.sampler import Sampler
from paged_engine.platform import openmp_waits_passively, threads_per_rank
from paged_engine.sampling_params import SEED_MODULUS
from paged_engine.utils.loader import load_model, process_weights_after_loading
from paged_engine.utils.model_config import head_dim, load_config
from paged_engine.worker.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    StaticDecodeBuffers,
    capture_sizes,
)
from paged_engine.worker.cuda_memory import cuda_pool_budget
from paged_engine.worker.devices import resolve_device, resolve_dtype
from paged_engine.worker.kv_cache import KVCacheLayout, allocate_kv_cache, pool_size

if TYPE_CHECKING:
    from paged_engine.worker.tp_worker import WorkerGroup

logger = logging.getLogger("paged_engine")


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
    prompt_spans: tuple[tuple[int, int, int, int], ...] = ()
    """``(sequence index, first row, first position, rows)`` of each sequence that asks
    for prompt logprobs and has prompt rows in this step: its rows ``first row …`` hold
    positions ``q`` (from ``first position``) that predict prompt tokens ``q + 1``."""


class ModelRunner:
    def __init__(
        self, model_dir: str | Path, config: EngineConfig, *, tp: TPGroup = SINGLE
    ) -> None:
        """Everything that can be refused is refused before a weight is read or the model
        or pool allocated: the device, config.json (``load_config``), ``max_model_len``
        against the model's ``max_position_embeddings``, the attention backend, the pool
        size, then the checkpoint's files and tensors (by the loader). Only a pool sized
        from CUDA memory is checked after the weights load: its budget is what a warm-up
        pass of the loaded model leaves.

        With ``tp`` (rank ``r`` of ``N``, ``tp_worker.py``) the runner holds that rank's
        shard of the model and of the KV heads, on ``cuda:r`` under CUDA; every rank runs
        this constructor at the same time, as it agrees the pool size with the others."""
        self.tp = tp
        self.workers: WorkerGroup | None = None
        """Rank 0's workers, when there are any (set by ``start_tensor_parallel``)."""
        self.device = resolve_device(config.device)
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
        path = Path(model_dir)
        self.hf_config = load_config(path)
        self._check_max_model_len(config, path)
        config = config.for_device(self.device.type)
        self.config = config
        self.dtype = resolve_dtype(
            config.dtype, self.device, getattr(self.hf_config, "dtype", None)
        )
        self.backend: AttentionBackend = get_attention_backend(
            config.attention_backend,
            self.device,
            config.kvcache_block_size,
            self.dtype,
            head_dim=head_dim(self.hf_config),
        )
        self.block_size = config.kvcache_block_size
        self.layout = KVCacheLayout(
            num_layers=int(self.hf_config.num_hidden_layers),
            num_kv_heads=kv_head_split(int(self.hf_config.num_key_value_heads), tp)[1],
            head_dim=head_dim(self.hf_config),
            block_size=self.block_size,
            dtype=self.dtype,
        )
        measured_pool = config.num_kvcache_blocks is None and self.device.type == "cuda"
        if not measured_pool:
            self.num_kvcache_blocks = self._agreed_pool_size()
        if config.num_threads is not None:  # process-wide: only once nothing is refused
            self._set_threads(config.num_threads)
        self.model, _ = load_model(
            path,
            device=self.device,
            dtype=self.dtype,
            backend=self.backend,
            config=self.hf_config,
            tp=tp,
        )
        process_weights_after_loading(self.model)
        self.sampler = Sampler()
        self.eos_token_ids: tuple[int, ...] = ()  # min_tokens masks them (LLM sets them)
        # any int seeds the engine: s and s + 2**64 are the same seed
        self.rng = torch.Generator(device=self.device).manual_seed(config.seed % SEED_MODULUS)
        self.kv_cache = torch.empty(0)  # the CUDA warm-up pass runs before the pool exists
        if measured_pool:
            self.num_kvcache_blocks = self._agreed_pool_size()
        self.kv_cache = self._allocate_kv_cache(self.num_kvcache_blocks)
        self.decode_graphs = self._capture_decode_graphs()
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

    def _set_threads(self, num_threads: int) -> None:
        """torch's intra-op threads for this process: ``num_threads``, except that the
        ranks of a tensor-parallel group on the CPU share this machine's cores, so each
        takes at most its share (``platform.threads_per_rank``)."""
        ranks = self.tp.size if self.device.type == "cpu" else 1
        threads = threads_per_rank(num_threads, ranks)
        torch.set_num_threads(threads)
        shared = f", rank {self.tp.rank} of {ranks} sharing this CPU ({num_threads} asked)"
        logger.info(
            "torch CPU threads: %d%s; OpenMP waits %s",
            threads,
            shared if ranks > 1 else "",
            "passively" if openmp_waits_passively() else "actively: spins",
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
        """Blocks for the pool (``kv_cache.pool_size``). Needs only the layout, so
        ``__init__`` calls it before the weights load, except for a pool sized from CUDA
        memory: that budget is measured with the loaded model."""
        return pool_size(self.config, self.layout, self.device, self._cuda_budget)

    def _agreed_pool_size(self) -> int:
        """``_pool_size``, the same on every rank: the minimum over the ranks, so that a
        block id means the same block everywhere. CPU ranks share this machine's memory,
        so there the pool is sized with the bytes all ranks together spend per block (the
        same blocks per byte as one rank holding every KV head)."""
        if self.tp.size == 1:
            return self._pool_size()
        from paged_engine.worker.distributed import agree_min

        layout = self.layout
        if self.device.type == "cpu":
            layout = replace(layout, num_kv_heads=layout.num_kv_heads * self.tp.size)
        blocks = pool_size(self.config, layout, self.device, self._cuda_budget)
        return agree_min(blocks, self.device)

    def _cuda_budget(self) -> int:
        """Bytes for the pool on CUDA, measured with the loaded model (``cuda_memory``)."""
        return cuda_pool_budget(self)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return allocate_kv_cache(self.model, self.layout, num_blocks, self.device)

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
        prompt_spans: list[tuple[int, int, int, int]] = []
        for i, seq in enumerate(seqs):
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens
            # rows q predict q + 1; the last prompt row predicts the first output token
            num_prompt_rows = min(end, seq.num_prompt_tokens - 1) - start
            if (
                is_prefill
                and num_prompt_rows > 0
                and seq.sampling_params.prompt_logprobs is not None
            ):
                prompt_spans.append((i, len(input_ids), start, num_prompt_rows))
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
        host = HostMetadata.build(query_lens, seq_lens, tables, self.block_size, is_prefill)
        i64 = torch.int64
        # One pinned, reused staging copy per dtype for the whole step (see HostStaging).
        tensors = _host_staging(self).stage(
            [
                *host.arrays(),
                (np.asarray(input_ids, dtype=np.int64), i64),
                (np.asarray(positions, dtype=np.int64), i64),
                (np.asarray(sample_rows, dtype=np.int64), i64),
            ]
        )
        ids, pos, rows = tensors[-3:]
        return Batch(
            input_ids=ids,
            positions=pos,
            meta=host.on_device(tensors[:-3]),
            sample_rows=rows,
            sampling=tuple(sampling),
            prompt_spans=tuple(prompt_spans),
        )

    @torch.inference_mode()
    def _forward(
        self, seqs: SequenceABC[Sequence], is_prefill: bool
    ) -> tuple[Batch, torch.Tensor, tuple[tuple[TokenLogprobs, ...], ...]]:
        """The batch, the logits of its sampling rows, and the prompt logprobs of each
        ``batch.prompt_spans`` entry (in that order)."""
        batch = self.prepare(seqs, is_prefill)
        graphs: DecodeGraphs | None = getattr(self, "decode_graphs", None)
        hidden = None
        if graphs is not None and not is_prefill:
            hidden = graphs.run(batch.input_ids, batch.positions, batch.meta)
        if hidden is None:  # prefill, eager mode, or a batch past the largest graph
            hidden = self._model_forward(batch.input_ids, batch.positions, batch.meta)
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        prompt = tuple(
            prompt_logprobs(
                hidden[row : row + count],
                self.model.compute_logits,
                seqs[i].token_ids[q + 1 : q + 1 + count],  # row q predicts q + 1
                seqs[i].sampling_params.prompt_logprobs or 0,
            )
            for i, row, q, count in batch.prompt_spans
        )
        return batch, logits, prompt

    def _model_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        with forward_context(meta):
            hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def _graphs_problem(self) -> str | None:
        """Why decode steps run eagerly here, or None when they can be captured."""
        if self.config.enforce_eager:
            return "enforce_eager=True"
        if self.device.type != "cuda":
            return f"CUDA graphs need CUDA; this device is {self.device.type}"
        if not getattr(self.backend, "supports_cuda_graphs", False):
            return f"the {self.backend.name} attention backend reads host data in decode"
        if getattr(getattr(self, "tp", None), "size", 1) > 1:
            return "tensor parallelism: the ranks' collectives are not captured"
        return None

    @torch.inference_mode()
    def _capture_decode_graphs(self, capture: GraphCapture | None = None) -> DecodeGraphs | None:
        """Capture decode for every bucket up to ``max_num_seqs`` (``cuda_graphs``), after
        the KV pool exists (the graphs read it in place); None when decode runs eagerly.
        ``capture`` replaces ``torch.cuda.CUDAGraph`` (tests run this on a CPU); it also
        skips the device checks of ``_graphs_problem``, not ``enforce_eager``."""
        problem = "enforce_eager=True" if self.config.enforce_eager else None
        if capture is None:
            problem = self._graphs_problem()
            capture = CudaGraphCapture()
        if problem is not None:
            logger.info("decode runs eagerly: %s", problem)
            return None
        sizes = capture_sizes(self.config.max_num_seqs)
        buffers = StaticDecodeBuffers.allocate(
            sizes[-1], self.config.max_blocks_per_seq(), self.device
        )
        graphs = DecodeGraphs(
            self._model_forward,
            buffers,
            sizes,
            int(self.hf_config.hidden_size),
            self.dtype,
            capture,
        )
        logger.info("captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, sizes)))
        return graphs

    def run(
        self, seqs: list[Sequence], is_prefill: bool
    ) -> list[int | FailedSample | SampleOutput | None]:
        """One token per sequence that samples in this step; None for a prefill chunk that
        does not finish its prompt (nothing is sampled for it); ``FailedSample`` for a
        sequence whose logits are not all finite (NaN or inf: the model broke down), so
        that one request fails and the rest of the batch goes on.

        A sequence whose params ask for ``logprobs`` or ``prompt_logprobs`` gets that
        result wrapped in a ``SampleOutput`` in every step, with the logprobs of its
        sampled token and of the prompt positions this step's rows predict (raw logprobs:
        the model's distribution before penalties, temperature or filters, as vLLM)."""
        if self.workers is None:
            batch, logits, prompt = self._forward(seqs, is_prefill)
        else:  # hands the step to the other ranks, which run _forward with this one
            batch, logits, prompt = self.workers.forward(self._forward, seqs, is_prefill)
        results: dict[int, int | FailedSample] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        if batch.sampling:
            picked = [seqs[i] for i in batch.sampling]
            params = [s.sampling_params for s in picked]
            generators = [self._generator(s) for s in picked]
            tokens = self.sampler(logits, params, generators, picked, self.eos_token_ids)
            for i, seq, t in zip(batch.sampling, picked, tokens, strict=True):
                results[i] = t if t is not None else self._failure(seq)
            asked = [p.logprobs for p in params]
            for r, lp in sampled_logprobs(logits, asked, tokens).items():
                logprobs[batch.sampling[r]] = lp
        prompt_of = {i: lps for (i, *_), lps in zip(batch.prompt_spans, prompt, strict=True)}
        out: list[int | FailedSample | SampleOutput | None] = []
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.logprobs is None and p.prompt_logprobs is None:
                out.append(results.get(i))
            else:
                out.append(SampleOutput(results.get(i), logprobs.get(i), prompt_of.get(i, ())))
        return out

    def run_worker(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """A worker rank's step: the forward pass rank 0 runs in ``run`` (the same
        collectives, in the same order), with nothing sampled and nothing returned."""
        self._forward(seqs, is_prefill)

    @staticmethod
    def _failure(seq: Sequence) -> FailedSample:
        return FailedSample(
            f"the model's logits for the token at position {seq.num_tokens} are not finite "
            "(NaN or inf), or leave no token to sample; nothing was sampled"
        )

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


def _host_staging(runner: ModelRunner) -> HostStaging:
    """The runner's pinned staging buffers, made on first use (``prepare`` also runs on
    stand-ins that carry only ``device``, ``block_size`` and ``kv_cache``)."""
    staging: HostStaging | None = getattr(runner, "_staging", None)
    if staging is None:
        staging = HostStaging(runner.device)
        setattr(runner, "_staging", staging)  # noqa: B010 (stand-ins have no such attribute)
    return staging
