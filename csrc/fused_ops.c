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
 * (EXACT_FP_BEGIN in fused_ops_rows.h; csrc/levels.h: GCC's pragma or clang's).
 * silu_and_mul keeps fast-math for glibc's vectorised expf, whose last bit can differ from
 * torch's exp: it is close to torch, not equal (bfloat16 rounds the same way as torch in
 * between, see fused_ops_ref.py).
 *
 * Each op's rows are in fused_ops_rows.h (qk_norm_rope's in fused_ops_rope.h); this file
 * checks a call's arguments and runs the rows over threads. It is one more module in the
 * _cpu_kernels library (PEP 489's several modules in one library: PyInit__fused_ops,
 * loaded by the launcher under that name), so it shares the library's build without
 * touching the decode kernel's module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "fused_ops_rope.h" /* and fused_ops_rows.h, which it includes */

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
