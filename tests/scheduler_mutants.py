"""Deliberately broken schedulers (and two engine mutants) the machines must catch.

Each scheduler mutant breaks one rule of spec/scheduler.py (S1-S12, docs/design.md) or
is one of the policy mutants that survived the suite before the scheduler spec existed
(issue 11). Most are subclasses that override one method of the scheduler's parts
(tests/scheduler_subclass_mutants.py). Those whose defect sits inside a loop are patch
files, ``scheduler_mutants/NAME.patch``: a unified diff of one product module, which
``build(NAME)`` applies to a copy of that module in a temporary directory and imports from
there (tests/patch_mutants.py); the mutant is ``Scheduler`` with the patched part first in
its MRO.

Nothing here reads the product's source at import: a patch is applied only when a test
builds its mutant, so a patch that no longer applies fails that test alone, raising
``StaleMutant`` with the mutant's name, the file and the hunk.
tests/test_scheduler_mutants.py hunts every mutant with the machines, and runs the two
engine mutants at the end (``AbortKeepsRequest``, ``prefill_tokens_not_a_difference``)
against the engine tests that pin their behaviour.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from pathlib import Path
from typing import Any

import paged_engine.engine.llm_engine as llm_engine_module
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.stats import RunStats
from tests.patch_mutants import ROOT, StaleMutant, import_copy, patched_copy, read_patch
from tests.scheduler_subclass_mutants import SUBCLASSES

PATCH_DIR = Path(__file__).resolve().parent / "scheduler_mutants"

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


def from_patch(name: str, patch_dir: Path = PATCH_DIR) -> type[Scheduler]:
    """The mutant ``patch_dir/NAME.patch`` describes, built now (see the module docstring)."""
    patch = read_patch(name, patch_dir / f"{name}.patch")
    path = patch.one_file()
    if not re.fullmatch(r"paged_engine/engine/\w+\.py", path) or not (ROOT / path).is_file():
        raise StaleMutant(name, path, None, "not a module of paged_engine/engine/")
    original = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    parts = [c for c in Scheduler.__mro__ if c.__module__ == original.__name__]
    if not parts:
        raise StaleMutant(name, path, None, "defines no part of Scheduler")
    module = import_copy(f"scheduler_mutant_{name}", patched_copy(name, patch) / path)
    patched = tuple(getattr(module, part.__name__) for part in parts)
    return type(name, (*patched, Scheduler), {"__doc__": patch.description, "__module__": __name__})


@functools.cache
def build(name: str) -> type[Scheduler]:
    """The scheduler mutant ``name``: one of ``SUBCLASSES``, or its patch applied now."""
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
