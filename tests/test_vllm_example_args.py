"""What vLLM's example scripts import and call beyond ``LLM`` itself, on the tiny model:
``FlexibleArgumentParser``, ``EngineArgs.add_cli_args`` feeding ``LLM(**vars(args))``,
``runner=``, ``StructuredOutputsParams`` from ``sampling_params``, ``vllm.outputs``,
``print_embeddings``, chat messages' ``reasoning`` fields and ``LLM.chat(tools=...)``.
Each refusal names what it refuses and changes nothing."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, EngineArgs, SamplingParams
from paged_engine.chat_messages import template_message, template_messages
from paged_engine.engine_args import engine_args_from_kwargs
from paged_engine.entrypoints.protocol import ChatCompletionRequest
from paged_engine.entrypoints.serving import RequestError, chat_prompt
from paged_engine.utils.argparse_utils import FlexibleArgumentParser, normalize_flag

SMALL = ["--max-model-len", "128", "--num-gpu-blocks-override", "64", "--block-size", "8"]
ONE = SamplingParams(temperature=0, max_tokens=1)
SHOW = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m.get('reasoning') %} [r={{ m['reasoning'] }}|rc={{ m['reasoning_content'] }}]"
    "{% endif %}\n{% endfor %}"
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
    "{% endif %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def parser_with(model: Path | None) -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    if model is not None:
        parser.set_defaults(model=str(model), runner="pooling", enforce_eager=True)
    return parser


# ---- FlexibleArgumentParser ----------------------------------------------------------------


def test_flexible_parser_reads_underscores_as_dashes() -> None:
    p = FlexibleArgumentParser()
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--chat-template")
    p.add_argument("rest", nargs="*")
    a = p.parse_args(["--max_model_len", "7", "--chat_template=a_b.jinja", "--", "--x_y"])
    assert (a.max_model_len, a.chat_template, a.rest) == (7, "a_b.jinja", ["--x_y"])
    assert p.parse_args(["--max-model-len=3"]).max_model_len == 3
    assert normalize_flag("-tp") == "-tp" and normalize_flag("a_b") == "a_b"
    # a plain ArgumentParser refuses the underscore spelling: the subclass is what reads it
    plain = argparse.ArgumentParser()
    plain.add_argument("--max-model-len", type=int)
    with pytest.raises(SystemExit):
        plain.parse_args(["--max_model_len", "7"])


def test_flexible_parser_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    p = FlexibleArgumentParser()
    p.add_argument("--max-model-len", type=int)
    with pytest.raises(SystemExit):
        p.parse_args(["--max_model_lem", "7"])
    assert "--max-model-lem" in capsys.readouterr().err
    with pytest.raises(TypeError, match="arguments must be strings"):
        p.parse_args(["--max-model-len", 7])  # type: ignore[list-item]
    assert p.parse_args([]).max_model_len is None  # nothing kept from the refused calls


# ---- EngineArgs.add_cli_args -> LLM(**vars(args)) -------------------------------------------


def test_every_dest_is_an_llm_argument(tiny_model_dir: Path) -> None:
    args = parser_with(tiny_model_dir).parse_args(SMALL)  # --model from set_defaults
    from_vars = engine_args_from_kwargs(args.model, args.tokenizer, {
        k: v for k, v in vars(args).items() if k not in ("model", "tokenizer")
    })  # fmt: skip
    assert asdict(from_vars) == asdict(EngineArgs.from_cli_args(args))
    assert from_vars.num_gpu_blocks_override == 64 and from_vars.runner == "pooling"
    a = parser_with(None).parse_args(["--model", "m", "--threads", "3", "--max_num_seqs", "2"])
    assert (
        a.num_threads == 3
        and a.max_num_seqs == 2
        and asdict(EngineArgs.from_cli_args(a))["num_threads"] == 3
    )


def test_llm_from_vars_args_embeds_and_generates(tiny_model_dir: Path) -> None:
    args = parser_with(tiny_model_dir).parse_args([*SMALL, "--max_num_seqs", "4"])
    llm = LLM(**vars(args))
    assert llm.config.num_kvcache_blocks == 64 and llm.config.max_num_seqs == 4
    (emb,) = llm.embed(["Hello, my name is"], use_tqdm=False)
    assert len(emb.outputs.embedding) > 0
    (score,) = llm.score("a b", ["a b"])
    assert score.outputs.score == pytest.approx(1.0, abs=1e-4)
    (out,) = llm.generate("Hello", ONE, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1


def test_missing_model_and_bad_runner_are_refused_by_name(tiny_model_dir: Path) -> None:
    args = parser_with(None).parse_args(SMALL)
    assert args.model is None
    with pytest.raises(ValueError, match=r"model must be .*--model.*None"):
        EngineArgs.from_cli_args(args)
    with pytest.raises(ValueError, match=r"model must be"):
        LLM(**vars(args))
    with pytest.raises(ValueError, match=r"runner='draft': .*use 'auto', 'generate' or"):
        LLM(tiny_model_dir, runner="draft", max_model_len=128, num_gpu_blocks_override=64)
    # the refused LLM built nothing: a good one after it works as before
    llm = LLM(tiny_model_dir, runner="generate", max_model_len=128, num_gpu_blocks_override=64)
    assert len(llm.generate("Hi", ONE, use_tqdm=False)[0].outputs[0].token_ids) == 1


def test_vllm_import_paths() -> None:
    from paged_engine.outputs import EmbeddingRequestOutput, RequestOutput
    from paged_engine.sampling_params import GuidedDecodingParams, StructuredOutputsParams
    from paged_engine.utils.print_utils import print_embeddings

    assert GuidedDecodingParams is StructuredOutputsParams and RequestOutput.__name__
    assert SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert EmbeddingRequestOutput.__name__ == "EmbeddingRequestOutput"
    print_embeddings([0.5] * 20)
    with pytest.raises(TypeError, match="embeds must be a sequence"):
        print_embeddings(3.0)  # type: ignore[arg-type]


# ---- reasoning fields and tools in chat ------------------------------------------------------


def test_template_message_reasoning() -> None:
    user = {"role": "user", "content": "q", "reasoning": None, "reasoning_content": None}
    assert template_message(user) == {"role": "user", "content": "q"}
    said = {"role": "assistant", "content": "a", "reasoning_content": "because"}
    assert template_message(said) == {
        "role": "assistant", "content": "a", "reasoning": "because", "reasoning_content": "because"
    }  # fmt: skip
    bad = [said, {"role": "assistant", "content": "a", "reasoning": 3}]
    with pytest.raises(TypeError, match=r"messages\[1\]: reasoning must be a string"):
        template_messages(bad)
    with pytest.raises(ValueError, match="reasoning and reasoning_content differ"):
        template_message({**said, "reasoning": "other"})
    assert said == {"role": "assistant", "content": "a", "reasoning_content": "because"}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, max_model_len=128, num_gpu_blocks_override=64)


def rendered(llm: LLM, conv: list[dict[str, Any]], **kw: Any) -> str:
    (out,) = llm.chat(conv, ONE, chat_template=SHOW, use_tqdm=False, **kw)
    assert llm.tokenizer is not None
    return str(llm.tokenizer.decode(out.prompt_token_ids))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_llm_chat_reasoning_and_tools(llm: LLM) -> None:
    conv = [
        {"role": "user", "content": "hi", "reasoning": None},
        {"role": "assistant", "content": "yo", "reasoning": "greet", "reasoning_content": None},
        {"role": "user", "content": "weather?"},
    ]
    text = rendered(llm, conv, tools=TOOLS)
    text = text.replace("\n", "")  # the tiny vocabulary has no newline token
    assert "user: hiassistant: yo [r=greet|rc=greet]user: weather?" in text
    assert text.endswith("tools: get_weatherassistant:")
    assert "tools:" not in rendered(llm, conv)
    with pytest.raises(TypeError, match="tools must be a list of tool dicts"):
        llm.chat(conv, ONE, chat_template=SHOW, tools="get_weather")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"messages\[1\]: reasoning must be a string"):
        llm.chat([conv[0], {**conv[1], "reasoning": 1}], ONE, chat_template=SHOW)
    assert conv[1]["reasoning_content"] is None  # the caller's messages are not changed
    assert llm.llm_engine.has_unfinished_requests() is False


def test_server_chat_prompt_takes_reasoning(llm: LLM) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi", "reasoning": None, "reasoning_content": None},
            {"role": "assistant", "content": "yo", "reasoning": "greet"},
        ],
    }
    ids = chat_prompt(llm.tokenizer, ChatCompletionRequest(**body), SHOW)()["prompt_token_ids"]
    assert llm.tokenizer is not None
    assert "assistant: yo [r=greet|rc=greet]" in llm.tokenizer.decode(ids)
    bad = {**body, "messages": [{"role": "assistant", "content": "", "reasoning": "a",
                                 "reasoning_content": "b"}]}  # fmt: skip
    with pytest.raises(RequestError, match="differ") as e:
        chat_prompt(llm.tokenizer, ChatCompletionRequest(**bad), SHOW)
    assert e.value.param == "messages[0]"


def test_cleanup_dist_env_and_memory() -> None:
    import gc

    from paged_engine.distributed import cleanup_dist_env_and_memory

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    gc.disable()
    try:
        Cycle()
        with pytest.raises(TypeError, match="shutdown_ray must be a bool"):
            cleanup_dist_env_and_memory(shutdown_ray="yes")  # type: ignore[arg-type]
        assert any(type(o) is Cycle for o in gc.get_objects())  # the refusal freed nothing
        cleanup_dist_env_and_memory()
        assert not any(type(o) is Cycle for o in gc.get_objects())
    finally:
        gc.enable()
