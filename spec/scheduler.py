"""Reference model of the scheduler: the simplest code that states rules S1-S12.

Each step cites the rule it implements. It runs on the reference allocator
(spec/block_manager.py) with its own sequences (``SpecRequest``, spec/sequence.py), not
the engine's ``Sequence``: the engine's sequence carries caches and a compact pickled form
that are optimisations, and the lockstep machine (tests/scheduler_machine.py) should
compare two states held independently, so that a counter the engine's sequence gets wrong
shows up as a difference. For the same reason its statistics and its failed-sample marker are its own
(spec/records.py), compared with the engine's field by field. Speed is no concern (lists,
linear scans, the hash chain recomputed from block 0); ``paged_engine.engine.scheduler``
is the fast twin.

What a scheduler does not decide is outside the spec: the model (a token per sequence
that finished its context, ``SpecFailedSample`` when its logits could not be sampled),
``min_tokens`` (the sampler masks stop tokens until then), stop strings (the engine's
text layer calls ``finish_now``), and ``n`` (the engine adds one sequence per completion).
"""

from __future__ import annotations

from spec.block_manager import BlockManager
from spec.hashing import salt_block
from spec.records import SpecFailedSample, SpecSchedulerStats
from spec.sequence import SpecRequest

__all__ = ["Result", "Scheduler", "SpecFailedSample", "SpecRequest", "SpecSchedulerStats"]

Result = int | SpecFailedSample | None
"""The model's result for one scheduled sequence (None: a chunk that samples nothing)."""


class Scheduler:
    """S1. ``waiting`` holds sequences without blocks, in arrival order (preempted and
    recovered ones at the front); ``running`` those that hold blocks, in admission order;
    ``finished`` those finished and not yet delivered (the caller empties it). A sequence
    is in exactly one of them until it is delivered, aborted or finished by ``finish_now``.
    ``prefix_aware`` turns on S5 (pass False without prefix caching).
    """

    def __init__(
        self,
        allocator: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        prefix_aware: bool = True,
        mixed_steps: bool = False,
    ) -> None:
        self.allocator = allocator
        self.mixed_steps = mixed_steps
        """S2m: every step carries the decodes and then prefill chunks (vLLM V1's steps)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.prefix_aware = prefix_aware
        self.waiting: list[SpecRequest] = []
        self.running: list[SpecRequest] = []
        self.finished: list[SpecRequest] = []
        self.errors: dict[str, str] = {}
        """Why each sequence finished with "error", by seq_id (S9)."""
        self.stats = SpecSchedulerStats()
        self.in_flight: list[tuple[SpecRequest, int]] = []
        """S11: the sequences this step changed and did not commit, with their lengths."""

    def add(self, seq: SpecRequest) -> None:
        """S1: a new sequence joins the back of waiting."""
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # ---- S2-S7: choosing a step -------------------------------------------------------

    def schedule(self) -> tuple[list[SpecRequest], bool]:
        """S2: a prefill step when S3 or S4 schedules anything, else a decode step (S6);
        S2m: with ``mixed_steps``, the decodes and then S3-S4's chunks in one step.
        Each scheduled sequence has ``num_scheduled_tokens`` set. Nothing schedulable
        while work remains is a stall: RuntimeError. If anything raises, ``recover()``
        has run (S11). The lockstep machine checks these after every step:

        post: 1 <= len(__return__[0]) <= self.max_num_seqs
        post: sum(s.num_scheduled_tokens for s in __return__[0]) <= self.max_num_batched_tokens
        post: all(s.num_scheduled_tokens >= 1 for s in __return__[0])
        post: __return__[1] or all(s.num_scheduled_tokens == 1 for s in __return__[0])
        """
        if self.in_flight:
            raise RuntimeError("schedule: the previous step was not post-processed or recovered")
        try:
            if self.mixed_steps:  # S2m: the decodes first, then chunks in what is left
                batch = self._schedule_decode()
                seats, budget = self.max_num_seqs - len(batch), self.max_num_batched_tokens
                prefills = self._schedule_prefill(seats, budget - len(batch))
                batch, is_prefill = batch + prefills, bool(prefills)
            else:
                batch = self._schedule_prefill(self.max_num_seqs, self.max_num_batched_tokens)
                is_prefill = bool(batch)
                if not is_prefill:
                    batch = self._schedule_decode()
            if not batch:
                raise RuntimeError("scheduler stalled: work remains and nothing can run")
        except BaseException:
            self.recover()
            raise
        self.stats.steps += 1  # S12
        in_use = self.allocator.num_blocks - self.allocator.num_free_blocks
        self.stats.peak_blocks_in_use = max(self.stats.peak_blocks_in_use, in_use)
        return batch, is_prefill

    def _schedule_prefill(self, seats: int, budget: int) -> list[SpecRequest]:
        """S3-S5 within ``seats`` sequences and ``budget`` tokens. S5 sees the blocks the
        prefill chunks complete, not those a decode in the same step (S2m) completes."""
        batch: list[SpecRequest] = []
        completed: list[tuple[int, tuple[int, ...]]] = []  # S5: blocks this step completes
        for seq in self.running:  # S3: chunked prefills continue first, in running order
            if seq.is_prefill and len(batch) < seats and budget > 0:
                self._touch(seq)
                budget -= self._chunk(seq, budget, completed)
                batch.append(seq)
        i = 0  # S4: then admission from the head of waiting
        while i < len(self.waiting) and len(batch) < seats and budget > 0:
            seq = self.waiting[i]
            hits = self.allocator.can_allocate(seq)
            if hits is None:
                break  # S4: no request overtakes one that does not fit
            if hits < seq.num_blocks - 1 and self._chain(seq)[hits] in completed:
                i += 1  # S5: deferred; it keeps its place, later ones are considered
                continue
            self._touch(seq)
            self.allocator.allocate(seq, hits)
            self.waiting.pop(i)
            if seq.num_prefix_hit_tokens is None:  # S12: the first admission only
                seq.num_prefix_hit_tokens = seq.num_cached_tokens
                self.stats.cached_prompt_tokens += seq.num_cached_tokens
                self.stats.prompt_tokens += seq.num_prompt_tokens
            seq.status = "running"
            seq.is_prefill = True
            budget -= self._chunk(seq, budget, completed)
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _chunk(
        self, seq: SpecRequest, budget: int, completed: list[tuple[int, tuple[int, ...]]]
    ) -> int:
        """S3: the rest of the sequence's context (prompt and any generated tokens to
        recompute), cut to the budget; S5: note the blocks it completes."""
        n = min(len(seq) - seq.num_cached_tokens, budget)
        seq.num_scheduled_tokens = n
        if self.prefix_aware:
            bs = seq.block_size
            chain = self._chain(seq)
            for j in range(seq.num_cached_tokens // bs, (seq.num_cached_tokens + n) // bs):
                completed.append(chain[j])
        return n

    def _chain(self, seq: SpecRequest) -> list[tuple[int, tuple[int, ...]]]:
        """S5: each full block as the prefix cache tells blocks apart (R5, R10): its chained
        hash under the allocator's own hash function (R4, the salt: R4s) and its tokens."""
        hash_fn = self.allocator.hash_fn
        h = None if seq.cache_salt is None else hash_fn(salt_block(seq.cache_salt), None)
        chain = []
        for i in range(len(seq) // seq.block_size):
            h = hash_fn(seq.block(i), h)
            chain.append((h, seq.block(i)))
        return chain

    def _schedule_decode(self) -> list[SpecRequest]:
        """S6: every running sequence from the front computes its newest token, within
        min(max_num_seqs, max_num_batched_tokens); R7 grows its table. S2m: the decodes
        end at the first chunked prefill in running (the decoding sequences are its head:
        the lockstep machine checks it), which may be preempted (S7) as any running
        sequence not yet scheduled."""
        batch: list[SpecRequest] = []
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        while self.running and len(batch) < limit and not self.running[0].is_prefill:
            seq = self.running.pop(0)
            self._touch(seq)
            while not self.allocator.can_append(seq):
                # S7: the newest running sequence not yet scheduled, else this one.
                victim = self.running.pop() if self.running else seq
                self._touch(victim)
                self._preempt(victim)
                self._commit(victim)
                if victim is seq:
                    break
            else:
                self.allocator.may_append(seq)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        self.running = batch + self.running
        return batch

    def _preempt(self, seq: SpecRequest) -> None:
        """S7: release its blocks (R3) and send it to the front of waiting; its tokens
        stay, to be recomputed (S3)."""
        self.allocator.deallocate(seq)
        seq.status = "waiting"
        seq.is_prefill = True
        seq.num_scheduled_tokens = 0
        self.waiting.insert(0, seq)
        self.stats.preemptions += 1  # S12

    # ---- S8, S9: applying a step's results ---------------------------------------------

    def postprocess(self, batch: list[SpecRequest], results: list[Result]) -> list[SpecRequest]:
        """S8: register the blocks the step filled (R8), advance, sample; S9: stop.
        Returns the sequences finished now (also appended to ``finished``)."""
        finished = []
        for seq, result in zip(batch, results, strict=True):
            self.allocator.hash_blocks(seq)
            n = seq.num_scheduled_tokens
            seq.num_cached_tokens += n
            prefill_row = seq.is_prefill  # S2m: a step may hold both kinds of row
            if prefill_row and seq.num_cached_tokens < len(seq):
                self.stats.prefill_tokens += n  # a chunk that samples nothing
                self._commit(seq)
                continue
            if isinstance(result, SpecFailedSample):
                self.errors[seq.seq_id] = result.reason
                stops = True
            elif isinstance(result, int) and not isinstance(result, bool):
                seq.token_ids.append(int(result))
                stops = self._stops(seq)
            else:
                raise RuntimeError(f"the model returned {result!r} for a sampling sequence")
            seq.is_prefill = False
            if stops:
                seq.status = "finished"
                self.allocator.deallocate(seq)
                self.running.remove(seq)
                self.finished.append(seq)
                finished.append(seq)
            if prefill_row:  # S12
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += 1
            if not isinstance(result, SpecFailedSample):
                self.stats.output_tokens += 1
            self._commit(seq)
        return finished

    def _stops(self, seq: SpecRequest) -> bool:
        """S9, after a token is appended."""
        last = seq.token_ids[-1]
        return (
            (not seq.ignore_eos and last in self.eos_token_ids)
            or last in seq.stop_token_ids
            or (seq.max_tokens is not None and seq.num_completion_tokens >= seq.max_tokens)
            or len(seq) >= self.max_model_len
        )

    def finish_reason(self, seq: SpecRequest) -> str:
        """S9: "error" (a failed sample), "stop" (its last token is an EOS id it does not
        ignore, or a stop token), else "length"."""
        if seq.seq_id in self.errors:
            return "error"
        last = seq.token_ids[-1]
        if (not seq.ignore_eos and last in self.eos_token_ids) or last in seq.stop_token_ids:
            return "stop"
        return "length"

    def stop_reason(self, seq: SpecRequest) -> int | str | None:
        """S9: the error's reason, the stop token that ended it, else None (EOS, length)."""
        if seq.seq_id in self.errors:
            return self.errors[seq.seq_id]
        last = seq.token_ids[-1]
        if not seq.ignore_eos and last in self.eos_token_ids:
            return None
        return last if last in seq.stop_token_ids else None

    # ---- S10: ending a sequence between steps ------------------------------------------

    def finish_now(self, seq: SpecRequest) -> None:
        """S10: a stop string matched: out of its queue, blocks released, finished (the
        caller reports it: it does not enter ``finished``). Statistics are unchanged."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.status = "finished"
        if seq.block_table:
            self.allocator.deallocate(seq)

    def abort(self, seq: SpecRequest) -> bool:
        """S10: out of whichever queue holds it (``finished`` included), blocks released,
        its error forgotten. False when no queue holds it."""
        for queue in (self.waiting, self.running, self.finished):
            if seq in queue:
                queue.remove(seq)
                if seq.block_table:
                    self.allocator.deallocate(seq)
                seq.status = "finished"
                self.errors.pop(seq.seq_id, None)
                return True
        return False

    # ---- S11: atomic steps -------------------------------------------------------------

    def _touch(self, seq: SpecRequest) -> None:
        """S11: recorded before the step changes it (admits it, grows it, dequeues it)."""
        if all(s is not seq for s, _ in self.in_flight):
            self.in_flight.append((seq, len(seq)))

    def _commit(self, seq: SpecRequest) -> None:
        """S11: the last statement of a sequence's bookkeeping in the step."""
        self.in_flight = [(s, n) for s, n in self.in_flight if s is not seq]

    def recover(self) -> list[SpecRequest]:
        """S11: after a step raised, preempt every sequence it touched and did not commit,
        in the order it touched them, to the front of waiting: a token appended without
        commit is dropped, blocks are released, the error of a failed sample forgotten.
        Returns them; counts a failed step when there were any."""
        if not self.in_flight:
            return []
        self.stats.failed_steps += 1  # S12
        stale = [seq for seq, _ in self.in_flight]
        self.running = [s for s in self.running if s not in stale]
        self.waiting = [s for s in self.waiting if s not in stale]
        self.finished = [s for s in self.finished if s not in stale]
        for seq, num_tokens in self.in_flight:
            if seq.block_table:
                self.allocator.deallocate(seq)
            del seq.token_ids[num_tokens:]
            seq.num_cached_tokens = 0
            seq.num_scheduled_tokens = 0
            seq.is_prefill = True
            seq.status = "waiting"
            self.errors.pop(seq.seq_id, None)
        self.waiting = stale + self.waiting
        self.in_flight = []
        return stale
