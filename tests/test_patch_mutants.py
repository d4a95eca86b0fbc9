"""The patch mutants' applier (tests/patch_mutants.py): a patch applies wherever its lines
stand, and one that does not apply, or applies in two places, or is malformed, is refused
with ``StaleMutant`` naming the mutant, the file and the hunk, never an AssertionError
(which a test of the mutant could take for a catch). Every suite's patch files are held
to it here, against the current source, without building their mutants.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.patch_mutants import (
    ROOT,
    Patch,
    StaleMutant,
    apply_hunks,
    import_copy,
    parse_patch,
    patched_copy,
    read_patch,
)

SOURCE = "a = 1\nb = 2\nc = 3\n"
PATCH = """Example: one line changed.

--- a/x.py
+++ b/x.py
@@ -1,3 +1,3 @@
 a = 1
-b = 2
+b = 20
 c = 3
"""
SUITES = ("allocator_mutants", "fused_mutants", "kernel_mutants", "scheduler_mutants")
PATCH_FILES = sorted(
    p
    for suite in SUITES
    for p in (ROOT / "tests" / suite).iterdir()
    if p.suffix in {".diff", ".patch"}
)


def _stale(call: Callable[..., object], *args: object) -> StaleMutant:
    """What ``call(*args)`` raises: a ``StaleMutant``, never an AssertionError."""
    with pytest.raises(StaleMutant) as caught:
        call(*args)
    assert not isinstance(caught.value, AssertionError)
    return caught.value


def test_a_patch_applies_wherever_its_lines_stand() -> None:
    patch = parse_patch("Example", PATCH)
    assert patch.description == "Example: one line changed."
    (hunk,) = patch.files["x.py"]
    assert (hunk.header, hunk.old, hunk.new) == (
        "@@ -1,3 +1,3 @@",
        ("a = 1", "b = 2", "c = 3"),
        ("a = 1", "b = 20", "c = 3"),
    )
    assert apply_hunks("Example", "x.py", SOURCE, [hunk]) == "a = 1\nb = 20\nc = 3\n"
    moved = "# a new first line\n" + SOURCE
    assert apply_hunks("Example", "x.py", moved, [hunk]) == "# a new first line\n" + (
        "a = 1\nb = 20\nc = 3\n"
    )


@pytest.mark.parametrize(
    ("source", "times"), [("a = 1\nb = 3\nc = 3\n", 0), (SOURCE + SOURCE, 2)], ids=["gone", "twice"]
)
def test_a_hunk_whose_lines_do_not_occur_once_names_the_mutant_and_hunk(
    source: str, times: int
) -> None:
    (hunk,) = parse_patch("Example", PATCH).files["x.py"]
    stale = _stale(apply_hunks, "Example", "x.py", source, [hunk])
    assert (stale.mutant, stale.file, stale.hunk_header) == ("Example", "x.py", "@@ -1,3 +1,3 @@")
    message = str(stale)
    assert message.startswith(
        f"mutant Example: x.py, hunk @@ -1,3 +1,3 @@: its lines occur {times} times"
    )
    assert "    b = 2" in message  # the lines it looked for
    assert ("(at lines 1, 4)" in message) == (times == 2)


def test_the_second_hunk_stale_is_named_after_the_first_applied() -> None:
    second = "@@ -3,1 +3,1 @@\n-c = 4\n+c = 30\n"
    patch = parse_patch("Two", PATCH + second)
    first, stale_hunk = patch.files["x.py"]
    stale = _stale(apply_hunks, "Two", "x.py", SOURCE, [first, stale_hunk])
    assert stale.hunk_header == "@@ -3,1 +3,1 @@" and "    c = 4" in str(stale)
    # The hunks apply in order, each to what the one before left.
    fixed = parse_patch("Two", PATCH + "@@ -2,1 +2,1 @@\n-b = 20\n+b = 200\n")
    assert apply_hunks("Two", "x.py", SOURCE, fixed.files["x.py"]) == "a = 1\nb = 200\nc = 3\n"


@pytest.mark.parametrize(
    ("text", "hunk_header", "reason"),
    [
        (
            PATCH.replace("@@ -1,3", "@@ -1,4"),
            "@@ -1,4 +1,3 @@",
            "3 old and 3 new lines for its header's 4 and 3",
        ),
        (PATCH.replace("@@ -1,3 +1,3 @@", "@@ one @@"), "@@ one @@", "unreadable hunk header"),
        (PATCH.replace("-b = 2\n+b = 20\n", " b = 2\n"), "@@ -1,3 +1,3 @@", "changes nothing"),
        (PATCH.replace("+++ b/x.py\n", ""), None, "is not followed by '+++'"),
        (PATCH.replace(" c = 3\n", " c = 3\n*junk\n"), None, "unexpected line 10: '*junk'"),
        ("Example: a description, no diff.\n", None, "changes no file"),
    ],
    ids=["counts", "header", "no-change", "no-plus", "junk", "empty"],
)
def test_a_malformed_patch_is_refused(text: str, hunk_header: str | None, reason: str) -> None:
    stale = _stale(parse_patch, "Example", text, "Example.diff")
    assert stale.mutant == "Example" and stale.hunk_header == hunk_header
    assert reason in stale.reason, stale.reason


def test_a_git_diff_reads_like_a_plain_one() -> None:
    git = "diff --git a/x.py b/x.py\nindex 1234567..89abcde 100644\n" + PATCH[PATCH.index("---") :]
    described = PATCH.replace(
        "--- a/x.py", "diff --git a/x.py b/x.py\nindex 1..2 100644\n--- a/x.py"
    )
    assert parse_patch("Example", git) == Patch("Example", "", parse_patch("E", PATCH).files)
    assert parse_patch("Example", described).description == "Example: one line changed."


def test_a_missing_patch_file_is_refused_naming_it(tmp_path: Path) -> None:
    stale = _stale(read_patch, "Gone", tmp_path / "Gone.patch")
    assert stale.mutant == "Gone" and stale.file == str(tmp_path / "Gone.patch")
    assert str(stale) == f"mutant Gone: {tmp_path / 'Gone.patch'}: no such patch file"


def test_a_patched_copy_leaves_the_repository_alone_and_imports_from_the_copy(
    tmp_path: Path,
) -> None:
    rel = "paged_engine/engine/stats.py"
    real = (ROOT / rel).read_text()
    line = next(ln for ln in real.split("\n") if ln.startswith("from __future__"))
    text = f"--- a/{rel}\n+++ b/{rel}\n@@ -1,1 +1,2 @@\n {line}\n+PATCHED = True\n"
    work = patched_copy("Copy", parse_patch("Copy", text), ("paged_engine/engine/hashing.py",))
    assert (work / "paged_engine/engine/hashing.py").read_text() == (
        ROOT / "paged_engine/engine/hashing.py"
    ).read_text()
    assert (ROOT / rel).read_text() == real
    module = import_copy("patch_mutants_copy", work / rel)
    assert module.PATCHED is True and sys.modules["patch_mutants_copy"] is module
    del sys.modules["patch_mutants_copy"]
    # into a given directory; a file the repository lacks is refused by name
    assert patched_copy("Copy", None, ("csrc/isa.h",), into=tmp_path) == tmp_path
    assert (tmp_path / "csrc/isa.h").read_text() == (ROOT / "csrc/isa.h").read_text()
    stale = _stale(patched_copy, "Copy", None, ("csrc/no_such.h",), tmp_path)
    assert (stale.mutant, stale.file) == ("Copy", "csrc/no_such.h")


def test_a_copy_that_fails_to_import_is_not_left_registered(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise ValueError('broken copy')\n")
    with pytest.raises(ValueError, match="broken copy"):
        import_copy("patch_mutants_broken", tmp_path / "broken.py")
    assert "patch_mutants_broken" not in sys.modules


# ---- every suite's patch files, against the current source ---------------------------------


def test_every_suite_has_patch_files() -> None:
    assert {p.parent.name for p in PATCH_FILES} == set(SUITES)


@pytest.mark.parametrize(
    "path", PATCH_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in PATCH_FILES]
)
def test_a_patch_applies_after_edits_elsewhere_and_goes_stale_after_its_own(path: Path) -> None:
    """Lines added above a hunk leave it applying; its own lines edited, or repeated
    elsewhere in the file, make it stale, naming the mutant, the file and the hunk."""
    patch = read_patch(path.stem, path)
    for rel, hunks in patch.files.items():
        source = (ROOT / rel).read_text()
        patched = apply_hunks(path.stem, rel, source, hunks)
        assert patched != source
        moved = apply_hunks(path.stem, rel, "\n" * 5 + source, hunks)
        assert moved == "\n" * 5 + patched
        lines = source.split("\n")
        old = hunks[0].old
        (at,) = [j for j in range(len(lines)) if tuple(lines[j : j + len(old)]) == old]
        k = next(k for k, line in enumerate(old) if line.strip())
        edited = [*lines[: at + k], lines[at + k] + " /* edited */", *lines[at + k + 1 :]]
        repeated = [*lines, *old]
        for text, times in (("\n".join(edited), 0), ("\n".join(repeated), 2)):
            stale = _stale(apply_hunks, path.stem, rel, text, hunks)
            assert (stale.mutant, stale.file, stale.hunk_header) == (
                path.stem,
                rel,
                hunks[0].header,
            )
            assert f"its lines occur {times} times" in stale.reason
