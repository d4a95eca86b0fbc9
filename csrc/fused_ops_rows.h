/*
 * The fused small ops' rows (fused_ops.c's header comment says what each op is and why its
 * numerics are torch's): the element helpers, and each op as a function over rows
 * [begin, end) of a call, compiled once per instruction-set level (LEVELS, levels.h).
 * fused_ops.c holds the Python entry points that check a call's arguments and run these
 * rows over threads; qk_norm_rope's rows are in fused_ops_rope.h, which includes this.
 */
#ifndef PAGED_ENGINE_FUSED_OPS_ROWS_H
#define PAGED_ENGINE_FUSED_OPS_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* One torch lane-vector of floats: 4, 8 or 16 lanes (GCC's and clang's vector extension,
 * lowered to whatever registers the level has), or a single float for rows shorter than
 * one vector. Element-wise + and * on them are each lane's IEEE float ops: no order changes
 * (EXACT_FP_BEGIN keeps contraction off), so a lane's sums are the scalar loop's bits. */
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x1;

/* acc += the squares of x's L-wide unit `unit`. A macro, not a function returning a vector:
 * the baseline copy would return 32- and 64-byte vectors without AVX, which GCC warns
 * changes the ABI. */
#define ADD_SQUARES(L, acc, x, unit)                                                        \
    do {                                                                                    \
        f32x##L v_;                                                                         \
        memcpy(&v_, (x) + (unit) * L, sizeof v_);                                           \
        (acc) += v_ * v_;                                                                   \
    } while (0)

/* lane_sums_<L>: the L lane partials of sum(x^2) over `units` consecutive L-wide units of
 * x, before they are added up, in the order of torch's multi_row_sum and row_sum:
 * - the units in groups of 4 (k = 0..3), a running sum per (k, lane) of each group's
 *   squares, carried up 4 levels every `step` groups so that only partial sums of similar
 *   size are added (levels above 0 stay zero below `step` groups, so they are not added:
 *   x + 0 == x for the non-negative sums here);
 * - the units past the last whole group, into k = 0's sum;
 * - each lane's 4 partials added in order of k.
 * The accumulators are vector locals, 16 of them, that the compiler keeps in registers
 * where the level has enough (stack arrays indexed by lane made each row's carries and its
 * final adds a chain of scalar stores and vector reloads). */
#define DEFINE_LANE_SUMS(L)                                                                 \
    INLINE void lane_sums_##L(const float *x, int64_t units, float out[MAX_LANES]) {        \
        const f32x##L zero = {0};                                                           \
        const int64_t size = units / 4;                                                     \
        const int64_t log2 = size <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)size - 1);      \
        const int64_t power = log2 / 4 > 4 ? log2 / 4 : 4;                                  \
        const int64_t step = (int64_t)1 << power, mask = step - 1;                          \
        f32x##L a[4] = {zero, zero, zero, zero}, b[4] = {zero, zero, zero, zero};           \
        f32x##L c[4] = {zero, zero, zero, zero}, d[4] = {zero, zero, zero, zero};           \
        int64_t i = 0;                                                                      \
        while (i + step <= size) {                                                          \
            for (int64_t j = 0; j < step; j++, i++)                                         \
                for (int k = 0; k < 4; k++) ADD_SQUARES(L, a[k], x, i * 4 + k);             \
            for (int k = 0; k < 4; k++) b[k] += a[k], a[k] = zero;                          \
            if (i & (mask << power)) continue;                                              \
            for (int k = 0; k < 4; k++) c[k] += b[k], b[k] = zero;                          \
            if (i & (mask << 2 * power)) continue;                                          \
            for (int k = 0; k < 4; k++) d[k] += c[k], c[k] = zero;                          \
        }                                                                                   \
        for (; i < size; i++)                                                               \
            for (int k = 0; k < 4; k++) ADD_SQUARES(L, a[k], x, i * 4 + k);                 \
        if (size >= step)                                                                   \
            for (int k = 0; k < 4; k++) a[k] += b[k], a[k] += c[k], a[k] += d[k];           \
        for (int64_t u = size * 4; u < units; u++) ADD_SQUARES(L, a[0], x, u);              \
        f32x##L sum = a[0] + a[1];                                                          \
        sum += a[2];                                                                        \
        sum += a[3];                                                                        \
        memcpy(out, &sum, sizeof sum);                                                      \
    }

DEFINE_LANE_SUMS(1)
DEFINE_LANE_SUMS(4)
DEFINE_LANE_SUMS(8)
DEFINE_LANE_SUMS(16)

/* sum_squares' L lane partials for a row of n >= L floats (lane_sums over its whole L-wide
 * vectors; the elements past the last one are not in them). L: 4, 8 or 16, a constant at
 * each call site, so the branch folds away. */
INLINE void lane_partials(const float *x, int64_t n, const int L, float out[MAX_LANES]) {
    if (L == 4)
        lane_sums_4(x, n / 4, out);
    else if (L == 8)
        lane_sums_8(x, n / 8, out);
    else
        lane_sums_16(x, n / 16, out);
}

/* The squares of the elements past the last whole L-wide vector, one by one: where torch's
 * sum starts before it adds the lanes. */
INLINE float tail_squares(const float *x, int64_t n, const int L) {
    float total = 0.f;
    for (int64_t i = n / L * L; i < n; i++) total += x[i] * x[i];
    return total;
}

/* sum(x^2) over n floats, in torch's order for a contiguous row (its row_sum over L-wide
 * vectors, 4 interleaved, then the leftover elements, then the lanes one by one; a row
 * shorter than one vector: the same over single elements). */
INLINE float sum_squares(const float *x, int64_t n, const int L) {
    if (n < L) {
        float one[MAX_LANES];
        lane_sums_1(x, n, one);
        return one[0];
    }
    float lanes[MAX_LANES];
    lane_partials(x, n, L, lanes);
    float total = tail_squares(x, n, L);
    for (int l = 0; l < L; l++) total += lanes[l];
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

EXACT_FP_END

typedef struct {
    const void *x;
    void *out;
    int64_t xs, os, d;
} SiluArgs;

/* silu(g) * u with g the first d columns of a row and u the next d; fast-math (outside the
 * exact section: fused_ops.c's header comment). In bfloat16 silu's result is rounded before
 * the multiply, as torch's two ops round it. The exponent is capped at 88 (expf(88) ~
 * 1.7e38, finite): fast-math's refined reciprocal of an infinite 1 + exp(-g) is NaN, where
 * torch gets -0; capped, g < -88 gives a |silu| below 6e-37 instead. */
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

#endif
