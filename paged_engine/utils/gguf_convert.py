"""Serving a GGUF file: it is converted once into a Hugging Face directory in the cache, and
that directory is what every part of the engine loads (config, tokenizer, weights,
tensor-parallel workers), unchanged. The engine has no quantized path; the weights are
dequantized (``gguf_weights``), so a 4-bit file is served at float32's size.

**What is written.** ``config.json`` is transformers' own reading of the file (``AutoConfig``),
with ``architectures``, ``dtype`` and every size the engine requires set explicitly and no
``quantization_config`` (the weights are no longer quantized); ``generation_config.json``
holds the file's bos/eos ids (its end-of-turn ids too, which llama.cpp also stops at); the
tokenizer is transformers' reading of the file, saved with its chat template; the weights
are those transformers loads from the file, tensor for tensor.

**The cache.** ``cache_root()/gguf/<stem>-<key>``, where the key hashes the file's
resolved path, size and modification time and ``CONVERTER_VERSION``: an edited file, or a
converter that writes differently, gets a new directory. Every refusal the header allows
(``gguf_file.read_gguf_header``, then the config and tokenizer) comes before anything is
written. The directory is written under a temporary name beside it and renamed into place
with its ``gguf_source.json`` last inside, so a crashed or concurrent conversion never
leaves a half directory that is reused; a crashed one's temporary directory is removed by
the next conversion of the file (``_remove_stale_temps``: the cache may be shared by hosts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_engine.errors import ModelConfigError
from paged_engine.utils.gguf_file import GGUFHeader, read_gguf_header

__all__ = ["CACHE_ENV", "CONVERTER_VERSION", "GGUFSource", "cache_root", "resolve_model_path"]

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
"""Bumped whenever the converted directory would differ: old conversions are not reused."""
CACHE_ENV = "PAGED_ENGINE_CACHE_DIR"
SOURCE_FILE = "gguf_source.json"
"""Written last into a converted directory: its presence marks the directory complete."""
_UNSAFE = re.compile(r"[^\w.-]")
_DROPPED_KEYS = ("_model_name_or_path", "_name_or_path", "quantization_config", "torch_dtype")
STALE_TEMP_AGE_S = 24 * 3600
"""A temporary directory not written for this long (its newest mtime, files included) is
removed whoever wrote it: the only sign of another host's crash, as its pids mean nothing
here (a cache on NFS). Generous, since a conversion writes for minutes and clocks differ."""


def cache_root() -> Path:
    """The engine's one cache, ``$PAGED_ENGINE_CACHE_DIR`` (else ``paged_engine`` in
    ``$XDG_CACHE_HOME`` or ``~/.cache``): GGUF conversions and the demo's tiny model go in it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get(CACHE_ENV) or Path(base) / "paged_engine")


@dataclass(slots=True, frozen=True)
class GGUFSource:
    """A GGUF file as the cache knows it: what it hashes to find its conversion."""

    path: Path
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> GGUFSource:
        stat = path.stat()
        return cls(path.resolve(), stat.st_size, stat.st_mtime_ns)

    @property
    def cache_dir(self) -> Path:
        """This file's converted directory (which may not exist yet)."""
        text = f"{self.path}\n{self.size}\n{self.mtime_ns}\n{CONVERTER_VERSION}"
        digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        stem = _UNSAFE.sub("_", self.path.stem)[:80]
        return cache_root() / "gguf" / f"{stem}-{digest}"


def resolve_model_path(model: str | Path) -> Path:
    """The Hugging Face directory to load for ``model``.

    A directory with config.json, or any path that is neither a file nor a directory
    holding .gguf files, is returned unchanged (the caller reports what is missing). A
    file, or a directory with exactly one .gguf file and no config.json, is converted once
    and its cached directory returned (a file that is not GGUF is refused naming it). A
    directory with two or more .gguf files and no config.json is refused naming them.
    """
    path = Path(model)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            reason = (
                f"has no config.json and {len(found)} .gguf files ({names}): pass the one to load"
            )
            raise ModelConfigError(str(path), reason)
        return _converted(found[0]) if found else path
    return _converted(path) if path.is_file() else path


def _is_complete(directory: Path) -> bool:
    return (directory / SOURCE_FILE).is_file() and (directory / "config.json").is_file()


def _converted(path: Path) -> Path:
    source = GGUFSource.of(path)
    out = source.cache_dir
    if _is_complete(out):
        return out
    header = read_gguf_header(path)
    config = _hf_config(header)
    tokenizer = _tokenizer(header)
    generation = _generation_config(header)
    _announce(header, out)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_stem(out)}-{os.getpid()}-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0o700 would keep a shared cache from other users
        from paged_engine.utils.gguf_weights import write_safetensors

        _write_json(tmp / "config.json", config)
        if generation:
            _write_json(tmp / "generation_config.json", generation)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        write_safetensors(header, tmp)
        record = {"source": str(source.path), "size": source.size, "mtime_ns": source.mtime_ns}
        _write_json(tmp / SOURCE_FILE, record | {"converter_version": CONVERTER_VERSION})
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return out


def _announce(header: GGUFHeader, out: Path) -> None:
    """Said only when converting, on stderr too: a first load takes that much longer."""
    message = (
        f"converting {header.path.name} ({len(header.tensors)} tensors) to a Hugging Face "
        f"directory, {out}, once; later runs reuse it"
    )
    logger.info(message)
    print(f"paged_engine: {message}", file=sys.stderr, flush=True)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; another process's finished one wins."""
    if out.exists() and not _is_complete(out):
        shutil.rmtree(out, ignore_errors=True)  # not a conversion of ours: replaced
    try:
        os.rename(tmp, out)
    except OSError:
        if not _is_complete(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _temp_stem(out: Path) -> str:
    """``out``'s temporary directories here are ``<stem>-<pid>-<random>``: a pid is per host."""
    return f".{out.name}.tmp-{_UNSAFE.sub('_', socket.gethostname())[:64]}"


def _remove_stale_temps(out: Path) -> None:
    """Remove ``out``'s temporary directories left by a crash: this host's whose process is
    gone, any host's older than ``STALE_TEMP_AGE_S`` (another host's pid may be free here)."""
    this_host = re.compile(rf"{re.escape(_temp_stem(out))}-(\d+)-[^-]*")
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        m = this_host.fullmatch(tmp.name)
        if (m and _no_process(int(m[1]))) or _age_s(tmp) > STALE_TEMP_AGE_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _no_process(pid: int) -> bool:
    """Whether this host has no process ``pid`` (ours, or another user's, is alive)."""
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True
    except OSError:  # alive, under another user
        return False


def _age_s(directory: Path) -> float:
    """Seconds since ``directory`` or a file in it was written (0 once it is gone)."""
    try:
        return time.time() - max(p.stat().st_mtime for p in [directory, *directory.iterdir()])
    except OSError:
        return 0.0


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _hf_config(header: GGUFHeader) -> dict[str, Any]:
    """config.json's contents: transformers' reading of the file, the sizes checked against
    the tensors (which win where transformers guesses: ``head_dim``)."""
    from transformers import AutoConfig

    from paged_engine.utils.gguf_rope import TENSOR, rope_parameters_from_freqs
    from paged_engine.utils.gguf_weights import checkpoint_dtype

    where = str(header.path)
    try:
        parsed = AutoConfig.from_pretrained(
            str(header.path.parent), gguf_file=header.path.name, local_files_only=True
        )
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as err:
        raise ModelConfigError(where, f"transformers cannot read its config: {err}") from None
    raw = {k: v for k, v in parsed.to_diff_dict().items() if k not in _DROPPED_KEYS}
    if raw.get("model_type") != header.architecture:  # a "llama" file named Mistral
        raw.pop("sliding_window", None)
    shapes = {t.name: t.shape for t in header.tensors}
    vocab, hidden = shapes["token_embd.weight"]
    heads = header.arch_int("attention.head_count") or 0
    q_rows = shapes.get("blk.0.attn_q.weight", (0,))[0]
    head_dim = header.arch_int("attention.key_length") or q_rows // heads
    if q_rows != heads * head_dim or hidden != header.arch_int("embedding_length"):
        reason = (
            f"blk.0.attn_q.weight has shape {shapes.get('blk.0.attn_q.weight')} and "
            f"token_embd.weight {(vocab, hidden)}: not {heads} heads of {head_dim} over "
            f"a hidden size of {header.arch_int('embedding_length')}"
        )
        raise ModelConfigError(where, reason, key="blk.0.attn_q.weight")
    rotary = header.arch_int("rope.dimension_count", head_dim)
    if rotary != head_dim:
        reason = f"rotates {rotary} of each head's {head_dim} dimensions: not supported"
        raise ModelConfigError(where, reason, key=f"{header.architecture}.rope.dimension_count")
    scaling = header.metadata.get(f"{header.architecture}.rope.scaling.type", "none")
    if scaling != "none":
        reason = f"rope scaling {scaling!r} is not supported"
        raise ModelConfigError(where, reason, key=f"{header.architecture}.rope.scaling.type")
    if TENSOR in header.skipped:  # Llama 3.1's scaling, as llama.cpp stores it
        theta = float(header.metadata.get(f"{header.architecture}.rope.freq_base", 10000.0))
        divisors = next(t for t in header.reader.tensors if t.name == TENSOR).data
        rope = rope_parameters_from_freqs(divisors, theta, head_dim, where)
        if rope is not None:
            raw["rope_parameters"] = rope
            raw.pop("rope_scaling", None)
    return raw | {
        "model_type": header.architecture,
        "architectures": [header.hf_architecture],
        "dtype": checkpoint_dtype(header.tensors),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": header.arch_int("feed_forward_length"),
        "num_hidden_layers": header.arch_int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": header.arch_int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _tokenizer(header: GGUFHeader) -> Any:
    """transformers' tokenizer for the file (None when it has no vocabulary), with the
    file's chat template."""
    if "tokenizer.ggml.model" not in header.metadata:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(header.path.parent), gguf_file=header.path.name, local_files_only=True
        )
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as err:
        reason = f"transformers cannot build its tokenizer: {err}"
        raise ModelConfigError(str(header.path), reason, key="tokenizer.ggml.model") from None
    template = header.metadata.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    return tokenizer


def _generation_config(header: GGUFHeader) -> dict[str, Any]:
    """The file's special ids; eos lists the end-of-turn and end-of-message ids as well,
    since llama.cpp stops at each (an instruct model ends its turn with one of them)."""
    ids = {k: header.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "pad")}
    out: dict[str, Any] = {f"{k}_token_id": v for k, v in ids.items() if v is not None}
    eos = [header.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(i for i in eos if i is not None))
    if stops:
        out["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return out
