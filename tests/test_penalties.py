"""The logit processors and filters vLLM adds, each against an independent oracle:

* repetition, frequency and presence penalties against a hand computation, and greedy
  decoding with them through ``ModelRunner.run`` against transformers (its ``generate``
  with ``repetition_penalty``; its model plus the OpenAI penalties by hand);
* min_tokens against transformers' ``MinNewTokensLengthLogitsProcessor``, and through the
  runner with its eos ids; min_p against ``MinPLogitsWarper``, and vLLM's order of
  min_p before top-p; logit_bias forcing a token;
* mutants: penalties counted over the prompt (or the whole sequence) instead of the
  output, caught by these checks.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.sequence import Sequence as EngineSequence
from paged_engine.layers import logits_processors
from paged_engine.layers.logits_processors import apply_logits_processors
from paged_engine.layers.sampler import Sampler, probabilities
from paged_engine.sampling_params import SamplingParams
from paged_engine.worker.model_runner import ModelRunner
from tests.test_logprobs import SMALL, Steps

V = 60


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_model_dir, EngineConfig(device="cpu", **SMALL))


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@dataclass(frozen=True)
class History:
    token_ids: list[int]
    num_prompt_tokens: int


def _random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------- penalties by hand, and mutants

CASES = [
    # prompt, output: tokens repeated in each, tokens in only one, an empty output
    ([3, 3, 4, 9, 10], [4, 4, 4, 7, 3, 50]),
    ([1, 2, 2, 2], [5, 6, 5, 1]),
    ([8, 9], []),
    ([20] * 6, [21, 20]),
]


def _by_hand(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """vLLM's penalties written out per token: repetition over prompt and output
    (divide a positive logit, multiply the others), then frequency × count and presence ×
    (count > 0) over the output."""
    counts = Counter(output)
    seen = set(prompt) | set(output)
    out = []
    for token, x in enumerate(row):
        if token in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[token]
        x -= p.presence_penalty * (1 if counts[token] else 0)
        out.append(x)
    return out


PENALTIES = [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=1.3),
    SamplingParams(frequency_penalty=-0.4, presence_penalty=0.9),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=2.0, presence_penalty=-2.0),
]


def check_penalties_by_hand() -> None:
    logits = _random_logits(len(CASES) * len(PENALTIES), seed=1)
    params = [p for p in PENALTIES for _ in CASES]
    histories = [History(pr + out, len(pr)) for _ in PENALTIES for pr, out in CASES]
    got = apply_logits_processors(logits.clone(), params, histories)
    for r, (p, (prompt, output)) in enumerate((p, case) for p in PENALTIES for case in CASES):
        want = torch.tensor(_by_hand(logits[r].tolist(), prompt, output, p))
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-6)


def test_penalties_match_a_hand_computation() -> None:
    check_penalties_by_hand()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalties_on_cuda_logits_match_the_hand_computation() -> None:
    """Every tensor the penalties build lives on the logits' device: CUDA logits come back
    on CUDA with the hand-computed values, and the counts are made there. The ten device
    survivors of tests/equivalent_mutants.md ("Survivors not killed on this machine")
    differ from the real code only here (each raises a device mismatch)."""
    logits = _random_logits(len(CASES) * len(PENALTIES), seed=1)
    params = [p for p in PENALTIES for _ in CASES]
    histories = [History(pr + out, len(pr)) for _ in PENALTIES for pr, out in CASES]
    got = apply_logits_processors(logits.cuda(), params, histories)
    assert got.device.type == "cuda"
    for r, (p, (prompt, output)) in enumerate((p, case) for p in PENALTIES for case in CASES):
        want = torch.tensor(_by_hand(logits[r].tolist(), prompt, output, p))
        torch.testing.assert_close(got[r].cpu(), want, atol=1e-5, rtol=1e-6)
    counts = logits_processors._counts([(0, [1, 1, 2])], torch.Size([1, 4]), torch.device("cuda"))
    assert counts.device.type == "cuda"
    assert counts.cpu().tolist() == [[0.0, 2.0, 1.0, 0.0]]  # token 1 twice, token 2 once


def test_rows_without_penalties_are_untouched_beside_rows_with_them() -> None:
    logits = _random_logits(3, seed=2)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams()]
    histories = [History([1, 2, 3], 1)] * 3
    got = apply_logits_processors(logits.clone(), params, histories)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


@contextmanager
def penalty_mutant(view: Callable[[Any], History]) -> Iterator[None]:
    """Penalties that count what ``view`` makes of each history (a broken product)."""
    original = logits_processors._apply_penalties

    def mutant(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Any) -> None:
        original(logits, params, [None if h is None else view(h) for h in histories])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logits_processors, "_apply_penalties", mutant)
        yield


MUTANTS: dict[str, Callable[[Any], History]] = {
    # frequency and presence counted over the prompt, not the output
    "over the prompt": lambda h: History(list(h.token_ids[: h.num_prompt_tokens]), 0),
    # ... over the prompt and the output
    "over the whole sequence": lambda h: History(list(h.token_ids), 0),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_penalty_mutants_are_caught(name: str, runner: ModelRunner, hf: Any) -> None:
    with penalty_mutant(MUTANTS[name]):
        with pytest.raises(AssertionError):
            check_penalties_by_hand()
        with pytest.raises(AssertionError):
            check_greedy_with_penalties(runner, hf, FREQUENCY)


# ---------------------------------------------------------- greedy through the runner vs HF

# The second and third end with tokens the model itself continues them with (566 and
# 698; 253 and 457): counted in the prompt, a penalty would change the first tokens.
PROMPTS = [[5, 6, 7], [9, 9, 2, 4, 566, 698], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 253, 457]]
STEPS = 14
EOS = 0  # the tiny model's


def _runner_greedy(runner: ModelRunner, params: SamplingParams) -> list[list[int]]:
    """``STEPS`` tokens per prompt; eos is masked throughout (``min_tokens``), as
    transformers' ``min_new_tokens`` does for the reference."""
    seqs = [EngineSequence(p, replace(params, min_tokens=STEPS)) for p in PROMPTS]
    saved, runner.eos_token_ids = runner.eos_token_ids, (EOS,)
    try:
        Steps(runner).generate(seqs, STEPS)
    finally:
        runner.eos_token_ids = saved
    return [s.completion_token_ids for s in seqs]


def _first_difference(ours: list[int], ref: list[int], scores: list[torch.Tensor]) -> str | None:
    """None when equal, or equal up to a near tie (top-2 margin < 1e-4) in ``scores``."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = scores[i].topk(2).values
            if float(top2[0] - top2[1]) < 1e-4:
                return None
            return f"position {i}: ours {a}, reference {b}"
    return None


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_with_repetition_penalty_is_transformers_generate(
    runner: ModelRunner,
    hf: Any,
    penalty: float,
) -> None:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, repetition_penalty=penalty, max_new_tokens=STEPS, min_new_tokens=STEPS
    )
    ours = _runner_greedy(runner, SamplingParams(temperature=0, repetition_penalty=penalty))
    plain = _runner_greedy(runner, SamplingParams(temperature=0))
    assert ours != plain  # the penalty changes these continuations
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            gen = hf.generate(
                torch.tensor([prompt]),
                # explicit: generate would mask the prompt's pad ids (2) otherwise
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=config,
                return_dict_in_generate=True,
                output_scores=True,
            )
        ref = gen.sequences[0, len(prompt) :].tolist()
        scores = [s[0].float() for s in gen.scores]
        assert _first_difference(tokens, ref, scores) is None, (prompt, tokens, ref)


FREQUENCY = SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5)


def check_greedy_with_penalties(runner: ModelRunner, hf: Any, params: SamplingParams) -> None:
    """transformers' model, its ``RepetitionPenaltyLogitsProcessor``, and the OpenAI
    penalties written out, argmax at each step, against the runner."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ours = _runner_greedy(runner, params)
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        out: list[int] = []
        scores = []
        for _ in range(STEPS):
            ids = torch.tensor([prompt + out])
            with torch.inference_mode():
                logits = hf(input_ids=ids, use_cache=False).logits[:, -1].float()
            logits = repetition(ids, logits)[0]
            logits[EOS] = -math.inf  # min_tokens
            counts = Counter(out)
            for t, c in counts.items():
                logits[t] -= params.frequency_penalty * c + params.presence_penalty
            scores.append(logits)
            out.append(int(logits.argmax()))
        assert _first_difference(tokens, out, scores) is None, (prompt, tokens, out)


@pytest.mark.parametrize(
    "params",
    [FREQUENCY, SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=1.0)],
)
def test_greedy_with_penalties_is_transformers_plus_the_openai_penalties(
    runner: ModelRunner,
    hf: Any,
    params: SamplingParams,
) -> None:
    assert _runner_greedy(runner, params) != _runner_greedy(runner, SamplingParams(temperature=0))
    check_greedy_with_penalties(runner, hf, params)


# ----------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_like_transformers(ignore_eos: bool) -> None:
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    eos, stops, prompt = (0, 13), (5, 7), [4, 4, 9]
    logits = _random_logits(1, seed=3)
    params = SamplingParams(min_tokens=3, stop_token_ids=stops, ignore_eos=ignore_eos)
    hf_proc = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [*eos, *stops])
    for n_out in range(6):
        tokens = prompt + [30 + i for i in range(n_out)]
        got = apply_logits_processors(logits.clone(), [params], [History(tokens, 3)], eos)
        want = hf_proc(torch.tensor([tokens]), logits.clone())
        assert torch.equal(got, want), n_out
        assert (got[0, [0, 13, 5, 7]] == -math.inf).all().item() is (n_out < 3)


def test_min_tokens_holds_back_eos_under_greedy_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 0], logits[0, 7], logits[0, 12] = 5.0, 4.0, 3.0  # eos, a stop id, the rest
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(7,))
    picks = [
        Sampler()(logits, [params], [None], [History([1] * (4 + n), 4)], eos_token_ids=(0,))
        for n in range(3)
    ]
    assert picks == [[12], [12], [0]]


def test_a_row_min_tokens_leaves_no_token_fails_like_a_non_finite_one() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    params = [SamplingParams(temperature=t, min_tokens=1, stop_token_ids=(1, 2)) for t in (0, 1)]
    history = History([2, 2], 2)
    assert Sampler()(logits, params, [None, None], [history] * 2, eos_token_ids=(0,)) == [
        None,
        None,
    ]


def test_min_tokens_through_the_runner_uses_its_eos_ids(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt = PROMPTS[0]
    (first,) = _runner_greedy(runner, SamplingParams(temperature=0))[:1]
    monkeypatch.setattr(runner, "eos_token_ids", (first[0],))
    seqs = [EngineSequence(prompt, SamplingParams(temperature=0, min_tokens=1))]
    Steps(runner).generate(seqs, 1)
    assert seqs[0].completion_token_ids[0] != first[0]
    seqs = [EngineSequence(prompt, SamplingParams(temperature=0))]  # no min_tokens
    Steps(runner).generate(seqs, 1)
    assert seqs[0].completion_token_ids[0] == first[0]


# ---------------------------------------------------------------------------------- min_p


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.3, 0.9, 1.0])
def test_min_p_keeps_the_tokens_transformers_keeps(temperature: float, min_p: float) -> None:
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = _random_logits(8, seed=4)
    ids = torch.zeros(8, 1, dtype=torch.long)
    scores = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temperature)(ids, logits))
    want = torch.isfinite(scores)
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 8
    kept = probabilities(logits, params) > 0
    assert torch.equal(kept, want)
    # and the sampler draws only from that set
    gens = [torch.Generator().manual_seed(s) for s in range(8)]
    for _ in range(20):
        drawn = Sampler()(logits, params, gens)
        assert all(bool(want[r, t]) for r, t in enumerate(drawn))


def test_min_p_comes_before_top_p_as_in_vllm() -> None:
    """probs 0.5, 0.22, 0.18, 0.1 and min_p 0.25 drop 0.1; top_p 0.75 over the rest
    (0.556, 0.244, 0.2) keeps two tokens. top_p first would keep three (0.5 + 0.22 <
    0.75), and min_p after it all three."""
    logits = torch.tensor([[0.5, 0.22, 0.18, 0.1]]).log()
    kept = probabilities(logits, [SamplingParams(min_p=0.25, top_p=0.75)]) > 0
    assert kept.tolist() == [[True, True, False, False]]
    kept = probabilities(logits, [SamplingParams(top_p=0.75)]) > 0
    assert kept.tolist() == [[True, True, True, False]]


# ----------------------------------------------------------------------------- logit_bias


def test_a_large_bias_forces_a_token_under_greedy(runner: ModelRunner) -> None:
    plain = _runner_greedy(runner, SamplingParams(temperature=0))
    target = next(t for t in range(300, 400) if all(t not in ts for ts in plain))
    forced = _runner_greedy(runner, SamplingParams(temperature=0, logit_bias={target: 100.0}))
    assert all(ts == [target] * STEPS for ts in forced)
    # a huge bias (beyond float32 once added) forces it too, sampled or greedy
    for params in (
        SamplingParams(temperature=0, logit_bias={target: 3e38, 1: 3e38}),
        SamplingParams(temperature=1.0, seed=1, logit_bias={target: 3.4e38}),
    ):
        assert all(ts[0] in (target, 1) for ts in _runner_greedy(runner, params))


def test_a_bias_moves_only_its_own_row() -> None:
    logits = _random_logits(3, seed=5)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0)] * 3
    params[1] = SamplingParams(temperature=0, logit_bias={best[1]: -50.0, 17: 0.5})
    got = Sampler()(logits, params, [None] * 3)
    assert got[0] == best[0] and got[2] == best[2]
    second = logits[1].clone()
    second[best[1]] -= 50.0
    second[17] += 0.5
    assert got[1] == int(second.argmax()) != best[1]


def test_a_bias_beyond_the_vocabulary_fails_its_row_alone_naming_it() -> None:
    # check_request refuses such a bias at admission; the sampler still fails only its row
    logits = _random_logits(2, seed=6)
    greedy = SamplingParams(temperature=0)
    got = Sampler()(logits, [SamplingParams(logit_bias={V: 1.0}), greedy], [None, None])
    assert isinstance(got[0], FailedSample) and f"logit_bias names token {V}" in got[0].reason
    assert got[1] == int(logits[1].argmax())


def test_penalties_need_a_history() -> None:
    got = Sampler()(_random_logits(1, seed=7), [SamplingParams(presence_penalty=1.0)], [None])
    assert isinstance(got[0], FailedSample) and "no token history" in got[0].reason
