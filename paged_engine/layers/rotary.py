"""Rotary position embedding (RoPE), computed the way transformers computes it.

cos/sin are computed per step from the positions (``positions * inv_freq``, float32) rather
than looked up from a table: it costs ``num_tokens * head_dim / 2`` multiplies, has no
length limit, and produces exactly transformers' values, op for op.

``norm_rotate`` is Qwen3's whole q/k step (per-head RMSNorm, then the rotation). On the
CPU it runs the compiled fused kernel in place (``kernels/fused_ops_cpu.py``; bit for bit
the torch ops it replaces), elsewhere those torch ops. The kernel is reached through
``kernels/fused_ops_layers.py``'s one pass of checks where the heads come straight from the
qkv output, through the launcher's general path otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_engine.kernels.fused_ops_cpu import MAX_COLS, fused_ok, qk_norm_rope_cpu_
from paged_engine.kernels.fused_ops_layers import qk_norm_rope_layer_
from paged_engine.layers.layernorm import rms_norm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The parameters Llama 3.1's frequency-dependent scaling needs (all required)."""


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """The rope settings the model needs, whichever config spelling they came from.

    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``
    are read for ``rope_type == "llama3"`` only (None otherwise)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


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
    if rope_type == "llama3":
        return _llama3_spec(float(theta), params)
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    if rope_type == "linear" and factor <= 0:
        raise ValueError(f"linear rope scaling needs factor > 0, got {factor}")
    return RopeSpec(theta=float(theta), rope_type=rope_type, factor=factor)


def _llama3_spec(theta: float, params: Mapping[str, Any]) -> RopeSpec:
    missing = [k for k in LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(f"llama3 rope scaling needs {', '.join(missing)} in rope_parameters")
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    factor, original = float(params["factor"]), params["original_max_position_embeddings"]
    if not (factor > 0 and 0 < low < high) or not (isinstance(original, int) and original > 0):
        raise ValueError(
            "llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
            f"and an int original_max_position_embeddings > 0, got {dict(params)}"
        )
    return RopeSpec(theta, "llama3", factor, low, high, original)


def _llama3_inv_freq(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths (beyond ``original / low_freq_factor``) are
    divided by ``factor``, short ones (below ``original / high_freq_factor``) kept, and
    those between interpolated smoothly; op for op as transformers computes it."""
    assert spec.low_freq_factor is not None and spec.high_freq_factor is not None
    assert spec.original_max_position_embeddings is not None
    original = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = original / spec.low_freq_factor, original / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (original / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


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
        elif spec.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, spec)
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round it.
        self.inv_freq = inv_freq
        self._memo: (
            tuple[torch.Tensor, int, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None
        ) = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``[N, head_dim]`` cos and sin for each position, in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_signed_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, head_dim]`` cos and "signed" sin (first half negated), made once per step.

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
        factors = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        self._memo = (positions, version, dtype, factors)
        return factors

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[N, heads, d]`` (any heads: q, k, or both side by side).

        ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, computed as
        ``[x2, x1] * [-sin, sin]``: the same products (IEEE negation is exact), one op fewer.
        """
        cos, signed_sin = self.cos_signed_sin(positions, x.dtype)
        half = self.head_dim // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + swapped * signed_sin[:, None, :]

    def _fused_layout(self, qk: torch.Tensor) -> bool:
        """Whether the fused kernel takes ``qk``'s shape: ``[N, heads, head_dim]``, each
        head's row contiguous (the kernel also checks it)."""
        return (
            qk.dim() == 3
            and qk.shape[-1] == self.head_dim <= MAX_COLS
            and (qk.stride(1) == self.head_dim)
        )

    def rotate_(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """``rotate`` in place on the CPU where the fused kernel takes ``qk`` (the same
        bits: each product and the sum rounded as torch's ops round them), so pass a buffer
        nothing else reads, like the qkv projection's output; elsewhere a new tensor."""
        cos, signed_sin = self.cos_signed_sin(positions, qk.dtype)
        if qk_norm_rope_layer_(qk, None, None, 0, 0.0, cos, signed_sin) is not None:
            return qk
        if self._fused_layout(qk) and fused_ok(qk, sum_order=False):
            return qk_norm_rope_cpu_(qk, None, None, 0, 0.0, cos, signed_sin)
        return self.rotate(positions, qk)

    def norm_rotate(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_q_heads: int,
        eps: float,
    ) -> torch.Tensor:
        """Qwen3's q/k step on ``qk`` ``[N, heads, d]`` (its first ``num_q_heads`` heads are
        q, the rest k): each head RMSNormed with ``q_weight`` or ``k_weight`` ``[d]``, then
        rotated. On the CPU, in place (``qk`` is overwritten and returned: pass a buffer
        nothing else reads, like the qkv projection's output); elsewhere a new tensor.

        The torch form norms q and k side by side, ``[N, H + kvh, d]``, in one call: each
        head's norm is per row, so this is op for op the separate ``q_norm``/``k_norm``.
        """
        cos, signed_sin = self.cos_signed_sin(positions, qk.dtype)
        fast = qk_norm_rope_layer_(qk, q_weight, k_weight, num_q_heads, eps, cos, signed_sin)
        if fast is not None:
            return qk
        if self._fused_layout(qk) and fused_ok(qk, q_weight, k_weight):
            return qk_norm_rope_cpu_(qk, q_weight, k_weight, num_q_heads, eps, cos, signed_sin)
        heads, d = qk.shape[-2], qk.shape[-1]
        weight = torch.cat(
            (q_weight.expand(num_q_heads, d), k_weight.expand(heads - num_q_heads, d))
        )
        return self.rotate(positions, rms_norm(qk, weight, eps))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[N, H, d]`` and ``k`` ``[N, kvh, d]`` by their tokens' positions."""
        return self.rotate(positions, q), self.rotate(positions, k)
