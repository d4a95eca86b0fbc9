"""Patch mutants: a unified diff applied to a temporary copy of a product source file.

A patch mutant plants its bug in the product's own code, so the product carries no hook
for it. tests/allocator_mutants/, tests/scheduler_mutants.py, tests/kernel_mutants.py and
tests/fused_mutants.py build theirs with this one applier. A patch is read and applied
only when a test builds its mutant, never at import, so an edit of the product that makes
one stale fails that mutant's test alone, with ``StaleMutant`` naming the mutant, the file
and the hunk.

The rule for finding a hunk: its old lines (context and removed) must occur exactly once
in the file as the hunks before it left it; line numbers are not used. So an edit
elsewhere in the file leaves a patch applying, and an edit of the lines it names, or one
that repeats them elsewhere, makes it stale: an ambiguous hunk is refused, never applied
at a guess. To write or refresh a patch: a first paragraph that says what the mutant
breaks, then edit the source in the working tree, ``git diff -U2 -- <file> >>
<name>.patch``, and undo the edit.
"""

from __future__ import annotations

import atexit
import importlib.util
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
"""The repository: the paths in a patch are relative to it."""


class StaleMutant(Exception):
    """A patch mutant that cannot be built: its patch is missing, malformed, or no longer
    applies to the source. Deliberately not an AssertionError, so that a test expecting a
    check's AssertionError can never take a stale mutant for a caught one."""

    def __init__(self, mutant: str, file: str, hunk_header: str | None, reason: str) -> None:
        self.mutant, self.file, self.hunk_header, self.reason = mutant, file, hunk_header, reason
        where = file if hunk_header is None else f"{file}, hunk {hunk_header}"
        super().__init__(f"mutant {mutant}: {where}: {reason}")


@dataclass(frozen=True, slots=True)
class Hunk:
    header: str
    """Its ``@@ -a,b +c,d @@`` line."""
    old: tuple[str, ...]
    """The lines it replaces (context and removed), without their line ends."""
    new: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Patch:
    mutant: str
    description: str
    """The text before the first file header: what the mutant breaks."""
    files: dict[str, tuple[Hunk, ...]]
    """Hunks by the path they patch, relative to the repository (``b/`` dropped)."""

    def one_file(self) -> str:
        """The one file the patch changes; a patch of several raises ``StaleMutant``."""
        if len(self.files) != 1:
            raise StaleMutant(self.mutant, ", ".join(self.files), None, "patches several files")
        return next(iter(self.files))


_HEADER = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_GIT_LINES = ("diff --git ", "index ")
"""The lines ``git diff`` writes before a file's header: skipped."""


def read_patch(mutant: str, patch: Path) -> Patch:
    """The patch file ``patch`` of ``mutant``; a missing one raises ``StaleMutant``."""
    if not patch.is_file():
        raise StaleMutant(mutant, str(patch), None, "no such patch file")
    return parse_patch(mutant, patch.read_text(encoding="utf-8"), patch.name)


def parse_patch(mutant: str, text: str, source: str = "the patch") -> Patch:
    """A unified diff as ``Patch``; a malformed one raises ``StaleMutant`` (its file is
    ``source``, the patch's name, until a file header names the file patched)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    heads = (k for k, line in enumerate(lines) if line.startswith(("--- ", *_GIT_LINES)))
    i = next(heads, len(lines))
    description = "\n".join(lines[:i]).strip()
    files: dict[str, list[Hunk]] = {}
    path: str | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise StaleMutant(mutant, source, None, f"{line!r} is not followed by '+++'")
            path = lines[i + 1][4:].split("\t")[0].strip().removeprefix("b/")
            files.setdefault(path, [])
            i += 2
        elif line.startswith("@@"):
            if path is None:
                raise StaleMutant(mutant, source, line, "a hunk before any file header")
            hunk, i = _parse_hunk(mutant, path, lines, i)
            files[path].append(hunk)
        elif line.startswith(_GIT_LINES):
            path = None
            i += 1
        elif path is not None and line.startswith("\\"):  # "\ No newline at end of file"
            i += 1
        else:
            raise StaleMutant(mutant, path or source, None, f"unexpected line {i + 1}: {line!r}")
    if not files or not all(files.values()):
        raise StaleMutant(mutant, source, None, "the patch changes no file")
    return Patch(mutant, description, {p: tuple(h) for p, h in files.items()})


def _parse_hunk(mutant: str, path: str, lines: list[str], i: int) -> tuple[Hunk, int]:
    header = lines[i]
    match = _HEADER.match(header)
    if match is None:
        raise StaleMutant(mutant, path, header, "an unreadable hunk header")
    old_len, new_len = (int(n) if n is not None else 1 for n in match.groups())
    old: list[str] = []
    new: list[str] = []
    i += 1
    while i < len(lines) and (len(old) < old_len or len(new) < new_len):
        line = lines[i]
        tag, body = (line[:1] or " "), line[1:]  # an empty line: blank context
        if tag not in " -+\\":
            break
        if tag in " -":
            old.append(body)
        if tag in " +":
            new.append(body)
        i += 1  # a "\" line ("\ No newline at end of file") counts on neither side
    if (len(old), len(new)) != (old_len, new_len):
        raise StaleMutant(
            mutant,
            path,
            header,
            f"{len(old)} old and {len(new)} new lines for its header's {old_len} and {new_len}",
        )
    if not old or old == new:
        raise StaleMutant(mutant, path, header, "no old lines to find, or changes nothing")
    return Hunk(header, tuple(old), tuple(new)), i


def apply_hunks(mutant: str, path: str, source: str, hunks: Sequence[Hunk]) -> str:
    """``source`` (the text of ``path``) with each hunk's old lines, which must occur
    exactly once in the text the hunks before it left, replaced by its new lines."""
    lines = source.split("\n")
    for hunk in hunks:
        n = len(hunk.old)
        at = [j for j in range(len(lines) - n + 1) if tuple(lines[j : j + n]) == hunk.old]
        if len(at) != 1:
            where = f" (at lines {', '.join(str(j + 1) for j in at)})" if at else ""
            shown = "\n".join(f"    {line}" for line in hunk.old)
            raise StaleMutant(
                mutant,
                path,
                hunk.header,
                f"its lines occur {len(at)} times{where}, not once; refresh the patch "
                f"(tests/patch_mutants.py says how). Its lines:\n{shown}",
            )
        lines[at[0] : at[0] + n] = hunk.new
    return "\n".join(lines)


def patched_copy(
    mutant: str, patch: Patch | None, copy: Sequence[str] = (), into: Path | None = None
) -> Path:
    """A directory (``into``, or a new temporary one removed at exit) holding ``copy``
    (paths relative to the repository: files or whole directories) and every file
    ``patch`` names, copied from the repository at the same relative paths, with ``patch``
    applied to them. A Python module copied there is imported with ``import_copy``; a C
    source is compiled from there."""
    if into is None:
        into = Path(tempfile.mkdtemp(prefix=f"paged-engine-mutant-{mutant}-"))
        atexit.register(shutil.rmtree, into, True)
    files = patch.files if patch is not None else {}
    for rel in (*copy, *files):
        src, dst = ROOT / rel, into / rel
        if dst.exists():
            continue
        if not src.exists():
            raise StaleMutant(mutant, rel, None, "no such file in the repository")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
    for rel, hunks in files.items():
        target = into / rel
        source = target.read_text(encoding="utf-8")
        target.write_text(apply_hunks(mutant, rel, source, hunks), encoding="utf-8")
    return into


def import_copy(module_name: str, path: Path) -> ModuleType:
    """The Python file ``path`` imported as ``module_name``, which it is registered under
    in ``sys.modules`` (dataclasses look their module up there; a caller importing copies
    under the real modules' names puts those back); a copy that fails to run is removed
    from there."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
