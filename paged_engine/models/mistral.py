"""Mistral: Llama's block without biases. Mistral 7B v0.1 attends through a 4,096-token
sliding window; a config whose ``sliding_window`` is shorter than its context is refused
(the paged attention here attends to the whole context), one without (v0.2 and later,
Mistral NeMo) runs."""

from __future__ import annotations

from typing import Any

from paged_engine.layers.decoder import DecoderForCausalLM, DecoderOptions, check_common_config


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral's dense models."""

    @staticmethod
    def options_for(config: Any) -> DecoderOptions:
        return DecoderOptions()

    @staticmethod
    def check_supported_config(config: Any) -> None:
        check_common_config(config)
        window = getattr(config, "sliding_window", None)
        if window is not None and window < config.max_position_embeddings:
            raise ValueError(
                f"sliding_window={window} (shorter than max_position_embeddings="
                f"{config.max_position_embeddings}) is not supported: the paged attention "
                "here attends to the whole context"
            )
