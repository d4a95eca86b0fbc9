"""Deliberately broken allocators, each named after the rule it breaks.

tests/test_mutants.py runs the lockstep machine (not a hand-written example) against each
and requires it to fail: proof that the machine can catch that class of bug. Two kinds:

* **Patch mutants**: ``<name>.diff`` in this directory, a unified diff against the
  allocator's modules (``ALLOCATOR_MODULES``), described by its first line. ``allocator``
  applies it to copies of their sources in a directory of the caller's and imports the
  copies from there, so the bug is in the product's own code, and the product carries no
  hook for it. Each hunk must match the source exactly once (anywhere: line numbers are
  not used); a patch that no longer applies raises ``StaleMutant`` naming the mutant and
  the hunk, in that mutant's own test only. Regenerate such a patch from the current
  source with the same edit (``diff -u``), or write a new one by hand.
* **Subclass mutants**: the engine's ``BlockManager`` with a public method overridden.

``colliding_hash`` is the hash under which R10's token check decides most lookups.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from paged_engine.engine.block_manager import BlockManager, xxh64_block_hash
from paged_engine.engine.sequence import Sequence

PATCHES = Path(__file__).parent
ALLOCATOR_MODULES = (
    "paged_engine.engine.hashing",
    "paged_engine.engine.block_pool",
    "paged_engine.engine.block_manager",
)
"""The allocator's modules, in import order (each imports only earlier ones of these): a
patch mutant gets fresh copies of all three, so a patch to one reaches the classes built
on it."""


# ---- subclass mutants ------------------------------------------------------------------------


class R3ForwardRelease(BlockManager):
    """R3: release walks the table first to last, so shared prefixes are evicted first."""

    def deallocate(self, seq: Sequence) -> None:
        seq.block_table.reverse()  # the real release walks backwards: undo that
        super().deallocate(seq)


class R7ModOneGrowth(BlockManager):
    """R7: nano-vllm's ``len % bs == 1`` growth rule: never true when block_size == 1."""

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks > 0 or len(seq) % self.block_size != 1

    def may_append(self, seq: Sequence) -> None:
        if len(seq) % self.block_size == 1:
            super().may_append(seq)


class R13KeepsBlockHashes(BlockManager):
    """R13: the reset empties the hash map but leaves each block's hash and tokens behind."""

    def reset_prefix_cache(self) -> bool:
        hashes, tokens = list(self.block_hashes), list(self.block_tokens)
        reset = super().reset_prefix_cache()
        self.block_hashes[:], self.block_tokens[:] = hashes, tokens
        return reset


SUBCLASS_MUTANTS: dict[str, type[BlockManager]] = {
    cls.__name__: cls for cls in (R3ForwardRelease, R7ModOneGrowth, R13KeepsBlockHashes)
}


def colliding_hash(token_ids: SequenceABC[int], prefix: int | None) -> int:
    """Eight hash values in all: different blocks collide constantly, so the token check
    (R10) decides most lookups."""
    return xxh64_block_hash(token_ids, prefix) % 8


# ---- patch mutants ---------------------------------------------------------------------------


class StaleMutant(Exception):
    """A patch mutant that no longer applies to the allocator's source."""


@dataclass(frozen=True, slots=True)
class Hunk:
    header: str
    """Its ``@@ -a,b +c,d @@`` line."""
    old: tuple[str, ...]
    """The lines it replaces (context and removed), without their line ends."""
    new: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Patch:
    name: str
    description: str
    """The text before the first file header: what the mutant breaks."""
    files: dict[str, tuple[Hunk, ...]]
    """Hunks by the path they patch (``paged_engine/...``, the ``a/`` prefix dropped)."""


def patch_names() -> list[str]:
    """Every patch mutant in this directory."""
    return sorted(p.stem for p in PATCHES.glob("*.diff"))


def parse_patch(name: str, text: str) -> Patch:
    """A unified diff as ``Patch``; a malformed one raises ``StaleMutant``."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    description: list[str] = []
    files: dict[str, list[Hunk]] = {}
    path: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise StaleMutant(f"mutant {name}: '{line}' is not followed by a '+++' line")
            path = lines[i + 1][4:].split("\t")[0].removeprefix("b/")
            files.setdefault(path, [])
            i += 2
        elif line.startswith("@@ "):
            if path is None:
                raise StaleMutant(f"mutant {name}: hunk '{line}' before any file header")
            hunk, i = _parse_hunk(name, path, lines, i)
            files[path].append(hunk)
        elif path is None:
            description.append(line)
            i += 1
        elif line.startswith("\\"):  # "\ No newline at end of file"
            i += 1
        else:
            raise StaleMutant(f"mutant {name}: unexpected line {i + 1} in {path}: {line!r}")
    if not files or not all(files.values()):
        raise StaleMutant(f"mutant {name}: the patch changes nothing")
    return Patch(name, "\n".join(description).strip(), {p: tuple(h) for p, h in files.items()})


def _parse_hunk(name: str, path: str, lines: list[str], i: int) -> tuple[Hunk, int]:
    header = lines[i]
    try:
        ranges = header.split("@@")[1].split()
        old_len, new_len = (int(r.partition(",")[2] or 1) for r in ranges)
    except ValueError as e:
        raise StaleMutant(f"mutant {name}: unreadable hunk header {header!r} in {path}") from e
    old: list[str] = []
    new: list[str] = []
    i += 1
    while i < len(lines) and (len(old) < old_len or len(new) < new_len):
        line = lines[i]
        tag, body = (line[:1] or " "), line[1:]  # an empty line: blank context
        if tag == "\\":  # "\ No newline at end of file"
            i += 1
            continue
        if tag not in " -+":
            break
        if tag in " -":
            old.append(body)
        if tag in " +":
            new.append(body)
        i += 1
    if (len(old), len(new)) != (old_len, new_len) or old == new:
        raise StaleMutant(
            f"mutant {name}: hunk {header!r} of {path} has {len(old)} old and {len(new)} new "
            f"lines for its header's {old_len} and {new_len}, or changes nothing"
        )
    return Hunk(header, tuple(old), tuple(new)), i


def apply_hunks(name: str, path: str, source: str, hunks: SequenceABC[Hunk]) -> str:
    """``source`` with each hunk's old lines, which must occur exactly once, replaced."""
    lines = source.split("\n")
    for k, hunk in enumerate(hunks, 1):
        n = len(hunk.old)
        at = [j for j in range(len(lines) - n + 1) if tuple(lines[j : j + n]) == hunk.old]
        if len(at) != 1:
            shown = "\n".join(f"    {line}" for line in hunk.old)
            raise StaleMutant(
                f"mutant {name}: hunk {k} of {path} ({hunk.header}) matches the source "
                f"{len(at)} times, not once; its lines:\n{shown}"
            )
        lines[at[0] : at[0] + n] = hunk.new
    return "\n".join(lines)


def patched_modules(name: str, workdir: Path) -> dict[str, ModuleType]:
    """The allocator's modules with ``<name>.diff`` applied (an empty name: unpatched),
    written under ``workdir`` and imported from there, without touching the real ones."""
    if name:
        patch = parse_patch(name, (PATCHES / f"{name}.diff").read_text())
        files = dict(patch.files)
    else:
        files = {}
    paths = {m: m.replace(".", "/") + ".py" for m in ALLOCATOR_MODULES}
    unknown = sorted(set(files) - set(paths.values()))
    if unknown:
        raise StaleMutant(f"mutant {name}: patches {unknown}, outside {sorted(paths.values())}")
    for module_name, rel in paths.items():
        real = importlib.import_module(module_name)
        source = Path(real.__file__ or "").read_text()
        if rel in files:
            source = apply_hunks(name, rel, source, files[rel])
        target = workdir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    # Imported under their own names, so that each copy's imports of the others find the
    # copies; the real modules are put back before anything else can see the swap.
    saved = {m: sys.modules[m] for m in ALLOCATOR_MODULES}
    loaded: dict[str, ModuleType] = {}
    try:
        for module_name, rel in paths.items():
            spec = importlib.util.spec_from_file_location(module_name, workdir / rel)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            loaded[module_name] = module
    finally:
        sys.modules.update(saved)
    return loaded


def allocator(name: str, workdir: Path) -> type[BlockManager]:
    """The mutant allocator class called ``name``: a subclass mutant, or the
    ``BlockManager`` of the allocator patched by ``<name>.diff`` (built under
    ``workdir``). An unknown name raises KeyError; a stale patch ``StaleMutant``."""
    if name in SUBCLASS_MUTANTS:
        return SUBCLASS_MUTANTS[name]
    if name not in patch_names():
        raise KeyError(f"no mutant {name!r}: neither a subclass nor {PATCHES / name}.diff")
    cls: type[BlockManager] = patched_modules(name, workdir)[ALLOCATOR_MODULES[-1]].BlockManager
    return cls
