"""Token ids against the real model (the tiny Qwen3): a ``logit_bias`` beyond the vocabulary
is refused at admission (it used to pass validation and fail inside the batch's step),
``allowed_token_ids`` really restricts sampling (seeded draws over many tokens, and greedy
decoding against transformers' logits restricted by hand), and the allowed-token and
bad-word processors against rules computed by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.errors import InvalidRequestError
from paged_engine.layers.logits_processors import apply_logits_processors, processes
from paged_engine.layers.sampler import Sampler
from tests.hf_oracle import TIE_MARGIN, HFOracle

SMALL: dict[str, Any] = dict(num_kvcache_blocks=64, max_model_len=128, dtype="float32")
PROMPTS = [[5, 6, 7], [9, 9, 2, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
ALLOWED = (40, 77, 130, 131, 250, 301, 302, 415, 500, 640)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **SMALL)


def _vocab(llm: LLM) -> int:
    return int(llm.model_runner.hf_config.vocab_size)


def _idle(llm: LLM) -> bool:
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks == engine.num_blocks
    return free and not engine.has_unfinished_requests() and engine.scheduler.is_finished()


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw})


# ------------------------------------------------------------------ logit_bias at admission


@pytest.mark.parametrize("offset", [0, 1, 10**6])
def test_a_bias_beyond_the_vocabulary_is_refused_at_admission(llm: LLM, offset: int) -> None:
    vocab = _vocab(llm)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(), use_tqdm=False)]
    params = [_greedy(), _greedy(logit_bias={vocab + offset: 1.0}), _greedy()]
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert refused.value.field == "logit_bias" and refused.value.where == "prompt 1"
    assert f"names token {vocab + offset}, outside the vocabulary [0, {vocab})" in str(
        refused.value
    )
    assert _idle(llm)  # nothing was queued, no block taken
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(), use_tqdm=False)]
    assert got == want
    # the last id of the vocabulary is a token like any other
    edge = llm.generate(PROMPTS[0], _greedy(logit_bias={vocab - 1: 100.0}), use_tqdm=False)
    assert edge[0].outputs[0].token_ids == [vocab - 1] * 12


@pytest.mark.parametrize("field", ["allowed_token_ids", "stop_token_ids"])
def test_other_ids_beyond_the_vocabulary_are_refused_at_admission(llm: LLM, field: str) -> None:
    vocab = _vocab(llm)
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(PROMPTS[0], _greedy(**{field: [3, vocab]}), use_tqdm=False)
    assert refused.value.field == field
    assert _idle(llm)


# ------------------------------------------------------------------------ allowed_token_ids


def test_seeded_sampling_draws_only_allowed_tokens(llm: LLM) -> None:
    base = dict(temperature=1.3, max_tokens=40, ignore_eos=True, n=3)
    variants: list[dict[str, Any]] = [
        {"seed": 1},
        {"seed": 2, "top_k": 4},
        {"seed": 3, "top_p": 0.9, "presence_penalty": 1.0},
        {"seed": 4, "logit_bias": {0: 100.0}},  # a forced token that is not allowed
    ]
    free = [
        t
        for o in llm.generate(PROMPTS, SamplingParams(**base, seed=1), use_tqdm=False)
        for c in o.outputs
        for t in c.token_ids
    ]
    assert len([t for t in free if t not in ALLOWED]) > len(free) // 2  # the restriction bites
    for extra in variants:
        params = SamplingParams(**base, **extra, allowed_token_ids=ALLOWED)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        drawn = [t for o in outs for c in o.outputs for t in c.token_ids]
        assert len(drawn) == 3 * 3 * 40
        assert set(drawn) <= set(ALLOWED), extra
        assert len(set(drawn)) >= 3, extra  # sampled, not stuck on one token


def test_greedy_picks_the_best_allowed_token_by_transformers_logits(
    llm: LLM, tiny_model_dir: Path
) -> None:
    oracle = HFOracle(tiny_model_dir)
    allowed = torch.tensor(ALLOWED)
    for prompt in PROMPTS:
        plain = llm.generate(prompt, _greedy(), use_tqdm=False)[0].outputs[0].token_ids
        out = llm.generate(prompt, _greedy(allowed_token_ids=ALLOWED), use_tqdm=False)
        ours = out[0].outputs[0].token_ids
        assert plain != ours  # the unrestricted argmax is not allowed somewhere
        for i, token in enumerate(ours):
            with torch.inference_mode():
                ids = torch.tensor([prompt + ours[:i]])
                row = oracle.model(input_ids=ids, use_cache=False).logits[0, -1].float()
            top2 = row[allowed].topk(2)
            if float(top2.values[0] - top2.values[1]) < TIE_MARGIN:
                break  # a tie among the allowed tokens: later positions follow either
            assert token == ALLOWED[int(top2.indices[0])], (prompt, i)


# ----------------------------------------------------------------- the processors by hand


class History:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.token_ids = [*prompt, *output]
        self.num_prompt_tokens = len(prompt)


def test_allowed_token_ids_mask_every_other_token_before_the_bias() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    params = [
        SamplingParams(allowed_token_ids=[2, 0], logit_bias={3: 50.0, 0: 1.5}),
        SamplingParams(logit_bias={1: 1.0}),
    ]
    out = apply_logits_processors(logits.clone(), params, [None, None])
    inf = float("-inf")
    assert out.tolist() == [[2.5, inf, 3.0, inf], [1.0, 3.0, 3.0, 4.0]]
    assert processes(SamplingParams(allowed_token_ids=[1]), None)


BAD_CASES = [
    # (words, prompt, output, the ids banned)
    (((7,),), [1], [], {7}),  # a one-token word: always
    (((3, 4),), [1], [2, 3], {4}),  # the output ends with the word's first token
    (((3, 4),), [1], [3, 2], set()),
    (((3, 4),), [1, 3], [], set()),  # the prompt's tokens are not generated ones
    (((2, 3, 4),), [2], [3], set()),  # the word is longer than the output allows
    (((2, 3, 4),), [9], [5, 2, 3], {4}),
    (((2, 3, 4), (3, 5), (6,)), [9], [2, 3], {4, 5, 6}),
    (((3, 3),), [], [3], {3}),
]


@pytest.mark.parametrize(("words", "prompt", "output", "banned"), BAD_CASES)
def test_bad_words_ban_a_last_token_after_the_rest_of_the_word(
    words: tuple[tuple[int, ...], ...], prompt: list[int], output: list[int], banned: set[int]
) -> None:
    logits = torch.arange(10, dtype=torch.float32)[None, :].repeat(2, 1)
    params = [SamplingParams(bad_words=["w"], bad_words_token_ids=words), SamplingParams()]
    hist = History(prompt or [0], output)
    out = apply_logits_processors(logits.clone(), params, [hist, hist])
    assert {t for t in range(10) if out[0, t] == float("-inf")} == banned
    assert out[1].tolist() == logits[1].tolist()  # its neighbour untouched


def test_bad_words_that_were_never_tokenized_are_refused_by_row() -> None:
    logits = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="row 0: its bad_words were never tokenized"):
        apply_logits_processors(logits, [SamplingParams(bad_words=["w"])], [History([1], [])])
    assert logits.tolist() == [[0.0] * 4]


def test_a_one_token_bad_word_needs_no_history_and_a_longer_one_does() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0]])
    one = SamplingParams(temperature=0, bad_words=["w"], bad_words_token_ids=[[1]])
    assert processes(one, None)
    assert Sampler()(logits, [one], [None]) == [2]  # the argmax, 1, is banned
    two = SamplingParams(temperature=0, bad_words=["w"], bad_words_token_ids=[[2, 1]])
    with pytest.raises(ValueError, match="row 0 uses penalties, min_tokens or bad_words"):
        apply_logits_processors(logits.clone(), [two], [None])
    assert Sampler()(logits, [two], [None], [History([0], [2])]) == [2]
    assert Sampler()(logits, [two], [None], [History([0], [0])]) == [1]
