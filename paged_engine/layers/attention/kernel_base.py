"""What the Triton and flash-attn backends share: the store, and checks made once per step.

Both store K/V with this package's Triton scatter kernel, and both attend with kernels that
read the paged cache, so both must tell an empty cache apart: the warm-up pass that measures
peak memory runs before the KV pool exists, stores nothing, and attends over the step's own
K/V rows.

A launcher checks its arguments on every call: right for a library function, wasteful for
a model that calls it once per layer with the same shapes (28 layers: 28 identical sets of
checks per step). ``StepMemo`` keeps what a step's first call derived (the checks passed,
the launch plan) for the step's other calls with arguments of the same shapes, strides and
dtypes; a new step (a new metadata object) starts afresh. Nothing here imports Triton at
module level, so importing the flash-attn backend stays free of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from paged_engine.layers.attention.base import AttentionMetadata

__all__ = ["KernelAttentionBackend", "StepMemo", "cache_is_empty", "shape_key"]

T = TypeVar("T")


def shape_key(*tensors: torch.Tensor) -> tuple[Any, ...]:
    """What the launchers' checks read from ``tensors``: shapes, strides, dtypes, and the
    device (of the first: the checks hold all of them to one)."""
    return (tensors[0].device, *((t.shape, t.stride(), t.dtype) for t in tensors))


class StepMemo:
    """Values derived once per step and argument shapes, shared by the step's layers.

    Keyed by the identity of the step object (the metadata, or the slot mapping for a bare
    ``store_kv`` call), which is held so its id cannot be reused while the memo lives.
    """

    def __init__(self) -> None:
        self._step: object | None = None
        self._values: dict[Any, Any] = {}
        self.misses = 0
        """Values computed (not reused) so far: tests count checks with it."""

    def get(self, step: object, key: Any, make: Callable[[], T]) -> T:
        if step is not self._step:
            self._step, self._values = step, {}
        try:
            value: T = self._values[key]
        except KeyError:
            value = self._values[key] = make()
            self.misses += 1
        return value


class KernelAttentionBackend:
    """The store half of a kernel backend; subclasses add ``name`` and ``attend``."""

    supports_cuda_graphs = True
    """Decode reads only device tensors and static shapes, so it can be captured."""

    def __init__(self, block_size: int, dtype: torch.dtype) -> None:
        from paged_engine.kernels.store_kv import check_store_kv, store_kv_launches

        self._check_store = check_store_kv
        self._store_launches = store_kv_launches
        self.block_size = block_size
        self.dtype = dtype
        self.memo = StepMemo()

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Scatter the rows whose slot is not -1 into the cache; no-op on an empty cache.
        Arguments are checked once per step and shape (``StepMemo``)."""
        if k_cache.numel() == 0:
            return
        step = slot_mapping if meta is None else meta
        shapes = ("store", shape_key(key, value, k_cache, v_cache, slot_mapping))
        self.memo.get(
            step, shapes, lambda: self._check_store(key, value, k_cache, v_cache, slot_mapping)
        )
        for launch in self._store_launches(key, value, k_cache, v_cache, slot_mapping):
            launch.run()


def cache_is_empty(k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether ``attend`` runs without a cache (warm-up), where every context is the step's
    own rows; a step that needs a cached prefix cannot run so and is refused."""
    if k_cache.numel() != 0:
        return False
    if meta.has_cached_prefix:
        raise ValueError("attention over a cached prefix needs a KV cache; it is empty")
    return True
