"""How the engine core's step outputs should travel to the API process: measured.

Issue 24 asks for the IPC to be picked by measurement: ZeroMQ with msgspec (as vLLM V1
does) or what the project already has (``multiprocessing`` pipes, pickle). What crosses
per step is one record per running request: its new token ids, its ending, its timings
(``core_wire.WireOutput``). Three ways are timed, each sending ``STEPS`` steps of
``BATCH`` requests from a spawned child to this process, which decodes every step back to
Python objects (what the reader thread must do before it can make text):

* ``pipe-pickle-wire``: what the core sends now, ``WireOutput`` tuples through a
  ``multiprocessing`` pipe;
* ``pipe-pickle-output``: what it sent before, whole ``RequestOutput`` records (prompt
  and prompt token ids included in every step);
* ``zmq-msgspec``: a ZeroMQ PUSH/PULL socket over ``ipc://``, msgspec's msgpack encoding
  of ``array_like`` structs with the same fields (vLLM V1's choice).

Reported per way: microseconds per step, wall (both sides at once) and the receiving
side's CPU (the API process's GIL is what the HTTP side competes for), best and median
of ``ROUNDS`` alternated rounds, and each way's ratio to ``pipe-pickle-wire``.
Nothing is asserted about time; every step must arrive whole.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from paged_engine.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from paged_engine.entrypoints.core_wire import encode

STEPS = 2000
BATCH = (8, 64)
ROUNDS = 5
PROMPT_LEN = 128
WAYS = ("pipe-pickle-wire", "pipe-pickle-output", "zmq-msgspec")
HAVE_ZMQ = importlib.util.find_spec("zmq") is not None and importlib.util.find_spec("msgspec")


def step_outputs(batch: int, step: int) -> list[RequestOutput]:
    """One decode step's outputs: ``batch`` requests, one new token each."""
    prompt = list(range(PROMPT_LEN))
    t = 1.7e9 + step
    return [
        RequestOutput(
            request_id=f"cmpl-{r}",
            prompt=None,
            prompt_token_ids=prompt,
            prompt_logprobs=None,
            outputs=[CompletionOutput(0, "", [1000 + step], None, None, None, None)],
            finished=False,
            num_cached_tokens=32,
            metrics=RequestMetrics(t, t, t, t, None),
        )
        for r in range(batch)
    ]


if HAVE_ZMQ:
    import msgspec

    class WireCompletionStruct(msgspec.Struct, array_like=True):
        index: int
        token_ids: list[int]
        finish_reason: str | None
        stop_reason: int | str | None

    class WireOutputStruct(msgspec.Struct, array_like=True):
        request_id: str
        completions: list[WireCompletionStruct]
        finished: bool
        num_cached_tokens: int | None
        metrics: tuple[float, float | None, float | None, float | None, float | None]


def _send(way: str, batch: int, conn: Any, address: str) -> None:
    """The child: build every step first (outside the timing), then send them all."""
    steps = [step_outputs(batch, s) for s in range(STEPS)]
    if way == "zmq-msgspec":
        import msgspec
        import zmq

        completion, output = WireCompletionStruct, WireOutputStruct
        sock = zmq.Context().socket(zmq.PUSH)
        sock.connect(address)
        enc = msgspec.msgpack.Encoder()
        conn.send("ready")
        conn.recv()
        for outs in steps:
            records = []
            for o in outs:
                w = encode(o, False)
                cs = [completion(c[0], c[1], c[4], c[5]) for c in w.completions]
                records.append(output(w.request_id, cs, w.finished, w.num_cached_tokens, w.metrics))
            sock.send(enc.encode(records), copy=False)
        sock.close(linger=5000)
        return
    conn.send("ready")
    conn.recv()
    for outs in steps:
        conn.send([encode(o, False) for o in outs] if way == "pipe-pickle-wire" else outs)


def one_round(way: str, batch: int) -> tuple[float, float]:
    """(wall, receiving CPU) seconds for ``STEPS`` steps."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    address = f"ipc://{tempfile.mkdtemp()}/steps"
    sock = dec = None
    if way == "zmq-msgspec":
        import msgspec
        import zmq

        sock = zmq.Context().socket(zmq.PULL)
        sock.bind(address)
        dec = msgspec.msgpack.Decoder(list[WireOutputStruct])
    proc = ctx.Process(target=_send, args=(way, batch, child, address))
    proc.start()
    assert parent.recv() == "ready"
    parent.send("go")
    t0, c0 = time.perf_counter(), time.process_time()
    got = 0
    for _ in range(STEPS):
        if sock is not None and dec is not None:
            step = dec.decode(sock.recv(copy=False))
        else:
            step = parent.recv()
        got += len(step)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    proc.join(30)
    assert got == STEPS * batch
    if sock is not None:
        sock.close()
        Path(address[len("ipc://") :]).unlink(missing_ok=True)
    return wall, cpu


@pytest.mark.benchmark(group="ipc")
@pytest.mark.parametrize("batch", BATCH)
def test_step_outputs_over_ipc(benchmark: Any, batch: int) -> None:
    ways = WAYS if HAVE_ZMQ else WAYS[:2]
    walls: dict[str, list[float]] = {w: [] for w in ways}
    cpus: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(ROUNDS):
        for way in ways if r % 2 == 0 else reversed(ways):
            wall, cpu = one_round(way, batch)
            walls[way].append(1e6 * wall / STEPS)
            cpus[way].append(1e6 * cpu / STEPS)
    info: dict[str, Any] = {"suite": "ipc", "batch": batch, "steps": STEPS}
    base = min(walls["pipe-pickle-wire"])
    for way in ways:
        info[f"{way}_us_per_step_best"] = round(min(walls[way]), 2)
        info[f"{way}_us_per_step_median"] = round(statistics.median(walls[way]), 2)
        info[f"{way}_recv_cpu_us_per_step_best"] = round(min(cpus[way]), 2)
        info[f"{way}_vs_wire"] = round(min(walls[way]) / base, 3)
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: one_round("pipe-pickle-wire", batch), rounds=1, iterations=1)
    print(f"\nstep outputs over IPC, batch {batch}, {STEPS} steps, {ROUNDS} rounds")
    for way in ways:
        best, median = min(walls[way]), statistics.median(walls[way])
        print(
            f"  {way:20} {best:8.1f} us/step (median {median:.1f})"
            f"  receiver CPU {min(cpus[way]):7.1f} us/step"
        )
