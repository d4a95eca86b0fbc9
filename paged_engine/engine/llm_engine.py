"""LLMEngine: requests in, finished outputs out, one scheduler step at a time.

The engine is torch-free: the model runner is anything with ``run(seqs, is_prefill) ->
list[int]`` (one sampled token per scheduled sequence; ignored for a prefill chunk that
does not finish its prompt). That lets the whole loop be verified with a deterministic fake
model in milliseconds, and the real runner (``model_runner.py``) plug in unchanged.

Every request is validated in full before any state changes: a refused request leaves the
engine exactly as it was, and everything else keeps being served. Steps are atomic (see
the scheduler's docstring): a step that raises leaves every request either as it was or
preempted, and the engine keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, replace
from numbers import Integral
from typing import Any, Protocol

from tqdm.auto import tqdm

from paged_engine.config import EngineConfig
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.scheduler import Allocator, FailedSample, Scheduler, SchedulerStats
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams

Prompt = str | SequenceABC[int]
ParamsLike = SamplingParams | dict[str, Any]


class ModelRunner(Protocol):
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SequenceABC[int | FailedSample | None]:
        """One sampled token per sequence (``FailedSample`` where it could not sample);
        None (or anything) for a prefill chunk that does not finish its prompt."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: Any) -> Any: ...
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """The generated tokens (the prompt excluded)."""
    finish_reason: str
    """"stop" (EOS or a stop token), "length" (max_tokens or max_model_len) or "error"
    (the model's output for it could not be sampled: ``stop_reason`` says why)."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache when the request was first admitted."""
    text: str | None = None
    stop_reason: str | None = None
    """For ``finish_reason == "error"``: why."""


@dataclass(frozen=True, slots=True)
class RunStats:
    """What one ``generate`` call did (the scheduler's counters over the run)."""

    num_requests: int
    prompt_tokens: int
    prefill_tokens: int
    """Tokens computed by prefill steps: uncached prompt tokens plus recomputation."""
    decode_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    peak_blocks_in_use: int
    num_blocks: int
    steps: int
    elapsed_s: float

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Generated tokens (one per request per decode step plus the prefill's first)."""
        return (self.decode_tokens + self.num_requests) / self.elapsed_s if self.elapsed_s else 0.0


class LLMEngine:
    def __init__(
        self,
        model_runner: ModelRunner,
        config: EngineConfig,
        *,
        vocab_size: int,
        num_kvcache_blocks: int | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        tokenizer: Tokenizer | None = None,
        block_manager: Allocator | None = None,
        scheduler_cls: type[Scheduler] = Scheduler,
    ) -> None:
        """``eos_token_id`` is one id or several (a model whose generation config lists
        several stops at each); ``num_kvcache_blocks`` is the pool the runner allocated
        (default: the config's);
        ``block_manager`` replaces the engine's allocator (tests run the spec in the loop),
        ``scheduler_cls`` the scheduler (tests run deliberately broken ones)."""
        pool = num_kvcache_blocks or config.num_kvcache_blocks
        if pool is None:
            raise ValueError("the KV pool size is unknown: set config.num_kvcache_blocks")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.config = config
        self.model_runner = model_runner
        self.vocab_size = vocab_size
        if eos_token_id is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos_token_id, int):
            eos_ids = (eos_token_id,)
        else:
            eos_ids = tuple(eos_token_id)
        for e in eos_ids:
            if not isinstance(e, int) or isinstance(e, bool) or e < 0:
                raise ValueError(f"eos_token_id must hold ints >= 0, got {eos_token_id!r}")
        self.eos_token_ids = eos_ids
        self.tokenizer = tokenizer
        self.num_blocks = pool
        self.block_manager = block_manager or BlockManager(
            pool,
            config.kvcache_block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = scheduler_cls(
            self.block_manager,
            num_blocks=pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=eos_ids,
            prefix_aware=config.enable_prefix_caching,
        )
        self._requests: dict[int, Sequence] = {}
        self.last_run_stats: RunStats | None = None

    # ---- validation ------------------------------------------------------------------------

    def _prompt_tokens(self, prompt: object, where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(f"{where}: a text prompt needs a tokenizer; pass token ids")
            tokens = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list | tuple):
            tokens = list(prompt)
        else:
            raise TypeError(
                f"{where}: a prompt is a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not tokens:
            raise ValueError(f"{where}: the prompt is empty")
        # The common case, checked at C speed; otherwise find and name the offending token.
        if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < self.vocab_size:
            return tokens
        ids: list[int] = []
        for i, t in enumerate(tokens):
            if not isinstance(t, Integral) or isinstance(t, bool):
                raise TypeError(f"{where}: token {i} is {t!r}, not an int")
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(
                    f"{where}: token {i} is {t}, outside the vocabulary [0, {self.vocab_size})"
                )
            ids.append(int(t))
        return ids

    @staticmethod
    def _params(params: object, where: str) -> SamplingParams:
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, dict):
            return SamplingParams.from_dict(params)
        raise TypeError(
            f"{where}: sampling params must be SamplingParams or a dict, got {params!r}"
        )

    def _validate(
        self, prompt: object, params: object, where: str
    ) -> tuple[list[int], SamplingParams]:
        tokens = self._prompt_tokens(prompt, where)
        sp = self._params(params, where)
        cfg = self.config
        if len(tokens) + sp.max_tokens > cfg.max_model_len:
            raise ValueError(
                f"{where}: prompt ({len(tokens)} tokens) + max_tokens ({sp.max_tokens}) "
                f"exceeds max_model_len ({cfg.max_model_len})"
            )
        # The last sampled token is never computed, so it needs no slot.
        need = num_blocks(len(tokens) + sp.max_tokens - 1, cfg.kvcache_block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"{where}: the request needs {need} KV blocks at full length but the pool "
                f"has {self.num_blocks}"
            )
        return tokens, sp

    # ---- the request API -------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: ParamsLike | None = None) -> int:
        """Queue a request; returns its id. Refused (ValueError/TypeError) before any change."""
        tokens, sp = self._validate(prompt, params or SamplingParams(), "add_request")
        return self._add(tokens, sp)

    def _add(self, tokens: list[int], params: SamplingParams) -> int:
        seq = Sequence(tokens, params, block_size=self.config.kvcache_block_size)
        self._requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort_request(self, request_id: int) -> bool:
        """Drop a request and free its blocks at once; False if it is not in the engine
        (a finished request whose output was not delivered yet can still be aborted)."""
        seq = self._requests.pop(request_id, None)
        return seq is not None and self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or has an output not yet returned."""
        return not self.scheduler.is_finished() or bool(self.scheduler.finished)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step through the model; return the requests finished in it
        (and any finished earlier whose outputs a failed step did not deliver).

        If anything raises (the scheduler, the model runner, the sampler, building an
        output, KeyboardInterrupt), the same exception propagates. The scheduler has then
        recovered (see its docstring): every request is either committed or preempted,
        and calling ``step()`` again goes on as if the fault had not happened. Finished
        requests are delivered only once every one of their outputs is built, so a
        failure there loses none: they come out of the next ``step()``. On an idle
        engine it returns ``[]`` and changes nothing.
        """
        sched = self.scheduler
        if not sched.is_finished():
            seqs, is_prefill = sched.schedule()
            try:
                token_ids = self.model_runner.run(seqs, is_prefill)
                sched.postprocess(seqs, token_ids, is_prefill)
            except BaseException:
                sched.recover()
                raise
        if not sched.finished:
            return []
        outputs = [self._output(seq) for seq in sched.finished]
        for seq in sched.finished:
            del self._requests[seq.seq_id]
            sched.errors.pop(seq.seq_id, None)
        sched.finished.clear()
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = seq.completion_token_ids
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=tuple(seq.prompt_token_ids),
            token_ids=tuple(completion),
            finish_reason=self.scheduler.finish_reason(seq),
            num_cached_tokens=seq.num_prefix_hit_tokens or 0,
            text=text,
            stop_reason=self.scheduler.errors.get(seq.seq_id),
        )

    # ---- batch generation ------------------------------------------------------------------

    def generate(
        self,
        prompts: SequenceABC[Prompt],
        params: ParamsLike | SequenceABC[ParamsLike] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in input order. ``params`` is one set for
        all prompts or one per prompt. Every request is validated before any is queued.

        If a step raises, the requests this call added are aborted (every block is freed;
        blocks they completed stay registered in the prefix cache, which is valid) and the
        same exception propagates, carrying the outputs of the requests that had finished
        (in input order) as its ``partial_outputs`` attribute. The engine is idle again.
        """
        if self.has_unfinished_requests():
            raise RuntimeError(
                "generate() needs an idle engine: requests added with add_request() are "
                "unfinished; drive them with step() first"
            )
        if isinstance(prompts, str) or not isinstance(prompts, SequenceABC):
            raise TypeError("prompts must be a list of prompts (strings or token-id lists)")
        if params is None or isinstance(params, SamplingParams | dict):
            per_prompt: list[Any] = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(
                    f"got {len(per_prompt)} sampling params for {len(prompts)} prompts"
                )
        checked = [
            self._validate(p, sp, f"prompt {i}")
            for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True))
        ]
        ids = [self._add(tokens, sp) for tokens, sp in checked]
        before = _copy_stats(self.scheduler.stats)
        self.scheduler.stats.peak_blocks_in_use = 0
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, dynamic_ncols=True)
        prefill_rate = decode_rate = 0.0
        start = time.perf_counter()
        try:
            while self.has_unfinished_requests():
                t0 = time.perf_counter()
                stats = self.scheduler.stats
                prefill0, decode0 = stats.prefill_tokens, stats.decode_tokens
                for out in self.step():
                    outputs[out.request_id] = out
                    bar.update(1)
                dt = max(time.perf_counter() - t0, 1e-9)
                if stats.prefill_tokens > prefill0:
                    prefill_rate = (stats.prefill_tokens - prefill0) / dt
                else:
                    decode_rate = (stats.decode_tokens - decode0) / dt
                bar.set_postfix_str(
                    f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                    refresh=False,  # redrawn at tqdm's own pace, not every step
                )
        except BaseException as exc:
            for i in ids:
                self.abort_request(i)
            _attach_partial_outputs(exc, [outputs[i] for i in ids if i in outputs])
            raise
        finally:
            bar.close()
        self.last_run_stats = _run_stats(
            before, self.scheduler.stats, len(ids), self.num_blocks, time.perf_counter() - start
        )
        return [outputs[i] for i in ids]


def _attach_partial_outputs(exc: BaseException, outputs: list[RequestOutput]) -> None:
    try:
        exc.partial_outputs = outputs  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type with __slots__: nothing to do
        return
    if outputs and hasattr(exc, "add_note"):
        exc.add_note(f"generate: {len(outputs)} request(s) had finished: see .partial_outputs")


def _copy_stats(s: SchedulerStats) -> SchedulerStats:
    return replace(s)


def _run_stats(
    before: SchedulerStats, after: SchedulerStats, n: int, pool: int, elapsed: float
) -> RunStats:
    return RunStats(
        num_requests=n,
        prompt_tokens=after.prompt_tokens - before.prompt_tokens,
        prefill_tokens=after.prefill_tokens - before.prefill_tokens,
        decode_tokens=after.decode_tokens - before.decode_tokens,
        cached_prompt_tokens=after.cached_prompt_tokens - before.cached_prompt_tokens,
        preemptions=after.preemptions - before.preemptions,
        peak_blocks_in_use=after.peak_blocks_in_use,
        num_blocks=pool,
        steps=after.steps - before.steps,
        elapsed_s=elapsed,
    )
