#!/usr/bin/env python3
"""GPU side by side: candle-qlora (`.gpu/qlora train`) against transformers + PEFT + bitsandbytes, same model, same
settings, same token ids, on one GPU.

Rows (each system in a fresh process, systems alternating, over --rounds rounds):

    shape  micro-batch       LoRA dropout
    8b     1 x 2048          0 and 0.05
    8b     4 x 512           0.05
    8b     1 x 16384         0
    1b     1 x 2048          0.05
    1b     4 x 512           0.05

Common settings: Llama-3.1-8B shape (hidden 4096, 32 layers, MLP 14336, 32/8 heads, vocab 128256) or Llama-3.2-1B
shape (hidden 2048, 16 layers, MLP 8192, 32/8 heads, tied embeddings), random weights (std 0.02, seed 0) whose block
linears bitsandbytes quantizes once to NF4 with double quantization, saved as the folder transformers writes for such
a model, which both systems load (so both train the very same base weights); bf16 compute; LoRA r = 16, alpha = 16,
every linear layer of the blocks; gradient checkpointing (non-reentrant on theirs); paged_adamw_8bit, lr 1e-4
constant, weight decay 0; gradient clipping at 1.0; one micro-batch per step; every token a label. Theirs:
`attn_implementation="sdpa"` and the QLoRA recipe (`prepare_model_for_kbit_training`, which keeps norms, embeddings
and head in float32; pass --peer-no-prepare to skip it), a plain loop under `torch.autocast(bfloat16)`,
`bitsandbytes.optim.PagedAdamW8bit`.

Measured: tokens/s = median over the steps after --warmup of tokens / seconds of one optimizer step (ours:
`step_seconds` of log.jsonl — one read from the GPU per step, so a step's time includes the previous step's queued
work; theirs: `loss.item()` each step, the same single synchronization); peak GPU memory: ours the memory pool's
high-water mark of allocations (memory_timeline.json), theirs `torch.cuda.max_memory_allocated()` (and reserved);
MFU = 6 · N · tokens/s / 989 TFLOP/s (H100 SXM bf16 dense), N = the parameters every token passes through (all
linear weights of the blocks and the head; embeddings excluded; attention's own FLOPs not counted). Correctness:
the first losses of both systems with learning rate 0 on the same ids (the LoRA A matrices start random and
differently in each system, so only a frozen adapter compares step for step) agree within bf16 noise (--loss-tol,
relative); with --loss-steps 0, step 1 of the timed runs instead (taken before any update: both systems' LoRA B
start at zero, so both compute the base model's loss).

Other modes: --decode times NF4 greedy decoding (`qlora generate` against transformers + bitsandbytes `generate`,
the same 32 prompt ids, exactly --new-tokens tokens); --trace DIR traces step 2 of a 3-step run of each system
(ours: trace.json and memory_snapshot.pickle; theirs: torch.profiler's chrome trace).
--offload and --tiled-mlp run ours with activation_offloading and tiled_mlp, --fsdp ours with its base sharded (one
rank: the sharded layers' path, and with `offload` their shares copied from pinned host memory at each use) (rows of
their own, with --only ours: theirs has no such settings); ours' rows also record the run's estimate and pinned host memory beside its peak.

Results accumulate in WORK/results.jsonl, or --results (a run already there is not repeated), so the benchmark can
go on over several invocations; --report prints the tables from what is there. scripts/gpu-check.sh runs the rows
of a first GPU check through this script.

    QLORA_CUDA_VERSION=13.0 scripts/build-cuda.sh && scripts/bench_gpu.py --prepare-bnb   # here: .gpu/ (CUDA 13)
    # on the GPU machine, from the repository (carry .gpu):
    PYTHONPATH=.gpu/site python3 scripts/bench_gpu.py --work /tmp/bench_gpu
    # a dry run of the script on the CPU (ours built without the cuda feature):
    python3 scripts/bench_gpu.py --device cpu --shape tiny --seq 64 --qlora target/release/qlora --work /tmp/b
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import OURS_GENERATE_LINE  # noqa: E402
from bench_vs_peft import run_child, toml_str  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
LORA = {"r": 16, "lora_alpha": 16, "target_modules": "all-linear"}
PEAK_FLOPS = 989e12
BNB_WHEEL = "bitsandbytes==0.50.2"

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # For checking this script on a CPU (--device cpu): a few MiB.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
ROWS = [("8b", 1, 2048, 0.0), ("8b", 1, 2048, 0.05), ("8b", 4, 512, 0.05), ("8b", 1, 16384, 0.0),
        ("1b", 1, 2048, 0.05), ("1b", 4, 512, 0.05)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_gpu"), help="models, data and results")
    p.add_argument("--qlora", type=Path, default=ROOT / ".gpu" / "qlora", help="our CUDA binary")
    p.add_argument("--rows", default="all", help="comma-separated row indices (0-based) or 'all'")
    p.add_argument("--shape", help="run this shape only (8b, 1b, tiny), with --batch/--seq/--dropout")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--loss-steps", type=int, default=5,
                   help="steps of the learning-rate-0 loss check (0: compare the first step of the timed runs, "
                        "which is taken before any update, instead)")
    p.add_argument("--loss-tol", type=float, default=2e-2, help="relative tolerance of the loss check")
    p.add_argument("--only", default="ours,theirs", help="systems to run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script only")
    p.add_argument("--peer-device", choices=["cuda", "cpu"],
                   help="where theirs runs (default: --device; cpu with ours on the emulated GPU rehearses the script)")
    p.add_argument("--results", type=Path, help="the results file (default WORK/results.jsonl)")
    p.add_argument("--decode", action="store_true",
                   help="time NF4 greedy decoding of --shape (both systems) instead of training steps")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each --decode run generates")
    p.add_argument("--trace", type=Path,
                   help="one run of each system on --shape with a profile of step 2: ours' trace.json and "
                        "memory_snapshot.pickle, theirs' torch.profiler chrome trace, into this folder")
    p.add_argument("--peer-no-prepare", action="store_true", help="theirs without prepare_model_for_kbit_training")
    p.add_argument("--offload", action="store_true",
                   help="ours with activation_offloading (a row of its own; theirs has no such setting: --only ours)")
    p.add_argument("--tiled-mlp", action="store_true", help="ours with tiled_mlp (a row of its own, as --offload)")
    p.add_argument("--fsdp", choices=["full_shard", "offload"],
                   help="ours with fsdp = \"full_shard\" (offload: its shards in pinned host memory) on one GPU, "
                        "a row of its own as --offload")
    p.add_argument("--report", action="store_true", help="print the table of WORK/results.jsonl and stop")
    p.add_argument("--prepare-bnb", action="store_true",
                   help=f"(here, with network) put {BNB_WHEEL} trimmed to its CUDA 13.0 library in .gpu/site")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args()


# ----------------------------------------------------------------------------------------------------------------
# Carry: bitsandbytes for the GPU machine (it has torch, transformers and PEFT but not bitsandbytes)
# ----------------------------------------------------------------------------------------------------------------


def prepare_bnb() -> None:
    """Downloads the bitsandbytes wheel and unpacks its Python files and the CUDA 13.0 library into .gpu/site."""
    import tempfile

    site = ROOT / ".gpu" / "site"
    shutil.rmtree(site / "bitsandbytes", ignore_errors=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--platform", "manylinux_2_24_x86_64", "-d", wheels, BNB_WHEEL],
                       check=True)
        with zipfile.ZipFile(next(Path(wheels).glob("bitsandbytes-*.whl"))) as z:
            for name in z.namelist():
                if name.startswith("bitsandbytes/") and (
                        not name.endswith(".so") or name.endswith(("_cuda130.so", "_cpu.so"))):
                    z.extract(name, site)
    size = sum(f.stat().st_size for f in (site / "bitsandbytes").rglob("*") if f.is_file())
    print(f"bitsandbytes in .gpu/site ({size / 2**20:.1f} MiB); on the GPU machine: PYTHONPATH=.gpu/site")


# ----------------------------------------------------------------------------------------------------------------
# The model and the data (made once per shape and length, in WORK)
# ----------------------------------------------------------------------------------------------------------------


def model_dir(work: Path, shape: str) -> Path:
    return work / f"model-{shape}-nf4"


def make_model(shape: str, work: Path, device: str) -> None:
    """Random weights (std 0.02, seed 0), the blocks' linear layers quantized by bitsandbytes (NF4, double quant,
    blocksize 64, bf16 compute) and written as transformers saves a model loaded with that BitsAndBytesConfig (each
    weight's packed codes with its quant state beside it), with a word-level tokenizer (`w0` … `w<vocab-1>`, split
    on whitespace). Made on `device` and quantized there, without a dense copy on disk (16 GB for the 8B shape)."""
    import bitsandbytes as bnb
    import torch
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    out = model_dir(work, shape)
    if (out / "config.json").exists():
        return
    # Llama-3.1's context (the long-sequence rows need it; RoPE without scaling: the positions' cost is the same).
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         initializer_range=0.02, torch_dtype="bfloat16")
    torch.manual_seed(SEED)
    # Made in bf16 directly: an 8B model in float32 first would take 32 GB.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    tensors = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module = name.rsplit(".", 1)[0]
        # transformers quantizes every nn.Linear but the output head (its modules_to_not_convert).
        if (name.endswith(".weight") and module != "lm_head"
                and isinstance(model.get_submodule(module), torch.nn.Linear)):
            codes, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True,
                                                        quant_type="nf4")
            tensors[name] = codes.cpu()
            tensors.update({f"{name}.{k}": v.cpu() for k, v in state.as_dict(packed=True).items()})
        else:
            tensors[name] = weight.detach().cpu().contiguous()
    del model
    tmp = out.with_suffix(".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    (tmp / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": quant.to_dict()},
                                                indent=2, default=str))
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}
    (tmp / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tmp.rename(out)


def data_file(work: Path, shape: str, batch: int, seq: int, steps: int) -> Path:
    """`steps · batch` rows of `seq` random ids as text (`{"text": "w17 w3 …"}`), the same for both systems."""
    path = work / f"data-{shape}-{batch}x{seq}-{steps}.jsonl"
    if not path.exists():
        rng = random.Random(SEED)
        vocab = SHAPES[shape]["vocab_size"]
        lines = [json.dumps({"text": " ".join(f"w{rng.randrange(vocab)}" for _ in range(seq))})
                 for _ in range(steps * batch)]
        path.write_text("\n".join(lines) + "\n")
    return path


def read_ids(path: Path) -> list[list[int]]:
    return [[int(w[1:]) for w in json.loads(line)["text"].split()] for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------------------
# One run of each system
# ----------------------------------------------------------------------------------------------------------------


def ours_config(spec: dict, data: Path, out: Path) -> str:
    return f"""\
[model]
name_or_path = {toml_str(spec["model"])}

[model.quantization]
load_in_4bit = true
bnb_4bit_quant_type = "nf4"
bnb_4bit_use_double_quant = true
bnb_4bit_compute_dtype = "bfloat16"

[lora]
r = {LORA["r"]}
lora_alpha = {LORA["lora_alpha"]}
lora_dropout = {spec["dropout"]}
target_modules = {toml_str(LORA["target_modules"])}

[data]
train_file = {toml_str(str(data))}
format = "text"
max_length = {spec["seq"]}
packing = false

[training]
output_dir = {toml_str(str(out))}
overwrite_output_dir = true
use_cpu = {str(spec["device"] == "cpu").lower()}
bf16 = {str(spec["device"] == "cuda").lower()}
{spec.get("extra_training", "")}
per_device_train_batch_size = {spec["batch"]}
gradient_accumulation_steps = 1
learning_rate = {spec["lr"]}
max_steps = {spec["steps"]}
lr_scheduler_type = "constant"
warmup_steps = 0
optim = "paged_adamw_8bit"
weight_decay = 0.0
max_grad_norm = {MAX_GRAD_NORM}
gradient_checkpointing = true
train_sampling_strategy = "sequential"
logging_steps = 1
save_strategy = "no"
eval_strategy = "no"
seed = {SEED}
"""


def run_ours(qlora: Path, spec: dict, work: Path) -> dict | None:
    """One `qlora train` run; with `spec["trace"]`, its trace.json and memory_snapshot.pickle are copied there."""
    run_dir = work / "runs" / f"ours-{spec['key']}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "config.toml"
    cfg.write_text(ours_config(spec, Path(spec["data"]), run_dir / "out"))
    child = run_child([str(qlora), "train", "--config", str(cfg)])
    log = run_dir / "out" / "log.jsonl"
    if child.returncode != 0 or not log.exists():
        print(f"ours: `qlora train` failed (exit code {child.returncode})", file=sys.stderr)
        return None
    entries = sorted((e for e in map(json.loads, log.read_text().splitlines()) if "loss" in e),
                     key=lambda e: e["step"])
    timeline = json.loads((run_dir / "out" / "memory_timeline.json").read_text())
    peak = max((s.get("peak", 0) for s in timeline.get("samples", [])), default=0)
    estimate = (timeline.get("estimate") or {}).get("prediction") or {}
    if spec.get("trace"):
        for name in ("trace.json", "memory_snapshot.pickle"):
            shutil.copy(run_dir / "out" / name, Path(spec["trace"]) / f"ours-{name}")
    return {"step_seconds": [e["step_seconds"] for e in entries], "tokens": [e["tokens"] for e in entries],
            "losses": [e["loss"] for e in entries], "peak_allocated": peak, "peak_reserved": None,
            "source": timeline.get("source"), "host_pinned": timeline.get("host_pinned_bytes", 0),
            "estimate": estimate.get("total_bytes"), "estimate_host": estimate.get("host_bytes")}


def theirs_worker(spec: dict) -> dict:
    """transformers + PEFT + bitsandbytes: the QLoRA recipe in a plain loop."""
    import torch
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    cuda = spec["peer_device"] == "cuda"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 device_map={"": 0 if cuda else "cpu"})
    model.config.use_cache = False
    ckpt = {"use_reentrant": False}
    if spec["peer_prepare"]:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs=ckpt)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=spec["dropout"], **LORA))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = (bnb.optim.PagedAdamW8bit(params, lr=spec["lr"], weight_decay=0.0) if cuda
                 else torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0))
    ids = torch.tensor(read_ids(Path(spec["data"])), dtype=torch.long)
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batch, step_seconds, losses, tokens = spec["batch"], [], [], []
    for step in range(spec["steps"]):
        input_ids = ids[step * batch:(step + 1) * batch].to(device)
        # With spec["trace"], step 2 runs under torch.profiler (as ours traces step 2), written as a chrome trace.
        profiler = None
        if spec.get("trace") and step == 1:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda
                                                                  else [])
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_seconds.append(time.perf_counter() - t)
        if profiler is not None:
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(str(Path(spec["trace"]) / "theirs-trace.json"))
        tokens.append(int(input_ids.numel()))
        print(f"theirs step {step + 1}/{spec['steps']}: loss {losses[-1]:.4f}, {step_seconds[-1]:.3f} s",
              file=sys.stderr)
    return {"step_seconds": step_seconds, "tokens": tokens, "losses": losses,
            "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None, "source": "torch"}


def run_theirs(spec: dict, work: Path) -> dict | None:
    spec_path = work / "runs" / f"theirs-{spec['key']}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    worker = "decode" if spec.get("new_tokens") else "theirs"
    child = run_child([sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--spec", str(spec_path)])
    result = spec_path.with_suffix(".result.json")
    if child.returncode != 0 or not result.exists():
        print(f"theirs: worker failed (exit code {child.returncode})", file=sys.stderr)
        return None
    return json.loads(result.read_text())


# ----------------------------------------------------------------------------------------------------------------
# Decoding: greedy NF4 generation of the same prompt ids, exactly --new-tokens tokens
# ----------------------------------------------------------------------------------------------------------------

def decode_prompt(shape: str) -> str:
    rng = random.Random(SEED + 1)
    return " ".join(f"w{rng.randrange(SHAPES[shape]['vocab_size'])}" for _ in range(32))


def decode_ours(qlora: Path, spec: dict) -> dict | None:
    """`qlora generate` on the bitsandbytes folder (NF4 as stored, bf16 compute on the GPU): one warm-up process of
    2 tokens (the driver compiles and caches the kernels' PTX), then the timed one. tokens/s is the line it prints,
    timed around its generation call (prompt included, loading excluded)."""
    def generate(n: int) -> subprocess.CompletedProcess:
        return subprocess.run([str(qlora), "generate", "--model", spec["model"], "--device", spec["device"],
                               "--prompt", spec["prompt"], "--max-new-tokens", str(n), "--ignore-eos"],
                              capture_output=True, text=True)
    generate(2)
    p = generate(spec["new_tokens"])
    sys.stderr.write(p.stderr[-2000:])
    m = OURS_GENERATE_LINE.search(p.stderr)
    if p.returncode != 0 or not m:
        print(f"ours: `qlora generate` failed (exit code {p.returncode})", file=sys.stderr)
        return None
    ids = [int(w[1:]) for w in p.stdout.split() if w.startswith("w") and w[1:].isdigit()]
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)), "tokens_per_s": float(m.group(3)),
            "new_ids": ids}


def decode_theirs_worker(spec: dict) -> dict:
    """transformers + bitsandbytes: the same folder, bf16 compute, SDPA, KV cache; a warm-up call of 2 tokens, then
    `generate` timed with the device synchronized."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = spec["peer_device"] == "cuda"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 device_map={"": 0 if cuda else "cpu"}).eval()
    gen = model.generation_config
    gen.eos_token_id = None
    gen.pad_token_id = 0
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    ids = torch.tensor([[int(w[1:]) for w in spec["prompt"].split()]], device=model.device)

    def run(n: int):
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, use_cache=True)
        if cuda:
            torch.cuda.synchronize()
        return out

    run(2)
    start = time.perf_counter()
    out = run(spec["new_tokens"])
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return {"tokens": len(new), "seconds": seconds, "tokens_per_s": len(new) / seconds, "new_ids": new}


# ----------------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------------


def params_touched(shape: str) -> int:
    s = SHAPES[shape]
    h, i, v, layers = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    return layers * (2 * h * h + 2 * h * kv + 3 * h * i) + v * h


def tokens_per_second(r: dict, warmup: int) -> float | None:
    """The median over the steps after the run's warm-up (the one it was run with, else `warmup`)."""
    timed = list(zip(r["tokens"], r["step_seconds"]))[r.get("warmup", warmup):]
    return statistics.median(t / s for t, s in timed) if timed else None


def fmt(x, spec=".0f") -> str:
    return format(x, spec) if x is not None else "—"


def losses_agree(ours: list[float] | None, theirs: list[float] | None, loss_tol: float) -> str:
    if not ours or not theirs:
        return "not run"
    worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(ours, theirs))
    return f"{'agree' if worst <= loss_tol else 'DIFFER'} (max rel. diff {worst:.1e})"


def report(path: Path, warmup: int, loss_tol: float) -> None:
    results = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rows: dict[str, dict] = {}
    decodes: dict[str, dict] = {}
    for r in results:
        if r["kind"] == "decode":
            decodes.setdefault(r["row"], {})[r["system"]] = r["result"]
            continue
        row = rows.setdefault(r["row"], {"ours": [], "theirs": [], "loss": {}, "first": {}})
        if r["kind"] == "loss":
            row["loss"][r["system"]] = r["result"]["losses"] if r["result"] else None
        elif r["kind"] == "speed" and r["result"]:
            row[r["system"]].append(r["result"])
            row["first"].setdefault(r["system"], r["result"]["losses"][:1])
    print("| shape | batch x seq | dropout | ours tokens/s | theirs tokens/s | speed ratio | ours peak GiB | "
          "theirs peak GiB (reserved) | memory ratio | ours MFU | theirs MFU | losses |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, row in rows.items():
        shape, bxs, dropout, *variant = key.split("/")
        if variant:
            dropout += f" ({', '.join(variant)})"
        speed = {s: statistics.median(v) if (v := [tokens_per_second(r, warmup) for r in row[s]]) else None
                 for s in ("ours", "theirs")}
        peak = {s: max((r["peak_allocated"] or 0 for r in row[s]), default=0) / 2**30 for s in ("ours", "theirs")}
        reserved = max((r["peak_reserved"] or 0 for r in row["theirs"]), default=0) / 2**30
        mfu = {s: 6 * params_touched(shape) * speed[s] / PEAK_FLOPS if speed[s] else None for s in speed}
        # The learning-rate-0 runs when there are any, else step 1 of the timed runs (before any update, the LoRA
        # B matrices are zero, so both systems compute the base model's loss whatever their random A).
        if row["loss"]:
            losses = "lr 0: " + losses_agree(row["loss"].get("ours"), row["loss"].get("theirs"), loss_tol)
        else:
            losses = "step 1: " + losses_agree(row["first"].get("ours"), row["first"].get("theirs"), loss_tol)
        ratio = speed["ours"] / speed["theirs"] if speed["ours"] and speed["theirs"] else None
        mem_ratio = peak["ours"] / peak["theirs"] if peak["ours"] and peak["theirs"] else None
        print(f"| {shape} | {bxs} | {dropout} | {fmt(speed['ours'])} | {fmt(speed['theirs'])} | {fmt(ratio, '.2f')}× | "
              f"{fmt(peak['ours'], '.2f')} | {fmt(peak['theirs'], '.2f')} ({fmt(reserved, '.2f')}) | "
              f"{fmt(mem_ratio, '.2f')}× | {fmt(mfu['ours'], '.1%')} | {fmt(mfu['theirs'], '.1%')} | {losses} |")
    planned = [(key, r) for key, row in rows.items() for r in row["ours"][:1] if r.get("estimate")]
    if planned:
        print("\n| ours: row | measured peak GiB | estimate GiB | measured / estimate | pinned host GiB "
              "(estimate) |")
        print("|---|---:|---:|---:|---:|")
        for key, r in planned:
            pinned, est_host = r.get("host_pinned") or 0, r.get("estimate_host") or 0
            print(f"| {key} | {r['peak_allocated'] / 2**30:.2f} | {r['estimate'] / 2**30:.2f} | "
                  f"{r['peak_allocated'] / r['estimate']:.3f} | {pinned / 2**30:.2f} ({est_host / 2**30:.2f}) |")
    print(f"\ntokens/s: median over rounds of the median step after {warmup} warmup steps; MFU: 6 · N · tokens/s / "
          f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s, N = block linears + head")
    if decodes:
        print("\n| shape | new tokens | ours tokens/s | theirs tokens/s | ratio | same greedy tokens |")
        print("|---|---:|---:|---:|---:|---|")
        for key, d in decodes.items():
            ours, theirs = d.get("ours"), d.get("theirs")
            o = ours["tokens_per_s"] if ours else None
            t = theirs["tokens_per_s"] if theirs else None
            same = "—"
            if ours and theirs:
                prefix = next((i for i, (a, b) in enumerate(zip(ours["new_ids"], theirs["new_ids"])) if a != b),
                              min(len(ours["new_ids"]), len(theirs["new_ids"])))
                same = f"first {prefix} of {len(theirs['new_ids'])}"
            print(f"| {key} | {(ours or theirs or {}).get('tokens', '—')} | {fmt(o, '.1f')} | {fmt(t, '.1f')} | "
                  f"{fmt(o / t if o and t else None, '.2f')}× | {same} |")
        print("\ndecoding: greedy, NF4 (double quantization) as bitsandbytes stored it, bf16 compute, KV cache, the "
              "same 32 prompt ids; tokens/s of one timed call after a warm-up (prompt included, loading excluded)")
    print(f"\n{len(results)} runs in {path}")


# ----------------------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = decode_theirs_worker(spec) if args.worker == "decode" else theirs_worker(spec)
        Path(args.spec).with_suffix(".result.json").write_text(json.dumps(result))
        return
    if args.prepare_bnb:
        prepare_bnb()
        return
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    done_path = args.results or work / "results.jsonl"
    if args.report:
        report(done_path, args.warmup, args.loss_tol)
        return
    rows = ([(args.shape, args.batch, args.seq, args.dropout)] if args.shape else
            ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")])
    systems = args.only.split(",")
    done = {(r["row"], r["system"], r["kind"], r["round"])
            for r in map(json.loads, done_path.read_text().splitlines())} if done_path.exists() else set()

    def record(row_key: str, system: str, kind: str, rnd: int, result: dict | None) -> None:
        if result is not None and kind == "speed":
            result["warmup"] = args.warmup
        with done_path.open("a") as f:
            f.write(json.dumps({"row": row_key, "system": system, "kind": kind, "round": rnd, "result": result})
                    + "\n")

    def run(row_key: str, system: str, kind: str, rnd: int, spec: dict) -> None:
        if (row_key, system, kind, rnd) in done:
            return
        print(f"--- {system}, {kind} run {rnd} ({row_key})", file=sys.stderr, flush=True)
        if kind == "decode":
            result = decode_ours(args.qlora, spec) if system == "ours" else run_theirs(spec, work)
        else:
            result = run_ours(args.qlora, spec, work) if system == "ours" else run_theirs(spec, work)
        record(row_key, system, kind, rnd, result)

    for shape, batch, seq, dropout in rows:
        print(f"\n=== {shape} {batch} x {seq}, dropout {dropout} ===", file=sys.stderr, flush=True)
        t = time.perf_counter()
        make_model(shape, work, args.peer_device or args.device)
        print(f"model ready ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
        base = {"model": str(model_dir(work, shape)), "batch": batch, "seq": seq, "dropout": dropout,
                "device": args.device, "peer_device": args.peer_device or args.device,
                "peer_prepare": not args.peer_no_prepare}
        if args.decode:
            spec = {**base, "prompt": decode_prompt(shape), "new_tokens": args.new_tokens,
                    "key": f"{shape}-decode-{args.new_tokens}"}
            for system in systems:
                run(f"{shape}/decode", system, "decode", 0, spec)
            continue
        fsdp = {None: [], "full_shard": ["fsdp"], "offload": ["fsdp offloaded"]}[args.fsdp]
        variant = ["offload"] * args.offload + ["tiled MLP"] * args.tiled_mlp + fsdp
        row_key = "/".join([shape, f"{batch}x{seq}", str(dropout), *variant])
        base["extra_training"] = ("activation_offloading = true\n" * args.offload + "tiled_mlp = true\n" * args.tiled_mlp
                                  + (f'fsdp = "full_shard{" offload" * (args.fsdp == "offload")}"\n' if fsdp else ""))
        steps = args.warmup + args.steps
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            spec = {**base, "lr": LEARNING_RATE, "steps": 3, "trace": str(args.trace),
                    "extra_training": base["extra_training"] + "memory_snapshot = true\ntrace_steps = [2]"}
            spec["data"] = str(data_file(work, shape, batch, seq, spec["steps"]))
            spec["key"] = f"{shape}-{batch}x{seq}-{dropout}-trace"
            for system in systems:
                run(row_key, system, "trace", 0, spec)
            continue
        runs = [("loss", 0, {**base, "lr": 0.0, "steps": args.loss_steps})] if args.loss_steps else []
        runs += [("speed", r, {**base, "lr": LEARNING_RATE, "steps": steps}) for r in range(args.rounds)]
        for kind, rnd, spec in runs:
            spec["data"] = str(data_file(work, shape, batch, seq, spec["steps"]))
            spec["key"] = "-".join([shape, f"{batch}x{seq}", str(dropout), *(v.replace(" ", "_") for v in variant),
                                    kind])
            order = systems if rnd % 2 == 0 else systems[::-1]
            for system in order:
                run(row_key, system, kind, rnd, spec)
    report(done_path, args.warmup, args.loss_tol)


if __name__ == "__main__":
    main()
