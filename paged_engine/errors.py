"""Errors that carry the name of what was wrong, so that callers map them without parsing
messages: the server turns ``field`` into the OpenAI error's ``param``, the CLI into a
flag name. They subclass ``ValueError`` / ``TypeError``, the types these refusals have
always had, so ``except ValueError`` keeps catching them.

This module imports nothing from the package: every layer (sampling parameters, the
engine, the loaders, the server) may raise these.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) that the engine refuses before queuing it.

    ``field`` names the parameter as the user spelled it (``"logit_bias"``, ``"n"``,
    ``"prompt"``); ``where`` says which request of a batch (``"prompt 3"``), or "" for one.
    The message is ``"{where}: {reason}"``, or the reason alone without ``where``.
    """

    def __init__(self, field: str, reason: str, where: str = "") -> None:
        self.field = field
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # Pickles with its fields (a TP worker or another process may raise it).
        return (type(self), (self.field, self.reason, self.where))


class InvalidRequestTypeError(InvalidRequestError, TypeError):
    """An ``InvalidRequestError`` about a value of the wrong type."""


class ModelConfigError(ValueError):
    """A model directory or file that cannot be served: ``path`` names the file, ``key``
    the config key or tensor name when there is one."""

    def __init__(self, path: str, reason: str, key: str | None = None) -> None:
        self.path = path
        self.key = key
        self.reason = reason
        super().__init__(f"{path}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        return (type(self), (self.path, self.reason, self.key))
