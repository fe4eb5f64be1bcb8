#!/usr/bin/env bash
# Builds the emulated CUDA device into OUT (default target/cuda-emu):
#   OUT/lib/libcuda.so.1, libcublas.so.N, libcublasLt.so.N, libcurand.so.10, libnvrtc.so.N, libcudart.so.N
#       (N = the toolkit's major version), libnccl.so.2, with their unversioned link names;
#   OUT/lib/kernels/*.so   the CPU builds of the kernel modules: ours (kernels/*.cu) and the Candle modules the
#                          crate loads (from the locked candle-kernels in Cargo's registry), each instrumented (every
#                          access checked) and in fast/ without the instrumentation (for CUDA_EMU_FAST=1);
#   OUT/bin/selftest       the emulator's own tests (tests/selftest.cpp), OUT/bin/numeric_test (its numbers) and
#                          OUT/bin/nccl_test (NCCL across processes).
#
#   tools/cuda-emu/build.sh [OUT]
# Needs CUDA_HOME (a toolkit: include/cuda.h, bin/nvcc — scripts/build-cuda.sh sets it up from PyPI) and
# CUDA_COMPUTE_CAP (the PTX target of the kernels, e.g. 80). Programs run on it with OUT/lib first in
# LD_LIBRARY_PATH (scripts/build-cuda.sh emulate-env).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-${CARGO_TARGET_DIR:-$root/target}/cuda-emu}"
: "${CUDA_HOME:?set CUDA_HOME to a CUDA toolkit (scripts/build-cuda.sh env)}"
arch="${CUDA_COMPUTE_CAP:-80}"
arch="${arch//[!0-9]/}"
cxx="${CXX:-g++}"
jobs="${CUDA_EMU_JOBS:-$(nproc)}"

# The toolkit's version, as nvcc reports it ("release 13.0").
version="$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
major="${version%%.*}"
[ -n "$major" ] || { echo "cannot read the CUDA version from $CUDA_HOME/bin/nvcc" >&2; exit 1; }

# Sources of the locked Candle kernels and cudarc bindings, from Cargo's registry.
package_dir() {
  (cd "$root" && cargo metadata --format-version 1 --locked --features cuda 2>/dev/null) |
    python3 -c 'import json,sys,os
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == sys.argv[1]: print(os.path.dirname(p["manifest_path"]))' "$1" | head -1
}
candle_kernels="$(package_dir candle-kernels)"
cudarc="$(package_dir cudarc)"
[ -d "$candle_kernels/src" ] && [ -d "$cudarc/src" ] || { echo "run cargo fetch first" >&2; exit 1; }

mkdir -p "$out/lib/kernels" "$out/bin" "$out/obj"
stamp="$out/obj/config"
echo "cuda $version arch $arch cxx $("$cxx" --version | head -1)" >"$stamp.new"
if ! cmp -s "$stamp.new" "$stamp"; then rm -f "$out"/obj/*.o "$out"/lib/kernels/*.so "$out"/lib/*.so*; fi
mv "$stamp.new" "$stamp"

common=(-std=c++17 -O2 -fPIC -Wall -Wextra -Wno-unused-parameter -I"$here/runtime" -I"$CUDA_HOME/include")

# Compiles $1 to $2 when the source (or a runtime header) is newer; $3: more flags.
compile() {
  if [ ! -e "$2" ] || [ -n "$(find "$1" "$here/runtime" -newer "$2" -name '*.[ch]*' 2>/dev/null | head -1)" ]; then
    "$cxx" "${common[@]}" ${3:-} -c "$1" -o "$2"
  fi
}

# Stubs: a weak definition of every binding cudarc can link; the implemented ones override them.
stubs() { # library status bindings…
  local name="$1" status="$2"
  shift 2
  python3 "$here/stubs.py" "$@" --status "$status" --out "$out/obj/stubs_$name.cpp"
  compile "$out/obj/stubs_$name.cpp" "$out/obj/stubs_$name.o"
}

# libcuda.so.1: the driver and the device.
runtime_objs=()
for src in "$here"/runtime/{state,memory,ptx,launch,driver,module}.cpp; do
  obj="$out/obj/$(basename "${src%.cpp}").o"
  compile "$src" "$obj"
  runtime_objs+=("$obj")
done
stubs driver 801 "$cudarc/src/driver/sys/mod.rs"
"$cxx" -shared -o "$out/lib/libcuda.so.1" -Wl,-soname,libcuda.so.1 "${runtime_objs[@]}" "$out/obj/stubs_driver.o" \
  -ldl -lpthread
ln -sf libcuda.so.1 "$out/lib/libcuda.so"

# The libraries on top of the driver, each linked against it for the device's memory and counters.
library() { # name soname sources…
  local name="$1" soname="$2"
  shift 2
  local objs=("$out/obj/stubs_$name.o")
  for src in "$@"; do
    local obj="$out/obj/$(basename "${src%.cpp}").o"
    # The GEMMs' tiles unroll and vectorize at -O3 (no change to their arithmetic: no fast-math, no contraction).
    compile "$src" "$obj" "$([ "$name" = cublas ] && echo -O3)"
    objs+=("$obj")
  done
  "$cxx" -shared -o "$out/lib/$soname" -Wl,-soname,"$soname" "${objs[@]}" -L"$out/lib" -lcuda -lpthread
  ln -sf "$soname" "$out/lib/${soname%%.so*}.so"
}
stubs cublas 15 "$cudarc/src/cublas/sys/mod.rs"
library cublas "libcublas.so.$major" "$here/runtime/cublas.cpp"
stubs cublasLt 15 "$cudarc/src/cublaslt/sys/mod.rs"
library cublasLt "libcublasLt.so.$major"
stubs curand 999 "$cudarc/src/curand/sys/mod.rs"
library curand libcurand.so.10 "$here/runtime/curand.cpp"
stubs nvrtc 11 "$cudarc/src/nvrtc/sys/mod.rs"
library nvrtc "libnvrtc.so.$major"
stubs cudart 801 "$cudarc/src/runtime/sys/mod.rs"
library cudart "libcudart.so.$major" "$here/runtime/cudart.cpp"
stubs nccl 5 "$cudarc/src/nccl/sys/mod.rs"
library nccl libnccl.so.2 "$here/runtime/nccl.cpp"

# The kernel modules, two at a time per core: ours and Candle's (those the crate loads).
# Each item is SOURCE:OUTPUT.so; a module is rebuilt when its source, its folder's headers or the shim changed.
modules=()
for cu in "$root"/kernels/*.cu; do modules+=("$cu:$out/lib/kernels/qlora_$(basename "${cu%.cu}").so"); done
for m in affine binary cast fill indexing reduce sort ternary unary; do
  modules+=("$candle_kernels/src/$m.cu:$out/lib/kernels/candle_$m.so")
done
build_module() {
  local src="${1%%:*}" so="${1##*:}"
  local inc fast
  inc="$(dirname "$src")"
  fast="$(dirname "$so")/fast/$(basename "$so")"
  if [ ! -e "$so" ] || [ ! -e "$fast" ] ||
    [ -n "$(find "$here/include" "$here/kernelize.py" "$inc" -newer "$so" -type f | head -1)" ]; then
    mkdir -p "$(dirname "$fast")"
    python3 "$here/kernelize.py" "$src" "$so" --arch "$arch" --cuda-version "$version" --cxx "$cxx" \
      --uninstrumented "$fast"
  fi
}
export -f build_module
export out here arch version cxx
printf '%s\n' "${modules[@]}" | xargs -P "$jobs" -I{} bash -c 'build_module "$@"' _ {}

# The emulator's own tests: kernels with planted bugs (PTX from nvcc, CPU builds beside it), run through the
# driver API by tests/selftest.cpp.
mkdir -p "$out/tests/kernels"
"$cxx" "${common[@]}" -o "$out/bin/selftest" "$here/tests/selftest.cpp" -L"$out/lib" -lcuda -Wl,-rpath,"$out/lib"
# NCCL across forked ranks: collectives, a rank that exits, a rank that hangs.
"$cxx" "${common[@]}" -o "$out/bin/nccl_test" "$here/tests/nccl_test.cpp" -L"$out/lib" -l:libnccl.so.2 -lcuda -lpthread \
  -Wl,-rpath,"$out/lib"
# The half-precision types and device math of the shim against references (built as the kernels are: no FMA).
if [ ! -e "$out/bin/numeric_test" ] || [ -n "$(find "$here/include" "$here/tests/numeric_test.cpp" -newer "$out/bin/numeric_test" -type f | head -1)" ]; then
  "$cxx" -std=c++17 -O2 -ffp-contract=off -I"$here/include" "$here/tests/numeric_test.cpp" -o "$out/bin/numeric_test"
fi
for t in "$here"/tests/*.cu; do
  [ -e "$t" ] || continue
  base="$(basename "${t%.cu}")"
  if [ ! -e "$out/tests/$base.ptx" ] || [ "$t" -nt "$out/tests/$base.ptx" ]; then
    "$CUDA_HOME/bin/nvcc" --ptx -std=c++17 -fmad=false -arch="compute_$arch" "$t" -o "$out/tests/$base.ptx"
  fi
  build_module "$t:$out/tests/kernels/$base.so"
done
echo "built the emulated device in $out (CUDA $version, kernels for compute $arch)"
