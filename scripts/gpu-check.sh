#!/usr/bin/env bash
# The GPU check: one command, on a GPU machine that has PyTorch, transformers and PEFT but no Rust and no network,
# that runs the GPU suite and the side-by-side benchmark against transformers + PEFT + bitsandbytes, and writes
# everything to the folder it is given.
#
#   scripts/gpu-check.sh RESULTS [--budget SECONDS] [--work DIR]   # on the GPU machine, from the repository
#   scripts/gpu-check.sh RESULTS --rehearse                         # here: the same stages on the emulated device
#
# What travels (made here by `QLORA_CUDA_VERSION=13.0 scripts/build-cuda.sh` and
# `scripts/bench_gpu.py --prepare-bnb`): .gpu/qlora.xz and .gpu/integration.xz (stripped, xz-compressed), and
# bitsandbytes' Python files with its CUDA 13.0 library in .gpu/site. The binaries load the driver and CUDA 13's
# cuBLAS, cuRAND and runtime from PyTorch's nvidia-* wheels.
#
# Stages, in this order (the most telling first); RESULTS/stages.tsv records each one that finished, and a later
# call skips those, so a second call goes on where the first stopped (the bench keeps every finished run in
# RESULTS/results.jsonl too):
#   preflight     (every call, seconds) the GPU, driver, free memory and disk, the binaries and the libraries they
#                 load, a 2-token generation on the GPU, PyTorch + transformers + PEFT + bitsandbytes on the GPU;
#                 anything off stops the script here with a message naming it
#   suite         the GPU suite: `.gpu/integration cuda::` (the tests that need the SmolLM2 test model skip: it does
#                 not travel)
#   bench-1b      bench_gpu.py: Llama-3.2-1B shape, 1 × 2048, ours against transformers + PEFT + bitsandbytes
#   bench-8b      the same, Llama-3.1-8B shape, 1 × 2048
#   decode-1b     NF4 greedy decoding of 128 tokens, 1B shape, ours against transformers + bitsandbytes
#   trace-8b      one 8B step traced: ours' trace.json (Perfetto) and memory_snapshot.pickle (memory_viz), theirs'
#                 torch.profiler trace of the same step
#   bench-8b-16k  8B shape, 1 × 16384
#   long-8b-64k   ours alone, 8B shape, 1 × 65536 with activation offload and the tiled MLP: one step's peak pool,
#                 pinned host memory and tokens/s beside `qlora estimate`'s figures
#   long-8b-16k   ours alone, 8B shape, 1 × 16384, plain and then offloaded with the tiled MLP: what offload and
#                 tiling cost in tokens/s, and both peaks beside the estimate's
#   fsdp-8b       ours alone, 8B shape, 1 × 2048: plain, activation offload, fsdp on one rank (shards on the GPU, then
#                 offloaded to pinned host memory): tokens/s and each peak beside its estimate
# --stages a,b,…: run only these stages (preflight always runs).
# --budget SECONDS (default 540): a stage starts only when its estimated time (an H100's, below) fits in what is
# left, and runs under a timeout of what is left; the summary says what remains for the next call.
# --rehearse: the emulated device (scripts/build-cuda.sh emulate-env builds it), the tiny shape, the peer on the
# CPU, a few suite tests: every stage and every file of the real run, to find script bugs before a GPU is at hand.
#
# RESULTS ends with summary.md: the device, each stage's result and time, the suite's last lines, the benchmark and
# decoding tables.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

results="" budget=540 rehearse=0 work="" only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) budget="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --stages) only=",$2,"; shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    -h|--help) sed -n '2,44p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) results="$1"; shift ;;
  esac
done
[ -n "$results" ] || { echo "usage: scripts/gpu-check.sh RESULTS [--budget SECONDS] [--work DIR] [--rehearse]" >&2; exit 2; }
mkdir -p "$results" || exit 2
results="$(cd "$results" && pwd)"
work="${work:-${TMPDIR:-/tmp}/gpu-check-work}"
mkdir -p "$work" && work="$(cd "$work" && pwd)" || exit 2
started=$SECONDS
stages="$results/stages.tsv"
touch "$stages"

say() { echo "gpu-check: $*" | tee -a "$results/preflight.txt" >&2; }
fail() { say "STOP: $*"; write_summary; exit 1; }
left() { echo $((budget - (SECONDS - started))); }

# ---------------------------------------------------------------------------------------------------------------
# What runs where: the real GPU, or the emulated device in a rehearsal.
# ---------------------------------------------------------------------------------------------------------------
if [ "$rehearse" = 1 ]; then
  # The emulated device's libraries, `qlora` and the GPU test binary, built for it (debug, with NCCL).
  eval "$("$root/scripts/build-cuda.sh" emulate-env)" || { echo "gpu-check: the emulated device did not build" >&2; exit 1; }
  integration="$QLORA_CUDA_TESTS"
  # The peer must not meet the emulator's libcuda (PyTorch would try it), while ours needs it: a wrapper for each.
  qlora="$work/qlora-emulated" python="$work/python-peer" qlora_bin="$QLORA_CUDA_BIN"
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%q exec %q "$@"\n' "$LD_LIBRARY_PATH" "$QLORA_CUDA_BIN" >"$qlora"
  printf '#!/bin/sh\nunset LD_LIBRARY_PATH\nexec %q "$@"\n' "$(command -v "${QLORA_PYTHON:-python3}")" >"$python"
  chmod +x "$qlora" "$python"
  peer_device=cpu
  suite_filter="${QLORA_CHECK_SUITE_FILTER:-cuda::four_bit_decoding_product}"
  big=tiny small=tiny long_seq=128 longest_seq=256 seq=64 new_tokens=16
else
  for f in qlora integration; do
    if [ ! -x "$root/.gpu/$f" ] || [ "$root/.gpu/$f.xz" -nt "$root/.gpu/$f" ]; then
      [ -f "$root/.gpu/$f.xz" ] || { echo "gpu-check: .gpu/$f.xz is missing: build it with QLORA_CUDA_VERSION=13.0 scripts/build-cuda.sh and carry .gpu" >&2; exit 1; }
      xz -dkf "$root/.gpu/$f.xz" || exit 1
    fi
  done
  qlora="$root/.gpu/qlora" qlora_bin="$root/.gpu/qlora"
  integration="$root/.gpu/integration"
  python="${QLORA_PYTHON:-python3}"
  # CUDA 13's libraries from PyTorch's nvidia-* wheels, and bitsandbytes from .gpu/site.
  nvidia_libs="$("$python" -c 'import nvidia, glob; print(":".join(p for d in nvidia.__path__ for p in sorted(glob.glob(d + "/*/lib"))))' 2>/dev/null)"
  export LD_LIBRARY_PATH="${nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The tests run `qlora` at the path cargo built it to (.gpu/qlora.path).
  if [ -f "$root/.gpu/qlora.path" ]; then
    built="$(cat "$root/.gpu/qlora.path")"
    mkdir -p "$(dirname "$built")" && ln -sf "$root/.gpu/qlora" "$built"
  fi
  export PYTHONPATH="$root/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
  # The driver compiles the kernels' PTX for the GPU at first use: a cache large enough to keep all of them.
  export CUDA_CACHE_MAXSIZE=4294967296
  peer_device=cuda
  suite_filter="${QLORA_CHECK_SUITE_FILTER:-cuda::}"
  big=8b small=1b long_seq=16384 longest_seq=65536 seq=2048 new_tokens=128
fi
export PYTHONUNBUFFERED=1
# The tests read tests/data from the working directory.
cd "$root" || exit 1

# bench_gpu.py with the check's folders, systems and devices.
bench=("$python" "$root/scripts/bench_gpu.py" --work "$work" --results "$results/results.jsonl" --qlora "$qlora"
  --peer-device "$peer_device" --warmup 1)

write_summary() {
  {
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo '```'
    cat "$results/device.txt" 2>/dev/null
    echo '```'
    echo
    echo "| stage | result | seconds |"
    echo "|---|---|---:|"
    awk -F'\t' '{ printf "| %s | %s | %s |\n", $1, $2, $3 }' "$stages"
    echo
    if [ -f "$results/suite.log" ]; then
      echo "GPU suite (last lines):"
      echo '```'
      grep -E "^test result|FAILED|panicked|^failures:|^    cuda::" "$results/suite.log" | tail -25
      echo '```'
      echo
    fi
    [ -f "$results/results.jsonl" ] && "${bench[@]}" --report 2>/dev/null
    if [ -d "$results/trace" ]; then
      echo
      echo "Traces of one step (trace/): $(cd "$results/trace" && ls -s --block-size=K | tail -n +2 | tr '\n' ' ')"
    fi
    echo
    echo "This call: $((SECONDS - started)) s of a $budget s budget."
  } >"$results/summary.md"
}

# ---------------------------------------------------------------------------------------------------------------
# Preflight: everything a stage relies on, each checked in seconds, stopping at the first that is off.
# ---------------------------------------------------------------------------------------------------------------
: >"$results/preflight.txt"
if [ "$rehearse" = 1 ]; then
  echo "emulated CUDA device (tools/cuda-emu), capacity $CUDA_EMU_MEMORY; rehearsal: tiny shapes, the peer on the CPU" >"$results/device.txt"
else
  command -v nvidia-smi >/dev/null || fail "nvidia-smi is not on PATH: is this a GPU machine with NVIDIA's driver?"
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free,compute_cap --format=csv >"$results/device.txt" 2>&1 ||
    fail "nvidia-smi finds no GPU: $(cat "$results/device.txt")"
  read -r driver free_mib < <(nvidia-smi --query-gpu=driver_version,memory.free --format=csv,noheader,nounits | head -1 | tr -d ',')
  [ "${driver%%.*}" -ge 580 ] 2>/dev/null || fail "driver $driver: the CUDA 13.0 build needs driver 580 or later (or build with QLORA_CUDA_VERSION=12.4 for 550+)"
  [ "$free_mib" -ge 40000 ] 2>/dev/null || fail "only $free_mib MiB of GPU memory free: the 8B rows need about 40 GiB; another process holds the GPU?"
fi
{ uname -r; nproc; free -g | sed -n 2p; } >>"$results/device.txt" 2>&1
free_disk_gib=$(df -Pk "$work" | awk 'NR==2 { print int($4 / 1048576) }')
need_disk=$([ "$rehearse" = 1 ] && echo 1 || echo 12)
[ "$free_disk_gib" -ge "$need_disk" ] || fail "$work has $free_disk_gib GiB free; the models need $need_disk GiB (--work elsewhere)"
missing="$(ldd "$qlora_bin" "$integration" 2>&1 | grep "not found" | sort -u)"
if echo "$missing" | grep -q libcuda.so.1; then
  # The driver's library where container images mount it.
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:/usr/lib/x86_64-linux-gnu"
  missing="$(ldd "$qlora_bin" "$integration" 2>&1 | grep "not found" | sort -u)"
fi
[ -z "$missing" ] || fail "libraries not found (LD_LIBRARY_PATH=$LD_LIBRARY_PATH):
$missing"
"$qlora" --version >>"$results/device.txt" 2>&1 || fail "$qlora does not start"
smoke="$(timeout 180 "$qlora" generate --model "$root/tests/data/models/tiny-llama" --device cuda --prompt "hello" \
  --max-new-tokens 2 --ignore-eos 2>&1)" || fail "a 2-token generation on the GPU failed:
$smoke"
say "GPU generation: $(echo "$smoke" | grep -E "^loaded|tokens/s" | tr '\n' ' ')"
peer="$(timeout 180 "$python" - "$peer_device" 2>&1 <<'PY'
import sys
import torch, transformers, peft, bitsandbytes as bnb
device = sys.argv[1]
assert device == "cpu" or torch.cuda.is_available(), "torch sees no GPU"
w = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
codes, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
back = bnb.functional.dequantize_4bit(codes, state)
# NF4's widest gap between codes is 0.28 of a block's absmax: an element is off by at most half of it.
assert (back - w).abs().max().item() <= 0.15 * w.abs().max().item(), "bitsandbytes' NF4 round trip is off"
name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
print(f"peer: torch {torch.__version__} (CUDA {torch.version.cuda}, {name}), transformers {transformers.__version__}, "
      f"peft {peft.__version__}, bitsandbytes {bnb.__version__} NF4 on {device}")
PY
)" || fail "the peer (PyTorch + transformers + PEFT + bitsandbytes on $peer_device) is not ready:
$peer"
say "$peer"
echo "$peer" >>"$results/device.txt"
say "preflight passed in $((SECONDS - started)) s"

# ---------------------------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------------------------

# stage NAME ESTIMATE_SECONDS COMMAND…: runs COMMAND (output to RESULTS/NAME.log) unless NAME finished in an earlier
# call, when its estimate fits in the budget left, under a timeout of what is left.
stage() {
  local name="$1" estimate="$2"
  shift 2
  if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then
    return 0
  fi
  if grep -q "^$name	" "$stages"; then
    echo "gpu-check: $name done in an earlier call" >&2
    return 0
  fi
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt "$estimate" ]; then
    echo "gpu-check: $name needs about $estimate s, $remaining s left: call again to go on" >&2
    deferred+=("$name")
    return 0
  fi
  echo "gpu-check: $name (about $estimate s on an H100; $remaining s left)" >&2
  local t0=$SECONDS rc
  timeout --kill-after=10 "$remaining" "$@" >"$results/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) result
  case $rc in
    0) result="ok" ;;
    124|137) result="stopped at the budget (rc $rc): call again to go on" ;;
    *) result="FAILED (rc $rc): see $name.log" ;;
  esac
  echo "gpu-check: $name: $result, $took s" >&2
  # A stage that ran out of time is not recorded, so the next call runs it again (the bench skips its finished runs).
  if [ $rc -ne 124 ] && [ $rc -ne 137 ]; then
    printf '%s\t%s\t%s\n' "$name" "$result" "$took" >>"$stages"
  fi
  write_summary
}
deferred=()

stage suite 150 "$integration" "$suite_filter" --test-threads 1
stage bench-1b 90 "${bench[@]}" --shape "$small" --batch 1 --seq "$seq" --dropout 0.05 --rounds 1 --steps 3 --loss-steps 0
stage bench-8b 180 "${bench[@]}" --shape "$big" --batch 1 --seq "$seq" --dropout 0.0 --rounds 1 --steps 3 --loss-steps 0
stage decode-1b 60 "${bench[@]}" --shape "$small" --decode --new-tokens "$new_tokens"
stage trace-8b 90 bash -c 'set -e; "$@"; cd "$0/trace" && xz -T0 -f ours-memory_snapshot.pickle theirs-trace.json' \
  "$results" "${bench[@]}" --shape "$big" --batch 1 --seq "$seq" --dropout 0.0 --trace "$results/trace"
stage bench-8b-16k 200 "${bench[@]}" --shape "$big" --batch 1 --seq "$long_seq" --dropout 0.0 --rounds 1 --steps 2 --loss-steps 0
# The long rows: ours alone (theirs would need over 100 GiB at 64k), one step (its first: a 64k step lasts minutes).
long=("${bench[@]}" --shape "$big" --batch 1 --dropout 0.0 --rounds 1 --loss-steps 0 --only ours)
stage long-8b-64k 300 "${long[@]}" --seq "$longest_seq" --warmup 0 --steps 1 --offload --tiled-mlp
stage long-8b-16k 150 bash -c '"$@" && "$@" --offload --tiled-mlp' _ "${long[@]}" --seq "$long_seq" --warmup 1 --steps 1
# One GPU, the 8B shape at 2048 tokens, ours alone: plain, with activation offload (a second stream: what cudarc's
# per-buffer events cost), and with the base sharded by fsdp on one rank (the sharded layers' path), its shards on the
# GPU and then in pinned host memory (copied to the GPU at each use): tokens/s and each peak beside its estimate.
stage fsdp-8b 240 bash -c '"$@" && "$@" --offload && "$@" --fsdp full_shard && "$@" --fsdp offload' _ "${long[@]}" \
  --seq "$seq" --warmup 1 --steps 2

write_summary
if [ ${#deferred[@]} -gt 0 ]; then
  echo "gpu-check: left for the next call: ${deferred[*]}" | tee -a "$results/summary.md" >&2
fi
cat "$results/summary.md"
