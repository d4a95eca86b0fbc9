"""Tensor parallelism on Ray (``distributed_executor_backend="ray"``) against a local Ray
cluster started here (2 CPUs): TP=2 with rank 1 as a Ray actor is token for token TP=1
and the "mp" backend on the tiny model, with prefix hits, chunked prefill and preemption
(tests/tp_support.py's configuration), over both hand-offs; an actor killed by
``ray.kill`` mid-generate raises ``WorkerError`` within a bound and leaves no actor and
no placement group; ``close()`` and the ``with`` block release them; a rank given the
wrong shard is caught by the comparison; bad values are refused with nothing started.

Skipped without Ray (``pip install 'paged_engine[ray]'``; tox -e ray).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM
from paged_engine.config import EngineConfig
from paged_engine.worker.handoff import BroadcastChannel, ShmChannel
from paged_engine.worker.tp_process import WorkerError
from tests.tp_support import CONFIG, GREEDY, alive, assert_gone, bounded, make_prompts, tokens_of

ray = pytest.importorskip("ray")

from paged_engine.worker import ray_executor  # noqa: E402 - after the skip: imports nothing of Ray
from tests import ray_mutants  # noqa: E402

RAY = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray", **CONFIG}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A local Ray cluster for the module; the mutant module is pickled by value, so the
    actors need not find ``tests`` on their path."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(ray_mutants)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def tp1_tokens(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(tiny_model_dir, **CONFIG) as llm:
        return tokens_of(llm, prompts)


def check(tokens: list[list[int]], want: list[list[int]], what: str) -> None:
    differ = [i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b]
    assert not differ, f"Ray TP=2 differs from {what} in requests {differ}"


def released(cluster: Any, group: Any, within: float = 15.0) -> None:
    """The group's placement group is removed, its actors' processes are gone, and every
    CPU of the cluster is free again."""
    table = cluster.util.placement_group_table(group.placement_group)
    assert table["state"] == "REMOVED", table
    assert_gone([w.pid for w in group.workers], within)
    deadline = time.monotonic() + within
    while cluster.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.available_resources().get("CPU") == 2.0, cluster.available_resources()


def run_and_check(llm: LLM, tp1: list[list[int]], prompts: list[list[int]]) -> None:
    first = tokens_of(llm, prompts)
    stats = llm.last_run_stats
    assert stats is not None and stats.preemptions > 0
    assert stats.steps > stats.prefill_tokens // 19  # chunked prefill
    second = tokens_of(llm, prompts)  # prefix hits now
    stats = llm.last_run_stats
    assert stats is not None and stats.cached_prompt_tokens > 0
    check(first, tp1, "TP=1")
    check(second, tp1, "TP=1")


def test_ray_tp2_is_token_identical_to_tp1_and_mp(
    cluster: Any, tiny_model_dir: Path, prompts: list[list[int]], tp1_tokens: list[list[int]]
) -> None:
    with LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG) as mp_llm:
        mp_tokens = tokens_of(mp_llm, prompts)
    llm = LLM(tiny_model_dir, **RAY)
    group = llm.model_runner.workers  # type: ignore[union-attr]
    assert isinstance(group, ray_executor.RayWorkerGroup)
    assert isinstance(group.channel, ShmChannel)  # one node: the shared-memory hand-off
    assert llm.model_runner.tp.size == 2  # type: ignore[union-attr]
    (worker,) = group.workers
    assert alive(worker.pid)
    run_and_check(llm, tp1_tokens, prompts)
    check(tokens_of(llm, prompts), mp_tokens, '"mp"')
    llm.close()
    released(cluster, group)


class BroadcastGroup(ray_executor.RayWorkerGroup):
    """The hand-off used across nodes (broadcast on its own group), forced on one node."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, transport="broadcast", **kwargs)


def test_the_broadcast_hand_off_and_the_with_block(
    cluster: Any,
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    tp1_tokens: list[list[int]],
) -> None:
    monkeypatch.setattr(ray_executor, "RayWorkerGroup", BroadcastGroup)
    with LLM(tiny_model_dir, **RAY) as llm:
        group = llm.model_runner.workers  # type: ignore[union-attr]
        assert isinstance(group.channel, BroadcastChannel)
        run_and_check(llm, tp1_tokens, prompts)
    released(cluster, group)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)


def test_an_actor_killed_mid_generate_raises_worker_error(
    cluster: Any, tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    llm = LLM(tiny_model_dir, **RAY)
    engine = llm.llm_engine
    group = llm.model_runner.workers  # type: ignore[union-attr]
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    cluster.kill(group.actors[0], no_restart=True)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(Ray actor, pid \d+ on .*\) died"):
        bounded(lambda: [engine.step() for _ in range(100)])
    assert time.monotonic() - start < 15.0
    released(cluster, group)
    sched = engine.scheduler  # the step was recovered: nothing in flight, R12 holds
    assert not sched._in_flight
    engine.block_manager.check_invariants([*sched.waiting, *sched.running])  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="workers were shut down"):
        engine.step()
    llm.close()


class WrongShardGroup(ray_executor.RayWorkerGroup):
    entry = staticmethod(ray_mutants.wrong_shard_rank)


def test_the_equality_check_catches_a_rank_with_the_wrong_shard(
    cluster: Any,
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    tp1_tokens: list[list[int]],
) -> None:
    monkeypatch.setattr(ray_executor, "RayWorkerGroup", WrongShardGroup)
    with LLM(tiny_model_dir, **RAY) as llm:
        tokens = tokens_of(llm, prompts)
        group = llm.model_runner.workers  # type: ignore[union-attr]
    released(cluster, group)
    with pytest.raises(AssertionError, match="differs from TP=1"):
        check(tokens, tp1_tokens, "TP=1")


def test_bad_values_are_refused_with_nothing_started(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    groups = cluster.util.placement_group_table()
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(tiny_model_dir, tensor_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(distributed_executor_backend="")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ImportError, match=r"paged_engine\[ray\]"):
        LLM(tiny_model_dir, **RAY)
    monkeypatch.undo()
    assert cluster.util.placement_group_table() == groups
    assert cluster.available_resources().get("CPU") == 2.0


def test_the_placement_comes_from_the_environment(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setenv("PAGED_ENGINE_RAY_PLACEMENT", "spread")
    with LLM(tiny_model_dir, **RAY) as llm:
        group = llm.model_runner.workers  # type: ignore[union-attr]
        table = cluster.util.placement_group_table(group.placement_group)
        assert table["strategy"] == "SPREAD", table
    released(cluster, group)
    groups = cluster.util.placement_group_table()
    monkeypatch.setenv("PAGED_ENGINE_RAY_PLACEMENT", "ANYWHERE")
    with pytest.raises(ValueError, match=r"\$PAGED_ENGINE_RAY_PLACEMENT must be one of"):
        LLM(tiny_model_dir, **RAY)
    assert cluster.util.placement_group_table() == groups  # nothing placed


def test_the_cli_flag() -> None:
    import argparse

    from paged_engine.entrypoints.cli_args import add_engine_args, engine_fields

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    given = parser.parse_args(["--distributed-executor-backend", "ray"])
    assert engine_fields(given)["distributed_executor_backend"] == "ray"
    assert engine_fields(parser.parse_args([]))["distributed_executor_backend"] == "mp"
