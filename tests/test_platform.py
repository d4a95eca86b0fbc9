"""The platform layer (``paged_engine/platform.py``, with ``platform_cpu.py`` and
``platform_cgroup.py``): its answers for this machine against
torch's own (``torch.backends``, ``torch.cpu.get_capabilities``, which reads CPUID through
the cpuinfo library, not /proc/cpuinfo) and the compiled kernels' (GCC's CPUID checks), and
its parsing of /proc and /sys files on fakes of each (the paths monkeypatched).

What the layer decides is tested where it is decided: packing (tests/test_linear_packing.py),
the bfloat16 path forced without AVX-512 (tests/test_e2e_bf16.py), kernel levels and
variants (tests/test_cpu_kernel*.py, tests/test_fused_ops.py), threads
(tests/test_cpu_defaults.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_engine import platform, platform_cgroup
from paged_engine.kernels import paged_decode_cpu

CAPS = torch.cpu.get_capabilities()
X86 = platform.cpu_info().architecture in ("x86_64", "AMD64")
only_x86 = pytest.mark.skipif(
    not X86, reason=f"x86-64 flags; this is {platform.cpu_info().architecture}"
)
TORCH_NAMES = {
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma3",
    "bmi1": "bmi",
    "bmi2": "bmi2",
    "f16c": "f16c",
    "abm": "lzcnt",
    "avx512f": "avx512_f",
    "avx512bw": "avx512_bw",
    "avx512cd": "avx512_cd",
    "avx512dq": "avx512_dq",
    "avx512vl": "avx512_vl",
    "avx512_bf16": "avx512_bf16",
}
"""/proc/cpuinfo's flag names and torch.cpu.get_capabilities()' names for the same bits.
Not AMX: a kernel before Linux 5.16 lists no amx flags where CPUID has them."""


# ---- this machine, against torch ------------------------------------------------------------


def test_torchs_answers_are_torchs() -> None:
    got = platform.torch_cpu()
    assert got.capability == torch.backends.cpu.get_cpu_capability()
    assert got.mkldnn == torch.backends.mkldnn.is_available()
    assert got.mkldnn_bf16 == (got.mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert got.onednn_linear == (got.mkldnn and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    assert platform.torch_cpu() is got  # asked once


@only_x86
@pytest.mark.parametrize("flag", sorted(TORCH_NAMES))
def test_the_cpuinfo_flags_agree_with_torchs_cpuid(flag: str) -> None:
    assert (flag in platform.cpu_info().flags) == bool(CAPS[TORCH_NAMES[flag]])


@only_x86
def test_the_levels_agree_with_torchs_capability() -> None:
    """torch's own vector code: AVX2 needs AVX2 and FMA, AVX512 needs AVX512F/BW/VL/DQ;
    every CPU with those has the rest of x86-64-v3 (v4), so the levels must agree."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("ATEN_CPU_CAPABILITY caps torch's capability below the CPU's")
    levels = platform.cpu_info().isa_levels
    capability = torch.backends.cpu.get_cpu_capability()
    assert ("x86-64-v3" in levels) == (capability in ("AVX2", "AVX512")), capability
    assert ("x86-64-v4" in levels) == (capability == "AVX512"), capability


def test_the_levels_agree_with_the_kernels_own_cpuid_check() -> None:
    """The compiled module asks the CPU itself (GCC's ``__builtin_cpu_supports``, CPUID and
    the OS's saved state) which of its levels run; on x86-64 (built by GCC 12 or later,
    as setup.py's every x86 build here: a build without the levels fails this, as a
    silently slower build should) it must find exactly the levels the platform layer
    finds in /proc/cpuinfo. Elsewhere both say "baseline"."""
    compiled = paged_decode_cpu._COMPILED
    assert compiled is not None, paged_decode_cpu.cpu_kernels_problem()
    assert compiled.module.isa_levels() == platform.cpu_info().isa_levels
    assert paged_decode_cpu.isa_levels() == platform.cpu_info().isa_levels


def test_the_model_name_and_cores_are_this_machines() -> None:
    cpu = platform.cpu_info()
    assert cpu.architecture == os.uname().machine  # what the kernel says
    if X86 and Path("/proc/cpuinfo").is_file():
        assert cpu.model_name  # every x86 Linux reports one
    cores = platform.usable_physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert cores <= max(1, CAPS["num_logical_cores"])


def test_the_summary_is_plain_data() -> None:
    got = json.loads(json.dumps(platform.summary()))
    assert got["torch"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert got["cpu"]["isa_levels"][-1] == "baseline"


def test_importing_the_platform_layer_imports_no_torch() -> None:
    """config.py (and so engine/) imports it: torch comes only with ``torch_cpu()``."""
    code = (
        "import sys, paged_engine.platform as p\n"
        "p.cpu_info(); p.usable_physical_cores(); p.available_memory_bytes()\n"
        "print('torch' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert run.stdout.strip() == "False", run.stderr


# ---- /proc/cpuinfo --------------------------------------------------------------------------

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse2 {flags}
bugs\t\t: sysret_ss_attrs

processor\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu
"""
V2 = "cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3"
V3 = V2 + " avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("flags", "levels"),
    [
        (V4 + " avx512_bf16", ("x86-64-v4", "x86-64-v3", "baseline")),
        (V3, ("x86-64-v3", "baseline")),
        (V3.replace(" movbe", ""), ("baseline",)),  # one feature short of v3
        (V4.replace(" avx512cd", ""), ("x86-64-v3", "baseline")),
        (V2, ("baseline",)),
    ],
)
def test_the_levels_need_every_flag_of_the_level(
    tmp_path: Path, flags: str, levels: tuple[str, ...]
) -> None:
    path = write(tmp_path / "cpuinfo", X86_CPUINFO.format(flags=flags))
    cpu = platform.read_cpu_info(path, architecture="x86_64")
    assert cpu.model_name == "AMD EPYC 7B13 64-Core Processor"
    assert "bugs" not in cpu.flags and "sysret_ss_attrs" not in cpu.flags
    assert cpu.isa_levels == levels
    # the first processor's flags, not the second's
    assert cpu.has(["fpu", "sse2"]) and cpu.has(flags.split())


def test_aarch64_reads_features_and_has_the_baseline_only(tmp_path: Path) -> None:
    text = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16 i8mm\nCPU part\t: 0xd40\n"
    cpu = platform.read_cpu_info(write(tmp_path / "cpuinfo", text), architecture="aarch64")
    assert cpu.flags == {"fp", "asimd", "bf16", "i8mm"} and cpu.model_name is None
    assert cpu.isa_levels == ("baseline",)
    # x86 flag names on another architecture never make an x86 level
    fake = platform.CpuInfo("aarch64", None, frozenset(V4.split()))
    assert fake.isa_levels == ("baseline",)


def test_a_missing_cpuinfo_is_a_cpu_without_features(tmp_path: Path) -> None:
    cpu = platform.read_cpu_info(tmp_path / "missing", architecture="x86_64")
    assert cpu == platform.CpuInfo("x86_64", None, frozenset())
    assert cpu.isa_levels == ("baseline",) and cpu.bf16_features == ()


# ---- cgroups, affinity, memory ----------------------------------------------------------------


@pytest.fixture
def fake_sys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tmp tree standing in for /sys/fs/cgroup, /proc/self/cgroup, /proc/meminfo and
    /sys/devices/system/cpu (every probe reads these module paths when called)."""
    monkeypatch.setattr(platform_cgroup, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(platform_cgroup, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(platform, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(platform, "SYS_CPU", tmp_path / "cpu")
    (tmp_path / "cgroup").mkdir()
    return tmp_path


def test_v2_quotas_on_the_process_path_apply_the_tightest(fake_sys: Path) -> None:
    write(fake_sys / "self-cgroup", "0::/user.slice/job.scope\n")
    root = fake_sys / "cgroup"
    assert platform._cgroup_cpu_limit() is None  # no files at all: unlimited
    write(root / "user.slice" / "job.scope" / "cpu.max", "max 100000\n")
    assert platform._cgroup_cpu_limit() is None
    write(root / "user.slice" / "cpu.max", "250000 100000\n")
    assert platform._cgroup_cpu_limit() == 3  # 2.5 CPUs, rounded up
    write(root / "user.slice" / "job.scope" / "cpu.max", "50000 100000\n")
    assert platform._cgroup_cpu_limit() == 1
    write(root / "cpu.max", "garbage\n")  # unreadable values are no limit, not an error
    assert platform._cgroup_cpu_limit() == 1


def test_v1_quotas_under_the_controllers_directory(fake_sys: Path) -> None:
    write(fake_sys / "self-cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    job = fake_sys / "cgroup" / "cpu,cpuacct" / "docker" / "abc"
    write(job / "cpu.cfs_quota_us", "-1\n")
    write(job / "cpu.cfs_period_us", "100000\n")
    assert platform._cgroup_cpu_limit() is None  # -1: no quota
    write(job / "cpu.cfs_quota_us", "400000\n")
    assert platform._cgroup_cpu_limit() == 4


def test_a_path_outside_the_namespace_reads_the_roots_only(fake_sys: Path) -> None:
    write(fake_sys / "self-cgroup", "0::/../../elsewhere\n")
    write(fake_sys / "cgroup" / "cpu.max", "100000 100000\n")
    want = [fake_sys / "cgroup", fake_sys / "cgroup" / "cpu"]
    assert platform_cgroup.cgroup_dirs("cpu") == want
    assert platform._cgroup_cpu_limit() == 1


def test_the_cores_count_smt_siblings_once_under_the_quota(
    fake_sys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    for cpu, siblings in {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 5: "1,5"}.items():
        write(fake_sys / "cpu" / f"cpu{cpu}" / "topology" / "core_cpus_list", siblings)
    assert platform.usable_physical_cores() == 4  # 1 and 5 share a core
    write(fake_sys / "self-cgroup", "0::/\n")
    write(fake_sys / "cgroup" / "cpu.max", "150000 100000\n")
    assert platform.usable_physical_cores() == 2
    assert platform.threads_per_rank(8, 2) == 1 and platform.threads_per_rank(8, 1) == 8


def test_memory_is_the_least_any_limit_leaves(fake_sys: Path) -> None:
    write(fake_sys / "meminfo", "MemTotal:  1000 kB\nMemAvailable:  800 kB\n")
    assert platform.available_memory_bytes() == 800 * 1024
    write(fake_sys / "self-cgroup", "4:memory:/job\n0::/svc\n")
    write(fake_sys / "cgroup" / "svc" / "memory.max", "max\n")  # v2, unlimited
    write(fake_sys / "cgroup" / "svc" / "memory.current", "100\n")
    assert platform.available_memory_bytes() == 800 * 1024
    v1 = fake_sys / "cgroup" / "memory" / "job"
    write(v1 / "memory.limit_in_bytes", "500000\n")
    write(v1 / "memory.usage_in_bytes", "300000\n")
    assert platform.available_memory_bytes() == 200000
    write(fake_sys / "cgroup" / "svc" / "memory.max", "150100\n")  # v2 leaves 150000
    assert platform.available_memory_bytes() == 150000
    write(v1 / "memory.usage_in_bytes", "600000\n")  # over its limit: no room at all
    assert platform.available_memory_bytes() == 0


def test_without_meminfo_the_free_pages_count(
    fake_sys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = {"SC_AVPHYS_PAGES": 10, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert platform.available_memory_bytes() == 40960
