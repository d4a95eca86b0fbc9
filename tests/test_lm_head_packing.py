"""The LM head on a oneDNN-packed weight (``LMHead.process_weights_after_loading``), as the
projections are (``test_linear_packing.py``).

The packed head must compute ``F.linear`` with the checkpoint's matrix, within the GEMM's
rounding (the tolerances of ``test_linear_packing``). A tied head shares the embedding's
matrix, which the embedding still looks rows up in: it must stay whole and unchanged; an
untied one is released like a projection's. Mutants: a tied head that releases the
shared matrix, and one that packs a float32 copy where oneDNN cannot take bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paged_engine import LLM
from paged_engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tests.test_linear_packing import (
    ONEDNN_BF16,
    TOL,
    needs_onednn,
    needs_onednn_bf16,
    no_onednn_bf16,
)

__all__ = ["no_onednn_bf16"]  # a fixture, used by name

VOCAB, HIDDEN = 300, 48


def _head(dtype: torch.dtype, tied: bool) -> tuple[ParallelLMHead, VocabParallelEmbedding]:
    gen = torch.Generator().manual_seed(0)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN).to(dtype)
    embed.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
    head = ParallelLMHead(VOCAB, HIDDEN, embed if tied else None).to(dtype)
    if not tied:
        head.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
    return head, embed


def check_head(
    head: ParallelLMHead, embed: VocabParallelEmbedding, dtype: torch.dtype, packed: bool
) -> None:
    """Loaded, then ``process_weights_after_loading``: packed (or, with ``packed`` False,
    dense); the logits are the dense product; a tied embedding keeps its whole matrix and
    looks up the same rows as before."""
    weight = head.weight.detach().clone()
    table = embed.weight.detach().clone()
    head.process_weights_after_loading()
    assert (head._packed is not None) == packed
    if head.tied:
        assert tuple(embed.weight.shape) == (VOCAB, HIDDEN), "the shared matrix was released"
        assert torch.equal(embed.weight, table)
        ids = torch.tensor([0, 5, VOCAB - 1])
        assert torch.equal(embed(ids), table[ids])
    elif packed:
        assert tuple(head.weight.shape) == (0, HIDDEN)  # the dense copy is released
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 33):
        x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        expected = F.linear(x.float(), weight.float())
        got = head(x)
        assert got.shape == (rows, VOCAB) and got.dtype == dtype
        rtol, atol = TOL[dtype]
        scale = float(expected.abs().max())
        assert float((got.float() - expected).abs().max()) <= (atol + rtol) * scale, rows


DTYPES = [
    pytest.param(torch.float32, marks=needs_onednn, id="float32"),
    pytest.param(torch.bfloat16, marks=needs_onednn_bf16, id="bfloat16"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_packed_head_computes_the_dense_product(dtype: torch.dtype, tied: bool) -> None:
    check_head(*_head(dtype, tied), dtype, packed=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bfloat16_without_onednn_bf16_stays_dense(no_onednn_bf16: None, tied: bool) -> None:
    check_head(*_head(torch.bfloat16, tied), torch.bfloat16, packed=False)


def test_float16_stays_dense() -> None:
    head, _ = _head(torch.float16, tied=False)
    head.process_weights_after_loading()
    assert head._packed is None and tuple(head.weight.shape) == (VOCAB, HIDDEN)


def test_bfloat16_packs_exactly_where_torch_says_onednn_computes_it() -> None:
    head, _ = _head(torch.bfloat16, tied=True)
    head.process_weights_after_loading()  # never raises, whatever the CPU
    assert (head._packed is not None) == ONEDNN_BF16


@needs_onednn
def test_packing_twice_is_packing_once() -> None:
    head, _ = _head(torch.float32, tied=False)
    head.process_weights_after_loading()
    packed = head._packed
    head.process_weights_after_loading()  # the weight is empty now: must not repack it
    assert head._packed is packed


@needs_onednn
def test_the_model_runner_packs_the_head_on_cpu(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kvcache_blocks=64, max_model_len=256)
    model = llm.model_runner.model
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert len(heads) == 1 and heads[0]._packed is not None
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0


class ReleasesTheSharedMatrix(ParallelLMHead):
    """A head that releases its dense matrix even when the embedding shares it."""

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        if self._packed is not None:
            self.weight.data = self.weight.data.new_empty((0, self.weight.shape[1]))


class PacksAFloat32Copy(ParallelLMHead):
    """A wrong fallback: packs the bfloat16 matrix widened to float32 instead of leaving it
    dense where oneDNN cannot compute bfloat16."""

    def process_weights_after_loading(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().float(), None)


@needs_onednn
def test_the_check_catches_a_head_that_releases_the_embeddings_matrix() -> None:
    _, embed = _head(torch.float32, tied=True)
    with pytest.raises(AssertionError, match="released"):
        check_head(ReleasesTheSharedMatrix(VOCAB, HIDDEN, embed), embed, torch.float32, True)


@needs_onednn
def test_the_check_catches_a_fallback_that_packs_anyway(no_onednn_bf16: None) -> None:
    _, embed = _head(torch.bfloat16, tied=True)
    head = PacksAFloat32Copy(VOCAB, HIDDEN, embed)
    with pytest.raises(AssertionError):
        check_head(head, embed, torch.bfloat16, packed=False)
