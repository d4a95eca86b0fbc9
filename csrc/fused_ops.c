/*
 * The small per-layer ops of a Qwen3 decoder on the CPU, float32 and bfloat16, each one pass
 * over its rows instead of a chain of torch ops:
 *
 * - add_rms_norm: the residual add and the RMSNorm after it (one row at a time: the sum, its
 *   mean square, the scaled and weighted row);
 * - qk_norm_rope: Qwen3's per-head q/k RMSNorm and the rotary embedding after it (or the
 *   rotation alone, for the families without the norm), in place in the qkv projection's
 *   output;
 * - silu_and_mul: silu(gate) * up over the fused gate_up output.
 *
 * Why C: at decode a step's rows are few (one per sequence), and in torch each norm is a
 * chain of 5-8 ops over them, each dispatched and allocated on its own; at prefill the
 * chain writes and rereads a full-size temporary per op. bench/test_fused_ops_bench.py
 * measures both against the torch code in one process. The readable references are in
 * paged_engine/kernels/fused_ops_ref.py; the launcher that checks shapes, strides, dtypes
 * and devices is paged_engine/kernels/fused_ops_cpu.py.
 *
 * Numerics. The norms and the rotation round exactly where torch's op chain rounds
 * (transformers' order: float32 statistics, the normalised row cast to the model dtype
 * before the weight multiply, every bfloat16 product and sum rounded to bfloat16), and the
 * mean square sums its squares in the order of torch's own CPU sum (its cascade of vector
 * lanes, `lanes` wide: the launcher measures the width torch uses), so both are bit for
 * bit torch's results. That needs exact IEEE arithmetic: those functions are compiled
 * without -ffast-math's reassociation and reciprocals and without FMA contraction
 * (EXACT_FP_BEGIN below, csrc/levels.h: GCC's pragma or clang's). silu_and_mul keeps
 * fast-math for glibc's vectorised expf, whose last bit can differ from torch's exp: it is
 * close to torch, not equal (bfloat16 rounds the same way as torch in between, see
 * fused_ops_ref.py).
 *
 * This file is one more module in the _cpu_kernels library (PEP 489's several modules in
 * one library: PyInit__fused_ops, loaded by the launcher under that name), so it shares
 * the library's build without touching the decode kernel's module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"
#include "levels.h"

#define INLINE static inline __attribute__((always_inline))

#define MAX_COLS 16384 /* a row's widened copy lives on the stack */
#define MAX_LANES 16

INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f rounded to bfloat16, as torch rounds (to nearest, ties to even; a NaN stays a quiet
 * NaN), and widened back: the bfloat16 bits in the upper half of a float's, in 32-bit
 * integer arithmetic (no FP mode involved). A rounding between two float32 steps stays in
 * 32-bit lanes this way: the vectorised loops need not narrow to 16 bits and widen back. */
INLINE float rnd_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t nan = (u | 0x00400000u) & 0xffff0000u; /* the quiet bit set */
    const uint32_t even = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? nan : even;
    float out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* f rounded to bfloat16's 16 bits. */
INLINE uint16_t f32_to_bf16(float f) {
    const float r = rnd_bf16(f);
    uint32_t u;
    memcpy(&u, &r, sizeof u);
    return (uint16_t)(u >> 16);
}

/* v rounded to the model dtype, kept as a float (exact for bfloat16 values). */
INLINE float rnd(float v, const int bf16) { return bf16 ? rnd_bf16(v) : v; }

INLINE float load(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* store() for a v already rounded to the model dtype (rnd's result): its upper half as is. */
INLINE void store_rounded(void *p, int64_t i, float v, const int bf16) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if (bf16)
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    else
        ((float *)p)[i] = v;
}

EXACT_FP_BEGIN

/* torch's multi_row_sum over `size` groups of 4 consecutive L-wide units of x^2: a running
 * sum per (row k, lane), carried up 4 levels every `step` groups so that only partial sums
 * of similar size are added. out: [4][L]. Levels above 0 stay zero below `step` groups
 * (rows under 64 L elements): they are then neither cleared nor added, which changes no bit
 * (x + 0 == x for the non-negative sums here). */
INLINE void cascade4(const float *x, int64_t size, const int L, float out[4][MAX_LANES]) {
    float acc[4][4][MAX_LANES];
    const int64_t log2 = size <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)size - 1);
    const int64_t power = log2 / 4 > 4 ? log2 / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    const int levels = size >= step ? 4 : 1;
    for (int j = 0; j < levels; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++) acc[j][k][l] = 0.f;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++) {
                    const float v = x[(i * 4 + k) * L + l];
                    acc[0][k][l] += v * v;
                }
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.f;
                }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++) {
                const float v = x[(i * 4 + k) * L + l];
                acc[0][k][l] += v * v;
            }
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < L; l++) {
            out[k][l] = acc[0][k][l];
            for (int j = 1; j < levels; j++) out[k][l] += acc[j][k][l];
        }
}

/* sum(x^2) over n floats, in torch's order for a contiguous row (its row_sum over L-wide
 * vectors, 4 interleaved, then the leftover elements, then the lanes one by one; a row
 * shorter than one vector: the same over single elements). */
INLINE float sum_squares(const float *x, int64_t n, const int L) {
    float parts[4][MAX_LANES];
    if (n < L) {
        cascade4(x, n / 4, 1, parts);
        for (int64_t i = n / 4 * 4; i < n; i++) parts[0][0] += x[i] * x[i];
        return parts[0][0] + parts[1][0] + parts[2][0] + parts[3][0];
    }
    const int64_t units = n / L;
    cascade4(x, units / 4, L, parts);
    for (int64_t u = units / 4 * 4; u < units; u++)
        for (int l = 0; l < L; l++) parts[0][l] += x[u * L + l] * x[u * L + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < L; l++) parts[0][l] += parts[k][l];
    float total = 0.f;
    for (int64_t i = units * L; i < n; i++) total += x[i] * x[i];
    for (int l = 0; l < L; l++) total += parts[0][l];
    return total;
}

/* 1 / sqrt(mean(x^2) + eps), as torch's mean (sum, then a true division) and rsqrt. */
INLINE float inv_rms(const float *x, int64_t n, float eps, const int L) {
    /* L a constant in each branch: each width's loops unrolled and vectorised */
    const float sum = L == 4   ? sum_squares(x, n, 4)
                      : L == 8 ? sum_squares(x, n, 8)
                               : sum_squares(x, n, 16);
    const float mean = sum / (float)n;
    return 1.f / sqrtf(mean + eps);
}

typedef struct {
    const void *x, *res, *w;
    void *out, *res_out;
    int64_t xs, rs, os, ros, rows, n;
    float eps;
} NormArgs;

INLINE void add_rms_norm_rows(const NormArgs *a, const int bf16, const int L, int64_t begin,
                              int64_t end) {
    for (int64_t i = begin; i < end; i++) {
        float row[MAX_COLS];
        const char *x = (const char *)a->x + i * a->xs * (bf16 ? 2 : 4);
        if (a->res != NULL) {
            const char *r = (const char *)a->res + i * a->rs * (bf16 ? 2 : 4);
            char *ro = (char *)a->res_out + i * a->ros * (bf16 ? 2 : 4);
            for (int64_t j = 0; j < a->n; j++) {
                row[j] = rnd(load(r, j, bf16) + load(x, j, bf16), bf16);
                store_rounded(ro, j, row[j], bf16);
            }
        } else {
            for (int64_t j = 0; j < a->n; j++) row[j] = load(x, j, bf16);
        }
        const float scale = inv_rms(row, a->n, a->eps, L);
        char *o = (char *)a->out + i * a->os * (bf16 ? 2 : 4);
        for (int64_t j = 0; j < a->n; j++)
            store(o, j, load(a->w, j, bf16) * rnd(row[j] * scale, bf16), bf16);
    }
}

LEVELS(add_rms_norm_f32, add_rms_norm_rows(a, 0, L, begin, end))
LEVELS(add_rms_norm_bf16, add_rms_norm_rows(a, 1, L, begin, end))

typedef struct {
    void *qk;
    const void *wq, *wk, *cos, *sin;
    int64_t ts, cs, tokens, q_heads, heads, d;
    float eps;
} RopeArgs;

/* Per (token, head): the head's RMSNorm (q weight for the first q_heads, else k; no norm
 * when both weights are NULL: the Llama families rotate without one), then
 * x * cos + [x2, x1] * [-sin, sin] (sin's first half arrives negated), each product and
 * the sum rounded to the model dtype, as torch's three ops round them. */
INLINE void qk_norm_rope_rows(const RopeArgs *a, const int bf16, const int L, int64_t begin,
                              int64_t end) {
    const int64_t half = a->d / 2;
    for (int64_t it = begin; it < end; it++) {
        float row[MAX_COLS], normed[MAX_COLS];
        const int64_t t = it / a->heads, h = it % a->heads;
        char *x = (char *)a->qk + (t * a->ts + h * a->d) * (bf16 ? 2 : 4);
        const void *w = h < a->q_heads ? a->wq : a->wk;
        for (int64_t j = 0; j < a->d; j++) row[j] = load(x, j, bf16);
        if (w != NULL) {
            const float scale = inv_rms(row, a->d, a->eps, L);
            for (int64_t j = 0; j < a->d; j++)
                normed[j] = rnd(load(w, j, bf16) * rnd(row[j] * scale, bf16), bf16);
        } else {
            for (int64_t j = 0; j < a->d; j++) normed[j] = row[j];
        }
        const char *c = (const char *)a->cos + t * a->cs * (bf16 ? 2 : 4);
        const char *s = (const char *)a->sin + t * a->cs * (bf16 ? 2 : 4);
        for (int64_t j = 0; j < half; j++) {
            const float p = rnd(normed[j] * load(c, j, bf16), bf16);
            store(x, j, p + rnd(normed[j + half] * load(s, j, bf16), bf16), bf16);
        }
        for (int64_t j = half; j < a->d; j++) {
            const float p = rnd(normed[j] * load(c, j, bf16), bf16);
            store(x, j, p + rnd(normed[j - half] * load(s, j, bf16), bf16), bf16);
        }
    }
}

LEVELS(qk_norm_rope_f32, qk_norm_rope_rows(a, 0, L, begin, end))
LEVELS(qk_norm_rope_bf16, qk_norm_rope_rows(a, 1, L, begin, end))

EXACT_FP_END

typedef struct {
    const void *x;
    void *out;
    int64_t xs, os, d;
} SiluArgs;

/* silu(g) * u with g the first d columns of a row and u the next d; fast-math (above). In
 * bfloat16 silu's result is rounded before the multiply, as torch's two ops round it. The
 * exponent is capped at 88 (expf(88) ~ 1.7e38, finite): fast-math's refined reciprocal of
 * an infinite 1 + exp(-g) is NaN, where torch gets -0; capped, g < -88 gives a |silu| below
 * 6e-37 instead. */
INLINE void silu_and_mul_rows(const SiluArgs *a, const int bf16, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
        const char *g = (const char *)a->x + i * a->xs * (bf16 ? 2 : 4);
        const char *u = g + a->d * (bf16 ? 2 : 4);
        char *o = (char *)a->out + i * a->os * (bf16 ? 2 : 4);
        for (int64_t j = 0; j < a->d; j++) {
            const float v = load(g, j, bf16);
            const float silu = v / (1.f + expf(fminf(-v, 88.f)));
            store(o, j, rnd(silu, bf16) * load(u, j, bf16), bf16);
        }
    }
}

LEVELS(silu_and_mul_f32, ((void)L, silu_and_mul_rows(a, 0, begin, end)))
LEVELS(silu_and_mul_bf16, ((void)L, silu_and_mul_rows(a, 1, begin, end)))

/* ------------------------------------------------------------------ Python entry points */

static int check_common(int lanes, int threads, int64_t cols) {
    if (lanes != 4 && lanes != 8 && lanes != 16) {
        PyErr_Format(PyExc_ValueError, "fused ops: lanes must be 4, 8 or 16, got %d", lanes);
        return -1;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "fused ops: threads must be >= 1, got %d", threads);
        return -1;
    }
    if (cols < 1 || cols > MAX_COLS) {
        PyErr_Format(PyExc_ValueError, "fused ops: rows of %lld elements (1 to %d supported)",
                     (long long)cols, MAX_COLS);
        return -1;
    }
    return 0;
}

#define PTR(v) ((void *)(uintptr_t)(v))

static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, res, w, out, res_out;
    NormArgs a;
    int dtype, lanes, threads, isa;
    if (!PyArg_ParseTuple(args, "KLKLKLKLKLLfiiii", &x, &a.xs, &res, &a.rs, &out, &a.os,
                          &res_out, &a.ros, &w, &a.rows, &a.n, &a.eps, &dtype, &lanes,
                          &threads, &isa))
        return NULL;
    const RangeFn fn =
        pick("fused ops", add_rms_norm_f32_levels, add_rms_norm_bf16_levels, dtype, isa);
    if (fn == NULL || check_common(lanes, threads, a.n) < 0) return NULL;
    if (a.rows < 0 || (res != 0) != (res_out != 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "add_rms_norm: rows must be >= 0, residual and residual_out given "
                        "together");
        return NULL;
    }
    a.x = PTR(x), a.res = PTR(res), a.w = PTR(w), a.out = PTR(out), a.res_out = PTR(res_out);
    int team;
    Py_BEGIN_ALLOW_THREADS;
    team = run_ranges(fn, &a, lanes, a.rows, threads);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(team);
}

static PyObject *py_qk_norm_rope(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long qk, wq, wk, cos, sin;
    RopeArgs a;
    int dtype, lanes, threads, isa;
    if (!PyArg_ParseTuple(args, "KLLLLKKKKLLfiiii", &qk, &a.ts, &a.tokens, &a.q_heads, &a.heads,
                          &wq, &wk, &cos, &sin, &a.cs, &a.d, &a.eps, &dtype, &lanes, &threads,
                          &isa))
        return NULL;
    const RangeFn fn =
        pick("fused ops", qk_norm_rope_f32_levels, qk_norm_rope_bf16_levels, dtype, isa);
    if (fn == NULL || check_common(lanes, threads, a.d) < 0) return NULL;
    if (a.tokens < 0 || a.d % 2 || a.q_heads < 0 || a.q_heads > a.heads || !wq != !wk) {
        PyErr_SetString(PyExc_ValueError,
                        "qk_norm_rope: needs tokens >= 0, an even head dim, "
                        "0 <= q_heads <= heads and both weights or neither");
        return NULL;
    }
    a.qk = PTR(qk), a.wq = PTR(wq), a.wk = PTR(wk), a.cos = PTR(cos), a.sin = PTR(sin);
    int team;
    Py_BEGIN_ALLOW_THREADS;
    team = run_ranges(fn, &a, lanes, a.tokens * a.heads, threads);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(team);
}

static PyObject *py_silu_and_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, out;
    SiluArgs a;
    long long rows;
    int dtype, threads, isa;
    if (!PyArg_ParseTuple(args, "KLKLLLiii", &x, &a.xs, &out, &a.os, &rows, &a.d, &dtype,
                          &threads, &isa))
        return NULL;
    const RangeFn fn =
        pick("fused ops", silu_and_mul_f32_levels, silu_and_mul_bf16_levels, dtype, isa);
    if (fn == NULL || check_common(8, threads, 1) < 0) return NULL;
    if (rows < 0 || a.d < 0) {
        PyErr_SetString(PyExc_ValueError, "silu_and_mul: rows and d must be >= 0");
        return NULL;
    }
    a.x = PTR(x), a.out = PTR(out);
    int team;
    Py_BEGIN_ALLOW_THREADS;
    team = run_ranges(fn, &a, 8, rows, threads);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(team);
}

static PyObject *py_isa_levels(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    int built[ISA_LEVELS]; /* every op's tables have the same levels (LEVELS) */
    for (int isa = 0; isa < ISA_LEVELS; isa++) built[isa] = add_rms_norm_f32_levels[isa] != NULL;
    return isa_levels_usable(built);
}

static PyMethodDef methods[] = {
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS,
     "add_rms_norm(x, x_stride, res, res_stride, out, out_stride, res_out, res_out_stride, "
     "weight, rows, n, eps, dtype, lanes, threads, isa): raw addresses (res = res_out = 0: "
     "no residual), isa the instruction-set level's code (0 baseline, 1 x86-64-v3, 2 "
     "x86-64-v4); returns the threads that ran. Use paged_engine.kernels.fused_ops_cpu."},
    {"qk_norm_rope", py_qk_norm_rope, METH_VARARGS,
     "qk_norm_rope(qk, token_stride, tokens, q_heads, heads, wq, wk, cos, sin, cos_stride, "
     "head_dim, eps, dtype, lanes, threads, isa): in place (wq = wk = 0: rotation only); "
     "returns the threads that ran. "
     "Use paged_engine.kernels.fused_ops_cpu."},
    {"silu_and_mul", py_silu_and_mul, METH_VARARGS,
     "silu_and_mul(x, x_stride, out, out_stride, rows, d, dtype, threads, isa): returns the "
     "threads that ran. Use paged_engine.kernels.fused_ops_cpu."},
    {"isa_levels", py_isa_levels, METH_NOARGS,
     "isa_levels(): the instruction-set levels this build has and this CPU runs, best "
     "first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paged_engine._fused_ops",
    "Fused norm, rotary and activation kernels (see csrc/fused_ops.c).", -1, methods,
};

/* ROTATION_ONLY: qk_norm_rope takes NULL weights (the rotation alone). A build without the
 * constant would read through them: the loader refuses it (kernels/cpu_library.py). */
PyMODINIT_FUNC PyInit__fused_ops(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ROTATION_ONLY", 1) < 0) Py_CLEAR(m);
    return m;
}
