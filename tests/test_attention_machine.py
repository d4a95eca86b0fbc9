"""Every attention backend against the naive oracle, through the attention machine.

tests/attention_machine.py describes the machine and its checks. Here it runs:

* on CPU: the "cpu" backend (the compiled decode kernel, float32: the production CPU path),
  the torch backend in float32 and float16, with and without shared-prefix cascades, and
  the Triton backend under ``TRITON_INTERPRET=1`` in float32 and float16 (the interpreter's
  bfloat16 arithmetic is broken), at small shapes (1-2 KV heads, GQA groups of 2-3, head
  dim 16, block sizes 4/8/16, pools of 3-16 blocks, sequences up to 64 tokens);
* the "cpu" backend on bfloat16 caches, each compiled variant (AVX512-BF16, portable),
  its decode steps held to one rounding (half a bfloat16 ulp of the float32 oracle,
  ``attention_machine.ONE_ROUNDING``), the torch backend's bfloat16 lane alongside;
* against the Triton kernel, CPU kernel (block walk, GQA; in bfloat16, an accumulator and
  a softmax kept in bfloat16) and cascade-plan mutants: each must make the machine fail;
* under the ``gpu`` marker on CUDA: compiled Triton (block sizes 16 and 256) and flash-attn
  (block size 256), float16 and bfloat16, at Qwen3-0.6B's head shapes (16 query heads, 8 KV
  heads, head dim 128), prompts up to ~2,000 tokens, contexts up to 4,096. Tolerances are
  ``attention_machine.TOLERANCES``: float32 1e-5, float16 2e-3, bfloat16 2e-2 (atol = rtol).

Budget: example and step counts are set per test below instead of the ci profile's
300 x 60, which would take hours under the Triton interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
import importlib.util
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from paged_engine.kernels.paged_decode_attention import is_interpreted
from paged_engine.kernels.paged_decode_cpu import bf16_variants
from paged_engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
)
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.layers.attention.triton_backend import TritonAttentionBackend
from paged_engine.layers.cascade import CascadePlan
from tests.attention_machine import BackendFactory, Geometry, Lane, MachineConfig, make_machine
from tests.cascade_mutants import CASCADE_MUTANTS, CascadeMutant, CascadeMutantBackend
from tests.kernel_mutants import (
    AVX512_BF16_MUTANTS,
    BF16_MUTANTS,
    CPU_MUTANTS,
    MUTANTS,
    PREFILL_MUTANTS,
    STORE_MUTANTS,
    CpuKernelMutant,
    CpuMutantBackend,
    KernelMutant,
)

CUDA = torch.cuda.is_available()
INTERPRETED = is_interpreted()
FLASH = importlib.util.find_spec("flash_attn") is not None

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="the CPU Triton lanes need TRITON_INTERPRET=1 set before paged_engine.kernels "
    "is first imported",
)
needs_cuda = pytest.mark.skipif(
    not CUDA or INTERPRETED, reason="needs CUDA and compiled kernels (TRITON_INTERPRET unset)"
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_IDS = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}


def torch_backend(block_size: int, dtype: torch.dtype) -> AttentionBackend:
    return TorchAttentionBackend(block_size=block_size, dtype=dtype)


def cpu_backend(block_size: int, dtype: torch.dtype) -> AttentionBackend:
    return CpuAttentionBackend(block_size=block_size, dtype=dtype)


def triton_backend(block_size: int, dtype: torch.dtype) -> AttentionBackend:
    return TritonAttentionBackend(block_size=block_size, dtype=dtype)


def flash_backend(block_size: int, dtype: torch.dtype) -> AttentionBackend:
    from paged_engine.layers.attention.flash import FlashAttnBackend

    return FlashAttnBackend(block_size=block_size, dtype=dtype)


def lane(name: str, factory: BackendFactory, dtype: torch.dtype) -> Lane:
    return Lane(f"{name}-{DTYPE_IDS[dtype]}", factory, dtype)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The machine's tensors are tiny: with several threads on a busy 2-core machine, every
    op pays an OpenMP barrier (measured: 35 ms instead of 0.2 ms for a small matmul)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Small counts: under the interpreter a compute step costs ~0.1-0.3 s per Triton lane.
BASE = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


class CascadeCounter(TorchAttentionBackend):
    """The torch backend attending every shared prefix as a cascade (threshold 0), counting
    the decode steps that did, so a test can tell the cascade path really ran."""

    def __init__(self, block_size: int, dtype: torch.dtype, seen: list[int]) -> None:
        super().__init__(block_size, dtype, shared_prefix_min_tokens=0)
        self.seen = seen

    def _decode_plan(
        self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype, num_kv_heads: int
    ) -> object:
        plan = super()._decode_plan(meta, block_size, dtype, num_kv_heads)
        if isinstance(plan, CascadePlan):
            self.seen.append(1)  # a count: ids of freed plans are reused
        return plan


def test_torch_backend_machine() -> None:
    """The CPU paths: the compiled decode kernel (float32), and the torch backend in
    float32 and float16 with and without shared-prefix cascades: 60 runs of up to 40
    steps (~6 s)."""
    cascades: list[int] = []
    cascade = functools.partial(CascadeCounter, seen=cascades)
    config = MachineConfig(
        lanes=(
            lane("cpu", cpu_backend, FP32),
            lane("torch", torch_backend, FP32),
            lane("torch", torch_backend, FP16),
            lane("torch-cascade", cascade, FP32),
            lane("torch-cascade", cascade, FP16),
        )
    )
    hunt = settings(BASE, max_examples=60, stateful_step_count=40)
    run_state_machine_as_test(make_machine(config), settings=hunt)
    # Decode steps where running sequences shared prefix blocks: the cascade lanes ran them.
    # A check on the derandomised examples CI replays (the ci profile): under a random seed
    # (scripts/fuzz.py) how many cascades 60 runs reach is chance (4 with seed 3371993138),
    # which says nothing about the backends.
    if hunt.derandomize:
        assert len(cascades) >= 10, f"only {len(cascades)} cascade decode steps were exercised"


@needs_interpreter
def test_triton_backend_machine_interpreted() -> None:
    """Triton (interpreted) in float32 and float16, with the torch float32 lane alongside,
    at block sizes 4, 8, 16 and 24: 8 runs of up to 30 steps (~15 s)."""
    config = MachineConfig(
        lanes=(
            lane("torch", torch_backend, FP32),
            lane("triton", triton_backend, FP32),
            lane("triton", triton_backend, FP16),
        ),
        block_sizes=(4, 8, 16, 24),  # any block size: 24 is no power of two
    )
    run_state_machine_as_test(
        make_machine(config), settings=settings(BASE, max_examples=8, stateful_step_count=30)
    )


# --------------------------------------------------------------------------------------------
# Mutants: the machine, not a hand-written example, must catch each planted kernel bug.
# --------------------------------------------------------------------------------------------


class MutantTritonBackend(TritonAttentionBackend):
    """The Triton backend running one mutant kernel (the real host code around it)."""

    def __init__(self, mutant: KernelMutant, block_size: int, dtype: torch.dtype) -> None:
        super().__init__(block_size, dtype)
        self.name = f"triton[{mutant.name}]"
        self.mutant = mutant

    def attend(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with self.mutant.active():
            return super().attend(*args, **kwargs)


# The block-walk and GQA bugs in both kernels, and the prefill kernel's missing causal mask.
ALL_MUTANTS = (*MUTANTS, *PREFILL_MUTANTS)

# No shrinking: we only need to know that a failing run exists, not its smallest form.
HUNT = settings(
    max_examples=8,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def mutant_config(mutant: KernelMutant) -> MachineConfig:
    factory = functools.partial(MutantTritonBackend, mutant)
    # Only the mutant's lane (float32, the tightest tolerance), and the default geometries:
    # GQA with several KV heads and sequence lengths off block boundaries must come from
    # the machine's own draws.
    return MachineConfig(lanes=(Lane(f"mutant-{mutant.name}", factory, FP32),))


@needs_interpreter
@pytest.mark.parametrize("mutant", ALL_MUTANTS, ids=[m.name for m in ALL_MUTANTS])
def test_machine_catches_kernel_mutant(mutant: KernelMutant) -> None:
    # Caught by the oracle comparison (none of these bugs reads an unwritten slot).
    with pytest.raises(AssertionError, match="differs from naive attention"):
        run_state_machine_as_test(make_machine(mutant_config(mutant)), settings=HUNT)


@needs_interpreter
def test_real_triton_passes_the_same_hunt() -> None:
    """The hunt's settings must not fail the real kernels (or the catches mean nothing)."""
    config = MachineConfig(lanes=(lane("triton", triton_backend, FP32),))
    run_state_machine_as_test(make_machine(config), settings=HUNT)


CASCADE_HUNT = settings(HUNT, max_examples=40, stateful_step_count=30)
"""Cascades need two running sequences sharing a prefix block: more runs than the kernels'."""


def cascade_config(factory: BackendFactory, name: str) -> MachineConfig:
    return MachineConfig(lanes=(Lane(name, factory, FP32),))


@pytest.mark.parametrize("mutant", CASCADE_MUTANTS, ids=[m.name for m in CASCADE_MUTANTS])
def test_machine_catches_cascade_mutant(mutant: CascadeMutant) -> None:
    factory = functools.partial(CascadeMutantBackend, mutant)
    with pytest.raises(AssertionError, match="differs from naive attention"):
        run_state_machine_as_test(
            make_machine(cascade_config(factory, f"mutant-{mutant.name}")), settings=CASCADE_HUNT
        )


def test_real_cascade_passes_the_same_hunt() -> None:
    cascades: list[int] = []
    factory = functools.partial(CascadeCounter, seen=cascades)
    run_state_machine_as_test(
        make_machine(cascade_config(factory, "torch-cascade")), settings=CASCADE_HUNT
    )
    assert cascades, "the hunt never reached a cascade decode step: its catches would mean nothing"


RUNS = Geometry(num_kv_heads=2, group=2, head_dim=64)
WITH_RUNS = (*MachineConfig(()).geometries, RUNS)
"""The default geometries and RUNS: 2 KV heads of 64, where the CPU kernel's items take a run
of KV heads (csrc's run_span), and the AVX512-BF16 copy does a group's P @ V together."""


@pytest.mark.parametrize(
    "mutant", (*CPU_MUTANTS, *STORE_MUTANTS), ids=[m.name for m in (*CPU_MUTANTS, *STORE_MUTANTS)]
)
def test_machine_catches_cpu_kernel_mutant(mutant: CpuKernelMutant) -> None:
    factory = functools.partial(CpuMutantBackend, mutant)
    lanes = (Lane(f"mutant-{mutant.name}", factory, FP32),)
    config = MachineConfig(lanes=lanes, geometries=WITH_RUNS)
    # a store mutant is caught by the machine's check of the pool after each store
    caught = "store_kv did not write" if mutant.kind == "store" else "differs from naive attention"
    with pytest.raises(AssertionError, match=caught):
        run_state_machine_as_test(make_machine(config), settings=HUNT)


def test_real_cpu_kernel_passes_the_same_hunt() -> None:
    config = MachineConfig(lanes=(lane("cpu", cpu_backend, FP32),))
    run_state_machine_as_test(make_machine(config), settings=HUNT)


# ---- bfloat16 on the CPU kernel: held to one rounding (tests/attention_machine.ONE_ROUNDING)


def cpu_bf16_lane(variant: str) -> Lane:
    factory = functools.partial(CpuAttentionBackend, bf16_variant=variant)
    return Lane(f"cpu-bf16-{variant}", factory, BF16, one_rounding=True)


BF16_LANE_VARIANTS = bf16_variants()


def test_cpu_bf16_machine() -> None:
    """The CPU kernel on bfloat16 caches, every variant this CPU runs, each within half a
    bfloat16 ulp of the float32 oracle; the torch backend's bfloat16 lane alongside at its
    dtype tolerance (~4 s)."""
    lanes = (*(cpu_bf16_lane(v) for v in BF16_LANE_VARIANTS), lane("torch", torch_backend, BF16))
    run_state_machine_as_test(
        make_machine(MachineConfig(lanes=lanes, geometries=WITH_RUNS)),
        settings=settings(BASE, max_examples=40, stateful_step_count=40),
    )


@pytest.mark.parametrize("variant", BF16_LANE_VARIANTS)
@pytest.mark.parametrize("mutant", BF16_MUTANTS, ids=[m.name for m in BF16_MUTANTS])
def test_machine_catches_cpu_bf16_precision_mutant(mutant: CpuKernelMutant, variant: str) -> None:
    factory = functools.partial(CpuMutantBackend, mutant, bf16_variant=variant)
    config = MachineConfig(
        lanes=(Lane(f"mutant-{mutant.name}-{variant}", factory, BF16, one_rounding=True),)
    )
    with pytest.raises(AssertionError, match="differs from naive attention"):
        run_state_machine_as_test(make_machine(config), settings=HUNT)


@pytest.mark.skipif("avx512bf16" not in BF16_LANE_VARIANTS, reason="no AVX512-BF16 copy here")
@pytest.mark.parametrize("mutant", AVX512_BF16_MUTANTS, ids=[m.name for m in AVX512_BF16_MUTANTS])
def test_machine_catches_cpu_avx512_bf16_mutant(mutant: CpuKernelMutant) -> None:
    factory = functools.partial(CpuMutantBackend, mutant, bf16_variant="avx512bf16")
    config = MachineConfig(
        lanes=(Lane(f"mutant-{mutant.name}", factory, BF16, one_rounding=True),),
        geometries=WITH_RUNS,
    )
    with pytest.raises(AssertionError, match="differs from naive attention"):
        run_state_machine_as_test(make_machine(config), settings=HUNT)


def test_real_cpu_bf16_kernel_passes_the_same_hunt() -> None:
    config = MachineConfig(
        lanes=tuple(cpu_bf16_lane(v) for v in BF16_LANE_VARIANTS), geometries=WITH_RUNS
    )
    run_state_machine_as_test(make_machine(config), settings=HUNT)


class StrayStoreBackend(TorchAttentionBackend):
    """A store with a block-index bug: each row also lands one block further on (wrapping
    around the pool), i.e. in a block the writing sequence may not own (R9)."""

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, meta=None):  # type: ignore[no-untyped-def]
        pool_slots = k_cache.shape[0] * k_cache.shape[1]
        stray = (slot_mapping + k_cache.shape[1]) % pool_slots
        super().store_kv(key, value, k_cache, v_cache, stray)
        super().store_kv(key, value, k_cache, v_cache, slot_mapping, meta)


def test_machine_catches_stray_store() -> None:
    """The data-side R9 check can fail: a store that writes outside the step's own slots."""
    config = MachineConfig(lanes=(Lane("torch-stray-store", StrayStoreBackend, FP32),))
    with pytest.raises(AssertionError, match="outside the step's own"):
        run_state_machine_as_test(make_machine(config), settings=HUNT)


# --------------------------------------------------------------------------------------------
# GPU: compiled Triton and flash-attn at Qwen3-0.6B's head shapes.
# --------------------------------------------------------------------------------------------

QWEN3_0_6B = Geometry(num_kv_heads=8, group=2, head_dim=128)
GPU_SETTINGS = settings(BASE, max_examples=8, stateful_step_count=25)


def gpu_config(lanes: tuple[Lane, ...], block_size: int) -> MachineConfig:
    """Pools of 2,048-8,192 tokens, prompts of runs up to 600 tokens, contexts to 4,096."""
    tokens = (2048, 8192)
    return MachineConfig(
        lanes=lanes,
        device="cuda",
        geometries=(QWEN3_0_6B,),
        block_sizes=(block_size,),
        pool_blocks=(tokens[0] // block_size, tokens[1] // block_size),
        max_model_len=4096,
        max_run=600,
        max_live=8,
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_gpu_triton_machine(block_size: int, dtype: torch.dtype) -> None:
    lanes = (lane("triton", triton_backend, dtype), lane("torch", torch_backend, dtype))
    run_state_machine_as_test(make_machine(gpu_config(lanes, block_size)), settings=GPU_SETTINGS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not FLASH, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_gpu_flash_attn_machine(dtype: torch.dtype) -> None:
    lanes = (lane("flash-attn", flash_backend, dtype),)
    run_state_machine_as_test(make_machine(gpu_config(lanes, 256)), settings=GPU_SETTINGS)
