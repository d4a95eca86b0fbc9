"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are strict (``extra="forbid"``, ``strict=True``): a string where a number belongs,
a float for ``n`` or a misspelt field is a 400 naming the field, never silently coerced or
ignored. Beside OpenAI's fields, the requests take vLLM's sampling extensions under vLLM's
names (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``allowed_token_ids``, ``bad_words``, ``return_token_ids``, ``structured_outputs`` and the
older ``guided_*`` fields). Responses keep OpenAI's field names and its nulls. vLLM's
``/tokenize`` and ``/detokenize`` bodies have vLLM's shapes and names, which its benchmark
client (``vllm bench serve``) reads.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    """vLLM's extension: only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """vLLM's extension: words never generated (see ``SamplingParams``)."""
    return_token_ids: bool = False
    """vLLM's extension: each choice carries its ``token_ids`` (and ``prompt_token_ids``)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``,
    read by ``response_format.structured_params`` (which names the field)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's extension: ``StructuredOutputsParams``' fields (json, regex, choice...)."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    """A message as the chat template sees it; extra keys (``name``, ``tool_calls``...)
    are passed to the template as they are."""

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    """OpenAI's ``{type: function, function: {name, description, parameters}}`` objects,
    checked by ``tool_calls.tool_policy`` (which names the field)."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TokenizeCompletionRequest(_Request):
    """vLLM's ``/tokenize`` of a text. ``model`` may be omitted, as in vLLM (the served
    model)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """vLLM's ``/tokenize`` of a conversation, rendered by the chat template; special
    tokens are not added by default (the template writes its own), as in vLLM.
    ``chat_template`` is taken so that it can be refused by name: vLLM too refuses a
    request's template unless trusted (a template is code the server runs)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None


def _tokenize_form(body: Any) -> str:
    """A body with ``messages`` is the chat form, any other the text form (the tags are
    class names, which ``validation_error`` leaves out of a field's path)."""
    chat = isinstance(body, dict) and "messages" in body
    return "TokenizeChatRequest" if chat else "TokenizeCompletionRequest"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_form),
]
"""Either form of a ``/tokenize`` body, told apart by its ``messages`` key."""


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    """vLLM's: the reasoning a parser split off; none here (always null)."""
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "paged_engine"
    root: str | None = None
    max_model_len: int | None = None


class TokenizeResponse(BaseModel):
    """vLLM's names: ``vllm bench serve`` reads ``tokens``."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error shape."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type_, param=param, code=code)
    ).model_dump()
