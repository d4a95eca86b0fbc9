"""Mutation testing with mutmut, and the score of each mutated file.

Usage: ``python scripts/mutation.py [--max-children N] [--report-only] [--survivors]
[--rerun] [--sample N [--seed S]] [GLOB...]`` (``tox -e mutation --
'paged_engine.engine.indexing*'``), and ``python scripts/mutation.py --recheck PATTERN
TEST... [--timeout S]``.

mutmut 3 (configured in pyproject.toml's ``[tool.mutmut]``) mutates every function of
paged_engine/engine/, spec/ and the sampler, records which of the selected fast tests call
each function, and runs only those against each of its mutants, under the deterministic
``mutation`` Hypothesis profile (tests/conftest.py) without its shrink phase
(scripts/mutation_plugin.py says why the verdicts are the same). Results accumulate in
mutants/, so a long run can be done in parts: GLOB narrows it to mutant names
(``paged_engine.engine.scheduler*``, ``spec.*``), and this passes mutmut the names of the
matching mutants not run yet (mutmut itself, given a glob, reruns every mutant it matches,
decided ones too: ``--rerun`` asks for that). A mutant whose function changed is not run
again until a run reaches it.

``--sample N --seed S`` runs N more randomly drawn not-yet-run mutants of each file with a
matching one (scripts/mutation_sample.py: the draws are recorded in mutants/sample.json,
and an unfinished file that was sampled shows an estimated score with its 95% interval).

``--recheck PATTERN TEST...`` is the second pass (scripts/mutation_recheck.py): every
survivor (and "no tests" mutant) whose name matches PATTERN (fnmatch) runs against TEST...
(pytest arguments: kill tests written since the run, tests/test_validation.py, the slower
files outside the fast selection); a mutant some TEST fails on (pytest exit 1, or past
``--timeout``) is recorded in mutants/recheck.json and counted as "killed later" from then
on (a rerun of mutmut that decides the mutant again takes precedence). For example,
``python scripts/mutation.py --recheck 'paged_engine.engine.*' tests/kills
tests/test_validation.py``.

Kill tests go under tests/kills/: the selection names the directory, so a new file there
does not change mutmut's configuration (a changed test selection resets every verdict).

After the run this prints, per file: mutants, killed (some selected test failed), killed
later (by the recheck), timeouts, survived (every selected test passed), no tests (no
selected test calls the function: an untested function), not yet run, and the score:
(killed + killed later + timeouts) / decided mutants, where "no tests" counts as not
killed; exact where every mutant is decided, estimated where the file was sampled, and
marked partial otherwise. ``--survivors`` lists the surviving mutants (``mutmut show
NAME`` prints each diff; ``mutmut results`` lists them too).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mutation_recheck import recheck
from mutation_sample import Estimate, draw, estimate, read_samples, write_samples

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
SCRIPTS = ROOT / "scripts"

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
SAMPLES = MUTANTS / "sample.json"


@dataclass(slots=True, frozen=True)
class FileScore:
    """One mutated file's verdict counts, and its estimate where it was sampled."""

    path: str
    counts: dict[str, int]
    estimate: Estimate | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def decided(self) -> int:
        return self.total - self.counts["not run"]

    @property
    def score(self) -> float | None:
        """(killed + killed later + timeout) / decided mutants; None while none is."""
        caught = self.counts["killed"] + self.counts["killed later"] + self.counts["timeout"]
        return None if self.decided == 0 else caught / self.decided

    def score_cell(self) -> str:
        """The score, said as what it is: exact (every mutant decided), estimated from a
        random sample (with its 95% interval), or partial (not a sample: mutmut runs the
        fastest-looking mutants first, so the rest may score otherwise)."""
        if self.score is None:
            return "-"
        if self.decided == self.total:
            return f"{100 * self.score:.0f}%"
        e = self.estimate
        if e is not None:
            # Drawn mutants not run yet (an interrupted run) make the sample less random.
            waiting = e.drawn - e.drawn_decided
            late = f", {waiting} drawn not run yet" if waiting else ""
            return (
                f"~{100 * e.score:.0f}% (95% CI {100 * e.low:.0f}-{100 * e.high:.0f}%; "
                f"sample of {e.drawn_decided} from {e.population} not run before{late})"
            )
        return f"{100 * self.score:.0f}% of {self.decided} decided (partial)"


def verdict(exit_code: int | None) -> str:
    name = VERDICTS.get(exit_code, "other")
    return name if name in COLUMNS else "other"


def read_verdicts(mutants: Path = MUTANTS) -> dict[str, dict[str, str]]:
    """file -> mutant name -> verdict, the recheck's kills applied."""
    recheck_file = mutants / RECHECK.name
    rechecked = json.loads(recheck_file.read_text()) if recheck_file.exists() else {}
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
    """Each mutated file's counts (and estimate), and the names of the surviving mutants."""
    samples = read_samples(mutants / SAMPLES.name)
    scores: list[FileScore] = []
    survivors: list[str] = []
    for path, verdicts in read_verdicts(mutants).items():
        counts = Counter({column: 0 for column in COLUMNS})
        for name, v in verdicts.items():
            counts[v] += 1
            if v == "survived":
                survivors.append(name)
        sample = samples.get(path)
        guess = None if sample is None else estimate(verdicts, sample)
        scores.append(FileScore(path, dict(counts), guess))
    return scores, survivors


def table(scores: list[FileScore]) -> str:
    """A Markdown table: one row per file, and the total (over decided mutants only)."""
    head = "| file | mutants | " + " | ".join(COLUMNS) + " | score |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    totals = Counter({column: 0 for column in COLUMNS})
    for s in scores:
        totals.update(s.counts)
        rows.append(_row(f"`{s.path}`", s))
    rows.append(_row("**all**", FileScore("all", dict(totals))))
    return "\n".join(rows)


def _row(label: str, s: FileScore) -> str:
    cells = " | ".join(str(s.counts[c]) for c in COLUMNS)
    return f"| {label} | {s.total} | {cells} | {s.score_cell()} |"


def survivors_matching(pattern: str, mutants: Path = MUTANTS) -> list[str]:
    """The survivors (and "no tests" mutants) whose names match ``pattern`` (fnmatch)."""
    return [
        name
        for verdicts in read_verdicts(mutants).values()
        for name, v in verdicts.items()
        if v in ("survived", "no tests") and fnmatch.fnmatch(name, pattern)
    ]


def mutmut_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment for ``mutmut run``: the ``mutation`` Hypothesis profile, and
    scripts/mutation_plugin.py loaded into every pytest session (no shrinking; its
    docstring says why the verdicts cannot change)."""
    env = dict(base, HYPOTHESIS_PROFILE="mutation")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), env.get("PYTHONPATH")]))
    addopts = [env.get("PYTEST_ADDOPTS"), "-p mutation_plugin"]
    env["PYTEST_ADDOPTS"] = " ".join(filter(None, addopts))
    return env


def sync_extensions(root: Path = ROOT, mutants: Path = MUTANTS) -> list[Path]:
    """Copy each compiled extension (``paged_engine/*.so``) that mutants/ lacks or holds an
    older build of; returns the copied ones. mutmut copies a non-Python file only when
    mutants/ does not have it yet, so a kernel rebuilt since the first run would otherwise
    meet the new Python wrapper there and fail the clean run (or, worse, pass it)."""
    copied = []
    for so in sorted((root / "paged_engine").rglob("*.so")):
        target = mutants / so.relative_to(root)
        if target.exists() and target.read_bytes() == so.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
        copied.append(target)
    return copied


def not_run(verdicts: dict[str, dict[str, str]], globs: list[str]) -> dict[str, list[str]]:
    """file -> its not-yet-run mutants whose names match a glob (files with none left out).
    Given names or globs, ``mutmut run`` reruns every mutant they match, decided ones too;
    given these names, only the rest."""
    out: dict[str, list[str]] = {}
    for path, names in verdicts.items():
        match = [
            name
            for name, v in names.items()
            if v == "not run" and any(fnmatch.fnmatch(name, g) for g in globs)
        ]
        if match:
            out[path] = match
    return out


def to_run(globs: list[str], sample: int | None, seed: int, mutants: Path = MUTANTS) -> list[str]:
    """The mutants a run of ``globs`` should try: every not-yet-run match, or with ``sample``
    that many more of each file's, drawn at random (recorded in mutants/sample.json)."""
    waiting = not_run(read_verdicts(mutants), globs)
    if sample is None:
        return [name for names in waiting.values() for name in names]
    samples = read_samples(mutants / SAMPLES.name)
    names = draw(samples, waiting, sample, seed)
    write_samples(mutants / SAMPLES.name, samples)
    return names


def run_mutmut(names: list[str], max_children: int) -> int:
    """``mutmut run`` on ``names`` (all not-yet-run mutants when empty); its exit status."""
    for copied in sync_extensions():
        print(f"copied {copied.relative_to(ROOT)} (rebuilt since mutants/ was made)")
    mutmut = Path(sys.executable).parent / "mutmut"
    cmd = [str(mutmut), "run", "--max-children", str(max_children), *names]
    return subprocess.run(cmd, cwd=ROOT, env=mutmut_env(os.environ)).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("globs", nargs="*", help="mutant name patterns (mutmut run's)")
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutants")
    parser.add_argument("--report-only", action="store_true", help="only print the scores")
    parser.add_argument("--rerun", action="store_true", help="rerun decided mutants too")
    parser.add_argument("--sample", type=int, metavar="N", help="N random mutants per file")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--survivors", action="store_true", help="list surviving mutants")
    parser.add_argument("--recheck", metavar="PATTERN", help="rerun these survivors on GLOBs")
    parser.add_argument("--timeout", type=float, default=300.0, help="recheck s per mutant")
    args = parser.parse_args(argv)
    if args.max_children < 1:
        parser.error(f"--max-children must be at least 1, got {args.max_children}")
    if args.sample is not None and (args.sample < 1 or args.rerun):
        parser.error(f"--sample takes N >= 1 (got {args.sample}) of mutants not run yet")
    if args.recheck is not None:
        if not args.globs:
            parser.error("--recheck needs the tests to run (pytest arguments)")
        os.environ["HYPOTHESIS_PROFILE"] = "mutation"
        names = survivors_matching(args.recheck)
        if not names:
            print(f"recheck: no survivor matches {args.recheck!r}")
        killed = recheck(names, args.globs, args.timeout, ROOT, MUTANTS) if names else 0
        print(f"recheck: {killed} killed")
        args.report_only = True

    status = 0
    if not args.report_only:
        names = args.globs
        if args.sample is not None or (args.globs and not args.rerun):
            names = to_run(args.globs or ["*"], args.sample, args.seed)
        if (args.globs or args.sample is not None) and not names:
            print(f"nothing left to run in {args.globs}")
        else:
            status = run_mutmut(names, args.max_children)
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
