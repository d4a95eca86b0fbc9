"""``serve``'s data-parallel flags (``dp_args``): ``--data-parallel-backend ray``'s
refusals, each by name and before any model loads (argparse's exit 2), with or without
Ray installed; and how the replicas are counted for each backend."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from paged_engine.__main__ import main as cli
from paged_engine.entrypoints.dp_args import add_dp_args, check_dp_args

RAY = ["--data-parallel-size", "2", "--data-parallel-backend", "ray"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--headless"], "--headless is for --data-parallel-backend mp"),
        (["--data-parallel-size-local", "1"], "--data-parallel-size-local is for"),
        (["--engine-core", "thread"], "--data-parallel-backend ray needs --engine-core process"),
        (
            ["--distributed-executor-backend", "ray"],
            "--data-parallel-backend ray with --distributed-executor-backend ray is not",
        ),
        (["--data-parallel-backend", "slurm"], "-dpb: invalid choice: 'slurm'"),
    ],
)
def test_bad_ray_flags_are_refused_by_name_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli(["serve", "/nonexistent/model", *RAY, *flags])  # else the model would be the error
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_ray_the_extra_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda n: None if n == "ray" else real(n))
    with pytest.raises(SystemExit) as info:
        cli(["serve", "/nonexistent/model", *RAY])
    assert info.value.code == 2
    assert "pip install 'paged_engine[ray]'" in capsys.readouterr().err


def parsed(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dp_args(parser.add_argument)
    a = parser.parse_args(list(flags))
    a.engine_core, a.distributed_executor_backend = "process", "mp"
    return a


@pytest.mark.parametrize(
    ("flags", "counts"),
    [
        (("--data-parallel-size", "3"), (3, 0, 0)),
        (("--data-parallel-size", "3", "--data-parallel-size-local", "1"), (1, 2, 0)),
        (("--data-parallel-size", "3", "--data-parallel-backend", "ray"), (0, 0, 3)),
        (("--data-parallel-size", "3", "-dpb", "ray"), (0, 0, 3)),
    ],
)
def test_replicas_are_counted_per_backend(
    monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], counts: tuple[int, int, int]
) -> None:
    monkeypatch.setenv("PAGED_ENGINE_DP_AUTHKEY", "k")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # Ray "installed"
    a = parsed(*flags)
    check_dp_args(a)
    assert (a.dp_local, a.dp_remote, a.dp_ray) == counts


def test_a_bad_placement_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGED_ENGINE_RAY_PLACEMENT", "STRICT_SPREAD")
    with pytest.raises(SystemExit) as info:
        cli(["serve", "/nonexistent/model", *RAY])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "$PAGED_ENGINE_RAY_PLACEMENT must be one of ('PACK', 'SPREAD'), got 'STRICT_SPREAD'" in err
    )
