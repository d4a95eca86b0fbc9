"""What a call did, as one value a test can compare: a crash becomes a wrong answer.

A kill test must fail on an assertion, not on a mutant's exception; comparing
``outcome(call)`` with the expected value turns a mutant that raises (or stops raising)
into a failed comparison.
"""

from __future__ import annotations

from collections.abc import Callable


def outcome(run: Callable[[], object]) -> object:
    """What ``run`` returns, or the type name and message of the exception it raises."""
    try:
        return run()
    except Exception as exc:  # compared by the caller, not swallowed
        return (type(exc).__name__, str(exc))
