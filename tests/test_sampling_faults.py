"""Sampling through the real model path (the tiny Qwen3): temperatures too small to divide
by, top_k beyond any tensor, seeds of any size, and non-finite logits, for which the model
runner returns ``FailedSample`` in place of a token; and a request whose processing,
probabilities or draw raise inside the sampler, which fails alone (``finish_reason
"error"``) while the rest of its batch gets exactly the tokens it gets without it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.config import EngineConfig
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.sequence import Sequence
from paged_engine.layers import sampler as sampler_module
from paged_engine.layers.sampler import Sampler
from paged_engine.utils.tiny_model import make_tiny_model
from paged_engine.worker.model_runner import ModelRunner
from tests.hf_oracle import HFOracle, compare

SMALL: dict[str, Any] = dict(num_kvcache_blocks=64, max_model_len=128, dtype="float32")
"""float32 everywhere (also on CUDA), so greedy tokens compare with transformers'."""
PROMPTS = [[5, 6, 7], [9, 9, 2, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **SMALL)


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _sampled(**overrides: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **overrides})


# ------------------------------------------------------------------- through LLM.generate


def test_a_temperature_below_epsilon_decodes_like_transformers_argmax(
    llm: LLM, tiny_model_dir: Path
) -> None:
    oracle = HFOracle(tiny_model_dir)
    refs = [oracle.greedy(p, 8) for p in PROMPTS]
    for t in (1e-38, 5e-324, 9e-6):
        for params in (_sampled(temperature=t), _sampled(temperature=t, top_p=0.5, seed=3)):
            for ours, ref in zip(_tokens(llm, params), refs, strict=True):
                assert compare(ours, ref) in ("same", "tie"), (t, params)


@pytest.mark.parametrize("top_k", [2**63, 10**30])
def test_top_k_beyond_the_vocabulary_samples_as_if_disabled(llm: LLM, top_k: int) -> None:
    vocab = int(llm.model_runner.hf_config.vocab_size)
    plain = _tokens(llm, [_sampled(top_p=0.9, seed=s) for s in range(3)])
    assert len({t for ts in plain for t in ts}) > 3  # really sampled
    for k in (top_k, vocab, vocab + 1, 0, -1):
        assert _tokens(llm, [_sampled(top_k=k, top_p=0.9, seed=s) for s in range(3)]) == plain
    # beside requests that do filter, in the same steps
    mixed = [_sampled(top_k=top_k, top_p=0.9, seed=0), _sampled(top_k=3, seed=1), _sampled()]
    assert _tokens(llm, mixed)[0] == plain[0]


def _first_unseeded_samples(model_dir: Path, seed: int) -> list[list[int]]:
    llm = LLM(model_dir, seed=seed, **SMALL)
    return _tokens(llm, _sampled(temperature=1.0))


def test_any_int_is_an_engine_seed_taken_modulo_2_to_the_64(tiny_model_dir: Path) -> None:
    base = _first_unseeded_samples(tiny_model_dir, 0)
    assert _first_unseeded_samples(tiny_model_dir, 2**64) == base
    assert _first_unseeded_samples(tiny_model_dir, 1) != base
    assert _first_unseeded_samples(tiny_model_dir, -5) == _first_unseeded_samples(
        tiny_model_dir, 2**64 - 5
    )


@pytest.mark.parametrize("seed", [2**70, -5])
def test_any_int_is_a_request_seed_taken_modulo_2_to_the_64(llm: LLM, seed: int) -> None:
    alone = _tokens(llm, _sampled(seed=seed))
    assert len({t for ts in alone for t in ts}) > 3
    assert _tokens(llm, _sampled(seed=seed)) == alone
    assert _tokens(llm, _sampled(seed=seed + 2**64)) == alone
    assert _tokens(llm, _sampled(seed=seed - 3 * 2**64)) == alone
    assert _tokens(llm, _sampled(seed=seed + 1)) != alone
    crowd = [_sampled(seed=seed), _sampled(temperature=0.7), _sampled(seed=seed, top_k=5)]
    assert _tokens(llm, crowd)[0] == alone[0]


# ----------------------------------------------------------- the runner, non-finite logits


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_model_dir, EngineConfig(device="cpu", **SMALL))


def _prefill(specs: list[tuple[list[int], SamplingParams, int | None]]) -> list[Sequence]:
    """Fresh sequences over disjoint blocks; ``int`` schedules only that many tokens."""
    seqs, block = [], 0
    for prompt, params, scheduled in specs:
        seq = Sequence(prompt, params, block_size=16)
        seq.block_table = list(range(block, block + seq.num_blocks))
        block += seq.num_blocks
        seq.num_scheduled_tokens = scheduled or len(prompt)
        seqs.append(seq)
    return seqs


GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.9, seed=21)
FILTERED = SamplingParams(temperature=1.1, top_k=20, top_p=0.8, seed=22)
A, B, C, D = [5, 6, 7], list(range(1, 30)), [8, 8, 9], [3, 1, 4, 1, 5]


@pytest.mark.parametrize("poison", ["nan row", "one inf", "one -inf", "one nan"])
@pytest.mark.parametrize("victim", [GREEDY, SEEDED, FILTERED])
def test_a_non_finite_row_fails_alone(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, poison: str, victim: SamplingParams
) -> None:
    # A greedy, B a chunk that samples nothing, C the victim, D a filtered seeded draw
    specs = [(A, GREEDY, None), (B, SEEDED, 10), (C, victim, None), (D, FILTERED, None)]
    clean = runner.run(_prefill([specs[0], specs[3]]), is_prefill=True)
    assert all(isinstance(t, int) for t in clean)
    original = runner.model.compute_logits

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        assert logits.shape[0] == 3  # the rows of A, C and D
        value = {"nan row": math.nan, "one nan": math.nan, "one inf": math.inf}
        if poison == "nan row":
            logits[1] = math.nan
        else:
            logits[1, 17] = value.get(poison, -math.inf)
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    out = runner.run(_prefill(specs), is_prefill=True)
    assert [out[0], out[1], out[3]] == [clean[0], None, clean[1]]
    assert isinstance(out[2], FailedSample)
    assert "position 3" in out[2].reason and "not finite" in out[2].reason


def test_a_batch_of_only_non_finite_rows_fails_every_sequence(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: original(h) * math.nan)
    out = runner.run(_prefill([(A, GREEDY, None), (C, SEEDED, None), (D, FILTERED, None)]), True)
    assert all(isinstance(t, FailedSample) for t in out)


# ------------------------------------------------- NaN weights, end to end (scheduler side)


@pytest.fixture(scope="module")
def untied_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """Untied, so a NaN embedding row poisons only the requests that read that token."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("untied") / "model", seed=0, tie_word_embeddings=False
    )
    yield LLM(path, **SMALL)


def test_nan_weights_fail_their_request_with_error_and_spare_the_rest(untied_llm: LLM) -> None:
    params = [_sampled(temperature=0), _sampled(seed=4), _sampled(temperature=0)]
    before = _tokens(untied_llm, params)
    used = {t for ts in [*PROMPTS, *before] for t in ts}
    bad = next(t for t in range(40, 1000) if t not in used)
    with torch.no_grad():
        untied_llm.model_runner.model.model.embed_tokens.weight[bad] = math.nan
    prompts = [PROMPTS[0], [bad, *PROMPTS[1][1:]], PROMPTS[2]]
    out = [o.outputs[0] for o in untied_llm.generate(prompts, params, use_tqdm=False)]
    assert [out[0].token_ids, out[2].token_ids] == [before[0], before[2]]
    assert [o.finish_reason for o in out] == ["length", "error", "length"]
    assert out[1].token_ids == []  # no garbage token before the failure
    assert isinstance(out[1].stop_reason, str) and "not finite" in out[1].stop_reason


# ------------------------------------- a request whose sampling raises fails alone (sampler)

MARK = 0.125
"""The presence penalty that marks the request whose processing the tests make raise."""


def _isolation_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded requests, processed (penalties, a bias) or not, around index 1."""
    prompts = [PROMPTS[0], [4, 4, 2], PROMPTS[1], PROMPTS[2], [7, 1]]
    params = [
        _sampled(temperature=0, presence_penalty=0.5),
        _sampled(seed=9, presence_penalty=MARK, temperature=0.77),  # the one that fails
        _sampled(seed=7, repetition_penalty=1.2),
        _sampled(temperature=0),
        _sampled(seed=8, logit_bias={5: 2.0}, top_k=30),
    ]
    return prompts, params


def _without(items: list[Any], index: int) -> list[Any]:
    return items[:index] + items[index + 1 :]


@pytest.mark.parametrize("phase", ["apply_logits_processors", "probabilities"])
def test_a_request_whose_sampling_raises_fails_alone(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    prompts, params = _isolation_batch()
    alone = llm.generate(_without(prompts, 1), _without(params, 1), use_tqdm=False)
    want = [o.outputs[0].token_ids for o in alone]
    assert len({t for ts in want for t in ts}) > 5
    real = getattr(sampler_module, phase)

    def faulty(logits: torch.Tensor, rows: Any, *args: Any) -> torch.Tensor:
        if any(p.presence_penalty == MARK for p in rows):
            raise RuntimeError("injected fault")
        return real(logits, rows, *args)  # type: ignore[no-any-return]

    monkeypatch.setattr(sampler_module, phase, faulty)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in _without(outs, 1)] == want
    assert [c.finish_reason for c in outs] == ["length", "error", "length", "length", "length"]
    assert outs[1].token_ids == []
    assert isinstance(outs[1].stop_reason, str)
    assert "RuntimeError: injected fault" in outs[1].stop_reason
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    monkeypatch.undo()
    again = llm.generate(_without(prompts, 1), _without(params, 1), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want


def test_a_draw_that_raises_fails_only_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(seed=s, top_p=0.95) for s in range(4)]

    def gens(seeds: list[int | None]) -> list[torch.Generator | None]:
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    torch.manual_seed(11)
    clean = Sampler()(logits, params, gens([1, 2, None, 4]))
    broken = gens([1, 2, None, 4])
    real = sampler_module._draw

    def faulty(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is broken[1]:
            raise RuntimeError("injected draw fault")
        return real(probs, generator)

    monkeypatch.setattr(sampler_module, "_draw", faulty)
    torch.manual_seed(11)
    got = Sampler()(logits, params, broken)
    assert [got[0], got[2], got[3]] == [clean[0], clean[2], clean[3]]
    assert isinstance(got[1], FailedSample) and "injected draw fault" in got[1].reason


def test_untokenized_bad_words_fail_their_row_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    greedy = SamplingParams(temperature=0)
    params = [greedy, SamplingParams(temperature=0, bad_words=["x"]), greedy]
    got = Sampler()(logits, params, [None] * 3)
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())
    assert isinstance(got[1], FailedSample) and "never tokenized" in got[1].reason
