/*
 * The decode kernel's work items (paged_decode_cpu.h): in which order they run, and on how
 * many threads. Every variant's entry point (paged_decode_items.h) hands its items here.
 *
 * Items. A call's work is batch x kv_heads / span items, one (sequence, run of span kv
 * heads) each (run_span, paged_decode_cpu.h), computed whole by one thread in the one order
 * the template fixes, so the output is the same bits at any thread count and in any order
 * of the items.
 *
 * Order (item_order). Sequences whose contexts begin in the same block (a cached prefix)
 * run one after another, so the prefix's blocks, read from memory by the first of them, are
 * still in the core's cache for the next. In the order a scheduler hands them over,
 * sequences of different prefixes alternate: the blocks of 4 prefixes of 320 tokens, 8
 * query / 4 KV heads of 64 in float32 (the 29M model), are 2.6 MB a layer, more than a
 * core's 2 MB L2, so each sequence found its prefix evicted by the others'
 * (docs/performance.md has the measurements). The groups run ordered by their longest
 * context, longest first, so that the last items claimed are from short groups (within a
 * group, the order of the block tables, not of the lengths); a sequence that shares no
 * first block is a group of its own, so a batch without shared prefixes runs longest
 * first, as the threaded path always did (one thread used to run in batch order).
 * tests/test_item_order.py reads the order back from a harness built on this file.
 *
 * Threads. With num_threads > 1 (the launcher passes torch.get_num_threads(), read once per
 * step) the items are claimed one at a time, in that order, from an atomic counter by up to
 * min(num_threads, items) threads: a thread that loses its core to another process holds
 * back at most the one item it is in, where a static split would leave its whole share
 * waiting. num_threads 1 runs no parallel region. Block ids and lengths are checked before
 * (paged_decode_cpu.c), single-threaded.
 *
 * Why OpenMP rather than a pthread pool of our own: torch's CPU ops already run on
 * OpenMP, so the kernel's threads are torch's (no second set of threads competing for the
 * cores), and they wait the way the process chose (paged_engine sets
 * OMP_WAIT_POLICY=PASSIVE before torch loads libgomp: see EngineConfig.num_threads). Only
 * GOMP_parallel and omp_get_thread_num/num_threads are used (no worksharing constructs),
 * which every libgomp since GCC 4.9 has. The extension needs libgomp.so.1 and torch's
 * wheel bundles its own: the dynamic loader takes whichever libgomp.so.1 is loaded first
 * for both, so a process maps one OpenMP runtime (torch's, when torch is imported first,
 * as the launcher does; tests/test_cpu_kernel_threads.py reads /proc/self/maps). Built
 * without -fopenmp (setup.py drops it where the toolchain lacks it), run_items is the
 * single-threaded loop whatever num_threads says.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "paged_decode_cpu.h"

/* A sequence, with what item_order sorts it by. */
typedef struct {
    const int32_t *table; /* its block table row */
    int blocks;           /* the blocks its context reads */
    int first;            /* its first block, or -1 - index when it reads none */
    int len, group_len, index;
} Ranked;

static int by_first_block(const void *x, const void *y) {
    const Ranked *p = x, *q = y;
    if (p->first != q->first) return p->first < q->first ? -1 : 1;
    return p->index < q->index ? -1 : p->index > q->index;
}

/* Groups longest first, a group's members together, those sharing more blocks nearer. */
static int by_group(const void *x, const void *y) {
    const Ranked *p = x, *q = y;
    if (p->group_len != q->group_len) return p->group_len > q->group_len ? -1 : 1;
    if (p->first != q->first) return p->first < q->first ? -1 : 1;
    const int n = p->blocks < q->blocks ? p->blocks : q->blocks;
    for (int j = 1; j < n; j++)
        if (p->table[j] != q->table[j]) return p->table[j] < q->table[j] ? -1 : 1;
    if (p->len != q->len) return p->len > q->len ? -1 : 1;
    return p->index < q->index ? -1 : p->index > q->index;
}

/* The call's sequences in the order above, or NULL without the memory (then index order:
 * the same results, only the caches and the threads' balance serve less). The caller
 * frees it. */
static Ranked *item_order(const Args *a) {
    if (a->batch <= 0) return NULL;
    Ranked *r = malloc(sizeof(Ranked) * (size_t)a->batch);
    if (r == NULL) return NULL;
    for (int b = 0; b < a->batch; b++) {
        const int len = a->lens[b];
        const int blocks = (int)(((int64_t)len + a->block_size - 1) / a->block_size);
        const int32_t *table = a->tables + (int64_t)b * a->table_width;
        r[b] = (Ranked){table, blocks, blocks > 0 ? table[0] : -1 - b, len, 0, b};
    }
    qsort(r, (size_t)a->batch, sizeof(Ranked), by_first_block);
    for (int i = 0; i < a->batch;) { /* each group's longest context */
        int j = i, longest = 0;
        for (; j < a->batch && r[j].first == r[i].first; j++)
            longest = r[j].len > longest ? r[j].len : longest;
        for (; i < j; i++) r[i].group_len = longest;
    }
    qsort(r, (size_t)a->batch, sizeof(Ranked), by_group);
    return r;
}

int run_items(const Args *a, ItemFn item, int span) {
    const int per = a->kv_heads / span; /* items per sequence */
    const int64_t items = (int64_t)a->batch * per;
    const int threads = items < a->num_threads ? (int)items : a->num_threads;
    Ranked *order = item_order(a);
    int team = 1;
#ifdef _OPENMP
    if (threads > 1) {
        int64_t next = 0;
#pragma omp parallel num_threads(threads)
        {
            if (omp_get_thread_num() == 0) team = omp_get_num_threads();
            for (;;) {
                const int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
                if (i >= items) break;
                const int64_t rank = i / per;
                item(a, order != NULL ? order[rank].index : (int)rank, (int)(i % per) * span,
                     span);
            }
        }
        free(order);
        return team;
    }
#endif
    (void)threads;
    for (int rank = 0; rank < a->batch; rank++) {
        const int b = order != NULL ? order[rank].index : rank;
        for (int kh0 = 0; kh0 < a->kv_heads; kh0 += span) item(a, b, kh0, span);
    }
    free(order);
    return team;
}

/* The share items (paged_decode_share.h): per group, per kv head, its members' virtual heads
 * MAX_GROUP at a time, in that order, so that one kv head's shared rows are read by its
 * items one after another. Claimed as run_items claims its own; every item writes the
 * state of its own heads only, so the order does not change a bit. */
void run_share_items(const Args *a, ShareFn item) {
    const int G = a->heads / a->kv_heads;
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)a->share_groups + 1));
    int64_t items = 0;
    for (int g = 0; g < a->share_groups; g++) {
        if (first != NULL) first[g] = items;
        const int heads = (a->share_bounds[g + 1] - a->share_bounds[g]) * G;
        items += (int64_t)a->kv_heads * ((heads + MAX_GROUP - 1) / MAX_GROUP);
    }
    if (first != NULL) first[a->share_groups] = items;
#ifdef _OPENMP
    const int threads = items < a->num_threads ? (int)items : a->num_threads;
    if (threads > 1 && first != NULL) {
        int64_t next = 0;
#pragma omp parallel num_threads(threads)
        for (;;) {
            const int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (i >= items) break;
            int g = 0;
            while (first[g + 1] <= i) g++;
            const int heads = (a->share_bounds[g + 1] - a->share_bounds[g]) * G;
            const int chunks = (heads + MAX_GROUP - 1) / MAX_GROUP;
            const int kh = (int)((i - first[g]) / chunks), v0 = (int)((i - first[g]) % chunks) * MAX_GROUP;
            item(a, g, kh, v0, heads - v0 < MAX_GROUP ? heads - v0 : MAX_GROUP);
        }
        free(first);
        return;
    }
#endif
    free(first);
    for (int g = 0; g < a->share_groups; g++) {
        const int heads = (a->share_bounds[g + 1] - a->share_bounds[g]) * G;
        for (int kh = 0; kh < a->kv_heads; kh++)
            for (int v0 = 0; v0 < heads; v0 += MAX_GROUP)
                item(a, g, kh, v0, heads - v0 < MAX_GROUP ? heads - v0 : MAX_GROUP);
    }
}
