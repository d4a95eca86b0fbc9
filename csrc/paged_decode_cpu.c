/*
 * Paged decode attention on the CPU, float32 and bfloat16: one new token per sequence attends
 * over its whole context, read block by block through its block table. The kernel is written
 * once, in paged_decode_head.h, and instantiated here for float32 and in paged_decode_bf16.c
 * for bfloat16 (float32 arithmetic throughout; AVX512-BF16 dot products where the CPU has
 * them), each at several instruction-set levels (isa.h); the launcher names the level and
 * the variant on every call. This file parses, validates and dispatches. The readable
 * reference is paged_engine.kernels.paged_attention_ref.paged_decode_attention_ref; the
 * launcher that checks shapes, strides and dtypes is paged_engine.kernels.paged_decode_cpu.
 *
 * Why C: in torch, decode attention over a paged cache is a gather of every context into a
 * padded batch (one copy of all K/V), then SDPA over it (a second pass). Here each K/V row
 * is read once, straight from the pool, and the softmax runs online (flash-attention style:
 * a running max, a running sum, a rescaled accumulator), so nothing is gathered, padded or
 * allocated. Sequences sharing prefix blocks read the same memory, which stays in cache.
 *
 * Layout (what store_kv writes): k/v cache [num_blocks, block_size, kv_heads, head_dim],
 * contiguous; token t of sequence b sits at block tables[b][t / block_size], row
 * t % block_size. Query head h reads kv head h / (H / KVH). The GQA group's query heads are
 * processed together, so each K/V row is loaded once for all of them.
 *
 * Built with -ffast-math (vectorised dot products and expf) but linked without it, so the
 * process's floating-point mode (denormals) is left alone. The running max starts at
 * -FLT_MAX rather than -inf (fast-math assumes finite values); the first rescale factor may
 * still underflow to 0 or, for scores beyond ~1e31, be exp(-inf) = 0, which multiplies an
 * accumulator that is still 0 either way. No slot outside a context is read.
 *
 * The arguments (lengths, tables) are validated, then read again with the GIL released:
 * callers must not change them from another thread during the call.
 *
 * Threads and the order of the work items: csrc/run_items.c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "isa.h"
#include "paged_decode_cpu.h"

/* The float32 copies, one per instruction-set level (isa.h), the launcher's choice. With
 * AVX-512 the accumulator rows of a D = 64, G = 2 item fit in registers (8 of 32, where
 * AVX2 would need all 16), which is what the x86-64-v4 copy is for
 * (bench/test_isa_levels_bench.py compares the levels). The copies vectorise the dots in
 * different lane orders, so their outputs differ in the last bits from one level to the
 * next; a process runs one level unless a caller names another. */
static inline __attribute__((always_inline)) float dot_f32(const float *q, const float *k,
                                                           int D) {
    float dot = 0.f;
    for (int x = 0; x < D; x++) dot += q[x] * k[x];
    return dot;
}
#define DH_ELEM float
#define DH_TO_F32(e) (e)
#define DH_FROM_F32(f) (f)
#define DH_DOT(qs, qe, k, D, scale) dot_f32(qs, k, D)
#define DH_NAME(x) x##_f32
#define DH_ATTR
#include "paged_decode_head.h"
#ifdef HAVE_X86_LEVELS
#define DH_NAME(x) x##_f32_v3
#define DH_ATTR ATTR_X86_64_V3
#include "paged_decode_head.h"
#define DH_NAME(x) x##_f32_v4
#define DH_ATTR ATTR_X86_64_V4
#include "paged_decode_head.h"
static const Kernel f32_levels[ISA_LEVELS] = {decode_f32, decode_f32_v3, decode_f32_v4};
#else
static const Kernel f32_levels[ISA_LEVELS] = {decode_f32, NULL, NULL};
#endif
#undef DH_ELEM
#undef DH_TO_F32
#undef DH_FROM_F32
#undef DH_DOT

/* Every block id a context reads must lie in the pool: checked before any read, so a bad
 * table is an exception, never a stray read. Returns the first bad sequence, or -1. */
static int first_bad_sequence(const Args *a, int *bad_block) {
    for (int b = 0; b < a->batch; b++) {
        const int len = a->lens[b];
        const int64_t blocks = ((int64_t)len + a->block_size - 1) / a->block_size;
        *bad_block = -1;
        if (len < 0 || blocks > a->table_width) return b;
        for (int j = 0; j < blocks; j++) {
            const int32_t id = a->tables[(int64_t)b * a->table_width + j];
            if (id < 0 || id >= a->num_blocks) {
                *bad_block = j;
                return b;
            }
        }
    }
    return -1;
}

/* The shared-prefix groups (paged_decode_share.h), checked before any read: the rows lie in
 * the batch, each in one group at most; a group's members share its token count, a whole
 * number of blocks no longer than any member's context, and their tables begin with the
 * same blocks; every other row starts at 0. Writes the problem into msg and returns 1. */
static int share_problem(const Args *a, char *msg, size_t size) {
    if (a->share_groups == 0) return 0;
    if (a->share_groups < 0 || a->share_bounds[0] != 0) {
        snprintf(msg, size, "share groups: %d groups, the first from row %d", a->share_groups,
                 a->share_groups < 0 ? 0 : a->share_bounds[0]);
        return 1;
    }
    for (int b = 0; b < a->batch; b++)
        if (a->starts[b] < 0) {
            snprintf(msg, size, "share starts: sequence %d starts at %d", b, a->starts[b]);
            return 1;
        }
    char *seen = calloc((size_t)a->batch + 1, 1);
    if (seen == NULL) {
        snprintf(msg, size, "share groups: out of memory");
        return 1;
    }
    int bad = 0;
    for (int g = 0; g < a->share_groups && !bad; g++) {
        const int lo = a->share_bounds[g], hi = a->share_bounds[g + 1];
        if (hi <= lo || hi > a->batch) {
            snprintf(msg, size, "share group %d: rows %d .. %d of a batch of %d", g, lo, hi,
                     a->batch);
            bad = 1;
            break;
        }
        const int r0 = a->share_rows[lo];
        for (int i = lo; i < hi && !bad; i++) {
            const int b = a->share_rows[i];
            if (b < 0 || b >= a->batch || seen[b]) {
                snprintf(msg, size, "share group %d: row %d is outside the batch or in two "
                         "groups", g, b);
                bad = 1;
                break;
            }
            seen[b] = 1;
            const int n = a->starts[b];
            if (n != a->starts[r0] || n == 0 || n % a->block_size || n > a->lens[b]) {
                snprintf(msg, size, "share group %d: sequence %d starts at %d (its group at %d, "
                         "blocks of %d, its length %d)", g, b, n, a->starts[r0],
                         a->block_size, a->lens[b]);
                bad = 1;
                break;
            }
            for (int j = 0; j < n / a->block_size; j++)
                if (a->tables[(int64_t)b * a->table_width + j] !=
                    a->tables[(int64_t)r0 * a->table_width + j]) {
                    snprintf(msg, size, "share group %d: sequence %d's block %d differs from "
                             "sequence %d's", g, b, j, r0);
                    bad = 1;
                    break;
                }
        }
    }
    for (int b = 0; b < a->batch && !bad; b++)
        if (!seen[b] && a->starts[b] != 0) {
            snprintf(msg, size, "share starts: sequence %d starts at %d in no group", b,
                     a->starts[b]);
            bad = 1;
        }
    free(seen);
    return bad;
}

enum { BF16_AUTO = 0, BF16_PORTABLE = 1, BF16_AVX512 = 2, BF16_AMX = 3 };
static int avx512_usable, amx_usable; /* set once, when the module loads */

/* Parse the launcher's arguments (the instruction-set level, then for bfloat16 `impl`, the
 * variant, last), validate them and run the chosen copy with the GIL released. */
static PyObject *run_checked(PyObject *args, const char *format, const char *what, int *impl) {
    unsigned long long q, k, v, tables, lens, out, starts = 0, rows = 0, bounds = 0;
    Args a;
    int isa;
    a.share_groups = 0;
    if (impl == NULL
            ? !PyArg_ParseTuple(args, format, &q, &k, &v, &tables, &lens, &out, &a.q_stride_b,
                                &a.q_stride_h, &a.out_stride_b, &a.out_stride_h, &a.batch,
                                &a.heads, &a.kv_heads, &a.head_dim, &a.block_size,
                                &a.table_width, &a.num_blocks, &a.scale, &a.num_threads, &isa,
                                &starts, &rows, &bounds, &a.share_groups)
            : !PyArg_ParseTuple(args, format, &q, &k, &v, &tables, &lens, &out, &a.q_stride_b,
                                &a.q_stride_h, &a.out_stride_b, &a.out_stride_h, &a.batch,
                                &a.heads, &a.kv_heads, &a.head_dim, &a.block_size,
                                &a.table_width, &a.num_blocks, &a.scale, &a.num_threads, &isa,
                                impl, &starts, &rows, &bounds, &a.share_groups))
        return NULL;
    if (isa < 0 || isa >= ISA_LEVELS || f32_levels[isa] == NULL || !isa_usable(isa)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: instruction-set level %d is not built or not run by this CPU", what,
                     isa);
        return NULL;
    }
    Kernel kernel = f32_levels[isa];
    if (a.kv_heads <= 0 || a.heads % a.kv_heads || a.heads / a.kv_heads > MAX_GROUP ||
        a.head_dim <= 0 || a.head_dim > MAX_DIM || a.block_size <= 0 || a.batch < 0) {
        PyErr_Format(PyExc_ValueError, "%s: unsupported geometry", what);
        return NULL;
    }
    if (a.num_threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: num_threads must be >= 1, got %d", what,
                     a.num_threads);
        return NULL;
    }
    a.q = (const void *)(uintptr_t)q;
    a.k = (const void *)(uintptr_t)k;
    a.v = (const void *)(uintptr_t)v;
    a.tables = (const int32_t *)(uintptr_t)tables;
    a.lens = (const int32_t *)(uintptr_t)lens;
    a.out = (void *)(uintptr_t)out;
    a.starts = a.share_groups != 0 ? (const int32_t *)(uintptr_t)starts : NULL;
    a.share_rows = (const int32_t *)(uintptr_t)rows;
    a.share_bounds = (const int32_t *)(uintptr_t)bounds;
    a.state = NULL;
    if (a.share_groups != 0 && (!starts || !rows || !bounds)) {
        PyErr_Format(PyExc_ValueError, "%s: share groups without their arrays", what);
        return NULL;
    }
    int bad_block;
    const int bad = first_bad_sequence(&a, &bad_block);
    if (bad >= 0) {
        if (bad_block < 0)
            PyErr_Format(PyExc_ValueError,
                         "%s: sequence %d has length %d, beyond its block table (%d blocks "
                         "of %d)",
                         what, bad, a.lens[bad], a.table_width, a.block_size);
        else
            PyErr_Format(PyExc_ValueError,
                         "%s: sequence %d reads block table entry %d = %d, outside the pool "
                         "of %d blocks",
                         what, bad, bad_block,
                         a.tables[(int64_t)bad * a.table_width + bad_block], a.num_blocks);
        return NULL;
    }
    if (impl != NULL) {
        /* Below 32 elements a 512-bit VDPBF16PS is mostly masked off, and the portable
         * (AVX2) copy measured faster (bench/test_cpu_bf16_bench.py, head_dim 16). */
        if (*impl == BF16_AUTO)
            *impl = a.head_dim < 32 || !avx512_usable ? BF16_PORTABLE
                    : amx_usable                      ? BF16_AMX
                                                      : BF16_AVX512;
        if (*impl == BF16_PORTABLE) {
            kernel = decode_bf16_portable_level(isa);
        } else if (*impl == BF16_AVX512 && avx512_usable) {
            kernel = decode_bf16_avx512;
        } else if (*impl == BF16_AMX && amx_usable) {
            kernel = decode_bf16_amx;
        } else {
            PyErr_Format(PyExc_ValueError, "%s: bfloat16 variant %d is not available here",
                         what, *impl);
            return NULL;
        }
    }
    char msg[200];
    if (share_problem(&a, msg, sizeof msg)) {
        PyErr_Format(PyExc_ValueError, "%s: %s", what, msg);
        return NULL;
    }
    if (a.share_groups > 0) {
        a.state = malloc(sizeof(float) * (size_t)a.batch * a.heads * (a.head_dim + 2));
        if (a.state == NULL) return PyErr_NoMemory();
    }
    int threads;
    Py_BEGIN_ALLOW_THREADS;
    threads = kernel(&a);
    Py_END_ALLOW_THREADS;
    free(a.state);
    return PyLong_FromLong(threads);
}

static PyObject *paged_decode_f32(PyObject *self, PyObject *args) {
    (void)self;
    return run_checked(args, "KKKKKKLLLLiiiiiiifii|KKKi", "paged_decode_f32", NULL);
}

static PyObject *paged_decode_bf16(PyObject *self, PyObject *args) {
    (void)self;
    int impl = BF16_AUTO;
    return run_checked(args, "KKKKKKLLLLiiiiiiifiii|KKKi", "paged_decode_bf16", &impl);
}

/* The bfloat16 variants this build and CPU run, best first (the one "auto" takes). */
static PyObject *bf16_variants(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    if (amx_usable) return Py_BuildValue("(sss)", "amx", "avx512bf16", "portable");
    return avx512_usable ? Py_BuildValue("(ss)", "avx512bf16", "portable")
                         : Py_BuildValue("(s)", "portable");
}

static PyObject *isa_levels(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    int built[ISA_LEVELS];
    for (int isa = 0; isa < ISA_LEVELS; isa++) built[isa] = f32_levels[isa] != NULL;
    return isa_levels_usable(built);
}

/* Whether this build has OpenMP (else run_items is single-threaded whatever it is asked). */
static PyObject *threaded(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

/* store_kv_cpu.c: the step's K/V rows into their pool slots, a method of this module. */
PyObject *py_store_kv(PyObject *self, PyObject *args);

static PyMethodDef methods[] = {
    {"paged_decode_f32", paged_decode_f32, METH_VARARGS,
     "paged_decode_f32(q, k, v, tables, lens, out, q_stride_b, q_stride_h, out_stride_b, "
     "out_stride_h, batch, heads, kv_heads, head_dim, block_size, table_width, num_blocks, "
     "scale, num_threads, isa[, starts, share_rows, share_bounds, share_groups]): raw "
     "addresses and sizes, isa the instruction-set level's code (0 baseline, 1 x86-64-v3, 2 "
     "x86-64-v4), then optionally the shared-prefix groups; returns the threads that ran. Use "
     "paged_engine.kernels.paged_decode_cpu."},
    {"paged_decode_bf16", paged_decode_bf16, METH_VARARGS,
     "paged_decode_bf16(paged_decode_f32's arguments to isa, then variant: 0 the best, 1 "
     "portable, 2 avx512bf16, 3 amx, then the optional groups): bfloat16 q, caches and out."},
    {"store_kv", py_store_kv, METH_VARARGS,
     "store_kv(key, key_row_stride, value, value_row_stride, k_cache, v_cache, slots, rows, "
     "row_bytes, num_slots): int64 slots, strides in bytes, negative slots skipped; returns "
     "the rows stored. Use paged_engine.kernels.store_kv_cpu."},
    {"bf16_variants", bf16_variants, METH_NOARGS,
     "bf16_variants(): the names of the bfloat16 variants usable here, best first."},
    {"isa_levels", isa_levels, METH_NOARGS,
     "isa_levels(): the instruction-set levels this build has and this CPU runs, best "
     "first."},
    {"threaded", threaded, METH_NOARGS,
     "threaded(): whether this build runs work items in parallel (OpenMP)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paged_engine._cpu_kernels",
    "Compiled CPU kernels (see csrc/paged_decode_cpu.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    avx512_usable = decode_bf16_avx512_usable(); /* the load-time choice */
    amx_usable = decode_bf16_amx_usable();
    return PyModule_Create(&module);
}
