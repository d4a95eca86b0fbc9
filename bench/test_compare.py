"""bench/compare.py and bench/ratios.py on hand-made runs: the regression verdicts, the
tolerance rules, the derived engine/spec ratios, the exit codes. No timing here: every
expected figure below is worked out by hand from the inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.compare import compare, main, tolerance_for
from bench.ratios import tracked_ratios
from bench.report import report

BASELINE: dict[str, Any] = {
    "tolerance": 0.2,
    "tolerances": {"engine/spec": 0.1, "engine/spec bs16-pool100k": 0.3},
    "machine": {"cpu_model": "x", "cpus": 2},
    "ratios": {"engine/spec bs256-pool4000": 4.0, "paged_engine/transformers": 5.0},
}


def _alloc(scenario: str, allocator: str, us: float) -> dict[str, Any]:
    return {
        "group": scenario,
        "extra_info": {
            "suite": "allocator",
            "scenario": scenario,
            "allocator": allocator,
            "us_per_seq_step_min": us,
        },
    }


def _run(**ratios: float) -> dict[str, Any]:
    return {"benchmarks": [{"extra_info": {"tracked_ratios": ratios}}]}


def test_tolerance_longest_prefix_default_and_override() -> None:
    assert tolerance_for("engine/spec bs16-pool100k", BASELINE, None) == 0.3
    assert tolerance_for("engine/spec bs256-pool4000", BASELINE, None) == 0.1
    assert tolerance_for("paged_engine/transformers", BASELINE, None) == 0.2
    assert tolerance_for("engine/spec bs16-pool100k", BASELINE, 0.05) == 0.05


@pytest.mark.parametrize(
    ("spec_ratio", "passed"),
    [(4.0, True), (3.61, True), (3.6, True), (3.59, False), (1.0, False), (9.0, True)],
)
def test_a_ratio_fails_only_below_its_floor(spec_ratio: float, passed: bool) -> None:
    # floor = 4.0 * (1 - 0.1) = 3.6; the transformers ratio sits at its baseline
    ok, lines = compare(
        {"engine/spec bs256-pool4000": spec_ratio, "paged_engine/transformers": 5.0}, BASELINE
    )
    assert ok is passed
    assert any("REGRESSION" in line for line in lines) is not passed
    assert lines[-1] == f"2 compared, {0 if passed else 1} regressed"


def test_missing_ratio_is_not_run_but_nothing_compared_fails() -> None:
    ok, lines = compare({"paged_engine/transformers": 4.1}, BASELINE)  # floor 4.0
    assert ok
    assert any(line.endswith("not run") and "bs256" in line for line in lines)
    ok, lines = compare({"something else": 1.0}, BASELINE)
    assert not ok
    assert "none of the baseline's ratios" in lines[-1]
    assert any("not in the baseline" in line for line in lines)


def test_engine_spec_ratios_are_derived_from_complete_pairs() -> None:
    run = {
        "benchmarks": [
            _alloc("a", "engine", 2.0),
            _alloc("a", "spec", 7.0),
            _alloc("b", "engine", 1.0),  # no spec side: no ratio
            {"extra_info": {"tracked_ratios": {"paged_engine/transformers": 4.5}}},
        ]
    }
    assert tracked_ratios(run) == {"engine/spec a": 3.5, "paged_engine/transformers": 4.5}
    assert run["benchmarks"][0]["extra_info"]["tracked_ratios"] == {"engine/spec a": 3.5}
    assert "tracked_ratios" not in run["benchmarks"][1]["extra_info"]


def test_an_interleaved_engine_spec_ratio_is_kept_not_derived_again() -> None:
    spec = _alloc("a", "spec", 7.0)
    spec["extra_info"]["tracked_ratios"] = {"engine/spec a": 4.0}  # measured interleaved
    run = {"benchmarks": [_alloc("a", "engine", 2.0), spec]}
    assert tracked_ratios(run) == {"engine/spec a": 4.0}  # not 7.0 / 2.0
    assert "tracked_ratios" not in run["benchmarks"][0]["extra_info"]


def _write(tmp_path: Path, run: dict[str, Any], baseline: dict[str, Any]) -> tuple[Path, Path]:
    run_path, base_path = tmp_path / "run.json", tmp_path / "base.json"
    run_path.write_text(json.dumps(run))
    base_path.write_text(json.dumps(baseline))
    return run_path, base_path


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {
        "benchmarks": [
            _alloc("bs256-pool4000", "engine", 1.0),
            _alloc("bs256-pool4000", "spec", 3.8),
        ]
    }
    run, base = _write(tmp_path, good, BASELINE)
    assert main([str(run), "--baseline", str(base)]) == 0
    assert main([str(run), "--baseline", str(base), "--tolerance", "0.01"]) == 1  # 3.8 < 3.96
    bad = {
        "benchmarks": [
            _alloc("bs256-pool4000", "engine", 1.0),
            _alloc("bs256-pool4000", "spec", 3.5),
        ]
    }
    run, base = _write(tmp_path, bad, BASELINE)
    assert main([str(run), "--baseline", str(base)]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert main([str(run), "--baseline", str(tmp_path / "missing.json")]) == 2


def test_write_baseline_merges_ratios_and_keeps_tolerances(tmp_path: Path) -> None:
    measured = {"paged_engine/vllm tiny float32 1t": 1.25, "paged_engine/transformers": 6.0}
    run, base = _write(tmp_path, _run(**measured), BASELINE)
    assert main([str(run), "--baseline", str(base), "--write-baseline"]) == 0
    written = json.loads(base.read_text())
    assert written["ratios"] == {
        "engine/spec bs256-pool4000": 4.0,  # not measured by this run: kept
        "paged_engine/transformers": 6.0,  # measured: replaced
        "paged_engine/vllm tiny float32 1t": 1.25,  # new
    }
    assert written["tolerance"] == 0.2 and written["tolerances"] == BASELINE["tolerances"]
    assert set(written["machine"]) == {"cpu_model", "cpus"}
    assert written["source_runs"] == {"run.json": sorted(measured)}


def test_report_prints_vllm_and_transformers_ratios_in_one_table(tmp_path: Path) -> None:
    side = {
        "output_tokens_per_s": 3000.0,
        "output_tokens_per_s_median": 2500.0,
        "output_tokens_per_cpu_s": 2900.0,
        "ttft_mean_s": 0.2,
        "peak_rss_bytes": 300 * 2**20,
    }
    vllm = {**side, "output_tokens_per_s": 2000.0, "ttft_mean_s": 0.1}
    v_info = {
        "suite": "vllm",
        "model": "tiny",
        "dtype": "bfloat16",
        "threads": 2,
        "paged_engine": side,
        "vllm": vllm,
        "speedup_vs_vllm": 1.5,
        "speedup_vs_vllm_median": 1.0,
        "ttft_mean_vs_vllm": 2.0,
        "target_speedup": 1.5,
    }
    e2e = {
        "engine": "paged_engine",
        "threads": 1,
        "speedup_vs_transformers": 4.25,
        "speedup_vs_transformers_median": 3.5,
    }
    run = {"benchmarks": [{"extra_info": v_info}, {"group": "e2e-cpu", "extra_info": e2e}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    text = report(path)
    row = next(line for line in text.splitlines() if line.startswith("tiny bfloat16 2t"))
    assert "1.50x (1.00x)" in row and "200 / 100" in row and "300 / 300" in row
    assert row.endswith("pass* ttft")  # the ratio passes, the median does not, TTFT is worse
    e2e_row = next(line for line in text.splitlines() if line.startswith("e2e pe float32 1t"))
    assert "4.25x (3.50x)" in e2e_row


def test_report_marks_a_cell_over_its_matmul_floor(tmp_path: Path) -> None:
    side = {
        "output_tokens_per_s": 2600.0,
        "output_tokens_per_s_median": 2600.0,
        "output_tokens_per_cpu_s": 2600.0,
        "ttft_mean_s": 0.1,
        "peak_rss_bytes": 2**20,
    }
    info = {
        "suite": "vllm",
        "model": "qwen3-29m",
        "dtype": "float32",
        "threads": 1,
        "paged_engine": side,
        "vllm": {**side, "output_tokens_per_s": 2000.0, "output_tokens_per_s_median": 2000.0},
        "speedup_vs_vllm": 1.3,
        "speedup_vs_vllm_median": 1.3,
        "ttft_mean_vs_vllm": 1.0,
        "target_speedup": 1.3,
    }
    cells = {"within": (1.25, "pass"), "over": (2.234, "pass floor 2.23x")}
    for name, (time_vs_floor, verdict) in cells.items():
        path = tmp_path / f"{name}.json"
        extra = {**info, "time_vs_floor": time_vs_floor, "target_floor": 1.3}
        path.write_text(json.dumps({"benchmarks": [{"extra_info": extra}]}))
        row = next(x for x in report(path).splitlines() if x.startswith("qwen3-29m float32 1t"))
        assert row.endswith(f"  {verdict}"), (name, row)
