"""The "cpu" and torch backends on a mixed step (S2m: the running sequences' decodes first,
then prefill chunks; ``layers.attention.mixed`` cuts it): the leading one-token sequences
take the decode path (the compiled kernel, or torch's batched gather), the chunks after
them the torch backend's prefill loop, each part with the bits it gets in a step of its
own, and the whole within tolerance of the naive oracle (``paged_prefill_attention_ref``,
which treats a decode row as a one-row chunk).

Every prefill sequence here continues a cached prefix, so the torch backend reads its whole
context from the cache, as the kernel and the oracle do.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest
import torch

from paged_engine.layers.attention import TorchAttentionBackend, make_attention_metadata
from paged_engine.layers.attention import cpu as cpu_module
from paged_engine.layers.attention import torch_backend as torch_module
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.layers.attention.mixed import split_mixed
from tests.kernel_cases import Case, Tensors, assert_close, make_tensors, ref_prefill

CPU = torch.device("cpu")
BS = 8
DTYPES = [torch.float32, torch.bfloat16]


def _meta(t: Tensors, seq_lens: list[int], query_lens: list[int]) -> Any:
    tables = [[b for b in row if b >= 0] for row in t.block_tables.tolist()]
    tables = [row[: -(-s // BS)] for row, s in zip(tables, seq_lens, strict=True)]
    return make_attention_metadata(query_lens, seq_lens, tables, BS)


def _step(
    seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, seed: int = 0
) -> tuple[Tensors, Any]:
    case = Case(
        seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens),
        block_size=BS,
        num_kv_heads=4,
        group=2,
        head_dim=64,
        dtype=dtype,
        seed=seed,
    )
    t = make_tensors(case, CPU)
    return t, _meta(t, seq_lens, query_lens)


def _part(t: Tensors, rows: slice, seqs: slice, seq_lens: list[int], q_lens: list[int]) -> Any:
    """Sequences ``seqs`` of ``t`` (their query ``rows``) as a step of their own."""
    part = Tensors(
        query=t.query[rows],
        k_cache=t.k_cache,
        v_cache=t.v_cache,
        block_tables=t.block_tables[seqs],
        seq_lens=t.seq_lens[seqs],
        query_start_loc=t.query_start_loc,  # unused by _meta
        scale=t.scale,
    )
    return part, _meta(part, seq_lens[seqs], q_lens[seqs])


def _counting(monkeypatch: pytest.MonkeyPatch, name: str, module: Any = cpu_module) -> list[int]:
    """Count calls of ``module.<name>``; each records its first argument's length."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        first = args[1] if name == "run_paged_decode_cpu" else args[0]
        calls.append(len(first) if isinstance(first, torch.Tensor) else 1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


BACKENDS = {"cpu": CpuAttentionBackend, "torch": TorchAttentionBackend}


def test_each_part_of_the_cut_is_the_metadata_of_a_step_of_its_own() -> None:
    """``split_mixed``'s parts, field by field, against metadata built from the parts'
    own lists (``make_attention_metadata``, the runner's builder)."""
    seq_lens, q_lens = [37, 9, 16, 40, 30], [1, 1, 1, 12, 7]
    t, meta = _step(seq_lens, q_lens, torch.float32)
    split = split_mixed(meta)
    assert split is not None and split.rows == 3
    parts = ((slice(0, 3), slice(0, 3)), (slice(3, 5), slice(3, 22)))  # sequences, rows
    for got, (seqs, rows) in zip((split.decode, split.rest), parts, strict=True):
        _, want = _part(t, rows, seqs, seq_lens, q_lens)
        for f in fields(want):
            a, b = getattr(got, f.name), getattr(want, f.name)
            same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
            assert same, f"{f.name}: {a} != {b}"
    # Nothing to cut: a step that starts with a chunk, or is all decodes.
    assert split_mixed(_step([40, 37], [12, 1], torch.float32)[1]) is None
    assert split_mixed(_step([40, 37], [1, 1], torch.float32)[1]) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_leading_decodes_take_the_decode_path_and_the_chunks_the_prefill_loop(
    dtype: torch.dtype, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = BACKENDS[backend]
    seq_lens, q_lens = [37, 9, 16, 40, 30], [1, 1, 1, 12, 7]
    t, meta = _step(seq_lens, q_lens, dtype)
    kernel_rows = _counting(monkeypatch, "run_paged_decode_cpu")
    gathered_rows: list[int] = []
    gather = TorchAttentionBackend._attend_gathered

    def counted_gather(self: Any, query: torch.Tensor, *args: Any) -> torch.Tensor:
        gathered_rows.append(len(query))
        return gather(self, query, *args)

    monkeypatch.setattr(TorchAttentionBackend, "_attend_gathered", counted_gather)
    q = t.query
    got = make(BS, dtype).attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale)
    # The three decode rows take the backend's decode path together: the "cpu" backend's
    # kernel, or torch's one gathered SDPA call (whose values the per-row loop would match).
    want_paths = ([3], []) if backend == "cpu" else ([], [3])
    assert (kernel_rows, gathered_rows) == want_paths, "the decodes left the decode path"
    gathered_rows.clear()

    # The decode rows: the bits of the same three sequences in a decode step of their own.
    dec, dec_meta = _part(t, slice(0, 3), slice(0, 3), seq_lens, q_lens)
    qd = dec.query
    alone = make(BS, dtype).attend(qd, qd, qd, t.k_cache, t.v_cache, dec_meta, t.scale)
    assert torch.equal(got[:3], alone)
    # The chunks: the torch backend's bits for the two of them as a step of their own.
    pre, pre_meta = _part(t, slice(3, None), slice(3, None), seq_lens, q_lens)
    qp = pre.query
    want = TorchAttentionBackend(BS, dtype).attend(
        qp, qp, qp, t.k_cache, t.v_cache, pre_meta, t.scale
    )
    assert torch.equal(got[3:], want)
    # And the whole step against the oracle.
    assert_close(got, ref_prefill(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_mixed_step_is_split_and_checked_once_for_all_its_layers(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = _counting(monkeypatch, "check_paged_decode_cpu")
    splits = _counting(monkeypatch, "split_mixed", torch_module)
    backend = CpuAttentionBackend(BS, dtype)
    for step in range(2):
        t, meta = _step([37, 9, 40], [1, 1, 12], dtype, seed=step)
        q = t.query
        outs = [backend.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale) for _ in range(4)]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
        assert_close(outs[0], ref_prefill(t))
        assert (len(checks), len(splits)) == (step + 1, step + 1), "made again in a layer"


@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "all_stored"),
    [([40, 37, 9], [12, 1, 1], True), ([37, 40], [1, 12], False)],
    ids=["chunk-first", "unstored-row"],
)
def test_steps_the_split_leaves_alone_run_all_on_the_torch_path(
    seq_lens: list[int], q_lens: list[int], all_stored: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a leading run of one-token sequences is cut off (the scheduler puts a mixed
    step's decodes first): a decode row after a chunk stays with the torch backend. And a
    slot of -1 (a row that is not stored: warm-up passes, padded graph rows) keeps the
    kernel away, which would read that row from the pool, where nothing was written."""
    t, meta = _step(seq_lens, q_lens, torch.float32)
    kernel_rows = _counting(monkeypatch, "run_paged_decode_cpu")
    step = replace(meta, slots_all_valid=all_stored)
    q = t.query
    got = CpuAttentionBackend(BS, torch.float32).attend(
        q, q, q, t.k_cache, t.v_cache, step, t.scale
    )
    want = TorchAttentionBackend(BS, torch.float32).attend(
        q, q, q, t.k_cache, t.v_cache, step, t.scale
    )
    assert kernel_rows == []
    assert torch.equal(got, want)
