"""The spec imports nothing from the engine it specifies.

A reference model that borrows the engine's records (its statistics, its snapshot, its
failed-sample marker) shares their mistakes: a field defined wrongly there is wrong on
both sides of the lockstep, which then cannot see it. Two checks: every ``spec/*.py``
parsed for an import of ``paged_engine`` (static, names the file and line), and a clean
interpreter that imports every spec module and must end with no ``paged_engine`` module
loaded (dynamic: catches an import made through another module).
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import spec

ROOT = Path(__file__).resolve().parent.parent
SPEC_DIR = ROOT / "spec"
FORBIDDEN = "paged_engine"


def _spec_modules() -> list[str]:
    return sorted(f"spec.{m.name}" for m in pkgutil.iter_modules(spec.__path__))


def _is_forbidden(name: str | None) -> bool:
    return name is not None and (name == FORBIDDEN or name.startswith(FORBIDDEN + "."))


def engine_imports(source: str, filename: str) -> list[str]:
    """``file:line: what`` for every import of ``paged_engine`` in ``source``: ``import``
    and ``from`` statements anywhere (functions and ``if TYPE_CHECKING`` blocks included),
    and ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str | None] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                names = [arg.value if isinstance(arg.value, str) else None]
        line = getattr(node, "lineno", 0)
        found += [f"{filename}:{line}: {n}" for n in names if _is_forbidden(n)]
    return found


def test_the_spec_package_has_the_modules_this_test_expects() -> None:
    # Guards the tests below against passing vacuously over an empty list.
    expected = {"spec.block_manager", "spec.scheduler", "spec.records", "spec.diff_targets"}
    assert expected <= set(_spec_modules())
    assert {p.name for p in SPEC_DIR.glob("*.py")} >= {"block_manager.py", "scheduler.py"}


def test_the_parser_finds_every_form_of_engine_import() -> None:
    """The check's own control: each form below is found, and lookalikes are not."""
    source = (
        "import paged_engine\n"
        "import os, paged_engine.engine.scheduler as s\n"
        "from paged_engine.engine.outputs import FailedSample\n"
        "def f():\n"
        "    from paged_engine import config\n"
        "    importlib.import_module('paged_engine.engine')\n"
        "    __import__('paged_engine')\n"
        "import paged_engine_extra\n"
        "from spec.scheduler import paged_engine\n"
        "from . import paged_engine\n"
    )
    assert engine_imports(source, "x.py") == [
        "x.py:1: paged_engine",
        "x.py:2: paged_engine.engine.scheduler",
        "x.py:3: paged_engine.engine.outputs",
        "x.py:5: paged_engine",
        "x.py:6: paged_engine.engine",
        "x.py:7: paged_engine",
    ]


def test_no_spec_file_imports_the_engine() -> None:
    files = sorted(SPEC_DIR.rglob("*.py"))
    found = [hit for f in files for hit in engine_imports(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], f"spec/ imports the engine it specifies: {found}"


def test_importing_every_spec_module_loads_no_engine_module() -> None:
    """A fresh interpreter, rooted at the repository: nothing of ``paged_engine`` is loaded
    before the imports (the environment's own start-up), nor after them."""
    code = (
        "import importlib, json, sys\n"
        "def engine(): return sorted(k for k in sys.modules"
        f" if k == {FORBIDDEN!r} or k.startswith({FORBIDDEN + '.'!r}))\n"
        "before = engine()\n"
        f"for m in {_spec_modules()!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps({'before': before, 'after': engine(),"
        " 'spec': sorted(k for k in sys.modules if k.startswith('spec.'))}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["spec"] == _spec_modules(), "the subprocess did not import every spec module"
    assert got["before"] == [], f"the interpreter loads the engine at start-up: {got['before']}"
    assert got["after"] == [], f"importing spec/ loaded the engine: {got['after']}"
