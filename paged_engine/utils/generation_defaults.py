"""The model's own sampling defaults, from its generation_config.json, as vLLM takes them.

vLLM's ``LLM.get_default_sampling_params()`` (and ``generate`` / ``chat`` without params)
starts from the sampling values the model's authors put in generation_config.json:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` as ``max_tokens``; every other key (``do_sample`` included) is left
out, as vLLM leaves it. Why from the file: an instruct model tuned for, say,
temperature 0.6 and top_p 0.95 degrades under plain defaults.

vLLM reads the file through transformers' ``GenerationConfig.to_diff_dict()``; with
transformers 5 (installed here) every value the file sets survives it, so every set,
non-null key counts. (Builds on transformers 4 also dropped values equal to its old
defaults, such as ``top_k: 50``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged_engine.errors import InvalidRequestError, ModelConfigError
from paged_engine.sampling_params import SamplingParams
from paged_engine.utils.json_file import read_json_object

GENERATION_CONFIG_FILE = "generation_config.json"

SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json's key -> the ``SamplingParams`` field it sets (vLLM's list)."""


def default_sampling_values(model_dir: str | Path) -> dict[str, Any]:
    """The ``SamplingParams`` fields the directory's generation_config.json sets (empty
    without the file or those keys). A value ``SamplingParams`` refuses is a
    ``ModelConfigError`` naming the file and the key."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    raw = read_json_object(path)
    values = {ours: raw[key] for key, ours in SAMPLING_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**values)
    except InvalidRequestError as err:
        key = next((k for k, ours in SAMPLING_KEYS.items() if ours == err.field), err.field)
        raise ModelConfigError(str(path), f"{key}: {err.reason}", key=key) from None
    return values


__all__ = ["SAMPLING_KEYS", "default_sampling_values"]
