"""``Sequence.from_checked_tokens``: the engine's unchecked constructor (see its docstring).

What it must keep: the same state as the checked constructor, and no token list shared
with the caller or between a request's completions (each sequence appends to its own).
"""

from __future__ import annotations

from pathlib import Path

from paged_engine import LLM, SamplingParams
from paged_engine.engine.sequence import Sequence


def _state(seq: Sequence) -> dict[str, object]:
    return {name: getattr(seq, name) for name in Sequence.__slots__ if name != "seq_id"}


def test_the_unchecked_constructor_builds_the_checked_ones_state() -> None:
    params = SamplingParams(max_tokens=3, seed=7)
    for salt in (None, "tenant-a"):
        checked = Sequence([5, 6, 7, 8, 9], params, block_size=4, cache_salt=salt)
        unchecked = Sequence.from_checked_tokens(
            [5, 6, 7, 8, 9], params, block_size=4, cache_salt=salt
        )
        assert _state(unchecked) == _state(checked)
        assert unchecked.cache_salt == salt
        assert (unchecked.num_tokens, unchecked.last_token, unchecked.num_blocks) == (5, 9, 2)
        assert unchecked.seq_id != checked.seq_id  # a fresh id, as __init__ draws


def test_the_engines_sequences_share_no_token_list(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kvcache_blocks=64, max_model_len=256)
    engine = llm.llm_engine
    prompt = [3, 4, 5, 6, 7]
    engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=2, seed=1))
    prompt.append(99)  # the caller's list changes after the call
    request = engine._requests["r"]
    first, second = (c.seq for c in request.completions)
    assert first.token_ids == second.token_ids == [3, 4, 5, 6, 7]
    assert first.token_ids is not second.token_ids
    first.append_token(11)
    assert second.token_ids == [3, 4, 5, 6, 7]
    assert list(request.prompt_token_ids) == [3, 4, 5, 6, 7]
