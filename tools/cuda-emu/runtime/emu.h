// The emulated CUDA device's internals, shared by the driver API (driver.cpp), memory (memory.cpp), kernel
// launches (launch.cpp), PTX reading (ptx.cpp) and the libraries built on them (cuBLAS, cuRAND). One device
// state per process; every entry point takes the state's lock where it touches shared tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace emu {

// ---- configuration (environment variables, read once) ----
struct Config {
    uint64_t capacity;          // CUDA_EMU_MEMORY: device memory in bytes (default 80 GB, an H100's)
    int cc_major, cc_minor;     // CUDA_EMU_COMPUTE_CAP: e.g. "9.0" (default) or "75"
    int driver_version;         // CUDA_EMU_DRIVER_VERSION: e.g. 13000 (CUDA 13.0, default) or 12040
    int devices;                // CUDA_EMU_DEVICES: how many GPUs (default 1)
    bool race_check;            // CUDA_EMU_RACECHECK=1: threads run in reverse order, shared-memory races reported
    int threads;                // CUDA_EMU_THREADS: host threads for GEMMs and fast-mode blocks (default: all cores)
    bool fast;                  // CUDA_EMU_FAST=1: uninstrumented kernels, blocks over the cores (see launch.cpp)
    bool abort_on_error;        // CUDA_EMU_ABORT=1: abort the process at the first error the emulator reports
    std::string counters_path;  // CUDA_EMU_COUNTERS: the counters are written there as JSON at exit ("%p": the pid)
    std::string kernels_dir;    // CUDA_EMU_KERNELS: the CPU builds of kernel modules (default: kernels/ beside us)
};
const Config &config();

// ---- errors ----
// Records `message` as the calling thread's last error for `code` (cuGetErrorString returns it), prints it to
// stderr as "cuda-emu: …" and returns `code`. With CUDA_EMU_ABORT=1 it aborts.
int fail(int code, const std::string &message);
// The detailed message of the calling thread's last failure with `code`, or null.
const char *last_message(int code);
// A sticky error (an illegal address, a trap in a kernel): every later call of the process fails with it, as a
// CUDA context does after a kernel fault. 0 while there is none.
int sticky_error();
// Makes `code` sticky with `message`, the fault's own description; a later fault changes neither (the first one
// broke the context).
void set_sticky_error(int code, const std::string &message);
// Why a call fails after the sticky error: "an earlier kernel failed: FIRST", FIRST being the fault's own message,
// never a later call's (so the cause is said once, however many calls fail after it).
std::string earlier_failure();
// printf into a std::string.
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- memory ----
enum class Kind : uint8_t { Device, Host, Shared };
struct Allocation {
    uintptr_t base = 0;  // the first byte (256-byte aligned)
    size_t size = 0;     // the bytes asked for
    uintptr_t span_lo = 0, span_hi = 0;  // the pages it occupies; the guard page follows span_hi
    Kind kind = Kind::Device;
    uint64_t serial = 0;  // the allocation's number, in order of allocation
};
// Reserves the arena where every device allocation, pinned host allocation and block shared memory lives.
void init_memory();
// The arena's address range (set once by init_memory), read inline on the hot path of every checked access.
extern uintptr_t g_lo, g_len;
inline bool in_arena(uintptr_t addr) { return addr - g_lo < g_len; }
// A new allocation of `size` bytes; CUDA_ERROR_OUT_OF_MEMORY past the capacity (device memory only).
int allocate(size_t size, Kind kind, uintptr_t *out, const char *api);
// Frees the allocation starting at `ptr` (of `kind`); its pages become inaccessible (use after free faults).
int release(uintptr_t ptr, Kind kind, const char *api);
// The live allocation whose pages hold `addr`.
bool find_live(uintptr_t addr, Allocation *out);
// The most recently freed allocation whose pages held `addr`.
bool find_freed(uintptr_t addr, Allocation *out);
// Where `addr` lies, in words ("byte 12 past the end of allocation #3 (1024 bytes)", "freed allocation …").
std::string describe_address(uintptr_t addr, size_t bytes);
// Checks that [addr, addr + bytes) lies inside one live allocation; an empty string when it does, else why not.
std::string check_range(uintptr_t addr, size_t bytes);
// Checks the canary bytes after the end of an allocation; an empty string when intact.
std::string check_canary(const Allocation &a);
// Bumps the generation that invalidates cached allocation lookups (on every free).
uint64_t free_generation();

struct PoolStats {
    uint64_t used, reserved, used_high, reserved_high;
};
PoolStats pool_stats();
void reset_pool_high(bool used, bool reserved);
uint64_t release_threshold();
void set_release_threshold(uint64_t bytes);

// ---- counters (what a test can read: copies, launches, allocations, waits) ----
enum class Copy { HostToDevice, DeviceToHost, DeviceToDevice, HostToHost };
void count_copy(Copy direction, size_t bytes);
// The host waiting for the device (a context, stream or event synchronization, a synchronous copy), and a stream
// waiting for an event: the calls that order work, which a program that overlaps copies with compute keeps off the
// host.
void count_host_wait();
void count_stream_wait();
void count_launch(const std::string &kernel);
void count_allocation(size_t bytes);
// Overlap of collectives with compute: a collective issued on one stream stays open until something waits for it —
// a stream's or the host's wait on an event recorded on its stream after it, or the host's wait for its stream or
// the context. A collective during which a kernel (or GEMM) is queued on another stream counts as overlapped: on a
// GPU the two would run at the same time. Default streams (null, legacy, per-thread) are one stream here.
void note_collective(const void *stream);
// Asynchronous host-to-device copies are followed the same way (a copy on the stream whose kernels use it overlaps
// nothing; one on a stream of its own, made ahead, overlaps the kernels queued meanwhile).
void note_async_upload(const void *stream);
void note_kernel(const void *stream);
// An event stands for its latest record only: recording it again, or destroying it (its handle may be reused),
// takes it off the collectives an earlier record covered.
void note_event_record(const void *event, const void *stream);
void note_event_forget(const void *event);
// A stream's wait on an event (a stream waiting for its own earlier work orders nothing), and the host's.
void note_event_wait(const void *event, const void *stream);
void note_event_sync(const void *event);
// The host waiting for `stream`, or for the whole context.
void note_stream_sync(const void *stream);
void note_context_sync();
// The counters as JSON.
std::string counters_json();
void reset_counters();

// ---- streams ----
// Whether `stream` names a live stream (or one of the default streams).
bool valid_stream(const void *stream);

// ---- contexts ----
// CUDA_SUCCESS when the calling thread has a current context, else CUDA_ERROR_INVALID_CONTEXT (with a message
// naming `api`), or the sticky error.
int require_context(const char *api);

}  // namespace emu
