"""Tensor-parallel lifecycle: a worker that raises or exits mid-forward fails ``generate``
with a clear error within a bound, aborts its requests, frees the pool and leaves no
process behind; no worker outlives its process (normal exit, SIGKILL); a model the ranks
cannot shard is refused before any worker starts, and the CLI flag. TP=2 equality and the
killed worker: tests/test_tp.py; stopped workers and Ctrl-C: tests/test_tp_interrupt.py.
The failure notes on Python 3.10, which has no ``add_note``.
"""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM
from paged_engine.worker import tp_worker
from paged_engine.worker.tp_process import WorkerError
from paged_engine.worker.tp_worker import SHUTDOWN_NOTE, WorkerGroup, add_note
from tests import tp_mutants
from tests.tp_support import CONFIG, GREEDY, assert_gone, bounded, make_prompts


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


# ---- failures ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        (tp_mutants.raising_worker, r"(?s)rank 1 \(pid \d+\) raised:.*IndexError"),
        (tp_mutants.exiting_worker, r"rank 1 \(pid \d+\) died \(code 77\)"),
    ],
    ids=["raises", "exits mid-forward"],
)
def test_a_failing_worker_fails_generate_cleanly(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    worker: Callable[..., None],
    expected: str,
) -> None:
    monkeypatch.setattr(tp_worker, "worker_main", worker)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    pids = llm.model_runner.workers.pids  # type: ignore[union-attr]
    with pytest.raises(WorkerError, match=expected):
        bounded(lambda: llm.generate(prompts[:3], GREEDY, use_tqdm=False))
    assert_gone(pids)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()  # generate aborted its requests
    assert engine.block_manager.num_free_blocks == CONFIG["num_kvcache_blocks"]  # type: ignore[union-attr]
    llm.close()  # already closed by the failure: a no-op


class NoAddNote(RuntimeError):
    """A RuntimeError as Python 3.10 has them: no ``add_note`` (requires-python >= 3.10)."""

    def __getattribute__(self, name: str) -> Any:
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


class NoAddNoteWorkerError(NoAddNote, WorkerError):
    pass


@pytest.mark.parametrize("kind", [NoAddNote, NoAddNoteWorkerError])
def test_a_failed_group_notes_its_shutdown_without_add_note(
    monkeypatch: pytest.MonkeyPatch, kind: type[RuntimeError]
) -> None:
    """Before the fix ``fail`` called ``err.add_note`` and raised AttributeError there."""
    monkeypatch.setattr(tp_worker, "REPORT_GRACE_S", 0.0)
    group = WorkerGroup.__new__(WorkerGroup)  # no workers, closed: fail() only notes
    group.workers, group.closed, group.failed = [], True, False
    err = kind("the collective failed")
    assert not hasattr(err, "add_note")
    assert group.fail(err) is err
    assert err.__notes__ == [SHUTDOWN_NOTE]  # type: ignore[attr-defined]
    assert str(err) == f"the collective failed\n{SHUTDOWN_NOTE}"  # 3.10 prints no notes
    add_note(err, "second")
    assert err.__notes__ == [SHUTDOWN_NOTE, "second"]  # type: ignore[attr-defined]


def test_add_note_uses_the_native_one_where_there_is_one() -> None:
    err = ValueError("message")
    add_note(err, "a note")
    assert err.__notes__ == ["a note"] and str(err) == "message"


EXIT_SCRIPT = """
import os, signal, sys
from paged_engine import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kvcache_blocks=16, max_model_len=64,
              num_threads=1)
    print(*llm.model_runner.workers.pids, flush=True)
    if sys.argv[2] == "kill":  # no atexit, no finalizer: the worker must notice alone
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_worker_outlives_its_process(tiny_model_dir: Path, tmp_path: Path, how: str) -> None:
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert out.returncode == (0 if how == "exit" else -signal.SIGKILL), out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1
    assert_gone(pids)


# ---- refusals ------------------------------------------------------------------------------


def test_a_model_that_does_not_divide_is_refused_before_any_worker_starts(
    tiny_model_dir: Path,
) -> None:
    import torch.distributed as dist

    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by"):
        LLM(tiny_model_dir, tensor_parallel_size=3, **CONFIG)
    assert multiprocessing.active_children() == before and not dist.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(tiny_model_dir, tensor_parallel_size=0)


SHAPE = {  # a model 2, 4 and 8 ranks can shard: 8 heads, 2 KV heads, 96 features, 64 tokens
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 64,
}


@pytest.mark.parametrize(
    ("field", "value", "size", "expected"),
    [
        ("num_attention_heads", 6, 4, "num_attention_heads=6 is not divisible by"),
        ("intermediate_size", 90, 4, "intermediate_size=90 is not divisible by"),
        ("vocab_size", 66, 4, "vocab_size=66 is not divisible by"),
        ("num_key_value_heads", 3, 2, "num_key_value_heads=3 is not divisible by"),  # split
        ("num_key_value_heads", 3, 4, "num_key_value_heads=3 does not divide"),  # replicated
    ],
)
def test_each_shape_that_does_not_divide_is_named(
    field: str, value: int, size: int, expected: str
) -> None:
    from types import SimpleNamespace

    from paged_engine.layers.parallel import check_divisible

    for n in (1, 2, 4, 8):  # the model as it is: every size accepted
        check_divisible(SimpleNamespace(**SHAPE), n)
    with pytest.raises(ValueError, match=f"{expected} tensor_parallel_size={size}"):
        check_divisible(SimpleNamespace(**SHAPE | {field: value}), size)


def test_the_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from paged_engine.__main__ import build_parser, main
    from paged_engine.entrypoints.cli_args import engine_fields

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "-tp", "2"])
    assert engine_fields(args)["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "m", "--prompt", "p", "--tensor-parallel-size", "0"])
    assert exit_info.value.code == 2
    assert "--tensor-parallel-size must be an int >= 1, got 0" in capsys.readouterr().err
