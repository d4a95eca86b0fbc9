"""The C heap of the process that runs a model on the CPU: ``keep_freed_memory`` asks glibc
to keep the memory a step frees for the next step, instead of handing it back to the kernel.

Why it exists: on the CPU torch has no caching allocator, so every step allocates its
activations afresh through ``malloc`` and frees them at its end. glibc's defaults return
much of that memory to the kernel: a block of 128 KiB or more is its own ``mmap`` (the
threshold rises with the blocks freed, up to 32 MiB), and a free top of the heap larger
than twice that threshold is trimmed. A step frees several large activations at once (a
prefill's projections and MLP are MiBs each), so the heap's top is trimmed and the next
step's activations are new pages again: a page fault per 4 KiB on first write, each page
zeroed by the kernel, inside the matmul that writes it. vLLM's CPU build preloads tcmalloc
for the same reason; this does it with the allocator the process already has. The faults
and times it saves are in ``docs/performance.md`` ("The C heap between steps").

The setting, ``$PAGED_ENGINE_CPU_MALLOC``:

* ``"keep"`` (the default): blocks up to ``MMAP_THRESHOLD`` come from the heap, and the
  heap is trimmed only when its free top exceeds ``TRIM_THRESHOLD``; it grows by
  ``TOP_PAD`` beyond each request. Memory freed stays in the process, up to its peak.
* ``"off"``: glibc's defaults.

Process-wide and not undone (``mallopt`` has no scope); only where the C library is glibc
(Linux), elsewhere nothing is changed. Torch-free.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping

__all__ = ["ENV", "glibc", "keep_freed_memory", "malloc_setting"]

logger = logging.getLogger("paged_engine")

ENV = "PAGED_ENGINE_CPU_MALLOC"
SETTINGS = ("keep", "off")
DEFAULT = "keep"

MMAP_THRESHOLD = 32 * 2**20
"""Blocks below this come from the heap: glibc's largest accepted value on 64-bit."""
TRIM_THRESHOLD = 2**30
"""The heap's free top is given back only beyond this."""
TOP_PAD = 64 * 2**20
"""Extra bytes the heap takes each time it grows, so that it grows seldom."""

# mallopt's parameter numbers (<malloc.h>)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
PARAMS = (
    ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ("M_TOP_PAD", M_TOP_PAD, TOP_PAD),
)
"""All three: setting any one ends glibc's own raising of the thresholds, so a trim
threshold set alone would leave blocks of 128 KiB and more on their own ``mmap``."""


def malloc_setting(environ: Mapping[str, str] | None = None) -> str:
    """The setting from ``$PAGED_ENGINE_CPU_MALLOC`` (``DEFAULT`` when unset or empty).

    Raises ValueError naming the variable for anything else than ``SETTINGS``."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    value = raw.strip().lower() or DEFAULT
    if value not in SETTINGS:
        raise ValueError(f"{ENV}={raw!r}: use one of {', '.join(map(repr, SETTINGS))}")
    return value


def glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, where it is glibc (it has
    ``gnu_get_libc_version`` and ``mallopt``); None elsewhere (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process
    except OSError:
        return None
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    return libc


def keep_freed_memory(setting: str | None = None) -> bool:
    """Apply ``setting`` (None: ``malloc_setting()``, the environment's) to this process's
    heap; True where glibc took every parameter.

    A bad setting raises ValueError before anything is changed. A C library that is not
    glibc, or a parameter it refuses, changes nothing more and is logged."""
    value = malloc_setting({ENV: setting} if setting is not None else None)
    if value == "off":
        return False
    libc = glibc()
    if libc is None:
        logger.info("%s=%r: the C library is not glibc here, its heap is left as it is", ENV, value)
        return False
    for name, param, amount in PARAMS:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(amount)) != 1:
            logger.warning("%s: glibc refused mallopt(%s, %d); left there", ENV, name, amount)
            return False
    return True
