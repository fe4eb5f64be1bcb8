// The optimizers' updates on the device, operation for operation as `src/optim` does them on the CPU (float32
// IEEE arithmetic, no fused multiply-adds), so the states and parameters are bit-identical:
// - `adamw8bit`: bitsandbytes' blockwise 8-bit AdamW (`optim::adamw8bit`), one block of 256 threads per 256
//   elements: dequantize both moments, update them, reduce the block's new absmax, step and decay the parameter,
//   re-quantize by the 8-bit search (with the sign fix for m). A NaN/Inf gradient zeroes that element's moments.
// - `adamw_bnb32`: bitsandbytes' 32-bit kernel (`optim::adamw::adamw_bnb32_update`).
// - `adamw_torch`: `torch.optim.AdamW` (`optim::adamw::adamw_torch_update`).
// The parameters and gradients are float32 (LoRA masters); the step's scalars come from the host.
#include "common.cuh"

// `quant::dynamic_map::quantize_dynamic`: bitsandbytes' binary search over a sorted 256-entry map, then the closer
// of the last two probes.
__device__ __forceinline__ unsigned char quantize_dynamic(const float *code, float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = code[0] < 0.0f ? -1.0f : 0.0f;
    float upper = 1.0f;
    float val = code[pivot];
    for (int step = 64; step > 0; step >>= 1) {
        if (x > val) {
            lower_pivot = pivot;
            lower = val;
            pivot += step;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= step;
        }
        val = code[pivot];
    }
    if (upper_pivot == 255) upper = code[255];
    if (lower_pivot == 0) lower = code[0];
    int chosen;
    if (x > val) {
        chosen = x > (upper + val) * 0.5f ? upper_pivot : pivot;
    } else {
        chosen = x < (lower + val) * 0.5f ? lower_pivot : pivot;
    }
    return (unsigned char)chosen;
}

extern "C" __global__ void adamw8bit(float *p, const float *g, unsigned char *state1, unsigned char *state2,
                                     float *absmax1, float *absmax2, const float *qmap1, const float *qmap2, u64 n,
                                     float b1, float b2, float step_size, float denom_eps, float decay,
                                     int weight_decay) {
    __shared__ float q1[256], q2[256];
    q1[threadIdx.x] = qmap1[threadIdx.x];
    q2[threadIdx.x] = qmap2[threadIdx.x];
    __syncthreads();
    for (u64 block = blockIdx.x; block * 256 < n; block += gridDim.x) {
        const u64 i = block * 256 + threadIdx.x;
        const bool in = i < n;
        // Padding beyond the tensor: g = 0, codes 128 / 0 (the kernel's load defaults).
        const float gj = in ? g[i] : 0.0f;
        const unsigned char c1 = in ? state1[i] : 128, c2 = in ? state2[i] : 0;
        const float a1 = absmax1[block], a2 = absmax2[block];
        float s1 = 0.0f, s2 = 0.0f;
        const bool finite = isfinite(gj);
        if (finite) {
            const float v = q2[c2] * a2;
            s2 = v * b2 + (1.0f - b2) * gj * gj;
            const float m = q1[c1] * a1;
            s1 = m * b1 + (1.0f - b1) * gj;
        }
        // The block's new absmax of each moment (padding included); no lower than f32::MIN, where the CPU's fold
        // starts (NaN moments are skipped by both maxima).
        const float max1 = fmaxf(block_max(fabsf(s1)), -3.40282347e38f);
        const float max2 = fmaxf(block_max(fabsf(s2)), -3.40282347e38f);
        if (in) {
            if (finite) {
                float pj = p[i] + step_size * (s1 / (sqrtf(s2) + denom_eps));
                if (weight_decay) pj = pj * decay;
                p[i] = pj;
            }
            unsigned char n1 = quantize_dynamic(q1, s1 / max1);
            // Keep the sign of m through quantization.
            if ((signbit(q1[n1]) != 0) != (signbit(s1) != 0)) n1 = s1 > 0.0f ? (unsigned char)(n1 + 1) : (unsigned char)(n1 - 1);
            state1[i] = n1;
            state2[i] = quantize_dynamic(q2, s2 / max2);
        }
        __syncthreads(); // every thread read the old absmax before it is replaced
        if (threadIdx.x == 0) {
            absmax1[block] = max1;
            absmax2[block] = max2;
        }
    }
}

extern "C" __global__ void adamw_bnb32(float *p, const float *g, float *s1, float *s2, u64 n, float b1, float b2,
                                       float step_size, float denom_eps, float decay, int weight_decay) {
    FOR_EACH(i, n) {
        const float gi = g[i];
        const float m = s1[i] * b1 + (1.0f - b1) * gi;
        const float v = s2[i] * b2 + (1.0f - b2) * (gi * gi);
        s1[i] = m;
        s2[i] = v;
        float pi = p[i] + step_size * (m / (sqrtf(v) + denom_eps));
        if (weight_decay) pi = pi * decay;
        p[i] = pi;
    }
}

extern "C" __global__ void adamw_torch(float *p, const float *g, float *m, float *v, u64 n, float w1, float b2,
                                       float w2, float step_size, float bc2, float eps, float decay,
                                       int weight_decay) {
    FOR_EACH(i, n) {
        float pi = p[i];
        if (weight_decay) pi = pi * decay;
        const float gi = g[i];
        const float mi = m[i] + w1 * (gi - m[i]);
        const float vi = v[i] * b2 + w2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) / bc2 + eps;
        p[i] = pi - step_size * mi / denom;
    }
}

// Gradient clipping's squared global norm without a read per tensor: `sum_squares` writes Σ g² of one gradient
// (float64, one block of blockDim.x threads, a multiple of 32) to `*partial`, and `sum_partials` adds the tensors'
// partials in order into `*total`. Deterministic: the same gradients give the same bits on every run.
extern "C" __global__ void sum_squares(const float *g, u64 n, double *partial) {
    __shared__ double warp_sums[32];
    double s = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        const double v = (double)g[i];
        s += v * v;
    }
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) total += warp_sums[w];
        *partial = total;
    }
}

extern "C" __global__ void sum_partials(const double *partials, u64 n, double *total) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        double s = 0.0;
        for (u64 i = 0; i < n; ++i) s += partials[i];
        *total = s;
    }
}
