// What the emulated driver reads from a PTX module: its ISA version and target, its kernels (`.entry`) with their
// parameters' sizes, their launch bounds and the static shared memory each uses.
#pragma once

#include <string>
#include <vector>

namespace emu {

struct PtxEntry {
    std::string name;
    std::vector<size_t> param_sizes;  // bytes of each parameter, in order
    unsigned max_threads = 0;         // `.maxntid` (from __launch_bounds__): threads per block at most; 0 = none
    size_t static_shared = 0;         // bytes of `.shared` variables the kernel (or a function it calls) uses
};

struct PtxModule {
    int isa_major = 0, isa_minor = 0;  // `.version`
    int target = 0;                    // `.target sm_XY` → XY (e.g. 80)
    std::vector<PtxEntry> entries;
};

// Reads `text`; false with `error` set when it is not PTX this emulator understands.
bool parse_ptx(const std::string &text, PtxModule *out, std::string *error);

}  // namespace emu
