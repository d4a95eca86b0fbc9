"""Offline ``LLM`` with its engine core in a process of its own
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, ``paged_engine/mp_engine.py``) on the tiny Qwen3: the
same outputs as the in-process ``LLM`` (greedy, ``n=2``, stop strings, logprobs, seeded
sampling, chat), the same refusals with nothing left queued, Ctrl-C aborting the call's
requests in the core, a killed core failing ``generate`` by name, ``close()`` and
interpreter exit leaving no process behind, and the variable's values."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.engine.request import RequestOutput
from paged_engine.errors import InvalidRequestError
from paged_engine.llm import MULTIPROCESSING_ENV, multiprocessing_enabled
from paged_engine.llm_engine import LLMEngine
from paged_engine.mp_engine import MultiprocessLLMEngine

pytestmark = pytest.mark.timeout(180)
ARGS: dict[str, Any] = dict(block_size=8, num_threads=1, num_kvcache_blocks=128, max_model_len=512)
PROMPTS = ["The KV cache is", "Hello, world!", "Paged attention"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG_TOKENS = 480
LONG = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
"""Hundreds of steps: still running when the call is interrupted or the core killed."""


def running(pid: int) -> bool:
    """``pid`` is a live process (not gone, not a zombie left unreaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def build(model: Path, env: str) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MULTIPROCESSING_ENV, env)
        return LLM(model, **ARGS)


@pytest.fixture(scope="module")
def mp_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = build(tiny_model_dir, "1")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ref_llm(tiny_model_dir: Path) -> LLM:
    return build(tiny_model_dir, "0")


def view(out: RequestOutput) -> tuple[Any, ...]:
    """Everything but the request id and the wall-clock metrics."""
    return (
        out.prompt,
        out.prompt_token_ids,
        out.prompt_logprobs,
        out.outputs,
        out.finished,
        out.num_cached_tokens,
    )


def settled(llm: LLM, prompt_tokens: int = 0) -> Any:
    """The core's counters once nothing runs or waits in it and it has admitted
    ``prompt_tokens`` prompt tokens in all (within 20 s): the snapshot comes after a step's
    outputs, so one read right after them may be older than the step."""
    engine = llm.llm_engine
    assert isinstance(engine, MultiprocessLLMEngine)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snap = engine.snapshot
        idle = snap is not None and snap.running == 0 and snap.waiting == 0
        if idle and snap.prompt_tokens >= prompt_tokens:
            return snap
        time.sleep(0.02)
    raise AssertionError(f"the core still has work: {engine.snapshot}")


def core_children(pid: int) -> list[int]:
    return [
        int(c)
        for children in Path(f"/proc/{pid}/task").glob("*/children")
        for c in children.read_text().split()
        if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
        and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def test_the_engine_and_its_records(mp_llm: LLM, ref_llm: LLM) -> None:
    engine = mp_llm.llm_engine
    assert isinstance(engine, MultiprocessLLMEngine)
    assert isinstance(ref_llm.llm_engine, LLMEngine) and ref_llm.model_runner is not None
    assert engine.core_pid != os.getpid() and running(engine.core_pid)
    assert core_children(engine.core_pid) == []  # the core's own LLM runs in its process
    assert mp_llm.model_runner is None and mp_llm.last_run_stats is None
    assert mp_llm.config == ref_llm.config
    assert mp_llm.get_tokenizer() is engine.hf_tokenizer is not None
    assert mp_llm.get_default_sampling_params() == ref_llm.get_default_sampling_params()
    with pytest.raises(NotImplementedError, match="multiprocess mode"):
        mp_llm.reset_prefix_cache()


def test_outputs_equal_the_in_process_llm(mp_llm: LLM, ref_llm: LLM) -> None:
    salt = f"equal-{time.monotonic_ns()}"  # both caches see these prompts for the first time
    ids = ref_llm.tokenizer.encode("A list of token ids")
    prompts: list[Any] = [{"prompt": p, "cache_salt": salt} for p in PROMPTS]
    prompts += [{"prompt_token_ids": ids, "cache_salt": salt}, {"prompt": PROMPTS[0]}]
    params = [
        GREEDY,
        SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=24, stop=("e", "at"), ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=16, ignore_eos=True),
    ]
    got = mp_llm.generate(prompts, params, use_tqdm=False)
    want = ref_llm.generate(prompts, params, use_tqdm=False)
    assert [view(o) for o in got] == [view(o) for o in want]
    assert len(got[1].outputs) == 2 and got[3].outputs[0].logprobs is not None
    assert any(o.stop_reason in ("e", "at") for o in got[2].outputs)
    ints = [int(o.request_id) for o in got]
    assert ints == list(range(ints[0], ints[0] + len(prompts)))
    # one prompt and one params, plain strings and token ids, and chat
    (one,) = mp_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert one.outputs == ref_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs
    by_ids = mp_llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.outputs == ref_llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert [o.outputs for o in mp_llm.chat(chat, GREEDY, use_tqdm=False)] == [
        o.outputs for o in ref_llm.chat(chat, GREEDY, use_tqdm=False)
    ]


def test_a_bad_request_is_refused_as_in_process_and_nothing_is_queued(
    mp_llm: LLM, ref_llm: LLM
) -> None:
    before = settled(mp_llm)
    bad = [GREEDY, SamplingParams(max_tokens=600)]  # past max_model_len (512)
    with pytest.raises(InvalidRequestError) as got:
        mp_llm.generate(PROMPTS[:2], bad, use_tqdm=False)
    with pytest.raises(InvalidRequestError) as want:
        ref_llm.generate(PROMPTS[:2], bad, use_tqdm=False)
    assert str(got.value) == str(want.value) and "prompt 1" in str(got.value)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        mp_llm.generate(PROMPTS[:2], [GREEDY], use_tqdm=False)
    outs = mp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs for o in outs] == [
        o.outputs for o in ref_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    # the core admitted this call's prompts and nothing of the refused one
    expected = before.prompt_tokens + sum(len(o.prompt_token_ids) for o in outs)
    assert settled(mp_llm, expected).prompt_tokens == expected


class _InterruptingBar:
    """tqdm, but its first ``update`` (a request finished) is a Ctrl-C."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        return None

    def update(self, n: int) -> None:
        raise KeyboardInterrupt

    def close(self) -> None:
        return None


def test_ctrl_c_aborts_the_requests_in_the_core_and_leaves_it_usable(
    mp_llm: LLM, ref_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = settled(mp_llm)
    short = SamplingParams(temperature=0, max_tokens=1)
    monkeypatch.setattr("paged_engine.mp_engine.tqdm", _InterruptingBar)
    with pytest.raises(KeyboardInterrupt) as caught:
        mp_llm.generate(PROMPTS[:2], [short, LONG])
    (finished,) = caught.value.partial_outputs  # type: ignore[attr-defined]
    assert finished.prompt == PROMPTS[0] and len(finished.outputs[0].token_ids) == 1
    # the long request was aborted in the core, not run to its end
    after = settled(mp_llm, before.prompt_tokens + 1)
    assert after.output_tokens - before.output_tokens < 1 + LONG_TOKENS
    monkeypatch.undo()
    outs = mp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs for o in outs] == [
        o.outputs for o in ref_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ]


def test_a_real_sigint_while_waiting_for_the_core(mp_llm: LLM) -> None:
    engine = mp_llm.llm_engine
    assert isinstance(engine, MultiprocessLLMEngine)
    before = settled(mp_llm)
    returned = threading.Event()

    def interrupt() -> None:  # once the long request runs in the core
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not returned.is_set():
            snap = engine.snapshot
            if snap is not None and snap.running:
                time.sleep(0.05)
                if not returned.is_set():
                    os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    sender = threading.Thread(target=interrupt)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            mp_llm.generate(PROMPTS[0], LONG, use_tqdm=False)
    finally:
        returned.set()
        sender.join()
    after = settled(mp_llm, before.prompt_tokens + 1)
    assert after.output_tokens - before.output_tokens < LONG_TOKENS
    assert len(mp_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_a_killed_core_fails_generate_by_name(tiny_model_dir: Path) -> None:
    llm = build(tiny_model_dir, "1")
    engine = llm.llm_engine
    assert isinstance(engine, MultiprocessLLMEngine)
    pid = engine.core_pid

    def kill() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            snap = engine.snapshot
            if snap is not None and snap.running:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"engine core process died \(exit code -9\)"):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
    finally:
        killer.join()
    with pytest.raises(RuntimeError, match=r"died.*build a new LLM"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.close()
    assert gone(pid, 5.0)


def test_close_ends_the_core_process(tiny_model_dir: Path) -> None:
    llm = build(tiny_model_dir, "1")
    engine = llm.llm_engine
    assert isinstance(engine, MultiprocessLLMEngine)
    pid = engine.core_pid
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)) == 1
    assert running(pid)
    llm.close()
    assert not running(pid)  # close() waited for it
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)


SCRIPT = """
import sys
from paged_engine import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], block_size=8, num_threads=1, num_kvcache_blocks=64, max_model_len=128)
    print(llm.llm_engine.core_pid, flush=True)
    llm.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)
"""


def test_interpreter_exit_without_close_leaves_no_core(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "forgets_close.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, MULTIPROCESSING_ENV: "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert gone(int(done.stdout.split()[0]), 5.0)


@pytest.mark.parametrize("value", ["yes", "2", "true", "on"])
def test_other_values_of_the_variable_are_refused(
    value: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MULTIPROCESSING_ENV, value)
    with pytest.raises(ValueError, match=f"{MULTIPROCESSING_ENV}='{value}': use 1"):
        LLM(tiny_model_dir, **ARGS)


def test_the_variable_unset_or_0_means_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "", " 0 "):
        monkeypatch.setenv(MULTIPROCESSING_ENV, value)
        assert multiprocessing_enabled() is False
    monkeypatch.delenv(MULTIPROCESSING_ENV)
    assert multiprocessing_enabled() is False
    monkeypatch.setenv(MULTIPROCESSING_ENV, "1")
    assert multiprocessing_enabled() is True


def test_from_engine_args_refuses_multiprocessing(tiny_model_dir: Path) -> None:
    from paged_engine import EngineArgs

    with pytest.raises(NotImplementedError, match="enable_multiprocessing=True: LLMEngine runs"):
        LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir), enable_multiprocessing=True)


def test_serve_with_the_engine_on_a_thread_ignores_the_variable(tiny_model_dir: Path) -> None:
    """``--engine-core thread`` means the engine in the server's process: the variable,
    meant for offline ``LLM``, must not put it in another (its loop would have no engine)."""
    import openai

    from tests.test_server_support import MODEL, serve_process

    env = {MULTIPROCESSING_ENV: "1"}
    with serve_process(tiny_model_dir, "--engine-core", "thread", env=env) as (url, _):
        api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        got = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert got.choices[0].finish_reason == "length"
        assert len(got.choices[0].text) > 0
