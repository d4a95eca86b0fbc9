"""setup.py's build cache: a library built once is copied by the next build from the same
inputs, compiled again when a source changes, and ``--force`` skips the cache. Checked on
a one-function extension built with setup.py's own ``BuildExt`` (a minute less per
``pip install -e`` of an extra is what it is for)."""

from __future__ import annotations

import runpy
import shutil
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = """#include <Python.h>
static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "hello", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_hello(void) { return PyModule_Create(&m); }
/* %s */
"""

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


def setup_globals() -> dict[str, Any]:
    with mock.patch("setuptools.setup", lambda **kw: None):
        return runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")


def build(work: Path, out: str, force: bool = False) -> bytes:
    from setuptools import Distribution, Extension

    g = setup_globals()
    ext = Extension("hello", sources=[str(work / "hello.c")], optional=False)
    cmd = g["BuildExt"](Distribution({"name": "hello", "ext_modules": [ext]}))
    cmd.build_lib, cmd.build_temp, cmd.force = str(work / out), str(work / f"{out}-tmp"), force
    cmd.ensure_finalized()
    cmd.run()
    return Path(cmd.get_ext_fullpath("hello")).read_bytes()


def test_a_build_is_copied_from_the_cache_until_a_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGED_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "hello.c").write_text(SOURCE % "one")
    first = build(tmp_path, "a")
    (cached,) = (tmp_path / "cache" / "build").glob("*/hello*")
    assert cached.read_bytes() == first
    marker = first + b"\0copied, not compiled"
    cached.write_bytes(marker)  # what the cache holds is what the next build gives
    assert build(tmp_path, "b") == marker
    assert build(tmp_path, "c", force=True) == first  # --force compiles
    (tmp_path / "hello.c").write_text(SOURCE % "two")
    changed = build(tmp_path, "d")
    assert changed != marker
    assert len(list((tmp_path / "cache" / "build").glob("*/hello*"))) == 2


def test_an_unwritable_cache_costs_only_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cache").write_text("a file where the cache's directory should be")
    monkeypatch.setenv("PAGED_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "hello.c").write_text(SOURCE % "three")
    library = build(tmp_path, "a")
    assert library.startswith(b"\x7fELF") if sys.platform == "linux" else library
