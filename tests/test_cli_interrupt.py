"""The command line's manners: Ctrl-C ends any command with one line and status 130 (real
SIGINTs to real processes, mid-generation and mid-import), and ``make-tiny-model`` says
what it is doing and writes a tokenizer with a chat template, so ``chat()`` runs on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.entrypoints import cli
from paged_engine.entrypoints.cli import INTERRUPTED, main
from paged_engine.entrypoints.interrupts import Interrupts
from paged_engine.utils.tiny_model import CHAT_TEMPLATE

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _interrupt(args: list[str], ready: str, delay_s: float) -> tuple[int, str, str]:
    """Run ``python -m paged_engine ARGS``; once a line of stderr holds ``ready``, wait
    ``delay_s`` and send SIGINT. Returns the exit status, stdout and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paged_engine", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert proc.stderr is not None
    seen = []
    while not any(ready in line for line in seen):
        line = proc.stderr.readline()
        assert line, f"exited before {ready!r}: {''.join(seen)}"
        seen.append(line)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, "".join(seen) + err


def test_ctrl_c_during_generate_prints_one_line_and_exits_130(tiny_model_dir: Path) -> None:
    prompts = [a for i in range(48) for a in ("--prompt", f"request {i}")]
    args = ["generate", "--model", str(tiny_model_dir), "--quiet", "--ignore-eos"]
    args += ["--max-tokens", "4000", "--max-model-len", "4096", "--num-kv-blocks", "13000"]
    status, out, err = _interrupt([*args, *prompts], "KV cache", 0.5)
    assert status == INTERRUPTED == 130, err
    assert err.endswith("\ninterrupted\n") and "Traceback" not in err, err
    assert out == ""  # interrupted mid-run: no completion was printed


def test_ctrl_c_while_make_tiny_model_loads_exits_130(tmp_path: Path) -> None:
    status, out, err = _interrupt(["make-tiny-model", str(tmp_path / "m")], "loading torch", 0.2)
    assert status == 130, err
    assert err.endswith("interrupted\n") and "Traceback" not in err, err
    assert out == ""


def test_main_turns_a_keyboard_interrupt_into_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def pressed(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_make_tiny_model", pressed)
    assert main(["make-tiny-model", "anywhere"]) == 130
    assert capsys.readouterr().err == "loading torch and transformers ...\ninterrupted\n"


def test_a_swallowed_ctrl_c_still_ends_as_interrupted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library that catches the KeyboardInterrupt and fails later (an interrupted import
    does so) is still the user's Ctrl-C; an error with no Ctrl-C propagates as before."""

    def swallowed(*args: object) -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        except BaseException:  # what the library does
            pass
        raise ModuleNotFoundError("Could not import module 'Qwen3ForCausalLM'")

    def broken(*args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_make_tiny_model", swallowed)
    assert main(["make-tiny-model", "anywhere"]) == 130
    assert capsys.readouterr().err.endswith(" ...\ninterrupted\n")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    monkeypatch.setattr(cli, "cmd_make_tiny_model", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["make-tiny-model", "anywhere"])


def test_heavy_imports_finish_before_a_ctrl_c_is_raised() -> None:
    """``preload``'s deferral: the key press is kept, the block runs whole (an import
    interrupted inside C++ would abort the process), and the interrupt comes at its end."""
    ran = []
    with Interrupts(process_ends=False) as interrupts:
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs here, and raises nothing
            ran.append("the rest of the block")
        assert interrupts.pressed and ran == ["the rest of the block"]
        interrupts.preload()  # nothing pressed since: returns
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_make_tiny_model_reports_progress_and_writes_a_chat_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["make-tiny-model", str(tmp_path / "m"), "--layers", "1"]) == 0
    captured = capsys.readouterr()
    stages = [line.split(" ")[0] for line in captured.err.splitlines() if line.endswith(" ...")]
    assert stages == ["loading", "training", "building", "writing"], captured.err
    assert (
        captured.out.startswith("wrote a tiny random Qwen3") and str(tmp_path / "m") in captured.out
    )
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "m").chat_template == CHAT_TEMPLATE


def test_chat_runs_on_the_tiny_model_with_its_own_template(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kvcache_blocks=64, max_model_len=128)
    conv = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    params = SamplingParams(temperature=0, max_tokens=8)
    (out,) = llm.chat(conv, params, use_tqdm=False)
    rendered = (
        "<|bos|>system\nAnswer briefly.<|endoftext|>\n"
        "<|bos|>user\nWhat is the capital of France?<|endoftext|>\n<|bos|>assistant\n"
    )
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(rendered)
    assert out.prompt_token_ids[0] == tok.bos_token_id  # the special tokens, not their text
    assert tok.eos_token_id in out.prompt_token_ids  # a turn ends with the model's eos
    (direct,) = llm.generate(rendered, params, use_tqdm=False)
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    assert 1 <= len(out.outputs[0].token_ids) <= 8
