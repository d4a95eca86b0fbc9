"""What each route asks of the engine: from a validated OpenAI body to a ``PreparedRequest``
(the route's own checks, the ``SamplingParams``, the request ids, the job that tokenizes
its prompts, the formatter that answers it).

This is where the two routes differ; everything after it is the same for both and lives
in ``openai_server`` (admission against ``max_queue``, tokenizing on the pool, submission
to the engine loop, the answer and the release). No I/O and no engine here: each check
raises a ``RequestError`` naming the body's field before anything is queued.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from paged_engine.entrypoints.formatters import ChatFormatter, CompletionFormatter
from paged_engine.entrypoints.limits import check_prompt_chars, prompt_too_long, text_chars
from paged_engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from paged_engine.entrypoints.response_format import constrained
from paged_engine.entrypoints.serving import (
    RequestError,
    chat_prompt,
    completion_prompts,
    sampling_params,
)
from paged_engine.entrypoints.tokenize_pool import encoder
from paged_engine.entrypoints.tool_calls import tool_policy
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams
from paged_engine.structured_outputs import StructuredOutputsParams

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's ``max_tokens`` for ``/v1/completions`` when the body omits it (chat has none)."""


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One body's work for the engine, checked and not yet admitted."""

    body: CompletionRequest | ChatCompletionRequest
    ids: list[str]
    """One engine request id per prompt (chat has one prompt)."""
    params: SamplingParams
    prepare: Callable[[], list[object]]
    """Tokenizes the prompts (chat: renders the template), on the ``TokenizePool``."""
    formatter: CompletionFormatter | ChatFormatter
    rename: dict[str, str]
    """Engine field -> the body's name for it, so that a refusal names the body's field."""


def check_model(name: str, served: str) -> None:
    """A 404 for a ``model`` this server does not serve."""
    if name != served:
        raise RequestError(
            f"the model {name!r} does not exist; this server serves {served!r}",
            status=404,
            param="model",
            code="model_not_found",
            type_="not_found_error",
        )


def prepare_completion(
    body: CompletionRequest, *, tokenizer: Any, max_prompt_chars: int, created: int
) -> PreparedRequest:
    """``/v1/completions``: one engine request per prompt; ``suffix``, ``best_of`` other
    than ``n`` and ``echo`` with logprobs are refused by name."""
    if body.suffix is not None:
        raise RequestError("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise RequestError("best_of must equal n (or be omitted)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise RequestError("echo with logprobs is not supported", param="echo")
    prompts = completion_prompts(body)
    check_prompt_chars(prompts, max_prompt_chars)
    max_tokens = (
        body.max_tokens if "max_tokens" in body.model_fields_set else DEFAULT_COMPLETION_MAX_TOKENS
    )
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, rename={})
    params = constrained(params, body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    ids = [f"{rid}-{i}" for i in range(len(prompts))]
    formatter = CompletionFormatter(
        rid,
        body.model,
        created,
        ids,
        body.n,
        echo_texts=[str(p) for p in prompts] if body.echo else None,
        logprobs=body.logprobs is not None,
        return_token_ids=body.return_token_ids,
    )
    return PreparedRequest(body, ids, params, encoder(tokenizer, prompts), formatter, {})


def prepare_chat(
    body: ChatCompletionRequest,
    *,
    tokenizer: Any,
    chat_template: str | None,
    has_chat_template: bool,
    max_prompt_chars: int,
    created: int,
    tool_call_parser: str | None = None,
) -> PreparedRequest:
    """``/v1/chat/completions``: one engine request for the conversation, rendered by the
    chat template; its errors name ``messages``, ``max_completion_tokens`` (when the body
    gave that spelling) and ``top_logprobs`` where the engine says ``prompt``,
    ``max_tokens`` and ``logprobs``."""
    if not has_chat_template or tokenizer is None:
        raise RequestError(
            "this model has no chat template: start the server with --chat-template "
            "(a Jinja template or a file holding one), or use /v1/completions",
            param="messages",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    given = {"max_tokens", "max_completion_tokens"} & body.model_fields_set
    limit_name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    k = (body.top_logprobs or 0) if body.logprobs else None
    rename = {"prompt": "messages", "max_tokens": limit_name, "logprobs": "top_logprobs"}
    params = sampling_params(body, max_tokens=getattr(body, limit_name), logprobs=k, rename=rename)
    params = constrained(params, body)
    tools = tool_policy(body.tools, body.tool_choice, tool_call_parser, body.parallel_tool_calls)
    forced = None if tools is None else tools.forced_schema()
    if forced is not None:
        if params.structured_outputs is not None:
            raise RequestError(
                f"tool_choice {body.tool_choice!r} forces the output itself: it cannot be "
                "combined with response_format or structured_outputs",
                param="tool_choice",
            )
        try:
            params = replace(params, structured_outputs=StructuredOutputsParams(json=forced))
        except InvalidRequestError as e:
            raise RequestError(f"a tool's parameters cannot be followed: {e}", param="tools") from e
    chars = text_chars([m.model_dump(exclude_none=True) for m in body.messages])
    if chars > max_prompt_chars:
        raise prompt_too_long("the conversation", chars, max_prompt_chars, "messages")
    render = chat_prompt(tokenizer, body, chat_template)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    formatter = ChatFormatter(
        rid,
        body.model,
        created,
        [rid],
        body.n,
        top_logprobs=k,
        return_token_ids=body.return_token_ids,
        tools=tools,
    )
    return PreparedRequest(body, [rid], params, lambda: [render()], formatter, rename)
