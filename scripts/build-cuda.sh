#!/usr/bin/env bash
# Builds candle-qlora with `--features cuda` on a machine without a GPU or a CUDA installation, and runs it on the
# emulated CUDA device of tools/cuda-emu (with `--features nccl` there, so the emulated NCCL runs several ranks).
# The CUDA toolkit for compiling (nvcc, headers) is fetched into a cache folder (see below); the binaries link
# against the emulator's libraries, which carry the sonames of NVIDIA's (libcuda.so.1, libcublas, libcurand,
# libnvrtc, libcudart, libnccl), so where they run they load whichever libraries come first: NVIDIA's on a GPU
# machine, the emulator's under `emulate-env`.
#
#   scripts/build-cuda.sh emulate    # build the emulator and the `cuda` test binary, run the emulator's self-tests
#                                    # and the GPU suite (tests/integration/cuda.rs) on it in the race-check mode;
#                                    # non-zero exit on any failure (CI runs this)
#   eval "$(scripts/build-cuda.sh emulate-env)"  # a shell whose $QLORA_CUDA_BIN (the `cuda` qlora) and
#                                    # $QLORA_CUDA_TESTS (the `cuda` integration tests) run on the emulated device
#   scripts/build-cuda.sh            # the release `qlora`, the integration-test binary and the transfer counter
#                                    # (scripts/count_transfers.c) for a real GPU, then how to carry them
#   scripts/build-cuda.sh check      # compile-check only: every kernel to PTX, `cargo clippy --features nccl`
#   eval "$(scripts/build-cuda.sh env)"  # CUDA_HOME, PATH, … for this shell
#
# CUDA 12.4 by default: its PTX (ISA 8.4) runs on NVIDIA driver 550 or later, the branch that cloud GPU images
# (AWS and GCP deep-learning images, Colab, RunPod, Lambda) ship or exceed, and it is the oldest CUDA whose compiler
# is packaged where this project's machines reach: Debian's non-free `nvidia-cuda-toolkit` (nvcc, cicc, ptxas;
# NVIDIA's own binaries, fetched from the pool by a pinned checksum), with the headers of NVIDIA's PyPI wheels and
# Debian's libcu++. PyPI ships no CUDA 12 compiler (nvidia-cuda-nvcc-cu12 holds ptxas only).
# QLORA_CUDA_VERSION=13.0 builds with CUDA 13.0 from PyPI wheels instead (driver 580+; the runtime libraries of
# PyTorch's CUDA 13 wheels). QLORA_CUDA_TOOLKIT=/usr/local/cuda-12.x uses a toolkit of one's own (12.0: driver 525+).
# The binaries check the driver at start against the toolkit that built them and say what to do.
# The cache is $QLORA_CUDA_HOME, else $XDG_CACHE_HOME/candle-qlora/cuda-$QLORA_CUDA_VERSION.
# CUDA_COMPUTE_CAP (default 80) picks the PTX target of the kernels, ours and Candle's: compute 8.0 runs on every GPU
# from the A100 on (A10, L4, RTX 30xx/40xx, H100, …: the driver compiles it for the GPU once and caches it). A T4
# (compute 7.5, no bf16 tensor cores) needs its own build, CUDA_COMPUTE_CAP=75, which trains in float16.
set -euo pipefail
mode="${1:-build}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cuda_version="${QLORA_CUDA_VERSION:-12.4}"
cache="${QLORA_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-qlora/cuda-$cuda_version}"
target="${CARGO_TARGET_DIR:-$root/target}"
emu="$target/cuda-emu"

# The toolkit for compiling (and checking) the crate, and CUPTI for the transfer counter of a real GPU's runs.
case "$cuda_version" in
  12.4)
    compile_wheels=(nvidia-cuda-runtime-cu12==12.4.127 nvidia-cuda-nvcc-cu12==12.4.131)
    # Debian trixie's packages of NVIDIA's CUDA 12.4.1 compiler and of CCCL 2.3.2 (libcu++, CUB, Thrust: the
    # headers CUDA 12.4 ships): pool path, sha256.
    compile_debs=(
      "non-free/n/nvidia-cuda-toolkit/nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319"
      "main/c/cccl/libcu++-dev_2.3.2-2_all.deb 30e911c1909265591b5ea793df0e49e56bed631238b68b3e75c97590c4985686"
      "main/c/cccl/libcub-dev_2.3.2-2_all.deb 4a7e7c24ef2994140e47dba59507db60e281f968f17c18cf1cadc9c27c17c26b"
      "main/c/cccl/libthrust-dev_2.3.2-2_all.deb 61fe44b65834efad9b079452ebec7396d4b37712d251421f4218b3bc652a3147")
    cupti_wheels=(nvidia-cuda-cupti-cu12==12.4.127)
    toolkit="$cache/toolkit-12.4"
    cupti="$cache/toolkit/nvidia/cuda_cupti"
    ;;
  13.0)
    compile_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
      nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85)
    compile_debs=()
    cupti_wheels=(nvidia-cuda-cupti==13.0.85)
    toolkit="$cache/toolkit/nvidia/cu13"
    cupti="$toolkit"
    ;;
  *)
    echo "QLORA_CUDA_VERSION=$cuda_version: this script fetches CUDA 12.4 (the default) or 13.0; for another" \
      "version install its toolkit and set QLORA_CUDA_TOOLKIT to it" >&2
    exit 2
    ;;
esac

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
    chmod +x "$cache/toolkit/nvidia/"*/bin/* "$cache/toolkit/nvidia/"*/nvvm/bin/* 2>/dev/null || true
  fi
}

# Downloads Debian's packages `compile_debs` (checksums checked) and lays out a CUDA 12.4 toolkit in $toolkit the way
# NVIDIA's installer does (bin/, nvvm/, include/), with the wheels' headers; nvcc finds the rest by its nvcc.profile.
fetch_debian_toolkit() {
  [ -e "$toolkit/.complete" ] && return 0
  fetch "${compile_wheels[@]}"
  mkdir -p "$cache/debs"
  rm -rf "$toolkit" && mkdir -p "$toolkit/bin" "$toolkit/nvvm/bin" "$toolkit/nvvm/libdevice" "$toolkit/include"
  local unpacked="$cache/debs/unpacked"
  rm -rf "$unpacked" && mkdir -p "$unpacked"
  for item in "${compile_debs[@]}"; do
    local path="${item%% *}" sum="${item##* }" deb="$cache/debs/$(basename "${item%% *}")"
    if ! echo "$sum  $deb" | sha256sum -c --status 2>/dev/null; then
      echo "fetching $(basename "$path")" >&2
      curl -fsSL --retry 3 -o "$deb" "http://deb.debian.org/debian/pool/$path"
      echo "$sum  $deb" | sha256sum -c --status || { echo "checksum mismatch: $deb (from pool/$path)" >&2; exit 1; }
    fi
    dpkg-deb -x "$deb" "$unpacked"
  done
  local nv="$unpacked/usr/lib/nvidia-cuda-toolkit"
  cp -a "$unpacked"/usr/bin/{bin2c,cudafe++,fatbinary,nvlink,ptxas} "$nv/bin/nvcc" "$nv/bin/crt" "$toolkit/bin/"
  cp -a "$nv/bin/cicc" "$toolkit/nvvm/bin/"
  cp -a "$nv/libdevice/." "$toolkit/nvvm/libdevice/"
  cp -a "$cache/toolkit/nvidia/cuda_runtime/include/." "$cache/toolkit/nvidia/cuda_nvcc/include/." \
    "$unpacked/usr/include/." "$toolkit/include/"
  cat >"$toolkit/bin/nvcc.profile" <<'PROFILE'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
PROFILE
  rm -rf "$unpacked"
  touch "$toolkit/.complete"
}

# CUDA_HOME and friends for nvcc, Candle's kernels, cudarc and our build script.
setup_env() {
  if [ -n "${QLORA_CUDA_TOOLKIT:-}" ]; then
    export CUDA_HOME="$QLORA_CUDA_TOOLKIT"
  elif [ ${#compile_debs[@]} -gt 0 ]; then
    fetch_debian_toolkit
    export CUDA_HOME="$toolkit"
  else
    fetch "${compile_wheels[@]}"
    export CUDA_HOME="$toolkit"
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

# The executable of cargo's test target `integration` built with features $1 and cargo options `${@:2}` (cargo's
# JSON messages name it).
test_binary() {
  cargo test "${@:2}" --features "$1" --test integration --no-run --message-format=json |
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
  "$emu/bin/nccl_test"
  export LD_LIBRARY_PATH="$emu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_EMU_MEMORY="${CUDA_EMU_MEMORY:-6GiB}"
  # A build for an older GPU (CUDA_COMPUTE_CAP=75, a T4) runs on an emulated GPU of that compute capability.
  if [ "$CUDA_COMPUTE_CAP" -lt 80 ]; then
    export CUDA_EMU_COMPUTE_CAP="${CUDA_EMU_COMPUTE_CAP:-${CUDA_COMPUTE_CAP:0:1}.${CUDA_COMPUTE_CAP:1}}"
  fi
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
    cargo clippy --features nccl --all-targets -- -D warnings
    ;;
  emulate)
    setup_env
    check_t4_kernels
    setup_link
    cd "$root"
    # The test build links the `cuda` qlora too (the suite runs it): keep it for `emulate-env`.
    test_bin="$(test_binary nccl)"
    cp "$target/debug/qlora" "$emu/bin/qlora"
    run_emulated "$test_bin"
    ;;
  emulate-env)
    {
      setup_env
      setup_link
      cd "$root"
      # The test build links the `cuda` qlora too.
      test_bin="$(test_binary nccl)"
      cp "$target/debug/qlora" "$emu/bin/qlora"
    } >&2
    printf 'export LD_LIBRARY_PATH=%q\n' "$emu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    printf 'export QLORA_CUDA_BIN=%q\n' "$emu/bin/qlora"
    printf 'export QLORA_CUDA_TESTS=%q\n' "$test_bin"
    printf 'export CUDA_EMU_MEMORY=%q\n' "${CUDA_EMU_MEMORY:-16GiB}"
    ;;
  build)
    setup_env
    setup_link
    fetch "${cupti_wheels[@]}"
    cd "$root"
    cargo build --release --features cuda --bin qlora
    test_bin="$(test_binary cuda --release)"
    mkdir -p "$root/.gpu"
    # Stripped and xz-compressed (≈ 75 MiB each, mostly PTX, → ≈ 10 MiB): what travels to a GPU machine is small.
    for pair in "$target/release/qlora:qlora" "$test_bin:integration"; do
      strip -o "$root/.gpu/${pair##*:}" "${pair%%:*}"
      xz -T0 -6 -f "$root/.gpu/${pair##*:}"
    done
    # The tests run `qlora` at the path cargo built it to: scripts/gpu-check.sh links it there on the GPU machine.
    echo "$target/release/qlora" >"$root/.gpu/qlora.path"
    cc -shared -fPIC -O2 -Wall -I"$cupti/include" -I"$CUDA_HOME/include" scripts/count_transfers.c \
      -o "$root/.gpu/libcount_transfers.so" -L"$cupti/lib" -l:libcupti.so."${cuda_version%%.*}"
    cat <<EOF
built .gpu/qlora.xz, .gpu/integration.xz and .gpu/libcount_transfers.so (CUDA $cuda_version, PTX for sm_$CUDA_COMPUTE_CAP;
they need NVIDIA driver $([ "$cuda_version" = 12.4 ] && echo 550 || echo 580) or later and CUDA ${cuda_version%%.*}'s runtime libraries: cuBLAS, cuRAND, cudart, e.g.
PyTorch's nvidia-* wheels). On the GPU machine, with the repository as the working directory (the tests read
tests/data/):
  xz -dkf .gpu/qlora.xz .gpu/integration.xz
  export LD_LIBRARY_PATH="\$(python3 -c 'import nvidia, glob; print(":".join(p for d in nvidia.__path__ for p in glob.glob(d + "/*/lib")))'):\${LD_LIBRARY_PATH:-}"
  mkdir -p "\$(dirname "\$(cat .gpu/qlora.path)")" && ln -sf "\$PWD/.gpu/qlora" "\$(cat .gpu/qlora.path)"   # the tests run it there
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
