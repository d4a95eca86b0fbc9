"""A checked GGUF file's tensors as Hugging Face safetensors (``gguf_convert`` calls it).

Each tensor is dequantized by the ``gguf`` package (llama.cpp's own reference code), so the
values are those llama.cpp and transformers compute: F32, F16 and BF16 tensors keep their
type, quantized ones become float32, where every block's scale times its integer is exact.
GGUF lists dimensions innermost first; the PyTorch shape is their reverse.

**The rotary row order of Llama files.** llama.cpp's converter reorders the rows of each
head of ``q_proj`` and ``k_proj`` for the "llama" architecture: Hugging Face's rotary
embedding pairs dimension ``i`` of a head with dimension ``i + head_dim/2`` (the two
halves), llama.cpp's pairs ``2i`` with ``2i + 1`` (interleaved), so it writes Hugging Face
row ``j * head_dim/2 + i`` of a head (half ``j``, index ``i``) at row ``2i + j``. The
inverse reads each head's rows as ``(head_dim/2, 2)`` and transposes them back to
``(2, head_dim/2)``; q uses the attention heads, k the KV heads. Qwen2 and Qwen3 files are
written without the reorder and are read as they are.

The output is sharded at ``SHARD_BYTES`` (one ``model.safetensors`` below it), so that
converting holds one shard of dequantized weights in memory, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from paged_engine.utils.gguf_file import GGUFHeader, GGUFTensor, import_gguf

__all__ = ["SHARD_BYTES", "checkpoint_dtype", "unpermute_rotary_rows", "write_safetensors"]

SHARD_BYTES = 2 << 30
"""Largest safetensors file written (a tensor larger than this gets a file of its own)."""
_OUT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _out_dtype(type_name: str) -> torch.dtype:
    return _OUT_DTYPES.get(type_name, torch.float32)


def checkpoint_dtype(tensors: tuple[GGUFTensor, ...]) -> str:
    """config.json's ``dtype``: the type of the matrices when all are F16, or all BF16,
    else float32. Vectors (norms, biases) do not count: llama.cpp writes them in F32 in
    every file type, which would otherwise make every file a float32 one."""
    types = {t.type_name for t in tensors if len(t.shape) >= 2}
    if len(types) == 1 and next(iter(types)) in _OUT_DTYPES:
        return _DTYPE_NAMES[_OUT_DTYPES[types.pop()]]
    return "float32"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of q/k rows (see the module docstring):
    row ``2i + j`` of each head goes back to row ``j * head_dim/2 + i``. Works on a
    matrix and on a bias alike (the rows are dimension 0)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of pairs")
    half = rows // num_heads // 2
    paired = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return paired.transpose(1, 2).reshape(weight.shape).contiguous()


def _dense(gguf: Any, raw: Any, tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values in its output dtype and PyTorch shape, copied out of the map."""
    if tensor.type_name == "F32":
        out = torch.from_numpy(np.array(raw.data, dtype=np.float32))
    elif tensor.type_name == "F16":
        out = torch.from_numpy(np.array(raw.data, dtype=np.float16))
    elif tensor.type_name == "BF16":  # stored as bytes: two per value
        out = torch.from_numpy(np.array(raw.data, dtype=np.uint8).view(np.int16))
        out = out.view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw.data, raw.tensor_type)))
        out = out.to(torch.float32)
    return out.reshape(tensor.shape)


def _hf_tensor(gguf: Any, header: GGUFHeader, raw: Any, tensor: GGUFTensor) -> torch.Tensor:
    out = _dense(gguf, raw, tensor)
    if header.architecture == "llama":
        heads = header.arch_int("attention.head_count")
        assert heads is not None  # read_gguf_header requires it
        if ".attn_q." in tensor.name:
            out = unpermute_rotary_rows(out, heads)
        elif ".attn_k." in tensor.name:
            out = unpermute_rotary_rows(out, header.arch_int("attention.head_count_kv", heads) or 1)
    return out


def _shards(tensors: tuple[GGUFTensor, ...], limit: int) -> list[list[GGUFTensor]]:
    """Consecutive groups of tensors whose output bytes stay within ``limit``."""
    groups: list[list[GGUFTensor]] = [[]]
    size = 0
    for t in tensors:
        n = int(np.prod(t.shape, dtype=np.int64)) * _out_dtype(t.type_name).itemsize
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def write_safetensors(header: GGUFHeader, out_dir: Path, shard_bytes: int = SHARD_BYTES) -> int:
    """Write every tensor of ``header`` (dequantized, renamed, in PyTorch shape) into
    ``out_dir`` as ``model.safetensors``, or as shards with a
    ``model.safetensors.index.json`` when they exceed ``shard_bytes``. Returns the number of
    files. F32, F16 and BF16 tensors keep their type, the rest are float32."""
    gguf = import_gguf()
    raw_by_name = {t.name: t for t in header.reader.tensors}
    groups = _shards(header.tensors, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups, 1):
        name = "model.safetensors"
        if len(groups) > 1:
            name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        shard = {t.hf_name: _hf_tensor(gguf, header, raw_by_name[t.name], t) for t in group}
        total += sum(v.numel() * v.element_size() for v in shard.values())
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        (out_dir / name).chmod(0o644)  # safetensors writes 0o600: readable like the rest
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(index, indent=2)
        (out_dir / "model.safetensors.index.json").write_text(text, encoding="utf-8")
    return len(groups)
