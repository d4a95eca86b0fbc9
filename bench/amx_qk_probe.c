/*
 * A probe, not product code: how fast a decode step's Q.K scores are on AMX tiles, next to
 * the way the AVX512-BF16 decode copy computes them (csrc/paged_decode_bf16.c), on the same
 * bfloat16 K rows in cache, the scoring alone (the kernel's "amx" variant,
 * csrc/paged_decode_amx.h, was built after it). bench/test_amx_qk_probe_bench.py compiles and runs it on
 * CPUs with AMX-BF16 and reports its JSON line.
 *
 * Both ways score T tokens (rows of kv_heads x D bfloat16, as a pool block lays them) against
 * a sequence's kv_heads x G query heads:
 * - "dpbf16": per token and head, VDPBF16PS over the head's D elements into 16 lanes, then the
 *   lanes of 16 tokens added together (the decode copy's part_dpbf16 and sum16);
 * - "amx": per kv head and 16 tokens, C[16 tokens][G heads] = K rows (tile A: 16 rows of 32
 *   elements, read in place with the row stride) times the G heads' q (tile B, pairs of
 *   elements, arranged once), one TDPBF16PS per 32 elements, then each head's 16 scores
 *   gathered out of C (D a multiple of 64: two tile pairs in turn).
 * Each is timed over the same rows (fastest of ROUNDS), and checked against a double-precision
 * reference: both must be within fp32 rounding of it.
 *
 * Built per geometry (-DKVH=4 -DG=2 -DD=64: constants, as the decode copies specialise theirs,
 * so that both ways' loops unroll); usage: amx_qk_probe TOKENS. Prints one JSON line.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ROUNDS 200
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if !defined(KVH) || !defined(G) || !defined(D)
#error "build with -DKVH=... -DG=... -DD=... (kv heads, query heads per kv head, head dim)"
#endif
#if G < 1 || G > 16 || KVH * G > 64 || D % 64 || D < 64
#error "geometry out of range"
#endif
static int T;

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

/* 16 vectors' lane sums in one vector (the decode copy's sum16; lane order transposed). */
AVX512 static inline __m512 sum16(const __m512 *v) {
    __m512 c[8], e[4], g[2];
    for (int p = 0; p < 8; p++)
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++)
        e[r] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * r], c[2 * r + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * r], c[2 * r + 1], 0xDD));
    for (int w = 0; w < 2; w++)
        g[w] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * w], e[2 * w + 1], 0x44),
                             _mm512_shuffle_ps(e[2 * w], e[2 * w + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88),
                         _mm512_shuffle_ps(g[0], g[1], 0xDD));
}

AVX512 __attribute__((noinline)) static void scores_dpbf16(const uint16_t *K, const uint16_t *q,
                                                           float *s) {
    const int H = KVH * G, row = KVH * D;
    __m512 part[64][16];
    for (int t = 0; t < T; t += 16) {
        for (int u = 0; u < 16; u++)
            for (int h = 0; h < H; h++) {
                const uint16_t *k = K + (int64_t)(t + u) * row + (h / G) * D;
                __m512 acc = _mm512_setzero_ps();
                for (int x = 0; x < D; x += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + h * D + x),
                                           (__m512bh)_mm512_loadu_si512(k + x));
                part[h][u] = acc;
            }
        for (int h = 0; h < H; h++) {
            __m512 v[16];
            for (int p = 0; p < 16; p++) v[p] = part[h][4 * (p % 4) + p / 4];
            _mm512_storeu_ps(s + (int64_t)h * T + t, sum16(v));
        }
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* qv: per kv head j and 32-element slice c, 16 rows (element pairs 2r, 2r + 1) of G pairs. */
AMX __attribute__((noinline)) static void scores_amx(const uint16_t *K, const uint16_t *qv,
                                                     float *s) {
    const int row = KVH * D, slices = D / 32;
    float c[16 * 16];
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = (uint16_t)(G * 4); /* C: 16 tokens x G float32 */
    cfg.rows[1] = 16, cfg.colsb[1] = 64;                /* A: 16 K rows x 32 elements */
    cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(G * 4); /* B: 16 pairs x G heads */
    cfg.rows[3] = 16, cfg.colsb[3] = 64;                /* A and B again, for odd slices */
    cfg.rows[4] = 16, cfg.colsb[4] = (uint16_t)(G * 4);
    _tile_loadconfig(&cfg);
    for (int t = 0; t < T; t += 16)
        for (int j = 0; j < KVH; j++) {
            _tile_zero(0);
            for (int sl = 0; sl < slices; sl += 2) { /* two tile pairs in turn (D % 64 == 0) */
                _tile_loadd(1, K + (int64_t)t * row + j * D + 32 * sl, row * 2);
                _tile_loadd(2, qv + (int64_t)(j * slices + sl) * 16 * G * 2, G * 4);
                _tile_dpbf16ps(0, 1, 2);
                _tile_loadd(3, K + (int64_t)t * row + j * D + 32 * sl + 32, row * 2);
                _tile_loadd(4, qv + (int64_t)(j * slices + sl + 1) * 16 * G * 2, G * 4);
                _tile_dpbf16ps(0, 3, 4);
            }
            _tile_stored(0, c, G * 4);
            /* head i's 16 scores are every G-th float of C from i: one gather each */
            const __m512i every = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8,
                                                                      7, 6, 5, 4, 3, 2, 1, 0),
                                                     _mm512_set1_epi32(G));
            for (int i = 0; i < G; i++)
                _mm512_storeu_ps(s + (int64_t)(j * G + i) * T + t,
                                 _mm512_i32gather_ps(every, c + i, 4));
        }
    _tile_release();
}

int main(int argc, char **argv) {
    if (argc != 2) return fprintf(stderr, "usage: %s TOKENS\n", argv[0]), 2;
    T = atoi(argv[1]);
    if (T % 16 || T < 16) return fprintf(stderr, "TOKENS must be a multiple of 16\n"), 2;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
        return fprintf(stderr, "the kernel refused AMX tile data\n"), 3;
    const int H = KVH * G, row = KVH * D;
    uint16_t *K = malloc((size_t)T * row * 2), *q = malloc((size_t)H * D * 2);
    uint16_t *qv = malloc((size_t)H * D * 2);
    float *s1 = malloc((size_t)H * T * 4), *s2 = malloc((size_t)H * T * 4);
    srand(1);
    for (int64_t i = 0; i < (int64_t)T * row; i++) K[i] = to_bf16((rand() / (float)RAND_MAX - 0.5f) * 4);
    for (int i = 0; i < H * D; i++) q[i] = to_bf16((rand() / (float)RAND_MAX - 0.5f) * 4);
    for (int j = 0; j < KVH; j++)
        for (int sl = 0; sl < D / 32; sl++)
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < G; i++)
                    for (int e = 0; e < 2; e++)
                        qv[(((int64_t)(j * (D / 32) + sl) * 16 + r) * G + i) * 2 + e] =
                            q[(j * G + i) * D + 32 * sl + 2 * r + e];
    double best1 = 1e9, best2 = 1e9;
    for (int r = 0; r < ROUNDS; r++) {
        const double t0 = now();
        scores_dpbf16(K, q, s1);
        const double t1 = now();
        scores_amx(K, qv, s2);
        const double t2 = now();
        best1 = t1 - t0 < best1 ? t1 - t0 : best1;
        best2 = t2 - t1 < best2 ? t2 - t1 : best2;
    }
    double err1 = 0, err2 = 0, size = 0;
    int64_t same = 0;
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) {
            double ref = 0;
            for (int x = 0; x < D; x++)
                ref += (double)from_bf16(q[h * D + x]) * from_bf16(K[(int64_t)t * row + (h / G) * D + x]);
            const float a = s1[(int64_t)h * T + t], b = s2[(int64_t)h * T + t];
            err1 = fmax(err1, fabs(a - ref)), err2 = fmax(err2, fabs(b - ref));
            size = fmax(size, fabs(ref));
            same += a == b;
        }
    printf("{\"kv_heads\": %d, \"group\": %d, \"head_dim\": %d, \"tokens\": %d, "
           "\"dpbf16_ns_per_token\": %.3f, \"amx_ns_per_token\": %.3f, "
           "\"max_abs_err_dpbf16\": %.3g, \"max_abs_err_amx\": %.3g, \"max_abs_score\": %.3g, "
           "\"same_bits\": %lld, \"scores\": %lld}\n",
           KVH, G, D, T, best1 * 1e9 / T, best2 * 1e9 / T, err1, err2, size, (long long)same,
           (long long)H * T);
    return 0;
}
