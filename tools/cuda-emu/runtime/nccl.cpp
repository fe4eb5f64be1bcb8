// NCCL of the emulated device (libnccl.so.2): communicators across the processes of one machine, as data-parallel
// training uses them — unique ids, init by rank, all-reduce, broadcast, all-gather, group calls, abort, destroy and
// the asynchronous error query.
//
// A communicator is a shared-memory file (/dev/shm, named by the unique id) holding each rank's pid, a barrier
// counter per rank and a staging slot per rank. A collective runs on the calling thread when it is issued (the
// emulated device runs stream work at once): in chunks of a slot, each rank copies its input into its slot, waits for
// all ranks, reduces the slots in rank order (so every rank gets the same bits) into its output, and waits again.
//
// Faults behave as on real GPUs: a collective whose peer never arrives waits forever (the kernel spins); a peer whose
// process has exited, or that aborted its communicator, makes `ncclCommGetAsyncError` report ncclRemoteError with a
// message naming that rank (`ncclGetLastError`); `ncclCommAbort` from another thread ends the waiting call with
// ncclSystemError. A program's watchdog is what turns a hang into an error, as torch's is.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"
#include "half.h"

using namespace emu;

namespace {

enum Result : int {
    Success = 0,
    UnhandledCudaError = 1,
    SystemError = 2,
    InternalError = 3,
    InvalidArgument = 4,
    InvalidUsage = 5,
    RemoteError = 6,
};
enum DataType : int { Int8, Uint8, Int32, Uint32, Int64, Uint64, Float16, Float32, Float64, Bfloat16 };
enum RedOp : int { Sum, Prod, Max, Min, Avg };

constexpr int kMaxRanks = 64;
constexpr size_t kSlotBytes = 8u << 20;  // staging per rank; larger collectives run in chunks
constexpr char kIdPrefix[] = "cuemu-nccl-";
constexpr uint32_t kMagic = 0x4e43434c;  // "NCCL"

// The communicator's shared file: written by every rank, read by all.
struct Shared {
    std::atomic<uint32_t> magic;
    std::atomic<int32_t> nranks;
    std::atomic<int32_t> joined;
    std::atomic<int32_t> aborted_by;  // rank + 1 of the first rank that aborted, 0 while none has
    std::atomic<int32_t> pid[kMaxRanks];
    std::atomic<uint64_t> arrived[kMaxRanks];  // barrier phases each rank has reached
    char doing[kMaxRanks][48];                 // the collective each rank is in (for messages)
    // the slots follow, nranks × kSlotBytes
};

size_t shared_bytes(int nranks) { return sizeof(Shared) + static_cast<size_t>(nranks) * kSlotBytes; }

struct Comm {
    std::string name;
    int rank = 0, nranks = 0;
    Shared *shared = nullptr;
    uint64_t phase = 0;
    std::atomic<bool> aborted{false};
    std::atomic<int> calls{0};  // calls in flight (an abort from another thread waits for them)
    std::atomic<int> async_error{Success};
    std::mutex message_lock;
    std::string message;  // the last error's message (ncclGetLastError)
    uint8_t *slot(int r) const { return reinterpret_cast<uint8_t *>(shared + 1) + static_cast<size_t>(r) * kSlotBytes; }
};

std::mutex g_lock;
std::set<Comm *> g_comms;  // live communicators (never freed: a thread may still be leaving a call)
thread_local std::string t_last_error;
thread_local int t_group_depth = 0;
thread_local std::vector<std::function<int()>> t_group;

int refuse(int code, Comm *comm, const std::string &message) {
    fail(code, message);
    t_last_error = message;
    if (comm) {
        std::lock_guard<std::mutex> hold(comm->message_lock);
        comm->message = message;
    }
    return code;
}

bool live(Comm *comm) {
    std::lock_guard<std::mutex> hold(g_lock);
    return g_comms.count(comm) != 0;
}

size_t element_size(int type) {
    switch (type) {
    case Int8: case Uint8: return 1;
    case Float16: case Bfloat16: return 2;
    case Int32: case Uint32: case Float32: return 4;
    case Int64: case Uint64: case Float64: return 8;
    default: return 0;
    }
}

// Whether process `pid` has exited (a zombie its parent has not reaped yet has exited too).
bool exited(pid_t pid) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], stat[256] = {0};
    snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
    const int fd = open(path, O_RDONLY);
    if (fd < 0) return false;
    const ssize_t n = read(fd, stat, sizeof stat - 1);
    close(fd);
    const char *end = n > 0 ? strrchr(stat, ')') : nullptr;  // "pid (name) S …"
    return end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

// Notes a peer that exited or aborted as the communicator's asynchronous error, once. The message is in place
// before the error is published: a watchdog that sees the error reads the message next (ncclGetLastError).
void note_remote_failure(Comm *comm, int peer, const char *what) {
    std::lock_guard<std::mutex> hold(comm->message_lock);
    if (comm->async_error.load() != Success) return;
    comm->message = format("NCCL (emulated): rank %d %s while rank %d was in %s", peer, what, comm->rank,
                           comm->shared->doing[comm->rank]);
    comm->async_error.store(RemoteError);
    fprintf(stderr, "cuda-emu: %s\n", comm->message.c_str());
}

// Waits until every rank has reached the communicator's next phase. Only an abort of this communicator ends the
// wait early (SystemError); a peer that exited or aborted is noted as the asynchronous error meanwhile.
int barrier(Comm *comm) {
    const uint64_t phase = ++comm->phase;
    Shared *s = comm->shared;
    s->arrived[comm->rank].store(phase);
    auto last_check = std::chrono::steady_clock::now();
    for (unsigned spins = 0;; spins++) {
        bool all = true;
        for (int r = 0; r < comm->nranks && all; r++) all = s->arrived[r].load() >= phase;
        if (all) return Success;
        if (comm->aborted.load()) {
            return refuse(SystemError, comm, format("NCCL (emulated): rank %d's communicator was aborted during %s",
                                                    comm->rank, s->doing[comm->rank]));
        }
        const auto now = std::chrono::steady_clock::now();
        if (now - last_check > std::chrono::milliseconds(20)) {
            last_check = now;
            if (int by = s->aborted_by.load()) note_remote_failure(comm, by - 1, "aborted its communicator");
            for (int r = 0; r < comm->nranks; r++) {
                if (s->arrived[r].load() >= phase) continue;
                if (exited(s->pid[r].load())) note_remote_failure(comm, r, "exited");
            }
        }
        if (spins < 64) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 50 : 500));
        }
    }
}

// Reduces element `i` of every rank's slot (chunk-relative) into `out`, in rank order.
template <typename T>
void reduce_into(const Comm *comm, size_t offset, size_t n, int op, T *out) {
    for (size_t i = 0; i < n; i++) {
        T acc = reinterpret_cast<const T *>(comm->slot(0) + offset)[i];
        for (int r = 1; r < comm->nranks; r++) {
            const T v = reinterpret_cast<const T *>(comm->slot(r) + offset)[i];
            switch (op) {
            case Sum: case Avg: acc = static_cast<T>(acc + v); break;
            case Prod: acc = static_cast<T>(acc * v); break;
            case Max: acc = v > acc ? v : acc; break;
            case Min: acc = v < acc ? v : acc; break;
            }
        }
        if (op == Avg) acc = static_cast<T>(acc / static_cast<T>(comm->nranks));
        out[i] = acc;
    }
}

// The same for float16 / bfloat16: each step in float, rounded back to the type (as each hop of a ring does).
void reduce_half(const Comm *comm, size_t n, int op, bool bf16, uint16_t *out) {
    auto load = [&](int r, size_t i) {
        const uint16_t h = reinterpret_cast<const uint16_t *>(comm->slot(r))[i];
        return bf16 ? bf16_to_float(h) : half_to_float(h);
    };
    auto round = [&](float f) { return bf16 ? float_to_bf16(f) : float_to_half(f); };
    auto widen = [&](uint16_t h) { return bf16 ? bf16_to_float(h) : half_to_float(h); };
    for (size_t i = 0; i < n; i++) {
        float acc = load(0, i);
        for (int r = 1; r < comm->nranks; r++) {
            const float v = load(r, i);
            switch (op) {
            case Sum: case Avg: acc = widen(round(acc + v)); break;
            case Prod: acc = widen(round(acc * v)); break;
            case Max: acc = std::fmax(acc, v); break;
            case Min: acc = std::fmin(acc, v); break;
            }
        }
        if (op == Avg) acc = acc / static_cast<float>(comm->nranks);
        out[i] = round(acc);
    }
}

void reduce_chunk(const Comm *comm, int type, int op, size_t n, void *out) {
    switch (type) {
    case Int8: reduce_into(comm, 0, n, op, static_cast<int8_t *>(out)); break;
    case Uint8: reduce_into(comm, 0, n, op, static_cast<uint8_t *>(out)); break;
    case Int32: reduce_into(comm, 0, n, op, static_cast<int32_t *>(out)); break;
    case Uint32: reduce_into(comm, 0, n, op, static_cast<uint32_t *>(out)); break;
    case Int64: reduce_into(comm, 0, n, op, static_cast<int64_t *>(out)); break;
    case Uint64: reduce_into(comm, 0, n, op, static_cast<uint64_t *>(out)); break;
    case Float32: reduce_into(comm, 0, n, op, static_cast<float *>(out)); break;
    case Float64: reduce_into(comm, 0, n, op, static_cast<double *>(out)); break;
    case Float16: reduce_half(comm, n, op, false, static_cast<uint16_t *>(out)); break;
    case Bfloat16: reduce_half(comm, n, op, true, static_cast<uint16_t *>(out)); break;
    }
}

// Checks a collective's communicator, stream, type and device buffers; Success when it may run.
int check_call(const char *api, Comm *comm, void *stream, int type, int op,
               std::initializer_list<std::pair<const void *, size_t>> buffers) {
    if (!live(comm)) return refuse(InvalidArgument, nullptr, format("%s: not a live communicator", api));
    if (comm->aborted.load()) return refuse(InvalidUsage, comm, format("%s: the communicator was aborted", api));
    if (!valid_stream(stream)) return refuse(InvalidArgument, comm, format("%s: not a live stream", api));
    if (element_size(type) == 0) return refuse(InvalidArgument, comm, format("%s: data type %d", api, type));
    if (op < Sum || op > Avg) return refuse(InvalidArgument, comm, format("%s: reduction %d", api, op));
    for (const auto &b : buffers) {
        if (b.second == 0) continue;
        const uintptr_t p = reinterpret_cast<uintptr_t>(b.first);
        const std::string bad = in_arena(p) ? check_range(p, b.second) : "not device memory";
        if (!bad.empty()) return refuse(InvalidArgument, comm, format("%s: buffer %p: %s", api, b.first, bad.c_str()));
    }
    note_collective(stream);
    return Success;
}

// Runs `body` as a collective named `api` of `comm`: deferred to ncclGroupEnd inside a group, else now, with the
// communicator held against a concurrent abort.
int collective(const char *api, Comm *comm, std::function<int()> body) {
    count_launch(api);
    auto run = [api, comm, body]() -> int {
        comm->calls++;
        snprintf(comm->shared->doing[comm->rank], sizeof(Shared::doing[0]), "%s", api);
        int r = body();
        comm->calls--;
        return r;
    };
    if (t_group_depth > 0) {
        t_group.push_back(run);
        return Success;
    }
    return run();
}

}  // namespace

extern "C" {

typedef struct {
    char internal[128];
} ncclUniqueId;

const char *ncclGetErrorString(int result) {
    switch (result) {
    case Success: return "no error";
    case UnhandledCudaError: return "unhandled cuda error";
    case SystemError: return "unhandled system error";
    case InternalError: return "internal error";
    case InvalidArgument: return "invalid argument";
    case InvalidUsage: return "invalid usage";
    case RemoteError: return "remote process exited or there was a network error";
    default: return "unknown result code";
    }
}

const char *ncclGetLastError(Comm *comm) {
    if (comm && live(comm)) {
        std::lock_guard<std::mutex> hold(comm->message_lock);
        if (!comm->message.empty()) {
            t_last_error = comm->message;
        }
    }
    return t_last_error.c_str();
}

int ncclGetVersion(int *version) {
    if (!version) return refuse(InvalidArgument, nullptr, "ncclGetVersion: null version");
    *version = 22800;  // 2.28.0
    return Success;
}

int ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return refuse(InvalidArgument, nullptr, "ncclGetUniqueId: null id");
    uint8_t random[16];
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, random, sizeof random) != static_cast<ssize_t>(sizeof random)) {
        if (fd >= 0) close(fd);
        return refuse(SystemError, nullptr, "ncclGetUniqueId: cannot read /dev/urandom");
    }
    close(fd);
    memset(id->internal, 0, sizeof id->internal);
    std::string name = kIdPrefix;
    for (uint8_t b : random) name += format("%02x", b);
    memcpy(id->internal, name.c_str(), name.size());
    return Success;
}

int ncclCommInitRank(Comm **out, int nranks, ncclUniqueId id, int rank) {
    const char *api = "ncclCommInitRank";
    if (!out) return refuse(InvalidArgument, nullptr, format("%s: null communicator", api));
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks) {
        return refuse(InvalidArgument, nullptr, format("%s: rank %d of %d (the emulator allows up to %d ranks)", api,
                                                       rank, nranks, kMaxRanks));
    }
    if (int r = require_context(api)) return refuse(UnhandledCudaError, nullptr, format("%s: no CUDA context (%d)", api, r));
    const std::string name(id.internal, strnlen(id.internal, sizeof id.internal));
    if (name.rfind(kIdPrefix, 0) != 0) {
        return refuse(InvalidArgument, nullptr, format("%s: not a unique id of ncclGetUniqueId", api));
    }
    const std::string path = "/" + name;
    int fd = shm_open(path.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0) return refuse(SystemError, nullptr, format("%s: shm_open %s: %s", api, path.c_str(), strerror(errno)));
    const size_t bytes = shared_bytes(nranks);
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        close(fd);
        return refuse(SystemError, nullptr, format("%s: ftruncate %s: %s", api, path.c_str(), strerror(errno)));
    }
    void *map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return refuse(SystemError, nullptr, format("%s: mmap: %s", api, strerror(errno)));
    Shared *s = static_cast<Shared *>(map);
    uint32_t expected = 0;
    if (s->magic.compare_exchange_strong(expected, kMagic)) s->nranks.store(nranks);
    while (s->nranks.load() == 0) std::this_thread::yield();  // the first rank is writing the header
    if (s->nranks.load() != nranks) {
        const int theirs = s->nranks.load();
        munmap(map, bytes);
        return refuse(InvalidUsage, nullptr, format("%s: rank %d says %d ranks, an earlier rank said %d", api, rank,
                                                    nranks, theirs));
    }
    int32_t no_pid = 0;
    if (!s->pid[rank].compare_exchange_strong(no_pid, getpid())) {
        munmap(map, bytes);
        return refuse(InvalidUsage, nullptr, format("%s: rank %d joined twice", api, rank));
    }
    s->joined.fetch_add(1);
    // Every rank joins before any returns (NCCL's bootstrap); a rank that exits meanwhile fails the others.
    while (s->joined.load() < nranks) {
        for (int r = 0; r < nranks; r++) {
            if (exited(s->pid[r].load())) {
                munmap(map, bytes);
                return refuse(RemoteError, nullptr, format("%s: rank %d exited before every rank joined", api, r));
            }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (rank == 0) shm_unlink(path.c_str());  // all have it mapped: nothing is left behind in /dev/shm
    Comm *comm = new Comm;
    comm->name = name;
    comm->rank = rank;
    comm->nranks = nranks;
    comm->shared = s;
    snprintf(s->doing[rank], sizeof(Shared::doing[0]), "%s", "ncclCommInitRank");
    {
        std::lock_guard<std::mutex> hold(g_lock);
        g_comms.insert(comm);
    }
    *out = comm;
    return Success;
}

int ncclCommInitRankConfig(Comm **out, int nranks, ncclUniqueId id, int rank, void *) {
    return ncclCommInitRank(out, nranks, id, rank);
}

// Unmaps the shared file once no call of the communicator is in flight, and retires it.
static int retire(Comm *comm, const char *api, bool abort) {
    if (!live(comm)) return refuse(InvalidArgument, nullptr, format("%s: not a live communicator", api));
    if (abort) {
        comm->aborted.store(true);
        int none = 0;
        comm->shared->aborted_by.compare_exchange_strong(none, comm->rank + 1);
    }
    while (comm->calls.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    {
        std::lock_guard<std::mutex> hold(g_lock);
        g_comms.erase(comm);
    }
    munmap(comm->shared, shared_bytes(comm->nranks));
    comm->shared = nullptr;
    return Success;
}

int ncclCommAbort(Comm *comm) { return retire(comm, "ncclCommAbort", true); }
int ncclCommDestroy(Comm *comm) { return retire(comm, "ncclCommDestroy", false); }
int ncclCommFinalize(Comm *comm) {
    return live(comm) ? Success : refuse(InvalidArgument, nullptr, "ncclCommFinalize: not a live communicator");
}

int ncclCommGetAsyncError(Comm *comm, int *error) {
    if (!live(comm) || !error) return refuse(InvalidArgument, nullptr, "ncclCommGetAsyncError: not a live communicator");
    *error = comm->async_error.load();
    return Success;
}

int ncclCommCount(Comm *comm, int *count) {
    if (!live(comm) || !count) return refuse(InvalidArgument, nullptr, "ncclCommCount: not a live communicator");
    *count = comm->nranks;
    return Success;
}

int ncclCommUserRank(Comm *comm, int *rank) {
    if (!live(comm) || !rank) return refuse(InvalidArgument, nullptr, "ncclCommUserRank: not a live communicator");
    *rank = comm->rank;
    return Success;
}

int ncclCommCuDevice(Comm *comm, int *device) {
    if (!live(comm) || !device) return refuse(InvalidArgument, nullptr, "ncclCommCuDevice: not a live communicator");
    *device = 0;
    return Success;
}

int ncclAllReduce(const void *send, void *recv, size_t count, int type, int op, Comm *comm, void *stream) {
    const char *api = "ncclAllReduce";
    const size_t es = element_size(type), bytes = count * es;
    if (int r = check_call(api, comm, stream, type, op, {{send, bytes}, {recv, bytes}})) return r;
    return collective(api, comm, [=]() -> int {
        const size_t per_chunk = kSlotBytes / es;
        for (size_t start = 0; start < count; start += per_chunk) {
            const size_t n = std::min(per_chunk, count - start);
            memcpy(comm->slot(comm->rank), static_cast<const uint8_t *>(send) + start * es, n * es);
            if (int r = barrier(comm)) return r;
            reduce_chunk(comm, type, op, n, static_cast<uint8_t *>(recv) + start * es);
            if (int r = barrier(comm)) return r;
        }
        return Success;
    });
}

int ncclBroadcast(const void *send, void *recv, size_t count, int type, int root, Comm *comm, void *stream) {
    const char *api = "ncclBroadcast";
    const size_t es = element_size(type), bytes = count * es;
    const bool is_root = live(comm) && comm->rank == root;
    if (int r = check_call(api, comm, stream, type, Sum, {{is_root ? send : nullptr, is_root ? bytes : 0}, {recv, bytes}})) {
        return r;
    }
    if (root < 0 || root >= comm->nranks) return refuse(InvalidArgument, comm, format("%s: root %d", api, root));
    return collective(api, comm, [=]() -> int {
        for (size_t start = 0; start < bytes; start += kSlotBytes) {
            const size_t n = std::min(kSlotBytes, bytes - start);
            if (is_root) memcpy(comm->slot(root), static_cast<const uint8_t *>(send) + start, n);
            if (int r = barrier(comm)) return r;
            memcpy(static_cast<uint8_t *>(recv) + start, comm->slot(root), n);
            if (int r = barrier(comm)) return r;
        }
        return Success;
    });
}

int ncclBcast(void *buffer, size_t count, int type, int root, Comm *comm, void *stream) {
    return ncclBroadcast(buffer, buffer, count, type, root, comm, stream);
}

int ncclAllGather(const void *send, void *recv, size_t count, int type, Comm *comm, void *stream) {
    const char *api = "ncclAllGather";
    const size_t es = element_size(type), bytes = count * es;
    const int nranks = live(comm) ? comm->nranks : 1;
    if (int r = check_call(api, comm, stream, type, Sum, {{send, bytes}, {recv, bytes * nranks}})) return r;
    return collective(api, comm, [=]() -> int {
        for (size_t start = 0; start < bytes; start += kSlotBytes) {
            const size_t n = std::min(kSlotBytes, bytes - start);
            memcpy(comm->slot(comm->rank), static_cast<const uint8_t *>(send) + start, n);
            if (int r = barrier(comm)) return r;
            for (int peer = 0; peer < comm->nranks; peer++) {
                memcpy(static_cast<uint8_t *>(recv) + peer * bytes + start, comm->slot(peer), n);
            }
            if (int r = barrier(comm)) return r;
        }
        return Success;
    });
}

int ncclGroupStart() {
    t_group_depth++;
    return Success;
}

int ncclGroupEnd() {
    if (t_group_depth == 0) return refuse(InvalidUsage, nullptr, "ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return Success;
    std::vector<std::function<int()>> calls;
    calls.swap(t_group);
    for (auto &call : calls) {
        if (int r = call()) return r;
    }
    return Success;
}

}  // extern "C"
