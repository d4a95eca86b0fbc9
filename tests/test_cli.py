"""The command line: flags checked before any model loads and refused by their flag names
(exit status 2), vLLM's flag names beside the old ones, ``--help`` with every default,
``--seed`` reproducible."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import paged_engine.llm
import paged_engine.worker.model_runner as model_runner
from paged_engine.__main__ import main as cli


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if weights are loaded or the KV pool is allocated."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the bad flag was refused")

    monkeypatch.setattr(model_runner, "load_model", forbidden)
    monkeypatch.setattr(model_runner.ModelRunner, "_allocate_kv_cache", forbidden)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI, expecting argparse's exit (status 2); its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


NOWHERE = ["generate", "--model", "/nonexistent/model", "--prompt", "hi"]
"""A model that does not exist: a flag refused with it was refused before the model was
looked at (the directory would be the error otherwise)."""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "0"], "--block-size must be an int >= 1, got 0"),
        (["--block-size", "-16"], "--block-size must be an int >= 1, got -16"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks must be an int >= 1, got 0"),
        (["--num-gpu-blocks-override", "0"], "--num-kv-blocks must be an int >= 1, got 0"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory must be an int >= 1, got 0"),
        (["--kv-cache-memory-bytes", "-1"], "--kv-cache-memory must be an int >= 1, got -1"),
        (["--max-model-len", "0"], "--max-model-len must be an int >= 1, got 0"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be an int >= 1, got 0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be an int >= 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--threads", "0"], "--threads must be an int >= 1, got 0"),
        (["--device", ""], "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (["--max-tokens", "0"], "--max-tokens must be"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be finite"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-k", "-2"], "--top-k must be"),
        # argparse's own checks name the flag too
        (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--attention-backend", "magic"], "argument --attention-backend: invalid choice"),
        (["--prefix-cache-hash", "md5"], "argument --prefix-cache-hash: invalid choice"),
    ],
)
def test_a_bad_generate_flag_is_refused_by_its_name_before_the_model_loads(
    no_model: None, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    err = refused([*NOWHERE, *flags], capsys)
    assert message in err
    assert "/nonexistent/model" not in err
    assert "usage: python -m paged_engine generate" in err
    for field in ("kvcache_block_size", "num_kvcache_blocks", "max_num_seqs", "num_threads"):
        assert field not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--block-size", "0"], "--block-size must be an int >= 1, got 0"),
        (["demo", "--max-tokens", "0"], "--max-tokens must be"),
        (["demo", "--requests", "0"], "argument --requests: must be an int >= 1, got 0"),
        (["make-tiny-model", "d", "--layers", "0"], "argument --layers: must be an int >= 1"),
        (["make-tiny-model", "d", "--shards", "-1"], "argument --shards: must be an int >= 1"),
    ],
)
def test_bad_flags_of_the_other_commands(
    tmp_path: Path,
    no_model: None,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    cache = ["--cache-dir", str(tmp_path / "cache")] if argv[0] == "demo" else []
    assert message in refused([*argv, *cache], capsys)
    assert not (tmp_path / "cache").exists()  # the demo model was not even built
    assert not Path("d").exists()


def test_flags_the_model_refuses_are_named_too(
    tiny_model_dir: Path, no_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--quiet"]
    assert cli([*base, "--max-model-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len=100000 is larger than the model's max_position_embeddings" in err
    assert cli([*base, "--max-model-len", "1024", "--kv-cache-memory", "4096"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold one --max-model-len=1024 sequence" in err
    assert "raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len" in err


class Recorded(Exception):
    """Raised by the stand-in LLM once it has the engine's keyword arguments."""


@pytest.fixture
def engine_kwargs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_llm(model: Any, **kwargs: Any) -> None:
        seen.clear()
        seen.update(kwargs)
        raise Recorded

    monkeypatch.setattr(paged_engine.llm, "LLM", fake_llm)
    return seen


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"kvcache_block_size": 16, "enable_prefix_caching": True, "seed": 0}),
        (["--block-size", "32"], {"kvcache_block_size": 32}),
        (["--no-prefix-caching"], {"enable_prefix_caching": False}),
        (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
        (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
        (["--num-kv-blocks", "7"], {"num_kvcache_blocks": 7}),
        (["--num-gpu-blocks-override", "9"], {"num_kvcache_blocks": 9}),
        (["--kv-cache-memory", "4096"], {"kv_cache_memory": 4096}),
        (["--kv-cache-memory-bytes", "8192"], {"kv_cache_memory": 8192}),
        (["--max-model-len", "64"], {"max_model_len": 64}),
        (["--max-num-seqs", "3", "--max-num-batched-tokens", "99"], {"max_num_seqs": 3}),
        (["--threads", "3"], {"num_threads": 3}),
        (["--seed", "5"], {"seed": 5}),
        (["--prefix-cache-hash", "sha256"], {"prefix_cache_hash": "sha256"}),
        (["--enforce-eager"], {"enforce_eager": True}),
        (["--gpu-memory-utilization", "0.5", "--dtype", "float32"], {"dtype": "float32"}),
    ],
)
def test_old_and_vllm_flag_names_reach_the_engine(
    engine_kwargs: dict[str, Any], flags: list[str], expected: dict[str, Any]
) -> None:
    with pytest.raises(Recorded):
        cli([*NOWHERE, *flags])
    assert {k: engine_kwargs.get(k) for k in expected} == expected


def test_unset_flags_leave_the_llm_defaults(engine_kwargs: dict[str, Any]) -> None:
    with pytest.raises(Recorded):
        cli(NOWHERE)
    # LLM caps its own default max_model_len at the model's; the thread count is its own
    assert "max_model_len" not in engine_kwargs and "num_threads" not in engine_kwargs
    assert engine_kwargs["num_kvcache_blocks"] is None
    assert engine_kwargs["kv_cache_memory"] is None


def help_entries(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``--help`` as ``{flag: its help text}`` (every spelling of an option maps to it)."""
    with pytest.raises(SystemExit) as exit_info:
        cli([*argv, "--help"])
    assert exit_info.value.code == 0
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in capsys.readouterr().out.splitlines():
        if re.match(r"^  -", line):
            invocation, _, text = line.strip().partition("  ")
            current = re.findall(r"--[a-z][a-z-]*", invocation)
            for flag in current:
                entries[flag] = text.strip()
        elif line.startswith("      ") and current:
            for flag in current:
                entries[flag] = (entries[flag] + " " + line.strip()).strip()
        else:
            current = []
    entries.pop("--help")
    return entries


ENGINE_DEFAULTS = {
    "--block-size": "16",
    "--num-kv-blocks": "auto",
    "--num-gpu-blocks-override": "auto",
    "--kv-cache-memory": "auto",
    "--kv-cache-memory-bytes": "auto",
    "--max-model-len": "4096, capped at the model's max_position_embeddings",
    "--max-num-seqs": "256",
    "--max-num-batched-tokens": "per device: 1024 on CPU, 8192 on CUDA",
    "--attention-backend": "auto",
    "--device": "auto",
    "--cpu-bind": "$PAGED_ENGINE_CPU_BIND",
    "--dtype": "auto",
    "--enable-prefix-caching": "True",
    "--no-enable-prefix-caching": "True",
    "--no-prefix-caching": None,  # an alias: described as one, no default of its own
    "--prefix-cache-hash": "xxh64",
    "--mixed-steps": "False",
    "--gpu-memory-utilization": "0.9",
    "--seed": "0",
    "--threads": "auto",
    "--tensor-parallel-size": "1",
    "--distributed-executor-backend": "mp",
    "--enforce-eager": "False",
}
HELP_DEFAULTS = {
    "generate": {
        "--model": None,  # required
        "--prompt": None,
        "--max-tokens": "64",
        "--temperature": "0.0",
        "--top-k": "None",
        "--top-p": "1.0",
        "--ignore-eos": "False",
        "--quiet": "False",
        **ENGINE_DEFAULTS,
    },
    "demo": {
        "--model": "None",
        "--tiny": "False",
        "--cache-dir": "/cache/root",
        "--requests": "32",
        "--max-tokens": "64",
        **ENGINE_DEFAULTS,
        # the demo's own: a tight pool, so preemption shows in its figures
        "--num-kv-blocks": "160",
        "--num-gpu-blocks-override": "160",
        "--max-model-len": "1024",
    },
    "make-tiny-model": {
        "--seed": "0",
        "--layers": "2",
        "--hidden-size": "64",
        "--shards": "1",
    },
}


@pytest.mark.parametrize("command", sorted(HELP_DEFAULTS))
def test_help_describes_every_flag_with_its_default(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    monkeypatch.setenv("PAGED_ENGINE_CACHE_DIR", "/cache/root")
    monkeypatch.setenv("COLUMNS", "100")
    entries = help_entries([command], capsys)
    expected = HELP_DEFAULTS[command]
    assert sorted(entries) == sorted(expected)
    for flag, default in expected.items():
        text = entries[flag]
        assert re.sub(r"\(default: [^)]*\)", "", text).strip(), f"{flag} has no help"
        if default is None:
            assert "(default:" not in text, (flag, text)
        else:
            assert f"(default: {default}" in text, (flag, text)


def test_help_of_the_whole_command_lists_the_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli(["--help"])
    out = capsys.readouterr().out
    for command in HELP_DEFAULTS:
        assert command in out


def test_cli_generate_and_make_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["make-tiny-model", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    args = ["generate", "--model", str(tmp_path / "m"), "--prompt", "hello", "--max-tokens", "4"]
    assert cli([*args, "--quiet", "--max-model-len", "64", "--num-kv-blocks", "8"]) == 0
    assert capsys.readouterr().out.strip()
    err = refused([*args, "--block-size", "0"], capsys)
    assert "--block-size must be an int >= 1, got 0" in err


def sampled(model: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    argv = ["generate", "--model", str(model), "--quiet", "--max-model-len", "64"]
    common = ["--num-kv-blocks", "32", "--temperature", "1.0", "--max-tokens", "12"]
    assert cli([*argv, *common, "--ignore-eos", *flags]) == 0
    return capsys.readouterr().out.splitlines()


def test_seed_changes_sampled_output_reproducibly(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = ["--prompt", "the cache"]
    first = sampled(tiny_model_dir, capsys, *prompt, "--seed", "1")
    assert len(first) == 1 and first[0].strip()
    assert sampled(tiny_model_dir, capsys, *prompt, "--seed", "1") == first
    assert sampled(tiny_model_dir, capsys, *prompt, "--seed", "2") != first
    # every request is seeded: the prompt samples the same whatever else is in the batch
    crowd = sampled(tiny_model_dir, capsys, "--prompt", "a b c", *prompt, "--seed", "1")
    assert crowd[1] == first[0]
