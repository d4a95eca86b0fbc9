"""``python -m paged_engine``: the command line lives in ``paged_engine.entrypoints.cli``."""

from __future__ import annotations

import sys

from paged_engine.entrypoints.cli import build_parser, main
from paged_engine.entrypoints.cli_args import ENGINE_FLAGS, FLAGS, flag_message

__all__ = ["ENGINE_FLAGS", "FLAGS", "build_parser", "flag_message", "main"]

if __name__ == "__main__":
    sys.exit(main())
