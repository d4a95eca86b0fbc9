/*
 * A test harness for csrc/run_items.c (tests/test_item_order.py compiles it): the driver's
 * own source included whole, and a work item that only records which sequence it was
 * given, so the order run_items runs a call's sequences in can be read back. No kernel, no
 * Python: stdin holds batches, each "batch width block_size", then batch lengths, then
 * batch x width block ids; stdout gets one line per batch, the sequence indices in the
 * order their items ran. Built without OpenMP: the one-thread path (both paths walk the
 * same order array).
 */
#include <stdio.h>
#include <stdlib.h>

#include "run_items.c"

static int ran[1 << 16];
static int count;

static void record(const Args *a, int b, int kh0, int nkv) {
    (void)a, (void)nkv;
    if (kh0 == 0 && count < (int)(sizeof ran / sizeof ran[0])) ran[count++] = b;
}

int main(void) {
    int batch, width, block_size;
    while (scanf("%d %d %d", &batch, &width, &block_size) == 3) {
        int32_t *lens = malloc(sizeof(int32_t) * (size_t)(batch + 1));
        int32_t *tables = malloc(sizeof(int32_t) * (size_t)(batch * width + 1));
        if (lens == NULL || tables == NULL) return 2;
        for (int b = 0; b < batch; b++)
            if (scanf("%d", &lens[b]) != 1) return 3;
        for (int i = 0; i < batch * width; i++)
            if (scanf("%d", &tables[i]) != 1) return 3;
        Args a = {0};
        a.batch = batch;
        a.kv_heads = 2;
        a.block_size = block_size;
        a.table_width = width;
        a.tables = tables;
        a.lens = lens;
        a.num_threads = 1;
        count = 0;
        run_items(&a, record, 1);
        for (int i = 0; i < count; i++) printf(i ? " %d" : "%d", ran[i]);
        printf("\n");
        free(lens);
        free(tables);
    }
    return 0;
}
