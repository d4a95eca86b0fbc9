"""``bad_words`` (vLLM's name and rule): each word tokenized at admission with and without a
leading space (``engine/request_limits.tokenize_bad_words``), and a word's last token banned
whenever the generated tokens end with its other tokens.

Through the real model (the tiny Qwen3 and its byte-level BPE): a word greedy decoding
produces (one token; two tokens; one that only appears after a space) never appears once
it is banned, and the text before it is unchanged. The engine tests need ``LLMEngine`` to
hand its tokenizer to ``check_request`` and queue the params it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.config import EngineConfig
from paged_engine.engine.inputs import check_request
from paged_engine.engine.request_limits import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    tokenize_bad_words,
)
from paged_engine.errors import InvalidRequestError
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeTokenizer

SMALL: dict[str, Any] = dict(num_kvcache_blocks=64, max_model_len=128, dtype="float32")
PROMPTS = ["The cat", "Once upon a time", "hello world", "the the the"]
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **SMALL)


def _plain(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _contains(tokens: Sequence[int], word: Sequence[int]) -> bool:
    k = len(word)
    return any(list(tokens[i : i + k]) == list(word) for i in range(len(tokens) - k + 1))


def _greedy(llm: LLM, prompt: str, **kw: Any) -> list[int]:
    out = llm.generate(prompt, SamplingParams(**GREEDY, **kw), use_tqdm=False)
    return out[0].outputs[0].token_ids


# ------------------------------------------------------------------------- tokenization


class BosTokenizer(FakeTokenizer):
    """Ids as text (``"<3><1>"``), spaces ignored; a BOS (4) first unless asked not to."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = super().encode(text.replace(" ", ""))
        return [4, *ids] if add_special_tokens else ids


class SpacedTokenizer(FakeTokenizer):
    """``" <3>"`` is token 3 + 1: a word after a space has a token of its own."""

    def encode(self, text: str) -> list[int]:
        ids = super().encode(text.lstrip())
        return [ids[0] + 1, *ids[1:]] if text.startswith(" ") else ids


def test_words_are_tokenized_with_and_without_a_space_and_no_special_tokens() -> None:
    assert tokenize_bad_words(["<1><2>", "  <3>"], BosTokenizer()) == ((1, 2), (3,))
    words = tokenize_bad_words(["<1><2>", "  <3>", "<1><2>"], SpacedTokenizer())
    assert words == ((1, 2), (2, 2), (3,), (4,))


def test_the_tiny_tokenizers_words_match_its_own_encoding(llm: LLM) -> None:
    tok = llm.tokenizer
    words = ["hello", " world", "ket"]
    want: list[tuple[int, ...]] = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(_plain(tok, text))
            if ids not in want:
                want.append(ids)
    assert list(tokenize_bad_words(words, tok)) == want
    assert len(want) == 6  # every word has a spaced form of its own here


def test_check_request_returns_the_params_with_their_words_tokenized() -> None:
    cfg = EngineConfig(max_model_len=40, kvcache_block_size=4, num_kvcache_blocks=16)
    params = SamplingParams(bad_words=["<1><2>"], bad_words_token_ids=[[3]])
    out = check_request([1], params, cfg, 16, "w", has_tokenizer=True, tokenizer=SpacedTokenizer())
    assert out.bad_words_token_ids == ((1, 2), (2, 2))  # recomputed, not the caller's
    assert params.bad_words_token_ids == ((3,),)  # the caller's params are unchanged
    stale = SamplingParams(bad_words_token_ids=[[3]])
    assert check_request([1], stale, cfg, 16, "w", has_tokenizer=False).bad_words_token_ids is None
    with pytest.raises(InvalidRequestError, match="bad_words names token 7, outside") as refused:
        check_request(
            [1],
            SamplingParams(bad_words=["<6>"]),
            cfg,
            16,
            "w",
            has_tokenizer=True,
            vocab_size=7,
            tokenizer=SpacedTokenizer(),
        )
    assert refused.value.field == "bad_words"


# ------------------------------------------------------------------------ through LLMEngine


def test_the_engine_refuses_words_outside_the_vocabulary_and_queues_nothing() -> None:
    cfg = EngineConfig(max_model_len=40, kvcache_block_size=4, num_kvcache_blocks=16)
    engine = build_engine(cfg, spec=False, tokenizer=SpacedTokenizer())
    with pytest.raises(InvalidRequestError, match=f"names token {VOCAB}, outside") as refused:
        engine.add_request("bad", [1, 2], SamplingParams(bad_words=[f"<{VOCAB - 1}>"]))
    assert refused.value.field == "bad_words"  # " <4>" is token 5
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 16


def test_a_banned_one_token_word_never_appears(llm: LLM) -> None:
    tok = llm.tokenizer
    for prompt in PROMPTS:
        plain = _greedy(llm, prompt)
        # the most repeated output token that is a word of its own
        for t in sorted(set(plain), key=plain.count, reverse=True):
            word = tok.decode([t])
            if word.strip() and word == word.lstrip() and _plain(tok, word) == [t]:
                break
        else:
            continue
        banned = _greedy(llm, prompt, bad_words=[word])
        assert t not in banned, (prompt, word)
        assert not _contains(banned, _plain(tok, " " + word))
        first = plain.index(t)
        assert banned[:first] == plain[:first]  # the same text up to the word
        return
    pytest.fail("no greedy output holds a one-token word")


def test_a_banned_two_token_word_never_appears_but_its_first_token_may(llm: LLM) -> None:
    tok = llm.tokenizer
    for prompt in PROMPTS:
        plain = _greedy(llm, prompt)
        for i in range(len(plain) - 1):
            pair = plain[i : i + 2]
            word = tok.decode(pair)
            if word.strip() and word == word.lstrip() and _plain(tok, word) == pair:
                break
        else:
            continue
        banned = _greedy(llm, prompt, bad_words=[word])
        assert not _contains(banned, pair), (prompt, word)
        assert banned[: i + 1] == plain[: i + 1]  # its first token is still generated
        assert banned[i + 1] != pair[1]
        return
    pytest.fail("no greedy output holds a two-token word")


def test_a_word_generated_after_a_space_is_banned_by_its_bare_spelling(llm: LLM) -> None:
    tok = llm.tokenizer
    for prompt in PROMPTS:
        plain = _greedy(llm, prompt)
        for t in plain:
            text = tok.decode([t])
            bare = text[1:]
            if text.startswith(" ") and bare.strip() and _plain(tok, text) == [t]:
                break
        else:
            continue
        assert _plain(tok, bare) != [t]  # the bare spelling alone would not ban it
        banned = _greedy(llm, prompt, bad_words=[bare])
        assert t not in banned, (prompt, bare)
        return
    pytest.fail("no greedy output holds a word after a space")


def test_a_banned_word_holds_for_every_completion_of_a_sampled_request(llm: LLM) -> None:
    tok = llm.tokenizer
    base = dict(temperature=1.0, seed=5, n=3, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, SamplingParams(**base), use_tqdm=False)
    drawn = [t for o in outs for c in o.outputs for t in c.token_ids]
    t, word = next(
        (t, w)
        for t in sorted(set(drawn), key=drawn.count, reverse=True)
        if (w := tok.decode([t])).strip() and (t,) in tokenize_bad_words([w], tok)
    )
    assert drawn.count(t) >= 3
    again = llm.generate(PROMPTS, SamplingParams(**base, bad_words=[word]), use_tqdm=False)
    assert all(t not in c.token_ids for o in again for c in o.outputs)
    assert sum(len(c.token_ids) for o in again for c in o.outputs) == len(drawn)


class OneToken:
    """Every text is token 1."""

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "w"


def test_bad_words_at_their_bounds_are_accepted() -> None:
    cfg = EngineConfig(max_model_len=40, kvcache_block_size=4, num_kvcache_blocks=16)
    words = [f"{i:03d}" + "w" * (MAX_BAD_WORD_CHARS - 3) for i in range(MAX_BAD_WORDS)]
    out = check_request(
        [1], SamplingParams(bad_words=words), cfg, 16, "w", has_tokenizer=True, tokenizer=OneToken()
    )
    assert out.bad_words_token_ids == ((1,),)  # every word and spelling is token 1
