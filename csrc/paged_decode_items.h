/*
 * The decode kernel's entry point and its work items, for one instantiation of
 * paged_decode_head.h (which includes this file at its end, with its macros still defined:
 * DH_NAME, DH_ATTR and the element macros; no include guard, as there). The template's
 * arithmetic is there; here, which specialised copy of it each geometry runs, and how a
 * call's items reach run_items (run_items.c).
 */

/* The work items: one copy per specialised head dim (D a constant, so the dots unroll and
 * vectorise) and group size, each carrying DH_ATTR. run_items calls them through a pointer,
 * from one thread or from many, so every item runs the same compiled copy at any thread
 * count (no loop of items here for OpenMP to outline into code of another target: the same
 * bits either way). A call per item costs nothing next to an item (a whole context).
 * A copy with G a constant keeps the group's accumulator rows in registers, where one with
 * G read at run time cannot (head_dim 16, G 3: the two differed in the last bit).
 *
 * Runs of kv heads (decode_run; run_span says when) only for head dims 64 and 128 with G a
 * constant 2, 3 or 4, in copies of their own: every other geometry takes one kv head per
 * item, and more copies would cost build time (each is compiled per level and dtype). */
#define DH_ITEM(DIM, GR)                                                              \
    DH_ATTR static void DH_NAME(item_d##DIM##_g##GR)(const Args *a, int b, int kh0,   \
                                                      int nkv) {                      \
        (void)nkv; /* 1: run_items' span for these copies */                         \
        DH_NAME(decode_head)(a, b, kh0, DIM, GR);                                     \
    }
#define DH_RUN_ITEM(DIM, GR)                                                          \
    DH_ATTR static void DH_NAME(run_d##DIM##_g##GR)(const Args *a, int b, int kh0,    \
                                                     int nkv) {                       \
        if (nkv == 4) DH_NAME(decode_run)(a, b, kh0, 4, DIM, GR);                     \
        else if (nkv == 3) DH_NAME(decode_run)(a, b, kh0, 3, DIM, GR);                \
        else DH_NAME(decode_run)(a, b, kh0, 2, DIM, GR); /* run_span: 2, 3 or 4 */    \
    }
#define DH_GENERIC_G(DIM)                                                              \
    DH_ATTR static void DH_NAME(item_d##DIM)(const Args *a, int b, int kh0, int nkv) { \
        (void)nkv;                                                                     \
        DH_NAME(decode_head)(a, b, kh0, DIM, a->heads / a->kv_heads);                  \
    }
#define DH_SPECIALISE(DIM) \
    DH_ITEM(DIM, 1) DH_ITEM(DIM, 2) DH_ITEM(DIM, 3) DH_ITEM(DIM, 4) DH_GENERIC_G(DIM)
#define DH_RUNS(DIM) DH_RUN_ITEM(DIM, 2) DH_RUN_ITEM(DIM, 3) DH_RUN_ITEM(DIM, 4)
DH_SPECIALISE(16)
DH_SPECIALISE(32)
DH_SPECIALISE(64)
DH_SPECIALISE(128)
DH_RUNS(64)
DH_RUNS(128)
#undef DH_SPECIALISE
#undef DH_RUNS
#undef DH_GENERIC_G
#undef DH_ITEM
#undef DH_RUN_ITEM

DH_ATTR static void DH_NAME(item_dany)(const Args *a, int b, int kh0, int nkv) {
    (void)nkv;
    DH_NAME(decode_head)(a, b, kh0, a->head_dim, a->heads / a->kv_heads);
}

/* The copy for this head dim and group size (other group sizes: G read at run time), one kv
 * head per item; DH_PICK_RUNS takes runs of kv heads where run_span allows. */
#define DH_PICK(DIM)                                                       \
    switch (a->heads / a->kv_heads) {                                      \
        case 1: return run_items(a, DH_NAME(item_d##DIM##_g1), 1);         \
        case 2: return run_items(a, DH_NAME(item_d##DIM##_g2), 1);         \
        case 3: return run_items(a, DH_NAME(item_d##DIM##_g3), 1);         \
        case 4: return run_items(a, DH_NAME(item_d##DIM##_g4), 1);         \
        default: return run_items(a, DH_NAME(item_d##DIM), 1);             \
    }
#define DH_PICK_RUNS(DIM)                                                  \
    if (run_span(a) > 1) switch (a->heads / a->kv_heads) {                 \
            case 2: return run_items(a, DH_NAME(run_d##DIM##_g2), run_span(a)); \
            case 3: return run_items(a, DH_NAME(run_d##DIM##_g3), run_span(a)); \
            case 4: return run_items(a, DH_NAME(run_d##DIM##_g4), run_span(a)); \
            default: break;                                                \
        }                                                                  \
    DH_PICK(DIM)

/* The variant's entry point: 16, 32, 64 and 128 have their own copies, others the generic. */
int DH_NAME(decode)(const Args *a) {
    if (a->share_groups > 0)
        run_share_items(a, a->head_dim == 32    ? DH_NAME(share_d32)
                           : a->head_dim == 64  ? DH_NAME(share_d64)
                           : a->head_dim == 128 ? DH_NAME(share_d128)
                                                : DH_NAME(share_dany));
    switch (a->head_dim) {
        case 16: DH_PICK(16)
        case 32: DH_PICK(32)
        case 64: DH_PICK_RUNS(64)
        case 128: DH_PICK_RUNS(128)
        default: return run_items(a, DH_NAME(item_dany), 1);
    }
}
#undef DH_PICK_RUNS
#undef DH_PICK
