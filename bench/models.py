"""The two Qwen3-shaped models the side-by-side benchmarks run (random weights, written
locally by ``make_tiny_model``): ``tiny``, the end-to-end model with ``head_dim`` 32
(vLLM's CPU attention takes head sizes 32, 64, 80, ... only), and ``qwen3-29m``, issue
13's model (hidden 512, 8 layers, 8 heads / 4 KV heads, head_dim 64, intermediate 1792:
28.7M parameters)."""

from __future__ import annotations

MODELS: dict[str, dict[str, int]] = {
    "tiny": {"head_dim": 32},
    "qwen3-29m": dict(
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1792,
    ),
}
