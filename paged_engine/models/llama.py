"""Llama 2 and 3 (with Llama 3.1's ``llama3`` rope scaling), SmolLM2 and the many models
that share Llama's layout: the shared decoder (``layers/decoder.py``) as it is, with
``attention_bias`` (q, k, v and o) and ``mlp_bias`` where a config sets them."""

from __future__ import annotations

from typing import Any

from paged_engine.layers.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama's block: pre-norm GQA attention with rotary, a gated SiLU MLP, RMSNorm."""

    @staticmethod
    def options_for(config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)
