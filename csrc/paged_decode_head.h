/*
 * The decode kernel, written once and instantiated per element type and instruction set
 * (C's generics: this file has no include guard and is included once per copy, with the
 * macros below defined). It undefines DH_NAME and DH_ATTR at the end; the element macros
 * stay, so that a file instantiates one element type at several levels (isa.h) and
 * undefines them itself.
 *
 *   DH_NAME(x)      the variant's name for x (decode_head_f32, decode_bf16_avx512, ...)
 *   DH_ELEM         the element type of q, K, V and out (float, or uint16_t bfloat16 bits)
 *   DH_TO_F32(e)    an element as float (exact for both types)
 *   DH_FROM_F32(f)  a float as an element (round to nearest even for bfloat16)
 *   DH_DOT(qs, qe, k, D, scale)  one query head's score against one K row, in float32
 *                   (not read where DH_PART is defined):
 *                   qs is the head as floats times scale, qe the head's elements (unscaled,
 *                   so the dot must apply scale itself), k the K row's elements
 *   DH_ATTR         attributes of the specialised copies (a level's target, or nothing)
 *   DH_RAW_Q        defined when DH_DOT or DH_PART_DOT reads qe (q's elements, on the stack)
 *   DH_PART         optional, with DH_RAW_Q: scores in two halves, so that the last step of
 *                   each dot product (a horizontal sum) is done for DH_PARTS_N tokens at once.
 *                   DH_PART_DOT(qe, k, D) is one head's unfinished dot against one K row (a
 *                   DH_PART); DH_PART_SUMS(parts, n, scale, out) finishes n <= DH_PARTS_N of
 *                   them into out[0 .. n), times scale, each score's bits independent of n
 *                   and of the others. The K rows are still read token after token.
 *   DH_TILES        optional, with DH_RAW_Q, in place of DH_PART: the scores of 16 tokens
 *                   of one kv head for its G query heads at once in a tile unit (AMX).
 *                   DH_TILES_BEGIN(qt, qe, hstride, nkv, D, G) once per item, on the thread
 *                   that runs it (the heads' q, hstride elements apart, arranged into qt; the
 *                   unit configured), DH_TILES_SCORES(qt, j, k, row, m, D, G, scale, s, t)
 *                   for kv head j (its K rows at k) and tokens t .. t + m - 1 (m <= 16) into
 *                   s[i][t ..] for its heads i < G, and DH_TILES_END() at the item's end. It
 *                   reads 16 K rows whatever m is (the entry point takes it only where they
 *                   lie in the chunk's block) and drops the rows past m.
 *   DH_PV_GROUP     optional: DH_PV_GROUP(acc, p, v, row, n, D, G) does decode_run's P @ V
 *                   of a chunk for the G query heads of one kv head together (acc row i at
 *                   acc + i * D, p[i] its probabilities), each accumulator element's sum in
 *                   the template's order (token after token, one fused multiply-add each),
 *                   so the bits are decode_head's (tests/test_cpu_kernel.py compares them).
 *
 * Precision, every variant: q and K/V are read as given, every product, the scores, the
 * softmax (max, exponentials, sum) and the P @ V accumulator are float32; the output is
 * rounded to DH_ELEM once, at the end. P is never rounded to the cache dtype.
 */

/* P @ V of one query head over one chunk, for decode_run: acc[x] += p[t] * v[t * row + x]
 * for the chunk's n tokens in order. Head by head, so that the compiler can keep a head's
 * accumulators in registers over the chunk (one pass over all heads per token, as
 * decode_head does it, goes through every accumulator row at every token). The same sums
 * in the same order as decode_head's loop; a body of its own per copy and head dim, never
 * inlined: inlined into decode_run, GCC (-ffast-math) ordered them its own way, and a
 * head's output differed in the last bit from decode_head's (tests/test_cpu_kernel.py). */
static inline __attribute__((always_inline)) void DH_NAME(pv_body)(float *restrict acc,
                                                                   const float *restrict p,
                                                                   const DH_ELEM *restrict v,
                                                                   int64_t row, int n,
                                                                   const int D) {
    float a[MAX_DIM];
    for (int x = 0; x < D; x++) a[x] = acc[x];
    for (int t = 0; t < n; t++, v += row) {
        const float pt = p[t];
        for (int x = 0; x < D; x++) a[x] += pt * DH_TO_F32(v[x]);
    }
    for (int x = 0; x < D; x++) acc[x] = a[x];
}
#define DH_PV(DIM)                                                                      \
    DH_ATTR __attribute__((noinline)) static void DH_NAME(pv_d##DIM)(                   \
        float *acc, const float *p, const DH_ELEM *v, int64_t row, int n) {             \
        DH_NAME(pv_body)(acc, p, v, row, n, DIM);                                       \
    }
#ifndef DH_PV_GROUP /* decode_run's P @ V is DH_PV_GROUP's where it is defined */
DH_PV(64)
DH_PV(128)
#endif
#undef DH_PV
/* D is a constant, 64 or 128 (DH_RUNS below), so the choice folds away. */
#define DH_PV_CHUNK(acc, p, v, row, n, D) \
    ((D) == 64 ? DH_NAME(pv_d64)(acc, p, v, row, n) : DH_NAME(pv_d128)(acc, p, v, row, n))

/* Ask for the V elements of a token while its K row is scored, for P @ V, which walks the
 * chunk's V rows once per head: without it, head-by-head P @ V measured slower than the
 * token-by-token loop it replaced when the blocks came from memory (docs/performance.md).
 * One request per 64-byte line; no effect on the arithmetic. */
static inline __attribute__((always_inline)) void DH_NAME(prefetch)(const DH_ELEM *v, int n) {
    const char *p = (const char *)v;
    for (int64_t c = 0; c < n * (int64_t)sizeof(DH_ELEM); c += 64) __builtin_prefetch(p + c);
}

/* One head's online-softmax step over a chunk: its n scores s become probabilities against
 * the new running max m, and its running sum l and accumulator acc are rescaled to it. */
static inline __attribute__((always_inline)) void DH_NAME(softmax_chunk)(float *s, int n,
                                                                         float *m, float *l,
                                                                         float *acc,
                                                                         const int D) {
    float top = *m;
    for (int t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
    const float rescale = expf(*m - top);
    float sum = 0.f;
    for (int t = 0; t < n; t++) {
        s[t] = expf(s[t] - top);
        sum += s[t];
    }
    *l = *l * rescale + sum;
    *m = top;
    for (int x = 0; x < D; x++) acc[x] *= rescale;
}

/* The share pass, and how an item resumes after it. */
#include "paged_decode_share.h"

/* One (sequence, kv head): its G query heads against the whole context. D, and G where the
 * group is 1, 2, 3 or 4, are constants in the specialised copies below: the compiler unrolls
 * and vectorises the dots, and with G known it keeps the group's loops unrolled (the
 * accumulator rows no longer go through memory on every token). The same arithmetic in
 * every copy, but -ffast-math lets GCC order a copy's sums its own way (the last bit). */
static inline __attribute__((always_inline)) void DH_NAME(decode_head)(const Args *a, int b,
                                                                       int kh, const int D,
                                                                       const int G) {
    const int BS = a->block_size;
    const int64_t row = (int64_t)a->kv_heads * D; /* elements from one token to the next */
    const int32_t *table = a->tables + (int64_t)b * a->table_width;
    const int len = a->lens[b];
    const DH_ELEM *Q = (const DH_ELEM *)a->q, *K = (const DH_ELEM *)a->k;
    const DH_ELEM *V = (const DH_ELEM *)a->v;

    float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][CHUNK];
#ifdef DH_RAW_Q
    DH_ELEM qe[MAX_GROUP][MAX_DIM];
#else
    const DH_ELEM(*qe)[MAX_DIM] = NULL; /* this variant's dot reads only qs */
#endif
    float m[MAX_GROUP], l[MAX_GROUP];
    int head[MAX_GROUP];
    for (int i = 0; i < G; i++) {
        head[i] = kh * G + i; /* query head h reads kv head h / G */
        const DH_ELEM *qq = Q + b * a->q_stride_b + head[i] * a->q_stride_h;
        for (int x = 0; x < D; x++) {
#ifdef DH_RAW_Q
            qe[i][x] = qq[x];
#endif
            qs[i][x] = DH_TO_F32(qq[x]) * a->scale;
            acc[i][x] = 0.f;
        }
        m[i] = -FLT_MAX;
        l[i] = 0.f;
    }
    int start = 0; /* past a shared prefix, the state the share pass left */
    for (int i = 0; i < G; i++) start = DH_NAME(resume)(a, b, head[i], acc[i], &m[i], &l[i], D);
    (void)qe, (void)qs; /* each variant's dot reads one of the two */
#ifdef DH_TILES
    DH_ELEM qt[MAX_GROUP * MAX_DIM];
    DH_TILES_BEGIN(qt, &qe[0][0], MAX_DIM, 1, D, G);
#endif
    for (int t0 = start; t0 < len;) {
        const int n = chunk_tokens(BS, t0, len);
        const int64_t base = token_slot(table, BS, t0) * row + (int64_t)kh * D;
        const DH_ELEM *kr = K + base, *vr = V + base;
#if defined(DH_TILES)
        for (int t = 0; t < n; t += 16, kr += 16 * row)
            DH_TILES_SCORES(qt, 0, kr, row, n - t < 16 ? n - t : 16, D, G, a->scale, s, t);
#elif defined(DH_PART)
        for (int t = 0; t < n; t += DH_PARTS_N, kr += DH_PARTS_N * row) {
            const int m = n - t < DH_PARTS_N ? n - t : DH_PARTS_N;
            DH_PART part[MAX_GROUP][DH_PARTS_N];
            for (int u = 0; u < m; u++)
                for (int i = 0; i < G; i++) part[i][u] = DH_PART_DOT(qe[i], kr + u * row, D);
            for (int i = 0; i < G; i++) DH_PART_SUMS(part[i], m, a->scale, s[i] + t);
        }
#else
        for (int t = 0; t < n; t++, kr += row)
            for (int i = 0; i < G; i++) s[i][t] = DH_DOT(qs[i], qe[i], kr, D, a->scale);
#endif
        for (int i = 0; i < G; i++) DH_NAME(softmax_chunk)(s[i], n, &m[i], &l[i], acc[i], D);
        for (int t = 0; t < n; t++, vr += row)
            for (int i = 0; i < G; i++) {
                const float p = s[i][t];
                for (int x = 0; x < D; x++) acc[i][x] += p * DH_TO_F32(vr[x]);
            }
        t0 += n;
    }
#ifdef DH_TILES
    DH_TILES_END();
#endif
    for (int i = 0; i < G; i++) {
        DH_ELEM *o = (DH_ELEM *)a->out + b * a->out_stride_b + head[i] * a->out_stride_h;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f; /* an empty context gives zeros */
        for (int x = 0; x < D; x++) o[x] = DH_FROM_F32(acc[i][x] * inv);
    }
}

/* A run of kv heads: sequence b against kv heads kh0 .. kh0 + nkv - 1 (their nkv x G query
 * heads). Each head's arithmetic is decode_head's (every score, softmax update and
 * accumulation in the same order), so the bits do not depend on how a sequence's heads
 * are split into items (a test compares them). Why runs of heads: a token's K (and V) row
 * holds every kv head, so an item of all of them reads each block's rows as one contiguous
 * stretch, front to back, where an item of one kv head reads a kv_heads-th of each row and
 * jumps to the next (bench/test_bandwidth_bench.py measures the kernel's read rate). nkv is
 * a constant (2, 3 or 4) in every copy: read at run time, the heads' loops are neither
 * unrolled nor vectorised. decode_head stays, unchanged, for items of one kv head: the
 * geometries this was not measured to help keep the code they had. */
static inline __attribute__((always_inline)) void DH_NAME(decode_run)(const Args *a, int b,
                                                                      int kh0, int nkv,
                                                                      const int D,
                                                                      const int G) {
    const int BS = a->block_size, H = nkv * G;
    const int64_t row = (int64_t)a->kv_heads * D; /* elements from one token to the next */
    const int32_t *table = a->tables + (int64_t)b * a->table_width;
    const int len = a->lens[b];
    const DH_ELEM *Q = (const DH_ELEM *)a->q, *K = (const DH_ELEM *)a->k + (int64_t)kh0 * D;
    const DH_ELEM *V = (const DH_ELEM *)a->v + (int64_t)kh0 * D;

    float qs[ITEM_MAX_ELEMS], acc[ITEM_MAX_ELEMS], s[ITEM_MAX_HEADS][CHUNK];
#ifdef DH_RAW_Q
    DH_ELEM qe[ITEM_MAX_ELEMS];
#else
    const DH_ELEM *qe = NULL; /* this variant's dot reads only qs */
#endif
    float m[ITEM_MAX_HEADS], l[ITEM_MAX_HEADS];
    for (int h = 0; h < H; h++) {
        /* item head h is query head kh0 * G + h, which reads kv head kh0 + h / G */
        const DH_ELEM *qq = Q + b * a->q_stride_b + (kh0 * G + h) * a->q_stride_h;
        for (int x = 0; x < D; x++) {
#ifdef DH_RAW_Q
            qe[h * D + x] = qq[x];
#endif
            qs[h * D + x] = DH_TO_F32(qq[x]) * a->scale;
            acc[h * D + x] = 0.f;
        }
        m[h] = -FLT_MAX;
        l[h] = 0.f;
    }
    int start = 0; /* past a shared prefix, the state the share pass left */
    for (int h = 0; h < H; h++)
        start = DH_NAME(resume)(a, b, kh0 * G + h, acc + h * D, &m[h], &l[h], D);
    (void)qe, (void)qs; /* each variant's dot reads one of the two */
#ifdef DH_TILES
    DH_ELEM qt[ITEM_MAX_ELEMS];
    DH_TILES_BEGIN(qt, qe, D, nkv, D, G);
#endif
    for (int t0 = start; t0 < len;) {
        const int n = chunk_tokens(BS, t0, len);
        const int64_t base = token_slot(table, BS, t0) * row;
        const DH_ELEM *kr = K + base, *vr = V + base;
#if defined(DH_PART) || defined(DH_TILES)
        /* The next chunk's K rows, asked for token by token while this chunk's are scored:
         * in this copy only, the one measured faster with it (on Zen 3 the float32 copy was
         * slower with it; both in docs/performance.md). */
        const int t1 = t0 + n, n1 = t1 < len ? chunk_tokens(BS, t1, len) : 0;
        const DH_ELEM *next = n1 ? K + token_slot(table, BS, t1) * row : NULL;
#if defined(DH_TILES)
        for (int t = 0; t < n; t += 16, kr += 16 * row) {
            const int m = n - t < 16 ? n - t : 16;
            for (int j = 0; j < nkv; j++) { /* the prefetches spread over the kv heads */
                for (int u = j * m / nkv; u < (j + 1) * m / nkv; u++) {
                    DH_NAME(prefetch)(vr + (t + u) * row, nkv * D);
                    if (t + u < n1) DH_NAME(prefetch)(next + (t + u) * row, nkv * D);
                }
                DH_TILES_SCORES(qt, j, kr + j * D, row, m, D, G, a->scale, s + j * G, t);
            }
        }
#else
        for (int t = 0; t < n; t += DH_PARTS_N) {
            const int m = n - t < DH_PARTS_N ? n - t : DH_PARTS_N;
            DH_PART part[ITEM_MAX_HEADS][DH_PARTS_N];
            for (int u = 0; u < m; u++, kr += row) {
                DH_NAME(prefetch)(vr + (t + u) * row, nkv * D);
                if (t + u < n1) DH_NAME(prefetch)(next + (t + u) * row, nkv * D);
                for (int j = 0; j < nkv; j++)
                    for (int i = 0; i < G; i++)
                        part[j * G + i][u] = DH_PART_DOT(qe + (j * G + i) * D, kr + j * D, D);
            }
            for (int h = 0; h < H; h++) DH_PART_SUMS(part[h], m, a->scale, s[h] + t);
        }
#endif
#else
        for (int t = 0; t < n; t++, kr += row) {
            DH_NAME(prefetch)(vr + t * row, nkv * D);
            for (int j = 0; j < nkv; j++)
                for (int i = 0; i < G; i++) {
                    const int h = j * G + i;
                    s[h][t] = DH_DOT(qs + h * D, qe + h * D, kr + j * D, D, a->scale);
                }
        }
#endif
        for (int h = 0; h < H; h++)
            DH_NAME(softmax_chunk)(s[h], n, &m[h], &l[h], acc + h * D, D);
#ifdef DH_PV_GROUP
        for (int j = 0; j < nkv; j++) /* kv head j: item heads j * G .. j * G + G - 1 */
            DH_PV_GROUP(acc + j * G * D, s + j * G, vr + j * D, row, n, D, G);
#else
        for (int h = 0; h < H; h++) DH_PV_CHUNK(acc + h * D, s[h], vr + (h / G) * D, row, n, D);
#endif
        t0 += n;
    }
#ifdef DH_TILES
    DH_TILES_END();
#endif
    for (int h = 0; h < H; h++) {
        DH_ELEM *o = (DH_ELEM *)a->out + b * a->out_stride_b + (kh0 * G + h) * a->out_stride_h;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f; /* an empty context gives zeros */
        for (int x = 0; x < D; x++) o[x] = DH_FROM_F32(acc[h * D + x] * inv);
    }
}

/* The specialised copies and the entry point, DH_NAME(decode). */
#include "paged_decode_items.h"

#undef DH_PV_CHUNK
#undef DH_NAME
#undef DH_ATTR
