"""The GGUF conversion cache without a GGUF file (``utils/gguf_convert.py``): which crashed
conversions' temporary directories the next conversion removes, and the one cache root
that the conversions and the demo's tiny model share.

The reaper matters on a cache shared by hosts (an NFS home): a pid names a process only on
the host that wrote it, so another host's temporary directory is judged by its age alone,
and a live conversion there must survive whatever its pid means here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_engine.entrypoints.cli import build_parser
from paged_engine.utils import gguf_convert

OTHER_HOST = "build-node-7.example.org"


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A conversion's final directory (not written yet) and its parent, the gguf cache."""
    (tmp_path / "gguf").mkdir()
    return tmp_path / "gguf" / "tiny-0123456789abcdef"


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """A pid whose process has exited: no process of this host has it (checked)."""
    code = "import os; print(os.getpid())"
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    assert gguf_convert._no_process(pid)
    return pid


def temp_dir(out: Path, name: str, age_s: float = 0.0) -> Path:
    """A temporary directory of ``out`` with a file in it, last written ``age_s`` ago."""
    tmp = out.parent / name
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    then = time.time() - age_s
    for path in (tmp / "config.json", tmp):
        os.utime(path, (then, then))
    return tmp


def test_another_hosts_conversion_is_kept_whatever_its_pid_means_here(
    out: Path, dead_pid: int
) -> None:
    other = temp_dir(out, f".{out.name}.tmp-{OTHER_HOST}-{dead_pid}-k3x_9a")
    # a host whose name is ours with a suffix is another host too
    longer = temp_dir(out, f"{gguf_convert._temp_stem(out)}-12-{dead_pid}-k3x_9a")
    # an older version's name, without a host: whose it is cannot be told
    unnamed = temp_dir(out, f".{out.name}.tmp-{dead_pid}-k3x_9a")
    gguf_convert._remove_stale_temps(out)
    assert other.is_dir() and longer.is_dir() and unnamed.is_dir()


def test_this_hosts_conversion_is_removed_once_its_process_is_gone(
    out: Path, dead_pid: int
) -> None:
    stem = gguf_convert._temp_stem(out)
    crashed = temp_dir(out, f"{stem}-{dead_pid}-k3x_9a")
    running = temp_dir(out, f"{stem}-{os.getpid()}-k3x_9a")
    parent = temp_dir(out, f"{stem}-{os.getppid()}-k3x_9a")
    other_file = temp_dir(out, f"{gguf_convert._temp_stem(out.parent / 'x')}-{dead_pid}-k3x_9a")
    gguf_convert._remove_stale_temps(out)
    assert not crashed.exists()
    assert running.is_dir() and parent.is_dir() and other_file.is_dir()


def test_any_hosts_conversion_is_removed_once_nothing_was_written_for_a_day(
    out: Path,
) -> None:
    day = gguf_convert.STALE_TEMP_AGE_S
    assert day >= 6 * 3600  # generous: a conversion writes for minutes, and clocks differ
    old = temp_dir(out, f".{out.name}.tmp-{OTHER_HOST}-4242-k3x_9a", age_s=day + 60)
    unnamed = temp_dir(out, f".{out.name}.tmp-4242-k3x_9a", age_s=day + 60)
    # this host's, its pid taken since by a live process
    reused = temp_dir(out, f"{gguf_convert._temp_stem(out)}-{os.getppid()}-k3x_9a", day + 60)
    recent = temp_dir(out, f".{out.name}.tmp-{OTHER_HOST}-4243-k3x_9a", age_s=day - 600)
    # an old directory whose weights file is still being written is alive
    writing = temp_dir(out, f".{out.name}.tmp-{OTHER_HOST}-4244-k3x_9a", age_s=day + 60)
    (writing / "model.safetensors").write_bytes(b"...")
    os.utime(writing, (time.time() - day - 60,) * 2)
    gguf_convert._remove_stale_temps(out)
    assert not old.exists() and not unnamed.exists() and not reused.exists()
    assert recent.is_dir() and writing.is_dir()


def test_one_variable_moves_every_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def roots() -> tuple[Path, Path]:
        demo = Path(build_parser().parse_args(["demo"]).cache_dir)
        gguf = gguf_convert.GGUFSource(tmp_path / "m.gguf", 1, 2).cache_dir.parent
        assert gguf == gguf_convert.cache_root() / "gguf"
        return demo, gguf.parent

    monkeypatch.delenv(gguf_convert.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert roots() == (tmp_path / "home" / ".cache" / "paged_engine",) * 2
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert roots() == (tmp_path / "xdg" / "paged_engine",) * 2
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(tmp_path / "shared"))
    assert gguf_convert.CACHE_ENV == "PAGED_ENGINE_CACHE_DIR"
    assert roots() == (tmp_path / "shared",) * 2
