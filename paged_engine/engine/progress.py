"""``generate``'s progress bar: requests done, with output and prefill throughput since the
call began (cumulative, so the figures do not jump with each step's mix)."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from paged_engine.engine.scheduler import SchedulerStats


class Progress:
    """Updated every step; tqdm redraws at most every ``mininterval`` seconds, so a step
    costs an attribute update, not a terminal write."""

    def __init__(self, total: int, stats: SchedulerStats, *, enabled: bool) -> None:
        self._stats = stats
        self._prefill0 = stats.prefill_tokens
        self._outputs0 = stats.output_tokens
        self._start = time.perf_counter()
        self._bar = tqdm(total=total, desc="generate", disable=not enabled, dynamic_ncols=True)
        self.enabled = enabled

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def update(self, finished: SequenceABC[Any]) -> None:
        if not self.enabled:
            return
        dt = max(self.elapsed, 1e-9)
        s = self._stats
        prefill = s.prefill_tokens - self._prefill0
        out = s.output_tokens - self._outputs0
        self._bar.set_postfix_str(
            f"out {out / dt:,.0f} tok/s, prefill {prefill / dt:,.0f} tok/s", refresh=False
        )
        self._bar.update(len(finished))

    def close(self) -> None:
        self._bar.close()
