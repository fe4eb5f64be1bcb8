// cuBLAS of the emulated device (libcublas.so.N): handles bound to a stream and the GEMM entry points Candle and the
// crate call — S/D/H gemm, GemmEx and the strided-batched forms — column-major as cuBLAS defines them, N or T
// operands, alpha and beta read in the pointer mode's place and the compute type's precision. Products accumulate in
// float32 (float64 for double GEMMs) in a fixed order; beta == 0 does not read C, as cuBLAS does not. Every operand
// span is checked to lie inside one live device allocation; a violation fails naming the call and the operand.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"
#include "half.h"

using namespace emu;

namespace {

enum Status : int {
    SUCCESS = 0,
    NOT_INITIALIZED = 1,
    INVALID_VALUE = 7,
    EXECUTION_FAILED = 13,
    NOT_SUPPORTED = 15,
};
enum DataType : int { R_32F = 0, R_64F = 1, R_16F = 2, R_16BF = 14 };
enum ComputeType : int {
    COMPUTE_16F = 64,
    COMPUTE_16F_PEDANTIC = 65,
    COMPUTE_32F = 68,
    COMPUTE_32F_PEDANTIC = 69,
    COMPUTE_64F = 70,
    COMPUTE_64F_PEDANTIC = 71,
    COMPUTE_32F_FAST_16F = 74,
    COMPUTE_32F_FAST_16BF = 75,
    COMPUTE_32F_FAST_TF32 = 77,
};

struct Handle {
    void *stream = nullptr;
    int pointer_mode = 0;  // 0: alpha and beta in host memory, 1: in device memory
    int math_mode = 0;
};

std::mutex g_lock;
std::set<const Handle *> g_handles;

int refuse(int status, const char *api, const std::string &why) {
    fail(status, format("%s: %s", api, why.c_str()));
    return status;
}

bool live(const Handle *h) {
    std::lock_guard<std::mutex> hold(g_lock);
    return g_handles.count(h) != 0;
}

size_t element_size(int type) {
    switch (type) {
    case R_32F: return 4;
    case R_64F: return 8;
    case R_16F:
    case R_16BF: return 2;
    default: return 0;
    }
}

const char *type_name(int type) {
    switch (type) {
    case R_32F: return "CUDA_R_32F";
    case R_64F: return "CUDA_R_64F";
    case R_16F: return "CUDA_R_16F";
    case R_16BF: return "CUDA_R_16BF";
    default: return "an unsupported cudaDataType";
    }
}

double load(const void *p, int type, size_t index) {
    switch (type) {
    case R_32F: return static_cast<const float *>(p)[index];
    case R_64F: return static_cast<const double *>(p)[index];
    case R_16F: return half_to_float(static_cast<const uint16_t *>(p)[index]);
    default: return bf16_to_float(static_cast<const uint16_t *>(p)[index]);
    }
}

void store(void *p, int type, size_t index, double v) {
    switch (type) {
    case R_32F: static_cast<float *>(p)[index] = static_cast<float>(v); break;
    case R_64F: static_cast<double *>(p)[index] = v; break;
    case R_16F: static_cast<uint16_t *>(p)[index] = float_to_half(static_cast<float>(v)); break;
    default: static_cast<uint16_t *>(p)[index] = float_to_bf16(static_cast<float>(v)); break;
    }
}

// One GEMM call, validated, in float32 or float64 arithmetic.
struct Gemm {
    const char *api;
    const Handle *handle;
    int transa, transb;
    long long m, n, k;
    const void *alpha, *beta;  // of `scalar_type`
    int scalar_type;
    const void *a;
    int a_type;
    long long lda, stride_a;
    const void *b;
    int b_type;
    long long ldb, stride_b;
    void *c;
    int c_type;
    long long ldc, stride_c;
    long long batch;
    bool wide;  // float64 arithmetic (double GEMMs)
};

// Checks that the `rows` × `cols` column-major operand with leading dimension `ld`, `batch` times `stride` apart,
// lies in one live allocation (alpha and beta need no check: in either pointer mode they are read in place, the
// emulated device sharing the host's address space).
std::string check_operand(const char *name, const void *p, int type, long long rows, long long cols, long long ld,
                          long long stride, long long batch) {
    if (rows == 0 || cols == 0 || batch == 0) return "";
    const long long last = (batch - 1) * stride + (cols - 1) * ld + rows;  // one past the last element
    const std::string bad = check_range(reinterpret_cast<uintptr_t>(p), static_cast<size_t>(last) * element_size(type));
    return bad.empty() ? bad : format("operand %s (%lld × %lld, ld %lld): %s", name, rows, cols, ld, bad.c_str());
}

// One tile of the product: 2 × 16 bytes of rows of the four columns from j0, the rows' values of op(A) in `panel`
// (k × rows, p-major, so the loop reads it in order), the sums kept in vector registers (GCC's vector extension:
// lane-wise IEEE arithmetic, nothing reassociated) while p runs. Each element is Σ_p a[i, p] · b[p, j] added in
// ascending p from zero, the order every tile, panel and thread count keeps, so the rounding never depends on them.
template <typename T>
inline void product_tile(const T *panel, const T *pb, T *acc, long long m, long long k, long long i0, long long j0) {
    typedef T Lanes __attribute__((vector_size(16)));
    constexpr long long L = 16 / sizeof(T);  // two vectors of rows, four columns: eight sums
    Lanes s00 = {}, s01 = {}, s10 = {}, s11 = {}, s20 = {}, s21 = {}, s30 = {}, s31 = {};
    const T *b0 = pb + j0 * k, *b1 = b0 + k, *b2 = b1 + k, *b3 = b2 + k;
    for (long long p = 0; p < k; p++) {
        Lanes c0, c1;
        __builtin_memcpy(&c0, panel + p * 2 * L, sizeof(c0));
        __builtin_memcpy(&c1, panel + p * 2 * L + L, sizeof(c1));
        s00 += c0 * b0[p], s01 += c1 * b0[p];
        s10 += c0 * b1[p], s11 += c1 * b1[p];
        s20 += c0 * b2[p], s21 += c1 * b2[p];
        s30 += c0 * b3[p], s31 += c1 * b3[p];
    }
    const Lanes out[8] = {s00, s01, s10, s11, s20, s21, s30, s31};
    for (long long jj = 0; jj < 4; jj++) __builtin_memcpy(acc + (j0 + jj) * m + i0, &out[2 * jj], 2 * sizeof(Lanes));
}

// The edge of the product the full tiles leave: every element one by one, in the same order.
template <typename T>
void product_edge(const T *pa, const T *pb, T *acc, long long m, long long k, long long i0, long long i1,
                  long long j0, long long j1) {
    for (long long j = j0; j < j1; j++)
        for (long long i = i0; i < i1; i++) {
            T sum = 0;
            for (long long p = 0; p < k; p++) sum += pa[p * m + i] * pb[j * k + p];
            acc[j * m + i] = sum;
        }
}

// Columns j0 … j1 of acc = op(A) · op(B) (op(A) packed column-major m × k, op(B) k × n): panel by panel of rows
// (copied p-major, so a panel stays in cache while every column tile reads it), then the edges.
template <typename T>
void product_columns(const T *pa, const T *pb, T *acc, long long m, long long k, long long j0, long long j1) {
    constexpr long long TI = 2 * 16 / sizeof(T), TJ = 4;
    const long long m_full = m - m % TI, j_full = j0 + (j1 - j0) / TJ * TJ;
    std::vector<T> panel(static_cast<size_t>(k * TI));
    for (long long i0 = 0; i0 < m_full; i0 += TI) {
        for (long long p = 0; p < k; p++) std::copy(pa + p * m + i0, pa + p * m + i0 + TI, &panel[p * TI]);
        for (long long j = j0; j < j_full; j += TJ) product_tile<T>(panel.data(), pb, acc, m, k, i0, j);
    }
    product_edge(pa, pb, acc, m, k, m_full, m, j0, j_full);
    product_edge(pa, pb, acc, m, k, 0, m, j_full, j1);
}

// acc = op(A) · op(B), the column tiles shared among the host's cores (CUDA_EMU_THREADS, default all): each thread
// writes its own columns, and each element's sum order is fixed, so the result is the same for any thread count.
template <typename T>
void accumulate(const std::vector<T> &pa, const std::vector<T> &pb, std::vector<T> &acc, long long m, long long n,
                long long k) {
    const long long work = m * n * k;
    const long long threads = std::max<long long>(1, std::min<long long>(config().threads, work / (1 << 20)));
    const long long per_thread = ((n + threads - 1) / threads + 3) / 4 * 4;  // whole column tiles
    std::vector<std::thread> pool;
    for (long long j0 = per_thread; j0 < n; j0 += per_thread)
        pool.emplace_back(product_columns<T>, pa.data(), pb.data(), acc.data(), m, k, j0, std::min(n, j0 + per_thread));
    product_columns<T>(pa.data(), pb.data(), acc.data(), m, k, 0, std::min(n, per_thread));
    for (auto &t : pool) t.join();
}

int run(const Gemm &g) {
    if (!g.handle || !live(g.handle)) return refuse(NOT_INITIALIZED, g.api, "the handle is not a live cublasCreate handle");
    if (sticky_error()) return refuse(EXECUTION_FAILED, g.api, earlier_failure());
    if (g.transa < 0 || g.transa > 1 || g.transb < 0 || g.transb > 1)
        return refuse(INVALID_VALUE, g.api, "only CUBLAS_OP_N and CUBLAS_OP_T are emulated (real matrices)");
    if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0)
        return refuse(INVALID_VALUE, g.api, format("negative size m %lld n %lld k %lld batch %lld", g.m, g.n, g.k, g.batch));
    for (int t : {g.a_type, g.b_type, g.c_type})
        if (!element_size(t)) return refuse(NOT_SUPPORTED, g.api, format("cudaDataType %d is not emulated", t));
    if (g.a_type != g.b_type)
        return refuse(NOT_SUPPORTED, g.api, format("A is %s but B is %s", type_name(g.a_type), type_name(g.b_type)));
    const long long a_rows = g.transa ? g.k : g.m, a_cols = g.transa ? g.m : g.k;
    const long long b_rows = g.transb ? g.n : g.k, b_cols = g.transb ? g.k : g.n;
    const struct {
        const char *name;
        long long ld, rows;
    } leading[] = {{"lda", g.lda, a_rows}, {"ldb", g.ldb, b_rows}, {"ldc", g.ldc, g.m}};
    for (const auto &l : leading)
        if (l.ld < std::max<long long>(1, l.rows))
            return refuse(INVALID_VALUE, g.api, format("%s %lld is below the operand's %lld rows", l.name, l.ld, l.rows));
    for (const std::string &bad :
         {check_operand("A", g.a, g.a_type, a_rows, a_cols, g.lda, g.stride_a, g.batch),
          check_operand("B", g.b, g.b_type, b_rows, b_cols, g.ldb, g.stride_b, g.batch),
          check_operand("C", g.c, g.c_type, g.m, g.n, g.ldc, g.stride_c, g.batch)})
        if (!bad.empty()) return refuse(EXECUTION_FAILED, g.api, bad);
    count_launch(std::string("cublas:") + g.api);
    note_kernel(g.handle->stream);
    if (g.m == 0 || g.n == 0 || g.batch == 0) return SUCCESS;

    const double alpha = load(g.alpha, g.scalar_type, 0), beta = load(g.beta, g.scalar_type, 0);
    const size_t es_a = element_size(g.a_type), es_b = element_size(g.b_type), es_c = element_size(g.c_type);
    // op(A) packed column-major (m × k) and op(B) (k × n), in the arithmetic's precision.
    std::vector<double> wa, wb, wacc;
    std::vector<float> fa, fb, facc;
    const size_t mk = static_cast<size_t>(g.m * g.k), kn = static_cast<size_t>(g.k * g.n), mn = static_cast<size_t>(g.m * g.n);
    if (g.wide) wa.resize(mk), wb.resize(kn), wacc.resize(mn);
    else fa.resize(mk), fb.resize(kn), facc.resize(mn);
    for (long long batch = 0; batch < g.batch; batch++) {
        const char *a = static_cast<const char *>(g.a) + batch * g.stride_a * es_a;
        const char *b = static_cast<const char *>(g.b) + batch * g.stride_b * es_b;
        char *c = static_cast<char *>(g.c) + batch * g.stride_c * es_c;
        for (long long p = 0; p < g.k; p++)
            for (long long i = 0; i < g.m; i++) {
                const double v = load(a, g.a_type, g.transa ? i * g.lda + p : p * g.lda + i);
                if (g.wide) wa[p * g.m + i] = v;
                else fa[p * g.m + i] = static_cast<float>(v);
            }
        for (long long j = 0; j < g.n; j++)
            for (long long p = 0; p < g.k; p++) {
                const double v = load(b, g.b_type, g.transb ? p * g.ldb + j : j * g.ldb + p);
                if (g.wide) wb[j * g.k + p] = v;
                else fb[j * g.k + p] = static_cast<float>(v);
            }
        if (g.wide) accumulate(wa, wb, wacc, g.m, g.n, g.k);
        else accumulate(fa, fb, facc, g.m, g.n, g.k);
        for (long long j = 0; j < g.n; j++)
            for (long long i = 0; i < g.m; i++) {
                const size_t at = static_cast<size_t>(j * g.ldc + i);
                double v;
                if (g.wide) {
                    v = alpha * wacc[j * g.m + i];
                    if (beta != 0) v += beta * load(c, g.c_type, at);
                } else {
                    // float32 arithmetic throughout, as the 32F compute types do.
                    float f = static_cast<float>(alpha) * facc[j * g.m + i];
                    if (beta != 0) f += static_cast<float>(beta) * static_cast<float>(load(c, g.c_type, at));
                    v = f;
                }
                store(c, g.c_type, at, v);
            }
    }
    return SUCCESS;
}

// The scalar type of alpha and beta for a compute type (cuBLAS: half for 16F, double for 64F, else float).
int scalar_type_of(int compute) {
    if (compute == COMPUTE_16F || compute == COMPUTE_16F_PEDANTIC) return R_16F;
    if (compute == COMPUTE_64F || compute == COMPUTE_64F_PEDANTIC) return R_64F;
    return R_32F;
}

bool known_compute(int compute) {
    switch (compute) {
    case COMPUTE_16F: case COMPUTE_16F_PEDANTIC: case COMPUTE_32F: case COMPUTE_32F_PEDANTIC: case COMPUTE_64F:
    case COMPUTE_64F_PEDANTIC: case COMPUTE_32F_FAST_16F: case COMPUTE_32F_FAST_16BF: case COMPUTE_32F_FAST_TF32:
        return true;
    default: return false;
    }
}

}  // namespace

extern "C" {

int cublasCreate_v2(Handle **handle) {
    if (!handle) return refuse(INVALID_VALUE, "cublasCreate_v2", "null handle pointer");
    auto *h = new Handle();
    std::lock_guard<std::mutex> hold(g_lock);
    g_handles.insert(h);
    *handle = h;
    return SUCCESS;
}

int cublasDestroy_v2(Handle *handle) {
    std::lock_guard<std::mutex> hold(g_lock);
    if (!g_handles.erase(handle)) {
        fail(NOT_INITIALIZED, "cublasDestroy_v2: not a live handle");
        return NOT_INITIALIZED;
    }
    delete handle;
    return SUCCESS;
}

int cublasSetStream_v2(Handle *handle, void *stream) {
    if (!live(handle)) return refuse(NOT_INITIALIZED, "cublasSetStream_v2", "not a live handle");
    if (!valid_stream(stream)) return refuse(INVALID_VALUE, "cublasSetStream_v2", "not a live stream");
    handle->stream = stream;
    return SUCCESS;
}

int cublasGetStream_v2(Handle *handle, void **stream) {
    if (!live(handle)) return refuse(NOT_INITIALIZED, "cublasGetStream_v2", "not a live handle");
    *stream = handle->stream;
    return SUCCESS;
}

int cublasSetWorkspace_v2(Handle *handle, void *, size_t) {
    return live(handle) ? SUCCESS : refuse(NOT_INITIALIZED, "cublasSetWorkspace_v2", "not a live handle");
}

int cublasSetPointerMode_v2(Handle *handle, int mode) {
    if (!live(handle)) return refuse(NOT_INITIALIZED, "cublasSetPointerMode_v2", "not a live handle");
    if (mode != 0 && mode != 1) return refuse(INVALID_VALUE, "cublasSetPointerMode_v2", format("mode %d", mode));
    handle->pointer_mode = mode;
    return SUCCESS;
}

int cublasGetPointerMode_v2(Handle *handle, int *mode) {
    if (!live(handle)) return refuse(NOT_INITIALIZED, "cublasGetPointerMode_v2", "not a live handle");
    *mode = handle->pointer_mode;
    return SUCCESS;
}

int cublasSetMathMode(Handle *handle, int mode) {
    if (!live(handle)) return refuse(NOT_INITIALIZED, "cublasSetMathMode", "not a live handle");
    handle->math_mode = mode;
    return SUCCESS;
}

int cublasGetMathMode(Handle *handle, int *mode) {
    if (!live(handle)) return refuse(NOT_INITIALIZED, "cublasGetMathMode", "not a live handle");
    *mode = handle->math_mode;
    return SUCCESS;
}

int cublasGemmStridedBatchedEx(Handle *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *a,
                               int at, int lda, long long sa, const void *b, int bt, int ldb, long long sb,
                               const void *beta, void *c, int ct, int ldc, long long sc, int batch, int compute, int) {
    if (!known_compute(compute))
        return refuse(NOT_SUPPORTED, "cublasGemmStridedBatchedEx", format("compute type %d is not emulated", compute));
    const int st = scalar_type_of(compute);
    return run({"cublasGemmStridedBatchedEx", h, ta, tb, m, n, k, alpha, beta, st, a, at, lda,
                sa, b, bt, ldb, sb, c, ct, ldc, sc, batch, st == R_64F});
}

int cublasGemmEx(Handle *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int at, int lda,
                 const void *b, int bt, int ldb, const void *beta, void *c, int ct, int ldc, int compute, int) {
    if (!known_compute(compute))
        return refuse(NOT_SUPPORTED, "cublasGemmEx", format("compute type %d is not emulated", compute));
    const int st = scalar_type_of(compute);
    return run({"cublasGemmEx", h, ta, tb, m, n, k, alpha, beta, st, a, at, lda, 0, b, bt, ldb, 0,
                c, ct, ldc, 0, 1, st == R_64F});
}

int cublasSgemm_v2(Handle *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *a, int lda,
                   const float *b, int ldb, const float *beta, float *c, int ldc) {
    return run({"cublasSgemm_v2", h, ta, tb, m, n, k, alpha, beta, R_32F, a, R_32F, lda, 0, b, R_32F, ldb, 0, c, R_32F,
                ldc, 0, 1, false});
}

int cublasDgemm_v2(Handle *h, int ta, int tb, int m, int n, int k, const double *alpha, const double *a, int lda,
                   const double *b, int ldb, const double *beta, double *c, int ldc) {
    return run({"cublasDgemm_v2", h, ta, tb, m, n, k, alpha, beta, R_64F, a, R_64F, lda, 0, b, R_64F, ldb, 0, c, R_64F,
                ldc, 0, 1, true});
}

int cublasSgemmStridedBatched(Handle *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *a,
                              int lda, long long sa, const float *b, int ldb, long long sb, const float *beta,
                              float *c, int ldc, long long sc, int batch) {
    return run({"cublasSgemmStridedBatched", h, ta, tb, m, n, k, alpha, beta, R_32F, a, R_32F, lda, sa, b, R_32F, ldb,
                sb, c, R_32F, ldc, sc, batch, false});
}

int cublasDgemmStridedBatched(Handle *h, int ta, int tb, int m, int n, int k, const double *alpha, const double *a,
                              int lda, long long sa, const double *b, int ldb, long long sb, const double *beta,
                              double *c, int ldc, long long sc, int batch) {
    return run({"cublasDgemmStridedBatched", h, ta, tb, m, n, k, alpha, beta, R_64F, a, R_64F, lda, sa, b, R_64F, ldb,
                sb, c, R_64F, ldc, sc, batch, true});
}

// Half GEMMs compute in half precision on the GPU; the emulator accumulates in float32 and rounds once (closer to
// the exact result than the hardware, never further).
int cublasHgemm(Handle *h, int ta, int tb, int m, int n, int k, const uint16_t *alpha, const uint16_t *a, int lda,
                const uint16_t *b, int ldb, const uint16_t *beta, uint16_t *c, int ldc) {
    return run({"cublasHgemm", h, ta, tb, m, n, k, alpha, beta, R_16F, a, R_16F, lda, 0, b, R_16F, ldb, 0, c, R_16F, ldc,
                0, 1, false});
}

int cublasHgemmStridedBatched(Handle *h, int ta, int tb, int m, int n, int k, const uint16_t *alpha,
                              const uint16_t *a, int lda, long long sa, const uint16_t *b, int ldb, long long sb,
                              const uint16_t *beta, uint16_t *c, int ldc, long long sc, int batch) {
    return run({"cublasHgemmStridedBatched", h, ta, tb, m, n, k, alpha, beta, R_16F, a, R_16F, lda, sa, b, R_16F, ldb,
                sb, c, R_16F, ldc, sc, batch, false});
}

}  // extern "C"
