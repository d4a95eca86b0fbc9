"""Engine == transformers (greedy, float32, token for token) across families and shapes.

tests/test_e2e.py runs one tiny Qwen3, whose head_dim equals hidden_size / num_heads, as
in no real Qwen3 (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128). Here tiny models of every
family the registry serves, built once per session, cover between them:

==========  =======  =======================  ===  ====  =======  =========================
model       family   heads x head_dim (h 64)  GQA  tied  max pos  also
==========  =======  =======================  ===  ====  =======  =========================
wide        Qwen3    4 x 32 (64 / 4 = 16)     1    yes   4096     theta 1e4
narrow      Qwen3    4 x 8 (16)               2    no    160      theta 1e6
many        Qwen3    8 x 16 (8)               4    no    4096     theta 1e6
plain       Qwen3    4 x 16 (16)              4    yes   192      theta 1e4
llama3      Llama    4 x 16 (16)              2    no    4096     llama3 rope scaling
llama_bias  Llama    4 x 32 (16)              4    yes   4096     all biases, eps 0.3
qwen2       Qwen2    4 x 16 (16)              4    no    4096     q/k/v biases
mistral     Mistral  8 x 16 (8)               2    yes   4096     no sliding window
==========  =======  =======================  ===  ====  =======  =========================

Each family has its mutants below (a bias dropped, the rope scaling skipped, the norm's
epsilon ignored), each caught by this comparison.

On each, one engine run with a small pool (preemption), a small token budget (chunked
prefill) and prompts sharing prefixes (prefix hits), twice over (the second run hits the
cache again); the run statistics show each of those happened. The two models whose
``max_position_embeddings`` is below the engine's default ``max_model_len`` run without
one: the engine caps it there, and a prompt ends 8 positions short of it.

The mutant that scales attention by ``(hidden_size / num_heads) ** -0.5`` instead of
``head_dim ** -0.5`` (built by patching the model's attention in the test) fails this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import paged_engine.layers.decoder as decoder
import paged_engine.layers.rotary as rotary
from paged_engine import LLM, SamplingParams
from paged_engine.layers.layernorm import RMSNorm
from paged_engine.layers.linear import QKVParallelLinear
from paged_engine.models.mistral import MistralForCausalLM
from paged_engine.models.registry import MODELS
from paged_engine.utils.model_config import load_config
from paged_engine.utils.tiny_model import make_tiny_model
from tests.hf_oracle import HFOracle, Reference, compare

MAX_TOKENS = 10
BLOCK_SIZE = 8
BUDGET = 24
"""Tokens per step: every prompt is longer, so every prompt is chunked."""
MAX_MODEL_LEN = 160
"""For the models whose max_position_embeddings is larger (the others run capped at it)."""


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int = 4096
    architecture: str = "Qwen3ForCausalLM"
    rope_extra: tuple[tuple[str, Any], ...] = ()
    overrides: tuple[tuple[str, Any], ...] = ()


LLAMA3_ROPE = (
    ("rope_type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 64),
)
"""With head_dim 16 and theta 1e4 the wavelengths run from 6 to 2e4 positions: some are
kept (below 64 / 4), some divided by 8 (above 64), some interpolated."""

NO_WINDOW = (("sliding_window", None),)

SHAPES = {
    "wide": Shape(4, 4, 32, True, 1e4),
    "narrow": Shape(4, 2, 8, False, 1e6, max_position_embeddings=160),
    "many": Shape(8, 2, 16, False, 1e6),
    "plain": Shape(4, 1, 16, True, 1e4, max_position_embeddings=192),
    "llama3": Shape(4, 2, 16, False, 1e4, architecture="LlamaForCausalLM", rope_extra=LLAMA3_ROPE),
    "llama_bias": Shape(
        4,
        1,
        32,
        True,
        1e4,
        architecture="LlamaForCausalLM",
        overrides=(("attention_bias", True), ("mlp_bias", True), ("rms_norm_eps", 0.3)),
    ),
    "qwen2": Shape(4, 1, 16, False, 1e6, architecture="Qwen2ForCausalLM"),
    "mistral": Shape(
        8,
        4,
        16,
        True,
        1e4,
        architecture="MistralForCausalLM",
        overrides=(("sliding_window", None),),
    ),
}
HIDDEN = 64


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("matrix")
    return {
        name: make_tiny_model(
            root / name,
            seed=i + 1,
            hidden_size=HIDDEN,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            tie_word_embeddings=s.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta}
            | dict(s.rope_extra),
            max_position_embeddings=s.max_position_embeddings,
            architecture=s.architecture,
            config_overrides=dict(s.overrides),
        )
        for i, (name, s) in enumerate(SHAPES.items())
    }


def max_model_len(shape: Shape) -> int:
    return min(MAX_MODEL_LEN, shape.max_position_embeddings)


def prompts_for(shape: Shape) -> list[list[int]]:
    """Two prefixes (33 and 50 tokens) x 3 suffixes (1-9 tokens), and a prompt that ends
    ``MAX_TOKENS`` + 8 tokens short of ``max_model_len``."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 700) for _ in range(n)] for n in (33, 50)]
    prompts = [
        p + [rng.randrange(3, 700) for _ in range(rng.randint(1, 9))]
        for _ in range(3)
        for p in prefixes
    ]
    prompts.append([rng.randrange(3, 700) for _ in range(max_model_len(shape) - MAX_TOKENS - 8)])
    return prompts


_REFERENCES: dict[str, list[Reference]] = {}


def references(name: str, model_dir: Path) -> list[Reference]:
    if name not in _REFERENCES:
        oracle = HFOracle(model_dir)
        _REFERENCES[name] = [oracle.greedy(p, MAX_TOKENS) for p in prompts_for(SHAPES[name])]
    return _REFERENCES[name]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def check(name: str, model_dir: Path, **backend: Any) -> None:
    """Two runs on one engine against transformers, with prefix hits, chunked prefill and
    preemption all seen. Raises AssertionError on any real difference.

    The pool is the smallest legal one: one ``max_model_len`` sequence, so requests
    preempt each other."""
    shape = SHAPES[name]
    length = max_model_len(shape)
    size: dict[str, Any] = {} if length < MAX_MODEL_LEN else {"max_model_len": length}
    llm = LLM(
        model_dir,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=length // BLOCK_SIZE,
        max_num_batched_tokens=BUDGET,
        device="cpu",  # float32 on the CPU paths, token for token (also on a CUDA machine)
        dtype="float32",
        **size,
        **backend,
    )
    assert llm.config.max_model_len == length  # given, or capped at max_position_embeddings
    chunks = record_chunks(llm)
    prompts, refs = prompts_for(shape), references(name, model_dir)
    cached = preemptions = 0
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        verdicts = [compare(o.outputs[0].token_ids, r) for o, r in zip(outs, refs, strict=True)]
        real = [v for v in verdicts if v not in ("same", "tie")]
        assert not real, f"{name}: {real}"
        assert verdicts.count("tie") <= 1, f"{name}: too many ties to be a good oracle"
        stats = llm.last_run_stats
        assert stats is not None
        cached += stats.cached_prompt_tokens
        preemptions += stats.preemptions
    assert cached > 0 and preemptions > 0 and chunks, (cached, preemptions, len(chunks))


def record_chunks(llm: LLM) -> list[int]:
    """Every prefill step's sequences that stop short of their prompt (a chunk)."""
    chunks: list[int] = []
    run = llm.model_runner.run

    def recording(seqs: list[Any], is_prefill: bool) -> Any:
        if is_prefill:
            chunks.extend(
                s.seq_id
                for s in seqs
                if s.num_cached_tokens + s.num_scheduled_tokens < s.num_prompt_tokens
            )
        return run(seqs, is_prefill)

    llm.model_runner.run = recording  # type: ignore[method-assign]
    return chunks


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_equals_transformers(model_dirs: dict[str, Path], name: str) -> None:
    check(name, model_dirs[name])


@pytest.mark.parametrize("name", ["llama3", "llama_bias", "qwen2", "mistral"])
def test_the_torch_backend_serves_every_family(model_dirs: dict[str, Path], name: str) -> None:
    """The comparison above runs the CPU default (the compiled decode kernel); the
    families differ only above attention, and here they run over the torch backend too
    (Triton: tests/test_e2e_triton.py)."""
    check(name, model_dirs[name], attention_backend="torch")


def test_the_shapes_are_what_the_table_says(model_dirs: dict[str, Path]) -> None:
    for name, shape in SHAPES.items():
        cfg = load_config(model_dirs[name])
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )
        assert cfg.tie_word_embeddings is shape.tie_word_embeddings
        assert cfg.rope_parameters["rope_theta"] == shape.rope_theta
        assert cfg.architectures == [shape.architecture]
        for key, value in (*shape.overrides, *shape.rope_extra):
            where = cfg.rope_parameters if (key, value) in shape.rope_extra else cfg.__dict__
            assert where[key] == value, (name, key)
    distinct = {s.head_dim != HIDDEN // s.num_heads for s in SHAPES.values()}
    assert distinct == {True, False}
    assert {s.num_heads // s.num_kv_heads for s in SHAPES.values()} == {1, 2, 4}
    assert {s.architecture for s in SHAPES.values()} == set(MODELS)


# ---- mutants: each is caught by the comparison (an AssertionError naming the difference) --


def assert_caught(name: str, model_dir: Path) -> None:
    with pytest.raises(AssertionError, match="differs at"):
        check(name, model_dir)


def test_a_scale_from_hidden_size_over_heads_is_caught(
    monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path]
) -> None:
    real_init = decoder.DecoderAttention.__init__

    def init(self: decoder.DecoderAttention, config: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, config, *args, **kwargs)
        self.attn.scale = (config.hidden_size / config.num_attention_heads) ** -0.5

    monkeypatch.setattr(decoder.DecoderAttention, "__init__", init)
    check("plain", model_dirs["plain"])  # head_dim == hidden / heads: the mutant is exact
    for name in ("wide", "narrow", "many"):
        assert_caught(name, model_dirs[name])


class QKVWithoutBias(QKVParallelLinear):
    """Loads the q/k/v biases, then never adds them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, None)


class RMSNormFixedEps(RMSNorm):
    """Ignores the config's epsilon (always 1e-6)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps=1e-6)


@pytest.mark.parametrize("name", ["qwen2", "llama_bias"])
def test_a_dropped_qkv_bias_is_caught(
    monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path], name: str
) -> None:
    monkeypatch.setattr(decoder, "QKVParallelLinear", QKVWithoutBias)
    assert_caught(name, model_dirs[name])


def test_skipped_llama3_rope_scaling_is_caught(
    monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path]
) -> None:
    monkeypatch.setattr(rotary, "_llama3_inv_freq", lambda inv_freq, spec: inv_freq)
    assert_caught("llama3", model_dirs["llama3"])


def test_an_ignored_norm_epsilon_is_caught(
    monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path]
) -> None:
    monkeypatch.setattr(decoder, "RMSNorm", RMSNormFixedEps)
    assert_caught("llama_bias", model_dirs["llama_bias"])


def test_mistral_run_as_qwen3_is_caught(
    monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path]
) -> None:
    """Options taken from the wrong family: q/k norms (weights all ones) where Mistral
    has none."""

    def qwen3_options(config: Any) -> decoder.DecoderOptions:
        return decoder.DecoderOptions(qk_norm=True)

    monkeypatch.setattr(MistralForCausalLM, "options_for", staticmethod(qwen3_options))
    with pytest.raises(ValueError, match="missing tensor"):  # the loader names the norms
        check("mistral", model_dirs["mistral"])
