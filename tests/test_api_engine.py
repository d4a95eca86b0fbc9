"""The vLLM-shaped engine API on the fake model: request ids, prompt forms, streaming
``step()``, ``n`` sharing the prompt's blocks, stop strings, stop reasons, aborts, and every
refusal leaving the engine as it was. The fake tokenizer spells token t as ``<t>``, so text
and tokens can be checked against each other exactly."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeTokenizer, reference_generate

CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=40,
    kvcache_block_size=4,
    num_kvcache_blocks=40,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make(config: EngineConfig = CONFIG, eos: int = 0) -> LLMEngine:
    return build_engine(config, spec=False, eos=eos, tokenizer=FakeTokenizer())


def oracle(prompt: list[int], params: SamplingParams, eos: int | None = None) -> list[int]:
    # The fake model ignores sampling settings: it is "greedy" whatever the temperature.
    limit = params.max_tokens or CONFIG.max_model_len
    tokens, _ = reference_generate(
        prompt,
        replace(params, stop=None, n=1, temperature=0, max_tokens=limit),
        vocab_size=VOCAB,
        eos_token_id=eos,
        max_model_len=CONFIG.max_model_len,
    )
    return tokens


def spell(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


def run(engine: LLMEngine) -> dict[str, list[Any]]:
    """Step to the end; every request's outputs, in order."""
    seen: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def snapshot(engine: LLMEngine) -> object:
    sched = engine.scheduler
    return (
        engine.block_manager.snapshot(),  # type: ignore[attr-defined]
        [s.seq_id for s in sched.waiting],
        [s.seq_id for s in sched.running],
        sorted(engine._requests),
    )


# ---- streaming ---------------------------------------------------------------------------


def test_step_streams_cumulative_outputs_one_token_per_decode_step() -> None:
    engine = make()
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [3, 3, 3, 3, 3], replace(GREEDY, max_tokens=5))
    seen = run(engine)
    for rid, prompt, n in (("a", [1, 2, 3], 8), ("b", [3, 3, 3, 3, 3], 5)):
        outs = seen[rid]
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == list(range(1, n + 1))  # one new token per step
        assert [o.finished for o in outs] == [False] * (n - 1) + [True]  # finished once
        final = outs[-1].outputs[0]
        assert final.token_ids == oracle(prompt, GREEDY)[:n]
        for o in outs:  # cumulative text, always the spelling of the tokens so far
            assert o.outputs[0].text == spell(o.outputs[0].token_ids)
        assert final.finish_reason == "length"
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time  # type: ignore[operator]
        assert m.first_token_time <= m.last_token_time <= m.finished_time  # type: ignore[operator]
    assert engine.step() == []  # idle


def test_outputs_name_the_request_and_the_prompt() -> None:
    engine = make()
    engine.add_request("tokens", [4, 1, 2], GREEDY)
    engine.add_request("text", "<4><1><2>", GREEDY)
    engine.add_request("dict", {"prompt_token_ids": [4, 1, 2]}, GREEDY)
    engine.add_request("textdict", {"prompt": "<4><1><2>"}, GREEDY)
    finals = {rid: outs[-1] for rid, outs in run(engine).items()}
    assert finals["tokens"].prompt is None and finals["dict"].prompt is None
    assert finals["text"].prompt == finals["textdict"].prompt == "<4><1><2>"
    expected = oracle([4, 1, 2], GREEDY)
    for rid, out in finals.items():
        assert out.request_id == rid
        assert out.prompt_token_ids == [4, 1, 2]
        assert out.outputs[0].token_ids == expected


# ---- n -------------------------------------------------------------------------------------


def test_n_completions_share_the_prompt_blocks() -> None:
    """n=4 over a 10-token prompt (blocks of 4): one prefill computes the two full prompt
    blocks; the other three completions hit both and hold only their own last block."""
    engine = make()
    prompt = [1, 2, 3, 4, 2, 3, 4, 1, 0, 0]
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, n=4)
    engine.add_request("a", prompt, params)
    engine.step()  # the first completion's prefill; the others wait to hit its blocks
    engine.step()
    tables = [s.block_table for s in engine.scheduler.running]
    # Shared full blocks 0 and 1 (computed by the first), then a last block each.
    assert tables == [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]]
    out = run(engine)["a"][-1]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.finished and all(c.finished() for c in out.outputs)
    assert all(c.token_ids == oracle(prompt, params)[:2] for c in out.outputs)  # fake: same
    assert engine.scheduler.stats.cached_prompt_tokens == 3 * 8


def test_n_without_prefix_caching_still_completes() -> None:
    engine = make(replace(CONFIG, enable_prefix_caching=False))
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=3)
    engine.add_request("a", [1, 2, 3, 4, 1], params)
    out = run(engine)["a"][-1]
    assert [c.token_ids for c in out.outputs] == [oracle([1, 2, 3, 4, 1], params)[:3]] * 3


# ---- stop strings and stop reasons -------------------------------------------------------


def _stop_case() -> tuple[list[int], list[int]]:
    prompt = [2, 3, 1]
    return prompt, oracle(prompt, replace(GREEDY, max_tokens=12))


def test_a_stop_string_spanning_tokens_ends_the_request_in_that_step() -> None:
    prompt, free = _stop_case()
    # A stop string made of the end of token 3's text and the start of token 4's; it
    # first completes with the token ``k``, which the tokens must stop at.
    stop = spell(free[3:5])[2:-1]
    k = next(k for k in range(1, len(free) + 1) if stop in spell(free[:k]))
    engine = make()
    engine.add_request("a", prompt, replace(GREEDY, max_tokens=12, stop=[stop, "never"]))
    engine.add_request(
        "b", prompt, replace(GREEDY, max_tokens=12, stop=stop, include_stop_str_in_output=True)
    )
    seen = run(engine)
    for rid, include in (("a", False), ("b", True)):
        final = seen[rid][-1].outputs[0]
        full = spell(free)
        at = full.index(stop)
        assert final.text == full[: at + len(stop)] if include else final.text == full[:at]
        assert final.finish_reason == "stop" and final.stop_reason == stop
        # The tokens stop with the one that completed the stop string: no token past it.
        assert final.token_ids == free[:k]
        # Streamed text is always a prefix of the final text: nothing is taken back.
        for out in seen[rid]:
            assert final.text.startswith(out.outputs[0].text)
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks


def test_stop_strings_with_n_stop_each_completion() -> None:
    prompt, free = _stop_case()
    stop = spell(free[2:4])
    engine = make()
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, stop=stop)
    engine.add_request("a", prompt, params)
    out = run(engine)["a"][-1]
    full = spell(free)
    for c in out.outputs:
        assert c.text == full[: full.index(stop)] and c.stop_reason == stop
        assert c.token_ids == free[:4]


def test_stop_strings_wait_for_min_tokens() -> None:
    prompt, free = _stop_case()
    stop = spell(free[:1])  # would match the very first token
    engine = make()
    engine.add_request("a", prompt, replace(GREEDY, max_tokens=12, stop=stop, min_tokens=12))
    final = run(engine)["a"][-1].outputs[0]
    assert final.token_ids == free and final.finish_reason == "length"


def test_stop_token_and_eos_stop_reasons() -> None:
    prompt, free = _stop_case()
    # EOS is the first token to appear only after two others; the first token is a stop token.
    eos = next(t for t in free if free.index(t) >= 2)
    stop_token = free[0]
    assert stop_token != eos
    engine = make(eos=eos)
    params = replace(GREEDY, ignore_eos=False, max_tokens=12)
    engine.add_request("tok", prompt, replace(params, stop_token_ids=[stop_token]))
    engine.add_request("eos", prompt, params)
    seen = run(engine)
    tok = seen["tok"][-1].outputs[0]
    assert tok.token_ids == free[:1]
    assert (tok.finish_reason, tok.stop_reason) == ("stop", stop_token)
    out = seen["eos"][-1].outputs[0]
    assert out.token_ids == free[: free.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)


def test_max_tokens_none_runs_to_max_model_len() -> None:
    engine = make()
    prompt = [1, 2, 3]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    final = run(engine)["a"][-1].outputs[0]
    assert len(prompt) + len(final.token_ids) == CONFIG.max_model_len
    assert final.token_ids == oracle(
        prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )
    assert final.finish_reason == "length"


# ---- aborts and refusals ---------------------------------------------------------------


def test_abort_takes_one_id_or_several() -> None:
    engine = make()
    for rid in "abc":
        engine.add_request(rid, [1, 2, 3], GREEDY)
    engine.step()
    assert engine.abort_request(["a", "c", "nope"])
    assert not engine.abort_request("a")
    seen = run(engine)
    assert sorted(seen) == ["b"] and seen["b"][-1].finished
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks


@pytest.mark.parametrize(
    ("rid", "prompt", "params", "exc", "words"),
    [
        (7, [1, 2], GREEDY, TypeError, "request_id must be a str"),
        ("busy", [1, 2], GREEDY, ValueError, "already in the engine"),
        ("x", {"prompt_ids": [1]}, GREEDY, TypeError, "unknown prompt key"),
        ("x", {"cache_salt": "s"}, GREEDY, TypeError, "needs 'prompt' or 'prompt_token_ids'"),
        ("x", {"prompt_token_ids": [1], "cache_salt": 3}, GREEDY, TypeError, "cache_salt"),
        ("x", {"prompt_token_ids": [1], "cache_salt": ""}, GREEDY, ValueError, "cache_salt"),
        ("x", {"prompt_token_ids": "12"}, GREEDY, TypeError, "prompt_token_ids"),
        ("x", [1] * 40, SamplingParams(max_tokens=None), ValueError, "no room"),
        ("x", [1, 2], SamplingParams(logprobs=21), ValueError, "logprobs=21"),
        ("x", [1, 2], SamplingParams(prompt_logprobs=50), ValueError, "prompt_logprobs=50"),
        ("x", [1, 2], "greedy", TypeError, "sampling params"),
    ],
)
def test_a_refused_request_changes_nothing(
    rid: Any, prompt: Any, params: Any, exc: type, words: str
) -> None:
    engine = make()
    engine.add_request("busy", [4, 4, 4, 4, 4], GREEDY)
    engine.step()
    before = snapshot(engine)
    with pytest.raises(exc, match=words):
        engine.add_request(rid, prompt, params)
    assert snapshot(engine) == before
    final = run(engine)["busy"][-1]
    assert final.outputs[0].token_ids == oracle([4, 4, 4, 4, 4], GREEDY)


def test_stop_strings_need_a_tokenizer() -> None:
    engine = build_engine(CONFIG, spec=False)  # no tokenizer
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("a", [1, 2], SamplingParams(stop="x"))
    assert not engine.has_unfinished_requests()


# ---- generate ------------------------------------------------------------------------------


def test_generate_takes_one_prompt_or_a_list_in_every_form() -> None:
    engine = make()
    expected = oracle([4, 1, 2], GREEDY)
    for prompts in ([4, 1, 2], "<4><1><2>", {"prompt_token_ids": [4, 1, 2]}):
        (out,) = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected
    outs = engine.generate(
        [[4, 1, 2], "<4><1><2>", {"prompt": "<4><1><2>"}], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 3
    assert [o.outputs[0].text for o in outs] == [spell(expected)] * 3


@pytest.mark.parametrize(
    ("prompts", "params", "exc", "words"),
    [
        ([[1], [2]], "temperature=0", TypeError, "sampling_params must be SamplingParams"),
        ([[1], [2]], [GREEDY], ValueError, "1 sampling params for 2 prompts"),
        ([], GREEDY, ValueError, "prompts is empty"),
        (42, GREEDY, TypeError, "prompts must be"),
        ([[1], 42], GREEDY, TypeError, "prompt 1"),
    ],
)
def test_generate_refuses_bad_arguments_and_queues_nothing(
    prompts: Any, params: Any, exc: type, words: str
) -> None:
    engine = make()
    before = snapshot(engine)
    with pytest.raises(exc, match=words):
        engine.generate(prompts, params, use_tqdm=False)
    assert snapshot(engine) == before and not engine.has_unfinished_requests()


def test_prompt_logprobs_requests_bypass_the_prefix_cache() -> None:
    """Every prompt row must be computed for its logprobs: a request asking for them gets
    no prefix hit even when its prompt is cached (and the fake runner returns no logprobs,
    so the lists stay empty)."""
    engine = make()
    prompt = [1, 2, 3, 4, 2, 3, 4, 1, 0]
    engine.generate(prompt, GREEDY, use_tqdm=False)
    (hit,) = engine.generate(prompt, GREEDY, use_tqdm=False)
    (miss,) = engine.generate(prompt, replace(GREEDY, prompt_logprobs=0), use_tqdm=False)
    assert (hit.num_cached_tokens, miss.num_cached_tokens) == (8, 0)
    assert miss.outputs[0].token_ids == hit.outputs[0].token_ids


def test_run_stats_print_the_hit_rate_and_throughput() -> None:
    engine = make()
    engine.generate([[1, 2, 3, 4, 4], [1, 2, 3, 4, 0]], GREEDY, use_tqdm=False)
    stats = engine.last_run_stats
    assert stats is not None and stats.output_tokens == 16
    text = str(stats)
    assert f"{stats.prefix_cache_hit_rate:.1%}" in text and "tok/s" in text
    assert "16 tokens out" in text


def test_generate_honours_stop_strings_without_streaming() -> None:
    """``generate`` detokenises only requests with stop strings step by step; those must
    still end (a request finished by its text, not its tokens, once hung generate)."""
    prompt, free = _stop_case()
    stop = spell(free[2:4])
    engine = make()
    long = replace(GREEDY, max_tokens=12)
    plain, stopped = engine.generate(
        [prompt, prompt], [long, replace(long, stop=stop)], use_tqdm=False
    )
    assert plain.outputs[0].token_ids == free and plain.outputs[0].text == spell(free)
    full = spell(free)
    assert stopped.outputs[0].text == full[: full.index(stop)]
    assert stopped.outputs[0].stop_reason == stop
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks


def test_delta_outputs_add_up_and_final_only_reports_once() -> None:
    prompt, free = _stop_case()
    stop = spell(free[5:7])
    engine = make()
    for rid, kind in (("c", RequestOutputKind.CUMULATIVE), ("d", RequestOutputKind.DELTA),
                      ("f", RequestOutputKind.FINAL_ONLY)):  # fmt: skip
        engine.add_request(rid, prompt, replace(GREEDY, max_tokens=12, stop=stop, output_kind=kind))
    seen = run(engine)
    final = seen["c"][-1].outputs[0]
    deltas = [o.outputs[0] for o in seen["d"]]
    assert len(deltas) == len(seen["c"]) > 1
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert "".join(d.text for d in deltas) == final.text
    assert [d.finish_reason for d in deltas][-1] == "stop"
    assert len(seen["f"]) == 1 and seen["f"][0].outputs[0] == final
