"""Our layers and the torch attention backend against independent references (the sampler:
tests/test_sampling.py).

References: transformers' own Qwen3 modules (same weights, float32), ``naive_attention``
(itself anchored to transformers' eager attention).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3 as hf

from paged_engine.layers.attention import (
    Attention,
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
    make_attention_metadata,
    naive_attention,
)
from paged_engine.layers.context import forward_context
from paged_engine.layers.decoder import PACKED_MODULES_MAPPING, DecoderLayer
from paged_engine.layers.layernorm import RMSNorm
from paged_engine.layers.rotary import RopeSpec, RotaryEmbedding, rope_spec_from_config
from paged_engine.models.qwen3 import Qwen3ForCausalLM
from paged_engine.utils.loader import load_model
from paged_engine.utils.tiny_model import make_tiny_model
from paged_engine.utils.tokenizer import load_tokenizer

CPU = torch.device("cpu")
TIGHT = {"atol": 1e-5, "rtol": 1e-5}


def small_config(**overrides: object) -> Qwen3Config:
    values: dict[str, object] = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
    }
    values.update(overrides)
    config = Qwen3Config(**values)
    config._attn_implementation = "eager"
    return config


# ------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref = hf.Qwen3RMSNorm(48, eps=1e-6).to(dtype)
    ours = RMSNorm(48, eps=1e-6).to(dtype)
    weight = torch.rand(48) + 0.5
    ref.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    x = (torch.randn(7, 48) * 3).to(dtype)
    residual = torch.randn(7, 48).to(dtype)
    assert torch.equal(ours(x), ref(x))
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, ref(residual + x))


# -------------------------------------------------------------------------------- rotary


def _hf_rotary(config: Qwen3Config, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    rope = hf.Qwen3RotaryEmbedding(config)
    cos, sin = rope(q, positions[None, :])
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 1_000_000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
)
def test_rotary_matches_transformers(rope_parameters: dict[str, object]) -> None:
    config = small_config(rope_parameters=dict(rope_parameters))
    torch.manual_seed(1)
    q, k = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    positions = torch.tensor([0, 1, 2, 3, 17, 100, 513, 2048, 4000])
    ours = RotaryEmbedding(16, rope_spec_from_config(config))
    q_ours, k_ours = ours(positions, q, k)
    q_ref, k_ref = _hf_rotary(config, q, k, positions)
    torch.testing.assert_close(q_ours, q_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(k_ours, k_ref, atol=1e-6, rtol=0)
    assert not torch.allclose(q_ours[1:], q[1:])  # it did rotate


def test_linear_rope_scaling_divides_positions() -> None:
    torch.manual_seed(2)
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    plain = RotaryEmbedding(16, RopeSpec(theta=10000.0))
    scaled = RotaryEmbedding(16, RopeSpec(theta=10000.0, rope_type="linear", factor=4.0))
    positions = torch.tensor([0, 4, 40, 400])
    q_s, k_s = scaled(positions, q, k)
    q_p, k_p = plain(positions // 4, q, k)
    torch.testing.assert_close(q_s, q_p, atol=1e-5, rtol=0)
    torch.testing.assert_close(k_s, k_p, atol=1e-5, rtol=0)
    assert not torch.allclose(scaled(positions, q, k)[0][1:], plain(positions, q, k)[0][1:])


def test_rope_spec_reads_both_config_spellings_and_rejects_unknown_types() -> None:
    v5 = small_config(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0})
    assert rope_spec_from_config(v5) == RopeSpec(500000.0, "linear", 2.0)
    legacy = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 8})
    assert rope_spec_from_config(legacy) == RopeSpec(1e6, "linear", 8.0)
    assert rope_spec_from_config(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == RopeSpec(
        1e4
    )
    for rope_type in ("yarn", "dynamic", "llama3"):
        bad = SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": rope_type, "factor": 2.0})
        with pytest.raises(ValueError, match=rope_type):
            rope_spec_from_config(bad)


# ----------------------------------------------------------------------- weight copying


def copy_hf_weights(ours: torch.nn.Module, hf_module: torch.nn.Module) -> None:
    """Load an HF module's tensors into ours through the packed mapping and weight loaders."""
    params = dict(ours.named_parameters())
    loaded = set()
    for name, tensor in hf_module.state_dict().items():
        parts = name.split(".")
        shard = None
        for i, part in enumerate(parts):
            if part in PACKED_MODULES_MAPPING:
                parts[i], shard = PACKED_MODULES_MAPPING[part]
        target = ".".join(parts)
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            param.data.copy_(tensor)
        loaded.add(target)
    assert loaded == set(params)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim == 1:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def allocate_cache(model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
            module.k_cache = torch.zeros(shape)
            module.v_cache = torch.zeros(shape)


def test_decoder_layer_matches_transformers() -> None:
    config = small_config()
    ref = hf.Qwen3DecoderLayer(config, layer_idx=0).eval()
    randomize_(ref, seed=3)
    ours = DecoderLayer(config, Qwen3ForCausalLM.options_for(config), TorchAttentionBackend())
    copy_hf_weights(ours, ref)
    allocate_cache(ours, num_blocks=8, block_size=4)
    seq = 11
    torch.manual_seed(4)
    x = torch.randn(seq, 64)
    positions = torch.arange(seq)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    rope = hf.Qwen3RotaryEmbedding(config)
    with torch.no_grad():
        expected = ref(x[None], attention_mask=causal, position_embeddings=rope(x, positions[None]))
        meta = make_attention_metadata([seq], [seq], [[5, 2, 7]], block_size=4)
        with forward_context(meta):
            out, residual = ours(positions, x, None)
    torch.testing.assert_close(out + residual, expected[0], **TIGHT)


# ------------------------------------------------------------------------- whole model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3ForCausalLM, object]:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    model, _ = load_model(path, device=CPU, dtype=torch.float32, backend=TorchAttentionBackend())
    reference = HFQwen3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return path, model, reference


PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little girl",
    "Hello, world!",
    "def add(a, b):",
]


def test_model_logits_match_transformers_for_prefill_chunk_and_decode(tiny) -> None:
    path, model, reference = tiny
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    block_size, rng = 4, random.Random(5)
    free = list(range(40))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(len(p) + 3) // block_size))] for p in prompts]
    allocate_cache(model, num_blocks=40, block_size=block_size)
    # Three steps per prompt: prefill all but the last 3 tokens; a chunk of 2 new tokens
    # over that cached prefix; one decode step. Each is checked against the full forward.
    assert all(len(p) >= 4 for p in prompts)
    with torch.no_grad():
        full = [reference(torch.tensor([p])).logits[0] for p in prompts]
        for step in range(3):
            spans = [
                [(0, len(p) - 3), (len(p) - 3, len(p) - 1), (len(p) - 1, len(p))][step]
                for p in prompts
            ]
            meta = make_attention_metadata(
                [e - s for s, e in spans], [e for _, e in spans], tables, block_size
            )
            ids = torch.tensor(
                [t for p, (s, e) in zip(prompts, spans, strict=True) for t in p[s:e]]
            )
            pos = torch.tensor([j for s, e in spans for j in range(s, e)])
            with forward_context(meta):
                logits = model.compute_logits(model(ids, pos))
            expected = torch.cat([f[s:e] for f, (s, e) in zip(full, spans, strict=True)])
            torch.testing.assert_close(logits, expected, **TIGHT)


def greedy_paged(model: Qwen3ForCausalLM, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Batched greedy decoding through the paged cache: one prefill, then decode steps."""
    block_size = 8
    need = [-(-(len(p) + steps) // block_size) for p in prompts]
    ids = list(range(sum(need)))
    random.Random(6).shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in need]
    allocate_cache(model, num_blocks=sum(need), block_size=block_size)
    seqs = [list(p) for p in prompts]
    query_lens = [len(p) for p in prompts]
    with torch.no_grad():
        for _ in range(steps):
            lens = [len(s) for s in seqs]
            meta = make_attention_metadata(query_lens, lens, tables, block_size)
            tok = torch.tensor(
                [t for s, q in zip(seqs, query_lens, strict=True) for t in s[len(s) - q :]]
            )
            pos = torch.tensor(
                [
                    j
                    for s, q in zip(seqs, query_lens, strict=True)
                    for j in range(len(s) - q, len(s))
                ]
            )
            with forward_context(meta):
                hidden = model(tok, pos)
            last = meta.query_start_loc[1:].long() - 1
            nxt = model.compute_logits(hidden[last]).argmax(-1).tolist()
            for s, t in zip(seqs, nxt, strict=True):
                s.append(t)
            query_lens = [1] * len(seqs)
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def test_greedy_decode_matches_transformers_and_outputs_vary(tiny) -> None:
    path, model, reference = tiny
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = greedy_paged(model, prompts, steps=16)
    with torch.no_grad():
        for prompt, got in zip(prompts, ours, strict=True):
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None
            )
            assert got == out[0, len(prompt) :].tolist()
    assert len({tuple(o) for o in ours}) == len(ours)  # different prompts, different outputs
    assert all(len(set(o)) >= 5 for o in ours)  # no single token repeated forever


# --------------------------------------------------------------------- attention backend


def test_naive_attention_matches_transformers_eager() -> None:
    torch.manual_seed(7)
    n, length, heads, kv_heads, d = 3, 8, 6, 2, 8
    q = torch.randn(n, heads, d)
    k, v = torch.randn(length, kv_heads, d), torch.randn(length, kv_heads, d)
    offset = length - n
    mask = torch.zeros(n, length)
    for r in range(n):
        mask[r, offset + r + 1 :] = float("-inf")
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    expected, _ = hf.eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask[None, None],
        scaling=0.3,
    )
    torch.testing.assert_close(naive_attention(q, k, v, 0.3, offset), expected[0], **TIGHT)


def _paged_case(
    contexts: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    shared_prefix_blocks: int = 0,
    block_size: int = 4,
    seed: int = 0,
):
    """Random K/V for each context, prefixes written to shuffled blocks by hand.

    ``contexts`` holds ``(seq_len, query_len)``. With ``shared_prefix_blocks``, every
    sequence starts with the same tokens, stored once in the same physical blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    d = 8
    num_blocks = sum(-(-s // block_size) for s, _ in contexts) + 3
    physical = list(range(num_blocks))
    random.Random(seed).shuffle(physical)
    shared_tokens = shared_prefix_blocks * block_size
    shared_k = torch.randn(shared_tokens, kv_heads, d, generator=gen)
    shared_v = torch.randn(shared_tokens, kv_heads, d, generator=gen)
    shared_ids = [physical.pop() for _ in range(shared_prefix_blocks)]
    k_cache = torch.full((num_blocks, block_size, kv_heads, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, ks, vs = [], [], []
    for seq_len, q_len in contexts:
        assert seq_len - q_len >= shared_tokens
        k = torch.cat([shared_k, torch.randn(seq_len - shared_tokens, kv_heads, d, generator=gen)])
        v = torch.cat([shared_v, torch.randn(seq_len - shared_tokens, kv_heads, d, generator=gen)])
        n_blocks = -(-seq_len // block_size)
        table = shared_ids + [physical.pop() for _ in range(n_blocks - shared_prefix_blocks)]
        for pos in range(seq_len - q_len):  # the cached prefix, written without store_kv
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        ks.append(k)
        vs.append(v)
    meta = make_attention_metadata(
        [q for _, q in contexts], [s for s, _ in contexts], tables, block_size
    )
    q = torch.randn(sum(q for _, q in contexts), heads, d, generator=gen)
    new_k = torch.cat([k[s - ql :] for k, (s, ql) in zip(ks, contexts, strict=True)])
    new_v = torch.cat([v[s - ql :] for v, (s, ql) in zip(vs, contexts, strict=True)])
    return meta, q, new_k, new_v, k_cache, v_cache, ks, vs


CASES = {
    "prefill": [(5, 5), (9, 9), (1, 1), (16, 16)],
    "cached_prefix": [(12, 4), (7, 7), (10, 1), (13, 5)],
    "decode": [(5, 1), (17, 1), (8, 1), (1, 1), (33, 1)],
}


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_backend_matches_naive(case: str, heads: int, kv_heads: int) -> None:
    contexts = CASES[case]
    meta, q, k_new, v_new, k_cache, v_cache, ks, vs = _paged_case(contexts, heads, kv_heads)
    backend = TorchAttentionBackend()
    backend.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    out = backend.attend(q, k_new, v_new, k_cache, v_cache, meta, scale=0.35)
    start = 0
    for (seq_len, q_len), k, v in zip(contexts, ks, vs, strict=True):
        expected = naive_attention(q[start : start + q_len], k, v, 0.35, seq_len - q_len)
        torch.testing.assert_close(out[start : start + q_len], expected, **TIGHT)
        start += q_len


@pytest.mark.parametrize("query_len", [1, 3])
def test_torch_backend_shared_prefix_blocks(query_len: int) -> None:
    contexts = [(9 + query_len, query_len), (8 + query_len, query_len), (12 + query_len, query_len)]
    meta, q, k_new, v_new, k_cache, v_cache, ks, vs = _paged_case(
        contexts, 4, 2, shared_prefix_blocks=2, seed=8
    )
    assert meta.block_tables[0, :2].tolist() == meta.block_tables[1, :2].tolist()
    backend = TorchAttentionBackend()
    backend.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    out = backend.attend(q, k_new, v_new, k_cache, v_cache, meta, scale=0.35)
    for i, ((seq_len, q_len), k, v) in enumerate(zip(contexts, ks, vs, strict=True)):
        rows = slice(i * q_len, (i + 1) * q_len)
        expected = naive_attention(q[rows], k, v, 0.35, seq_len - q_len)
        torch.testing.assert_close(out[rows], expected, **TIGHT)


def test_store_kv_skips_minus_one_slots() -> None:
    k_cache = torch.full((3, 4, 2, 8), -7.0)
    v_cache = torch.full((3, 4, 2, 8), -7.0)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 0, -1, 9])
    TorchAttentionBackend().store_kv(key, value, k_cache, v_cache, slots)
    k_flat, v_flat = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    for row, slot in ((0, 3), (2, 0), (4, 9)):
        assert torch.equal(k_flat[slot], key[row])
        assert torch.equal(v_flat[slot], value[row])
    untouched = [s for s in range(12) if s not in (0, 3, 9)]
    assert bool((k_flat[untouched] == -7.0).all()) and bool((v_flat[untouched] == -7.0).all())


def test_attention_layer_without_cache_and_outside_context() -> None:
    torch.manual_seed(9)
    layer = Attention(4, 8, 0.3, 2, TorchAttentionBackend())
    q, k, v = torch.randn(7, 32), torch.randn(7, 16), torch.randn(7, 16)
    with pytest.raises(RuntimeError, match="forward_context"):
        layer(q, k, v)
    meta = make_attention_metadata([3, 4], [3, 4], [], block_size=4)
    with forward_context(meta):
        out = layer(q, k, v)
    assert out.shape == (7, 32)
    for rows in (slice(0, 3), slice(3, 7)):
        expected = naive_attention(
            q[rows].view(-1, 4, 8), k[rows].view(-1, 2, 8), v[rows].view(-1, 2, 8), 0.3, 0
        )
        torch.testing.assert_close(out[rows], expected.reshape(-1, 32), **TIGHT)
    cached = make_attention_metadata([3, 4], [5, 4], [], block_size=4)
    with forward_context(cached), pytest.raises(ValueError, match="empty"):
        layer(q, k, v)


def test_metadata_builder_layout() -> None:
    meta = make_attention_metadata([2, 1], [6, 3], [[4, 1], [0]], block_size=4)
    assert isinstance(meta, AttentionMetadata)
    assert meta.slot_mapping.tolist() == [1 * 4 + 0, 1 * 4 + 1, 0 * 4 + 2]
    assert meta.block_tables.tolist() == [[4, 1], [0, -1]]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.seq_start_loc.tolist() == [0, 6, 9]
    assert meta.is_prefill and meta.has_cached_prefix and meta.max_seq_len == 6


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert get_attention_backend("torch", CPU, 16, torch.float32).name == "torch"
    assert get_attention_backend("auto", CPU, 256, torch.bfloat16).name == "cpu"
    with pytest.raises(ValueError, match="flash-attn needs CUDA; this device is cpu"):
        get_attention_backend("flash-attn", CPU, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="triton attention needs CUDA"):
        get_attention_backend("triton", CPU, 16, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda-magic'"):
        get_attention_backend("cuda-magic", CPU, 16, torch.float32)
