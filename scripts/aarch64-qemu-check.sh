#!/usr/bin/env bash
# The compiled kernels' tests and the tiny model's token-for-token test against transformers,
# on aarch64 under qemu-user: docs/verification.md, "Other compilers, and aarch64".
#
# Not CI: it needs root, apt, Debian's mirror and PyPI, about 6 GB of disk and 25 minutes
# (the emulator runs one core at a tenth of its speed or less). On Debian or Ubuntu, x86-64:
#     scripts/aarch64-qemu-check.sh [ROOT]     (ROOT: the arm64 root, default /opt/arm64)
# A second run reuses ROOT's system and virtualenv and copies the checkout afresh.
set -euo pipefail
ROOT=${1:-/opt/arm64}
REPO=$(cd "$(dirname "$0")/.." && pwd)
TESTS=(tests/test_fused_ops.py tests/test_fused_ops_layers.py tests/test_sample_ops.py
    tests/test_cpu_kernel.py
    tests/test_cpu_kernel_bf16.py tests/test_cpu_kernel_threads.py
    tests/test_cpu_kernel_threads_build.py tests/test_store_kv_cpu.py
    tests/test_e2e.py tests/test_platform.py)

apt-get install -y --no-install-recommends qemu-user-static debootstrap >/dev/null

# The kernel runs aarch64 programs through qemu: F loads the interpreter now, so it works
# inside the chroot too.
binfmt=/proc/sys/fs/binfmt_misc
mountpoint -q "$binfmt" || mount -t binfmt_misc binfmt_misc "$binfmt"
if [ ! -e "$binfmt/qemu-aarch64" ]; then
    magic='\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    echo ":qemu-aarch64:M::$magic:$mask:/usr/bin/qemu-aarch64-static:OCF" >"$binfmt/register"
fi

if [ ! -x "$ROOT/usr/bin/python3" ]; then
    debootstrap --arch=arm64 --include=python3,python3-venv,python3-dev,python3-pip,gcc,libc6-dev \
        bookworm "$ROOT" http://deb.debian.org/debian
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"

# qemu-user shows the host's /proc/cpuinfo and sysfs, which crash torch's CPU probes
# (cpuinfo, oneDNN's xbyak_aarch64): an arm64 cpuinfo and a minimal cpu sysfs instead.
fake=$(mktemp -d)
cleanup() {
    for m in proc/cpuinfo proc sys dev; do umount "$ROOT/$m" 2>/dev/null || true; done
    rm -rf "$fake"
}
trap cleanup EXIT
for c in 0 1; do
    id="$fake/sys/devices/system/cpu/cpu$c/regs/identification"
    mkdir -p "$id"
    echo 0x00000000413fd0c1 >"$id/midr_el1" # Neoverse N1
    echo 0x0000000000000000 >"$id/revidr_el1"
    printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' "$c" >>"$fake/cpuinfo"
done
for f in possible present online; do echo 0-1 >"$fake/sys/devices/system/cpu/$f"; done
mount -t proc proc "$ROOT/proc"
mount --bind "$fake/cpuinfo" "$ROOT/proc/cpuinfo"
mount --bind "$fake/sys" "$ROOT/sys"
mount --bind /dev "$ROOT/dev"

export QEMU_CPU=neoverse-n1 # NEON, no SVE, no bfloat16
in_root() { chroot "$ROOT" /bin/sh -c ". /work/venv/bin/activate && cd /work/pe && $1"; }
if [ ! -x "$ROOT/work/venv/bin/python" ]; then
    mkdir -p "$ROOT/work"
    chroot "$ROOT" python3 -m venv /work/venv
    # PyPI's aarch64 torch is its CUDA build (+cu130: 5 GB with its NVIDIA libraries), run
    # on the CPU here; the rest is what these tests import.
    chroot "$ROOT" /work/venv/bin/pip install -q torch==2.13.0 'numpy>=1.24' xxhash \
        transformers safetensors tokenizers tqdm pytest hypothesis pytest-timeout
fi

rm -rf "$ROOT/work/pe" && mkdir -p "$ROOT/work/pe"
(cd "$REPO" && git ls-files -co --exclude-standard | grep -v '\.so$' | tar -cf - -T -) |
    tar -xf - -C "$ROOT/work/pe"
in_root "python setup.py build_ext --inplace 2>&1 | grep 'paged_engine:'"
in_root "python -c 'import torch; from paged_engine.kernels import fused_ops_cpu as f, paged_decode_cpu as d, sample_ops_cpu as s; print(\"torch\", torch.__version__, torch.backends.cpu.get_cpu_capability(), \"| sum lanes\", f.torch_sum_lanes(), \"| fused_ok\", f.fused_ok(torch.ones(2, 8)), \"| decode kernel:\", d.cpu_kernels_problem() or \"built\", \"threaded\" if d.cpu_kernels_threaded() else \"one thread\", \"| sampler pass:\", s.sample_ops_problem() or \"built\")'"
in_root "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HYPOTHESIS_PROFILE=ci python -m pytest -p no:cacheprovider -q -rs --timeout 0 ${TESTS[*]}"
