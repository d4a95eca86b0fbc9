"""A chat message as the chat template sees it, for ``LLM.chat`` and the server's chat
route alike: vLLM's ``reasoning`` (and its older name ``reasoning_content``).

As in vLLM, a null ``reasoning`` / ``reasoning_content`` is dropped; an assistant
message's reasoning (a string) reaches the template under both names, so templates that
read either one (interleaved thinking) see it; the two, when both given, must agree. Other
roles carry no reasoning in vLLM's parsed messages, so theirs is dropped too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REASONING_KEYS = ("reasoning", "reasoning_content")


def template_message(message: Mapping[str, Any], where: str = "message") -> dict[str, Any]:
    """A copy of ``message`` with its reasoning keys as the template takes them; refuses,
    naming ``where`` and the key, a non-string reasoning or two that differ."""
    out = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    given = {k: message[k] for k in REASONING_KEYS if message.get(k) is not None}
    for key, value in given.items():
        if not isinstance(value, str):
            raise TypeError(f"{where}: {key} must be a string or null, got {value!r}")
    if len(set(given.values())) > 1:
        raise ValueError(f"{where}: reasoning and reasoning_content differ; give one")
    if given and message.get("role") == "assistant":
        text = next(iter(given.values()))
        out["reasoning"] = out["reasoning_content"] = text
    return out


def template_messages(conversation: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``template_message`` of each message of a conversation (its index in errors)."""
    return [template_message(m, f"messages[{i}]") for i, m in enumerate(conversation)]


__all__ = ["REASONING_KEYS", "template_message", "template_messages"]
