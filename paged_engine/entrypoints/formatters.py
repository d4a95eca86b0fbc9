"""Engine outputs as OpenAI responses: one formatter per HTTP request (see ``serving``).

A choice's ``index`` is ``prompt_index * n + completion_index``, as OpenAI numbers the
choices of a request with several prompts. A streamed choice appears in a chunk only when
it has something new (a token, or its finish reason); once finished it never appears
again.
"""

from __future__ import annotations

from pydantic import BaseModel

from paged_engine.engine.request import CompletionOutput, RequestOutput
from paged_engine.entrypoints.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from paged_engine.entrypoints.serving import (
    UsageCounter,
    chat_logprobs,
    completion_logprobs,
    sse,
)
from paged_engine.entrypoints.tool_calls import ToolCall, ToolPolicy, ToolStream


class _Formatter:
    def __init__(
        self, response_id: str, model: str, created: int, request_ids: list[str], n: int
    ) -> None:
        self.id, self.model, self.created, self.n = response_id, model, created, n
        self.prompt_index = {r: i for i, r in enumerate(request_ids)}
        self.usage = UsageCounter()
        self._started: set[int] = set()
        self._done: set[int] = set()

    def _news(self, out: RequestOutput) -> list[tuple[int, CompletionOutput, bool]]:
        """(choice index, completion, first time seen) for each completion with news."""
        base = self.prompt_index[out.request_id] * self.n
        news = []
        for c in out.outputs:
            index = base + c.index
            if index in self._done or (not c.token_ids and not c.text and not c.finish_reason):
                continue
            first = index not in self._started
            self._started.add(index)
            if c.finish_reason is not None:
                self._done.add(index)
            news.append((index, c, first))
        return news


class CompletionFormatter(_Formatter):
    """``/v1/completions``: ``echo`` prefixes each choice's text with its prompt."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        request_ids: list[str],
        n: int,
        *,
        echo_texts: list[str] | None,
        logprobs: bool,
        return_token_ids: bool,
    ) -> None:
        super().__init__(response_id, model, created, request_ids, n)
        self.echo_texts = echo_texts
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self._offsets: dict[int, int] = {}

    def _choice(
        self, out: RequestOutput, index: int, c: CompletionOutput, first: bool
    ) -> CompletionChoice:
        text = c.text
        if first and self.echo_texts is not None:
            text = self.echo_texts[self.prompt_index[out.request_id]] + text
        lps = None
        if self.logprobs:
            start = self._offsets.get(index, len(text) - len(c.text))
            lps, self._offsets[index] = completion_logprobs(c, start)
        ids = self.return_token_ids
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=lps,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if ids else None,
            prompt_token_ids=list(out.prompt_token_ids) if ids and first else None,
        )

    def chunks(self, out: RequestOutput) -> list[str]:
        self.usage.count(out)
        return [
            sse(self._response([self._choice(out, i, c, first)])) for i, c, first in self._news(out)
        ]

    def _response(self, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices
        )

    def response(self, outs: list[RequestOutput]) -> BaseModel:
        choices = []
        for out in outs:
            self.usage.count(out)
            choices += [self._choice(out, i, c, first) for i, c, first in self._news(out)]
        body = self._response(sorted(choices, key=lambda ch: ch.index))
        body.usage = self.usage.usage()
        return body

    def usage_chunk(self) -> str:
        body = self._response([])
        body.usage = self.usage.usage()
        return sse(body)


class ChatFormatter(_Formatter):
    """``/v1/chat/completions``: the first chunk of each choice carries the role. Under a
    tool policy (``tool_calls``) a choice's calls are read from its text when it ends: a
    streamed one sends its content until a call begins, and its calls when it ends."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        request_ids: list[str],
        n: int,
        *,
        top_logprobs: int | None,
        return_token_ids: bool,
        tools: ToolPolicy | None = None,
    ) -> None:
        super().__init__(response_id, model, created, request_ids, n)
        self.top_logprobs = top_logprobs
        self.return_token_ids = return_token_ids
        self.tools = tools
        self._streams: dict[int, ToolStream] = {}
        self._calls: dict[int, list[ToolCall]] = {}

    def _logprobs(self, c: CompletionOutput) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(c, self.top_logprobs))

    def chunks(self, out: RequestOutput) -> list[str]:
        self.usage.count(out)
        return [
            sse(
                self._chunk(
                    [
                        ChatChunkChoice(
                            index=i,
                            delta=self._delta(i, c, first),
                            logprobs=self._logprobs(c),
                            finish_reason=self._finish_reason(i, c),
                            stop_reason=c.stop_reason,
                            token_ids=list(c.token_ids) if self.return_token_ids else None,
                        )
                    ]
                )
            )
            for i, c, first in self._news(out)
        ]

    def _delta(self, index: int, c: CompletionOutput, first: bool) -> DeltaMessage:
        role = "assistant" if first else None
        if self.tools is None:
            return DeltaMessage(role=role, content=c.text)
        stream = self._streams.setdefault(index, ToolStream(self.tools))
        if c.finish_reason is None:
            return DeltaMessage(role=role, content=stream.add(c.text))
        content, calls = stream.finish(c.text)
        self._calls[index] = calls
        deltas = [dict(call.as_dict(), index=k) for k, call in enumerate(calls)]
        return DeltaMessage(role=role, content=content, tool_calls=deltas or None)

    def _message(self, index: int, c: CompletionOutput) -> AssistantMessage:
        if self.tools is None or c.finish_reason is None:
            return AssistantMessage(content=c.text)
        content, calls = self.tools.extract(c.text)
        self._calls[index] = calls
        return AssistantMessage(
            content=content, tool_calls=[call.as_dict() for call in calls] or None
        )

    def _finish_reason(self, index: int, c: CompletionOutput) -> str | None:
        """``tool_calls`` (or ``stop``, for a named function) where the choice made calls;
        read after ``_delta`` / ``_message`` has read its text."""
        if self.tools is None or c.finish_reason is None or not self._calls.get(index):
            return c.finish_reason
        return self.tools.finish_reason

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices
        )

    def response(self, outs: list[RequestOutput]) -> BaseModel:
        choices = []
        for out in outs:
            self.usage.count(out)
            for i, c, _ in self._news(out):
                choices.append(
                    ChatChoice(
                        index=i,
                        message=self._message(i, c),
                        logprobs=self._logprobs(c),
                        finish_reason=self._finish_reason(i, c),
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if self.return_token_ids else None,
                    )
                )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=sorted(choices, key=lambda ch: ch.index),
            usage=self.usage.usage(),
            prompt_token_ids=list(outs[0].prompt_token_ids) if self.return_token_ids else None,
        )

    def usage_chunk(self) -> str:
        body = self._chunk([])
        body.usage = self.usage.usage()
        return sse(body)
