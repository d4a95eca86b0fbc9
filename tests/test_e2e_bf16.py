"""Engine ~ transformers in bfloat16 on the CPU: vLLM's logprob-closeness criterion
(tests/logprobs_close.py), with prefix hits, chunked prefill and preemption all happening,
decode on the compiled kernel's bfloat16 path (the "cpu" backend).

Greedy token identity holds only in float32 (tests/test_e2e.py): here both sides compute
in bfloat16 and may part where two tokens are nearly tied. ``LOGPROB_ATOL`` is the largest
logprob difference allowed at any compared position; the measured worst case on these
prompts is printed by each test (run with -s).

These run on whatever this CPU does (oneDNN-packed bfloat16 linears with AVX-512, dense
``F.linear`` without; the decode variant and level the platform allows), and one test
forces what a CPU without AVX-512 runs, so that AVX-512 machines test that path too.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, SamplingParams, platform
from paged_engine.kernels import paged_decode_cpu
from paged_engine.layers.attention import cpu as cpu_backend
from paged_engine.layers.linear import Linear
from tests.kernel_mutants import CPU_MUTANTS
from tests.logprobs_close import Generation, check_logprobs_close, hf_greedy_with_logprobs

MAX_TOKENS = 24
TOP_K = 5
LOGPROB_ATOL = 0.25
"""nats: a few times the worst difference the tests print for the real engine, and far
below what a wrong kernel gives (``test_the_criterion_catches_a_wrong_kernel``)."""


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """20 prompts: 4 shared prefixes (37-90 tokens) x 5 suffixes (1-20 tokens)."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 700) for _ in range(n)] for n in (37, 52, 70, 90)]
    return [
        p + [rng.randrange(3, 700) for _ in range(rng.randrange(1, 21))]
        for p in prefixes
        for _ in range(5)
    ]


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, prompts: list[list[int]]) -> list[Generation]:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    return [hf_greedy_with_logprobs(model, p, MAX_TOKENS, TOP_K) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)


def generate(llm: LLM, prompts: list[list[int]]) -> list[Generation]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        assert c.logprobs is not None
        result.append(
            Generation(
                c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]
            )
        )
    return result


def check(llm: LLM, prompts: list[list[int]], refs: list[Generation]) -> None:
    assert llm.model_runner.backend.name == "cpu" and llm.model_runner.dtype == torch.bfloat16
    agreement = check_logprobs_close(
        generate(llm, prompts), refs, "paged_engine", "transformers", atol=LOGPROB_ATOL
    )
    print(agreement)
    # The comparison must mostly bite on whole generations, not stop at an early parting.
    assert agreement.identical >= len(prompts) // 2, agreement


def bf16_llm(model_dir: Path, **kw: object) -> LLM:
    return LLM(model_dir, dtype="bfloat16", **kw)  # type: ignore[arg-type]


def test_plain_then_served_from_the_prefix_cache(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Generation]
) -> None:
    llm = bf16_llm(tiny_model_dir, num_kvcache_blocks=256, max_model_len=256)
    check(llm, prompts, references)
    check(llm, prompts, references)  # again: every prompt's full blocks hit the cache
    stats = llm.last_run_stats
    assert stats is not None
    assert stats.cached_prompt_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts) > 0


def test_chunked_prefill(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Generation]
) -> None:
    llm = bf16_llm(
        tiny_model_dir, num_kvcache_blocks=256, max_model_len=256, max_num_batched_tokens=19
    )
    check(llm, prompts, references)
    stats = llm.last_run_stats
    assert stats is not None and stats.steps > stats.prefill_tokens // 19


def test_preemption(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Generation]
) -> None:
    llm = bf16_llm(tiny_model_dir, num_kvcache_blocks=9, max_model_len=136, kvcache_block_size=16)
    check(llm, prompts, references)
    stats = llm.last_run_stats
    assert stats is not None and stats.preemptions > 0


def test_the_criterion_catches_a_wrong_kernel(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Generation]
) -> None:
    """The same check with the GQA mutant in the bfloat16 decode kernel: it must fail."""
    llm = bf16_llm(tiny_model_dir, num_kvcache_blocks=256, max_model_len=256)
    mutant = next(m for m in CPU_MUTANTS if m.name == "cpu_decode_gqa_wrong_kv_head")
    with mutant.active(), pytest.raises(AssertionError, match="prompt"):
        check_logprobs_close(
            generate(llm, prompts), references, "paged_engine", "transformers", atol=LOGPROB_ATOL
        )


def without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """The platform layer describes this machine minus every AVX-512 and AMX feature, and
    a oneDNN without bfloat16: what an AVX2-only CPU (AMD Zen 3, say) reports."""
    cpu = platform.cpu_info()
    flags = frozenset(f for f in cpu.flags if not f.startswith(("avx512", "amx")))
    monkeypatch.setattr(platform, "cpu_info", lambda: replace(cpu, flags=flags))
    no_bf16 = replace(platform.torch_cpu(), mkldnn_bf16=False)
    monkeypatch.setattr(platform, "torch_cpu", lambda: no_bf16)


def test_the_no_avx512_path_forced(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    references: list[Generation],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28: ``LLM(dtype="bfloat16")`` crashed on CPUs without AVX-512 (oneDNN's
    bfloat16 weight packing). Forced here on any CPU: no linear is packed, decode runs the
    portable variant at most at x86-64-v3, and the generations meet the same criterion."""
    without_avx512(monkeypatch)
    launches: list[Any] = []
    real = cpu_backend.check_paged_decode_cpu

    def recording(*args: Any, **kwargs: Any) -> Any:
        launches.append(real(*args, **kwargs))
        return launches[-1]

    monkeypatch.setattr(cpu_backend, "check_paged_decode_cpu", recording)
    llm = bf16_llm(tiny_model_dir, num_kvcache_blocks=256, max_model_len=256)
    linears = [m for m in llm.model_runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m._packed is None for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 and m.weight.shape[0] > 0 for m in linears)
    check(llm, prompts, references)
    portable = paged_decode_cpu.BF16_VARIANTS["portable"]
    allowed = {paged_decode_cpu.ISA_CODES[n] for n in ("baseline", "x86-64-v3")}
    assert launches and all(x.bf16_variant == portable and x.isa in allowed for x in launches)
