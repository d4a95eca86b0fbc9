/*
 * store_kv: one step's new K and V rows copied into their slots of the paged pool, one
 * memcpy per row (a row is a token's kv_heads x head_dim elements, contiguous in the pool).
 *
 * Why C: torch's index_copy_ (the torch backend's store) copies element by element on the
 * CPU, several times slower than the rows' bytes need at prefill, where a step stores
 * hundreds of rows per layer (bench/test_store_kv_bench.py measures both in one process).
 * The copy is exact, so there is no arithmetic to keep in step with a reference: the
 * readable one is paged_engine/kernels/store_kv_ref.py, and the launcher that checks shapes,
 * strides and dtypes once per step is paged_engine/kernels/store_kv_cpu.py.
 *
 * A negative slot is skipped (a padded row, or a token whose block a prefix-cache hit
 * already filled). Every slot is checked against the pool before any row is written, so a
 * bad slot mapping raises and leaves the pool as it was.
 *
 * An entry point of the _cpu_kernels module (its method table is in paged_decode_cpu.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "paged_decode_cpu.h"

PyObject *py_store_kv(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long key, value, k_cache, v_cache, slots;
    long long key_stride, value_stride, rows, row_bytes, num_slots;
    if (!PyArg_ParseTuple(args, "KLKLKKKLLL", &key, &key_stride, &value, &value_stride,
                          &k_cache, &v_cache, &slots, &rows, &row_bytes, &num_slots))
        return NULL;
    if (rows < 0 || row_bytes < 1 || num_slots < 0 || key_stride < row_bytes ||
        value_stride < row_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "store_kv: needs rows >= 0, row_bytes >= 1, num_slots >= 0 and row "
                     "strides of at least row_bytes (got rows %lld, row_bytes %lld, "
                     "num_slots %lld, strides %lld and %lld bytes)",
                     rows, row_bytes, num_slots, key_stride, value_stride);
        return NULL;
    }
    const int64_t *slot = (const int64_t *)(uintptr_t)slots;
    for (long long i = 0; i < rows; i++) {
        if (slot[i] >= num_slots) {
            PyErr_Format(PyExc_ValueError,
                         "store_kv: row %lld's slot %lld is outside the pool's %lld slots",
                         i, (long long)slot[i], num_slots);
            return NULL;
        }
    }
    const char *k = (const char *)(uintptr_t)key, *v = (const char *)(uintptr_t)value;
    char *kc = (char *)(uintptr_t)k_cache, *vc = (char *)(uintptr_t)v_cache;
    long long stored = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (long long i = 0; i < rows; i++) {
        if (slot[i] < 0) continue;
        memcpy(kc + slot[i] * row_bytes, k + i * key_stride, (size_t)row_bytes);
        memcpy(vc + slot[i] * row_bytes, v + i * value_stride, (size_t)row_bytes);
        stored++;
    }
    Py_END_ALLOW_THREADS;
    return PyLong_FromLongLong(stored);
}
