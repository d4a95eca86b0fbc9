"""Tensor parallelism on a Ray cluster (``distributed_executor_backend="ray"``): ranks
1..N-1 are Ray actors (``ray_actor.RankActor``), rank 0 stays in the caller's process as
with spawned workers (``tp_worker.py``), and everything after the start is that module's
``WorkerGroup``: the same steps, failures (``WorkerError``) and close.

**Placement.** One placement group per engine: bundle 0 holds nothing but a sliver of
rank 0's node resource (``node:<ip>``), bundles 1..N-1 one actor each
(``ACTOR_CPUS``). With ``PACK`` (the default) Ray puts the bundles on one node where it
can, and bundle 0 makes that node rank 0's: the group then needs no network between
ranks. ``SPREAD`` (``$PAGED_ENGINE_RAY_PLACEMENT=SPREAD``, ``ray_support``) puts them on
different nodes where it can. ``ray.init()`` is called when Ray is not initialized yet:
it joins the cluster of ``RAY_ADDRESS`` or a local
``ray start``, else starts a local one.

**Rendezvous.** Rank 0's store listens on every interface; the actors connect to rank
0's node address (``ray.util.get_node_ip_address``), gloo on CPU.

**Hand-off.** When every actor is on rank 0's node, the shared-memory channel as with
spawned workers, woken through named pipes (``ray_actor.FifoSignal``); otherwise the
broadcast over torch.distributed, on a group of its own so that an idle engine keeps its
actors. Chosen by ``bench/test_ray_handoff_bench.py`` (figures in its docstring).

**Lifecycle.** ``close()`` (``LLM.close()``, ``with``, garbage collection) ends the
ranks as ``WorkerGroup.close`` does, then kills every actor and removes the placement
group; so does a failure. An actor killed or lost with its node fails the step with
``WorkerError`` at once: gloo sees the closed connection, and rank 0 polls each actor's
``run`` call every ``tp_worker.POLL_S`` while a step waits.

Not built: CUDA ranks on Ray (each actor would need its Ray-assigned device rather than
``cuda:rank``), and a stopped (not dead) actor is noticed only by the collective
timeout of the forward pass, not named as stopped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence as SequenceABC
from contextlib import suppress
from typing import Any

import torch

from paged_engine.config import EngineConfig
from paged_engine.layers.parallel import check_divisible
from paged_engine.ray_support import PLACEMENTS, import_ray, placement_strategy, within
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker import distributed as tpd
from paged_engine.worker.devices import resolve_tp_device
from paged_engine.worker.handoff import BroadcastChannel, ShmChannel
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.ray_actor import IDLE_TIMEOUT_S, FifoSignal, RankActor, RayRank
from paged_engine.worker.tp_process import STARTUP_TIMEOUT_S, WorkerSpec, run_rank
from paged_engine.worker.tp_worker import WorkerGroup, attach_runner

__all__ = ["ACTOR_CPUS", "PLACEMENTS", "RayWorkerGroup", "import_ray", "start_ray_tensor_parallel"]

ACTOR_CPUS = 1.0
"""CPUs each actor reserves: one, so that TP=2 fits a 2-CPU machine beside rank 0."""


class RayWorkerGroup(WorkerGroup):
    """Rank 0's handle on ranks 1..N-1 as Ray actors (see the module docstring).

    ``transport``: "shm", "broadcast", or None to choose by where the actors landed."""

    entry = staticmethod(run_rank)
    """What each actor runs (``RankActor.run``)."""
    report_grace_s = 5.0
    """Ray marks a killed actor's call failed within a second or so, not at once."""

    def __init__(
        self,
        model: ModelConfig,
        config: EngineConfig,
        device: torch.device,
        transport: str | None = None,
        placement: str | None = None,
    ) -> None:
        if transport not in (None, "shm", "broadcast"):
            raise ValueError(f"transport must be None, 'shm' or 'broadcast', got {transport!r}")
        placement = placement_strategy(placement)
        if device.type != "cpu":
            raise NotImplementedError(
                "distributed_executor_backend='ray' runs CPU ranks only so far; use 'mp' on CUDA"
            )
        ray = import_ray()
        tpd.refuse_existing_group()
        timeout_s = tpd.collective_timeout_s()
        n = config.tensor_parallel_size
        self.closed = False
        self.failed = False
        self.workers: list[Any] = []
        self.actors: list[Any] = []
        self.placement_group: Any = None
        self._ray = ray
        self._fifo_dir: str | None = None
        self.channel: ShmChannel | BroadcastChannel = BroadcastChannel(IDLE_TIMEOUT_S)
        self._caller = tpd.CollectiveThread("paged_engine-tp0")
        try:
            if not ray.is_initialized():
                ray.init()
            self._store = tpd.open_store(n, timeout_s)
            ranks = self._place(n, placement)
            here = ray.get_runtime_context().get_node_id()
            remote = [node for node, _, _ in self._where() if node != here]
            chosen = transport or ("broadcast" if remote else "shm")
            fifos: list[str | None] = [None] * (n - 1)
            if chosen == "shm":
                if remote:
                    raise ValueError("transport='shm' needs every actor on rank 0's node")
                self._fifo_dir = tempfile.mkdtemp(prefix="paged_engine-tp-")
                fifos = [os.path.join(self._fifo_dir, f"rank{r.rank}") for r in ranks]
                for path in fifos:
                    os.mkfifo(path)  # type: ignore[arg-type]
                self.channel = ShmChannel([FifoSignal(p) for p in fifos])  # type: ignore[arg-type]
            segment = self.channel.name if isinstance(self.channel, ShmChannel) else None
            host = ray.util.get_node_ip_address()
            backend = tpd.backend_for(device)
            spec = WorkerSpec(model, config, self._store.port, backend, segment, timeout_s, host)
            for r, fifo in zip(ranks, fifos, strict=True):
                r.run_ref = r.actor.run.remote(type(self).entry, r.rank, spec, fifo)
            self.workers = ranks
            self.tp = self._run(lambda: tpd.join_group(0, n, self._store, backend, timeout_s))
        except BaseException as err:
            raise self.fail(err)  # noqa: B904 - err itself, or its wrapper

    def _place(self, n: int, placement: str) -> list[RayRank]:
        """The placement group and one actor per worker rank, started."""
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host = ray.util.get_node_ip_address()
        bundles = [{f"node:{host}": 0.001}] + [{"CPU": ACTOR_CPUS}] * (n - 1)
        self.placement_group = ray.util.placement_group(bundles, strategy=placement)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=STARTUP_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {n - 1} actors of {ACTOR_CPUS} CPU each "
                f"({placement}) within {STARTUP_TIMEOUT_S:.0f} s: too few free CPUs?"
            )
        cls = ray.remote(num_cpus=ACTOR_CPUS, max_concurrency=2, max_restarts=0)(RankActor)
        for rank in range(1, n):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank
            )
            self.actors.append(cls.options(scheduling_strategy=strategy).remote())
        return [
            RayRank(ray, rank, actor, pid, ip)
            for rank, (actor, (_, ip, pid)) in enumerate(
                zip(self.actors, self._where(), strict=True), start=1
            )
        ]

    def _where(self) -> list[tuple[str, str, int]]:
        calls = [a.where.remote() for a in self.actors]
        return list(self._ray.get(calls, timeout=STARTUP_TIMEOUT_S))

    def close(self) -> None:
        """``WorkerGroup.close``, then the actors killed and the placement group removed
        (idempotent)."""
        if self.closed:
            return
        try:
            super().close()
        finally:
            for actor in self.actors:
                with suppress(Exception):
                    self._ray.kill(actor, no_restart=True)
            if self.placement_group is not None:
                group = self.placement_group
                within(lambda: self._ray.util.remove_placement_group(group))
            if isinstance(self.channel, ShmChannel):
                for signal_ in self.channel.signals:
                    signal_.close()
            if self._fifo_dir is not None:
                shutil.rmtree(self._fifo_dir, ignore_errors=True)


def start_ray_tensor_parallel(
    model: ModelConfig,
    config: EngineConfig,
    *,
    eos_token_ids: SequenceABC[int] = (),
) -> ModelRunner:
    """``tp_worker.start_tensor_parallel`` with Ray actors for ranks 1..N-1; the same
    refusals before anything starts, and an ImportError naming the extra without Ray."""
    n = config.tensor_parallel_size
    if n < 2:
        raise ValueError(f"tensor_parallel_size={n}: a tensor-parallel group needs 2 or more")
    check_divisible(model.hf_config, n)
    import_ray()
    group = RayWorkerGroup(model, config, resolve_tp_device(config.device, n))
    return attach_runner(group, model, config, eos_token_ids)
