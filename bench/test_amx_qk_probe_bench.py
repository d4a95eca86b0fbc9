"""A probe of the decode kernel's Q.K scores on AMX tiles against the AVX512-BF16 way
(``bench/amx_qk_probe.c`` says how each works), the two alone, outside the kernel. Not
product code: it measured whether an AMX copy would pay before the "amx" variant
(csrc/paged_decode_amx.h) was built, and still shows the scoring's share by itself.

Per geometry the probe is compiled with the geometry as constants (as the kernel's copies are)
and run once, pinned to no core (run the bench under ``taskset`` for figures). Both ways must
agree with a double-precision reference within float32 rounding (an assertion); the figures
are ns per token (all of a sequence's heads) and their ratio. Skips where the CPU has no
AMX-BF16 or no C compiler is found.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from paged_engine import platform

PROBE = Path(__file__).with_name("amx_qk_probe.c")
GEOMETRIES = {"qwen3-29m": (4, 2, 64), "smollm2": (3, 3, 64), "qwen3-8b": (8, 4, 128)}
"""kv heads, query heads per kv head, head dim: the bench models' and a real Qwen3's."""
TOKENS = 448
"""A bench-vllm sequence's context (its K rows stay in cache: the compute side alone)."""
AMX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def _problem() -> str | None:
    if not platform.cpu_info().has(AMX_FLAGS):
        return f"this CPU lacks one of {AMX_FLAGS}"
    if shutil.which("gcc") is None:
        return "no gcc to build the probe"
    return None


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_amx_qk_probe(benchmark: Any, tmp_path: Path, geometry: str) -> None:
    problem = _problem()
    if problem is not None:
        pytest.skip(problem)
    kvh, group, dim = GEOMETRIES[geometry]
    exe = tmp_path / "probe"
    defines = [f"-DKVH={kvh}", f"-DG={group}", f"-DD={dim}"]
    subprocess.run(["gcc", "-O3", *defines, "-o", str(exe), str(PROBE), "-lm"], check=True)

    def run() -> dict[str, Any]:
        out = subprocess.run([str(exe), str(TOKENS)], check=True, capture_output=True, text=True)
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    result = benchmark.pedantic(run, rounds=1, iterations=1)
    # float32 sums of dim exact products: within a few ulps of the largest score
    bound = dim * 2**-23 * max(1.0, result["max_abs_score"])
    assert result["max_abs_err_dpbf16"] <= bound, result
    assert result["max_abs_err_amx"] <= bound, result
    result["amx_over_dpbf16"] = round(result["amx_ns_per_token"] / result["dpbf16_ns_per_token"], 3)
    benchmark.extra_info.update(result)
    print(f"\n{geometry}: {json.dumps(result)}")
