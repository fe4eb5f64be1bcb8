// The driver API header, for kernel sources: only the version macro, which Candle's cast.cu tests (when
// __CUDA_ARCH__ < 800). It follows the toolkit the kernels are built for (kernelize.py's __CUDACC_VER_*__).
#pragma once
#include "emu_defs.h"

#if defined(__CUDACC_VER_MAJOR__) && defined(__CUDACC_VER_MINOR__)
#define CUDA_VERSION (__CUDACC_VER_MAJOR__ * 1000 + __CUDACC_VER_MINOR__ * 10)
#else
#define CUDA_VERSION 13000
#endif
