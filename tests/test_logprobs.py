"""Logprobs through ``ModelRunner.run`` on the tiny Qwen3 against transformers' own model:
the sampled token's logprob, rank and top-k, and prompt logprobs in one chunk and in two,
all from the model's raw distribution (vLLM's default), whatever the penalties or
temperature. Float32 everywhere, tolerance 1e-4.

``Steps`` (used by tests/test_penalties.py too) drives the runner as the scheduler would.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.outputs import FailedSample, SampleOutput, TokenLogprobs
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from paged_engine.worker.model_runner import ModelRunner

SMALL: dict[str, Any] = dict(num_kvcache_blocks=64, max_model_len=128, dtype="float32")
TOL = 1e-4
PROMPT = [11, 42, 7, 300, 5, 99, 123, 8, 17, 256, 4, 61, 700, 3, 88, 19, 2, 640, 31, 77]


class Steps:
    """Runs sequences through a ModelRunner step by step, as the scheduler would: each
    gets fresh blocks as it grows (the pool is reused from block 0 by each new driver)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 0

    def step(self, seqs: list[Sequence], counts: list[int], is_prefill: bool) -> list[Any]:
        """Compute ``counts[i]`` more tokens of ``seqs[i]``; append what is sampled."""
        for seq, n in zip(seqs, counts, strict=True):
            seq.num_scheduled_tokens = n
            while len(seq.block_table) < num_blocks(seq.num_cached_tokens + n, seq.block_size):
                seq.block_table.append(self.next_block)
                self.next_block += 1
        out = self.runner.run(seqs, is_prefill)
        for seq, result in zip(seqs, out, strict=True):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            token = result.token if isinstance(result, SampleOutput) else result
            if isinstance(token, int):
                seq.append_token(token)
                seq.is_prefill = False
        return out

    def generate(self, seqs: list[Sequence], steps: int) -> list[list[Any]]:
        """Prefill whole prompts, then decode; the runner's results, step by step."""
        results = [self.step(seqs, [len(s) for s in seqs], is_prefill=True)]
        for _ in range(steps - 1):
            results.append(self.step(seqs, [1] * len(seqs), is_prefill=False))
        return results


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_model_dir, EngineConfig(device="cpu", **SMALL))


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(hf: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``tokens``: row q predicts q + 1."""
    logits = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_position(ours: TokenLogprobs, ref: torch.Tensor, token: int, k: int) -> None:
    """``ours`` against transformers' logprobs ``ref`` ``[V]`` for ``token`` and top ``k``."""
    assert ours.token_id == token
    assert abs(ours.logprob - float(ref[token])) <= TOL, (ours.logprob, float(ref[token]))
    # the rank, up to tokens within the tolerance of the chosen one
    above = int((ref > ref[token] + TOL).sum()) + 1
    close = int((ref > ref[token] - TOL).sum()) + 1
    assert above <= ours.rank <= close, (ours.rank, above, close)
    assert len(ours.top) == k
    want = ref.topk(k).values.tolist()
    assert [v for _, v in ours.top] == pytest.approx(want, abs=TOL)
    for tid, value in ours.top:  # each listed id has that logprob (ties in any order)
        assert abs(value - float(ref[tid])) <= TOL, (tid, value, float(ref[tid]))
    assert len({tid for tid, _ in ours.top}) == k


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.8, seed=3, logprobs=3),
        # raw logprobs: penalties and temperature change the draw, not the logprobs
        SamplingParams(temperature=0.5, seed=4, repetition_penalty=1.6, logprobs=4),
        SamplingParams(temperature=0, frequency_penalty=1.5, logit_bias={9: 4.0}, logprobs=2),
        SamplingParams(temperature=0, logprobs=0),
    ],
)
def test_sampled_token_logprobs_match_transformers(
    runner: ModelRunner, hf: Any, params: SamplingParams
) -> None:
    seqs = [Sequence(PROMPT[:7], params), Sequence([5, 6, 7], SamplingParams(temperature=0))]
    results = Steps(runner).generate(seqs, steps=6)
    k = params.logprobs or 0
    for step, out in enumerate(results):
        assert isinstance(out[1], int)  # the neighbour asked for nothing
        result = out[0]
        assert isinstance(result, SampleOutput) and result.prompt_logprobs == ()
        assert isinstance(result.token, int) and result.logprobs is not None
        tokens = seqs[0].token_ids[: 7 + step]
        ref = hf_logprobs(hf, tokens)[-1]
        check_position(result.logprobs, ref, result.token, k)
        if params.greedy and not params.has_penalties and params.logit_bias is None:
            assert result.logprobs.rank == 1


def test_a_penalised_token_has_the_raw_rank(runner: ModelRunner, hf: Any) -> None:
    """A bias forces a token the model itself ranks low: its rank is the model's."""
    ref = hf_logprobs(hf, PROMPT[:5])[-1]
    low = int(ref.argsort()[100])  # the 101st least likely
    params = SamplingParams(temperature=0, logit_bias={low: 1000.0}, logprobs=1)
    (out,) = runner.run(_prefilled([Sequence(PROMPT[:5], params)]), is_prefill=True)
    assert isinstance(out, SampleOutput) and out.token == low
    assert out.logprobs is not None and out.logprobs.rank > 600
    check_position(out.logprobs, ref, low, 1)


def _prefilled(seqs: list[Sequence]) -> list[Sequence]:
    block = 0
    for seq in seqs:
        seq.block_table = list(range(block, block + seq.num_blocks))
        block += seq.num_blocks
        seq.num_scheduled_tokens = len(seq)
    return seqs


def _prompt_entries(out: SampleOutput) -> list[TokenLogprobs]:
    return list(out.prompt_logprobs)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_in_one_chunk_match_transformers(
    runner: ModelRunner, hf: Any, k: int
) -> None:
    params = SamplingParams(temperature=0, prompt_logprobs=k)
    seqs = [Sequence([8, 8, 9], SamplingParams(temperature=0)), Sequence(PROMPT, params)]
    out = Steps(runner).step(seqs, [3, len(PROMPT)], is_prefill=True)
    assert isinstance(out[0], int)
    result = out[1]
    assert isinstance(result, SampleOutput) and isinstance(result.token, int)
    assert result.logprobs is None  # not asked for
    ref = hf_logprobs(hf, PROMPT)
    entries = _prompt_entries(result)
    assert [e.token_id for e in entries] == PROMPT[1:]  # positions 1 … len - 1
    for q, entry in enumerate(entries):
        check_position(entry, ref[q], PROMPT[q + 1], k)


def test_prompt_logprobs_over_two_chunks_match_transformers(runner: ModelRunner, hf: Any) -> None:
    params = SamplingParams(temperature=0, prompt_logprobs=2, logprobs=2)
    seq = Sequence(PROMPT, params)
    steps = Steps(runner)
    first = steps.step([seq], [8], is_prefill=True)[0]
    assert isinstance(first, SampleOutput) and first.token is None and first.logprobs is None
    assert [e.token_id for e in first.prompt_logprobs] == PROMPT[1:9]  # rows 0 … 7
    second = steps.step([seq], [len(PROMPT) - 8], is_prefill=True)[0]
    assert isinstance(second, SampleOutput) and isinstance(second.token, int)
    assert [e.token_id for e in second.prompt_logprobs] == PROMPT[9:]  # rows 8 … 18
    ref = hf_logprobs(hf, PROMPT)
    for q, entry in enumerate([*first.prompt_logprobs, *second.prompt_logprobs]):
        check_position(entry, ref[q], PROMPT[q + 1], 2)
    assert second.logprobs is not None
    check_position(second.logprobs, ref[-1], second.token, 2)
    # decode steps carry no prompt logprobs
    third = steps.step([seq], [1], is_prefill=False)[0]
    assert isinstance(third, SampleOutput) and third.prompt_logprobs == ()
    assert third.logprobs is not None


def test_a_chunk_ending_one_before_the_last_prompt_token(runner: ModelRunner, hf: Any) -> None:
    """Rows stop at the second-to-last prompt token's successor; none beyond the prompt."""
    seq = Sequence(PROMPT[:6], SamplingParams(temperature=0, prompt_logprobs=1))
    steps = Steps(runner)
    first = steps.step([seq], [5], is_prefill=True)[0]
    assert isinstance(first, SampleOutput) and first.token is None
    assert [e.token_id for e in first.prompt_logprobs] == PROMPT[1:6]
    last = steps.step([seq], [1], is_prefill=True)[0]
    assert isinstance(last, SampleOutput) and isinstance(last.token, int)
    assert last.prompt_logprobs == ()  # the last row predicts the first output token
    ref = hf_logprobs(hf, PROMPT[:6])
    for q, entry in enumerate(first.prompt_logprobs):
        check_position(entry, ref[q], PROMPT[q + 1], 1)


def test_a_failed_row_that_asked_for_logprobs_reports_none(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: original(h) * math.nan)
    seqs = _prefilled([Sequence([1, 2, 3], SamplingParams(temperature=0, logprobs=2))])
    (out,) = runner.run(seqs, is_prefill=True)
    assert isinstance(out, SampleOutput) and isinstance(out.token, FailedSample)
    assert out.logprobs is None


def test_ranks_count_strictly_larger_logprobs_so_ties_share_the_better_rank() -> None:
    from paged_engine.layers.logprobs import token_logprobs

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    z = math.log(2 * math.e**3 + math.e + 1)  # the first row's log-partition
    got = token_logprobs(logits.repeat(2, 1), [2, 3, 0, 1], [1, 4, 10, 0])
    assert [g.rank for g in got] == [1, 1, 3, 1]
    assert got[0].logprob == pytest.approx(3 - z, abs=1e-6)
    assert got[2].logprob == pytest.approx(1 - z, abs=1e-6)
    assert got[1].logprob == pytest.approx(-math.log(4), abs=1e-6)
    assert {t for t, _ in got[1].top} == {0, 1, 2, 3}  # k = 4 is the whole vocabulary
    assert len(got[2].top) == 4  # k beyond it is clamped
    assert [t for t, _ in got[2].top][:2] in ([1, 2], [2, 1]) and got[2].top[2][0] == 0
    assert got[3].top == ()


# ---- n > 1 with prompt logprobs: computed once, by completion 0 (issue 28, defect 5) ----------


def _prompt_run(n: int, prompt: list[int]) -> tuple[Any, Any]:
    """One request through the engine on the logprobs fake (tests/fault_tracing.py), whose
    prompt logprobs depend on the sampling seed: each completion computing the prompt
    rows would give them its own values."""
    from dataclasses import replace

    from tests import fault_tracing as ft

    config = replace(ft.CONFIG, max_num_batched_tokens=64, num_kvcache_blocks=40)
    engine = ft.LLMEngine(
        ft.LogprobsRunner(config, ft.VOCAB, 100), config, vocab_size=ft.VOCAB, eos_token_id=None
    )
    params = SamplingParams(temperature=1.0, seed=11, n=n, max_tokens=3, prompt_logprobs=2)
    (out,) = engine.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return out, engine.scheduler.stats


def test_n_completions_return_the_prompt_logprobs_of_one_computation() -> None:
    prompt = [1, 2, 3, 4, 5, 1, 2]  # 3 full blocks of 2, then one token
    alone, alone_stats = _prompt_run(1, prompt)
    three, stats = _prompt_run(3, prompt)
    assert alone.prompt_logprobs[0] is None and None not in alone.prompt_logprobs[1:]
    assert three.prompt_logprobs == alone.prompt_logprobs  # completion 0's values only
    # The prompt is computed once: completions 1 and 2 hit completion 0's full blocks and
    # compute the last token alone.
    assert alone_stats.prefill_tokens == len(prompt)
    assert stats.cached_prompt_tokens == 2 * 6
    assert stats.prefill_tokens == len(prompt) + 2 * 1


def test_n_completions_compute_the_prompt_once_on_the_real_model(tiny_model_dir: Path) -> None:
    from paged_engine import LLM

    llm = LLM(
        tiny_model_dir,
        num_kvcache_blocks=32,
        kvcache_block_size=4,
        max_model_len=64,
        dtype="float32",
    )
    prompt = PROMPT[:14]  # 3 full blocks of 4, then two tokens
    one = SamplingParams(temperature=0.8, seed=5, max_tokens=2, prompt_logprobs=3)
    (alone,) = llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)
    from dataclasses import replace

    (two,) = llm.generate({"prompt_token_ids": prompt}, replace(one, n=2), use_tqdm=False)
    stats = llm.last_run_stats
    assert stats is not None
    assert stats.prefill_tokens == len(prompt) + (len(prompt) - 12)
    assert stats.cached_prompt_tokens == 12
    assert len(two.prompt_logprobs) == len(prompt) and two.prompt_logprobs[0] is None
    for got, want in zip(two.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()
        for t in got:
            assert abs(got[t].logprob - want[t].logprob) <= TOL
            assert got[t].rank == want[t].rank
