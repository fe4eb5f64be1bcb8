// cuRAND of the emulated device (libcurand.so.10): what Candle's device creation and random tensors call —
// generators with a seed, an offset and a stream; uniform and normal floats and doubles. Numbers come from a
// Philox-4x32-10 counter stream (value i of a generator is a function of its seed and offset + i), so they are
// reproducible but not the values NVIDIA's default XORWOW generator gives. As cuRAND does, normal fills need an even
// count (CURAND_STATUS_LENGTH_NOT_MULTIPLE otherwise); every output span must lie in one live device allocation.

#include <cmath>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "emu.h"

using namespace emu;

namespace {

enum Status : int {
    SUCCESS = 0,
    NOT_INITIALIZED = 101,
    TYPE_ERROR = 103,
    LENGTH_NOT_MULTIPLE = 105,
    LAUNCH_FAILURE = 201,
};
constexpr int PSEUDO_DEFAULT = 100, PSEUDO_XORWOW = 101, PSEUDO_PHILOX = 161;

struct Generator {
    uint64_t seed = 0;
    uint64_t offset = 0;  // values already drawn (as 32-bit words)
    void *stream = nullptr;
};

std::mutex g_lock;
std::set<const Generator *> g_generators;

int refuse(int status, const char *api, const std::string &why) {
    fail(status, format("%s: %s", api, why.c_str()));
    return status;
}

bool live(const Generator *g) {
    std::lock_guard<std::mutex> hold(g_lock);
    return g_generators.count(g) != 0;
}

// Philox-4x32-10 (Salmon et al., 2011): four 32-bit words of counter `counter` under key `seed`.
void philox(uint64_t counter, uint64_t seed, uint32_t out[4]) {
    uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; round++) {
        const uint64_t p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
        c1 = static_cast<uint32_t>(p1);
        c3 = static_cast<uint32_t>(p0);
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

// Word `i` of the generator's stream.
uint32_t word(const Generator &g, uint64_t i) {
    uint32_t block[4];
    philox(i / 4, g.seed, block);
    return block[i % 4];
}

// Uniform in (0, 1], as cuRAND's floats are.
double uniform(const Generator &g, uint64_t i, bool wide) {
    if (!wide) return (static_cast<double>(word(g, i)) + 1.0) / 4294967296.0;
    const uint64_t bits = (static_cast<uint64_t>(word(g, 2 * i)) << 21) ^ word(g, 2 * i + 1);
    return (static_cast<double>(bits & ((1ull << 53) - 1)) + 1.0) / 9007199254740992.0;
}

// Checks the generator and the output span; the status to return, SUCCESS when the fill may go on.
int prepare(const char *api, Generator *g, void *out, size_t count, size_t element, bool pairs) {
    if (!live(g)) return refuse(NOT_INITIALIZED, api, "not a live curandCreateGenerator generator");
    if (pairs && count % 2)
        return refuse(LENGTH_NOT_MULTIPLE, api, format("%zu values: normal fills need an even count", count));
    if (sticky_error()) return refuse(LAUNCH_FAILURE, api, earlier_failure());
    const std::string bad = check_range(reinterpret_cast<uintptr_t>(out), count * element);
    if (count && !bad.empty()) return refuse(LAUNCH_FAILURE, api, format("output of %zu values: %s", count, bad.c_str()));
    count_launch(std::string("curand:") + api);
    return SUCCESS;
}

template <typename T> int fill_uniform(const char *api, Generator *g, T *out, size_t count) {
    if (int e = prepare(api, g, out, count, sizeof(T), false)) return e;
    const bool wide = sizeof(T) == 8;
    for (size_t i = 0; i < count; i++) out[i] = static_cast<T>(uniform(*g, g->offset + i, wide));
    g->offset += count * (wide ? 2 : 1);
    return SUCCESS;
}

// Box–Muller over pairs of uniforms, as cuRAND's normal generators produce values two at a time.
template <typename T> int fill_normal(const char *api, Generator *g, T *out, size_t count, T mean, T stddev, bool log) {
    if (int e = prepare(api, g, out, count, sizeof(T), true)) return e;
    const bool wide = sizeof(T) == 8;
    for (size_t i = 0; i < count; i += 2) {
        const double u1 = uniform(*g, g->offset + i, wide), u2 = uniform(*g, g->offset + i + 1, wide);
        const double r = std::sqrt(-2.0 * std::log(u1)), theta = 2.0 * M_PI * u2;
        const double z[2] = {r * std::cos(theta), r * std::sin(theta)};
        for (int j = 0; j < 2; j++) {
            const double v = static_cast<double>(mean) + static_cast<double>(stddev) * z[j];
            out[i + j] = static_cast<T>(log ? std::exp(v) : v);
        }
    }
    g->offset += count * (wide ? 2 : 1);
    return SUCCESS;
}

}  // namespace

extern "C" {

int curandCreateGenerator(Generator **generator, int type) {
    if (type != PSEUDO_DEFAULT && type != PSEUDO_XORWOW && type != PSEUDO_PHILOX)
        return refuse(TYPE_ERROR, "curandCreateGenerator",
                      format("generator type %d is not emulated (only the pseudo-random default, XORWOW and Philox)", type));
    auto *g = new Generator();
    std::lock_guard<std::mutex> hold(g_lock);
    g_generators.insert(g);
    *generator = g;
    return SUCCESS;
}

int curandDestroyGenerator(Generator *generator) {
    std::lock_guard<std::mutex> hold(g_lock);
    if (!g_generators.erase(generator)) {
        fail(NOT_INITIALIZED, "curandDestroyGenerator: not a live generator");
        return NOT_INITIALIZED;
    }
    delete generator;
    return SUCCESS;
}

int curandSetPseudoRandomGeneratorSeed(Generator *g, unsigned long long seed) {
    if (!live(g)) return refuse(NOT_INITIALIZED, "curandSetPseudoRandomGeneratorSeed", "not a live generator");
    g->seed = seed;
    g->offset = 0;
    return SUCCESS;
}

int curandSetGeneratorOffset(Generator *g, unsigned long long offset) {
    if (!live(g)) return refuse(NOT_INITIALIZED, "curandSetGeneratorOffset", "not a live generator");
    g->offset = offset;
    return SUCCESS;
}

int curandSetStream(Generator *g, void *stream) {
    if (!live(g)) return refuse(NOT_INITIALIZED, "curandSetStream", "not a live generator");
    if (!valid_stream(stream)) return refuse(NOT_INITIALIZED, "curandSetStream", "not a live stream");
    g->stream = stream;
    return SUCCESS;
}

int curandGenerateUniform(Generator *g, float *out, size_t n) {
    return fill_uniform("curandGenerateUniform", g, out, n);
}
int curandGenerateUniformDouble(Generator *g, double *out, size_t n) {
    return fill_uniform("curandGenerateUniformDouble", g, out, n);
}
int curandGenerateNormal(Generator *g, float *out, size_t n, float mean, float stddev) {
    return fill_normal("curandGenerateNormal", g, out, n, mean, stddev, false);
}
int curandGenerateNormalDouble(Generator *g, double *out, size_t n, double mean, double stddev) {
    return fill_normal("curandGenerateNormalDouble", g, out, n, mean, stddev, false);
}
int curandGenerateLogNormal(Generator *g, float *out, size_t n, float mean, float stddev) {
    return fill_normal("curandGenerateLogNormal", g, out, n, mean, stddev, true);
}
int curandGenerateLogNormalDouble(Generator *g, double *out, size_t n, double mean, double stddev) {
    return fill_normal("curandGenerateLogNormalDouble", g, out, n, mean, stddev, true);
}
int curandGenerate(Generator *g, uint32_t *out, size_t n) {
    if (int e = prepare("curandGenerate", g, out, n, sizeof(uint32_t), false)) return e;
    for (size_t i = 0; i < n; i++) out[i] = word(*g, g->offset + i);
    g->offset += n;
    return SUCCESS;
}

}  // extern "C"
