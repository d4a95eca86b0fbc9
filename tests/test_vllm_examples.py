"""vLLM's two basic offline examples, ported by changing the import only, on the tiny model.

Written from what the examples do (not copied): ``examples/offline_inference/basic/
generate.py`` parses ``EngineArgs``' flags and sampling flags, builds ``LLM(**args)``,
starts from ``llm.get_default_sampling_params()`` and sets the fields the user gave on it
after construction, then prints each prompt with its completion.
``examples/offline_inference/llm_engine_example.py`` builds an ``LLMEngine`` from
``EngineArgs.from_cli_args``, feeds one (prompt, params) pair per step while driving
``step()``, and prints every finished ``RequestOutput``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from paged_engine.errors import InvalidRequestError

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
ENGINE_FLAGS = ["--max-model-len", "128", "--num-gpu-blocks-override", "64", "--block-size", "8"]


# ---- generate.py ---------------------------------------------------------------------------


def create_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("Sampling parameters")
    group.add_argument("--max-tokens", type=int)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    return parser


def generate_main(args: dict[str, Any]) -> list[tuple[str, str]]:
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    top_p = args.pop("top_p")
    top_k = args.pop("top_k")
    # as vLLM's: every dest add_cli_args makes is an LLM argument
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k
    outputs = llm.generate(PROMPTS, sampling_params, use_tqdm=False)
    printed = []
    for output in outputs:
        assert output.prompt is not None
        printed.append((output.prompt, output.outputs[0].text))
        print(f"Prompt: {output.prompt!r}\nOutput: {output.outputs[0].text!r}")
    return printed


def test_generate_py(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tuned = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 5}
    (model / "generation_config.json").write_text(json.dumps(tuned))
    flags = ["--model", str(model), *ENGINE_FLAGS]
    args = vars(create_parser().parse_args([*flags, "--temperature", "0", "--max-tokens", "7"]))
    printed = generate_main(args)
    assert [p for p, _ in printed] == PROMPTS and all(text for _, text in printed)
    # what the script asked for: the model's defaults, two fields set after construction
    want = SamplingParams(temperature=0.0, top_p=0.8, top_k=20, max_tokens=7)
    llm = LLM(model, max_model_len=128, block_size=8, num_gpu_blocks_override=64)
    assert [(o.prompt, o.outputs[0].text) for o in llm.generate(PROMPTS, want)] == printed


# ---- llm_engine_example.py -----------------------------------------------------------------


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?",
         SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]  # fmt: skip


def process_requests(
    engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]
) -> list[RequestOutput]:
    request_id = 0
    finished = []
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                finished.append(request_output)
    return finished


def initialize_engine(args: argparse.Namespace) -> LLMEngine:
    engine_args = EngineArgs.from_cli_args(args)
    return LLMEngine.from_engine_args(engine_args)


def test_llm_engine_example_py(tiny_model_dir: Path) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_model_dir), *ENGINE_FLAGS])
    engine = initialize_engine(args)
    finished = process_requests(engine, create_test_prompts())
    assert sorted(o.request_id for o in finished) == ["0", "1", "2"]
    by_id = {o.request_id: o for o in finished}
    assert by_id["0"].prompt_logprobs is not None and by_id["0"].outputs[0].logprobs
    assert len(by_id["2"].outputs) == 2
    assert all(len(c.token_ids) <= 16 for o in finished for c in o.outputs)  # max_tokens
    # vLLM's older example asked for best_of=5 with n=2: refused naming it, nothing queued
    old = SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)
    old.best_of = 5
    with pytest.raises(InvalidRequestError, match="best_of=5 > n=2 is not supported") as e:
        engine.add_request("3", "What is the meaning of life?", old)
    assert e.value.field == "best_of" and not engine.has_unfinished_requests()
