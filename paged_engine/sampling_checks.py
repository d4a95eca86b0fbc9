"""The checks ``SamplingParams`` runs on each field when it is built: each takes the value
as the user gave it and returns it normalised (a float, a tuple), or raises an
``InvalidRequestError`` (a ``ValueError``) or ``InvalidRequestTypeError`` (also a
``TypeError``) whose ``field`` is the parameter's name. They know nothing of the model:
token ids are checked >= 0 here and against the vocabulary at admission
(``engine/inputs.check_request``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError


def finite_float(field: str, x: object, label: str | None = None) -> float:
    """``x`` as a finite float: a type error for a non-number, a value error for one that
    is not finite or is an int beyond the float range. ``label`` names it in the message
    (default: the field)."""
    name = label or field
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise InvalidRequestTypeError(field, f"{name} must be a number, got {x!r}")
    try:
        value = float(x)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"{name} must be finite, got {x!r}")
    return value


def float_in(name: str, x: object, low: float, high: float) -> float:
    value = finite_float(name, x)
    if not low <= value <= high:
        raise InvalidRequestError(name, f"{name} must be in [{low:g}, {high:g}], got {x!r}")
    return value


def integer(field: str, x: object, label: str | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidRequestTypeError(field, f"{label or field} must be an int, got {x!r}")
    return x


def optional_count(name: str, x: object) -> int | None:
    """None, or an int >= 0."""
    if x is None:
        return None
    value = integer(name, x)
    if value < 0:
        raise InvalidRequestError(name, f"{name} must be None or an int >= 0, got {x!r}")
    return value


def boolean(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise InvalidRequestTypeError(name, f"{name} must be a bool, got {x!r}")
    return x


def id_tuple(name: str, x: object) -> tuple[int, ...]:
    """A sequence of ints >= 0 as a tuple, in order."""
    if isinstance(x, str | bytes | Mapping) or not hasattr(x, "__iter__"):
        raise InvalidRequestTypeError(name, f"{name} must be a sequence of ints, got {x!r}")
    ids = tuple(x)
    for t in ids:
        if integer(name, t, f"each of {name}") < 0:
            raise InvalidRequestError(name, f"{name} must hold ints >= 0, got {t!r}")
    return ids


def token_ids(name: str, x: object) -> tuple[int, ...]:
    """A sequence of ints >= 0 as a tuple, duplicates dropped (first kept), as vLLM."""
    return tuple(dict.fromkeys(id_tuple(name, x)))


def strings(name: str, x: object) -> tuple[str, ...]:
    """None, one string or a sequence of strings, as a tuple of strings that are not
    empty (``bad_words``: not blank either, as vLLM strips a word's leading spaces)."""
    if x is None:
        return ()
    if isinstance(x, str):
        x = (x,)
    if isinstance(x, bytes | Mapping) or not hasattr(x, "__iter__"):
        raise InvalidRequestTypeError(
            name, f"{name} must be None, a str or a sequence of str, got {x!r}"
        )
    values = tuple(x)
    for s in values:
        if not isinstance(s, str):
            raise InvalidRequestTypeError(name, f"{name} must hold only strings, got {s!r}")
        if not (s.strip() if name == "bad_words" else s):
            raise InvalidRequestError(name, f"{name} cannot contain an empty string, got {s!r}")
    return values


def allowed_token_ids(x: object) -> tuple[int, ...] | None:
    """None (every token) or a non-empty sequence of ids, as ``token_ids`` (vLLM refuses
    an empty list: it would leave nothing to sample)."""
    if x is None:
        return None
    ids = token_ids("allowed_token_ids", x)
    if not ids:
        raise InvalidRequestError(
            "allowed_token_ids", "allowed_token_ids must be None or hold at least one id"
        )
    return ids


def word_token_ids(x: object) -> tuple[tuple[int, ...], ...] | None:
    """None, or a sequence of non-empty sequences of token ids, as tuples."""
    name = "bad_words_token_ids"
    if x is None:
        return None
    if isinstance(x, str | bytes | Mapping) or not hasattr(x, "__iter__"):
        raise InvalidRequestTypeError(name, f"{name} must be sequences of token ids, got {x!r}")
    words = tuple(id_tuple(name, w) for w in x)
    if not all(words):
        raise InvalidRequestError(name, f"{name} cannot hold an empty word, got {x!r}")
    return words


def logit_bias(x: object) -> tuple[tuple[int, float], ...] | None:
    """None or a mapping token id (int >= 0) -> finite float, as ``(id, bias)`` pairs
    sorted by id (hashable, and equal whatever the mapping's order); ``{}`` is None."""
    name = "logit_bias"
    if x is None:
        return None
    if isinstance(x, tuple):  # already normalised (dataclasses.replace passes it back)
        try:
            x = dict(x)
        except (TypeError, ValueError):
            raise InvalidRequestTypeError(
                name, f"logit_bias as a tuple must hold (id, bias) pairs, got {x!r}"
            ) from None
    if not isinstance(x, Mapping):
        raise InvalidRequestTypeError(
            name, f"logit_bias must be None or a dict of token id -> float, got {x!r}"
        )
    pairs = []
    for token, bias in x.items():
        if integer(name, token, "each logit_bias key (token id)") < 0:
            raise InvalidRequestError(
                name, f"logit_bias keys must be token ids >= 0, got {token!r}"
            )
        pairs.append((token, finite_float(name, bias, f"logit_bias[{token}]")))
    return tuple(sorted(pairs)) or None
