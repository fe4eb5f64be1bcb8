// Modules, functions and launches of the emulated driver.
//
// A program loads a kernel module as PTX text. The emulator reads the PTX for what the hardware would check (its
// ISA version and target against the driver and device, each kernel's parameters, launch bounds and static shared
// memory) and runs the kernels from their CPU build: a shared library per module, made by kernelize.py from the
// same `.cu` source, whose table lists its kernels by name. The library chosen is the one whose kernels are exactly
// the PTX's entries.

#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "emu.h"
#include "launch.h"
#include "ptx.h"

using namespace emu;

namespace {

// A CPU build of one kernel module.
struct KernelLibrary {
    std::string path;
    std::map<std::string, const cuemu_kernel *> kernels;
};

struct Module;

struct Function {
    Module *module;
    const PtxEntry *ptx;
    const cuemu_kernel *cpu;
    size_t max_dynamic_shared;
};

struct Module {
    PtxModule ptx;
    const KernelLibrary *library;
    std::map<std::string, std::unique_ptr<Function>> functions;
};

std::mutex g_lock;
std::set<const void *> g_modules, g_functions;
std::vector<KernelLibrary> *g_libraries = nullptr;

CUresult result(int code) { return static_cast<CUresult>(code); }

// Every CPU kernel module in the kernels folder (read once); in the fast mode, their builds without the access
// instrumentation (its `fast` subfolder) where the folder has them.
const std::vector<KernelLibrary> &libraries() {
    if (g_libraries) return *g_libraries;
    g_libraries = new std::vector<KernelLibrary>;
    std::string dir = config().kernels_dir;
    struct stat uninstrumented;
    if (config().fast && stat((dir + "/fast").c_str(), &uninstrumented) == 0 && S_ISDIR(uninstrumented.st_mode)) {
        dir += "/fast";
    }
    if (DIR *d = opendir(dir.c_str())) {
        while (dirent *entry = readdir(d)) {
            const std::string name = entry->d_name;
            if (name.size() < 4 || name.compare(name.size() - 3, 3, ".so") != 0) continue;
            const std::string path = dir + "/" + name;
            void *handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
            if (!handle) {
                fail(CUDA_ERROR_INVALID_IMAGE, format("cannot load the kernel module %s: %s", path.c_str(), dlerror()));
                continue;
            }
            using Table = const cuemu_kernel *(*)(unsigned *);
            Table table = reinterpret_cast<Table>(dlsym(handle, "cuemu_module_kernels"));
            if (!table) continue;
            KernelLibrary lib;
            lib.path = path;
            unsigned count = 0;
            const cuemu_kernel *kernels = table(&count);
            for (unsigned i = 0; i < count; ++i) lib.kernels[kernels[i].name] = &kernels[i];
            g_libraries->push_back(std::move(lib));
        }
        closedir(d);
    }
    return *g_libraries;
}

// The PTX ISA versions a driver version can compile: CUDA 11.x → 7.x, 12.0–12.5 → 8.0–8.5, 12.6 → 8.5, 12.8 → 8.7,
// 12.9 → 8.8, 13.x → 9.x (the PTX ISA release notes).
bool driver_supports_isa(int driver, int major, int minor) {
    const int cuda_major = driver / 1000, cuda_minor = driver % 1000 / 10;
    int max_major, max_minor;
    if (cuda_major <= 11) {
        max_major = 7, max_minor = cuda_minor;
    } else if (cuda_major == 12) {
        static const int minors[10] = {0, 1, 2, 3, 4, 5, 5, 6, 7, 8};
        max_major = 8, max_minor = minors[std::min(cuda_minor, 9)];
    } else {
        max_major = 9, max_minor = cuda_minor;
    }
    return major < max_major || (major == max_major && minor <= max_minor);
}

CUresult load_ptx(CUmodule *module, const char *text, const char *api) {
    if (CUresult r = result(require_context(api))) return r;
    if (!text) return result(fail(CUDA_ERROR_INVALID_VALUE, format("%s: null image", api)));
    if (memcmp(text, "\x7f" "ELF", 4) == 0 || *reinterpret_cast<const uint32_t *>(text) == 0xBA55ED50u) {
        return result(fail(CUDA_ERROR_INVALID_IMAGE,
                           format("%s: a cubin or fatbin image: the emulated device runs modules given as PTX text",
                                  api)));
    }
    auto m = std::make_unique<Module>();
    std::string error;
    if (!parse_ptx(text, &m->ptx, &error)) {
        return result(fail(CUDA_ERROR_INVALID_PTX, format("%s: %s", api, error.c_str())));
    }
    const int cc = config().cc_major * 10 + config().cc_minor;
    if (m->ptx.target > cc) {
        return result(fail(CUDA_ERROR_NO_BINARY_FOR_GPU,
                           format("%s: the module is PTX for sm_%d, the device is compute capability %d.%d", api,
                                  m->ptx.target, config().cc_major, config().cc_minor)));
    }
    if (!driver_supports_isa(config().driver_version, m->ptx.isa_major, m->ptx.isa_minor)) {
        return result(fail(CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                           format("%s: PTX ISA %d.%d is newer than driver %d.%d can compile", api, m->ptx.isa_major,
                                  m->ptx.isa_minor, config().driver_version / 1000,
                                  config().driver_version % 1000 / 10)));
    }
    std::set<std::string> entries;
    for (const PtxEntry &e : m->ptx.entries) entries.insert(e.name);
    std::lock_guard<std::mutex> g(g_lock);
    for (const KernelLibrary &lib : libraries()) {
        std::set<std::string> names;
        for (const auto &k : lib.kernels) names.insert(k.first);
        if (names == entries) m->library = &lib;
    }
    if (!m->library) {
        std::string first;
        for (const std::string &e : entries) {
            if (first.size() > 200) break;
            first += (first.empty() ? "" : ", ") + e;
        }
        return result(fail(CUDA_ERROR_INVALID_IMAGE,
                           format("%s: no CPU build of this module (%zu kernels: %s…) in %s: build the emulator's "
                                  "kernels for it (tools/cuda-emu/build.sh)",
                                  api, entries.size(), first.c_str(), config().kernels_dir.c_str())));
    }
    Module *raw = m.release();
    g_modules.insert(raw);
    *module = reinterpret_cast<CUmodule>(raw);
    return CUDA_SUCCESS;
}

Function *function_of(CUfunction f) {
    std::lock_guard<std::mutex> g(g_lock);
    return g_functions.count(f) ? reinterpret_cast<Function *>(f) : nullptr;
}

CUresult launch_function(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, CUstream stream, void **params, void **extra, const char *api) {
    if (CUresult r = result(require_context(api))) return r;
    Function *fn = function_of(f);
    if (!fn) return result(fail(CUDA_ERROR_INVALID_HANDLE, format("%s: not a function of a loaded module", api)));
    if (!valid_stream(stream)) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, format("%s(%s): not a live stream", api, fn->cpu->name)));
    }
    if (extra) {
        return result(fail(CUDA_ERROR_NOT_SUPPORTED,
                           format("%s(%s): parameters through `extra` are not emulated", api, fn->cpu->name)));
    }
    if (!params && fn->cpu->param_count > 0) {
        return result(fail(CUDA_ERROR_INVALID_VALUE, format("%s(%s): no kernelParams", api, fn->cpu->name)));
    }
    Launch l;
    l.cpu = fn->cpu;
    l.ptx = fn->ptx;
    l.max_dynamic_shared = fn->max_dynamic_shared;
    l.grid[0] = gx, l.grid[1] = gy, l.grid[2] = gz;
    l.block[0] = bx, l.block[1] = by, l.block[2] = bz;
    l.dynamic_shared = shared;
    l.params = params;
    note_kernel(stream);
    return result(launch(l));
}

}  // namespace

extern "C" {

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    return load_ptx(module, static_cast<const char *>(image), "cuModuleLoadData");
}

CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int, CUjit_option *, void **) {
    return load_ptx(module, static_cast<const char *>(image), "cuModuleLoadDataEx");
}

CUresult CUDAAPI cuModuleUnload(CUmodule module) {
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_modules.erase(module)) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleUnload: not a loaded module"));
    Module *m = reinterpret_cast<Module *>(module);
    for (auto &f : m->functions) g_functions.erase(f.second.get());
    delete m;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    if (CUresult r = result(require_context("cuModuleGetFunction"))) return r;
    std::lock_guard<std::mutex> g(g_lock);
    if (!g_modules.count(module)) {
        return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleGetFunction: not a loaded module"));
    }
    Module *m = reinterpret_cast<Module *>(module);
    auto found = m->functions.find(name);
    if (found == m->functions.end()) {
        const PtxEntry *entry = nullptr;
        for (const PtxEntry &e : m->ptx.entries) {
            if (e.name == name) entry = &e;
        }
        if (!entry) {
            return result(fail(CUDA_ERROR_NOT_FOUND,
                               format("cuModuleGetFunction: the module has no kernel named `%s`", name)));
        }
        auto f = std::make_unique<Function>();
        f->module = m;
        f->ptx = entry;
        f->cpu = m->library->kernels.at(name);
        f->max_dynamic_shared = SHARED_DEFAULT_LIMIT - std::min(SHARED_DEFAULT_LIMIT, entry->static_shared);
        g_functions.insert(f.get());
        found = m->functions.emplace(name, std::move(f)).first;
    }
    *function = reinterpret_cast<CUfunction>(found->second.get());
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuFuncGetAttribute(int *value, CUfunction_attribute attrib, CUfunction f) {
    Function *fn = function_of(f);
    if (!fn) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuFuncGetAttribute: not a function"));
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = fn->ptx->max_threads ? (int)fn->ptx->max_threads : 1024; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *value = (int)fn->ptx->static_shared; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *value = (int)fn->max_dynamic_shared; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *value = 0; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *value = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *value = fn->module->ptx.isa_major * 10 + fn->module->ptx.isa_minor; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *value = config().cc_major * 10 + config().cc_minor; break;
    default:
        return result(fail(CUDA_ERROR_INVALID_VALUE,
                           format("cuFuncGetAttribute(%s): attribute %d is not emulated", fn->cpu->name, (int)attrib)));
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute attrib, int value) {
    Function *fn = function_of(f);
    if (!fn) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuFuncSetAttribute: not a function"));
    if (attrib == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
        if (value < 0 || (size_t)value + fn->ptx->static_shared > shared_optin_limit()) {
            return result(fail(CUDA_ERROR_INVALID_VALUE,
                               format("cuFuncSetAttribute(%s): %d bytes of dynamic shared memory with %zu static: the "
                                      "device allows %zu per block",
                                      fn->cpu->name, value, fn->ptx->static_shared, shared_optin_limit())));
        }
        fn->max_dynamic_shared = (size_t)value;
        return CUDA_SUCCESS;
    }
    if (attrib == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) return CUDA_SUCCESS;
    return result(fail(CUDA_ERROR_INVALID_VALUE,
                       format("cuFuncSetAttribute(%s): attribute %d is not emulated", fn->cpu->name, (int)attrib)));
}

CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction f, CUfunc_cache) {
    return function_of(f) ? CUDA_SUCCESS
                          : result(fail(CUDA_ERROR_INVALID_HANDLE, "cuFuncSetCacheConfig: not a function"));
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                unsigned int by, unsigned int bz, unsigned int shared, CUstream stream, void **params,
                                void **extra) {
    return launch_function(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra, "cuLaunchKernel");
}

CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                           unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                           CUstream stream, void **params) {
    return launch_function(f, gx, gy, gz, bx, by, bz, shared, stream, params, nullptr, "cuLaunchCooperativeKernel");
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
    if (!config) return result(fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernelEx: null config"));
    if (config->numAttrs != 0) {
        return result(fail(CUDA_ERROR_NOT_SUPPORTED, "cuLaunchKernelEx: launch attributes are not emulated"));
    }
    return launch_function(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                           config->blockDimY, config->blockDimZ, config->sharedMemBytes, config->hStream, params,
                           extra, "cuLaunchKernelEx");
}

CUresult CUDAAPI cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, CUfunction f, int block_size, size_t) {
    if (!function_of(f) || block_size <= 0) {
        return result(fail(CUDA_ERROR_INVALID_VALUE, "cuOccupancyMaxActiveBlocksPerMultiprocessor: bad arguments"));
    }
    *blocks = std::max(1, std::min(32, 2048 / block_size));
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *blocks, CUfunction f, int block_size,
                                                                      size_t shared, unsigned int) {
    return cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks, f, block_size, shared);
}

CUresult CUDAAPI cuOccupancyAvailableDynamicSMemPerBlock(size_t *bytes, CUfunction f, int, int) {
    Function *fn = function_of(f);
    if (!fn) return result(fail(CUDA_ERROR_INVALID_HANDLE, "cuOccupancyAvailableDynamicSMemPerBlock: not a function"));
    *bytes = shared_optin_limit() - fn->ptx->static_shared;
    return CUDA_SUCCESS;
}

}  // extern "C"
