"""Llama 3.1's rotary scaling from a GGUF file: llama.cpp stores it as
``rope_freqs.weight`` (one divisor per frequency), not as parameters. The conversion
recovers the parameters, so the served rotation is transformers' llama3 rotation; divisors
that no Llama 3 scaling gives are refused, naming the tensor. The divisors written here
come from transformers' own llama3 frequencies, not from the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paged_engine.errors import ModelConfigError
from paged_engine.layers.rotary import RotaryEmbedding, rope_spec_from_config
from paged_engine.utils import gguf_convert
from paged_engine.utils.model_config import load_config
from tests.test_gguf import _add, _finish, _gguf_name, _llama_cpp_rows, _writer, tiny_model

pytest.importorskip("gguf")

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,  # the tiny files' freq_base
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""With head_dim 16 and theta 1e4 the wavelengths run from 6 to 2e4 positions: some are
kept (below 2048), some divided by 8 (above 8192), one blended."""


def transformers_llama3_inv_freq() -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=dict(LLAMA3)
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    return inv_freq


def default_inv_freq() -> torch.Tensor:
    exponents = torch.arange(0, 16, 2, dtype=torch.int64).float() / 16
    return 1.0 / (LLAMA3["rope_theta"] ** exponents)


def write_with_freqs(path: Path, divisors: np.ndarray) -> Path:
    model = tiny_model("llama")
    w = _writer(path, "llama")
    for hf_name, t in model.state_dict().items():
        name, a = _gguf_name(hf_name), t.detach().float().numpy()
        if ".attn_q." in name:
            a = _llama_cpp_rows(a, 4)
        elif ".attn_k." in name:
            a = _llama_cpp_rows(a, 2)
        _add(w, name, a, "F32")
    _add(w, "rope_freqs.weight", divisors.astype(np.float32), "F32")
    _finish(w)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_llama3_scaling_is_recovered_from_the_divisors(tmp_path: Path, cache: Path) -> None:
    theirs = transformers_llama3_inv_freq()
    divisors = (default_inv_freq() / theirs).numpy()
    assert len({round(float(d), 3) for d in divisors}) >= 3  # kept, blended and divided
    out = gguf_convert.resolve_model_path(write_with_freqs(tmp_path / "l3.gguf", divisors))
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_parameters"] == pytest.approx(LLAMA3)
    ours = RotaryEmbedding(16, rope_spec_from_config(load_config(out))).inv_freq
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)


def test_all_ones_means_no_scaling(tmp_path: Path, cache: Path) -> None:
    out = gguf_convert.resolve_model_path(write_with_freqs(tmp_path / "d.gguf", np.ones(8)))
    assert rope_spec_from_config(load_config(out)).rope_type == "default"


@pytest.mark.parametrize(
    "divisors", [np.linspace(1.0, 3.0, 8), np.ones(4)], ids=["not-llama3", "wrong-length"]
)
def test_other_divisors_are_refused_naming_the_tensor(
    tmp_path: Path, cache: Path, divisors: Any
) -> None:
    path = write_with_freqs(tmp_path / "x.gguf", divisors)
    with pytest.raises(ModelConfigError, match=r"rope_freqs\.weight") as err:
        gguf_convert.resolve_model_path(path)
    assert err.value.key == "rope_freqs.weight"
    assert not any(cache.rglob("config.json"))
