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
 *   DH_DOT(qs, qe, k, D, scale)  one query head's score against one K row, in float32:
 *                   qs is the head as floats times scale, qe the head's elements (unscaled,
 *                   so the dot must apply scale itself), k the K row's elements
 *   DH_ATTR         attributes of the specialised copies (a level's target, or nothing)
 *   DH_RAW_Q        defined when DH_DOT reads qe (a copy of q's elements on the stack)
 *
 * Precision, every variant: q and K/V are read as given, every product, the scores, the
 * softmax (max, exponentials, sum) and the P @ V accumulator are float32; the output is
 * rounded to DH_ELEM once, at the end. P is never rounded to the cache dtype.
 */

/* One (sequence, kv head): its G query heads against the whole context. D, and G where the
 * group is 1, 2 or 4, are constants in the specialised copies below: the compiler unrolls
 * and vectorises the dots, and with G known it keeps the group's loops unrolled (the
 * accumulator rows no longer go through memory on every token). The arithmetic, and so
 * every bit of the output, is the same in every copy. */
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
    (void)qe, (void)qs; /* each variant's dot reads one of the two */
    for (int t0 = 0; t0 < len;) {
        const int off = t0 % BS;
        int n = BS - off;
        if (n > CHUNK) n = CHUNK;
        if (n > len - t0) n = len - t0;
        const int64_t base = ((int64_t)table[t0 / BS] * BS + off) * row + (int64_t)kh * D;
        const DH_ELEM *kr = K + base, *vr = V + base;
        for (int t = 0; t < n; t++, kr += row)
            for (int i = 0; i < G; i++) s[i][t] = DH_DOT(qs[i], qe[i], kr, D, a->scale);
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
                for (int x = 0; x < D; x++) acc[i][x] += p * DH_TO_F32(vr[x]);
            }
        t0 += n;
    }
    for (int i = 0; i < G; i++) {
        DH_ELEM *o = (DH_ELEM *)a->out + b * a->out_stride_b + head[i] * a->out_stride_h;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f; /* an empty context gives zeros */
        for (int x = 0; x < D; x++) o[x] = DH_FROM_F32(acc[i][x] * inv);
    }
}

/* The work items: one copy per specialised head dim (D a constant, so the dots unroll and
 * vectorise) and group size, each carrying DH_ATTR. run_items calls them through a pointer,
 * from one thread or from many, so every item runs the same compiled copy at any thread
 * count (no loop of items here for OpenMP to outline into code of another target: the same
 * bits either way). A call per item costs nothing next to an item (a context of G heads).
 * A copy with G a constant keeps the group's accumulator rows in registers, where one with
 * G read at run time cannot; both give the same bits. */
#define DH_ITEM(DIM, GR)                                                           \
    DH_ATTR static void DH_NAME(item_d##DIM##_g##GR)(const Args *a, int b, int kh) { \
        DH_NAME(decode_head)(a, b, kh, DIM, GR);                                   \
    }
#define DH_SPECIALISE(DIM)                                                  \
    DH_ITEM(DIM, 1)                                                         \
    DH_ITEM(DIM, 2)                                                         \
    DH_ITEM(DIM, 4)                                                         \
    DH_ATTR static void DH_NAME(item_d##DIM)(const Args *a, int b, int kh) { \
        DH_NAME(decode_head)(a, b, kh, DIM, a->heads / a->kv_heads);        \
    }
DH_SPECIALISE(16)
DH_SPECIALISE(32)
DH_SPECIALISE(64)
DH_SPECIALISE(128)
#undef DH_SPECIALISE
#undef DH_ITEM

DH_ATTR static void DH_NAME(item_dany)(const Args *a, int b, int kh) {
    DH_NAME(decode_head)(a, b, kh, a->head_dim, a->heads / a->kv_heads);
}

/* The copy for this head dim and group size (other group sizes: G read at run time). */
#define DH_PICK(DIM)                                                \
    switch (a->heads / a->kv_heads) {                               \
        case 1: return run_items(a, DH_NAME(item_d##DIM##_g1));     \
        case 2: return run_items(a, DH_NAME(item_d##DIM##_g2));     \
        case 4: return run_items(a, DH_NAME(item_d##DIM##_g4));     \
        default: return run_items(a, DH_NAME(item_d##DIM));         \
    }

/* The variant's entry point: 16, 32, 64 and 128 have their own copies, others the generic. */
int DH_NAME(decode)(const Args *a) {
    switch (a->head_dim) {
        case 16: DH_PICK(16)
        case 32: DH_PICK(32)
        case 64: DH_PICK(64)
        case 128: DH_PICK(128)
        default: return run_items(a, DH_NAME(item_dany));
    }
}
#undef DH_PICK

#undef DH_NAME
#undef DH_ATTR
