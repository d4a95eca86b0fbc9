"""The one compiled part of paged_engine: the CPU paged-decode kernel (csrc/), float32 and
bfloat16 in one extension.

Everything else is in pyproject.toml. The extension is optional: where no C compiler is
available the package installs without it and the "auto" attention backend uses the torch
backend on CPU (paged_engine.kernels.paged_decode_cpu.cpu_kernels_problem says why).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "paged_engine._cpu_kernels",
            sources=["csrc/paged_decode_cpu.c", "csrc/paged_decode_bf16.c"],
            # The kernel template and shared declarations: a change to either rebuilds.
            depends=["csrc/paged_decode_cpu.h", "csrc/paged_decode_head.h"],
            include_dirs=["csrc"],
            # No -march: the AVX2 and AVX512-BF16 copies carry their own target attributes
            # and are chosen at load time, so one build runs on any x86-64 (and elsewhere).
            # Fast-math for vectorised dots and expf at compile time only: linking with it
            # would add crtfastmath.o, which flushes denormals process-wide.
            extra_compile_args=["-O3", "-ffast-math"],
            # glibc's vector math library: the vectorised expf that fast-math calls.
            libraries=["mvec", "m"] if sys.platform == "linux" else [],
            optional=True,
        )
    ]
)
