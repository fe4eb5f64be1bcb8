#!/usr/bin/env python3
"""Golden files for candle-qlora's LoRA / DoRA adapters (PEFT format), produced by Hugging Face PEFT itself.

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, peft 0.21.2, safetensors 0.8.0,
numpy 2.4.6, Python 3.11, all run on the CPU.
    pip install torch==2.15.0 transformers==5.23.0 peft==0.21.2 safetensors numpy

Usage:
    python3 scripts/golden_peft.py generate                # (re)writes everything under tests/data/peft/
    python3 scripts/golden_peft.py float64                 # only the float64 goldens (see "Float64"), added to the
                                                           # committed golden files without touching anything else
    python3 scripts/golden_peft.py check-ours ADAPTER_DIR [BASE]
                                                           # loads an adapter written by our Rust code with PEFT
                                                           # on BASE (default tests/data/models/tiny-llama; a folder,
                                                           # or a name such as tiny-qwen3) and compares it with
                                                           # ADAPTER_DIR/expected.safetensors in float64 (see below)
    python3 scripts/golden_peft.py check-trained DIR       # evaluates an adapter our trainer wrote for
                                                           # SmolLM2-135M-Instruct with PEFT (plain and bitsandbytes
                                                           # NF4 base) and compares the losses with ours in float64
                                                           # (see below)

No Hugging Face Hub access is needed. The base model of the first four cases is tests/data/models/tiny-llama
(LlamaForCausalLM, float32, hidden 64, intermediate 160, 2 layers, 4 heads / 2 kv heads, vocab 128, untied lm_head;
scripts/golden_model.py); the <family>_lora cases use tests/data/models/tiny-<family>. Loaded with dtype float32,
eager attention, eval mode.

Outputs, one folder per case under tests/data/peft/<case>/:
    adapter_config.json          PEFT's own file (PeftModel.save_pretrained), unmodified. base_model_name_or_path is
                                 set to the base folder, e.g. "tests/data/models/tiny-llama" (relative to the
                                 repository root).
    adapter_model.safetensors    PEFT's own file, unmodified (metadata {"format": "pt"}).
    golden.safetensors           tensors:
        input_ids        int64 [2, 13]        seeded
        logits           f32 [2, 13, 128]     PeftModel(input_ids).logits, adapter active, eval mode
        logits_base      f32 [2, 13, 128]     the same inside `with model.disable_adapter():`
        merged_logits    f32 [2, 13, 128]     deepcopy(model).merge_and_unload()(input_ids).logits
        merged.<name>    f32                  merge_and_unload() weights (HF names, e.g.
                                              merged.model.layers.0.self_attn.q_proj.weight) of the linear weights the
                                              adapter changes; lora_all_linear and the <family>_lora cases only layer 0
                                              (every module kind; the size budget), the other cases every touched
                                              weight (incl. lm_head for modules_to_save)
        logits_f64, logits_base_f64, merged_logits_f64, merged.<name>_f64
                         f64                  the same, computed by PEFT in float64 from end to end (see "Float64")
      metadata: versions, base_model, the case's LoraConfig kwargs (JSON), "modules" = JSON {module name: {r, alpha,
      scaling}} as PEFT resolved them (rank_pattern / alpha_pattern / rslora applied), keys sorted.
    PEFT's README.md model card is deleted (not needed, and it would carry machine-specific paths).
  tests/data/peft/lora_all_linear/expected_config_keys.json: the sorted keys PEFT 0.21.2 writes in adapter_config.json.

Cases:
    lora_all_linear   r=8, alpha=16, target_modules="all-linear" (PEFT expands it to the 14 full module names; below
                      20 names it does not condense them to suffixes), task_type CAUSAL_LM
    lora_patterns     rslora (scaling alpha/sqrt(r)), r=4, alpha=8, target_modules [q_proj, v_proj, down_proj,
                      gate_proj], exclude_modules regex (layer 1 gate_proj), rank_pattern, alpha_pattern (incl. a
                      regex key)
    dora              use_dora, r=4, alpha=8, lora_dropout 0.05 (inactive in eval), q/k/v/o/up_proj
    modules_to_save   r=4, alpha=4, q/v_proj, modules_to_save ["lm_head"] (the saved copy perturbed)
    qwen3_lora, gemma2_lora, gemma3_lora, phi3_lora, mistral_sw_lora
                      r=4, alpha=8, target_modules="all-linear", task_type CAUSAL_LM, on tiny-qwen3 / tiny-gemma2 /
                      tiny-gemma3 / tiny-phi3 / tiny-mistral-sw. What all-linear resolves to (PEFT 0.21.2,
                      tuners_utils._maybe_include_all_linear_layers: every torch.nn.Linear of the model except
                      model.get_output_embeddings(), i.e. lm_head, tied or not):
                        qwen3, gemma2, gemma3, mistral-sw: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
                                                           down_proj in every layer
                        phi3: qkv_proj, o_proj, gate_up_proj, down_proj in every layer (the fused modules get one
                              LoRA pair each: lora_A [r, 64], lora_B [128, r] for qkv_proj, [320, r] for gate_up_proj)
                      adapter_config.json's target_modules: the full module names (14 names, 8 for phi3), except
                      gemma3_lora (21 names): from 20 names on PEFT condenses the list to the minimal suffixes
                      (tuners_utils._find_minimal_target_modules), so it holds the 7 suffixes.
  Every lora_A / lora_B weight is overwritten with 0.1 * randn (seeded torch.Generator per case, parameters in sorted
  name order) so B != 0; DoRA magnitudes are multiplied by (1 + 0.05 * randn); the lm_head copy gets + 0.01 * randn.

How PEFT 0.21.2 matches the patterns (peft/tuners/tuners_utils.py::check_target_module_exists,
peft/utils/other.py::get_pattern_key), keys being module names relative to the transformers model
("model.layers.0.self_attn.q_proj", "lm_head"):
    target_modules  str: re.fullmatch(pattern, key); list: key == t or key.endswith("." + t)
    exclude_modules str: re.fullmatch; list: key == t or key.endswith("." + t); checked before target_modules
    modules_to_save excluded from LoRA targets when re.match(rf"(^|.*\\.){m}($|\\..*)", key)
    rank_pattern / alpha_pattern: the FIRST key (dict order) for which re.match(rf"(.*\\.)?({k})$", key) matches,
                    i.e. a regex that must match a whole dot-separated suffix of the name (so "down_proj" and
                    "model.layers.1.self_attn.q_proj" both work; "proj" does not match "q_proj"). The order is
                    insertion order when the model is built, but the order in adapter_config.json (json sort_keys)
                    when it is loaded, so overlapping keys can resolve differently after a round trip; the cases
                    here use non-overlapping keys.

Determinism: torch runs single-threaded with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2). PEFT stores target_modules
as a Python set and writes it with list(set), so its order depends on string hashing: the script re-executes
itself with PYTHONHASHSEED=0 so adapter_config.json is byte-identical between runs. MKL's BLAS still picks its
kernels by host: on an AMD EPYC host the adapter-active `logits` of the four tiny-llama cases come out up to 2.3e-6
away from the committed ones (also with the unmodified script; every other file is bit-identical), so restore those
with git when only other cases changed.

Float64: every float golden also has a `_f64` twin computed by PEFT and transformers in float64 from end to end
(scripts/float64_reference.py: the base model and the adapter read from float64 copies of their folders — exactly the
stored float32 values — inside a dispatch mode that widens the steps transformers keeps in float32, RMSNorm, RoPE,
softmax, and fails if any float32 result remains): the logits with the adapter active and disabled, and
merge_and_unload()'s logits and weights (W + scaling·B·A, DoRA's magnitude / ‖W + scaling·B·A‖ per row, the
modules_to_save copy) without any float32 rounding. The Rust tests compare a float64 model of ours with them at ~1e-9,
where neither side's float32 rounding nor the CPU's choice of matrix kernels can decide the result (the float32
goldens are 1e-6 to 3e-6 from them in the logits, up to 7e-8 in the merged weights). `python3 scripts/golden_peft.py
float64` adds them to the committed files without touching anything else (each float32 golden is checked to be within
float32 rounding of its twin); `generate` writes them too.

Size budget: the four tiny-llama cases stay under 2.6 MB, all cases under 6.3 MB (asserted): the float32 files take
0.95 / 2.3 MB, and each float golden's float64 twin twice its bytes.

check-ours ADAPTER_DIR [BASE]: BASE is the base model folder (default tests/data/models/tiny-llama; also accepted:
a path relative to the repository root or the working directory, or a folder name under tests/data/models such as
tiny-phi3); a note is printed when adapter_config.json's base_model_name_or_path names another folder.
ADAPTER_DIR holds adapter_config.json + adapter_model.safetensors (written by our code) and
expected.safetensors with `input_ids` (int) and, from a float64 model of ours with the adapter active, `logits` (f64)
and optionally `merged.<hf name>` weights (f64, our merge). Fails unless: PEFT loads the folder (on the float32 base,
as a user would) without warnings/log records about missing / unexpected / mismatched keys (an adapter_config.json key
PEFT does not know also counts: PEFT warns "Unexpected keyword arguments [...] for class LoraConfig"); the file's
tensor names are exactly the names PEFT would save for that config (no unexpected, none missing) with the same shapes,
and loaded bit-exactly; adapter_config.json has every key PEFT writes; expected.safetensors holds float64 values; and
PEFT's logits and merge_and_unload() weights, in float64 from end to end (see "Float64"), are within 1e-9 × max(1,
max |PEFT's|) of ours (F64_TOLERANCE, as the Rust tests).

check-trained DIR: an adapter trained by our Rust trainer on SmolLM2-135M-Instruct (r=8, all linear layers). Produce
DIR with
    QLORA_PEFT_CHECK_DIR=/tmp/x cargo test --test integration smollm2_qlora
    python3 scripts/golden_peft.py check-trained /tmp/x/trained-smollm2
(also needs: pip install bitsandbytes gguf). DIR holds adapter_config.json + adapter_model.safetensors and
expected_eval.json with
    model                                  path of the base GGUF (SmolLM2-135M-Instruct.Q4_1.gguf)
    examples                               [{"input_ids": [...], "labels": [...]}], labels aligned with input_ids,
                                           -100 = ignored; position t predicts labels[t + 1] (transformers' shift)
    base_loss_f64, adapted_loss_f64        our token-level mean NLL (total NLL over every counted label token of
                                           every example / total counted tokens) without / with the adapter, from a
                                           float64 model of the GGUF (dequantized, as transformers loads it)
    base_loss_nf4_f64, adapted_loss_nf4_f64
                                           the same with the base quantized to NF4 on load as bitsandbytes on the
                                           CPU (double quant, blocksize 64)
The GGUF is loaded by transformers dequantized to float32 and saved as a safetensors folder in a temp dir (its GGUF
quantizer dropped, as in scripts/bench_vs_peft.py); scripts/golden_model.py's float64_models reads it in float64 from
end to end (see "Float64"), plainly and with bitsandbytes' dequantized NF4 weights (BitsAndBytesConfig(load_in_4bit=
True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True) on the CPU), eager attention, eval mode; the adapter
is loaded on each with PeftModel.from_pretrained (from a float64 copy; it must load without problems, as in
check-ours). Each example runs alone (batch 1, no padding) and the loss is sum(cross_entropy(reduction="sum")) / count
over the shifted labels, the same token-level mean as ours. Fails unless |ours - PEFT| <= 1e-9 × max(1, PEFT's) for
each loss. Prints a table of ours vs PEFT; exit code 1 on any FAIL.
"""
import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import warnings

if os.environ.get("PYTHONHASHSEED") != "0":  # see "Determinism"
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import peft  # noqa: E402
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

transformers.utils.logging.disable_progress_bar()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import float64_copy, float64_everywhere  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "peft")
BASE_REL = "tests/data/models/tiny-llama"
BASE = os.path.join(ROOT, BASE_REL)
ATTN = "eager"
SEQ = (2, 13)
F64_TOLERANCE = 1e-9  # relative to max(1, max |reference|): tests/integration/common.rs's F64_TOLERANCE

VERSIONS = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "peft": peft.__version__,
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
    "python": sys.version.split()[0],
}

CASES = [
    # name, LoraConfig kwargs, seed, layers whose merged weights are stored (None = all), base model folder
    ("lora_all_linear",
     dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"), 101, [0],
     BASE_REL),
    ("lora_patterns",
     dict(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.0, task_type="CAUSAL_LM",
          target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"],
          # a str is re.fullmatch'ed against the full module name
          exclude_modules=r"model\.layers\.1\.mlp\.gate_proj",
          # keys: regexes matched against a whole dot-separated suffix of the module name (see module docstring)
          rank_pattern={"down_proj": 6, "model.layers.1.self_attn.q_proj": 2},
          alpha_pattern={"v_proj": 3, r"layers\.1\.mlp\.down_p.*": 12}), 102, None, BASE_REL),
    ("dora",
     dict(r=4, lora_alpha=8, lora_dropout=0.05, use_dora=True, task_type="CAUSAL_LM",
          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]), 103, None, BASE_REL),
    ("modules_to_save",
     dict(r=4, lora_alpha=4, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"],
          modules_to_save=["lm_head"]), 104, None, BASE_REL),
] + [
    # one all-linear case per newer family (scripts/golden_model.py), on that family's tiny model
    (f"{family.replace('-', '_')}_lora",
     dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"), seed, [0],
     f"tests/data/models/tiny-{family}")
    for family, seed in [("qwen3", 111), ("gemma2", 112), ("gemma3", 113), ("phi3", 114), ("mistral-sw", 115)]
]
BUDGET_FIRST_CASES = 2_600_000  # the four tiny-llama cases
BUDGET_ALL = 6_300_000


def save_sorted(tensors, path, metadata):
    """safetensors' save_file with the header's metadata keys sorted (as in scripts/golden_model.py)."""
    data = safetensors.torch.save(tensors, metadata=metadata)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


def base_dir(base):
    """A base model folder: absolute, relative to the repository root, relative to the working directory, or a
    folder name under tests/data/models (e.g. "tiny-qwen3")."""
    for candidate in (os.path.join(ROOT, base), base, os.path.join(ROOT, "tests", "data", "models", base)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return os.path.abspath(candidate)
    raise SystemExit(f"no base model folder (with config.json) at {base!r}")


def load_base(folder=BASE, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTN)
    model.eval()
    assert all(p.dtype == dtype for p in model.parameters())
    return model


def lora_layers(model):
    """{module name relative to the transformers model: LoRA layer} for the default adapter."""
    from peft.tuners.lora import LoraLayer

    inner = model.base_model.model
    return {n: m for n, m in inner.named_modules() if isinstance(m, LoraLayer) and "default" in m.lora_A}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name in sorted(params):
            p = params[name]
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float32))
            elif ".lora_magnitude_vector." in name:
                p.mul_(1.0 + 0.05 * torch.randn(p.shape, generator=g, dtype=torch.float32))
            elif ".modules_to_save.default." in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=torch.float32))


def forward(model, ids):
    with torch.no_grad():
        return model(ids).logits.float().contiguous()


def config_keys():
    with tempfile.TemporaryDirectory() as tmp:
        LoraConfig().save_pretrained(tmp)
        with open(os.path.join(tmp, "adapter_config.json")) as f:
            return sorted(json.load(f))


def generate_case(name, kwargs, seed, merged_layers, base_rel):
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)  # PEFT's own init (kaiming A) uses the global generator; all of it is overwritten
    base = load_base(base_dir(base_rel))
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(base, LoraConfig(**kwargs))
    for w in caught:
        if not issubclass(w.category, (FutureWarning, DeprecationWarning)):
            print(f"{name}: PEFT warning at build: {w.category.__name__}: {w.message}")
    model.eval()
    model.peft_config["default"].base_model_name_or_path = base_rel
    randomize(model, seed)

    layers = lora_layers(model)
    modules = {n: {"r": m.r["default"], "alpha": m.lora_alpha["default"], "scaling": m.scaling["default"]}
               for n, m in sorted(layers.items())}

    g = torch.Generator().manual_seed(seed + 1000)
    ids = torch.randint(0, 128, SEQ, generator=g, dtype=torch.int64)
    logits = forward(model, ids)
    with model.disable_adapter():
        logits_base = forward(model, ids)
    assert float((logits - logits_base).abs().max()) > 1e-2, "adapter does not change the outputs"

    merged = copy.deepcopy(model).merge_and_unload()
    merged.eval()
    merged_logits = forward(merged, ids)
    merged_state = merged.state_dict()
    touched = sorted(k for k in merged_state if not torch.equal(merged_state[k], base_state[k]))
    expected_touched = sorted([f"{n}.weight" for n in layers] + [f"{m}.weight" for m in kwargs.get("modules_to_save")
                                                                 or []])
    assert touched == expected_touched, (touched, expected_touched)

    model.save_pretrained(folder)
    readme = os.path.join(folder, "README.md")
    if os.path.exists(readme):
        os.remove(readme)

    tensors = {"input_ids": ids.contiguous(), "logits": logits, "logits_base": logits_base,
               "merged_logits": merged_logits}
    for k in touched:
        layer = k.split(".")[2] if k.startswith("model.layers.") else None
        if merged_layers is None or layer is None or int(layer) in merged_layers:
            tensors[f"merged.{k}"] = merged_state[k].float().contiguous()
    meta = {**VERSIONS, "attn_implementation": ATTN, "seed": str(seed), "base_model": base_rel,
            "lora_config": json.dumps(kwargs, sort_keys=True), "modules": json.dumps(modules, sort_keys=True)}
    save_sorted(tensors, os.path.join(folder, "golden.safetensors"), meta)

    # reload everything: the golden file, and PEFT's adapter on a fresh base model
    back = load_file(os.path.join(folder, "golden.safetensors"))
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    reloaded, problems = load_peft(folder, load_base(base_dir(base_rel)))
    assert not problems, problems
    assert torch.equal(forward(reloaded, ids), logits), "reloaded adapter gives different logits"
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    ours = get_peft_model_state_dict(reloaded)
    assert sorted(saved) == sorted(ours) and all(torch.equal(saved[k], ours[k]) for k in saved)

    d_adapter = float((logits - logits_base).abs().max())
    d_merge = float((merged_logits - logits).abs().max())
    print(f"{name}: {len(layers)} LoRA modules, {len(saved)} adapter tensors, |logits - base| max {d_adapter:.4f}, "
          f"|merged - unmerged| max {d_merge:.3g}, {sum(k.startswith('merged.') for k in tensors)} merged weights")
    if kwargs.get("target_modules") == "all-linear":
        suffixes = sorted({n.rsplit(".", 1)[1] for n in layers})
        print(f"{name}: all-linear on {base_rel} -> {suffixes} (not: {sorted(set(untargeted_linears(model)))})")
    return saved


# ---------------------------------------------------------------------------------------------------- float64


@contextlib.contextmanager
def float64_peft(adapter_dir, base_rel):
    """PEFT's model of the adapter in `adapter_dir` on the base `base_rel`, in float64 from end to end (see
    "Float64"): both read from float64 copies inside float64_everywhere(), which stays active meanwhile."""
    base, adapter = float64_copy(base_dir(base_rel)), float64_copy(adapter_dir)
    try:
        with float64_everywhere():
            model = PeftModel.from_pretrained(load_base(base, torch.float64), adapter)
            model.eval()
            assert all(p.dtype == torch.float64 for p in model.parameters())
            yield model
    finally:
        shutil.rmtree(base)
        shutil.rmtree(adapter)


def float64_tensors(folder, base_rel, ids, merged_names):
    """The float64 twins of a case's golden tensors (see "Float64"): PEFT's logits of `ids` with the adapter active
    and disabled, and merge_and_unload()'s logits and its weights `merged_names` (HF names)."""
    with float64_peft(folder, base_rel) as model:
        with torch.no_grad():
            out = {"logits_f64": model(ids).logits}
            with model.disable_adapter():
                out["logits_base_f64"] = model(ids).logits
            merged = copy.deepcopy(model).merge_and_unload()
            merged.eval()
            out["merged_logits_f64"] = merged(ids).logits
            state = merged.state_dict()
            for name in merged_names:
                out[f"merged.{name}_f64"] = state[name]
    assert all(t.dtype == torch.float64 for t in out.values())
    return {k: v.detach().contiguous() for k, v in out.items()}


def read_golden(path):
    """The tensors of a golden file, copied out of the file's memory map (it is rewritten next)."""
    return {k: v.clone() for k, v in load_file(path).items()}


def add_float64(name, base_rel):
    """Adds (or recomputes) the float64 twins in case `name`'s golden.safetensors, whose other tensors and metadata
    stay as they are; each float32 golden must be within float32 rounding of its twin."""
    path = os.path.join(OUT, name, "golden.safetensors")
    golden = {k: v for k, v in read_golden(path).items() if not k.endswith("_f64")}
    with safetensors.safe_open(path, "pt") as f:
        meta = dict(f.metadata())
    merged_names = [k[len("merged."):] for k in golden if k.startswith("merged.")]
    f64 = float64_tensors(os.path.join(OUT, name), base_rel, golden["input_ids"], merged_names)
    off = {}
    for k, v in f64.items():
        plain = golden[k[:-len("_f64")]]
        off[k] = float((plain.double() - v).abs().max())
        assert off[k] < 1e-3 * (1 + float(v.abs().max())), (name, k, off[k])
    save_sorted({**golden, **f64}, path, meta)
    print(f"{name}: {len(f64)} float64 goldens; the float32 goldens are off by at most "
          + ", ".join(f"{k[:-4]} {off[k]:.2g}" for k in ("logits_f64", "logits_base_f64", "merged_logits_f64"))
          + f", merged weights {max(v for k, v in off.items() if k.startswith('merged.')):.2g}")


def generate_float64():
    """Only the float64 twins, added to the committed golden files (nothing else in tests/data/peft changes)."""
    for name, _, _, _, base_rel in CASES:
        add_float64(name, base_rel)


def untargeted_linears(model):
    """Suffixes of the nn.Linear modules of the PEFT-wrapped model that carry no LoRA layer (e.g. lm_head)."""
    from peft.tuners.lora import LoraLayer

    inner = model.base_model.model
    lora_names = {n for n, m in inner.named_modules() if isinstance(m, LoraLayer)}
    return [n.rsplit(".", 1)[-1] for n, m in inner.named_modules()
            if type(m) is torch.nn.Linear and not any(n == x or n.startswith(x + ".") for x in lora_names)]


def generate():
    os.makedirs(OUT, exist_ok=True)
    for name, kwargs, seed, merged_layers, base_rel in CASES:
        saved = generate_case(name, kwargs, seed, merged_layers, base_rel)
        add_float64(name, base_rel)
        if name == "lora_all_linear":
            with open(os.path.join(OUT, name, "adapter_config.json")) as f:
                written = sorted(json.load(f))
            assert written == config_keys(), (written, config_keys())
            with open(os.path.join(OUT, name, "expected_config_keys.json"), "w") as f:
                json.dump(written, f, indent=1)
                f.write("\n")
        if name == "dora":
            for k in sorted(saved):
                print(f"    {k}: {saved[k].dtype} {list(saved[k].shape)}")
    total, first = 0, 0
    first_cases = {c[0] for c in CASES[:4]}
    for dirpath, _, files in sorted(os.walk(OUT)):
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            size = os.path.getsize(path)
            total += size
            if os.path.relpath(path, OUT).split(os.sep)[0] in first_cases:
                first += size
            with open(path, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()[:16]
            print(f"  {os.path.relpath(path, ROOT)}: {size} bytes  sha256 {digest}")
    print(f"total: {total} bytes ({total / 1e6:.3f} MB), the four tiny-llama cases {first} bytes")
    assert first < BUDGET_FIRST_CASES and total < BUDGET_ALL


# ------------------------------------------------------------------------------------------------- check-ours


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


KEY_WORDS = ("missing", "unexpected", "mismatch", "ignored", "not found", "did not match", "unknown")


def load_peft(adapter_dir, base=None):
    """PeftModel.from_pretrained on `base` (default: a fresh tiny-llama); returns (model, [problems with the load])."""
    if base is None:
        base = load_base()
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("peft", "transformers", "")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = PeftModel.from_pretrained(base, adapter_dir)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    model.eval()
    messages = [f"warning {w.category.__name__}: {w.message}" for w in caught
                if not issubclass(w.category, (FutureWarning, DeprecationWarning))]
    messages += [f"log {r.name} {r.levelname}: {r.getMessage()}" for r in handler.records]
    problems = [m for m in messages if any(k in m.lower() for k in KEY_WORDS)]
    for m in messages:
        if m not in problems:
            print(f"note: {m}")

    # PeftModel.from_pretrained ignores unexpected keys silently: compare the file against what PEFT would save
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    wanted = get_peft_model_state_dict(model)
    unexpected = sorted(set(saved) - set(wanted))
    missing = sorted(set(wanted) - set(saved))
    if unexpected:
        problems.append(f"unexpected tensors in adapter_model.safetensors: {unexpected}")
    if missing:
        problems.append(f"missing tensors in adapter_model.safetensors: {missing}")
    for k in sorted(set(saved) & set(wanted)):
        if saved[k].shape != wanted[k].shape:
            problems.append(f"{k}: shape {list(saved[k].shape)}, PEFT expects {list(wanted[k].shape)}")
        elif not torch.equal(saved[k].to(wanted[k].dtype), wanted[k]):
            problems.append(f"{k}: PEFT did not load the stored values")
    return model, problems


def f64_difference(ours, reference):
    """max |ours - reference| and its tolerance: F64_TOLERANCE relative to the larger of 1 and the reference's largest
    magnitude (the Rust tests' assert_f64_close)."""
    return float((ours - reference).abs().max()), F64_TOLERANCE * max(1.0, float(reference.abs().max()))


def compare_float64(adapter_dir, base_rel, expected):
    """Our float64 logits and merged weights in `expected` against PEFT's, both in float64 from end to end."""
    ok = True
    merged_keys = sorted(k for k in expected if k.startswith("merged."))
    with float64_peft(adapter_dir, base_rel) as model:
        with torch.no_grad():
            logits = model(expected["input_ids"].to(torch.int64)).logits
            merged = copy.deepcopy(model).merge_and_unload().state_dict() if merged_keys else {}
    if expected["logits"].shape != logits.shape:
        print(f"FAIL: logits shape {list(expected['logits'].shape)}, PEFT {list(logits.shape)}")
        ok = False
    else:
        diff, tolerance = f64_difference(expected["logits"], logits)
        ok &= diff <= tolerance
        print(f"{'ok' if diff <= tolerance else 'FAIL'}: max |logits - PEFT logits| = {diff:.3g} (tolerance "
              f"{tolerance:.3g})")
    if merged_keys:
        worst, merged_ok = 0.0, True
        for k in merged_keys:
            name = k[len("merged."):]
            if name not in merged:
                print(f"FAIL: {k}: no weight {name} in the merged model")
            elif expected[k].shape != merged[name].shape:
                print(f"FAIL: {k}: shape {list(expected[k].shape)}, PEFT {list(merged[name].shape)}")
            else:
                diff, tolerance = f64_difference(expected[k], merged[name])
                worst = max(worst, diff)
                if diff <= tolerance:
                    continue
                print(f"FAIL: {k}: max |ours - PEFT merge_and_unload| = {diff:.3g} (tolerance {tolerance:.3g})")
            merged_ok = False
        print(f"{'ok' if merged_ok else 'FAIL'}: {len(merged_keys)} merged weights, max |ours - PEFT "
              f"merge_and_unload| = {worst:.3g}")
        ok &= merged_ok
    return ok


def check_ours(adapter_dir, base_rel=BASE_REL):
    ok = True
    print(f"base model: {base_rel}")
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        named = json.load(f).get("base_model_name_or_path")
    if named and os.path.basename(os.path.normpath(named)) != os.path.basename(base_dir(base_rel)):
        print(f"note: adapter_config.json names base_model_name_or_path {named!r}, checked against {base_rel!r}")
    model, problems = load_peft(adapter_dir, load_base(base_dir(base_rel)))
    for p in problems:
        print(f"FAIL: {p}")
        ok = False

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg_keys = set(json.load(f))
    absent = sorted(set(config_keys()) - cfg_keys)
    if absent:
        print(f"FAIL: adapter_config.json lacks keys PEFT {peft.__version__} writes: {absent}")
        ok = False
    extra = sorted(cfg_keys - set(config_keys()))
    if extra:
        print(f"note: adapter_config.json has keys PEFT {peft.__version__} does not write: {extra}")

    layers = lora_layers(model)
    print(f"PEFT loaded {len(layers)} LoRA modules: " + ", ".join(
        f"{n} (r {m.r['default']}, scaling {m.scaling['default']:.6g}"
        f"{', dora' if m.use_dora.get('default') else ''})" for n, m in sorted(layers.items())))

    expected = load_file(os.path.join(adapter_dir, "expected.safetensors"))
    narrow = sorted(k for k, v in expected.items() if v.is_floating_point() and v.dtype != torch.float64)
    if narrow:
        print(f"FAIL: expected.safetensors holds {narrow} in float32: it must hold a float64 model's results (rerun "
              "the Rust test that writes it)")
        ok = False
    else:
        ok &= compare_float64(adapter_dir, base_rel, expected)
    print("check-ours: " + ("PASS" if ok else "FAIL"))
    return ok


# ---------------------------------------------------------------------------------------------- check-trained

def load_gguf_f32(gguf_path):
    """The GGUF base dequantized by transformers to float32, eager attention, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                                 gguf_file=os.path.basename(gguf_path), dtype=torch.float32,
                                                 attn_implementation=ATTN)
    model.eval()
    assert model.dtype == torch.float32
    return model


def save_plain_f32(model, folder):
    """Saves a GGUF-loaded model as a float32 safetensors folder. transformers refuses while the model still carries
    its GGUF "quantizer"; the weights are plain f32 tensors once dequantized (see scripts/bench_vs_peft.py)."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)


def eval_loss(model, examples):
    """Token-level mean NLL: each example alone (batch 1, no padding), position t predicting labels[t + 1]; the
    summed cross entropy of every counted token of every example / the number of counted tokens."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex["input_ids"]], dtype=torch.int64)
            labels = torch.tensor(ex["labels"], dtype=torch.int64)
            assert labels.shape[0] == ids.shape[1], "labels must be aligned with input_ids"
            logits = model(ids).logits[0]
            target = labels[1:]
            nll = torch.nn.functional.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum")
            total += float(nll)
            count += int((target != -100).sum())
    assert count > 0, "no counted label tokens"
    return total / count


def check_trained(folder):
    from golden_model import float64_models  # bitsandbytes and gguf: only this command needs them

    with open(os.path.join(folder, "expected_eval.json")) as f:
        expected = json.load(f)
    examples = expected["examples"]
    n_tokens = sum(sum(1 for t in ex["labels"][1:] if t != -100) for ex in examples)
    print(f"base {expected['model']}, {len(examples)} examples, {n_tokens} counted label tokens")
    ok = True
    rows = []  # (name, ours, PEFT)

    def load_adapter(adapter, base, what):
        nonlocal ok
        model, problems = load_peft(adapter, base)
        for p in problems:
            print(f"FAIL ({what}): {p}")
            ok = False
        print(f"PEFT loaded {len(lora_layers(model))} LoRA modules on the {what} base")
        return model

    with tempfile.TemporaryDirectory() as tmp:
        model = load_gguf_f32(expected["model"])
        save_plain_f32(model, tmp)
        del model
        adapter = float64_copy(folder)
        try:
            with float64_models(tmp) as (plain, quantized):
                for base, kind in ((plain, ""), (quantized, "_nf4")):
                    rows.append((f"base_loss{kind}_f64", eval_loss(base, examples)))
                    adapted = load_adapter(adapter, base, "float64 NF4" if kind else "float64")
                    rows.append((f"adapted_loss{kind}_f64", eval_loss(adapted, examples)))
        finally:
            shutil.rmtree(adapter)

    print(f"{'loss':<22}{'ours':>20}{'PEFT':>20}{'|diff|':>11}{'tolerance':>11}")
    for name, theirs in rows:
        ours = expected[name]
        diff, tolerance = abs(ours - theirs), F64_TOLERANCE * max(1.0, abs(theirs))
        ok &= diff <= tolerance
        print(f"{name:<22}{ours:>20.15f}{theirs:>20.15f}{diff:>11.2e}{tolerance:>11.2e}  "
              f"{'PASS' if diff <= tolerance else 'FAIL'}")
    print("check-trained: " + ("PASS" if ok else "FAIL"))
    return ok


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "generate":
        generate()
    elif len(sys.argv) == 2 and sys.argv[1] == "float64":
        generate_float64()
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "check-ours":
        sys.exit(0 if check_ours(*sys.argv[2:]) else 1)
    elif len(sys.argv) == 3 and sys.argv[1] == "check-trained":
        sys.exit(0 if check_trained(sys.argv[2]) else 1)
    else:
        print(__doc__)
        sys.exit(2)
