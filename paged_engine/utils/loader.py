"""Load a Hugging Face checkpoint directory into the model class its architecture names
(``models/registry.py``: Llama, Mistral, Qwen2, Qwen3).

Everything that can be wrong with a checkpoint is found before any real memory is spent:
the directory and config.json (``model_config.load_config``), the shard files, and every
tensor's name and shape (read from the safetensors headers and checked against a model
built on the meta device). Only then is the model allocated on the target device and the
data copied in.

Under tensor parallelism each rank reads only its slices: a parameter that carries
``checkpoint_slice`` (``layers/linear.py``, ``layers/embed_head.py``) names the part of
the checkpoint tensor it holds, and only that part is read (safetensors ``get_slice``,
which reads the bytes of the slice from the file, never the whole tensor).

**What is read.** Only files inside the model directory: an index whose ``weight_map``
names an absolute path or one with ``..`` is refused (``ModelConfigError`` naming the
index and the entry), as is a weight file that is not a regular file (a FIFO, a device
such as ``/dev/zero``, a directory). A symlink inside the directory is followed, whatever
it points at: Hugging Face's cache lays a snapshot out as symlinks into a ``blobs``
directory beside it (``snapshots/<rev>/model.safetensors -> ../../blobs/<hash>``), and
whoever can place a symlink in the directory can as well replace the file it stands for.
The threat refused is a downloaded text file (the index) steering the loader elsewhere.
Every tensor must be a floating type (``FLOAT_TENSOR_DTYPES``): this engine has no
quantized path, so an integer (``I8``), boolean or 8-bit float tensor in a checkpoint
that declares a floating dtype is refused, naming the tensor and its file, rather than
cast into garbage weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from paged_engine.errors import ModelConfigError
from paged_engine.layers.decoder import PACKED_MODULES_MAPPING, DecoderForCausalLM
from paged_engine.layers.parallel import SINGLE, TPGroup
from paged_engine.models.registry import class_for_config
from paged_engine.utils.json_file import read_json_object
from paged_engine.utils.model_config import CONFIG_FILE, load_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from paged_engine.layers.attention import AttentionBackend

INDEX_FILE = "model.safetensors.index.json"
FLOAT_TENSOR_DTYPES = ("F16", "BF16", "F32", "F64")
"""safetensors dtypes a checkpoint's tensors may have (cast to the run's dtype on load)."""


@dataclass(slots=True, frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a model parameter and its shard (None = whole)."""

    param_name: str
    shard_id: str | int | None


def _shard_path(model_dir: Path, name: str, index_path: Path) -> Path:
    """The shard file an index entry names, confined to ``model_dir`` (module docstring)."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\\" in name:
        raise ModelConfigError(
            str(index_path),
            f"weight_map names {name!r}: shard files must be named by paths inside the "
            "model directory (relative, without '..')",
            key="weight_map",
        )
    return model_dir / rel


def _check_regular(path: Path, named_by: Path) -> None:
    if path.exists() and not path.is_file():  # both follow symlinks
        raise ModelConfigError(
            str(path), f"is not a regular file (named by {named_by})", key=path.name
        )


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files: the index's shards when an index exists, else every file."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ModelConfigError(
                str(index_path), "has no weight_map of tensor names to file names", "weight_map"
            )
        files = [_shard_path(model_dir, n, index_path) for n in sorted(set(weight_map.values()))]
        for f in files:
            _check_regular(f, index_path)
        missing = [str(f.relative_to(model_dir)) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names shard files that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        _check_regular(f, model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
    return files


@contextlib.contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open`` on CPU, with the file named when it is garbage or truncated."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's shape and file, from the safetensors headers (no data is read).

    safetensors checks on opening that the header parses and that its offsets cover the
    file exactly, so a truncated or garbage file is refused here, by name.
    """
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in files:
        with _open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in shapes:
                    raise ValueError(f"tensor {name} appears in both {shapes[name][1]} and {path}")
                tensor = f.get_slice(name)
                _check_tensor_dtype(name, tensor.get_dtype(), path)
                shapes[name] = (tuple(tensor.get_shape()), path)
    return shapes


def _check_tensor_dtype(name: str, dtype: str, path: Path) -> None:
    if dtype not in FLOAT_TENSOR_DTYPES:
        raise ModelConfigError(
            str(path),
            f"tensor {name} is {dtype}, not a floating type ({', '.join(FLOAT_TENSOR_DTYPES)}): "
            f"{path.parent / CONFIG_FILE} declares a floating-point checkpoint, and this "
            "engine loads no quantized weights",
            key=name,
        )


def _target(checkpoint_name: str) -> _Target:
    """Map a checkpoint tensor name to our parameter, through the packed modules."""
    parts = checkpoint_name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED_MODULES_MAPPING:
            fused, shard_id = PACKED_MODULES_MAPPING[part]
            return _Target(".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id)
    return _Target(checkpoint_name, None)


def _expected_names(model: torch.nn.Module) -> dict[str, str]:
    """Checkpoint tensor names the model needs → our parameter name."""
    unpacked: dict[str, list[str]] = {}
    for src, (fused, _) in PACKED_MODULES_MAPPING.items():
        unpacked.setdefault(fused, []).append(src)
    expected: dict[str, str] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        hits = [i for i, p in enumerate(parts) if p in unpacked]
        if not hits:
            expected[name] = name
            continue
        i = hits[0]
        for src in unpacked[parts[i]]:
            expected[".".join([*parts[:i], src, *parts[i + 1 :]])] = name
    return expected


def _is_ignorable(name: str, tied: bool) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def _checkpoint_index(
    param: torch.nn.Parameter, shard_id: Any, shape: tuple[int, ...]
) -> tuple[slice, ...] | None:
    """The part of a checkpoint tensor of ``shape`` that ``param`` holds (None: all of
    it). Raises ValueError when the checkpoint's shape cannot be sliced as expected."""
    slicer = getattr(param, "checkpoint_slice", None)
    return None if slicer is None else slicer(shard_id, tuple(shape))


def _load_tensor(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id: Any) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard_id)
        return
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    param.data.copy_(tensor)


def _validate(
    meta_model: DecoderForCausalLM,
    shapes: Mapping[str, tuple[tuple[int, ...], Path]],
    tied: bool,
    model_dir: Path,
) -> None:
    """Missing, unexpected and misshapen tensors, each named; checked on meta tensors."""
    expected = _expected_names(meta_model)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing tensor(s): {missing}")
    unexpected = sorted(n for n in shapes if n not in expected and not _is_ignorable(n, tied))
    if unexpected:
        raise ValueError(f"checkpoint {model_dir} has unexpected tensor(s): {unexpected}")
    params = dict(meta_model.named_parameters())
    for name in expected:
        target = _target(name)
        fake = torch.empty(shapes[name][0], device="meta")
        param = params[target.param_name]
        try:
            index = _checkpoint_index(param, target.shard_id, shapes[name][0])
            _load_tensor(param, fake if index is None else fake[index], target.shard_id)
        except ValueError as err:
            raise ValueError(f"tensor {name} (in {shapes[name][1].name}): {err}") from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    config: PretrainedConfig | None = None,
    tp: TPGroup = SINGLE,
) -> tuple[DecoderForCausalLM, PretrainedConfig]:
    """Validate the checkpoint fully, then build the model on ``device`` in ``dtype``
    (rank ``tp.rank``'s shard of it, reading only that rank's slices).

    ``config`` is the directory's config as ``load_config`` returned it (read and
    validated here when None). Raises FileNotFoundError (directory, config.json, shard or
    weight files missing) or ValueError (config.json or a weight file unreadable,
    unsupported architecture or settings; a weight path outside the directory; missing,
    unexpected, misshapen or non-floating tensors, each named) before anything is
    allocated on ``device``.
    """
    path = Path(model_dir)
    if config is None:
        config = load_config(path)
    files = _weight_files(path)
    shapes = _checkpoint_shapes(files)
    tied = bool(config.tie_word_embeddings)
    model_cls = class_for_config(config)
    with torch.device("meta"):
        meta_model = model_cls(config, backend, tp)
    _validate(meta_model, shapes, tied, path)

    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config, backend, tp)
    params = dict(model.named_parameters())
    expected = _expected_names(model)
    for path_ in files:
        with _open_safetensors(path_) as f:
            for name in f.keys():  # noqa: SIM118
                if name not in expected:
                    continue
                target = _target(name)
                param = params[target.param_name]
                index = _checkpoint_index(param, target.shard_id, shapes[name][0])
                tensor = f.get_tensor(name) if index is None else f.get_slice(name)[index]
                _load_tensor(param, tensor, target.shard_id)
    return model.eval(), config


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let each layer turn its loaded weights into the form it runs on (``Linear``: a
    oneDNN-packed copy on CPU, which empties the checkpoint-shaped one). The model runner
    calls it after ``load_model``; ``load_model`` alone keeps the weights as the
    checkpoint has them, which is what the loader's tests read."""
    for module in model.modules():
        finish = getattr(module, "process_weights_after_loading", None)
        if finish is not None:
            finish()


__all__ = ["load_model", "process_weights_after_loading"]
