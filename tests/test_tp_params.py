"""Every ``SamplingParams`` field through the tensor-parallel hand-off, and against TP=1.

The fields are iterated from ``dataclasses.fields(SamplingParams)``, so a field added
later is covered without editing this file, or fails loudly here, by name, until it has a
value builder (``BY_TYPE``, by annotation, or ``SPECIAL``). Each field gets a value that
differs from its default, a falsy one wherever the type allows (``0`` for an optional
count such as ``prompt_logprobs``, ``temperature=0``, token id 0, bias 0.0), as a
truthiness check in place of a comparison with the default is the bug to catch.

1. The round trip (no process): a prefill step whose sequences carry one field's value
   goes through ``StepMessage``, pickling and ``restore`` as a worker gets it. Field by
   field, the worker's params equal rank 0's for ``WORKER_FIELDS`` (what a worker's
   forward pass reads) and the defaults for every other one; and, whatever that list
   says, the worker-side sequences build the same batch and the same prompt logprobs.
2. TP=2 against TP=1: one request per field, in one batch, through ``LLM.generate``; every
   output field equal (logprobs within 1e-4: TP sums in another order).
A mutant that checks the carried fields by truth is caught by (1), and by (2).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import re
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM
from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from paged_engine.worker import handoff
from paged_engine.worker.handoff import StepMessage, encode
from paged_engine.worker.model_runner import ModelRunner
from tests.test_pickling import BLOCK_SIZE, assert_same_batch, make_seq
from tests.tp_support import CONFIG, bounded

DEFAULTS = SamplingParams()
FIELDS = [f for f in dataclasses.fields(SamplingParams)]
WORKER_FIELDS = ("prompt_logprobs",)
"""Written out, not read from the code: what a worker's forward pass reads of a sequence's
params (``BatchBuilder.build`` and ``step_logits``: grep ``sampling_params`` in
worker/model_inputs.py and worker/sampling_step.py; ``step_results`` is rank 0's)."""


def _first_other_member(default: Enum) -> Enum:
    return next(m for m in type(default) if m is not default)


BY_TYPE: dict[str, Callable[[Any], Any]] = {
    "bool": lambda d: not d,
    "int": lambda d: d + 1,
    "int | None": lambda d: 0 if d is None else None,  # 0: falsy, and not the default
    "float": lambda d: d / 2 if d else 0.5,
    "tuple[int, ...]": lambda d: (0, 7),
    "tuple[int, ...] | None": lambda d: (0, 5, 7, 9),
    "tuple[str, ...]": lambda d: ("the",),
    "tuple[tuple[int, float], ...] | None": lambda d: {0: 0.0, 5: 2.0},
    "tuple[tuple[int, ...], ...] | None": lambda d: ((5,), (7, 9)),
    "RequestOutputKind": _first_other_member,
}
"""A non-default value per annotation (``dataclasses.Field.type``), from the default."""
SPECIAL: dict[str, Any] = {
    "top_k": 3,  # 0 and -1 mean "off" and are stored as None, the default
    "max_tokens": 1,  # None would run to max_model_len
    "temperature": 0.0,  # falsy: greedy
    "best_of": 1,  # None or n: 0 is refused
    "structured_outputs": {"choice": ["the", "a"]},  # a dict: built into the record
    "guided_decoding": {"regex": "[a-z]{1,3}"},  # the older name, mirrored
}


def value_for(field: dataclasses.Field[Any]) -> Any:
    """A value for ``field`` that differs from its default; fails naming the field."""
    if field.name in SPECIAL:
        value = SPECIAL[field.name]
    elif str(field.type) in BY_TYPE:
        value = BY_TYPE[str(field.type)](field.default)
    else:
        pytest.fail(
            f"SamplingParams.{field.name} ({field.type}) has no value builder: add its "
            f"type to BY_TYPE or the field to SPECIAL in {__file__}"
        )
    made = getattr(SamplingParams(**{field.name: value}), field.name)
    if made == getattr(DEFAULTS, field.name):
        pytest.fail(f"SamplingParams.{field.name}={value!r} is stored as the default {made!r}")
    return value


def params_for(field: dataclasses.Field[Any], **base: Any) -> SamplingParams:
    return SamplingParams(**{**base, field.name: value_for(field)})


# ---- 1. the round trip ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        num_kvcache_blocks=64,
        max_model_len=128,
        kvcache_block_size=BLOCK_SIZE,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_threads=None,
    )
    return ModelRunner(tiny_model_dir, config)


def step_with(params: SamplingParams) -> list[Sequence]:
    """A prefill step: the params on the first and last sequence, the defaults between
    (so a carried entry must name the right index). Nothing is cached: the pool holds
    no real K/V, so the forward passes compared read only what they write."""
    seqs = [
        make_seq(1001, 10, 0, 0, 10, [9, 2, 30], prefill=True),
        make_seq(1002, 12, 0, 0, 6, [4, 17, 5], prefill=True),  # a first chunk
        make_seq(1003, 14, 0, 0, 14, [40, 41, 42, 43], prefill=True),
    ]
    seqs[0].sampling_params = seqs[2].sampling_params = params
    return seqs


def check_round_trip(runner: ModelRunner, name: str, params: SamplingParams) -> None:
    seqs = step_with(params)
    workers = pickle.loads(encode(StepMessage.of(seqs, is_prefill=True))).restore()
    for i, (original, worker) in enumerate(zip(seqs, workers, strict=True)):
        for f in FIELDS:
            sent = getattr(original.sampling_params, f.name)
            want = sent if f.name in WORKER_FIELDS else getattr(DEFAULTS, f.name)
            got = getattr(worker.sampling_params, f.name)
            assert got == want, f"{name} set, seq {i}: worker's {f.name} is {got!r}, not {want!r}"
    assert_same_batch(runner, seqs, workers, is_prefill=True)
    assert runner._forward(workers, True)[2] == runner._forward(seqs, True)[2], (
        f"{name} set: the worker's prompt logprobs differ"
    )


def test_worker_fields_are_the_ones_the_hand_off_carries() -> None:
    assert handoff.WORKER_FIELDS == WORKER_FIELDS


@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_every_field_survives_the_hand_off(
    runner: ModelRunner, field: dataclasses.Field[Any]
) -> None:
    check_round_trip(runner, field.name, params_for(field))


def test_every_field_at_once_survives_the_hand_off(runner: ModelRunner) -> None:
    """As many fields as combine: each added unless SamplingParams refuses it with those
    before (n > 1 with the greedy temperature 0, stop strings without detokenize)."""
    values: dict[str, Any] = {}
    for f in FIELDS:
        try:
            SamplingParams(**values, **{f.name: value_for(f)})
        except ValueError:
            continue
        values[f.name] = value_for(f)
    assert "prompt_logprobs" in values and len(values) >= len(FIELDS) - 3, sorted(values)
    check_round_trip(runner, "every field", SamplingParams(**values))


def by_truth(params: SamplingParams) -> tuple[tuple[str, Any], ...]:
    """The held-out bug: the carried fields picked by truth (``if value:``)."""
    return tuple((n, v) for n in handoff.WORKER_FIELDS if (v := getattr(params, n)))


def test_a_hand_off_that_drops_falsy_values_is_caught(
    monkeypatch: pytest.MonkeyPatch, runner: ModelRunner
) -> None:
    monkeypatch.setattr(handoff, "_carried", by_truth)
    field = next(f for f in FIELDS if f.name == "prompt_logprobs")
    with pytest.raises(AssertionError, match="worker's prompt_logprobs is None, not 0"):
        check_round_trip(runner, field.name, params_for(field))


# ---- 2. TP=2 against TP=1 --------------------------------------------------------------------

BASE = {"max_tokens": 5}
"""Every request's other settings (sampling, at the default temperature; seeded below)."""


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    """One request per field: a prompt of its own, a seed of its own (unless the field
    is the seed), the field's value."""
    rng = random.Random(28)
    out = []
    for i, f in enumerate(FIELDS):
        prompt = [rng.randrange(3, 760) for _ in range(rng.randrange(8, 30))]
        out.append((f.name, prompt, params_for(f, **BASE, seed=1000 + i)))
    return out


def assert_same(got: Any, want: Any, where: str) -> None:
    """Equal, field by field; floats within 1e-4 (absolute) or 1e-5 (relative)."""
    if dataclasses.is_dataclass(got) and not isinstance(got, type):
        assert type(got) is type(want), where
        for f in dataclasses.fields(got):
            if f.name not in ("metrics", "request_id"):  # timings; the engine's counter
                assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(got, dict):
        assert isinstance(want, dict) and got.keys() == want.keys(), f"{where}: {got} != {want}"
        for k in got:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(got, list | tuple):
        assert isinstance(want, list | tuple) and len(got) == len(want), f"{where}: lengths"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(got, float) and isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-4), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def generate(llm: LLM, batch: list[tuple[str, list[int], SamplingParams]]) -> list[Any]:
    return llm.generate([p for _, p, _ in batch], [sp for _, _, sp in batch], use_tqdm=False)


@pytest.fixture(scope="module")
def tp1(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **CONFIG)


@pytest.fixture(scope="module")
def tp2(tiny_model_dir: Path) -> Iterator[LLM]:
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGED_ENGINE_TP_TIMEOUT_S", "30")  # a hand-off bug desynchronises the ranks
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    mp.undo()
    yield llm
    llm.close()


def test_every_field_through_tp2_equals_tp1(tp1: LLM, tp2: LLM) -> None:
    batch = requests()
    accepted = []
    for name, prompt, params in batch:  # a request TP=1 refuses, TP=2 refuses alike
        try:
            generate(tp1, [(name, prompt, params)])
        except ValueError as err:
            with pytest.raises(type(err), match=re.escape(str(err))):
                generate(tp2, [(name, prompt, params)])
            continue
        accepted.append((name, prompt, params))
    refused = sorted({n for n, _, _ in batch} - {n for n, _, _ in accepted})
    assert "prompt_logprobs" not in refused and len(refused) <= 2, refused
    want = generate(tp1, accepted)
    got = bounded(lambda: generate(tp2, accepted))
    for (name, _, _), g, w in zip(accepted, got, want, strict=True):
        assert_same(g, w, f"request setting {name}")
    asked = next(o for (n, _, _), o in zip(accepted, got, strict=True) if n == "prompt_logprobs")
    assert asked.prompt_logprobs is not None and len(asked.prompt_logprobs) == len(
        asked.prompt_token_ids
    )  # prompt_logprobs=0: the prompt tokens' own logprobs, every position
