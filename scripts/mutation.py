"""Mutation testing with mutmut, and the score of each mutated file.

Usage: ``python scripts/mutation.py [--max-children N] [--report-only] [--survivors] [GLOB...]``
(``tox -e mutation -- 'paged_engine.engine.indexing*'``), and
``python scripts/mutation.py --recheck PATTERN TEST... [--timeout S]``.

mutmut 3 (configured in pyproject.toml's ``[tool.mutmut]``) mutates every function of
paged_engine/engine/, spec/ and the sampler, records which of the selected fast tests call
each function, and runs only those against each of its mutants, under the deterministic
``mutation`` Hypothesis profile (tests/conftest.py). Results accumulate in mutants/ (a
rerun skips mutants already decided, unless their function changed), so a long run can be
done in parts: GLOB narrows it to mutant names (``paged_engine.engine.scheduler*``,
``spec.*``), as ``mutmut run`` does.

``--recheck PATTERN TEST...`` is the second pass: every survivor (and "no tests" mutant)
whose name matches PATTERN (fnmatch) runs against TEST... (pytest arguments: kill tests
written since the run, tests/test_validation.py, the slower files outside the fast
selection), forked from one process that has already imported them; a mutant some TEST
fails on (pytest exit 1, or past ``--timeout``) is recorded in mutants/recheck.json and
counted as "killed later" from then on (a rerun of mutmut that decides the mutant again
takes precedence). For example, ``python scripts/mutation.py --recheck
'paged_engine.engine.*' tests/kills tests/test_validation.py``.

Kill tests go under tests/kills/: the selection names the directory, so a new file there
does not change mutmut's configuration (a changed test selection resets every verdict).

After the run this prints, per file: mutants, killed (some selected test failed), timeouts,
survived (every selected test passed), no tests (no selected test calls the function: an
untested function), not yet run, and the score: (killed + timeouts) / decided mutants,
where "no tests" counts as not killed. ``--survivors`` lists the surviving mutants
(``mutmut show NAME`` prints each diff; ``mutmut results`` lists them too).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"

# mutmut's exit codes per verdict (mutmut/stats.py, 3.8): the rest are "suspicious".
VERDICTS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
    None: "not run",
}
COLUMNS = ("killed", "killed later", "timeout", "survived", "no tests", "not run", "other")
RECHECK = MUTANTS / "recheck.json"


@dataclass(slots=True, frozen=True)
class FileScore:
    """One mutated file's verdict counts."""

    path: str
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def score(self) -> float | None:
        """(killed + timeout) / decided mutants; None while none is decided."""
        caught = self.counts["killed"] + self.counts["killed later"] + self.counts["timeout"]
        decided = self.total - self.counts["not run"]
        return None if decided == 0 else caught / decided


def verdict(exit_code: int | None) -> str:
    name = VERDICTS.get(exit_code, "other")
    return name if name in COLUMNS else "other"


def read_verdicts(mutants: Path = MUTANTS) -> dict[str, dict[str, str]]:
    """file -> mutant name -> verdict, the recheck's kills applied."""
    rechecked = json.loads(RECHECK.read_text()) if RECHECK.exists() else {}
    out: dict[str, dict[str, str]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        verdicts = {}
        for name, code in sorted(codes.items()):
            v = verdict(code)
            if v in ("survived", "no tests") and rechecked.get(name, {}).get("killed"):
                v = "killed later"
            verdicts[name] = v
        if verdicts:
            out[str(meta.relative_to(mutants))[: -len(".meta")]] = verdicts
    return out


def read_results(mutants: Path = MUTANTS) -> tuple[list[FileScore], list[str]]:
    """Each mutated file's counts, and the names of the surviving mutants."""
    scores: list[FileScore] = []
    survivors: list[str] = []
    for path, verdicts in read_verdicts(mutants).items():
        counts = Counter({column: 0 for column in COLUMNS})
        for name, v in verdicts.items():
            counts[v] += 1
            if v == "survived":
                survivors.append(name)
        scores.append(FileScore(path, dict(counts)))
    return scores, survivors


def table(scores: list[FileScore]) -> str:
    """A Markdown table: one row per file, and the total."""
    head = "| file | mutants | " + " | ".join(COLUMNS) + " | score |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    totals = Counter({column: 0 for column in COLUMNS})
    for s in scores:
        totals.update(s.counts)
        rows.append(_row(f"`{s.path}`", s))
    rows.append(_row("**all**", FileScore("all", dict(totals))))
    return "\n".join(rows)


def _row(label: str, s: FileScore) -> str:
    score = "-" if s.score is None else f"{100 * s.score:.0f}%"
    cells = " | ".join(str(s.counts[c]) for c in COLUMNS)
    return f"| {label} | {s.total} | {cells} | {score} |"


def recheck(pattern: str, tests: list[str], timeout: float) -> int:
    """Run the matching undecided-by-the-selection mutants against ``tests``; returns the
    number killed. Runs inside mutants/, as mutmut does, one fork per mutant."""
    names = [
        name
        for verdicts in read_verdicts().values()
        for name, v in verdicts.items()
        if v in ("survived", "no tests") and fnmatch.fnmatch(name, pattern)
    ]
    if not names:
        print(f"recheck: no survivor matches {pattern!r}")
        return 0
    # mutmut copies tests/ into mutants/ when it runs: bring tests written since then.
    shutil.copytree(ROOT / "tests", MUTANTS / "tests", dirs_exist_ok=True)
    os.chdir(MUTANTS)
    sys.path.insert(0, str(MUTANTS))
    args = ["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-m", "not gpu", *tests]
    import pytest  # imported here: only the recheck needs it in this process

    # Import the tests, conftest and torch once; each fork then only runs them.
    if pytest.main(["--collect-only", "-q", *args]) != 0:
        print("recheck: the tests do not collect")
        return 0
    killed = 0
    for k, name in enumerate(names, 1):
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: this mutant only
            os.environ["MUTANT_UNDER_TEST"] = name
            with open(os.devnull, "w") as quiet:
                os.dup2(quiet.fileno(), 1)
                os.dup2(quiet.fileno(), 2)
                os._exit(int(pytest.main(args)))
        code = _wait(pid, timeout)
        # 1: some test failed; None: past the timeout. Any other code (2 interrupted, 3
        # internal error, 4 usage error, 5 no test ran, a signal) is no verdict on the mutant.
        dead = code in (1, None)
        killed += dead
        _record(name, {"tests": tests, "exit": code, "killed": dead})
        took = time.monotonic() - start
        said = "killed" if dead else f"survived (exit {code})"
        print(f"recheck {k}/{len(names)} {said} {took:.1f}s {name}")
    return killed


def _record(name: str, result: dict[str, object]) -> None:
    """Add one verdict to mutants/recheck.json, re-read first (rechecks may run side by
    side) and replaced atomically. A kill stands: a later recheck on other tests that the
    mutant survives does not undo it."""
    results = json.loads(RECHECK.read_text()) if RECHECK.exists() else {}
    if not results.get(name, {}).get("killed"):
        results[name] = result
    tmp = RECHECK.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(RECHECK)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("globs", nargs="*", help="mutant name patterns (mutmut run's)")
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutants")
    parser.add_argument("--report-only", action="store_true", help="only print the scores")
    parser.add_argument("--survivors", action="store_true", help="list surviving mutants")
    parser.add_argument("--recheck", metavar="PATTERN", help="rerun these survivors on GLOBs")
    parser.add_argument("--timeout", type=float, default=300.0, help="recheck s per mutant")
    args = parser.parse_args(argv)
    if args.max_children < 1:
        parser.error(f"--max-children must be at least 1, got {args.max_children}")
    if args.recheck is not None:
        if not args.globs:
            parser.error("--recheck needs the tests to run (pytest arguments)")
        os.environ["HYPOTHESIS_PROFILE"] = "mutation"
        killed = recheck(args.recheck, args.globs, args.timeout)
        print(f"recheck: {killed} killed")
        args.report_only = True

    status = 0
    if not args.report_only:
        mutmut = Path(sys.executable).parent / "mutmut"
        env = dict(os.environ, HYPOTHESIS_PROFILE="mutation")
        cmd = [str(mutmut), "run", "--max-children", str(args.max_children), *args.globs]
        status = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    scores, survivors = read_results()
    if not scores:
        print("no mutation results under mutants/ yet")
        return status or 1
    print(table(scores))
    if args.survivors:
        print(f"\n{len(survivors)} surviving mutants:")
        print("\n".join(f"  {name}" for name in survivors))
    return status


if __name__ == "__main__":
    sys.exit(main())
