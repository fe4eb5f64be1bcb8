#!/usr/bin/env python3
"""Golden GGUF files for candle-qlora's `qlora export`, written by llama.cpp's own converter (`convert_hf_to_gguf.py`).

The converter is not on PyPI by itself: it ships inside the source distribution of llama-cpp-python, whose
`vendor/llama.cpp` holds llama.cpp's converter and its `gguf-py` package. This script downloads that sdist (pinned
below, checked by its sha256), runs the converter on tiny models of the tests — the Llama for each type it writes
(f32, f16, bf16, q8_0), the Qwen 2, Qwen 3, Mixtral, Qwen 2-MoE, Phi-3 and an all-sparse Qwen 3-MoE in some (that
one, tests/data/models/tiny-qwen3-moe-sparse, is written once by `sparse_qwen3_moe`) — and `convert_lora_to_gguf.py`
on a LoRA adapter of the Llama and of the Qwen 3 (tests/data/peft) in the same types, and records each file — every metadata key with its
type and value, every tensor's name, dimensions, type and the sha256 of its bytes — in tests/data/gguf/NAME.json
(`files`: the model; `adapter_files`: the adapter).
It also quantizes a fixed set of rows (random values at several scales, a zero block, a constant block, a lone
spike, a negative extreme) with the `gguf` package's own quantizers for every block type it has (q8_0, q4_0, q4_1,
q5_0, q5_1), and rows of 256-value super-blocks with ggml's own k-quant quantizers (`quantize_row_q*_K_ref` of
libggml-base, which the gguf package lacks), and writes the inputs and the bytes to tests/data/gguf/quants.json.

For the k-quant mixes it writes two generated Llamas (tests/data/models/kquant-llama*, whose config.json and
tokenizer are committed; the weights come from `kquant_weights`, a counter hash that the Rust tests repeat bit for
bit): one with 256-wide rows, 8 layers and its own head, one 320 wide (so most rows fall back to 32-blocks) with
tied embeddings. Each is converted to f32 and quantized by `llama-quantize` (`--pure` for one type alone, the mixes
Q4_K_M and Q5_K_M as they are); tests/data/gguf/kquant-llama*.json record the files as above.
llama-quantize and libggml-base come from a build of the sdist's llama.cpp: LLAMA_CPP_BUILD names one (its bin/
folder is used), otherwise the script builds them with cmake (`pip install cmake`; about 10 minutes on 2 cores).

Versions used for the committed file: llama-cpp-python 0.3.36 (llama.cpp 0c1e5709, gguf-py 0.19.0), torch 2.15.0,
transformers 4.57.6 (the version the vendored converter's requirements pin), numpy 2.4.6.
    pip install torch "transformers==4.57.6" sentencepiece "protobuf>=4.21.0,<5.0.0" safetensors numpy

Two things the test model needs, neither of which changes what is compared:
- its tokenizer is a WordLevel one (made for tests) that transformers' auto class would take for a Llama
  SentencePiece tokenizer: a `tokenizer_config.json` naming `PreTrainedTokenizerFast` keeps it as it is;
- its pre-tokenizer is not one whose hash the converter knows, so it stops; `get_vocab_base_pre` is wrapped to
  answer `default` (what `qlora export --tokenizer-pre default` writes) instead of stopping.

Usage:
    python3 scripts/golden_gguf.py generate      # writes tests/data/gguf/tiny-*.json and quants.json
"""
import hashlib
import json
import os
import re
import runpy
import shutil
import sys
import tarfile
import tempfile
import urllib.request

SDIST = "llama_cpp_python-0.3.36.tar.gz"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TYPES = ["f32", "f16", "bf16", "q8_0"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.path.join(ROOT, "tests", "data", "models")
PEFT_DIR = os.path.join(ROOT, "tests", "data", "peft")
GGUF_DIR = os.path.join(ROOT, "tests", "data", "gguf")
QUANTS_OUT = os.path.join(GGUF_DIR, "quants.json")
CONVERTER = "llama-cpp-python 0.3.36 (llama.cpp 0c1e5709)"
# The tiny models converted: the types written, and the adapter (tests/data/peft) converted alone.
MODELS = {
    "tiny-llama": (TYPES, "lora_all_linear"),
    "tiny-qwen2": (["f32"], None),
    "tiny-qwen3": (["f32", "q8_0"], "qwen3_lora"),
    "tiny-mixtral": (["f32", "q8_0"], None),
    "tiny-qwen2-moe": (["f32", "q8_0"], None),
    "tiny-phi3": (["f32", "q8_0"], None),
    "tiny-qwen3-moe-sparse": (["f32", "q8_0"], None),
}
# The tokenizer_config.json the converter is given (see above); Phi-3's converter takes a byte-level vocabulary only
# from a `GPT2Tokenizer` (Phi-4-mini's), whose default special tokens the test vocabulary does not have.
TOKENIZER_CONFIGS = {
    "tiny-phi3": {"tokenizer_class": "GPT2Tokenizer", "bos_token": None, "eos_token": None, "unk_token": None},
}
QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Generated models quantized by llama-quantize: our --quant name -> (llama-quantize's name, --pure).
K_QUANTS = {
    "q2_k": ("Q2_K", True),
    "q3_k": ("Q3_K", True),
    "q4_k": ("Q4_K", True),
    "q5_k": ("Q5_K", True),
    "q6_k": ("Q6_K", True),
    "q4_k_m": ("Q4_K_M", False),
    "q5_k_m": ("Q5_K_M", False),
}
K_MODELS = {
    "kquant-llama": list(K_QUANTS),
    "kquant-llama-tied": ["q4_k", "q6_k", "q4_k_m", "q5_k_m"],
}
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def fetch_converter(work):
    """The sdist's llama.cpp folder, extracted under `work`."""
    with urllib.request.urlopen(INDEX) as r:
        index = r.read().decode()
    url = re.search(r'href="([^"#]*/' + re.escape(SDIST) + ')', index).group(1)
    path = os.path.join(work, SDIST)
    with urllib.request.urlopen(url) as r, open(path, "wb") as f:
        shutil.copyfileobj(r, f)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{SDIST}: sha256 {digest}, expected {SDIST_SHA256}")
    prefix = SDIST[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(work, members=members, filter="data")
    return os.path.join(work, prefix)


def convert(llama_cpp, model, outtype, outfile, adapter=None):
    """Runs the converter (the LoRA one with `adapter`) in this process, its pre-tokenizer lookup answering
    `default` for an unknown hash."""
    sys.path[:0] = [llama_cpp, os.path.join(llama_cpp, "gguf-py")]
    import conversion.base as base

    original = base.TextModel.get_vocab_base_pre

    def pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "default"

    base.TextModel.get_vocab_base_pre = pre
    argv = sys.argv
    script = "convert_lora_to_gguf.py" if adapter else "convert_hf_to_gguf.py"
    if adapter:
        sys.argv = [script, "--base", model, "--outtype", outtype, "--outfile", outfile, adapter]
    else:
        sys.argv = [script, model, "--outtype", outtype, "--outfile", outfile]
    try:
        runpy.run_path(os.path.join(llama_cpp, script), run_name="__main__")
    finally:
        sys.argv = argv
        base.TextModel.get_vocab_base_pre = original


def describe(path):
    """A GGUF file's metadata and tensors, as JSON."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        types = [t.name for t in field.types]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            value = [field.contents(i) for i in range(len(field.data))]
        else:
            value = field.contents()
        metadata.append({"key": key, "type": types, "value": value})
    tensors = [
        {
            "name": t.name,
            "ne": [int(d) for d in t.shape],
            "type": t.tensor_type.name,
            "sha256": hashlib.sha256(t.data.tobytes()).hexdigest(),
        }
        for t in reader.tensors
    ]
    return {"metadata": metadata, "tensors": tensors}


def quant_inputs():
    """Rows of 64 float32 values: random at several scales, and blocks of 32 with edge cases."""
    import numpy as np

    rng = np.random.default_rng(47)
    rows = [rng.standard_normal(64) * scale for scale in (1e-3, 0.02, 1.0, 300.0)]
    rows.append(np.concatenate([np.zeros(32), np.full(32, 0.75)]))  # zero block; constant block
    spike = np.zeros(64)
    spike[5], spike[40] = 3.0, -7.5  # a lone spike; a negative extreme
    spike[41:] = rng.uniform(-1, 1, 23)
    rows.append(spike)
    rows.append(np.linspace(-2.0, 2.0, 64))
    return np.stack(rows).astype(np.float32)


def quants(llama_cpp):
    """The gguf package's bytes for each block type of the fixed rows."""
    sys.path[:0] = [os.path.join(llama_cpp, "gguf-py")]
    import gguf

    data = quant_inputs()
    out = {"inputs": [[float(v) for v in row] for row in data]}
    for name in QUANT_TYPES:
        qtype = getattr(gguf.GGMLQuantizationType, name)
        out[name.lower()] = [gguf.quants.quantize(row[None, :], qtype).tobytes().hex() for row in data]
    return out


def llama_cpp_tools(llama_cpp):
    """The bin/ folder of a llama.cpp build holding llama-quantize and libggml-base: LLAMA_CPP_BUILD's, or one
    built here."""
    import subprocess

    build = os.environ.get("LLAMA_CPP_BUILD")
    if not build:
        build = os.path.join(llama_cpp, "build")
        subprocess.run(["cmake", "-S", llama_cpp, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
                        "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON"], check=True)
        subprocess.run(["cmake", "--build", build, "--target", "llama-quantize", "-j"], check=True)
    return os.path.join(build, "bin")


def k_quant_inputs():
    """Rows of 256 float32 values (one super-block each): random at several scales, heavy tails, zero and constant
    sub-blocks, all of one sign, and values too small to quantize."""
    import numpy as np

    rng = np.random.default_rng(470)
    rows = [rng.standard_normal(256) * scale for scale in (1e-3, 0.02, 1.0, 300.0)]
    rows.append(rng.standard_t(2, 256) * 0.05)  # heavy tails
    mixed = rng.standard_normal(256)
    mixed[:16] = 0.0  # a zero sub-block
    mixed[32:64] = 0.75  # constant sub-blocks
    mixed[100] = -40.0  # a lone extreme
    rows.append(mixed)
    rows.append(np.abs(rng.standard_normal(256)) + 0.5)  # all positive: the minimum stays at 0
    rows.append(-np.abs(rng.standard_normal(256)) - 0.5)  # all negative
    rows.append(np.zeros(256))
    rows.append(rng.standard_normal(256) * 1e-20)
    rows.append(np.linspace(-2.0, 2.0, 256))
    return np.stack(rows).astype(np.float32)


def k_quants(bin_dir):
    """ggml's reference k-quant quantizers' bytes for the fixed rows."""
    import ctypes

    import numpy as np

    lib = ctypes.CDLL(os.path.join(bin_dir, "libggml-base.so"))
    data = k_quant_inputs()
    out = {"k_inputs": [[float(v) for v in row] for row in data]}
    for name in K_TYPES:
        quantize = getattr(lib, f"quantize_row_{name[:2].lower()}_K_ref")
        quantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        rows = []
        for row in data:
            row = np.ascontiguousarray(row)
            block = ctypes.create_string_buffer(BLOCK_BYTES[name])
            quantize(row.ctypes.data, block, 256)
            rows.append(block.raw.hex())
        out[name.lower()] = rows
    return out


def lowbias32(x):
    """A 32-bit integer hash (numpy uint32 arrays, wrapping)."""
    import numpy as np

    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def kquant_weights(config):
    """The generated Llama's weights by Hugging Face name: tensor number k (in name order) holds, at flat index i,
    u + 4u³ (u = hash(k·2654435761 + i) / 2³² − ½, in float32) times 2^−(row % 5) / 16; norms hold 1 + that / 8.
    Every operation is exact or one float32 rounding, so the Rust tests rebuild the same bits."""
    import numpy as np

    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    weights = {}
    for k, name in enumerate(sorted(shapes)):
        shape = shapes[name]
        n = int(np.prod(shape))
        keys = (np.uint64(k) * np.uint64(2654435761) + np.arange(n, dtype=np.uint64)) & np.uint64(0xFFFFFFFF)
        hashed = lowbias32(keys.astype(np.uint32))
        u = (hashed >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
        cube = u * u
        cube = cube * u
        cube = cube * np.float32(4.0)
        v = u + cube
        if len(shape) == 1:
            weights[name] = np.float32(1.0) + v * np.float32(0.125)
        else:
            rows = np.arange(n) // shape[1]
            scale = (np.float32(2.0) ** -(rows % 5).astype(np.float32)) * np.float32(1 / 16)
            weights[name] = (v * scale.astype(np.float32)).reshape(shape)
    return weights


def kquant_models(llama_cpp, work, bin_dir):
    """The generated Llamas quantized by llama-quantize, as tests/data/gguf/<model>.json."""
    import subprocess

    from safetensors.numpy import save_file

    for name, quants in K_MODELS.items():
        model = os.path.join(work, name)
        shutil.copytree(os.path.join(MODELS_DIR, name), model)
        with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        save_file(kquant_weights(config), os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
        f32 = os.path.join(work, f"{name}-f32.gguf")
        convert(llama_cpp, model, "f32", f32)
        files = {}
        for ours in quants:
            theirs, pure = K_QUANTS[ours]
            out = os.path.join(work, f"{name}-{ours}.gguf")
            args = [os.path.join(bin_dir, "llama-quantize")] + (["--pure"] if pure else []) + [f32, out, theirs]
            subprocess.run(args, check=True, capture_output=True)
            files[ours] = describe(out)
        path = os.path.join(GGUF_DIR, f"{name}.json")
        with open(path, "w") as f:
            json.dump({"converter": CONVERTER, "quantizer": "llama-quantize of the converter's f32 file",
                       "files": files}, f, indent=1)
            f.write("\n")
        print(f"wrote {path}")


def sparse_qwen3_moe():
    """tests/data/models/tiny-qwen3-moe-sparse (written once): a Qwen 3-MoE whose every layer is sparse, as llama.cpp's
    `qwen3moe` requires (the tests' tiny-qwen3-moe has a dense layer), random weights from transformers' own
    initialization (seed 47)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = os.path.join(MODELS_DIR, "tiny-qwen3-moe-sparse")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(47)
    Qwen3MoeForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    shutil.copy(os.path.join(MODELS_DIR, "tiny-qwen3-moe", "tokenizer.json"), folder)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))


SPM_CORPUS = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! The five boxing wizards jump quickly. Sphinx of black quartz, judge my vow.
Training a small model is a good way to test the whole road from data to a file that runs elsewhere.
"""


def spm_llama():
    """tests/data/models/tiny-llama-spm (written once): a Llama config with a SentencePiece tokenizer as Llama 2's
    and Mistral's are — a BPE `tokenizer.model` with byte fallback (320 pieces: control, user-defined and byte pieces
    among them), and transformers' `tokenizer.json` / `tokenizer_config.json` converted from it. Its weights are
    `kquant_weights`' (not stored)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    folder = os.path.join(MODELS_DIR, "tiny-llama-spm")
    if os.path.exists(os.path.join(folder, "tokenizer.model")):
        return
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        corpus = os.path.join(work, "corpus.txt")
        with open(corpus, "w") as f:
            f.write(SPM_CORPUS * 20)
        spm.SentencePieceTrainer.train(
            input=corpus, model_prefix=os.path.join(work, "tok"), vocab_size=320, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<tool>"], control_symbols=["<ctl>"],
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True, normalization_rule_name="identity",
            split_digits=True, remove_extra_whitespaces=False, minloglevel=2,
        )
        tokenizer = LlamaTokenizerFast(vocab_file=os.path.join(work, "tok.model"), legacy=False)
        tokenizer.save_pretrained(folder)
    os.remove(os.path.join(folder, "special_tokens_map.json"))
    with open(os.path.join(MODELS_DIR, "kquant-llama", "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=320)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def spm_golden(llama_cpp, work):
    """The converter's files of tiny-llama-spm (its SentencePiece vocabulary: tokens, scores, types) in f32 and
    q8_0, as tests/data/gguf/tiny-llama-spm.json."""
    from safetensors.numpy import save_file

    name = "tiny-llama-spm"
    model = os.path.join(work, name)
    shutil.copytree(os.path.join(MODELS_DIR, name), model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    save_file(kquant_weights(config), os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    files = {}
    for outtype in ["f32", "q8_0"]:
        out = os.path.join(work, f"{name}-{outtype}.gguf")
        convert(llama_cpp, model, outtype, out)
        files[outtype] = describe(out)
    path = os.path.join(GGUF_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"converter": CONVERTER, "files": files}, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


def generate():
    os.makedirs(GGUF_DIR, exist_ok=True)
    sparse_qwen3_moe()
    spm_llama()
    with tempfile.TemporaryDirectory() as work:
        llama_cpp = fetch_converter(work)
        for name, (types, adapter_name) in MODELS.items():
            model = os.path.join(work, name)
            shutil.copytree(os.path.join(MODELS_DIR, name), model)
            with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
                json.dump(TOKENIZER_CONFIGS.get(name, {"tokenizer_class": "PreTrainedTokenizerFast"}), f)
            adapter = None
            if adapter_name:
                adapter = os.path.join(work, adapter_name)
                shutil.copytree(os.path.join(PEFT_DIR, adapter_name), adapter)
            files, adapter_files = {}, {}
            for outtype in types:
                out = os.path.join(work, f"{name}-{outtype}.gguf")
                convert(llama_cpp, model, outtype, out)
                files[outtype] = describe(out)
                if adapter:
                    out = os.path.join(work, f"{adapter_name}-{outtype}.gguf")
                    convert(llama_cpp, model, outtype, out, adapter)
                    adapter_files[outtype] = describe(out)
            path = os.path.join(GGUF_DIR, f"{name}.json")
            with open(path, "w") as f:
                record = {"converter": CONVERTER, "files": files}
                if adapter:
                    record["adapter"] = adapter_name
                    record["adapter_files"] = adapter_files
                json.dump(record, f, indent=1)
                f.write("\n")
            print(f"wrote {path}")
        quantized = quants(llama_cpp)
        bin_dir = llama_cpp_tools(llama_cpp)
        quantized.update(k_quants(bin_dir))
        kquant_models(llama_cpp, work, bin_dir)
        spm_golden(llama_cpp, work)
    with open(QUANTS_OUT, "w") as f:
        quantizers = "gguf-py 0.19.0 and, for k-quants, libggml-base (llama.cpp 0c1e5709)"
        json.dump({"quantizers": quantizers, **quantized}, f, indent=1)
        f.write("\n")
    print(f"wrote {QUANTS_OUT}")


if __name__ == "__main__":
    if sys.argv[1:] != ["generate"]:
        sys.exit(__doc__)
    generate()
