// Device memory of the emulated GPU: one reserved arena of address space, so that any address a kernel touches
// can be told apart as "device" (checked) or "host" (the kernel's own stack and globals). Each allocation gets
// pages of its own and ends, 256-byte aligned as cuMemAlloc promises, right before an inaccessible guard page; the
// alignment slack between the bytes asked for and the guard holds canary bytes, checked after every launch that
// could write there. Freed pages become inaccessible again and addresses are never reused, so a use after free
// faults instead of reading someone else's data.

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "emu.h"

namespace emu {
namespace {

constexpr size_t PAGE = 4096;
constexpr size_t ALIGN = 256;
constexpr unsigned char CANARY = 0xCD;
constexpr size_t FREED_REMEMBERED = 1 << 16;
constexpr size_t FILL_LIMIT = size_t(256) << 20;

struct Arena {
    uintptr_t lo = 0, hi = 0, next = 0;
    std::mutex lock;
    std::map<uintptr_t, Allocation> live;   // by span_lo
    std::map<uintptr_t, Allocation> freed;  // by span_lo, the most recent FREED_REMEMBERED
    std::deque<uintptr_t> freed_order;
    uint64_t serial = 0;
    uint64_t used = 0, used_high = 0, cached = 0, reserved_high = 0, threshold = 0;
};

Arena &arena() {
    static Arena *a = new Arena;  // never destroyed: kernels of other threads may still run at exit
    return *a;
}

uint64_t g_free_generation = 0;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// The allocation of `map` whose pages (or guard page) hold `addr`.
const Allocation *lookup(const std::map<uintptr_t, Allocation> &map, uintptr_t addr) {
    auto it = map.upper_bound(addr);
    if (it == map.begin()) return nullptr;
    --it;
    return addr < it->second.span_hi + PAGE ? &it->second : nullptr;
}

const char *kind_name(Kind k) {
    switch (k) {
    case Kind::Device: return "device";
    case Kind::Host: return "pinned host";
    case Kind::Shared: return "shared";
    }
    return "?";
}

}  // namespace

uintptr_t g_lo = 0, g_len = 0;  // the arena, for the hot path of every checked access

void init_memory() {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    if (a.lo) return;
    // 1 TiB of address space, committed page by page as allocations need it.
    for (size_t bytes = size_t(1) << 40; bytes >= (size_t(1) << 34); bytes >>= 1) {
        void *p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p != MAP_FAILED) {
            a.lo = a.next = reinterpret_cast<uintptr_t>(p);
            a.hi = a.lo + bytes;
            g_lo = a.lo;
            g_len = bytes;
            return;
        }
    }
    fail(2, "cannot reserve address space for the emulated device's memory");
}

int allocate(size_t size, Kind kind, uintptr_t *out, const char *api) {
    init_memory();
    Arena &a = arena();
    const size_t rounded = round_up(size, ALIGN);
    const size_t span = round_up(rounded, PAGE);
    std::lock_guard<std::mutex> g(a.lock);
    if (kind == Kind::Device && a.used + rounded > config().capacity) {
        return fail(2 /* CUDA_ERROR_OUT_OF_MEMORY */,
                    format("%s: out of memory: %zu bytes asked, %llu of %llu bytes in use", api, size,
                           (unsigned long long)a.used, (unsigned long long)config().capacity));
    }
    if (a.next + span + PAGE > a.hi) {
        return fail(2, format("%s: the emulated device's address space is exhausted", api));
    }
    Allocation al;
    al.span_lo = a.next;
    al.span_hi = a.next + span;
    al.base = al.span_hi - rounded;
    al.size = size;
    al.kind = kind;
    al.serial = ++a.serial;
    a.next = al.span_hi + PAGE;  // the page after stays inaccessible: the guard
    if (span && mprotect(reinterpret_cast<void *>(al.span_lo), span, PROT_READ | PROT_WRITE) != 0) {
        return fail(2, format("%s: cannot map %zu bytes", api, span));
    }
    // Fresh memory holds garbage on a GPU: make it visible garbage (NaN in every float type) so that a kernel that
    // reads what nobody wrote gives NaN rather than plausible zeros. Huge allocations are left untouched, so that
    // their pages are only committed when used.
    if (kind != Kind::Shared && size <= FILL_LIMIT) memset(reinterpret_cast<void *>(al.base), 0xFF, size);
    memset(reinterpret_cast<void *>(al.base + size), CANARY, rounded - size);
    a.live.emplace(al.span_lo, al);
    if (kind == Kind::Device) {
        a.used += rounded;
        a.cached = a.cached > rounded ? a.cached - rounded : 0;
        if (a.used > a.used_high) a.used_high = a.used;
        if (a.used + a.cached > a.reserved_high) a.reserved_high = a.used + a.cached;
        count_allocation(size);
    }
    *out = al.base;
    return 0;
}

int release(uintptr_t ptr, Kind kind, const char *api) {
    Arena &a = arena();
    Allocation al;
    {
        std::lock_guard<std::mutex> g(a.lock);
        const Allocation *found = lookup(a.live, ptr);
        if (!found || found->base != ptr) {
            const Allocation *old = lookup(a.freed, ptr);
            return fail(1 /* CUDA_ERROR_INVALID_VALUE */,
                        old && old->base == ptr
                            ? format("%s: 0x%llx was already freed (allocation #%llu)", api, (unsigned long long)ptr,
                                     (unsigned long long)old->serial)
                            : format("%s: 0x%llx is not the start of an allocation", api, (unsigned long long)ptr));
        }
        if (found->kind != kind) {
            return fail(1, format("%s: 0x%llx is %s memory", api, (unsigned long long)ptr, kind_name(found->kind)));
        }
        al = *found;
        a.live.erase(al.span_lo);
        a.freed.emplace(al.span_lo, al);
        a.freed_order.push_back(al.span_lo);
        if (a.freed_order.size() > FREED_REMEMBERED) {
            a.freed.erase(a.freed_order.front());
            a.freed_order.pop_front();
        }
        if (kind == Kind::Device) {
            const size_t rounded = round_up(al.size, ALIGN);
            a.used -= rounded;
            a.cached = std::min<uint64_t>(a.cached + rounded, a.threshold);
        }
        __atomic_add_fetch(&g_free_generation, 1, __ATOMIC_RELEASE);
    }
    const std::string damage = check_canary(al);
    // The pages go back to the system and stay reserved, inaccessible.
    if (al.span_hi > al.span_lo) {
        mmap(reinterpret_cast<void *>(al.span_lo), al.span_hi - al.span_lo, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    }
    if (!damage.empty()) return fail(700 /* CUDA_ERROR_ILLEGAL_ADDRESS */, format("%s: %s", api, damage.c_str()));
    return 0;
}

bool find_live(uintptr_t addr, Allocation *out) {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    const Allocation *found = lookup(a.live, addr);
    if (found) *out = *found;
    return found != nullptr;
}

bool find_freed(uintptr_t addr, Allocation *out) {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    const Allocation *found = lookup(a.freed, addr);
    if (found) *out = *found;
    return found != nullptr;
}

std::string describe_address(uintptr_t addr, size_t bytes) {
    Allocation al;
    if (find_live(addr, &al)) {
        const char *what = al.kind == Kind::Shared ? "the block's shared memory" : "allocation";
        if (addr + bytes > al.base + al.size) {
            return format("%zu bytes at byte %lld of %s #%llu (%zu bytes): %lld bytes past its end", bytes,
                          (long long)(addr - al.base), what, (unsigned long long)al.serial, al.size,
                          (long long)(addr + bytes - (al.base + al.size)));
        }
        if (addr < al.base) {
            return format("%zu bytes at %lld bytes before the start of %s #%llu (%zu bytes)", bytes,
                          (long long)(al.base - addr), what, (unsigned long long)al.serial, al.size);
        }
        return format("%zu bytes at byte %lld of %s #%llu (%zu bytes)", bytes, (long long)(addr - al.base), what,
                      (unsigned long long)al.serial, al.size);
    }
    if (find_freed(addr, &al)) {
        return format("%zu bytes at byte %lld of allocation #%llu (%zu bytes), which was freed", bytes,
                      (long long)(addr - al.base), (unsigned long long)al.serial, al.size);
    }
    return format("%zu bytes at 0x%llx, which no allocation holds", bytes, (unsigned long long)addr);
}

std::string check_range(uintptr_t addr, size_t bytes) {
    if (bytes == 0) return "";
    Allocation al;
    if (find_live(addr, &al) && addr >= al.base && addr + bytes <= al.base + al.size && addr + bytes >= addr) {
        return "";
    }
    return describe_address(addr, bytes);
}

std::string check_canary(const Allocation &a) {
    const unsigned char *p = reinterpret_cast<const unsigned char *>(a.base + a.size);
    const size_t slack = round_up(a.size, ALIGN) - a.size;
    for (size_t i = 0; i < slack; ++i) {
        if (p[i] != CANARY) {
            return format("the %zu bytes after the end of allocation #%llu (%zu bytes) were overwritten (byte %zu past "
                          "its end is 0x%02x)",
                          slack, (unsigned long long)a.serial, a.size, i, p[i]);
        }
    }
    return "";
}

uint64_t free_generation() { return __atomic_load_n(&g_free_generation, __ATOMIC_ACQUIRE); }

PoolStats pool_stats() {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    return PoolStats{a.used, a.used + a.cached, a.used_high, a.reserved_high};
}

void reset_pool_high(bool used, bool reserved) {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    if (used) a.used_high = a.used;
    if (reserved) a.reserved_high = a.used + a.cached;
}

uint64_t release_threshold() {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    return a.threshold;
}

void set_release_threshold(uint64_t bytes) {
    Arena &a = arena();
    std::lock_guard<std::mutex> g(a.lock);
    a.threshold = bytes;
    a.cached = std::min(a.cached, bytes);
}

}  // namespace emu
