"""What every Ray path shares, without torch (the API process imports it): Ray imported on
demand with the extra named when it is missing, Ray's calls in a close bounded, and Ray
shut down before a process ends with ``os._exit``.

Why the last: ``os._exit`` skips Ray's own atexit shutdown, and a local Ray that
``ray.init()`` started in that process (its GCS, raylet and agents) would outlive it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

CLOSE_CALL_S = 5.0
"""The most one of Ray's calls in a close may take. Why a bound: a signal sent to the whole
process group (a terminal's, ``timeout``'s, ``kill -TERM -- -PGID``) also reaches the local
Ray that ``ray.init()`` started, and once its raylet is gone ``remove_placement_group``
waits for an answer forever (``tests/test_ray_dp.py``'s process-group test)."""


PLACEMENT_ENV = "PAGED_ENGINE_RAY_PLACEMENT"
PLACEMENTS = ("PACK", "SPREAD")
"""Ray's placement group strategies for a tensor-parallel group's actors and for the
data-parallel replicas: PACK (the default) puts them onto as few nodes as fit, SPREAD onto
different nodes where it can."""


def placement_strategy(value: str | None = None) -> str:
    """``value``, else ``$PAGED_ENGINE_RAY_PLACEMENT``, else PACK (any case); ValueError
    naming where it came from when it is neither PACK nor SPREAD."""
    source = "placement" if value is not None else f"${PLACEMENT_ENV}"
    raw = value if value is not None else os.environ.get(PLACEMENT_ENV, "")
    chosen = raw.strip().upper() or "PACK"
    if chosen not in PLACEMENTS:
        raise ValueError(f"{source} must be one of {PLACEMENTS}, got {raw!r}")
    return chosen


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(
            "distributed_executor_backend='ray' and --data-parallel-backend ray need Ray: "
            "pip install 'paged_engine[ray]'"
        ) from err
    return ray


def actor_location() -> tuple[str, str, int]:
    """Where the calling Ray actor runs: its node id, node address and pid (what an actor's
    ``where`` answers, for a tensor-parallel rank and a data-parallel replica alike)."""
    import ray

    ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
    return ray.get_runtime_context().get_node_id(), ip, os.getpid()


def within(call: Callable[[], object], timeout_s: float = CLOSE_CALL_S) -> bool:
    """Run ``call`` on a daemon thread and wait at most ``timeout_s`` for it; True if it
    returned in time (an exception it raises is dropped: a close goes on)."""
    done = threading.Event()

    def run() -> None:
        with suppress(Exception):
            call()
        done.set()

    threading.Thread(target=run, name="paged_engine-ray-close", daemon=True).start()
    return done.wait(timeout_s)


def end_ray() -> None:
    """Shut Ray down in this process, bounded, if it is connected as a driver (a cluster
    that this process joined is only left; a local one it started ends). Not in an actor
    (a data-parallel replica's core): Ray ends the actor's process itself."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if ray.get_runtime_context().get_actor_id() is None:
        within(ray.shutdown)
