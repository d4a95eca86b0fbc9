"""``LLM.beam_search`` (vLLM's): the beams equal transformers' ``num_beams`` greedy beam
search on the tiny model, best first; the beams share blocks through the prefix cache;
EOS and the length penalty rank as vLLM ranks; bad params are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, BeamSearchParams
from paged_engine.beam_search import BeamSearchSequence, beam_score
from paged_engine.errors import InvalidRequestError

PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 111], [5, 6, 7, 8, 9, 10, 11]]
WIDTH, NEW = 3, 6


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    engine = LLM(tiny_model_dir, block_size=4, num_threads=1)
    yield engine
    engine.close()


@torch.inference_mode()
def hf_beams(model_dir: Path, prompt: list[int]) -> list[list[int]]:
    """transformers' beam search, EOS turned off (as ``ignore_eos``), best first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=WIDTH,
        num_return_sequences=WIDTH,
        do_sample=False,
        max_new_tokens=NEW,
        length_penalty=1.0,
        early_stopping=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return [row.tolist() for row in out]


def test_beams_equal_transformers_beam_search(llm: Any, tiny_model_dir: Path) -> None:
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert [b.tokens for b in out.sequences] == hf_beams(tiny_model_dir, prompt)
        for b in out.sequences:
            new = b.tokens[len(prompt) :]
            chosen = sum(lp[t].logprob for lp, t in zip(b.logprobs, new, strict=True))
            assert b.cum_logprob == pytest.approx(chosen)
            assert b.finish_reason == "length"
            assert b.text == llm.tokenizer.decode(b.tokens[len(prompt) :], skip_special_tokens=True)
        scores = [b.cum_logprob for b in out.sequences]
        assert scores == sorted(scores, reverse=True)


def test_beams_share_blocks_through_the_prefix_cache(llm: Any) -> None:
    """Each round's beams are the last round's plus one token: their full blocks hit."""
    assert llm.reset_prefix_cache()
    llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW))
    stats = llm.last_run_stats  # the last round: WIDTH beams of len(prompt) + NEW - 1 tokens
    length = len(PROMPTS[0]) + NEW - 1
    assert stats.num_requests == WIDTH
    assert stats.cached_prompt_tokens == WIDTH * ((length - 1) // 4 * 4)


def test_eos_ends_a_beam_and_the_length_penalty_ranks() -> None:
    short = BeamSearchSequence([1, 2, 3, 0], cum_logprob=-3.0)  # ends with EOS 0
    long = BeamSearchSequence([1, 2, 3, 4, 5], cum_logprob=-4.0)
    assert beam_score(short, (0,), 1.0) == pytest.approx(-1.0)  # the EOS is not counted
    assert beam_score(long, (0,), 1.0) == pytest.approx(-0.8)
    assert beam_score(long, (0,), 0.0) == pytest.approx(-4.0)
    assert beam_score(short, (), 1.0) == pytest.approx(-0.75)  # ignore_eos: a token


@pytest.mark.parametrize(
    ("field", "value"),
    [("beam_width", 0), ("max_tokens", -1), ("beam_width", 1.5), ("temperature", -0.1)],
)
def test_bad_params_are_refused_by_name(llm: Any, field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"beam_width": 2, "max_tokens": 2, field: value}
    with pytest.raises(InvalidRequestError, match=field) as err:
        BeamSearchParams(**kwargs)
    assert err.value.field == field
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS[0], {"beam_width": 2})
