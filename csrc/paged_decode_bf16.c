/*
 * The bfloat16 variants of the paged decode kernel (paged_decode_head.h): q, K/V and out in
 * bfloat16, everything in between float32. Two instantiations:
 *
 * - portable: each bfloat16 widened to float32 (a 16-bit shift, exact) and multiplied in
 *   float32. Plain C, one copy per instruction-set level up to x86-64-v3 (isa.h; the
 *   launcher picks the level, as for the float32 kernel). No v4 copy: AVX-512 CPUs with
 *   bfloat16 instructions take the avx512 variant, and no v4 copy was measured.
 * - avx512: the Q.K dot products with AVX512-BF16's VDPBF16PS, which multiplies bfloat16
 *   pairs exactly and accumulates in float32 (32 products per instruction, no widening).
 *   Compiled for that target alone (a pragma, not a global -march flag), so the build runs
 *   anywhere; decode_bf16_avx512_usable() asks the CPU before it is ever called. The
 *   dispatcher (paged_decode_cpu.c) takes it for head_dim >= 32 only.
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

/* 32 bfloat16 pairs per VDPBF16PS into 16 float32 lanes; a masked load takes a tail of
 * fewer than 32 elements (reading nothing past the row), then one horizontal sum. */
static inline __attribute__((always_inline)) float dot_dpbf16(const uint16_t *q,
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
    return _mm512_reduce_add_ps(acc);
}

#undef DH_DOT
#define DH_DOT(qs, qe, k, D, scale) (dot_dpbf16(qe, k, D) * (scale))
#define DH_RAW_Q
#define DH_NAME(x) x##_bf16_avx512
#define DH_ATTR
#include "paged_decode_head.h"
#undef DH_RAW_Q

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
