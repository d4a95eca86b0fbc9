"""Model directories: config.json and the weight files are validated, every error names
its file and field, and everything is refused before a weight is read; eos lists; the
model's max_position_embeddings bounds max_model_len."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import paged_engine.utils.loader as loader
import paged_engine.worker.model_runner as model_runner
from paged_engine import LLM, SamplingParams
from paged_engine.layers.attention import TorchAttentionBackend
from tests.hf_oracle import HFOracle

CPU = torch.device("cpu")
GARBAGE = b"\x93 this is not a safetensors file \x00\xff" * 8


def load(path: Path) -> Any:
    return loader.load_model(path, device=CPU, dtype=torch.float32, backend=TorchAttentionBackend())


def copy_with(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of ``src`` whose config.json has ``changes`` applied (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record any model construction (meta or real) or weight loading through LLM."""
    calls: list[object] = []

    def recording(name: str) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            calls.append(name)
            raise AssertionError(f"{name} called before the bad input was refused")

        return record

    model_class = recording("the model class")
    monkeypatch.setattr(loader, "class_for_config", lambda config: model_class)
    monkeypatch.setattr(model_runner, "load_model", recording("load_model"))
    return calls


# ------------------------------------------------------------------------- config.json


BAD_FIELDS = [
    ("hidden_size", 0, "hidden_size"),
    ("hidden_size", -64, "hidden_size"),
    ("hidden_size", "64", "hidden_size"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("num_key_value_heads", 0, "num_key_value_heads"),
    (
        "num_key_value_heads",
        3,
        "num_attention_heads (4) must be a multiple of num_key_value_heads (3)",
    ),
    ("head_dim", 0, "head_dim"),
    ("head_dim", -16, "head_dim"),
    ("head_dim", 15, "head_dim"),  # rotary embedding needs an even head_dim
    ("intermediate_size", 0, "intermediate_size"),
    ("vocab_size", 0, "vocab_size"),
    ("vocab_size", -1, "vocab_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("num_hidden_layers", 2.0, "num_hidden_layers"),
    ("max_position_embeddings", 0, "max_position_embeddings"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps"),
    ("rms_norm_eps", True, "rms_norm_eps"),
]


@pytest.mark.parametrize(("field", "value", "words"), BAD_FIELDS)
def test_bad_sizes_are_refused_before_any_weight_is_read(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_weights: list[object],
    field: str,
    value: Any,
    words: str,
) -> None:
    path = copy_with(tiny_model_dir, tmp_path / "m", **{field: value})
    # garbage weights: a check that ran after the headers are read would report those
    (path / "model.safetensors").write_bytes(GARBAGE)
    for build in (load, LLM):
        with pytest.raises(ValueError) as err:
            build(path)
        assert words in str(err.value)
        assert str(path / "config.json") in str(err.value)
    assert no_weights == []


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b'{"architectures": ["Qwen3ForCausalLM"], ', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'["Qwen3ForCausalLM"]', "JSON object, not a list"),
        (b"42", "JSON object, not a int"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
    ],
)
def test_config_that_is_not_a_json_object_is_named(
    tiny_model_dir: Path, tmp_path: Path, no_weights: list[object], content: bytes, words: str
) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (path / "config.json").write_bytes(content)
    for build in (load, LLM):
        with pytest.raises(ValueError) as err:
            build(path)
        assert str(path / "config.json") in str(err.value)
        assert words in str(err.value)
    assert no_weights == []


# ------------------------------------------------------------------------ weight files


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_unreadable_safetensors_file_is_named(
    tiny_model_dir: Path, tmp_path: Path, damage: str
) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": GARBAGE, "truncated": data[:-100], "empty": b""}[damage])
    for build in (load, LLM):
        with pytest.raises(ValueError, match="not a readable safetensors file") as err:
            build(path)
        assert str(weights) in str(err.value)


def test_truncated_shard_is_named(tmp_path: Path) -> None:
    from paged_engine.utils.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=1, num_shards=3)
    shard = path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        load(path)
    assert str(shard) in str(err.value)


def test_index_that_is_not_json_is_named(tmp_path: Path) -> None:
    from paged_engine.utils.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=1, num_shards=2)
    index = path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match="not valid JSON") as err:
        load(path)
    assert str(index) in str(err.value)
    index.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="weight_map") as err:
        load(path)
    assert str(index) in str(err.value)


# ------------------------------------------------------------------- the pool, refused first


@pytest.mark.parametrize(
    "pool", [{"num_kvcache_blocks": 2}, {"kv_cache_memory": 4096}], ids=["blocks", "bytes"]
)
def test_pool_too_small_is_refused_before_the_weights_are_read(
    tiny_model_dir: Path, tmp_path: Path, no_weights: list[object], pool: dict[str, int]
) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (path / "model.safetensors").write_bytes(GARBAGE)  # reading it would fail differently
    with pytest.raises(ValueError, match="cannot hold one max_model_len=128 sequence"):
        LLM(path, max_model_len=128, **pool)
    assert no_weights == []


def test_refused_construction_leaves_the_thread_count(tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="cannot hold"):
        LLM(tiny_model_dir, max_model_len=128, num_kvcache_blocks=2, num_threads=before + 1)
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------------------- max_model_len


def test_max_model_len_above_max_position_embeddings_is_refused(
    tiny_model_dir: Path, no_weights: list[object]
) -> None:
    with pytest.raises(ValueError) as err:
        LLM(tiny_model_dir, max_model_len=4097, num_kvcache_blocks=512)
    message = str(err.value)
    assert "max_model_len=4097" in message and "max_position_embeddings=4096" in message
    assert no_weights == []


def test_default_max_model_len_is_capped_by_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = copy_with(tiny_model_dir, tmp_path / "m", max_position_embeddings=200)
    llm = LLM(path, num_kvcache_blocks=64)
    assert llm.config.max_model_len == 200
    assert llm.engine.config.max_model_len == 200
    prompt = list(range(3, 198))  # 195 tokens
    fits = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([prompt], fits, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5  # 200 tokens in all: the model's whole range
    too_long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match=r"max_model_len \(200\)"):
        llm.generate([prompt], too_long, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=201"):
        LLM(path, max_model_len=201, num_kvcache_blocks=64)
    assert LLM(path, max_model_len=64, num_kvcache_blocks=64).config.max_model_len == 64
    # a model that allows more keeps EngineConfig's default
    assert LLM(tiny_model_dir, num_kvcache_blocks=256).config.max_model_len == 4096


# ------------------------------------------------------------------------------ eos lists

PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 24
TOKENIZER_EOS = 0  # the tiny model's tokenizer, config.json and generation_config.json


def first_new_token_at(tokens: list[int], start: int) -> int:
    """The first position >= start whose token has not appeared before (nor the eos)."""
    return next(
        i
        for i in range(start, len(tokens))
        if tokens[i] not in tokens[:i] and TOKENIZER_EOS not in tokens[: i + 1]
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[int]:
    """transformers' greedy continuation of PROMPT, ignoring eos."""
    return HFOracle(tiny_model_dir).greedy(PROMPT, MAX_TOKENS).tokens


def hf_generate(model_dir: Path) -> list[int]:
    """transformers' generate: it reads generation_config.json (else config.json) itself."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
    return [int(t) for t in out[0, len(PROMPT) :]]


def set_generation_eos(path: Path, eos: object) -> None:
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos}))


@pytest.mark.parametrize("where", ["generation_config", "config", "both"])
def test_every_eos_id_in_a_list_stops_generation(
    tiny_model_dir: Path, tmp_path: Path, reference: list[int], where: str
) -> None:
    k = first_new_token_at(reference, 4)
    second = reference[k]
    path = shutil.copytree(tiny_model_dir, tmp_path / "m")
    if where == "generation_config":
        set_generation_eos(path, [TOKENIZER_EOS, second])
    elif where == "config":
        (path / "generation_config.json").unlink()
        copy_with(path, tmp_path / "c", eos_token_id=[TOKENIZER_EOS, second])
        path = tmp_path / "c"
    else:  # config.json's list would stop earlier: generation_config.json's must win
        earlier = reference[first_new_token_at(reference, 1)]
        assert reference.index(earlier) < k
        path = copy_with(path, tmp_path / "c", eos_token_id=[TOKENIZER_EOS, earlier])
        set_generation_eos(path, [TOKENIZER_EOS, second])
    llm = LLM(path, num_kvcache_blocks=64, max_model_len=128)
    assert llm.engine.eos_token_ids == (TOKENIZER_EOS, second)
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == reference[: k + 1]
    assert out.finish_reason == "stop"
    assert out.token_ids == hf_generate(path)


def test_eos_falls_back_to_the_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = copy_with(tiny_model_dir, tmp_path / "m", eos_token_id=None)
    (path / "generation_config.json").unlink()
    llm = LLM(path, num_kvcache_blocks=64, max_model_len=128)
    assert llm.engine.eos_token_ids == (TOKENIZER_EOS,)


@pytest.mark.parametrize("eos", [[], [0, -1], "0", [0, True]])
def test_bad_eos_in_generation_config_is_named(
    tiny_model_dir: Path, tmp_path: Path, no_weights: list[object], eos: object
) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "m")
    set_generation_eos(path, eos)
    with pytest.raises(ValueError, match="eos_token_id") as err:
        LLM(path, num_kvcache_blocks=64, max_model_len=128)
    assert str(path / "generation_config.json") in str(err.value)
    assert no_weights == []
