"""tests/conftest.py empties Hypothesis's pool of constants taken from the project's loaded
modules (outside the fuzz profile), so that a derandomised run draws the same examples
whatever other tests imported before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis.internal.conjecture import providers

import paged_engine.engine.block_pool  # noqa: F401  (a loaded module with constants in it)

ROOT = Path(__file__).resolve().parent.parent

# Draws 200 derandomised integers from a range that holds block_pool.py's constants, after
# importing (or not) the OpenAI server's modules, and prints them.
DRAWS = """
import sys
from hypothesis import given, settings, strategies as st
import tests.conftest  # the setup under test
if sys.argv[1] == "server":
    import paged_engine.entrypoints.openai_server  # many more local modules, more constants
seen = []

@settings(derandomize=True, database=None, max_examples=200)
@given(st.integers(-(2**20), 2**20))
def draw(n):
    seen.append(n)

draw()
print(seen)
"""


@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE") == "fuzz", reason="the fuzz profile keeps the pool"
)
def test_no_local_constants_are_drawn() -> None:
    if hasattr(providers, "_get_local_constants"):
        assert not providers._get_local_constants().integers


@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE") == "fuzz", reason="the fuzz profile keeps the pool"
)
def test_derandomised_draws_do_not_depend_on_the_modules_loaded() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", DRAWS, which],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for which in ("plain", "server")
    ]
    assert runs[0] == runs[1]
