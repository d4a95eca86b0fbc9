"""A body's output constraint (OpenAI's ``response_format``, vLLM's ``structured_outputs``
and older ``guided_*`` fields) as the engine's ``StructuredOutputsParams``.

Why a module of its own: the same reading serves both routes, and each of its refusals must
name the body's field, not the engine's ``structured_outputs``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from paged_engine.entrypoints.protocol import SamplingFields
from paged_engine.entrypoints.serving import RequestError
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams
from paged_engine.structured_outputs import StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older request fields -> ``StructuredOutputsParams``' names."""


def constrained(params: SamplingParams, body: SamplingFields) -> SamplingParams:
    """``params`` with the body's output constraint, if it has one."""
    so = structured_params(body)
    return params if so is None else replace(params, structured_outputs=so)


def structured_params(body: SamplingFields) -> StructuredOutputsParams | None:
    """The body's constraint, None without one; at most one of ``response_format`` (other
    than ``text``), ``structured_outputs`` and the ``guided_*`` fields may be given."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            given.append(("response_format", spec))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", dict(body.structured_outputs)))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            given.append((name, {kind: value}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(n for n, _ in given)
        raise RequestError(f"give one output constraint, got {names}", param=given[1][0])
    param, spec = given[0]
    try:
        return StructuredOutputsParams(**spec)
    except (InvalidRequestError, TypeError) as e:
        raise RequestError(f"{param}: {getattr(e, 'reason', e)}", param=param) from None


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise RequestError(
                "response_format json_schema needs json_schema.schema (an object)",
                param="response_format",
            )
        return {"json": inner["schema"]}
    raise RequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )
