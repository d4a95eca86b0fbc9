"""``LLM.beam_search`` (vLLM's): the beams equal transformers' ``num_beams`` greedy beam
search on the tiny model, best first; the beams share blocks through the prefix cache;
EOS and the length penalty rank as vLLM ranks; bad params are refused by name; the text
is the whole beam decoded with ``skip_special_tokens``; the logprobs carry decoded tokens;
a beam that reaches ``max_model_len`` ends there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, BeamSearchParams, SamplingParams
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
            assert b.text == llm.tokenizer.decode(b.tokens, skip_special_tokens=True)
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


def test_text_is_the_whole_beam_decoded_with_skip_special_tokens(llm: Any) -> None:
    """As vLLM's ``LLM.beam_search``: prompt and completion decoded together, special
    tokens (here the prompt's BOS) dropped or kept as ``skip_special_tokens`` says."""
    prompt = [llm.tokenizer.bos_token_id, *PROMPTS[1]]
    for skip in (True, False):
        params = BeamSearchParams(beam_width=2, max_tokens=3, skip_special_tokens=skip)
        (out,) = llm.beam_search([prompt], params)
        for b in out.sequences:
            assert b.text == llm.tokenizer.decode(b.tokens, skip_special_tokens=skip)
            assert (llm.tokenizer.bos_token in b.text) is not skip
    assert BeamSearchParams(beam_width=1, max_tokens=1).skip_special_tokens  # vLLM's default


def test_logprobs_carry_decoded_tokens(llm: Any) -> None:
    """Every position's tokens decoded, as ``generate`` decodes its logprobs."""
    (out,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=WIDTH, max_tokens=3))
    (first,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, logprobs=2 * WIDTH))
    generated = first.outputs[0].logprobs[0]
    for b in out.sequences:
        assert len(b.logprobs) == 3
        for top in b.logprobs:
            assert all(lp.decoded_token == llm.tokenizer.decode([t]) for t, lp in top.items())
        assert {t: lp.decoded_token for t, lp in b.logprobs[0].items()} == {
            t: lp.decoded_token for t, lp in generated.items()
        }


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_candidates_are_the_step_logprobs(llm: Any, temperature: float) -> None:
    """Pinned (vLLM's step reports the same): a position's candidates are the top
    ``2 * beam_width`` logprobs and, above temperature 0, the sampled token if outside."""
    params = BeamSearchParams(beam_width=2, max_tokens=4, temperature=temperature)
    (out,) = llm.beam_search([PROMPTS[0]], params)
    for b in out.sequences:
        for top, token in zip(b.logprobs, b.tokens[len(PROMPTS[0]) :], strict=True):
            assert token in top
            assert len(top) == 4 if temperature == 0 else len(top) in (4, 5)


def test_a_beam_that_reaches_max_model_len_ends_there(tiny_model_dir: Path, llm: Any) -> None:
    """A prompt 3 tokens short of ``max_model_len`` and ``max_tokens`` 6: the beams end
    cleanly at ``max_model_len`` ('length'), the beams an uncapped engine finds in 3."""
    prompt = list(range(100, 113))
    capped = LLM(tiny_model_dir, block_size=4, num_threads=1, max_model_len=16)
    try:
        (out,) = capped.beam_search([prompt], BeamSearchParams(beam_width=WIDTH, max_tokens=6))
        assert not capped.llm_engine.has_unfinished_requests()
    finally:
        capped.close()
    (free,) = llm.beam_search([prompt], BeamSearchParams(beam_width=WIDTH, max_tokens=3))
    assert [b.tokens for b in out.sequences] == [b.tokens for b in free.sequences]
    assert all(len(b.tokens) == 16 and b.finish_reason == "length" for b in out.sequences)
