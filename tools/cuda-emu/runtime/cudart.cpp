// The CUDA runtime API of the emulated device (libcudart.so.N), as far as the binaries reference it: Candle's
// statically compiled kernels (candle-kernels' libmoe.a, built by nvcc with host-side launch stubs) link against
// it. Memory, devices and streams forward to the emulated driver; the registration hooks nvcc's host code calls
// record the kernels' names, and a launch of one of them fails naming it: those kernels exist only as GPU machine
// code in a fat binary, which the emulator cannot run (the crate does not call them).

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "emu.h"

using namespace emu;

namespace {

// The runtime's types, as the ABI lays them out (no runtime headers: their declarations would clash).
struct dim3 {
    unsigned x, y, z;
};
typedef int cudaError_t;
typedef void *cudaStream_t;

enum : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoKernelImageForDevice = 209,
    cudaErrorNotSupported = 801,
};

std::mutex g_lock;
std::map<const void *, std::string> g_kernels;  // host stub → kernel name (from __cudaRegisterFunction)
thread_local int t_last_error = cudaSuccess;    // what cudaGetLastError returns
thread_local int t_device = 0;
struct CallConfiguration {
    dim3 grid, block;
    size_t shared;
    void *stream;
};
thread_local CallConfiguration t_pushed{};  // the `<<<…>>>` configuration between push and pop

// Records a driver result as the runtime's error (the numbering of the codes the emulator returns is shared).
cudaError_t record(int code) {
    if (code != cudaSuccess) t_last_error = code;
    return code;
}

// Makes the device's primary context current, as the runtime does on its first call of a thread.
cudaError_t with_context(const char *api) {
    CUcontext ctx = nullptr;
    if (cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx) return cudaSuccess;
    int code = cuInit(0);
    if (code == CUDA_SUCCESS) code = cuDevicePrimaryCtxRetain(&ctx, t_device);
    if (code == CUDA_SUCCESS) code = cuCtxSetCurrent(ctx);
    if (code != CUDA_SUCCESS) return record(fail(code, format("%s: no context for device %d", api, t_device)));
    return cudaSuccess;
}

cudaError_t launch(const void *func, const char *api) {
    std::string name;
    {
        std::lock_guard<std::mutex> hold(g_lock);
        auto it = g_kernels.find(func);
        name = it == g_kernels.end() ? "an unregistered host function" : it->second;
    }
    return record(fail(cudaErrorNoKernelImageForDevice,
                       format("%s: kernel %s exists only as GPU machine code (nvcc's fat binary, e.g. candle-kernels' "
                              "libmoe.a); the emulated device runs kernels loaded from PTX only",
                              api, name.c_str())));
}

}  // namespace

extern "C" {

// ---- nvcc's registration hooks (called by host code at load time) ----

void **__cudaRegisterFatBinary(void *fat_binary) {
    static void *handle_storage[1];
    handle_storage[0] = fat_binary;
    return handle_storage;
}
void __cudaRegisterFatBinaryEnd(void **) {}
void __cudaUnregisterFatBinary(void **) {}

void __cudaRegisterFunction(void **, const char *host_function, char *, const char *device_name, int, void *, void *,
                            void *, void *, int *) {
    std::lock_guard<std::mutex> hold(g_lock);
    g_kernels[host_function] = device_name ? device_name : "?";
}

void __cudaRegisterVar(void **, char *, char *, const char *, int, size_t, int, int) {}
void __cudaRegisterManagedVar(void **, void **, char *, const char *, int, size_t, int, int) {}

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, void *stream) {
    t_pushed = CallConfiguration{grid, block, shared, stream};
    return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shared, void *stream) {
    *grid = t_pushed.grid;
    *block = t_pushed.block;
    *shared = t_pushed.shared;
    *static_cast<void **>(stream) = t_pushed.stream;
    return cudaSuccess;
}

// ---- launches ----

cudaError_t cudaLaunchKernel(const void *func, dim3, dim3, void **, size_t, cudaStream_t) {
    return launch(func, "cudaLaunchKernel");
}
cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3, dim3, void **, size_t, cudaStream_t) {
    return launch(func, "cudaLaunchKernel_ptsz");
}
cudaError_t __cudaLaunchKernel(const void *func, dim3, dim3, void **, size_t, cudaStream_t) {
    return launch(func, "__cudaLaunchKernel");
}
cudaError_t __cudaLaunchKernel_ptsz(const void *func, dim3, dim3, void **, size_t, cudaStream_t) {
    return launch(func, "__cudaLaunchKernel_ptsz");
}
cudaError_t __cudaGetKernel(void **kernel, const void *func) {
    *kernel = const_cast<void *>(func);
    return cudaSuccess;
}

struct cudaFuncAttributes;
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *, const void *func) { return launch(func, "cudaFuncGetAttributes"); }
cudaError_t cudaFuncSetAttribute(const void *func, int, int) { return launch(func, "cudaFuncSetAttribute"); }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *, const void *func, int, size_t, unsigned) {
    return launch(func, "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags");
}

// ---- errors ----

cudaError_t cudaGetLastError(void) {
    int e = t_last_error;
    t_last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return t_last_error; }

const char *cudaGetErrorString(cudaError_t error) {
    if (const char *m = last_message(error)) return m;
    const char *s = nullptr;
    return cuGetErrorString(static_cast<CUresult>(error), &s) == CUDA_SUCCESS && s ? s : "unknown error";
}
const char *cudaGetErrorName(cudaError_t error) {
    const char *s = nullptr;
    return cuGetErrorName(static_cast<CUresult>(error), &s) == CUDA_SUCCESS && s ? s : "cudaErrorUnknown";
}

// ---- devices ----

cudaError_t cudaGetDeviceCount(int *count) { return record(cuDeviceGetCount(count)); }
cudaError_t cudaGetDevice(int *device) {
    *device = t_device;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    int count = 0;
    if (int e = cuDeviceGetCount(&count)) return record(e);
    if (device < 0 || device >= count)
        return record(fail(cudaErrorInvalidDevice, format("cudaSetDevice: no device %d (%d present)", device, count)));
    t_device = device;
    return cudaSuccess;
}
// The runtime's device attributes carry the driver's numbers.
cudaError_t cudaDeviceGetAttribute(int *value, int attribute, int device) {
    if (int e = cuInit(0)) return record(e);
    return record(cuDeviceGetAttribute(value, static_cast<CUdevice_attribute>(attribute), device));
}
cudaError_t cudaDeviceSynchronize(void) {
    if (cudaError_t e = with_context("cudaDeviceSynchronize")) return e;
    return record(cuCtxSynchronize());
}

// ---- memory and streams ----

cudaError_t cudaMalloc(void **ptr, size_t bytes) {
    if (cudaError_t e = with_context("cudaMalloc")) return e;
    CUdeviceptr p = 0;
    int e = cuMemAlloc(&p, bytes);
    *ptr = reinterpret_cast<void *>(p);
    return record(e);
}
cudaError_t cudaFree(void *ptr) {
    if (!ptr) return cudaSuccess;
    if (cudaError_t e = with_context("cudaFree")) return e;
    return record(cuMemFree(reinterpret_cast<CUdeviceptr>(ptr)));
}
cudaError_t cudaMallocAsync_ptsz(void **ptr, size_t bytes, cudaStream_t stream) {
    if (cudaError_t e = with_context("cudaMallocAsync")) return e;
    CUdeviceptr p = 0;
    int e = cuMemAllocAsync(&p, bytes, static_cast<CUstream>(stream));
    *ptr = reinterpret_cast<void *>(p);
    return record(e);
}
cudaError_t cudaMallocAsync(void **ptr, size_t bytes, cudaStream_t stream) {
    return cudaMallocAsync_ptsz(ptr, bytes, stream);
}
cudaError_t cudaFreeAsync_ptsz(void *ptr, cudaStream_t stream) {
    if (cudaError_t e = with_context("cudaFreeAsync")) return e;
    return record(cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(ptr), static_cast<CUstream>(stream)));
}
cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) { return cudaFreeAsync_ptsz(ptr, stream); }
cudaError_t cudaMemsetAsync_ptsz(void *ptr, int value, size_t bytes, cudaStream_t stream) {
    if (cudaError_t e = with_context("cudaMemsetAsync")) return e;
    return record(cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(ptr), static_cast<unsigned char>(value), bytes,
                                  static_cast<CUstream>(stream)));
}
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t bytes, cudaStream_t stream) {
    return cudaMemsetAsync_ptsz(ptr, value, bytes, stream);
}
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) {
    if (cudaError_t e = with_context("cudaStreamSynchronize")) return e;
    return record(cuStreamSynchronize(static_cast<CUstream>(stream)));
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return cudaStreamSynchronize_ptsz(stream); }

}  // extern "C"
