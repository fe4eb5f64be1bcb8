#!/usr/bin/env python3
"""Golden files for candle-qlora's 4-bit quantization, produced by bitsandbytes itself.

Versions used for the committed files: torch 2.15.0, bitsandbytes 0.50.2, transformers 5.23.0 (CPU).
    pip install torch==2.15.0 bitsandbytes==0.50.2 transformers==5.23.0 safetensors numpy

Usage:
    python3 scripts/golden_quant.py generate            # writes tests/data/quant/*.safetensors
    python3 scripts/golden_quant.py check-ours QLORA    # runs `QLORA quantize` on a tiny Llama folder and checks that
                                                        # transformers + bitsandbytes load it, bit-identical to their own

Determinism: torch runs single-threaded with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), so `absmax.mean()` (the
double-quantization offset) and `create_dynamic_map` are reproducible on any x86-64 host with AVX2.

What each case file holds (tensor names):
    input                      the weight, in its dtype
    cpu.packed / cpu.absmax    bitsandbytes' CPU backend output of quantize_4bit (absmax: f32, or u8 codes if nested)
    cpu.nested_absmax / cpu.nested_quant_map / cpu.offset    double quantization (nested cases)
    cpu.dequant                that state dequantized to the input dtype by bitsandbytes' reference implementation
                               (default backend `_dequantize_4bit_compute`). Its native CPU kernel is not used: on
                               AVX-512 hosts (0.50.2) it indexes absmax per row (`row * (cols / blocksize)`), which is
                               wrong whenever blocks do not align with rows (cols % blocksize != 0 or blocksize > cols);
                               the mismatch counts are recorded in manifest.json
    cuda.packed / cuda.absmax  a numpy emulation of bitsandbytes' CUDA kernels (kQuantizeBlockwise + dQuantize),
                               cross-checked here against bitsandbytes' default backend (identical except at exact
                               float32 midpoints, which are counted and must be 0 for these inputs)
  metadata: quant_type, blocksize, double_quant, dtype, shape
"""
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "quant")

NF4_MIDS = None


def cuda_search(code, x):
    """bitsandbytes' CUDA dQuantize<0> binary search, vectorized over x (float32)."""
    code = code.astype(np.float32)
    x = x.astype(np.float32)
    pivot = np.full(x.shape, 127, dtype=np.int64)
    upper_pivot = np.full(x.shape, 255, dtype=np.int64)
    lower_pivot = np.zeros(x.shape, dtype=np.int64)
    lower = np.full(x.shape, -1.0 if code[0] < 0 else 0.0, dtype=np.float32)
    upper = np.ones(x.shape, dtype=np.float32)
    val = code[pivot]
    for step in [64, 32, 16, 8, 4, 2, 1]:
        gt = x > val
        lower_pivot = np.where(gt, pivot, lower_pivot)
        lower = np.where(gt, val, lower)
        upper_pivot = np.where(gt, upper_pivot, pivot)
        upper = np.where(gt, upper, val)
        pivot = np.where(gt, pivot + step, pivot - step)
        val = code[pivot]
    upper = np.where(upper_pivot == 255, code[255], upper)
    lower = np.where(lower_pivot == 0, code[0], lower)
    gt = x > val
    up_mid = ((upper + val) * np.float32(0.5)).astype(np.float32)
    lo_mid = ((lower + val) * np.float32(0.5)).astype(np.float32)
    res = np.where(gt, np.where(x > up_mid, upper_pivot, pivot), np.where(x < lo_mid, lower_pivot, pivot))
    return res.astype(np.uint8)


def cuda_tree_4bit(quant_type, x):
    """The CUDA dQuantizeNF4 / dQuantizeFP4 trees (NaN -> 0)."""
    x = x.astype(np.float32)
    if quant_type == "nf4":
        code = F.get_4bit_type("nf4", device="cpu").numpy()
        mids = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
        q = (mids[None, :] < x[:, None]).sum(axis=1)
        return np.where(np.isnan(x), 0, q).astype(np.uint8)
    sign = np.where(x < 0, 8, 0)
    a = np.abs(x)
    t = [np.float32(v) for v in (0.29166667, 0.583333, 0.8333333, 0.4166667, 0.0859375, 0.20833333, 0.00260417)]
    mag = np.where(
        a > t[0],
        np.where(a > t[1], np.where(a > t[2], 3, 2), np.where(a > t[3], 5, 4)),
        np.where(a > t[4], np.where(a > t[5], 7, 6), np.where(a > t[6], 1, 0)),
    )
    return (sign | mag).astype(np.uint8)


def cuda_quantize(w, quant_type, blocksize, double_quant, offset):
    """Emulates bitsandbytes' CUDA quantize_4bit (+ nested quantize_blockwise) on float32 values."""
    flat = w.reshape(-1).float().numpy()
    n = flat.size
    blocks = -(-n // blocksize)
    padded = np.zeros(blocks * blocksize, dtype=np.float32)
    padded[:n] = flat
    pb = padded.reshape(blocks, blocksize)
    absmax = np.abs(pb).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = (np.float32(1.0) / absmax).astype(np.float32)
        scaled = (pb * inv[:, None]).astype(np.float32).reshape(-1)
    codes = cuda_tree_4bit(quant_type, scaled)
    if n % 2:
        codes = codes[: n + 1]
    else:
        codes = codes[:n]
    packed = (codes[0::2] << 4) | codes[1::2]
    result = {"cuda.packed": torch.from_numpy(packed.reshape(-1, 1).copy())}
    if not double_quant:
        result["cuda.absmax"] = torch.from_numpy(absmax)
        return result, 0
    centered = (absmax - np.float32(offset)).astype(np.float32)
    nb = -(-centered.size // 256)
    cp = np.zeros(nb * 256, dtype=np.float32)
    cp[: centered.size] = centered
    cp = cp.reshape(nb, 256)
    amax2 = np.abs(cp).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv2 = (np.float32(1.0) / amax2).astype(np.float32)
        sc = (cp * inv2[:, None]).astype(np.float32).reshape(-1)[: centered.size]
    code = F.create_dynamic_map(signed=True).numpy().astype(np.float32)
    qa = cuda_search(code, sc)
    # Cross-check against bitsandbytes' default backend (bucketize on midpoints = nearest, ties low).
    mids = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
    ties = int(np.isin(sc, mids).sum())
    nearest = np.searchsorted(mids, sc, side="left").astype(np.uint8)
    finite = np.isfinite(sc)
    mismatch = int((nearest[finite] != qa[finite]).sum())
    assert mismatch <= ties, f"CUDA search emulation disagrees with bucketize at {mismatch} non-tie values"
    result["cuda.absmax"] = torch.from_numpy(qa)
    result["cuda.nested_absmax"] = torch.from_numpy(amax2)
    return result, ties


def reference_dequant(packed, state):
    """bitsandbytes' reference 4-bit dequantization (default backend), with the absmax as dequantize_4bit makes it."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
        absmax = absmax.float()
    return compute(packed.reshape(-1).view(torch.uint8), absmax, state.code, state.blocksize, state.shape, state.dtype)


def native_mismatches(packed, state, reference):
    """Elements where bitsandbytes' native CPU dequantize_4bit differs from its reference implementation."""
    native = F.dequantize_4bit(packed, state)
    return int((native.float() != reference.float()).sum())


def make_input(shape, dtype, seed, zero_rows=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
    # A few outliers, as real weights have, so blocks have different absmax.
    idx = torch.randint(0, w.numel(), (max(1, w.numel() // 500),), generator=g)
    w.view(-1)[idx] *= 8
    for r in zero_rows:
        w[r] = 0
    return w.to(dtype)


CASES = [
    # name, shape, dtype, quant_type, blocksize, double_quant, zero_rows
    ("nf4_f32_128x128_b64_dq", (128, 128), torch.float32, "nf4", 64, True, ()),
    ("nf4_bf16_128x128_b64_dq", (128, 128), torch.bfloat16, "nf4", 64, True, ()),
    ("nf4_f16_128x128_b64", (128, 128), torch.float16, "nf4", 64, False, ()),
    ("nf4_f32_7x9_b64", (7, 9), torch.float32, "nf4", 64, False, ()),
    ("nf4_bf16_7x9_b64_dq", (7, 9), torch.bfloat16, "nf4", 64, True, ()),
    ("nf4_f16_33x65_b128_dq", (33, 65), torch.float16, "nf4", 128, True, ()),
    ("nf4_bf16_16x4096_b4096_dq", (16, 4096), torch.bfloat16, "nf4", 4096, True, ()),
    ("nf4_bf16_64x4096_b64_dq", (64, 4096), torch.bfloat16, "nf4", 64, True, ()),
    ("nf4_f32_8x128_b64_dq_zero_blocks", (8, 128), torch.float32, "nf4", 64, True, (1, 2, 5)),
    ("nf4_f32_8x128_b32", (8, 128), torch.float32, "nf4", 32, False, (3,)),
    ("fp4_f32_64x96_b64_dq", (64, 96), torch.float32, "fp4", 64, True, ()),
    ("fp4_bf16_7x9_b128", (7, 9), torch.bfloat16, "fp4", 128, False, ()),
    ("fp4_f16_32x256_b4096_dq_zero_blocks", (32, 256), torch.float16, "fp4", 4096, True, (0,)),
]


def generate():
    os.makedirs(OUT, exist_ok=True)
    manifest = {"torch": torch.__version__, "bitsandbytes": bnb.__version__, "cases": []}
    for i, (name, shape, dtype, qt, bs, dq, zero_rows) in enumerate(CASES):
        w = make_input(shape, dtype, seed=1000 + i, zero_rows=zero_rows)
        packed, state = F.quantize_4bit(w, blocksize=bs, compress_statistics=dq, quant_type=qt)
        deq = reference_dequant(packed, state)
        assert deq.dtype == dtype and tuple(deq.shape) == shape
        bad_native = native_mismatches(packed, state, deq)
        t = {"input": w.contiguous(), "cpu.packed": packed.contiguous(), "cpu.dequant": deq.contiguous()}
        offset = 0.0
        if dq:
            t["cpu.absmax"] = state.absmax
            t["cpu.nested_absmax"] = state.state2.absmax
            t["cpu.nested_quant_map"] = state.state2.code
            t["cpu.offset"] = state.offset.reshape(1).float()
            offset = state.offset.item()
        else:
            t["cpu.absmax"] = state.absmax
        cuda, ties = cuda_quantize(w, qt, bs, dq, offset)
        t.update(cuda)
        meta = {"quant_type": qt, "blocksize": str(bs), "double_quant": str(dq).lower(), "dtype": str(dtype)[6:],
                "shape": json.dumps(list(shape))}
        save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(OUT, f"{name}.safetensors"), metadata=meta)
        manifest["cases"].append({"name": name, "cuda_midpoint_ties": ties, "bnb_native_cpu_dequant_mismatches": bad_native})
        print(f"{name}: {w.numel()} elements, {packed.numel()} packed bytes, ties={ties}, native mismatches={bad_native}")

    # torch's float32 mean (the double-quant offset) on long vectors, to pin the summation order.
    g = torch.Generator().manual_seed(7)
    sums = {}
    for n in [1, 7, 8, 31, 32, 33, 1000, 4096, 70001]:
        v = (torch.rand(n, generator=g) * 0.1).float()
        sums[f"v{n}"] = v
        sums[f"mean{n}"] = v.mean().reshape(1)
    save_file(sums, os.path.join(OUT, "torch_mean.safetensors"))

    # A bitsandbytes-written layer checkpoint (Linear4bit state dict, packed quant state) for the loader test.
    torch.manual_seed(3)
    for qt in ["nf4", "fp4"]:
        lin = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16)
        q = bnb.nn.Linear4bit(96, 64, bias=True, compute_dtype=torch.bfloat16, compress_statistics=(qt == "nf4"),
                              quant_type=qt)
        q.load_state_dict(lin.state_dict())
        q = q.to("cpu")
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, compress_statistics=(qt == "nf4"),
                                      quant_type=qt, blocksize=64)._quantize("cpu")
        sd = {f"model.layers.0.mlp.up_proj.{k}": v.contiguous() for k, v in q.state_dict().items()}
        sd["expected.dequant"] = reference_dequant(q.weight.data, q.weight.quant_state).contiguous()
        sd["expected.input"] = lin.weight.data.contiguous()
        save_file(sd, os.path.join(OUT, f"bnb_linear4bit_{qt}.safetensors"), metadata={"format": "pt"})
        print(f"bnb_linear4bit_{qt}: keys {sorted(k for k in sd)}")
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


def tiny_llama_dir(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return model


def check_ours(qlora):
    """Our `qlora quantize` output loads in transformers + bitsandbytes and equals their own quantization."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as tmp:
        src, ours = os.path.join(tmp, "tiny"), os.path.join(tmp, "tiny-nf4")
        tiny_llama_dir(src)
        subprocess.run([qlora, "quantize", "--input", src, "--output", ours, "--kernels", "cpu"], check=True)
        loaded = AutoModelForCausalLM.from_pretrained(ours, device_map="cpu")
        bnb_cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                     bnb_4bit_compute_dtype=torch.bfloat16)
        theirs = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb_cfg, device_map="cpu")
        n = 0
        for (name, a), (_, b) in zip(loaded.named_modules(), theirs.named_modules()):
            if isinstance(a, bnb.nn.Linear4bit):
                assert isinstance(b, bnb.nn.Linear4bit), name
                assert torch.equal(a.weight.data, b.weight.data), f"{name}: packed codes differ"
                da = F.dequantize_4bit(a.weight.data, a.weight.quant_state)
                db = F.dequantize_4bit(b.weight.data, b.weight.quant_state)
                assert torch.equal(da, db), f"{name}: dequantized weights differ"
                n += 1
        assert n == 14, f"expected 14 quantized linears, found {n}"
        ids = torch.tensor([[1, 5, 9, 42, 7, 100]])
        with torch.no_grad():
            la, lb = loaded(ids).logits, theirs(ids).logits
        assert torch.equal(la, lb), f"logits differ: max {float((la - lb).abs().max())}"
        print(f"OK: transformers loaded {n} Linear4bit layers from our folder, byte- and logit-identical to bitsandbytes")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "generate":
        generate()
    elif len(sys.argv) == 3 and sys.argv[1] == "check-ours":
        check_ours(sys.argv[2])
    else:
        print(__doc__)
        sys.exit(2)
