// The emulator's process-wide state that is not memory: its configuration, error reporting and the counters a
// test reads.

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "emu.h"

namespace emu {
namespace {

// "80e9", "16GiB", "512MiB", "1000000" → bytes.
uint64_t parse_bytes(const char *text, uint64_t fallback) {
    if (!text || !*text) return fallback;
    char *end = nullptr;
    const double value = strtod(text, &end);
    if (end == text || value < 0) return fallback;
    const std::string unit(end);
    double scale = 1;
    if (unit == "KiB") scale = 1024.0;
    else if (unit == "MiB") scale = 1024.0 * 1024;
    else if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
    else if (unit == "KB") scale = 1e3;
    else if (unit == "MB") scale = 1e6;
    else if (unit == "GB") scale = 1e9;
    else if (!unit.empty()) return fallback;
    return (uint64_t)(value * scale);
}

// The folder of this library (libcuda.so.1), where the kernel modules are built next to it.
std::string own_folder() {
    Dl_info info;
    if (dladdr(reinterpret_cast<void *>(&own_folder), &info) && info.dli_fname) {
        std::string path(info.dli_fname);
        const size_t slash = path.rfind('/');
        if (slash != std::string::npos) return path.substr(0, slash);
    }
    return ".";
}

Config read_config() {
    Config c;
    c.capacity = parse_bytes(getenv("CUDA_EMU_MEMORY"), 80000000000ull);
    c.cc_major = 9;
    c.cc_minor = 0;
    if (const char *cc = getenv("CUDA_EMU_COMPUTE_CAP")) {
        // "8.6" or "86".
        int major = 0, minor = 0;
        if (sscanf(cc, "%d.%d", &major, &minor) == 2) {
            c.cc_major = major, c.cc_minor = minor;
        } else if (sscanf(cc, "%d", &major) == 1 && major >= 10) {
            c.cc_major = major / 10, c.cc_minor = major % 10;
        }
    }
    c.driver_version = 13000;
    if (const char *v = getenv("CUDA_EMU_DRIVER_VERSION")) c.driver_version = atoi(v);
    c.devices = 1;
    if (const char *v = getenv("CUDA_EMU_DEVICES")) c.devices = atoi(v) > 0 ? atoi(v) : 1;
    const char *race = getenv("CUDA_EMU_RACECHECK");
    c.race_check = race && *race && strcmp(race, "0") != 0;
    c.threads = (int)std::max(1u, std::thread::hardware_concurrency());
    if (const char *v = getenv("CUDA_EMU_THREADS")) c.threads = atoi(v) > 0 ? atoi(v) : c.threads;
    const char *fast = getenv("CUDA_EMU_FAST");
    c.fast = fast && *fast && strcmp(fast, "0") != 0 && !c.race_check;
    const char *abort_env = getenv("CUDA_EMU_ABORT");
    c.abort_on_error = abort_env && *abort_env && strcmp(abort_env, "0") != 0;
    if (const char *p = getenv("CUDA_EMU_COUNTERS")) c.counters_path = p;
    const char *k = getenv("CUDA_EMU_KERNELS");
    c.kernels_dir = k && *k ? std::string(k) : own_folder() + "/kernels";
    return c;
}

thread_local int t_last_code = 0;
thread_local std::string t_last_message;
std::atomic<int> g_sticky{0};
// The sticky fault's message, written once under its lock before `g_sticky` is published.
std::mutex g_sticky_lock;
std::string g_sticky_message;

struct Counters {
    std::mutex lock;
    uint64_t copies[4] = {0, 0, 0, 0}, copy_bytes[4] = {0, 0, 0, 0};
    uint64_t allocations = 0, allocated_bytes = 0, launches = 0;
    uint64_t host_waits = 0, stream_waits = 0;
    uint64_t collectives = 0, overlapped_collectives = 0;
    uint64_t async_uploads = 0, overlapped_uploads = 0;
    std::map<std::string, uint64_t> launches_by_kernel;
    // The collectives and asynchronous host-to-device copies nothing has waited for yet: which, their stream,
    // whether a kernel ran beside them, and the events recorded on their stream after them.
    struct Open {
        bool upload;
        const void *stream;
        bool overlapped;
        std::vector<const void *> events;
    };
    std::vector<Open> open;
};
Counters &counters() {
    static Counters *c = new Counters;
    return *c;
}

// Writes the counters to CUDA_EMU_COUNTERS at exit; a "%p" there becomes the process id (each rank of a job its own
// file).
void write_counters_at_exit() {
    std::string path = config().counters_path;
    if (path.empty()) return;
    if (const size_t at = path.find("%p"); at != std::string::npos) path.replace(at, 2, std::to_string(getpid()));
    if (FILE *f = fopen(path.c_str(), "w")) {
        const std::string json = counters_json();
        fwrite(json.data(), 1, json.size(), f);
        fclose(f);
    }
}

}  // namespace

const Config &config() {
    // Never destroyed: the exit handler that writes the counters runs after the destructors of statics made
    // before it was registered, and reads the configuration.
    static const Config *c = [] {
        Config *read = new Config(read_config());
        if (!read->counters_path.empty()) atexit(write_counters_at_exit);
        return read;
    }();
    return *c;
}

std::string format(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list copy;
    va_copy(copy, ap);
    const int n = vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    std::string out(n > 0 ? n : 0, '\0');
    if (n > 0) vsnprintf(&out[0], n + 1, fmt, ap);
    va_end(ap);
    return out;
}

int fail(int code, const std::string &message) {
    t_last_code = code;
    t_last_message = message;
    fprintf(stderr, "cuda-emu: %s\n", message.c_str());
    fflush(stderr);
    if (config().abort_on_error) abort();
    return code;
}

const char *last_message(int code) { return code == t_last_code && code != 0 ? t_last_message.c_str() : nullptr; }

int sticky_error() { return g_sticky.load(std::memory_order_acquire); }

void set_sticky_error(int code, const std::string &message) {
    std::lock_guard<std::mutex> g(g_sticky_lock);
    if (g_sticky.load(std::memory_order_relaxed)) return;
    g_sticky_message = message;
    g_sticky.store(code, std::memory_order_release);
}

std::string earlier_failure() {
    std::lock_guard<std::mutex> g(g_sticky_lock);
    return "an earlier kernel failed: " + g_sticky_message;
}

void count_copy(Copy direction, size_t bytes) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.copies[(int)direction] += 1;
    c.copy_bytes[(int)direction] += bytes;
}

void count_launch(const std::string &kernel) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.launches += 1;
    c.launches_by_kernel[kernel] += 1;
}

void count_host_wait() {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.host_waits += 1;
}

void count_stream_wait() {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.stream_waits += 1;
}

void count_allocation(size_t bytes) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.allocations += 1;
    c.allocated_bytes += bytes;
}

namespace {
// The one default stream: null, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2).
const void *normal_stream(const void *stream) {
    return reinterpret_cast<uintptr_t>(stream) <= 2 ? nullptr : stream;
}
}  // namespace

void note_collective(const void *stream) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.collectives += 1;
    c.open.push_back({false, normal_stream(stream), false, {}});
}

void note_async_upload(const void *stream) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.async_uploads += 1;
    c.open.push_back({true, normal_stream(stream), false, {}});
}

void note_kernel(const void *stream) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    stream = normal_stream(stream);
    for (auto &o : c.open) {
        if (o.stream != stream && !o.overlapped) {
            o.overlapped = true;
            (o.upload ? c.overlapped_uploads : c.overlapped_collectives) += 1;
        }
    }
}

namespace {
void forget_event(Counters &c, const void *event) {
    for (auto &o : c.open) o.events.erase(std::remove(o.events.begin(), o.events.end(), event), o.events.end());
}
}  // namespace

void note_event_record(const void *event, const void *stream) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    stream = normal_stream(stream);
    forget_event(c, event);
    for (auto &o : c.open) {
        if (o.stream == stream) o.events.push_back(event);
    }
}

void note_event_forget(const void *event) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    forget_event(c, event);
}

void note_event_wait(const void *event, const void *stream) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    stream = normal_stream(stream);
    c.open.erase(std::remove_if(c.open.begin(), c.open.end(),
                                [event, stream](const Counters::Open &o) {
                                    return o.stream != stream &&
                                           std::find(o.events.begin(), o.events.end(), event) != o.events.end();
                                }),
                 c.open.end());
}

void note_event_sync(const void *event) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.open.erase(std::remove_if(c.open.begin(), c.open.end(),
                                [event](const Counters::Open &o) {
                                    return std::find(o.events.begin(), o.events.end(), event) != o.events.end();
                                }),
                 c.open.end());
}

void note_stream_sync(const void *stream) {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    stream = normal_stream(stream);
    c.open.erase(std::remove_if(c.open.begin(), c.open.end(),
                                [stream](const Counters::Open &o) { return o.stream == stream; }),
                 c.open.end());
}

void note_context_sync() {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    c.open.clear();
}

std::string counters_json() {
    const PoolStats pool = pool_stats();
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    static const char *names[4] = {"host_to_device", "device_to_host", "device_to_device", "host_to_host"};
    std::string out = "{\"copies\": {";
    for (int i = 0; i < 4; ++i) {
        out += format("%s\"%s\": {\"count\": %llu, \"bytes\": %llu}", i ? ", " : "", names[i],
                      (unsigned long long)c.copies[i], (unsigned long long)c.copy_bytes[i]);
    }
    out += format("}, \"allocations\": {\"count\": %llu, \"bytes\": %llu}, \"pool\": {\"used\": %llu, \"peak\": %llu}",
                  (unsigned long long)c.allocations, (unsigned long long)c.allocated_bytes,
                  (unsigned long long)pool.used, (unsigned long long)pool.used_high);
    out += format(", \"waits\": {\"host\": %llu, \"stream\": %llu}", (unsigned long long)c.host_waits,
                  (unsigned long long)c.stream_waits);
    out += format(", \"collectives\": {\"count\": %llu, \"overlapped\": %llu}", (unsigned long long)c.collectives,
                  (unsigned long long)c.overlapped_collectives);
    out += format(", \"async_uploads\": {\"count\": %llu, \"overlapped\": %llu}",
                  (unsigned long long)c.async_uploads, (unsigned long long)c.overlapped_uploads);
    out += format(", \"launches\": {\"count\": %llu, \"by_kernel\": {", (unsigned long long)c.launches);
    bool first = true;
    for (const auto &kv : c.launches_by_kernel) {
        out += format("%s\"%s\": %llu", first ? "" : ", ", kv.first.c_str(), (unsigned long long)kv.second);
        first = false;
    }
    out += "}}}";
    return out;
}

void reset_counters() {
    Counters &c = counters();
    std::lock_guard<std::mutex> g(c.lock);
    for (int i = 0; i < 4; ++i) c.copies[i] = c.copy_bytes[i] = 0;
    c.allocations = c.allocated_bytes = c.launches = 0;
    c.host_waits = c.stream_waits = 0;
    c.collectives = c.overlapped_collectives = 0;
    c.async_uploads = c.overlapped_uploads = 0;
    c.launches_by_kernel.clear();
    c.open.clear();
}

}  // namespace emu

// For tests: the counters as JSON (a static string, valid until the next call on this thread), and their reset.
extern "C" __attribute__((visibility("default"))) const char *cuemu_counters(void) {
    thread_local std::string json;
    json = emu::counters_json();
    return json.c_str();
}
extern "C" __attribute__((visibility("default"))) void cuemu_reset_counters(void) { emu::reset_counters(); }
