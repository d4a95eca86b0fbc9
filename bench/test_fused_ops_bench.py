"""The fused small ops (csrc/fused_ops.c) against the torch code they replaced, one thread.

Shapes are the 29M Qwen3 of bench/test_vllm_bench.py (hidden 512, 8 heads / 4 KV heads,
head_dim 64, intermediate 1792) at a decode step of 32 sequences (32 rows) and a prefill
chunk of 2048 tokens, float32 and bfloat16. Per op, the candidates:

* ``torch``: the modules' code before the kernels (residual add + ``rms_norm``; the
  q/k weights concatenated, ``rms_norm``, ``rotate``; ``chunk``, ``F.silu``, ``*``);
* ``torch_inplace`` (activation only): ``F.silu(gate)`` then ``mul_(up)`` in place, one
  temporary fewer, the same bits as ``torch``;
* ``launcher``: the kernels as the modules called them before kernels/fused_ops_layers.py:
  ``fused_ok``, then the launcher (``fused_ops_cpu``) with its full checks;
* ``fused``: the layer module as it now runs on the CPU (``fused_ops_layers``' one pass of
  checks, then the same kernel).

The rotation runs in place on one buffer, call after call, with q/k norm weights of 1:
weights other than 1 shrink every element but the largest a little more at each call, until
they are denormals and the kernel slows down (a drift no model step sees).

Candidates alternate call by call in one process (the machine is shared and noisy); each
sample is the mean of ``CALLS`` calls. Reported: ``us_min``/``us_median`` per candidate and
``ratio_*`` = candidate / ``torch`` (below 1: faster). ``test_model_step`` times whole
``LLM`` steps (a 2048-token prefill of 32 prompts, then decode steps of 32) with the kernels
and with them switched off in the modules (a bench-only patch of ``fused_ok`` and of the
layer calls), alternating.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from paged_engine import LLM, SamplingParams
from paged_engine.kernels.fused_ops_cpu import (
    add_rms_norm_cpu,
    fused_ok,
    qk_norm_rope_cpu_,
    silu_and_mul_cpu,
)
from paged_engine.layers import activation, layernorm, rotary
from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.layernorm import RMSNorm, rms_norm
from paged_engine.layers.rotary import RopeSpec, RotaryEmbedding
from paged_engine.utils.tiny_model import make_tiny_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 512, 8, 4, 64, 1792
SAMPLES, CALLS = 30, 10
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


pytestmark = pytest.mark.usefixtures("one_thread")  # bench/conftest.py


def measure(candidates: dict[str, Callable[[], object]]) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()  # warm-up
    for _ in range(SAMPLES):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times[name].append((time.perf_counter() - start) / CALLS)
    mins = {k: min(v) for k, v in times.items()}
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "us_min": {k: round(v * 1e6, 2) for k, v in mins.items()},
        "us_median": {k: round(v * 1e6, 2) for k, v in medians.items()},
        "ratio_min": {k: round(v / mins["torch"], 3) for k, v in mins.items()},
        "ratio_median": {k: round(v / medians["torch"], 3) for k, v in medians.items()},
    }


def op_candidates(op: str, rows: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    if op == "add_rms_norm":
        norm = RMSNorm(HIDDEN).to(dtype)
        x, res = (torch.randn(2, rows, HIDDEN, generator=gen) * 3).to(dtype)
        return {
            "torch": lambda: (rms_norm(res + x, norm.weight, norm.eps), res + x),
            "launcher": lambda: (
                fused_ok(x, res, norm.weight) and add_rms_norm_cpu(x, res, norm.weight, norm.eps)
            ),
            "fused": lambda: norm(x, res),
        }
    if op == "qk_norm_rope":
        rope = RotaryEmbedding(HEAD_DIM, RopeSpec(theta=1e6))
        positions = torch.arange(rows) + 100
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        qkv = torch.randn(rows, width, generator=gen).to(dtype)
        wq, wk = torch.ones(2, HEAD_DIM, dtype=dtype)  # see the module: no drift
        heads = HEADS + KV_HEADS

        def old() -> torch.Tensor:
            qk = qkv[:, : heads * HEAD_DIM].view(rows, heads, HEAD_DIM)
            weight = torch.cat((wq.expand(HEADS, HEAD_DIM), wk.expand(KV_HEADS, HEAD_DIM)))
            return rope.rotate(positions, rms_norm(qk, weight, 1e-6))

        def fused() -> torch.Tensor:  # in place: the values drift, the work does not
            qk = qkv[:, : heads * HEAD_DIM].view(rows, heads, HEAD_DIM)
            return rope.norm_rotate(positions, qk, wq, wk, HEADS, 1e-6)

        def launcher() -> torch.Tensor | bool:
            qk = qkv[:, : heads * HEAD_DIM].view(rows, heads, HEAD_DIM)
            cos, sin = rope.cos_signed_sin(positions, dtype)
            return fused_ok(qk, wq, wk) and qk_norm_rope_cpu_(qk, wq, wk, HEADS, 1e-6, cos, sin)

        return {"torch": old, "launcher": launcher, "fused": fused}
    act = SiluAndMul()
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(dtype)

    def old_act() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def inplace() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    return {
        "torch": old_act,
        "torch_inplace": inplace,
        "launcher": lambda: fused_ok(gate_up) and silu_and_mul_cpu(gate_up),
        "fused": lambda: act(gate_up),
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [32, 2048])
@pytest.mark.parametrize("op", ["add_rms_norm", "qk_norm_rope", "silu_and_mul"])
def test_op(benchmark: Any, op: str, rows: int, dtype: str) -> None:
    candidates = op_candidates(op, rows, DTYPES[dtype])
    result: dict[str, Any] = {}
    benchmark.pedantic(lambda: result.update(measure(candidates)), rounds=1, iterations=1)
    info = {"op": op, "rows": rows, "dtype": dtype, "threads": 1, **result}
    benchmark.extra_info.update(info)
    print(json.dumps(info))


# ------------------------------------------------------------------------- whole model

BATCH, PROMPT, STEPS, ROUNDS = 32, 64, 8, 4


def torch_only() -> list[Any]:
    """Patches that switch the kernels off in the modules (bench-only: the product has no
    switch), started and stopped around each torch round."""
    off = [
        mock.patch.object(m, "fused_ok", lambda *t, **k: False)
        for m in (layernorm, activation, rotary)
    ]
    layer_calls = [
        (layernorm, "add_rms_norm_layer"),
        (activation, "silu_and_mul_layer"),
        (rotary, "qk_norm_rope_layer_"),
    ]
    return off + [mock.patch.object(m, name, lambda *a: None) for m, name in layer_calls]


def one_round(llm: LLM, rng: random.Random, vocab: int) -> tuple[float, list[float]]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
    for _ in range(BATCH):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
        engine.add_request(f"r{rng.random()}", {"prompt_token_ids": prompt}, params)
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    decode = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - start)
    return prefill, decode


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_model_step(benchmark: Any, tmp_path: Path, dtype: str) -> None:
    path = make_tiny_model(
        tmp_path / "qwen3-29m",
        seed=0,
        hidden_size=HIDDEN,
        num_layers=8,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
    )
    llm = LLM(path, dtype=dtype, num_threads=1, max_model_len=256, num_kvcache_blocks=1024)
    vocab = int(llm.model_runner.hf_config.vocab_size)
    rng = random.Random(0)
    patches = torch_only()
    times: dict[str, dict[str, list[float]]] = {
        k: {"prefill": [], "decode": []} for k in ("torch", "fused")
    }

    def run() -> None:
        one_round(llm, rng, vocab)  # warm-up
        for r in range(ROUNDS):
            for name in ("torch", "fused") if r % 2 else ("fused", "torch"):
                if name == "torch":
                    for p in patches:
                        p.start()
                try:
                    prefill, decode = one_round(llm, rng, vocab)
                finally:
                    if name == "torch":
                        for p in patches:
                            p.stop()
                times[name]["prefill"].append(prefill)
                times[name]["decode"].extend(decode)

    benchmark.pedantic(run, rounds=1, iterations=1)
    info: dict[str, Any] = {"dtype": dtype, "threads": 1, "batch": BATCH, "prompt": PROMPT}
    for phase in ("prefill", "decode"):
        mins = {k: min(v[phase]) for k, v in times.items()}
        meds = {k: statistics.median(v[phase]) for k, v in times.items()}
        info[f"{phase}_ms_min"] = {k: round(v * 1e3, 2) for k, v in mins.items()}
        info[f"{phase}_ms_median"] = {k: round(v * 1e3, 2) for k, v in meds.items()}
        info[f"{phase}_ratio_min"] = round(mins["fused"] / mins["torch"], 3)
        info[f"{phase}_ratio_median"] = round(meds["fused"] / meds["torch"], 3)
    benchmark.extra_info.update(info)
    print(json.dumps(info))
