"""Deliberately broken schedulers (and two engine mutants) the machines must catch.

The first six are subclasses, hunted by the engine machine (tests/engine_machine.py) and
the scheduler machine (tests/scheduler_machine.py). The rest are the engine's own source
with one edit (``patched``): the policy mutants that survived the suite before the
scheduler spec existed (issue 11), then at least one per rule S1-S12 of spec/scheduler.py.
Each edit must match the source exactly once, so a mutant that no longer applies fails
loudly instead of silently testing the original. ``ENGINE_MUTANTS`` break ``LLMEngine``
around the scheduler; tests/test_scheduler_mutants.py runs them against the engine tests
that pin their behaviour.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Any

import paged_engine.engine.llm_engine as llm_engine_module
import paged_engine.engine.scheduler as scheduler_module
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.engine.stats import RunStats


class PreemptWithoutRelease(Scheduler):
    """Preemption requeues the victim but keeps its blocks allocated (a leak)."""

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        seq.block_table.clear()
        seq.num_cached_tokens = 0


class NoHashAfterChunk(Scheduler):
    """Prefill chunks are computed but their full blocks are never registered (R8)."""

    def postprocess(self, seqs: list[Sequence], token_ids: Any, is_prefill: bool) -> list[Sequence]:
        if is_prefill:
            hash_blocks = self.block_manager.hash_blocks
            self.block_manager.hash_blocks = lambda seq: None  # type: ignore[method-assign]
            try:
                return super().postprocess(seqs, token_ids, is_prefill)
            finally:
                self.block_manager.hash_blocks = hash_blocks  # type: ignore[method-assign]
        return super().postprocess(seqs, token_ids, is_prefill)


class AdmitPastTokenBudget(Scheduler):
    """Admission schedules whole prompts, ignoring max_num_batched_tokens."""

    def _schedule_prefill(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        self.max_num_batched_tokens = 1 << 30
        try:
            return super()._schedule_prefill()
        finally:
            self.max_num_batched_tokens = budget


class MaxTokensOffByOne(Scheduler):
    """Stops one token late when max_tokens is reached."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or (params.max_tokens is not None and seq.num_completion_tokens > params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        )


class DecodeWithoutGrowth(Scheduler):
    """Decode never calls may_append, so a token that starts a block has no slot (R7)."""

    def _schedule_decode(self) -> list[Sequence]:
        may_append = self.block_manager.may_append
        self.block_manager.may_append = lambda seq: None  # type: ignore[method-assign]
        try:
            return super()._schedule_decode()
        finally:
            self.block_manager.may_append = may_append  # type: ignore[method-assign]


class RecoverKeepsDecodeGrowth(Scheduler):
    """After a failed step, decoding sequences are "restored" by putting them back in
    running as they are: the block ``may_append`` gave them in the failed step is kept."""

    def recover(self) -> list[Sequence]:
        decoding = [s for s in self._in_flight if not s.is_prefill and s.block_table]
        for seq in decoding:
            del self._in_flight[seq]
            seq.num_scheduled_tokens = 0
            if seq not in self.running:
                self.running.append(seq)
        return super().recover()


SUBCLASS_MUTANTS: list[type[Scheduler]] = [
    PreemptWithoutRelease,
    NoHashAfterChunk,
    AdmitPastTokenBudget,
    MaxTokensOffByOne,
    DecodeWithoutGrowth,
    RecoverKeepsDecodeGrowth,
]


def patched(module: types.ModuleType, cls: str, name: str, *edits: tuple[str, str]) -> Any:
    """Class ``cls`` of ``module``, from the module's source with ``edits`` applied (each
    ``old`` must occur exactly once), under the name ``name``."""
    source = inspect.getsource(module)
    for old, new in edits:
        count = source.count(old)
        if count != 1:
            raise AssertionError(f"mutant {name}: {old!r} occurs {count} times in the source")
        source = source.replace(old, new)
    mutant = types.ModuleType(f"{__name__}.{name}")
    sys.modules[mutant.__name__] = mutant  # dataclasses look their module up
    exec(compile(source, f"<mutant {name}>", "exec"), mutant.__dict__)
    made = mutant.__dict__[cls]
    made.__name__ = made.__qualname__ = name
    return made


def _scheduler(name: str, *edits: tuple[str, str]) -> type[Scheduler]:
    made: type[Scheduler] = patched(scheduler_module, "Scheduler", name, *edits)
    return made


# ---- the held-out policy mutants of issue 11 ------------------------------------------

PreemptOldest = _scheduler(
    "PreemptOldest",
    ("victim = running[-1]  # the most recently admitted", "victim = running[0]"),
    (
        "running.pop()\n                    self._preempt(victim)",
        "running.popleft()\n                    self._preempt(victim)",
    ),
)
DeferredToBack = _scheduler(
    "DeferredToBack",
    (
        "                    skipped += 1\n                    continue",
        "                    deferred.append(seq)\n"
        "                    del waiting[skipped]\n                    continue",
    ),
    (
        "        skipped = 0  # deferred",
        "        deferred: list[Sequence] = []\n        skipped = 0  #",
    ),
    (
        "            scheduled.append(seq)\n        return scheduled\n\n    def _schedule_chunk",
        "            scheduled.append(seq)\n        waiting.extend(deferred)\n"
        "        return scheduled\n\n"
        "    def _schedule_chunk",
    ),
)
PromptStatsEveryAdmission = _scheduler(
    "PromptStatsEveryAdmission",
    (  # the request's own record (its output's num_cached_tokens) stays right
        "                seq.num_prefix_hit_tokens = seq.num_cached_tokens\n",
        "                seq.num_prefix_hit_tokens = seq.num_cached_tokens\n            if True:\n",
    ),
)
MaxModelLenOneLate = _scheduler(
    "MaxModelLenOneLate",
    (
        "            or seq.num_tokens >= self.max_model_len",
        "            or seq.num_tokens > self.max_model_len",
    ),
)
ChunkFromPrompt = _scheduler(
    "ChunkFromPrompt",
    (
        "        n = min(seq.num_tokens - cached, budget)",
        "        n = min(seq.num_prompt_tokens - cached, budget)",
    ),
)

# ---- one (or more) per rule of spec/scheduler.py -------------------------------------

NewestFirst = _scheduler(  # S1: arrival order
    "NewestFirst",
    (
        "    def add(self, seq: Sequence) -> None:\n        self.waiting.append(seq)",
        "    def add(self, seq: Sequence) -> None:\n        self.waiting.appendleft(seq)",
    ),
)
DecodeBeforePrefill = _scheduler(  # S2: prefill before decode
    "DecodeBeforePrefill",
    (
        "            scheduled = self._schedule_prefill()\n"
        "            is_prefill = bool(scheduled)\n",
        "            scheduled = [] if any(not s.is_prefill for s in self.running) else "
        "self._schedule_prefill()\n            is_prefill = bool(scheduled)\n",
    ),
)
ChunkWaitsForAdmission = _scheduler(  # S3: chunked prefills continue first
    "ChunkWaitsForAdmission",
    (
        "            if seq.is_prefill:\n                in_flight[seq]",
        "            if seq.is_prefill and not self.waiting:\n                in_flight[seq]",
    ),
)
AdmitPastBlockedHead = _scheduler(  # S4: no request overtakes one that does not fit
    "AdmitPastBlockedHead",
    (
        "            if hits is None:\n                break",
        "            if hits is None:\n                skipped += 1\n                continue",
    ),
)
DeferByPosition = _scheduler(  # S5: keyed by the chain (the defect this replaced)
    "DeferByPosition",
    ("if (hashes[hits], tokens[hits]) in filling:", "if (hits, seq.block(hits)) in filling:"),
    (
        "                filling.update(zip(hashes[first:end], tokens[first:end], strict=True))",
        "                filling.update((j, seq.block(j)) for j in range(first, end))",
    ),
)
NoDeferral = _scheduler(  # S5
    "NoDeferral",
    (
        "            if filling and hits < seq.num_blocks - 1",
        "            if False and hits < seq.num_blocks - 1",
    ),
)
DecodePastTokenBudget = _scheduler(  # S6: min(max_num_seqs, max_num_batched_tokens)
    "DecodePastTokenBudget",
    (
        "        limit = min(self.max_num_seqs, self.max_num_batched_tokens)",
        "        limit = self.max_num_seqs",
    ),
)
PreemptedToBack = _scheduler(  # S7: to the front of waiting
    "PreemptedToBack",
    (
        "        self.waiting.appendleft(seq)\n        self.stats.preemptions += 1",
        "        self.waiting.append(seq)\n        self.stats.preemptions += 1",
    ),
)
SampleAfterChunk = _scheduler(  # S8: a chunk that leaves the context incomplete samples nothing
    "SampleAfterChunk",
    (
        "            if is_prefill and seq.num_cached_tokens < seq.num_tokens:",
        "            if is_prefill and seq.num_cached_tokens < seq.num_tokens"
        " and type(token) is not int:",
    ),
)
IgnoreEosIgnored = _scheduler(  # S9: ignore_eos
    "IgnoreEosIgnored",
    (
        "            (not params.ignore_eos and token in self.eos_token_ids)\n"
        "            or token in params.stop_token_ids\n"
        "            or (params.max_tokens",
        "            token in self.eos_token_ids\n            or token in params.stop_token_ids\n"
        "            or (params.max_tokens",
    ),
)
AbortMissesFinished = _scheduler(  # S10: abort reaches finished, undelivered sequences
    "AbortMissesFinished",
    (
        "        for queue in (self.waiting, self.running, self.finished):",
        "        for queue in (self.waiting, self.running):",
    ),
)
FinishNowKeepsBlocks = _scheduler(  # S10: a text stop releases the blocks
    "FinishNowKeepsBlocks",
    (
        "        if seq.block_table:  # first: interrupted, it is still running and may repeat\n"
        "            self.block_manager.deallocate(seq)\n",
        "",
    ),
)
RecoverToBack = _scheduler(  # S11: recovered sequences go to the front of waiting
    "RecoverToBack",
    ("        self.waiting.extendleft(reversed(undone))", "        self.waiting.extend(undone)"),
)
OutputTokensCountFailures = _scheduler(  # S12: output_tokens are tokens appended
    "OutputTokensCountFailures",
    (
        "            if not isinstance(token, FailedSample):\n"
        "                stats.output_tokens += 1",
        "            if True:\n                stats.output_tokens += 1",
    ),
)
FailedStepsNotCounted = _scheduler(  # S12: failed_steps
    "FailedStepsNotCounted",
    ("        self.stats.failed_steps += 1\n", ""),
)

HELD_OUT_MUTANTS = [
    PreemptOldest,
    DeferredToBack,
    PromptStatsEveryAdmission,
    MaxModelLenOneLate,
    ChunkFromPrompt,
]
RULE_MUTANTS = [
    NewestFirst,
    DecodeBeforePrefill,
    ChunkWaitsForAdmission,
    AdmitPastBlockedHead,
    DeferByPosition,
    NoDeferral,
    DecodePastTokenBudget,
    PreemptedToBack,
    SampleAfterChunk,
    IgnoreEosIgnored,
    AbortMissesFinished,
    FinishNowKeepsBlocks,
    RecoverToBack,
    OutputTokensCountFailures,
    FailedStepsNotCounted,
]

# ---- around the scheduler: the engine ---------------------------------------------------


class AbortKeepsRequest(LLMEngine):
    """``abort_request`` frees the scheduler's sequences but keeps the request in the
    engine's table (held out in issue 11)."""

    def abort_request(self, request_id: Any) -> bool:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        found = False
        for rid in ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            found = True
            for c in request.completions:
                self.scheduler.abort(c.seq)
        return found


def prefill_tokens_not_a_difference(
    before: Any, after: Any, n: int, pool: int, elapsed: float
) -> RunStats:
    """``run_stats`` with ``prefill_tokens`` the lifetime count, not this call's (held out
    in issue 11); patched into ``llm_engine.run_stats``."""
    stats = RUN_STATS(before, after, n, pool, elapsed)
    return dataclasses.replace(stats, prefill_tokens=after.prefill_tokens)


RUN_STATS = llm_engine_module.run_stats
