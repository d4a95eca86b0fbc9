"""What queueing a request costs per prompt token: ``LLMEngine.add_request`` of a
1,400-token prompt (token ids), against the checked ``Sequence`` constructor alone.

``add_request`` checks the prompt once (``inputs.parse_prompt``: ints in the vocabulary,
three C-speed scans) and builds its sequence with ``Sequence.from_checked_tokens``; before
that it built it with the checked constructor, which scanned the tokens again. The
``sequence`` case times that constructor by itself, so the ratio of the two says how much
of ``add_request`` is now the one check. Each round queues one request and aborts it
outside the timed region. Figures: ns per prompt token (``extra_info``), min and median.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.engine.sequence import Sequence

PROMPT_TOKENS = 1400
ROUNDS = 300


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    from paged_engine.utils.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("request") / "model", seed=0)
    return LLM(str(path), num_kvcache_blocks=256, max_model_len=2048)


@pytest.mark.benchmark(group="request")
@pytest.mark.parametrize("what", ["add_request", "sequence"])
def test_request_cost(benchmark: Any, llm: LLM, what: str) -> None:
    engine = llm.llm_engine
    rng = random.Random(0)
    prompt = [rng.randrange(1, engine.vocab_size) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=8)
    ids = iter(range(10**9))
    queued: list[str] = []

    def setup() -> tuple[tuple[str], dict[str, Any]]:
        while queued:
            engine.abort_request(queued.pop())
        queued.append(f"r{next(ids)}")
        return (queued[-1],), {}

    if what == "add_request":
        benchmark.pedantic(
            lambda rid: engine.add_request(rid, prompt, params),
            setup=setup,
            rounds=ROUNDS,
            warmup_rounds=5,
        )
        assert len(engine._requests[queued[-1]].completions[0].seq) == PROMPT_TOKENS
    else:
        seqs: list[Sequence] = []
        benchmark.pedantic(
            lambda rid: seqs.append(Sequence(prompt, params)),
            setup=setup,
            rounds=ROUNDS,
            warmup_rounds=5,
        )
        assert all(len(s) == PROMPT_TOKENS for s in seqs)
    while queued:
        engine.abort_request(queued.pop())
    info = benchmark.extra_info
    info.update(suite="request", what=what, prompt_tokens=PROMPT_TOKENS)
    if benchmark.stats is not None:  # None under --benchmark-disable
        for key in ("min", "median"):
            info[f"ns_per_token_{key}"] = getattr(benchmark.stats.stats, key) / PROMPT_TOKENS * 1e9
