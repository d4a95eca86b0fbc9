/*
 * Shared prefixes: the template's share pass (paged_decode_head.h includes this file once per
 * copy, with its macros defined; no include guard, as there).
 *
 * Why: sequences that begin with the same cached blocks (a system prompt, a few-shot
 * prefix, the n samples of one prompt) score their query heads against the same K rows.
 * One item per sequence reads those rows once per sequence, and scores them for the G
 * query heads of one kv head at a time: with the rows in cache, the kernel is bound by its
 * arithmetic, and for the tile unit (DH_TILES) G of its 16 columns are all it uses. The
 * share pass takes a group's members together: their G x members query heads of one kv head
 * ("virtual heads", MAX_GROUP at a time) against the shared tokens, each K and V row read
 * once for all of them. Each virtual head keeps its own online softmax, as decode_head
 * would keep it, and leaves its accumulator, running max and sum in a->state; the items of
 * decode_head and decode_run then resume from there (DH_NAME(resume)) at the first token
 * that is not shared.
 *
 * Numerics: a virtual head's scores, its softmax updates and its P @ V sums are those of
 * decode_head for that head, in the same order and over the same chunks (the shared
 * tokens are whole blocks, so every chunk boundary is where a plain call would put it),
 * so a call with groups gives the same bits as one without (tests/test_cpu_kernel_share.py
 * compares them in every copy). The launcher and paged_decode_cpu.c check the groups:
 * each member's table begins with the group's blocks, every shared count is whole blocks
 * no longer than the member's context, and a row is in one group at most.
 */

/* Where sequence b's walk begins for its query head h: 0 with an empty state, or past its
 * group's shared tokens with the state the share pass left. */
static inline __attribute__((always_inline)) int DH_NAME(resume)(const Args *a, int b, int h,
                                                                 float *acc, float *m,
                                                                 float *l, const int D) {
    if (a->starts == NULL || a->starts[b] == 0) return 0;
    const float *st = a->state + ((int64_t)b * a->heads + h) * (D + 2);
    for (int x = 0; x < D; x++) acc[x] = st[x];
    *m = st[D];
    *l = st[D + 1];
    return a->starts[b];
}

/* Group g's virtual heads v0 .. v0 + nv - 1 (nv <= MAX_GROUP) of kv head kh against the
 * group's shared tokens: virtual head v is query head kh * G + v % G of member v / G. The
 * body of decode_head with the group's virtual heads in place of one sequence's G heads,
 * its state written to a->state instead of its output. */
static inline __attribute__((always_inline)) void DH_NAME(share_heads)(const Args *a, int g,
                                                                       int kh, int v0, int nv,
                                                                       const int D) {
    const int BS = a->block_size, G = a->heads / a->kv_heads;
    const int64_t row = (int64_t)a->kv_heads * D; /* elements from one token to the next */
    const int32_t *rows = a->share_rows + a->share_bounds[g];
    const int32_t *table = a->tables + (int64_t)rows[0] * a->table_width;
    const int len = a->starts[rows[0]]; /* the same for every member: checked */
    const DH_ELEM *Q = (const DH_ELEM *)a->q, *K = (const DH_ELEM *)a->k;
    const DH_ELEM *V = (const DH_ELEM *)a->v;

    float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP * MAX_DIM], s[MAX_GROUP][CHUNK];
#ifdef DH_RAW_Q
    DH_ELEM qe[MAX_GROUP][MAX_DIM];
#else
    const DH_ELEM(*qe)[MAX_DIM] = NULL;
#endif
    float m[MAX_GROUP], l[MAX_GROUP];
    int seq[MAX_GROUP], head[MAX_GROUP];
    for (int i = 0; i < nv; i++) {
        seq[i] = rows[(v0 + i) / G];
        head[i] = kh * G + (v0 + i) % G;
        const DH_ELEM *qq = Q + seq[i] * a->q_stride_b + head[i] * a->q_stride_h;
        for (int x = 0; x < D; x++) {
#ifdef DH_RAW_Q
            qe[i][x] = qq[x];
#endif
            qs[i][x] = DH_TO_F32(qq[x]) * a->scale;
            acc[i * D + x] = 0.f;
        }
        m[i] = -FLT_MAX;
        l[i] = 0.f;
    }
    (void)qe, (void)qs;
#ifdef DH_TILES
    DH_ELEM qt[MAX_GROUP * MAX_DIM];
    DH_TILES_BEGIN(qt, &qe[0][0], MAX_DIM, 1, D, nv);
#endif
    for (int t0 = 0; t0 < len;) {
        const int n = chunk_tokens(BS, t0, len);
        const int64_t base = token_slot(table, BS, t0) * row + (int64_t)kh * D;
        const DH_ELEM *kr = K + base, *vr = V + base;
        /* the next chunk's K rows (this head's), asked for while this one is scored */
        const int t1 = t0 + n, n1 = t1 < len ? chunk_tokens(BS, t1, len) : 0;
        const DH_ELEM *next = n1 ? K + token_slot(table, BS, t1) * row + (int64_t)kh * D : NULL;
#if defined(DH_TILES)
        for (int t = 0; t < n; t += 16, kr += 16 * row) {
            for (int u = t; u < t + 16 && u < n; u++) {
                DH_NAME(prefetch)(vr + u * row, D);
                if (u < n1) DH_NAME(prefetch)(next + u * row, D);
            }
            DH_TILES_SCORES(qt, 0, kr, row, n - t < 16 ? n - t : 16, D, nv, a->scale, s, t);
        }
#elif defined(DH_PART)
        for (int t = 0; t < n; t += DH_PARTS_N, kr += DH_PARTS_N * row) {
            const int mm = n - t < DH_PARTS_N ? n - t : DH_PARTS_N;
            DH_PART part[MAX_GROUP][DH_PARTS_N];
            for (int u = 0; u < mm; u++) {
                DH_NAME(prefetch)(vr + (t + u) * row, D);
                if (t + u < n1) DH_NAME(prefetch)(next + (t + u) * row, D);
                for (int i = 0; i < nv; i++) part[i][u] = DH_PART_DOT(qe[i], kr + u * row, D);
            }
            for (int i = 0; i < nv; i++) DH_PART_SUMS(part[i], mm, a->scale, s[i] + t);
        }
#else
        for (int t = 0; t < n; t++, kr += row) {
            DH_NAME(prefetch)(vr + t * row, D);
            if (t < n1) DH_NAME(prefetch)(next + t * row, D);
            for (int i = 0; i < nv; i++) s[i][t] = DH_DOT(qs[i], qe[i], kr, D, a->scale);
        }
#endif
        for (int i = 0; i < nv; i++)
            DH_NAME(softmax_chunk)(s[i], n, &m[i], &l[i], acc + i * D, D);
#ifdef DH_PV_GROUP
        if (D % 64 == 0) { /* the copy's grouped P @ V (whole 64s of dims), 4 heads at a time */
            for (int i = 0; i < nv; i += 4) {
                float *ai = acc + i * D;
                if (nv - i >= 4) DH_PV_GROUP(ai, s + i, vr, row, n, D, 4);
                else if (nv - i == 3) DH_PV_GROUP(ai, s + i, vr, row, n, D, 3);
                else if (nv - i == 2) DH_PV_GROUP(ai, s + i, vr, row, n, D, 2);
                else DH_PV_GROUP(ai, s + i, vr, row, n, D, 1);
            }
            t0 += n;
            continue;
        }
#endif
        for (int t = 0; t < n; t++, vr += row)
            for (int i = 0; i < nv; i++) {
                const float p = s[i][t];
                for (int x = 0; x < D; x++) acc[i * D + x] += p * DH_TO_F32(vr[x]);
            }
        t0 += n;
    }
#ifdef DH_TILES
    DH_TILES_END();
#endif
    for (int i = 0; i < nv; i++) {
        float *st = a->state + ((int64_t)seq[i] * a->heads + head[i]) * (D + 2);
        for (int x = 0; x < D; x++) st[x] = acc[i * D + x];
        st[D] = m[i];
        st[D + 1] = l[i];
    }
}

/* The share items, D a constant where the copy has one (as the decode items). */
#define DH_SHARE(DIM)                                                                      \
    DH_ATTR static void DH_NAME(share_d##DIM)(const Args *a, int g, int kh, int v0, int nv) { \
        DH_NAME(share_heads)(a, g, kh, v0, nv, DIM);                                       \
    }
DH_SHARE(32)
DH_SHARE(64)
DH_SHARE(128)
#undef DH_SHARE
DH_ATTR static void DH_NAME(share_dany)(const Args *a, int g, int kh, int v0, int nv) {
    DH_NAME(share_heads)(a, g, kh, v0, nv, a->head_dim);
}
