"""The rest of vLLM's offline surface: the names the package root exports (without torch),
``EngineArgs`` and ``LLMEngine.from_engine_args`` (the one path ``LLM`` builds through),
vLLM's other ``LLM`` arguments (each accepted where it means something, else refused
naming it, before anything loads), ``get_default_sampling_params`` from
generation_config.json, and a mutable ``SamplingParams`` checked again when a request is
added, of which the engine keeps a private copy."""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import paged_engine
from paged_engine import (
    LLM,
    EngineArgs,
    LLMEngine,
    RequestOutputKind,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)
from paged_engine.config import EngineConfig
from paged_engine.engine.inputs import check_request
from paged_engine.engine_args import CONFIG_NAMES, VLLM_ONLY, engine_args_from_kwargs
from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError, ModelConfigError
from paged_engine.utils.generation_defaults import default_sampling_values
from paged_engine.worker import model_runner
from tests.engine_machine import build_engine
from tests.fake_model import FakeTokenizer

SMALL: dict[str, Any] = dict(num_gpu_blocks_override=64, max_model_len=128, block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the model is loaded or the KV pool is allocated."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model loaded before the bad argument was refused")

    monkeypatch.setattr(model_runner, "load_model", forbidden)
    monkeypatch.setattr(model_runner.ModelRunner, "_allocate_kv_cache", forbidden)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **SMALL)


def _copy_model(src: Path, dst: Path, generation_config: dict[str, Any] | None) -> Path:
    """``src`` copied to ``dst``, its generation_config.json replaced (None: removed)."""
    shutil.copytree(src, dst)
    (dst / "generation_config.json").unlink()
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


# ---- the package root ------------------------------------------------------------------------


def test_the_root_exports_vllms_names_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "import paged_engine as pe\n"
        "from paged_engine import EngineArgs, SamplingParams, RequestOutputKind, EngineConfig\n"
        "from paged_engine import RequestOutput, CompletionOutput, TextPrompt, TokensPrompt\n"
        "assert 'torch' not in sys.modules, 'the records pulled in torch'\n"
        "from paged_engine import LLMEngine, LLM\n"
        "assert 'torch' in sys.modules\n"
        "print(sorted(pe.__all__))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "LLMEngine" in out.stdout and "TokensPrompt" in out.stdout
    from paged_engine.engine.request import CompletionOutput, RequestOutput
    from paged_engine.llm_engine import LLMEngine as Built

    assert paged_engine.RequestOutput is RequestOutput
    assert paged_engine.CompletionOutput is CompletionOutput
    assert LLMEngine is Built and RequestOutputKind.DELTA.name == "DELTA"
    with pytest.raises(AttributeError, match="no attribute 'LoRARequest'"):
        paged_engine.LoRARequest  # noqa: B018


def test_prompt_typeddicts_are_vllms_and_take_every_key_the_parser_takes() -> None:
    assert TokensPrompt.__required_keys__ == {"prompt_token_ids"}
    assert TokensPrompt.__optional_keys__ == {"prompt", "cache_salt"}
    assert TextPrompt.__required_keys__ == {"prompt"}
    assert TextPrompt.__optional_keys__ == {"cache_salt"}


def test_typed_prompts_run_wherever_prompts_are_taken(llm: LLM) -> None:
    tok = llm.tokenizer
    ids = tok.encode("Once upon a time")
    outs = llm.generate(
        [TextPrompt(prompt="Once upon a time"), TokensPrompt(prompt_token_ids=ids, cache_salt="s")],
        GREEDY,
        use_tqdm=False,
    )
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("typed", TokensPrompt(prompt_token_ids=ids, prompt="told"), GREEDY)
    finals = [o for _ in range(20) for o in engine.step() if o.finished]
    assert (
        finals[0].prompt == "told"
        and finals[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    )


# ---- EngineArgs ------------------------------------------------------------------------------


def test_engine_args_defaults_are_the_configs() -> None:
    assert EngineArgs(model="m").create_engine_config() == EngineConfig()


def test_every_config_field_is_reachable_under_vllms_name() -> None:
    """A field added to ``EngineConfig`` without an ``EngineArgs`` counterpart fails here."""
    changed = dict(
        max_num_batched_tokens=96, max_num_seqs=3, max_model_len=77, kvcache_block_size=4,
        num_kvcache_blocks=9, enable_prefix_caching=False, prefix_cache_hash="sha256",
        attention_backend="torch", dtype="float32", device="cpu", kv_cache_memory=1 << 20,
        gpu_memory_utilization=0.5, enforce_eager=True, seed=7, num_threads=None, max_n=4,
        max_logprobs=5, tensor_parallel_size=2, mixed_steps=True, cpu_bind="auto",
        distributed_executor_backend="ray",
    )  # fmt: skip
    assert set(changed) == {f.name for f in fields(EngineConfig)}
    assert all(changed[k] != getattr(EngineConfig(), k) for k in changed)
    vllm_names = {
        next((a for a, c in CONFIG_NAMES.items() if c == k), k): v for k, v in changed.items()
    }
    assert {"block_size", "num_gpu_blocks_override", "kv_cache_memory_bytes"} <= set(vllm_names)
    assert EngineArgs(model="m", **vllm_names).create_engine_config() == EngineConfig(**changed)


ACCEPTED: list[tuple[str, object]] = [
    ("pipeline_parallel_size", 1),
    ("enable_chunked_prefill", True),
    ("enable_chunked_prefill", None),
    ("revision", None),
    ("kv_cache_dtype", "auto"),
    ("load_format", "auto"),
    ("load_format", "safetensors"),
    ("trust_remote_code", False),
    ("quantization", None),
    ("disable_log_stats", True),
    ("swap_space", 0),
    ("max_logprobs", -1),
    ("seed", None),
    ("runner", "auto"),
    ("runner", "generate"),
    ("runner", "pooling"),
]
REFUSED: list[tuple[str, object, str]] = [
    ("pipeline_parallel_size", 2, "pipeline parallelism is not supported"),
    ("pipeline_parallel_size", True, "pipeline parallelism"),  # not 1, though == 1
    ("enable_chunked_prefill", False, "always splits a prompt longer than"),
    ("revision", "main", "have no revisions"),
    ("kv_cache_dtype", "fp8", "kept in the model's dtype"),
    ("load_format", "pt", "safetensors directories and .gguf files"),
    ("load_format", "dummy", "use 'auto', 'safetensors' or 'gguf'"),
    ("trust_remote_code", True, "no remote code runs here"),
    ("quantization", "awq", "dequantized when loaded"),
    ("disable_log_stats", "yes", "must be a bool"),
    ("swap_space", -1, "a number of GiB >= 0"),
    ("swap_space", "4GiB", "a number of GiB >= 0"),
    ("max_logprobs", -2, "must be an int >= 0, or -1"),
    ("max_logprobs", 2.5, "must be an int"),
    ("runner", "draft", "use 'auto', 'generate' or 'pooling'"),
    ("runner", "embed", "the one runner generates and pools"),
]


@pytest.mark.parametrize(("name", "value"), ACCEPTED)
def test_vllm_arguments_accepted_where_they_mean_something(name: str, value: object) -> None:
    EngineArgs(model="m", **{name: value}).create_engine_config()


@pytest.mark.parametrize(("name", "value", "words"), REFUSED)
def test_vllm_arguments_refused_naming_them(name: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b.*{words}") as refused:
        EngineArgs(model="m", **{name: value}).create_engine_config()
    assert "\n" not in str(refused.value)  # one line
    assert set(VLLM_ONLY) <= {n for n, _, _ in REFUSED}  # every table entry has a row


def test_swap_space_is_ignored_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="paged_engine.engine_args"):
        config = EngineArgs(model="m", swap_space=4).create_engine_config()
    assert config == EngineConfig()
    assert "swap_space=4 is ignored: a preempted sequence is recomputed" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="paged_engine.engine_args"):
        EngineArgs(model="m").create_engine_config()
    assert "swap_space" not in caplog.text


def test_load_format_must_match_the_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^load_format='gguf': .* is a Hugging Face directory"):
        EngineArgs(model=tiny_model_dir, load_format="gguf").check_load_format()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"^load_format='safetensors': .* not a Hugging Face"):
        EngineArgs(model=gguf, load_format="safetensors").check_load_format()
    for ok in (
        EngineArgs(model=tiny_model_dir, load_format="safetensors"),
        EngineArgs(model=gguf, load_format="gguf"),
        EngineArgs(model=tmp_path / "missing", load_format="gguf"),  # the loader says so
    ):
        ok.check_load_format()


def test_llm_keywords_map_onto_engine_args() -> None:
    args = engine_args_from_kwargs("m", None, dict(kvcache_block_size=4, num_kvcache_blocks=9))
    assert (args.block_size, args.num_gpu_blocks_override) == (4, 9)
    args = engine_args_from_kwargs("m", "t", dict(kv_cache_memory_bytes=1 << 20, max_logprobs=3))
    assert (args.kv_cache_memory_bytes, args.max_logprobs, args.tokenizer) == (1 << 20, 3, "t")
    with pytest.raises(TypeError, match="both 'num_gpu_blocks_override' and 'num_kvcache_blocks'"):
        engine_args_from_kwargs("m", None, dict(num_gpu_blocks_override=1, num_kvcache_blocks=1))
    with pytest.raises(TypeError, match=r"unknown LLM argument\(s\) \['tokenizer_mode'\]") as e:
        engine_args_from_kwargs("m", None, dict(tokenizer_mode="auto"))
    for known in ("swap_space", "max_logprobs", "block_size", "kvcache_block_size", "revision"):
        assert repr(known) in str(e.value)


@pytest.mark.parametrize(("name", "value", "words"), [r for r in REFUSED if r[0] != "max_logprobs"])
def test_llm_refuses_before_anything_loads(
    tiny_model_dir: Path, no_allocation: None, name: str, value: object, words: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b.*{words}"):
        LLM(tiny_model_dir, **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}\b.*{words}"):
        LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, **{name: value}))


# ---- LLMEngine.from_engine_args: the one path ----------------------------------------------


def test_llm_builds_its_engine_through_from_engine_args(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[EngineArgs] = []
    build = LLMEngine.from_engine_args.__func__  # type: ignore[attr-defined]

    def spy(cls: type[LLMEngine], engine_args: EngineArgs) -> LLMEngine:
        seen.append(engine_args)
        return build(cls, engine_args)  # type: ignore[no-any-return]

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(spy))
    llm = LLM(tiny_model_dir, kvcache_block_size=8, num_gpu_blocks_override=64, max_model_len=128)
    assert seen == [EngineArgs(model=tiny_model_dir, **SMALL)]
    assert type(llm.llm_engine) is LLMEngine and llm.model_runner is llm.llm_engine.model_runner


def test_from_engine_args_builds_what_llm_builds(llm: LLM, tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), **SMALL))
    assert engine.config == llm.config and engine.eos_token_ids == llm.llm_engine.eos_token_ids
    assert engine.get_model_config().vocab_size == llm.llm_engine.vocab_size
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=6, n=2)]
    prompts = ["The quick brown fox", "Once upon a time"]
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, sp)
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    want = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(want):
        got = finals[str(i)].outputs
        assert [c.token_ids for c in got] == [c.token_ids for c in out.outputs]
    engine.close()
    engine.close()  # idempotent


def test_a_lora_request_is_refused_naming_it_and_nothing_is_queued(llm: LLM) -> None:
    adapter = object()
    for call in (
        lambda: llm.generate("hi", GREEDY, lora_request=adapter),
        lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request=adapter),
        lambda: llm.llm_engine.add_request("x", "hi", GREEDY, lora_request=adapter),
    ):
        with pytest.raises(InvalidRequestError, match="lora_request: LoRA adapters") as refused:
            call()
        assert refused.value.field == "lora_request"
        assert not llm.llm_engine.has_unfinished_requests()
    llm.generate("hi", GREEDY, lora_request=None, use_tqdm=False)


def test_the_accepted_vllm_arguments_build_an_engine_that_honours_max_logprobs(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _copy_model(tiny_model_dir, tmp_path / "m", None)  # and no generation_config.json
    with caplog.at_level(logging.INFO, logger="paged_engine.engine_args"):
        llm = LLM(
            model, enable_chunked_prefill=True, disable_log_stats=True, max_logprobs=3,
            revision=None, kv_cache_dtype="auto", load_format="safetensors",
            trust_remote_code=False, quantization=None, swap_space=4,
            pipeline_parallel_size=1, **SMALL,
        )  # fmt: skip
    assert "swap_space=4 is ignored" in caplog.text
    assert llm.config.max_logprobs == 3 and llm.config.num_kvcache_blocks == 64
    assert llm.get_default_sampling_params() == SamplingParams()  # no file: plain defaults
    for name in ("logprobs", "prompt_logprobs"):
        asked = SamplingParams(max_tokens=2, **{name: 4})
        with pytest.raises(InvalidRequestError, match=rf"{name}=4 is more than the 3 allowed"):
            llm.generate(["a", "b"], [GREEDY, asked], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate("a", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and all(1 <= len(p) <= 4 for p in logprobs)


def test_max_logprobs_bounds_requests_and_never_exceeds_the_vocabulary() -> None:
    config = EngineConfig(max_model_len=40, num_kvcache_blocks=20, kvcache_block_size=4)
    tokens = [1, 2, 3]
    check_request(tokens, SamplingParams(logprobs=20), config, 20, "w", has_tokenizer=False)
    with pytest.raises(InvalidRequestError, match=r"logprobs=21 .* 20 allowed \(max_logprobs\)"):
        check_request(tokens, SamplingParams(logprobs=21), config, 20, "w", has_tokenizer=False)
    only_sampled = EngineConfig(max_model_len=40, num_kvcache_blocks=20, max_logprobs=0)
    check_request(tokens, SamplingParams(logprobs=0), only_sampled, 20, "w", has_tokenizer=False)
    with pytest.raises(InvalidRequestError, match=r"prompt_logprobs=1 .* 0 allowed") as e:
        check_request(
            tokens, SamplingParams(prompt_logprobs=1), only_sampled, 20, "w",
            has_tokenizer=False, vocab_size=768,
        )  # fmt: skip
    assert e.value.field == "prompt_logprobs"
    unbounded = EngineConfig(max_model_len=40, num_kvcache_blocks=20, max_logprobs=-1)
    check_request(tokens, SamplingParams(logprobs=10**6), unbounded, 20, "w", has_tokenizer=False)
    with pytest.raises(InvalidRequestError, match=r"the 768 allowed \(the vocabulary size\)"):
        check_request(
            tokens, SamplingParams(prompt_logprobs=769), unbounded, 20, "w",
            has_tokenizer=False, vocab_size=768,
        )  # fmt: skip


# ---- get_default_sampling_params ----------------------------------------------------------


def test_default_sampling_params_from_generation_config(
    tiny_model_dir: Path, tmp_path: Path, llm: LLM
) -> None:
    assert llm.get_default_sampling_params() == SamplingParams()  # the file sets no sampling
    config = dict(
        temperature=0.0, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
        max_new_tokens=3, do_sample=True, num_beams=4, eos_token_id=0,
    )  # fmt: skip
    tuned = LLM(_copy_model(tiny_model_dir, tmp_path / "m", config), **SMALL)
    want = SamplingParams(
        temperature=0.0, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=3
    )
    first = tuned.get_default_sampling_params()
    assert first == want
    first.max_tokens = 9
    assert tuned.get_default_sampling_params() == want  # a new record each call
    (out,) = tuned.generate("Once upon a time", use_tqdm=False)  # no params: the model's
    (same,) = tuned.generate("Once upon a time", want, use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 3
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_generation_config_values_are_checked_naming_the_key(tmp_path: Path) -> None:
    assert default_sampling_values(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": None, "eos": 1}))
    assert default_sampling_values(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ModelConfigError, match=r"generation_config\.json: max_new_tokens: ") as e:
        default_sampling_values(tmp_path)
    assert e.value.key == "max_new_tokens"


# ---- a mutable SamplingParams, checked again when a request is added ----------------------

CONFIG = EngineConfig(
    max_num_batched_tokens=64, max_num_seqs=8, max_model_len=40, kvcache_block_size=4,
    num_kvcache_blocks=30, enable_prefix_caching=True,
)  # fmt: skip

BAD_AFTER_CONSTRUCTION: list[tuple[str, object]] = [
    ("temperature", -1.0),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_k", -2),
    ("min_p", 2.0),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("n", 0),
    ("best_of", 3),
    ("presence_penalty", 3.0),
    ("repetition_penalty", 0.0),
    ("ignore_eos", 1),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("logprobs", -1),
    ("logit_bias", {1: math.inf}),
    ("seed", 1.5),
    ("output_kind", "delta"),
    ("allowed_token_ids", []),
    ("bad_words", [" "]),
]


def _engine() -> Any:
    engine = build_engine(CONFIG, spec=False, tokenizer=FakeTokenizer())
    engine.add_request("busy", [4, 4, 4, 4, 4], GREEDY)
    engine.step()
    return engine


def _state(engine: Any) -> object:
    sched = engine.scheduler
    return (
        engine.block_manager.snapshot(),
        [(s.seq_id, list(s.token_ids)) for s in (*sched.waiting, *sched.running)],
        sorted(engine._requests),
    )


@pytest.mark.parametrize(("name", "bad"), BAD_AFTER_CONSTRUCTION)
def test_a_field_set_badly_after_construction_is_refused_when_added(name: str, bad: object) -> None:
    with pytest.raises(InvalidRequestError) as at_construction:
        SamplingParams(**{name: bad})
    params = SamplingParams()
    setattr(params, name, bad)  # vLLM scripts set fields after construction
    engine = _engine()
    before = _state(engine)
    with pytest.raises(InvalidRequestError) as at_add:
        engine.add_request("bad", [1, 2, 3], params)
    got, want = at_add.value, at_construction.value
    assert (type(got), got.field, got.reason) == (type(want), want.field, want.reason)
    assert got.field == name and got.where == "add_request"
    assert _state(engine) == before  # nothing queued
    engine.abort_request("busy")
    idle = _state(engine)
    with pytest.raises(InvalidRequestError) as in_batch:  # generate refuses it the same way
        engine.generate([[1, 2], [3, 4]], [GREEDY, params], use_tqdm=False)
    assert (in_batch.value.field, in_batch.value.where) == (name, "prompt 1")
    assert _state(engine) == idle and not engine.has_unfinished_requests()
    assert getattr(params, name) == bad  # the caller's object is left as it was


def test_best_of_is_accepted_as_vllm_accepts_it() -> None:
    assert SamplingParams(n=2, best_of=2, temperature=1.0).best_of == 2
    assert SamplingParams(best_of=None).best_of is None
    with pytest.raises(InvalidRequestError, match=r"^best_of=5 > n=2 is not supported") as e:
        SamplingParams(n=2, best_of=5)
    assert e.value.field == "best_of" and "\n" not in str(e.value)
    with pytest.raises(InvalidRequestError, match=r"^best_of must be >= n=2, got 1$"):
        SamplingParams(n=2, best_of=1)
    with pytest.raises(InvalidRequestTypeError, match="best_of must be an int"):
        SamplingParams(best_of=2.0)


def test_the_engine_runs_its_own_copy_of_the_params() -> None:
    engine = build_engine(CONFIG, spec=False, tokenizer=FakeTokenizer())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    params.stop = ["<9>"]  # a list, as a script sets it
    engine.add_request("a", [1, 2, 3], params)
    assert params.stop == ["<9>"]  # not normalised in place: the caller's, untouched
    queued = engine._requests["a"]
    assert queued.params is not params and queued.params.stop == ("<9>",)
    assert all(c.seq.sampling_params is not params for c in queued.completions)
    engine.step()
    # what would end it at once, were the engine reading the caller's object
    params.max_tokens, params.ignore_eos, params.stop_token_ids = 1, False, tuple(range(5))
    params.output_kind = RequestOutputKind.FINAL_ONLY
    outs = [o for _ in range(30) for o in engine.step()]
    assert len(outs) > 1  # still cumulative: reported every step
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
