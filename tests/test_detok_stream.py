"""Streamed text is one decode's text, for every tokenizer of the tests (issue 28, defect 7).

The incremental detokenizer (engine/detokenizer.py) must end where one ``decode`` of the
completion ends, and never show text that decode would not: for byte-level BPE (a
character split over tokens), for a decoder that joins tokens with spaces (a ``tokenizers``
model without a decoder: ``' Ġ27'`` once came out where one decode gives ``'Ġ27'``), for
WordPiece's ``##`` pieces, for SentencePiece's ``▁`` (the first word's space dropped), and
for the fake tokenizer; through DecodeStream (a transformers fast tokenizer) and through
the Python rule (any ``decode``). And ``generate`` gives the same text with a stop string
that never matches (the incremental path) as without (one decode at the end).

Not here: tests/kills/test_output_kills.py's ``ByteTokenizer`` and ``ContextTokenizer``,
whose decoders rewrite text already decoded once later tokens follow (on purpose, to reach
the best-effort path): no stream that never takes text back can equal their decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from paged_engine.config import EngineConfig
from paged_engine.engine.detokenizer import StreamingDetokenizer, make_detokenizer, stream_backend
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.sampling_params import SamplingParams
from tests.fake_model import FakeModelRunner, FakeTokenizer

WORDS = ["Ġ27", "Ġ12", "hello", "world", "##s", "##ing", "▁the", "▁cat", "sat", "▁", ".", ","]


def _fast(model: Any, decoder: Any, special: Sequence[str] = ("<eos>",)) -> Any:
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if decoder is not None:
        tok.decoder = decoder
    tok.add_special_tokens(list(special))
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, clean_up_tokenization_spaces=False
    )


def _words(decoder: Any) -> Any:
    from tokenizers import models

    vocab = {w: i for i, w in enumerate(WORDS)}
    return _fast(models.WordLevel(vocab, unk_token="hello"), decoder)


@cache
def tokenizer(name: str) -> Any:
    """Every tokenizer of the tests that decodes text once and for all."""
    from tokenizers import decoders

    if name == "fake":
        return FakeTokenizer()
    if name == "byte-level-bpe":  # the tiny model's
        from paged_engine.utils.tiny_model import train_tokenizer

        return train_tokenizer()
    if name == "space-joined":  # no decoder: tokenizers joins the pieces with spaces
        return _words(None)
    if name == "wordpiece":
        return _words(decoders.WordPiece())
    if name == "metaspace":
        return _words(decoders.Metaspace())
    raise KeyError(name)


NAMES = ["fake", "byte-level-bpe", "space-joined", "wordpiece", "metaspace"]


def vocab_size(tok: Any) -> int:
    return 40 if isinstance(tok, FakeTokenizer) else len(tok)


class ByDecode:
    """A tokenizer seen through its ``decode`` alone (the detokenizer's Python rule)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        text: str = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def stream(tok: Any, ids: list[int], steps: list[int], skip: bool, fast: bool) -> list[str]:
    """The text after each step of ``steps`` tokens (the last step takes the rest), then
    after the flush."""
    backend = stream_backend(tok) if fast else None
    detok = make_detokenizer(backend, skip)
    assert isinstance(detok, StreamingDetokenizer) == fast
    user = tok if fast else ByDecode(tok)
    texts, at = [], 0
    for n in [*steps, len(ids)]:
        detok.add(user, ids[at : at + n])
        at = min(len(ids), at + n)
        texts.append(detok.text)
        assert detok.num_tokens == at
    detok.flush(user)
    texts.append(detok.text)
    return texts


def check_stream(tok: Any, ids: list[int], steps: list[int], skip: bool, fast: bool) -> None:
    texts = stream(tok, ids, steps, skip, fast)
    at = 0
    for n, text in zip([*steps, len(ids)], texts, strict=False):
        at = min(len(ids), at + n)
        so_far = tok.decode(ids[:at], skip_special_tokens=skip)
        assert so_far.startswith(text), (ids[:at], text, so_far)  # nothing decode lacks
    assert texts[-1] == tok.decode(ids, skip_special_tokens=skip), (ids, texts)


def test_every_tokenizer_here_streams_through_the_rule_expected() -> None:
    assert stream_backend(tokenizer("fake")) is None
    for name in NAMES[1:]:
        assert stream_backend(tokenizer(name)) is not None, name
    # transformers edits the backend's text when it cleans up spaces: the Python rule
    cleaning = _words(None)
    cleaning.clean_up_tokenization_spaces = True
    assert stream_backend(cleaning) is None
    assert stream_backend(ByDecode(tokenizer("wordpiece"))) is None


RULES = [
    pytest.param(name, fast, id=f"{name}-{'decodestream' if fast else 'python'}")
    for name in NAMES
    for fast in (False, True)
    if not (fast and name == "fake")  # no backend (stream_backend says so above)
]


@pytest.mark.parametrize(("name", "fast"), RULES)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_streamed_text_is_one_decodes_text(
    name: str, fast: bool, data: st.DataObject, skip: bool
) -> None:
    tok = tokenizer(name)
    ids = data.draw(st.lists(st.integers(0, vocab_size(tok) - 1), max_size=24), label="ids")
    steps = data.draw(st.lists(st.integers(0, 3), max_size=len(ids)), label="steps")
    check_stream(tok, ids, steps, skip, fast)


@example(ids=[1, 0], steps=[1])  # "Ġ12 Ġ27": once " Ġ27" after the prompt
@example(ids=[2, 4, 3], steps=[1, 1])
@given(ids=st.lists(st.integers(0, len(WORDS) - 1), max_size=8), steps=st.just([1] * 8))
@settings(max_examples=30, deadline=None)
def test_a_space_joining_decoder_streams_without_a_leading_space(
    ids: list[int], steps: list[int]
) -> None:
    for fast in (False, True):
        check_stream(tokenizer("space-joined"), ids, steps[: len(ids)], skip=True, fast=fast)


def test_the_python_rule_takes_over_when_the_stream_refuses_a_token() -> None:
    """A decoder that changes earlier text makes DecodeStream raise: the completion goes on
    with the Python rule's best effort, from the same window."""

    class Refusing:
        def step(self, backend: Any, t: int) -> str:
            raise RuntimeError("InvalidPrefix")

    tok = tokenizer("wordpiece")
    detok = make_detokenizer(stream_backend(tok), True)
    assert isinstance(detok, StreamingDetokenizer)
    detok.add(tok, [2])
    detok._stream = Refusing()
    detok.add(tok, [4, 3])
    assert detok._stream is None
    assert detok.text == tok.decode([2, 4, 3]) == "hellos world"


# ---- through the engine: stop strings or not, the same text ----------------------------------


class Scripted(FakeModelRunner):
    """The fake model, sampling ``script`` (by prompt) instead of its own tokens."""

    def __init__(self, vocab: int, script: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(64, 4, vocab)
        self.script = script

    def run(self, seqs: list[Any], is_prefill: bool) -> list[Any]:
        ends = [s.num_cached_tokens + s.num_scheduled_tokens for s in seqs]
        super().run(seqs, is_prefill)
        out: list[Any] = []
        for seq, end in zip(seqs, ends, strict=True):
            script = self.script[tuple(seq.prompt_token_ids)]
            out.append(script[seq.num_completion_tokens] if end == seq.num_tokens else None)
        return out


def _engine(tok: Any, script: dict[tuple[int, ...], list[int]]) -> LLMEngine:
    config = EngineConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=64,
        kvcache_block_size=4,
        num_kvcache_blocks=64,
    )
    vocab = vocab_size(tok)
    return LLMEngine(Scripted(vocab, script), config, vocab_size=vocab, tokenizer=tok)


def texts_with_and_without_stop(
    tok: Any, prompt: list[int], completion: list[int], stop: str
) -> tuple[str, str, str]:
    """The completion's text from ``generate`` without a stop string (one decode), with
    one that never matches (streamed), and through ``step()``."""
    engine = _engine(tok, {tuple(prompt): completion})
    params = SamplingParams(temperature=0, max_tokens=len(completion), ignore_eos=True)
    ids = {"prompt_token_ids": prompt}
    (plain,) = engine.generate(ids, params, use_tqdm=False)
    never = SamplingParams(**{**_fields(params), "stop": [stop]})
    (stopped,) = engine.generate(ids, never, use_tqdm=False)
    engine.add_request("s", ids, params)
    outs: list[Any] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return plain.outputs[0].text, stopped.outputs[0].text, outs[-1].outputs[0].text


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in ("temperature", "max_tokens", "ignore_eos")}


def test_the_issues_example_gives_one_text_with_a_stop_string_or_without() -> None:
    tok = tokenizer("space-joined")
    plain, stopped, streamed = texts_with_and_without_stop(tok, [1, 2], [0], "\x00")
    assert plain == "Ġ27" and stopped == plain and streamed == plain


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_generate_gives_one_text_with_a_stop_string_or_without(
    name: str, data: st.DataObject
) -> None:
    tok = tokenizer(name)
    ids = st.integers(0, vocab_size(tok) - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=6), label="prompt")
    completion = data.draw(st.lists(ids, min_size=1, max_size=12), label="completion")
    # The stop string must not occur: a byte-level vocabulary has a token for "\x00".
    assume("\x00" not in tok.decode(completion, skip_special_tokens=True))
    plain, stopped, streamed = texts_with_and_without_stop(tok, prompt, completion, "\x00")
    assert plain == tok.decode(completion, skip_special_tokens=True)
    assert stopped == plain and streamed == plain


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_stop_string_cuts_one_decodes_text(name: str, data: st.DataObject) -> None:
    """A stop string taken from the completion's own text: the output is that text up to
    its first occurrence."""
    tok = tokenizer(name)
    ids = st.integers(0, vocab_size(tok) - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=6), label="prompt")
    completion = data.draw(st.lists(ids, min_size=1, max_size=12), label="completion")
    whole = tok.decode(completion, skip_special_tokens=True)
    if "\ufffd" in whole or len(whole) < 2:
        return  # a stop string must be text the stream shows as it is
    start = data.draw(st.integers(0, len(whole) - 2), label="start")
    stop = whole[start : start + 2]
    engine = _engine(tok, {tuple(prompt): completion})
    params = SamplingParams(temperature=0, max_tokens=len(completion), ignore_eos=True)
    params = SamplingParams(**{**_fields(params), "stop": [stop]})
    (out,) = engine.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out.outputs[0].text == whole[: whole.index(stop)]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
