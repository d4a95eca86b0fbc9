"""The API process's half of the output pipeline (``entrypoints/core_outputs.py``) agrees
with the engine's own: one machine drives two engines over the same model in lockstep,
the reference with each request's params as the client gave them, the "core" with
``core_params`` (tokens only, ``DELTA``), whose outputs go over the wire format
(``core_wire.encode``) into ``TextOutputs``. After every step, the outputs the client
would get must be equal, field for field (the timings aside); a request a stop string
ends in the API process is aborted in the core before the next step, as the core client
does. Hypothesis draws the params: stop strings cut from what the model says, with and
without ``include_stop_str_in_output``, ``min_tokens``, ``n``, logprobs, prompt logprobs,
special tokens, and the three output kinds.

Then the table around it (``core_streams.CoreStreams``): a request whose text cannot be
made fails alone, a restarted request starts over, and the metrics see one ``ended`` per
request."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_engine import LLM, SamplingParams
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.core_outputs import TextOutputs
from paged_engine.entrypoints.core_streams import CoreStreams
from paged_engine.entrypoints.core_wire import Restarted, WireCompletion, WireOutput, encode
from paged_engine.entrypoints.loop_types import RequestFailed
from paged_engine.sampling_params import RequestOutputKind

PROMPTS = ["The KV cache", "Paged attention keeps", "A block table maps"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Any, Any, Any]:
    ref = LLM(tiny_model_dir, block_size=8, num_threads=1)
    core = LLM(tiny_model_dir, block_size=8, num_threads=1)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    said = [o.outputs[0] for o in ref.generate(PROMPTS, free, use_tqdm=False)]
    return ref.llm_engine, core.llm_engine, said


def shown(out: RequestOutput) -> Any:
    """Everything the client reads but the wall-clock timings."""
    return replace(out, metrics=None)


def same(got: Any, want: Any, where: str = "") -> None:
    """Equal, but for float noise in logprobs: an ``n > 1`` request's completion that a
    stop string ends here keeps running in the core until the request ends, so later
    steps batch a row more than in the reference, and the logits' last bits may differ."""
    if isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5), where
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), where
        for f in dataclasses.fields(want):
            same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def lockstep(ref: Any, core: Any, requests: list[tuple[str, str, SamplingParams]]) -> int:
    """Run ``requests`` through both engines; assert equal client outputs after every
    step. Returns how many requests ended by a stop string in the API process."""
    assert ref.reset_prefix_cache() and core.reset_prefix_cache()  # the same cache hits
    text = TextOutputs(ref.tokenizer)
    introduced: set[str] = set()
    for rid, prompt, params in requests:
        ref.add_request(rid, prompt, params)
        sent = text.add(rid, params)
        if sent.output_kind is RequestOutputKind.FINAL_ONLY:  # as the relaying Routes do
            sent = replace(sent, output_kind=RequestOutputKind.DELTA)
        core.add_request(rid, prompt, sent)
    ended_here = 0
    for _ in range(200):
        if not (ref.has_unfinished_requests() or core.has_unfinished_requests()):
            return ended_here
        want = {o.request_id: shown(o) for o in ref.step()}
        got = {}
        abort = []
        for out in core.step():
            first = out.request_id not in introduced
            introduced.add(out.request_id)
            built = text.build(encode(out, first))
            if built is None:
                continue
            if built.client is not None:
                got[out.request_id] = shown(built.client)
            if built.ended_here:
                abort.append(out.request_id)
        core.abort_request(abort)
        ended_here += len(abort)
        same(dict(sorted(got.items())), dict(sorted(want.items())))
    raise AssertionError("the engines did not finish")


KINDS = list(RequestOutputKind)


@st.composite
def request_params(draw: st.DrawFn, free_run: Any) -> SamplingParams:
    said, tokens = free_run.text, free_run.token_ids
    stop_tokens = draw(st.lists(st.sampled_from(tokens[1:]), max_size=1))
    stops: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        if len(said) > 2:
            at = draw(st.integers(0, len(said) - 2))
            stops.append(said[at : at + draw(st.integers(1, 4))])
    seeded = draw(st.booleans())
    max_tokens = draw(st.integers(1, 24))
    return SamplingParams(
        temperature=0.8 if seeded else 0.0,
        seed=draw(st.integers(0, 3)) if seeded else None,
        max_tokens=max_tokens,
        ignore_eos=True,
        stop_token_ids=tuple(stop_tokens),
        n=draw(st.integers(1, 2)) if seeded else 1,
        stop=tuple(stops),
        include_stop_str_in_output=draw(st.booleans()),
        min_tokens=min(max_tokens, draw(st.sampled_from([0, 0, 3]))),
        logprobs=draw(st.sampled_from([None, None, 2])),
        prompt_logprobs=draw(st.sampled_from([None, None, 1])),
        skip_special_tokens=draw(st.booleans()),
        output_kind=draw(st.sampled_from(KINDS)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_api_side_text_agrees_with_the_engine(engines: Any, data: st.DataObject) -> None:
    ref, core, said = engines
    k = data.draw(st.integers(1, len(PROMPTS)))
    requests = [
        (f"r{i}", PROMPTS[i], data.draw(request_params(said[i]), label=f"params {i}"))
        for i in range(k)
    ]
    try:
        lockstep(ref, core, requests)
    finally:  # a failed example leaves nothing behind for the next
        for engine in (ref, core):
            engine.abort_request([r for r, _, _ in requests])


def test_a_stop_string_ends_the_request_in_the_api_process(engines: Any) -> None:
    ref, core, said = engines
    stop = said[0].text[3:6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,))
    assert lockstep(ref, core, [("s", PROMPTS[0], params)]) == 1
    assert not core.has_unfinished_requests()


class _Observer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def added(self, request_ids: list[str], arrival_time: float) -> None:
        self.calls.append(("added", tuple(request_ids)))

    def output(self, out: RequestOutput) -> None:
        self.calls.append(("output", out.request_id))

    def ended(self, request_id: str, how: str) -> None:
        self.calls.append(("ended", (request_id, how)))


class _Tok:
    """Decodes each id to one letter; id 13 cannot be decoded."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        if 13 in ids:
            raise RuntimeError("13 cannot be decoded")
        return "".join(chr(97 + i % 26) for i in ids)


def wire(rid: str, tokens: list[int], finish: str | None = None) -> WireOutput:
    c = WireCompletion(0, tokens, None, None, finish, None)
    times = (0.0, None, None, None, None)
    return WireOutput(rid, (c,), finish is not None, 0, times, None, [1], None)


def test_a_request_whose_text_fails_fails_alone() -> None:
    streams = CoreStreams(_Tok())
    sink: asyncio.Queue[Any] = asyncio.Queue()
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
    sent = streams.open(0, sink, [("a", [1], params), ("b", [1], params)])
    assert [p.detokenize for _, _, p in sent] == [False, False]
    obs = _Observer()
    batch, ended_here = streams.deliver([(0, wire("a", [0, 1])), (0, wire("b", [13]))], obs)
    events = [e for _, e in batch]
    assert isinstance(events[1], RequestFailed) and events[1].request_id == "b"
    assert events[1].status == 500 and "13 cannot be decoded" in events[1].message
    assert isinstance(events[0], RequestOutput) and events[0].outputs[0].text == "ab"
    assert ended_here == ["b"]
    assert obs.calls == [("output", "a"), ("ended", ("b", "failed"))]
    streams.core_ended("b", "aborted", obs)  # the core's report of the abort: dropped
    assert obs.calls[-1] == ("ended", ("b", "failed"))
    batch, _ = streams.deliver([(0, wire("a", [2], "length"))], obs)
    assert [e.outputs[0].text for _, e in batch] == ["c"]
    assert obs.calls[-1] == ("ended", ("a", "finished"))
    streams.core_ended("a", "finished", obs)  # reported by its final output already
    assert obs.calls[-1] == ("ended", ("a", "finished")) and len(obs.calls) == 4
    assert len(streams) == 0


def test_a_restarted_request_starts_over() -> None:
    streams = CoreStreams(_Tok())
    sink: asyncio.Queue[Any] = asyncio.Queue()
    final = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    streams.open(0, sink, [("a", [1], final)])
    obs = _Observer()
    assert streams.deliver([(0, wire("a", [3, 4]))], obs)[0] == []  # merged: not yet
    assert streams.deliver([(0, Restarted("a"))], obs)[0] == []
    batch, _ = streams.deliver([(0, wire("a", [0])), (0, wire("a", [1], "length"))], obs)
    (out,) = [e for _, e in batch]
    assert out.outputs[0].text == "ab" and out.outputs[0].token_ids == [0, 1]


def test_a_disconnect_closes_the_stream_and_is_reported() -> None:
    streams = CoreStreams(_Tok())
    sink: asyncio.Queue[Any] = asyncio.Queue()
    streams.open(0, sink, [("a", [1], SamplingParams()), ("b", [1], SamplingParams())])
    obs = _Observer()
    streams.core_ended("a", "aborted", obs)
    assert len(streams) == 1 and obs.calls == [("ended", ("a", "aborted"))]
    streams.core_ended("b", "aborted", obs)
    assert len(streams) == 0
    assert streams.deliver([(0, wire("b", [1]))], obs)[0] == []  # late news: dropped


class _UnstableTok(_Tok):
    """As ``_Tok``, but ``1, 2`` together decode to "Z": text that is not prefix-stable
    (as ``clean_up_tokenization_spaces`` makes), so pieces differ from the whole."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return super().decode(ids, skip_special_tokens).replace("bc", "Z")


def test_a_final_only_request_s_text_is_decoded_once_at_the_end_as_in_process() -> None:
    """In process, a ``FINAL_ONLY`` request without stop strings is decoded once, whole
    (``request_builder``); the API process does the same, so both give the same text."""
    tok = _UnstableTok()
    final = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    stopped = replace(final, stop=("zz",))
    streams = CoreStreams(tok)
    sink: asyncio.Queue[Any] = asyncio.Queue()
    streams.open(0, sink, [("a", [1], final), ("b", [1], stopped)])
    obs = _Observer()
    steps = [[0, 1], [2], [3]]
    for i, tokens in enumerate(steps):
        finish = "length" if i == len(steps) - 1 else None
        batch, _ = streams.deliver([(0, wire(r, tokens, finish)) for r in "ab"], obs)
    got = {e.request_id: e.outputs[0].text for _, e in batch}
    assert got["a"] == tok.decode([0, 1, 2, 3]) == "aZd"
    assert got["b"] != got["a"]  # stop strings are searched in text made as it comes


def test_news_of_a_request_that_ended_here_is_dropped() -> None:
    """A stop string ended "a" here: the core's later failure of it reaches no one (its
    client has its final output), while "b" of the same submit goes on."""
    streams = CoreStreams(_Tok())
    sink: asyncio.Queue[Any] = asyncio.Queue()
    params = SamplingParams(max_tokens=8, stop=("c",), output_kind=RequestOutputKind.DELTA)
    streams.open(0, sink, [("a", [1], params), ("b", [1], SamplingParams(max_tokens=8))])
    obs = _Observer()
    batch, ended_here = streams.deliver([(0, wire("a", [0, 1, 2]))], obs)
    assert ended_here == ["a"] and batch[0][1].finished
    late = RequestFailed("a", "the engine failed", 500)
    batch, _ = streams.deliver([(0, late), (0, wire("b", [3]))], obs)
    assert [(type(e).__name__, e.request_id) for _, e in batch] == [("RequestOutput", "b")]


def test_a_finished_request_whose_text_fails_is_not_aborted_in_the_core() -> None:
    """The core has ended it already (its report came first): nothing to abort there,
    and nothing waits for a report that will not come."""
    streams = CoreStreams(_Tok())
    sink: asyncio.Queue[Any] = asyncio.Queue()
    streams.open(0, sink, [("a", [1], SamplingParams(max_tokens=1))])
    obs = _Observer()
    streams.core_ended("a", "finished", obs)  # sent before the events, as the core does
    batch, ended_here = streams.deliver([(0, wire("a", [13], "length"))], obs)
    assert ended_here == [] and isinstance(batch[0][1], RequestFailed)
    assert obs.calls == [("ended", ("a", "failed"))] and len(streams) == 0


def test_a_merged_output_keeps_its_lists_while_more_is_gathered() -> None:
    streams = CoreStreams(_Tok())
    sink: asyncio.Queue[Any] = asyncio.Queue()
    cumulative = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.CUMULATIVE)
    streams.open(0, sink, [("a", [1], cumulative)])
    obs = _Observer()
    (first,) = [e for _, e in streams.deliver([(0, wire("a", [0, 1]))], obs)[0]]
    (second,) = [e for _, e in streams.deliver([(0, wire("a", [2], "length"))], obs)[0]]
    assert first.outputs[0].token_ids == [0, 1] and first.outputs[0].text == "ab"
    assert second.outputs[0].token_ids == [0, 1, 2] and second.outputs[0].text == "abc"
