"""The decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 share, written once.

These families differ in a handful of switches (``DecoderOptions``): biases on the q/k/v
projections (Qwen2; Llama's ``attention_bias``, which covers o_proj too), a per-head
RMSNorm of q and k before rotary (Qwen3), biases in the MLP (Llama's ``mlp_bias``), and
how rotary positions are scaled (``layers/rotary.py``). Everything else is one block:
pre-norm GQA attention over the paged KV cache, a gated SiLU MLP, RMSNorm with the
residual riding the fused norms, and a tied or untied LM head. A family file
(``models/``) names its switches and the config keys it refuses.

Parameter names match Hugging Face checkpoints except for the fused projections
(``qkv_proj``, ``gate_up_proj``); ``PACKED_MODULES_MAPPING`` tells the loader which
checkpoint tensors fill which shard of them. Ops run in transformers' order (q/k norm
before rotary, residual adds in the model dtype), so float32 logits match it.

Built with a ``TPGroup`` of ``N`` ranks, the model is one rank's shard
(``layers/parallel.py``: column-parallel QKV and gate_up, row-parallel o_proj and down
with their all-reduces, a vocabulary-parallel embedding and LM head).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.attention import Attention, AttentionBackend
from paged_engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from paged_engine.layers.layernorm import RMSNorm
from paged_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.parallel import SINGLE, TPGroup, check_divisible, kv_head_split
from paged_engine.layers.rotary import RotaryEmbedding, rope_spec_from_config

PACKED_MODULES_MAPPING: Mapping[str, tuple[str, str | int]] = MappingProxyType(
    {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
)
"""Checkpoint module name → (our fused module, shard id). Read-only: shared by all models."""


@dataclass(slots=True, frozen=True)
class DecoderOptions:
    """What one family's block has that another's lacks (all off: Llama 2 / Mistral)."""

    qkv_bias: bool = False
    """A bias on the q, k and v projections (Qwen2; Llama's and Qwen3's attention_bias)."""
    o_bias: bool = False
    """A bias on the output projection (Llama's and Qwen3's attention_bias, not Qwen2's)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before rotary (Qwen3)."""
    mlp_bias: bool = False
    """Biases on gate, up and down (Llama's mlp_bias)."""


def head_dim_of(config: Any) -> int:
    """``head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def check_common_config(config: Any) -> None:
    """ValueError for what no family here runs: another activation, heads that GQA cannot
    group, an unsupported rope scaling (``rope_spec_from_config`` names it)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}"
        )
    rope_spec_from_config(config)


class DecoderAttention(nn.Module):
    """qkv projection → (per-head q/k RMSNorm) → rotary → paged attention → o projection."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        backend: AttentionBackend,
        rotary: RotaryEmbedding | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = heads // tp.size  # this rank's heads
        self.num_kv_heads = kv_head_split(kv_heads, tp)[1]
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, bias=options.qkv_bias, tp=tp
        )
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, config.hidden_size, options.o_bias, tp
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # The model passes one instance to all its layers: it makes a step's cos/sin once.
        self.rotary_emb = rotary or RotaryEmbedding(self.head_dim, rope_spec_from_config(config))
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """q and k are normed (where the family norms them) and rotated side by side,
        ``[N, H + kvh, d]``, in one pass: each head's norm and rotation are per row, so
        this is op for op the separate norms and rotations, with fewer kernel launches
        (``RotaryEmbedding.norm_rotate`` or ``rotate_``: in place in the qkv output on the
        CPU)."""
        n, h, kvh, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
        if self.q_norm is not None and self.k_norm is not None:
            qk = self.rotary_emb.norm_rotate(
                positions, qk, self.q_norm.weight, self.k_norm.weight, h, self.q_norm.eps
            )
        else:
            qk = self.rotary_emb.rotate_(positions, qk)
        v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
        out = self.attn(qk[:, :h], qk[:, h:], v)
        result: torch.Tensor = self.o_proj(out)
        return result


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: Any, bias: bool = False, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=bias, tp=tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual stream rides the fused norms."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        backend: AttentionBackend,
        rotary: RotaryEmbedding | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, options, backend, rotary, tp)
        self.mlp = GatedMLP(config, options.mlp_bias, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder stack, final norm: packed tokens in, hidden states out."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        backend: AttentionBackend,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary = RotaryEmbedding(head_dim_of(config), rope_spec_from_config(config))
        self.layers = nn.ModuleList(
            [
                DecoderLayer(config, options, backend, rotary, tp)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # no decoder layers
            normed: torch.Tensor = self.norm(hidden)
            return normed
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A whole model (one rank's shard of it with ``tp``). A family subclasses it and
    says, from its config, which options it runs (``options_for``) and what it refuses
    (``check_supported_config``). Attention metadata comes from ``forward_context``."""

    def __init__(self, config: Any, backend: AttentionBackend, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.check_supported_config(config)
        check_divisible(config, tp.size)
        self.config = config
        self.tp = tp
        self.packed_modules_mapping = PACKED_MODULES_MAPPING
        self.model = DecoderModel(config, self.options_for(config), backend, tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied, tp)

    @staticmethod
    def options_for(config: Any) -> DecoderOptions:
        """The family's switches for this config (overridden by each family)."""
        raise NotImplementedError

    @staticmethod
    def check_supported_config(config: Any) -> None:
        """ValueError naming the option, for settings this family's code does not run;
        called before any weight is read (``model_config.load_config``)."""
        check_common_config(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` ``[N]`` (the batch's packed tokens) → ``[N, hidden]``."""
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` (usually each sequence's last token) → ``[B, vocab]`` (on the
        ranks other than 0: uninitialised, see ``ParallelLMHead``)."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
