#!/usr/bin/env bash
# Builds candle-qlora with `--features cuda` on a machine without a GPU or a CUDA installation, and runs it on the
# emulated CUDA device of tools/cuda-emu. The CUDA toolkit pieces for compiling (nvcc, runtime headers) come from
# PyPI wheels, unpacked into a cache folder; the binaries link against the emulator's libraries, which carry the
# sonames of NVIDIA's (libcuda.so.1, libcublas, libcurand, libnvrtc, libcudart), so where they run they load
# whichever libraries come first: NVIDIA's on a GPU machine, the emulator's under `emulate-env`.
#
#   scripts/build-cuda.sh emulate    # build the emulator and the `cuda` test binary, run the emulator's self-tests
#                                    # and the GPU suite (tests/integration/cuda.rs) on it in the race-check mode;
#                                    # non-zero exit on any failure (CI runs this)
#   eval "$(scripts/build-cuda.sh emulate-env)"  # a shell whose $QLORA_CUDA_BIN (the `cuda` qlora) runs on the
#                                    # emulated device
#   scripts/build-cuda.sh            # the release `qlora`, the integration-test binary and the transfer counter
#                                    # (scripts/count_transfers.c) for a real GPU, then how to carry them
#   scripts/build-cuda.sh check      # compile-check only: every kernel to PTX, `cargo clippy --features cuda`
#   eval "$(scripts/build-cuda.sh env)"  # CUDA_HOME, PATH, … for this shell
#
# CUDA 13.0.x on purpose: it is the oldest toolkit whose compiler (nvcc, cicc) PyPI ships — the CUDA 12 wheels
# (nvidia-cuda-nvcc-cu12 12.0 to 12.9) hold ptxas only — and the cudarc of Candle 0.11 refuses 13.5. Its PTX needs
# NVIDIA driver 580 or later (the binaries check at start and say so). A machine with an older driver builds with a
# CUDA 12 toolkit of its own: QLORA_CUDA_TOOLKIT=/usr/local/cuda-12.x (any 12.x; 12.0 needs driver 525+).
# The cache is $QLORA_CUDA_HOME, else $XDG_CACHE_HOME/candle-qlora/cuda-13.0, else ~/.cache/candle-qlora/cuda-13.0.
# CUDA_COMPUTE_CAP (default 80) picks the PTX target of the kernels, ours and Candle's: compute 8.0 runs on every GPU
# from the A100 on (A10, L4, RTX 30xx/40xx, H100, …: the driver compiles it for the GPU once and caches it). A T4
# (compute 7.5, no bf16 tensor cores) needs its own build, CUDA_COMPUTE_CAP=75, which trains in float16.
set -euo pipefail
mode="${1:-build}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${QLORA_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-qlora/cuda-13.0}"
target="${CARGO_TARGET_DIR:-$root/target}"

# The toolkit for compiling (and checking) the crate; CUPTI for the transfer counter of a real GPU's runs.
compile_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85)
cupti_wheels=(nvidia-cuda-cupti==13.0.85)
emu="$target/cuda-emu"

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
  if [ -n "${QLORA_CUDA_TOOLKIT:-}" ]; then
    export CUDA_HOME="$QLORA_CUDA_TOOLKIT"
  else
    fetch "${compile_wheels[@]}"
    export CUDA_HOME="$cache/toolkit/nvidia/cu13"
  fi
  export CUDA_PATH="$CUDA_HOME" CUDA_ROOT="$CUDA_HOME"
  export PATH="$CUDA_HOME/bin:$PATH"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
}

# The emulated device's libraries, which the binaries link against (they carry NVIDIA's sonames).
setup_link() {
  (cd "$root" && cargo fetch --locked >/dev/null)
  "$root/tools/cuda-emu/build.sh" "$emu"
  export LIBRARY_PATH="$emu/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
}

# The executable of cargo's test target `integration` built with `$@` (cargo's JSON messages name it).
test_binary() {
  cargo test "$@" --features cuda --test integration --no-run --message-format=json |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "integration":
        print(m["executable"])' | tail -1
}

# Runs the emulator's self-tests, then the GPU suite on the emulated device in its race-check mode (every barrier
# interval's threads in reverse order, shared-memory races reported: thread order is the one thing a second run in
# forward order would change). The capacity is small enough that the out-of-memory test fills it in this machine's
# RAM. QLORA_EMULATE_FILTER narrows the suite (a test-name filter).
run_emulated() {
  local bin="$1"
  "$emu/bin/numeric_test"
  "$emu/bin/selftest" "$emu/tests" "$emu/tests/kernels"
  export LD_LIBRARY_PATH="$emu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_EMU_MEMORY="${CUDA_EMU_MEMORY:-6GiB}"
  echo "== the GPU suite on the emulated device (race-check mode)"
  CUDA_EMU_RACECHECK=1 "$bin" "cuda::${QLORA_EMULATE_FILTER:-}" --test-threads 1
}

# The T4 build (compute 7.5, no bf16 tensor cores) compiles too: our kernels for it, to PTX.
check_t4_kernels() {
  for cu in "$root"/kernels/*.cu; do
    nvcc --ptx -std=c++17 --expt-relaxed-constexpr -fmad=false -arch=compute_75 -I"$root/kernels" "$cu" -o /dev/null
  done
}

case "$mode" in
  env)
    setup_env >&2
    for v in CUDA_HOME CUDA_PATH CUDA_ROOT PATH CUDA_COMPUTE_CAP; do
      printf 'export %s=%q\n' "$v" "${!v}"
    done
    ;;
  check)
    setup_env
    cd "$root"
    check_t4_kernels
    cargo clippy --features cuda --all-targets -- -D warnings
    ;;
  emulate)
    setup_env
    check_t4_kernels
    setup_link
    cd "$root"
    # The test build links the `cuda` qlora too (the suite runs it): keep it for `emulate-env`.
    test_bin="$(test_binary)"
    cp "$target/debug/qlora" "$emu/bin/qlora"
    run_emulated "$test_bin"
    ;;
  emulate-env)
    {
      setup_env
      setup_link
      cd "$root"
      cargo build --features cuda --bin qlora
      cp "$target/debug/qlora" "$emu/bin/qlora"
    } >&2
    printf 'export LD_LIBRARY_PATH=%q\n' "$emu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    printf 'export QLORA_CUDA_BIN=%q\n' "$emu/bin/qlora"
    printf 'export CUDA_EMU_MEMORY=%q\n' "${CUDA_EMU_MEMORY:-16GiB}"
    ;;
  build)
    setup_env
    setup_link
    fetch "${cupti_wheels[@]}"
    cd "$root"
    cargo build --release --features cuda --bin qlora
    test_bin="$(test_binary --release)"
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
    echo "usage: scripts/build-cuda.sh [build|check|env|emulate|emulate-env]" >&2
    exit 2
    ;;
esac
