// Gated activations `act(gate) · up`, forward and backward, element-wise in float32 (the CPU op's formulas):
//   SwiGLU: act = silu,  d gate = dy · up · σ(g)(1 + g(1 − σ(g))),  d up = dy · g · σ(g);
//   GeGLU:  act = the tanh GELU, computed as g·σ(2u) with u = √(2/π)(g + 0.044715 g³) (`ops/swiglu.rs`).
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

// σ(2u) and 1 − σ(2u) of the tanh GELU, the second without cancellation.
__device__ __forceinline__ void gelu_parts(float g, float *s, float *rest) {
    const float z = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    const float e = expf(-z);
    *s = 1.0f / (1.0f + e);
    *rest = e < 1.0f ? e * *s : 1.0f - *s;
}

template <typename T> __device__ void geglu_tanh_fwd(const T *gate, const T *up, u64 n, T *y) {
    FOR_EACH(i, n) {
        const float g = to_float(gate[i]);
        float s, rest;
        gelu_parts(g, &s, &rest);
        y[i] = from_float<T>(g * s * to_float(up[i]));
    }
}

template <typename T>
__device__ void geglu_tanh_bwd(const T *gate, const T *up, const T *dy, u64 n, int which, T *d_gate, T *d_up) {
    FOR_EACH(i, n) {
        const float g = to_float(gate[i]), u = to_float(up[i]), d = to_float(dy[i]);
        float s, rest;
        gelu_parts(g, &s, &rest);
        const float dz = 1.5957691216057308f * (1.0f + 0.134145f * g * g);
        if (which & 1) d_gate[i] = from_float<T>(d * u * (s + g * s * rest * dz));
        if (which & 2) d_up[i] = from_float<T>(d * g * s);
    }
}

#define FWD(T) (const T *gate, const T *up, u64 n, T *y)
#define BWD(T) (const T *gate, const T *up, const T *dy, u64 n, int which, T *d_gate, T *d_up)

FOR_FLOAT_TYPES(swiglu_fwd, swiglu_fwd, FWD, (gate, up, n, y))
FOR_FLOAT_TYPES(swiglu_bwd, swiglu_bwd, BWD, (gate, up, dy, n, which, d_gate, d_up))
FOR_FLOAT_TYPES(geglu_tanh_fwd, geglu_tanh_fwd, FWD, (gate, up, n, y))
FOR_FLOAT_TYPES(geglu_tanh_bwd, geglu_tanh_bwd, BWD, (gate, up, dy, n, which, d_gate, d_up))
