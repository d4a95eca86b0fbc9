"""``worker/cpu_malloc.py``: the setting, the exact ``mallopt`` calls, and what they change
(the page faults of a step-like allocation pattern, in fresh processes), and the model
runner applying it."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine.worker import cpu_malloc, model_runner
from paged_engine.worker.cpu_malloc import ENV, keep_freed_memory, malloc_setting

ROOT = Path(__file__).resolve().parent.parent
GLIBC = cpu_malloc.glibc() is not None


class RecordingLibc:
    """A C library that records ``mallopt`` calls and answers ``results`` in turn."""

    def __init__(self, *results: int) -> None:
        self.calls: list[tuple[int, int]] = []
        self.results = list(results) or [1, 1, 1]

    def mallopt(self, param: ctypes.c_int, value: ctypes.c_int) -> int:
        self.calls.append((param.value, value.value))
        return self.results[len(self.calls) - 1]


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> RecordingLibc:
    fake = RecordingLibc()
    monkeypatch.setattr(cpu_malloc, "glibc", lambda: fake)
    return fake


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, "keep"), ({ENV: ""}, "keep"), ({ENV: "keep"}, "keep"), ({ENV: " OFF "}, "off")],
)
def test_the_setting_comes_from_the_environment(environ: dict[str, str], expected: str) -> None:
    assert malloc_setting(environ) == expected


def test_keep_sets_the_three_parameters_in_order(libc: RecordingLibc) -> None:
    assert keep_freed_memory("keep") is True
    # M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB, M_TOP_PAD 64 MiB
    assert libc.calls == [(-3, 33554432), (-1, 1073741824), (-2, 67108864)]


def test_off_changes_nothing(libc: RecordingLibc) -> None:
    assert keep_freed_memory("off") is False
    assert libc.calls == []


@pytest.mark.parametrize("value", ["tcmalloc", "on", "1"])
def test_a_bad_setting_is_refused_before_any_call(
    libc: RecordingLibc, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    with pytest.raises(ValueError, match=f"{ENV}={value!r}: use one of 'keep', 'off'"):
        keep_freed_memory(value)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        keep_freed_memory()
    assert libc.calls == []


def test_a_refused_parameter_stops_there_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = RecordingLibc(1, 0, 1)
    monkeypatch.setattr(cpu_malloc, "glibc", lambda: fake)
    with caplog.at_level(logging.WARNING, logger="paged_engine"):
        assert keep_freed_memory("keep") is False
    assert fake.calls == [(-3, 33554432), (-1, 1073741824)]
    assert "glibc refused mallopt(M_TRIM_THRESHOLD, 1073741824)" in caplog.text


def test_without_glibc_nothing_is_changed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_malloc, "glibc", lambda: None)
    with caplog.at_level(logging.INFO, logger="paged_engine"):
        assert keep_freed_memory("keep") is False
    assert "the C library is not glibc here" in caplog.text


# A step in miniature: several large blocks live at once, all freed at its end. glibc's
# defaults trim the heap's free top after each such step, so the next one faults its pages
# in again; kept, the later steps reuse them. 3 blocks of 24 MiB: whatever glibc's own
# threshold has risen to in the process (at most 32 MiB), 72 MiB freed at once exceeds
# twice it, so the defaults trim (or map each block by itself) every time.
CHILD = """
import ctypes, json, resource, sys
from paged_engine.worker.cpu_malloc import glibc, keep_freed_memory
setting, how = sys.argv[1], sys.argv[2]
libc = glibc()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if how == "direct":
    keep_freed_memory(setting)
else:  # through the engine: an LLM on the CPU with the setting in its environment
    import os
    from paged_engine import LLM
    os.environ["PAGED_ENGINE_CPU_MALLOC"] = setting
    LLM(how, num_threads=1, num_kvcache_blocks=16, max_model_len=256)
size = 24 * 2**20
faults = []
for step in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("FAULTS " + json.dumps(faults[1:]))
"""


def step_faults(setting: str, how: str = "direct") -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, setting, how],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("FAULTS "))
    return list(json.loads(line.removeprefix("FAULTS ")))


PAGES = 3 * 24 * 2**20 // 4096
"""The pages of one miniature step's blocks."""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's: this C library is not glibc")
def test_kept_memory_is_not_faulted_in_again() -> None:
    off, keep = step_faults("off"), step_faults("keep")
    # glibc's defaults: every later step faults its blocks' pages in again
    assert all(f >= PAGES // 2 for f in off), off
    # kept: the heap the first step grew is reused
    assert all(f < PAGES // 20 for f in keep), keep


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's: this C library is not glibc")
def test_an_engine_on_the_cpu_keeps_its_heap(tiny_model_dir: Path) -> None:
    keep, off = step_faults("keep", str(tiny_model_dir)), step_faults("off", str(tiny_model_dir))
    assert all(f < PAGES // 20 for f in keep), keep
    assert all(f >= PAGES // 2 for f in off), off


def test_an_engine_refuses_a_bad_setting_before_any_process_wide_change(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    applied: list[Any] = []
    monkeypatch.setattr(model_runner, "keep_freed_memory", applied.append)
    monkeypatch.setenv(ENV, "jemalloc")
    threads = torch.get_num_threads()
    from paged_engine import LLM

    with pytest.raises(ValueError, match=f"{ENV}='jemalloc'"):
        LLM(str(tiny_model_dir), num_threads=threads + 1, num_kvcache_blocks=16, max_model_len=256)
    assert applied == []
    assert torch.get_num_threads() == threads
    monkeypatch.setenv(ENV, "off")
    LLM(str(tiny_model_dir), num_threads=threads, num_kvcache_blocks=16, max_model_len=256).close()
    assert applied == ["off"]
