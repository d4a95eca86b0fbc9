"""One kernel launch as a value: decided on the host, run, compiled offline, or re-run.

A launcher (``paged_decode_attention``, ``paged_prefill_attention``) checks its arguments
once, makes every host-side decision (tile sizes, warps, split-K plan, grid), and packs the
kernel's arguments into ``KernelLaunch`` records. Running a launch is then one call. Keeping
the decision in a value is what lets three users share it without a second copy:

* the attention backends, which check and plan once per step and shape and then only pack
  and launch for every layer (``DecodePlan`` / ``PrefillPlan``);
* ``scripts/compile_kernels.py``, which compiles exactly what a launch would run, from
  meta tensors, for GPUs this machine does not have;
* the mutation tests, which run a launch with its kernel replaced by a patched copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KernelLaunch", "run_launches"]


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``."""

    kernel: Any
    """A ``triton.JITFunction`` (an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``)."""
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    """The runtime arguments, in the kernel's parameter order (tensors, ints, floats)."""
    constexprs: Mapping[str, Any]
    num_warps: int
    num_stages: int

    def run(self) -> None:
        self.kernel[self.grid](
            *self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages
        )


def run_launches(launches: tuple[KernelLaunch, ...]) -> None:
    """Run ``launches`` in order (on the current stream: each sees the previous one's writes)."""
    for launch in launches:
        launch.run()
