"""``tox -e bench-compare``'s verdict: the newest run's side-by-side ratios against the
committed baseline (``bench/baselines/ratios.json``).

Usage: ``python bench/compare.py [RUN.json | DIR] [--baseline FILE] [--tolerance F]``
(default run: the newest saved one, as ``bench/report.py`` finds it), or
``python bench/compare.py RUN.json --write-baseline`` to write that run's ratios into the
baseline (replacing those it measured, keeping the others: a bench-vllm run adds the vLLM
ones), with this machine's CPU model and CPU count, keeping the stated tolerances.

A ratio regresses when it falls more than its tolerance below the baseline:
``ratio < baseline * (1 - tolerance)``. Ratios above the baseline never fail (an
improvement is a reason to raise the baseline, by hand). The tolerance is the baseline's
``tolerance`` (a default) and ``tolerances`` (per name prefix, the longest matching prefix
wins); ``--tolerance`` overrides both. A baseline ratio the run did not measure is listed
as "not run" (the vLLM ones outside ``tox -e bench-vllm``); a run that measured none of
the baseline's ratios fails, since nothing was checked. Exit status: 0 pass, 1 regression
or nothing compared, 2 no run or no baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ratios import machine, tracked_ratios
from bench.report import newest_run

BASELINE = Path(__file__).resolve().parent / "baselines" / "ratios.json"


def tolerance_for(name: str, baseline: dict[str, Any], override: float | None) -> float:
    """The tolerance that applies to ``name``: the override, else the longest matching
    prefix in ``tolerances``, else the default ``tolerance``."""
    if override is not None:
        return override
    prefixes = [p for p in baseline.get("tolerances", {}) if name.startswith(p)]
    if prefixes:
        return float(baseline["tolerances"][max(prefixes, key=len)])
    return float(baseline["tolerance"])


def compare(
    ratios: dict[str, float], baseline: dict[str, Any], override: float | None = None
) -> tuple[bool, list[str]]:
    """``(passed, report lines)`` for a run's ratios against a baseline."""
    lines = [f"{'ratio':<44}{'baseline':>9}{'run':>9}{'change':>9}{'floor':>9}  verdict"]
    lines.append("-" * len(lines[0]))
    compared, failed = 0, 0
    for name, base in sorted(baseline["ratios"].items()):
        tol = tolerance_for(name, baseline, override)
        floor = base * (1.0 - tol)
        if name not in ratios:
            lines.append(f"{name:<44}{base:>9.3f}{'-':>9}{'':>9}{floor:>9.3f}  not run")
            continue
        got = ratios[name]
        compared += 1
        ok = got >= floor
        failed += not ok
        verdict = "pass" if ok else f"REGRESSION (more than {tol:.0%} below)"
        lines.append(
            f"{name:<44}{base:>9.3f}{got:>9.3f}{got / base - 1:>+9.1%}{floor:>9.3f}  {verdict}"
        )
    new = sorted(set(ratios) - set(baseline["ratios"]))
    if new:
        lines.append(f"not in the baseline (not checked): {', '.join(new)}")
    if compared == 0:
        lines.append("FAIL: the run measured none of the baseline's ratios")
        return False, lines
    lines.append(f"{compared} compared, {failed} regressed")
    return failed == 0, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", type=Path, help="a saved run, or a folder of them")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--tolerance", type=float, default=None)
    parser.add_argument("--write-baseline", action="store_true")
    args = parser.parse_args(argv)
    path = newest_run(args.run)
    if path is None:
        print("no saved pytest-benchmark run found (run pytest bench --benchmark-autosave)")
        return 2
    run = json.loads(path.read_text())
    ratios = tracked_ratios(run)
    slowed = run.get("machine_info", {}).get("slowed_allocator")
    if slowed:
        print(f"note: this run had bench.slowed_allocator loaded (extra {slowed} per block)")
    here = machine()
    if args.write_baseline:
        old = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
        sources = {**old.get("source_runs", {}), path.name: sorted(ratios)}
        new = {
            "note": old.get("note", ""),
            "tolerance": old.get("tolerance", 0.2),
            "tolerances": old.get("tolerances", {}),
            "machine": here,
            "source_runs": sources,
            "ratios": dict(sorted({**old.get("ratios", {}), **ratios}.items())),
        }
        args.baseline.parent.mkdir(parents=True, exist_ok=True)
        args.baseline.write_text(json.dumps(new, indent=2) + "\n")
        print(f"wrote {len(ratios)} ratios from {path} to {args.baseline}")
        return 0
    if not args.baseline.exists():
        print(f"no baseline at {args.baseline} (write one with --write-baseline)")
        return 2
    baseline = json.loads(args.baseline.read_text())
    print(f"run {path}\nbaseline {args.baseline}: {baseline.get('machine')}")
    if baseline.get("machine") != here:
        print(f"note: this machine is {here}; the ratios are meant to carry over, but check")
    passed, lines = compare(ratios, baseline, args.tolerance)
    print("\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
