"""A model directory's config.json (and generation_config.json), read and validated.

Every problem is refused with the file it is in and the field it concerns, before a
weight is read or a tensor allocated: a directory or config.json that is missing, a file
that is not a JSON object, an unsupported architecture, sizes that are not positive or do
not fit together, eos ids that are not token ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError

from paged_engine.models.qwen3 import check_supported_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
"""Fields that must be ints >= 1."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def _check_architecture(raw: Mapping[str, Any], config_path: Path) -> None:
    """The listed architectures decide (a ``Qwen3ForSequenceClassification`` checkpoint has
    model_type "qwen3" but no LM head); model_type "qwen3" is accepted only when the
    config lists no architectures at all."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if isinstance(archs, list) and any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    if not archs and model_type == "qwen3":
        return
    found = f"architectures {archs}" if archs else f"model_type {model_type!r}"
    raise ValueError(
        f"{config_path.parent}: unsupported model ({found}); supported architectures: "
        f"{list(SUPPORTED_ARCHITECTURES)}"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(values: Mapping[str, Any], config_path: Path) -> None:
    """The size fields present in ``values``, and the rules between fields that are."""
    for name in SIZE_FIELDS:
        if name in values and not (_is_int(values[name]) and values[name] >= 1):
            raise ValueError(f"{config_path}: {name} must be an int >= 1, got {values[name]!r}")
    if "rms_norm_eps" in values:
        eps = values["rms_norm_eps"]
        if not (isinstance(eps, int | float) and not isinstance(eps, bool)) or not (
            0 < eps < math.inf
        ):
            raise ValueError(f"{config_path}: rms_norm_eps must be a number > 0, got {eps!r}")
    if "num_attention_heads" in values and "num_key_value_heads" in values:
        heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
        if heads % kv_heads:
            raise ValueError(
                f"{config_path}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
    if "head_dim" in values and values["head_dim"] % 2:
        raise ValueError(
            f"{config_path}: head_dim must be even (rotary embedding), got {values['head_dim']}"
        )


def head_dim(config: PretrainedConfig) -> int:
    """The attention head size: ``head_dim``, else ``hidden_size // num_attention_heads``."""
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The directory's config, validated; nothing else is read.

    Raises FileNotFoundError (no directory, no config.json) or ValueError naming the file
    and the field (not a JSON object, unsupported architecture or settings, a size that is
    not an int >= 1, ``rms_norm_eps <= 0``, heads not a multiple of KV heads). The raw
    JSON is checked before transformers parses it (its validators name neither file nor,
    always, the field), and the parsed config again, defaults included.
    """
    from transformers import AutoConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json ({config_path} is missing)")
    raw = read_json_object(config_path)
    _check_architecture(raw, config_path)
    _check_sizes(raw, config_path)
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError, OSError, StrictDataclassError) as err:
        raise ValueError(f"{config_path}: {err}") from None
    parsed = {name: getattr(config, name, None) for name in (*SIZE_FIELDS, "rms_norm_eps")}
    parsed["head_dim"] = head_dim(config) if parsed["num_attention_heads"] else None
    _check_sizes(parsed, config_path)
    try:
        check_supported_config(config)
    except ValueError as err:
        raise ValueError(f"{config_path}: {err}") from None
    return config


def _eos_ids(value: object, source: Path) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(
            f"{source}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return tuple(ids)


def eos_token_ids(model_dir: str | Path, config: PretrainedConfig) -> tuple[int, ...] | None:
    """Every id that ends generation: generation_config.json's ``eos_token_id`` when the
    file exists and sets it (transformers' ``generate`` uses that one), else config.json's;
    None when neither sets one. Either may be one id or a list.

    Where generation_config.json exists but sets no eos, transformers' ``generate`` stops
    at none; config.json's is used here instead, so that a declared eos still ends a
    request."""
    path = Path(model_dir)
    generation_path = path / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        value = read_json_object(generation_path).get("eos_token_id")
        if value is not None:
            return _eos_ids(value, generation_path)
    value = getattr(config, "eos_token_id", None)
    return None if value is None else _eos_ids(value, path / CONFIG_FILE)
