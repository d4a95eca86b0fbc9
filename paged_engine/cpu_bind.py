"""Which CPUs the process that runs the model may use: ``cpu_bind`` (``LLM``'s,
``EngineArgs``', ``--cpu-bind``), by default ``$PAGED_ENGINE_CPU_BIND`` (else vLLM's
``$VLLM_CPU_OMP_THREADS_BIND``, same syntax), else ``DEFAULT``.

Why it exists: vLLM's CPU build binds its workers' threads, so that none migrates or
shares a core with another rank or with the API process; "auto" places them the same
way. Why off by default: on a 2-vCPU machine binding won only with two
tensor-parallel ranks under a competing process per CPU, and lost otherwise (one pinned
thread can only share its CPU with a competitor; unpinned it takes its fair share of
both): ``bench/test_cpu_bind_bench.py``, figures in the README ("CPU binding").

The values (vLLM's syntax):

* ``"auto"``: where the model runs on the CPU, each rank gets ``threads`` CPUs of its
  own, one per physical core (the first of its SMT siblings), taken from the last of
  the CPUs this process may use, so that the first ones stay free: with a server's
  engine in a process of its own on 2 cores and 1 thread, the engine is on CPU 1 and
  the API process keeps CPU 0. Fewer cores than the ranks' threads: nothing is bound
  (logged), as binding them to shared cores would serialize them.
* ``"off"`` (also vLLM's ``"nobind"`` and its older ``"all"``): nothing is bound.
* CPU lists, one per tensor-parallel rank, separated by ``|``: ``"0-3"``, ``"0,2"``,
  ``"0-3|4-7"``. A rank gets one torch thread per listed CPU. With data parallelism
  (``serve --data-parallel-size``) the lists are replica-major: replica ``r``'s ranks
  take lists ``r * tp`` to ``r * tp + tp - 1``. The lists may not overlap.

Binding sets the affinity of every thread of the process (``/proc/self/task``), not just
of the calling one: threads that exist (torch's OpenMP pool, started when torch first ran
a parallel region) keep their own affinity otherwise, and threads created later inherit
their creator's. The threads of a rank share its CPU set; none is pinned to one CPU.
A process bound stays bound (``LLM.close()`` does not undo it); a later ``LLM`` in it
plans from the CPUs the process had before (``platform.allowed_cpus``).

Torch-free: ``config.py`` checks the syntax here; the binding itself runs in the model's
process (``worker/devices.set_cpu_threads``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from paged_engine.platform import allowed_cpus, physical_cores, record_binding

logger = logging.getLogger("paged_engine")

ENV = "PAGED_ENGINE_CPU_BIND"
VLLM_ENV = "VLLM_CPU_OMP_THREADS_BIND"
DEFAULT = "off"
"""The setting when neither variable is set (why: the module docstring)."""
OFF = ("off", "nobind", "all")
BIND_PASSES = 8
"""``bind_process``: how often it looks again for threads started while it bound."""
USAGE = "use 'auto', 'off', or CPU lists such as '0-3' or '0-3|4-7' (one per rank)"


@dataclass(frozen=True, slots=True)
class CpuBind:
    """A parsed ``cpu_bind``: ``mode`` "auto", "off" or "lists" (then ``lists``)."""

    mode: str
    lists: tuple[tuple[int, ...], ...] = ()


def default_cpu_bind() -> str:
    """``$PAGED_ENGINE_CPU_BIND``, else ``$VLLM_CPU_OMP_THREADS_BIND``, else ``DEFAULT``."""
    for name in (ENV, VLLM_ENV):
        value = os.environ.get(name)
        if value is not None and value.strip():
            return value
    return DEFAULT


def _source(value: object) -> str:
    """How an error names the setting: the field, and the variable it came from."""
    for name in (ENV, VLLM_ENV):
        if value == os.environ.get(name):
            return f"${name}={value!r} (cpu_bind's default)"
    return f"cpu_bind={value!r}"


def _cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` as (0, 1, 2, 3, 6); ValueError saying what is wrong."""
    cpus: list[int] = []
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
            raise ValueError(f"{item.strip()!r} is not a CPU number or a range N-M")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"the range {item.strip()!r} runs backwards")
        cpus += range(lo, hi + 1)
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{text.strip()!r} names a CPU twice")
    return tuple(sorted(cpus))


def parse_cpu_bind(value: object) -> CpuBind:
    """``value`` parsed; ValueError naming the setting (and the variable it came from),
    the value and what is wrong. Lists that share a CPU are refused: ranks bound to
    the same core wait for each other."""
    if not isinstance(value, str) or not value.strip():
        what = "empty" if isinstance(value, str) else "not a string"
        raise ValueError(f"{_source(value)}: {what}; {USAGE}")
    word = value.strip().lower()
    if word == "auto":
        return CpuBind("auto")
    if word in OFF:
        return CpuBind("off")
    try:
        lists = tuple(_cpu_list(part) for part in value.split("|"))
    except ValueError as err:
        raise ValueError(f"{_source(value)}: {err}; {USAGE}") from None
    seen: set[int] = set()
    for cpus in lists:
        if seen & set(cpus):
            shared = ",".join(map(str, sorted(seen & set(cpus))))
            raise ValueError(f"{_source(value)}: CPU {shared} is in two ranks' lists")
        seen |= set(cpus)
    return CpuBind("lists", lists)


def format_cpu_lists(lists: Collection[Collection[int]]) -> str:
    """Lists as ``cpu_bind`` spells them: ``((1,), (2, 3))`` is ``"1|2,3"``."""
    return "|".join(",".join(map(str, sorted(cpus))) for cpus in lists)


def check_cpu_bind(
    value: object,
    ranks: int,
    cpus: Collection[int] | None = None,
    ranks_are: str = "tensor_parallel_size",
) -> CpuBind:
    """``value`` parsed and checked for ``ranks`` ranks (``ranks_are`` says what makes
    them, for the error) on this machine (``cpus``: ``platform.allowed_cpus()``): one
    list per rank, each CPU one this process may use. ``EngineArgs.create_engine_config``
    calls it, before anything starts; ValueError naming the setting and the value."""
    bind = parse_cpu_bind(value)
    if bind.mode != "lists":
        return bind
    if len(bind.lists) != ranks:
        raise ValueError(
            f"{_source(value)}: {len(bind.lists)} CPU list(s) for {ranks} rank(s) "
            f"({ranks_are}): give one per rank, separated by '|'"
        )
    allowed = allowed_cpus() if cpus is None else frozenset(cpus)
    missing = sorted({c for cpus_ in bind.lists for c in cpus_} - allowed)
    if missing:
        raise ValueError(
            f"{_source(value)}: CPU {','.join(map(str, missing))} is not one this process "
            f"may run on ({format_cpu_lists([allowed])})"
        )
    return bind


def plan_auto(
    cpus: Collection[int], slots: int, threads: int
) -> tuple[tuple[int, ...], ...] | None:
    """``"auto"``'s CPUs for ``slots`` ranks (or replicas' ranks) of ``threads`` threads
    each, from ``cpus``: one CPU per physical core, the last cores, slot 0 lowest.
    None when there are fewer cores than ``slots * threads``."""
    firsts = [core[0] for core in physical_cores(cpus)]
    need = slots * threads
    if need < 1 or len(firsts) < need:
        return None
    chosen = firsts[len(firsts) - need :]
    return tuple(tuple(chosen[i * threads : (i + 1) * threads]) for i in range(slots))


def rank_plan(value: object, ranks: int, threads: int) -> tuple[tuple[int, ...], ...] | None:
    """The CPUs of each of ``ranks`` ranks (``threads`` each under "auto"), or None: not
    bound ("off", or too few cores for "auto", logged)."""
    bind = parse_cpu_bind(value)
    if bind.mode == "off":
        return None
    if bind.mode == "lists":
        if len(bind.lists) != ranks:
            raise ValueError(f"{_source(value)}: {len(bind.lists)} CPU list(s) for {ranks} rank(s)")
        return bind.lists
    cpus = allowed_cpus()
    plan = plan_auto(cpus, ranks, threads)
    if plan is None:
        logger.info(
            "cpu_bind auto: %d rank(s) x %d thread(s) need as many physical cores, this "
            "process may use %d: not bound",
            ranks,
            threads,
            len(physical_cores(cpus)),
        )
    return plan


def serve_cpu_bind(value: object, replicas: int, tp: int, threads: int) -> str:
    """The ``cpu_bind`` a server's engine cores get (what ``replica_spec`` slices), planned
    here in the API process, which binds nothing itself: explicit replica-major lists,
    or "off". Each rank's threads are ``threads`` at most, and no more than its share of
    the cores (replicas x ranks share the machine). ValueError naming the setting."""
    slots = replicas * tp
    what = f"{replicas} local data-parallel replica(s) x tensor_parallel_size {tp}"
    bind = check_cpu_bind(value, slots, ranks_are=what)
    if bind.mode == "lists":
        return format_cpu_lists(bind.lists)
    if bind.mode == "off":
        return "off"
    cpus = allowed_cpus()
    share = max(1, min(threads, len(physical_cores(cpus)) // slots))
    plan = rank_plan("auto", slots, share)
    return "off" if plan is None else format_cpu_lists(plan)


def thread_core_cpu_bind(value: str | None) -> str:
    """``cpu_bind`` for ``serve --engine-core thread``, where the API shares the engine's
    process: "auto" is "off" there, as binding the process would confine the API to the
    engine's cores; an explicit value stands."""
    value = default_cpu_bind() if value is None else value
    return "off" if parse_cpu_bind(value).mode == "auto" else value


def replica_kwargs(kwargs: Mapping[str, Any], replica: int) -> dict[str, Any]:
    """``LLM`` keywords for data-parallel replica ``replica`` of a server: ``cpu_bind``'s
    lists narrowed to its own ranks' (``tensor_parallel_size`` of them); other values
    unchanged. ValueError when the lists do not reach that replica."""
    value = kwargs.get("cpu_bind")
    if value is None or parse_cpu_bind(value).mode != "lists":
        return dict(kwargs)
    lists = parse_cpu_bind(value).lists
    tp = int(kwargs.get("tensor_parallel_size") or 1)
    part = lists[replica * tp : (replica + 1) * tp]
    if len(part) != tp:
        raise ValueError(
            f"{_source(value)}: {len(lists)} CPU list(s) do not reach data-parallel replica "
            f"{replica} of {tp} rank(s): give one list per replica and rank"
        )
    return {**kwargs, "cpu_bind": format_cpu_lists(part)}


class _Spec(Protocol):  # a dataclass with ``llm_kwargs``: ``CoreSpec``
    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def llm_kwargs(self) -> dict[str, Any]: ...


S = TypeVar("S", bound=_Spec)
T = TypeVar("T")


def replica_spec(spec: S, replica: int) -> S:
    """A core's spec (``CoreSpec``) for data-parallel replica ``replica``
    (``replica_kwargs``): what spawns the replicas passes each its own."""
    return dataclasses.replace(spec, llm_kwargs=replica_kwargs(spec.llm_kwargs, replica))


def replica_specs(spec: S, devices: Sequence[T]) -> list[tuple[S, T]]:
    """Each local replica's spec (``replica_spec``) beside its devices, in order."""
    return [(replica_spec(spec, i), d) for i, d in enumerate(devices)]


def _task_ids() -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [0]


def bind_process(cpus: Collection[int]) -> None:
    """Every thread of this process onto ``cpus`` (see the module docstring), until no
    new thread appears (one started meanwhile by a thread not yet bound); threads
    created later inherit. OSError when the OS refuses (a CPU outside the cpuset)."""
    mask = frozenset(cpus)
    before = allowed_cpus()
    os.sched_setaffinity(0, mask)
    done: set[int] = set()
    for _ in range(BIND_PASSES):
        todo = [t for t in _task_ids() if t not in done]
        if not todo:
            break
        for tid in todo:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.sched_setaffinity(tid, mask)
            done.add(tid)
    record_binding(before, mask)


def thread_cpus(pid: int | str = "self") -> dict[int, frozenset[int]]:
    """Each thread of ``pid`` and the CPUs it may run on (``Cpus_allowed_list`` in
    /proc/PID/task/TID/status): what a test or a log reads to see a binding."""
    found: dict[int, frozenset[int]] = {}
    root = f"/proc/{pid}/task"
    for tid in os.listdir(root):
        with contextlib.suppress(OSError), open(f"{root}/{tid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    found[int(tid)] = frozenset(_cpu_list(line.split(":", 1)[1]))
    return found
