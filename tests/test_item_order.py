"""The order the CPU decode kernel runs a call's sequences in (csrc/run_items.c's
``item_order``): sequences that begin in the same block (a shared prefix) one after
another, so the prefix's blocks are still in the core's cache for the next; the groups by
their longest context, longest first; within a group, in the order of their block tables.

The order changes no output bit (each item is computed whole: tests/test_cpu_kernel_threads.py
permutes batches), only which blocks the caches still hold, so no kernel output can show
it. Here the driver's own source is compiled into a harness (tests/c/item_order_harness.c)
whose work item records the sequence it is given; the orders it reads back are held to
hand-worked examples and, on drawn batches, to the properties above. The order's mutants
(tests/order_mutants/) must break one of them.
"""

from __future__ import annotations

import itertools
import random
import shlex
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.patch_mutants import patched_copy, read_patch

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "c" / "item_order_harness.c"
MUTANT_DIR = ROOT / "tests" / "order_mutants"
MUTANTS = {
    "group_by_length_only": "by_group drops the first block: groups of the same longest "
    "context interleave",
    "group_len_per_sequence": "each sequence's own length stands for its group's: a group "
    "splits by length",
}

Batch = tuple[int, list[int], list[list[int]]]  # block size, lengths, block tables


def compile_harness(csrc: Path, out: Path) -> Path:
    """The harness built against ``csrc`` with the compiler that builds the extension."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    exe = out / "item_order_harness"
    subprocess.run([*cc, "-O1", f"-I{csrc}", str(HARNESS), "-o", str(exe)], check=True)
    return exe


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_harness(ROOT / "csrc", tmp_path_factory.mktemp("order"))


def orders(exe: Path, batches: list[Batch]) -> list[list[int]]:
    lines = []
    for block_size, lens, tables in batches:
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        lines.append(f"{len(lens)} {width} {block_size}")
        lines.append(" ".join(map(str, lens)))
        lines.append(" ".join(str(x) for row in rows for x in row))
    done = subprocess.run(
        [str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
    )
    got = [[int(x) for x in line.split()] for line in done.stdout.splitlines()]
    assert len(got) == len(batches)
    return got


def used(batch: Batch, b: int) -> list[int]:
    """The blocks sequence b's context reads."""
    block_size, lens, tables = batch
    return tables[b][: -(-lens[b] // block_size)]


def check_order(batch: Batch, order: list[int]) -> None:
    """The properties of item_order's order, for one batch."""
    _, lens, _ = batch
    assert sorted(order) == list(range(len(lens))), f"not a permutation: {order}"
    key = {b: (used(batch, b)[0] if lens[b] else ("own", b)) for b in order}
    groups: list[list[int]] = []
    for b in order:
        if groups and key[groups[-1][0]] == key[b]:
            groups[-1].append(b)
        else:
            groups.append([b])
    firsts = [key[g[0]] for g in groups]
    assert len(set(firsts)) == len(firsts), f"a group is split: {order}"
    longest = [max(lens[b] for b in g) for g in groups]
    assert longest == sorted(longest, reverse=True), f"groups not longest first: {order}"
    for g in groups:
        for x, y in itertools.pairwise(g):
            bx, by = used(batch, x), used(batch, y)
            n = min(len(bx), len(by))
            if bx[:n] == by[:n]:
                assert lens[x] >= lens[y], f"{x} before {y}: same blocks, shorter first"
            else:
                assert bx[:n] < by[:n], f"{x} before {y}: tables out of order in {order}"


def drawn_batches(seed: int, count: int) -> Iterator[Batch]:
    """Batches of up to 24 sequences over prefix trees: a few prefixes, some extended by a
    shared block more, sequences on them or on nothing, lengths from a small set (so that
    groups tie on their longest), some zero."""
    rng = random.Random(seed)
    for _ in range(count):
        block_size = rng.choice((1, 4, 16))
        pool = list(range(200))
        rng.shuffle(pool)
        prefixes = [[pool.pop() for _ in range(rng.randint(1, 3))] for _ in range(3)]
        prefixes += [[*p, pool.pop()] for p in prefixes[:2]]
        lens, tables = [], []
        for _ in range(rng.randint(0, 24)):
            start = rng.choice([*prefixes, []])
            table = start + [pool.pop() for _ in range(rng.randint(0, 3))]
            if not table:
                table = [pool.pop()]
            blocks = len(table)
            length = rng.choice((0, (blocks - 1) * block_size + 1, blocks * block_size))
            lens.append(length)
            tables.append(table)
        yield block_size, lens, tables


def test_hand_worked_orders(harness: Path) -> None:
    examples: list[tuple[Batch, list[int]]] = [
        # 0 and 3 share block 1 (0's next block 2 sorts before 3's 4); 1 is longest; 2 reads nothing
        ((8, [10, 20, 0, 9], [[1, 2], [5, 6, 7], [0], [1, 4]]), [1, 0, 3, 2]),
        # two groups whose longest contexts tie: the one with the lower first block first
        ((4, [8, 8, 8, 8], [[9, 3], [2, 5], [9, 4], [2, 6]]), [1, 3, 0, 2]),
        # no shared prefix: longest first, ties by batch index
        ((4, [3, 9, 9, 1], [[7], [8, 10, 11], [12, 13, 14], [15]]), [1, 2, 0, 3]),
        # the same blocks: the longer context first
        ((4, [5, 8], [[3, 4], [3, 4]]), [1, 0]),
        ((4, [], []), []),
    ]
    got = orders(harness, [batch for batch, _ in examples])
    assert got == [want for _, want in examples]
    for (batch, _), order in zip(examples, got, strict=True):
        check_order(batch, order)


def test_drawn_batches_keep_the_order_properties(harness: Path) -> None:
    batches = list(drawn_batches(seed=0, count=300))
    for batch, order in zip(batches, orders(harness, batches), strict=True):
        check_order(batch, order)


def test_every_patch_file_is_a_listed_mutant() -> None:
    assert set(MUTANTS) == {p.stem for p in MUTANT_DIR.glob("*.patch")}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_breaks_a_property(mutant: str, tmp_path: Path) -> None:
    work = patched_copy(mutant, read_patch(mutant, MUTANT_DIR / f"{mutant}.patch"), ("csrc",))
    exe = compile_harness(work / "csrc", tmp_path)
    batches = list(drawn_batches(seed=0, count=300))
    failures = 0
    for batch, order in zip(batches, orders(exe, batches), strict=True):
        try:
            check_order(batch, order)
        except AssertionError:
            failures += 1
    assert failures, f"no drawn batch catches {mutant} ({MUTANTS[mutant]})"
