"""GPU benchmarks: paged decode attention bandwidth, and end-to-end throughput.

Run by ``scripts/gpu-check.sh`` (or ``pytest -m gpu bench/test_gpu_bench.py``) on a CUDA
machine; every test skips cleanly elsewhere. Figures are measured, never asserted: each test
prints its row and appends it as one JSON line to ``$GPU_BENCH_RESULTS`` (default
``.benchmarks/gpu-bench.jsonl``), which ``python -m bench.test_gpu_bench report`` turns into
the markdown tables of the GPU report, with the targets:

* **Decode attention** at batch 64 x context 2,048 and 8,192, Qwen3-0.6B head shapes (16
  query heads, 8 KV heads, head dim 128, bfloat16), block sizes 16 and 256, blocks shuffled
  across the pool: the Triton kernel's achieved memory bandwidth (K/V, queries, outputs and
  block tables, each read or written once) as a fraction of the device's peak -- target
  >= 70% -- and its time against flash-attn's ``flash_attn_with_kvcache`` on the same
  problem -- target <= 1.2x. flash-attn's paged cache needs blocks of 256 tokens, so both
  rows of a context compare against flash-attn at block size 256. Peak bandwidth is known
  for H200 (4.8 TB/s) and H100 SXM (3.35 TB/s) (override: ``GPU_PEAK_BW_GBS``); elsewhere only
  GB/s are reported, next to the device's measured copy bandwidth.
* **End to end**: nano-vllm's benchmark shape (256 requests, prompts and outputs each of
  100-1,024 tokens drawn uniformly, temperature 0.6, ``ignore_eos``) on a Qwen3-0.6B-shaped
  model with random bfloat16 weights, built locally (no download, no tokenizer), through
  ``LLM`` with the Triton backend (block sizes 16 and 256) and flash-attn (256) when
  installed, with decode CUDA graphs (the default), and Triton at 16 once more with
  ``enforce_eager=True``: generated tokens per second.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

CUDA = torch.cuda.is_available()
FLASH = importlib.util.find_spec("flash_attn") is not None
RESULTS = Path(os.environ.get("GPU_BENCH_RESULTS", ".benchmarks/gpu-bench.jsonl"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CUDA or os.environ.get("TRITON_INTERPRET") == "1",
        reason="GPU benchmarks need CUDA and compiled Triton kernels (TRITON_INTERPRET unset)",
    ),
]

# Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40_960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128

PEAK_BW_GBS: dict[str, float | None] = {
    "GH200": None,  # several memory configurations under one name: report absolute figures
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,  # what torch calls the H100 SXM
}
"""Device-name fragment -> peak HBM bandwidth (GB/s); the first matching fragment wins."""

DECODE_TARGET_FRACTION = 0.70
FLASH_TARGET_RATIO = 1.2


def peak_bandwidth_gbs(name: str) -> float | None:
    """Peak memory bandwidth of the named device, or None when unknown."""
    override = os.environ.get("GPU_PEAK_BW_GBS")
    if override:
        return float(override)
    for fragment, gbs in PEAK_BW_GBS.items():
        if fragment in name:
            return gbs
    return None


def record(row: dict[str, Any]) -> None:
    """Print one result and append it to the results file."""
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
    print(json.dumps(row))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")


def bench_ms(fn: Callable[[], Any]) -> float:
    """Median time of ``fn`` in ms (CUDA events; L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


# --------------------------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------------------------

BATCH = 64
CONTEXTS = (2048, 8192)
BLOCK_SIZES = (16, 256)
DTYPE = torch.bfloat16


def paged_problem(context: int, block_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random K/V for ``BATCH`` sequences of ``context`` tokens in shuffled blocks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = context // block_size
    num_blocks = BATCH * per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    return {
        "query": torch.randn(BATCH, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": perm.view(BATCH, per_seq).contiguous(),
        "seq_lens": torch.full((BATCH,), context, dtype=torch.int32, device="cuda"),
    }


def decode_bytes(p: dict[str, torch.Tensor]) -> int:
    """Bytes a decode step must move at least: K/V of every context token, q in, out back,
    block tables and lengths."""
    kv = 2 * int(p["seq_lens"].sum()) * NUM_KV_HEADS * HEAD_DIM * p["k_cache"].element_size()
    q_out = 2 * p["query"].numel() * p["query"].element_size()
    meta = p["block_tables"].numel() * 4 + p["seq_lens"].numel() * 4
    return kv + q_out + meta


def copy_bandwidth_gbs() -> float:
    """Measured device-to-device copy bandwidth (1 GiB read + 1 GiB written)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * 2**30 / (ms * 1e-3) / 1e9


@pytest.fixture(scope="module")
def device_info() -> dict[str, Any]:
    name = torch.cuda.get_device_name()
    info = {
        "device": name,
        "peak_gbs": peak_bandwidth_gbs(name),
        "copy_gbs": round(copy_bandwidth_gbs(), 1),
    }
    record({"kind": "device", **info})
    return info


@pytest.fixture(scope="module")
def flash_ms() -> Iterator[dict[int, float]]:
    """flash-attn's time per context (block size 256), filled by the first row that needs it."""
    yield {}


def _triton_decode(context: int, block_size: int) -> tuple[float, int]:
    """(median ms, bytes moved) of the Triton decode kernel; the problem is freed on return."""
    from paged_engine.kernels.paged_attention_ref import paged_decode_attention_ref
    from paged_engine.kernels.paged_decode_attention import paged_decode_attention

    p = paged_problem(context, block_size)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(p["query"])

    def step() -> torch.Tensor:
        return paged_decode_attention(
            p["query"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"], scale, out
        )

    # A benchmark of a wrong kernel measures nothing: check 4 sequences against the reference.
    step()
    expected = paged_decode_attention_ref(
        p["query"][:4], p["k_cache"], p["v_cache"], p["block_tables"][:4], p["seq_lens"][:4], scale
    )
    torch.testing.assert_close(out[:4].float(), expected.float(), atol=2e-2, rtol=2e-2)
    return bench_ms(step), decode_bytes(p)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_decode_attention_bandwidth(
    context: int, block_size: int, device_info: dict[str, Any], flash_ms: dict[int, float]
) -> None:
    ms, moved = _triton_decode(context, block_size)
    torch.cuda.empty_cache()
    gbs = moved / (ms * 1e-3) / 1e9
    peak = device_info["peak_gbs"]
    row: dict[str, Any] = {
        "kind": "decode_attention",
        "batch": BATCH,
        "context": context,
        "block_size": block_size,
        "dtype": "bfloat16",
        "triton_ms": round(ms, 4),
        "triton_gbs": round(gbs, 1),
        "peak_gbs": peak,
        "copy_gbs": device_info["copy_gbs"],
        "fraction_of_peak": round(gbs / peak, 3) if peak else None,
        "fraction_of_copy": round(gbs / device_info["copy_gbs"], 3),
    }
    if FLASH:
        if context not in flash_ms:
            flash_ms[context] = _flash_decode_ms(context)
            torch.cuda.empty_cache()
        row["flash_block_size"] = 256
        row["flash_ms"] = round(flash_ms[context], 4)
        row["ratio_vs_flash"] = round(ms / flash_ms[context], 3)
    else:
        row["flash_ms"] = None
        row["flash_note"] = "flash-attn is not installed"
    record(row)


def _flash_decode_ms(context: int) -> float:
    from flash_attn import flash_attn_with_kvcache

    p = paged_problem(context, 256, seed=1)
    scale = HEAD_DIM**-0.5
    q = p["query"].unsqueeze(1)

    def step() -> torch.Tensor:
        out: torch.Tensor = flash_attn_with_kvcache(
            q,
            p["k_cache"],
            p["v_cache"],
            cache_seqlens=p["seq_lens"],
            block_table=p["block_tables"],
            softmax_scale=scale,
            causal=True,
        )
        return out

    step()
    return bench_ms(step)


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------

NUM_REQUESTS = 256
LEN_RANGE = (100, 1024)
E2E_CONFIGS = [
    pytest.param("triton", 16, False, id="triton-bs16"),
    pytest.param(
        "flash-attn",
        256,
        False,
        id="flash-attn-bs256",
        marks=pytest.mark.skipif(not FLASH, reason="flash-attn is not installed"),
    ),
    pytest.param("triton", 256, False, id="triton-bs256"),
    pytest.param("triton", 16, True, id="triton-bs16-eager"),  # CUDA graphs off: their gain
]


def make_qwen3_0_6b_shaped(out_dir: Path, seed: int = 0) -> Path:
    """A Qwen3-0.6B-shaped checkpoint with random bfloat16 weights and no tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_0_6B, dtype="bfloat16", eos_token_id=151_645)
    torch.manual_seed(seed)
    with torch.device("cuda" if CUDA else "cpu"):  # initialising 0.6B weights on a CPU is slow
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(out_dir)
    del model
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return out_dir


def nano_vllm_requests(seed: int = 0) -> tuple[list[list[int]], list[Any]]:
    """nano-vllm's bench.py workload: 256 requests, prompt and output lengths 100-1,024."""
    from paged_engine import SamplingParams

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(10_000) for _ in range(rng.randint(*LEN_RANGE))] for _ in range(NUM_REQUESTS)
    ]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(*LEN_RANGE))
        for _ in range(NUM_REQUESTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_0_6b_shaped(tmp_path_factory.mktemp("qwen3-0.6b-shaped"))


@pytest.mark.parametrize(("backend", "block_size", "eager"), E2E_CONFIGS)
def test_end_to_end_throughput(model_dir: Path, backend: str, block_size: int, eager: bool) -> None:
    from paged_engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        attention_backend=backend,
        enforce_eager=eager,
        kvcache_block_size=block_size,
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        max_num_seqs=512,  # nano-vllm's defaults
        max_num_batched_tokens=16_384,
    )
    try:
        # Warm-up (not timed): compiles the kernels' prefill, single-pass and split decode
        # variants, and settles the allocator.
        warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4)
        llm.generate([[1] * 900, [2] * 700], warm, use_tqdm=False)
        llm.generate([[3] * 20] * 64, warm, use_tqdm=False)
        prompts, params = nano_vllm_requests()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        assert generated == sum(p.max_tokens for p in params)
        stats = llm.last_run_stats
        record(
            {
                "kind": "end_to_end",
                "backend": llm.model_runner.backend.name,
                "block_size": block_size,
                "cuda_graphs": llm.model_runner.decode_graphs is not None,
                "requests": NUM_REQUESTS,
                "prompt_tokens": sum(len(p) for p in prompts),
                "output_tokens": generated,
                "seconds": round(elapsed, 2),
                "output_tokens_per_s": round(generated / elapsed, 1),
                "total_tokens_per_s": round(
                    (generated + sum(len(p) for p in prompts)) / elapsed, 1
                ),
                "kv_blocks": llm.model_runner.num_kvcache_blocks,
                "preemptions": stats.preemptions if stats else None,
                "steps": stats.steps if stats else None,
            }
        )
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# The report (``python -m bench.test_gpu_bench report RESULTS.jsonl``)
# --------------------------------------------------------------------------------------------


def _fmt(value: object, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value}{suffix}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def report_tables(rows: list[dict[str, Any]]) -> str:
    """Markdown for the results file's rows (the newest device row, all benchmark rows)."""
    lines: list[str] = []
    devices = [r for r in rows if r.get("kind") == "device"]
    if devices:
        d = devices[-1]
        peak = f"{d['peak_gbs']:.0f} GB/s" if d.get("peak_gbs") else "unknown (absolute only)"
        lines += [
            f"Device: {d['device']}; peak memory bandwidth {peak}; measured copy bandwidth "
            f"{d['copy_gbs']:.0f} GB/s.",
            "",
        ]
    decode = [r for r in rows if r.get("kind") == "decode_attention"]
    lines += [
        "### Decode attention (batch 64, 16 q heads / 8 KV heads / dim 128, bfloat16)",
        "",
        f"Targets: >= {DECODE_TARGET_FRACTION:.0%} of peak bandwidth; "
        f"<= {FLASH_TARGET_RATIO}x flash-attn's time (flash-attn at block size 256).",
        "",
    ]
    if decode:
        lines += [
            "| context | block | Triton ms | GB/s | of peak | of copy | flash-attn ms "
            "| Triton/flash | verdict |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in decode:
            frac, ratio = r.get("fraction_of_peak"), r.get("ratio_vs_flash")
            verdict = []
            if frac is not None:
                verdict.append("bw ok" if frac >= DECODE_TARGET_FRACTION else "bw MISS")
            if ratio is not None:
                verdict.append("flash ok" if ratio <= FLASH_TARGET_RATIO else "flash MISS")
            lines.append(
                f"| {r['context']} | {r['block_size']} | {r['triton_ms']} | {r['triton_gbs']} "
                f"| {_pct(frac)} | {_pct(r.get('fraction_of_copy'))} "
                f"| {_fmt(r.get('flash_ms'))} | {_fmt(ratio, 'x')} "
                f"| {', '.join(verdict) or 'n/a'} |"
            )
        if any(r.get("flash_note") for r in decode):
            lines += ["", "flash-attn is not installed: no flash-attn comparison."]
    else:
        lines.append("No decode-attention results (the benchmark did not run or did not finish).")
    e2e = [r for r in rows if r.get("kind") == "end_to_end"]
    lines += [
        "",
        "### End to end (Qwen3-0.6B shape, random bf16 weights; 256 requests, "
        "prompts and outputs 100-1,024 tokens)",
        "",
    ]
    if e2e:
        lines += [
            "| backend | block | graphs | output tok/s | total tok/s | output tokens | seconds "
            "| preemptions |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in e2e:
            lines.append(
                f"| {r['backend']} | {r['block_size']} | {_fmt(r.get('cuda_graphs'))} "
                f"| {r['output_tokens_per_s']} "
                f"| {r['total_tokens_per_s']} | {r['output_tokens']} | {r['seconds']} "
                f"| {_fmt(r.get('preemptions'))} |"
            )
    else:
        lines.append("No end-to-end results (the benchmark did not run or did not finish).")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "report":
        print("usage: python -m bench.test_gpu_bench report RESULTS.jsonl", file=sys.stderr)
        return 2
    path = Path(argv[1])
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a timeout
    print(report_tables(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
