"""Where one decode step's time goes on the 29M model (issue 25, item 5's profile): the model
forward against the Python around it.

``LLM.generate`` (one thread, the "cpu" backend, float32 by default, the progress bar on as
a user gets it) runs ``--batch`` requests of ``--prompt`` random prompt tokens and
``--max-tokens`` outputs (``ignore_eos``): after the prefill steps, all of them decode in
every step until they finish together. A step is one turn of ``generate``'s loop, from one
``LLMEngine._step`` call to the next (the loop's own work and the progress bar included).
Kept: the steady decode steps, every sequence decoding, neither the first decode step of a
round nor its last (where every request finishes and its output is built once).

Two views, each over ``--rounds`` calls of ``generate`` on one ``LLM``:

* ``split``: methods wrapped from outside (this script sets instance, module or class
  attributes; nothing in the product changes) with ``time.perf_counter`` and exclusive
  accounting: a wrapped call's time, less that of the wrapped calls inside it, goes to its
  category. Categories (``CATEGORIES``): ``model`` (``ModelRunner._model_forward`` and
  ``step_logits``: the runner's torch work, LM head included; ``model/attention`` and
  ``model/store_kv`` are the attention backend's calls inside it), ``inputs`` (building the
  batch's tensors: ``ModelRunner.prepare``, with ``HostMetadata.build`` and the staging
  apart), ``sampling`` (``step_results`` and the ``Sampler`` call in it, the per-request
  generator lookup in ``ModelRunner.run``, ``sampled_logprobs``), ``scheduler``
  (``schedule``, ``postprocess``, ``recover``, ``is_finished``), ``output`` (the output
  processor's five stages), ``progress`` (``Progress.update``), ``glue`` (what
  ``LLMEngine._step`` and ``ModelRunner._forward`` do themselves); ``other`` = the step's
  wall time less all of them (the loop in ``_run_to_completion``, and this script's own
  wrappers: about 0.3 us per wrapped call, some 40 calls a step).
* ``cprofile``: ``cProfile`` over the same kind of steps, switched off during the model
  forward (``_model_forward`` and ``step_logits``), so what it lists is the Python outside
  the model; the top functions by own time, in microseconds per step under the profiler
  (which inflates Python calls: read it for the ranking, the split for the amounts).

Usage: ``python scripts/profile_step.py [--batch 8 32] [--sampling greedy random]
[--rounds 5] [--json]``. Prints a table per setting; ``--json``: the figures as the last
line, a JSON object (bench/test_step_overhead_bench.py reads it).
"""

from __future__ import annotations

import paged_engine  # noqa: F401  (first: OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import cProfile
import functools
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench.models, when run as a script
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.models import MODELS  # noqa: E402
from paged_engine.engine import progress as progress_module  # noqa: E402
from paged_engine.layers.attention import base as attention_base  # noqa: E402
from paged_engine.worker import model_runner as runner_module  # noqa: E402
from paged_engine.worker import sampling_step  # noqa: E402

CATEGORIES = ("model", "inputs", "sampling", "scheduler", "output", "progress", "glue", "other")
BLOCK_SIZE = 16


class Clock:
    """Exclusive time per category over wrapped calls (see the module)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.mark = 0.0
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        clock, now = self, time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = now()
            stack = clock.stack
            if stack:
                clock.acc[stack[-1]] += t - clock.mark
            stack.append(category)
            clock.mark = t
            try:
                return fn(*args, **kwargs)
            finally:
                t = now()
                clock.acc[stack.pop()] += t - clock.mark
                clock.mark = t

        return timed


class Patches:
    """Attributes set on objects, modules and classes, put back by ``undo``."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        self._saved.append((owner, name, vars(owner).get(name) if had else None, had))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, old, had in reversed(self._saved):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._saved.clear()


class StepLog:
    """Step boundaries (``_step`` entries) with the clock's totals there, and what each
    step scheduled."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.marks: list[tuple[float, dict[str, float]]] = []
        self.kinds: list[tuple[bool, int] | None] = []

    def boundary(self) -> None:
        self.marks.append((time.perf_counter(), dict(self.clock.acc)))
        self.kinds.append(None)

    def scheduled(self, is_prefill: bool, n: int) -> None:
        self.kinds[-1] = (is_prefill, n)

    def steady_indices(self, batch: int) -> list[int]:
        """The kept steps (see the module): decode steps of the whole batch between two
        others."""
        kinds, want = self.kinds, (False, batch)
        return [
            i
            for i in range(1, len(self.marks) - 1)
            if kinds[i - 1] == want and kinds[i] == want and kinds[i + 1] == want
        ]

    def steady(self, batch: int) -> list[dict[str, float]]:
        """Each kept step's wall time (``wall``) and category times, in seconds."""
        out = []
        for i in self.steady_indices(batch):
            (t0, a0), (t1, a1) = self.marks[i], self.marks[i + 1]
            step = {k: a1.get(k, 0.0) - a0.get(k, 0.0) for k in a1}
            step["wall"] = t1 - t0
            out.append(step)
        return out


def instrument(llm: Any, clock: Clock, log: StepLog, patches: Patches, fine: bool) -> None:
    """Wrap the step's methods (``fine``: every category; else only what the step log
    needs)."""
    engine, runner = llm.llm_engine, llm.model_runner
    step = engine._step if not fine else clock.wrap(engine._step, "glue")

    def step_entry(*args: Any, **kwargs: Any) -> Any:
        log.boundary()  # outside the clock's wrapper: the step's wall time starts here
        return step(*args, **kwargs)

    schedule = engine.scheduler.schedule

    def schedule_logged() -> Any:
        seqs, is_prefill = schedule()
        log.scheduled(is_prefill, len(seqs))
        return seqs, is_prefill

    if not fine:
        patches.set(engine, "_step", step_entry)
        patches.set(engine.scheduler, "schedule", schedule_logged)
        return
    patches.set(engine, "_step", step_entry)
    patches.set(engine.scheduler, "schedule", clock.wrap(schedule_logged, "scheduler"))
    for name in ("postprocess", "recover", "is_finished"):
        patches.set(
            engine.scheduler, name, clock.wrap(getattr(engine.scheduler, name), "scheduler")
        )
    out = engine.output_processor
    for name in (
        "store_logprobs",
        "stage_step",
        "record_committed",
        "detokenize_pending",
        "collect_outputs",
    ):
        patches.set(out, name, clock.wrap(getattr(out, name), f"output/{name}"))
    patches.set(runner, "run", clock.wrap(runner.run, "sampling/generators"))
    patches.set(runner, "_forward", clock.wrap(runner._forward, "glue"))
    patches.set(runner, "prepare", clock.wrap(runner.prepare, "inputs/BatchBuilder.build"))
    host = attention_base.HostMetadata
    patches.set(host, "build", staticmethod(clock.wrap(host.build, "inputs/HostMetadata.build")))
    patches.set(host, "on_device", clock.wrap(host.on_device, "inputs/HostMetadata.on_device"))
    staging = runner.batch_builder.staging
    patches.set(staging, "stage", clock.wrap(staging.stage, "inputs/HostStaging.stage"))
    patches.set(runner, "_model_forward", clock.wrap(runner._model_forward, "model/forward"))
    backend = runner.backend
    patches.set(backend, "attend", clock.wrap(backend.attend, "model/attention"))
    patches.set(backend, "store_kv", clock.wrap(backend.store_kv, "model/store_kv"))
    wrapped_logits = clock.wrap(runner_module.step_logits, "model/lm_head")
    patches.set(runner_module, "step_logits", wrapped_logits)
    wrapped_results = clock.wrap(runner_module.step_results, "sampling/step_results")
    patches.set(runner_module, "step_results", wrapped_results)
    patches.set(runner, "sampler", clock.wrap(runner.sampler, "sampling/Sampler"))
    wrapped_lp = clock.wrap(sampling_step.sampled_logprobs, "sampling/sampled_logprobs")
    patches.set(sampling_step, "sampled_logprobs", wrapped_lp)
    progress = progress_module.Progress
    patches.set(progress, "update", clock.wrap(progress.update, "progress"))


def requests(batch: int, prompt: int, max_tokens: int, sampling: str, vocab: int, seed: int):
    from paged_engine import SamplingParams

    rng = random.Random(seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt)]} for _ in range(batch)
    ]
    if sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    return prompts, params


def make_llm(model_dir: Path, batch: int, prompt: int, max_tokens: int, dtype: str) -> Any:
    from paged_engine import LLM

    per_seq = -(-(prompt + max_tokens) // BLOCK_SIZE) + 1
    return LLM(
        model_dir,
        attention_backend="cpu",
        dtype=dtype,
        num_threads=1,
        kvcache_block_size=BLOCK_SIZE,
        max_model_len=prompt + max_tokens + BLOCK_SIZE,
        num_kvcache_blocks=batch * per_seq + 4,
        max_num_seqs=max(batch, 8),
    )


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Microseconds per step per category and detail (median, min) and their shares of the
    wall time; ``outside_model``: the fraction of each step outside ``model``."""
    details = sorted({k for s in steps for k in s if k != "wall"})
    rows: dict[str, list[float]] = {"wall": [s["wall"] for s in steps]}
    for cat in CATEGORIES:
        if cat == "other":
            continue
        rows[cat] = [sum(v for k, v in s.items() if k.split("/")[0] == cat) for s in steps]
    rows["other"] = [
        s["wall"] - sum(rows[c][i] for c in CATEGORIES[:-1]) for i, s in enumerate(steps)
    ]
    for d in details:
        if "/" in d:
            rows[d] = [s.get(d, 0.0) for s in steps]
    wall_median = statistics.median(rows["wall"])
    table = {
        name: {
            "us_median": round(statistics.median(v) * 1e6, 1),
            "us_min": round(min(v) * 1e6, 1),
            "share_median": round(statistics.median(v) / wall_median, 4),
        }
        for name, v in rows.items()
    }
    outside = [1 - m / s["wall"] for m, s in zip(rows["model"], steps, strict=True)]
    return {
        "steps": len(steps),
        "table": table,
        "outside_model_median": round(statistics.median(outside), 4),
        "outside_model_min": round(min(outside), 4),
    }


def run_split(llm: Any, batch: int, prompts: Any, params: Any, rounds: int, tqdm: bool):
    clock, patches = Clock(), Patches()
    log = StepLog(clock)
    instrument(llm, clock, log, patches, fine=True)
    try:
        llm.generate(prompts, params, use_tqdm=tqdm)  # warm-up round, not kept
        steps: list[dict[str, float]] = []
        for _ in range(rounds):
            log.marks.clear()
            log.kinds.clear()
            llm.generate(prompts, params, use_tqdm=tqdm)
            log.boundary()  # closes the last step
            steps += log.steady(batch)
    finally:
        patches.undo()
    return summarize(steps)


def run_cprofile(llm: Any, batch: int, prompts: Any, params: Any, rounds: int, tqdm: bool):
    """cProfile over the kept steps, off during the model forward (see the module): one
    profile per step, those of the kept steps added together."""
    clock, patches = Clock(), Patches()
    log = StepLog(clock)
    instrument(llm, clock, log, patches, fine=False)
    engine, runner = llm.llm_engine, llm.model_runner
    step = engine._step
    current: list[cProfile.Profile] = []  # this step's profile, while one runs
    profiles: list[cProfile.Profile] = []  # one per step of the round, as log.kinds

    def stop() -> None:
        if current:
            current.pop().disable()

    def step_profiled(*args: Any, **kwargs: Any) -> Any:
        stop()
        prof = cProfile.Profile()
        profiles.append(prof)
        current.append(prof)
        prof.enable()
        return step(*args, **kwargs)

    def paused(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            prof = current[0] if current else None
            if prof is None:
                return fn(*args, **kwargs)
            prof.disable()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.enable()

        return call

    patches.set(engine, "_step", step_profiled)
    patches.set(runner, "_model_forward", paused(runner._model_forward))
    patches.set(runner_module, "step_logits", paused(runner_module.step_logits))
    total: pstats.Stats | None = None
    kept = 0
    try:
        for r in range(rounds + 1):  # round 0 warms up
            log.marks.clear()
            log.kinds.clear()
            profiles.clear()
            llm.generate(prompts, params, use_tqdm=tqdm)
            stop()
            log.boundary()
            if r == 0:
                continue
            for i in log.steady_indices(batch):
                kept += 1
                if total is None:
                    total = pstats.Stats(profiles[i])
                else:
                    total.add(profiles[i])
    finally:
        stop()
        patches.undo()
    assert total is not None, "no steady decode step"
    return top_functions(total, kept)


def top_functions(stats: pstats.Stats, steps: int, n: int = 30) -> list[dict[str, Any]]:
    """The profile's functions by own time: ``file:line(function)``, own and cumulative
    microseconds per step, calls per step."""
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = file.replace(str(ROOT) + "/", "").replace(sys.prefix + "/", "")
        rows.append(
            {
                "function": f"{where}:{line}({func})",
                "own_us_per_step": round(tt / steps * 1e6, 1),
                "cum_us_per_step": round(ct / steps * 1e6, 1),
                "calls_per_step": round(nc / steps, 1),
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:n]


def print_split(name: str, s: dict[str, Any]) -> None:
    t = s["table"]
    print(
        f"\n== split {name}: {s['steps']} steps; wall {t['wall']['us_median']:.0f} us median, "
        f"{t['wall']['us_min']:.0f} min; outside the model {s['outside_model_median']:.1%} "
        f"median ({s['outside_model_min']:.1%} min)"
    )
    for key, row in t.items():
        if key == "wall":
            continue
        indent = "    " if "/" in key else "  "
        print(
            f"{indent}{key:<40} {row['us_median']:>9.1f} us median {row['us_min']:>9.1f} min"
            f" {row['share_median']:>7.1%}"
        )


def print_profile(name: str, rows: list[dict[str, Any]], n: int = 20) -> None:
    print(f"\n== cProfile {name} (outside the model; us per step under the profiler)")
    print(f"  {'own':>8} {'cum':>8} {'calls':>6}  function")
    for r in rows[:n]:
        print(
            f"  {r['own_us_per_step']:>8.1f} {r['cum_us_per_step']:>8.1f} "
            f"{r['calls_per_step']:>6.1f}  {r['function']}"
        )


@contextmanager
def model_dir(path: str | None) -> Iterator[Path]:
    from paged_engine.utils.tiny_model import make_tiny_model

    if path is not None:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        yield make_tiny_model(Path(tmp) / "qwen3-29m", seed=0, **MODELS["qwen3-29m"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sampling", nargs="+", default=["greedy"], choices=["greedy", "random"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-tqdm", action="store_true", help="generate's progress bar off")
    parser.add_argument("--no-cprofile", action="store_true")
    parser.add_argument("--model", help="an existing model directory (default: the 29M model)")
    parser.add_argument("--json", action="store_true", help="the figures as the last line")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "torch_threads": None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "settings": {},
    }
    with model_dir(args.model) as path:
        for batch in args.batch:
            llm = make_llm(path, batch, args.prompt, args.max_tokens, args.dtype)
            result["torch_threads"] = torch.get_num_threads()
            vocab = int(llm.model_runner.hf_config.vocab_size)
            for sampling in args.sampling:
                name = f"{args.dtype} batch {batch} {sampling}"
                prompts, params = requests(batch, args.prompt, args.max_tokens, sampling, vocab, 0)
                tqdm = not args.no_tqdm
                split = run_split(llm, batch, prompts, params, args.rounds, tqdm)
                print_split(name, split)
                entry: dict[str, Any] = {"batch": batch, "sampling": sampling, "split": split}
                if not args.no_cprofile:
                    rows = run_cprofile(llm, batch, prompts, params, args.rounds, tqdm)
                    print_profile(name, rows)
                    entry["cprofile"] = rows
                result["settings"][name] = entry
            llm.close()
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
