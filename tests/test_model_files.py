"""A model directory's weight and tokenizer files, hostile ones included: the index cannot
send the loader outside the directory, every tensor must be a floating type, and a
tokenizer that cannot be read is named by its file. Each refusal is a ``ModelConfigError``
naming the file (and the key or tensor), raised before any model is built or any weight
file opened. config.json's own keys: tests/test_model_config_keys.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import paged_engine.utils.loader as loader
from paged_engine import LLM, SamplingParams
from paged_engine.errors import ModelConfigError
from paged_engine.layers.attention import TorchAttentionBackend
from paged_engine.utils.tiny_model import make_tiny_model
from paged_engine.utils.tokenizer import load_tokenizer
from tests.test_model_dirs import no_weights  # noqa: F401 - a fixture

INDEX = "model.safetensors.index.json"
SHARD = "model-00002-of-00003.safetensors"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
SMALL = {"num_kvcache_blocks": 16, "max_model_len": 64}


def load(path: Path) -> torch.nn.Module:
    model, _ = loader.load_model(
        path, device=torch.device("cpu"), dtype=torch.float32, backend=TorchAttentionBackend()
    )
    return model


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Records a model built (on the meta device or a real one) before the refusal: the
    weight files are checked before either."""
    built: list[object] = []

    def record(*args: Any, **kwargs: Any) -> None:
        built.append(args)
        raise AssertionError("a model was built before the bad weight file was refused")

    monkeypatch.setattr(loader, "class_for_config", lambda config: record)
    return built


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sharded") / "m", seed=2, num_shards=3)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the loader hands to ``safe_open``."""
    paths: list[str] = []
    real = loader.safe_open

    def recording(path: str, *args: Any, **kwargs: Any) -> Any:
        paths.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", recording)
    return paths


def point_shard_at(model: Path, entry: str) -> None:
    index = json.loads((model / INDEX).read_text())
    index["weight_map"] = {k: entry if v == SHARD else v for k, v in index["weight_map"].items()}
    (model / INDEX).write_text(json.dumps(index))


# ------------------------------------------------------------------- weight paths


@pytest.mark.parametrize("how", ["dot-dot", "absolute", "dot-dot inside"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(
    sharded: Path,
    tmp_path: Path,
    opened: list[str],
    no_model: list[object],
    how: str,
) -> None:
    """The shard is moved outside and the index points at it there: before the fix the
    loader followed the entry and loaded the model."""
    model = shutil.copytree(sharded, tmp_path / "m")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(model / SHARD, outside / SHARD)
    entry = {
        "dot-dot": f"../outside/{SHARD}",
        "absolute": str(outside / SHARD),
        "dot-dot inside": f"sub/../../outside/{SHARD}",
    }[how]
    point_shard_at(model, entry)
    before = (model / INDEX).read_bytes()
    for build in (load, lambda p: LLM(p, **SMALL)):
        with pytest.raises(ModelConfigError) as err:
            build(model)
        assert err.value.path == str(model / INDEX) and err.value.key == "weight_map"
        assert repr(entry) in str(err.value)
    assert opened == []  # refused before any weight file was opened
    assert no_model == []
    assert (model / INDEX).read_bytes() == before and (outside / SHARD).is_file()


def test_a_symlink_inside_the_directory_is_followed(sharded: Path, tmp_path: Path) -> None:
    """The documented decision (loader.py's docstring): Hugging Face's cache layout, a
    snapshot of symlinks into a blobs directory beside it, loads the same weights."""
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshots" / "rev"
    shutil.copytree(sharded, blobs)
    snapshot.mkdir(parents=True)
    for f in blobs.iterdir():
        (snapshot / f.name).symlink_to(os.path.relpath(f, snapshot))
    got = load(snapshot).state_dict()
    want = load(sharded).state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="this OS has no /dev/zero")
def test_a_weight_file_that_is_not_a_regular_file_is_refused(
    tiny_model_dir: Path, tmp_path: Path, opened: list[str]
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (model / "zeros.safetensors").symlink_to("/dev/zero")
    with pytest.raises(ModelConfigError, match="not a regular file") as err:
        load(model)
    assert err.value.path == str(model / "zeros.safetensors")
    assert opened == []


# ---------------------------------------------------------------------- tensor dtypes


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.int8, "I8"), (torch.int32, "I32"), (torch.bool, "BOOL"), (torch.float8_e4m3fn, "F8")],
)
def test_a_non_floating_tensor_is_refused_naming_it_and_its_file(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_model: list[object],
    dtype: torch.dtype,
    name: str,
) -> None:
    """Before the fix an int8 q_proj was cast into the float32 model, which generated."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    tensors[Q_PROJ] = (tensors[Q_PROJ] * 50).to(dtype)
    save_file(tensors, str(weights))
    for build in (load, lambda p: LLM(p, **SMALL)):
        with pytest.raises(ModelConfigError) as err:
            build(model)
        assert err.value.path == str(weights) and err.value.key == Q_PROJ
        assert name in str(err.value) and "config.json" in str(err.value)
    assert no_model == []


def test_a_half_precision_tensor_in_a_float32_checkpoint_loads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Floating tensors of another width are cast, as transformers does: not refused."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    tensors[Q_PROJ] = tensors[Q_PROJ].to(torch.bfloat16)
    save_file(tensors, str(model / "model.safetensors"))
    got = load(model).model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(got[: tensors[Q_PROJ].shape[0]], tensors[Q_PROJ].float())
    out = LLM(model, **SMALL).generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# -------------------------------------------------------------------------- tokenizer

TOKENIZER_DAMAGE = [
    ("tokenizer.json", b"\x93\xff\x00 not text"),  # was UnicodeDecodeError
    ("tokenizer.json", b'{"model": 5}'),  # was KeyError: 'added_tokens'
    ("tokenizer.json", b""),  # was JSONDecodeError
    ("tokenizer.json", b"[1, 2]"),  # was TypeError
    ("tokenizer_config.json", b""),
    ("tokenizer_config.json", b"\xff\xfe garbage"),
    ("tokenizer_config.json", b"[]"),  # was AttributeError
    ("special_tokens_map.json", b"{"),
]


@pytest.mark.parametrize(
    ("file", "content"), TOKENIZER_DAMAGE, ids=[f"{f}={c[:12]!r}" for f, c in TOKENIZER_DAMAGE]
)
def test_a_tokenizer_file_that_cannot_be_read_is_named(
    tiny_model_dir: Path,
    tmp_path: Path,
    no_weights: list[object],  # noqa: F811
    file: str,
    content: bytes,
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (model / file).write_bytes(content)
    for build in (load_tokenizer, lambda p: LLM(p, **SMALL)):
        with pytest.raises(ModelConfigError) as err:
            build(model)
        assert err.value.path == str(model / file), err.value
        assert str(model / file) in str(err.value)
    assert no_weights == []  # refused before the weights
    assert (model / file).read_bytes() == content


def test_a_tokenizer_transformers_cannot_build_names_the_directory(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """No tokenizer.json, and a tokenizer_config.json that needs one: transformers'
    ValueError, wrapped with the directory (no single file is to blame)."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (model / "tokenizer.json").unlink()
    with pytest.raises(ModelConfigError, match="the tokenizer cannot be loaded") as err:
        load_tokenizer(model)
    assert err.value.path == str(model)
    assert isinstance(err.value.__cause__, ValueError)
