"""One bad request fails alone on the server: a request that makes every engine step fail
while it is in the batch ends with an error, and every other request completes exactly as
the fake model makes it alone. Checked on the real ``EngineLoop`` over the fake model
(whose runner raises whenever the poisoned prompt is scheduled), streamed and not, the
poison arriving after the others or with them; and the bisection itself (``isolation``)
simulated for every culprit position in groups of 1 to 40."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.core_wire import Restarted, core_params
from paged_engine.entrypoints.engine_loop import EngineLoop
from paged_engine.entrypoints.isolation import Quarantine, Suspect
from paged_engine.entrypoints.loop_types import RequestFailed
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_machine import VOCAB, CheckedRunner, build_engine
from tests.fake_model import reference_generate

pytestmark = pytest.mark.timeout(60)
CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=16,
    max_model_len=64,
    kvcache_block_size=4,
    num_kvcache_blocks=256,
)
POISON = [4, 4, 4, 4, 4, 4]
"""A prompt the poisoned runner cannot compute: every step holding it raises."""


class PoisonedRunner(CheckedRunner):
    """The fake model, raising whenever a sequence of the poisoned prompt is scheduled."""

    def run(self, seqs: list[Any], is_prefill: bool) -> list[int]:
        if any(s.token_ids[: len(POISON)] == POISON for s in seqs):
            self.calls += 1
            raise RuntimeError("the poisoned request is in the batch")
        time.sleep(0.002)
        return super().run(seqs, is_prefill)


class LatePoisonedRunner(CheckedRunner):
    """The fake model, raising once a sequence of the poisoned prompt has 3 tokens: its
    first steps succeed, so it is no longer new when the steps begin to fail."""

    def run(self, seqs: list[Any], is_prefill: bool) -> list[int]:
        if any(s.token_ids[: len(POISON)] == POISON and len(s.token_ids) >= 9 for s in seqs):
            self.calls += 1
            raise RuntimeError("the poisoned request is in the batch")
        time.sleep(0.002)
        return super().run(seqs, is_prefill)


def prompt(i: int) -> list[int]:
    return [(i + k * (i + 1)) % VOCAB for k in range(5 + i % 4)]


def params(streamed: bool, max_tokens: int = 30) -> SamplingParams:
    kind = RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def alone(p: list[int], max_tokens: int = 30) -> list[int]:
    """What the fake model makes for ``p`` by itself."""
    tokens, _ = reference_generate(
        p,
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        vocab_size=VOCAB,
        eos_token_id=0,
        max_model_len=CONFIG.max_model_len,
    )
    return tokens


async def drain(sink: asyncio.Queue[Any], ids: set[str]) -> dict[str, list[int] | str]:
    """Each request's tokens (its deltas joined), or the error it ended with."""
    got: dict[str, list[int] | str] = {}
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    while len(got) < len(ids):
        event = await asyncio.wait_for(sink.get(), 30)
        if isinstance(event, Restarted):  # relayed: what came of it so far is void
            tokens[event.request_id] = []
            continue
        if isinstance(event, RequestFailed):
            got[event.request_id] = f"failed {event.status}: {event.message}"
            continue
        assert isinstance(event, RequestOutput)
        tokens[event.request_id] += event.outputs[0].token_ids
        if event.finished:
            got[event.request_id] = tokens[event.request_id]
    return got


def run(
    streamed: bool,
    n: int,
    poison_at: int | None,
    poison_last: bool,
    max_failures: int = 3,
    relay: bool = False,
    runner: type[CheckedRunner] = PoisonedRunner,
) -> tuple[dict[str, list[int] | str], Any]:
    """``n`` requests through an engine loop, admitted together (as the prompts of one
    HTTP request), the poisoned one ``poison_at`` among them; or (``poison_last``)
    submitted once the others have produced tokens. Each step takes 2 ms, so the others
    are still running when the poison comes. ``relay``: the loop as the engine core
    process runs it, the requests sent as its API process sends them (``core_params``)."""
    engine = build_engine(CONFIG, spec=False)
    engine.model_runner = runner(CONFIG, VOCAB, 5_000)
    sent = core_params if relay else (lambda p: p)
    work = [(f"r{i}", prompt(i), sent(params(streamed))) for i in range(n)]
    poison = ("poison", POISON, sent(params(streamed)))
    if poison_at is not None:
        work.insert(poison_at, poison)

    async def main() -> dict[str, list[int] | str]:
        loop = EngineLoop(engine, max_step_failures=max_failures)
        loop._routes.relay = relay
        loop.start(asyncio.get_running_loop())
        try:
            sink = await loop.submit(work, time.time())
            tasks = [asyncio.ensure_future(drain(sink, {r for r, _, _ in work}))]
            if poison_last:  # once the others have tokens (a streamed one has sent them)
                deadline = time.monotonic() + 30
                while (s := loop.snapshot) is None or s.output_tokens < 2 * n:
                    assert time.monotonic() < deadline, "the requests do not run"
                    await asyncio.sleep(0.002)
                late = await loop.submit([poison], time.time())
                tasks.append(asyncio.ensure_future(drain(late, {"poison"})))
            got: dict[str, list[int] | str] = {}
            for t in tasks:
                got.update(await t)
            return got
        finally:
            await asyncio.to_thread(loop.stop, 10)

    return asyncio.run(main()), engine


@pytest.mark.parametrize(
    ("streamed", "relay"),
    [(True, False), (False, False), (False, True)],
    ids=["streamed", "whole", "whole-relayed"],
)
@pytest.mark.parametrize(
    ("n", "poison_at", "poison_last"),
    [(6, None, True), (7, 0, False), (7, 3, False), (7, 7, False), (1, 1, False)],
    ids=["poison-after-the-others", "poison-first", "poison-amid", "poison-last", "a-pair"],
)
def test_a_poisoned_request_fails_alone_and_the_others_complete_exactly(
    streamed: bool, relay: bool, n: int, poison_at: int | None, poison_last: bool
) -> None:
    """``whole-relayed``: the engine core process's loop, whose non-streamed requests'
    clients have seen nothing, so they are run again (``Restarted``), not failed."""
    got, engine = run(streamed, n, poison_at, poison_last, relay=relay)
    poisoned = got.pop("poison")
    assert isinstance(poisoned, str) and poisoned.startswith("failed 500"), poisoned
    assert "failed 3 steps in a row" in poisoned and "poisoned request" in poisoned
    assert got == {f"r{i}": alone(prompt(i)) for i in range(n)}
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks


@pytest.mark.parametrize("relay", [False, True], ids=["whole", "whole-relayed"])
def test_a_request_that_breaks_steps_late_fails_alone(relay: bool) -> None:
    """Every request has had tokens when the steps begin to fail: the non-streamed ones
    are run again, in process and relayed by the core process alike (a relayed one whose
    client would count as served is failed instead, newest first: an innocent)."""
    got, engine = run(False, 5, 0, False, relay=relay, runner=LatePoisonedRunner)
    poisoned = got.pop("poison")
    assert isinstance(poisoned, str) and poisoned.startswith("failed 500"), poisoned
    assert got == {f"r{i}": alone(prompt(i)) for i in range(5)}
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks


def test_without_a_poison_the_loop_parks_nothing_and_fails_nothing() -> None:
    got, engine = run(False, 8, None, False)
    assert got == {f"r{i}": alone(prompt(i)) for i in range(8)}
    assert engine.scheduler.stats.failed_steps == 0


# ---- the bisection, simulated ----------------------------------------------------------


def simulate(n: int, culprit: int | None, threshold: int = 3, tokens: int = 4) -> dict[str, Any]:
    """``n`` re-runnable requests admitted together; every step fails while ``culprit``
    is in the engine. Each request needs ``tokens`` successful steps to finish (from its
    start: a parked one starts again)."""
    q = Quarantine(threshold)
    engine = [f"r{i}" for i in range(n)]
    progress = dict.fromkeys(engine, 0)
    confirmed: set[str] = set()
    failed, finished, steps = [], [], 0
    while engine or q.parked:
        steps += 1
        assert steps < 10_000, "the bisection does not end"
        for r in q.release(idle=not engine):
            engine.append(r)
            progress[r] = 0
        if culprit is not None and f"r{culprit}" in engine:
            verdict = q.failed([Suspect(r, True, r in confirmed) for r in engine])
            for r in verdict.park:
                engine.remove(r)
                confirmed.discard(r)
            for r in verdict.fail:
                engine.remove(r)
                failed.append(r)
                q.gone(r)
            continue
        done = set()
        for r in engine:
            progress[r] += 1
            if progress[r] == tokens:
                done.add(r)
        confirmed |= set(engine)
        q.succeeded()
        for r in done:
            engine.remove(r)
            finished.append(r)
            q.gone(r)
    return {"failed": failed, "finished": sorted(finished), "steps": steps}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 40])
def test_the_bisection_finds_any_culprit_and_fails_no_one_else(n: int) -> None:
    for culprit in range(n):
        out = simulate(n, culprit)
        assert out["failed"] == [f"r{culprit}"], (n, culprit, out)
        assert out["finished"] == sorted(f"r{i}" for i in range(n) if i != culprit)


def test_a_transient_fault_fails_no_one() -> None:
    q = Quarantine(3)
    suspects = [Suspect("a", False, True), Suspect("b", True, True)]
    assert q.failed(suspects).park == () and q.failed(suspects).fail == ()
    q.succeeded()
    assert q.failed(suspects).park == () and q.failed(suspects).fail == ()
    assert q.failures == 2 and not q.parked


def test_with_nothing_to_park_the_newest_request_fails_alone() -> None:
    q = Quarantine(2)
    streamed = [Suspect("old", False, True), Suspect("new", False, True)]
    q.failed(streamed)
    assert q.failed(streamed).fail == ("new",)
    # those that have produced no token are parked before any is failed
    mixed = [*streamed, Suspect("fresh", True, False), Suspect("whole", True, True)]
    q.failed(mixed)
    assert q.failed(mixed).park == ("fresh",)
