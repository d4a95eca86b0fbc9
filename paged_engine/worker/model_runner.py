"""The model runner: a rank's model over the paged KV cache, and what a step does with it.

``ModelRunner.__init__`` reads top to bottom as the load path: the model's config (read
once, by ``LLM``, as a ``ModelConfig``), the device and the engine config's defaults for
it, the dtype and the attention backend, the KV pool's layout and size, then the weights,
the pool itself and the decode graphs. A step (``run``) is inputs (``model_inputs.py``), the
forward pass (here), then sampling (``sampling_step.py``).

It lives in ``worker/``, beside the KV cache it owns, so that ``engine/`` stays torch-free
(a test imports every ``engine/`` module in a fresh interpreter and checks).

The KV pool (``kv_cache.py``) is sized before the weights load whenever it can be: from
``num_kvcache_blocks``, ``kv_cache_memory``, or room for ``max_num_seqs`` full-length
sequences capped by free memory; on CUDA without a block count, from the memory a warm-up
pass of the loaded model leaves (``cuda_memory.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    HostStaging,
    get_attention_backend,
)
from paged_engine.layers.context import forward_context
from paged_engine.layers.parallel import SINGLE, TPGroup, kv_head_split
from paged_engine.layers.sampler import Sampler
from paged_engine.sampling_params import SEED_MODULUS
from paged_engine.utils.loader import load_model, process_weights_after_loading
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker.cpu_malloc import keep_freed_memory, malloc_setting
from paged_engine.worker.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    capture_decode_graphs,
    graphs_problem,
)
from paged_engine.worker.cuda_memory import cuda_pool_budget
from paged_engine.worker.devices import resolve_device, resolve_dtype, set_cpu_threads
from paged_engine.worker.grammar import StructuredOutputs
from paged_engine.worker.kv_cache import KVCacheLayout, allocate_kv_cache, pool_size
from paged_engine.worker.model_inputs import Batch, BatchBuilder
from paged_engine.worker.sampling_step import PromptLogprobs, StepResult, step_logits, step_results

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Batch", "ModelRunner", "StepWorkers"]

T = TypeVar("T")
logger = logging.getLogger("paged_engine")


class StepWorkers(Protocol):
    """Rank 0's handle on the other ranks of its tensor-parallel group
    (``tp_worker.WorkerGroup``): declared here so that the dependency points one way (the
    group's module imports this one, never the reverse)."""

    @property
    def pids(self) -> list[int]: ...

    def forward(
        self, fn: Callable[[list[Sequence], bool], T], seqs: list[Sequence], is_prefill: bool
    ) -> T:
        """Hand the step to the workers, then run ``fn`` (rank 0's forward pass) with them."""
        ...

    def close(self) -> None: ...


class ModelRunner:
    """One rank's model, KV pool and sampler: what the engine calls ``run`` on each step
    (``engine.llm_engine.ModelRunner`` is its interface there)."""

    def __init__(
        self,
        model: ModelConfig | str | Path,
        config: EngineConfig,
        *,
        tp: TPGroup = SINGLE,
        eos_token_ids: SequenceABC[int] = (),
    ) -> None:
        """``model`` is the ``ModelConfig`` that ``LLM`` (or, for a worker, rank 0) read,
        or a model directory to read it from, for a runner built on its own.
        ``eos_token_ids`` are the ids the engine stops at (``min_tokens`` masks them).

        Everything that can be refused is refused before a weight is read or the model
        or pool allocated: the device (on the CPU with ``cpu_malloc``'s setting),
        ``max_model_len`` against the model's ``max_position_embeddings``, the attention
        backend, the pool size, then the checkpoint's files and tensors (by the loader).
        Only a pool sized from CUDA memory is checked after the weights load: its budget
        is what a warm-up pass of the loaded model leaves.

        With ``tp`` (rank ``r`` of ``N``, ``tp_worker.py``) the runner holds that rank's
        shard of the model and of the KV heads, on ``cuda:r`` under CUDA; every rank runs
        this constructor at the same time, as it agrees the pool size with the others."""
        self.model_config = model if isinstance(model, ModelConfig) else ModelConfig.load(model)
        hf_config = self.model_config.hf_config
        self.tp = tp
        self.workers: StepWorkers | None = None
        """Rank 0's workers, when there are any (set by ``start_tensor_parallel``)."""
        self.device = resolve_device(config.device)
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
        heap = malloc_setting() if self.device.type == "cpu" else None  # applied below
        self.model_config.check_max_model_len(config.max_model_len)
        self.config = config = config.for_device(self.device.type)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.checkpoint_dtype)
        self.backend: AttentionBackend = get_attention_backend(
            config.attention_backend,
            self.device,
            config.kvcache_block_size,
            self.dtype,
            head_dim=self.model_config.head_dim,
        )
        self.block_size = config.kvcache_block_size
        self.layout = KVCacheLayout(
            num_layers=int(hf_config.num_hidden_layers),
            num_kv_heads=kv_head_split(int(hf_config.num_key_value_heads), tp)[1],
            head_dim=self.model_config.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        measured_pool = config.num_kvcache_blocks is None and self.device.type == "cuda"
        if not measured_pool:
            self.num_kvcache_blocks = self._agreed_pool_size()
        if config.num_threads is not None:  # process-wide: only once nothing is refused
            set_cpu_threads(config.num_threads, self.device, tp, config.cpu_bind)
        if heap is not None:
            keep_freed_memory(heap)
        self.model, _ = load_model(
            self.model_config.model_dir,
            device=self.device,
            dtype=self.dtype,
            backend=self.backend,
            config=hf_config,
            tp=tp,
        )
        process_weights_after_loading(self.model)
        self.batch_builder = BatchBuilder(self.block_size, HostStaging(self.device))
        self.sampler = Sampler()
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = StructuredOutputs(  # rank 0's structured outputs (grammar.py)
            self.model_config.vocab_size, self.eos_token_ids, self.model_config.model_dir
        )
        # any int seeds the engine: s and s + 2**64 are the same seed
        self.rng = torch.Generator(device=self.device).manual_seed(config.seed % SEED_MODULUS)
        self.kv_cache = torch.empty(0)  # the CUDA warm-up pass runs before the pool exists
        self.decode_graphs: DecodeGraphs | None = None  # and runs eagerly
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

    @property
    def hf_config(self) -> PretrainedConfig:
        """transformers' config of the model (``model_config.hf_config``)."""
        return self.model_config.hf_config

    # ---- the KV pool -------------------------------------------------------------------------

    def _agreed_pool_size(self) -> int:
        """Blocks for the pool (``kv_cache.pool_size``), the same on every rank: the
        minimum over the ranks, so that a block id means the same block everywhere. CPU
        ranks share this machine's memory, so there the pool is sized with the bytes all
        ranks together spend per block (the same blocks per byte as one rank holding every
        KV head)."""
        if self.tp.size == 1:
            return pool_size(self.config, self.layout, self.device, self._cuda_budget)
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
        """The step's inputs (``BatchBuilder.build``); before the pool exists (the CUDA
        warm-up) with no block tables, so that nothing is stored."""
        tables = self.kv_cache.numel() > 0
        return self.batch_builder.build(seqs, is_prefill, with_block_tables=tables)

    @torch.inference_mode()
    def _forward(
        self, seqs: SequenceABC[Sequence], is_prefill: bool
    ) -> tuple[Batch, torch.Tensor, PromptLogprobs]:
        """The batch, the logits of its sampling rows, and the prompt logprobs of each
        ``batch.prompt_spans`` entry (in that order)."""
        batch = self.prepare(seqs, is_prefill)
        hidden = None
        if self.decode_graphs is not None and not is_prefill:
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta)
        if hidden is None:  # prefill, eager mode, or a batch past the largest graph
            hidden = self._model_forward(batch.input_ids, batch.positions, batch.meta)
        logits, prompt = step_logits(self.model.compute_logits, hidden, batch, seqs)
        return batch, logits, prompt

    def _model_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        with forward_context(meta):
            hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    @torch.inference_mode()
    def _capture_decode_graphs(self, capture: GraphCapture | None = None) -> DecodeGraphs | None:
        """Decode captured for every bucket up to ``max_num_seqs`` (``cuda_graphs``), after
        the KV pool exists (the graphs read it in place); None when decode runs eagerly.
        ``capture`` replaces ``torch.cuda.CUDAGraph`` (tests run this on a CPU); it also
        skips the device checks of ``graphs_problem``, not ``enforce_eager``."""
        problem = "enforce_eager=True" if self.config.enforce_eager else None
        if capture is None:
            problem = graphs_problem(self.config, self.device, self.backend, self.tp.size)
            capture = CudaGraphCapture()
        if problem is not None:
            logger.info("decode runs eagerly: %s", problem)
            return None
        hidden_size = int(self.model_config.hf_config.hidden_size)
        graphs = capture_decode_graphs(
            self._model_forward, self.config, self.device, hidden_size, self.dtype, capture
        )
        logger.info(
            "captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, graphs.sizes))
        )
        return graphs

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[StepResult]:
        """One token per sequence that samples in this step; None for a prefill chunk that
        does not finish its prompt (nothing is sampled for it); ``FailedSample`` for a
        sequence whose logits are not all finite (NaN or inf: the model broke down), so
        that one request fails and the rest of the batch goes on.

        A sequence whose params ask for ``logprobs`` or ``prompt_logprobs`` gets that
        result wrapped in a ``SampleOutput`` in every step, with the logprobs of its
        sampled token and of the prompt positions this step's rows predict (raw logprobs:
        the model's distribution before penalties, temperature or filters, as vLLM)."""
        self.grammars.prepare(seqs)  # compiles new grammars while the forward pass runs
        if self.workers is None:
            batch, logits, prompt = self._forward(seqs, is_prefill)
        else:  # hands the step to the other ranks, which run _forward with this one
            batch, logits, prompt = self.workers.forward(self._forward, seqs, is_prefill)
        generators = [self._generator(seqs[i]) for i in batch.sampling]
        return step_results(
            seqs, batch, logits, prompt, self.sampler, generators, self.eos_token_ids, self.grammars
        )

    def run_worker(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """A worker rank's step: the forward pass rank 0 runs in ``run`` (the same
        collectives, in the same order), with nothing sampled and nothing returned."""
        self._forward(seqs, is_prefill)

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
