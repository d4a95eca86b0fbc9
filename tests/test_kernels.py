"""Moved: the Triton kernel tests are now tests/test_kernels_{decode,prefill,backends,gpu}.py,
with their shared layouts and helpers in tests/kernel_cases.py.

This module holds no tests. It re-exports the names tests/test_cpu_kernel.py imports from
here, until that import reads ``from tests.kernel_cases import ...``; then delete it.
"""

from __future__ import annotations

from tests.kernel_cases import (
    DECODE_CASES,
    TOL,
    Case,
    assert_close,
    cpu_id,
    decode_case,
    make_tensors,
    ref_decode,
    run_decode,
)

__all__ = [
    "DECODE_CASES",
    "TOL",
    "Case",
    "assert_close",
    "cpu_id",
    "decode_case",
    "make_tensors",
    "ref_decode",
    "run_decode",
]
