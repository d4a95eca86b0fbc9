"""The Ray paths across several Ray nodes, simulated on this host (``ray.cluster_utils.Cluster``:
a head with 0 CPUs, where this driver runs, and two worker nodes of 1 CPU each, which share
the host's address and differ by node id only; every actor lands on a worker node).

Tensor parallelism (``distributed_executor_backend="ray"``): with rank 1's actor on another
node than rank 0, the group chooses the broadcast hand-off by itself and TP=2 is token for
token TP=1; close removes the placement group and the actor's process; losing the node of
rank 1 mid-generate raises ``WorkerError`` within a bound and leaves the scheduler
consistent. Data parallelism (``RayReplicas``, SPREAD): the replicas run on two different
worker nodes; losing one replica's node fails only that replica's request, ``/metrics``
counts it dead, and the other replica goes on and answers a new request as offline
``generate`` does.

Skipped without Ray (``pip install 'paged_engine[ray]'``; tox -e ray).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.entrypoints.loop_types import RequestFailed
from paged_engine.worker.handoff import BroadcastChannel
from paged_engine.worker.tp_process import WorkerError
from tests.ray_dp_support import BLOCK, failure_of, released, served
from tests.tp_support import CONFIG, GREEDY, alive, assert_gone, bounded, make_prompts, tokens_of

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from paged_engine.worker import ray_executor  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WORKER_NODES = 2
RAY = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray", **CONFIG}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head with 0 CPUs (this driver's node) and two worker nodes of 1 CPU each."""
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(WORKER_NODES):
            made.add_node(num_cpus=1)
        ray.init(address=made.address, include_dashboard=False, log_to_driver=False)
        made.wait_for_nodes()
        yield made
    finally:
        ray.shutdown()
        made.shutdown()  # type: ignore[no-untyped-call]


def refill(cluster: Cluster, within: float = 30.0) -> None:
    """Add worker nodes until there are two again (a test removes one), and wait until
    Ray sees them and both CPUs are free."""
    while len(cluster.worker_nodes) < WORKER_NODES:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    deadline = time.monotonic() + within
    while ray.available_resources().get("CPU", 0.0) != WORKER_NODES:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


@pytest.fixture
def nodes(cluster: Cluster) -> Cluster:
    refill(cluster)
    return cluster


def driver_node() -> str:
    return str(ray.get_runtime_context().get_node_id())


def node_of(cluster: Cluster, node_id: str) -> Any:
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    return node


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def tp1_tokens(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(tiny_model_dir, **CONFIG) as llm:
        return tokens_of(llm, prompts)


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, block_size=BLOCK, num_threads=1)


def group_removed(group: Any, within: float = 15.0) -> None:
    """The group's placement group is removed and its actors' processes are gone."""
    table = ray.util.placement_group_table(group.placement_group)
    assert table["state"] == "REMOVED", table
    assert_gone([w.pid for w in group.workers], within)


def test_tp2_across_nodes_chooses_the_broadcast_and_matches_tp1(
    nodes: Cluster, tiny_model_dir: Path, prompts: list[list[int]], tp1_tokens: list[list[int]]
) -> None:
    assert nodes.head_node is not None and driver_node() == nodes.head_node.node_id
    llm = LLM(tiny_model_dir, **RAY)
    group = llm.model_runner.workers
    assert isinstance(group, ray_executor.RayWorkerGroup)
    (worker,) = group.workers
    (actor,) = group.actors
    node_id, _, pid = ray.get(actor.where.remote())
    assert pid == worker.pid and alive(pid)
    assert node_id != driver_node()
    assert node_id in {n.node_id for n in nodes.worker_nodes}
    table = ray.util.placement_group_table(group.placement_group)
    assert table["strategy"] == "PACK"  # the default: the broadcast was not asked for
    assert isinstance(group.channel, BroadcastChannel)
    tokens = tokens_of(llm, prompts)
    assert [i for i, (a, b) in enumerate(zip(tokens, tp1_tokens, strict=True)) if a != b] == []
    llm.close()
    group_removed(group)
    refill(nodes)  # every CPU free again: nothing of the group holds one


def test_the_node_of_rank_1_lost_mid_generate_raises_worker_error(
    nodes: Cluster, tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    llm = LLM(tiny_model_dir, **RAY)
    engine = llm.llm_engine
    group: Any = llm.model_runner.workers  # type: ignore[union-attr]
    node_id, _, _ = ray.get(group.actors[0].where.remote())
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    nodes.remove_node(node_of(nodes, node_id))
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(Ray actor, pid \d+ on .*\) died"):
        bounded(lambda: [engine.step() for _ in range(100)])
    assert time.monotonic() - start < 15.0
    group_removed(group)
    sched = engine.scheduler  # the step was recovered: nothing in flight, R12 holds
    assert not sched._in_flight
    engine.block_manager.check_invariants([*sched.waiting, *sched.running])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="workers were shut down"):
        engine.step()
    llm.close()
    refill(nodes)


def test_a_lost_node_fails_only_its_replicas_request(
    nodes: Cluster, tiny_model_dir: Path, offline: LLM
) -> None:
    with served(tiny_model_dir, 2, placement="SPREAD") as s:
        ids = [node_id for node_id, _, _ in s.replicas.nodes]
        assert len(set(ids)) == 2 and driver_node() not in ids
        assert set(ids) == {n.node_id for n in nodes.worker_nodes}
        assert s.alive_gauges() == [1.0, 1.0]
        sinks = [s.submit("a", [1, 2, 3]), s.submit("b", [4, 5, 6])]
        assert s.dp._owner == {"a": 0, "b": 1}
        assert [s.call(sink.get()).request_id for sink in sinks] == ["a", "b"]  # both running
        nodes.remove_node(node_of(nodes, ids[0]))
        event = failure_of(s, sinks[0])
        assert event.status == 500 and "replica 0 (Ray actor" in event.message, event
        assert not isinstance(s.call(sinks[1].get()), RequestFailed)  # b goes on
        assert s.alive_gauges() == [0.0, 1.0]
        assert s.dp.loads() == [0, 1] and s.dp.routed == [1, 1]
        s.dp.abort(["b"])
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        sink = s.submit("c", [7, 8, 9], params)
        assert s.dp.routed == [1, 2]  # the live replica takes it
        while not (out := s.call(sink.get())).finished:
            pass
        want = offline.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    refill(nodes)
    released(ray, s.replicas, float(WORKER_NODES))
