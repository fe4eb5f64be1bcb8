// Kernel launches on the emulated device.
//
// A block runs on one host thread: each CUDA thread is a fiber with a stack of its own, and the fibers run in
// passes. In a pass every runnable thread runs until it exits or reaches a barrier — `__syncthreads` (the block's)
// or a warp-synchronous step (`__syncwarp`, a shuffle, a vote, a WMMA product outside the fast build, which involve
// the lanes of their mask) — and then switches straight to the next runnable thread of the pass; a thread that
// exits starts the pass's next thread on its own stack when that one has not run yet. A barrier is released when
// its last participant reaches it, and the threads it held run again from the next pass. So the threads of a barrier
// interval run one after the other, in thread order, or in reverse order in the race-check mode, where every
// shared-memory access is also checked against the others of its interval: a read of what another thread wrote in
// the same interval, or a write to what another thread read or wrote, depends on the order threads run in — the
// mark of a missing barrier — and stops the kernel with both threads named. The blocks of a launch run one after
// the other on the calling host thread, except in the fast mode, which spreads them over the host's cores.
//
// Every load and store of a kernel passes through `check_access` (the kernels are compiled with GCC's
// kernel-address instrumentation, whose callbacks are defined here): an access to device or shared memory must lie
// inside a live allocation or the block's shared memory. Accesses outside the arena (the thread's own stack, the
// module's globals) are not device memory and pass. The fast mode (CUDA_EMU_FAST=1, for runs that check memory
// and logic rather than kernels) skips these checks; the launch's own checks (its arguments' allocations, the
// canaries past each written buffer) stay.

#include "launch.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <csetjmp>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "emu.h"

namespace emu {
namespace {

constexpr size_t PAGE = 4096;
constexpr size_t STACK_BYTES = 128 * 1024;   // per CUDA thread; the kernels' local arrays live here
constexpr size_t SHARED_WINDOW = 256 * 1024; // above every GPU's per-block maximum
constexpr size_t WARP_SCRATCH = 8 * 1024;

// ---------------------------------------------------------------------------------------------------------------
// Fibers: a minimal context switch. `cuemu_switch(from, to)` saves the callee-saved registers on the current stack,
// stores the stack pointer into *from and resumes the context whose stack pointer is `to`. The floating-point
// control state (MXCSR, the x87 control word) is not switched: no kernel changes it (the shim's rounding-mode
// intrinsics compute their results without it), so every fiber runs with the host thread's.
extern "C" void cuemu_switch(void **from, void *to);
extern "C" void cuemu_fiber_start();
#if defined(__x86_64__)
asm(R"(
    .text
    .globl cuemu_switch
    .type cuemu_switch, @function
cuemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuemu_switch, .-cuemu_switch

    .globl cuemu_fiber_start
    .type cuemu_fiber_start, @function
cuemu_fiber_start:
    movq %r12, %rdi
    call cuemu_fiber_main@PLT
    ud2
    .size cuemu_fiber_start, .-cuemu_fiber_start
)");
#else
#error "the emulated device's fibers are written for x86-64"
#endif

enum class State : uint8_t { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Thread {
    unsigned info[12];  // threadIdx, blockIdx, blockDim, gridDim: the layout of cuemu_thread_info
    unsigned linear, warp, lane;
    State state;
    bool started;         // it has run: its fiber exists (a thread that has not gets one when it is first resumed)
    unsigned mask;        // the lanes of the warp barrier it waits at
    const char *waits_in; // what it waits in, for a deadlock report
    uint64_t collectives; // warp-synchronous steps taken: their parity picks the exchange slot
    uint64_t exchange[2]; // the value it offers in a shuffle or vote
    int block_arrival;    // the block barrier generation it arrived at (parity picks the result slot)
    uint64_t ready_pass;  // the first pass it may run in once runnable (released barriers wait for the next)
    void *sp;             // its saved stack pointer while it is not running
    char *stack_lo, *stack_hi;
};

struct Warp {
    uint32_t interval;  // the race check's id of the warp's current interval
    uint32_t waiting;   // the lanes waiting at a warp barrier
    bool released;      // a barrier of its lanes was released in this pass: a new interval from the next
    char *scratch;      // 2 × WARP_SCRATCH
};

// What the race check remembers of a shared-memory byte: who last wrote it and who last read it, in which
// intervals.
struct Shadow {
    uint32_t w_block, w_warp, r_block, r_warp;
    uint16_t w_tid, r_tid;
    uint8_t w_atomic;
    uint8_t r_many;       // another thread of r_tid's warp read it in the same warp interval
    uint8_t r_many_warps; // threads of more than one warp read it in this block interval
};

// The state of the block running on this host thread.
struct Block {
    const Launch *launch = nullptr;
    unsigned idx[3];
    std::vector<Thread> *threads;
    std::vector<Warp> *warps;
    unsigned size = 0;    // threads per block
    unsigned live = 0, at_barrier = 0;
    unsigned cursor = 0;  // the running thread's place in the pass order
    uint64_t pass = 0;    // the current pass
    bool reverse = false; // the pass order is reverse thread order (the race-check mode)
    bool released = false; // the block's barrier was released in this pass: a new interval from the next
    int barrier_generation = 0;
    int op_predicates[3] = {0, 0, 0};  // count, and, or of the barrier being gathered
    int op_results[2][3];               // of the last two barriers, by generation parity
    uintptr_t shared_base = 0, shared_used = 0, static_next = 0, static_limit = 0, dynamic_base = 0;
    std::vector<std::pair<const void *, uintptr_t>> static_sites;
    uint32_t interval = 0;  // the race check's id of the block's current interval
    // The first error, which stops the kernel.
    int error = 0;
    std::string message;
};

// Per host thread: fiber stacks, the shared-memory window, scratch and the race check's shadow, kept across
// launches.
struct Executor {
    std::vector<Thread> threads;
    std::vector<Warp> warps;
    uintptr_t window_lo = 0;  // the shared window: an allocation in the arena of SHARED_WINDOW bytes
    std::vector<Shadow> shadow;
    void *scheduler_sp = nullptr;
    sigjmp_buf fault_return;
    // Ranges of the launch's pointer parameters, checked first by every access.
    std::vector<std::pair<uintptr_t, uintptr_t>> param_ranges;
    // The last allocation an access hit, valid while no allocation has been freed since.
    uintptr_t cache_lo = 0, cache_hi = 0;
    uint64_t cache_generation = ~0ull;
};

__attribute__((tls_model("initial-exec"))) thread_local Executor *t_exec = nullptr;
__attribute__((tls_model("initial-exec"))) thread_local Block *t_block = nullptr;
__attribute__((tls_model("initial-exec"))) thread_local Thread *t_current = nullptr;
__attribute__((tls_model("initial-exec"))) thread_local bool t_in_fault_region = false;

uint32_t g_interval = 0;
uint32_t next_interval() { return __atomic_add_fetch(&g_interval, 1, __ATOMIC_RELAXED); }

std::string thread_name(const Thread &t) {
    return format("thread (%u,%u,%u)", t.info[0], t.info[1], t.info[2]);
}

std::string where() {
    const Block *b = t_block;
    std::string s = format("kernel `%s`, block (%u,%u,%u)", b->launch->cpu->name, b->idx[0], b->idx[1], b->idx[2]);
    if (t_current) s += ", " + thread_name(*t_current);
    return s;
}

// Back to the scheduler, for good: the running thread's kernel has failed.
[[noreturn]] void abandon_thread() {
    void *ignored;
    cuemu_switch(&ignored, t_exec->scheduler_sp);
    __builtin_unreachable();
}

// Records the kernel's first error and stops the running thread (the scheduler then stops the kernel).
[[noreturn]] void kernel_error(int code, const std::string &message) {
    Block *b = t_block;
    if (!b->error) {
        b->error = code;
        b->message = where() + ": " + message;
    }
    abandon_thread();
}

// The thread at place `pos` of the pass order (thread order, or reverse thread order in the race-check mode).
Thread &in_pass_order(Block &b, unsigned pos) {
    return (*b.threads)[b.reverse ? b.size - 1 - pos : pos];
}

// The next thread of the pass that may run, its place made the pass's cursor; null, the cursor past the end, when
// none is left.
Thread *next_in_pass(Block &b) {
    for (unsigned pos = b.cursor + 1; pos < b.size; ++pos) {
        Thread &next = in_pass_order(b, pos);
        if (next.state != State::Runnable || next.ready_pass > b.pass) continue;
        b.cursor = pos;
        return &next;
    }
    b.cursor = b.size;
    return nullptr;
}

void reset_fiber(Thread &t);

// Where to switch to resume `t`: its saved context, or a new fiber on its own stack when it has not run yet.
void *resume_point(Thread &t) {
    if (!t.started) {
        t.started = true;
        reset_fiber(t);
    }
    return t.sp;
}

// The running thread waits at a barrier until it is released: the pass goes on with the next runnable thread in
// its order, switched to directly, or ends in the scheduler when none is left.
void yield_to_scheduler() {
    Thread *t = t_current;
    if (Thread *next = next_in_pass(*t_block)) {
        t_current = next;
        cuemu_switch(&t->sp, resume_point(*next));
    } else {
        cuemu_switch(&t->sp, t_exec->scheduler_sp);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Race check of shared memory.

bool concurrent(uint32_t block_interval, uint32_t warp_interval, uint16_t tid, const Thread &t) {
    const Block *b = t_block;
    if (block_interval != b->interval || tid == t.linear) return false;
    const unsigned other_warp = tid / 32;
    return other_warp != t.warp || warp_interval == (*b->warps)[t.warp].interval;
}

void race(const Thread &t, uint16_t other, uintptr_t offset, const char *what) {
    const Thread &o = (*t_block->threads)[other];
    kernel_error(719 /* CUDA_ERROR_LAUNCH_FAILED */,
                 format("%s shared memory at byte %llu that %s %s in the same barrier interval: the result depends on "
                        "the order the threads run in (a missing __syncthreads() or __syncwarp()?)",
                        what, (unsigned long long)offset, thread_name(o).c_str(),
                        strcmp(what, "reads") == 0 ? "wrote" : "accessed"));
}

void shadow_access(uintptr_t addr, size_t n, bool write, bool atomic) {
    Executor *e = t_exec;
    Block *b = t_block;
    const Thread &t = *t_current;
    const uint32_t warp_interval = (*b->warps)[t.warp].interval;
    for (size_t i = 0; i < n; ++i) {
        const uintptr_t offset = addr + i - b->shared_base;
        Shadow &s = e->shadow[addr + i - e->window_lo];
        const bool written_concurrently = concurrent(s.w_block, s.w_warp, s.w_tid, t);
        // Readers since the last barrier: of several warps (one of them not ours: concurrent), several of one warp
        // in one warp interval (concurrent unless that interval is over for us), or one (checked as such).
        const bool read_concurrently =
            s.r_block == b->interval &&
            (s.r_many_warps ||
             (s.r_many ? s.r_tid / 32 != t.warp || s.r_warp == warp_interval
                       : concurrent(s.r_block, s.r_warp, s.r_tid, t)));
        if (atomic) {
            if (written_concurrently && !s.w_atomic) race(t, s.w_tid, offset, "updates atomically");
            if (read_concurrently) race(t, s.r_tid, offset, "updates atomically");
        } else if (write) {
            if (written_concurrently) race(t, s.w_tid, offset, "writes");
            if (read_concurrently) race(t, s.r_tid, offset, "writes");
        } else if (written_concurrently) {
            race(t, s.w_tid, offset, "reads");
        }
        if (write || atomic) {
            s.w_block = b->interval, s.w_warp = warp_interval, s.w_tid = (uint16_t)t.linear;
            s.w_atomic = atomic;
        } else {
            if (s.r_block != b->interval) {
                s.r_many = s.r_many_warps = 0;
            } else if (s.r_tid / 32 != t.warp) {
                s.r_many_warps = 1;
            } else if (s.r_warp != warp_interval) {
                s.r_many = 0;  // the warp's earlier reads are ordered before this one by a __syncwarp
            } else if (s.r_tid != t.linear) {
                s.r_many = 1;  // two threads of the warp in one warp interval
            }
            s.r_block = b->interval, s.r_warp = warp_interval, s.r_tid = (uint16_t)t.linear;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Access checks.

void check_device_access(uintptr_t addr, size_t n, bool write, bool atomic) {
    Executor *e = t_exec;
    Block *b = t_block;
    if (!b || !t_current) return;  // not kernel code (a module's constructor)
    if (addr - e->window_lo < SHARED_WINDOW + PAGE) {
        if (addr < b->shared_base || addr + n > b->shared_base + b->shared_used) {
            kernel_error(700 /* CUDA_ERROR_ILLEGAL_ADDRESS */,
                         format("%s %zu bytes at byte %lld of the block's shared memory (%llu bytes)",
                                write ? "writes" : "reads", n, (long long)(addr - b->shared_base),
                                (unsigned long long)b->shared_used));
        }
        if (config().race_check) shadow_access(addr, n, write, atomic);
        return;
    }
    for (const auto &r : e->param_ranges) {
        if (addr >= r.first && addr + n <= r.second) return;
    }
    const uint64_t generation = free_generation();
    if (generation == e->cache_generation && addr >= e->cache_lo && addr + n <= e->cache_hi) return;
    Allocation al;
    if (find_live(addr, &al) && addr >= al.base && addr + n <= al.base + al.size) {
        e->cache_lo = al.base, e->cache_hi = al.base + al.size, e->cache_generation = generation;
        return;
    }
    kernel_error(700, format("%s %s", write ? "writes" : "reads", describe_address(addr, n).c_str()));
}

// CUDA_EMU_FAST, copied here by each launch (the configuration is read at first use, not at load: the self-tests
// set it per case): the access hooks run for every load and store of a kernel.
std::atomic<bool> unchecked_accesses{false};

inline void check_access(uintptr_t addr, size_t n, bool write) {
    if (__builtin_expect(!in_arena(addr), 1) || unchecked_accesses.load(std::memory_order_relaxed)) return;
    check_device_access(addr, n, write, false);
}

inline void check_atomic(const volatile void *p, size_t n) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    if (in_arena(addr) && !unchecked_accesses.load(std::memory_order_relaxed)) check_device_access(addr, n, true, true);
}

// ---------------------------------------------------------------------------------------------------------------
// Barriers.

// Releases the block's barrier once every live thread has reached it. The threads run again from the next pass,
// as they would if barriers were released between passes (the intervals of the race check change there too).
void release_block_barrier(Block &b) {
    if (b.at_barrier == 0 || b.at_barrier != b.live) return;
    int *result = b.op_results[b.barrier_generation & 1];
    std::copy(b.op_predicates, b.op_predicates + 3, result);
    b.op_predicates[0] = 0, b.op_predicates[1] = 1, b.op_predicates[2] = 0;
    ++b.barrier_generation;
    b.at_barrier = 0;
    for (Thread &t : *b.threads) {
        if (t.state == State::AtBlockBarrier) t.state = State::Runnable, t.ready_pass = b.pass + 1;
    }
    b.released = true;
}

// The end of a pass: the barriers released in it start new intervals of the race check.
void end_pass(Block &b) {
    if (!config().race_check) return;
    for (Warp &w : *b.warps) {
        if (b.released || w.released) w.interval = next_interval();
        w.released = false;
    }
    if (b.released) b.interval = next_interval();
    b.released = false;
}

void warp_barrier(unsigned mask, const char *what) {
    Thread *t = t_current;
    if (!(mask >> t->lane & 1)) {
        kernel_error(719, format("%s with mask 0x%08x, which does not hold the calling lane %u", what, mask, t->lane));
    }
    t->state = State::AtWarpBarrier;
    t->mask = mask;
    t->waits_in = what;
    ++t->collectives;
    // Released when every lane of the mask waits with the same mask; the lanes run again from the next pass.
    Block &b = *t_block;
    Warp &w = (*b.warps)[t->warp];
    w.waiting |= 1u << t->lane;
    if ((w.waiting & mask) == mask) {
        std::vector<Thread> &threads = *b.threads;
        const unsigned first = t->warp * 32;
        bool same = true;
        for (unsigned lane = 0; lane < 32 && same; ++lane) {
            same = !(mask >> lane & 1) || threads[first + lane].mask == mask;
        }
        if (same) {
            for (unsigned lane = 0; lane < 32; ++lane) {
                if (!(mask >> lane & 1)) continue;
                threads[first + lane].state = State::Runnable;
                threads[first + lane].ready_pass = b.pass + 1;
            }
            w.waiting &= ~mask;
            w.released = true;
        }
    }
    yield_to_scheduler();
}

std::string deadlock_report(const Block &b) {
    std::string out = "the block's threads wait for each other forever:";
    for (const Thread &t : *b.threads) {
        if (t.state == State::AtWarpBarrier) {
            out += format(" %s waits in %s (mask 0x%08x);", thread_name(t).c_str(), t.waits_in, t.mask);
        } else if (t.state == State::AtBlockBarrier) {
            out += format(" %s waits at __syncthreads();", thread_name(t).c_str());
        }
        if (out.size() > 1500) {
            out += " …";
            break;
        }
    }
    return out + " (a barrier inside a branch not all threads take, or a lane that exited?)";
}

// ---------------------------------------------------------------------------------------------------------------
// Running a block.

Executor &executor() {
    if (!t_exec) {
        t_exec = new Executor;
        // The fault handler runs on an alternate stack (a fiber's stack may be what overflowed); Rust's threads
        // have one, other threads get one here.
        stack_t current;
        if (sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE)) {
            stack_t alt;
            alt.ss_size = 64 * 1024;
            alt.ss_sp = malloc(alt.ss_size);
            alt.ss_flags = 0;
            sigaltstack(&alt, nullptr);
        }
        uintptr_t window = 0;
        if (allocate(SHARED_WINDOW, Kind::Shared, &window, "shared memory") == 0) t_exec->window_lo = window;
    }
    return *t_exec;
}

void prepare_threads(Executor &e, unsigned count) {
    while (e.threads.size() < count) {
        Thread t{};
        void *mem = mmap(nullptr, STACK_BYTES + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                         -1, 0);
        mprotect(mem, PAGE, PROT_NONE);  // the stack's guard: an overflow faults
        t.stack_lo = static_cast<char *>(mem) + PAGE;
        t.stack_hi = t.stack_lo + STACK_BYTES;
        e.threads.push_back(t);
    }
    while (e.warps.size() * 32 < count) {
        Warp w{};
        w.scratch = static_cast<char *>(calloc(2, WARP_SCRATCH));
        e.warps.push_back(w);
    }
}

// Sets `t` up to start the kernel at its next switch: a frame that cuemu_switch "returns" into cuemu_fiber_start
// with a 16-byte aligned stack, which calls cuemu_fiber_main(t) (t travels in r12).
void reset_fiber(Thread &t) {
    uintptr_t top = reinterpret_cast<uintptr_t>(t.stack_hi) & ~uintptr_t(15);
    uint64_t *sp = reinterpret_cast<uint64_t *>(top);
    *--sp = reinterpret_cast<uint64_t>(&cuemu_fiber_start);       // return address
    *--sp = 0;                                                     // rbp
    *--sp = 0;                                                     // rbx
    *--sp = reinterpret_cast<uint64_t>(&t);                        // r12
    *--sp = 0;                                                     // r13
    *--sp = 0;                                                     // r14
    *--sp = 0;                                                     // r15
    t.sp = sp;
}

// The bytes after a block's shared memory that are set to a canary before it runs and checked after.
uintptr_t canary_bytes(const Block &b) {
    return std::min<uintptr_t>(128, t_exec->window_lo + SHARED_WINDOW - (b.shared_base + b.shared_used));
}

int run_block(const Launch &l, Block &b, unsigned bx, unsigned by, unsigned bz) {
    Executor &e = *t_exec;
    const unsigned nthreads = b.size;
    b.idx[0] = bx, b.idx[1] = by, b.idx[2] = bz;
    b.live = nthreads;
    b.at_barrier = 0;
    b.barrier_generation = 0;
    b.op_predicates[0] = 0, b.op_predicates[1] = 1, b.op_predicates[2] = 0;
    b.static_sites.clear();
    b.static_next = b.shared_base;
    // Shared memory starts as garbage on a GPU; here as NaN-like bytes, and the bytes after it as canaries (those
    // the end of the block checks).
    memset(reinterpret_cast<void *>(b.shared_base), 0xFF, b.shared_used);
    memset(reinterpret_cast<void *>(b.shared_base + b.shared_used), 0xCD, canary_bytes(b));
    if (config().race_check) {  // its intervals: a counter the host threads share, so only where they are read
        b.interval = next_interval();
        for (Warp &w : e.warps) w.interval = next_interval();
    }
    // Thread indices counted up, x fastest (no division per thread).
    unsigned tx = 0, ty = 0, tz = 0;
    for (unsigned i = 0; i < nthreads; ++i) {
        Thread &t = e.threads[i];
        const unsigned info[12] = {tx, ty, tz, bx, by, bz, l.block[0], l.block[1], l.block[2],
                                   l.grid[0], l.grid[1], l.grid[2]};
        memcpy(t.info, info, sizeof info);
        t.linear = i, t.warp = i / 32, t.lane = i % 32;
        t.state = State::Runnable;
        t.started = false;
        t.ready_pass = 0;
        t.collectives = 0;
        if (++tx == l.block[0]) {
            tx = 0;
            if (++ty == l.block[1]) ty = 0, ++tz;
        }
    }
    for (Warp &w : e.warps) w.waiting = 0, w.released = false;
    b.released = false;
    // Passes: the scheduler starts each with the first runnable thread, which hands over to the next at its
    // barrier (yield_to_scheduler); the scheduler takes over again when a thread exits or the pass is over.
    for (b.pass = 0;; ++b.pass) {
        bool ran = false;
        for (unsigned pos = 0; pos < nthreads; ++pos) {
            Thread &t = in_pass_order(b, pos);
            if (t.state != State::Runnable || t.ready_pass > b.pass) continue;
            b.cursor = pos;
            t_current = &t;
            cuemu_switch(&e.scheduler_sp, resume_point(t));
            t_current = nullptr;
            ran = true;
            if (b.error) return b.error;
            pos = b.cursor;  // the pass went on to here
        }
        end_pass(b);
        if (b.live == 0) break;
        if (!ran) {
            b.error = 719;
            b.message = where() + ": " + deadlock_report(b);
            return b.error;
        }
    }
    // Bytes written past the block's shared memory by code the instrumentation does not see (memcpy, memset).
    const unsigned char *slack = reinterpret_cast<const unsigned char *>(b.shared_base + b.shared_used);
    for (uintptr_t i = 0; i < canary_bytes(b); ++i) {
        if (slack[i] != 0xCD) {
            b.error = 700;
            b.message = where() + format(": wrote past the end of the block's shared memory (%llu bytes)",
                                         (unsigned long long)b.shared_used);
            return 700;
        }
    }
    return 0;
}

// A launch's blocks, taken in order by the host threads that run them.
struct Grid {
    const Launch *launch = nullptr;
    std::vector<std::pair<uintptr_t, uintptr_t>> param_ranges;  // the pointer parameters' allocations
    unsigned long long blocks = 0;
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> failed{false};
    std::mutex error_lock;
    unsigned long long error_block = ULLONG_MAX;  // the first failed block (in launch order) and its error
    int error = 0;
    std::string message;
};

// Runs blocks of `grid` on the calling host thread, the next one in launch order each time (x fastest, then y,
// z), until none is left or one has failed.
void run_blocks(Grid &grid) {
    const Launch &l = *grid.launch;
    Executor &e = executor();
    e.param_ranges = grid.param_ranges;
    Block b;
    b.size = l.block[0] * l.block[1] * l.block[2];
    prepare_threads(e, b.size);
    if (config().race_check && e.shadow.empty()) e.shadow.assign(SHARED_WINDOW, Shadow{});
    b.launch = &l;
    b.threads = &e.threads;
    b.warps = &e.warps;
    // Shared memory: static variables first, the dynamic part 128-byte aligned after them, ending as close to the
    // window's end (and its guard page) as alignment allows.
    const size_t static_shared = l.ptx->static_shared;
    const size_t dynamic_offset = (static_shared + 127) / 128 * 128;
    b.shared_used = dynamic_offset + l.dynamic_shared;
    b.shared_base = (e.window_lo + SHARED_WINDOW - b.shared_used) & ~uintptr_t(127);
    b.dynamic_base = b.shared_base + dynamic_offset;
    b.static_limit = b.shared_base + static_shared;
    b.reverse = config().race_check;
    t_block = &b;
    volatile int result = 0;  // set again after a fault's longjmp
    volatile unsigned long long index = 0;
    t_in_fault_region = true;
    if (sigsetjmp(e.fault_return, 1) == 0) {
        while (!result && !grid.failed.load(std::memory_order_relaxed)) {
            index = grid.next.fetch_add(1, std::memory_order_relaxed);
            if (index >= grid.blocks) break;
            const unsigned long long i = index;
            result = run_block(l, b, (unsigned)(i % l.grid[0]), (unsigned)(i / l.grid[0] % l.grid[1]),
                               (unsigned)(i / ((unsigned long long)l.grid[0] * l.grid[1])));
        }
    } else {
        result = b.error;
    }
    t_in_fault_region = false;
    t_block = nullptr;
    t_current = nullptr;
    if (result) {
        grid.failed.store(true, std::memory_order_relaxed);
        std::lock_guard<std::mutex> g(grid.error_lock);
        if (index < grid.error_block) {
            grid.error_block = index;
            grid.error = result;
            grid.message = b.message;
        }
    }
}

// Host threads kept for the fast mode's blocks (each keeps its executor: fiber stacks and a shared-memory window
// allocated once). One launch at a time uses them; another launch meanwhile (from another host thread) runs its
// blocks itself.
class BlockPool {
  public:
    void run(Grid &grid, unsigned helpers) {
        std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
        if (!busy.owns_lock()) return run_blocks(grid);
        {
            std::lock_guard<std::mutex> g(lock_);
            while (workers_ < helpers) std::thread(&BlockPool::work, this, workers_++).detach();
            job_ = &grid;
            wanted_ = helpers;
            running_ = helpers;
            ++generation_;
        }
        wake_.notify_all();
        run_blocks(grid);
        std::unique_lock<std::mutex> g(lock_);
        finished_.wait(g, [&] { return running_ == 0; });
    }

  private:
    void work(unsigned index) {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> g(lock_);
        for (;;) {
            wake_.wait(g, [&] { return generation_ != seen; });
            seen = generation_;
            if (index >= wanted_) continue;
            Grid *grid = job_;
            g.unlock();
            run_blocks(*grid);
            g.lock();
            if (--running_ == 0) finished_.notify_all();
        }
    }

    std::mutex busy_, lock_;
    std::condition_variable wake_, finished_;
    Grid *job_ = nullptr;
    uint64_t generation_ = 0;
    unsigned workers_ = 0, wanted_ = 0, running_ = 0;
};

// Never destroyed: its threads wait on it until the process exits. A forked child, which has none of them, starts
// a pool of its own.
BlockPool *g_block_pool = nullptr;

BlockPool &block_pool() {
    static const bool registered = [] {
        pthread_atfork(nullptr, nullptr, [] { g_block_pool = nullptr; });
        return true;
    }();
    (void)registered;
    static std::mutex creating;
    std::lock_guard<std::mutex> g(creating);
    if (!g_block_pool) g_block_pool = new BlockPool;
    return *g_block_pool;
}

}  // namespace

// The body of every fiber: run the kernel; then, while the pass's next thread has not started, run it too on this
// stack (threads that never wait — an element-wise kernel's — take no switch and keep one stack in the cache); then
// hand over to the next thread, or to the scheduler, for good. A stack lent on is free: its owner has finished, and
// a thread that waits on it holds it until it finishes in turn.
extern "C" __attribute__((used)) void cuemu_fiber_main(Thread *t) {
    Block &b = *t_block;
    Thread *next;
    for (;;) {
        b.launch->cpu->launch(b.launch->params);
        t->state = State::Done;
        --b.live;
        release_block_barrier(b);
        next = next_in_pass(b);
        if (!next || next->started) break;
        next->started = true;
        t_current = t = next;
    }
    void *ignored;
    if (next) {
        t_current = next;
        cuemu_switch(&ignored, next->sp);
    }
    cuemu_switch(&ignored, t_exec->scheduler_sp);
    __builtin_unreachable();
}

size_t shared_optin_limit() {
    // Per-block shared memory with the opt-in attribute, by compute capability (CUDA programming guide).
    const int cc = config().cc_major * 10 + config().cc_minor;
    if (cc >= 90) return 227 * 1024;
    if (cc == 80 || cc == 87) return 163 * 1024;
    if (cc >= 86) return 99 * 1024;
    if (cc >= 75) return 64 * 1024;
    return 48 * 1024;
}

int launch(const Launch &l) {
    const char *name = l.cpu->name;
    auto refuse = [&](const std::string &why) {
        return fail(1 /* CUDA_ERROR_INVALID_VALUE */, format("cuLaunchKernel(%s): %s", name, why.c_str()));
    };
    // The hardware's launch limits.
    const unsigned *g = l.grid, *bl = l.block;
    if (g[0] == 0 || g[1] == 0 || g[2] == 0 || bl[0] == 0 || bl[1] == 0 || bl[2] == 0) {
        return refuse(format("a zero-sized launch: grid (%u,%u,%u), block (%u,%u,%u)", g[0], g[1], g[2], bl[0], bl[1],
                             bl[2]));
    }
    const unsigned long long threads = (unsigned long long)bl[0] * bl[1] * bl[2];
    if (bl[0] > 1024 || bl[1] > 1024 || bl[2] > 64 || threads > 1024) {
        return refuse(format("block (%u,%u,%u) = %llu threads: at most 1024 threads (x, y ≤ 1024, z ≤ 64)", bl[0],
                             bl[1], bl[2], threads));
    }
    if (l.ptx->max_threads && threads > l.ptx->max_threads) {
        return refuse(format("block of %llu threads above the kernel's __launch_bounds__ of %u", threads,
                             l.ptx->max_threads));
    }
    if (g[0] > 0x7fffffffu || g[1] > 65535 || g[2] > 65535) {
        return refuse(format("grid (%u,%u,%u): gridDim.x ≤ 2^31 - 1, gridDim.y and gridDim.z ≤ 65535", g[0], g[1],
                             g[2]));
    }
    const size_t static_shared = l.ptx->static_shared;
    if (static_shared + l.dynamic_shared > shared_optin_limit()) {
        return refuse(format("%zu bytes of shared memory (%zu static + %zu dynamic): the device has %zu per block",
                             static_shared + l.dynamic_shared, static_shared, l.dynamic_shared,
                             shared_optin_limit()));
    }
    if (l.dynamic_shared > l.max_dynamic_shared) {
        return refuse(format("%zu bytes of dynamic shared memory, above the function's limit of %zu (more than 48 KiB "
                             "needs cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES))",
                             l.dynamic_shared, l.max_dynamic_shared));
    }
    // The parameters: the CPU build's signature equals the PTX's, and every pointer is device memory.
    if (l.cpu->param_count != l.ptx->param_sizes.size()) {
        return refuse(format("the CPU build has %u parameters, the PTX %zu: rebuild the emulator's kernels",
                             l.cpu->param_count, l.ptx->param_sizes.size()));
    }
    unchecked_accesses.store(config().fast, std::memory_order_relaxed);
    Grid grid;
    grid.launch = &l;
    std::vector<Allocation> written;
    for (unsigned i = 0; i < l.cpu->param_count; ++i) {
        if (l.cpu->param_sizes[i] != l.ptx->param_sizes[i]) {
            return refuse(format("parameter %u has %u bytes in the CPU build and %zu in the PTX", i,
                                 l.cpu->param_sizes[i], l.ptx->param_sizes[i]));
        }
        if (!l.params[i]) return refuse(format("parameter %u is a null pointer in kernelParams", i));
        if (!l.cpu->param_is_pointer[i]) continue;
        uintptr_t ptr;
        memcpy(&ptr, l.params[i], sizeof ptr);
        if (ptr == 0) continue;
        Allocation al;
        if (!in_arena(ptr) || !find_live(ptr, &al) || ptr < al.base || ptr > al.base + al.size) {
            return refuse(format("parameter %u (a pointer) is %s", i,
                                 in_arena(ptr) ? describe_address(ptr, 0).c_str() : "not device memory"));
        }
        grid.param_ranges.push_back({al.base, al.base + al.size});
        written.push_back(al);
    }
    if (const int sticky = sticky_error()) {
        return fail(sticky, format("cuLaunchKernel(%s): %s", name, earlier_failure().c_str()));
    }
    count_launch(name);

    grid.blocks = g[0] * g[1] * g[2];
    // The fast mode spreads the blocks over the host's cores (blocks are independent, except through atomics,
    // whose order then varies as on a GPU); the other modes run them one after the other, in order.
    const unsigned helpers =
        config().fast ? (unsigned)std::min<unsigned long long>(grid.blocks, std::max(1, config().threads)) - 1 : 0;
    if (helpers > 0) {
        block_pool().run(grid, helpers);
    } else {
        run_blocks(grid);
    }
    int result = grid.error;
    std::string message = grid.message;
    if (!result) {
        for (const Allocation &al : written) {
            const std::string damage = check_canary(al);
            if (!damage.empty()) {
                message = format("kernel `%s` wrote past the end of a buffer: %s", name, damage.c_str());
                result = 700;
                break;
            }
        }
    }
    if (result) {
        set_sticky_error(result, message);
        return fail(result, message);
    }
    return 0;
}

namespace {

struct sigaction g_previous_segv, g_previous_bus;

void on_fault(int sig, siginfo_t *info, void *context) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    Executor *e = t_exec;
    if (t_in_fault_region && t_block && e) {
        const auto *uc = static_cast<const ucontext_t *>(context);
        const bool write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
        std::string what;
        // A guard page below a stack (a thread may run on another's stack: any of them).
        const bool overflow = std::any_of(e->threads.begin(), e->threads.end(), [&](const Thread &t) {
            return addr >= reinterpret_cast<uintptr_t>(t.stack_lo) - PAGE && addr < reinterpret_cast<uintptr_t>(t.stack_lo);
        });
        if (overflow) {
            what = format("overflows its %zu KiB stack (local arrays too large, or unbounded recursion)",
                          STACK_BYTES / 1024);
        } else if (in_arena(addr)) {
            what = format("%s %s", write ? "writes" : "reads", describe_address(addr, 1).c_str());
        } else {
            what = format("%s 0x%llx, which is not device memory", write ? "writes" : "reads",
                          (unsigned long long)addr);
        }
        Block *b = t_block;
        if (!b->error) {
            b->error = 700;
            b->message = where() + ": " + what;
        }
        siglongjmp(e->fault_return, 1);
    }
    // Not a kernel's fault: whoever handled it before us (Rust's stack-overflow report), or the default.
    struct sigaction *previous = sig == SIGBUS ? &g_previous_bus : &g_previous_segv;
    if (previous->sa_flags & SA_SIGINFO) {
        previous->sa_sigaction(sig, info, context);
    } else if (previous->sa_handler != SIG_IGN && previous->sa_handler != SIG_DFL) {
        previous->sa_handler(sig);
    } else {
        signal(sig, SIG_DFL);
        raise(sig);
    }
}

}  // namespace

void install_fault_handler() {
    static bool installed = false;
    if (installed) return;
    installed = true;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    sigaction(SIGBUS, &sa, &g_previous_bus);
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------------------------
// The kernel-side API (emu_kernel.h).

using emu::t_block;
using emu::t_current;

extern "C" {

const void *cuemu_thread(void) { return t_current->info; }

int cuemu_syncthreads_op(int predicate, int op) {
    emu::Thread *t = t_current;
    emu::Block *b = t_block;
    b->op_predicates[0] += predicate != 0;
    b->op_predicates[1] &= predicate != 0;
    b->op_predicates[2] |= predicate != 0;
    t->block_arrival = b->barrier_generation;
    t->state = emu::State::AtBlockBarrier;
    t->waits_in = "__syncthreads";
    ++b->at_barrier;
    emu::release_block_barrier(*b);
    emu::yield_to_scheduler();
    return op < 0 ? 0 : b->op_results[t->block_arrival & 1][op];
}

void cuemu_syncthreads(void) { cuemu_syncthreads_op(0, -1); }

void cuemu_syncwarp(unsigned mask) { emu::warp_barrier(mask, "__syncwarp"); }

unsigned long long cuemu_shfl(unsigned mask, unsigned long long value, int arg, int width, int kind) {
    emu::Thread *t = t_current;
    static const char *names[4] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync"};
    if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
        emu::kernel_error(719, emu::format("%s with width %d (a power of two up to 32)", names[kind & 3], width));
    }
    const unsigned slot = (t->collectives + 1) & 1;  // the step this call is
    t->exchange[slot] = value;
    emu::warp_barrier(mask, names[kind & 3]);
    const int lane = (int)t->lane, base = lane & ~(width - 1);
    int src = lane;
    switch (kind) {
    case 0: src = base + (arg & (width - 1)); break;
    case 1: src = lane - arg >= base ? lane - arg : lane; break;
    case 2: src = lane + arg < base + width ? lane + arg : lane; break;
    default: src = (lane ^ arg) < base + width ? lane ^ arg : lane; break;
    }
    if (!(mask >> src & 1)) return value;  // undefined in CUDA: the source lane is not in the mask
    const emu::Thread &from = (*t_block->threads)[t->warp * 32 + src];
    return from.exchange[slot];
}

unsigned cuemu_vote(unsigned mask, int predicate, int kind) {
    emu::Thread *t = t_current;
    static const char *names[3] = {"__ballot_sync", "__any_sync", "__all_sync"};
    const unsigned slot = (t->collectives + 1) & 1;
    t->exchange[slot] = predicate != 0;
    emu::warp_barrier(mask, names[kind % 3]);
    unsigned ballot = 0;
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (mask >> lane & 1) ballot |= (unsigned)(*t_block->threads)[t->warp * 32 + lane].exchange[slot] << lane;
    }
    if (kind == 0) return ballot;
    if (kind == 1) return ballot != 0;
    return ballot == mask;
}

unsigned cuemu_activemask(void) {
    // Lanes that have not exited (the emulator runs a warp's lanes one by one: all that still run are "active").
    const emu::Thread *t = t_current;
    unsigned mask = 0;
    const std::vector<emu::Thread> &threads = *t_block->threads;
    const unsigned count = t_block->size;
    for (unsigned lane = 0; lane < 32; ++lane) {
        const unsigned i = t->warp * 32 + lane;
        if (i < count && threads[i].state != emu::State::Done) mask |= 1u << lane;
    }
    return mask;
}

void *cuemu_static_shared(const void *site, size_t size, size_t align) {
    emu::Block *b = t_block;
    for (const auto &s : b->static_sites) {
        if (s.first == site) return reinterpret_cast<void *>(s.second);
    }
    const uintptr_t at = (b->static_next + align - 1) / align * align;
    if (at + size > b->static_limit) {
        emu::kernel_error(719, emu::format("the CPU build's static shared memory (%llu bytes and more) exceeds the "
                                           "PTX's (%llu bytes): rebuild the emulator's kernels",
                                           (unsigned long long)(at + size - b->shared_base),
                                           (unsigned long long)(b->static_limit - b->shared_base)));
    }
    b->static_next = at + size;
    b->static_sites.push_back({site, at});
    return reinterpret_cast<void *>(at);
}

void *cuemu_dynamic_shared(void) { return reinterpret_cast<void *>(t_block->dynamic_base); }

void *cuemu_warp_scratch(void) {
    const emu::Thread *t = t_current;
    return (*t_block->warps)[t->warp].scratch + ((t->collectives + 1) & 1) * emu::WARP_SCRATCH;
}

void cuemu_trap(const char *why) { emu::kernel_error(710 /* CUDA_ERROR_ASSERT */, why); }

long long cuemu_clock64(void) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

// GCC's thread-sanitizer instrumentation (-fsanitize=thread without function entry/exit): every load, store and
// atomic operation of kernel code calls these. Unlike the address sanitizer's, it reports a store after a load of
// the same place too, which the race check needs.
void __tsan_init(void) {}
#define CUEMU_ACCESS_HOOKS(n)                                                                                   \
    void __tsan_read##n(uintptr_t a) { emu::check_access(a, n, false); }                                       \
    void __tsan_write##n(uintptr_t a) { emu::check_access(a, n, true); }                                       \
    void __tsan_unaligned_read##n(uintptr_t a) { emu::check_access(a, n, false); }                             \
    void __tsan_unaligned_write##n(uintptr_t a) { emu::check_access(a, n, true); }                             \
    void __tsan_volatile_read##n(uintptr_t a) { emu::check_access(a, n, false); }                              \
    void __tsan_volatile_write##n(uintptr_t a) { emu::check_access(a, n, true); }
CUEMU_ACCESS_HOOKS(1)
CUEMU_ACCESS_HOOKS(2)
CUEMU_ACCESS_HOOKS(4)
CUEMU_ACCESS_HOOKS(8)
CUEMU_ACCESS_HOOKS(16)
#undef CUEMU_ACCESS_HOOKS
void __tsan_read_range(uintptr_t a, size_t n) { emu::check_access(a, n, false); }
void __tsan_write_range(uintptr_t a, size_t n) { emu::check_access(a, n, true); }
void __tsan_func_entry(void *) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void **, void *) {}
void __tsan_vptr_read(void **) {}
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) {}

// Atomic operations: checked as atomic accesses (not races with each other), then done for real (blocks of
// kernels on other host threads may touch the same memory).
#define CUEMU_ATOMIC_HOOKS(bits, T)                                                                             \
    T __tsan_atomic##bits##_load(const volatile T *a, int) {                                                   \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                           \
    }                                                                                                          \
    void __tsan_atomic##bits##_store(volatile T *a, T v, int) {                                                \
        emu::check_atomic(a, sizeof(T));                                                                       \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                              \
    }                                                                                                          \
    T __tsan_atomic##bits##_exchange(volatile T *a, T v, int) {                                                \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                    \
    }                                                                                                          \
    T __tsan_atomic##bits##_fetch_add(volatile T *a, T v, int) {                                               \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                                     \
    }                                                                                                          \
    T __tsan_atomic##bits##_fetch_sub(volatile T *a, T v, int) {                                               \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                                     \
    }                                                                                                          \
    T __tsan_atomic##bits##_fetch_and(volatile T *a, T v, int) {                                               \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                                     \
    }                                                                                                          \
    T __tsan_atomic##bits##_fetch_or(volatile T *a, T v, int) {                                                \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                                      \
    }                                                                                                          \
    T __tsan_atomic##bits##_fetch_xor(volatile T *a, T v, int) {                                               \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                                     \
    }                                                                                                          \
    T __tsan_atomic##bits##_fetch_nand(volatile T *a, T v, int) {                                              \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                    \
    }                                                                                                          \
    int __tsan_atomic##bits##_compare_exchange_strong(volatile T *a, T *c, T v, int, int) {                    \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                \
    }                                                                                                          \
    int __tsan_atomic##bits##_compare_exchange_weak(volatile T *a, T *c, T v, int, int) {                      \
        emu::check_atomic(a, sizeof(T));                                                                       \
        return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                \
    }                                                                                                          \
    T __tsan_atomic##bits##_compare_exchange_val(volatile T *a, T c, T v, int, int) {                          \
        emu::check_atomic(a, sizeof(T));                                                                       \
        __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                      \
        return c;                                                                                              \
    }
CUEMU_ATOMIC_HOOKS(8, uint8_t)
CUEMU_ATOMIC_HOOKS(16, uint16_t)
CUEMU_ATOMIC_HOOKS(32, uint32_t)
CUEMU_ATOMIC_HOOKS(64, uint64_t)
#undef CUEMU_ATOMIC_HOOKS
}
