"""What the tensor-parallel tests share: the engine configuration that makes prefix hits,
chunked prefill and preemption all happen, the prompts, and the checks on processes (alive,
gone, a call bounded in time)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from paged_engine import LLM, SamplingParams

T = TypeVar("T")
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIG: dict[str, Any] = {
    "num_kvcache_blocks": 14,  # 224 slots for 12 sequences of up to ~126 tokens: preemption
    "max_model_len": 136,
    "max_num_batched_tokens": 19,  # every prompt (38-110 tokens) is chunked
    "kvcache_block_size": 16,
    "num_threads": 1,
}
BOUND_S = 60.0
"""A failure must surface within this (in practice: well under a second)."""


def make_prompts() -> list[list[int]]:
    """12 prompts: 4 shared prefixes (37-90 tokens) x 3 suffixes (1-20 tokens)."""
    rng = random.Random(12)
    prefixes = [[rng.randrange(3, 760) for _ in range(n)] for n in (37, 52, 70, 90)]
    return [
        p + [rng.randrange(3, 760) for _ in range(rng.randrange(1, 21))]
        for p in prefixes
        for _ in range(3)
    ]


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(pids: list[int], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"orphan worker processes: {pids}"


def bounded(fn: Callable[[], T], seconds: float = BOUND_S) -> T:
    """``fn()``, failing the test if it has not returned or raised within ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a hang"
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
