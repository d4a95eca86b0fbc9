"""SamplingParams' validation and normalisation, and the Sampler against distributions
computed by hand, ``argmax`` computed independently, and its own batch-independence.

Through the real model (the tiny Qwen3): tests/test_sampling_faults.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError
from paged_engine.layers.sampler import Sampler
from paged_engine.sampling_params import SamplingParams

# ------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "exc"),
    [
        ("temperature", "0.7", TypeError),
        ("temperature", None, TypeError),
        ("temperature", True, TypeError),
        ("temperature", -1e-9, ValueError),
        ("temperature", math.nan, ValueError),
        ("temperature", math.inf, ValueError),
        ("temperature", 10**400, ValueError),  # an int no float can hold
        ("top_k", 1.5, TypeError),
        ("top_k", "5", TypeError),
        ("top_k", True, TypeError),
        ("top_k", -2, ValueError),
        ("top_k", -(2**70), ValueError),
        ("top_p", 0, ValueError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.0000001, ValueError),
        ("top_p", -0.5, ValueError),
        ("top_p", math.nan, ValueError),
        ("top_p", 10**400, ValueError),
        ("top_p", "0.5", TypeError),
        ("top_p", False, TypeError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", -3, ValueError),
        ("max_tokens", 4.0, TypeError),
        ("max_tokens", True, TypeError),
        ("max_tokens", "5", TypeError),
        ("ignore_eos", 1, TypeError),
        ("ignore_eos", "yes", TypeError),
        ("stop_token_ids", "abc", TypeError),
        ("stop_token_ids", 5, TypeError),
        ("stop_token_ids", [1, -1], ValueError),
        ("stop_token_ids", [1, "2"], TypeError),
        ("stop_token_ids", [True], TypeError),
        ("seed", 1.5, TypeError),
        ("seed", "3", TypeError),
        ("seed", True, TypeError),
        ("max_tokens", 0.0, TypeError),
        *[("n", v, e) for v, e in [(0, ValueError), (-1, ValueError), (2.0, TypeError)]],
        ("n", True, TypeError),
        ("n", None, TypeError),
        *[
            (name, v, e)
            for name in ("presence_penalty", "frequency_penalty")
            for v, e in [
                (2.0001, ValueError),
                (-2.5, ValueError),
                (math.nan, ValueError),
                (math.inf, ValueError),
                ("1", TypeError),
                (None, TypeError),
                (True, TypeError),
            ]
        ],
        *[
            ("repetition_penalty", v, e)
            for v, e in [
                (0, ValueError),
                (0.0, ValueError),
                (-1.0, ValueError),
                (math.inf, ValueError),
                (math.nan, ValueError),
                ("1.1", TypeError),
                (None, TypeError),
            ]
        ],
        *[
            ("min_p", v, e)
            for v, e in [(-0.01, ValueError), (1.01, ValueError), (math.nan, ValueError)]
        ],
        ("min_p", "0.1", TypeError),
        ("stop", 5, TypeError),
        ("stop", b"x", TypeError),
        ("stop", ["ok", 3], TypeError),
        ("stop", "", ValueError),
        ("stop", ["a", ""], ValueError),
        ("stop", {"a": 1}, TypeError),
        ("include_stop_str_in_output", 1, TypeError),
        ("include_stop_str_in_output", None, TypeError),
        *[("min_tokens", v, e) for v, e in [(-1, ValueError), (1.0, TypeError), (None, TypeError)]],
        ("min_tokens", 17, ValueError),  # beyond the default max_tokens (16)
        ("min_tokens", True, TypeError),
        *[
            (name, v, e)
            for name in ("logprobs", "prompt_logprobs")
            for v, e in [(-1, ValueError), (-5, ValueError), (1.0, TypeError), (True, TypeError)]
        ],
        ("logprobs", "3", TypeError),
        ("detokenize", 0, TypeError),
        ("detokenize", "no", TypeError),
        ("skip_special_tokens", 1, TypeError),
        ("skip_special_tokens", None, TypeError),
        ("logit_bias", [1, 2], TypeError),
        ("logit_bias", "a", TypeError),
        ("logit_bias", {"5": 1.0}, TypeError),  # JSON's string keys: convert first
        ("logit_bias", {5.0: 1.0}, TypeError),
        ("logit_bias", {True: 1.0}, TypeError),
        ("logit_bias", {-1: 1.0}, ValueError),
        ("logit_bias", {5: math.inf}, ValueError),
        ("logit_bias", {5: -math.inf}, ValueError),
        ("logit_bias", {5: math.nan}, ValueError),
        ("logit_bias", {5: "1"}, TypeError),
        ("logit_bias", {5: None}, TypeError),
        ("logit_bias", ((5,),), TypeError),
        ("allowed_token_ids", [], ValueError),
        ("allowed_token_ids", [2, -1], ValueError),
        ("allowed_token_ids", 3, TypeError),
        ("allowed_token_ids", [True], TypeError),
        ("bad_words", 3, TypeError),
        ("bad_words", [b"x"], TypeError),
        ("bad_words", ["  "], ValueError),
        ("bad_words_token_ids", [[]], ValueError),
        ("bad_words_token_ids", [3], TypeError),
        ("bad_words_token_ids", [[1.5]], TypeError),
    ],
)
def test_every_refusal_names_its_field(field: str, value: Any, exc: type[Exception]) -> None:
    for build in (
        lambda: SamplingParams(**{field: value}),
        lambda: SamplingParams.from_dict({field: value}),
    ):
        with pytest.raises(exc, match=field) as refused:
            build()
        # the field travels with the error (errors.py), for callers that map it
        structured = InvalidRequestTypeError if exc is TypeError else InvalidRequestError
        assert type(refused.value) is structured and refused.value.field == field
        # the value refused, not the field unknown
        assert "unexpected keyword" not in str(refused.value)
        assert "unknown sampling parameter" not in str(refused.value)


def test_from_dict_names_an_unknown_key() -> None:
    with pytest.raises(TypeError, match=r"'colour'.*known: \[.*'top_k'"):
        SamplingParams.from_dict({"colour": "red", "top_k": 3})


@pytest.mark.parametrize("top_k", [None, 0, -1])
def test_top_k_zero_minus_one_and_none_all_mean_disabled(top_k: int | None) -> None:
    assert SamplingParams(top_k=top_k).top_k is None
    assert SamplingParams(top_k=top_k) == SamplingParams()


def test_accepted_values_are_kept_and_numbers_stored_as_floats() -> None:
    huge = SamplingParams(temperature=2, top_p=1, top_k=2**63, seed=2**70)
    assert (huge.top_k, huge.seed) == (2**63, 2**70)
    assert type(huge.temperature) is float and huge.temperature == 2.0
    assert type(huge.top_p) is float and huge.top_p == 1.0
    assert SamplingParams(seed=-5).seed == -5
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"n": 2, "temperature": 0}, "n"),  # vLLM: greedy decoding has one answer
        ({"stop": ["x"], "detokenize": False}, "stop"),
    ],
)
def test_combinations_vllm_refuses_are_refused(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**values)
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(values)


def test_vllm_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (
        1,
        16,
        0,
        None,
        None,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0, 0, 1, 0)
    assert (p.stop, p.include_stop_str_in_output, p.detokenize, p.skip_special_tokens) == (
        (),
        False,
        True,
        True,
    )
    assert p.logit_bias is None and not p.has_penalties


def test_new_values_are_normalised_and_kept() -> None:
    assert SamplingParams(stop="end").stop == ("end",)
    assert SamplingParams(stop=["a", "bb", "a"]).stop == ("a", "bb", "a")
    assert SamplingParams(stop=None) == SamplingParams()
    assert SamplingParams(stop_token_ids=[4, 3, 4]).stop_token_ids == (4, 3)  # as vLLM
    assert SamplingParams(max_tokens=None, min_tokens=10**6).max_tokens is None
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    p = SamplingParams(logprobs=0, prompt_logprobs=20, n=3, presence_penalty=-2, min_p=1)
    assert (p.logprobs, p.prompt_logprobs, p.n) == (0, 20, 3)
    assert type(p.presence_penalty) is float and type(p.min_p) is float
    assert SamplingParams(repetition_penalty=1e-9).has_penalties


def test_logit_bias_is_stored_as_sorted_pairs() -> None:
    a = SamplingParams(logit_bias={9: -1, 2: 0.5, 3000: 100.0})
    b = SamplingParams(logit_bias={3000: 100, 2: 0.5, 9: -1.0})
    assert a.logit_bias == ((2, 0.5), (9, -1.0), (3000, 100.0))
    assert a == b  # equal whatever the mapping's order
    assert all(type(v) is float for _, v in a.logit_bias)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert replace(a, temperature=0.5).logit_bias == a.logit_bias  # the stored form again
    assert a.clone() == a and a.clone() is not a


def test_a_refused_logit_bias_names_the_bad_entry() -> None:
    with pytest.raises(ValueError, match=r"logit_bias\[7\] must be finite"):
        SamplingParams(logit_bias={1: 1.0, 7: math.nan})


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    [
        *[(0, True), (0.0, True), (5e-324, True), (1e-38, True), (9.99e-6, True)],
        *[(1e-5, False), (0.01, False), (1, False), (1e30, False)],
    ],
)
def test_greedy_is_temperature_below_vllms_epsilon(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


# -------------------------------------------------------------------------------- Sampler


def test_greedy_and_top_k_one_are_argmax() -> None:
    torch.manual_seed(10)
    logits = torch.randn(6, 50)
    expected = logits.argmax(-1).tolist()
    sampler = Sampler()
    greedy = [SamplingParams(temperature=0)] * 6
    assert sampler(logits, greedy, [None] * 6) == expected
    top1 = [SamplingParams(temperature=1.5, top_k=1)] * 6
    for seed in range(5):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(3)] + [None] * 3
        assert sampler(logits, top1, gens) == expected


def _seeded_run(position: int, neighbours: list[SamplingParams], seed: int) -> list[int]:
    """20 steps of one seeded request at ``position`` among ``neighbours``.

    Its logits come from their own stream, so they are the same whatever the batch.
    """
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    own_logits = torch.Generator().manual_seed(11)
    other_logits = torch.Generator().manual_seed(position)
    sampler, tokens = Sampler(), []
    for _ in range(20):
        logits = torch.randn(len(neighbours) + 1, 100, generator=other_logits)
        logits[position] = torch.randn(100, generator=own_logits)
        batch = list(neighbours)
        batch.insert(position, params)
        gens = [torch.Generator().manual_seed(p.seed) if p.seed else None for p in batch]
        gens[position] = gen
        tokens.append(sampler(logits, batch, gens)[position])
    return tokens


def test_seeded_request_is_reproducible_whatever_its_neighbours() -> None:
    alone = _seeded_run(0, [], seed=123)
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.5, seed=7),
        SamplingParams(temperature=2.0, top_k=3),
    ]
    assert _seeded_run(3, neighbours, seed=123) == alone
    assert _seeded_run(1, neighbours[:2], seed=123) == alone
    assert _seeded_run(0, neighbours[1:], seed=123) == alone  # unseeded rows after it
    assert _seeded_run(0, [], seed=124) != alone


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    torch.manual_seed(12)
    tokens = Sampler()(logits_row.expand(n, -1), [params] * n, [None] * n)
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel()).float() / n


def test_top_p_and_top_k_filter_the_right_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert (freq > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(freq[:3], probs[:3] / 0.95, atol=0.03, rtol=0)
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (freq > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(freq[:2], probs[:2] / 0.8, atol=0.03, rtol=0)
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=1e-6))  # keeps one
    assert freq.tolist() == [1.0, 0.0, 0.0, 0.0]
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    assert (freq > 0).tolist() == [True, True, False, False]  # 0.5/0.95 < 0.6 keeps token 1


def test_temperature_sharpens_and_flattens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    torch.testing.assert_close(_frequencies(logits, SamplingParams()), probs, atol=0.03, rtol=0)
    assert _frequencies(logits, SamplingParams(temperature=0.05))[0] > 0.99
    hot = _frequencies(logits, SamplingParams(temperature=50.0))
    torch.testing.assert_close(hot, torch.full((4,), 0.25), atol=0.04, rtol=0)


def test_sampler_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 logit rows"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None, None])


def _generators(seeds: list[int | None]) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def test_temperatures_below_epsilon_are_argmax_and_never_divided_by() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 10
    expected = logits.argmax(-1).tolist()
    assert len(set(expected)) > 1  # token 0 over and over (1e-38's old output) would show
    for t in (1e-38, 5e-324, 9e-6):
        params = [
            SamplingParams(temperature=t),
            SamplingParams(temperature=t, top_k=5),
            SamplingParams(temperature=t, top_p=0.5),
        ] * 2
        assert Sampler()(logits, params, _generators([1, 2, 3, None, None, None])) == expected


def test_finite_logits_never_overflow_into_a_bad_distribution() -> None:
    """1e34 / 1e-5 is beyond float32: only the shift by the row maximum keeps it finite.
    The gaps are then so wide that all the mass is on the argmax."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4)) * 1e34
    expected = logits.argmax(-1).tolist()
    assert len(set(expected)) > 1
    for seed in range(10):
        for params in (
            SamplingParams(temperature=1e-5),
            SamplingParams(temperature=1e-5, top_k=10, top_p=0.9),
        ):
            got = Sampler()(logits, [params] * 4, _generators([seed, None, seed, None]))
            assert got == expected


def test_a_temperature_beyond_float32_is_uniform() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for t in (1e39, 1e300):
        freq = _frequencies(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(freq, torch.full((4,), 0.25), atol=0.04, rtol=0)


@pytest.mark.parametrize("top_k", [30, 31, 2**31, 2**63, 10**30])
def test_top_k_beyond_the_vocabulary_keeps_every_token(top_k: int) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    for top_p in (0.9, 1.0):
        big = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * 3
        big.append(SamplingParams(temperature=1.0, top_k=2))  # a real filter beside it
        none = [SamplingParams(temperature=1.0, top_p=top_p)] * 3 + big[3:]
        for seed in range(8):
            seeds: list[int | None] = [seed, seed + 1, seed + 2, seed + 3]
            want = Sampler()(logits, none, _generators(seeds))
            assert Sampler()(logits, big, _generators(seeds)) == want


def _poisoned_rows(vocab: int) -> list[torch.Tensor]:
    base = torch.randn(5, vocab, generator=torch.Generator().manual_seed(6))
    base[0] = math.nan  # all NaN
    base[1, 7] = math.nan  # one NaN
    base[2, 3] = math.inf
    base[3, 0] = -math.inf
    base[4] = -math.inf
    return list(base)


def test_non_finite_rows_get_none_and_leave_the_rest_of_the_batch_alone() -> None:
    vocab = 40
    clean = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7))
    clean_params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.8),
    ]
    clean_seeds: list[int | None] = [None, 11, 12]
    want = Sampler()(clean, clean_params, _generators(clean_seeds))
    assert want[0] == int(clean[0].argmax())
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.8),
        SamplingParams(temperature=1e-38),
    ]
    for poison in _poisoned_rows(vocab):
        for kind, seed in ((k, s) for k in kinds for s in (None, 13)):
            rows = [clean[0], poison, clean[1], clean[2]]
            params = [clean_params[0], kind, *clean_params[1:]]
            seeds = [clean_seeds[0], seed, *clean_seeds[1:]]
            got = Sampler()(torch.stack(rows), params, _generators(seeds))
            assert got == [want[0], None, want[1], want[2]], (poison, kind)


def test_a_batch_of_only_nan_rows_samples_nothing_and_does_not_fail() -> None:
    logits = torch.full((4, 20), math.nan)
    params = [SamplingParams(temperature=t, top_k=k) for t in (0, 1.0) for k in (None, 3)]
    assert Sampler()(logits, params, _generators([None, 1, None, 2])) == [None] * 4
    half = torch.full((2, 20), math.nan, dtype=torch.bfloat16)  # not float32 either
    assert Sampler()(half, params[:2], [None, None]) == [None, None]
