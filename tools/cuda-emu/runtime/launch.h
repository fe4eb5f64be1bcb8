// Running a kernel on the emulated device: the checks the hardware makes at launch, then every block's threads
// as fibers on the calling host thread (in the fast mode, the blocks spread over a pool of host threads).
#pragma once

#include <string>

#include "ptx.h"

// A kernel as its CPU build describes it (the table kernelize.py appends to each kernel module).
extern "C" struct cuemu_kernel {
    const char *name;
    void (*launch)(void **params);  // calls the kernel with the parameters cuLaunchKernel got
    unsigned param_count;
    const unsigned *param_sizes;
    const unsigned char *param_is_pointer;
};

namespace emu {

struct Launch {
    const cuemu_kernel *cpu;
    const PtxEntry *ptx;
    size_t max_dynamic_shared;  // the function's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    unsigned grid[3], block[3];
    size_t dynamic_shared;
    void **params;
};

// The largest shared memory a block may use with the opt-in attribute, for the emulated compute capability.
size_t shared_optin_limit();
// Without the opt-in attribute.
constexpr size_t SHARED_DEFAULT_LIMIT = 48 * 1024;

// Checks and runs a launch; CUDA_SUCCESS or the error (with a message naming the kernel).
int launch(const Launch &l);

// Installs the handler that turns a fault on a guard page into an error naming the kernel.
void install_fault_handler();

}  // namespace emu
