"""``bench/bandwidth.py``'s buffer sizes: larger than the last-level cache sysfs reports, so
that "cold" and "stream" read memory, not the cache (run by ``tox -e py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bandwidth import COLD_BYTES, STREAM_BYTES, last_level_cache_bytes, sized
from paged_engine import platform


def fake_caches(root: Path, sizes: dict[str, str]) -> Path:
    for index, size in sizes.items():
        (root / index).mkdir(parents=True)
        (root / index / "size").write_text(size + "\n")
    return root


def test_the_largest_cache_is_the_last_level(tmp_path: Path) -> None:
    root = fake_caches(tmp_path, {"index0": "48K", "index2": "2048K", "index3": "491520K"})
    assert last_level_cache_bytes(root) == 491520 * 1024
    assert last_level_cache_bytes(fake_caches(tmp_path / "m", {"index3": "32M"})) == 32 * 2**20
    assert last_level_cache_bytes(tmp_path / "none") is None


def test_reads_cpu0_under_the_platform_probes_root_and_skips_unreadable_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_caches(tmp_path / "cpu0" / "cache", {"index0": "48K", "index3": "32768K"})
    (tmp_path / "cpu0" / "cache" / "index4" / "size").mkdir(parents=True)  # unreadable
    monkeypatch.setattr(platform, "SYS_CPU", tmp_path)
    assert last_level_cache_bytes() == 32 * 2**20


def test_buffers_outgrow_a_large_cache_and_keep_their_floor() -> None:
    big = 480 * 2**20  # the Xeon VM whose L3 held the 256 MiB pools
    assert sized(COLD_BYTES, big) == 4 * big
    assert sized(STREAM_BYTES, big) == 4 * big
    assert sized(COLD_BYTES, 32 * 2**20) == COLD_BYTES  # a 32 MiB cache: the floor stays
    assert sized(STREAM_BYTES, None) == STREAM_BYTES
