"""A model directory's config.json, generation_config.json and tokenizer files, read and
validated (the weights: ``loader.py``).

Every problem is refused with the file it is in and the field it concerns
(``errors.ModelConfigError``: ``path`` and ``key``), before a weight is read or a tensor
allocated: a directory or config.json that is missing, a file that is not a JSON object,
an unsupported architecture, a missing size, sizes that are not positive or do not fit
together, a ``dtype`` that is not a floating type this engine runs, eos ids that are not
token ids of the model's vocabulary.

**Which keys are required.** transformers' ``Qwen3Config`` gives every key a default, but
the ones that fix the tensors' shapes (``REQUIRED_FIELDS``) default to the sizes of one
particular large model (hidden 4096, 32 layers, a 151,936-token vocabulary, 32 KV heads,
head_dim 128): a config.json that omits one describes some other model, and the
mismatch would surface, if at all, as a misleading tensor-shape error. They are therefore
required, each named when missing. Every other key the model reads (``rms_norm_eps``,
``max_position_embeddings``, the rope parameters, ``tie_word_embeddings``,
``hidden_act``, ``attention_bias``) takes transformers' default, because the config is
parsed by transformers itself (``AutoConfig``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError

from paged_engine.errors import ModelConfigError
from paged_engine.models.qwen3 import check_supported_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TOKENIZER_JSON_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)
"""The tokenizer's JSON files besides tokenizer.json (which ``tokenizers`` parses itself),
each checked to be a JSON object before transformers reads it."""
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
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""Keys config.json must set: they fix the tensors' shapes (see the module docstring)."""
DTYPE_KEYS = ("dtype", "torch_dtype")
"""Where a config declares the checkpoint's dtype (``torch_dtype``: transformers < 4.56)."""
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
"""The declared dtypes this engine runs (``worker/devices.py``)."""


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
    raise ModelConfigError(
        str(config_path),
        f"unsupported model ({found}); supported architectures: {list(SUPPORTED_ARCHITECTURES)}",
        key="architectures" if archs else "model_type",
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_required(raw: Mapping[str, Any], config_path: Path) -> None:
    missing = [name for name in REQUIRED_FIELDS if name not in raw]
    if missing:
        raise ModelConfigError(
            str(config_path),
            f"missing {', '.join(missing)}: every key that fixes a tensor's shape must be "
            "set (transformers' defaults for them describe another model)",
            key=missing[0],
        )


def _check_dtype(raw: Mapping[str, Any], config_path: Path) -> None:
    """``dtype`` / ``torch_dtype``, when set, name a floating dtype this engine runs
    (transformers would look anything else up as a torch attribute: AttributeError)."""
    for key in DTYPE_KEYS:
        value = raw.get(key)
        if value is not None and value not in FLOAT_DTYPES:
            raise ModelConfigError(
                str(config_path),
                f"{key} must be one of {list(FLOAT_DTYPES)} (or absent), got {value!r}",
                key=key,
            )


def _check_sizes(values: Mapping[str, Any], config_path: Path) -> None:
    """The size fields present in ``values``, and the rules between fields that are."""
    where = str(config_path)
    for name in SIZE_FIELDS:
        if name in values and not (_is_int(values[name]) and values[name] >= 1):
            reason = f"{name} must be an int >= 1, got {values[name]!r}"
            raise ModelConfigError(where, reason, key=name)
    if "rms_norm_eps" in values:
        eps = values["rms_norm_eps"]
        if not (isinstance(eps, int | float) and not isinstance(eps, bool)) or not (
            0 < eps < math.inf
        ):
            reason = f"rms_norm_eps must be a number > 0, got {eps!r}"
            raise ModelConfigError(where, reason, key="rms_norm_eps")
    if "num_attention_heads" in values and "num_key_value_heads" in values:
        heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
        if heads % kv_heads:
            reason = (
                f"num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
            raise ModelConfigError(where, reason, key="num_key_value_heads")
    if "head_dim" in values and values["head_dim"] % 2:
        reason = f"head_dim must be even (rotary embedding), got {values['head_dim']}"
        raise ModelConfigError(where, reason, key="head_dim")


def head_dim(config: PretrainedConfig) -> int:
    """The attention head size: ``head_dim``, else ``hidden_size // num_attention_heads``."""
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The directory's config, validated; nothing else is read.

    Raises FileNotFoundError (no directory, no config.json) or ``ModelConfigError`` (a
    ValueError) naming the file and the key: not a JSON object, unsupported architecture
    or settings, a required key missing (``REQUIRED_FIELDS``), a size that is not an int
    >= 1, ``rms_norm_eps <= 0``, heads not a multiple of KV heads, a ``dtype`` that is not
    one of ``FLOAT_DTYPES``. The raw JSON is checked before transformers parses it (its
    validators name neither file nor, always, the field), and the parsed config again,
    defaults included.
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
    _check_required(raw, config_path)
    _check_sizes(raw, config_path)
    _check_dtype(raw, config_path)
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError, AttributeError, OSError, StrictDataclassError) as err:
        raise ModelConfigError(str(config_path), str(err)) from None
    parsed = {name: getattr(config, name, None) for name in (*SIZE_FIELDS, "rms_norm_eps")}
    parsed["head_dim"] = head_dim(config) if parsed["num_attention_heads"] else None
    _check_sizes(parsed, config_path)
    try:
        check_supported_config(config)
    except ValueError as err:
        raise ModelConfigError(str(config_path), str(err)) from None
    return config


def _eos_ids(value: object, source: Path, vocab_size: int) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    ids = [i for i in items if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    if not ids or len(ids) != len(items):
        reason = f"eos_token_id must be a token id or a list of them, got {value!r}"
        raise ModelConfigError(str(source), reason, key="eos_token_id")
    outside = [i for i in ids if i >= vocab_size]
    if outside:
        reason = (
            f"eos_token_id {outside} outside the model's vocabulary (vocab_size "
            f"{vocab_size}, in {source.parent / CONFIG_FILE}): no such token can be generated"
        )
        raise ModelConfigError(str(source), reason, key="eos_token_id")
    return tuple(ids)


def eos_token_ids(model_dir: str | Path, config: PretrainedConfig) -> tuple[int, ...] | None:
    """Every id that ends generation: generation_config.json's ``eos_token_id`` when the
    file exists and sets it (transformers' ``generate`` uses that one), else config.json's;
    None when neither sets one. Either may be one id or a list; each must be a token id
    of the model's vocabulary (``ModelConfigError`` naming the file otherwise).

    Where generation_config.json exists but sets no eos, transformers' ``generate`` stops
    at none; config.json's is used here instead, so that a declared eos still ends a
    request."""
    path = Path(model_dir)
    vocab_size = int(config.vocab_size)
    generation_path = path / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        value = read_json_object(generation_path).get("eos_token_id")
        if value is not None:
            return _eos_ids(value, generation_path, vocab_size)
    value = getattr(config, "eos_token_id", None)
    return None if value is None else _eos_ids(value, path / CONFIG_FILE, vocab_size)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None when it has no tokenizer files.

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
            path, local_files_only=True
        )
    except (ValueError, TypeError, KeyError, AttributeError, OSError, json.JSONDecodeError) as err:
        reason = f"the tokenizer cannot be loaded: {type(err).__name__}: {err}"
        raise ModelConfigError(str(path), reason) from err
    return tokenizer
