"""The tree shows the architecture (docs/design.md, "Layers"): ``engine/`` is CPU bookkeeping
and never imports torch; files are short enough to read in one sitting; no two modules
import each other, however indirectly (``TYPE_CHECKING`` imports included); no arrow points
back up from ``engine/`` or ``config.py``; nothing cites a document the repository lacks.

Each check is a function over files or an import graph, so that it is also run on a
deliberately bad input here: a check that cannot fail proves nothing.
"""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import paged_engine.engine

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "paged_engine"
LINE_LIMIT = 300
"""The most lines a file of the product may have (one sitting's reading)."""

# Spelled in pieces so that this file does not mention them itself.
FORBIDDEN_MENTIONS = ("../" + "shared", "DESIGN" + ".md", "seed" + " §")
"""Citations of documents outside the repository: the design is docs/design.md."""
SCANNED_TREES = ("paged_engine", "spec", "tests", "bench", "scripts", "csrc", "docs")
SCANNED_SUFFIXES = (".py", ".md", ".c", ".h", ".cpp", ".sh", ".toml", ".txt")

DESIGN = ROOT / "docs" / "design.md"
DESIGN_SECTIONS = (
    "Allocator rules",
    "Scheduler rules",
    "Atomic steps",
    "The step hand-off",
    "Layers",
    "The output pipeline",
    "Verification",
)
"""The sections docstrings cite by title (the path, a comma, the title in double quotes)."""
_CITATION = re.compile(r'docs/design\.md,?\s+"([^"\n]+)"')

LOWER_LAYERS = ("paged_engine.engine", "paged_engine.config")
"""The modules below the torch side: they may import each other, never upwards."""
ABOVE_THEM = tuple(
    f"paged_engine.{p}"
    for p in ("worker", "layers", "models", "entrypoints", "kernels", "utils", "llm", "llm_engine")
)


# ---- the checks --------------------------------------------------------------------------


def long_files(package_dir: Path, limit: int = LINE_LIMIT) -> list[tuple[str, int]]:
    """Every ``.py`` file under ``package_dir`` with more than ``limit`` lines, with its count."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            found.append((path.relative_to(package_dir.parent).as_posix(), n))
    return found


def _modules(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``)."""
    mods = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return mods


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text: at the top, under
    ``if TYPE_CHECKING:``, or inside a function (a lazy import still ties the two modules).

    ``from a.b import c`` points to ``a.b.c`` when that is a module, else to ``a.b``;
    relative imports are resolved. A parent package that Python runs on the way (its
    ``__init__``) is not an edge: only what the text names.
    """
    mods = _modules(package_dir)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in mods.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = here[: len(here) - node.level + 1]
                    base = ".".join([*parent, node.module] if node.module else parent)
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted; empty when the graph has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """``engine/`` and ``config.py`` importing the torch side or the entrypoints, and
    ``config.py`` importing ``engine/``: each as ``"importer -> imported"``."""
    found = []
    for module in sorted(graph):
        if not any(_within(module, low) for low in LOWER_LAYERS):
            continue
        above = ABOVE_THEM
        if module == "paged_engine.config":
            above = (*ABOVE_THEM, "paged_engine.engine")
        found += [
            f"{module} -> {t}" for t in sorted(graph[module]) if any(_within(t, a) for a in above)
        ]
    return found


def forbidden_mentions(root: Path, trees: tuple[str, ...] = SCANNED_TREES) -> list[str]:
    """``path:line: mention`` for each citation of a document outside the repository."""
    found = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*")):
            if path.suffix not in SCANNED_SUFFIXES or "__pycache__" in path.parts:
                continue
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            for number, line in enumerate(lines, 1):
                for mention in FORBIDDEN_MENTIONS:
                    if mention in line:
                        where = path.relative_to(root).as_posix()
                        found.append(f"{where}:{number}: {mention}")
    return found


def design_sections(design: Path) -> list[str]:
    """The document's sections (its ``## `` headings), in order."""
    lines = design.read_text(encoding="utf-8").splitlines()
    return [line[3:].strip() for line in lines if line.startswith("## ")]


def unknown_citations(
    root: Path, sections: list[str], trees: tuple[str, ...] = SCANNED_TREES
) -> list[str]:
    """``path: "title"`` for each citation of a section of docs/design.md by its title in
    double quotes (across a line break too) that names no section of the document."""
    found = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*")):
            if path.suffix not in SCANNED_SUFFIXES or "__pycache__" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for cited in _CITATION.findall(text):
                if cited not in sections:
                    found.append(f'{path.relative_to(root).as_posix()}: "{cited}"')
    return found


# ---- the tree ----------------------------------------------------------------------------


def _engine_modules() -> list[str]:
    return sorted(
        f"paged_engine.engine.{m.name}" for m in pkgutil.iter_modules(paged_engine.engine.__path__)
    )


def test_the_engine_package_has_the_modules_this_test_expects() -> None:
    # Guards the next test against passing vacuously over an empty list.
    assert {"paged_engine.engine.block_manager", "paged_engine.engine.llm_engine"} <= set(
        _engine_modules()
    )


def test_no_engine_module_imports_torch() -> None:
    modules = _engine_modules()
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.'))\n"
        "print(len(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "0", f"engine/ pulled in torch: {out.stdout} {out.stderr}"


def test_the_import_graph_covers_the_package() -> None:
    # Guards the graph tests against passing over a graph that lost its edges.
    graph = import_graph(PACKAGE)
    assert len(graph) == len(list(PACKAGE.rglob("*.py")))
    assert "paged_engine.engine.llm_engine" in graph["paged_engine.llm_engine"]
    assert "paged_engine.llm_engine" in graph["paged_engine.llm"]
    assert "paged_engine.layers.attention.base" in graph["paged_engine.layers.attention"]


def test_no_product_file_is_longer_than_one_sitting() -> None:
    offenders = long_files(PACKAGE)
    assert offenders == [], f"files over {LINE_LIMIT} lines: " + ", ".join(
        f"{path} ({n})" for path, n in offenders
    )


def test_no_import_cycle() -> None:
    cycles = import_cycles(import_graph(PACKAGE))
    assert cycles == [], f"modules that import each other (TYPE_CHECKING included): {cycles}"


def test_no_arrow_back_up_from_the_engine_or_the_config() -> None:
    arrows = arrows_back_up(import_graph(PACKAGE))
    assert arrows == [], f"imports against the layering: {arrows}"


def test_nothing_cites_a_document_outside_the_repository() -> None:
    assert (ROOT / "spec" / "scheduler.py").exists()  # the scan looks where the files are
    mentions = forbidden_mentions(ROOT)
    assert mentions == [], "cite docs/design.md instead: " + "; ".join(mentions)


def test_the_design_has_the_sections_docstrings_cite() -> None:
    assert design_sections(DESIGN) == list(DESIGN_SECTIONS)


def test_every_citation_of_the_design_names_one_of_its_sections() -> None:
    assert unknown_citations(ROOT, design_sections(DESIGN)) == []


# ---- each check on a bad input -----------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_long_file_is_named_with_its_count(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "short.py": "x = 1\n" * LINE_LIMIT,
            "sub/long.py": "x = 1\n" * (LINE_LIMIT + 1),
        },
    )
    assert long_files(tmp_path / "pkg") == [("pkg/sub/long.py", LINE_LIMIT + 1)]


def test_a_type_checking_cycle_is_found(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a.py": "from pkg.b import B\n",
            "b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import c\n"
            ),
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from ..a import A\n",
            "d.py": "import pkg.a\n",
        },
    )
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"}  # from a package, the submodule itself
    assert graph["pkg.sub.c"] == {"pkg.a"}  # relative, inside a function
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert import_cycles({"x": {"y"}, "y": set(), "z": {"x"}}) == []


def test_an_arrow_back_up_is_found() -> None:
    graph = {
        "paged_engine.config": {"paged_engine.engine.hashing", "paged_engine.platform"},
        "paged_engine.engine.scheduler": {"paged_engine.engine.sequence", "paged_engine.config"},
        "paged_engine.engine.sequence": {"paged_engine.worker.handoff"},
        "paged_engine.engine.hashing": {"paged_engine.utils"},
        "paged_engine.worker.handoff": {"paged_engine.engine.sequence"},
        "paged_engine.engineering": {"paged_engine.layers"},  # not engine/: a name's prefix
    }
    assert arrows_back_up(graph) == [
        "paged_engine.config -> paged_engine.engine.hashing",
        "paged_engine.engine.hashing -> paged_engine.utils",
        "paged_engine.engine.sequence -> paged_engine.worker.handoff",
    ]


@pytest.mark.parametrize("mention", FORBIDDEN_MENTIONS)
def test_a_citation_outside_the_repository_is_found(tmp_path: Path, mention: str) -> None:
    _write(tmp_path, {"tests/ok.py": "# docs/design.md\n", "spec/x.py": f'"""\nsee {mention}\n"""'})
    assert forbidden_mentions(tmp_path, ("spec", "tests")) == [f"spec/x.py:2: {mention}"]


def test_a_citation_of_a_missing_section_is_found(tmp_path: Path) -> None:
    cite = "docs/" + "design.md"  # spelled in pieces: this file cites no missing section
    _write(
        tmp_path,
        {
            "docs/design.md": "# t\n\n## Atomic steps\n\ntext\n### Not a section\n",
            "spec/a.py": f'"""({cite},\n    "Atomic steps") and {cite} "Atomic step"."""',
        },
    )
    sections = design_sections(tmp_path / "docs" / "design.md")
    assert sections == ["Atomic steps"]
    assert unknown_citations(tmp_path, sections, ("spec",)) == ['spec/a.py: "Atomic step"']
