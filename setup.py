"""The one compiled part of paged_engine, for the CPU (csrc/), float32 and bfloat16, in one
library: the paged-decode kernel (module ``_cpu_kernels``), the fused small ops
(``_fused_ops``: RMSNorm with the residual add, q/k norm with rotary, SiLU times mul) and
the sampler's argmax and finiteness pass (``_sample_ops``).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is
available the package installs without it, the "auto" attention backend uses the torch
backend on CPU (paged_engine.kernels.paged_decode_cpu.cpu_kernels_problem says why) and
the layers their torch ops.

The build is cached: a library built once is copied, not compiled again, by the next
install from the same sources with the same compiler and flags (``pip install -e
'.[server]'`` after ``pip install -e .``, a second checkout, a fresh tox env). The cache
lies in ``$PAGED_ENGINE_CACHE_DIR/build`` (default ``~/.cache/paged_engine/build``);
``build_ext --force`` skips it.
"""

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = "-fopenmp"
MVEC = "mvec"
HONOUR_PRAGMAS = "-ffp-contract=fast-honor-pragmas"
EMPTY_PROGRAM = "int main(void) { return 0; }\n"


class BuildExt(build_ext):
    """setup.py's build_ext, but without what this toolchain cannot link: OpenMP where the
    compiler or linker refuses ``-fopenmp`` (clang without libomp, MSVC: the kernel then
    runs single-threaded, csrc/run_items.c's ``run_items`` is guarded by
    ``_OPENMP``), and glibc's vector math library where there is none (aarch64 before
    glibc 2.38, whose headers then declare no vector expf either: the scalar one serves).
    And one flag more where the compiler takes it (clang's; GCC refuses it): clang's
    -ffast-math fuses multiplies and adds across statements "disregarding pragmas", so the
    exact sections' pragma (csrc/levels.h's EXACT_FP_BEGIN) would not keep FMAs out of
    them without ``-ffp-contract=fast-honor-pragmas`` (tests/test_clang_build.py)."""

    def build_extensions(self) -> None:
        openmp = self._links(
            "#include <omp.h>\nint main(void) { return !omp_get_max_threads(); }\n",
            flags=[OPENMP],
        )
        mvec = self._links(EMPTY_PROGRAM, libraries=[MVEC])
        honour = self._links(EMPTY_PROGRAM, flags=[HONOUR_PRAGMAS])
        for ext in self.extensions:
            if honour and HONOUR_PRAGMAS not in ext.extra_compile_args:
                ext.extra_compile_args = [*ext.extra_compile_args, HONOUR_PRAGMAS]
            if not openmp:
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a != OPENMP]
                ext.extra_link_args = [a for a in ext.extra_link_args if a != OPENMP]
            if not mvec:
                ext.libraries = [lib for lib in ext.libraries if lib != MVEC]
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        """Copy ``ext``'s library from the cache when one was built from the same inputs
        (``build_key``), else compile it (saying so: it takes a minute) and keep a copy."""
        target = Path(self.get_ext_fullpath(ext.name))
        cached = cache_dir() / build_key(ext, self.compiler) / target.name
        if cached.is_file() and not self.force:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cached, target)
            print(f"paged_engine: {ext.name} copied from the build cache ({cached})", flush=True)
            return
        print(f"paged_engine: compiling {ext.name} (about a minute of one core)", flush=True)
        start = time.monotonic()
        super().build_extension(ext)
        print(f"paged_engine: compiled in {time.monotonic() - start:.0f} s", flush=True)
        if target.is_file():
            try:  # a cache that cannot be written costs the next install its time only
                cached.parent.mkdir(parents=True, exist_ok=True)
                partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
                shutil.copyfile(target, partial)
                os.replace(partial, cached)
            except OSError:
                pass

    def _links(self, source: str, flags: Sequence[str] = (), libraries: Sequence[str] = ()) -> bool:
        """Whether a program of ``source`` compiles and links with ``flags`` and
        ``libraries`` here."""
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp, "probe.c")
            probe.write_text(source)
            try:
                objs = self.compiler.compile(
                    [str(probe)], output_dir=tmp, extra_postargs=list(flags)
                )
                self.compiler.link_executable(
                    objs,
                    "probe",
                    output_dir=tmp,
                    libraries=list(libraries),
                    extra_postargs=list(flags),
                )
            except Exception:  # CompileError, LinkError, or no usable compiler at all
                return False
        return True


def cache_dir() -> Path:
    root = os.environ.get("PAGED_ENGINE_CACHE_DIR") or Path.home() / ".cache" / "paged_engine"
    return Path(root) / "build"


def build_key(ext: Extension, compiler: object) -> str:
    """A digest of everything the library depends on: its sources and headers, its flags
    (after ``build_extensions`` dropped what does not link here), the compiler's command
    lines and executables (path, size, modification time), and this Python's ABI."""
    h = hashlib.sha256()

    def put(*parts: object) -> None:
        for part in parts:
            h.update(repr(part).encode() + b"\0")

    for path in [*ext.sources, *ext.depends]:
        put(path, Path(path).read_bytes())
    put(ext.name, ext.extra_compile_args, ext.extra_link_args, ext.libraries)
    put(ext.include_dirs, ext.define_macros, ext.undef_macros)
    put(sys.version, sys.platform, sysconfig.get_config_var("EXT_SUFFIX"))
    for attr in ("compiler_so", "linker_so"):
        command = list(getattr(compiler, attr, None) or ())
        put(attr, command)
        exe = shutil.which(command[0]) if command else None
        if exe is not None:
            st = os.stat(exe)
            put(os.path.realpath(exe), st.st_size, st.st_mtime_ns)
    return h.hexdigest()[:32]


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "paged_engine._cpu_kernels",
            sources=[
                "csrc/paged_decode_cpu.c",
                "csrc/paged_decode_bf16.c",
                "csrc/run_items.c",
                "csrc/store_kv_cpu.c",
                # More modules in the same library (PyInit__fused_ops, PyInit__sample_ops:
                # PEP 489).
                "csrc/fused_ops.c",
                "csrc/sample_ops.c",
            ],
            # The kernel template and shared declarations: a change to any rebuilds.
            depends=[
                "csrc/fused_ops_rope.h",
                "csrc/fused_ops_rows.h",
                "csrc/isa.h",
                "csrc/levels.h",
                "csrc/paged_decode_amx.h",
                "csrc/paged_decode_cpu.h",
                "csrc/paged_decode_head.h",
                "csrc/paged_decode_items.h",
                "csrc/paged_decode_share.h",
            ],
            include_dirs=["csrc"],
            # No -march: the x86-64-v3/v4 and AVX512-BF16 copies carry their own target
            # attributes (csrc/isa.h) and the launchers choose one per call from
            # paged_engine/platform.py, so one build runs on any x86-64 (and elsewhere, as
            # the baseline copies alone).
            # Fast-math for vectorised dots and expf at compile time only: linking with it
            # would add crtfastmath.o, which flushes denormals process-wide.
            extra_compile_args=["-O3", "-ffast-math", OPENMP],
            # OpenMP (threads over (sequence, kv head) items), dropped by BuildExt where the
            # toolchain lacks it. GCC's libgomp.so.1: a process that imports torch first maps
            # torch's bundled copy only (tests/test_cpu_kernel_threads.py reads its maps).
            extra_link_args=[OPENMP],
            # glibc's vector math library: the vectorised expf that fast-math calls (dropped
            # by BuildExt where it does not link).
            libraries=[MVEC, "m"] if sys.platform == "linux" else [],
            optional=True,
        )
    ],
)
