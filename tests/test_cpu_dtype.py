"""``dtype="auto"`` on the CPU: bfloat16 for a 16-bit checkpoint where the CPU has AMX-BF16
or AVX512-BF16, float32 otherwise, and float32 for a float32 checkpoint (the test models,
so the token-identity tests keep float32 without naming it); the choice is logged."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from paged_engine import LLM, platform
from paged_engine.kernels.paged_decode_cpu import auto_cpu_dtype, cpu_bf16_features
from paged_engine.worker.devices import resolve_dtype

CPU = torch.device("cpu")
BOTH = ("amx_bf16", "avx512_bf16")
_CAPS = torch.cpu.get_capabilities()
FAST_BF16 = bool(_CAPS.get("amx_bf16")) or bool(_CAPS.get("avx512_bf16"))
"""Whether torch's probe (the cpuinfo library) finds AMX-BF16 or AVX512-BF16 here."""


def cpuinfo(tmp_path: Path, flags: str | None) -> Path:
    path = tmp_path / "cpuinfo"
    lines = ["processor\t: 0", "model name\t: Test CPU"]
    if flags is not None:
        lines.append(f"flags\t\t: {flags}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8", BOTH),
        ("fpu avx2 avx512f avx512_bf16 avx512_vnni", ("avx512_bf16",)),
        ("fpu avx2 avx512f avx512_vnni avx512_bf16x", ()),  # whole flags only
        ("fpu sse2 avx2", ()),
        (None, ()),  # no flags line
    ],
)
def test_features_are_read_from_cpuinfo_flags(
    tmp_path: Path, flags: str | None, expected: tuple[str, ...]
) -> None:
    assert platform.read_cpu_info(cpuinfo(tmp_path, flags)).bf16_features == expected


def test_an_unreadable_cpuinfo_means_no_features(tmp_path: Path) -> None:
    assert platform.read_cpu_info(tmp_path / "missing").bf16_features == ()


def test_this_cpus_features_agree_with_torchs_probe() -> None:
    assert bool(cpu_bf16_features()) == FAST_BF16, (cpu_bf16_features(), dict(_CAPS))


def test_the_auto_rule_reads_the_platform_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU reported with AVX512-BF16 (forced here) gets bfloat16 for a 16-bit checkpoint,
    one reported without it float32, whatever this machine has."""
    cpu = platform.cpu_info()
    for flags, expected in [({"avx512_bf16"}, torch.bfloat16), (set(), torch.float32)]:
        told = replace(cpu, flags=(cpu.flags - {"avx512_bf16", "amx_bf16"}) | flags)
        monkeypatch.setattr(platform, "cpu_info", lambda told=told: told)
        assert resolve_dtype("auto", CPU, "bfloat16") == expected


@pytest.mark.parametrize(
    ("checkpoint", "features", "expected", "why"),
    [
        (torch.bfloat16, BOTH, torch.bfloat16, "checkpoint is bfloat16 and this CPU has amx"),
        (torch.bfloat16, ("avx512_bf16",), torch.bfloat16, "has avx512_bf16"),
        (torch.float16, ("avx512_bf16",), torch.bfloat16, "checkpoint is float16"),
        (torch.bfloat16, (), torch.float32, "neither AMX-BF16 nor AVX512-BF16"),
        (torch.float32, BOTH, torch.float32, "checkpoint is float32"),
        (None, BOTH, torch.float32, "float32 (unstated)"),
    ],
)
def test_the_auto_rule(
    checkpoint: torch.dtype | None, features: tuple[str, ...], expected: torch.dtype, why: str
) -> None:
    dtype, reason = auto_cpu_dtype(checkpoint, features)
    assert dtype == expected
    assert why in reason


def test_resolve_dtype_follows_this_cpu_and_logs_its_choice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="paged_engine"):
        got = resolve_dtype("auto", CPU, "bfloat16")
    assert got == (torch.bfloat16 if FAST_BF16 else torch.float32)
    assert f"dtype 'auto' chose {str(got).removeprefix('torch.')}" in caplog.text
    assert resolve_dtype("auto", CPU, torch.float32) == torch.float32
    assert resolve_dtype("auto", CPU, None) == torch.float32
    # Named dtypes and CUDA's rule are unchanged.
    assert resolve_dtype("float32", CPU, "bfloat16") == torch.float32
    assert resolve_dtype("bfloat16", CPU, "float32") == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), "float16") == torch.float16
    assert resolve_dtype("auto", torch.device("cuda"), "float32") == torch.bfloat16


def test_the_test_models_stay_float32_by_default(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kvcache_blocks=16, max_model_len=64)
    assert llm.model_runner.dtype == torch.float32
    assert llm.model_runner.backend.name == "cpu"


def test_a_bfloat16_checkpoint_runs_bfloat16_on_the_cpu_kernel(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "bf16-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    llm = LLM(model, num_kvcache_blocks=16, max_model_len=64)
    assert llm.model_runner.dtype == (torch.bfloat16 if FAST_BF16 else torch.float32)
    assert llm.model_runner.backend.name == "cpu"  # the kernel takes either
    out = llm.generate([[5, 6, 7, 8]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
