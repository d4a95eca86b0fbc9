"""``scripts/mutation.py --recheck``: survivors rerun against more tests, one fork each.

mutmut runs each mutant against the tests of its own selection only; this runs the
survivors against others (kill tests written since, tests/test_validation.py, slow files),
forked from one process that has already imported them, and records each verdict in
mutants/recheck.json, which scripts/mutation.py's table reads as "killed later".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path


def recheck(names: list[str], tests: list[str], timeout: float, root: Path, mutants: Path) -> int:
    """Run each of ``names`` against ``tests`` (pytest arguments); returns the number
    killed. Runs inside mutants/, as mutmut does, one fork per mutant."""
    # mutmut copies tests/ into mutants/ when it runs: bring tests written since then.
    shutil.copytree(root / "tests", mutants / "tests", dirs_exist_ok=True)
    os.chdir(mutants)
    sys.path.insert(0, str(mutants))
    args = ["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-m", "not gpu", *tests]
    # Imported here: a report alone needs neither.
    import mutation_plugin  # no shrinking, as under mutmut
    import pytest

    # Import the tests, conftest and torch once; each fork then only runs them.
    if pytest.main(["--collect-only", "-q", *args], plugins=[mutation_plugin]) != 0:
        print("recheck: the tests do not collect")
        return 0
    # A test that fails inside mutants/ without any mutant (a file mutmut does not copy
    # there, say) would "kill" every mutant: the unmutated code must pass first.
    clean = _run_forked("", args, timeout, pytest.main, mutation_plugin)
    if clean != 0:
        print(f"recheck: the tests fail without a mutant (exit {clean}): no verdict recorded")
        return 0
    killed = 0
    for k, name in enumerate(names, 1):
        start = time.monotonic()
        code = _run_forked(name, args, timeout, pytest.main, mutation_plugin)
        # 1: some test failed; None: past the timeout. Any other code (2 interrupted, 3
        # internal error, 4 usage error, 5 no test ran, a signal) is no verdict on the mutant.
        dead = code in (1, None)
        killed += dead
        _record(mutants / "recheck.json", name, {"tests": tests, "exit": code, "killed": dead})
        took = time.monotonic() - start
        said = "killed" if dead else f"survived (exit {code})"
        print(f"recheck {k}/{len(names)} {said} {took:.1f}s {name}")
    return killed


def _run_forked(
    mutant: str, args: list[str], timeout: float, main: Callable[..., object], plugin: object
) -> int | None:
    """pytest ``args`` in a fork with ``mutant`` active ("" for none), quiet; its exit
    status, or None past ``timeout``."""
    pid = os.fork()
    if pid == 0:  # the child: this mutant only
        os.environ["MUTANT_UNDER_TEST"] = mutant
        with open(os.devnull, "w") as quiet:
            os.dup2(quiet.fileno(), 1)
            os.dup2(quiet.fileno(), 2)
            os._exit(int(main(args, plugins=[plugin])))  # type: ignore[call-overload]
    return _wait(pid, timeout)


def _record(path: Path, name: str, result: dict[str, object]) -> None:
    """Add one verdict to mutants/recheck.json, re-read first (rechecks may run side by
    side) and replaced atomically. A kill stands: a later recheck on other tests that the
    mutant survives does not undo it."""
    results = json.loads(path.read_text()) if path.exists() else {}
    if not results.get(name, {}).get("killed"):
        results[name] = result
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(path)


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
