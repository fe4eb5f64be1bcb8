#!/usr/bin/env python3
"""Training-throughput and memory benchmark: candle-qlora against PyTorch + transformers + PEFT, on the CPU.

One invocation runs the same LoRA training step, on the same machine, in up to three systems:

    ours        the `qlora` binary (`qlora train --config FILE`), NF4 base (double quantization, f32 compute);
                with --ours-f32 also `ours-f32`, the same run with load_in_4bit = false (unquantized f32 base),
                with --ours-budget-mib N also `ours-budget`, the NF4 run with memory-aware checkpointing (the last
                layers keep their activations within N MiB; only the others are recomputed)
    torch-f32   PyTorch + transformers + PEFT, float32 base
    torch-nf4   PyTorch + transformers + PEFT + bitsandbytes NF4 on the CPU: BitsAndBytesConfig(load_in_4bit=True,
                bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)

Common setup: SmolLM2-135M-Instruct; LoRA r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"
(PEFT semantics: every linear layer except lm_head); micro-batch 4 x sequence 256 with every row full (packed
data, all labels counted); gradient checkpointing, non-reentrant; AdamW, lr 1e-4 constant, weight decay 0,
gradient clipping at 1.0 (the transformers Trainer defaults, which ours follows); gradient accumulation 1.
The torch systems use attn_implementation="sdpa" (what transformers users get by default), torch threads =
os.cpu_count(), and a plain training loop (forward, backward, clip, optimizer step), the way
`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`,
`model.enable_input_require_grads()` and `get_peft_model` are used in PEFT's examples.

What is measured:
  * tokens/s: the median, over the --steps steps that follow --warmup steps, of tokens / wall seconds of one
    optimizer step (ours reports `step_seconds` and `tokens` per step in output_dir/log.jsonl);
  * peak RSS: every system runs in a fresh child process (the torch ones re-invoke this script with a hidden
    --worker argument), and its peak RSS is that child's ru_maxrss from os.wait4, model loading included;
  * a GEMM roofline: torch f32 matmul GFLOP/s (2048 x 2048 @ 2048 x 2048, best of a few seconds) in its own
    child, and each system's tokens/s as a fraction of peak_flops / FLOP-per-token, the FLOP count being computed
    from the model (printed with its formula);
  * the loss of the first and the last step, as a sanity check. The torch systems train on identical rows (the
    generated text tokenized once with the model's tokenizer, concatenated with EOS separators and cut into full
    rows); ours tokenizes and packs the same text itself, so its losses are close but not equal.

Model: the test GGUF $QLORA_TEST_MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf (default folder ~/.cache/candle-qlora;
scripts/fetch-test-model.sh downloads it and prints its path), or --model PATH (a .gguf file or a Hugging Face
model folder). Ours loads the GGUF itself; for the torch systems the GGUF is dequantized to f32 once and saved as
safetensors in a temporary folder (so that both torch systems load their native format, and GGUF dequantization
is charged to neither), and torch-nf4 quantizes that folder with bitsandbytes on load.

Run it on an idle machine (nothing else running: the numbers are wall-clock throughput on all cores):

    scripts/fetch-test-model.sh && cargo build --release && python3 scripts/bench_vs_peft.py
    python3 scripts/bench_vs_peft.py --only torch-f32,torch-nf4 --steps 4 --json-out bench.json

Requirements: pip install torch transformers peft bitsandbytes gguf
(bitsandbytes is optional: without it torch-nf4 is skipped; without the qlora binary ours is skipped.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench_common import load_causal_lm, machine_info

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEMS = ("ours", "torch-f32", "torch-nf4")
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
SEED = 42
GEMM_SIZE = 2048
GIB = 1024**3


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or a Hugging Face model folder (default: the cached test GGUF)")
    p.add_argument("--qlora", default=str(REPO_ROOT / "target" / "release" / "qlora"), help="the qlora binary")
    p.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--ours-f32", action="store_true", help="also run ours with load_in_4bit = false")
    p.add_argument("--ours-budget-mib", type=float,
                   help="also run ours (NF4) with activation_memory_budget_mib = this (memory-aware checkpointing)")
    p.add_argument("--steps", type=int, default=8, help="measured steps (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="steps run before the measured ones (default 2)")
    p.add_argument("--batch", type=int, default=4, help="micro-batch size (default 4)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times, interleaved (a, b, a, b, ...); tokens/s is the median over"
                        " the rounds and each ratio the median of the rounds' ratios, so a slow minute on a shared"
                        " machine hits one round of every system alike (default 1)")
    p.add_argument("--gemm-seconds", type=float, default=3.0, help="time spent measuring the GEMM peak")
    p.add_argument("--json-out", help="also write the results as JSON to this path")
    p.add_argument("--worker", choices=("gemm", "prepare", "torch-f32", "torch-nf4"), help=argparse.SUPPRESS)
    p.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 8 or args.rounds < 1:
        p.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 8, --rounds >= 1")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ChildRun:
    """Exit code, peak RSS (bytes) and wall time of one child process."""

    returncode: int
    peak_rss: int
    wall_seconds: float


def run_child(cmd: list[str]) -> ChildRun:
    """Runs `cmd` (output inherited) and reaps it with os.wait4 to get its own rusage (ru_maxrss is KiB on Linux)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(proc.returncode, usage.ru_maxrss * 1024, time.perf_counter() - start)


def run_worker(kind: str, work: Path) -> tuple[ChildRun, dict | None]:
    """Runs this script as `--worker kind`; returns the child run and the JSON the worker wrote (None on failure)."""
    print(f"\n=== {kind} ===", file=sys.stderr, flush=True)
    run = run_child([sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--work-dir", str(work)])
    result_path = work / f"{kind}.json"
    if run.returncode != 0 or not result_path.exists():
        print(f"{kind}: worker failed (exit code {run.returncode})", file=sys.stderr)
        return run, None
    return run, json.loads(result_path.read_text())


# ----------------------------------------------------------------------------------------------------------------
# Workers (each runs in its own process; settings come from work/settings.json, results go to work/<kind>.json)
# ----------------------------------------------------------------------------------------------------------------


def worker_main(kind: str, work: Path) -> None:
    settings = json.loads((work / "settings.json").read_text())
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    transformers.utils.logging.disable_progress_bar()
    if kind == "gemm":
        result = gemm_worker(settings)
    elif kind == "prepare":
        result = prepare_worker(settings, work)
    else:
        result = torch_train_worker(kind, settings, work)
    (work / f"{kind}.json").write_text(json.dumps(result))


def gemm_worker(settings: dict) -> dict:
    """Times f32 GEMMs for about settings["gemm_seconds"]; returns the best and the median GFLOP/s."""
    import torch

    n = GEMM_SIZE
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    times = []
    deadline = time.perf_counter() + settings["gemm_seconds"]
    while len(times) < 3 or time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - t)
    flop = 2.0 * n**3
    return {
        "size": n,
        "repeats": len(times),
        "best_gflops": flop / min(times) / 1e9,
        "median_gflops": flop / statistics.median(times) / 1e9,
    }


def load_f32_model(model: dict):
    """The model in f32 from a GGUF file (dequantized by transformers) or a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    if model["gguf_file"]:
        return AutoModelForCausalLM.from_pretrained(model["dir"], gguf_file=model["gguf_file"], dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model["dir"], dtype=torch.float32)


def load_tokenizer(model: dict):
    from transformers import AutoTokenizer

    if model["gguf_file"]:
        return AutoTokenizer.from_pretrained(model["dir"], gguf_file=model["gguf_file"])
    return AutoTokenizer.from_pretrained(model["dir"])


def prepare_worker(settings: dict, work: Path) -> dict:
    """Tokenizes the training text into full rows for the torch systems, saves a GGUF model as f32 safetensors,
    and counts the matmul parameters the FLOP estimate needs."""
    import torch
    from peft import LoraConfig, get_peft_model

    model_spec = settings["model"]
    tokenizer = load_tokenizer(model_spec)
    stream: list[int] = []
    with open(work / "train.jsonl") as f:
        for line in f:
            stream += tokenizer(json.loads(line)["text"])["input_ids"]
            if tokenizer.eos_token_id is not None:
                stream.append(tokenizer.eos_token_id)
    seq, n_rows = settings["seq"], settings["batch"] * settings["total_steps"]
    if len(stream) < n_rows * seq:
        raise SystemExit(f"prepare: the text gives {len(stream)} tokens, {n_rows * seq} are needed")
    (work / "rows.json").write_text(json.dumps([stream[i * seq : (i + 1) * seq] for i in range(n_rows)]))

    model = load_f32_model(model_spec)
    torch_model_dir = model_spec["dir"]
    if model_spec["gguf_file"]:
        # The weights are plain f32 tensors once dequantized; transformers only refuses to save because the model
        # still carries its GGUF "quantizer", so drop it and save a regular float32 safetensors folder.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        torch_model_dir = str(work / "hf-f32")
        model.save_pretrained(torch_model_dir)
    n_head = n_blocks = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if name.split(".")[-1] == "lm_head":
                n_head += module.weight.numel()
            else:
                n_blocks += module.weight.numel()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    n_lora = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return {
        "torch_model_dir": torch_model_dir,
        "stream_tokens": len(stream),
        "n_head": n_head,
        "n_blocks": n_blocks,
        "n_lora": n_lora,
        "num_layers": cfg.num_hidden_layers,
        "attn_dim": cfg.num_attention_heads * head_dim,
    }


def load_torch_model(kind: str, model_dir: str):
    """torch-f32: the f32 folder as is; torch-nf4: the same folder quantized by bitsandbytes on load."""
    return load_causal_lm(model_dir, kind == "torch-nf4")


def torch_train_worker(kind: str, settings: dict, work: Path) -> dict:
    """Loads the model, adds LoRA and runs settings["total_steps"] timed training steps on the prepared rows."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    prepared = json.loads((work / "prepare.json").read_text())
    start = time.perf_counter()
    model = load_torch_model(kind, prepared["torch_model_dir"])
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
    load_seconds = time.perf_counter() - start

    rows = torch.tensor(json.loads((work / "rows.json").read_text()), dtype=torch.long)
    batch, total = settings["batch"], settings["total_steps"]
    step_seconds, losses = [], []
    for step in range(total):
        input_ids = rows[step * batch : (step + 1) * batch]
        t = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_seconds.append(time.perf_counter() - t)
        losses.append(loss.item())
        print(f"{kind} step {step + 1}/{total}: loss {losses[-1]:.4f}, {step_seconds[-1]:.2f} s", file=sys.stderr)
    return {
        "step_seconds": step_seconds,
        "tokens": [int(input_ids.numel())] * total,
        "losses": losses,
        "load_seconds": load_seconds,
    }


# ----------------------------------------------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------------------------------------------


def toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def ours_config(settings: dict, train_file: Path, output_dir: Path, load_in_4bit: bool,
                budget_mib: float | None = None) -> str:
    """The TOML run config for `qlora train` (field names are the Python ones)."""
    budget = "" if budget_mib is None else f"activation_memory_budget_mib = {budget_mib}\n"
    return f"""\
[model]
name_or_path = {toml_str(settings["model"]["path"])}

[model.quantization]
load_in_4bit = {str(load_in_4bit).lower()}
bnb_4bit_quant_type = "nf4"
bnb_4bit_use_double_quant = true
bnb_4bit_compute_dtype = "float32"

[lora]
r = {LORA["r"]}
lora_alpha = {LORA["lora_alpha"]}
lora_dropout = {LORA["lora_dropout"]}
target_modules = {toml_str(LORA["target_modules"])}

[data]
train_file = {toml_str(str(train_file))}
format = "text"
max_length = {settings["seq"]}
packing = true

[training]
output_dir = {toml_str(str(output_dir))}
overwrite_output_dir = true
per_device_train_batch_size = {settings["batch"]}
gradient_accumulation_steps = 1
learning_rate = {LEARNING_RATE}
max_steps = {settings["total_steps"]}
lr_scheduler_type = "constant"
optim = "adamw_torch"
weight_decay = 0.0
max_grad_norm = {MAX_GRAD_NORM}
gradient_checkpointing = true
logging_steps = 1
save_strategy = "no"
eval_strategy = "no"
seed = {SEED}
{budget}"""


def run_ours(name: str, qlora: Path, settings: dict, work: Path, load_in_4bit: bool,
             budget_mib: float | None = None) -> tuple[ChildRun, dict | None]:
    """Runs `qlora train` on a generated config; returns the child run and its per-step log (None on failure)."""
    print(f"\n=== {name} ===", file=sys.stderr, flush=True)
    run_dir = work / name
    run_dir.mkdir(exist_ok=True)  # a later round reuses it (the config overwrites the output)
    cfg = run_dir / "config.toml"
    cfg.write_text(ours_config(settings, work / "train.jsonl", run_dir / "out", load_in_4bit, budget_mib))
    run = run_child([str(qlora), "train", "--config", str(cfg)])
    log_path = run_dir / "out" / "log.jsonl"
    if run.returncode != 0 or not log_path.exists():
        print(f"{name}: `qlora train` failed (exit code {run.returncode})", file=sys.stderr)
        return run, None
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    entries = sorted((e for e in entries if "loss" in e), key=lambda e: e["step"])
    timed = all("step_seconds" in e and "tokens" in e for e in entries)
    return run, {
        "step_seconds": [e["step_seconds"] for e in entries] if timed else None,
        "tokens": [e["tokens"] for e in entries] if timed else None,
        "losses": [e["loss"] for e in entries],
    }


# ----------------------------------------------------------------------------------------------------------------
# Inputs: model, text, machine
# ----------------------------------------------------------------------------------------------------------------


def resolve_model(arg: str | None) -> dict:
    """{"path", "dir", "gguf_file"} for --model, or the cached test GGUF; exits with a hint when it is missing."""
    if arg:
        path = Path(arg).expanduser().resolve()
    else:
        cache = os.environ.get("QLORA_TEST_MODEL_DIR") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        ) / "candle-qlora"
        path = Path(cache).expanduser().resolve() / TEST_MODEL_NAME
    if not path.exists():
        hint = "" if arg else " (run scripts/fetch-test-model.sh first, or pass --model)"
        sys.exit(f"bench_vs_peft: model not found: {path}{hint}")
    if path.is_file():
        if path.suffix != ".gguf":
            sys.exit(f"bench_vs_peft: --model must be a .gguf file or a model folder, got {path}")
        return {"path": str(path), "dir": str(path.parent), "gguf_file": path.name}
    return {"path": str(path), "dir": str(path), "gguf_file": None}


# Small lexicon for English-like sentences: determiner, adjective(s), noun, verb, object, prepositional phrase.
LEXICON = {
    "det": "the a this that every each one some another no".split(),
    "adj": (
        "small large quiet bright old young green heavy quick slow careful simple strange warm cold early late "
        "narrow wide gentle loud empty busy distant familiar hidden open"
    ).split(),
    "noun": (
        "river teacher garden machine village window letter engine farmer student city bridge market storm "
        "kitchen island painter road forest doctor library mountain ship clock friend question answer story "
        "table winter morning evening bird child museum station"
    ).split(),
    "verb": (
        "watches builds carries finds opens follows paints repairs reads remembers visits crosses describes "
        "measures answers moves keeps leaves explains discovers"
    ).split(),
    "prep": "near under behind beside across through after before inside around".split(),
}


def sentence(rng: random.Random) -> list[str]:
    """One English-like sentence as a list of words (capitalized, with a final period)."""

    def noun_phrase() -> list[str]:
        adjs = rng.sample(LEXICON["adj"], rng.choice((0, 1, 1, 2)))
        return [rng.choice(LEXICON["det"]), *adjs, rng.choice(LEXICON["noun"])]

    words = [*noun_phrase(), rng.choice(LEXICON["verb"]), *noun_phrase()]
    if rng.random() < 0.5:
        words += [rng.choice(LEXICON["prep"]), *noun_phrase()]
    words[0] = words[0].capitalize()
    words[-1] += "."
    return words


def generate_text(n_words: int, max_words: int, seed: int = SEED) -> list[str]:
    """Seeded text lines of at least `n_words` words in total. Line lengths are spread from one word to
    `max_words` so that best-fit packing (ours) can fill every row, and no line is truncated at max_length."""
    rng = random.Random(seed)
    lines, total = [], 0
    while total < n_words:
        target = rng.randint(1, 4) if rng.random() < 0.2 else rng.randint(5, max_words)
        words: list[str] = []
        while len(words) < target:
            words += sentence(rng)
        words = words[:target]
        if not words[-1].endswith("."):
            words[-1] += "."
        lines.append(" ".join(words))
        total += len(words)
    return lines




# ----------------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class SystemResult:
    """One system's outcome: measured numbers, or why it was skipped or failed."""

    name: str
    status: str = "ok"  # ok | skipped: ... | failed: ...
    tokens_per_s: float | None = None
    peak_rss_gib: float | None = None
    wall_seconds: float | None = None
    measured_steps: int = 0
    mean_tokens_per_step: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    round_tokens_per_s: list[float] = field(default_factory=list)
    raw: dict = field(default_factory=dict)


def summarize(name: str, run: ChildRun, log: dict | None, warmup: int) -> SystemResult:
    """Median tokens/s over the steps after `warmup`, peak RSS, first/last loss."""
    if log is None:
        return SystemResult(name, status=f"failed (exit code {run.returncode})")
    res = SystemResult(name, peak_rss_gib=run.peak_rss / GIB, wall_seconds=run.wall_seconds, raw=log)
    if log["losses"]:
        res.loss_first, res.loss_last = log["losses"][0], log["losses"][-1]
    if log["step_seconds"] is not None:
        measured = list(zip(log["tokens"], log["step_seconds"]))[warmup:]
        res.measured_steps = len(measured)
        if measured:
            res.tokens_per_s = statistics.median(tok / sec for tok, sec in measured)
            res.mean_tokens_per_step = statistics.mean(tok for tok, _ in measured)
    return res


def merge_rounds(runs: list[SystemResult]) -> SystemResult:
    """One result from a system's rounds: the median tokens/s and the largest peak RSS (a failed round wins)."""
    failed = next((r for r in runs if r.status != "ok"), None)
    if failed:
        return failed
    speeds = [r.tokens_per_s for r in runs]
    timed = None not in speeds
    return replace(
        runs[0],
        tokens_per_s=statistics.median(speeds) if timed else None,
        peak_rss_gib=max(r.peak_rss_gib for r in runs),
        round_tokens_per_s=speeds if timed else [],
    )


def speed_ratio(r: SystemResult, base: SystemResult | None) -> float | None:
    """tokens/s of `r` over `base`: the median of the per-round ratios when both ran in rounds."""
    if base and len(r.round_tokens_per_s) > 1 and len(r.round_tokens_per_s) == len(base.round_tokens_per_s):
        return statistics.median(a / b for a, b in zip(r.round_tokens_per_s, base.round_tokens_per_s))
    return ratio(r.tokens_per_s, base and base.tokens_per_s)


def flop_model(prep: dict, seq: int) -> dict:
    """Training FLOP per token with full recomputation (gradient checkpointing) and a frozen base."""
    n_head, n_blocks, n_lora = prep["n_head"], prep["n_blocks"], prep["n_lora"]
    n = n_head + n_blocks
    attn = 8 * prep["num_layers"] * seq * prep["attn_dim"]
    total = 4 * n + 2 * n_blocks + 8 * n_lora + attn
    formula = (
        "FLOP/token = 2N (forward) + 2N_blocks (decoder blocks recomputed once by gradient checkpointing)"
        " + 2N (backward: input gradients only; the base is frozen, so no weight gradients)"
        " + 8 N_lora (LoRA: forward, recompute, input and weight gradients)"
        " + 8 L s d_attn (causal attention scores and values: forward, recompute, 2x backward)"
        f"\n  = 4 x {n / 1e6:.2f}M + 2 x {n_blocks / 1e6:.2f}M + 8 x {n_lora / 1e6:.2f}M"
        f" + 8 x {prep['num_layers']} x {seq} x {prep['attn_dim']} = {total / 1e9:.3f} GFLOP/token"
        f"\n  (N = {n / 1e6:.2f}M matmul weights incl. the tied lm_head {n_head / 1e6:.2f}M;"
        " elementwise ops, norms and softmax ignored)"
    )
    return {"flop_per_token": total, "n": n, "n_blocks": n_blocks, "n_head": n_head, "n_lora": n_lora, "formula": formula}


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(results: list[SystemResult], gemm: dict | None, flops: dict | None, info: dict, command: str) -> dict:
    """Prints the Markdown report and returns the same data for --json-out."""
    base = next((r for r in results if r.name == "torch-f32" and r.status == "ok"), None)
    roofline = gemm["best_gflops"] * 1e9 / flops["flop_per_token"] if gemm and flops else None
    print("\n## candle-qlora vs PyTorch + PEFT: LoRA training step on the CPU\n")
    print("| system | tokens/s (median) | peak RSS (GiB) | tokens/s vs torch-f32 | RSS vs torch-f32 | fraction of GEMM roofline |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        if r.status != "ok":
            print(f"| {r.name} | {r.status} | | | | |")
            continue
        print(
            f"| {r.name} | {fmt(r.tokens_per_s, '.1f')} | {fmt(r.peak_rss_gib, '.3f')}"
            f" | {fmt(speed_ratio(r, base), '.2f')}"
            f" | {fmt(ratio(r.peak_rss_gib, base and base.peak_rss_gib), '.2f')}"
            f" | {fmt(ratio(r.tokens_per_s, roofline), '.1%')} |"
        )
    if any(len(r.round_tokens_per_s) > 1 for r in results):
        print("\ntokens/s of each round (in the order run): " + "; ".join(
            f"{r.name} {', '.join(f'{x:.1f}' for x in r.round_tokens_per_s)}" for r in results if r.round_tokens_per_s
        ))
    nf4 = next((r for r in results if r.name == "ours" and r.status == "ok"), None)
    f32 = next((r for r in results if r.name == "ours-f32" and r.status == "ok"), None)
    if nf4 and f32:
        print(
            f"\nours NF4 / ours f32: tokens/s {fmt(speed_ratio(nf4, f32), '.2f')},"
            f" peak RSS {fmt(ratio(nf4.peak_rss_gib, f32.peak_rss_gib), '.2f')}"
        )

    print("\nSanity check (losses; the torch systems train on identical rows, ours tokenizes and packs the text itself):\n")
    print("| system | measured steps | tokens/step | loss (first step) | loss (last step) | process wall (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        if r.status == "ok":
            print(
                f"| {r.name} | {r.measured_steps} | {fmt(r.mean_tokens_per_step, '.0f')} | {fmt(r.loss_first, '.4f')}"
                f" | {fmt(r.loss_last, '.4f')} | {fmt(r.wall_seconds, '.1f')} |"
            )

    print()
    if gemm:
        print(
            f"GEMM peak: torch f32 matmul {gemm['size']}x{gemm['size']} @ {gemm['size']}x{gemm['size']}:"
            f" best {gemm['best_gflops']:.1f} GFLOP/s, median {gemm['median_gflops']:.1f} GFLOP/s"
            f" ({gemm['repeats']} repeats); the roofline uses the best."
        )
    else:
        print("GEMM peak: n/a (the gemm worker failed)")
    if flops:
        print(flops["formula"])
    if roofline:
        print(f"Roofline: {roofline:.1f} tokens/s = GEMM peak / FLOP per token")
    v = info["versions"]
    print(
        f"Machine: {info['cpu']}, {info['cores']} logical CPUs (torch threads = {info['cores']}); Python {info['python']},"
        f" torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, bitsandbytes {v['bitsandbytes']}"
    )
    print("Torch systems: attn_implementation=sdpa, non-reentrant gradient checkpointing, plain training loop.")
    print(f"Command: {command}")
    return {
        "command": command,
        "machine": info,
        "gemm": gemm,
        "flops": flops,
        "roofline_tokens_per_s": roofline,
        "systems": [
            vars(r) | {"fraction_of_roofline": ratio(r.tokens_per_s, roofline)}
            for r in results
        ],
    }


# ----------------------------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------------------------


def check_python_packages(selected: list[str], model: dict) -> dict[str, str]:
    """Exits if a required package is missing; returns {"torch-nf4": reason} when bitsandbytes is missing."""
    required = ["torch", "transformers", "peft"] + (["gguf"] if model["gguf_file"] else [])
    missing = [m for m in required if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"bench_vs_peft: missing Python packages {missing}: pip install torch transformers peft bitsandbytes gguf")
    if "torch-nf4" in selected and importlib.util.find_spec("bitsandbytes") is None:
        return {"torch-nf4": "skipped: bitsandbytes not installed (pip install bitsandbytes)"}
    return {}


def run_benchmark(args: argparse.Namespace) -> None:
    selected = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(selected) - set(SYSTEMS))
    if unknown:
        sys.exit(f"bench_vs_peft: unknown systems {unknown} in --only (choose from {', '.join(SYSTEMS)})")
    model = resolve_model(args.model)
    skipped = check_python_packages(selected, model)
    qlora = Path(args.qlora).expanduser().resolve()
    if "ours" in selected and not (qlora.is_file() and os.access(qlora, os.X_OK)):
        reason = f"skipped: no qlora binary at {qlora} (build it: cargo build --release, or pass --qlora PATH)"
        skipped["ours"] = reason
        if args.ours_f32:
            skipped["ours-f32"] = reason
        if args.ours_budget_mib is not None:
            skipped["ours-budget"] = reason
    for name, reason in skipped.items():
        print(f"bench_vs_peft: {name} {reason}", file=sys.stderr)
    order = [s for s in SYSTEMS if s in selected]
    if "ours" in order and args.ours_f32:
        order.insert(order.index("ours") + 1, "ours-f32")
    if "ours" in order and args.ours_budget_mib is not None:
        order.insert(order.index("ours") + 1, "ours-budget")
    if all(name in skipped for name in order):
        sys.exit("bench_vs_peft: nothing to run")

    info = machine_info(("torch", "transformers", "peft", "bitsandbytes"))
    command = shlex.join([sys.executable, *sys.argv])
    total_steps = args.warmup + args.steps
    settings = {
        "model": model,
        "batch": args.batch,
        "seq": args.seq,
        "total_steps": total_steps,
        "gemm_seconds": args.gemm_seconds,
    }

    with tempfile.TemporaryDirectory(prefix="bench_vs_peft.") as tmp:
        work = Path(tmp)
        (work / "settings.json").write_text(json.dumps(settings))
        # Every word is at least one token, so this many words fill all rows, with two steps to spare.
        lines = generate_text(args.batch * args.seq * (total_steps + 2), max_words=max(2, args.seq // 4))
        (work / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))

        _, gemm = run_worker("gemm", work)
        _, prep = run_worker("prepare", work)
        if prep is None:
            sys.exit("bench_vs_peft: the prepare step failed (see above)")
        rounds: dict[str, list[SystemResult]] = {name: [] for name in order}
        for _ in range(args.rounds):
            for name in order:
                if name in skipped:
                    continue
                if name.startswith("ours"):
                    run, log = run_ours(name, qlora, settings, work, load_in_4bit=(name != "ours-f32"),
                                        budget_mib=args.ours_budget_mib if name == "ours-budget" else None)
                else:
                    run, log = run_worker(name, work)
                rounds[name].append(summarize(name, run, log, args.warmup))
        results = [
            SystemResult(name, status=skipped[name]) if name in skipped else merge_rounds(rounds[name])
            for name in order
        ]

    data = report(results, gemm, flop_model(prep, args.seq), info, command)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2) + "\n")
        print(f"JSON written to {args.json_out}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args.worker, Path(args.work_dir))
    else:
        run_benchmark(args)


if __name__ == "__main__":
    main()
