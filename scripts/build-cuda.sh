#!/usr/bin/env bash
# Builds candle-qlora with `--features cuda` on a machine without a GPU or a CUDA installation: the CUDA 13.0
# toolkit pieces come from PyPI wheels (nvcc, runtime, headers, cuBLAS, cuRAND, NVRTC), unpacked into a cache
# folder; the driver library (libcuda, which only a GPU machine has) is replaced at link time by a stub with its
# SONAME, so the binaries load the real driver where they run.
#
#   scripts/build-cuda.sh            # the release `qlora`, the integration-test binary and the transfer counter
#                                    # (scripts/count_transfers.c), then how to carry them
#   scripts/build-cuda.sh check      # compile-check only: every kernel to PTX, `cargo clippy --features cuda` (CI)
#   eval "$(scripts/build-cuda.sh env)"  # CUDA_HOME, PATH, … for this shell
#
# CUDA 13.0.x on purpose: the GPU machines' driver (580) runs CUDA 13.0, and the cudarc of Candle 0.11 refuses 13.5.
# The cache is $QLORA_CUDA_HOME, else $XDG_CACHE_HOME/candle-qlora/cuda-13.0, else ~/.cache/candle-qlora/cuda-13.0.
# CUDA_COMPUTE_CAP (default 90: H100/H200) picks the PTX target of the kernels.
set -euo pipefail
mode="${1:-build}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${QLORA_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-qlora/cuda-13.0}"
target="${CARGO_TARGET_DIR:-$root/target}"

# The toolkit for compiling (and checking) the crate; the libraries for linking binaries.
compile_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85)
link_wheels=(nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-cupti==13.0.85)

# Downloads and unpacks `wheels` into the cache (each once).
fetch() {
  mkdir -p "$cache/wheels"
  local missing=()
  for w in "$@"; do
    local name="${w%%==*}" version="${w##*==}"
    if [ ! -e "$cache/unpacked/${name//-/_}-$version" ]; then missing+=("$w"); fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "fetching ${missing[*]}" >&2
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 -d "$cache/wheels" "${missing[@]}"
    for w in "${missing[@]}"; do
      local name="${w%%==*}" version="${w##*==}"
      python3 -m zipfile -e "$(ls "$cache/wheels/${name//-/_}-$version"-*.whl | head -1)" "$cache/toolkit"
      touch "$cache/unpacked/${name//-/_}-$version" 2>/dev/null || { mkdir -p "$cache/unpacked"; touch "$cache/unpacked/${name//-/_}-$version"; }
    done
    chmod +x "$cache/toolkit/nvidia/cu13/bin/"* "$cache/toolkit/nvidia/cu13/nvvm/bin/"* 2>/dev/null || true
  fi
}

# CUDA_HOME and friends for nvcc, Candle's kernels, cudarc and our build script.
setup_env() {
  fetch "${compile_wheels[@]}"
  export CUDA_HOME="$cache/toolkit/nvidia/cu13"
  export CUDA_PATH="$CUDA_HOME" CUDA_ROOT="$CUDA_HOME"
  export PATH="$CUDA_HOME/bin:$PATH"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  export LIBRARY_PATH="$CUDA_HOME/lib:$cache/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
}

# Link-time libraries: the real cuBLAS, cuRAND, NVRTC and runtime under their unversioned names, and a stub of the
# driver (`libcuda.so.1`) defining every `cu*` symbol cudarc references.
setup_link() {
  fetch "${link_wheels[@]}"
  local lib="$CUDA_HOME/lib"
  for so in "$lib"/lib{cublas,cublasLt,curand,nvrtc,cudart}.so.*; do
    [ -e "$so" ] || continue
    local base="${so%%.so.*}.so"
    [ -e "$base" ] || ln -s "$(basename "$so")" "$base"
  done
  mkdir -p "$cache/stubs"
  if [ ! -e "$cache/stubs/libcuda.so" ]; then
    local rlib
    rlib="$(ls -t "$target"/release/deps/libcudarc-*.rlib 2>/dev/null | head -1)"
    if [ -z "$rlib" ]; then
      echo "no cudarc rlib yet: build the library first" >&2
      exit 1
    fi
    nm -u --format=just-symbols "$rlib" 2>/dev/null | grep -E '^cu[A-Z]' | sort -u |
      sed 's/.*/void &(void) {}/' >"$cache/stubs/libcuda.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cache/stubs/libcuda.so" "$cache/stubs/libcuda.c"
    ln -sf libcuda.so "$cache/stubs/libcuda.so.1"
  fi
}

case "$mode" in
  env)
    setup_env >&2
    for v in CUDA_HOME CUDA_PATH CUDA_ROOT PATH CUDA_COMPUTE_CAP LIBRARY_PATH; do
      printf 'export %s=%q\n' "$v" "${!v}"
    done
    ;;
  check)
    setup_env
    cd "$root"
    cargo clippy --features cuda --all-targets -- -D warnings
    ;;
  build)
    setup_env
    cd "$root"
    cargo build --release --features cuda --lib
    setup_link
    cargo build --release --features cuda --bin qlora
    test_bin="$(cargo test --release --features cuda --test integration --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "integration":
        print(m["executable"])' | tail -1)"
    mkdir -p "$root/.gpu"
    # Stripped and xz-compressed (≈ 75 MiB each, mostly PTX, → ≈ 10 MiB): what travels to a GPU machine is small.
    for pair in "$target/release/qlora:qlora" "$test_bin:integration"; do
      strip -o "$root/.gpu/${pair##*:}" "${pair%%:*}"
      xz -T0 -6 -f "$root/.gpu/${pair##*:}"
    done
    cc -shared -fPIC -O2 -Wall -I"$CUDA_HOME/include" scripts/count_transfers.c -o "$root/.gpu/libcount_transfers.so" \
      -L"$CUDA_HOME/lib" -l:libcupti.so.13
    cat <<EOF
built .gpu/qlora.xz, .gpu/integration.xz and .gpu/libcount_transfers.so (CUDA 13.0, PTX for sm_$CUDA_COMPUTE_CAP;
they need driver 580+ / CUDA 13). On the GPU machine, with the repository as the working directory (the tests read
tests/data/):
  xz -dkf .gpu/qlora.xz .gpu/integration.xz
  export LD_LIBRARY_PATH="\$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__))')/cu13/lib:\${LD_LIBRARY_PATH:-}"
  .gpu/integration cuda:: --test-threads 1
  CUDA_INJECTION64_PATH=.gpu/libcount_transfers.so .gpu/qlora train ...   # prints the host<->device copies at exit
Carry the folder .gpu (ignored by git) with the working tree, e.g. the device tool's carry: [".gpu"].
EOF
    ;;
  *)
    echo "usage: scripts/build-cuda.sh [build|check|env]" >&2
    exit 2
    ;;
esac
