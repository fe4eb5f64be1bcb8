// The row part of the fused linear cross-entropy: for float32 logits of a block of tokens (one block of threads per
// token), the token's loss `logsumexp(z) − z[label]` (0 for an ignored label, −100) and, when asked, the gradient
// with respect to the logits, `softmax(z) − onehot(label)` (zeros for an ignored label), in the storage dtype. The
// logits themselves come from a cuBLAS GEMM with float32 output.
#include "common.cuh"

template <typename T>
__device__ void ce_rows(const float *logits, const long long *labels, u64 rows, u64 vocab, int with_grad,
                        float *losses, T *dlogits) {
    FOR_EACH_ROW(row, rows) {
        const float *z = logits + row * vocab;
        const long long label = labels[row];
        float m = -INFINITY;
        for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, z[j]);
        m = block_max(m);
        float sum = 0.0f;
        for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(z[j] - m);
        sum = block_sum(sum);
        if (threadIdx.x == 0) {
            losses[row] = label == -100 ? 0.0f : m + logf(sum) - z[label];
        }
        if (with_grad) {
            T *d = dlogits + row * vocab;
            const float inv = 1.0f / sum;
            for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) {
                const float p = label == -100 ? 0.0f : expf(z[j] - m) * inv - ((long long)j == label ? 1.0f : 0.0f);
                d[j] = from_float<T>(p);
            }
        }
    }
}

#define ROWS(T)                                                                                                \
    (const float *logits, const long long *labels, u64 rows, u64 vocab, int with_grad, float *losses, T *dlogits)

FOR_FLOAT_TYPES(ce_rows, ce_rows, ROWS, (logits, labels, rows, vocab, with_grad, losses, dlogits))

// The loss: Σ of the `n` token losses, by one block (deterministic), into `*total`.
extern "C" __global__ void ce_sum(const float *losses, u64 n, float *total) {
    float s = 0.0f;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) s += losses[i];
    s = block_sum(s);
    if (threadIdx.x == 0) *total = s;
}

// The backward: the hidden states' gradient `dh` (float32) times the upstream gradient of the loss `*g`, rounded
// once to the activations' dtype — what the CPU path computes.
template <typename T> __device__ void ce_scale(const float *dh, const float *g, u64 n, T *out) {
    const float scale = *g;
    FOR_EACH(i, n) { out[i] = from_float<T>(dh[i] * scale); }
}

#define SCALE(T) (const float *dh, const float *g, u64 n, T *out)
FOR_FLOAT_TYPES(ce_scale, ce_scale, SCALE, (dh, g, n, out))
