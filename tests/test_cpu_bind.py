"""CPU binding (``paged_engine/cpu_bind.py``): ``cpu_bind`` / ``$PAGED_ENGINE_CPU_BIND``
parsed and refused by name before anything starts, the CPUs "auto" gives N ranks on M
CPUs, the lists a server's replicas get, and real processes whose every thread
(``/proc/PID/task/*/status``) runs where it was asked: the OpenMP pool's threads too.

What binds the pytest process itself is run in a spawned interpreter: a bound process
stays bound, and the next test would run on one CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import paged_engine.cpu_bind as cpu_bind
import paged_engine.platform as platform
import paged_engine.worker.model_runner as model_runner
from paged_engine import LLM, EngineConfig
from paged_engine.__main__ import main as cli
from paged_engine.cpu_bind import (
    CpuBind,
    check_cpu_bind,
    parse_cpu_bind,
    plan_auto,
    replica_kwargs,
    replica_spec,
    serve_cpu_bind,
    thread_core_cpu_bind,
    thread_cpus,
)
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.platform import physical_cores

ROOT = Path(__file__).resolve().parent.parent
CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs this process may use")


@pytest.fixture(autouse=True)
def no_bind_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults as a user without either variable gets them."""
    monkeypatch.delenv(cpu_bind.ENV, raising=False)
    monkeypatch.delenv(cpu_bind.VLLM_ENV, raising=False)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``machine(cpus, siblings)``: this process may use ``cpus``; ``siblings`` maps a CPU
    to its core's ``core_cpus_list`` (default: every CPU a core of its own)."""

    def set_machine(cpus: set[int], siblings: dict[int, str] | None = None) -> None:
        monkeypatch.setattr(cpu_bind, "allowed_cpus", lambda: frozenset(cpus))
        monkeypatch.setattr(platform, "_sys_cpu_file", lambda cpu, name: (siblings or {}).get(cpu))

    return set_machine


# ---- the values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("auto", CpuBind("auto")),
        (" AUTO ", CpuBind("auto")),
        ("off", CpuBind("off")),
        ("nobind", CpuBind("off")),  # vLLM's
        ("all", CpuBind("off")),  # vLLM's older spelling
        ("1", CpuBind("lists", ((1,),))),
        ("0-3", CpuBind("lists", ((0, 1, 2, 3),))),
        ("2,0", CpuBind("lists", ((0, 2),))),
        ("0-1,4|2-3, 5", CpuBind("lists", ((0, 1, 4), (2, 3, 5)))),
    ],
)
def test_the_values_parse(value: str, parsed: CpuBind) -> None:
    assert parse_cpu_bind(value) == parsed


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "empty"),
        ("zero", "'zero' is not a CPU number or a range N-M"),
        ("1.5", "'1.5' is not a CPU number"),
        ("-1", "'-1' is not a CPU number"),
        ("0|", "'' is not a CPU number"),
        ("3-1", "the range '3-1' runs backwards"),
        ("0,1,0", "'0,1,0' names a CPU twice"),
        ("0-2|2-3", "CPU 2 is in two ranks' lists"),
        (3, "not a string"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field_and_the_value(value: object, why: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(cpu_bind=value)  # type: ignore[arg-type]
    assert f"cpu_bind={value!r}: {why}" in str(e.value)


def test_the_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig().cpu_bind == cpu_bind.DEFAULT
    monkeypatch.setenv(cpu_bind.VLLM_ENV, "0")
    assert EngineConfig().cpu_bind == "0"  # vLLM's variable, when ours is unset
    monkeypatch.setenv(cpu_bind.ENV, "auto")
    assert EngineConfig().cpu_bind == "auto"
    assert EngineConfig(cpu_bind="off").cpu_bind == "off"  # the field wins
    monkeypatch.setenv(cpu_bind.ENV, "0-")
    with pytest.raises(ValueError, match=r"\$PAGED_ENGINE_CPU_BIND='0-' \(cpu_bind's default\)"):
        EngineConfig()


# ---- the CPUs chosen -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "slots", "threads", "plan"),
    [
        ({0, 1}, 1, 1, ((1,),)),  # 2 cores, 1 thread: CPU 0 stays free (the API's)
        ({0, 1}, 2, 1, ((0,), (1,))),
        ({0, 1}, 1, 2, ((0, 1),)),
        ({0, 1}, 3, 1, None),  # too few cores: not bound
        ({0, 1}, 2, 2, None),
        (set(range(8)), 2, 3, ((2, 3, 4), (5, 6, 7))),
        (set(range(8)), 4, 2, ((0, 1), (2, 3), (4, 5), (6, 7))),
        ({2, 5, 7, 9}, 2, 1, ((7,), (9,))),  # a taskset's CPUs, not 0..n-1
    ],
)
def test_auto_gives_each_rank_its_own_last_cores(
    machine: Any, cpus: set[int], slots: int, threads: int, plan: Any
) -> None:
    machine(cpus)
    assert plan_auto(cpus, slots, threads) == plan


def test_auto_takes_one_cpu_per_physical_core(machine: Any) -> None:
    siblings = {0: "0,4", 4: "0,4", 1: "1,5", 5: "1,5", 2: "2,6", 6: "2,6", 3: "3,7", 7: "3,7"}
    machine(set(siblings), siblings)
    assert plan_auto(set(siblings), 1, 3) == ((1, 2, 3),)  # never 5, 6, 7: siblings
    assert plan_auto(set(siblings), 2, 2) == ((0, 1), (2, 3))
    assert plan_auto(set(siblings), 1, 5) is None  # 8 CPUs, 4 cores


def test_auto_plans_are_disjoint_and_sized(machine: Any) -> None:
    for m in range(1, 9):
        machine(set(range(m)))
        for slots in range(1, 5):
            for threads in range(1, 4):
                plan = plan_auto(set(range(m)), slots, threads)
                if slots * threads > m:
                    assert plan is None
                    continue
                assert plan is not None and len(plan) == slots
                assert all(len(p) == threads for p in plan)
                flat = [c for p in plan for c in p]
                assert len(set(flat)) == len(flat) and set(flat) <= set(range(m))
                assert max(flat) == m - 1  # the last CPUs: the first stay free


def test_lists_are_checked_against_the_ranks_and_the_machine() -> None:
    assert check_cpu_bind("0|1", 2, cpus={0, 1}).lists == ((0,), (1,))
    with pytest.raises(ValueError, match=r"cpu_bind='0\|1': 2 CPU list\(s\) for 1 rank"):
        check_cpu_bind("0|1", 1, cpus={0, 1})
    with pytest.raises(ValueError, match=r"cpu_bind='0': 1 CPU list\(s\) for 2 rank"):
        check_cpu_bind("0", 2, cpus={0, 1})
    with pytest.raises(ValueError, match=r"cpu_bind='1-2': CPU 2 is not one this process"):
        check_cpu_bind("1-2", 1, cpus={0, 1})


@pytest.mark.parametrize(
    ("value", "cpus", "replicas", "tp", "threads", "expected"),
    [
        ("auto", 2, 1, 1, 1, "1"),  # the engine on CPU 1, the API process keeps CPU 0
        ("auto", 4, 1, 1, 3, "1,2,3"),
        ("auto", 2, 2, 1, 1, "0|1"),  # two replicas: all cores taken, none left over
        ("auto", 8, 2, 2, 4, "0,1|2,3|4,5|6,7"),  # 4 threads asked, 2 cores each
        ("auto", 2, 3, 1, 1, "off"),  # more replicas than cores: shared, unbound
        ("off", 2, 2, 1, 1, "off"),
        ("1|0", 2, 2, 1, 1, "1|0"),
    ],
)
def test_a_server_plans_every_local_replica(
    machine: Any, value: str, cpus: int, replicas: int, tp: int, threads: int, expected: str
) -> None:
    machine(set(range(cpus)))
    assert serve_cpu_bind(value, replicas, tp, threads) == expected


def test_a_server_refuses_lists_that_miss_a_replica(machine: Any) -> None:
    machine({0, 1})
    with pytest.raises(ValueError, match=r"1 CPU list.* for 2 rank.*2 local data-parallel"):
        serve_cpu_bind("0", 2, 1, 1)


def test_each_replica_gets_its_own_lists() -> None:
    kwargs = {"cpu_bind": "0|1|2|3", "tensor_parallel_size": 2, "seed": 1}
    assert replica_kwargs(kwargs, 0) == {**kwargs, "cpu_bind": "0|1"}
    assert replica_kwargs(kwargs, 1) == {**kwargs, "cpu_bind": "2|3"}
    with pytest.raises(ValueError, match="do not reach data-parallel replica 2"):
        replica_kwargs(kwargs, 2)
    assert replica_kwargs({"cpu_bind": "off"}, 3) == {"cpu_bind": "off"}
    spec = CoreSpec("m", {"cpu_bind": "4|5"})
    assert replica_spec(spec, 1) == CoreSpec("m", {"cpu_bind": "5"})
    assert spec.llm_kwargs == {"cpu_bind": "4|5"}  # the shared spec is left alone


def test_a_server_with_the_engine_in_its_process_binds_only_when_told() -> None:
    assert thread_core_cpu_bind("auto") == "off"  # it would confine the API too
    assert thread_core_cpu_bind("1") == "1"
    assert thread_core_cpu_bind(None) == cpu_bind.DEFAULT


# ---- refused before anything starts --------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the bad cpu_bind was refused")

    monkeypatch.setattr(model_runner, "load_model", forbidden)


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"cpu_bind": "0|1"}, None, r"cpu_bind='0\|1': 2 CPU list\(s\) for 1 rank"),
        ({"cpu_bind": "100000"}, None, "cpu_bind='100000': CPU 100000 is not one this"),
        ({"cpu_bind": "0-"}, None, "cpu_bind='0-': '0-' is not a CPU number"),
        ({}, "cores", r"\$PAGED_ENGINE_CPU_BIND='cores' \(cpu_bind's default\)"),
    ],
)
def test_llm_refuses_before_anything_changes(
    tiny_model_dir: Path,
    no_model: None,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    env: str | None,
    message: str,
) -> None:
    import torch

    if env is not None:
        monkeypatch.setenv(cpu_bind.ENV, env)
    before, threads = thread_cpus(), torch.get_num_threads()
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir, **kwargs)
    assert torch.get_num_threads() == threads
    assert all(thread_cpus().get(t, cpus) == cpus for t, cpus in before.items())


def test_the_cli_refuses_a_bad_cpu_bind_by_its_flag(
    no_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", "/nonexistent/model", "--prompt", "hi", "--cpu-bind", "x"]
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    assert exit_info.value.code == 2
    assert "--cpu-bind='x': 'x' is not a CPU number" in capsys.readouterr().err


# ---- real processes ------------------------------------------------------------------------


def run_child(code: str, env: dict[str, str] | None = None) -> Any:
    """``code`` in a fresh interpreter; the JSON it prints last."""
    full = {k: v for k, v in os.environ.items() if k not in (cpu_bind.ENV, cpu_bind.VLLM_ENV)}
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**full, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


POOL = """
import json, os, torch
from paged_engine.cpu_bind import bind_process, thread_cpus
torch.set_num_threads(2)  # OpenMP starts its pool: 2 threads, 1 of them new
x = torch.randn(1000, 1000)
for _ in range(3):
    x @ x
tasks = len(os.listdir("/proc/self/task"))
{bind}
x @ x
print(json.dumps({{"tasks": tasks, "cpus": [sorted(c) for c in thread_cpus().values()]}}))
"""


@two_cpus
def test_binding_moves_the_threads_openmp_already_started() -> None:
    last = CPUS[-1]
    naive = run_child(POOL.format(bind=f"os.sched_setaffinity(0, {{{last}}})"))
    assert naive["tasks"] > 1  # the pool existed before the binding
    # why every thread: the calling thread's affinity leaves the pool's where it was
    assert [last] in naive["cpus"] and any(c != [last] for c in naive["cpus"])
    bound = run_child(POOL.format(bind=f"bind_process({{{last}}})"))
    assert bound["tasks"] > 1
    assert bound["cpus"] == [[last]] * len(bound["cpus"])


@two_cpus
def test_a_bound_process_plans_from_the_cpus_it_had() -> None:
    got = run_child(
        "import json, os\n"
        "from paged_engine.platform import allowed_cpus, usable_physical_cores\n"
        "from paged_engine.cpu_bind import bind_process\n"
        "before = (sorted(allowed_cpus()), usable_physical_cores())\n"
        f"bind_process({{{CPUS[-1]}}})\n"
        "during = (sorted(allowed_cpus()), usable_physical_cores())\n"
        f"os.sched_setaffinity(0, {{{CPUS[0]}}})  # someone else's choice: believed\n"
        "print(json.dumps([before, during, sorted(allowed_cpus())]))\n"
    )
    assert got[0] == got[1] and got[0][0] == CPUS
    assert got[2] == [CPUS[0]]


ENGINE = """
import json, torch
from paged_engine import LLM, SamplingParams
from paged_engine.cpu_bind import thread_cpus
if __name__ == "__main__":
    llm = LLM({model!r}, num_kvcache_blocks=32, max_model_len=64, {kwargs})
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    pids = llm.model_runner.workers.pids if llm.model_runner.workers else []
    cpus = [sorted(set().union(*thread_cpus(p).values())) for p in ["self", *pids]]
    print(json.dumps({{"cpus": cpus, "threads": torch.get_num_threads()}}))
    llm.close()
"""


@two_cpus
@pytest.mark.parametrize("value", ["auto", str(CPUS[0])])
def test_an_engine_process_runs_where_the_variable_says(tiny_model_dir: Path, value: str) -> None:
    code = ENGINE.format(model=str(tiny_model_dir), kwargs="num_threads=1")
    got = run_child(code, {cpu_bind.ENV: value})
    last = physical_cores(CPUS)[-1][0]  # auto: the last core, CPU 1 of 2
    assert got == {"cpus": [[last] if value == "auto" else [CPUS[0]]], "threads": 1}
    assert run_child(code, {cpu_bind.ENV: "off"})["cpus"] == [CPUS]


@two_cpus
def test_the_llm_argument_binds_too(tiny_model_dir: Path) -> None:
    """Needs ``ModelRunner`` to pass ``config.cpu_bind`` to ``set_cpu_threads``."""
    code = ENGINE.format(model=str(tiny_model_dir), kwargs=f"cpu_bind='{CPUS[0]}'")
    assert run_child(code, {cpu_bind.ENV: "off"})["cpus"] == [[CPUS[0]]]


@two_cpus
@pytest.mark.parametrize("value", ["auto", f"{CPUS[1]}|{CPUS[0]}"])
def test_tensor_parallel_ranks_get_cpus_of_their_own(tiny_model_dir: Path, value: str) -> None:
    code = ENGINE.format(model=str(tiny_model_dir), kwargs="num_threads=1, tensor_parallel_size=2")
    got = run_child(code, {cpu_bind.ENV: value})
    auto = [[core[0]] for core in physical_cores(CPUS)[-2:]]  # the last two cores
    expected = auto if value == "auto" else [[CPUS[1]], [CPUS[0]]]
    assert got == {"cpus": expected, "threads": 1}
