"""Ctrl-C on the command line: every command ends with one line ("interrupted") and exit
status ``INTERRUPTED``, wherever the key was pressed (``cli.main``).

Two hazards make "catch ``KeyboardInterrupt``" not enough, both met in tests:

* A ``KeyboardInterrupt`` raised while C++ calls back into Python (torch's module
  initialisation through pybind11, e.g. ``torch.distributed`` imported on the way to a
  transformers model class) cannot unwind through C++: the process aborts. So the heavy
  imports run first, with Ctrl-C deferred to their end (``preload``); they take seconds,
  the rest of a command (Python calling C++) is interrupted where it stands.
* A library can swallow the ``KeyboardInterrupt`` of an interrupted import and fail later
  with another error (numpy's lazy ``dtypes`` recursing under transformers). So the
  handler records the key press, and ``main`` reports any error after one as the
  interruption it is.
"""

from __future__ import annotations

import importlib
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

INTERRUPTED = 130
"""The exit status after Ctrl-C: 128 + SIGINT, as a shell reports a process it ended."""

HEAVY_IMPORTS = ("torch", "transformers", "transformers.modeling_utils")
"""What ``preload`` imports: torch and the transformers machinery every command that
loads or builds a model reaches (after them, a model class or ``paged_engine.llm``
imports no further torch module)."""


class Interrupts:
    """SIGINT watched for the length of a command (a context manager).

    ``process_ends``: the command is the process (``main()`` reading ``sys.argv``), so on
    the way out SIGINT is ignored rather than restored: a Ctrl-C while the interpreter
    shuts down (a second or more with torch loaded) would otherwise end a finished
    command by the signal, its status lost. A caller that passes argv gets the previous
    handler back. Off the main thread, or under a handler of someone else's, nothing is
    installed and only the ``KeyboardInterrupt`` itself is seen."""

    def __init__(self, process_ends: bool) -> None:
        self.presses = 0
        """Ctrl-C key presses since the command started."""
        self.process_ends = process_ends
        self._deferring = False
        self._previous: Any = None

    def __enter__(self) -> Interrupts:
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: SIGINT is not ours to watch
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN if self.process_ends else self._previous)

    @property
    def pressed(self) -> bool:
        return self.presses > 0

    def _handle(self, signum: int, frame: object) -> None:
        self.presses += 1
        if not self._deferring:
            raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Run the block whole: a Ctrl-C in it raises ``KeyboardInterrupt`` at its end."""
        before = self.presses
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self.presses > before:
            raise KeyboardInterrupt

    def preload(self) -> None:
        """Import ``HEAVY_IMPORTS`` with Ctrl-C deferred (see the module docstring)."""
        with self.deferred():
            for name in HEAVY_IMPORTS:
                importlib.import_module(name)
