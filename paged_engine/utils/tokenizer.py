"""A model directory's tokenizer, read and validated: its JSON files and ``tokenizer.json``
are checked before transformers reads them, so that a broken one is refused naming the file
(``errors.ModelConfigError``) rather than with transformers' bare ``KeyError`` or
``JSONDecodeError``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from paged_engine.errors import ModelConfigError
from paged_engine.utils.json_file import read_json_object

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["TOKENIZER_FILES", "TOKENIZER_JSON_FILES", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these makes a directory one with a tokenizer."""
TOKENIZER_JSON_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)
"""The tokenizer's JSON files besides tokenizer.json (which ``tokenizers`` parses itself),
each checked to be a JSON object before transformers reads it."""


def load_tokenizer(
    model_dir: str | Path, config: PretrainedConfig | None = None
) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None when it has no tokenizer files. ``config`` is
    the directory's model config when it was read already (``ModelConfig``): transformers
    then chooses the tokenizer's class from it instead of parsing config.json again.

    A tokenizer that cannot be read is refused with ``ModelConfigError`` naming the file
    (its JSON files, and ``tokenizer.json`` parsed by ``tokenizers``, are checked first:
    the errors transformers raises for them, ``UnicodeDecodeError``, ``KeyError``,
    ``JSONDecodeError``, name none), else the directory."""
    path = Path(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    for name in TOKENIZER_JSON_FILES:
        if (path / name).is_file():
            read_json_object(path / name)
    if (path / "tokenizer.json").is_file():
        try:
            Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as err:  # tokenizers raises its own untyped Exception
            reason = f"is not a tokenizers file: {err}"
            raise ModelConfigError(str(path / "tokenizer.json"), reason) from err
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, config=config, local_files_only=True
        )
    except (ValueError, TypeError, KeyError, AttributeError, OSError, json.JSONDecodeError) as err:
        reason = f"the tokenizer cannot be loaded: {type(err).__name__}: {err}"
        raise ModelConfigError(str(path), reason) from err
    return tokenizer
