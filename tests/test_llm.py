"""The user-facing LLM: refused construction before allocation, bad requests through
generate (text prompts too), text outputs, seeded sampling. The CLI: tests/test_cli.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import paged_engine.worker.model_runner as model_runner
from paged_engine import LLM, SamplingParams

SMALL = dict(num_kvcache_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **SMALL)


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the model is loaded or the KV pool is allocated."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("allocated before the bad input was refused")

    monkeypatch.setattr(model_runner, "load_model", forbidden)
    monkeypatch.setattr(model_runner.ModelRunner, "_allocate_kv_cache", forbidden)


@pytest.mark.parametrize(
    ("config", "exc", "words"),
    [
        ({"kvcache_block_size": 0}, ValueError, "kvcache_block_size"),
        ({"kvcache_block_size": -16}, ValueError, "kvcache_block_size"),
        ({"kv_cache_memory": 0}, ValueError, "kv_cache_memory"),
        ({"num_kvcache_blocks": 0}, ValueError, "num_kvcache_blocks"),
        ({"attention_backend": "flash-attn"}, ValueError, "flash-attn needs CUDA"),
        ({"attention_backend": "magic"}, ValueError, "attention_backend"),
        ({"device": "cuda"}, ValueError, "CUDA is not available"),
        ({"dtype": "int8"}, ValueError, "dtype"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs"),
        ({"block_sise": 16}, TypeError, "block_sise"),
        ({"num_threads": 0}, ValueError, "num_threads"),
    ],
)
def test_bad_configuration_is_refused_before_allocation(
    tiny_model_dir: Path, no_allocation: None, config: dict[str, Any], exc: type, words: str
) -> None:
    with pytest.raises(exc, match=words):
        LLM(tiny_model_dir, **config)


def test_bad_model_directories(tmp_path: Path, tiny_model_dir: Path, no_allocation: None) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(tmp_path)


def test_unsupported_architecture_and_bad_shapes(tmp_path: Path, tiny_model_dir: Path) -> None:
    llama = shutil.copytree(tiny_model_dir, tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "architectures": ["PhiForCausalLM"]}))
    with pytest.raises(ValueError, match="PhiForCausalLM"):
        LLM(llama)
    wide = shutil.copytree(tiny_model_dir, tmp_path / "wide")
    (wide / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*expected shape"):
        LLM(wide)


def test_a_pool_too_small_for_max_model_len_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot hold one max_model_len=1024 sequence"):
        LLM(tiny_model_dir, max_model_len=1024, kv_cache_memory=4096)


@pytest.mark.parametrize(
    ("prompt", "params", "exc", "words"),
    [
        ("", {}, ValueError, "empty"),
        ([], {}, ValueError, "empty"),
        ([1, 10**6], {}, ValueError, "outside the vocabulary"),
        ([1, "2"], {}, TypeError, "not an int"),
        ("hello", {"max_tokens": 0}, ValueError, "max_tokens"),
        ("hello", {"top_p": 2.0}, ValueError, "top_p"),
        ("hello", {"temperature": -1.0}, ValueError, "temperature"),
        ("hello", {"top_k": -2}, ValueError, "top_k"),
        ("hello", {"colour": "red"}, TypeError, "colour"),
        ("hello " * 200, {}, ValueError, "max_model_len"),
    ],
)
def test_bad_requests_through_generate(
    llm: LLM, prompt: Any, params: dict[str, Any], exc: type, words: str
) -> None:
    good = llm.generate(
        ["hello world"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    with pytest.raises(exc, match=words):
        llm.generate(
            ["hello world", prompt], [{"temperature": 0, "max_tokens": 5}, params], use_tqdm=False
        )
    assert not llm.engine.has_unfinished_requests()
    again = llm.generate(
        ["hello world"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    assert again[0].outputs[0].token_ids == good[0].outputs[0].token_ids


def test_text_prompts_give_text(llm: LLM) -> None:
    out = llm.generate(
        ["the cache"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("the cache")  # type: ignore[union-attr]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 8 and completion.text
    # The text, checked against another code path: detokenised token by token while
    # streaming through the engine (generate decodes once at the end).
    engine = llm.engine
    engine.add_request(
        "stream", "the cache", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    streamed = []
    while engine.has_unfinished_requests():
        streamed += engine.step()
    assert streamed[-1].outputs[0].text == completion.text
    assert streamed[-1].outputs[0].token_ids == completion.token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0]
    crowd = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [other, seeded, other], use_tqdm=False)[
        1
    ]
    assert crowd.outputs[0].token_ids == alone.outputs[0].token_ids
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99, ignore_eos=True)
    again = llm.generate([[5, 6, 7]], reseeded, use_tqdm=False)[0]
    assert again.outputs[0].token_ids != alone.outputs[0].token_ids


def test_params_list_of_the_wrong_length_through_generate(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hello"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
