"""The three benchmark scenarios of the allocator suite, and their targets.

All three run the *same* trace (``TRACE``): the scenarios differ only in block size and
pool, so a figure moves with the allocator setting and nothing else. Spec and engine run
it identically: no shortened runs for the spec, whose slowest round (the 100k pool) takes
about 10-15 s here, so per-sequence-step figures compare like with like.

Scheduler limits are nano-vllm's defaults (``max_num_seqs=512``,
``max_num_batched_tokens=16384``): a wave's prompts are admitted over a few steps, the
later ones hitting blocks the earlier ones registered, and prompts that straddle the
budget are chunked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from bench.traces import Trace, TraceConfig, make_trace

__all__ = ["SCENARIOS", "TRACE", "Scenario", "trace"]

TRACE = TraceConfig(num_waves=12, seed=0)
"""12 waves, about 430 requests and 60,000 sequence-steps (see ``bench.traces``)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """One benchmark group: an allocator setting, and what the engine must achieve there.

    ``min_ratio`` is the required spec/engine time ratio, ``max_us`` the engine's ceiling
    in microseconds per sequence-step. They are reported by ``bench/report.py``, never
    asserted: a benchmark measures, the tests decide correctness.
    """

    name: str
    block_size: int
    num_blocks: int
    min_ratio: float
    max_us: float = 5.0
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16_384


SCENARIOS = (
    # 1.6M token slots: nothing is ever evicted, and the spec pays O(pool) per fresh block
    # (list.pop(0)) and per revived one (list.remove) on a 100,000-entry free queue.
    Scenario("bs16-pool100k", block_size=16, num_blocks=100_000, min_ratio=100.0),
    # nano-vllm's own setting: block size 256 (flash-attn's minimum), ~1M token slots.
    Scenario("bs256-pool4000", block_size=256, num_blocks=4_000, min_ratio=3.0),
    # 16,384 token slots: room for about six of the longest requests (160 blocks each)
    # while a wave needs thousands of blocks, so decode growth preempts; revived prefix
    # blocks are also overwritten sooner (FIFO reuse), so fewer of them are hit.
    Scenario("bs16-pool1024-preempt", block_size=16, num_blocks=1_024, min_ratio=3.0),
)


@cache
def trace(config: TraceConfig = TRACE) -> Trace:
    """The trace, generated once per process (it is deterministic)."""
    return make_trace(config)
