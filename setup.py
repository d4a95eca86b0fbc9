"""The one compiled part of paged_engine, for the CPU (csrc/), float32 and bfloat16, in one
library: the paged-decode kernel (module ``_cpu_kernels``) and the fused small ops
(``_fused_ops``: RMSNorm with the residual add, q/k norm with rotary, SiLU times mul).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is
available the package installs without it, the "auto" attention backend uses the torch
backend on CPU (paged_engine.kernels.paged_decode_cpu.cpu_kernels_problem says why) and
the layers their torch ops.
"""

import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = "-fopenmp"


class BuildExt(build_ext):
    """setup.py's build_ext, but without OpenMP where the compiler or linker refuses
    ``-fopenmp`` (clang without libomp, MSVC): the kernel then runs single-threaded
    (csrc/paged_decode_cpu.c's ``run_items`` is guarded by ``_OPENMP``)."""

    def build_extensions(self) -> None:
        if not self._links_openmp():
            for ext in self.extensions:
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a != OPENMP]
                ext.extra_link_args = [a for a in ext.extra_link_args if a != OPENMP]
        super().build_extensions()

    def _links_openmp(self) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp, "probe.c")
            probe.write_text(
                "#include <omp.h>\nint main(void) { return !omp_get_max_threads(); }\n"
            )
            try:
                objs = self.compiler.compile([str(probe)], output_dir=tmp, extra_postargs=[OPENMP])
                self.compiler.link_executable(
                    objs, "probe", output_dir=tmp, extra_postargs=[OPENMP]
                )
            except Exception:  # CompileError, LinkError, or no usable compiler at all
                return False
        return True


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "paged_engine._cpu_kernels",
            sources=[
                "csrc/paged_decode_cpu.c",
                "csrc/paged_decode_bf16.c",
                # A second module in the same library (PyInit__fused_ops, PEP 489).
                "csrc/fused_ops.c",
            ],
            # The kernel template and shared declarations: a change to either rebuilds.
            depends=["csrc/paged_decode_cpu.h", "csrc/paged_decode_head.h"],
            include_dirs=["csrc"],
            # No -march: the AVX2 and AVX512-BF16 copies carry their own target attributes
            # and are chosen at load time, so one build runs on any x86-64 (and elsewhere).
            # Fast-math for vectorised dots and expf at compile time only: linking with it
            # would add crtfastmath.o, which flushes denormals process-wide.
            extra_compile_args=["-O3", "-ffast-math", OPENMP],
            # OpenMP (threads over (sequence, kv head) items), dropped by BuildExt where the
            # toolchain lacks it. GCC's libgomp.so.1: a process that imports torch first maps
            # torch's bundled copy only (tests/test_cpu_kernel_threads.py reads its maps).
            extra_link_args=[OPENMP],
            # glibc's vector math library: the vectorised expf that fast-math calls.
            libraries=["mvec", "m"] if sys.platform == "linux" else [],
            optional=True,
        )
    ],
)
