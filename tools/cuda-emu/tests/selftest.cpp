// The emulated device's own tests: correct kernels give the right numbers, and each kind of bug the emulator exists
// to catch — an out-of-bounds index, a missing barrier, a launch beyond the hardware's limits, shared memory beyond
// the default limit, a use after free, a divergent barrier, a layout-dependent WMMA use — fails naming the kernel,
// and every call after a fault says that fault's message once.
// Each case runs in a child process (a kernel fault is sticky for the process, as on a GPU).
//
//   selftest PTX_DIR KERNELS_DIR [CASE]

#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string g_ptx_dir;

[[noreturn]] void die(const std::string &why) {
    fprintf(stderr, "FAILED: %s\n", why.c_str());
    exit(1);
}

void ok(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *s = nullptr;
        cuGetErrorString(r, &s);
        die(std::string(what) + ": " + (s ? s : "?"));
    }
}

// The module of the test kernels, on a fresh context.
CUmodule setup() {
    ok(cuInit(0), "cuInit");
    CUdevice dev;
    ok(cuDeviceGet(&dev, 0), "cuDeviceGet");
    CUcontext ctx;
    ok(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    ok(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    std::ifstream f(g_ptx_dir + "/selftest.ptx");
    std::stringstream text;
    text << f.rdbuf();
    CUmodule m;
    ok(cuModuleLoadData(&m, text.str().c_str()), "cuModuleLoadData");
    return m;
}

CUfunction kernel(CUmodule m, const char *name) {
    CUfunction f;
    ok(cuModuleGetFunction(&f, m, name), name);
    return f;
}

CUdeviceptr upload(const std::vector<float> &values) {
    CUdeviceptr p;
    ok(cuMemAlloc(&p, values.size() * sizeof(float)), "cuMemAlloc");
    ok(cuMemcpyHtoD(p, values.data(), values.size() * sizeof(float)), "cuMemcpyHtoD");
    return p;
}

std::vector<float> download(CUdeviceptr p, size_t n) {
    std::vector<float> out(n);
    ok(cuMemcpyDtoH(out.data(), p, n * sizeof(float)), "cuMemcpyDtoH");
    return out;
}

CUresult launch(CUfunction f, unsigned grid, unsigned block, std::vector<void *> args, unsigned shared = 0,
                unsigned grid_y = 1) {
    return cuLaunchKernel(f, grid, grid_y, 1, block, 1, 1, shared, CU_STREAM_PER_THREAD, args.data(), nullptr);
}

// The launch must fail with `code`, and the error's message must name the kernel and say `expected`.
void expect_failure(CUresult r, CUresult code, const char *kernel_name, const char *expected) {
    if (r == CUDA_SUCCESS) die(std::string(kernel_name) + ": the launch succeeded");
    const char *s = nullptr;
    cuGetErrorString(r, &s);
    const std::string message = s ? s : "";
    if (r != code) die(std::string(kernel_name) + ": wrong error " + std::to_string(r) + ": " + message);
    if (message.find(kernel_name) == std::string::npos || message.find(expected) == std::string::npos) {
        die(std::string("the message does not name `") + kernel_name + "` and say `" + expected + "`: " + message);
    }
}

std::vector<float> ramp(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = scale * (float)((i * 7919) % 101) - 50.0f * scale;
    return v;
}

uint16_t to_bf16(float x) {  // exact for the small integers used here
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)(bits >> 16);
}

// ---- the cases ----

void correct_kernels() {
    CUmodule m = setup();
    const unsigned n = 1000;
    std::vector<float> x = ramp(n), y = ramp(n, 0.5f);
    CUdeviceptr dx = upload(x), dy = upload(y);
    float a = 3.0f;
    ok(launch(kernel(m, "saxpy"), (n + 255) / 256, 256, {&dx, &dy, &a, (void *)&n}), "saxpy");
    std::vector<float> got = download(dy, n);
    for (unsigned i = 0; i < n; ++i) {
        if (got[i] != a * x[i] + y[i]) die("saxpy: wrong value at " + std::to_string(i));
    }
    // Block sums with barriers, warp sums with shuffles and ballots.
    std::vector<float> big = ramp(4 * 256);
    CUdeviceptr db = upload(big), dsums = upload(std::vector<float>(32)), dballots = upload(std::vector<float>(32));
    ok(launch(kernel(m, "reduce_synchronized"), 4, 256, {&db, &dsums}), "reduce_synchronized");
    std::vector<float> sums = download(dsums, 4);
    for (int b = 0; b < 4; ++b) {
        double want = 0;
        for (int i = 0; i < 256; ++i) want += big[b * 256 + i];
        if (std::fabs(sums[b] - want) > 1e-3) die("reduce_synchronized: wrong sum");
    }
    ok(launch(kernel(m, "warp_sums"), 4, 256, {&db, &dsums, &dballots}), "warp_sums");
    sums = download(dsums, 32);
    std::vector<uint32_t> ballots(32);
    ok(cuMemcpyDtoH(ballots.data(), dballots, 32 * 4), "ballots");
    for (int w = 0; w < 32; ++w) {
        double want = 0;
        uint32_t want_ballot = 0;
        for (int l = 0; l < 32; ++l) {
            want += big[w * 32 + l];
            if (big[w * 32 + l] > 0) want_ballot |= 1u << l;
        }
        if (std::fabs(sums[w] - want) > 1e-3) die("warp_sums: wrong sum");
        if (ballots[w] != want_ballot) die("warp_sums: wrong ballot");
    }
    // WMMA: C = 2 · A · B.
    std::vector<uint16_t> ha(256), hb(256);
    for (int i = 0; i < 256; ++i) {
        ha[i] = to_bf16((float)(i % 7) - 3.0f);
        hb[i] = to_bf16((float)(i % 5) - 2.0f);
    }
    CUdeviceptr da, dbb, dc;
    ok(cuMemAlloc(&da, 512), "alloc a");
    ok(cuMemAlloc(&dbb, 512), "alloc b");
    ok(cuMemAlloc(&dc, 1024), "alloc c");
    ok(cuMemcpyHtoD(da, ha.data(), 512), "a");
    ok(cuMemcpyHtoD(dbb, hb.data(), 512), "b");
    auto expected = [&](int r, int c) {  // B is column-major: element (k, c) at c·16 + k
        float s = 0;
        for (int k = 0; k < 16; ++k) s += ((float)((r * 16 + k) % 7) - 3.0f) * ((float)((c * 16 + k) % 5) - 2.0f);
        return 2.0f * s;
    };
    ok(launch(kernel(m, "wmma_tile"), 1, 32, {&da, &dbb, &dc}), "wmma_tile");
    std::vector<float> c = download(dc, 256);
    for (int r = 0; r < 16; ++r)
        for (int col = 0; col < 16; ++col)
            if (c[r * 16 + col] != expected(r, col)) die("wmma_tile: wrong product");
    // A kernel that assumes the fragment layout gets wrong numbers (and no error: the emulator cannot know). Not in
    // the fast mode, whose fragments are whole tiles in lane 0: there the kernel would write past its buffer.
    const char *fast = getenv("CUDA_EMU_FAST");
    if (!fast || !*fast || strcmp(fast, "0") == 0) {
        ok(launch(kernel(m, "wmma_layout_assumed"), 1, 32, {&da, &dbb, &dc}), "wmma_layout_assumed");
        c = download(dc, 256);
        int right = 0;
        for (int r = 0; r < 16; ++r)
            for (int col = 0; col < 16; ++col) right += c[r * 16 + col] == expected(r, col);
        if (right > 64) die("wmma_layout_assumed: a layout-dependent use of a fragment gave right numbers");
    }
    // 100 KiB of shared memory with the attribute set.
    CUfunction big_shared = kernel(m, "big_shared");
    ok(cuFuncSetAttribute(big_shared, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100 * 1024), "attribute");
    ok(launch(big_shared, 1, 256, {&dy}, 100 * 1024), "big_shared with the attribute");
    got = download(dy, 256);
    for (int i = 0; i < 256; ++i) {
        if (got[i] != (float)(255 - i)) die("big_shared: wrong value");
    }
}

void off_by_one_read() {
    CUmodule m = setup();
    const unsigned n = 100;  // 400 bytes: the read of x[100] lands in the allocation's alignment slack
    CUdeviceptr dx = upload(ramp(n)), dy = upload(ramp(n));
    expect_failure(launch(kernel(m, "off_by_one_read"), 1, 128, {&dx, &dy, (void *)&n}), CUDA_ERROR_ILLEGAL_ADDRESS,
                   "off_by_one_read", "past its end");
}

void off_by_one_write() {
    CUmodule m = setup();
    const unsigned n = 64;  // 256 bytes: the write of y[64] hits the guard page
    CUdeviceptr dx = upload(ramp(n)), dy = upload(ramp(n));
    expect_failure(launch(kernel(m, "off_by_one_write"), 1, 128, {&dx, &dy, (void *)&n}), CUDA_ERROR_ILLEGAL_ADDRESS,
                   "off_by_one_write", "past its end");
}

void fault_in_a_helper_thread() {
    // Run in the fast mode on four host threads: the write past the end, unchecked there, still faults on the guard
    // page in whichever host thread runs its block (the fifth), and the launch reports it.
    CUmodule m = setup();
    const unsigned n = 64;
    CUdeviceptr dx = upload(ramp(n)), dy = upload(ramp(n));
    expect_failure(launch(kernel(m, "off_by_one_write"), 8, 16, {&dx, &dy, (void *)&n}), CUDA_ERROR_ILLEGAL_ADDRESS,
                   "off_by_one_write", "past its end");
}

void missing_syncthreads() {
    // Run in the race-check mode (CUDA_EMU_RACECHECK=1): the synchronized version passes, the other fails.
    CUmodule m = setup();
    CUdeviceptr dx = upload(ramp(2 * 256)), dsums = upload(std::vector<float>(2));
    ok(launch(kernel(m, "reduce_synchronized"), 2, 256, {&dx, &dsums}), "reduce_synchronized in the race check");
    expect_failure(launch(kernel(m, "reduce_missing_syncthreads"), 2, 256, {&dx, &dsums}), CUDA_ERROR_LAUNCH_FAILED,
                   "reduce_missing_syncthreads", "same barrier interval");
}

// After a fault every call fails with it, each message saying the fault's own message once (not wrapping the
// message of the call before it).
void later_calls_name_the_fault_once() {
    CUmodule m = setup();
    const unsigned n = 64;
    CUdeviceptr dx = upload(ramp(n)), dy = upload(ramp(n));
    CUfunction fault = kernel(m, "off_by_one_write");
    expect_failure(launch(fault, 1, 128, {&dx, &dy, (void *)&n}), CUDA_ERROR_ILLEGAL_ADDRESS, "off_by_one_write",
                   "past its end");
    const char *first = nullptr;
    cuGetErrorString(CUDA_ERROR_ILLEGAL_ADDRESS, &first);
    const std::string cause = first ? first : "";
    std::vector<float> back(n);
    const std::pair<const char *, std::function<CUresult()>> calls[] = {
        {"cuMemcpyDtoH", [&] { return cuMemcpyDtoH(back.data(), dy, n * sizeof(float)); }},
        {"cuMemFreeAsync", [&] { return cuMemFreeAsync(dx, CU_STREAM_PER_THREAD); }},
        {"cuLaunchKernel", [&] { return launch(fault, 1, 32, {&dx, &dy, (void *)&n}); }},
        {"cuMemFree", [&] { return cuMemFree(dy); }},
    };
    for (const auto &[api, call] : calls) {
        const CUresult r = call();
        if (r != CUDA_ERROR_ILLEGAL_ADDRESS) die(std::string(api) + " did not fail with the fault");
        const char *s = nullptr;
        cuGetErrorString(r, &s);
        const std::string message = s ? s : "";
        const std::string expected = std::string(api) + ": an earlier kernel failed: " + cause;
        if (message != expected) die("expected `" + expected + "`, got `" + message + "`");
    }
}

void grid_too_large() {
    CUmodule m = setup();
    const unsigned n = 1;
    CUdeviceptr dx = upload(ramp(256)), dy = upload(ramp(256));
    float a = 1;
    expect_failure(launch(kernel(m, "saxpy"), 1, 32, {&dx, &dy, &a, (void *)&n}, 0, 70000), CUDA_ERROR_INVALID_VALUE,
                   "saxpy", "65535");
    expect_failure(launch(kernel(m, "saxpy"), 1, 2048, {&dx, &dy, &a, (void *)&n}), CUDA_ERROR_INVALID_VALUE, "saxpy",
                   "1024 threads");
    expect_failure(launch(kernel(m, "saxpy"), 0, 32, {&dx, &dy, &a, (void *)&n}), CUDA_ERROR_INVALID_VALUE, "saxpy",
                   "zero-sized");
}

void shared_without_attribute() {
    CUmodule m = setup();
    CUdeviceptr dy = upload(ramp(256));
    expect_failure(launch(kernel(m, "big_shared"), 1, 256, {&dy}, 100 * 1024), CUDA_ERROR_INVALID_VALUE, "big_shared",
                   "cuFuncSetAttribute");
}

void shared_out_of_bounds() {
    CUmodule m = setup();
    CUdeviceptr dy = upload(ramp(256));
    const unsigned n = 200;  // 256 threads write buffer[200 …] of 256 floats
    expect_failure(launch(kernel(m, "shared_overflow"), 1, 256, {&dy, (void *)&n}, 256 * 4), CUDA_ERROR_ILLEGAL_ADDRESS,
                   "shared_overflow", "shared memory");
}

void use_after_free() {
    CUmodule m = setup();
    CUdeviceptr dx = upload(ramp(256)), dy = upload(ramp(256));
    CUdeviceptr table = upload(std::vector<float>(2));
    ok(cuMemcpyHtoD(table, &dx, sizeof dx), "table");
    ok(cuMemFree(dx), "free");
    expect_failure(launch(kernel(m, "indirect_read"), 1, 32, {&table, &dy}), CUDA_ERROR_ILLEGAL_ADDRESS,
                   "indirect_read", "freed");
}

void freed_parameter() {
    CUmodule m = setup();
    const unsigned n = 256;
    CUdeviceptr dx = upload(ramp(256)), dy = upload(ramp(256));
    float a = 1;
    ok(cuMemFree(dx), "free");
    expect_failure(launch(kernel(m, "saxpy"), 1, 256, {&dx, &dy, &a, (void *)&n}), CUDA_ERROR_INVALID_VALUE, "saxpy",
                   "freed");
}

void divergent_barrier() {
    CUmodule m = setup();
    CUdeviceptr dy = upload(ramp(64));
    expect_failure(launch(kernel(m, "divergent_barrier"), 1, 64, {&dy}), CUDA_ERROR_LAUNCH_FAILED, "divergent_barrier",
                   "__syncthreads");
}

void wmma_misaligned() {
    CUmodule m = setup();
    CUdeviceptr da = upload(ramp(512)), dc = upload(ramp(32));
    expect_failure(launch(kernel(m, "wmma_misaligned"), 1, 32, {&da, &dc}), CUDA_ERROR_ASSERT, "wmma_misaligned",
                   "256-bit aligned");
}

void module_checks() {
    // PTX for a newer GPU than the device, and PTX newer than the driver, are refused at load.
    ok(cuInit(0), "cuInit");
    CUdevice dev;
    CUcontext ctx;
    ok(cuDeviceGet(&dev, 0), "cuDeviceGet");
    ok(cuDevicePrimaryCtxRetain(&ctx, dev), "retain");
    ok(cuCtxSetCurrent(ctx), "current");
    const char *sm90 = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
    const char *isa99 = ".version 9.9\n.target sm_80\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
    CUmodule m;
    if (cuModuleLoadData(&m, sm90) != CUDA_ERROR_NO_BINARY_FOR_GPU) die("sm_90 PTX loaded on a compute 8.6 device");
    if (cuModuleLoadData(&m, isa99) != CUDA_ERROR_UNSUPPORTED_PTX_VERSION) die("PTX ISA 9.9 loaded on driver 12.4");
    int major = 0, version = 0;
    ok(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attribute");
    ok(cuDriverGetVersion(&version), "version");
    if (major != 8 || version != 12040) die("the configured compute capability or driver version is not reported");
}

struct Case {
    const char *name;
    void (*run)();
    const char *env;  // NAME=VALUE set in the child before the device starts, or null
};

const Case CASES[] = {
    {"correct_kernels", correct_kernels, nullptr},
    {"correct_kernels_race_check", correct_kernels, "CUDA_EMU_RACECHECK=1"},
    {"correct_kernels_fast", correct_kernels, "CUDA_EMU_FAST=1;CUDA_EMU_THREADS=4"},
    {"fault_in_a_helper_thread", fault_in_a_helper_thread, "CUDA_EMU_FAST=1;CUDA_EMU_THREADS=4"},
    {"off_by_one_read", off_by_one_read, nullptr},
    {"off_by_one_write", off_by_one_write, nullptr},
    {"later_calls_name_the_fault_once", later_calls_name_the_fault_once, nullptr},
    {"missing_syncthreads", missing_syncthreads, "CUDA_EMU_RACECHECK=1"},
    {"grid_too_large", grid_too_large, nullptr},
    {"shared_without_attribute", shared_without_attribute, nullptr},
    {"shared_out_of_bounds", shared_out_of_bounds, nullptr},
    {"use_after_free", use_after_free, nullptr},
    {"freed_parameter", freed_parameter, nullptr},
    {"divergent_barrier", divergent_barrier, nullptr},
    {"wmma_misaligned", wmma_misaligned, nullptr},
    {"module_checks", module_checks, "CUDA_EMU_COMPUTE_CAP=8.6;CUDA_EMU_DRIVER_VERSION=12040"},
};

}  // namespace

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: selftest PTX_DIR KERNELS_DIR [CASE]\n");
        return 2;
    }
    g_ptx_dir = argv[1];
    setenv("CUDA_EMU_KERNELS", argv[2], 1);
    int failures = 0, run = 0;
    for (const Case &c : CASES) {
        if (argc > 3 && strcmp(argv[3], c.name) != 0) continue;
        ++run;
        fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) {
            if (c.env) {
                std::string all = c.env;
                for (size_t start = 0; start < all.size();) {
                    size_t end = all.find(';', start);
                    if (end == std::string::npos) end = all.size();
                    const std::string kv = all.substr(start, end - start);
                    setenv(kv.substr(0, kv.find('=')).c_str(), kv.substr(kv.find('=') + 1).c_str(), 1);
                    start = end + 1;
                }
            }
            c.run();
            _exit(0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        const bool passed = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        printf("%s %s\n", passed ? "ok  " : "FAIL", c.name);
        failures += !passed;
    }
    if (run == 0) {
        fprintf(stderr, "no case named %s\n", argv[3]);
        return 2;
    }
    printf("%d of %d emulator self-tests passed\n", run - failures, run);
    return failures ? 1 : 0;
}
