"""Issue 25, item 5's profile: how much of a 29M decode step is Python outside the model
forward (the goal: at most 10% at batch 32), at batch 8 and 32, float32, one thread.

The measurement is ``scripts/profile_step.py`` (its docstring says what is wrapped and how
a step is cut into categories), run in a fresh interpreter (paged_engine imported first,
``OMP_*``/``GOMP_*`` removed from its environment), greedy and top-p sampling. Figures in
``extra_info`` (flat keys per setting: ``b32_greedy_outside_model_median``,
``b32_greedy_inputs_us_median``, ...) and printed: the fraction of each step outside the
model, each category's microseconds per step and share, and the top functions of the
cProfile view. Nothing is asserted about them; pytest-benchmark's own time is the whole
measurement. ``PAGED_ENGINE_STEP_PROFILE_ROUNDS`` sets the rounds (default 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("PAGED_ENGINE_STEP_PROFILE_ROUNDS", "5"))


def run_profile(batch: int, rounds: int) -> tuple[dict[str, Any], str]:
    """``scripts/profile_step.py``'s figures for one batch size, and its printed tables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    command = [
        sys.executable,
        str(ROOT / "scripts" / "profile_step.py"),
        "--batch",
        str(batch),
        "--sampling",
        "greedy",
        "random",
        "--rounds",
        str(rounds),
        "--json",
    ]
    run = subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    *tables, last = run.stdout.strip().splitlines()
    return json.loads(last), "\n".join(tables)


@pytest.mark.benchmark(group="step-overhead")
@pytest.mark.parametrize("batch", [8, 32])
def test_step_overhead(benchmark: Any, batch: int) -> None:
    got: list[tuple[dict[str, Any], str]] = []
    benchmark.pedantic(lambda: got.append(run_profile(batch, ROUNDS)), rounds=1, iterations=1)
    result, tables = got[0]
    info: dict[str, Any] = {"suite": "step-overhead", "batch": batch, "rounds": ROUNDS}
    info["cpu_capability"] = result["cpu_capability"]
    info["torch_threads"] = result["torch_threads"]
    for setting in result["settings"].values():
        split = setting["split"]
        prefix = f"b{batch}_{'greedy' if setting['sampling'] == 'greedy' else 'random'}"
        info[f"{prefix}_steps"] = split["steps"]
        info[f"{prefix}_outside_model_median"] = split["outside_model_median"]
        info[f"{prefix}_outside_model_min"] = split["outside_model_min"]
        for name, row in split["table"].items():
            key = name.replace("/", "_").replace(".", "_")
            info[f"{prefix}_{key}_us_median"] = row["us_median"]
            info[f"{prefix}_{key}_us_min"] = row["us_min"]
            info[f"{prefix}_{key}_share_median"] = row["share_median"]
        top = setting.get("cprofile", [])[:10]
        info[f"{prefix}_cprofile_top"] = [f"{r['own_us_per_step']} us {r['function']}" for r in top]
    benchmark.extra_info.update(info)
    print()
    print(tables)
