/*
 * The instruction-set levels the CPU kernels are compiled for, shared by both modules.
 *
 * Each specialised function is compiled once per level: the compiler's baseline (every
 * target: aarch64, x86-64 without GCC 12, ...) and, on x86-64 with GCC 12 or later, the
 * x86-64 psABI levels v3 (AVX2, FMA, BMI, F16C) and v4 (AVX-512 F/BW/CD/DQ/VL), each
 * through a target attribute (no global -march: one build runs on every x86-64). The
 * launcher picks the level from the platform layer (paged_engine/platform.py, which reads
 * the CPU's flags) and passes its code; isa_usable() refuses a level this build lacks or
 * this CPU cannot execute, so a wrong choice is a ValueError, never an illegal
 * instruction. The levels are chosen per call, so a test runs every one this CPU has.
 */
#ifndef PAGED_ENGINE_ISA_H
#define PAGED_ENGINE_ISA_H

enum { ISA_BASELINE = 0, ISA_X86_64_V3 = 1, ISA_X86_64_V4 = 2, ISA_LEVELS = 3 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define HAVE_X86_LEVELS 1
#define ATTR_X86_64_V3 __attribute__((target("arch=x86-64-v3")))
#define ATTR_X86_64_V4 __attribute__((target("arch=x86-64-v4")))
#endif

/* 1 when this build has level `isa` and this CPU executes it (asked of the CPU itself,
 * CPUID and the OS's saved state, through GCC's __builtin_cpu_supports), else 0. */
static inline int isa_usable(int isa) {
    if (isa == ISA_BASELINE) return 1;
#ifdef HAVE_X86_LEVELS
    __builtin_cpu_init();
    if (isa == ISA_X86_64_V3) return __builtin_cpu_supports("x86-64-v3") != 0;
    if (isa == ISA_X86_64_V4) return __builtin_cpu_supports("x86-64-v4") != 0;
#endif
    return 0;
}

#ifdef Py_PYTHON_H
/* The names of the levels a module has copies for (`built`, indexed by level) that this
 * CPU runs, best first, as a tuple (the launcher intersects them with the platform
 * layer's). */
static inline PyObject *isa_levels_usable(const int built[ISA_LEVELS]) {
    static const char *const names[ISA_LEVELS] = {"baseline", "x86-64-v3", "x86-64-v4"};
    const char *usable[ISA_LEVELS];
    int n = 0;
    for (int isa = ISA_LEVELS - 1; isa >= 0; isa--)
        if (built[isa] && isa_usable(isa)) usable[n++] = names[isa];
    PyObject *tuple = PyTuple_New(n);
    for (int i = 0; tuple != NULL && i < n; i++) {
        PyObject *name = PyUnicode_FromString(usable[i]);
        if (name == NULL) {
            Py_CLEAR(tuple);
            break;
        }
        PyTuple_SET_ITEM(tuple, i, name);
    }
    return tuple;
}
#endif

#endif
