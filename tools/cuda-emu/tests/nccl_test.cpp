// The emulated NCCL (runtime/nccl.cpp) across processes: collectives give every rank the same, exact results; a
// rank that exits, or one that hangs, leaves the others in a wait that a watchdog ends by aborting the communicator,
// with the asynchronous error naming the rank that exited.
//
//   nccl_test        (exit status 0 when every check passes; each rank is a forked process)

#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

extern "C" {
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
int ncclGetUniqueId(ncclUniqueId *id);
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
int ncclCommAbort(ncclComm_t comm);
int ncclCommDestroy(ncclComm_t comm);
int ncclCommGetAsyncError(ncclComm_t comm, int *error);
const char *ncclGetLastError(ncclComm_t comm);
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, CUstream);
int ncclBroadcast(const void *, void *, size_t, int, int, ncclComm_t, CUstream);
int ncclAllGather(const void *, void *, size_t, int, ncclComm_t, CUstream);
int ncclGroupStart();
int ncclGroupEnd();
}

namespace {

constexpr int kFloat32 = 7, kBfloat16 = 9, kSum = 0, kAvg = 4;
constexpr int kSystemError = 2, kRemoteError = 6;

int failures = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            fprintf(stderr, "nccl_test:%d: ", __LINE__);              \
            fprintf(stderr, __VA_ARGS__);                             \
            fprintf(stderr, "\n");                                    \
            failures++;                                               \
        }                                                             \
    } while (0)

void open_device() {
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "nccl_test: no emulated device\n");
        exit(2);
    }
}

CUdeviceptr upload(const std::vector<float> &v) {
    CUdeviceptr p;
    cuMemAlloc(&p, v.size() * 4);
    cuMemcpyHtoD(p, v.data(), v.size() * 4);
    return p;
}

std::vector<float> download(CUdeviceptr p, size_t n) {
    std::vector<float> v(n);
    cuMemcpyDtoH(v.data(), p, n * 4);
    return v;
}

uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

// Runs `rank_main(rank)` in `nranks` forked processes sharing one unique id; true when every one exits 0.
bool run_ranks(int nranks, const std::function<int(int, ncclUniqueId)> &rank_main) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) != 0) return false;
    std::vector<pid_t> pids;
    for (int r = 0; r < nranks; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            open_device();
            _exit(rank_main(r, id));
        }
        pids.push_back(pid);
    }
    bool ok = true;
    for (pid_t pid : pids) {
        int status = 0;
        waitpid(pid, &status, 0);
        ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return ok;
}

// Collectives on 4 ranks: sum and average over more than one staging chunk, bf16, broadcast, all-gather, a group.
int collectives(int rank, ncclUniqueId id) {
    const int n = 4;
    ncclComm_t comm;
    CHECK(ncclCommInitRank(&comm, n, id, rank) == 0, "init rank %d", rank);
    const size_t count = (3u << 20) + 5;  // 12 MiB of f32: two chunks of the 8 MiB slot
    std::vector<float> mine(count);
    for (size_t i = 0; i < count; i++) mine[i] = static_cast<float>((i % 1000) * (rank + 1)) * 0.25f;
    CUdeviceptr buf = upload(mine), out;
    cuMemAlloc(&out, count * 4);
    CHECK(ncclAllReduce(reinterpret_cast<void *>(buf), reinterpret_cast<void *>(out), count, kFloat32, kSum, comm,
                        nullptr) == 0, "all-reduce");
    auto sum = download(out, count);
    for (size_t i = 0; i < count; i += 9973) {
        const float want = static_cast<float>((i % 1000) * 10) * 0.25f;  // (1+2+3+4) · …
        CHECK(sum[i] == want, "sum[%zu] = %g, want %g", i, sum[i], want);
    }
    CHECK(ncclAllReduce(reinterpret_cast<void *>(buf), reinterpret_cast<void *>(buf), count, kFloat32, kAvg, comm,
                        nullptr) == 0, "in-place average");
    auto avg = download(buf, count);
    CHECK(avg[count - 1] == static_cast<float>(((count - 1) % 1000) * 10) * 0.25f / 4, "average %g", avg[count - 1]);

    uint16_t h[3] = {to_bf16(1.0f + rank), to_bf16(-0.5f), to_bf16(1e-3f * rank)};
    CUdeviceptr hb;
    cuMemAlloc(&hb, sizeof h);
    cuMemcpyHtoD(hb, h, sizeof h);
    CHECK(ncclAllReduce(reinterpret_cast<void *>(hb), reinterpret_cast<void *>(hb), 3, kBfloat16, kSum, comm, nullptr) == 0,
          "bf16");
    cuMemcpyDtoH(h, hb, sizeof h);
    CHECK(h[0] == to_bf16(10.0f) && h[1] == to_bf16(-2.0f), "bf16 sums %04x %04x", h[0], h[1]);

    std::vector<float> root_data = {static_cast<float>(rank), 7, 8};
    CUdeviceptr b = upload(root_data);
    CHECK(ncclBroadcast(reinterpret_cast<void *>(b), reinterpret_cast<void *>(b), 3, kFloat32, 2, comm, nullptr) == 0,
          "broadcast");
    CHECK(download(b, 3)[0] == 2.0f, "broadcast from rank 2 gave %g", download(b, 3)[0]);

    CUdeviceptr one = upload({static_cast<float>(rank * 10), static_cast<float>(rank * 10 + 1)}), all;
    cuMemAlloc(&all, n * 2 * 4);
    CHECK(ncclAllGather(reinterpret_cast<void *>(one), reinterpret_cast<void *>(all), 2, kFloat32, comm, nullptr) == 0,
          "all-gather");
    auto gathered = download(all, n * 2);
    for (int r = 0; r < n; r++) CHECK(gathered[2 * r + 1] == r * 10 + 1, "gathered %d: %g", r, gathered[2 * r + 1]);

    CUdeviceptr g1 = upload({1, 2}), g2 = upload({3});
    ncclGroupStart();
    ncclAllReduce(reinterpret_cast<void *>(g1), reinterpret_cast<void *>(g1), 2, kFloat32, kSum, comm, nullptr);
    ncclAllReduce(reinterpret_cast<void *>(g2), reinterpret_cast<void *>(g2), 1, kFloat32, kSum, comm, nullptr);
    CHECK(download(g1, 2)[1] == 2.0f, "a grouped call ran before ncclGroupEnd");
    CHECK(ncclGroupEnd() == 0, "group end");
    CHECK(download(g1, 2)[1] == 8.0f && download(g2, 1)[0] == 12.0f, "grouped all-reduces");

    // A host pointer is not device memory.
    float host[2];
    CHECK(ncclAllReduce(host, host, 2, kFloat32, kSum, comm, nullptr) != 0, "host buffer accepted");
    CHECK(ncclCommDestroy(comm) == 0, "destroy");
    return failures ? 1 : 0;
}

// The watchdog of a rank: polls the asynchronous error and aborts the communicator on one, or after `timeout`.
// Returns what it saw ("remote: …", "timeout").
std::string watchdog(ncclComm_t comm, std::chrono::milliseconds timeout, const std::atomic<bool> &done) {
    const auto start = std::chrono::steady_clock::now();
    while (!done.load()) {
        int error = 0;
        ncclCommGetAsyncError(comm, &error);
        if (error == kRemoteError) {
            std::string why = std::string("remote: ") + ncclGetLastError(comm);
            ncclCommAbort(comm);
            return why;
        }
        if (std::chrono::steady_clock::now() - start > timeout) {
            ncclCommAbort(comm);
            return "timeout";
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return "done";
}

// Rank 1 exits without taking part; rank 0's all-reduce waits until its watchdog, told by the asynchronous error
// that rank 1 exited, aborts — long before the timeout.
int peer_exits(int rank, ncclUniqueId id) {
    ncclComm_t comm;
    CHECK(ncclCommInitRank(&comm, 2, id, rank) == 0, "init");
    if (rank == 1) _exit(0);
    CUdeviceptr buf = upload({1, 2, 3});
    std::atomic<bool> done{false};
    std::string seen;
    const auto start = std::chrono::steady_clock::now();
    std::thread dog([&] { seen = watchdog(comm, std::chrono::seconds(30), done); });
    const int r = ncclAllReduce(reinterpret_cast<void *>(buf), reinterpret_cast<void *>(buf), 3, kFloat32, kSum, comm,
                                nullptr);
    done = true;
    dog.join();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(r == kSystemError, "the aborted all-reduce returned %d", r);
    CHECK(seen.find("rank 1 exited") != std::string::npos && seen.find("ncclAllReduce") != std::string::npos,
          "watchdog saw: %s", seen.c_str());
    CHECK(waited < 5, "took %.1f s to notice", waited);
    return failures ? 1 : 0;
}

// Rank 1 hangs (alive, never arriving): rank 0 waits until its watchdog's timeout aborts. Rank 1, arriving later,
// learns that rank 0 aborted.
int peer_hangs(int rank, ncclUniqueId id) {
    ncclComm_t comm;
    CHECK(ncclCommInitRank(&comm, 2, id, rank) == 0, "init");
    CUdeviceptr buf = upload({1});
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    std::atomic<bool> done{false};
    std::string seen;
    std::thread dog([&] { seen = watchdog(comm, std::chrono::milliseconds(300), done); });
    const int r = ncclAllReduce(reinterpret_cast<void *>(buf), reinterpret_cast<void *>(buf), 1, kFloat32, kSum, comm,
                                nullptr);
    done = true;
    dog.join();
    CHECK(r == kSystemError, "rank %d: the all-reduce returned %d", rank, r);
    if (rank == 0) CHECK(seen == "timeout", "rank 0's watchdog saw: %s", seen.c_str());
    if (rank == 1) CHECK(seen.find("rank 0 aborted") != std::string::npos, "rank 1's watchdog saw: %s", seen.c_str());
    return failures ? 1 : 0;
}

}  // namespace

int main() {
    int failed = 0;
    for (auto &[name, nranks, fn] : std::vector<std::tuple<const char *, int, std::function<int(int, ncclUniqueId)>>>{
             {"collectives on 4 ranks", 4, collectives},
             {"a rank that exits", 2, peer_exits},
             {"a rank that hangs", 2, peer_hangs},
         }) {
        const bool ok = run_ranks(nranks, fn);
        printf("%s: %s\n", name, ok ? "ok" : "FAILED");
        failed += !ok;
    }
    return failed ? 1 : 0;
}
