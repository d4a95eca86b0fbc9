"""Rotary position embedding (RoPE), computed the way transformers computes it.

cos/sin are computed per step from the positions (``positions * inv_freq``, float32) rather
than looked up from a table: it costs ``num_tokens * head_dim / 2`` multiplies, has no
length limit, and produces exactly transformers' values, op for op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear")


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """The rope settings the model needs, whichever config spelling they came from."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0


def rope_spec_from_config(config: Any) -> RopeSpec:
    """Read rope settings from a Hugging Face config; ValueError for unsupported types.

    transformers >= 5 keeps everything in ``config.rope_parameters`` (``rope_type``,
    ``rope_theta``, ``factor``); older releases use ``config.rope_theta`` plus an optional
    ``config.rope_scaling`` dict whose type key is ``rope_type`` or the legacy ``type``.
    """
    params: Mapping[str, Any] | None = getattr(config, "rope_parameters", None)
    theta = getattr(config, "rope_theta", None)
    if params is None:
        params = getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters ({sorted(params)}) are not supported")
    theta = params.get("rope_theta", theta)
    if theta is None:
        raise ValueError("the config has no rope_theta (neither rope_parameters nor rope_theta)")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    if rope_type == "linear" and factor <= 0:
        raise ValueError(f"linear rope scaling needs factor > 0, got {factor}")
    return RopeSpec(theta=float(theta), rope_type=rope_type, factor=factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE (the "rotate half" layout of Llama/Qwen) to packed q and k.

    Linear scaling divides the inverse frequencies by ``factor`` (same as dividing the
    positions), as transformers' "linear" rope type does. ``inv_freq`` is made on the
    default device at construction (build the model under ``with torch.device(...)``).
    """

    def __init__(self, head_dim: int, spec: RopeSpec) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.spec = spec
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (spec.theta**exponents)
        if spec.rope_type == "linear":
            inv_freq = inv_freq / spec.factor
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round it.
        self.inv_freq = inv_freq
        self._memo: tuple[torch.Tensor, int, torch.dtype, tuple[torch.Tensor, ...]] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``[N, head_dim]`` cos and sin for each position, in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _factors(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``[N, 1, d]`` cos and "signed" sin (first half negated), made once per step.

        Every layer of a step rotates by the same positions tensor; one instance shared by
        the layers computes the factors once. The memo is keyed by the tensor's identity
        and its version counter (an in-place change invalidates it; inference-mode tensors
        have none, and the engine never writes its positions in place), and holds the
        tensor, so its identity cannot be reused while the memo lives.
        """
        version = -1 if positions.is_inference() else positions._version
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == version and memo[2] == dtype:
            return memo[3]
        cos, sin = self.cos_sin(positions, dtype)
        half = self.head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        factors = (cos[:, None, :], signed_sin[:, None, :])
        self._memo = (positions, version, dtype, factors)
        return factors

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[N, heads, d]`` (any heads: q, k, or both side by side).

        ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, computed as
        ``[x2, x1] * [-sin, sin]``: the same products (IEEE negation is exact), one op fewer.
        """
        cos, signed_sin = self._factors(positions, x.dtype)
        half = self.head_dim // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos + swapped * signed_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[N, H, d]`` and ``k`` ``[N, kvh, d]`` by their tokens' positions."""
        return self.rotate(positions, q), self.rotate(positions, k)
