// RMSNorm with a frozen weight, forward and backward, one block per row, in float32 whatever the storage dtype:
//   y = x · r · w,  r = 1 / sqrt(mean(x²) + eps);
//   dx = r · (g⊙w − x · r · mean(g⊙w⊙x·r)).
// The weight is float32 (as the model stores norms).
#include "common.cuh"

// r = 1 / sqrt(mean(x²) + eps) of the row `xr` of `h` values (every thread of the block gets it).
template <typename T> __device__ __forceinline__ float inverse_rms(const T *xr, u64 h, float eps) {
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) {
        const float v = to_float(xr[j]);
        sum += v * v;
    }
    return 1.0f / sqrtf(block_sum(sum) / (float)h + eps);
}

template <typename T> __device__ void rms_norm_fwd(const T *x, const float *w, float eps, u64 rows, u64 h, T *y) {
    FOR_EACH_ROW(row, rows) {
        const T *xr = x + row * h;
        const float r = inverse_rms(xr, h, eps);
        for (u64 j = threadIdx.x; j < h; j += blockDim.x) {
            y[row * h + j] = from_float<T>(to_float(xr[j]) * r * w[j]);
        }
    }
}

template <typename T>
__device__ void rms_norm_bwd(const T *x, const float *w, const T *grad, float eps, u64 rows, u64 h, T *dx) {
    FOR_EACH_ROW(row, rows) {
        const T *xr = x + row * h;
        const T *gr = grad + row * h;
        const float r = inverse_rms(xr, h, eps);
        float proj = 0.0f;
        for (u64 j = threadIdx.x; j < h; j += blockDim.x) {
            proj += to_float(gr[j]) * w[j] * to_float(xr[j]) * r;
        }
        proj = block_sum(proj) / (float)h;
        for (u64 j = threadIdx.x; j < h; j += blockDim.x) {
            const float gw = to_float(gr[j]) * w[j];
            dx[row * h + j] = from_float<T>(r * (gw - to_float(xr[j]) * r * proj));
        }
    }
}

#define FWD(T) (const T *x, const float *w, float eps, u64 rows, u64 h, T *y)
#define BWD(T) (const T *x, const float *w, const T *grad, float eps, u64 rows, u64 h, T *dx)

FOR_FLOAT_TYPES(rms_norm_fwd, rms_norm_fwd, FWD, (x, w, eps, rows, h, y))
FOR_FLOAT_TYPES(rms_norm_bwd, rms_norm_bwd, BWD, (x, w, grad, eps, rows, h, dx))
