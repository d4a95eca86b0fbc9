"""Checkpoint loading: shards, tied/untied heads, every clear error, the tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_engine.layers.attention import TorchAttentionBackend
from paged_engine.models.qwen3 import Qwen3ForCausalLM
from paged_engine.utils.loader import load_model
from paged_engine.utils.tiny_model import make_tiny_model
from paged_engine.utils.tokenizer import load_tokenizer

CPU = torch.device("cpu")


def load(path: Path, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    model, _ = load_model(path, device=CPU, dtype=dtype, backend=TorchAttentionBackend())
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "tied": make_tiny_model(root / "tied", seed=1),
        "tied_sharded": make_tiny_model(root / "tied_sharded", seed=1, num_shards=3),
        "untied": make_tiny_model(root / "untied", seed=1, tie_word_embeddings=False),
        "untied_sharded": make_tiny_model(
            root / "untied_sharded", seed=1, tie_word_embeddings=False, num_shards=2
        ),
    }


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def editable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model.safetensors"))


# ----------------------------------------------------------------------------- loading


def test_tiny_model_files(models: dict[str, Path]) -> None:
    assert [p.name for p in sorted(models["tied_sharded"].glob("*.safetensors"))] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    assert (models["tied_sharded"] / "model.safetensors.index.json").is_file()
    assert [p.name for p in models["tied"].glob("*.safetensors")] == ["model.safetensors"]
    assert "lm_head.weight" not in checkpoint(models["tied"])
    assert "lm_head.weight" in checkpoint(models["untied"])


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_fused_parameters_hold_the_checkpoint_shards(models: dict[str, Path], tie: str) -> None:
    model = load(models[tie])
    tensors = checkpoint(models[tie])
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q_rows, kv_rows = 4 * 16, 2 * 16
    qkv = attn.qkv_proj.weight
    prefix = "model.layers.1."
    assert torch.equal(qkv[:q_rows], tensors[prefix + "self_attn.q_proj.weight"])
    assert torch.equal(qkv[q_rows : q_rows + kv_rows], tensors[prefix + "self_attn.k_proj.weight"])
    assert torch.equal(qkv[q_rows + kv_rows :], tensors[prefix + "self_attn.v_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[:128], tensors[prefix + "mlp.gate_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[128:], tensors[prefix + "mlp.up_proj.weight"])
    assert torch.equal(attn.k_norm.weight, tensors[prefix + "self_attn.k_norm.weight"])
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])


def test_sharded_loads_the_same_weights_as_unsharded(models: dict[str, Path]) -> None:
    for single, sharded in (("tied", "tied_sharded"), ("untied", "untied_sharded")):
        a = dict(load(models[single]).named_parameters())
        b = dict(load(models[sharded]).named_parameters())
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_tied_and_untied_heads(models: dict[str, Path]) -> None:
    tied = load(models["tied"])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = load(models["untied"])
    tensors = checkpoint(models["untied"])
    assert torch.equal(untied.lm_head.weight, tensors["lm_head.weight"])
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_tied_checkpoint_may_carry_lm_head_and_inv_freq(
    models: dict[str, Path], tmp_path: Path
) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    tensors = checkpoint(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    rewrite_weights(path, tensors)
    assert torch.equal(load(path).lm_head.weight, tensors["model.embed_tokens.weight"])


def test_bfloat16_load(models: dict[str, Path]) -> None:
    model = load(models["tied"], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after loading


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    a = checkpoint(make_tiny_model(tmp_path / "a", seed=5))
    b = checkpoint(make_tiny_model(tmp_path / "b", seed=5))
    c = checkpoint(make_tiny_model(tmp_path / "c", seed=6))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)


# ------------------------------------------------------------------------------ errors


def test_missing_tensor_is_named(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    tensors = checkpoint(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    rewrite_weights(path, tensors)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(path)


def test_missing_untied_head_is_named(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["untied"], tmp_path / "m")
    tensors = checkpoint(path)
    del tensors["lm_head.weight"]
    rewrite_weights(path, tensors)
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        load(path)


def test_shape_mismatch_names_tensor_and_both_shapes(
    models: dict[str, Path], tmp_path: Path
) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    tensors = checkpoint(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(127, 64)
    rewrite_weights(path, tensors)
    with pytest.raises(ValueError) as err:
        load(path)
    message = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight" in message
    assert "(128, 64)" in message and "(127, 64)" in message


def test_shape_mismatch_in_unfused_tensor(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    tensors = checkpoint(path)
    tensors["model.norm.weight"] = torch.ones(65)
    rewrite_weights(path, tensors)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(64,\).*\(65,\)"):
        load(path)


def test_unexpected_tensor_is_named(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    tensors = checkpoint(path)
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    rewrite_weights(path, tensors)
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.self_attn\.extra_proj"):
        load(path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load(tmp_path / "nowhere")


def test_missing_config(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load(path)


def test_unsupported_architecture(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    config["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen3"):
        load(path)


def test_a_known_unrun_architecture_is_refused_with_its_reason(
    models: dict[str, Path], tmp_path: Path
) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    config["model_type"] = "gemma3_text"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM \(interleaved sliding-window"):
        load(path)


def test_a_llama_config_over_qwen3_weights_is_refused_by_tensor_name(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The architecture picks the class: Llama has no q/k norms, so Qwen3's are named."""
    path = editable_copy(models["tied"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unexpected tensor.*self_attn\.k_norm\.weight"):
        load(path)


def test_qwen3_type_with_other_head_is_rejected(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification"):
        load(path)


def test_unsupported_rope_type(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        load(path)


def test_no_safetensors(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(path)


def test_index_naming_a_missing_shard(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied_sharded"], tmp_path / "m")
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003\.safetensors"):
        load(path)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips(models: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(models["tied"])
    assert tokenizer is not None
    text = "The quick brown fox jumps over 13 lazy dogs. Ünïcode — 你好!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges happened
    config = json.loads((models["tied"] / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.eos_token_id == 0
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"


def test_no_tokenizer_files_gives_none(models: dict[str, Path], tmp_path: Path) -> None:
    path = editable_copy(models["tied"], tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    assert load_tokenizer(path) is None
