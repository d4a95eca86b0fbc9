"""The KV pool's budget on CUDA: what a step can hold besides the pool, measured with the
loaded model (nano-vllm's warm-up approach, widened).

One warm-up prefill of ``max_num_batched_tokens`` gives the forward pass's peak; to it
come the Triton decode's largest split-K workspace (computed), the sampler at
``[max_num_seqs, vocab]`` with every filter and logprobs on (measured), and, when decode
will be captured into CUDA graphs, a decode pass at the largest bucket (measured: the
graphs keep its activations). Runs once, at start-up, on CUDA only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.attention import Attention, AttentionBackend
from paged_engine.layers.decoder import DecoderForCausalLM
from paged_engine.layers.logprobs import sampled_logprobs
from paged_engine.layers.parallel import TPGroup
from paged_engine.layers.sampler import Sampler
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker.cuda_graphs import capture_sizes, graphs_problem

__all__ = ["MeasuredRunner", "StepMemory", "cuda_pool_budget"]

logger = logging.getLogger("paged_engine")


class MeasuredRunner(Protocol):
    """What the measurement reads of the model runner, which calls it before its KV pool
    exists: declared here so that the dependency points one way (``model_runner.py``
    imports this module, never the reverse)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def block_size(self) -> int: ...
    @property
    def tp(self) -> TPGroup: ...
    @property
    def backend(self) -> AttentionBackend: ...
    @property
    def model(self) -> DecoderForCausalLM: ...
    @property
    def sampler(self) -> Sampler: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def _forward(self, seqs: list[Sequence], is_prefill: bool) -> object:
        """The step's forward pass on this rank (``ModelRunner._forward``)."""
        ...


def cuda_pool_budget(runner: MeasuredRunner) -> int:
    """Bytes for the pool: the utilisation target minus everything else a step can hold
    at once (``StepMemory``): a warm-up prefill of ``max_num_batched_tokens`` tokens
    (weights and activations), the Triton decode's largest split-K workspace, the
    sampler over ``[max_num_seqs, vocab]`` float32 logits with every filter and
    logprobs on, and, when decode will be captured, a decode pass at the largest
    bucket (its activations stay in the graphs' memory pool)."""
    dev = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    weights = torch.cuda.memory_allocated(dev)
    cfg = runner.config
    budget = cfg.max_num_batched_tokens
    assert budget is not None  # the runner's config has its device's defaults
    n = min(budget, cfg.max_model_len * cfg.max_num_seqs)
    lens = []
    while n > 0:
        lens.append(min(n, cfg.max_model_len))
        n -= lens[-1]
    seqs = [Sequence([0] * m, block_size=runner.block_size) for m in lens]
    for s in seqs:
        s.num_scheduled_tokens = len(s)
    runner._forward(seqs, is_prefill=True)  # the cache is still empty: nothing is stored
    torch.cuda.synchronize(dev)
    forward_peak = torch.cuda.max_memory_allocated(dev)
    graphs = 0
    if graphs_problem(cfg, dev, runner.backend, runner.tp.size) is None:
        graphs = _peak_of(dev, lambda: runner._forward(_warmup_decode(runner), is_prefill=False))
    memory = StepMemory(
        forward_peak=forward_peak,
        weights=weights,
        decode_workspace=_decode_workspace_bytes(runner),
        sampling=_peak_of(dev, lambda: _sample_at_full_batch(runner)),
        graphs=graphs,
    )
    free, total = torch.cuda.mem_get_info(dev)
    used_by_others = total - free - torch.cuda.memory_allocated(dev)
    logger.info("CUDA memory besides the KV pool: %s", memory)
    return max(0, int(total * cfg.gpu_memory_utilization) - used_by_others - memory.need)


def _decode_workspace_bytes(runner: MeasuredRunner) -> int:
    """The Triton decode kernel's largest split-K partials over batches up to
    ``max_num_seqs`` (other backends allocate none of their own here)."""
    if runner.backend.name != "triton":
        return 0
    from paged_engine.kernels.decode_plan import max_decode_workspace_bytes
    from paged_engine.kernels.paged_decode_attention import sm_count

    layer = next(m for m in runner.model.modules() if isinstance(m, Attention))
    return max_decode_workspace_bytes(
        max_num_seqs=runner.config.max_num_seqs,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        block_size=runner.block_size,
        table_width=runner.config.max_blocks_per_seq(),
        dtype=runner.dtype,
        sm_count=sm_count(runner.device),
    )


@torch.inference_mode()
def _sample_at_full_batch(runner: MeasuredRunner) -> None:
    """The sampling half of a step at its largest: ``max_num_seqs`` rows of logits,
    sampled with temperature, top-k, top-p, min-p, a repetition penalty and logprobs
    (the heaviest path), then their logprobs."""
    from paged_engine.sampling_params import SamplingParams

    n = runner.config.max_num_seqs
    hidden_size = int(runner.model_config.hf_config.hidden_size)
    hidden = torch.zeros(n, hidden_size, dtype=runner.dtype, device=runner.device)
    logits = runner.model.compute_logits(hidden)
    params = SamplingParams(
        temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1, logprobs=5
    )
    seqs = [Sequence([0, 1], sampling_params=params, block_size=runner.block_size)] * n
    tokens = runner.sampler(logits, [params] * n, [None] * n, seqs, runner.eos_token_ids)
    sampled_logprobs(logits, [params.logprobs] * n, tokens)


@dataclass(frozen=True, slots=True)
class StepMemory:
    """What a step can hold on a CUDA device besides the KV pool, in bytes.

    ``forward_peak`` is absolute (the weights included); the rest are measured or computed
    on their own. The forward pass's activations and the split-K partials coexist (the
    partials live during one layer's attention); the sampler runs after the activations
    are freed, with the weights still there; captured graphs keep their pool for good.
    """

    forward_peak: int
    weights: int
    decode_workspace: int
    sampling: int
    graphs: int

    @property
    def need(self) -> int:
        during_forward = self.forward_peak + self.decode_workspace
        during_sampling = self.weights + self.sampling
        return max(during_forward, during_sampling) + self.graphs


def _peak_of(device: torch.device, fn: Callable[[], object]) -> int:
    """Bytes ``fn`` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def _warmup_decode(runner: MeasuredRunner) -> list[Sequence]:
    """A decode batch of the largest captured size over one-token contexts (the cache is
    still empty, so the pass attends over each row alone: the activations' shape)."""
    bucket = capture_sizes(runner.config.max_num_seqs)[-1]
    seqs = [Sequence([0], block_size=runner.block_size) for _ in range(bucket)]
    for s in seqs:
        s.num_scheduled_tokens = 1
    return seqs
