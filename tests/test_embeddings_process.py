"""``POST /v1/embeddings`` with the engine core in a process of its own (``serve
--engine-core process``, the default) and with data parallelism: the vectors (float and
base64, texts and token ids) equal transformers' normalised last hidden state computed
here; a bad input is a 400 naming the field (the core's own refusals included, carried
back over the pipe) and the server serves on; a core killed while an embedding is pending
fails that request with a 503 at once (no hang), and the restarted core pools again.

Without processes: the core client fails a pending call when its core dies, skips a late
answer, and the core answers an error that would not cross the pipe as ``ValueError``;
``DPClient`` sends each call to the least loaded live replica (round robin when idle)."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from paged_engine import SamplingParams
from paged_engine.entrypoints.core_calls import PendingCalls, answer_call, engine_function
from paged_engine.entrypoints.dp_client import DPClient
from paged_engine.entrypoints.loop_types import EngineUnavailable
from paged_engine.pooling import PoolBusy
from tests.test_core_client_faults import READY, FakeCoreClient
from tests.test_core_process import core_pid
from tests.test_server_support import MODEL, serve_process

pytestmark = pytest.mark.timeout(240)
TEXTS = ["The capital of France is Paris.", "Bananas are yellow", "hi", "naïve café 🙂"]
MAX_LEN = 256


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path, tok: Any) -> dict[str, torch.Tensor]:
    """Each text's expected embedding, from transformers (the oracle)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return {
            t: torch.nn.functional.normalize(
                model(input_ids=torch.tensor([tok.encode(t)])).last_hidden_state[0, -1], dim=0
            )
            for t in TEXTS
        }


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[tuple[str, Any]]:
    flags = ("--engine-core", "process", "--engine-core-restarts", "1")
    with serve_process(tiny_model_dir, *flags, "--max-model-len", str(MAX_LEN)) as live:
        yield live


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def check_vectors(got: list[list[float]], texts: list[str], hf: dict[str, torch.Tensor]) -> None:
    assert len(got) == len(texts)
    for vector, text in zip(got, texts, strict=True):
        torch.testing.assert_close(torch.tensor(vector), hf[text], rtol=1e-4, atol=1e-5)


def check_server(url: str, hf: dict[str, torch.Tensor], tok: Any) -> None:
    client = api(url)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    check_vectors([d.embedding for d in floats.data], TEXTS, hf)
    tokens = sum(len(tok.encode(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [list(d.embedding) for d in b64.data] == [d.embedding for d in floats.data]
    raw = httpx.post(
        url + "/v1/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"}, timeout=30
    ).json()["data"][0]["embedding"]
    blob = base64.b64decode(raw)
    assert list(struct.unpack(f"<{len(blob) // 4}f", blob)) == floats.data[2].embedding
    ids = client.embeddings.create(
        model=MODEL, input=[tok.encode(t) for t in TEXTS[1:]], encoding_format="float"
    )
    check_vectors([d.embedding for d in ids.data], TEXTS[1:], hf)


def test_vectors_equal_transformers(
    server: tuple[str, Any], hf: dict[str, torch.Tensor], tok: Any
) -> None:
    check_server(server[0], hf, tok)


BAD = [
    ({"input": TEXTS[0], "dimensions": 8}, "dimensions", "not supported"),
    ({"input": []}, "input", "at least one input"),
    ({"input": [[1, 2], [10**6]]}, "input", "input 1"),  # refused by the core
    ({"input": [[1, 2], list(range(1, MAX_LEN + 2))]}, "input", f"input 1: {MAX_LEN + 1} prompt"),
    ({"input": TEXTS[0], "encoding_format": "bin"}, "encoding_format", "encoding_format"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD)
def test_bad_input_is_a_400_naming_the_field_and_the_server_serves_on(
    server: tuple[str, Any], body: dict[str, Any], param: str, says: str
) -> None:
    url, proc = server
    r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"], error
    ok = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    assert proc.poll() is None


def test_a_core_killed_while_pooling_fails_the_request_then_its_restart_pools(
    server: tuple[str, Any], hf: dict[str, torch.Tensor], tok: Any
) -> None:
    """The core is stopped (SIGSTOP) so the call waits in it for sure, then killed."""
    url, proc = server
    core = core_pid(proc.pid)
    os.kill(core, signal.SIGSTOP)
    answers: list[httpx.Response] = []
    body = {"input": TEXTS, "encoding_format": "float"}
    worker = threading.Thread(
        target=lambda: answers.append(httpx.post(url + "/v1/embeddings", json=body, timeout=60))
    )
    worker.start()
    worker.join(1.0)
    assert not answers, "the stopped core answered"
    os.kill(core, signal.SIGKILL)
    worker.join(20)
    assert answers, "the pending embedding hangs after its core died"
    assert answers[0].status_code == 503, answers[0].text
    assert "engine core process died" in answers[0].json()["error"]["message"]
    deadline = time.monotonic() + 90
    while httpx.get(url + "/health").status_code != 200 or core_pid(proc.pid) == core:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    check_server(url, hf, tok)


def test_data_parallel_replicas_pool_as_transformers(
    tiny_model_dir: Path, hf: dict[str, torch.Tensor], tok: Any
) -> None:
    with serve_process(tiny_model_dir, "--data-parallel-size", "2") as (url, proc):
        check_server(url, hf, tok)
        r = httpx.post(url + "/v1/embeddings", json={"input": [[1], [10**6]]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert proc.poll() is None


# ---- without processes -------------------------------------------------------------------


def test_a_pending_call_fails_when_its_core_dies_and_a_late_answer_is_skipped() -> None:
    client = FakeCoreClient([[READY]])  # the core says nothing more until it dies
    client.launch()
    process, conn = client.spawned[0]
    reader = threading.Thread(target=client._read)
    reader.start()

    async def pending() -> BaseException | None:
        call = asyncio.ensure_future(client.call_core("pool", [1, 2], True, "LAST"))
        while not conn.sent:
            await asyncio.sleep(0.01)
        assert conn.sent[-1] == ("call", 0, "pool", ([1, 2], True, "LAST"))
        assert not call.done()
        process.terminate()  # the core dies: its pipe reads EOF
        try:
            await asyncio.wait_for(call, 10)
        except BaseException as exc:
            return exc
        return None

    error = asyncio.run(pending())
    reader.join(10)
    assert isinstance(error, EngineUnavailable) and "engine core process died" in str(error)
    assert client.calls == {} and client.deaths
    with pytest.raises(EngineUnavailable):  # a dead core takes no call
        asyncio.run(client.call_core("check_inputs", [[1]]))


def test_calls_are_answered_by_key_and_a_cancelled_one_is_skipped() -> None:
    calls = PendingCalls()
    sent: list[Any] = []

    async def run() -> tuple[Any, BaseException | None]:
        one = asyncio.ensure_future(calls.call(sent.append, "pool", (1,)))
        two = asyncio.ensure_future(calls.call(sent.append, "pool", (2,)))
        three = asyncio.ensure_future(calls.call(sent.append, "pool", (3,)))
        await asyncio.sleep(0.01)
        keys = {m[3]: m[1] for m in sent}
        three.cancel()
        await asyncio.sleep(0.01)
        calls.answer(keys[(2,)], None, PoolBusy("busy"))
        calls.answer(keys[(1,)], b"one", None)
        calls.answer(keys[(3,)], b"late", None)  # its caller is gone: skipped
        try:
            await two
        except PoolBusy as exc:
            return await one, exc
        return await one, None

    result, error = asyncio.run(run())
    assert result == b"one" and isinstance(error, PoolBusy)
    assert calls == {}


class Unpicklable(ValueError):
    def __reduce__(self) -> Any:
        raise TypeError("no")


class WontUnpickle(RuntimeError):
    def __init__(self, a: int, b: int) -> None:  # pickled with one arg: unpickling fails
        super().__init__(f"{a}-{b}")


def test_the_core_answers_an_error_that_would_not_cross_the_pipe_as_value_error() -> None:
    import concurrent.futures

    sent: list[Any] = []
    for key, error in enumerate([Unpicklable("bad"), WontUnpickle(1, 2), PoolBusy("busy")]):
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_exception(error)
        answer_call(sent.append, key, done)
    kinds = [(m[0], m[1], type(m[3]), str(m[3])) for m in sent]
    assert kinds == [
        ("called", 0, ValueError, "bad"),
        ("called", 1, ValueError, "1-2"),
        ("called", 2, PoolBusy, "busy"),
    ]
    with pytest.raises(ValueError, match="unknown engine call 'exec'"):
        engine_function("exec", ())


class _Replica:
    """What ``DPClient`` reads of a replica, with a ``call_core`` that records."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.alive, self.observer, self.snapshot, self.fatal = True, None, None, None
        self.info: Any = type("Info", (), {"block_size": 8, "prefix_cache_hash": "xxh64"})()
        self.name, self.log = name, log

    async def call_core(self, name: str, *args: Any) -> Any:
        self.log.append(self.name)
        return (name, args)

    async def submit(self, requests: Any, arrival_time: float) -> asyncio.Queue[Any]:
        return asyncio.Queue()


def test_dp_calls_go_to_the_least_loaded_live_replica() -> None:
    log: list[str] = []
    replicas = [_Replica("a", log), _Replica("b", log)]
    dp = DPClient(replicas)  # type: ignore[arg-type]

    def call() -> Any:
        return asyncio.run(dp.call_core("pool", [1], True, "LAST"))

    assert call() == ("pool", ([1], True, "LAST"))
    for _ in range(3):
        call()
    assert log == ["a", "b", "a", "b"]  # idle: round robin
    asyncio.run(dp.submit([("r", {"prompt_token_ids": [1]}, SamplingParams(n=3))], 0.0))
    busy = "a" if dp.in_flight[0] else "b"
    assert dp.in_flight in ([3, 0], [0, 3])
    log.clear()
    call(), call()
    assert log and busy not in log  # the one generating is skipped
    replicas[1 if busy == "a" else 0].alive = False  # and a dead one
    call()
    assert log[-1] == busy
    replicas[0].alive = replicas[1].alive = False
    with pytest.raises(EngineUnavailable):
        call()
    replicas[0].alive = True
    dp._draining = True
    with pytest.raises(EngineUnavailable, match="shutting down"):
        call()
