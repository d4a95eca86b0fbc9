/*
 * qk_norm_rope's rows (fused_ops.c's header comment says what the op is and why its numerics
 * are torch's): per (token, head) item of a call, the head's RMSNorm and the rotary
 * embedding after it, in place, compiled once per instruction-set level (LEVELS, levels.h).
 * fused_ops.c includes this after fused_ops_rows.h, whose element helpers and sum order it
 * uses.
 *
 * Why items go in groups. A head is short (64 or 128 elements), and the end of its norm is
 * serial: torch adds the L lane partials of the sum of squares one after another, then
 * divides and takes a square root. One item at a time, that chain of dependent scalar adds
 * was the largest part of an item's time. With the lane partials of GROUP items side by
 * side, the same adds run in the same order for GROUP items at once, one vector add per
 * lane, and so do the divisions and square roots: each item's bits are the ones it gets
 * alone (tests/test_fused_ops.py compares every shape with torch). Heads shorter than one
 * L-wide vector, or longer than GROUP_MAX_D, and the rotation alone (no weights) take the
 * items one by one.
 */
#ifndef PAGED_ENGINE_FUSED_OPS_ROPE_H
#define PAGED_ENGINE_FUSED_OPS_ROPE_H

#include "fused_ops_rows.h"

#define GROUP 16
#define GROUP_MAX_D 512 /* the group's widened heads live on the stack */

typedef struct {
    void *qk;
    const void *wq, *wk, *cos, *sin;
    int64_t ts, cs, tokens, q_heads, heads, d;
    float eps;
} RopeArgs;

EXACT_FP_BEGIN

/* Item `it`'s head in the qkv output: token it / heads, head it % heads. */
INLINE char *item_head(const RopeArgs *a, const int bf16, int64_t it) {
    const int64_t t = it / a->heads, h = it % a->heads;
    return (char *)a->qk + (t * a->ts + h * a->d) * (bf16 ? 2 : 4);
}

/* Item `it` = (token, head) once its norm's scale is known (unused without weights: the
 * Llama families rotate without a norm): the head normed with q's weight for the first
 * q_heads, else k's, then x * cos + [x2, x1] * [-sin, sin] (sin's first half arrives
 * negated), each product and the sum rounded to the model dtype, as torch's three ops round
 * them. `row` is the head widened to float32. */
INLINE void norm_rotate_item(const RopeArgs *a, const int bf16, int64_t it, const float *row,
                             float scale) {
    const int64_t half = a->d / 2, t = it / a->heads, h = it % a->heads;
    char *x = item_head(a, bf16, it);
    const void *w = h < a->q_heads ? a->wq : a->wk;
    float normed[MAX_COLS];
    if (w != NULL) {
        for (int64_t j = 0; j < a->d; j++)
            normed[j] = rnd(load(w, j, bf16) * rnd(row[j] * scale, bf16), bf16);
    } else {
        for (int64_t j = 0; j < a->d; j++) normed[j] = row[j];
    }
    const char *c = (const char *)a->cos + t * a->cs * (bf16 ? 2 : 4);
    const char *s = (const char *)a->sin + t * a->cs * (bf16 ? 2 : 4);
    for (int64_t j = 0; j < half; j++) {
        const float p = rnd(normed[j] * load(c, j, bf16), bf16);
        store(x, j, p + rnd(normed[j + half] * load(s, j, bf16), bf16), bf16);
    }
    for (int64_t j = half; j < a->d; j++) {
        const float p = rnd(normed[j] * load(c, j, bf16), bf16);
        store(x, j, p + rnd(normed[j - half] * load(s, j, bf16), bf16), bf16);
    }
}

/* One item at a time: inv_rms (fused_ops_rows.h) per head. */
INLINE void qk_items_one_by_one(const RopeArgs *a, const int bf16, const int L, int64_t begin,
                                int64_t end) {
    for (int64_t it = begin; it < end; it++) {
        float row[MAX_COLS];
        const char *x = item_head(a, bf16, it);
        for (int64_t j = 0; j < a->d; j++) row[j] = load(x, j, bf16);
        /* both weights or neither (the entry point checks) */
        norm_rotate_item(a, bf16, it, row, a->wq != NULL ? inv_rms(row, a->d, a->eps, L) : 0.f);
    }
}

/* GROUP items at a time (the header comment): sum_squares and inv_rms in the same order,
 * the lane chain, division and root across the group. Needs a->d in [L, GROUP_MAX_D]. */
INLINE void qk_items_grouped(const RopeArgs *a, const int bf16, const int L, int64_t begin,
                             int64_t end) {
    for (int64_t g = begin; g < end; g += GROUP) {
        const int n = end - g < GROUP ? (int)(end - g) : GROUP;
        float rows[GROUP][GROUP_MAX_D], lanes[MAX_LANES][GROUP], total[GROUP], scale[GROUP];
        for (int i = 0; i < n; i++) {
            const char *x = item_head(a, bf16, g + i);
            for (int64_t j = 0; j < a->d; j++) rows[i][j] = load(x, j, bf16);
            float part[MAX_LANES];
            /* L a constant in each branch, as in inv_rms */
            if (L == 4)
                lane_partials(rows[i], a->d, 4, part);
            else if (L == 8)
                lane_partials(rows[i], a->d, 8, part);
            else
                lane_partials(rows[i], a->d, 16, part);
            for (int l = 0; l < L; l++) lanes[l][i] = part[l];
            total[i] = tail_squares(rows[i], a->d, L);
        }
        for (int i = n; i < GROUP; i++) { /* a short last group: defined values, unused */
            for (int l = 0; l < L; l++) lanes[l][i] = 0.f;
            total[i] = 0.f;
        }
        for (int l = 0; l < L; l++)
            for (int i = 0; i < GROUP; i++) total[i] += lanes[l][i];
        for (int i = 0; i < GROUP; i++) scale[i] = 1.f / sqrtf(total[i] / (float)a->d + a->eps);
        for (int i = 0; i < n; i++) norm_rotate_item(a, bf16, g + i, rows[i], scale[i]);
    }
}

INLINE void qk_norm_rope_rows(const RopeArgs *a, const int bf16, const int L, int64_t begin,
                              int64_t end) {
    if (a->wq != NULL && a->d >= L && a->d <= GROUP_MAX_D)
        qk_items_grouped(a, bf16, L, begin, end);
    else
        qk_items_one_by_one(a, bf16, L, begin, end);
}

LEVELS(qk_norm_rope_f32, qk_norm_rope_rows(a, 0, L, begin, end))
LEVELS(qk_norm_rope_bf16, qk_norm_rope_rows(a, 1, L, begin, end))

EXACT_FP_END

#endif
