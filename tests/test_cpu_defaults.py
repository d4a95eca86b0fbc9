"""Defaults that make the CPU path work out of the box: the automatic KV pool (sized from
the model and ``max_num_seqs x max_model_len``, capped by available memory, explicit
settings winning) and the thread count (the physical cores but one, and only when OpenMP
waits passively; ``import paged_engine`` asks for that before torch loads; tensor-parallel
ranks on the CPU share the cores). The probes live in ``paged_engine/platform.py``
(tests/test_platform.py parses fake /proc and /sys files); ``config`` re-exports them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import paged_engine.config as config
import paged_engine.platform as platform
import paged_engine.worker.kv_cache as kv_cache
import paged_engine.worker.model_runner as model_runner
from paged_engine import LLM, EngineConfig, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def kv_bytes_per_block(model_dir: Path, block_size: int) -> int:
    """From config.json: K and V, every layer, every kv head, float32 (CPU's dtype)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return per_token * block_size


def pool_bytes(llm: LLM) -> int:
    cache = llm.model_runner.kv_cache
    return cache.numel() * cache.element_size()


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    """What the memory probe reports: ``memory["available"]`` bytes (None: unknown)."""
    state: dict[str, int | None] = {"available": None}
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: state["available"])
    return state


def test_the_auto_pool_holds_max_num_seqs_full_length_sequences(
    tiny_model_dir: Path, memory: dict[str, int | None], caplog: pytest.LogCaptureFixture
) -> None:
    per_block = kv_bytes_per_block(tiny_model_dir, 16)
    memory["available"] = 10**12
    with caplog.at_level(logging.INFO, logger="paged_engine"):
        llm = LLM(tiny_model_dir, max_model_len=100, max_num_seqs=3, kvcache_block_size=16)
    assert llm.model_runner.num_kvcache_blocks == 3 * 7  # ceil(100 / 16) blocks each
    assert pool_bytes(llm) == 21 * per_block
    assert "KV pool sized automatically: 21 blocks" in caplog.text
    assert llm.config.kv_cache_memory is None


def test_the_auto_pool_without_a_memory_probe(
    tiny_model_dir: Path, memory: dict[str, int | None]
) -> None:
    llm = LLM(tiny_model_dir, max_model_len=64, max_num_seqs=5, kvcache_block_size=8)
    assert llm.model_runner.num_kvcache_blocks == 5 * 8
    assert pool_bytes(llm) == 40 * kv_bytes_per_block(tiny_model_dir, 8)


def test_the_memory_cap_applies(
    tiny_model_dir: Path, memory: dict[str, int | None], caplog: pytest.LogCaptureFixture
) -> None:
    per_block = kv_bytes_per_block(tiny_model_dir, 16)
    memory["available"] = 2 * 10 * per_block + per_block  # half of it: 10.5 blocks
    with caplog.at_level(logging.INFO, logger="paged_engine"):
        llm = LLM(tiny_model_dir, max_model_len=64, max_num_seqs=8, kvcache_block_size=16)
    assert llm.model_runner.num_kvcache_blocks == 10  # not 8 * 4 = 32
    assert "10 blocks" in caplog.text and "capped at 50% of the 0 MiB" in caplog.text


def test_a_cap_below_one_sequence_says_what_to_change(
    tiny_model_dir: Path, memory: dict[str, int | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("loaded before the pool was refused")

    monkeypatch.setattr(model_runner, "load_model", forbidden)
    memory["available"] = 2 * 3 * kv_bytes_per_block(tiny_model_dir, 16)  # 3 blocks
    with pytest.raises(ValueError) as e:
        LLM(tiny_model_dir, max_model_len=64, max_num_seqs=8, kvcache_block_size=16)
    msg = str(e.value)
    assert "cannot hold one max_model_len=64 sequence (4 blocks)" in msg
    assert "lower max_model_len" in msg and "kv_cache_memory / num_kvcache_blocks" in msg
    assert "50%" in msg


@pytest.mark.parametrize("setting", ["num_kvcache_blocks", "kv_cache_memory"])
def test_explicit_pool_settings_win(
    tiny_model_dir: Path, memory: dict[str, int | None], setting: str
) -> None:
    per_block = kv_bytes_per_block(tiny_model_dir, 16)
    blocks = 9
    value = blocks if setting == "num_kvcache_blocks" else blocks * per_block + per_block // 2
    override = {setting: value}
    memory["available"] = 2 * per_block  # the auto pool could not even hold one sequence
    llm = LLM(tiny_model_dir, max_model_len=64, max_num_seqs=8, kvcache_block_size=16, **override)
    assert llm.model_runner.num_kvcache_blocks == blocks
    assert pool_bytes(llm) == blocks * per_block


def test_the_memory_probe_reads_this_machine() -> None:
    avail = config.available_memory_bytes()
    if Path("/proc/meminfo").is_file():
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        assert avail is not None and 0 < avail <= total_kib * 1024


# ---- threads -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("siblings", "cores"),
    [
        ({0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, 2),  # SMT: two threads per core
        ({0: "0", 1: "1", 2: "2", 3: "3"}, 4),
        ({0: "0-1", 1: "0-1", 2: None, 3: None}, 3),  # unreadable topology: a core each
    ],
)
def test_physical_cores_count_smt_siblings_once(
    monkeypatch: pytest.MonkeyPatch, siblings: dict[int, str | None], cores: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(siblings))
    monkeypatch.setattr(platform, "_sys_cpu_file", lambda cpu, name: siblings[cpu])
    monkeypatch.setattr(platform, "_cgroup_cpu_limit", lambda: None)
    assert config.usable_physical_cores() == cores
    monkeypatch.setattr(platform, "_cgroup_cpu_limit", lambda: 1)
    assert config.usable_physical_cores() == 1


@pytest.mark.parametrize(
    ("env", "cores", "threads"),
    [
        ({"OMP_WAIT_POLICY": "PASSIVE"}, 6, 5),  # one core left for other work
        ({"OMP_WAIT_POLICY": "passive"}, 2, 1),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, 1, 1),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 6, 1),
        ({}, 6, 1),  # the runtime spins: one thread
        ({"OMP_NUM_THREADS": "3"}, 6, 3),  # the user's count wins
        ({"OMP_NUM_THREADS": "4,2", "OMP_WAIT_POLICY": "PASSIVE"}, 6, 4),
        ({"OMP_NUM_THREADS": "lots", "OMP_WAIT_POLICY": "PASSIVE"}, 6, 5),
    ],
)
def test_default_threads(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cores: int, threads: int
) -> None:
    for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(platform, "usable_physical_cores", lambda: cores)
    assert config.default_num_threads() == threads
    assert EngineConfig().num_threads == threads
    assert EngineConfig(num_threads=None).num_threads is None  # torch's own setting


@pytest.mark.parametrize(
    ("cores", "asked", "ranks", "each"),
    [
        (2, 1, 2, 1),  # issue 28's machine: two ranks, one core each
        (2, 4, 2, 1),  # asking for more than the share gets the share
        (8, 7, 2, 4),  # the single-process default (cores - 1) over two ranks
        (8, 2, 2, 2),  # fewer than the share: as asked
        (3, 5, 4, 1),  # more ranks than cores: still one thread each
        (8, 7, 1, 7),  # one rank: as asked, even beyond the cores (a user's choice)
    ],
)
def test_tensor_parallel_ranks_share_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, asked: int, ranks: int, each: int
) -> None:
    monkeypatch.setattr(platform, "usable_physical_cores", lambda: cores)
    assert platform.threads_per_rank(asked, ranks) == each


@pytest.fixture
def torch_threads() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_tensor_parallel_rank_on_the_cpu_takes_its_share_of_the_cores(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    """Issue 28: every TP rank took ``num_threads`` (cores - 1 by default), so TP=2 on 2
    cores ran twice as many threads as cores. Rank 0 runs in this process: with 2 usable
    cores (told so) and 4 threads asked, it takes 2 // 2 = 1."""
    monkeypatch.setattr(platform, "usable_physical_cores", lambda: 2)
    llm = LLM(
        tiny_model_dir,
        tensor_parallel_size=2,
        num_threads=4,
        num_kvcache_blocks=16,
        max_model_len=64,
    )
    try:
        assert llm.model_runner.tp.size == 2
        assert torch.get_num_threads() == 1
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.close()
    # One rank keeps the count it is given.
    LLM(tiny_model_dir, num_threads=3, num_kvcache_blocks=16, max_model_len=64)
    assert torch.get_num_threads() == 3


PROBE = """
import json, os, sys
first = sys.argv[1]
if first == "torch":
    import torch
import paged_engine
import torch
from paged_engine.config import usable_physical_cores
print(json.dumps({
    "policy": os.environ.get("OMP_WAIT_POLICY"),
    "threads": paged_engine.EngineConfig().num_threads,
    "cores": usable_physical_cores(),
}))
"""


@pytest.mark.parametrize(
    ("first", "preset", "policy", "threads"),
    [
        ("paged_engine", None, "PASSIVE", "cores"),
        ("torch", None, None, 1),  # too late: the runtime read the environment already
        ("paged_engine", "ACTIVE", "ACTIVE", 1),  # the user's setting stays
    ],
)
def test_import_paged_engine_asks_openmp_to_wait_passively(
    first: str, preset: str | None, policy: str | None, threads: int | str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    run = subprocess.run(
        [sys.executable, "-c", PROBE, first],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(run.stdout)
    assert seen["policy"] == policy
    assert seen["threads"] == (max(1, seen["cores"] - 1) if threads == "cores" else threads)


def test_a_cpu_step_computes_at_most_1024_tokens_by_default(tiny_model_dir: Path) -> None:
    """``max_num_batched_tokens`` left None: the CPU budget, 1,024 tokens a step. Two
    700-token prompts: the first step computes the first prompt and 324 of the second."""
    llm = LLM(tiny_model_dir, max_model_len=1024, num_kvcache_blocks=128, kvcache_block_size=16)
    assert llm.config.max_num_batched_tokens == 1024
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("a", list(range(1, 701)), params)
    engine.add_request("b", list(range(2, 702)), params)
    engine.step()
    assert engine.scheduler.stats.prefill_tokens == 1024
    engine.step()
    assert engine.scheduler.stats.prefill_tokens == 1400
