"""Hypothesis profiles (HYPOTHESIS_PROFILE=dev|ci|fuzz) and shared fixtures."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

# A shell that starts pytest in the background without job control (`cmd &` in a script)
# starts it with SIGINT ignored, and every child inherits that: the Ctrl-C tests would then
# test nothing. They are about the user's terminal, where SIGINT is Python's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Triton kernels run under its interpreter on machines without CUDA. Triton reads the
# variable when it is first imported, so it is set here, before any test module loads.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The test models are tiny: one torch thread is fastest, and immune to OpenMP spin-waiting
# when the machine's cores are busy with other work (several times slower otherwise).
import torch

torch.set_num_threads(1)

settings.register_profile(
    "dev",
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Thorough but bounded: the whole `tox` run must stay well under 20 minutes on 2 cores.
settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Fuzz campaigns (`tox -e fuzz`, scripts/fuzz.py): random seeds (the driver passes each
# round's seed with --hypothesis-seed and prints it) and the example database, so a failure
# found once is replayed first by every later run on this checkout. Never the CI default.
settings.register_profile(
    "fuzz",
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    derandomize=False,
    database=DirectoryBasedExampleDatabase(".hypothesis/examples"),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Mutation testing (`tox -e mutation`): dev's budgets, but every mutant sees the same
# examples and no database, so a verdict does not depend on the mutants run before it.
settings.register_profile(
    "mutation",
    settings.get_profile("dev"),
    derandomize=True,
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _draw_no_local_constants() -> None:
    """Hypothesis (from 6.131) sometimes draws a constant it found in the source of the
    project's modules loaded at the time (``providers._get_local_constants``), so the
    examples a derandomised run draws depended on which modules earlier tests had
    imported: a lockstep hunt caught a mutant at example 362 of 400 in a full run and
    missed it after `pytest -k` had picked other tests to run first (R2UnguardedDelete,
    tests/test_mutants.py). An empty pool makes every derandomised run draw the same
    examples whatever ran before it (tests/test_hypothesis_setup.py checks it). A
    Hypothesis without the pool is left as it is."""
    from hypothesis.internal.conjecture import providers

    if hasattr(providers, "_get_local_constants"):
        providers._get_local_constants = providers.Constants


# The fuzz campaign keeps them: its seeds are random anyway, and the constants find bugs.
if os.environ.get("HYPOTHESIS_PROFILE", "dev") != "fuzz":
    _draw_no_local_constants()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 with its tokenizer, built locally once per session."""
    from paged_engine.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
