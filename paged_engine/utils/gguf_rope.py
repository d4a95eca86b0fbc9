"""Llama 3.1's rotary scaling, recovered from a GGUF file's ``rope_freqs.weight``.

llama.cpp's converter does not store Llama 3.1's ``rope_scaling`` parameters: it stores
their effect, one divisor per rotary frequency (``rope_freqs.weight``: 1 for the short
wavelengths, ``factor`` for the long ones, a smooth blend between). transformers skips
that tensor, so its GGUF load of a Llama 3.1/3.2/3.3 file rotates without the scaling.
Here the parameters are recovered instead: every Llama 3.x release uses
``low_freq_factor`` 1, ``high_freq_factor`` 4 and an original context of 8192, and
``factor`` is the largest divisor; the divisors these give must equal the file's, or the
file is refused, naming the tensor, rather than served with a rotation it did not ask for.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from paged_engine.errors import ModelConfigError

LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192
TENSOR = "rope_freqs.weight"


def llama3_divisors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """The divisor of each rotary frequency under Llama 3.1's scaling with the release
    constants above (what llama.cpp writes as ``rope_freqs.weight``)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    wavelen = 2 * math.pi * theta**exponents
    low = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
    )
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, factor, medium))


def rope_parameters_from_freqs(
    divisors: np.ndarray, theta: float, head_dim: int, where: str
) -> dict[str, Any] | None:
    """config.json's ``rope_parameters`` for a file whose ``rope_freqs.weight`` holds
    ``divisors``: None when they are all 1 (no scaling), the llama3 parameters when they
    reproduce them; ``ModelConfigError`` naming the tensor otherwise."""
    values = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if values.shape != (head_dim // 2,):
        reason = f"{TENSOR} has {values.size} values; the rotation has {head_dim // 2} frequencies"
        raise ModelConfigError(where, reason, key=TENSOR)
    if np.all(values == 1.0):
        return None
    factor = float(values.max())
    expected = llama3_divisors(theta, head_dim, factor)
    if factor <= 1.0 or not np.allclose(values, expected, rtol=1e-5, atol=0.0):
        reason = (
            f"{TENSOR} holds rotary frequency divisors that are not Llama 3.1's scaling "
            f"(low_freq_factor {LLAMA3_LOW_FREQ_FACTOR}, high_freq_factor "
            f"{LLAMA3_HIGH_FREQ_FACTOR}, original context {LLAMA3_ORIGINAL_CONTEXT}): "
            "not supported"
        )
        raise ModelConfigError(where, reason, key=TENSOR)
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
    }
