"""The engine machine: random add / step / abort interleavings, checked after every step.

Two engines run in lockstep on the same requests: one over the engine's allocator, one
over the spec allocator ("spec in the loop"); they must schedule identically and hold
identical block tables. Each uses the fake model of tests/fake_model.py, which really
writes and reads its paged cache, so every finished request must equal what the model
produces for it alone (chunking, prefix hits and preemption never change results).
``make_machine(scheduler_cls)`` lets the same machine hunt scheduler mutants.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged_engine.config import EngineConfig
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.llm_engine import LLMEngine, RequestOutput
from paged_engine.engine.scheduler import Scheduler
from paged_engine.sampling_params import SamplingParams
from spec.block_manager import BlockManager as SpecBlockManager
from tests.fake_model import FakeModelRunner, reference_generate

VOCAB = 5  # small, so generated continuations also repeat and share blocks


def build_engine(
    config: EngineConfig, spec: bool, scheduler_cls: type[Scheduler] = Scheduler, eos: int = 0
) -> LLMEngine:
    pool = config.num_kvcache_blocks
    assert pool is not None
    bm: Any = (
        SpecBlockManager(pool, config.kvcache_block_size)
        if spec
        else BlockManager(
            pool, config.kvcache_block_size, enable_prefix_caching=config.enable_prefix_caching
        )
    )
    runner = FakeModelRunner(pool, config.kvcache_block_size, VOCAB)
    return LLMEngine(
        runner,
        config,
        vocab_size=VOCAB,
        eos_token_id=eos,
        block_manager=bm,
        scheduler_cls=scheduler_cls,
    )


def make_machine(scheduler_cls: type[Scheduler] = Scheduler) -> type[RuleBasedStateMachine]:
    class EngineMachine(RuleBasedStateMachine):
        @initialize(
            block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
            max_model_len=st.integers(4, 48),
            extra_blocks=st.one_of(st.just(0), st.integers(0, 24)),
            max_num_seqs=st.integers(1, 6),
            max_num_batched_tokens=st.one_of(st.integers(1, 8), st.integers(1, 96)),
            eos=st.integers(0, VOCAB - 1),
        )
        def setup(
            self,
            block_size: int,
            max_model_len: int,
            extra_blocks: int,
            max_num_seqs: int,
            max_num_batched_tokens: int,
            eos: int,
        ) -> None:
            # Down to the smallest legal pool: one max_model_len sequence.
            pool = num_blocks(max_model_len, block_size) + extra_blocks
            self.config = EngineConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kvcache_block_size=block_size,
                num_kvcache_blocks=pool,
            )
            self.engines = [
                build_engine(self.config, spec, scheduler_cls, eos) for spec in (False, True)
            ]
            self.eos = eos
            self.prompts: list[list[int]] = []
            self.live: list[tuple[int, int, list[int], SamplingParams]] = []
            self.expected: dict[int, tuple[list[int], str]] = {}

        @property
        def engine(self) -> LLMEngine:
            return self.engines[0]

        @precondition(lambda self: len(self.live) < 10)
        @rule(data=st.data())
        def add_request(self, data: st.DataObject) -> None:
            limit = self.config.max_model_len - 1
            prompt: list[int] = []
            if self.prompts and data.draw(st.integers(0, 3), label="share"):
                base = data.draw(st.sampled_from(self.prompts), label="base")
                prompt = base[: data.draw(st.integers(0, len(base)), label="cut")]
            prompt += data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=limit), label="tail")
            prompt = prompt[:limit] or [1]
            self.prompts.append(prompt)
            params = SamplingParams(
                temperature=0,
                max_tokens=data.draw(st.integers(1, self.config.max_model_len - len(prompt))),
                ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
                stop_token_ids=tuple(data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=1))),
            )
            ids = [e.add_request(prompt, params) for e in self.engines]
            self.live.append((ids[0], ids[1], prompt, params))
            self.expected[ids[0]] = reference_generate(
                prompt,
                params,
                vocab_size=VOCAB,
                eos_token_id=self.eos,
                max_model_len=self.config.max_model_len,
            )

        @precondition(lambda self: self.engine.has_unfinished_requests())
        @rule(steps=st.integers(1, 4))
        def step(self, steps: int) -> None:
            for _ in range(steps):
                if not self.engine.has_unfinished_requests():
                    return
                self._step_both()

        def _step_both(self) -> None:
            outs = [e.step() for e in self.engines]
            runners = [e.model_runner for e in self.engines]
            batches = [r.batches[-1] for r in runners]  # type: ignore[attr-defined]
            by_index = {a: i for i, (a, _, _, _) in enumerate(self.live)}
            renamed = [(b, n) for b, n in batches[1][1]]
            id_b_to_a = {b: a for a, b, _, _ in self.live}
            assert batches[0][0] == batches[1][0]
            assert batches[0][1] == [(id_b_to_a[b], n) for b, n in renamed], "schedules differ"
            batch = batches[0][1]
            assert len(batch) <= self.config.max_num_seqs
            assert sum(n for _, n in batch) <= self.config.max_num_batched_tokens
            assert all(n >= 1 for _, n in batch)
            assert [(id_b_to_a[o.request_id], o.token_ids) for o in outs[1]] == [
                (o.request_id, o.token_ids) for o in outs[0]
            ]
            for out in outs[0]:
                self._check_output(out)
                del self.live[by_index[out.request_id]]
                by_index = {a: i for i, (a, _, _, _) in enumerate(self.live)}

        def _check_output(self, out: RequestOutput) -> None:
            tokens, reason = self.expected.pop(out.request_id)
            assert list(out.token_ids) == tokens, (out, tokens)
            assert out.finish_reason == reason

        @precondition(lambda self: bool(self.live))
        @rule(data=st.data())
        def abort_request(self, data: st.DataObject) -> None:
            a, b, _, _ = data.draw(st.sampled_from(self.live), label="abort")
            assert self.engines[0].abort_request(a) and self.engines[1].abort_request(b)
            self.live = [r for r in self.live if r[0] != a]
            del self.expected[a]

        @invariant()
        def consistent(self) -> None:
            for engine in self.engines:
                sched = engine.scheduler
                waiting, running = list(sched.waiting), list(sched.running)
                assert not {s.seq_id for s in waiting} & {s.seq_id for s in running}
                assert all(not s.block_table for s in waiting)
                engine.block_manager.check_invariants(running)  # type: ignore[attr-defined]
            tables = [[s.block_table for s in e.scheduler.running] for e in self.engines]
            assert tables[0] == tables[1], "spec and engine allocators diverged"
            bm = self.engines[0].block_manager
            bs = self.config.kvcache_block_size
            for seq in self.engines[0].scheduler.running:  # R8: computed full blocks registered
                for b in seq.block_table[: seq.num_cached_tokens // bs]:
                    assert bm.block_hashes[b] is not None, f"block {b} of {seq} not registered"  # type: ignore[attr-defined]

        def teardown(self) -> None:
            if not hasattr(self, "engines"):
                return
            guard = 0
            while self.engine.has_unfinished_requests():
                self._step_both()
                self.consistent()
                guard += 1
                assert guard < 20_000, "engine did not drain"
            for engine in self.engines:
                state = engine.block_manager.snapshot()  # type: ignore[attr-defined]
                assert sorted(state.free_queue) == list(range(self.config.num_kvcache_blocks or 0))
                assert set(state.ref_counts) == {0}
            assert not self.expected, "some accepted requests never finished"

    return EngineMachine
