// Embedding lookup for a frozen table: out[i, :] = table[ids[i], :], one block per token (grid-stride over
// tokens), the ids read on the device (Candle's index_select would upload the ids' layout with every call). The
// ids are range-checked on the host before the launch.
#include "common.cuh"

template <typename T> __device__ void embedding_rows(const T *table, const unsigned int *ids, u64 n, u64 hidden, T *out) {
    FOR_EACH_ROW(row, n) {
        const T *src = table + (u64)ids[row] * hidden;
        for (u64 j = threadIdx.x; j < hidden; j += blockDim.x) out[row * hidden + j] = src[j];
    }
}

#define ROWS(T) (const T *table, const unsigned int *ids, u64 n, u64 hidden, T *out)
FOR_FLOAT_TYPES(embedding_rows, embedding_rows, ROWS, (table, ids, n, hidden, out))
