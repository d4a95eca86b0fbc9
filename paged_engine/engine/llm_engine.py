"""LLMEngine: requests in, vLLM-shaped outputs out, one scheduler step at a time.

The engine is torch-free: the model runner is anything with ``run(seqs, is_prefill)``
returning one result per scheduled sequence (a token id, a ``FailedSample``, None for a
prefill chunk that samples nothing, or a ``SampleOutput`` carrying logprobs too), so the
loop is verified with a fake model in milliseconds and the real runner plugs in unchanged.

Every request is parsed and validated in full before any state changes
(``request_builder.py``): a refused request leaves the engine exactly as it was. A step
schedules, runs the model and commits (the scheduler), then turns what it committed into
outputs (``output_processor.py``, docs/design.md, "The output pipeline").

Faults are part of the contract (docs/design.md, "Atomic steps"): an exception or a
KeyboardInterrupt at any call of a step leaves the engine consistent and serving
(tests/test_fault_points.py injects one at every call site a traced step reaches).
Scheduling, the model and the scheduler's bookkeeping share one ``try``: whatever raises
there, ``recover()`` preempts what the step had not committed; what follows the commit is
idempotent work that the next step, ``abort_request`` or ``generate``'s cleanup finishes
first (``_settle``), so no output is lost, none is reported twice, and no stop string is
passed over.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from typing import Any, Protocol

from paged_engine.config import EngineConfig
from paged_engine.engine.batch import attach_partial_outputs, pair_prompts
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.inputs import Tokenizer
from paged_engine.engine.output_processor import OutputProcessor, RunnerResult
from paged_engine.engine.progress import Progress
from paged_engine.engine.request import Request, RequestOutput
from paged_engine.engine.request_builder import RequestBuilder
from paged_engine.engine.scheduler import Allocator, Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.engine.stats import RunStats, run_stats
from paged_engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "ModelRunner", "RequestOutput", "RunStats", "Tokenizer"]


class ModelRunner(Protocol):
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SequenceABC[RunnerResult]:
        """One result per scheduled sequence (see the module docstring)."""


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
        (default: the config's); ``block_manager`` replaces the engine's allocator (tests
        run the spec in the loop), ``scheduler_cls`` the scheduler (tests run broken ones)."""
        pool = num_kvcache_blocks or config.num_kvcache_blocks
        if pool is None:
            raise ValueError("the KV pool size is unknown: set config.num_kvcache_blocks")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if eos_token_id is None or isinstance(eos_token_id, int):
            eos_ids: tuple[int, ...] = () if eos_token_id is None else (eos_token_id,)
        else:
            eos_ids = tuple(eos_token_id)
        for e in eos_ids:
            if not isinstance(e, int) or isinstance(e, bool) or e < 0:
                raise ValueError(f"eos_token_id must hold ints >= 0, got {eos_token_id!r}")
        # The model runner fills in the per-device defaults once (``ModelRunner.config``,
        # which ``LLM`` passes here); only a config no runner has seen (a test's fake
        # runner) gets them here: the runner's device's, the CPU's without one.
        if config.max_num_batched_tokens is None:
            device = getattr(model_runner, "device", None)
            config = config.for_device(str(getattr(device, "type", "cpu")))
        budget = config.max_num_batched_tokens
        assert budget is not None  # for_device filled it in
        self.config = config
        self.model_runner = model_runner
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_ids
        self.tokenizer = tokenizer
        self.num_blocks = pool
        self.block_manager = block_manager or BlockManager(
            pool,
            config.kvcache_block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algorithm=config.prefix_cache_hash,
        )
        self.scheduler = scheduler_cls(
            self.block_manager,
            num_blocks=pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=config.max_model_len,
            eos_token_ids=eos_ids,
            prefix_aware=config.enable_prefix_caching,
            mixed_steps=config.mixed_steps,
        )
        self._requests: dict[str, Request] = {}
        self._builder = RequestBuilder(config, pool, vocab_size, tokenizer)
        self.output_processor = OutputProcessor(self._requests, self.scheduler, tokenizer)
        self._next_id = 0
        self.last_run_stats: RunStats | None = None

    # ---- the request API -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: object,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (vLLM's signature). ``prompt``: text, token ids, or a
        ``TextPrompt``/``TokensPrompt`` dict (optionally with ``cache_salt``). Its text is
        produced step by step, for streaming through ``step()``. Refused (ValueError or
        TypeError) before anything changes."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        request = self._builder.build(request_id, prompt, params, "add_request", stream=True)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        self._requests[request.request_id] = request
        try:
            for c in request.completions:
                self.output_processor.completion_of[c.seq] = (request, c)
                self.scheduler.add(c.seq)
        except BaseException:  # a KeyboardInterrupt between completions: none stays queued
            self.abort_request(request.request_id)
            raise

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Drop requests and free their blocks at once (also a finished request whose
        output was not returned yet). True if any was in the engine."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._settle()  # an interrupted step's sequences are back in a queue first
        found = False
        for rid in ids:
            request = self._requests.pop(rid, None)
            if request is None:
                continue
            found = True
            for c in request.completions:
                self.scheduler.abort(c.seq)
            self.output_processor.forget(request)
        return found

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or has an output not returned yet."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's name); False, changing nothing, while any
        request holds blocks."""
        if self._requests:
            return False
        reset = getattr(self.block_manager, "reset_prefix_cache", None)
        return bool(reset()) if reset is not None else False

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return a cumulative ``RequestOutput`` for every request
        that produced a token (or finished) in it, and for any whose news a failed step
        did not return.

        If anything raises (the scheduler, the model runner, the sampler, the tokenizer,
        KeyboardInterrupt, wherever it strikes), the same exception propagates and nothing
        is lost: the scheduler has recovered (every sequence committed or preempted), and
        what the step left undone (news, text, outputs) is done by the next call before it
        computes anything. On an idle engine it returns ``[]`` and changes nothing.
        """
        return self._step(report_running=True)

    def _step(self, report_running: bool) -> list[RequestOutput]:
        out, sched = self.output_processor, self.scheduler
        self._settle()  # what an interrupted step left: recorded before anything new
        out.detokenize_pending()
        if not sched.is_finished():
            try:
                seqs, is_prefill = sched.schedule()
                results = self.model_runner.run(seqs, is_prefill)
                tokens = out.store_logprobs(seqs, results)
                out.stage_step(seqs, tokens, report_running)
                sched.postprocess(seqs, tokens)
            except BaseException:
                self._settle()
                raise
            self._settle()
            out.detokenize_pending()
        return out.collect_outputs(report_running)

    def _settle(self) -> None:
        """Finish the bookkeeping of the last step, wherever it stopped: preempt what it
        left uncommitted (``Scheduler.recover``), then record the results of the sequences
        that committed, and only theirs. Each part may run again after an interruption."""
        self.output_processor.record_committed(self.scheduler.recover())

    # ---- batch generation ------------------------------------------------------------------

    def generate(
        self,
        prompts: object,
        params: object = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt or a list) to completion; outputs in input order.
        ``params`` is one ``SamplingParams`` for all or a list with one per prompt. Every
        request is validated before any is queued.

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
        pairs = pair_prompts(prompts, params)
        requests = [
            self._builder.build(str(self._next_id + i), p, sp, f"prompt {i}", stream=False)
            for i, (p, sp) in enumerate(pairs)
        ]
        self._next_id += len(requests)
        return self._run_to_completion(requests, use_tqdm)

    def _run_to_completion(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Queue ``requests`` and step until they are all finished. On any exception the
        outputs of those that finished, the failing step's included, are attached to it
        and every one of them is aborted (see ``generate``)."""
        stats = self.scheduler.stats
        before = replace(stats)
        stats.peak_blocks_in_use = 0
        outputs: dict[str, RequestOutput] = {}
        progress: Progress | None = None
        try:
            for r in requests:
                self._enqueue(r)
            progress = Progress(len(requests), stats, enabled=use_tqdm)
            while self.has_unfinished_requests():
                if self.scheduler.is_finished() and not self.output_processor.pending:
                    raise RuntimeError("generate: requests remain but nothing can run (a bug)")
                done = self._step(report_running=False)
                for out in done:
                    outputs[out.request_id] = out
                progress.update(done)
            self.last_run_stats = run_stats(
                before, stats, len(requests), self.num_blocks, progress.elapsed
            )
            progress.close()
            return [outputs[r.request_id] for r in requests]
        except BaseException as exc:
            try:
                self._salvage(requests, outputs)
            finally:
                self.abort_request([r.request_id for r in requests])
            partial = [outputs[r.request_id] for r in requests if r.request_id in outputs]
            attach_partial_outputs(exc, partial)
            if progress is not None:
                progress.close()
            raise

    def _salvage(self, requests: list[Request], outputs: dict[str, RequestOutput]) -> None:
        """After a step raised: add to ``outputs`` every request of ``requests`` that has
        finished and is not in it, the ones the failing step finished included, with the
        text the next step would have given them. A request whose text cannot be made now
        (the tokenizer raises again) is left out; the first exception is what propagates."""
        try:
            self._settle()
            self.output_processor.detokenize_pending()
        except Exception:  # such a request is left out of partial_outputs
            pass
        needs_text = self.output_processor.needs_text
        for r in requests:
            if r.request_id in outputs or not r.finished:
                continue
            if not any(c in needs_text for c in r.completions):
                outputs[r.request_id], _ = r.build_output()
