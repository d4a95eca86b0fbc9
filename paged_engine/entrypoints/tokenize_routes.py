"""vLLM's tokenizer routes: ``POST /tokenize`` (a text, or a conversation rendered by the
chat template, to token ids) and ``POST /detokenize`` (token ids to text).

Why they never reach the engine: they need only the tokenizer and ``max_model_len``, which
the API process holds in both engine modes (``--engine-core process`` loads the tokenizer,
not the weights), so they answer while the engine is busy or in another process, and add
nothing to its queue or counters. Why vLLM's shapes and names: its benchmark client
(``vllm bench serve``) posts ``{"model", "prompt", "add_special_tokens": false}`` to
``/tokenize`` and reads ``tokens``, then ``/detokenize`` and reads ``prompt``, to cut its
prompts to the server's tokenizer.

They are checked as the completion routes are (``openai_server``'s module docstring): the
body size, the fields (a 400 naming one), an unknown ``model`` (404), a text or
conversation over ``max_prompt_chars`` (400, before tokenizing); then the work runs on the
``TokenizePool``'s threads, never on the event loop. A request's own ``chat_template`` is
refused (400 naming it), as vLLM does unless told to trust it: a template is code the
server runs, and one that loops would hold a tokenize thread for good.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from pydantic import TypeAdapter, ValidationError

from paged_engine.entrypoints.limits import (
    check_prompt_chars,
    prompt_too_long,
    read_body,
    text_chars,
)
from paged_engine.entrypoints.openai_requests import check_model
from paged_engine.entrypoints.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from paged_engine.entrypoints.serving import RequestError, validation_error
from paged_engine.entrypoints.tokenize_pool import TokenizePool

T = TypeVar("T")


class _ForAModel(Protocol):
    """A tokenizer route's body: each names the model it is for, or None for the served one."""

    @property
    def model(self) -> str | None: ...


B = TypeVar("B", bound=_ForAModel)

_TOKENIZE_BODY: TypeAdapter[TokenizeCompletionRequest | TokenizeChatRequest] = TypeAdapter(
    TokenizeRequest
)


def max_token_id(tokenizer: Any) -> int | None:
    """The largest id the tokenizer can decode, as vLLM reckons it: the largest in its
    vocabulary (added tokens included), or its base ``vocab_size`` minus one if that is
    more. None without a tokenizer or a readable vocabulary. Why the tokenizer's and not
    the model's vocabulary: an id only the model has (padding rows, as in Qwen3's) decodes
    to nothing, and the API process does not load the model."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # a tokenizer that cannot list its vocabulary: decode decides
        return None
    largest = max(vocab.values(), default=-1)
    size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int):
        largest = max(largest, size - 1)
    return largest if largest >= 0 else None


@dataclass
class TokenizeRoutes:
    """What the two routes need of the server: its tokenizer (None: the model has none),
    its model name and limits, its chat template, and its ``TokenizePool``."""

    tokenizer: Any
    served_model_name: str
    max_model_len: int
    max_prompt_chars: int
    max_request_body_bytes: int
    chat_template: str | None
    has_chat_template: bool
    pool: TokenizePool
    max_token_id: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.max_token_id = max_token_id(self.tokenizer)

    def register(self, app: FastAPI) -> None:
        @app.post("/tokenize")
        async def tokenize(request: Request) -> TokenizeResponse:
            return await self.tokenize(request)

        @app.post("/detokenize")
        async def detokenize(request: Request) -> DetokenizeResponse:
            return await self.detokenize(request)

    # ---- the routes ---------------------------------------------------------------------

    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await self._body(request, _TOKENIZE_BODY.validate_json)
        if isinstance(body, TokenizeChatRequest):
            encode, param = self._chat_encoder(body), "messages"
        else:
            encode, param = self._text_encoder(body), "prompt"
        tokenizer, want_strs = self.tokenizer, bool(body.return_token_strs)

        def job() -> tuple[list[int], list[str] | None]:
            ids = encode()
            return ids, (list(tokenizer.convert_ids_to_tokens(ids)) if want_strs else None)

        ids, strs = await self._on_pool(job, param, "tokenized")
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        body = await self._body(request, DetokenizeRequest.model_validate_json)
        self._need_tokenizer("tokens")
        tokens, top = body.tokens, self.max_token_id
        bad = next(
            (i for i, t in enumerate(tokens) if t < 0 or (top is not None and t > top)), None
        )
        if bad is not None:
            bound = f"[0, {top}]" if top is not None else "the non-negative ids"
            raise RequestError(
                f"token {bad} is {tokens[bad]}, outside the vocabulary {bound}",
                param="tokens",
                code="invalid_value",
            )
        tokenizer = self.tokenizer
        text = await self._on_pool(lambda: str(tokenizer.decode(tokens)), "tokens", "decoded")
        return DetokenizeResponse(prompt=text)

    # ---- checks and work ----------------------------------------------------------------

    async def _body(self, request: Request, parse: Callable[[bytes], B]) -> B:
        """The request's body, parsed, after the refusals both routes make before any work:
        a body over the size limit, a field that does not validate (400 naming it), another
        model than the served one (404; an omitted ``model`` is the served one, as in vLLM)."""
        raw = await read_body(request, self.max_request_body_bytes)
        try:
            body = parse(raw)
        except ValidationError as e:
            raise validation_error(e) from None
        if body.model is not None:
            check_model(body.model, self.served_model_name)
        return body

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestError(
                "this model has no tokenizer (its directory holds none)", param=param
            )

    def _text_encoder(self, body: TokenizeCompletionRequest) -> Callable[[], list[int]]:
        """The prompt's ids, made when called (special tokens added unless refused)."""
        self._need_tokenizer("prompt")
        check_prompt_chars([body.prompt], self.max_prompt_chars)
        tokenizer, prompt, special = self.tokenizer, body.prompt, body.add_special_tokens
        return lambda: list(tokenizer.encode(prompt, add_special_tokens=special))

    def _chat_encoder(self, body: TokenizeChatRequest) -> Callable[[], list[int]]:
        """The conversation's ids, made when called: rendered by the server's template to
        text, then encoded, with the special tokens only if asked (``apply_chat_template``
        encodes without them, so by default this equals the ids chat completions send)."""
        if body.chat_template is not None:
            raise RequestError(
                "a request's own chat_template is not accepted: this server renders only "
                "its own (--chat-template, or the tokenizer's)",
                param="chat_template",
            )
        if body.continue_final_message and body.add_generation_prompt:
            raise RequestError(
                "continue_final_message needs add_generation_prompt: false (the final "
                "message is continued, so no new one is started)",
                param="continue_final_message",
            )
        if not self.has_chat_template or self.tokenizer is None:
            raise RequestError(
                "this model has no chat template: start the server with --chat-template "
                "(a Jinja template or a file holding one), or tokenize a prompt",
                param="messages",
            )
        messages = [_template_message(m.model_dump(exclude_none=True)) for m in body.messages]
        chars = text_chars(messages)
        if chars > self.max_prompt_chars:
            raise prompt_too_long("the conversation", chars, self.max_prompt_chars, "messages")
        tokenizer, template = self.tokenizer, self.chat_template
        generation, final, special = (
            body.add_generation_prompt,
            body.continue_final_message,
            body.add_special_tokens,
        )

        def encode() -> list[int]:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=generation,
                continue_final_message=final,
                chat_template=template,
            )
            return list(tokenizer.encode(text, add_special_tokens=special))

        return encode

    async def _on_pool(self, job: Callable[[], T], param: str, done: str) -> T:
        """``job`` on a tokenize thread; a tokenizer or template that raises is the input's
        fault: a 400 naming ``param``."""
        try:
            return await self.pool.run(job)
        except RequestError:
            raise
        except Exception as exc:
            raise RequestError(f"the input could not be {done}: {exc}", param=param) from exc


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat completions hands it to the template: text parts joined by
    newlines."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(part["text"] for part in content)
    return out
