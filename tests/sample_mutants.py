"""Deliberately broken builds of the sampler's argmax and finiteness pass
(``csrc/sample_ops.c``), each a patch file ``tests/sample_mutants/<name>.patch`` named after
its bug (the patch's first paragraph says what it breaks). Each is built as tests/
fused_mutants.py builds the fused ops' (baseline level, -O1) and bound in the launcher
(``sample_ops_cpu._COMPILED``) for the duration of a block; tests/test_sample_ops.py
requires each to fail the comparison the real pass passes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from paged_engine.kernels import sample_ops_cpu
from paged_engine.kernels.cpu_library import CompiledModule
from tests.fused_mutants import build_library_module
from tests.patch_mutants import ROOT

PATCH_DIR = ROOT / "tests" / "sample_mutants"

MUTANTS = ("ties_take_last", "lane_order_not_index", "tail_skipped", "sign_bit_in_finiteness")


@contextmanager
def mutant_active(name: str) -> Iterator[None]:
    """The pass built from csrc/ with mutant ``name``'s patch, bound in the launcher."""
    module = build_library_module(name, PATCH_DIR / f"{name}.patch", "sample_ops.c", "_sample_ops")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sample_ops_cpu, "_COMPILED", CompiledModule.of(module))
        yield
