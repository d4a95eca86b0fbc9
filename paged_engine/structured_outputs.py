"""What a request's output must match (vLLM's ``StructuredOutputsParams``), checked when the
request is built, so that a bad schema, regex or grammar is refused at ``add_request`` by
name and never reaches a step.

Why the check builds the grammar itself: the only authority on whether a JSON schema or a
regex can constrain decoding is the grammar library that will run it (xgrammar, vLLM's
default, chosen by ``bench/test_grammar_bench.py``). Building a grammar needs no tokenizer
and takes well under a millisecond; the result is cached by ``key`` so the copies the
engine makes of the params (``SamplingParams.clone``) cost a dictionary lookup. Compiling
it against the vocabulary (the costly part) is the runner's (``worker/grammar.py``).

xgrammar imports torch, so it is imported on the first structured request, never by
importing this module (``paged_engine`` and ``engine/`` stay torch-free).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The kinds of constraint, one per request (vLLM's field names)."""


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (xgrammar's EBNF) or
    ``json_object=True`` (any JSON value). Frozen, so the engine's copies of a request's
    ``SamplingParams`` can share it; ``choice`` is stored as a tuple.

    JSON (``json`` and ``json_object``, which asks for an object, as OpenAI's JSON mode)
    is generated compact, without free whitespace (vLLM's ``disable_any_whitespace``):
    a model may otherwise emit whitespace until ``max_tokens``, which a random one does.

    Refused with an ``InvalidRequestError`` whose ``field`` is ``structured_outputs`` and
    whose message names the kind and the problem (none or two kinds set, a schema that is
    not JSON or that xgrammar cannot follow, a bad regex, an empty choice)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str | bytes) or not hasattr(self.choice, "__iter__"):
                raise InvalidRequestTypeError(
                    FIELD, f"choice must be a list of strings, got {self.choice!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                FIELD,
                f"exactly one of {', '.join(KINDS)} must be set, got "
                f"{', '.join(set_kinds) or 'none'}",
            )
        grammar_of(*self.key)  # builds (and caches) the grammar, or refuses

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, text)``: equal for equal constraints (a schema dict and its JSON text
        alike, keys in the same order), so compiled grammars are cached by it."""
        kind = self.kind
        if kind == "json":
            return kind, _schema_text(self.json)
        if kind == "choice":
            assert self.choice is not None
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            if self.json_object is not True:
                raise InvalidRequestTypeError(
                    FIELD, f"json_object must be True or None, got {self.json_object!r}"
                )
            return kind, ""
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise InvalidRequestTypeError(FIELD, f"{kind} must be a non-empty str, got {text!r}")
        return kind, text


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``)."""


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(FIELD, f"json: the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(
            FIELD, f"json: a JSON schema must be an object, got {type(schema).__name__}"
        )
    try:
        return json.dumps(schema)  # key order kept: properties are generated in it
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(FIELD, f"json: the schema is not JSON: {e}") from None


def resolve(
    structured: object, guided: object
) -> tuple[StructuredOutputsParams | None, StructuredOutputsParams | None]:
    """``SamplingParams``' two spellings, both as the one record (``guided_decoding``
    mirrors ``structured_outputs``, so either reads the constraint): a dict becomes the
    record; both set and different is refused, naming ``guided_decoding``."""
    if guided is not None:
        if structured is not None and structured != guided:
            raise InvalidRequestError(
                "guided_decoding",
                "set structured_outputs or its older name guided_decoding, not both",
            )
        structured = guided
    if structured is None or isinstance(structured, StructuredOutputsParams):
        return structured, structured
    if isinstance(structured, dict):
        unknown = sorted(set(structured) - set(KINDS))
        if unknown:
            raise InvalidRequestTypeError(
                FIELD, f"unknown structured_outputs field(s) {unknown}; known: {list(KINDS)}"
            )
        made = StructuredOutputsParams(**structured)
        return made, made
    raise InvalidRequestTypeError(
        FIELD, f"structured_outputs must be StructuredOutputsParams or a dict, got {structured!r}"
    )


def choice_ebnf(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices`` (JSON's string escapes are
    the EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@lru_cache(maxsize=256)
def grammar_of(kind: str, text: str) -> Any:
    """The xgrammar ``Grammar`` for ``key``, or an ``InvalidRequestError`` naming the
    kind and xgrammar's reason."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise InvalidRequestError(
            FIELD, "structured outputs need xgrammar: pip install 'paged_engine[structured]'"
        ) from None
    if kind == "choice":
        choices = json.loads(text)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(
                FIELD, f"choice must hold at least one non-empty string, got {choices!r}"
            )
        kind, text = "grammar", choice_ebnf(choices)
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    except RuntimeError as e:
        raise InvalidRequestError(FIELD, f"{kind}: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location (``[time] file.cc:N: ``)."""
    text = str(e).strip()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text) or type(e).__name__
