"""What one ``generate`` call did, from the scheduler's counters."""

from __future__ import annotations

from dataclasses import dataclass

from paged_engine.engine.scheduler import SchedulerStats


@dataclass(frozen=True, slots=True)
class RunStats:
    """The scheduler's counters over one ``generate`` call, and its wall time."""

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
    output_tokens: int = 0
    """Generated tokens, over every completion."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def __str__(self) -> str:
        return (
            f"{self.num_requests} requests in {self.elapsed_s:.2f} s: "
            f"{self.output_tokens} tokens out ({self.output_tokens_per_s:,.0f} tok/s), "
            f"{self.prefill_tokens} prefilled ({self.prefill_tokens_per_s:,.0f} tok/s); "
            f"prefix-cache hit rate {self.prefix_cache_hit_rate:.1%} "
            f"({self.cached_prompt_tokens} of {self.prompt_tokens} prompt tokens); "
            f"{self.preemptions} preemptions; peak KV use {self.peak_blocks_in_use} of "
            f"{self.num_blocks} blocks; {self.steps} steps"
        )


def run_stats(
    before: SchedulerStats,
    after: SchedulerStats,
    n: int,
    pool: int,
    elapsed: float,
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
        output_tokens=after.output_tokens - before.output_tokens,
    )
