/*
 * The bfloat16 variants of the paged decode kernel (paged_decode_head.h): q, K/V and out in
 * bfloat16, everything in between float32. Three instantiations:
 *
 * - portable: each bfloat16 widened to float32 (a 16-bit shift, exact) and multiplied in
 *   float32. Plain C, one copy per instruction-set level up to x86-64-v3 (isa.h; the
 *   launcher picks the level, as for the float32 kernel). No v4 copy: AVX-512 CPUs with
 *   bfloat16 instructions take the avx512 variant, and no v4 copy was measured.
 * - avx512: the Q.K dot products with AVX512-BF16's VDPBF16PS, which multiplies bfloat16
 *   pairs exactly and accumulates in float32 (32 products per instruction, no widening);
 *   each dot's 16 lanes are added up together with 15 other tokens' (sum16); and, in runs
 *   of kv heads, P @ V for a GQA group's heads together, each V row widened once per group
 *   rather than once per head (pv_group_avx512).
 *   Compiled for that target alone (a pragma, not a global -march flag), so the build runs
 *   anywhere; decode_bf16_avx512_usable() asks the CPU before it is ever called. The
 *   dispatcher (paged_decode_cpu.c) takes it for head_dim >= 32 only.
 * - amx (paged_decode_amx.h, included in the avx512 section): the avx512 copy with its Q.K
 *   scores on AMX tiles, 16 tokens of a kv head at a time.
 *
 * VDPBF16PS treats bfloat16 denormals as zero; a denormal K or q element (below 1.2e-38)
 * contributes 0 instead of at most 1e-38 to a score: nothing a softmax can see.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"
#include "paged_decode_cpu.h"

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even (torch's rounding); a NaN stays a (quiet) NaN. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __attribute__((always_inline)) float dot_widened(const float *qs,
                                                               const uint16_t *k, int D) {
    float dot = 0.f;
    for (int x = 0; x < D; x++) dot += qs[x] * bf16_to_f32(k[x]);
    return dot;
}

#define DH_ELEM uint16_t
#define DH_TO_F32(e) bf16_to_f32(e)
#define DH_FROM_F32(f) f32_to_bf16(f)
#define DH_DOT(qs, qe, k, D, scale) dot_widened(qs, k, D)
#define DH_NAME(x) x##_bf16_portable
#define DH_ATTR
#include "paged_decode_head.h"
#ifdef HAVE_X86_LEVELS
#define DH_NAME(x) x##_bf16_portable_v3
#define DH_ATTR ATTR_X86_64_V3
#include "paged_decode_head.h"
#endif

Kernel decode_bf16_portable_level(int isa) {
#ifdef HAVE_X86_LEVELS
    if (isa >= ISA_X86_64_V3) return decode_bf16_portable_v3;
#endif
    (void)isa;
    return decode_bf16_portable;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define HAVE_AVX512_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
#include <immintrin.h>

/* The lane sums of 16 vectors as one vector: lane 4k + l of the result is the sum of v[4l + k]
 * (a 4 x 4 transpose, which sums_dpbf16 undoes by where it puts each token). Four rounds,
 * each adding two shuffles of a pair: 15 additions and 30 shuffles for 16 sums, where 16
 * horizontal sums take about 4 shuffles and 4 additions each. Each lane's sum is the same
 * tree whatever the other vectors hold: lanes i and i + 8, then + 4, + 2, + 1. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 c[8], e[4], g[2];
    for (int p = 0; p < 8; p++) /* blocks of 4 lanes: v[2p]'s halves folded, then v[2p+1]'s */
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++) /* block j: the vector 4r + j, folded to 4 lanes */
        e[r] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * r], c[2 * r + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * r], c[2 * r + 1], 0xDD));
    for (int w = 0; w < 2; w++) /* in block j, lanes 0-1: vector 8w + j, lanes 2-3: 8w + 4 + j */
        g[w] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * w], e[2 * w + 1], 0x44),
                             _mm512_shuffle_ps(e[2 * w], e[2 * w + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
}

/* One head's dot product against one K row, unfinished: 32 bfloat16 pairs per VDPBF16PS
 * into 16 float32 lanes, a masked load for a tail of fewer than 32 elements (reading
 * nothing past the row); sums_dpbf16 adds the lanes up, 16 tokens' at once. */
static inline __attribute__((always_inline)) __m512 part_dpbf16(const uint16_t *q,
                                                                const uint16_t *k, int D) {
    __m512 acc = _mm512_setzero_ps();
    int x = 0;
    for (; x + 32 <= D; x += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + x),
                               (__m512bh)_mm512_loadu_si512(k + x));
    if (x < D) {
        const __mmask32 tail = (__mmask32)((1u << (D - x)) - 1u);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, q + x),
                               (__m512bh)_mm512_maskz_loadu_epi16(tail, k + x));
    }
    return acc;
}

/* n <= 16 tokens' scores from their unfinished dots: sum16 over them (zeros past n, never
 * stored), each put where sum16's transpose brings its sum back to lane u. */
static inline __attribute__((always_inline)) void sums_dpbf16(const __m512 *parts, int n,
                                                              float scale, float *out) {
    __m512 v[16];
    for (int p = 0; p < 16; p++) {
        const int u = 4 * (p % 4) + p / 4; /* the token whose sum lands in lane u */
        v[p] = u < n ? parts[u] : _mm512_setzero_ps();
    }
    const __m512 sums = _mm512_mul_ps(sum16(v), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1u), sums);
}

/* P @ V for the G query heads of one kv head over a chunk of n tokens (DH_PV_GROUP, in runs
 * of kv heads): each V row widened to float32 once for all G heads, where the template's
 * head-by-head loop widens it once per head (docs/performance.md has the A/B of the two).
 * Element x of head i still gets acc[x] += p[i][t] * v[t][x], one fused multiply-add per
 * token in token order: decode_head's sums, bit for bit. D is 64 or 128, G 2 to 4. */
static inline __attribute__((always_inline)) void pv_group_avx512(float *acc,
                                                                  const float (*p)[CHUNK],
                                                                  const uint16_t *v,
                                                                  int64_t row, int n,
                                                                  const int D, const int G) {
    for (int c = 0; c < D; c += 64) { /* 64 dims at a time: 4 x G accumulators */
        __m512 a[4][4];
        for (int i = 0; i < G; i++)
            for (int k = 0; k < 4; k++)
                a[i][k] = _mm512_loadu_ps(acc + i * D + c + 16 * k);
        const uint16_t *vv = v + c;
        for (int t = 0; t < n; t++, vv += row) {
            __m512 x[4]; /* bfloat16 bits in a float's upper half: exact */
            for (int k = 0; k < 4; k++) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(vv + 16 * k));
                x[k] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
            for (int i = 0; i < G; i++) {
                const __m512 pt = _mm512_set1_ps(p[i][t]);
                for (int k = 0; k < 4; k++) a[i][k] = _mm512_fmadd_ps(pt, x[k], a[i][k]);
            }
        }
        for (int i = 0; i < G; i++)
            for (int k = 0; k < 4; k++)
                _mm512_storeu_ps(acc + i * D + c + 16 * k, a[i][k]);
    }
}

#undef DH_DOT /* unused: DH_PART scores */
#define DH_PV_GROUP(acc, p, v, row, n, D, G) pv_group_avx512(acc, p, v, row, n, D, G)
#define DH_PART __m512
#define DH_PARTS_N 16
#define DH_PART_DOT(qe, k, D) part_dpbf16(qe, k, D)
#define DH_PART_SUMS(parts, n, scale, out) sums_dpbf16(parts, n, scale, out)
#define DH_RAW_Q
#define DH_NAME(x) x##_bf16_avx512
#define DH_ATTR
#include "paged_decode_head.h"
#undef DH_PART
#undef DH_PARTS_N
#undef DH_PART_DOT
#undef DH_PART_SUMS

#include "paged_decode_amx.h"

#undef DH_RAW_Q
#undef DH_PV_GROUP

#pragma GCC pop_options
#endif
#undef DH_ELEM
#undef DH_TO_F32
#undef DH_FROM_F32
#undef DH_DOT

int decode_bf16_avx512_usable(void) {
#ifdef HAVE_AVX512_BF16
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

#ifndef HAVE_AVX512_BF16
int decode_bf16_avx512(const Args *a) { return decode_bf16_portable(a); }
#endif
#ifndef HAVE_AMX_BF16
int decode_bf16_amx_usable(void) { return 0; }
int decode_bf16_amx(const Args *a) { return decode_bf16_avx512(a); }
#endif
