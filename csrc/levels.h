/*
 * What the library's small-op modules (fused_ops.c, sample_ops.c) share: one worker per
 * instruction-set level (LEVELS), the launcher-chosen level and dtype checked before
 * anything runs (pick), and a call's items split over OpenMP threads (run_ranges).
 */
#ifndef PAGED_ENGINE_LEVELS_H
#define PAGED_ENGINE_LEVELS_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"

enum { DT_F32 = 0, DT_BF16 = 1 };

/* Exact IEEE arithmetic for the functions defined between EXACT_FP_BEGIN and EXACT_FP_END,
 * in a library that setup.py compiles with -ffast-math: no reassociation, no reciprocals,
 * no FMA contraction, NaNs and infinities honoured. GCC and clang each spell it their own
 * way and skip the other's pragma with at most a warning: a clang build once computed
 * add_rms_norm with fast-math and differed from torch in the last bit
 * (tests/test_clang_build.py builds the library with clang and compares). clang honours
 * its contract(off) under -ffast-math only with -ffp-contract=fast-honor-pragmas, which
 * setup.py adds where the compiler takes it. */
#if defined(__clang_major__) /* clang's own: tests build GCC copies told -D__clang__ */
#define EXACT_FP_BEGIN \
    _Pragma("float_control(precise, on, push)") _Pragma("clang fp contract(off)")
#define EXACT_FP_END _Pragma("float_control(pop)")
#elif defined(__GNUC__)
#define EXACT_FP_BEGIN \
    _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-fast-math\", \"fp-contract=off\")")
#define EXACT_FP_END _Pragma("GCC pop_options")
#else
#error "csrc/levels.h: exact arithmetic needs GCC's or clang's pragmas (see EXACT_FP_BEGIN)"
#endif

/* A worker: items [begin, end) of a call (rows, or (token, head) pairs). */
typedef void (*RangeFn)(const void *args, int lanes, int64_t begin, int64_t end);

/* `name`'s workers, one per instruction-set level (isa.h): name##_levels[isa], NULL where
 * this build lacks the level. The launcher picks the level. Each runs `body` (over the
 * arguments a, L, begin, end), compiled for its level; an op whose arithmetic is exact
 * (fused_ops_rows.h's norms, fused_ops_rope.h's norm and rotation, sample_ops.c's pass)
 * gives the same bits at every level. */
#ifdef HAVE_X86_LEVELS
#define LEVELS(name, body)                                                                  \
    static void name##_base(const void *a, int L, int64_t begin, int64_t end) { body; }     \
    ATTR_X86_64_V3 static void name##_v3(const void *a, int L, int64_t begin, int64_t end) { \
        body;                                                                               \
    }                                                                                       \
    ATTR_X86_64_V4 static void name##_v4(const void *a, int L, int64_t begin, int64_t end) { \
        body;                                                                               \
    }                                                                                       \
    static const RangeFn name##_levels[ISA_LEVELS] = {name##_base, name##_v3, name##_v4};
#else
#define LEVELS(name, body)                                                              \
    static void name##_base(const void *a, int L, int64_t begin, int64_t end) { body; } \
    static const RangeFn name##_levels[ISA_LEVELS] = {name##_base, NULL, NULL};
#endif

/* Items [0, count) split into one contiguous range per thread, each computed whole by its
 * thread (so the bits do not depend on the thread count). The OpenMP region lives out here,
 * not in the workers: GCC outlines a region's body into a function of its own, which would
 * lose the workers' target attributes. Returns the number of threads that ran. */

static inline int run_ranges(RangeFn fn, const void *args, int lanes, int64_t count, int threads) {
#ifdef _OPENMP
    if (threads > 1 && count > 1) {
        int team = 1;
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            if (t == 0) team = (int)nt;
            fn(args, lanes, count * t / nt, count * (t + 1) / nt);
        }
        return team;
    }
#endif
    (void)threads;
    fn(args, lanes, 0, count);
    return 1;
}

#ifdef Py_PYTHON_H
/* The worker for `dtype` at level `isa` from an op's two tables, or NULL with a
 * ValueError set where either is not one this module has and this CPU runs. */
static inline RangeFn pick(const char *what, const RangeFn f32[ISA_LEVELS],
                           const RangeFn bf16[ISA_LEVELS], int dtype, int isa) {
    if (dtype != DT_F32 && dtype != DT_BF16) {
        PyErr_Format(PyExc_ValueError, "%s: dtype code %d is not 0 (f32) or 1 (bf16)", what,
                     dtype);
        return NULL;
    }
    const RangeFn fn = isa >= 0 && isa < ISA_LEVELS ? (dtype == DT_F32 ? f32 : bf16)[isa] : NULL;
    if (fn == NULL || !isa_usable(isa)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: instruction-set level %d is not built or not run by this CPU",
                     what, isa);
        return NULL;
    }
    return fn;
}
#endif

#endif
