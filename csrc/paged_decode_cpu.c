/*
 * Paged decode attention on the CPU, float32: one new token per sequence attends over its
 * whole context, read block by block through its block table. The readable reference is
 * paged_engine.kernels.paged_decode_attention.paged_decode_attention_ref; the launcher that
 * checks shapes, strides and dtypes is paged_engine.kernels.paged_decode_cpu.
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
/* Tokens scored before each online-softmax update: at most this many, and never past the
 * end of a block (so with small blocks the accumulator is rescaled once per block). */
#define CHUNK 32

typedef struct {
    const float *q;
    const float *k;
    const float *v;
    const int32_t *tables;
    const int32_t *lens;
    float *out;
    int64_t q_stride_b, q_stride_h, out_stride_b, out_stride_h;
    int batch, heads, kv_heads, head_dim, block_size, table_width, num_blocks;
    float scale;
} Args;

/* One (sequence, kv head): its G query heads against the whole context. D is a constant
 * in the specialised copies below, which lets the compiler unroll and vectorise the dots. */
static inline __attribute__((always_inline)) void decode_head(const Args *a, int b, int kh,
                                                              const int D) {
    const int G = a->heads / a->kv_heads;
    const int BS = a->block_size;
    const int64_t row = (int64_t)a->kv_heads * D; /* floats from one token to the next */
    const int32_t *table = a->tables + (int64_t)b * a->table_width;
    const int len = a->lens[b];

    float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][CHUNK];
    float m[MAX_GROUP], l[MAX_GROUP];
    int head[MAX_GROUP];
    for (int i = 0; i < G; i++) {
        head[i] = kh * G + i; /* query head h reads kv head h / G */
        const float *qq = a->q + b * a->q_stride_b + head[i] * a->q_stride_h;
        for (int x = 0; x < D; x++) {
            qs[i][x] = qq[x] * a->scale;
            acc[i][x] = 0.f;
        }
        m[i] = -FLT_MAX;
        l[i] = 0.f;
    }
    for (int t0 = 0; t0 < len;) {
        const int off = t0 % BS;
        int n = BS - off;
        if (n > CHUNK) n = CHUNK;
        if (n > len - t0) n = len - t0;
        const int64_t base = ((int64_t)table[t0 / BS] * BS + off) * row + (int64_t)kh * D;
        const float *kr = a->k + base, *vr = a->v + base;
        for (int t = 0; t < n; t++, kr += row)
            for (int i = 0; i < G; i++) {
                float dot = 0.f;
                for (int x = 0; x < D; x++) dot += qs[i][x] * kr[x];
                s[i][t] = dot;
            }
        for (int i = 0; i < G; i++) {
            float top = m[i];
            for (int t = 0; t < n; t++) top = s[i][t] > top ? s[i][t] : top;
            const float rescale = expf(m[i] - top);
            float sum = 0.f;
            for (int t = 0; t < n; t++) {
                s[i][t] = expf(s[i][t] - top);
                sum += s[i][t];
            }
            l[i] = l[i] * rescale + sum;
            m[i] = top;
            for (int x = 0; x < D; x++) acc[i][x] *= rescale;
        }
        for (int t = 0; t < n; t++, vr += row)
            for (int i = 0; i < G; i++) {
                const float p = s[i][t];
                for (int x = 0; x < D; x++) acc[i][x] += p * vr[x];
            }
        t0 += n;
    }
    for (int i = 0; i < G; i++) {
        float *o = a->out + b * a->out_stride_b + head[i] * a->out_stride_h;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f; /* an empty context gives zeros */
        for (int x = 0; x < D; x++) o[x] = acc[i][x] * inv;
    }
}

/* On x86-64 with GCC, each specialised copy is also built for AVX2+FMA (x86-64-v3) and
 * picked at load time when the CPU has it; elsewhere the compiler's baseline is used. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define DEFINE_DECODE(NAME, DIM)                                                          \
    CLONES static void NAME(const Args *a) {                                              \
        for (int b = 0; b < a->batch; b++)                                                \
            for (int kh = 0; kh < a->kv_heads; kh++) decode_head(a, b, kh, DIM);          \
    }

DEFINE_DECODE(decode_d16, 16)
DEFINE_DECODE(decode_d32, 32)
DEFINE_DECODE(decode_d64, 64)
DEFINE_DECODE(decode_d128, 128)
DEFINE_DECODE(decode_any, a->head_dim)

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

static PyObject *paged_decode_f32(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, tables, lens, out;
    Args a;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLiiiiiiif", &q, &k, &v, &tables, &lens, &out,
                          &a.q_stride_b, &a.q_stride_h, &a.out_stride_b, &a.out_stride_h,
                          &a.batch, &a.heads, &a.kv_heads, &a.head_dim, &a.block_size,
                          &a.table_width, &a.num_blocks, &a.scale))
        return NULL;
    if (a.kv_heads <= 0 || a.heads % a.kv_heads || a.heads / a.kv_heads > MAX_GROUP ||
        a.head_dim <= 0 || a.head_dim > MAX_DIM || a.block_size <= 0 || a.batch < 0) {
        PyErr_SetString(PyExc_ValueError, "paged_decode_f32: unsupported geometry");
        return NULL;
    }
    a.q = (const float *)(uintptr_t)q;
    a.k = (const float *)(uintptr_t)k;
    a.v = (const float *)(uintptr_t)v;
    a.tables = (const int32_t *)(uintptr_t)tables;
    a.lens = (const int32_t *)(uintptr_t)lens;
    a.out = (float *)(uintptr_t)out;
    int bad_block;
    const int bad = first_bad_sequence(&a, &bad_block);
    if (bad >= 0) {
        if (bad_block < 0)
            PyErr_Format(PyExc_ValueError,
                         "paged_decode_f32: sequence %d has length %d, beyond its block "
                         "table (%d blocks of %d)",
                         bad, a.lens[bad], a.table_width, a.block_size);
        else
            PyErr_Format(PyExc_ValueError,
                         "paged_decode_f32: sequence %d reads block table entry %d = %d, "
                         "outside the pool of %d blocks",
                         bad, bad_block, a.tables[(int64_t)bad * a.table_width + bad_block],
                         a.num_blocks);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    switch (a.head_dim) {
        case 16: decode_d16(&a); break;
        case 32: decode_d32(&a); break;
        case 64: decode_d64(&a); break;
        case 128: decode_d128(&a); break;
        default: decode_any(&a); break;
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"paged_decode_f32", paged_decode_f32, METH_VARARGS,
     "paged_decode_f32(q, k, v, tables, lens, out, q_stride_b, q_stride_h, out_stride_b, "
     "out_stride_h, batch, heads, kv_heads, head_dim, block_size, table_width, num_blocks, "
     "scale): raw addresses and sizes; use paged_engine.kernels.paged_decode_cpu."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paged_engine._cpu_kernels",
    "Compiled CPU kernels (see csrc/paged_decode_cpu.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
