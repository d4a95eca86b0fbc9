/*
 * The sampler's per-step pass over the logits on the CPU, float32 and bfloat16: for each row
 * its argmax (the first index of its largest value, as torch.argmax) and whether every
 * value in it is finite.
 *
 * Why C: the sampler needs both for every row of every step (greedy rows take the argmax;
 * a row with a NaN or an infinity gets no token), and in torch that is isfinite, all and
 * argmax: three passes over [rows, vocab], the first two through a temporary bool tensor,
 * none of them vectorised well for a 49,152-entry vocabulary. Here it is one pass, each
 * row whole on one thread. bench/test_sample_ops_bench.py measures it against those torch
 * ops in one process. The readable reference is paged_engine/kernels/sample_ops_ref.py,
 * the launcher that checks shapes, strides, dtypes and devices
 * paged_engine/kernels/sample_ops_cpu.py.
 *
 * The pass: 16 lanes, lane l seeing elements j = l, l + 16, ... in order, each keeping its
 * largest value and the first index where it saw it (a strict >, so a tie keeps the earlier
 * one); the row's argmax is then the smallest index among the lanes that hold the largest
 * value. The finiteness is read from the bits (an all-ones exponent is an infinity or a
 * NaN), so no floating-point mode can change it. In a row that is not all finite the index
 * means nothing; the launcher's callers discard it.
 *
 * Another module in the _cpu_kernels library (PEP 489: PyInit__sample_ops), as the fused ops
 * are (csrc/fused_ops.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "isa.h"
#include "levels.h"

#define INLINE static inline __attribute__((always_inline))
#define LANES 16

typedef struct {
    const void *x;
    int64_t *tokens;
    uint8_t *ok;
    int64_t stride, n;
} ArgmaxArgs;

/* Exact compares and selects only: no fast-math (the library's default) down to the level
 * copies below, which the rows are inlined into. */
EXACT_FP_BEGIN

/* Element j's float32 bits (a bfloat16 is the top half of its float32). */
INLINE uint32_t bits(const void *row, int64_t j, const int bf16) {
    return bf16 ? (uint32_t)((const uint16_t *)row)[j] << 16 : ((const uint32_t *)row)[j];
}

INLINE float as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Element j in lane l: a larger value takes the lane, with its index; an all-ones exponent
 * (an infinity or a NaN) marks the lane. */
#define LANE_STEP(l, j)                                     \
    do {                                                    \
        const uint32_t u = bits(row, (j), bf16);            \
        const float v = as_float(u);                        \
        bad[l] |= (u & 0x7f800000u) == 0x7f800000u;         \
        at[l] = v > best[l] ? (int32_t)(j) : at[l];         \
        best[l] = v > best[l] ? v : best[l];                \
    } while (0)

INLINE void argmax_rows(const void *args, const int bf16, int64_t begin, int64_t end) {
    const ArgmaxArgs *a = args;
    const int64_t n = a->n;
    for (int64_t i = begin; i < end; i++) {
        const char *row = (const char *)a->x + i * a->stride * (bf16 ? 2 : 4);
        float best[LANES];
        int32_t at[LANES];
        uint32_t bad[LANES];
        const float first = as_float(bits(row, 0, bf16));
        for (int l = 0; l < LANES; l++) best[l] = first, at[l] = 0, bad[l] = 0;
        int64_t j = 0;
        for (; j + LANES <= n; j += LANES)
            for (int l = 0; l < LANES; l++) LANE_STEP(l, j + l);
        for (int l = 0; j + l < n; l++) LANE_STEP(l, j + l);
        float top = best[0];
        uint32_t any_bad = 0;
        for (int l = 0; l < LANES; l++) {
            top = best[l] > top ? best[l] : top;
            any_bad |= bad[l];
        }
        int32_t index = INT32_MAX;
        for (int l = 0; l < LANES; l++)
            if (best[l] == top && at[l] < index) index = at[l];
        a->tokens[i] = index == INT32_MAX ? 0 : index; /* a NaN top: no lane matches */
        a->ok[i] = !any_bad;
    }
}

LEVELS(argmax_f32, ((void)L, argmax_rows(a, 0, begin, end)))
LEVELS(argmax_bf16, ((void)L, argmax_rows(a, 1, begin, end)))

EXACT_FP_END

#define PTR(v) ((void *)(uintptr_t)(v))

static PyObject *py_argmax_finite(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, tokens, ok;
    ArgmaxArgs a;
    long long rows;
    int dtype, threads, isa;
    if (!PyArg_ParseTuple(args, "KLLLKKiii", &x, &a.stride, &rows, &a.n, &tokens, &ok, &dtype,
                          &threads, &isa))
        return NULL;
    const RangeFn fn = pick("argmax_finite", argmax_f32_levels, argmax_bf16_levels, dtype, isa);
    if (fn == NULL) return NULL;
    if (rows < 0 || a.n < 1 || a.n > INT32_MAX || threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "argmax_finite: needs rows >= 0, 1 <= n <= 2**31 - 1 and threads >= 1");
        return NULL;
    }
    a.x = PTR(x), a.tokens = PTR(tokens), a.ok = PTR(ok);
    int team;
    Py_BEGIN_ALLOW_THREADS;
    team = run_ranges(fn, &a, 0, rows, threads);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(team);
}

static PyObject *py_isa_levels(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    int built[ISA_LEVELS];
    for (int isa = 0; isa < ISA_LEVELS; isa++) built[isa] = argmax_f32_levels[isa] != NULL;
    return isa_levels_usable(built);
}

static PyMethodDef methods[] = {
    {"argmax_finite", py_argmax_finite, METH_VARARGS,
     "argmax_finite(x, row_stride, rows, n, tokens, ok, dtype, threads, isa): raw addresses "
     "(tokens int64 [rows], ok uint8 [rows]), dtype 0 float32 or 1 bfloat16, isa the "
     "instruction-set level's code; returns the threads that ran. Use "
     "paged_engine.kernels.sample_ops_cpu."},
    {"isa_levels", py_isa_levels, METH_NOARGS,
     "isa_levels(): the instruction-set levels this build has and this CPU runs, best "
     "first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paged_engine._sample_ops",
    "The sampler's argmax and finiteness pass (see csrc/sample_ops.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__sample_ops(void) { return PyModule_Create(&module); }
