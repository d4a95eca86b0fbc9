"""Backend selection (the fallback order, every backend's reason), checks made once per step
and shape in the kernel backends, and the torch backend's store deciding from host data.

The CUDA orders are checked by replacing the requirement functions (no GPU here); the CPU
paths run for real, the Triton backend under the interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest

from paged_engine.layers.attention import (
    FALLBACK_ORDER,
    TorchAttentionBackend,
    backend_problems,
    choose_backend,
    get_attention_backend,
    make_attention_metadata,
    selection,
)
from paged_engine.layers.attention.triton_backend import TritonAttentionBackend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


@pytest.fixture
def fake_requirements(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str | None]]:
    """Each backend's verdict, set by the test (None: it can run)."""
    verdicts: dict[str, str | None] = {name: None for name in selection.REQUIREMENTS}
    for name in selection.REQUIREMENTS:
        monkeypatch.setitem(
            selection.REQUIREMENTS, name, lambda d, b, t, h=None, name=name: verdicts[name]
        )
    yield verdicts


def test_the_cuda_order_is_flash_attn_then_triton_then_torch(
    fake_requirements: dict[str, str | None],
) -> None:
    assert FALLBACK_ORDER["cuda"] == ("flash-attn", "triton", "torch")
    assert choose_backend(CUDA, 256, torch.bfloat16) == "flash-attn"
    fake_requirements["flash-attn"] = "no flash here"
    assert choose_backend(CUDA, 48, torch.bfloat16) == "triton"
    fake_requirements["triton"] = "no triton here"
    assert choose_backend(CUDA, 48, torch.bfloat16) == "torch"


def test_the_cpu_order_is_the_kernel_then_torch(fake_requirements: dict[str, str | None]) -> None:
    assert choose_backend(CPU, 16, torch.float32) == "cpu"
    fake_requirements["cpu"] = "float32 only"
    assert choose_backend(CPU, 16, torch.float16) == "torch"


def test_flash_attn_checks_are_the_ones_auto_reads() -> None:
    # Real requirement functions: on a CPU machine flash-attn gives its first reason.
    problems = backend_problems(CUDA, 48, torch.float16, head_dim=128)
    assert "kvcache_block_size % 256 == 0" in (problems["flash-attn"] or "")
    assert "head_dim a multiple of 8" in (
        backend_problems(CUDA, 256, torch.float16, head_dim=100)["flash-attn"] or ""
    )
    assert backend_problems(CPU, 256, torch.float16)["flash-attn"] == (
        "flash-attn needs CUDA; this device is cpu"
    )
    assert problems["torch"] is None


@pytest.mark.parametrize("block_size", [1, 3, 16, 24, 48, 100, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_auto_never_refuses_a_legal_block_size(block_size: int, dtype: torch.dtype) -> None:
    backend = get_attention_backend("auto", CPU, block_size, dtype, head_dim=8)
    assert backend.name == ("cpu" if dtype in (torch.float32, torch.bfloat16) else "torch")


def test_auto_on_cuda_falls_back_past_a_refused_head_dim(
    fake_requirements: dict[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real flash-attn and Triton head-dim rules (the rest of their checks passing):
    head_dim 100 is no multiple of 8 (flash-attn), head_dim 4 is also below 16 (Triton)."""
    real_flash, real_triton = selection.flash_attn_problem, selection.triton_problem
    for name, real in (("flash-attn", real_flash), ("triton", real_triton)):
        monkeypatch.setitem(
            selection.REQUIREMENTS,
            name,
            lambda d, b, t, h=None, real=real: real(d, b, t, h) if h in (4, 100) else None,
        )
    assert choose_backend(CUDA, 256, torch.float16, head_dim=128) == "flash-attn"
    assert choose_backend(CUDA, 256, torch.float16, head_dim=100) == "triton"
    assert choose_backend(CUDA, 256, torch.float16, head_dim=4) == "torch"


def test_a_named_backend_that_cannot_run_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="'flash-attn' cannot run: flash-attn needs CUDA"):
        get_attention_backend("flash-attn", CPU, 256, torch.float16)
    with pytest.raises(ValueError, match=r"'cpu' cannot run: .*float32 only"):
        get_attention_backend("cpu", CPU, 16, torch.float16)
    with pytest.raises(ValueError, match="unknown attention backend 'magic'"):
        get_attention_backend("magic", CPU, 16, torch.float16)


# ---- checks once per step and shape ---------------------------------------------------------


def _caches(layers: int, block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pool = torch.randn(2, layers, 6, block_size, 2, 32)
    return [(pool[0, i], pool[1, i]) for i in range(layers)]


@pytest.mark.skipif(not INTERPRETED, reason="the Triton backend runs here under the interpreter")
def test_the_triton_backend_checks_once_per_step_and_shape() -> None:
    backend = TritonAttentionBackend(block_size=16, dtype=torch.float32)
    layers = _caches(3)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        meta = make_attention_metadata([1, 1], [5 + step, 9 + step], [[0], [1]], 16)
        before = backend.memo.misses
        for k_cache, v_cache in layers:
            q = torch.randn(2, 4, 32, generator=gen)
            kv = torch.randn(2, 2, 32, generator=gen)
            backend.store_kv(kv, kv, k_cache, v_cache, meta.slot_mapping, meta)
            backend.attend(q, kv, kv, k_cache, v_cache, meta, 0.2)
        assert backend.memo.misses - before == 2  # one store check, one decode plan
    # Arguments of another shape in the same step are checked on their own: and refused.
    bad = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="query head_dim 16 != cache head_dim 32"):
        backend.attend(bad, bad, bad, *layers[0], meta, 0.2)


def test_the_torch_backend_store_reads_host_data_not_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k_cache, v_cache = _caches(1, block_size=4)[0]
    meta = make_attention_metadata([3], [3], [[2]], 4)
    kv = torch.randn(3, 2, 32)
    reads: list[int] = []
    real_bool = torch.Tensor.__bool__

    def counting_bool(self: torch.Tensor) -> bool:
        reads.append(1)  # a bool() of a tensor: on CUDA, a device sync
        return real_bool(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
    TorchAttentionBackend().store_kv(kv, kv, k_cache, v_cache, meta.slot_mapping, meta)
    assert reads == []
    TorchAttentionBackend().store_kv(kv, kv, k_cache, v_cache, meta.slot_mapping)  # no meta
    assert reads, "without host data the store must look at the tensor (the detector works)"
    monkeypatch.setattr(torch.Tensor, "__bool__", real_bool)
    assert torch.equal(k_cache[2, :3], kv) and torch.equal(v_cache[2, :3], kv)
