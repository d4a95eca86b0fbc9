"""A deliberately slowed allocator, to show that ``tox -e bench-compare`` catches a small
regression: ``tox -e bench-compare -- -p bench.slowed_allocator``.

A pytest plugin (loaded only when named with ``-p``), never part of the product: at
configure time it replaces the ``xxh64_intdigest`` that the engine's block hashing and the
block manager's inlined decode path call with one that computes one extra hash of the same
block bytes first, thrown away: the prefix-cache work a careless change might add. The spec
allocator has its own hashing (``spec.hashing``) and is untouched, so the ``engine/spec``
ratios fall while the spec's side of them stays put.

``PAGED_ENGINE_SLOW_HASH`` picks the extra hash: ``sha256`` (the default; measured here, it
slows the engine's allocator loop by about 25% at block size 16 and 9% at 256) or ``xxh64``
(3-5%: below the noise a tolerance must absorb on a shared 2-core machine, see
``bench/baselines/ratios.json``'s note).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from hashlib import sha256
from typing import Any

from xxhash import xxh64_intdigest

import paged_engine.engine.block_manager as block_manager
import paged_engine.engine.hashing as hashing

SLOWED_MODULES = (hashing, block_manager)


def _extra_sha256(data: bytes) -> None:
    sha256(data).digest()


def _extra_xxh64(data: bytes) -> None:
    xxh64_intdigest(data)


EXTRA: dict[str, Callable[[bytes], None]] = {"sha256": _extra_sha256, "xxh64": _extra_xxh64}


def slowed(extra: Callable[[bytes], None]) -> Callable[..., int]:
    def digest(data: bytes, seed: int = 0) -> int:
        extra(data)
        return xxh64_intdigest(data, seed)

    return digest


def pytest_configure(config: Any) -> None:
    name = os.environ.get("PAGED_ENGINE_SLOW_HASH", "sha256")
    if name not in EXTRA:
        raise ValueError(f"PAGED_ENGINE_SLOW_HASH must be one of {sorted(EXTRA)}, got {name!r}")
    for module in SLOWED_MODULES:
        if module.xxh64_intdigest is not xxh64_intdigest:
            raise RuntimeError(f"{module.__name__} no longer hashes with xxh64_intdigest")
    for module in SLOWED_MODULES:
        module.xxh64_intdigest = slowed(EXTRA[name])  # type: ignore[attr-defined]
    config.paged_engine_slow_hash = name


def pytest_report_header(config: Any) -> str:
    name = getattr(config, "paged_engine_slow_hash", "?")
    return f"bench.slowed_allocator: one extra {name} per engine block hash (deliberate)"


def pytest_unconfigure(config: Any) -> None:
    for module in SLOWED_MODULES:
        module.xxh64_intdigest = xxh64_intdigest  # type: ignore[attr-defined]
