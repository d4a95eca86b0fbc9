"""HostStaging: the step's arrays arrive intact, one copy per dtype, through reused arenas
that are never overwritten while the previous copy out of them may still be in flight; the
runner's ``BatchBuilder`` stages every step through the one staging it was built with.

Without a GPU the arena path runs on the CPU with a stand-in event (``pin=False``), which
records when it is recorded and waited on: the ordering is what is checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_engine.engine.sequence import Sequence
from paged_engine.layers.attention import HostMetadata, HostStaging, make_attention_metadata
from paged_engine.worker.model_inputs import BatchBuilder


class FakeEvent:
    """Stands in for ``torch.cuda.Event``; logs its calls into a shared list."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log
        self.id = len([e for e in log if e[0] == "record"])

    def record(self) -> None:
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.log.append(("wait", self.id))


def _staging(log: list[tuple[str, int]]) -> HostStaging:
    return HostStaging(torch.device("cpu"), pin=False, event_factory=lambda: FakeEvent(log))


def test_arrays_arrive_with_their_dtypes_and_shapes_one_copy_per_dtype() -> None:
    staging = _staging([])
    a = np.arange(6).reshape(2, 3)
    b = np.array([7, -1, 9])
    c = np.array([[1, 2], [3, 4]])
    ta, tb, tc = staging.stage([(a, torch.int32), (b, torch.int64), (c, torch.int32)])
    assert ta.dtype == torch.int32 and ta.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert tb.dtype == torch.int64 and tb.tolist() == [7, -1, 9]
    assert tc.dtype == torch.int32 and tc.tolist() == [[1, 2], [3, 4]]
    assert staging.copies == 2


def test_an_arena_is_reused_only_after_its_previous_copy_is_waited_on() -> None:
    log: list[tuple[str, int]] = []
    staging = _staging(log)
    (first,) = staging.stage([(np.array([1, 2, 3]), torch.int64)])
    (second,) = staging.stage([(np.array([4, 5]), torch.int64)])
    assert log == [("record", 0), ("wait", 0), ("record", 1)]
    # The first step's tensor is its own copy: the arena's reuse did not change it.
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]


def test_a_grown_arena_has_no_copy_to_wait_for() -> None:
    log: list[tuple[str, int]] = []
    staging = _staging(log)
    staging.stage([(np.zeros(10, dtype=np.int64), torch.int64)])
    (big,) = staging.stage([(np.arange(5000), torch.int64)])  # past the arena: a new one
    assert log == [("record", 0), ("record", 1)]
    assert big.tolist() == list(range(5000))


def test_the_runner_path_builds_the_same_metadata_as_the_plain_builder() -> None:
    query_lens, seq_lens, tables = [2, 1, 5], [6, 3, 5], [[4, 1], [0], [2, 3]]
    plain = make_attention_metadata(query_lens, seq_lens, tables, block_size=4)
    host = HostMetadata.build(query_lens, seq_lens, tables, 4)
    staged = host.on_device(_staging([]).stage(host.arrays()))
    for name in ("slot_mapping", "query_start_loc", "seq_start_loc", "seq_lens", "block_tables"):
        assert getattr(staged, name).tolist() == getattr(plain, name).tolist(), name
        assert getattr(staged, name).dtype == getattr(plain, name).dtype, name
    # seq 0: positions 4, 5 in block 1; seq 1: position 2 in block 0; seq 2: blocks 2, 3.
    assert staged.slot_mapping.tolist() == [4, 5, 2, 8, 9, 10, 11, 12]
    assert staged.slots_all_valid is True


def test_slots_all_valid_is_false_when_a_slot_is_skipped() -> None:
    warmup = make_attention_metadata([3, 2], [3, 2], [], block_size=4)  # no cache yet
    assert warmup.slot_mapping.tolist() == [-1] * 5 and warmup.slots_all_valid is False


@pytest.mark.parametrize("bad", [([1, 2], [3], [[0]]), ([0], [3], [[0]]), ([4], [3], [[0]])])
def test_bad_layouts_are_refused(bad: tuple[list[int], list[int], list[list[int]]]) -> None:
    with pytest.raises(ValueError, match=r"sequence"):
        HostMetadata.build(*bad, block_size=4)


def test_every_array_starts_16_bytes_aligned() -> None:
    arrays = [(np.arange(n), dtype) for n in (3, 5, 1, 7) for dtype in (torch.int32, torch.int64)]
    tensors = _staging([]).stage(arrays)
    assert [t.tolist() for t in tensors] == [list(range(n)) for n in (3, 5, 1, 7) for _ in "ab"]
    assert all(t.data_ptr() % 16 == 0 for t in tensors), [t.data_ptr() % 16 for t in tensors]


def _prefill(tokens: list[int], table: list[int]) -> Sequence:
    seq = Sequence(tokens, block_size=4)
    seq.block_table = table
    seq.num_scheduled_tokens = len(tokens)
    return seq


def test_the_batch_builder_stages_every_step_through_its_one_staging() -> None:
    log: list[tuple[str, int]] = []
    builder = BatchBuilder(4, _staging(log))
    seqs = [_prefill([3, 4, 5, 6, 7, 8], [4, 1]), _prefill([9, 10, 11], [0])]
    first = builder.build(seqs, is_prefill=True)
    recorded = list(log)
    assert recorded and all(kind == "record" for kind, _ in recorded)
    second = builder.build(seqs, is_prefill=True)
    # the second step waits on each of the first step's copies before reusing its arenas
    waits = [e for e in log[len(recorded) :] if e[0] == "wait"]
    assert sorted(i for _, i in waits) == sorted(i for _, i in recorded)
    for batch in (first, second):
        assert batch.input_ids.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11]
        assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
        assert batch.meta.slot_mapping.tolist() == [16, 17, 18, 19, 4, 5, 0, 1, 2]
        assert batch.sample_rows.tolist() == [5, 8] and batch.sampling == (0, 1)


def test_without_block_tables_nothing_is_stored() -> None:
    """The CUDA warm-up runs before the pool exists: every slot is -1."""
    builder = BatchBuilder(4, _staging([]))
    batch = builder.build([_prefill([3, 4, 5], [7])], is_prefill=True, with_block_tables=False)
    assert batch.meta.slot_mapping.tolist() == [-1, -1, -1]
    assert batch.input_ids.tolist() == [3, 4, 5]
