"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses.

Pure functions and small per-request formatters, no I/O: the routes (``openai_server``)
wire them to the engine loop. A formatter turns each ``RequestOutput`` of a streamed
request (``RequestOutputKind.DELTA``: only what is new) into one SSE chunk per completion
that produced a token, which is one chunk per new token; for a request that is not
streamed it builds the whole response from the final outputs. Usage is counted from the
token ids it saw, so a streamed request's ``usage`` equals the non-streamed one's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from paged_engine.chat_messages import template_message
from paged_engine.engine.request import CompletionOutput, PositionLogprobs, RequestOutput
from paged_engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

LOGIT_BIAS_LIMIT = 100.0
"""OpenAI's range for ``logit_bias`` values: larger ones are clamped to it."""


class RequestError(Exception):
    """A request answered with an error status before (or instead of) reaching the engine."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type_,
        )


_WIRE_NAMES = {"prompt_token_ids": "prompt", "cache_salt": "prompt"}
"""Engine fields that a server request spells otherwise: its prompt arrives as ``prompt``
(or, for chat, ``messages``: each route's ``rename`` maps ``prompt`` on)."""

_PARAM_ORDER = (
    "max_tokens", "min_tokens", "prompt_logprobs", "logprobs", "temperature", "top_p",
    "top_k", "min_p", "stop_token_ids", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "seed", "n",
    "prompt",
)  # fmt: skip
"""For an error that carries no field (a bare message): where it names several fields, the
one to blame comes first here."""


def param_of(error: BaseException | str, rename: Mapping[str, str] | None = None) -> str:
    """The request field an engine or ``SamplingParams`` error is about, renamed through
    ``rename`` (chat's ``messages``, ``top_logprobs``).

    An ``InvalidRequestError`` (what the engine and ``SamplingParams`` raise) names it in
    ``field``. Anything else, or a bare message (a caller that passes ``str(error)``), is
    read for the first field name it leads with or holds, ``prompt`` when it names none."""
    if isinstance(error, InvalidRequestError):
        found = _WIRE_NAMES.get(error.field, error.field)
    else:
        found = _field_in_message(str(error))
    return (rename or {}).get(found, found)


def _field_in_message(message: str) -> str:
    body = re.sub(r"^[\w ]+: ", "", message, count=1)  # "add_request: ..." / "prompt 0: ..."
    lead = re.match(r"(\w+)(?: must| cannot|=)", body)  # "n must be 1 ...", "logprobs=21 ..."
    if lead and lead[1] in _PARAM_ORDER:
        return lead[1]
    return next((f for f in _PARAM_ORDER if re.search(rf"\b{f}\b", body)), "prompt")


def sampling_params(
    req: SamplingFields, *, max_tokens: int | None, logprobs: int | None, rename: Mapping[str, str]
) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``req``; a bad value is a ``RequestError``
    naming the field (``SamplingParams`` validates, and its errors carry the field). What
    needs the model (token ids in its vocabulary, ``bad_words`` through its tokenizer)
    is checked when the engine admits the request."""
    bias = None
    if req.logit_bias is not None:
        bias = {}
        for key, value in req.logit_bias.items():
            if not re.fullmatch(r"\d+", key):
                raise RequestError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                )
            bias[int(key)] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            n=req.n,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=cast(Any, bias),  # normalised by SamplingParams
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            allowed_token_ids=cast(Any, req.allowed_token_ids),  # normalised to a tuple
            bad_words=cast(Any, req.bad_words),
        )
    except (ValueError, TypeError) as e:  # InvalidRequestError(Type)Error: param_of reads .field
        raise RequestError(str(e), param=param_of(e, rename)) from None


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: one string, strings, token ids, lists of them."""
    p = req.prompt
    prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts:
        raise RequestError("prompt must not be empty", param="prompt")
    if req.echo and not all(isinstance(x, str) for x in prompts):
        raise RequestError("echo needs text prompts (not token ids)", param="echo")
    return prompts


def chat_prompt(
    tokenizer: Any, req: ChatCompletionRequest, template: str | None
) -> Callable[[], dict[str, list[int]]]:
    """The conversation as a prompt, rendered when called: the engine thread calls it, so
    the tokenizer is used by that thread alone. Text parts are joined by newlines. The
    request's tools go to the template (which shows them to the model) unless its
    ``tool_choice`` is ``"none"``."""
    messages = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "\n".join(part.text for part in m.content)
        try:
            messages.append(template_message(d, f"messages[{i}]"))
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), param=f"messages[{i}]") from e
    add_generation_prompt = req.add_generation_prompt
    tools = None if req.tool_choice == "none" else req.tools

    def render() -> dict[str, list[int]]:
        out = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
        )
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return {"prompt_token_ids": list(ids)}

    return render


def sse(payload: BaseModel | dict[str, Any]) -> str:
    import json

    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def _token_text(lp: PositionLogprobs, token: int) -> str:
    d = lp[token].decoded_token
    return d if d is not None else f"token_id:{token}"


class UsageCounter:
    """Prompt tokens once per prompt, completion tokens over every completion."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._seen: set[str] = set()

    def count(self, out: RequestOutput) -> None:
        if out.request_id not in self._seen:
            self._seen.add(out.request_id)
            self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> Usage:
        p, c = self.prompt_tokens, self.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def completion_logprobs(c: CompletionOutput, offset: int) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs for ``c``'s tokens, text offsets from ``offset``; and the
    offset after them."""
    out = CompletionLogprobs()
    for token, lp in zip(c.token_ids, c.logprobs or [], strict=False):
        text = _token_text(lp, token)
        out.tokens.append(text)
        out.token_logprobs.append(lp[token].logprob)
        top: dict[str, float] = {}
        for t, entry in lp.items():
            top.setdefault(_token_text(lp, t), entry.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(c: CompletionOutput, k: int) -> list[TokenLogprob]:
    """Chat's logprobs: each token with its ``k`` most likely alternatives, by rank."""
    content = []
    for token, lp in zip(c.token_ids, c.logprobs or [], strict=False):
        text = _token_text(lp, token)
        ranked = sorted(
            (e.rank, _token_text(lp, t), e.logprob) for t, e in lp.items() if e.rank and e.rank <= k
        )
        top = [TopLogprob(token=s, logprob=v, bytes=list(s.encode())) for _, s, v in ranked]
        content.append(
            TokenLogprob(
                token=text, logprob=lp[token].logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return content


def validation_error(e: ValidationError) -> RequestError:
    errors = e.errors()
    if any(err["type"] == "json_invalid" for err in errors):
        msg = next(err["msg"] for err in errors if err["type"] == "json_invalid")
        return RequestError(f"malformed JSON body: {msg}", code="json_invalid")
    loc = [p for p in errors[0]["loc"] if isinstance(p, int) or _is_field(p)]
    param = ".".join(map(str, loc)) or None
    msgs = list(dict.fromkeys(err["msg"] for err in errors))
    where = f"{param}: " if param else "the body: "
    return RequestError(where + "; ".join(msgs), param=param, code="invalid_type")


def _is_field(part: object) -> bool:
    """A field name in a validation error's location, not a union member's tag
    (``str``, ``list[int]``, ``TextPart``)."""
    return (
        isinstance(part, str)
        and part.isidentifier()
        and part.islower()
        and part not in ("str", "int", "float", "bool", "list", "dict", "none")
    )
