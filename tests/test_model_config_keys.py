"""config.json's keys: every key that fixes a tensor's shape is required and named when
missing; every other key the model reads takes exactly transformers' default
(``Qwen3Config``); a declared dtype must be one this engine runs; every eos id must be a
token of the model's vocabulary. Each refusal is a ``ModelConfigError`` naming the file
and the key, raised before any model is built, and the directory is left as it was.
Sizes out of range, files that are not JSON: tests/test_model_dirs.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM
from paged_engine.errors import ModelConfigError
from paged_engine.models.registry import REQUIRED_KEYS
from paged_engine.utils.model_config import load_config
from tests.test_model_dirs import copy_with, no_weights  # noqa: F401 - no_weights is a fixture

SMALL = {"num_kvcache_blocks": 16, "max_model_len": 64}
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""Written out here, not read from the code: the keys a Qwen3 checkpoint's tensor shapes
depend on (embed/head: vocab x hidden; q/k/v/o: heads x head_dim; MLP: intermediate)."""
DEFAULTED_KEYS = (
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
    "use_sliding_window",
)
"""Keys the model reads whose absence takes transformers' default."""


def refused(path: Path, key: str, file: str = "config.json") -> ModelConfigError:
    """Both ways in refuse ``path`` naming ``file`` and ``key``; the error."""
    errors = []
    for build in (load_config, lambda p: LLM(p, **SMALL)):
        with pytest.raises(ModelConfigError) as err:
            build(path)
        assert err.value.path == str(path / file) and err.value.key == key, err.value
        assert str(path / file) in str(err.value) and key in str(err.value)
        errors.append(err.value)
    return errors[0]


def test_the_required_keys_are_the_shape_keys() -> None:
    assert set(REQUIRED_KEYS["Qwen3ForCausalLM"]) == set(SHAPE_KEYS)


@pytest.mark.parametrize("key", SHAPE_KEYS)
def test_a_missing_shape_key_is_named(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_weights: list[object],  # noqa: F811
    key: str,
) -> None:
    """Before the fix hidden_size, vocab_size and the others silently took Qwen3Config's
    defaults (4096, 151936, ...), a model of other shapes than the checkpoint's."""
    from transformers import Qwen3Config

    assert key in Qwen3Config().to_dict()  # transformers would have defaulted it
    path = copy_with(tiny_model_dir, tmp_path / "m", **{key: None})
    before = (path / "config.json").read_bytes()
    error = refused(path, key)
    assert f"missing {key}" in str(error)
    assert no_weights == []
    assert (path / "config.json").read_bytes() == before


def test_two_missing_keys_are_both_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = copy_with(tiny_model_dir, tmp_path / "m", hidden_size=None, head_dim=None)
    with pytest.raises(ModelConfigError, match="missing hidden_size, head_dim"):
        load_config(path)


@pytest.mark.parametrize("key", DEFAULTED_KEYS)
def test_other_keys_default_exactly_as_transformers(
    tiny_model_dir: Path, tmp_path: Path, key: str
) -> None:
    from transformers import Qwen3Config

    path = copy_with(tiny_model_dir, tmp_path / "m", **{key: None})
    assert key not in json.loads((path / "config.json").read_text())
    assert getattr(load_config(path), key) == getattr(Qwen3Config(), key)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["float7", "int8", "torch.float32", 5, ["float32"]])
def test_a_dtype_that_is_not_a_floating_type_is_named(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_weights: list[object],  # noqa: F811
    key: str,
    value: Any,
) -> None:
    """Before the fix ``"dtype": "float7"`` raised AttributeError (transformers looked
    ``torch.float7`` up) and ``torch_dtype`` was not checked at all."""
    path = copy_with(tiny_model_dir, tmp_path / "m", **{key: value})
    error = refused(path, key)
    assert repr(value) in str(error)
    assert no_weights == []


@pytest.mark.parametrize("value", ["float32", "float16", "bfloat16"])
def test_the_floating_dtypes_are_accepted(tiny_model_dir: Path, tmp_path: Path, value: str) -> None:
    path = copy_with(tiny_model_dir, tmp_path / "m", dtype=None, torch_dtype=value)
    assert load_config(path).vocab_size == 768


# ---------------------------------------------------------------------------- eos ids

VOCAB = 768  # the tiny model's


@pytest.mark.parametrize(
    ("file", "eos"),
    [
        ("config.json", VOCAB),
        ("config.json", [0, VOCAB + 5]),
        ("generation_config.json", 10**6),
        ("generation_config.json", [0, VOCAB]),
    ],
)
def test_an_eos_id_outside_the_vocabulary_is_named(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_weights: list[object],  # noqa: F811
    file: str,
    eos: object,
) -> None:
    """Before the fix these were accepted: an id the model can never generate, which
    ``min_tokens`` masking would index past the logits with."""
    path = shutil.copytree(tiny_model_dir, tmp_path / "m")
    if file == "generation_config.json":
        gen = json.loads((path / file).read_text())
        (path / file).write_text(json.dumps({**gen, "eos_token_id": eos}))
    else:
        (path / "generation_config.json").unlink()  # else it would decide
        cfg = json.loads((path / file).read_text())
        (path / file).write_text(json.dumps({**cfg, "eos_token_id": eos}))
    with pytest.raises(ModelConfigError, match="outside the model's vocabulary") as err:
        LLM(path, **SMALL)
    assert err.value.path == str(path / file) and err.value.key == "eos_token_id"
    assert str(VOCAB) in str(err.value)
    assert no_weights == []


def test_a_tokenizer_eos_outside_the_vocabulary_is_named(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_weights: list[object],  # noqa: F811
) -> None:
    """Neither config sets an eos, so the tokenizer's is the fallback; here the model's
    vocabulary (700) is smaller than the tokenizer's and its eos token is id 750."""
    from transformers import AutoTokenizer

    path = copy_with(tiny_model_dir, tmp_path / "m", eos_token_id=None, vocab_size=700)
    (path / "generation_config.json").unlink()
    token = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(750)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": token}))
    with pytest.raises(ModelConfigError, match="id 750, outside the model's vocabulary") as err:
        LLM(path, **SMALL)
    assert err.value.path == str(path / "tokenizer_config.json")
    assert no_weights == []
