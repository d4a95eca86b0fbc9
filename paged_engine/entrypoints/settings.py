"""The server's own settings (the engine's are ``EngineConfig``), checked when built, so
``serve`` refuses a bad flag before the model loads. No server dependency is imported."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

API_KEY_ENV = "PAGED_ENGINE_API_KEY"
"""The environment variable ``serve`` reads the API key from when ``--api-key`` is absent."""
TOOL_CALL_PARSERS = ("hermes",)
"""The ``--tool-call-parser`` values the server reads (``tool_calls``)."""
DP_AUTHKEY_ENV = "PAGED_ENGINE_DP_AUTHKEY"
"""The secret that a head and its headless nodes share (``dp_remote``): an environment
variable, not a flag, so that it shows in no process list."""
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
"""``--max-request-body-bytes``'s default: room for a batch of long prompts, far below the
size at which parsing a body costs real memory or time."""


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """``served_model_name``: the ``model`` clients must send (and ``/v1/models`` lists);
    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer KEY``;
    ``chat_template``: the Jinja template for chat (None: the tokenizer's, if any);
    ``max_queue``: the most sequences (completions: each prompt counts ``n``) the server
    holds at once, queued or running; a request that would pass it is answered 503 (retry
    later), or 400 if it alone needs more;
    ``shutdown_timeout``: after SIGTERM/SIGINT, seconds in-flight requests may run on
    before they are aborted (their streams end with an error event);
    ``max_step_failures``: consecutive failed engine steps after which the loop looks for
    the request at fault (``isolation``) rather than retrying again;
    ``max_prompt_chars``: the longest text prompt (or chat conversation) accepted, checked
    before tokenizing; None: ``max_model_len`` times the tokenizer's longest token
    (``limits``);
    ``max_request_body_bytes``: the largest request body accepted (413 beyond);
    ``tokenize_threads``: the threads that tokenize prompts, beside the event loop;
    ``tool_call_parser``: how ``tool_choice="auto"`` reads calls from the text (vLLM's
    ``--enable-auto-tool-choice --tool-call-parser``; None: ``auto`` is refused)."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    chat_template: str | None = None
    max_queue: int = 1024
    shutdown_timeout: float = 5.0
    max_step_failures: int = 3
    log_level: str = "info"
    max_prompt_chars: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tokenize_threads: int = 2
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(
                f"served_model_name must be a non-empty string, got {self.served_model_name!r}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be a string or None, got {self.chat_template!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)} or None, "
                f"got {self.tool_call_parser!r}"
            )
        names = ["max_queue", "max_step_failures", "max_request_body_bytes", "tokenize_threads"]
        if self.max_prompt_chars is not None:
            names.append("max_prompt_chars")
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        t = self.shutdown_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"shutdown_timeout must be a finite number >= 0, got {t!r}")


def dp_authkey() -> bytes:
    """The shared key of remote data-parallel replicas, from ``$PAGED_ENGINE_DP_AUTHKEY``;
    ValueError naming the variable when it is unset or empty: over TCP every peer must
    prove it knows the key before a single (pickled) message is read."""
    key = os.environ.get(DP_AUTHKEY_ENV, "")
    if not key:
        raise ValueError(
            f"replicas on other hosts need a shared key: set ${DP_AUTHKEY_ENV}, the same "
            "on the head and on every --headless node"
        )
    return key.encode()
