"""Which model class serves a checkpoint, keyed by config.json's ``architectures`` (as
vLLM's registry is): the families here share one decoder (``layers/decoder.py``) and
differ in a few switches, each family's file saying which.

Architectures that are known but not run are refused with the reason, before any weight
is read, rather than with a generic "unsupported"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from paged_engine.layers.decoder import DecoderForCausalLM
from paged_engine.models.llama import LlamaForCausalLM
from paged_engine.models.mistral import MistralForCausalLM
from paged_engine.models.qwen2 import Qwen2ForCausalLM
from paged_engine.models.qwen3 import Qwen3ForCausalLM

__all__ = [
    "MODELS",
    "MODEL_TYPES",
    "REFUSED",
    "REQUIRED_KEYS",
    "SHAPE_KEYS",
    "class_for_config",
    "model_class",
]

MODELS: Mapping[str, type[DecoderForCausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
    }
)
"""The architectures served, each by its family's class."""

MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    | {"qwen3": "Qwen3ForCausalLM"}
)
"""A config that lists no ``architectures`` is taken by its ``model_type``."""

SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
"""The sizes every family's tensors take their shapes from (``model_config.SIZE_FIELDS``
extends them: one list, so a size required here is also checked there)."""
REQUIRED_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "LlamaForCausalLM": SHAPE_KEYS,
        "MistralForCausalLM": SHAPE_KEYS,
        "Qwen2ForCausalLM": SHAPE_KEYS,
        "Qwen3ForCausalLM": (*SHAPE_KEYS, "head_dim"),
    }
)
"""Keys config.json must set because they fix tensor shapes and transformers' defaults
for them describe one particular large model. ``head_dim`` is required for Qwen3 only:
Qwen3Config defaults it to 128 whatever the hidden size, where the other families derive
it as ``hidden_size // num_attention_heads``."""

REFUSED: Mapping[str, str] = MappingProxyType(
    {
        "Gemma2ForCausalLM": "interleaved sliding-window layers and logit soft-capping",
        "Gemma3ForCausalLM": "interleaved sliding-window layers",
        "MixtralForCausalLM": "mixture-of-experts MLPs",
        "Qwen2MoeForCausalLM": "mixture-of-experts MLPs",
        "Qwen3MoeForCausalLM": "mixture-of-experts MLPs",
    }
)
"""Known architectures that are not run, and what they need that is not here."""


def architecture_of(architectures: Sequence[str], model_type: object) -> str | None:
    """The served architecture a config names (the first listed that is served), or
    its ``model_type``'s when it lists none; None when neither is served."""
    served = [a for a in architectures if a in MODELS]
    if served:
        return served[0]
    if not architectures and isinstance(model_type, str):
        return MODEL_TYPES.get(model_type)
    return None


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class for a served architecture; ValueError naming the reason otherwise."""
    if architecture in MODELS:
        return MODELS[architecture]
    reason = REFUSED.get(architecture, "not implemented here")
    raise ValueError(
        f"architecture {architecture!r} is not supported ({reason}); supported: {list(MODELS)}"
    )


def class_for_config(config: Any) -> type[DecoderForCausalLM]:
    """The class for a parsed config (``architectures``, else ``model_type``)."""
    archs = list(getattr(config, "architectures", None) or [])
    found = architecture_of(archs, getattr(config, "model_type", None))
    return model_class(found if found is not None else (archs or ["?"])[0])
