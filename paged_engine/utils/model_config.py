"""A model directory's config.json and generation_config.json, read and validated once into
a ``ModelConfig`` that is handed down (the tokenizer: ``tokenizer.py``; the weights:
``loader.py``).

Every problem is refused with the file it is in and the field it concerns
(``errors.ModelConfigError``: ``path`` and ``key``), before a weight is read or a tensor
allocated: a directory or config.json that is missing, a file that is not a JSON object,
an unsupported architecture, a missing size, sizes that are not positive or do not fit
together, a ``dtype`` that is not a floating type this engine runs, eos ids that are not
token ids of the model's vocabulary.

**Which keys are required.** transformers' configs give every key a default, but the
ones that fix the tensors' shapes (``registry.REQUIRED_KEYS``, per architecture) default
to the sizes of one
particular large model (hidden 4096, 32 layers, a 151,936-token vocabulary, 32 KV heads,
head_dim 128): a config.json that omits one describes some other model, and the
mismatch would surface, if at all, as a misleading tensor-shape error. They are therefore
required, each named when missing. Every other key the model reads (``rms_norm_eps``,
``max_position_embeddings``, the rope parameters, ``tie_word_embeddings``,
``hidden_act``, ``attention_bias``) takes transformers' default, because the config is
parsed by transformers itself (``AutoConfig``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError

from paged_engine.errors import ModelConfigError
from paged_engine.models.registry import (
    MODELS,
    REFUSED,
    REQUIRED_KEYS,
    SHAPE_KEYS,
    architecture_of,
    model_class,
)
from paged_engine.utils.json_file import read_json_object

__all__ = ["ModelConfig", "eos_token_ids", "head_dim", "load_config"]

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SUPPORTED_ARCHITECTURES = tuple(MODELS)
SIZE_FIELDS = (*SHAPE_KEYS, "head_dim", "max_position_embeddings")
"""Fields that must be ints >= 1 where a config sets them: the shape keys
(``registry.SHAPE_KEYS``), ``head_dim`` and ``max_position_embeddings``."""
DTYPE_KEYS = ("dtype", "torch_dtype")
"""Where a config declares the checkpoint's dtype (``torch_dtype``: transformers < 4.56)."""
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
"""The declared dtypes this engine runs (``worker/devices.py``)."""


def _check_architecture(raw: Mapping[str, Any], config_path: Path) -> str:
    """The served architecture this config names (``registry.architecture_of``: the listed
    architectures decide, since a ``Qwen3ForSequenceClassification`` checkpoint has
    model_type "qwen3" but no LM head; ``model_type`` only when none is listed)."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        reason = f"architectures must be a list of names, got {archs!r}"
        raise ModelConfigError(str(config_path), reason, key="architectures")
    found = architecture_of(archs, model_type)
    if found is not None:
        return found
    refused = [f"{a} ({REFUSED[a]})" for a in archs if a in REFUSED]
    named = f"architectures {archs}" if archs else f"model_type {model_type!r}"
    if refused:
        named = f"architecture {', '.join(refused)}"
    raise ModelConfigError(
        str(config_path),
        f"unsupported model ({named}); supported architectures: {list(MODELS)}",
        key="architectures" if archs else "model_type",
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_required(raw: Mapping[str, Any], config_path: Path, architecture: str) -> None:
    missing = [name for name in REQUIRED_KEYS[architecture] if name not in raw]
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
    or settings, a required key missing (``registry.REQUIRED_KEYS``), a size that is not an int
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
    architecture = _check_architecture(raw, config_path)
    _check_required(raw, config_path, architecture)
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
        model_class(architecture).check_supported_config(config)
    except ValueError as err:
        raise ModelConfigError(str(config_path), str(err)) from None
    config.architectures = [architecture]  # the one served, whichever way it was named
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


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A model directory's configuration, read and validated once (``load``) and handed
    down: ``LLM`` reads it, the model runner builds the model and its KV pool from it, and
    each tensor-parallel worker gets it pickled in its spec. No rank reads config.json
    again, so every rank runs the config that was validated, even if the file changes
    while they start.

    ``hf_config`` is transformers' parse of config.json (what the model's modules read);
    ``eos_token_ids`` are the ids that end generation by the directory's own files
    (``eos_token_ids``: generation_config.json's, else config.json's), None when neither
    sets one."""

    model_dir: Path
    hf_config: PretrainedConfig
    eos_token_ids: tuple[int, ...] | None

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        """Read and validate config.json and generation_config.json (``load_config``,
        ``eos_token_ids``: their errors); no weight is read."""
        path = Path(model_dir)
        hf_config = load_config(path)
        return cls(path, hf_config, eos_token_ids(path, hf_config))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def head_dim(self) -> int:
        return head_dim(self.hf_config)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.max_position_embeddings)

    @property
    def checkpoint_dtype(self) -> object:
        """The dtype config.json declares (a name or a ``torch.dtype``), None if none."""
        return getattr(self.hf_config, "dtype", None)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a longer context than the model was built for, as vLLM does."""
        max_pos = self.max_position_embeddings
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={max_pos} (in {self.model_dir / CONFIG_FILE}): "
                f"lower max_model_len to at most {max_pos}"
            )
