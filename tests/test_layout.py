"""The tree shows the architecture: ``engine/`` is CPU bookkeeping and never imports torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import paged_engine.engine


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
