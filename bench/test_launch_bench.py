"""What a kernel launcher's host-side checks cost per layer call, against the per-step memo
that replaced them in the Triton and flash-attn backends (``kernel_base.StepMemo``).

Shapes are Qwen3-0.6B's decode at batch 64 (16 query heads as a slice of the fused q/k
tensor, 8 KV heads, head dim 128, the pool's layer views), on CPU tensors: the checks read
only shapes, strides and dtypes, so the device does not change their cost.

* ``checks``: what every call of ``paged_decode_attention`` does before launching
  (``plan_paged_decode``: the argument, dtype and device checks and the launch plan), and
  ``check_store_kv`` for the store;
* ``memo``: what the backend does instead for layers 2..N of a step: one memo lookup keyed
  by the arguments' shapes, strides and dtypes.

Figures are microseconds per call (``extra_info``: ``us_per_call_min`` and ``_median``);
read the checks/memo ratio within one run. Multiply by 2 x layers for a step's saving.
"""

from __future__ import annotations

import os

import torch

# The launchers' device check passes on CPU tensors only for interpreted kernels: make them
# so when nothing set the variable (tox's bench env sets it empty) and there is no GPU.
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from typing import Any

import pytest

from paged_engine.kernels.paged_decode_attention import is_interpreted, plan_paged_decode
from paged_engine.kernels.store_kv import check_store_kv
from paged_engine.layers.attention import make_attention_metadata
from paged_engine.layers.attention.kernel_base import StepMemo, shape_key

CALLS = 2000
B, H, KVH, D, BS = 64, 16, 8, 128, 16


def _decode_args() -> dict[str, Any]:
    qk = torch.zeros(B, H + KVH, D)
    pool = torch.zeros(2, 2, 256, BS, KVH, D)
    meta = make_attention_metadata([1] * B, [30] * B, [[i, i + 64] for i in range(B)], BS)
    return {
        "query": qk[:, :H],
        "key": qk[:, H:],
        "k_cache": pool[0, 1],
        "v_cache": pool[1, 1],
        "meta": meta,
    }


def _checks(a: dict[str, Any]) -> object:
    meta = a["meta"]
    return plan_paged_decode(
        a["query"], a["k_cache"], a["v_cache"], meta.block_tables, meta.seq_lens
    )


def _memo(a: dict[str, Any], memo: StepMemo) -> object:
    q, kc, vc = a["query"], a["k_cache"], a["v_cache"]
    return memo.get(a["meta"], ("decode", shape_key(q, kc, vc)), lambda: _checks(a))


def _store_checks(a: dict[str, Any]) -> object:
    k, kc, vc, slots = a["key"], a["k_cache"], a["v_cache"], a["meta"].slot_mapping
    check_store_kv(k, k, kc, vc, slots)
    return None


def _store_memo(a: dict[str, Any], memo: StepMemo) -> object:
    k, kc, vc, slots = a["key"], a["k_cache"], a["v_cache"], a["meta"].slot_mapping
    return memo.get(a["meta"], ("store", shape_key(k, k, kc, vc, slots)), lambda: None)


WAYS = {
    ("decode", "checks"): lambda a, m: _checks(a),
    ("decode", "memo"): _memo,
    ("store", "checks"): lambda a, m: _store_checks(a),
    ("store", "memo"): _store_memo,
}


@pytest.mark.parametrize("how", ["checks", "memo"])
@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(k, marks=pytest.mark.benchmark(group=f"{k}-launch-host-cost"))
        for k in ("decode", "store")
    ],
)
def test_launch_host_cost(benchmark: Any, kernel: str, how: str) -> None:
    if not (is_interpreted() or torch.cuda.is_available()):
        pytest.skip("the kernels were imported compiled before this module, and there is no GPU")
    args = _decode_args()
    memo = StepMemo()
    way = WAYS[kernel, how]
    way(args, memo)  # the step's first layer filled the memo

    def calls() -> None:
        for _ in range(CALLS):
            way(args, memo)

    benchmark.pedantic(calls, rounds=15, iterations=1, warmup_rounds=1)
    stats = benchmark.stats.stats
    benchmark.extra_info.update(
        us_per_call_min=stats.min / CALLS * 1e6, us_per_call_median=stats.median / CALLS * 1e6
    )
    assert memo.misses == (1 if how == "memo" else 0)  # the memo side measured lookups only
