// SwiGLU `silu(gate) · up`, forward and backward, element-wise in float32:
//   d gate = dy · up · σ(g)(1 + g(1 − σ(g))),  d up = dy · g · σ(g).
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T> __device__ void swiglu_fwd(const T *gate, const T *up, u64 n, T *y) {
    FOR_EACH(i, n) {
        const float g = to_float(gate[i]);
        y[i] = from_float<T>(g * sigmoid(g) * to_float(up[i]));
    }
}

// Writes the gradients asked for (`d_gate`, `d_up` may be the same unused buffer when `which` leaves one out):
// bit 0 of `which`: d gate, bit 1: d up.
template <typename T>
__device__ void swiglu_bwd(const T *gate, const T *up, const T *dy, u64 n, int which, T *d_gate, T *d_up) {
    FOR_EACH(i, n) {
        const float g = to_float(gate[i]), u = to_float(up[i]), d = to_float(dy[i]);
        const float s = sigmoid(g);
        if (which & 1) d_gate[i] = from_float<T>(d * u * (s * (1.0f + g * (1.0f - s))));
        if (which & 2) d_up[i] = from_float<T>(d * g * s);
    }
}

#define FWD(T) (const T *gate, const T *up, u64 n, T *y)
#define BWD(T) (const T *gate, const T *up, const T *dy, u64 n, int which, T *d_gate, T *d_up)

FOR_FLOAT_TYPES(swiglu_fwd, swiglu_fwd, FWD, (gate, up, n, y))
FOR_FLOAT_TYPES(swiglu_bwd, swiglu_bwd, BWD, (gate, up, dy, n, which, d_gate, d_up))
