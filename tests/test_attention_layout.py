"""The attention package's shape: no import circle, ``base`` imports no backend, only
``selection`` builds backends, Triton stays optional, files stay readable.

The import graph is read from the source (module-level imports, the ones that run when a
module loads), so a circle shows up even where Python's import order happens to hide it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import paged_engine.layers.attention as package

PACKAGE = "paged_engine.layers.attention"
DIR = Path(package.__file__).parent
MODULES = sorted(f"{PACKAGE}.{p.stem}" for p in DIR.glob("*.py") if p.stem != "__init__")
BACKENDS = {f"{PACKAGE}.{m}" for m in ("torch_backend", "cpu", "triton_backend", "flash")}


def _path(module: str) -> Path:
    return DIR / ("__init__.py" if module == PACKAGE else f"{module.rsplit('.', 1)[1]}.py")


def _imports(module: str, *, top_level_only: bool) -> set[str]:
    """The package modules ``module`` imports (all of them, or only at module level)."""
    tree = ast.parse(_path(module).read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES or n == PACKAGE}
    return found - {module}


def test_the_package_has_the_modules_this_test_expects() -> None:
    assert BACKENDS | {f"{PACKAGE}.base", f"{PACKAGE}.selection"} <= set(MODULES)


def test_no_import_circle() -> None:
    graph = {m: _imports(m, top_level_only=True) for m in [PACKAGE, *MODULES]}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*path, m, dep])}")
            if dep not in state:
                visit(dep, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])
    assert graph[f"{PACKAGE}.triton_backend"], "the graph read no imports: the test is blind"


def test_base_imports_no_backend_and_only_selection_builds_them() -> None:
    assert not _imports(f"{PACKAGE}.base", top_level_only=False) & (BACKENDS | {PACKAGE})
    importers = {m for m in MODULES if _imports(m, top_level_only=False) & BACKENDS - {m}}
    # cpu extends the torch backend; selection builds them all; nothing else reaches one.
    assert importers == {f"{PACKAGE}.selection", f"{PACKAGE}.cpu"}, importers


def test_the_package_and_the_flash_backend_import_without_triton() -> None:
    """Triton is optional: the package, selection and the flash-attn backend load without
    it (a fresh interpreter, so nothing imported it before)."""
    code = (
        "import sys\n"
        f"import {PACKAGE}, {PACKAGE}.selection, {PACKAGE}.flash, {PACKAGE}.requirements\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_no_file_is_much_over_300_lines() -> None:
    long = {p.name: n for p in DIR.glob("*.py") if (n := len(p.read_text().splitlines())) > 320}
    assert not long, long
