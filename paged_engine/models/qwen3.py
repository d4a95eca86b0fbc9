"""Qwen3: the shared decoder (``layers/decoder.py``) with a per-head RMSNorm of q and k
before rotary, and ``attention_bias`` on the q/k/v and output projections."""

from __future__ import annotations

from typing import Any

from paged_engine.layers.decoder import DecoderForCausalLM, DecoderOptions, check_common_config


def refuse_sliding_window(config: Any) -> None:
    """Qwen2/Qwen3 configs carry ``sliding_window`` even when ``use_sliding_window`` is
    off (then every layer attends to the whole context, as here); on, it is refused."""
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(
            f"use_sliding_window with sliding_window={config.sliding_window} is not "
            "supported: the paged attention here attends to the whole context"
        )


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3's dense models (0.6B to 32B)."""

    @staticmethod
    def options_for(config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @staticmethod
    def check_supported_config(config: Any) -> None:
        check_common_config(config)
        refuse_sliding_window(config)
