/*
 * What the CPU paged-decode kernels share: the argument record and the entry points of each
 * compiled variant. paged_decode_cpu.c parses and validates the arguments (once, for every
 * variant) and dispatches; each variant is one instantiation of paged_decode_head.h, whose
 * work items run_items (run_items.c) orders and schedules over threads.
 */
#ifndef PAGED_DECODE_CPU_H
#define PAGED_DECODE_CPU_H

#include <stdint.h>

#define MAX_GROUP 16
#define MAX_DIM 256
/* Tokens scored before each online-softmax update: at most this many, and never past the
 * end of a block (so with small blocks the accumulator is rescaled once per block). */
#define CHUNK 32
/* An item's query heads and their accumulators live on its stack: at most this many heads,
 * and heads x head_dim elements (MAX_GROUP x MAX_DIM, one kv head's worst case, fits). */
#define ITEM_MAX_HEADS 64
#define ITEM_MAX_ELEMS 4096

typedef struct {
    const void *q; /* float or bfloat16 (raw uint16_t bits), as the variant reads them */
    const void *k;
    const void *v;
    const int32_t *tables;
    const int32_t *lens;
    void *out;
    int64_t q_stride_b, q_stride_h, out_stride_b, out_stride_h;
    int batch, heads, kv_heads, head_dim, block_size, table_width, num_blocks;
    float scale;
    int num_threads; /* >= 1: the most threads run_items may use (the launcher's choice) */
    /* Shared prefixes (paged_decode_share.h), or share_groups 0 and the pointers NULL: */
    int share_groups;
    const int32_t *share_rows;   /* the groups' rows, group after group */
    const int32_t *share_bounds; /* group g: share_rows[share_bounds[g] .. share_bounds[g + 1]) */
    const int32_t *starts;       /* per row: the tokens the share pass attends (0: none) */
    float *state; /* [batch][heads][head_dim + 2]: a head's acc, max and sum after them */
} Args;

/* The tokens of the chunk that begins at token t0 of a len-token context: at most CHUNK,
 * never past the end of t0's block nor of the context (t0 < len). */
static inline int chunk_tokens(int block_size, int t0, int len) {
    int n = block_size - t0 % block_size;
    if (n > CHUNK) n = CHUNK;
    return n < len - t0 ? n : len - t0;
}

/* Token t's slot in the pool (block id times block_size plus its place in the block): the
 * caches' rows are slot * kv_heads * head_dim elements in. */
static inline int64_t token_slot(const int32_t *table, int block_size, int t) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

/* One work item: sequence b against kv heads kh0 .. kh0 + nkv - 1 (their query heads), its
 * output written in full. Each variant's is compiled for its instruction sets; run_items
 * calls it. */
typedef void (*ItemFn)(const Args *a, int b, int kh0, int nkv);

/* Every item of a call, `span` kv heads each (kv_heads a multiple of it), each computed whole
 * by one thread (so the result is the same bits whatever the thread count); in parallel
 * when a->num_threads > 1 and OpenMP is built in (run_items.c). Returns the number
 * of threads that ran. */
int run_items(const Args *a, ItemFn item, int span);

/* How many kv heads one item takes where the copy has runs (paged_decode_items.h): all of
 * them where there are 2, 3 or 4, each with a group of 2 or more query heads that fit an
 * item (ITEM_MAX_*), else 1. Only whole rows: a run of 4 of 8 kv heads (head_dim 128) still
 * jumps half a row at every token, and measured no faster than one kv head at a time. Not
 * for groups of 1: there GCC vectorised the run's copy in another order than decode_head's,
 * and a head's output differed in the last bit between the two (tests/test_cpu_kernel.py
 * compares them). A function of the geometry alone, never of the thread count or the
 * batch, so the items, and the bits, are the same however a call runs. */
static inline int run_span(const Args *a) {
    const int G = a->heads / a->kv_heads, span = a->kv_heads;
    const int fits = span * G <= ITEM_MAX_HEADS && span * G * a->head_dim <= ITEM_MAX_ELEMS;
    return span >= 2 && span <= 4 && G >= 2 && fits ? span : 1;
}

/* One share item: kv head kh of shared-prefix group g, for the group's virtual heads v0 ..
 * v0 + nv - 1 (paged_decode_share.h). */
typedef void (*ShareFn)(const Args *a, int g, int kh, int v0, int nv);

/* Every share item of a call (each group's kv heads, its virtual heads MAX_GROUP at a time),
 * before run_items' items read the state they leave, on up to a->num_threads threads as
 * run_items runs its own (run_items.c). */
void run_share_items(const Args *a, ShareFn item);

/* A copy's entry point: returns run_items' thread count. */
typedef int (*Kernel)(const Args *a);

/* paged_decode_bf16.c. The portable bfloat16 copy for instruction-set level `isa` (isa.h):
 * the best one this build has at or below it (the portable copies stop at x86-64-v3). */
Kernel decode_bf16_portable_level(int isa);
/* AVX512-BF16 dot products: 1 when this build has the variant and this CPU runs it, else 0
 * (then decode_bf16_avx512 must not be called). */
int decode_bf16_avx512_usable(void);
int decode_bf16_avx512(const Args *a);
/* The avx512 copy with its scores on AMX tiles (paged_decode_amx.h): 1 when this build has
 * it, this CPU runs it and the OS grants the process tile data, else 0. decode_bf16_amx
 * takes the avx512 copy itself where the tiles do not apply (head_dim not a multiple of
 * 64, blocks not of a multiple of 16 tokens). */
int decode_bf16_amx_usable(void);
int decode_bf16_amx(const Args *a);

#endif
