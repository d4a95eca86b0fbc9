"""Transparent huge pages for a CPU KV pool: the kernel's mode, and the advice to use them
(``bench/bandwidth.py`` and ``bench/test_huge_pages_bench.py`` measure what they change).

Why measure it: decode attention reads the pool block by block in block-table order, and
one sequence's blocks may lie anywhere in a pool of hundreds of MiB. With 4 KiB pages each
page a block touches is another address translation, and the TLB covers a few MiB; a 2 MiB
page holds 128 of the 29M model's 16 KiB K blocks. The product does not advise its pool:
end to end the advice measured no faster (``docs/performance.md``), and it costs memory
(a touched block commits its whole 2 MiB page).

Linux only, and only where the kernel's THP mode is ``always`` or ``madvise`` (its file
``/sys/kernel/mm/transparent_hugepage/enabled``). Torch-free: the caller gives the address
and size.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
"""The kernel's THP mode: its words, the one in force bracketed (``always [madvise] never``)."""
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice for THP (``<asm-generic/mman-common.h>``)."""
HUGE_PAGE_BYTES = 2 * 2**20
"""The smallest range worth advising: one x86-64 / aarch64 (4 KiB granule) huge page."""


def transparent_huge_pages() -> str | None:
    """The THP mode in force (``"always"``, ``"madvise"`` or ``"never"``), or None where the
    kernel says nothing (not Linux, or built without THP)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    if "[" not in text or "]" not in text:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def huge_pages_usable() -> bool:
    """Whether advice can take effect here: Linux, with THP ``always`` or ``madvise``."""
    return sys.platform.startswith("linux") and transparent_huge_pages() in ("always", "madvise")


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Advise the kernel to back ``[address, address + nbytes)`` with huge pages
    (``madvise(MADV_HUGEPAGE)`` over the whole small pages inside it). Give the advice
    before the memory is first written: pages already faulted in stay small until the
    kernel's background collapse gets to them. True when the advice was taken; False (and
    nothing changed) off Linux, where THP is ``never`` or absent, for a range smaller than
    one huge page, or when ``madvise`` refuses it."""
    if address < 0 or nbytes < 0:
        raise ValueError(f"advise_huge_pages: address {address} and nbytes {nbytes} must be >= 0")
    if not huge_pages_usable():
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end - start < HUGE_PAGE_BYTES:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return bool(libc.madvise(start, end - start, MADV_HUGEPAGE) == 0)
