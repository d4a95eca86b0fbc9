"""Deliberately broken allocators, each named after the rule it breaks.

tests/test_mutants.py runs the lockstep machine (not a hand-written example) against each
and requires it to fail: proof that the machine can catch that class of bug. Two kinds:

* **Patch mutants**: ``<name>.diff`` in this directory, a unified diff against the
  allocator's modules (``ALLOCATOR_MODULES``), described by its first line. ``allocator``
  applies it to copies of their sources in a directory of the caller's and imports the
  copies from there, so the bug is in the product's own code, and the product carries no
  hook for it. A patch that no longer applies (tests/patch_mutants.py's rule: each hunk
  matches exactly once) raises ``StaleMutant`` naming the mutant, the file and the hunk,
  in that mutant's own test only.
* **Subclass mutants**: the engine's ``BlockManager`` with a public method overridden.

``colliding_hash`` is the hash under which R10's token check decides most lookups.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from types import ModuleType

from paged_engine.engine.block_manager import BlockManager, xxh64_block_hash
from paged_engine.engine.sequence import Sequence
from tests.patch_mutants import StaleMutant, import_copy, patched_copy, read_patch

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


def patch_names() -> list[str]:
    """Every patch mutant in this directory."""
    return sorted(p.stem for p in PATCHES.glob("*.diff"))


def patched_modules(name: str, workdir: Path) -> dict[str, ModuleType]:
    """The allocator's modules with ``<name>.diff`` applied (an empty name: unpatched),
    written under ``workdir`` and imported from there, without touching the real ones."""
    patch = read_patch(name, PATCHES / f"{name}.diff") if name else None
    paths = {m: m.replace(".", "/") + ".py" for m in ALLOCATOR_MODULES}
    unknown = sorted(set(patch.files if patch else ()) - set(paths.values()))
    if unknown:
        raise StaleMutant(name, ", ".join(unknown), None, "outside the allocator's modules")
    patched_copy(name, patch, copy=tuple(paths.values()), into=workdir)
    # Imported under their own names, so that each copy's imports of the others find the
    # copies; the real modules are put back before anything else can see the swap.
    saved = {m: sys.modules[m] for m in ALLOCATOR_MODULES}
    try:
        return {m: import_copy(m, workdir / rel) for m, rel in paths.items()}
    finally:
        sys.modules.update(saved)


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
