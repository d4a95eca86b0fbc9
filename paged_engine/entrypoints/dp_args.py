"""``serve``'s data-parallel flags (vLLM's names), and their check before anything loads:
how many replicas, which run on this node, where the head listens for the others, and
whether Ray places them (``--data-parallel-backend ray``, ``dp_ray``)."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from typing import Any

from paged_engine.entrypoints.cli_args import positive
from paged_engine.entrypoints.settings import dp_authkey
from paged_engine.ray_support import placement_strategy

DP_BACKENDS = ("mp", "ray")


def add_dp_args(add: Callable[..., Any]) -> None:
    """The flags, added with ``add`` (an argument group's ``add_argument``)."""
    add(
        "--data-parallel-size",
        type=positive,
        default=1,
        metavar="N",
        help="engine core processes, each with its own KV pool and prefix cache; requests "
        "go to the one holding the longest prefix of their blocks, balanced against load",
    )
    add(
        "--data-parallel-backend",
        "-dpb",
        choices=DP_BACKENDS,
        default="mp",
        help="mp: the replicas are processes spawned here (and --headless ones on other "
        "hosts); ray: each replica is a Ray actor that Ray places on a node of its cluster "
        "(extra ray)",
    )
    add(
        "--data-parallel-size-local",
        type=int,
        default=None,
        metavar="L",
        help="of the N replicas, those this node runs; the head listens for the other N - L, "
        "started on other hosts with --headless (shared key: $PAGED_ENGINE_DP_AUTHKEY)",
    )
    dp_help = "the head's address, where it listens for remote replicas and they connect"
    add("--data-parallel-address", default="127.0.0.1", metavar="HOST", help=dp_help)
    add("--data-parallel-rpc-port", type=int, default=29550, metavar="PORT", help="its port")
    add(
        "--data-parallel-connect-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long the head waits for its remote replicas, and a headless core for the head",
    )
    add(
        "--headless",
        action="store_true",
        help="run only --data-parallel-size-local engine cores, no API server: remote "
        "replicas of the head at --data-parallel-address:--data-parallel-rpc-port",
    )


def check_dp_args(a: argparse.Namespace) -> None:
    """Resolve ``a.dp_local`` (the replicas spawned on this node), ``a.dp_remote`` (those
    the head waits for from --headless nodes) and ``a.dp_ray`` (those Ray places); remote
    replicas need the shared key, refused by name when unset, and Ray its extra."""
    n, local = a.data_parallel_size, a.data_parallel_size_local
    if not 0 < a.data_parallel_rpc_port < 65536:
        raise ValueError(
            f"--data-parallel-rpc-port must be in [1, 65535], got {a.data_parallel_rpc_port}"
        )
    if not a.data_parallel_connect_timeout > 0:
        raise ValueError(
            f"--data-parallel-connect-timeout must be > 0, got {a.data_parallel_connect_timeout}"
        )
    if a.data_parallel_backend == "ray":
        _check_ray(a)
        return
    a.dp_ray = 0
    a.dp_local = n if local is None else local
    a.dp_remote = 0 if a.headless else n - a.dp_local
    if a.headless and a.dp_local < 1:
        raise ValueError(f"--data-parallel-size-local must be >= 1 with --headless, got {local}")
    if not a.headless and not 0 <= a.dp_local <= n:
        raise ValueError(f"--data-parallel-size-local must be in [0, {n}], got {local}")
    if (n > 1 or a.dp_remote or a.headless) and a.engine_core != "process":
        raise ValueError("--data-parallel-size > 1 and --headless need --engine-core process")
    if a.dp_remote or a.headless:
        dp_authkey()


def _check_ray(a: argparse.Namespace) -> None:
    """``--data-parallel-backend ray``: every replica is a Ray actor, none spawned here."""
    if a.headless or a.data_parallel_size_local is not None:
        flag = "--headless" if a.headless else "--data-parallel-size-local"
        raise ValueError(
            f"{flag} is for --data-parallel-backend mp: with ray, Ray places every replica"
        )
    if a.engine_core != "process":
        raise ValueError("--data-parallel-backend ray needs --engine-core process")
    if getattr(a, "distributed_executor_backend", None) == "ray":
        raise ValueError(
            "--data-parallel-backend ray with --distributed-executor-backend ray is not "
            "supported: a replica's tensor-parallel ranks are processes of its own actor "
            "(--distributed-executor-backend mp)"
        )
    placement_strategy()  # $PAGED_ENGINE_RAY_PLACEMENT, refused by name before any load
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--data-parallel-backend ray needs Ray: pip install 'paged_engine[ray]'")
    a.dp_ray, a.dp_local, a.dp_remote = a.data_parallel_size, 0, 0
