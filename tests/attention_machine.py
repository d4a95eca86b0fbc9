"""The attention oracle machine (docs/design.md, "Verification": attention paths ≡ oracle).

A Hypothesis ``RuleBasedStateMachine`` that owns the engine's ``BlockManager`` and one paged
KV cache per *lane* (an attention backend at one dtype), and drives them the way the engine
does: requests arrive (built from prefixes of earlier requests, so prefix blocks are shared
and, after release, revived from the free queue), are admitted through ``can_allocate`` /
``allocate``, prefill in chunks, several per step, then decode one token per sequence per
step, all decoding sequences in one batch; decode growth preempts when the pool runs dry,
and sequences are preempted or finished at random, their blocks released and reused.

Every compute step goes through the production paths: the step's metadata comes from
the runner's ``BatchBuilder`` (which maps slots with ``engine.indexing.slot_mapping``), K/V rows
are written with the lane's ``store_kv`` and read back with its ``attend``. The machine keeps
what the cache is supposed to mean: each live sequence's logical, contiguous K/V history.
The K/V of the token at position ``p`` is a deterministic function of tokens ``0..p`` (a
seeded draw keyed by the chained hash of that prefix), so blocks shared through the prefix
cache legitimately hold the same data for every sequence that uses them.

Checks, after every step (each names the lane, the step and the sequence when it fails):

* **attention**: every lane's output for every sequence, decode and prefill over a cached
  prefix alike, equals ``naive_attention`` (plain float32 softmax) over that sequence's
  logical history, within the lane's dtype tolerance (or, for the decode steps of a lane
  that rounds once, half a bfloat16 ulp of the unrounded oracle: ``ONE_ROUNDING``), and
  holds no NaN (the pool starts as NaN, so reading a slot nothing wrote shows up);
* **R9, allocator side**: before each store, every slot the step writes lies in a block of
  the writing sequence's own table with ``ref_count == 1`` and no registered hash;
* **R9, data side**: the store wrote exactly those slots, bit for bit, and changed nothing
  else in the pool (so no shared or cached block is ever overwritten);
* **prefix hits**: on admission, every block the prefix cache hands out holds, bit for bit,
  the K/V of the admitted sequence's own tokens;
* **R12**: ``check_invariants`` over all sequences.

``make_machine`` parameterises the lanes, device and shapes, so one machine runs the torch
backend, Triton under the interpreter on CPU, compiled Triton and flash-attn on CUDA, and the
kernel mutants of tests/kernel_mutants.py (tests/test_attention_machine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from xxhash import xxh64_intdigest

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    HostStaging,
    naive_attention,
)
from paged_engine.worker.model_inputs import BatchBuilder

BackendFactory = Callable[[int, torch.dtype], AttentionBackend]
"""``(block_size, dtype) -> backend``."""

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    # Output vs naive_attention in float32 over the same (dtype-rounded) q/K/V, rounded to the
    # output dtype. float32: summation order only. float16: one ulp near 1 is 9.8e-4, and the
    # kernels round P to the cache dtype before P @ V. bfloat16: the same, 8x coarser.
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass(frozen=True)
class Geometry:
    """Attention head layout: ``num_kv_heads * group`` query heads of ``head_dim``."""

    num_kv_heads: int
    group: int
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group


ONE_ROUNDING: dict[str, float] = {"atol": 1e-5, "rtol": 2**-8 + 1e-5}
"""A lane whose kernel computes in float32 over bfloat16 inputs and rounds once, at the
output (the CPU kernel): within half a bfloat16 ulp (at most 2**-8 of the value) of the
float32 oracle, unrounded, over the same inputs; atol covers float32 summation order."""


@dataclass(frozen=True)
class Lane:
    """One backend at one dtype, checked against the oracle on its own KV pool."""

    name: str
    make_backend: BackendFactory
    dtype: torch.dtype
    one_rounding: bool = False
    """Hold the lane's decode steps to ``ONE_ROUNDING`` instead of its dtype's
    ``TOLERANCES`` (the CPU backend's prefill is torch's SDPA: dtype tolerance)."""


@dataclass(frozen=True)
class MachineConfig:
    lanes: tuple[Lane, ...]
    device: str = "cpu"
    geometries: tuple[Geometry, ...] = (Geometry(2, 2, 16), Geometry(1, 3, 16))
    """Drawn per run (shrinking moves towards the first): GQA with several KV heads first."""
    block_sizes: tuple[int, ...] = (4, 8, 16)
    pool_blocks: tuple[int, int] = (3, 16)
    """Inclusive range of the pool size, in blocks."""
    max_model_len: int = 64
    """Tokens; a sequence that reaches it (or the pool's capacity) finishes."""
    max_run: int | None = None
    """Longest run of one token when building a prompt; default ``2 * block_size``."""
    max_live: int = 6
    """Most sequences alive (waiting or running) at once."""
    max_prefill_batch: int = 3


class Live:
    """A sequence the machine tracks, with the hash seed of each token's K/V."""

    __slots__ = ("seeds", "seq")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.seeds: list[int] = []

    def __repr__(self) -> str:
        return repr(self.seq)


@dataclass
class LaneState:
    lane: Lane
    backend: AttentionBackend
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that NaN == NaN in equality checks."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def make_machine(config: MachineConfig) -> type[RuleBasedStateMachine]:
    """A machine class that checks every lane of ``config``."""
    device = torch.device(config.device)

    class AttentionMachine(RuleBasedStateMachine):
        @initialize(
            geometry=st.sampled_from(config.geometries),
            block_size=st.sampled_from(config.block_sizes),
            pool=st.integers(*config.pool_blocks),
            alphabet=st.integers(2, 3),
            seed=st.integers(0, 2**32 - 1),
        )
        def setup(
            self, geometry: Geometry, block_size: int, pool: int, alphabet: int, seed: int
        ) -> None:
            self.geo = geometry
            self.bs = block_size
            self.bm = BlockManager(pool, block_size)
            self.alphabet = alphabet
            self.seed = seed
            self.max_len = min(config.max_model_len, pool * block_size)
            self.max_run = config.max_run or 2 * block_size
            self.scale = geometry.head_dim**-0.5
            self.waiting: list[Live] = []
            self.running: list[Live] = []  # admission order: the last one is preempted first
            self.corpus: list[list[int]] = []  # earlier prompts and finished sequences
            self.kv_memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self.qgen = torch.Generator().manual_seed(seed)
            self.steps = 0
            shape = (pool, block_size, geometry.num_kv_heads, geometry.head_dim)
            self.lanes = [
                LaneState(
                    lane=lane,
                    backend=lane.make_backend(block_size, lane.dtype),
                    k_cache=torch.full(shape, float("nan"), dtype=lane.dtype, device=device),
                    v_cache=torch.full(shape, float("nan"), dtype=lane.dtype, device=device),
                )
                for lane in config.lanes
            ]
            # The model runner's own input builder: each step's metadata is built exactly as
            # the engine builds it, without loading a model.
            self.batch_builder = BatchBuilder(block_size, HostStaging(device))

        # ---- K/V as a function of the prefix -----------------------------------------------

        def _extend_seeds(self, live: Live) -> None:
            tokens = live.seq.token_ids
            for p in range(len(live.seeds), len(tokens)):
                prev = live.seeds[p - 1] if p else self.seed
                data = prev.to_bytes(8, "little") + tokens[p].to_bytes(8, "little")
                live.seeds.append(xxh64_intdigest(data))

        def _kv_rows(self, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            """``[n, kvh, d]`` float32 K and V of the tokens with these prefix seeds (CPU)."""
            kvh, d = self.geo.num_kv_heads, self.geo.head_dim
            if not seeds:
                empty = torch.empty(0, kvh, d)
                return empty, empty
            ks, vs = [], []
            for s in seeds:
                rows = self.kv_memo.get(s)
                if rows is None:
                    gen = torch.Generator().manual_seed(s % 2**63)
                    kv = torch.randn(2, kvh, d, generator=gen)
                    rows = self.kv_memo[s] = (kv[0], kv[1])
                ks.append(rows[0])
                vs.append(rows[1])
            return torch.stack(ks), torch.stack(vs)

        # ---- bookkeeping --------------------------------------------------------------------

        def _all_seqs(self) -> list[Sequence]:
            return [lv.seq for lv in self.waiting + self.running]

        def _prefilling(self) -> list[Live]:
            return [lv for lv in self.running if lv.seq.is_prefill]

        def _decoding(self) -> list[Live]:
            return [lv for lv in self.running if not lv.seq.is_prefill]

        def _preempt(self, live: Live) -> None:
            self.bm.deallocate(live.seq)
            live.seq.status = SequenceStatus.WAITING
            live.seq.is_prefill = True
            live.seq.num_scheduled_tokens = 0
            self.running.remove(live)
            self.waiting.insert(0, live)
            event("preempted")

        def _finish(self, live: Live) -> None:
            self.bm.deallocate(live.seq)
            live.seq.status = SequenceStatus.FINISHED
            self.running.remove(live)
            self.corpus.append(list(live.seq.token_ids))

        def _sample(self, live: Live, data: st.DataObject) -> None:
            """Append the 'sampled' token, or finish a sequence that is as long as allowed."""
            if len(live.seq) >= self.max_len:
                self._finish(live)
                return
            live.seq.append_token(data.draw(st.integers(0, self.alphabet - 1), label="token"))
            self._extend_seeds(live)

        # ---- rules --------------------------------------------------------------------------

        @precondition(lambda self: len(self.waiting) + len(self.running) < config.max_live)
        @rule(data=st.data(), count=st.integers(1, 3))
        def add_requests(self, data: st.DataObject, count: int) -> None:
            """New requests, most of them extending a prefix of an earlier sequence."""
            for _ in range(min(count, config.max_live - len(self.waiting) - len(self.running))):
                prompt: list[int] = []
                if self.corpus and data.draw(st.integers(0, 3), label="share") > 0:
                    base = data.draw(st.sampled_from(self.corpus), label="base")
                    cut = st.one_of(st.just(len(base)), st.integers(0, len(base)))
                    prompt = base[: data.draw(cut, label="cut")]
                runs = data.draw(
                    st.lists(
                        st.tuples(st.integers(0, self.alphabet - 1), st.integers(1, self.max_run)),
                        max_size=3,
                    ),
                    label="runs",
                )
                for token, length in runs:
                    prompt.extend([token] * length)
                # Most prompts fit in half the pool, so that several sequences share it.
                cap = data.draw(st.sampled_from([self.max_len // 2, self.max_len - 1]), label="cap")
                prompt = prompt[:cap] or [0]
                live = Live(Sequence(prompt, block_size=self.bs))
                self._extend_seeds(live)
                self.corpus.append(list(prompt))
                self.waiting.append(live)

        def _admit(self, live: Live) -> bool:
            hits = self.bm.can_allocate(live.seq)
            if hits is None:
                event("admission refused: pool too short")
                return False
            self.bm.allocate(live.seq, hits)
            event(f"admitted with {min(hits, 2)}{'+' if hits > 2 else ''} prefix-cache hits")
            live.seq.status = SequenceStatus.RUNNING
            live.seq.is_prefill = True
            self.waiting.remove(live)
            self.running.append(live)
            if any(self.bm.ref_counts[b] == 1 for b in live.seq.block_table[:hits]):
                event("revived a cached block from the free queue")
            self._check_cached_prefix(live, hits)
            return True

        @precondition(lambda self: bool(self.waiting) or bool(self._prefilling()))
        @rule(data=st.data())
        def prefill_step(self, data: st.DataObject) -> None:
            """One prefill step, as the scheduler builds it: chunks of some sequences already
            prefilling, then waiting sequences admitted (prefix hits, revivals) and chunked."""
            picked: list[Live] = []
            if self._prefilling():
                picked = data.draw(
                    st.lists(
                        st.sampled_from(self._prefilling()),
                        max_size=config.max_prefill_batch,
                        unique_by=id,
                    ),
                    label="continue",
                )
            admit = data.draw(st.integers(0, config.max_prefill_batch - len(picked)), label="n")
            for _ in range(admit):
                if not self.waiting:
                    break
                live = data.draw(st.sampled_from(self.waiting), label="admit")
                if not self._admit(live):
                    break
                picked.append(live)
            if not picked:
                return
            batch = [lv for lv in self.running if any(lv is p for p in picked)]
            for live in batch:
                seq = live.seq
                left = len(seq) - seq.num_cached_tokens
                chunk = data.draw(st.one_of(st.just(left), st.integers(1, left)), label="chunk")
                seq.num_scheduled_tokens = chunk
            self._run_step(batch, is_prefill=True)
            for live in batch:
                seq = live.seq
                self.bm.hash_blocks(seq)
                seq.num_cached_tokens += seq.num_scheduled_tokens
                if seq.num_cached_tokens == len(seq):
                    seq.is_prefill = False
                    self._sample(live, data)

        @precondition(lambda self: bool(self._decoding()))
        @rule(data=st.data(), steps=st.integers(1, 4))
        def decode_steps(self, data: st.DataObject, steps: int) -> None:
            """Scheduler-style decode steps over every decoding sequence, preempting the most
            recently admitted unscheduled sequence while the pool cannot grow one."""
            for _ in range(steps):
                scheduled: list[Live] = []
                for live in self._decoding():
                    if not any(live is r for r in self.running):
                        continue  # preempted earlier in this step
                    while not self.bm.can_append(live.seq):
                        victims = [r for r in self.running if all(r is not s for s in scheduled)]
                        victim = victims[-1]
                        self._preempt(victim)
                        if victim is live:
                            break
                    else:
                        self.bm.may_append(live.seq)
                        live.seq.num_scheduled_tokens = 1
                        scheduled.append(live)
                if not scheduled:
                    return
                self._run_step(scheduled, is_prefill=False)
                for live in scheduled:
                    self.bm.hash_blocks(live.seq)
                    live.seq.num_cached_tokens += 1
                    self._sample(live, data)

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data(), finished=st.booleans())
        def release(self, data: st.DataObject, finished: bool) -> None:
            live = data.draw(st.sampled_from(self.running), label="release")
            if finished:
                self._finish(live)
            else:
                self._preempt(live)

        @invariant()
        def allocator_invariants(self) -> None:
            if hasattr(self, "bm"):
                self.bm.check_invariants(self._all_seqs())

        # ---- one compute step, and the checks -----------------------------------------------

        def _run_step(self, batch: list[Live], is_prefill: bool) -> None:
            self.steps += 1
            seqs = [lv.seq for lv in batch]
            meta: AttentionMetadata = self.batch_builder.build(seqs, is_prefill).meta
            spans = [
                (s.num_cached_tokens, s.num_cached_tokens + s.num_scheduled_tokens) for s in seqs
            ]
            what = f"step {self.steps} ({'prefill' if is_prefill else 'decode'}, spans {spans})"
            slots = meta.slot_mapping.tolist()
            self._check_exclusive_slots(batch, spans, slots, what)

            # Each sequence's whole logical history; the step's new rows are its tail.
            histories = [
                self._kv_rows(lv.seeds[:end]) for lv, (_, end) in zip(batch, spans, strict=True)
            ]
            k_new = torch.cat([k[a:] for (k, _), (a, _) in zip(histories, spans, strict=True)])
            v_new = torch.cat([v[a:] for (_, v), (a, _) in zip(histories, spans, strict=True)])
            q_new = torch.randn(
                len(slots), self.geo.num_heads, self.geo.head_dim, generator=self.qgen
            )
            for st_ in self.lanes:
                self._store_and_check(st_, k_new, v_new, meta, slots, what)
                dt = st_.lane.dtype
                q = q_new.to(device, dt)
                out = st_.backend.attend(
                    q,
                    k_new.to(device, dt),
                    v_new.to(device, dt),
                    st_.k_cache,
                    st_.v_cache,
                    meta,
                    self.scale,
                )
                self._check_output(st_, out, q, batch, spans, histories, what, is_prefill)

        def _check_exclusive_slots(
            self, batch: list[Live], spans: list[tuple[int, int]], slots: list[int], what: str
        ) -> None:
            """R9 from the allocator's side: each new token goes to a block its sequence owns
            alone, that no other sequence can hit (unregistered)."""
            state = self.bm.snapshot()
            total = sum(end - start for start, end in spans)
            assert total == len(slots), f"{what}: {len(slots)} slots for {total} new tokens"
            row = 0
            for live, (start, end) in zip(batch, spans, strict=True):
                table = live.seq.block_table
                for pos, slot in zip(
                    range(start, end), slots[row : row + end - start], strict=True
                ):
                    block = slot // self.bs
                    assert block in table, (
                        f"{what}: seq {live.seq.seq_id} writes token {pos} to slot {slot} of "
                        f"block {block}, which is not in its block table {table}"
                    )
                    assert state.ref_counts[block] == 1 and state.block_hashes[block] is None, (
                        f"{what}: seq {live.seq.seq_id} writes token {pos} into block {block} "
                        f"(ref_count {state.ref_counts[block]}, hash "
                        f"{state.block_hashes[block]}): a shared or cached block (R9)"
                    )
                row += end - start

        def _store_and_check(
            self,
            st_: LaneState,
            k_new: torch.Tensor,
            v_new: torch.Tensor,
            meta: AttentionMetadata,
            slots: list[int],
            what: str,
        ) -> None:
            """Store through the lane's backend; it must write exactly the step's slots."""
            dt = st_.lane.dtype
            kvh, d = self.geo.num_kv_heads, self.geo.head_dim
            before = (st_.k_cache.clone(), st_.v_cache.clone())
            st_.backend.store_kv(
                k_new.to(device, dt),
                v_new.to(device, dt),
                st_.k_cache,
                st_.v_cache,
                meta.slot_mapping,
                meta,
            )
            index = torch.tensor(slots, dtype=torch.long, device=device)
            untouched = torch.ones(st_.k_cache.shape[0] * self.bs, dtype=torch.bool, device=device)
            untouched[index] = False
            for name, cache, old, new in (
                ("K", st_.k_cache, before[0], k_new),
                ("V", st_.v_cache, before[1], v_new),
            ):
                flat, old_flat = cache.view(-1, kvh, d), old.view(-1, kvh, d)
                assert torch.equal(_bits(flat[index]), _bits(new.to(device, dt))), (
                    f"{st_.lane.name}, {what}: store_kv did not write the step's {name} rows "
                    "to their slots"
                )
                assert torch.equal(_bits(flat[untouched]), _bits(old_flat[untouched])), (
                    f"{st_.lane.name}, {what}: store_kv changed {name} slots outside the "
                    "step's own (R9: it wrote into a block the sequence does not own)"
                )

        def _check_output(
            self,
            st_: LaneState,
            out: torch.Tensor,
            q: torch.Tensor,
            batch: list[Live],
            spans: list[tuple[int, int]],
            histories: list[tuple[torch.Tensor, torch.Tensor]],
            what: str,
            is_prefill: bool,
        ) -> None:
            dt = st_.lane.dtype
            one_rounding = st_.lane.one_rounding and not is_prefill
            assert out.shape == q.shape and out.dtype == dt, (
                f"{st_.lane.name}, {what}: output {tuple(out.shape)} {out.dtype}, "
                f"expected {tuple(q.shape)} {dt}"
            )
            row = 0
            for live, (start, end), (k_hist, v_hist) in zip(batch, spans, histories, strict=True):
                n = end - start
                got = out[row : row + n]
                # One rounding: the oracle in float32 over the lane's rounded inputs, unrounded.
                up = torch.float32 if one_rounding else dt
                expected = naive_attention(
                    q[row : row + n].to(up),
                    k_hist.to(device, dt).to(up),
                    v_hist.to(device, dt).to(up),
                    self.scale,
                    causal_offset=start,
                )
                where = (
                    f"{st_.lane.name}, {what}: seq {live.seq.seq_id} (tokens {start}..{end - 1} "
                    f"over a {end}-token context, block table {live.seq.block_table})"
                )
                assert not got.isnan().any(), f"{where}: NaN in the output (read an unwritten slot)"

                def message(detail: str, where: str = where) -> str:
                    return f"{where}: differs from naive attention over its K/V history\n{detail}"

                tol = ONE_ROUNDING if one_rounding else TOLERANCES[dt]
                torch.testing.assert_close(
                    got.float(), expected.float(), atol=tol["atol"], rtol=tol["rtol"], msg=message
                )
                row += n

        def _check_cached_prefix(self, live: Live, hits: int) -> None:
            """Blocks handed out by the prefix cache hold this sequence's own K/V."""
            if not hits:
                return
            bs = self.bs
            k_ref, v_ref = self._kv_rows(live.seeds[: hits * bs])
            blocks = torch.tensor(live.seq.block_table[:hits], dtype=torch.long, device=device)
            for st_ in self.lanes:
                dt = st_.lane.dtype
                for name, cache, ref in (("K", st_.k_cache, k_ref), ("V", st_.v_cache, v_ref)):
                    got = cache[blocks].flatten(0, 1)
                    assert torch.equal(_bits(got), _bits(ref.to(device, dt))), (
                        f"{st_.lane.name}: seq {live.seq.seq_id} hit {hits} cached blocks "
                        f"{live.seq.block_table[:hits]} whose {name} is not its own prefix's"
                    )

    AttentionMachine.__name__ = "AttentionMachine_" + "_".join(
        lane.name.replace("-", "_") for lane in config.lanes
    )
    return AttentionMachine
