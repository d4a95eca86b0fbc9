"""Structured outputs offline, on the tiny random model: every output matches its constraint
(checked by jsonschema, ``re`` and by hand, never by the grammar library under test), greedy
decoding is the argmax of transformers' logits over the tokens a brute-force prefix check
allows, a sampler that skips one row's mask is caught, and bad constraints are refused by
name with the engine unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from paged_engine import (  # noqa: E402
    LLM,
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from paged_engine.engine.sequence import Sequence  # noqa: E402
from paged_engine.errors import InvalidRequestError  # noqa: E402
from paged_engine.layers import sampler as sampler_module  # noqa: E402
from paged_engine.layers.grammar_mask import apply_token_bitmask, unpack_bitmask  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The quick brown fox", "Call me Ishmael.", "In the beginning", "It was the best"]
EMAIL = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
COLOURS = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, max_model_len=256, num_kvcache_blocks=256, block_size=8)


def check_json(out: Any, schema: dict[str, Any]) -> None:
    """Every completion finished by the model (not cut) and is a document of ``schema``."""
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        try:
            doc = json.loads(c.text)
            jsonschema.validate(doc, schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{c.text!r}: {e}") from None
        assert set(doc) == {"name", "age", "pet", "ok"} and isinstance(doc["age"], int)


def json_params(**kw: Any) -> SamplingParams:
    kw = {"max_tokens": 80, "seed": 0, **kw}
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_is_a_document_of_its_schema(llm: LLM, temperature: float) -> None:
    n = 1 if temperature == 0 else 3
    outs = llm.generate(PROMPTS, json_params(temperature=temperature, n=n), use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == n
        check_json(out, SCHEMA)
    # only finished, terminated matchers were dropped: none is left behind
    assert len(llm.llm_engine.model_runner.grammars) == 0


def test_a_schema_as_text_and_the_older_spelling_give_the_same_tokens(llm: LLM) -> None:
    a = llm.generate(PROMPTS[:2], json_params(temperature=0.0), use_tqdm=False)
    text = GuidedDecodingParams(json=json.dumps(SCHEMA))
    p = SamplingParams(temperature=0.0, max_tokens=80, guided_decoding=text)
    assert p.structured_outputs == text and p.guided_decoding is p.structured_outputs
    b = llm.generate(PROMPTS[:2], p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_regex_and_choice_outputs_match(llm: LLM) -> None:
    regex = SamplingParams(
        temperature=1.0, n=4, seed=3, max_tokens=40, structured_outputs={"regex": EMAIL}
    )
    choice = SamplingParams(
        temperature=1.0, n=4, seed=3, max_tokens=10, structured_outputs={"choice": COLOURS}
    )
    for out in llm.generate(PROMPTS, regex, use_tqdm=False):
        for c in out.outputs:
            assert c.finish_reason == "stop" and re.fullmatch(EMAIL, c.text), c.text
    seen = set()
    for out in llm.generate(PROMPTS, choice, use_tqdm=False):
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.text in COLOURS, c.text
            seen.add(c.text)
    assert len(seen) > 1  # sampled, not forced to one answer


def test_greedy_is_the_argmax_over_the_allowed_tokens(llm: LLM, tiny_model_dir: Path) -> None:
    """Each greedy token, recomputed with transformers' logits: the best token whose text
    extends the output to a prefix of a choice (or eos, once it is a whole choice)."""
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    choices = ["brown fox", "lazy dog", "journey"]
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": choices})
    for prompt in PROMPTS:
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ids = list(tok.encode(prompt))
        out: list[int] = []
        for t in got.token_ids:
            with torch.no_grad():
                logits = model(torch.tensor([ids + out])).logits[0, -1]
            text = tok.decode(out)
            allowed = [
                v
                for v in range(logits.shape[0])
                if (text in choices and v == tok.eos_token_id)
                or (
                    v not in tok.all_special_ids
                    and any(c.startswith(tok.decode([*out, v])) for c in choices)
                    and len(tok.decode([*out, v])) > len(text)
                )
            ]
            best = max(allowed, key=lambda v: float(logits[v]))
            assert t == best, (prompt, text, t, best)
            out.append(t)
        assert got.text in choices and got.finish_reason == "stop"


def test_a_sampler_that_skips_one_rows_mask_is_caught(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def skips_first_row(logits: torch.Tensor, bitmask: torch.Tensor, rows: Any) -> torch.Tensor:
        return apply_token_bitmask(logits[:], bitmask[1:], list(rows)[1:])

    monkeypatch.setattr(sampler_module, "apply_token_bitmask", skips_first_row)
    outs = llm.generate(PROMPTS, json_params(temperature=1.0), use_tqdm=False)
    with pytest.raises(AssertionError):
        for out in outs:
            check_json(out, SCHEMA)


def test_the_mask_sets_minus_inf_only_in_its_rows_and_pads() -> None:
    logits = torch.arange(3 * 70, dtype=torch.float32).reshape(3, 70)
    bitmask = torch.zeros((1, 2), dtype=torch.int32)  # 64 bits for a 70-wide row
    bitmask[0, 0] = 1 | (1 << 5)
    bitmask[0, 1] = -(2**31)  # token 63: the sign bit of an int32 word
    out = apply_token_bitmask(logits, bitmask, [1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    kept = [v for v in range(70) if out[1, v] > float("-inf")]
    assert kept == [0, 5, 63] and out[1, 5] == logits[1, 5]
    assert unpack_bitmask(bitmask, 3).tolist() == [[True, False, False]]


def test_a_matcher_follows_the_sequence_when_the_engine_drops_a_token(llm: LLM) -> None:
    """A failed step (the token sampled, then dropped) or a recompute: the next mask is the
    one the sequence's own tokens call for."""
    grammars = llm.llm_engine.model_runner.grammars
    p = SamplingParams(structured_outputs={"choice": COLOURS})
    seq = Sequence([5, 6, 7], p, block_size=8)
    first, _ = grammars.masks([seq])
    assert first is not None
    allowed = unpack_bitmask(first[0], 768)[0].nonzero().flatten().tolist()
    tok = llm.get_tokenizer()
    t = next(v for v in allowed if tok.decode([v]) in ("r", "re", "red", "g", "b", "bl"))
    grammars.advance([seq], [t])  # and the engine never appends it
    again, _ = grammars.masks([seq])
    assert again is not None and torch.equal(again[0], first[0])
    seq.append_token(t)
    grammars.advance([seq], [None])
    after, _ = grammars.masks([seq])
    assert after is not None and not torch.equal(after[0], first[0])


BAD = [
    ({"json": {"type": "foo"}}, "json"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "[a-z"}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json_object": False}, "exactly one"),
]


@pytest.mark.parametrize(("spec", "named"), BAD)
def test_bad_constraints_are_refused_by_name(spec: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(named)) as e:
        StructuredOutputsParams(**spec)
    assert e.value.field == "structured_outputs"


def test_a_bad_constraint_set_after_construction_is_refused_at_add(llm: LLM) -> None:
    engine = llm.llm_engine
    free = (
        engine.block_manager.num_free_blocks
        if hasattr(engine.block_manager, "num_free_blocks")
        else None
    )
    p = SamplingParams(max_tokens=4)
    p.structured_outputs = {"regex": "(unclosed"}  # type: ignore[assignment]
    with pytest.raises(ValueError, match="regex") as e:
        engine.add_request("bad", "hello", p)
    assert getattr(e.value, "field", None) == "structured_outputs"
    assert not engine.has_unfinished_requests()
    if free is not None:
        assert engine.block_manager.num_free_blocks == free
    with pytest.raises(InvalidRequestError, match="guided_decoding"):
        SamplingParams(
            structured_outputs={"regex": "a"}, guided_decoding=GuidedDecodingParams(regex="b")
        )


def test_rows_without_a_grammar_are_untouched(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(
        PROMPTS, [plain, json_params(temperature=0.0), plain, json_params()], use_tqdm=False
    )
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    check_json(mixed[1], SCHEMA)
    check_json(mixed[3], SCHEMA)


def test_an_unused_matcher_is_dropped_and_rebuilt_on_return(llm: LLM) -> None:
    """An aborted or waiting sequence's matcher goes after ``STALE_STEPS`` steps without
    it; if the sequence comes back, its matcher is replayed from its tokens."""
    from paged_engine.worker.grammar import STALE_STEPS

    grammars = llm.llm_engine.model_runner.grammars
    seq = Sequence([5, 6, 7], SamplingParams(structured_outputs={"choice": COLOURS}), block_size=8)
    first, _ = grammars.masks([seq])
    before = len(grammars)
    assert first is not None and before >= 1
    for _ in range(STALE_STEPS + 16):
        grammars.masks([])
    assert len(grammars) == 0  # every matcher here was unused as long
    again, _ = grammars.masks([seq])
    assert again is not None and torch.equal(again[0], first[0])


def test_ignore_eos_past_the_grammars_end_repeats_only_eos(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    p = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=12,
        ignore_eos=True,
        structured_outputs={"choice": COLOURS},
    )
    for out in llm.generate(PROMPTS, p, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.text in COLOURS, (c.text, c.finish_reason)
        end = c.token_ids.index(eos)
        assert set(c.token_ids[end:]) == {eos} and len(c.token_ids) == 12


def test_unpacking_agrees_with_python_ints_bit_by_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 7), dtype=torch.int32, generator=gen)
    got = unpack_bitmask(bitmask, 7 * 32 + 3)  # 3 tokens past the mask: never allowed
    for r in range(5):
        for t in range(7 * 32 + 3):
            expect = t < 7 * 32 and (int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1
            assert bool(got[r, t]) == expect, (r, t)
