"""Tensor parallelism: a worker that is stopped (SIGSTOP) mid-generate fails the step with
``WorkerError`` naming it within the collective timeout, and a Ctrl-C (SIGINT) while rank
0 waits in a collective that the stopped worker blocks is taken at once, not after the
timeout. Either way the group is shut down, the step recovered, and no process is left.
The timeout comes from ``PAGED_ENGINE_TP_TIMEOUT_S``, refused when it is not a number of
seconds. Each test spawns one worker; workers that raise, exit or are killed:
tests/test_tp_lifecycle.py, tests/test_tp.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paged_engine import LLM
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.worker import distributed as tpd
from paged_engine.worker.tp_process import WorkerError
from tests.tp_support import CONFIG, GREEDY, alive, assert_gone, bounded, make_prompts

ENV = "PAGED_ENGINE_TP_TIMEOUT_S"
STOPPED_TIMEOUT_S = 15.0
"""The collective timeout of the stopped-worker test: long enough for the start-up
collectives on a busy 2-core machine (the pool agreement waits while the fresh worker
imports transformers), short enough to wait for."""
INTERRUPT_BOUND_S = 10.0
"""A Ctrl-C must end the step this soon (rank 0 polls every 0.25 s; closing the group
kills the worker and waits for the collective to fail, at once under gloo)."""


def stopped_mid_generate(llm: LLM) -> tuple[LLMEngine, int]:
    """Four requests two steps in, then the worker stopped: the next step blocks in its
    first collective."""
    engine = llm.llm_engine
    for i, p in enumerate(make_prompts()[:4]):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    (pid,) = llm.model_runner.workers.pids  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    return engine, pid


def assert_recovered(engine: LLMEngine, pid: int) -> None:
    assert_gone([pid])
    sched = engine.scheduler
    assert not sched._in_flight
    everyone = [*sched.waiting, *sched.running]
    assert len(everyone) == 4  # no request lost
    engine.block_manager.check_invariants(everyone)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="workers were shut down"):
        engine.step()


@pytest.fixture
def resume() -> Iterator[list[int]]:
    """pids to SIGKILL at teardown, should a test fail with its worker still stopped."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_worker_fails_the_step_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, resume: list[int]
) -> None:
    """Before the fix the timeout was 300 s, fixed, and the step waited all of it."""
    monkeypatch.setenv(ENV, str(STOPPED_TIMEOUT_S))
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    engine, pid = stopped_mid_generate(llm)
    resume.append(pid)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) is stopped") as err:
        bounded(engine.step, STOPPED_TIMEOUT_S + 30)
    elapsed = time.monotonic() - start
    print(f"stopped worker reported after {elapsed:.1f} s (timeout {STOPPED_TIMEOUT_S} s)")
    assert elapsed >= STOPPED_TIMEOUT_S - 1  # the timeout decided, not something else
    assert "shut down" in "\n".join(getattr(err.value, "__notes__", []))
    assert_recovered(engine, pid)


def test_ctrl_c_in_a_blocked_collective_is_taken_at_once(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, resume: list[int]
) -> None:
    """The stopped worker would hold the collective for 120 s; SIGINT comes after 1 s.
    Before the fix rank 0 sat in gloo, deaf to it: the safety net below (SIGKILL to the
    worker after 30 s, which fails the collective) ended that step."""
    monkeypatch.setenv(ENV, "120")
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    engine, pid = stopped_mid_generate(llm)
    resume.append(pid)
    interrupt = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    net = threading.Timer(30.0, lambda: alive(pid) and os.kill(pid, signal.SIGKILL))
    start = time.monotonic()
    interrupt.start()
    net.start()
    try:
        with pytest.raises(KeyboardInterrupt) as err:
            engine.step()  # in the main thread, where Python delivers SIGINT
        elapsed = time.monotonic() - start
    finally:
        interrupt.cancel()
        net.cancel()
    print(f"Ctrl-C taken after {elapsed:.1f} s (sent at 1 s)")
    assert elapsed < 1.0 + INTERRUPT_BOUND_S
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "is stopped" in notes and "shut down" in notes
    assert_recovered(engine, pid)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, value: str
) -> None:
    import torch.distributed as dist

    monkeypatch.setenv(ENV, value)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=f"{ENV} must be a number of seconds > 0, got '{value}'"):
        LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    assert multiprocessing.active_children() == before and not dist.is_initialized()


def test_the_timeout_default_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert tpd.collective_timeout_s() == 60.0
    monkeypatch.setenv(ENV, " 2.5 ")
    assert tpd.collective_timeout_s() == 2.5
