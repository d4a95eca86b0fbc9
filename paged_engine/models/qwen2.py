"""Qwen2 and Qwen2.5: the shared decoder (``layers/decoder.py``) with biases on the q, k
and v projections (and none on the output projection)."""

from __future__ import annotations

from typing import Any

from paged_engine.layers.decoder import DecoderForCausalLM, DecoderOptions, check_common_config
from paged_engine.models.qwen3 import refuse_sliding_window


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 and Qwen2.5's dense models."""

    @staticmethod
    def options_for(config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)

    @staticmethod
    def check_supported_config(config: Any) -> None:
        check_common_config(config)
        refuse_sliding_window(config)
