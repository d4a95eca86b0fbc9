"""``FlexibleArgumentParser`` (vLLM's ``vllm.utils.argparse_utils``): an ``ArgumentParser``
that reads a long flag spelt with underscores as the same flag spelt with dashes
(``--max_model_len 64`` is ``--max-model-len 64``), as vLLM's example scripts expect.

Only the flag's name is rewritten, never its value (``--chat-template=a_b.jinja`` keeps
``a_b.jinja``); anything after a bare ``--`` is left alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def normalize_flag(arg: str) -> str:
    """``--a_b=c_d`` -> ``--a-b=c_d``; a value or a short flag is returned as it is."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that accepts ``--a_b`` for a flag added as ``--a-b``."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        if not all(isinstance(a, str) for a in given):
            raise TypeError(f"arguments must be strings, got {given!r}")
        out: list[str] = []
        for i, arg in enumerate(given):
            if arg == "--":
                out.extend(given[i:])
                break
            out.append(normalize_flag(arg))
        return super().parse_known_args(out, namespace)


__all__ = ["FlexibleArgumentParser", "normalize_flag"]
