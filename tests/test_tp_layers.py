"""Each tensor-parallel layer against its single-device twin, and the loader reading only
each rank's slices.

Two gloo ranks (spawned) build their shard of each layer from the same full weights,
through ``checkpoint_slice`` and the weight loaders exactly as the checkpoint loader
does, and run it on the same input; this process compares what each rank returned with
the twin's output. The expected share of each rank is written out here from the rules
(query heads ``[2r, 2r + 2)`` of 4; KV head ``r`` of 2, or head 0 of 1 for both ranks;
vocabulary rows ``[r V/2, (r+1) V/2)``), not computed by the code under test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from paged_engine.layers.embed_head import (
    LMHead,
    ParallelLMHead,
    VocabEmbedding,
    VocabParallelEmbedding,
)
from paged_engine.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    MergedLinear,
    QKVLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.parallel import SINGLE, TPGroup
from paged_engine.worker.distributed import agree_min

HIDDEN, HEAD_DIM, HEADS, INTER, VOCAB, ROWS = 32, 8, 4, 48, 40, 7


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q": r(HEADS * HEAD_DIM, HIDDEN),
        "q.bias": r(HEADS * HEAD_DIM),
        **{f"{n}{kv}": r(kv * HEAD_DIM, HIDDEN) for kv in (1, 2) for n in "kv"},
        **{f"{n}{kv}.bias": r(kv * HEAD_DIM) for kv in (1, 2) for n in "kv"},
        "gate": r(INTER, HIDDEN),
        "up": r(INTER, HIDDEN),
        "down": r(HIDDEN, INTER),
        "down.bias": r(HIDDEN),
        "embed": r(VOCAB, HIDDEN),
        "head": r(VOCAB, HIDDEN),
        "x": r(ROWS, HIDDEN),
        "x_inter": r(ROWS, INTER),
        # every shard's first and last row, and some in between
        "ids": torch.tensor([0, 19, 20, 39, 5, 33, 20, 0]),
    }


def load(module: torch.nn.Module, name: str, full: torch.Tensor, shard: Any = None) -> None:
    """What the loader does with one checkpoint tensor."""
    param = dict(module.named_parameters())[name]
    slicer = getattr(param, "checkpoint_slice", None)
    index = slicer(shard, tuple(full.shape)) if slicer is not None else None
    part = full if index is None else full[index]
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, part, shard)
    else:
        param.data.copy_(part)


def run_layers(tp: TPGroup, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every layer at ``tp`` (``SINGLE``: the twins), on the same inputs."""
    out: dict[str, torch.Tensor] = {}
    one = tp.size == 1
    for kv in (2, 1):
        cls = QKVLinear if one else QKVParallelLinear
        extra = {} if one else {"tp": tp}
        qkv = cls(HIDDEN, HEAD_DIM, HEADS, kv, bias=True, **extra)
        for s, key in (("q", "q"), ("k", f"k{kv}"), ("v", f"v{kv}")):
            load(qkv, "weight", w[key], s)
            load(qkv, "bias", w[f"{key}.bias"], s)
        out[f"qkv{kv}"] = qkv(w["x"])
    gate_up = (
        MergedLinear(HIDDEN, [INTER, INTER])
        if one
        else MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp=tp)
    )
    load(gate_up, "weight", w["gate"], 0)
    load(gate_up, "weight", w["up"], 1)
    out["gate_up"] = gate_up(w["x"])
    down = Linear(INTER, HIDDEN, bias=True) if one else RowParallelLinear(INTER, HIDDEN, True, tp)
    load(down, "weight", w["down"])
    load(down, "bias", w["down.bias"])
    half = INTER // tp.size
    out["down"] = down(w["x_inter"][:, tp.rank * half : (tp.rank + 1) * half])
    embed = VocabEmbedding(VOCAB, HIDDEN) if one else VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    load(embed, "weight", w["embed"])
    out["embed"] = embed(w["ids"])
    head = LMHead(VOCAB, HIDDEN) if one else ParallelLMHead(VOCAB, HIDDEN, tp=tp)
    load(head, "weight", w["head"])
    out["head"] = head(w["x"])
    tied_cls = LMHead if one else ParallelLMHead
    tied = tied_cls(VOCAB, HIDDEN, embed) if one else tied_cls(VOCAB, HIDDEN, embed, tp)  # type: ignore[arg-type]
    out["tied_head"] = tied(w["x"])
    return out


def _rank(rank: int, store_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        outputs = run_layers(TPGroup(rank, 2), full_weights())
        # the KV pool's agreement: rank 0 could hold 10 blocks, rank 1 only 7
        outputs["pool"] = torch.tensor(agree_min(10 - 3 * rank, torch.device("cpu")))
        torch.save(outputs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_outputs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("tp_layers")
    mp.start_processes(_rank, args=(str(d / "store"), str(d)), nprocs=2, start_method="spawn")
    return [torch.load(d / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def twin() -> dict[str, torch.Tensor]:
    return run_layers(SINGLE, full_weights())


def cols(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end]


@pytest.mark.parametrize("kv", [2, 1], ids=["kv heads split", "kv head replicated"])
def test_qkv_column_parallel(
    rank_outputs: list[dict[str, torch.Tensor]], twin: dict[str, torch.Tensor], kv: int
) -> None:
    d, q_all = HEAD_DIM, HEADS * HEAD_DIM
    full = twin[f"qkv{kv}"]
    q, k, v = full[:, :q_all], full[:, q_all : q_all + kv * d], full[:, q_all + kv * d :]
    for r, out in enumerate(rank_outputs):
        got = out[f"qkv{kv}"]
        head = r if kv == 2 else 0  # rank r: KV head r of 2; of 1, both ranks hold head 0
        assert got.shape == (ROWS, 2 * d + d + d)  # 2 query heads, 1 KV head each for k, v
        assert_close(cols(got, 0, 2 * d), cols(q, 2 * r * d, (2 * r + 2) * d))
        assert_close(cols(got, 2 * d, 3 * d), cols(k, head * d, (head + 1) * d))
        assert_close(cols(got, 3 * d, 4 * d), cols(v, head * d, (head + 1) * d))


def test_gate_up_column_parallel(
    rank_outputs: list[dict[str, torch.Tensor]], twin: dict[str, torch.Tensor]
) -> None:
    h = INTER // 2
    for r, out in enumerate(rank_outputs):
        gate, up = (
            cols(twin["gate_up"], r * h, (r + 1) * h),
            cols(twin["gate_up"], INTER + r * h, INTER + (r + 1) * h),
        )
        assert_close(out["gate_up"], torch.cat([gate, up], dim=1))


@pytest.mark.parametrize("name", ["down", "embed"], ids=["row-parallel down", "vocab embedding"])
def test_all_reduced_outputs_are_the_twins_on_every_rank(
    rank_outputs: list[dict[str, torch.Tensor]], twin: dict[str, torch.Tensor], name: str
) -> None:
    for out in rank_outputs:
        assert_close(out[name], twin[name])


@pytest.mark.parametrize("name", ["head", "tied_head"])
def test_lm_head_logits_are_gathered_on_rank_0(
    rank_outputs: list[dict[str, torch.Tensor]], twin: dict[str, torch.Tensor], name: str
) -> None:
    assert_close(rank_outputs[0][name], twin[name])
    assert rank_outputs[1][name].shape == twin[name].shape  # rank 1: a placeholder


# ---- the loader reads only each rank's slices ---------------------------------------------


class _Recorder:
    """A safetensors handle that records each read: ``(name, index)`` for a slice,
    ``(name, None)`` for a whole tensor."""

    def __init__(self, handle: Any, reads: list[tuple[str, Any]]) -> None:
        self.handle, self.reads = handle, reads

    def keys(self) -> Any:
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        self.reads.append((name, None))
        return self.handle.get_tensor(name)  # type: ignore[no-any-return]

    def get_slice(self, name: str) -> Any:
        real = self.handle.get_slice(name)
        reads = self.reads

        class Slice:
            def get_shape(self) -> Any:
                return real.get_shape()

            def get_dtype(self) -> Any:
                return real.get_dtype()

            def __getitem__(self, index: Any) -> torch.Tensor:
                reads.append((name, index))
                return real[index]  # type: ignore[no-any-return]

        return Slice()


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_slices(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, rank: int
) -> None:
    from contextlib import contextmanager

    from safetensors import safe_open

    from paged_engine.layers.attention import get_attention_backend
    from paged_engine.utils import loader

    reads: list[tuple[str, Any]] = []
    real_open = loader._open_safetensors

    @contextmanager
    def recording(path: Path) -> Any:
        with real_open(path) as f:
            yield _Recorder(f, reads)

    monkeypatch.setattr(loader, "_open_safetensors", recording)
    backend = get_attention_backend("torch", torch.device("cpu"), 16, torch.float32)
    tp = TPGroup(rank, 2)
    model, cfg = loader.load_model(
        tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32, backend=backend, tp=tp
    )
    (path,) = tiny_model_dir.glob("*.safetensors")
    with safe_open(str(path), framework="pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    loaded = [name for name, _ in reads]
    assert sorted(loaded) == sorted(full), "each tensor is read exactly once"
    params = dict(model.named_parameters())
    v, inter, q = cfg.vocab_size, cfg.intermediate_size, cfg.num_attention_heads * 16
    halves = {  # checkpoint name suffix -> (dim, full size): rank r holds half r
        "q_proj.weight": (0, q),
        "k_proj.weight": (0, 32),
        "v_proj.weight": (0, 32),
        "gate_proj.weight": (0, inter),
        "up_proj.weight": (0, inter),
        "o_proj.weight": (1, q),
        "down_proj.weight": (1, inter),
        "embed_tokens.weight": (0, v),
    }
    for name, tensor in full.items():
        suffix = ".".join(name.split(".")[-2:])
        read = dict(reads)[name]
        if suffix not in halves:  # norms: replicated, so read whole
            assert_close(params[name], tensor)
            continue
        assert read is not None, f"{name} was read whole"
        dim, size = halves[suffix]
        assert tensor.shape[dim] == size
        part = tensor.narrow(dim, rank * size // 2, size // 2)
        assert_close(tensor[read], part)  # the slice read is exactly this rank's half
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.shape == (inter, cfg.hidden_size)  # 2 x inter / 2
    assert layer.self_attn.qkv_proj.weight.shape == (q // 2 + 2 * 16, cfg.hidden_size)


def test_the_pool_size_is_the_minimum_on_every_rank(
    rank_outputs: list[dict[str, torch.Tensor]],
) -> None:
    assert [int(out["pool"]) for out in rank_outputs] == [7, 7]
