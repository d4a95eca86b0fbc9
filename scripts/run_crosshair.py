"""The CrossHair layer of tox env ``spec``: check the spec's contracts, diff the helpers.

Usage: ``python scripts/run_crosshair.py [--jobs N] [--scale F] [--thorough] [--only S] [-v]``

Two kinds of job, each one CrossHair process:

* ``crosshair check --analysis_kind=PEP316 --report_all --per_condition_timeout=T TARGET...``
  over the spec's contracts: ``spec.indexing`` (block counts, R7, slot mapping),
  ``spec.hashing.simple_block_hash``, and the bounded allocator scenarios of
  ``spec.crosshair_targets`` (``BlockManager``'s method contracts and R3-R12, restated
  over short scripted traffic).
* ``crosshair diffbehavior --per_condition_timeout=T ENGINE SPEC`` for each index helper,
  through the domain guards of ``spec.diff_targets`` (diffbehavior ignores ``pre:``): the
  spec's wrappers there, the engine's in ``tests.test_spec_diff_targets`` (the spec
  imports nothing from the engine).

CrossHair exits 0 both when it checked everything and when it checked nothing (no
checkable function, every path ignored, preconditions never met), so an exit status is
not a verdict. Each CrossHair process therefore runs inside this script
(``--probe``: CrossHair's own ``main`` with the same arguments, plus two counters), which
counts, per condition, the paths on which the postcondition was actually evaluated and
held, and, per diffed function, the calls that returned a value on the domain. A job
fails on any counterexample or error, on a ``post:``/``inv:`` line of a target that
CrossHair did not report, on a condition checked on fewer than ``min_paths`` paths, on a
diff with too few in-domain comparisons, and where a condition or diff that CrossHair
has always proved (``must_confirm``, ``must_exhaust``) is no longer proved.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROBE_MARK = "@@run_crosshair-probe@@ "

# A line of ``crosshair check`` output; anything else continues the previous message.
_REPORT_RE = re.compile(
    r"^(?P<file>/?[^:\n]+\.py):(?P<line>\d+): (?P<kind>info|error): (?P<msg>.*)$"
)
_CONDITION_RE = re.compile(r"^\s*(post|inv)(\[[^\]]*\])?\s*:")
_NO_DIFF_RE = re.compile(r"No differences found\. \(attempted (\d+) iterations\)")


# ---- the jobs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckJob:
    """One ``crosshair check`` process over ``targets`` (modules, functions, methods)."""

    name: str
    targets: tuple[str, ...]
    per_condition_timeout: float
    # Functions (qualified names) whose every condition CrossHair must confirm over all
    # paths, not merely check: it does so in well under a second today, so losing it means
    # the contract or the helper changed shape.
    must_confirm: tuple[str, ...] = ()
    min_paths: int = 5


@dataclass(frozen=True, slots=True)
class DiffJob:
    """One ``crosshair diffbehavior`` process: ``fn1`` (engine) against ``fn2`` (spec)."""

    name: str
    fn1: str
    fn2: str
    per_condition_timeout: float
    must_exhaust: bool = False
    min_paths: int = 5


_CT = "spec.crosshair_targets"
_DT = "spec.diff_targets"
_ET = "tests.test_spec_diff_targets"  # the engine's wrappers, behind the same guards
# (helper, must CrossHair exhaust every path?) The counting helpers are proved equal in a
# few iterations; slot_mapping loops over a symbolic range, so it is searched, not proved.
DIFF_PAIRS: tuple[tuple[str, bool], ...] = (
    ("num_blocks", True),
    ("last_block_num_tokens", True),
    ("needs_new_block", True),
    ("slot_mapping", False),
)

_BM = "spec.block_manager.BlockManager"
# Method contracts checked one by one (--thorough only). CrossHair builds the receiver
# through __init__, so these start from an empty pool, where deallocate's precondition
# (the table holds blocks in use) admits only an empty table, i.e. misuse: its contract
# is checked by the scenarios instead, which restate it after every release.
THOROUGH_METHODS: tuple[str, ...] = (
    "__init__",
    "can_allocate",
    "allocate",
    "can_append",
    "may_append",
    "hash_blocks",
    "check_invariants",
)


def default_jobs(scale: float = 1.0, thorough: bool = False) -> list[CheckJob | DiffJob]:
    """The CI plan, longest job first. Timeouts are CPU seconds per condition (CrossHair
    splits a diff's between its two orderings); the default totals about 90 CPU seconds,
    under a minute of wall time on two idle cores."""
    jobs: list[CheckJob | DiffJob] = [
        # prefill_then_decode's 288 paths take about 15 CPU seconds to exhaust (a proof
        # over its bounded domain); share_prefix's 10,800 inputs are searched, not proved.
        CheckJob("scenario share_prefix", (f"{_CT}.share_prefix",), 25 * scale),
        CheckJob("scenario prefill_then_decode", (f"{_CT}.prefill_then_decode",), 30 * scale),
        CheckJob(
            "index helpers",
            ("spec.indexing", "spec.hashing.simple_block_hash"),
            5 * scale,
            must_confirm=(
                "spec.indexing.num_blocks",
                "spec.indexing.last_block_num_tokens",
                "spec.indexing.needs_new_block",
            ),
        ),
    ]
    for helper, exhaust in DIFF_PAIRS:
        jobs.append(
            DiffJob(
                f"diff {helper}",
                f"{_ET}.{helper}_engine",
                f"{_DT}.{helper}_spec",
                (10 if exhaust else 16) * scale,
                must_exhaust=exhaust,
            )
        )
    if thorough:
        targets = tuple(f"{_BM}.{m}" for m in THOROUGH_METHODS)
        jobs.insert(0, CheckJob("BlockManager methods", targets, 3 * scale))
    jobs.sort(key=_expected_cost, reverse=True)
    return jobs


def _expected_cost(job: CheckJob | DiffJob) -> float:
    """A rough CPU-second estimate, to start the longest jobs first."""
    if isinstance(job, DiffJob):
        return 1.0 if job.must_exhaust else job.per_condition_timeout
    if job.name == "index helpers":
        return 4 * job.per_condition_timeout  # the slot_mapping conditions and the hash
    return job.per_condition_timeout * len(job.targets)


# ---- the probe: CrossHair's own main, plus path counters --------------------------------


def probe(argv: list[str]) -> int:
    """Run ``crosshair <argv>`` in this process, counting what it actually analysed.

    Hooks two CrossHair 0.0.113 internals; if they are missing, fail loudly rather than
    report nothing. ``attempt_call`` runs one path of one condition: its result says
    whether the postcondition held (CONFIRMED), failed (REFUTED), was cut short (UNKNOWN)
    or the path was ignored (None: a precondition failed, or CrossHair gave up on it).
    ``describe_behavior`` runs one side of one diffbehavior path. The counts go to stderr
    as one JSON line: CrossHair's audit wall forbids opening files once it is engaged.
    """
    import crosshair.core as ch_core
    import crosshair.diff_behavior as ch_diff
    import crosshair.main as ch_main

    for module, attr in ((ch_core, "attempt_call"), (ch_diff, "describe_behavior")):
        if not callable(getattr(module, attr, None)):
            print(f"run_crosshair: {module.__name__}.{attr} is gone", file=sys.stderr)
            return 3
    conditions: dict[str, int] = {}
    calls: dict[str, int] = {}
    attempt_call = ch_core.attempt_call
    describe_behavior = ch_diff.describe_behavior

    def counted_attempt_call(conds: Any, *args: Any, **kwargs: Any) -> Any:
        analysis = attempt_call(conds, *args, **kwargs)
        post = conds.post[0]
        status = analysis.verification_status
        key = f"{post.filename}:{post.line}:{status.name if status else 'IGNORED'}"
        conditions[key] = conditions.get(key, 0) + 1
        return analysis

    def counted_describe_behavior(fn: Callable[..., object], args: Any) -> Any:
        ret, exc = describe_behavior(fn, args)
        outcome = "raised" if exc is not None else "none" if ret is None else "value"
        key = f"{getattr(fn, '__qualname__', fn)}:{outcome}"
        calls[key] = calls.get(key, 0) + 1
        return ret, exc

    # setattr: plain assignment would make mypy demand the internals' exact signatures.
    setattr(ch_core, "attempt_call", counted_attempt_call)  # noqa: B010
    setattr(ch_diff, "describe_behavior", counted_describe_behavior)  # noqa: B010
    code: object = 0
    try:
        ch_main.main(argv)
    except SystemExit as stop:
        code = stop.code
    finally:
        payload = {"conditions": conditions, "calls": calls}
        print(PROBE_MARK + json.dumps(payload), file=sys.stderr, flush=True)
    return code if isinstance(code, int) else 2


@dataclass(slots=True)
class Run:
    """A finished CrossHair process: its exit status, output and probe counts."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    conditions: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    probed: bool = False


def run_crosshair(argv: list[str], wall_limit: float | None = None) -> Run:
    """``crosshair <argv>`` through the probe, in a child process rooted at the repo."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", *argv]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=wall_limit
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as late:
        rc, out = 124, _text(late.stdout)
        err = _text(late.stderr) + f"\nrun_crosshair: killed after {wall_limit} s wall\n"
    run = Run(argv, rc, out, "", time.monotonic() - start)
    kept = []
    for line in err.splitlines():
        if line.startswith(PROBE_MARK):
            payload = json.loads(line[len(PROBE_MARK) :])
            run.conditions, run.calls, run.probed = payload["conditions"], payload["calls"], True
        else:
            kept.append(line)
    run.stderr = "\n".join(kept)
    return run


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _wall_limit(per_condition_timeout: float, conditions: int) -> float:
    """A generous wall-clock backstop (the CrossHair timeouts are CPU time)."""
    return 120 + 4 * per_condition_timeout * conditions


# ---- check: expected conditions, report parsing, verdicts -------------------------------


@dataclass(slots=True)
class Condition:
    """One condition (a ``post:`` or ``inv:`` line) and what became of it."""

    file: str
    line: int
    owner: str
    expr: str
    state: str = "missing"  # confirmed | unconfirmed | pre_unsat | error | missing | other
    message: str = ""
    held: int = 0  # paths on which it was evaluated and held
    refuted: int = 0
    unknown: int = 0
    ignored: int = 0


@dataclass(slots=True)
class Row:
    """One line of the summary table."""

    target: str
    kind: str
    conditions: int = 0
    confirmed: int = 0
    checked: int = 0
    counterexamples: int = 0
    paths: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class JobResult:
    """What one job found: its rows, the CrossHair run, its failures."""

    name: str
    command: str
    rows: list[Row]
    run: Run
    problems: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.rows)


def _owners(path: Path, module: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and class in a file."""
    tree = ast.parse(path.read_text(), str(path))
    spans: list[tuple[int, int, str]] = []

    def walk(nodes: Iterable[ast.stmt], prefix: str) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{node.name}"
                spans.append((node.lineno, node.end_lineno or node.lineno, name))
                if isinstance(node, ast.ClassDef):
                    walk(node.body, name)

    walk(tree.body, module)
    return spans


def _owner_of(spans: list[tuple[int, int, str]], line: int) -> str | None:
    """The innermost function or class whose span holds ``line``."""
    best: tuple[int, int, str] | None = None
    for span in spans:
        if span[0] <= line <= span[1] and (best is None or span[0] >= best[0]):
            best = span
    return best[2] if best else None


def resolve_target(target: str) -> tuple[Path, str, str]:
    """``(file, module, qualified name)`` for a module, function, class or method name."""
    if str(ROOT) not in sys.path:  # run as a script, sys.path[0] is scripts/
        sys.path.insert(0, str(ROOT))
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.origin and found.origin.endswith(".py"):
            return Path(found.origin).resolve(), module, target
    raise ValueError(f"cannot find the module of CrossHair target {target!r}")


def expected_conditions(target: str) -> list[Condition]:
    """Every ``post:``/``inv:`` line CrossHair must report for ``target``.

    A whole module: the conditions of all its functions and classes. A class or a method:
    its own lines plus the class's ``inv:`` lines, which CrossHair checks after every
    public method. Conditions are found textually in the source, independently of
    CrossHair's parser, so a contract it silently skips shows up as missing.
    """
    path, module, qualname = resolve_target(target)
    lines = path.read_text().splitlines()
    spans = _owners(path, module)
    if qualname == module:
        scan = [(1, len(lines))]
        parent = None
    else:
        scan = [(first, last) for first, last, name in spans if name == qualname]
        if not scan:
            raise ValueError(f"no function or class {qualname!r} in {path}")
        parent = qualname.rsplit(".", 1)[0]
        scan += [(first, last) for first, last, name in spans if name == parent]
    found: dict[int, Condition] = {}
    for first, last in scan:
        for number in range(first, last + 1):
            match = _CONDITION_RE.match(lines[number - 1])
            owner = _owner_of(spans, number) or module
            if not match or (owner == parent and match.group(1) != "inv"):
                continue  # outside a contract, or another method of the method's class
            mine = owner == qualname or owner.startswith(qualname + ".")
            if not mine and owner != parent:
                continue
            expr = lines[number - 1].split(":", 1)[1].strip()
            found[number] = Condition(str(path), number, owner, expr)
    return [found[n] for n in sorted(found)]


def parse_check_report(stdout: str) -> list[tuple[str, int, str, str]]:
    """``(file, line, info|error, message)`` for each message of ``crosshair check``;
    lines that do not start a message continue the previous one."""
    messages: list[list[str | int]] = []
    for text in stdout.splitlines():
        match = _REPORT_RE.match(text)
        if match:
            messages.append([match["file"], int(match["line"]), match["kind"], match["msg"]])
        elif messages:
            messages[-1][3] = f"{messages[-1][3]}\n{text}"
    return [(str(f), int(n), str(k), str(m)) for f, n, k, m in messages]


def _classify(kind: str, message: str) -> str:
    if kind == "error":
        return "error"
    if message.startswith("Confirmed over all paths"):
        return "confirmed"
    if message.startswith("Not confirmed"):
        return "unconfirmed"
    if message.startswith("Unable to meet precondition"):
        return "pre_unsat"
    return "other"


def check_command(job: CheckJob) -> list[str]:
    """The ``crosshair`` arguments of a check job."""
    return [
        "check",
        "--analysis_kind=PEP316",
        "--report_all",
        f"--per_condition_timeout={job.per_condition_timeout:g}",
        *job.targets,
    ]


def run_check(job: CheckJob) -> JobResult:
    """Run one check job and judge every condition of its targets."""
    expected: dict[tuple[str, int], Condition] = {}
    for target in job.targets:
        for cond in expected_conditions(target):
            expected.setdefault((cond.file, cond.line), cond)
    argv = check_command(job)
    run = run_crosshair(argv, _wall_limit(job.per_condition_timeout, len(expected)))
    result = JobResult(job.name, "crosshair " + " ".join(argv), [], run)
    if not run.probed:
        result.problems.append("the probe reported nothing (CrossHair crashed?)")
    if run.returncode not in (0, 1):
        result.problems.append(f"crosshair exited {run.returncode}")
    if "contain no checkable functions" in run.stderr:
        result.problems.append("CrossHair found no checkable function")

    conds = dict(expected)
    for file, line, kind, message in parse_check_report(run.stdout):
        path = Path(file).resolve()
        reported = conds.get((str(path), line))
        if reported is None:  # a condition we did not expect: judge it all the same
            module = _module_for(path)
            owner = _owner_of(_owners(path, module), line) or module
            source = path.read_text().splitlines()[line - 1].strip()
            reported = conds[(str(path), line)] = Condition(str(path), line, owner, source)
        reported.state, reported.message = _classify(kind, message), message
    for counted, count in run.conditions.items():
        file, line_text, status = counted.rsplit(":", 2)
        probed = conds.get((str(Path(file).resolve()), int(line_text)))
        if probed is None:
            continue
        if status == "CONFIRMED":
            probed.held += count
        elif status == "REFUTED":
            probed.refuted += count
        elif status == "UNKNOWN":
            probed.unknown += count
        else:
            probed.ignored += count

    rows: dict[str, Row] = {}
    for cond in sorted(conds.values(), key=lambda c: (c.file, c.line)):
        row = rows.setdefault(cond.owner, Row(cond.owner, "check"))
        row.conditions += 1
        row.paths += cond.held
        where = f"{Path(cond.file).name}:{cond.line} ({cond.expr})"
        must_confirm = cond.owner in job.must_confirm
        if cond.state == "error" or cond.refuted:
            row.counterexamples += 1
            row.problems.append(f"counterexample or error at {where}: {cond.message}")
        elif cond.state == "missing":
            row.problems.append(f"not reported by CrossHair: {where}")
        elif cond.state == "other":
            row.problems.append(f"unexpected report at {where}: {cond.message}")
        elif cond.state == "confirmed" and cond.held:
            row.confirmed += 1
        elif must_confirm:
            row.problems.append(f"no longer confirmed over all paths: {where}")
        elif cond.held >= job.min_paths:
            # "Not confirmed", or a precondition CrossHair could not meet in one method
            # while the same (invariant) line held on enough paths in others.
            row.checked += 1
        else:
            row.problems.append(
                f"checked on only {cond.held} path(s) (< {job.min_paths}) at {where}: "
                f"{cond.message or cond.state}"
            )
    result.rows = list(rows.values())
    if not result.rows:
        result.problems.append("no condition found in the targets")
    if result.rows:
        result.rows[0].seconds = run.seconds  # one process for all the job's rows
    return result


def _module_for(path: Path) -> str:
    """The dotted module name of a file under the repository root."""
    try:
        rel = path.relative_to(ROOT)
    except ValueError:
        return path.stem
    return ".".join(rel.with_suffix("").parts)


# ---- diffbehavior -----------------------------------------------------------------------


def diff_command(job: DiffJob) -> list[str]:
    """The ``crosshair`` arguments of a diff job."""
    return [
        "diffbehavior",
        f"--per_condition_timeout={job.per_condition_timeout:g}",
        job.fn1,
        job.fn2,
    ]


def run_diff(job: DiffJob) -> JobResult:
    """Run one diffbehavior job: fail on a difference, an error, or too little compared."""
    argv = diff_command(job)
    run = run_crosshair(argv, _wall_limit(job.per_condition_timeout, 1))
    result = JobResult(job.name, "crosshair " + " ".join(argv), [], run)
    row = Row(job.name, "diff", conditions=1, seconds=run.seconds)
    result.rows.append(row)
    fn1, fn2 = job.fn1.rsplit(".", 1)[1], job.fn2.rsplit(".", 1)[1]
    valued = [run.calls.get(f"{fn}:value", 0) for fn in (fn1, fn2)]
    row.paths = min(valued)
    raised = sum(run.calls.get(f"{fn}:raised", 0) for fn in (fn1, fn2))
    no_diff = _NO_DIFF_RE.search(run.stdout)
    exhausted = "All paths exhausted" in run.stdout
    if not run.probed:
        row.problems.append("the probe reported nothing (CrossHair crashed?)")
    if run.returncode == 1 or "Given:" in run.stdout:
        row.counterexamples = run.stdout.count("Given:")
        row.problems.append("behaviours differ:\n" + run.stdout.strip())
    elif run.returncode != 0 or no_diff is None:
        row.problems.append(f"crosshair exited {run.returncode}: {run.stderr.strip()[-400:]}")
    elif row.paths < (1 if exhausted else job.min_paths):
        # An exhausted search is a proof however few paths it took, but it must have
        # compared something on the domain; a bounded search must have compared enough.
        row.problems.append(
            f"only {row.paths} in-domain comparison(s) (< {job.min_paths}); calls: {run.calls}"
        )
    elif job.must_exhaust and not exhausted:
        row.problems.append("paths no longer exhausted (was a proof, now only a search)")
    elif exhausted:
        row.confirmed = 1
    else:
        row.checked = 1
    if no_diff is not None:
        result.details.append(
            f"{no_diff.group(1)} iterations, {row.paths} compared on the domain, "
            f"{raised} raising call(s), {'exhausted' if exhausted else 'not exhausted'}"
        )
    return result


# ---- main -------------------------------------------------------------------------------


def run_job(job: CheckJob | DiffJob) -> JobResult:
    return run_check(job) if isinstance(job, CheckJob) else run_diff(job)


def print_summary(results: list[JobResult], wall: float, out: Callable[[str], None]) -> None:
    """The summary table: for check rows, conditions confirmed over all paths and
    conditions checked without counterexample (with the paths they held on); for diff
    rows, 'confirmed' means every path was exhausted and 'checked' a bounded search."""
    header = ("target", "kind", "conds", "confirmed", "checked", "cex", "paths", "time", "ok")
    rows = [r for res in results for r in res.rows]
    table = [header] + [
        (
            r.target,
            r.kind,
            str(r.conditions),
            str(r.confirmed),
            str(r.checked),
            str(r.counterexamples),
            str(r.paths),
            f"{r.seconds:.0f}s" if r.seconds else "",
            "ok" if r.ok else "FAIL",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for n, line in enumerate(table):
        out("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            out("  ".join("-" * w for w in widths))
    confirmed = sum(r.confirmed for r in rows if r.kind == "check")
    checked = sum(r.checked for r in rows if r.kind == "check")
    out(
        f"conditions: {confirmed} confirmed over all paths, {checked} checked without "
        f"counterexample; diffs: {sum(r.confirmed for r in rows if r.kind == 'diff')} "
        f"exhausted, {sum(r.checked for r in rows if r.kind == 'diff')} searched; "
        f"wall {wall:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--probe"]:
        return probe(args[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="CrossHair processes at once")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every timeout")
    parser.add_argument(
        "--thorough",
        action="store_true",
        help="also check BlockManager's methods one by one (from an empty pool; several minutes)",
    )
    parser.add_argument("--only", default="", help="run the jobs whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true", help="print CrossHair output")
    opts = parser.parse_args(args)
    jobs = [j for j in default_jobs(opts.scale, opts.thorough) if opts.only in j.name]
    if not jobs:
        print(f"no job matches --only {opts.only!r}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        results = list(pool.map(run_job, jobs))
    wall = time.monotonic() - start
    for res in results:
        status = "ok" if res.ok else "FAIL"
        print(f"[{status}] {res.name} ({res.run.seconds:.0f} s): {res.command}")
        for detail in res.details:
            print(f"    {detail}")
        for problem in res.problems + [p for r in res.rows for p in r.problems]:
            print("    " + problem.replace("\n", "\n    "))
        if opts.verbose or not res.ok:
            for text in (res.run.stdout.strip(), res.run.stderr.strip()):
                if text:
                    print("    | " + text.replace("\n", "\n    | "))
    print()
    print_summary(results, wall, print)
    failed = [res.name for res in results if not res.ok]
    if failed:
        print(f"CrossHair layer FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
