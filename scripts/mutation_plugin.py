"""A pytest plugin for mutation runs only: Hypothesis stops at the first failing example.

scripts/mutation.py loads it (``-p mutation_plugin`` in PYTEST_ADDOPTS for mutmut, a
plugin object for ``--recheck``); the test suite never does. After tests/conftest.py has
loaded the ``mutation`` profile, this loads the same profile without the shrink and explain
phases.

Why: a mutant that a Hypothesis machine catches is caught by the generate phase; Hypothesis
then spends most of the test's time shrinking the failing program (40 steps, derandomized)
to a small one that nobody reads in a mutation run. The verdict cannot change: with the
same derandomized examples, the generate phase finds a failure (the test fails, with or
without shrinking) or it does not (no shrink phase runs either way). The cost: a failure
reports the unshrunk example, and ``--recheck`` or a kill test is where a small one is found.

The flag is not in mutmut's configuration, so recorded verdicts stand (a changed
``pytest_add_cli_args`` would reset all of them).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings

PROFILE = "mutation-no-shrink"
DROPPED = frozenset({Phase.shrink, Phase.explain})


def no_shrink(parent: settings) -> settings:
    """``parent`` with every phase but shrink and explain (the order kept)."""
    return settings(parent, phases=[p for p in parent.phases if p not in DROPPED])


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Replace the loaded profile (conftest's, loaded when it was imported) by its
    no-shrink copy; idempotent, so a forked child's second session changes nothing."""
    loaded = settings.default
    assert loaded is not None  # tests/conftest.py has loaded the mutation profile
    settings.register_profile(PROFILE, no_shrink(loaded))
    settings.load_profile(PROFILE)
