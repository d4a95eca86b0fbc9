"""Deliberately broken schedulers (and two engine mutants) the machines must catch.

Each scheduler mutant breaks one rule of spec/scheduler.py (S1-S12, docs/design.md) or
is one of the policy mutants that survived the suite before the scheduler spec existed
(issue 11). Most are subclasses that override one method of the scheduler's parts
(engine/scheduler.py, admission.py, preemption.py). Those whose defect sits inside a loop
are patch files, ``scheduler_mutants/NAME.patch``: a unified diff of one product module,
which ``build(NAME)`` applies to a copy of that module in a temporary directory and
imports from there; the mutant is ``Scheduler`` with the patched part first in its MRO.

Nothing here reads the product's source at import: a patch is applied only when a test
builds its mutant, so a patch that no longer applies fails that test alone, raising
``StaleMutant`` with the mutant's name, the file and the hunk.
tests/test_scheduler_mutants.py hunts every mutant with the machines, and runs the two
engine mutants at the end (``AbortKeepsRequest``, ``prefill_tokens_not_a_difference``)
against the engine tests that pin their behaviour.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import importlib.util
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from collections.abc import Sequence as Sequence_
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paged_engine.engine.llm_engine as llm_engine_module
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.scheduler_state import BlockKey
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.engine.stats import RunStats

ROOT = Path(__file__).resolve().parents[1]
PATCH_DIR = Path(__file__).resolve().parent / "scheduler_mutants"


@contextmanager
def _doing_nothing(allocator: Any, name: str) -> Iterator[None]:
    """``allocator.<name>(seq)`` does nothing inside the block; the method is put back."""
    real = getattr(allocator, name)
    setattr(allocator, name, lambda seq: None)
    try:
        yield
    finally:
        setattr(allocator, name, real)


# ---- hunted by both machines -----------------------------------------------------------


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
            with _doing_nothing(self.block_manager, "hash_blocks"):
                return super().postprocess(seqs, token_ids, is_prefill)
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
        with _doing_nothing(self.block_manager, "may_append"):
            return super()._schedule_decode()


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


# ---- the held-out policy mutants of issue 11 ----------------------------------------------


class PromptStatsEveryAdmission(Scheduler):
    """S12: the prompt statistics count every admission, a readmission after preemption
    included (the request's own record, its ``num_prefix_hit_tokens``, stays right)."""

    def _admit(self, seq: Sequence, num_cached_blocks: int, index: int) -> None:
        readmitted = seq.num_prefix_hit_tokens is not None
        super()._admit(seq, num_cached_blocks, index)
        if readmitted:
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
            self.stats.prompt_tokens += seq.num_prompt_tokens


class MaxModelLenOneLate(Scheduler):
    """S9: a sequence stops one token past max_model_len."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or (params.max_tokens is not None and seq.num_completion_tokens >= params.max_tokens)
            or seq.num_tokens > self.max_model_len
        )


class ChunkFromPrompt(Scheduler):
    """S3: a chunk is sized from the prompt, so a preempted sequence recomputes none of
    its generated tokens (its prefill never completes)."""

    def _schedule_chunk(self, seq: Sequence, budget: int, completing_blocks: set[BlockKey]) -> int:
        prompt_left = seq.num_prompt_tokens - seq.num_cached_tokens
        return super()._schedule_chunk(seq, min(budget, prompt_left), completing_blocks)


# ---- one (or more) per rule of spec/scheduler.py ---------------------------------------


class NewestFirst(Scheduler):
    """S1: a new request joins the front of waiting, not the back."""

    def add(self, seq: Sequence) -> None:
        self.waiting.appendleft(seq)


class DecodeBeforePrefill(Scheduler):
    """S2: while any running sequence decodes, nothing prefills."""

    def _schedule_prefill(self) -> list[Sequence]:
        if any(not s.is_prefill for s in self.running):
            return []
        return super()._schedule_prefill()


class DeferByPosition(Scheduler):
    """S5: blocks told apart by position and tokens, not by the allocator's chain (the
    defect the chain replaced: requests that can never hit each other's blocks wait)."""

    def _block_keys(self, seq: Sequence, first: int, end: int) -> list[BlockKey]:
        return [(j, seq.block(j)) for j in range(first, end)]


class NoDeferral(Scheduler):
    """S5: no request waits for the blocks an earlier one completes in the same step."""

    def _defers(self, seq: Sequence, num_cached_blocks: int, completing: set[BlockKey]) -> bool:
        return False


class DecodePastTokenBudget(Scheduler):
    """S6: a decode step is bounded by max_num_seqs alone, not also by the token budget."""

    def _schedule_decode(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        self.max_num_batched_tokens = 1 << 30
        try:
            return super()._schedule_decode()
        finally:
            self.max_num_batched_tokens = budget


class PreemptedToBack(Scheduler):
    """S7: a preempted sequence goes to the back of waiting, not the front."""

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)
        self.waiting.popleft()
        self.waiting.append(seq)


class IgnoreEosIgnored(Scheduler):
    """S9: EOS ends a sequence even when its request ignores EOS."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        return token in self.eos_token_ids or super()._stops(seq, token)


class AbortMissesFinished(Scheduler):
    """S10: abort does not reach a finished sequence whose output is undelivered."""

    def abort(self, seq: Sequence) -> bool:
        if seq in self.finished:
            return False
        return super().abort(seq)


class FinishNowKeepsBlocks(Scheduler):
    """S10: a text stop (``finish_now``) ends the sequence but keeps its blocks."""

    def finish_now(self, seq: Sequence) -> None:
        with _doing_nothing(self.block_manager, "deallocate"):
            super().finish_now(seq)


class RecoverToBack(Scheduler):
    """S11: recovered sequences go to the back of waiting, not the front."""

    def recover(self) -> list[Sequence]:
        undone = super().recover()
        for _ in undone:
            self.waiting.popleft()
        self.waiting.extend(undone)
        return undone


class OutputTokensCountFailures(Scheduler):
    """S12: a failed sample counts as an output token (none was appended)."""

    def postprocess(
        self, seqs: list[Sequence], token_ids: Sequence_[Any], is_prefill: bool
    ) -> list[Sequence]:
        finished = super().postprocess(seqs, token_ids, is_prefill)
        failed = [s for s, t in zip(seqs, token_ids, strict=True) if isinstance(t, FailedSample)]
        self.stats.output_tokens += sum(s.seq_id in self.errors for s in failed)
        return finished


class FailedStepsNotCounted(Scheduler):
    """S12: a recovered step is not counted in ``failed_steps``."""

    def recover(self) -> list[Sequence]:
        counted = bool(self._in_flight)
        undone = super().recover()
        if counted:
            self.stats.failed_steps -= 1
        return undone


SUBCLASSES: dict[str, type[Scheduler]] = {
    cls.__name__: cls
    for cls in (
        PreemptWithoutRelease,
        NoHashAfterChunk,
        AdmitPastTokenBudget,
        MaxTokensOffByOne,
        DecodeWithoutGrowth,
        RecoverKeepsDecodeGrowth,
        PromptStatsEveryAdmission,
        MaxModelLenOneLate,
        ChunkFromPrompt,
        NewestFirst,
        DecodeBeforePrefill,
        DeferByPosition,
        NoDeferral,
        DecodePastTokenBudget,
        PreemptedToBack,
        IgnoreEosIgnored,
        AbortMissesFinished,
        FinishNowKeepsBlocks,
        RecoverToBack,
        OutputTokensCountFailures,
        FailedStepsNotCounted,
    )
}
PATCHES = (
    "PreemptOldest",  # issue 11, S7
    "DeferredToBack",  # issue 11, S5
    "ChunkWaitsForAdmission",  # S3
    "AdmitPastBlockedHead",  # S4
    "SampleAfterChunk",  # S8
)
"""The patch mutants, by name: ``scheduler_mutants/NAME.patch`` (its first lines say what
it breaks)."""

ENGINE_HUNTED = [
    "PreemptWithoutRelease",
    "NoHashAfterChunk",
    "AdmitPastTokenBudget",
    "MaxTokensOffByOne",
    "DecodeWithoutGrowth",
    "RecoverKeepsDecodeGrowth",
]
"""Hunted by the engine machine (tests/engine_machine.py) as well as the scheduler's."""
HELD_OUT = [
    "PreemptOldest",
    "DeferredToBack",
    "PromptStatsEveryAdmission",
    "MaxModelLenOneLate",
    "ChunkFromPrompt",
]
RULES = [
    "NewestFirst",  # S1
    "DecodeBeforePrefill",  # S2
    "ChunkWaitsForAdmission",  # S3
    "AdmitPastBlockedHead",  # S4
    "DeferByPosition",  # S5
    "NoDeferral",  # S5
    "DecodePastTokenBudget",  # S6
    "PreemptedToBack",  # S7
    "SampleAfterChunk",  # S8
    "IgnoreEosIgnored",  # S9
    "AbortMissesFinished",  # S10
    "FinishNowKeepsBlocks",  # S10
    "RecoverToBack",  # S11
    "OutputTokensCountFailures",  # S12
    "FailedStepsNotCounted",  # S12
]
SCHEDULER_MUTANTS = ENGINE_HUNTED + HELD_OUT + RULES
"""Every scheduler mutant, by name: each is hunted by the scheduler machine."""


# ---- patch mutants -------------------------------------------------------------------------


class StaleMutant(Exception):
    """A patch mutant that no longer applies to the product's source: bring it up to date
    (or drop it). Deliberately not an AssertionError, so that a test expecting a machine's
    AssertionError can never take a stale mutant for a caught one."""


@dataclass(frozen=True, slots=True)
class Hunk:
    """One hunk of a unified diff: the lines it expects and the lines it writes."""

    header: str
    old: tuple[str, ...]
    new: tuple[str, ...]


def parse_patch(text: str, name: str) -> tuple[str, list[Hunk]]:
    """The file a unified diff edits (its ``+++ b/...`` path) and its hunks. Lines before
    the ``---`` header describe the mutant and are skipped."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("--- ")), None)
    if start is None or start + 1 >= len(lines) or not lines[start + 1].startswith("+++ "):
        raise StaleMutant(f"mutant {name}: its patch has no '--- a/...' '+++ b/...' header")
    path = lines[start + 1][4:].strip().removeprefix("b/")
    hunks: list[Hunk] = []
    old: list[str] = []
    new: list[str] = []
    header = ""
    for line in lines[start + 2 :]:
        if line.startswith("@@"):
            if header:
                hunks.append(Hunk(header, tuple(old), tuple(new)))
            header, old, new = line.strip(), [], []
        elif not header:
            raise StaleMutant(f"mutant {name}: a line before the first hunk: {line!r}")
        elif line.startswith("\\"):  # "\ No newline at end of file": of the line before
            for side in (old, new):
                if side:
                    side[-1] = side[-1].rstrip("\n")
        elif line[:1] in (" ", "\n"):
            old.append(line[1:] or "\n")
            new.append(line[1:] or "\n")
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        else:
            raise StaleMutant(f"mutant {name}: not a line of a hunk: {line!r}")
    if header:
        hunks.append(Hunk(header, tuple(old), tuple(new)))
    if not hunks:
        raise StaleMutant(f"mutant {name}: its patch has no hunk")
    return path, hunks


def apply_patch(source: str, path: str, hunks: list[Hunk], name: str) -> str:
    """``source`` with each hunk applied where its expected lines occur, which must be
    exactly once: a hunk found nowhere (the code changed) or in two places raises
    ``StaleMutant`` naming the mutant, the file and the hunk."""
    lines = source.splitlines(keepends=True)
    for number, hunk in enumerate(hunks, 1):
        what = f"mutant {name}: hunk #{number} ({hunk.header}) of {name}.patch"
        n = len(hunk.old)
        if n == 0:
            raise StaleMutant(f"{what} has no context lines to find in {path}")
        found = [i for i in range(len(lines) - n + 1) if tuple(lines[i : i + n]) == hunk.old]
        if not found:
            raise StaleMutant(
                f"{what} no longer applies to {path}: these lines are not in it:\n"
                + "".join(hunk.old)
            )
        if len(found) > 1:
            where = ", ".join(str(i + 1) for i in found)
            raise StaleMutant(f"{what} matches {path} at lines {where}: ambiguous")
        lines[found[0] : found[0] + n] = hunk.new
    patched = "".join(lines)
    if patched == source:
        raise StaleMutant(f"mutant {name}: {name}.patch changes nothing in {path}")
    return patched


_TEMP: list[Path] = []


def _temp_dir() -> Path:
    """One temporary directory per process for the patched copies, removed at exit."""
    if not _TEMP:
        _TEMP.append(Path(tempfile.mkdtemp(prefix="scheduler-mutants-")))
        atexit.register(shutil.rmtree, _TEMP[0], True)
    return _TEMP[0]


def from_patch(name: str, patch_dir: Path = PATCH_DIR) -> type[Scheduler]:
    """The mutant ``patch_dir/NAME.patch`` describes, built now (see the module docstring)."""
    patch = patch_dir / f"{name}.patch"
    if not patch.is_file():
        raise StaleMutant(f"mutant {name}: {patch} is missing")
    text = patch.read_text(encoding="utf-8")
    path, hunks = parse_patch(text, name)
    product = ROOT / path
    if not re.fullmatch(r"paged_engine/engine/\w+\.py", path) or not product.is_file():
        raise StaleMutant(f"mutant {name}: {path} is not a module of paged_engine/engine/")
    original = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    parts = [c for c in Scheduler.__mro__ if c.__module__ == original.__name__]
    if not parts:
        raise StaleMutant(f"mutant {name}: {path} defines no part of Scheduler")
    copy = _temp_dir() / f"{name}__{product.name}"
    copy.write_text(apply_patch(product.read_text(encoding="utf-8"), path, hunks, name))
    module_name = f"scheduler_mutant_{name}"
    spec = importlib.util.spec_from_file_location(module_name, copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    patched = tuple(getattr(module, part.__name__) for part in parts)
    description = text[: text.find("--- ")].strip()
    return type(name, (*patched, Scheduler), {"__doc__": description, "__module__": __name__})


@functools.cache
def build(name: str) -> type[Scheduler]:
    """The scheduler mutant ``name``: a subclass above, or its patch applied now."""
    if name in SUBCLASSES:
        return SUBCLASSES[name]
    if name not in PATCHES:
        raise KeyError(f"no scheduler mutant named {name!r}")
    return from_patch(name)


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
