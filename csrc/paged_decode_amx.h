/*
 * The "amx" bfloat16 variant of the decode kernel: the avx512 copy (paged_decode_bf16.c) with
 * its Q.K scores computed on Intel's AMX tiles. Included once, by paged_decode_bf16.c, inside
 * its AVX512-BF16 section (whose helpers it reuses: P @ V is pv_group_avx512's), with
 * DH_ELEM and DH_RAW_Q still defined.
 *
 * Why: in cache the avx512 copy is bound by its arithmetic, and most of it is the scoring
 * (VDPBF16PS into 16 lanes, then the lanes of 16 tokens added together, partial sums through
 * the stack). One TDPBF16PS multiplies 16 K rows by up to 16 query heads' 32 elements in a
 * unit beside the vector ones (bench/amx_qk_probe.c measures the two ways alone;
 * docs/performance.md). Per kv head and 16 tokens: C[16 tokens][G heads] = A x B, with A
 * the K rows as the pool lays them (16 rows of 32 elements, the row stride given to the
 * load) and B the G query heads arranged once per item into pairs of elements (AMX's
 * layout for B: row r holds elements 2r and 2r + 1 of each head), D / 32 products per
 * kv head, then each head's 16 scores gathered out of C and scaled.
 *
 * Numerics: every product of two bfloat16 is exact in float32 and the sums are float32, as
 * in the other variants; only their order differs (and AMX, like VDPBF16PS, treats
 * denormal inputs as zero). The precision contract in paged_decode_head.h holds unchanged.
 *
 * Where: head dims that are multiples of 64 (two tile pairs in turn) and blocks of a
 * multiple of 16 tokens. A tile load reads 16 K rows, also past the last token of a short
 * chunk; with such blocks every chunk starts at a multiple of 16 within its block, so those
 * rows lie in the block (unused slots: their scores are dropped, and each row of C depends
 * on its own row of A alone). decode_bf16_amx runs the avx512 copy for every other call.
 * The OS must grant the process tile data (Linux's arch_prctl), asked once, when the module
 * loads (decode_bf16_amx_usable); a tile configuration is loaded per item, on the thread
 * that runs it, and released at the item's end.
 */
#if defined(__linux__) && __GNUC__ >= 12
#define HAVE_AMX_BF16 1
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) AmxConfig;

/* The item's query heads into B's layout (qt: per kv head j and 32-element slice c, 16 rows
 * of G pairs), and the tiles configured: 0 is C (16 x G float32), 1 and 3 A (16 x 32
 * bfloat16), 2 and 4 B (16 x G pairs). */
static inline __attribute__((always_inline)) void amx_begin(uint16_t *qt, const uint16_t *qe,
                                                            int hstride, int nkv, int D,
                                                            int G) {
    const int slices = D / 32;
    for (int j = 0; j < nkv; j++)
        for (int c = 0; c < slices; c++)
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < G; i++)
                    for (int e = 0; e < 2; e++)
                        qt[(((j * slices + c) * 16 + r) * G + i) * 2 + e] =
                            qe[(j * G + i) * hstride + 32 * c + 2 * r + e];
    AmxConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)(t == 1 || t == 3 ? 64 : G * 4);
    }
    _tile_loadconfig(&cfg);
}

/* Tokens t .. t + m - 1 of kv head j (K rows at k, row elements apart) for its G heads:
 * s[i][t + u] = q_i . k_u * scale. */
static inline __attribute__((always_inline)) void amx_scores(const uint16_t *qt, int j,
                                                             const uint16_t *k, int64_t row,
                                                             int m, int D, int G, float scale,
                                                             float (*s)[CHUNK], int t) {
    const int slices = D / 32;
    const uint16_t *b = qt + (int64_t)j * slices * 16 * G * 2;
    float c[16 * MAX_GROUP];
    _tile_zero(0);
    for (int sl = 0; sl < slices; sl += 2) {
        _tile_loadd(1, k + 32 * sl, row * 2);
        _tile_loadd(2, b + (int64_t)sl * 16 * G * 2, G * 4);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(3, k + 32 * sl + 32, row * 2);
        _tile_loadd(4, b + (int64_t)(sl + 1) * 16 * G * 2, G * 4);
        _tile_dpbf16ps(0, 3, 4);
    }
    _tile_stored(0, c, G * 4);
    /* head i's scores are every G-th float of C from i: for a group of 2, the even and the
     * odd floats of two vectors (a permute each); otherwise a gather each */
    const __mmask16 keep = (__mmask16)((1u << m) - 1u);
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    if (G == 2) {
        const __m512 lo = _mm512_loadu_ps(c), hi = _mm512_loadu_ps(c + 16);
        const __m512i even = _mm512_add_epi32(lane, lane);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        _mm512_mask_storeu_ps(s[0] + t, keep, _mm512_mul_ps(_mm512_permutex2var_ps(lo, even, hi), sc));
        _mm512_mask_storeu_ps(s[1] + t, keep, _mm512_mul_ps(_mm512_permutex2var_ps(lo, odd, hi), sc));
        return;
    }
    const __m512i every = _mm512_mullo_epi32(lane, _mm512_set1_epi32(G));
    for (int i = 0; i < G; i++)
        _mm512_mask_storeu_ps(s[i] + t, keep, _mm512_mul_ps(_mm512_i32gather_ps(every, c + i, 4), sc));
}

#define DH_TILES
#define DH_TILES_BEGIN(qt, qe, hstride, nkv, D, G) amx_begin(qt, qe, hstride, nkv, D, G)
#define DH_TILES_SCORES(qt, j, k, row, m, D, G, scale, s, t) \
    amx_scores(qt, j, k, row, m, D, G, scale, s, t)
#define DH_TILES_END() _tile_release()
#define DH_NAME(x) x##_bf16_amx_tiles
#define DH_ATTR
#include "paged_decode_head.h"
#undef DH_TILES
#undef DH_TILES_BEGIN
#undef DH_TILES_SCORES
#undef DH_TILES_END

/* CPUID says AMX-BF16 and AMX-TILE, the OS saves tile state (XCR0 bits 17 and 18), the
 * avx512 copy runs, and the OS grants this process tile data. */
int decode_bf16_amx_usable(void) {
    unsigned a, b, c, d;
    if (!decode_bf16_avx512_usable() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

int decode_bf16_amx(const Args *a) {
    if (a->block_size % 16 || a->head_dim % 64) return decode_bf16_avx512(a);
    return decode_bf16_amx_tiles(a);
}

#pragma GCC pop_options
#endif
