#!/usr/bin/env python3
"""Decoding-speed benchmark: `qlora generate` against transformers (f32, and bitsandbytes NF4) on the CPU.

One invocation runs the same generation in four systems, side by side, on one or two models:

    ours-f32    the release `qlora generate --quantize none` (dense float32 weights)
    ours-nf4    the release `qlora generate --quantize nf4` (NF4, double quantization, blocksize 64, f32 compute;
                decoding multiplies by the 4-bit codes in place)
    hf-f32      transformers, float32, attn_implementation="sdpa"
    hf-nf4      transformers + bitsandbytes on the CPU: BitsAndBytesConfig(load_in_4bit=True,
                bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
                (on a CPU with AVX512-BF16, bitsandbytes 0.50 decodes through its fused 4-bit kernel, which rounds
                the activations and block scales to bfloat16; ours keeps them in float32)

The same work on every side: the same prompt token ids (the model folder's tokenizer.json with special tokens,
which is what `qlora generate --prompt` encodes; the torch side encodes with the same `tokenizers` library and
passes the ids), greedy decoding (no sampling), exactly --new-tokens new tokens with end-of-sequence ignored
(`--ignore-eos`; the torch side with the EOS id removed from its generation config, and the count checked), the
KV cache on, and the same number of threads (RAYON_NUM_THREADS for ours; torch.set_num_threads, OMP and MKL
thread variables for torch). tokens/s = new tokens / wall seconds of the whole generation call, prompt
processing included, model loading excluded: ours is the line `qlora generate` prints (measured around its
`generate` call, a cold first call in a fresh process); the torch side times `model.generate` after one warm-up
call of 2 tokens (which favours it slightly).

Models:
  smollm2   SmolLM2-135M-Instruct: the test GGUF (~/.cache/candle-qlora/SmolLM2-135M-Instruct.Q4_1.gguf, or
            $QLORA_TEST_MODEL_DIR; scripts/fetch-test-model.sh downloads it) dequantized to f32 once by
            transformers and saved as a safetensors folder with its tokenizer, which every system loads.
  llama-1b  a Llama-3.2-1B-shaped model with random weights (hidden 2048, 16 layers, 32 heads / 8 KV heads,
            intermediate 8192, vocabulary --vocab, default 128256, tied embeddings) written once as f32 (or,
            with --weights-dtype bf16, bf16 as the published model is) safetensors, with SmolLM2's tokenizer (its ids are all below the vocabulary size; generated ids the
            tokenizer does not know are skipped when printing). Needs about 5 GiB of disk and, per system, up to
            about 10 GiB of memory at load.

Runs alternate: each round runs every system once (in the order above), each in a fresh process, and the table
shows the median of the rounds; each ratio is the median of the rounds' ratios (each pair from one round).
Each run records the 1-minute load average before it and the cores other processes kept busy while it ran (model
loading included; from /proc/stat, less this script's children). Run it on an otherwise idle machine; on a shared
one, --wait-load waits for a lower load before each run and --max-others/--retries repeat a disturbed run (torch's
threads in particular slow down many times over when another process takes a core). The table shows the figures
of the runs kept.

    cargo build --release --bin qlora && python3 scripts/bench_generate.py
    python3 scripts/bench_generate.py --models smollm2 --rounds 5 --json-out gen.json

Requirements: pip install torch transformers bitsandbytes gguf tokenizers
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import OURS_GENERATE_LINE, load_causal_lm, machine_info

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEMS = ("ours-f32", "ours-nf4", "hf-f32", "hf-nf4")
MODELS = ("smollm2", "llama-1b")
SMOLLM2_VOCAB = 49152
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qlora", default=str(REPO_ROOT / "target" / "release" / "qlora"), help="the qlora binary")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per generation (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every system (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    p.add_argument("--prompt", default="The capital of France is", help="the prompt (plain text, no chat template)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary of the 1B model (default 128256)")
    p.add_argument("--weights-dtype", choices=("f32", "bf16"), default="f32",
                   help="dtype the 1B model's folder is written in (bf16: as Llama-3.2-1B is published; every "
                        "system still computes in f32 — transformers upcasts on load)")
    p.add_argument("--gguf", help="the SmolLM2 GGUF (default: the cached test model)")
    p.add_argument("--work-dir", help="keep the prepared model folders here (reused when present)")
    p.add_argument("--wait-load", type=float,
                   help="before each run, wait until the 1-minute load average is below this (shared machines)")
    p.add_argument("--wait-max", type=float, default=600, help="longest wait for --wait-load, seconds")
    p.add_argument("--max-others", type=float,
                   help="repeat a run during which other processes kept more than this many cores busy")
    p.add_argument("--retries", type=int, default=0, help="repeats allowed per run for --max-others (default 0)")
    p.add_argument("--retry-pause", type=float, default=15, help="seconds between repeats (default 15)")
    p.add_argument("--json-out", help="also write the results as JSON to this path")
    p.add_argument("--worker", choices=("prepare-smollm2", "prepare-llama-1b", "hf-f32", "hf-nf4"),
                   help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    return p.parse_args()


# ----------------------------------------------------------------------------------------------------------------
# Workers (fresh processes, so each system's memory and threads start clean)
# ----------------------------------------------------------------------------------------------------------------


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def prepare_smollm2(args: argparse.Namespace, out: Path) -> None:
    """The GGUF dequantized to f32 by transformers, saved as safetensors with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain f32 tensors once dequantized; transformers only refuses to save because the model
    # still carries its GGUF "quantizer".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)


def prepare_llama_1b(args: argparse.Namespace, out: Path, tokenizer_dir: Path) -> None:
    """A Llama-3.2-1B-shaped model with random weights (transformers' initialization, seed 0) in --weights-dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, bos_token_id=1, eos_token_id=2, **LLAMA_1B)
    dtype = torch.bfloat16 if args.weights_dtype == "bf16" else torch.float32
    model = LlamaForCausalLM(config).to(dtype)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(out)


def hf_worker(kind: str, args: argparse.Namespace) -> dict:
    """Loads the folder (quantized by bitsandbytes for hf-nf4), generates once to warm up, then times one call."""
    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    model = load_causal_lm(model_dir, kind == "hf-nf4").eval()
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(args.prompt, add_special_tokens=True).ids
    # Never stop at EOS: exactly the requested count, like `qlora generate --ignore-eos`.
    gen = model.generation_config
    gen.eos_token_id = None
    gen.pad_token_id = 0
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    input_ids = torch.tensor([ids], dtype=torch.long)
    mask = torch.ones_like(input_ids)

    def run(n: int):
        with torch.inference_mode():
            return model.generate(input_ids, attention_mask=mask, max_new_tokens=n,
                                  do_sample=False, use_cache=True)

    run(2)
    start = time.perf_counter()
    out = run(args.new_tokens)
    seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    if len(new) != args.new_tokens:
        raise SystemExit(f"{kind}: generated {len(new)} tokens, expected {args.new_tokens}")
    return {"prompt_ids": ids, "tokens": len(new), "seconds": seconds, "tokens_per_s": len(new) / seconds,
            "new_ids": new}


def worker_main(args: argparse.Namespace) -> None:
    kind = args.worker
    if kind == "prepare-smollm2":
        prepare_smollm2(args, Path(args.model_dir))
    elif kind == "prepare-llama-1b":
        prepare_llama_1b(args, Path(args.model_dir), Path(args.tokenizer_dir))
    else:
        print(json.dumps(hf_worker(kind, args)))


# ----------------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------------


def child_args(args: argparse.Namespace, **extra) -> list[str]:
    cmd = [sys.executable, __file__, "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
           "--prompt", args.prompt, "--vocab", str(args.vocab), "--gguf", str(args.gguf),
           "--weights-dtype", args.weights_dtype]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def prepare(args: argparse.Namespace, work: Path, models: list[str]) -> dict[str, Path]:
    dirs = {"smollm2": work / "smollm2-f32", "llama-1b": work / f"llama-1b-v{args.vocab}-{args.weights_dtype}"}
    # The 1B model borrows SmolLM2's tokenizer, so SmolLM2's folder is made first either way.
    needed = ["smollm2"] + [m for m in models if m != "smollm2"]
    for m in needed:
        if dirs[m].exists():
            print(f"[prepare] {m}: reusing {dirs[m]}", file=sys.stderr)
            continue
        print(f"[prepare] {m}: writing {dirs[m]}", file=sys.stderr)
        start = time.time()
        if m == "smollm2":
            cmd = child_args(args, worker="prepare-smollm2", model_dir=dirs[m])
        else:
            cmd = child_args(args, worker="prepare-llama-1b", model_dir=dirs[m], tokenizer_dir=dirs["smollm2"])
        subprocess.run(cmd, check=True, env=thread_env(os.cpu_count() or 1))
        print(f"[prepare] {m}: {time.time() - start:.0f} s", file=sys.stderr)
    return {m: dirs[m] for m in models}


def busy_seconds() -> float | None:
    """CPU seconds all processes have spent so far (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_system(system: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """One generation in a fresh process: tokens/s, the generated text or ids for the sanity check, and how busy
    the machine was: the 1-minute load average before, and the cores other processes kept busy meanwhile."""
    for attempt in range(1 + args.retries):
        if args.wait_load is not None:
            deadline = time.time() + args.wait_max
            while os.getloadavg()[0] > args.wait_load and time.time() < deadline:
                time.sleep(5)
        before = (time.time(), busy_seconds(), children_seconds())
        result = generate_once(system, model_dir, args)
        wall, busy = time.time() - before[0], busy_seconds()
        result["attempts"] = attempt + 1
        if busy is None or before[1] is None or wall <= 0:
            return result
        result["others_cores"] = max(0.0, (busy - before[1]) - (children_seconds() - before[2])) / wall
        if args.max_others is None or result["others_cores"] <= args.max_others:
            return result
        print(f"[retry] {system}: other processes kept {result['others_cores']:.2f} cores busy", file=sys.stderr)
        time.sleep(args.retry_pause)
    return result


def generate_once(system: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """`qlora generate` for ours (its tokens/s line), a worker process for the torch systems."""
    load = os.getloadavg()[0]
    env = thread_env(args.threads)
    if system.startswith("ours"):
        quantize = {"ours-f32": "none", "ours-nf4": "nf4"}[system]
        cmd = [args.qlora, "generate", "--model", str(model_dir), "--quantize", quantize,
               "--prompt", args.prompt, "--max-new-tokens", str(args.new_tokens), "--ignore-eos"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise SystemExit(f"{system} failed:\n{p.stderr}")
        m = OURS_GENERATE_LINE.search(p.stderr)
        if not m or int(m.group(1)) != args.new_tokens:
            raise SystemExit(f"{system}: no '{args.new_tokens} tokens in ...' line in:\n{p.stderr}")
        tokens, seconds = int(m.group(1)), float(m.group(2))
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "load": load,
                "text": p.stdout.strip()}
    p = subprocess.run(child_args(args, worker=system, model_dir=model_dir), capture_output=True, text=True,
                       env=env)
    if p.returncode != 0:
        raise SystemExit(f"{system} failed:\n{p.stderr[-4000:]}")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    result["load"] = load
    return result


def decode(model_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True).strip()




def median_ratio(runs: dict, a: str, b: str) -> float | None:
    if a not in runs or b not in runs:
        return None
    return statistics.median(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b]))


def report(model: str, model_dir: Path, runs: dict, args: argparse.Namespace) -> dict:
    print(f"\n## {model}: {args.new_tokens} new tokens, greedy, EOS ignored, {args.threads} threads, "
          f"{args.rounds} rounds (median)\n")
    print("| system | tokens/s (median) | rounds (tokens/s) | 1-min load before | other processes (cores) |")
    print("|---|---|---|---|---|")
    out = {"systems": {}}
    for s in SYSTEMS:
        if s not in runs:
            continue
        tps = [r["tokens_per_s"] for r in runs[s]]
        loads = ", ".join(f"{r['load']:.1f}" for r in runs[s])
        others = ", ".join(f"{r['others_cores']:.2f}" if "others_cores" in r else "?" for r in runs[s])
        print(f"| {s} | {statistics.median(tps):.1f} | {', '.join(f'{t:.1f}' for t in tps)} | {loads} | "
              f"{others} |")
        out["systems"][s] = {"median_tokens_per_s": statistics.median(tps), "rounds": runs[s]}
    ratios = {
        "ours-nf4 / hf-nf4": median_ratio(runs, "ours-nf4", "hf-nf4"),
        "ours-nf4 / ours-f32": median_ratio(runs, "ours-nf4", "ours-f32"),
        "ours-f32 / hf-f32": median_ratio(runs, "ours-f32", "hf-f32"),
        "ours-nf4 / hf-f32": median_ratio(runs, "ours-nf4", "hf-f32"),
        "hf-nf4 / hf-f32": median_ratio(runs, "hf-nf4", "hf-f32"),
    }
    print()
    for name, value in ratios.items():
        if value is not None:
            print(f"- {name}: {value:.2f}x")
    out["ratios"] = ratios
    # Same prompt, same greedy decoding: the f32 systems should print the same text (float summation order aside).
    if "ours-f32" in runs and "hf-f32" in runs:
        ours = runs["ours-f32"][0]["text"]
        theirs = decode(model_dir, runs["hf-f32"][0]["new_ids"])
        n = len(os.path.commonprefix([ours, theirs]))
        print(f"- f32 texts agree on their first {n} of {max(len(ours), len(theirs))} characters")
        out["f32_text_common_prefix"] = n
    if "hf-f32" in runs:
        out["prompt_ids"] = runs["hf-f32"][0]["prompt_ids"]
        print(f"- prompt: {len(out['prompt_ids'])} tokens {out['prompt_ids']}")
    return out


def main() -> None:
    args = parse_args()
    if args.gguf is None:
        cache = os.environ.get("QLORA_TEST_MODEL_DIR") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "candle-qlora"
        args.gguf = str(Path(cache).expanduser() / TEST_MODEL_NAME)
    if args.worker:
        worker_main(args)
        return
    models = [m for m in args.models.split(",") if m]
    systems = [s for s in args.only.split(",") if s]
    for name, given, valid in (("model", models, MODELS), ("system", systems, SYSTEMS)):
        bad = [x for x in given if x not in valid]
        if bad or not given:
            sys.exit(f"bench_generate: unknown {name} {bad}; choose from {','.join(valid)}")
    if not Path(args.gguf).exists():
        sys.exit(f"bench_generate: {args.gguf} not found (run scripts/fetch-test-model.sh, or pass --gguf)")
    if any(s.startswith("ours") for s in systems) and not Path(args.qlora).exists():
        sys.exit(f"bench_generate: {args.qlora} not found (cargo build --release --bin qlora)")
    if "llama-1b" in models and args.vocab < SMOLLM2_VOCAB:
        sys.exit(f"bench_generate: --vocab must be at least {SMOLLM2_VOCAB}, the size of SmolLM2's tokenizer, "
                 "which the 1B model borrows")
    if args.new_tokens < 1 or args.rounds < 1 or args.threads < 1:
        sys.exit("bench_generate: --new-tokens, --rounds and --threads must be at least 1")

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench-generate-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        dirs = prepare(args, work, models)
        results = {"machine": machine_info(("torch", "transformers", "bitsandbytes", "tokenizers")), "settings": {k: v for k, v in vars(args).items() if k != "worker"},
                   "models": {}}
        print(f"machine: {results['machine']}", file=sys.stderr)
        for model in models:
            runs: dict[str, list[dict]] = {}
            for rnd in range(args.rounds):
                for s in systems:
                    r = run_system(s, dirs[model], args)
                    runs.setdefault(s, []).append(r)
                    print(f"[{model} round {rnd + 1}] {s}: {r['tokens_per_s']:.1f} tokens/s "
                          f"(load {r['load']:.1f}, others {r.get('others_cores', float('nan')):.2f} cores)",
                          file=sys.stderr)
            results["models"][model] = report(model, dirs[model], runs, args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=1))
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
