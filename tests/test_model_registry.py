"""The model registry and the options each family refuses: every refusal names the option
(or architecture) and comes before any weight is read; llama3 rotary frequencies equal
transformers' bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine.errors import ModelConfigError
from paged_engine.layers.rotary import RotaryEmbedding, rope_spec_from_config
from paged_engine.models.registry import MODELS, class_for_config, model_class
from paged_engine.utils import loader
from paged_engine.utils.model_config import load_config
from paged_engine.utils.tiny_model import make_tiny_model

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""Llama 3.1's own values."""


class _Config:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_inverse_frequencies_equal_transformers(head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=dict(LLAMA3)
    )
    theirs, factor = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = RotaryEmbedding(head_dim, rope_spec_from_config(config)).inv_freq
    assert factor == 1.0
    assert torch.equal(ours, theirs)
    plain = RotaryEmbedding(
        head_dim,
        rope_spec_from_config(
            LlamaConfig(
                hidden_size=head_dim * 4,
                num_attention_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            )
        ),
    ).inv_freq
    assert not torch.equal(ours, plain)  # the scaling changed something


@pytest.mark.parametrize(
    "missing", ["factor", "low_freq_factor", "original_max_position_embeddings"]
)
def test_llama3_without_a_parameter_is_refused_by_name(missing: str) -> None:
    """As a config carries them (transformers' own parse fills some from other keys)."""
    params = {k: v for k, v in LLAMA3.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        rope_spec_from_config(_Config(rope_parameters=params))


def test_the_registry_serves_four_families() -> None:
    assert sorted(MODELS) == [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ]
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM.*interleaved sliding-window"):
        model_class("Gemma3ForCausalLM")
    with pytest.raises(ValueError, match=r"'FalconForCausalLM' is not supported"):
        model_class("FalconForCausalLM")


def test_a_config_without_architectures_is_taken_by_model_type() -> None:
    assert (
        class_for_config(_Config(architectures=None, model_type="qwen2"))
        is MODELS["Qwen2ForCausalLM"]
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        class_for_config(_Config(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


# ---- refusals on model directories: named, and before any weight is read ----------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("llama") / "m", seed=5, architecture="LlamaForCausalLM"
    )


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    read: list[object] = []

    def record(*args: Any) -> Any:
        read.append(args)
        raise AssertionError("weight files were read before the refusal")

    monkeypatch.setattr(loader, "_weight_files", record)
    return read


def with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "sliding_window": 64,
            },
            "sliding_window=64",
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 64,
            },
            "use_sliding_window",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "mixture-of-experts"),
    ],
)
def test_an_unsupported_option_is_named_before_any_weight_is_read(
    llama_dir: Path,
    tmp_path: Path,
    no_weights: list[object],
    changes: dict[str, Any],
    named: str,
) -> None:
    path = with_config(llama_dir, tmp_path / "m", **changes)
    before = (path / "config.json").read_bytes()
    with pytest.raises(ModelConfigError, match=named) as err:
        loader.load_model(path, device=torch.device("cpu"), dtype=torch.float32, backend=None)  # type: ignore[arg-type]
    assert err.value.path == str(path / "config.json")
    assert no_weights == []
    assert (path / "config.json").read_bytes() == before


def test_llama_derives_head_dim_where_qwen3_requires_it(llama_dir: Path, tmp_path: Path) -> None:
    """transformers' Llama derives head_dim from hidden / heads, so config.json may omit
    it; Qwen3Config would default it to 128 whatever the shapes, so there it is required."""
    path = with_config(llama_dir, tmp_path / "llama", head_dim=None)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("head_dim")
    (path / "config.json").write_text(json.dumps(raw))
    assert load_config(path).head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    raw["architectures"], raw["model_type"] = ["Qwen3ForCausalLM"], "qwen3"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="missing head_dim"):
        load_config(path)
