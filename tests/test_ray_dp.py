"""Data-parallel replicas as Ray actors (``dp_ray``; ``serve --data-parallel-backend ray``) on a
local 2-CPU Ray cluster started here: each replica is an actor of its own whose core
answers as offline ``generate``; the router keeps each shared prefix on one replica (the
prefix cache serves 240 tokens, a round-robin mutant 160); an actor killed by
``ray.kill`` fails only its own in-flight request, ``/metrics`` shows it dead and the
router sends the next request to the live one; close releases the actors, the placement
group and the CPUs; a model the core refuses, an actor that fails before serving and too
few CPUs each fail the launch by name with nothing left; and ``serve`` itself joins this
cluster (``RAY_ADDRESS``), answers, survives a replica's death and releases everything
on SIGTERM. The flags' refusals are in ``test_dp_args.py`` (no Ray needed).

Skipped without Ray (``pip install 'paged_engine[ray]'``; tox -e ray).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.entrypoints.dp_client import DPClient
from paged_engine.entrypoints.dp_remote import ReplicaError
from paged_engine.entrypoints.loop_types import RequestFailed
from tests.ray_dp_support import BLOCK, core_spec, failure_of, released, served
from tests.test_dp_routing import PARAMS, RoundRobin, run, shared_prefix_prompts
from tests.test_server_support import MODEL, PROMPTS, parse_metrics, serve_process
from tests.tp_support import alive

ray = pytest.importorskip("ray")

from paged_engine.entrypoints.dp_ray import RayReplicas  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, block_size=BLOCK, num_threads=1)


@pytest.mark.parametrize(("router", "cached"), [(DPClient, 240), (RoundRobin, 160)])
def test_replicas_are_actors_that_answer_as_offline_and_keep_prefixes_together(
    cluster: Any, tiny_model_dir: Path, offline: LLM, router: type[DPClient], cached: int
) -> None:
    with served(tiny_model_dir) as s:
        pids = [pid for _, _, pid in s.replicas.nodes]
        assert [c.info.pid for c in s.cores] == pids  # type: ignore[union-attr]
        assert len(set(pids)) == 2 and os.getpid() not in pids and all(map(alive, pids))
        assert s.alive_gauges() == [1.0, 1.0]
        dp = router(s.cores)
        prompts = shared_prefix_prompts(10)
        outs = run(dp, s.loop, prompts, router.__name__)
        want = offline.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
        assert sum(o.num_cached_tokens for o in outs) == cached
        if router is DPClient:
            assert sorted(dp.routed) == [4, 4]


def test_a_killed_replica_fails_only_its_own_request(
    cluster: Any, tiny_model_dir: Path, offline: LLM
) -> None:
    with served(tiny_model_dir) as s:
        sinks = [s.submit("a", [1, 2, 3]), s.submit("b", [4, 5, 6])]
        assert s.dp._owner == {"a": 0, "b": 1}
        for sink in sinks:
            assert s.call(sink.get()).request_id in ("a", "b")  # both running
        cluster.kill(s.replicas.actors[0], no_restart=True)
        event = failure_of(s, sinks[0])
        assert event.status == 500 and "replica 0 (Ray actor" in event.message, event
        assert not isinstance(s.call(sinks[1].get()), RequestFailed)  # b goes on
        assert s.alive_gauges() == [0.0, 1.0]
        assert s.dp.loads() == [0, 1] and s.dp.choose([]) == 1
        s.dp.abort(["b"])
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        sink = s.submit("c", [7, 8, 9], params)  # the live replica takes it
        while not (out := s.call(sink.get())).finished:
            pass
        want = offline.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    released(cluster, s.replicas, 2.0)


def test_close_releases_the_actors_the_group_and_the_cpus(
    cluster: Any, tiny_model_dir: Path
) -> None:
    with served(tiny_model_dir) as s:
        assert cluster.available_resources().get("CPU", 0.0) == 0.0  # 1 CPU each
    released(cluster, s.replicas, 2.0)


def test_a_model_the_core_refuses_fails_the_launch_with_its_error(
    cluster: Any, tiny_model_dir: Path
) -> None:
    spec = core_spec(tiny_model_dir, max_model_len=10**7)
    replicas = RayReplicas(spec, 2, connect_timeout=60)
    with pytest.raises(Exception, match="max_model_len"):
        replicas.launch()
    released(cluster, replicas, 2.0)


class Unloadable:
    """Pickles fine here; unpickling it in the actor raises ZeroDivisionError."""

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return divmod, (1, 0)


def test_an_actor_that_fails_before_serving_fails_the_launch_by_name(
    cluster: Any, tiny_model_dir: Path
) -> None:
    replicas = RayReplicas(core_spec(tiny_model_dir, broken=Unloadable()), 2)
    start = time.monotonic()
    with pytest.raises(
        ReplicaError, match=r"(?s)replica actor \d ended before serving:.*ZeroDivisionError"
    ):
        replicas.launch()
    assert time.monotonic() - start < 30.0  # not the 300 s connect timeout
    released(cluster, replicas, 2.0)


def test_too_few_cpus_are_named(cluster: Any, tiny_model_dir: Path) -> None:
    replicas = RayReplicas(core_spec(tiny_model_dir), 3, connect_timeout=2.0)
    with pytest.raises(ReplicaError, match=r"could not place 3 data-parallel replicas"):
        replicas.launch()
    released(cluster, replicas, 2.0)
    with pytest.raises(ValueError, match="placement must be one of"):
        RayReplicas(core_spec(tiny_model_dir), 2, placement="STRICT")


def actor_pids() -> list[int]:
    """The replica actors' processes on this machine (Ray titles them ``ray::ReplicaActor``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::ReplicaActor") and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_serve_joins_the_cluster_and_survives_a_replica(
    cluster: Any, tiny_model_dir: Path, offline: LLM
) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS[:2], params, use_tqdm=False)]
    address = cluster.get_runtime_context().gcs_address
    flags = ("--data-parallel-size", "2", "--data-parallel-backend", "ray")
    with serve_process(tiny_model_dir, *flags, env={"RAY_ADDRESS": address}) as (url, proc):
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def answer(prompt: str) -> str:
            extra = {"ignore_eos": True}
            got = api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
            )
            return got.choices[0].text

        assert [answer(p) for p in PROMPTS[:2]] == want

        def gauges() -> list[float]:
            m = parse_metrics(httpx.get(url + "/metrics").text)
            return [m[f'dp_replica_alive{{replica="{i}"}}'] for i in (0, 1)]

        assert gauges() == [1.0, 1.0]
        pids = actor_pids()
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while sorted(gauges()) != [0.0, 1.0]:
            assert time.monotonic() < deadline, "the dead replica is still counted alive"
            time.sleep(0.1)
        assert answer(PROMPTS[0]) == want[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    released_after_serve(cluster)


def released_after_serve(cluster: Any, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while actor_pids() or cluster.available_resources().get("CPU") != 2.0:
        assert time.monotonic() < deadline, (actor_pids(), cluster.available_resources())
        time.sleep(0.1)
    for group in cluster.util.placement_group_table().values():
        assert group["state"] == "REMOVED", group


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (field 6 of ``/proc/PID/stat``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_serve_with_its_own_ray_ends_on_a_signal_to_its_whole_group(
    cluster: Any, tiny_model_dir: Path
) -> None:
    """As a terminal's or ``timeout``'s signal: it reaches the local Ray that serve's
    ``ray.init()`` started too, whose raylet then dies first; the close is bounded
    (``ray_executor.within``) and nothing of the session is left."""
    env = {"RAY_ADDRESS": ""}  # not this module's cluster: serve starts a Ray of its own
    flags = ("--data-parallel-size", "2", "--data-parallel-backend", "ray")
    with serve_process(tiny_model_dir, *flags, env=env, new_session=True) as (url, proc):
        assert httpx.get(url + "/health").status_code == 200
        assert len(session_members(proc.pid)) > 2  # serve, and Ray's daemons and actors
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 15
        while left := session_members(proc.pid):
            assert time.monotonic() < deadline, f"left in serve's session: {left}"
            time.sleep(0.1)
        assert time.monotonic() - start < 30


def test_serve_with_ray_tensor_parallel_ranks_answers_and_leaves_nothing(
    tiny_model_dir: Path, offline: LLM
) -> None:
    """``serve --distributed-executor-backend ray``: the core process's ``ray.init()``
    starts a local Ray, which its ``os._exit`` would leave running (``end_ray``)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = offline.generate(PROMPTS[:2], params, use_tqdm=False)
    flags = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    env = {"RAY_ADDRESS": ""}
    with serve_process(tiny_model_dir, *flags, env=env, new_session=True) as (url, proc):
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for prompt, w in zip(PROMPTS[:2], want, strict=True):
            got = api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert got.choices[0].text == w.outputs[0].text
        proc.send_signal(signal.SIGTERM)  # to serve alone: the rest must follow it
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 15
        while left := session_members(proc.pid):
            assert time.monotonic() < deadline, f"left in serve's session: {left}"
            time.sleep(0.1)
