"""scripts/compile_kernels.py's checks can fail: each is shown failing on a patched kernel
or a patched tile choice, and passing on the real one.

Offline compiles need kernels built for the GPU, which a test session on a machine without
CUDA cannot have (its kernels are interpreted, and Triton cannot compile once imported that
way), so every scenario runs in one subprocess without ``TRITON_INTERPRET`` (~20 s). The
script itself runs in tox (env ``compile``); these tests hold its verdicts honest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

DRIVER = r"""
import contextlib, importlib.util, json, sys
from unittest import mock
sys.path.insert(0, sys.argv[1])
script = sys.argv[1] + "/scripts/compile_kernels.py"
spec = importlib.util.spec_from_file_location("compile_kernels", script)
ck = importlib.util.module_from_spec(spec)
sys.modules["compile_kernels"] = ck
spec.loader.exec_module(ck)
from paged_engine.kernels import prefill_plan as prefill
from tests.kernel_mutants import COMPILE_MUTANTS
from tests.patch_mutants import StaleMutant

out = {}
for name, sc in json.loads(sys.argv[2]).items():
    cases = [ck.Case(*c) for c in sc["cases"]]
    tiles = sc.get("tiles")
    chosen = (lambda d, h: tuple(tiles)) if tiles else prefill.default_tiles
    try:  # a stale mutant fails its own scenario's test, not the others'
        with contextlib.ExitStack() as stack:
            if "mutant" in sc:
                (mutant,) = [m for m in COMPILE_MUTANTS if m.name == sc["mutant"]]
                stack.enter_context(mutant.active())
            stack.enter_context(mock.patch.object(prefill, "default_tiles", chosen))
            v = ck.check(cases)
    except StaleMutant as exc:
        out[name] = {"stale": str(exc)}
        continue
    out[name] = {
        "failures": list(v.failures),
        "warnings": list(v.warnings),
        "results": [[r.kernel, r.regs, r.mma] for r in v.results],
    }
print("VERDICTS " + json.dumps(out))
"""

DECODE = ("decode", 90, "fp16", 128, 2, 16)
SCENARIOS: dict[str, dict[str, Any]] = {
    "real": {"cases": [DECODE]},
    # tests/kernel_mutants.py's COMPILE_MUTANTS, by name
    "narrow_offsets": {"mutant": "decode_cache_offsets_int32", "cases": [DECODE]},
    "tf32": {"mutant": "decode_dot_tf32", "cases": [("decode", 90, "fp32", 128, 2, 16)]},
    # 256-row, 64-key tiles on 4 warps: far past the register file. G=2 is a Qwen3
    # default shape, G=16 is not.
    "big_tiles": {
        "tiles": [256, 64, 4],
        "cases": [("prefill", 90, "fp16", 128, 2, 16), ("prefill", 90, "fp16", 128, 16, 16)],
    },
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(ROOT), json.dumps(SCENARIOS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: dict[str, dict[str, Any]] = json.loads(lines[-1].removeprefix("VERDICTS "))
    return result


def verdict(verdicts: dict[str, Any], scenario: str) -> dict[str, Any]:
    """One scenario's verdict; its mutant's StaleMutant, if its patch no longer applies."""
    v: dict[str, Any] = verdicts[scenario]
    assert "stale" not in v, v["stale"]
    return v


def test_the_real_decode_kernel_passes_every_check(verdicts: dict[str, Any]) -> None:
    v = verdict(verdicts, "real")
    assert v["failures"] == [] and v["warnings"] == []
    ((kernel, regs, mma),) = v["results"]
    assert kernel == "decode_kernel" and 0 < regs <= 255 and mma == "mma.sync"


def test_32_bit_cache_offsets_are_caught(verdicts: dict[str, Any]) -> None:
    v = verdict(verdicts, "narrow_offsets")
    found = [f for f in v["failures"] if "not int64" in f]
    assert len(found) == 2, v  # the K gather and the V gather
    assert any("k_cache_ptr" in f for f in found) and any("v_cache_ptr" in f for f in found)


def test_a_tf32_dot_in_float32_is_caught(verdicts: dict[str, Any]) -> None:
    failures = verdict(verdicts, "tf32")["failures"]
    assert any("MMA family mma.sync, expected fma" in f for f in failures), failures


def test_spills_fail_in_a_qwen3_default_and_warn_elsewhere(verdicts: dict[str, Any]) -> None:
    v = verdict(verdicts, "big_tiles")
    assert [f for f in v["failures"] if "spills" in f and "G=2 " in f], v
    assert not [f for f in v["failures"] if "G=16" in f], v
    assert [w for w in v["warnings"] if "spills" in w and "G=16" in w], v


def _load_script() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "compile_kernels_cases", ROOT / "scripts/compile_kernels.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compile_kernels_cases"] = module
    spec.loader.exec_module(module)  # defines cases only: imports nothing from Triton
    return module


def test_the_default_sweep_covers_every_qwen3_group_and_both_archs() -> None:
    ck = _load_script()
    cases = ck.default_cases(sample=5, seed=1)
    defaults = [c for c in cases if c.qwen3_default and c.block_size == 16]
    for kind in ("decode", "decode-split", "prefill"):
        got = {(c.arch, c.dtype, c.group) for c in defaults if c.kind == kind}
        want = {(a, d, g) for a in (80, 90) for d in ("fp16", "bf16") for g in range(1, 9)}
        assert got >= want, (kind, want - got)
    assert len(cases) == len(set(cases))  # the sample adds cases, never repeats one
    assert len(ck.full_sweep()) > len(cases)
