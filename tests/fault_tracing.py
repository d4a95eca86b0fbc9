"""Where a step can fail: every call it makes into (or out of) ``paged_engine/engine/``,
found by tracing real runs with ``sys.setprofile``, and a fault injected at any one of them.

A *call site* is a Python function called from one line: the callee (``qualname`` and
where it is defined) and the caller's file and line. It counts when the callee is defined
in ``paged_engine/engine/`` or the caller's line is there (so the engine's calls into the
model runner, the tokenizer or tqdm count too). C functions are not sites: a profile hook
cannot make them raise. ``trace`` records the sites a run reaches, in order; ``inject``
replays the same run and raises at the ``k``-th call of one site, just before the callee's
first line (a KeyboardInterrupt arrives exactly there: CPython checks for signals on
entering a function). Runs are deterministic (the fake model, the fake tokenizer), so
the ``k``-th call of a replay is the traced one.

``Scenario`` is the traced workload: prefill, chunked prefill, prefix hits, decode,
preemption, stop strings, stop tokens, EOS, logprobs and prompt logprobs, ``n > 1``,
the three output kinds, a failed sample, an abort, and requests added while others run;
once through ``step()`` (streaming), once through ``generate``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import xxhash

import paged_engine.engine
from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.outputs import FailedSample, SampleOutput, TokenLogprobs
from paged_engine.engine.request import RequestOutput
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_machine import CheckedRunner
from tests.fake_model import FakeTokenizer, next_token

ENGINE_DIR = str(Path(paged_engine.engine.__file__).parent) + "/"
ROOT = str(Path(paged_engine.engine.__file__).parents[2]) + "/"


# ---- the model: the fake, with logprobs and a failed sample ----------------------------------


VOCAB = 7
EOS = 0
POISON = 6
"""A prompt starting with this token cannot be sampled (``FailedSample``)."""


def fake_logprobs(context: list[int], token: int, k: int, seed: int | None) -> TokenLogprobs:
    """Deterministic logprobs of ``token`` after ``context``: a function of both and of the
    sampling seed (a model whose rows depended on the seed would show which completion
    computed a row)."""
    h = xxhash.xxh64_intdigest(repr((context, token, seed)).encode())
    top = tuple((t, -0.5 * (r + 1) - (h % 7) / 100) for r, t in enumerate(range(k)))
    return TokenLogprobs(token, -((h % 1000) / 250) - 0.01, 1 + h % 3, top)


class LogprobsRunner(CheckedRunner):
    """The checked fake model (tests/engine_machine.py), returning ``SampleOutput`` with
    logprobs and prompt logprobs where the params ask, and ``FailedSample`` for a prompt
    that starts with ``POISON``."""

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[Any]:
        starts = [(s.num_cached_tokens, s.num_cached_tokens + s.num_scheduled_tokens) for s in seqs]
        tokens: list[Any] = super().run(seqs, is_prefill)
        out: list[Any] = []
        for seq, t, (start, end) in zip(seqs, tokens, starts, strict=True):
            samples = end == seq.num_tokens
            if samples and seq.token_ids[0] == POISON:
                t = FailedSample("logits are not finite")
            p = seq.sampling_params
            if p.logprobs is None and p.prompt_logprobs is None:
                out.append(t if samples else None)
                continue
            ctx = seq.token_ids[:end]
            lps = None
            if samples and p.logprobs is not None and isinstance(t, int):
                lps = fake_logprobs(ctx, t, p.logprobs, p.seed)
            prompt: tuple[TokenLogprobs, ...] = ()
            if p.prompt_logprobs is not None:
                last = min(end, seq.num_prompt_tokens - 1)
                prompt = tuple(
                    fake_logprobs(seq.token_ids[:q], seq.token_ids[q], p.prompt_logprobs, p.seed)
                    for q in range(start + 1, last + 1)
                )
            out.append(SampleOutput(t if samples else None, lps, prompt))
        return out


# ---- the workload ------------------------------------------------------------------------------


CONFIG = EngineConfig(
    max_num_batched_tokens=6,  # prompts are chunked
    max_num_seqs=4,
    max_model_len=24,
    kvcache_block_size=2,
    num_kvcache_blocks=18,  # tight: preemptions happen
)
G: dict[str, Any] = dict(temperature=0)
"""Greedy (the fake model ignores sampling; ``n > 1`` needs a temperature all the same)."""


def _reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


def _text(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


Added = tuple[int, str, list[int], SamplingParams]


def _added(at: int, rid: str, prompt: list[int], **params: Any) -> Added:
    return at, rid, prompt, SamplingParams(**params)


def stream_requests() -> list[Added]:
    """(the step before which it is added, id, prompt, params) of the streaming run."""
    b = [1, 2, 3, 4, 2]
    stop_b = _text(_reference(b, 6)[2:4])  # completed by B's 4th token: a stop string
    delta, final = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
    return [
        _added(0, "A", [1, 2, 3, 4, 1, 2, 3], **G, max_tokens=8, ignore_eos=True, logprobs=1,
               prompt_logprobs=1),
        _added(0, "B", b, **G, max_tokens=9, ignore_eos=True, stop=[stop_b, "<9>"]),
        _added(0, "C", [3, 3, 3, 3, 3, 3, 3, 3, 1], n=2, seed=3, max_tokens=6, ignore_eos=True,
               stop_token_ids=[5], output_kind=delta, logprobs=0),
        _added(0, "D", [4, 1], **G, max_tokens=10, output_kind=final),
        _added(1, "E", [POISON, 1, 2], **G, max_tokens=3),
        _added(2, "F", [2, 2, 2, 2, 2, 1], **G, max_tokens=9, ignore_eos=True),
        _added(3, "G", [1, 2, 3, 4, 1, 2, 4], n=2, seed=7, max_tokens=5, stop_token_ids=[3],
               include_stop_str_in_output=True, prompt_logprobs=0),
    ]  # fmt: skip


ABORT_AT = (5, "F")
"""Before this step, the streaming run aborts this request."""


def generate_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 3], [5, 5, 5, 5, 5, 2, 1], [POISON, 2], [2, 4]]
    stop = _text(_reference(prompts[1], 5)[1:3])
    params = [
        SamplingParams(**G, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(**G, max_tokens=8, ignore_eos=True, stop=[stop]),
        SamplingParams(n=2, seed=5, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(**G, max_tokens=4),
        SamplingParams(**G, max_tokens=9, include_stop_str_in_output=True),
    ]
    return prompts, params


class TracedEngine(LLMEngine):
    """Records the requests whose final outputs its steps delivered (``generate`` keeps
    them to itself until it returns), and hooks ``window`` over ``generate``'s steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delivered: set[str] = set()
        self.window: Profile | None = None

    def _step(self, report_running: bool) -> list[RequestOutput]:
        outs = super()._step(report_running)
        self.delivered.update(o.request_id for o in outs if o.finished)
        return outs

    def _run_to_completion(self, requests: list[Any], use_tqdm: bool) -> list[RequestOutput]:
        if self.window is None:
            return super()._run_to_completion(requests, use_tqdm)
        with hooked(self.window):
            return super()._run_to_completion(requests, use_tqdm)


def fast_tokenizer() -> Any:
    """The fake tokenizer's texts ("<3><1>") from a transformers fast tokenizer over a
    ``tokenizers`` WordLevel model (its decoder fuses the pieces), so that streamed text
    goes through DecodeStream (``detokenizer.stream_backend``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{t}>": t for t in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(">", behavior="merged_with_previous")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, clean_up_tokenization_spaces=False
    )


def build_engine(tokenizer: Any = None, engine_cls: type[LLMEngine] = TracedEngine) -> LLMEngine:
    """The workload's engine: the logprobs fake, the fake tokenizer (or ``tokenizer``),
    EOS 0."""
    return engine_cls(
        LogprobsRunner(CONFIG, VOCAB, 2_000),
        CONFIG,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        tokenizer=tokenizer or FakeTokenizer(),
    )


# ---- tracing -----------------------------------------------------------------------------------


def _where(code: CodeType, line: int) -> str:
    return f"{code.co_filename.removeprefix(ROOT)}:{line}"


@dataclass(slots=True)
class Profile:
    """The profile hook of ``trace`` and ``inject``: counts each site's calls and, armed,
    raises at the ``at``-th call of ``site`` (then unhooks itself)."""

    site: str | None = None
    at: int = 0
    error: type[BaseException] = RuntimeError
    on_fire: Callable[[], None] | None = None
    order: list[str] = field(default_factory=list)
    """Every site reached, in order (``trace``)."""
    counts: dict[str, int] = field(default_factory=dict)
    fired: BaseException | None = None
    dropped: bool = False
    """The fault fired in a generator being closed (a ``genexpr`` that ``all()`` left
    suspended): the interpreter drops what that raises, as it would a KeyboardInterrupt
    arriving then, so the run goes on as if there had been no fault."""
    _names: dict[tuple[CodeType, CodeType, int], str | None] = field(default_factory=dict)

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        caller = frame.f_back
        if caller is None:
            return
        key = (frame.f_code, caller.f_code, caller.f_lineno)
        name = self._names.get(key, "")
        if name == "":
            name = self._names[key] = _site_name(*key)
        if name is None:
            return
        k = self.counts.get(name, 0)
        self.counts[name] = k + 1
        if self.site is None:
            self.order.append(name)
        elif name == self.site and k == self.at:
            sys.setprofile(None)
            if self.on_fire is not None:
                self.on_fire()
            self.fired = self.error(f"injected fault at {name} (call {k})")
            raise self.fired


def _site_name(callee: CodeType, caller: CodeType, line: int) -> str | None:
    """The site's name, or None when neither end is in the engine, or for a finalizer
    (what ``__del__`` raises is printed and dropped, never seen by its caller)."""
    if callee.co_name == "__del__":
        return None
    if not (callee.co_filename.startswith(ENGINE_DIR) or caller.co_filename.startswith(ENGINE_DIR)):
        return None
    where = _where(callee, callee.co_firstlineno)
    return f"{callee.co_qualname} ({where}) <- {_where(caller, line)}"


@contextmanager
def hooked(profile: Profile) -> Iterator[None]:
    """``profile`` hooked for the duration; a fault the interpreter drops (raised in a
    finalizer) is recorded as ``profile.dropped``."""
    previous, unraisable = sys.getprofile(), sys.unraisablehook

    def dropped(info: Any) -> None:
        if info.exc_value is not None and info.exc_value is profile.fired:
            profile.dropped = True
        else:
            unraisable(info)

    sys.unraisablehook = dropped
    sys.setprofile(profile.hook)
    try:
        yield
    finally:
        sys.setprofile(previous)
        sys.unraisablehook = unraisable


# ---- the two runs ------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamRun:
    """What a streaming run returned: every request's outputs in order, and the requests
    aborted (by the workload, or after a fault)."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    faults: int = 0


FaultCheck = Callable[[LLMEngine, BaseException, StreamRun], None]


def run_stream(
    engine: LLMEngine, profile: Profile | None = None, on_fault: FaultCheck | None = None
) -> StreamRun:
    """The streaming workload through ``step()``, each step under ``profile``. The
    injected fault, once it propagates out of ``step()``, goes to ``on_fault`` and the run
    goes on; any other exception propagates."""
    adds = stream_requests()
    last_add = max(at for at, *_ in adds)
    run = StreamRun()
    step = 0
    while step <= last_add or engine.has_unfinished_requests():
        assert step < 400, "the streaming run does not end"
        for at, rid, prompt, params in adds:
            if at == step:
                engine.add_request(rid, prompt, params)
                run.outputs[rid] = []
        if step == ABORT_AT[0] and ABORT_AT[1] not in run.aborted:
            assert engine.abort_request(ABORT_AT[1])
            run.aborted.add(ABORT_AT[1])
        step += 1
        armed = profile is not None and profile.fired is None
        try:
            if armed:
                assert profile is not None
                with hooked(profile):
                    got = engine.step()
            else:
                got = engine.step()
        except BaseException as exc:
            if not armed or profile is None or exc is not profile.fired:
                raise
            run.faults += 1
            assert on_fault is not None
            on_fault(engine, exc, run)
            continue
        for out in got:
            assert out.request_id in run.outputs, f"an output for {out.request_id}"
            assert out.request_id not in run.aborted, f"an output for aborted {out.request_id}"
            run.outputs[out.request_id].append(out)
    return run


def run_generate(engine: LLMEngine, profile: Profile | None = None) -> list[RequestOutput]:
    """The batch through ``generate``, its steps (``_run_to_completion``: queueing, the
    step loop, the results) under ``profile``."""
    prompts, params = generate_batch()
    assert isinstance(engine, TracedEngine)
    engine.window = profile
    try:
        return engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.window = None


KINDS = {"stream": FakeTokenizer, "stream-fast": fast_tokenizer, "generate": FakeTokenizer}
"""The runs, and the tokenizer of each."""


def run(kind: str, engine: LLMEngine, profile: Profile | None = None) -> Any:
    if kind == "generate":
        return run_generate(engine, profile)
    return run_stream(engine, profile)


def trace_sites(kind: str) -> list[str]:
    """Every site a clean run of ``kind`` (a key of ``KINDS``) reaches, in order of the
    calls (a site appears once per call). A first run warms every cache (an ABC's
    ``isinstance``, say), so that the traced run and its replays make the same calls."""
    run(kind, build_engine(KINDS[kind]()))
    profile = Profile()
    run(kind, build_engine(KINDS[kind]()), profile)
    return profile.order


# ---- the checks --------------------------------------------------------------------------------


def check_consistent(engine: LLMEngine, where: str) -> None:
    """Between steps (and after a step that raised): nothing in flight; every live
    request's unfinished completion in exactly one queue, a finished one in none, and no
    other sequence queued; blocks held by running sequences only, as many as their tokens
    need, and R12 with those tables; the output records only of live requests; no
    first-token time without a token; no text ahead of its tokens."""
    sched = engine.scheduler
    assert not sched._in_flight, f"{where}: a step left {list(sched._in_flight)} in flight"
    queued: dict[int, list[str]] = {}
    for name, queue in (("waiting", sched.waiting), ("running", sched.running)):
        for s in queue:
            queued.setdefault(id(s), []).append(name)
    for s in sched.finished:
        queued.setdefault(id(s), []).append("finished")
    live: set[int] = set()
    for rid, r in engine._requests.items():
        for c in r.completions:
            live.add(id(c.seq))
            at = queued.get(id(c.seq), [])
            expected = 0 if c.finish_reason is not None else 1
            assert len(at) == expected, f"{where}: {rid}[{c.index}] ({c.finish_reason}) is in {at}"
            if c.detokenizer is not None:
                assert c.detokenizer.num_tokens <= c.seq.num_completion_tokens, (
                    f"{where}: text ahead"
                )
        if r.first_token_time is not None:
            assert any(c.seq.num_completion_tokens for c in r.completions), (
                f"{where}: {rid} has a first-token time and no token"
            )
    assert set(queued) <= live, f"{where}: a sequence of no live request is queued"
    for s in [*sched.waiting, *sched.finished]:
        assert not s.block_table, f"{where}: {s} holds blocks outside running"
    for s in sched.running:
        need = (s.num_tokens - (0 if s.is_prefill else 1) + s.block_size - 1) // s.block_size
        assert len(s.block_table) == need, f"{where}: the table of {s}"
        if not s.is_prefill:
            assert s.num_cached_tokens == s.num_tokens - 1, f"{where}: the counters of {s}"
    for r in engine._requests.values():
        for c in r.completions:
            if not any(c.seq is s for s in sched.running):
                assert not c.seq.block_table, f"{where}: {c.seq} holds blocks outside running"
    engine.block_manager.check_invariants(list(sched.running))  # type: ignore[attr-defined]
    out = engine.output_processor
    assert {id(s) for s in out.completion_of} == live, f"{where}: the completion table"
    assert all(rid in engine._requests for rid in out.to_report), f"{where}: news of the gone"
    assert all(r.request_id in engine._requests for r in out.needs_text.values()), where


def check_idle(engine: LLMEngine, where: str) -> None:
    """No request, nothing queued or in flight, every block free, R12, no record left."""
    sched, out = engine.scheduler, engine.output_processor
    assert not engine.has_unfinished_requests(), f"{where}: requests left"
    assert not (sched.waiting or sched.running or sched.finished or sched._in_flight), where
    assert not sched.errors, f"{where}: error records left"
    assert not (out.completion_of or out.needs_text or out.to_report or out.staged), where
    bm: Any = engine.block_manager
    assert bm.num_free_blocks == CONFIG.num_kvcache_blocks, f"{where}: blocks not freed"
    bm.check_invariants([])


def result(out: RequestOutput) -> tuple[Any, ...]:
    """An output as a run without faults must reproduce it: every field but the request id
    (generate numbers its requests), the prefix-cache hits (a fault changes what is cached
    when) and the wall-clock times, of which only which are set counts (``metrics_shape``)."""
    return (out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.outputs, out.finished)


def metrics_shape(out: RequestOutput) -> tuple[bool, ...]:
    """Which times are set, after checking that the set ones are in order."""
    m = out.metrics
    times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time]
    times.append(m.finished_time)
    set_times = [t for t in times if t is not None]
    assert set_times == sorted(set_times), f"{out.request_id}: times out of order {m}"
    return tuple(t is None for t in times)


def streamed(outs: list[RequestOutput], delta: bool) -> list[list[Any]]:
    """What a client holds after each output: per completion its text, tokens, logprobs,
    cumulative logprob and ending (DELTA outputs added up). Each output must change it:
    a step reports a request only with news."""
    state: list[list[Any]] | None = None
    history = []
    for out in outs:
        now = [
            [
                c.text,
                list(c.token_ids),
                c.logprobs,
                c.cumulative_logprob,
                c.finish_reason,
                c.stop_reason,
            ]
            for c in out.outputs
        ]
        if delta and state is not None:
            for held, new in zip(state, now, strict=True):
                new[0] = held[0] + new[0]
                new[1] = held[1] + new[1]
                if new[2] is not None:
                    new[2] = (held[2] or []) + new[2]
        assert now != state, f"{out.request_id}: an output with no news ({out})"
        state = now
        history.append(now)
    return history
