"""The one reader of a model directory's JSON files (config.json, generation_config.json,
the tokenizer's, the weights' index): a file that is not a JSON object is refused naming
the file, before transformers or the loader would fail on it without a name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paged_engine.errors import ModelConfigError

__all__ = ["read_json_object"]


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``ModelConfigError`` naming the file when it is not
    one (not UTF-8, not JSON, not an object)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ModelConfigError(str(path), f"is not UTF-8 text: {err}") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(str(path), f"is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        reason = f"must hold a JSON object, not a {type(value).__name__}"
        raise ModelConfigError(str(path), reason)
    return value
