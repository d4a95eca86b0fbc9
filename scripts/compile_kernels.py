"""Compile every Triton kernel for sm_80 and sm_90 offline and check what the cubins say.

No GPU is needed: ``triton.compile`` builds PTX and, with the ptxas bundled in Triton's
wheel, the cubin, for a target given by hand. Each case goes through the product's own host
code (``decode_launch_plan``, ``prefill_launch_plan`` and the ``*_launches`` packers) on
meta tensors shaped like the model's, so what is compiled is what a launch would run: the
same tiles, warps, stages and constexprs, and the same argument specialisation Triton's JIT
derives from real arguments (16-byte alignment, integers divisible by 16, integers equal
to 1). For every case it prints registers, spill bytes (from ptxas's log), shared memory
and the matrix-multiply instruction family, and checks two things read from the IR:

* the cache gather's address arithmetic is 64-bit: every ``tt.addptr`` on the K/V cache
  pointers (in the TTIR) takes int64 offsets, so pools past 2**31 elements do not wrap;
* the MMA family in the PTX is the expected one: ``mma.sync`` for 16-bit decode (16-row
  tiles), ``wgmma`` for 16-bit prefill on sm_90 and ``mma.sync`` on sm_80, plain FMA for
  float32 (the kernels ask for IEEE dots, never TF32).

Exit status 1 when any case fails to compile, when an IR check fails, or when a
configuration a launcher picks by default for Qwen3-family shapes (head_dim 128, GQA groups
1-8, float16/bfloat16) spills registers; spills elsewhere are printed as warnings.

    python scripts/compile_kernels.py          # CI: Qwen3 defaults + a seeded sample
    python scripts/compile_kernels.py --all    # the whole sweep

The default run is 124 cases (166 compiles: a split-K case also builds its merge kernel),
about 90 s of CPU; ``--all`` is 6,066 cases, some 8,000 compiles, more than an hour of CPU
(``--jobs`` spreads them over cores).

The sweep: head_dim 64/128/256, groups 1-16, block sizes 16-256 (powers of two, 24 and 48),
float16/bfloat16/float32, decode unsplit and split-K (with its merge kernel), prefill,
the K/V store. ``--unhinted`` also compiles each case with no alignment hints at all (what
the issue that added this script measured), for comparison only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARCHS = (80, 90)
SM_COUNT = {80: 108, 90: 132}
"""A100 and H100/H200: the split-K heuristic reads the SM count."""
DTYPES = ("fp16", "bf16", "fp32")
KINDS = ("decode", "decode-split", "prefill", "store")
HEAD_DIMS = (64, 128, 256)
GROUPS = tuple(range(1, 17))
BLOCK_SIZES = (16, 24, 32, 48, 64, 128, 256)
NUM_KV_HEADS = 8
MAX_MODEL_LEN = 4096
QWEN3_GROUPS = tuple(range(1, 9))
SAMPLE = 24
"""Cases drawn from the rest of the sweep on each default run (seeded: CI is repeatable)."""


@dataclass(frozen=True, slots=True)
class Case:
    kind: str
    arch: int
    dtype: str
    head_dim: int
    group: int
    block_size: int

    @property
    def qwen3_default(self) -> bool:
        """A configuration the launchers pick by default for Qwen3-family shapes."""
        return self.head_dim == 128 and self.group in QWEN3_GROUPS and self.dtype != "fp32"

    def label(self) -> str:
        return (
            f"{self.kind:12s} sm_{self.arch} {self.dtype} D={self.head_dim:<3d} "
            f"G={self.group:<2d} bs={self.block_size}"
        )


@dataclass(frozen=True, slots=True)
class Result:
    case: Case
    kernel: str
    hinted: bool
    constexprs: str
    num_warps: int
    regs: int | None
    spill_stores: int | None
    spill_loads: int | None
    shared: int | None
    mma: str | None
    problems: tuple[str, ...]
    seconds: float

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


def _launches(case: Case) -> tuple[Any, ...]:
    """The product's launches for ``case``, built on meta tensors (no memory, no device)."""
    import torch

    from paged_engine.kernels.decode_plan import decode_launch_plan
    from paged_engine.kernels.paged_decode_attention import decode_launches
    from paged_engine.kernels.paged_prefill_attention import (
        prefill_launch_plan,
        prefill_launches,
    )
    from paged_engine.kernels.store_kv import store_kv_launches

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    kvh, d, bs = NUM_KV_HEADS, case.head_dim, case.block_size
    h = kvh * case.group
    meta = {"device": "meta"}
    width = -(-MAX_MODEL_LEN // bs)
    # The model's layout (models/qwen3.py): q and k are slices of one [N, H + KVH, D] tensor,
    # v a slice of the fused qkv projection; the pool is one tensor, each layer a view.
    tokens = 64 if case.kind.startswith("decode") else 4096
    qk = torch.empty(tokens, h + kvh, d, dtype=dtype, **meta)
    qkv = torch.empty(tokens, (h + 2 * kvh) * d, dtype=dtype, **meta)
    query, key = qk[:, :h], qk[:, h:]
    value = qkv[:, (h + kvh) * d :].view(tokens, kvh, d)
    pool = torch.empty(2, 2, 1024, bs, kvh, d, dtype=dtype, **meta)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    i32 = {"dtype": torch.int32, **meta}
    if case.kind == "store":
        slots = torch.empty(tokens, dtype=torch.int64, **meta)
        return store_kv_launches(key, value, k_cache, v_cache, slots)
    if case.kind == "prefill":
        batch = 4
        plan = prefill_launch_plan(
            batch=batch,
            num_heads=h,
            num_kv_heads=kvh,
            head_dim=d,
            block_size=bs,
            max_query_len=2048,
            dtype=dtype,
        )
        tables = torch.empty(batch, width, **i32)
        qsl, lens = torch.empty(batch + 1, **i32), torch.empty(batch, **i32)
        out = torch.empty(tokens, h, d, dtype=dtype, **meta)
        return prefill_launches(plan, query, k_cache, v_cache, tables, qsl, lens, 0.1, out)
    split = case.kind == "decode-split"
    batch = 1 if split else tokens  # one long sequence splits; a big batch does not
    plan = decode_launch_plan(
        batch=batch,
        num_heads=h,
        num_kv_heads=kvh,
        head_dim=d,
        block_size=bs,
        table_width=width,
        dtype=dtype,
        sm_count=SM_COUNT[case.arch],
        num_splits=None if split else 1,
    )
    assert plan.split == split, (case, plan)
    out = torch.empty(batch, h, d, dtype=dtype, **meta)
    tables, lens = torch.empty(batch, width, **i32), torch.empty(batch, **i32)
    return decode_launches(plan, query[:batch], k_cache, v_cache, tables, lens, 0.1, out)


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_CACHE_PTRS = ("k_cache_ptr", "v_cache_ptr")


def _signature(launch: Any, backend: Any, hinted: bool) -> tuple[dict, dict, dict]:
    """What Triton's JIT derives from the launch's arguments: (signature, constexprs, attrs)."""
    from triton._C.libtriton import native_specialize_impl

    kernel = launch.kernel
    constexprs: dict[str, object] = dict(launch.constexprs)
    names = [n for n in kernel.arg_names if n not in constexprs]
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for name, arg in zip(names, launch.args, strict=True):
        ty, spec = native_specialize_impl(type(backend), arg, False, True, True)
        if ty == "constexpr":  # an integer equal to 1
            if hinted:
                constexprs[name] = arg
            else:
                ty = "i32"
        signature[name] = ty
        if hinted and isinstance(spec, str) and spec:
            attrs[(kernel.arg_names.index(name),)] = backend.parse_attr(spec)
    for name in constexprs:
        signature[name] = "constexpr"
    return {n: signature[n] for n in kernel.arg_names}, constexprs, attrs


def _mma_family(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync\.aligned", ptx):
        return "mma.sync"
    return "fma"


def expected_mma(case: Case, kernel: str) -> str | None:
    """The MMA family a kernel must use (None: no dot products, nothing to check)."""
    if kernel not in ("decode_kernel", "prefill_kernel"):
        return None
    if case.dtype == "fp32":
        return "fma"
    if kernel == "prefill_kernel" and case.arch >= 90:
        return "wgmma"
    return "mma.sync"


def cache_offsets_problems(ttir: str) -> list[str]:
    """Pointer arithmetic on the K/V cache pointers with offsets narrower than int64."""
    problems = []
    derived = {f"%{p}": p for p in _CACHE_PTRS if f"%{p}" in ttir}
    if not derived:
        return []
    for line in ttir.splitlines():
        m = re.match(r"\s*(%[\w.]+) = tt\.(splat|broadcast) (%[\w.]+)\b", line)
        if m and m.group(3) in derived:
            derived[m.group(1)] = derived[m.group(3)]
            continue
        m = re.match(r"\s*(%[\w.]+) = tt\.addptr (%[\w.]+), (%[\w.]+) : (.*?) loc", line)
        if m and m.group(2) in derived:
            offset_type = m.group(4).rsplit(",", 1)[-1].strip()
            if not re.search(r"\bi64\b|xi64>", offset_type):
                problems.append(
                    f"{derived[m.group(2)]}: address arithmetic in {offset_type}, not int64"
                )
    return problems


def compile_case(case: Case, hinted: bool = True) -> list[Result]:
    """Compile every launch of ``case``; one result per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", case.arch, 32)
    backend = make_backend(target)
    results = []
    for launch in _launches(case):
        signature, constexprs, attrs = _signature(launch, backend, hinted)
        kernel = launch.kernel
        name = kernel.fn.__name__
        log = io.StringIO()
        start = time.perf_counter()
        problems: list[str] = []
        regs = stores = loads = shared = None
        mma = None
        try:
            with contextlib.redirect_stdout(log), _knobs(triton):
                compiled = triton.compile(
                    ASTSource(kernel, signature, constexprs, attrs),
                    target=target,
                    options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
                )
        except Exception as exc:  # any failure to compile is a finding, with its reason
            problems.append(f"does not compile: {type(exc).__name__}: {str(exc)[:2000]}")
        else:
            text = log.getvalue()
            if (r := _REGS.search(text)) and (s := _SPILLS.search(text)):
                regs, stores, loads = int(r.group(1)), int(s.group(1)), int(s.group(2))
            else:
                problems.append("no ptxas resource report in the compile log")
            shared = int(compiled.metadata.shared)
            mma = _mma_family(compiled.asm["ptx"])
            want = expected_mma(case, name)
            if want is not None and mma != want:
                problems.append(f"MMA family {mma}, expected {want}")
            problems += cache_offsets_problems(compiled.asm["ttir"])
        shown = {k: v for k, v in launch.constexprs.items()}
        results.append(
            Result(
                case=case,
                kernel=name,
                hinted=hinted,
                constexprs=" ".join(f"{k}={v}" for k, v in shown.items()),
                num_warps=launch.num_warps,
                regs=regs,
                spill_stores=stores,
                spill_loads=loads,
                shared=shared,
                mma=mma,
                problems=tuple(problems),
                seconds=round(time.perf_counter() - start, 2),
            )
        )
    return results


@contextlib.contextmanager
def _knobs(triton: Any) -> Iterator[None]:
    """ptxas's resource report printed (and captured), and no cache hit (which prints none)."""
    nvidia, compilation = triton.knobs.nvidia, triton.knobs.compilation
    saved = nvidia.dump_ptxas_log, compilation.always_compile
    nvidia.dump_ptxas_log, compilation.always_compile = True, True
    try:
        yield
    finally:
        nvidia.dump_ptxas_log, compilation.always_compile = saved


def full_sweep() -> list[Case]:
    cases = []
    for kind in KINDS:
        for arch in ARCHS:
            for dtype in DTYPES:
                for d in HEAD_DIMS:
                    for g in GROUPS if kind != "store" else (1,):
                        for bs in BLOCK_SIZES if kind != "store" else (16,):
                            cases.append(Case(kind, arch, dtype, d, g, bs))
    return cases


def default_cases(sample: int, seed: int) -> list[Case]:
    """The Qwen3-family defaults (block size 16), then ``sample`` more from the sweep."""
    defaults = [
        Case(kind, arch, dtype, 128, g, 16)
        for kind in KINDS
        for arch in ARCHS
        for dtype in ("fp16", "bf16")
        for g in (QWEN3_GROUPS if kind != "store" else (1,))
    ]
    rest = [c for c in full_sweep() if c not in set(defaults)]
    return defaults + random.Random(seed).sample(rest, min(sample, len(rest)))


def _run(job: tuple[Case, bool]) -> list[Result]:
    return compile_case(*job)


def run_all(cases: Sequence[Case], jobs: int, unhinted: bool) -> Iterator[Result]:
    work = [(c, True) for c in cases] + ([(c, False) for c in cases] if unhinted else [])
    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # compile every case; touch no user cache
        try:
            if jobs <= 1:
                for job in work:
                    yield from _run(job)
            else:
                with ProcessPoolExecutor(jobs) as pool:
                    for results in pool.map(_run, work, chunksize=2):
                        yield from results
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved


def _row(r: Result) -> str:
    spill = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
    flag = "" if r.hinted else " (unhinted)"
    return (
        f"{r.case.label()}  {r.kernel:21s} w={r.num_warps} regs={r.regs!s:>4} "
        f"spill={spill:>9} smem={r.shared!s:>6} {r.mma or '-':8s}{flag}"
    )


@dataclass(frozen=True, slots=True)
class Verdict:
    results: tuple[Result, ...]
    failures: tuple[str, ...]
    """Each one makes the script exit 1."""
    warnings: tuple[str, ...]


def check(
    cases: Sequence[Case], jobs: int = 1, unhinted: bool = False, echo: bool = False
) -> Verdict:
    """Compile ``cases`` and apply the exit rules (see the module docstring)."""
    results: list[Result] = []
    failures: list[str] = []
    warnings: list[str] = []
    for r in run_all(cases, jobs, unhinted):
        results.append(r)
        if echo:
            print(_row(r), flush=True)
        where = f"{r.case.label()} {r.kernel}{'' if r.hinted else ' (unhinted)'}"
        failures += [f"{where}: {p}" for p in r.problems if r.hinted]
        if r.spills:
            what = f"{where}: spills {r.spill_stores}/{r.spill_loads} bytes (stores/loads)"
            (failures if r.hinted and r.case.qwen3_default else warnings).append(what)
    return Verdict(tuple(results), tuple(failures), tuple(warnings))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="compile the whole sweep")
    parser.add_argument("--sample", type=int, default=SAMPLE, help="extra cases by default")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--unhinted", action="store_true", help="also compile without hints")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    # Compiled kernels, not the interpreter's stand-ins (tox sets TRITON_INTERPRET=1 for the
    # tests): the variable must be unset before paged_engine.kernels is first imported.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated

    cases = full_sweep() if args.all else default_cases(args.sample, args.seed)
    start = time.perf_counter()
    verdict = check(cases, args.jobs, args.unhinted, echo=True)
    elapsed = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in verdict.results], indent=1) + "\n")
    print(f"\n{len(cases)} cases, {len(verdict.results)} compiles in {elapsed:.0f} s")
    for w in verdict.warnings:
        print(f"warning: {w}")
    for f in verdict.failures:
        print(f"FAIL: {f}")
    if verdict.failures:
        print("FAILED")
        return 1
    print("OK: every case compiled, the IR checks hold, the Qwen3-family defaults do not spill")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
