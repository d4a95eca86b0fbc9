"""A GGUF file's header, read and checked before anything is converted (``gguf_convert``).

A GGUF file is served by converting it once into a Hugging Face directory; every refusal
this engine can know from the header (an architecture it does not run, a tensor type it
cannot dequantize, a tensor it would not know where to put, a missing size) is made here,
naming the file and the key or tensor, so that a refused file costs a header read and
leaves nothing behind in the cache.

The ``gguf`` package (llama.cpp's reader) is an optional extra and is imported only here,
inside the functions that need it: a Hugging Face directory never needs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from paged_engine.errors import ModelConfigError

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_TYPES",
    "GGUFHeader",
    "GGUFTensor",
    "hf_tensor_name",
    "import_gguf",
    "read_gguf_header",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""Tensor types converted: the float types kept as they are, and the block quantizations
whose dequantization is a scale (and offset) per block of 32, exact in float32."""
ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
)
"""``general.architecture`` -> the Hugging Face class. llama.cpp files Mistral under
"llama" too: the same maths, served by the Llama class."""
INSTALL_HINT = "pip install 'paged_engine[gguf]'"

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARCH_PARTS = {
    "llama": {},
    "qwen2": {f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight"}
    | {"attn_k_norm.weight": "self_attn.k_norm.weight"},
}
"""Per architecture, the layer tensors its Hugging Face class has beyond the shared ones
(Qwen2's q/k/v biases, Qwen3's per-head q/k norms). A Llama file with biases is refused:
transformers' LlamaConfig would drop them silently."""
_SKIPPED = re.compile(r"rope_freqs\.weight|blk\.\d+\.rot_embd")
"""Tensors that are not weights of the Hugging Face model (llama.cpp's rotary frequency
factors, old files' rotary tables); transformers skips them too."""
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF and Hugging Face names, its ggml type's name and
    its shape in PyTorch order (GGUF lists dimensions innermost first)."""

    name: str
    hf_name: str
    type_name: str
    shape: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class GGUFHeader:
    """What the converter needs from a checked file: the architecture, the tensors it
    converts (``skipped``: those it leaves out), the scalar metadata, and the open
    ``reader`` whose memory-mapped tensors the converter dequantizes."""

    path: Path
    architecture: str
    hf_architecture: str
    tensors: tuple[GGUFTensor, ...]
    skipped: tuple[str, ...]
    metadata: Mapping[str, Any]
    reader: Any = field(repr=False, compare=False)

    def arch_int(self, key: str, default: int | None = None) -> int | None:
        """``{architecture}.{key}`` as an int (default when absent)."""
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        return value if value is None or isinstance(value, int) else int(value)


def import_gguf() -> ModuleType:
    """The ``gguf`` package, or an ImportError saying which extra installs it."""
    try:
        import gguf
    except ImportError as err:
        raise ImportError(
            f"loading a .gguf file needs the gguf package: {INSTALL_HINT} ({err})"
        ) from err
    return gguf


def hf_tensor_name(architecture: str, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of ``architecture``; None for a name this
    architecture's Hugging Face class has no tensor for."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None:
        return None
    part = _LAYER_PARTS.get(m[2]) or _ARCH_PARTS.get(architecture, {}).get(m[2])
    return None if part is None else f"model.layers.{int(m[1])}.{part}"


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelConfigError(str(path), f"cannot be read: {err}") from None
    if magic != GGUF_MAGIC:
        reason = f"is not a GGUF file (it starts with {magic!r}, not the magic {GGUF_MAGIC!r})"
        raise ModelConfigError(str(path), reason)


def _scalar_metadata(reader: Any, gguf: ModuleType) -> dict[str, Any]:
    """The file's metadata values that are not long arrays (the vocabulary and merges
    stay in the file: transformers reads them for the tokenizer)."""
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and len(f.data) > 1024:
            continue
        out[key] = f.contents()
    return out


def _check_tensors(
    path: Path, architecture: str, reader: Any
) -> tuple[list[GGUFTensor], list[str]]:
    tensors: list[GGUFTensor] = []
    skipped: list[str] = []
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            reason = (
                f"tensor {t.name} has type {type_name}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
            raise ModelConfigError(str(path), reason, key=t.name)
        if _SKIPPED.fullmatch(t.name):
            skipped.append(t.name)
            continue
        hf_name = hf_tensor_name(architecture, t.name)
        if hf_name is None:
            reason = f"tensor {t.name} is not a weight of a {architecture} model this engine loads"
            raise ModelConfigError(str(path), reason, key=t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors.append(GGUFTensor(t.name, hf_name, type_name, shape))
    return tensors, skipped


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Read and check ``path``'s header; nothing is dequantized.

    Raises ``ModelConfigError`` naming the file (and the key or tensor): not a GGUF file
    (bad magic) or not a readable one, one part of a split file, an architecture not in
    ``ARCHITECTURES``, a tensor
    whose type is not in ``SUPPORTED_TYPES`` or whose name the architecture's Hugging
    Face class lacks, a required size missing or not one integer, a layer index out of
    range. ImportError (with the install hint) when the ``gguf`` package is missing.
    """
    path = Path(path)
    _check_magic(path)
    gguf = import_gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as err:
        raise ModelConfigError(str(path), f"is not a readable GGUF file: {err}") from None
    metadata = _scalar_metadata(reader, gguf)
    if metadata.get("split.count", 1) > 1:
        reason = (
            f"is part {metadata.get('split.no', 0) + 1} of a GGUF split into "
            f"{metadata['split.count']} files: merge them first (llama-gguf-split --merge)"
        )
        raise ModelConfigError(str(path), reason, key="split.count")
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        reason = f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        raise ModelConfigError(str(path), reason, key="general.architecture")
    for key in (f"{arch}.{k}" for k in _REQUIRED_KEYS):
        value = metadata.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            reason = f"{key} must be one positive integer, got {value!r}"
            raise ModelConfigError(str(path), reason, key=key)
    tensors, skipped = _check_tensors(path, arch, reader)
    layers = metadata[f"{arch}.block_count"]
    for t in tensors:
        m = _LAYER.fullmatch(t.name)
        if m is not None and int(m[1]) >= layers:
            reason = f"tensor {t.name} is past the last layer ({arch}.block_count = {layers})"
            raise ModelConfigError(str(path), reason, key=t.name)
    if not any(t.name == "token_embd.weight" for t in tensors):
        reason = "has no token_embd.weight (the token embeddings)"
        raise ModelConfigError(str(path), reason, key="token_embd.weight")
    return GGUFHeader(
        path=path,
        architecture=arch,
        hf_architecture=ARCHITECTURES[arch],
        tensors=tuple(tensors),
        skipped=tuple(skipped),
        metadata=MappingProxyType(metadata),
        reader=reader,
    )
