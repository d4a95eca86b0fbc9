"""Data-parallel replicas as Ray actors: ``serve MODEL --data-parallel-size N
--data-parallel-backend ray`` (vLLM's flag).

Why over the remote replicas' wire: a replica actor does what a ``--headless`` core does
(``dp_headless``): it connects to the head, proves it knows the key, and runs
``core_main`` over that TCP connection. On the head each replica is then a
``RemoteCoreClient`` like any other, so the router (``DPClient``: cache-aware routing, a
dead replica's requests failed alone, no work sent to it after) and ``/metrics``
(``paged_engine_dp_replica_alive``) need nothing of Ray. What Ray adds is what a user
would otherwise launch by hand on each node: it places the actors, one bundle each in a
placement group (``PACK`` by default: onto as few nodes as fit; ``SPREAD``, from
``$PAGED_ENGINE_RAY_PLACEMENT``: onto different nodes where it can), starts them, and
kills them with the head (an actor's owner is the head process: Ray ends it when the
owner goes).

**The key** is drawn at random for each launch (no ``$PAGED_ENGINE_DP_AUTHKEY`` to set) and
reaches the actors as a call argument, inside the cluster.

**Liveness** is the connection's, as for a headless core: an actor killed, or lost with its
node, closes it (on one host at once; across hosts TCP keepalive counts it dead within
about 15 s), its in-flight requests fail and the router skips it. An actor whose call ends
before its core connected or loaded (an error on its node) fails the launch with its
traceback, and every other actor is killed.

**Resources.** Each actor reserves ``tensor_parallel_size x num_threads`` CPUs (1 thread a
rank unless ``--threads`` says otherwise; the core then runs that many), and on CUDA one GPU
a rank, which Ray makes its ``CUDA_VISIBLE_DEVICES`` (untested here: no GPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import secrets
from contextlib import suppress
from typing import Any

from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec, core_main
from paged_engine.entrypoints.dp_client import stop_all
from paged_engine.entrypoints.dp_headless import connect_to_head
from paged_engine.entrypoints.dp_remote import CoreListener, RemoteCoreClient, ReplicaError
from paged_engine.ray_support import actor_location, import_ray, placement_strategy, within

log = logging.getLogger(__name__)

WATCH_S = 0.2
"""How often the launch looks whether an actor's call ended before its core came."""


class ReplicaActor:
    """What runs in each actor (wrapped by ``ray.remote`` in ``RayReplicas``): ``where``,
    then ``serve``, the replica's whole life, on the actor's main thread (``core_main``
    sets a signal handler)."""

    def where(self) -> tuple[str, str, int]:
        """This actor's node id, node address and pid."""
        return actor_location()

    def serve(
        self, spec: CoreSpec, address: tuple[str, int], authkey: bytes, timeout: float
    ) -> None:
        """Connect to the head, then serve it until it stops this core (``core_main``
        then ends the process) or refuses the model (``core_main`` returns, having told
        the head why)."""
        core_main(spec, connect_to_head(address, authkey, timeout))


def replica_resources(spec: CoreSpec) -> tuple[CoreSpec, float, float]:
    """The spec each actor runs (``num_threads`` set: 1 unless given), with the CPUs and
    GPUs one actor reserves (see the module docstring)."""
    kwargs = dict(spec.llm_kwargs)
    threads = int(kwargs.get("num_threads") or 1)
    tp = int(kwargs.get("tensor_parallel_size") or 1)
    device = str(kwargs.get("device") or "cpu")
    kwargs["num_threads"] = threads
    gpus = float(tp) if device.startswith("cuda") else 0.0
    return dataclasses.replace(spec, llm_kwargs=kwargs), float(tp * threads), gpus


class RayReplicas:
    """The head's Ray side of ``count`` replicas of ``spec``: its placement group and
    actors, and (``launch``) their cores as ``CoreClient``\\s, in actor order; ``close``
    kills the actors, removes the group, and shuts down a Ray it started itself."""

    def __init__(
        self,
        spec: CoreSpec,
        count: int,
        *,
        placement: str | None = None,
        connect_timeout: float = 300.0,
        ray_module: Any = None,
    ) -> None:
        placement = placement_strategy(placement)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if ray_module is None:
            ray_module = import_ray()
        self.spec, self.cpus, self.gpus = replica_resources(spec)
        self.count = count
        self.placement = placement
        self.connect_timeout = connect_timeout
        self.ray = ray_module
        self.started_ray = False
        self.placement_group: Any = None
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, str, int]] = []
        """Each actor's node id, node address and pid, in actor order."""
        self.calls: list[Any] = []
        """Each actor's ``serve`` call: it resolves only once the replica has ended."""

    def launch(self) -> list[CoreClient]:
        """Place and start the actors, and wait until each core has connected and loaded
        its model. ReplicaError when Ray cannot place them, an actor's call ends first, or
        they do not connect within ``connect_timeout``; the actors are killed then."""
        try:
            return self._launch()
        except BaseException:
            self.close()
            raise

    def _launch(self) -> list[CoreClient]:
        ray = self.ray
        if not ray.is_initialized():
            ray.init()
            self.started_ray = True
        self._place()
        authkey = secrets.token_bytes(32)
        listener = CoreListener(("", 0), authkey)
        try:
            host = ray.util.get_node_ip_address()
            port = int(listener.address.rpartition(":")[2])
            self.calls = [
                a.serve.remote(self.spec, (host, port), authkey, self.connect_timeout)
                for a in self.actors
            ]
            clients = self._gather(listener)
        finally:
            listener.close()
        by_pid = {c.info.pid: c for c in clients if c.info is not None}
        ordered: list[CoreClient] = []
        for i, (_, ip, pid) in enumerate(self.nodes):
            client = by_pid.get(pid)
            if client is None:
                stop_all(clients, 0.0)
                raise ReplicaError(f"replica actor {i} (pid {pid}) is not among the cores")
            client.remote.peer = f"replica {i} (Ray actor, pid {pid} on {ip})"
            ordered.append(client)
        return ordered

    def _place(self) -> None:
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        self.placement_group = ray.util.placement_group(
            [bundle] * self.count, strategy=self.placement
        )
        ready, _ = ray.wait([self.placement_group.ready()], timeout=self.connect_timeout)
        if not ready:
            raise ReplicaError(
                f"Ray could not place {self.count} data-parallel replicas of {bundle} each "
                f"({self.placement}) within {self.connect_timeout:g} s: too few free resources "
                f"(the cluster has {ray.cluster_resources()})"
            )
        cls = ray.remote(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0)(ReplicaActor)
        for i in range(self.count):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=i
            )
            self.actors.append(cls.options(scheduling_strategy=strategy).remote())
        calls = [a.where.remote() for a in self.actors]
        self.nodes = list(ray.get(calls, timeout=self.connect_timeout))

    def _gather(self, listener: CoreListener) -> list[RemoteCoreClient]:
        """``listener.replicas``, while watching the actors' calls: one that raises or
        dies first fails the launch with what ended it."""
        ray = self.ray
        pool = concurrent.futures.ThreadPoolExecutor(1, "dp-ray-launch")
        future = pool.submit(listener.replicas, self.count, self.connect_timeout)
        watching = list(self.calls)
        try:
            while not future.done():
                if not watching:  # each call ended cleanly: the listener says why
                    concurrent.futures.wait([future], timeout=WATCH_S)
                    continue
                ended, _ = ray.wait(watching, num_returns=1, timeout=WATCH_S)
                if not ended or future.done():
                    continue
                watching.remove(ended[0])
                i = self.calls.index(ended[0])
                why = self._error(i)
                if why is not None:  # a refused model ends the call cleanly: not here
                    listener.close()  # ``replicas`` fails at once, ending those it holds
                    raise ReplicaError(f"replica actor {i} ended before serving: {why}")
            return future.result()
        finally:
            pool.shutdown(wait=True)

    def _error(self, i: int) -> str | None:
        """What ended actor ``i``'s ``serve`` call: its traceback, or that the actor died;
        None when it returned (its core refused the model and told the head why)."""
        try:
            self.ray.get(self.calls[i], timeout=0)
        except Exception as err:  # RayTaskError, ActorDiedError, ...
            return str(err).strip()[-4000:] or type(err).__name__
        return None

    def close(self) -> None:
        """Kill every actor, remove the placement group, and shut Ray down if ``launch``
        started it (idempotent; each of Ray's calls bounded: ``ray_support.within``). The
        cores are stopped first by the caller (``stop_all``): an actor killed while
        serving is a replica lost."""
        ray = self.ray
        if not ray.is_initialized():
            return
        for actor in self.actors:
            with suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []
        group, self.placement_group = self.placement_group, None
        if group is not None and not self.started_ray:  # else the shutdown removes it
            within(lambda: ray.util.remove_placement_group(group))
        if self.started_ray:
            self.started_ray = False
            within(ray.shutdown)
