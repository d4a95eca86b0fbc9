"""Per-request sampling settings, validated when built and again when a request is added, so
a bad request never reaches a step.

Names, defaults and ranges are vLLM's (``vllm.SamplingParams``); the differences are
listed in ``SamplingParams``' docstring. Each field is checked by ``sampling_checks.py``;
every refusal is an ``InvalidRequestError`` (a ``ValueError``) or
``InvalidRequestTypeError`` (also a ``TypeError``) whose ``field`` is the parameter's
name, so callers map it without reading the message. What needs the model (token ids
within its vocabulary, ``n`` within the engine's bound, ``bad_words`` through its
tokenizer) is checked at admission, by ``engine/inputs.check_request``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

from paged_engine import sampling_checks as check
from paged_engine import structured_outputs as structured
from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError
from paged_engine.structured_outputs import GuidedDecodingParams as GuidedDecodingParams
from paged_engine.structured_outputs import StructuredOutputsParams as StructuredOutputsParams

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy decoding, as in vLLM (``_SAMPLING_EPS = 1e-5``):
dividing logits by a temperature that small overflows to ``inf``, and its distribution
is the argmax one anyway."""

SEED_MODULUS = 2**64
"""Seeds are reduced modulo this (the range of ``torch.Generator.manual_seed``), so any
int is a seed and seeds congruent modulo ``2**64`` sample the same tokens."""


class RequestOutputKind(Enum):
    """What ``LLMEngine.step()`` reports for a running request (vLLM's names).

    CUMULATIVE: everything so far, every step it produced a token (the default);
    DELTA: only the tokens and text new since its last output (what a server streams);
    FINAL_ONLY: nothing until it finishes (what ``generate`` needs; no per-step cost).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's fields and defaults).

    Sampling, applied in vLLM's order (``layers/sampler.py``): ``allowed_token_ids`` (every
    other token gets -inf), ``bad_words``, ``min_tokens`` (while fewer than that many
    tokens are generated, every eos id and ``stop_token_ids`` get -inf, also under
    ``ignore_eos``), ``logit_bias`` (added), ``repetition_penalty`` (over the prompt and
    the output: positive logits divided by it, negative ones multiplied),
    ``frequency_penalty`` × count and ``presence_penalty`` × (count > 0) subtracted over
    the output only; then temperature, ``min_p``, ``top_k``, ``top_p``, draw. Greedy
    decoding is the argmax of the logits after those processors.

    ``temperature`` below ``GREEDY_BELOW`` (1e-5, vLLM's threshold; 0 in particular) is
    greedy decoding (argmax, first index on ties), which exact oracles need; it is stored
    as a float. ``top_k`` of None, 0 or -1 (vLLM's spellings) keeps every token and is
    stored as None; a ``top_k`` larger than the vocabulary keeps every token too.
    ``top_p == 1`` disables nucleus sampling, ``min_p == 0`` min-p sampling (tokens less
    likely than ``min_p`` times the most likely one are dropped). ``seed`` (any int,
    reduced modulo ``SEED_MODULUS``) makes one request's samples reproducible whatever
    else is batched with it: seeds ``s`` and ``s + 2**64`` sample the same tokens.

    ``bad_words`` (strings) are banned as vLLM bans them: each word is tokenized with and
    without a leading space (``bad_words_token_ids``, filled in at admission by
    ``engine/inputs.check_request`` from the model's tokenizer, replacing whatever a
    caller put there), and a word's last token gets -inf whenever the generated tokens end
    with its other tokens; a one-token word is always banned. vLLM adds the spaced form
    only where it has as many tokens as the other; here both forms are always banned.

    Stopping and output: ``max_tokens`` (None: up to ``max_model_len``), ``stop`` (strings,
    normalised to a tuple), ``stop_token_ids`` (a tuple), ``include_stop_str_in_output``,
    ``ignore_eos``, ``n`` completions per prompt, ``logprobs`` / ``prompt_logprobs`` (how
    many most likely tokens to report beside the chosen one, from the model's raw
    distribution), ``detokenize``, ``skip_special_tokens``. ``logit_bias`` is stored as
    ``(token_id, bias)`` pairs sorted by id (equal whatever the mapping's order).
    ``output_kind`` says what ``LLMEngine.step()`` reports while the request runs.
    ``structured_outputs`` (a ``StructuredOutputsParams`` or a dict of its fields; vLLM's
    older ``guided_decoding`` is accepted and mirrors it: set one) constrains the output to a JSON
    schema, a regex, a choice or a grammar: every other token gets -inf before the other
    processors (``worker/grammar.py``), and the request stops at eos once it is complete.
    ``best_of`` is vLLM's: None or equal to ``n`` (this engine has no best-of selection,
    so a larger one is refused naming it; a smaller one is refused as vLLM refuses it).

    Mutable, as vLLM's: scripts set fields after construction (``params.max_tokens = 10``).
    Why validation runs twice: construction checks and normalises every field, but a
    field set afterwards is checked only when the request is added. ``add_request`` and
    ``generate`` take a private copy (``clone``), built and so validated again, and queue
    that: a bad value set after construction is refused there with the same
    ``InvalidRequestError`` naming the field (nothing is queued), and a change the user
    makes after adding a request never reaches it. The record is therefore not hashable.

    Unlike vLLM: booleans are never ints (``logprobs=True`` is refused, not 1), ``-1`` is
    not "the whole vocabulary" for ``logprobs``, a seed of -1 is a seed, temperatures
    are neither raised to 0.01 nor capped at 2, ``logit_bias`` keys must be ints (the
    OpenAI layer converts JSON's strings, and clamps biases to [-100, 100]), and the
    engine bounds ``n``, the stop strings, ``bad_words`` and ``logit_bias``
    (``engine/request_limits.py`` says why).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    best_of: int | None = None
    structured_outputs: structured.StructuredOutputsParams | None = None
    guided_decoding: structured.StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        t = check.finite_float("temperature", self.temperature)
        if t < 0:
            raise InvalidRequestError(
                "temperature", f"temperature must be >= 0, got {self.temperature!r}"
            )
        self.temperature = t
        if self.top_k is not None:
            k = check.integer("top_k", self.top_k)
            if k < -1:
                raise InvalidRequestError(
                    "top_k", f"top_k must be None, 0 or -1 (disabled) or >= 1, got {k!r}"
                )
            if k <= 0:
                self.top_k = None
        p = check.finite_float("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = p
        self.min_p = check.float_in("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None and check.integer("max_tokens", self.max_tokens) < 1:
            raise InvalidRequestError(
                "max_tokens", f"max_tokens must be None or >= 1, got {self.max_tokens!r}"
            )
        if check.integer("min_tokens", self.min_tokens) < 0:
            raise InvalidRequestError(
                "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}",
            )
        if check.integer("n", self.n) < 1:
            raise InvalidRequestError("n", f"n must be >= 1, got {self.n!r}")
        if self.n > 1 and self.greedy:
            raise InvalidRequestError(
                "n", f"n must be 1 for greedy sampling (temperature 0), got {self.n}"
            )
        self._check_best_of()
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, check.float_in(name, getattr(self, name), -2.0, 2.0))
        r = check.finite_float("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise InvalidRequestError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            )
        self.repetition_penalty = r
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "detokenize",
            "skip_special_tokens",
        ):
            check.boolean(name, getattr(self, name))
        self.stop_token_ids = check.token_ids("stop_token_ids", self.stop_token_ids)
        self.stop = check.strings("stop", self.stop)
        if self.stop and not self.detokenize:
            raise InvalidRequestError(
                "stop", "stop strings need detokenize=True (they match the text)"
            )
        self.logprobs = check.optional_count("logprobs", self.logprobs)
        self.prompt_logprobs = check.optional_count("prompt_logprobs", self.prompt_logprobs)
        self.logit_bias = check.logit_bias(self.logit_bias)
        if self.seed is not None:
            check.integer("seed", self.seed)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestTypeError(
                "output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"
            )
        self.allowed_token_ids = check.allowed_token_ids(self.allowed_token_ids)
        self.bad_words = check.strings("bad_words", self.bad_words)
        self.bad_words_token_ids = check.word_token_ids(self.bad_words_token_ids)
        self.structured_outputs, self.guided_decoding = structured.resolve(
            self.structured_outputs, self.guided_decoding
        )

    def _check_best_of(self) -> None:
        """vLLM accepts None or ``best_of >= n``; without best-of selection only ``n``
        itself means the same here."""
        if self.best_of is None:
            return
        b = check.integer("best_of", self.best_of)
        if b < self.n:
            raise InvalidRequestError("best_of", f"best_of must be >= n={self.n}, got {b}")
        if b > self.n:
            raise InvalidRequestError(
                "best_of",
                f"best_of={b} > n={self.n} is not supported: this engine has no best-of "
                "selection; set best_of to None or n",
            )

    def clone(self) -> SamplingParams:
        """A copy built from the current fields, so validated and normalised again (a
        field set to a bad value since construction raises ``InvalidRequestError`` naming
        it). The engine queues such a copy, never the caller's object."""
        return replace(self)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature < GREEDY_BELOW`` (the sampler never divides by
        such a temperature)."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Any of the repetition, frequency or presence penalties is on."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a mapping, naming any key that is not a sampling parameter."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestTypeError(
                str(unknown[0]),
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}",
            )
        return cls(**values)
