// The CUDA driver API of the emulated device (libcuda.so.1): devices, contexts, memory, copies, streams, events
// and errors. Modules and launches are in module.cpp. Every entry point the binaries reference and this file does
// not implement is a generated stub that fails naming itself (stubs_driver.cpp).
//
// Work submitted to a stream runs at once on the calling thread, so streams and events are always complete; an
// event records the host time it was recorded at.

#include <cuda.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

#include "emu.h"
#include "launch.h"

using namespace emu;

namespace {

struct Context {
    int device;
    unsigned flags;
    int refcount;
};

struct Stream {
    unsigned flags;
    int priority;
    CUcontext context;
};

struct Event {
    unsigned flags;
    bool recorded;
    double time_ms;
};

std::mutex g_lock;  // the tables below
std::vector<Context> g_primary;  // one primary context per device
std::set<const void *> g_streams, g_events;
bool g_initialized = false;
thread_local std::vector<CUcontext> t_contexts;  // the calling thread's context stack

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

CUresult result(int code) { return static_cast<CUresult>(code); }

CUresult refuse(const char *api, const std::string &why) {
    return result(fail(CUDA_ERROR_INVALID_VALUE, format("%s: %s", api, why.c_str())));
}

// CUDA_SUCCESS when the API may run: cuInit was called, no kernel has faulted, and a context is current.
CUresult ready(const char *api) { return result(require_context(api)); }

bool valid_device(CUdevice d) { return d >= 0 && d < config().devices; }

CUresult check_stream(CUstream s, const char *api) {
    if (!valid_stream(s)) return result(fail(CUDA_ERROR_INVALID_HANDLE, format("%s: not a live stream", api)));
    return CUDA_SUCCESS;
}

// A copy of `bytes` from `src` to `dst`; each side, when it lies in the emulated device's memory, must be inside one
// live allocation.
CUresult copy(void *dst, const void *src, size_t bytes, const char *api) {
    if (CUresult r = ready(api)) return r;
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    for (auto side : {std::make_pair(d, "destination"), std::make_pair(s, "source")}) {
        if (!in_arena(side.first)) continue;
        const std::string bad = check_range(side.first, bytes);
        if (!bad.empty()) return refuse(api, format("the %s is %s", side.second, bad.c_str()));
    }
    auto device_side = [](uintptr_t p) {
        Allocation al;
        return in_arena(p) && find_live(p, &al) && al.kind == Kind::Device;
    };
    const bool dd = device_side(d), sd = device_side(s);
    count_copy(sd ? (dd ? Copy::DeviceToDevice : Copy::DeviceToHost) : (dd ? Copy::HostToDevice : Copy::HostToHost),
               bytes);
    if (bytes) memmove(dst, src, bytes);
    return CUDA_SUCCESS;
}

template <typename T> CUresult fill(CUdeviceptr dst, T value, size_t count, const char *api) {
    if (CUresult r = ready(api)) return r;
    const std::string bad = check_range(dst, count * sizeof(T));
    if (!bad.empty()) return refuse(api, format("the destination is %s", bad.c_str()));
    T *p = reinterpret_cast<T *>(dst);
    for (size_t i = 0; i < count; ++i) p[i] = value;
    return CUDA_SUCCESS;
}

}  // namespace

namespace emu {

bool valid_stream(const void *stream) {
    if (stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD) return true;
    std::lock_guard<std::mutex> g(g_lock);
    return g_streams.count(stream) != 0;
}

int require_context(const char *api) {
    if (!g_initialized) return fail(CUDA_ERROR_NOT_INITIALIZED, format("%s: cuInit was not called", api));
    if (int sticky = sticky_error()) return fail(sticky, format("%s: %s", api, earlier_failure().c_str()));
    if (t_contexts.empty() || t_contexts.back() == nullptr) {
        return fail(CUDA_ERROR_INVALID_CONTEXT, format("%s: no context is current on this thread", api));
    }
    return CUDA_SUCCESS;
}

}  // namespace emu

extern "C" {

// ---- initialization, versions, errors ----

CUresult CUDAAPI cuInit(unsigned int flags) {
    if (flags != 0) return refuse("cuInit", "flags must be 0");
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_initialized) {
        init_memory();
        install_fault_handler();
        g_primary.resize(config().devices);
        for (int d = 0; d < config().devices; ++d) g_primary[d] = Context{d, 0, 0};
        g_initialized = true;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int *version) {
    if (!version) return refuse("cuDriverGetVersion", "null pointer");
    *version = config().driver_version;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **str) {
    static const struct {
        CUresult code;
        const char *name;
    } names[] = {
        {CUDA_SUCCESS, "CUDA_SUCCESS"},
        {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
        {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
        {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
        {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
        {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
        {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE"},
        {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
        {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
        {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX"},
        {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"},
        {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
        {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
        {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
        {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
        {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
        {CUDA_ERROR_ASSERT, "CUDA_ERROR_ASSERT"},
        {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"},
        {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
        {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
    };
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    for (const auto &n : names) {
        if (n.code == error) {
            *str = n.name;
            return CUDA_SUCCESS;
        }
    }
    *str = "CUDA_ERROR (unknown code)";
    return CUDA_ERROR_INVALID_VALUE;
}

// The last detailed message of this thread for `error` (so an error a program prints names the kernel and the
// fault), else the code's name.
CUresult CUDAAPI cuGetErrorString(CUresult error, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    if (const char *message = last_message(error)) {
        *str = message;
        return CUDA_SUCCESS;
    }
    return cuGetErrorName(error, str);
}

// ---- devices ----

CUresult CUDAAPI cuDeviceGetCount(int *count) {
    if (!g_initialized) return result(fail(CUDA_ERROR_NOT_INITIALIZED, "cuDeviceGetCount: cuInit was not called"));
    *count = config().devices;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    if (!g_initialized) return result(fail(CUDA_ERROR_NOT_INITIALIZED, "cuDeviceGet: cuInit was not called"));
    if (!valid_device(ordinal)) {
        return result(fail(CUDA_ERROR_INVALID_DEVICE,
                           format("cuDeviceGet: no device %d (the emulator has %d)", ordinal, config().devices)));
    }
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!valid_device(dev) || !name || len <= 0) return refuse("cuDeviceGetName", "bad device or buffer");
    snprintf(name, (size_t)len, "Emulated NVIDIA H100 80GB HBM3 (CPU, compute %d.%d)", config().cc_major,
             config().cc_minor);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    if (!valid_device(dev) || !uuid) return refuse("cuDeviceGetUuid", "bad device or pointer");
    memset(uuid, 0, sizeof *uuid);
    memcpy(uuid->bytes, "cuda-emu", 8);
    uuid->bytes[15] = (char)dev;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
    if (!valid_device(dev) || !bytes) return refuse("cuDeviceTotalMem", "bad device or pointer");
    *bytes = config().capacity;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    if (!valid_device(dev)) return refuse("cuDeviceComputeCapability", "bad device");
    *major = config().cc_major;
    *minor = config().cc_minor;
    return CUDA_SUCCESS;
}

// An H100 SXM's attributes (compute capability, driver and shared memory per the configuration).
CUresult CUDAAPI cuDeviceGetAttribute(int *value, CUdevice_attribute attrib, CUdevice dev) {
    if (!valid_device(dev) || !value) return refuse("cuDeviceGetAttribute", "bad device or pointer");
    int v;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = (int)SHARED_DEFAULT_LIMIT; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: v = (int)shared_optin_limit(); break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: v = (int)shared_optin_limit() + 1024; break;
    case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 50 * 1024 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 3; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = config().cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = config().cc_minor; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = dev + 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
    case CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT:
    case CU_DEVICE_ATTRIBUTE_INTEGRATED:
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE:
    case CU_DEVICE_ATTRIBUTE_TCC_DRIVER:
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD:
    case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS:
    case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES:
    case CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM:
    case CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO: v = 2; break;
    default:
        return result(fail(CUDA_ERROR_INVALID_VALUE,
                           format("cuDeviceGetAttribute: attribute %d is not emulated", (int)attrib)));
    }
    *value = v;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    if (!valid_device(dev) || !pool) return refuse("cuDeviceGetDefaultMemPool", "bad device or pointer");
    // One pool per device; its handle is the device's number, made non-null.
    *pool = reinterpret_cast<CUmemoryPool>(static_cast<uintptr_t>(dev) + 0x100);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) { return cuDeviceGetDefaultMemPool(pool, dev); }

CUresult CUDAAPI cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    if (!valid_device(dev) || !valid_device(peer)) return refuse("cuDeviceCanAccessPeer", "bad device");
    *can = dev != peer;
    return CUDA_SUCCESS;
}

// ---- contexts ----

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    if (!g_initialized) return result(fail(CUDA_ERROR_NOT_INITIALIZED, "cuDevicePrimaryCtxRetain: no cuInit"));
    if (!valid_device(dev) || !ctx) return refuse("cuDevicePrimaryCtxRetain", "bad device or pointer");
    std::lock_guard<std::mutex> g(g_lock);
    g_primary[dev].refcount += 1;
    *ctx = reinterpret_cast<CUcontext>(&g_primary[dev]);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
    if (!valid_device(dev)) return refuse("cuDevicePrimaryCtxRelease", "bad device");
    std::lock_guard<std::mutex> g(g_lock);
    if (g_primary[dev].refcount > 0) g_primary[dev].refcount -= 1;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    if (!valid_device(dev)) return refuse("cuDevicePrimaryCtxGetState", "bad device");
    std::lock_guard<std::mutex> g(g_lock);
    *flags = g_primary[dev].flags;
    *active = g_primary[dev].refcount > 0;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    if (!valid_device(dev)) return refuse("cuDevicePrimaryCtxSetFlags", "bad device");
    std::lock_guard<std::mutex> g(g_lock);
    g_primary[dev].flags = flags;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) {
    if (!valid_device(dev)) return refuse("cuDevicePrimaryCtxReset", "bad device");
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
    if (!g_initialized) return result(fail(CUDA_ERROR_NOT_INITIALIZED, "cuCtxSetCurrent: cuInit was not called"));
    if (t_contexts.empty()) t_contexts.push_back(ctx);
    else t_contexts.back() = ctx;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *ctx) {
    if (!g_initialized) return result(fail(CUDA_ERROR_NOT_INITIALIZED, "cuCtxGetCurrent: cuInit was not called"));
    *ctx = t_contexts.empty() ? nullptr : t_contexts.back();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {
    t_contexts.push_back(ctx);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent(CUcontext *ctx) {
    if (t_contexts.empty()) return result(fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxPopCurrent: no context to pop"));
    if (ctx) *ctx = t_contexts.back();
    t_contexts.pop_back();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) {
    if (CUresult r = ready("cuCtxGetDevice")) return r;
    *device = reinterpret_cast<Context *>(t_contexts.back())->device;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) {
    count_host_wait();
    note_context_sync();
    return ready("cuCtxSynchronize");
}

CUresult CUDAAPI cuCtxGetFlags(unsigned int *flags) {
    if (CUresult r = ready("cuCtxGetFlags")) return r;
    *flags = reinterpret_cast<Context *>(t_contexts.back())->flags;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetFlags(unsigned int flags) {
    if (CUresult r = ready("cuCtxSetFlags")) return r;
    reinterpret_cast<Context *>(t_contexts.back())->flags = flags;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetApiVersion(CUcontext, unsigned int *version) {
    *version = 3020;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetLimit(size_t *value, CUlimit limit) {
    if (CUresult r = ready("cuCtxGetLimit")) return r;
    switch (limit) {
    case CU_LIMIT_STACK_SIZE: *value = 1024; break;
    case CU_LIMIT_PRINTF_FIFO_SIZE: *value = 1 << 20; break;
    case CU_LIMIT_MALLOC_HEAP_SIZE: *value = 8 << 20; break;
    default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetLimit(CUlimit, size_t) { return ready("cuCtxSetLimit"); }

CUresult CUDAAPI cuCtxGetCacheConfig(CUfunc_cache *config) {
    *config = CU_FUNC_CACHE_PREFER_NONE;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCacheConfig(CUfunc_cache) { return ready("cuCtxSetCacheConfig"); }

// ---- memory ----

CUresult CUDAAPI cuMemGetInfo(size_t *free_bytes, size_t *total) {
    if (CUresult r = ready("cuMemGetInfo")) return r;
    const PoolStats s = pool_stats();
    *total = config().capacity;
    *free_bytes = s.reserved > config().capacity ? 0 : config().capacity - s.reserved;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytes) {
    if (CUresult r = ready("cuMemAlloc")) return r;
    if (bytes == 0) return refuse("cuMemAlloc", "0 bytes");
    uintptr_t p;
    if (int r = allocate(bytes, Kind::Device, &p, "cuMemAlloc")) return result(r);
    *dptr = p;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    if (CUresult r = ready("cuMemAllocAsync")) return r;
    if (CUresult r = check_stream(stream, "cuMemAllocAsync")) return r;
    uintptr_t p;
    if (int r = allocate(bytes, Kind::Device, &p, "cuMemAllocAsync")) return result(r);
    *dptr = p;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool, CUstream stream) {
    return cuMemAllocAsync(dptr, bytes, stream);
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
    if (CUresult r = ready("cuMemFree")) return r;
    if (dptr == 0) return CUDA_SUCCESS;
    return result(release(dptr, Kind::Device, "cuMemFree"));
}

CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    if (CUresult r = ready("cuMemFreeAsync")) return r;
    if (CUresult r = check_stream(stream, "cuMemFreeAsync")) return r;
    if (dptr == 0) return CUDA_SUCCESS;
    return result(release(dptr, Kind::Device, "cuMemFreeAsync"));
}

CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int) {
    return cuMemAlloc(dptr, bytes);
}

CUresult CUDAAPI cuMemAllocHost(void **pp, size_t bytes) {
    if (CUresult r = ready("cuMemAllocHost")) return r;
    uintptr_t p;
    if (int r = allocate(bytes, Kind::Host, &p, "cuMemAllocHost")) return result(r);
    *pp = reinterpret_cast<void *>(p);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytes, unsigned int) { return cuMemAllocHost(pp, bytes); }

CUresult CUDAAPI cuMemFreeHost(void *p) {
    if (CUresult r = ready("cuMemFreeHost")) return r;
    return result(release(reinterpret_cast<uintptr_t>(p), Kind::Host, "cuMemFreeHost"));
}

CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr *dptr, void *p, unsigned int) {
    if (CUresult r = ready("cuMemHostGetDevicePointer")) return r;
    Allocation al;
    if (!find_live(reinterpret_cast<uintptr_t>(p), &al) || al.kind != Kind::Host) {
        return refuse("cuMemHostGetDevicePointer", "not pinned host memory from cuMemHostAlloc");
    }
    *dptr = reinterpret_cast<CUdeviceptr>(p);  // unified addressing: the same address
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr dptr) {
    if (CUresult r = ready("cuMemGetAddressRange")) return r;
    Allocation al;
    if (!find_live(dptr, &al) || dptr < al.base || dptr >= al.base + al.size) {
        return result(fail(CUDA_ERROR_NOT_FOUND, format("cuMemGetAddressRange: %s",
                                                        describe_address(dptr, 1).c_str())));
    }
    if (base) *base = al.base;
    if (size) *size = al.size;
    return CUDA_SUCCESS;
}

// CUDA 13 gave these the location arguments of CUDA 12's `_v2` forms (and dropped the names `_v2`).
#if CUDA_VERSION >= 13000
CUresult CUDAAPI cuMemPrefetchAsync(CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream stream) {
    return check_stream(stream, "cuMemPrefetchAsync");
}

CUresult CUDAAPI cuMemAdvise(CUdeviceptr, size_t, CUmem_advise, CUmemLocation) { return ready("cuMemAdvise"); }
#else
CUresult CUDAAPI cuMemPrefetchAsync(CUdeviceptr, size_t, CUdevice, CUstream stream) {
    return check_stream(stream, "cuMemPrefetchAsync");
}

CUresult CUDAAPI cuMemPrefetchAsync_v2(CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream stream) {
    return check_stream(stream, "cuMemPrefetchAsync_v2");
}

CUresult CUDAAPI cuMemAdvise(CUdeviceptr, size_t, CUmem_advise, CUdevice) { return ready("cuMemAdvise"); }

CUresult CUDAAPI cuMemAdvise_v2(CUdeviceptr, size_t, CUmem_advise, CUmemLocation) { return ready("cuMemAdvise_v2"); }
#endif

// ---- the memory pool ----

CUresult CUDAAPI cuMemPoolGetAttribute(CUmemoryPool, CUmemPool_attribute attr, void *value) {
    if (CUresult r = ready("cuMemPoolGetAttribute")) return r;
    const PoolStats s = pool_stats();
    cuuint64_t v;
    switch (attr) {
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: v = s.used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: v = s.used_high; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: v = s.reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: v = s.reserved_high; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: v = release_threshold(); break;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *static_cast<int *>(value) = 1; return CUDA_SUCCESS;
    default: return refuse("cuMemPoolGetAttribute", format("attribute %d is not emulated", (int)attr));
    }
    *static_cast<cuuint64_t *>(value) = v;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemPoolSetAttribute(CUmemoryPool, CUmemPool_attribute attr, void *value) {
    if (CUresult r = ready("cuMemPoolSetAttribute")) return r;
    switch (attr) {
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
        // Only a reset to zero is allowed: the high-water mark becomes the current value.
        if (*static_cast<cuuint64_t *>(value) != 0) {
            return refuse("cuMemPoolSetAttribute", "a high-water mark can only be reset (set to 0)");
        }
        reset_pool_high(attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH, attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH);
        return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: set_release_threshold(*static_cast<cuuint64_t *>(value)); return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: return CUDA_SUCCESS;
    default: return refuse("cuMemPoolSetAttribute", format("attribute %d is not emulated", (int)attr));
    }
}

CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool, size_t keep) {
    if (CUresult r = ready("cuMemPoolTrimTo")) return r;
    // Trimming releases cached memory down to `keep` bytes; the threshold bounds what stays cached.
    const uint64_t threshold = release_threshold();
    set_release_threshold(keep);
    set_release_threshold(threshold);
    return CUDA_SUCCESS;
}

// ---- copies and fills ----

CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    count_host_wait();
    return copy(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), bytes, "cuMemcpy");
}
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemcpyAsync")) return r;
    return copy(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), bytes, "cuMemcpyAsync");
}
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t bytes) {
    count_host_wait();
    return copy(reinterpret_cast<void *>(dst), src, bytes, "cuMemcpyHtoD");
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t bytes, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemcpyHtoDAsync")) return r;
    const CUresult r = copy(reinterpret_cast<void *>(dst), src, bytes, "cuMemcpyHtoDAsync");
    if (r == CUDA_SUCCESS) note_async_upload(s);
    return r;
}
CUresult CUDAAPI cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t bytes) {
    count_host_wait();
    return copy(dst, reinterpret_cast<const void *>(src), bytes, "cuMemcpyDtoH");
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t bytes, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemcpyDtoHAsync")) return r;
    return copy(dst, reinterpret_cast<const void *>(src), bytes, "cuMemcpyDtoHAsync");
}
CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    return copy(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), bytes, "cuMemcpyDtoD");
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemcpyDtoDAsync")) return r;
    return copy(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), bytes, "cuMemcpyDtoDAsync");
}
CUresult CUDAAPI cuMemcpyPeer(CUdeviceptr dst, CUcontext, CUdeviceptr src, CUcontext, size_t bytes) {
    return copy(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), bytes, "cuMemcpyPeer");
}
CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext, CUdeviceptr src, CUcontext, size_t bytes, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemcpyPeerAsync")) return r;
    return copy(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), bytes, "cuMemcpyPeerAsync");
}

CUresult CUDAAPI cuMemsetD8(CUdeviceptr dst, unsigned char v, size_t n) { return fill(dst, v, n, "cuMemsetD8"); }
CUresult CUDAAPI cuMemsetD16(CUdeviceptr dst, unsigned short v, size_t n) { return fill(dst, v, n, "cuMemsetD16"); }
CUresult CUDAAPI cuMemsetD32(CUdeviceptr dst, unsigned int v, size_t n) { return fill(dst, v, n, "cuMemsetD32"); }
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemsetD8Async")) return r;
    return fill(dst, v, n, "cuMemsetD8Async");
}
CUresult CUDAAPI cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemsetD16Async")) return r;
    return fill(dst, v, n, "cuMemsetD16Async");
}
CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream s) {
    if (CUresult r = check_stream(s, "cuMemsetD32Async")) return r;
    return fill(dst, v, n, "cuMemsetD32Async");
}

// ---- pointers ----

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    if (CUresult r = ready("cuPointerGetAttribute")) return r;
    Allocation al;
    const bool known = find_live(ptr, &al) && ptr >= al.base && ptr <= al.base + al.size;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        if (!known) return result(fail(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttribute: not emulated memory"));
        *static_cast<unsigned *>(data) = al.kind == Kind::Host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (!known) return result(fail(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttribute: not emulated memory"));
        *static_cast<void **>(data) = reinterpret_cast<void *>(ptr);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int *>(data) = 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<int *>(data) = 0; return CUDA_SUCCESS;
    default: return refuse("cuPointerGetAttribute", format("attribute %d is not emulated", (int)attribute));
    }
}

// ---- streams ----

CUresult CUDAAPI cuStreamCreate(CUstream *stream, unsigned int flags) {
    if (CUresult r = ready("cuStreamCreate")) return r;
    Stream *s = new Stream{flags, 0, t_contexts.back()};
    std::lock_guard<std::mutex> g(g_lock);
    g_streams.insert(s);
    *stream = reinterpret_cast<CUstream>(s);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority) {
    CUresult r = cuStreamCreate(stream, flags);
    if (r == CUDA_SUCCESS) reinterpret_cast<Stream *>(*stream)->priority = priority;
    return r;
}

CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_streams.erase(stream)) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamDestroy: not a live stream (destroyed twice?)"));
    }
    delete reinterpret_cast<Stream *>(stream);
    note_stream_sync(stream);  // its work is done; the handle may be reused
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
    count_host_wait();
    note_stream_sync(stream);
    if (CUresult r = ready("cuStreamSynchronize")) return r;
    return check_stream(stream, "cuStreamSynchronize");
}

CUresult CUDAAPI cuStreamQuery(CUstream stream) {
    if (CUresult r = ready("cuStreamQuery")) return r;
    return check_stream(stream, "cuStreamQuery");
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int) {
    if (CUresult r = check_stream(stream, "cuStreamWaitEvent")) return r;
    count_stream_wait();
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_events.count(event)) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamWaitEvent: not a live event"));
    note_event_wait(event, stream);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetPriority(CUstream stream, int *priority) {
    if (CUresult r = check_stream(stream, "cuStreamGetPriority")) return r;
    *priority = stream && stream != CU_STREAM_LEGACY && stream != CU_STREAM_PER_THREAD
                    ? reinterpret_cast<Stream *>(stream)->priority
                    : 0;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetFlags(CUstream stream, unsigned int *flags) {
    if (CUresult r = check_stream(stream, "cuStreamGetFlags")) return r;
    *flags = stream && stream != CU_STREAM_LEGACY && stream != CU_STREAM_PER_THREAD
                 ? reinterpret_cast<Stream *>(stream)->flags
                 : 0;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetCtx(CUstream stream, CUcontext *ctx) {
    if (CUresult r = ready("cuStreamGetCtx")) return r;
    if (CUresult r = check_stream(stream, "cuStreamGetCtx")) return r;
    *ctx = stream && stream != CU_STREAM_LEGACY && stream != CU_STREAM_PER_THREAD
               ? reinterpret_cast<Stream *>(stream)->context
               : t_contexts.back();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
    if (CUresult r = check_stream(stream, "cuStreamIsCapturing")) return r;
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data) {
    if (CUresult r = ready("cuLaunchHostFunc")) return r;
    if (CUresult r = check_stream(stream, "cuLaunchHostFunc")) return r;
    fn(data);
    return CUDA_SUCCESS;
}

// ---- events ----

CUresult CUDAAPI cuEventCreate(CUevent *event, unsigned int flags) {
    if (CUresult r = ready("cuEventCreate")) return r;
    Event *e = new Event{flags, false, 0.0};
    std::lock_guard<std::mutex> g(g_lock);
    g_events.insert(e);
    *event = reinterpret_cast<CUevent>(e);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent event) {
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_events.erase(event)) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy: not a live event (destroyed twice?)"));
    }
    delete reinterpret_cast<Event *>(event);
    note_event_forget(event);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecord(CUevent event, CUstream stream) {
    if (CUresult r = check_stream(stream, "cuEventRecord")) return r;
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_events.count(event)) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord: not a live event"));
    Event *e = reinterpret_cast<Event *>(event);
    e->recorded = true;
    e->time_ms = now_ms();
    note_event_record(event, stream);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecordWithFlags(CUevent event, CUstream stream, unsigned int) {
    return cuEventRecord(event, stream);
}

CUresult CUDAAPI cuEventQuery(CUevent event) {
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_events.count(event)) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuEventQuery: not a live event"));
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventSynchronize(CUevent event) {
    count_host_wait();
    note_event_sync(event);
    return cuEventQuery(event);
}

CUresult CUDAAPI cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_events.count(start) || !g_events.count(end)) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime: not a live event"));
    }
    const Event *a = reinterpret_cast<Event *>(start), *b = reinterpret_cast<Event *>(end);
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime: an event was created without timing"));
    }
    if (!a->recorded || !b->recorded) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime: an event was never recorded"));
    }
    *ms = (float)(b->time_ms - a->time_ms);
    return CUDA_SUCCESS;
}

}  // extern "C"
