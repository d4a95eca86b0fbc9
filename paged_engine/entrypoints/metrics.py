"""``/metrics``: the engine's state and the server's latencies in Prometheus' text format.

Each server has its own ``CollectorRegistry`` (not prometheus_client's global one), so two
servers in one process (tests) never mix their series. The engine's counters are not
copied into prometheus objects as they change: a collector reads the loop's latest
``EngineSnapshot`` at scrape time, so the engine thread pays nothing per scrape and the
HTTP side never touches the engine. Latencies are histograms observed on the engine
thread as outputs leave it:

* time to first token: from the HTTP request's arrival (passed to the engine as the
  request's ``arrival_time``) to the step that sampled its first token;
* inter-token latency: the time between consecutive steps that gave a request tokens,
  measured as they happen, streamed or not (the engine loop runs every request with
  ``DELTA`` outputs, so each such step reports it; see ``engine_loop``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.loop_types import EngineSnapshot

PREFIX = "paged_engine_"
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(slots=True)
class _Timing:
    last_token_time: float | None = None
    """When the request's previous tokens came (None before the first)."""


class ServerMetrics:
    """The server's metrics (see the module docstring); implements the loop's ``Observer``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Engine requests (prompts) by how they ended: finished, aborted, failed",
            ["outcome"],
            registry=r,
        )
        self.added_total = Counter(
            PREFIX + "requests_added", "Prompts added to the engine", registry=r
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected",
            "HTTP requests refused before reaching the engine, by status",
            ["status"],
            registry=r,
        )
        self._timings: dict[str, _Timing] = {}

    def bind(self, loop: _HasSnapshot) -> None:
        """Export ``loop``'s engine snapshot too, and its replicas' state when it is a
        data-parallel router."""
        self.registry.register(_SnapshotCollector(loop))
        if isinstance(loop, _HasReplicas):
            self.registry.register(_ReplicaCollector(loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the loop's Observer (engine thread) ---------------------------------------------

    def added(self, request_ids: list[str], arrival_time: float) -> None:
        self.added_total.inc(len(request_ids))
        for r in request_ids:
            self._timings[r] = _Timing()

    def output(self, out: RequestOutput) -> None:
        timing = self._timings.get(out.request_id)
        m = out.metrics
        if timing is None or m.first_token_time is None or m.last_token_time is None:
            return
        if timing.last_token_time is None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            timing.last_token_time = m.first_token_time
        if m.last_token_time > timing.last_token_time:
            self.itl.observe(m.last_token_time - timing.last_token_time)
            timing.last_token_time = m.last_token_time

    def ended(self, request_id: str, how: str) -> None:
        self._timings.pop(request_id, None)
        self.requests.labels(how).inc()


class _HasSnapshot(Protocol):
    """An engine loop, in this process or the client of a core process."""

    @property
    def snapshot(self) -> EngineSnapshot | None: ...


class _Replica(Protocol):
    @property
    def alive(self) -> bool: ...


@runtime_checkable
class _HasReplicas(Protocol):
    """A data-parallel router (``DPClient``)."""

    replicas: Sequence[_Replica]

    def loads(self) -> list[int]: ...


class _ReplicaCollector:
    """Each data-parallel replica's state, read at scrape time: whether its core serves
    (a dead one gets no more requests) and the sequences it holds."""

    def __init__(self, router: _HasReplicas) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        alive = GaugeMetricFamily(
            PREFIX + "dp_replica_alive",
            "1 while the data-parallel replica's engine core serves, 0 once it is gone",
            labels=["replica"],
        )
        load = GaugeMetricFamily(
            PREFIX + "dp_replica_in_flight",
            "Sequences routed to the data-parallel replica and not yet ended",
            labels=["replica"],
        )
        loads = self._router.loads()
        for i, (replica, n) in enumerate(zip(self._router.replicas, loads, strict=True)):
            alive.add_metric([str(i)], 1.0 if replica.alive else 0.0)
            load.add_metric([str(i)], float(n))
        yield alive
        yield load


class _SnapshotCollector:
    """The engine's gauges and counters, from the loop's latest snapshot."""

    def __init__(self, loop: _HasSnapshot) -> None:
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        s = self._loop.snapshot
        if s is None:
            return
        gauges = {
            "num_requests_running": ("Sequences running (each of n completions counts)", s.running),
            "num_requests_waiting": ("Sequences waiting (each of n completions counts)", s.waiting),
            "kv_blocks_in_use": ("KV cache blocks held by requests", s.blocks_in_use),
            "kv_blocks_total": ("KV cache blocks in the pool", s.num_blocks),
            # vLLM's name; a fraction in [0, 1], as vLLM's is despite the "perc".
            "kv_cache_usage_perc": ("Share of the KV pool in use", s.blocks_in_use / s.num_blocks),
            "prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache over all prompt tokens",
                s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "prompt_tokens": ("Prompt tokens admitted", s.prompt_tokens),
            # vLLM's pair: tokens looked up in the prefix cache, and those it served.
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                s.prompt_tokens,
            ),
            "prefix_cache_hits": ("Prompt tokens the prefix cache served", s.cached_prompt_tokens),
            "generation_tokens": ("Tokens generated", s.output_tokens),
            "num_preemptions": ("Sequences preempted (recomputed later)", s.preemptions),
            "engine_steps": ("Engine steps", s.steps),
            "engine_failed_steps": ("Engine steps that raised and were recovered", s.failed_steps),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
