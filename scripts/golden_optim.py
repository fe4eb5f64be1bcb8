#!/usr/bin/env python3
"""Golden files for candle-qlora's optimizers, gradient clipping and learning-rate schedules.

Versions used for the committed files: torch 2.15.0, bitsandbytes 0.50.2, transformers 5.23.0, numpy 2.4.6,
safetensors 0.8.0 (CPU only, Python 3.11).
    pip install torch==2.15.0 bitsandbytes==0.50.2 transformers==5.23.0 safetensors numpy

Usage:
    python3 scripts/golden_optim.py generate      # writes tests/data/optim/{adamw8bit,adamw32,sgd,clip}.safetensors
                                                  # and tests/data/optim/schedules.json

Determinism: torch runs single-threaded with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), inputs come from seeded torch
CPU generators, the 8-bit/32-bit kernel emulations are plain numpy float32 (every operation rounded to float32, no
FMA), and the safetensors headers are written with sorted metadata keys, so reruns are byte-identical.

Common hyper-parameters (float32 constants in the emulations): lr = 2e-3, betas = (0.9, 0.999), eps = 1e-8,
weight decay 0.0 (`wd0.`) or 0.01 (`wd001.`), 20 steps (step = 1..20), blocksize 256.
Inputs: p0 = randn(n) * 0.5, grads = randn(20, n) * 0.1 with max(1, n // 1000) outliers per step (x 30).
Special inputs:
    n = 5000: at the 7th update (row 6 of `grads.5000`) element 17 = NaN, 2600 = +Inf, 4999 = -Inf (tail block)
    n = 4096: block 7 (elements 1792..2047) has gradients randn * 1e-8 except element 1792 = 1.0 (exercises the
              sign fix: tiny negative first moments quantize to +0.0 and are moved to code 126)
    n = 8448: block 4 (elements 1024..1279) has zero gradient at every step (absmax stays 0, codes from 0/0 = NaN);
              block 5 (elements 1280..1535) has zero gradient from the 11th update on (rows 10..19)

adamw8bit.safetensors -- numpy emulation of bitsandbytes' CUDA kernel kOptimizerStatic8bit2StateBlockwise (AdamW8bit,
        csrc/kernels.cu), n in {1000, 4096, 5000, 8448} (the 8-bit kernel for every size, although bitsandbytes'
        default min_8bit_size=4096 would give n=1000 a 32-bit state):
    qmap1 / qmap2                   f32[256] create_dynamic_map(signed=True) / (signed=False) (the FMA/AVX2 tables)
    p0.<n>                          f32[n] initial parameters
    grads.<n>                       f32[20, n] gradient of update k in row k-1 (n=5000 contains NaN/+Inf/-Inf)
    wd0.p.<n>, wd001.p.<n>          f32[n] parameters after 20 updates (weight_decay 0.0 / 0.01)
    wd0.state1.<n>, ...state2.<n>   u8[n] final codes of the first (qmap1) and second (qmap2) moment
    wd0.absmax1.<n>, ...absmax2.<n> f32[ceil(n/256)] final block absmax values
    Initial state: codes 0, absmax 0 (as bitsandbytes initialises). Emulated operation order, all in float32:
        pow_k = f32(prod_{1..step} f64(beta_k)) (f64 loop), c1 = 1 - pow1, c2 = sqrt(1 - pow2),
        step_size = (-lr * c2) / c1
        tail block padded with g = 0, code1 = 128, code2 = 0 (padding takes part in the absmax reductions)
        finite g:  s2 = qmap2[c2]*absmax2; s2 = s2*beta2 + ((1-beta2)*g)*g
                   s1 = qmap1[c1]*absmax1; s1 = s1*beta1 + (1-beta1)*g
                   p = p + step_size * (s1 / (sqrt(s2) + c2*eps)); if wd > 0: p = p * (1 - lr*wd)
        non-finite g: s1 = s2 = 0, p unchanged
        absmax_k = max(-FLT_MAX, max |s_k| over the 256-block incl. padding)
        code1 = quantize_2D<1>(qmap1, s1 / absmax1), code2 = quantize_2D<0>(qmap2, s2 / absmax2)
        sign fix: if signbit(qmap1[code1]) != signbit(s1): code1 += 1 if s1 > 0 else -1 (u8 wrap-around)
    NOT emulated: __powf / __fdividef approximations and nvcc's default FMA contraction (--fmad=true), so real GPU
    results may differ from these by a few ulp (and then occasionally by one code).
  metadata: versions, hyper-parameters, `emulation_counts` (JSON, per run: float32 midpoint ties met by the search,
    sign fixes applied, sign fixes that wrapped the u8 code, NaN scaled values from 0/0 blocks -- the search is
    checked against round-to-nearest at every update), `bnb_cpu_comparison` (JSON): this emulation vs bitsandbytes'
    own CPU AdamW8bit (min_8bit_size=0, weight_decay=0, finite grads -- `grads_clean.5000` for n=5000); the CPU
    backend dequantizes/requantizes with its native quantize_blockwise (a lookup table that is not round-to-nearest
    for small scaled values, no sign fix) and uses f64 (1 - beta) constants, so they differ; statistics only, at
    steps 1, 2, 5, 20; `*_ordinary` leaves out the special blocks of n=4096 and n=8448;
    `cpu_formula_with_cuda_quantizer_step20`: the CPU backend's arithmetic with the CUDA requantization swapped in
    (agrees with this emulation to a few ulp with identical codes, so the quantizer is the whole difference).
    Kernel quirk visible in n=4096 block 7: a negative first moment below half of the smallest code is moved to
    code 126 (-5.5e-7 * absmax1) by the sign fix while the second moment quantizes to 0, so later updates are
    ~ step_size * m / (c2 * eps): these elements drift by up to +1.5 over 20 steps (faithful to the CUDA kernel).

adamw32.safetensors -- n in {1000, 5000}, p0 = `p0.<n>` of adamw8bit.safetensors, weight_decay 0.01, grads =
        `grads.1000` of adamw8bit.safetensors for n=1000 and `grads_clean.5000` (below) for n=5000:
    grads_clean.5000                f32[20, 5000] = adamw8bit `grads.5000` with the three non-finite entries
                                    replaced by their finite values before injection
    torch.p.<n>, torch.exp_avg.<n>, torch.exp_avg_sq.<n>
                                    torch.optim.AdamW(lr=2e-3, betas=(0.9,0.999), eps=1e-8, weight_decay=0.01,
                                    foreach=False) after 20 steps (decoupled decay applied BEFORE the update)
    bnb32.p.<n>, bnb32.state1.<n>, bnb32.state2.<n>
                                    numpy f32 emulation of bitsandbytes' CUDA kOptimizer32bit2State<ADAM>
                                    (decay applied AFTER the update): s1 = s1*beta1 + (1-beta1)*g;
                                    s2 = s2*beta2 + (1-beta2)*(g*g); p = p + step_size*(s1/(sqrt(s2) + eps*c2));
                                    if wd > 0: p = p*(1 - lr*wd); c1, c2, step_size as above (powf)
  metadata: versions, statistics of bnb32 vs torch and vs bitsandbytes' own CPU 32-bit AdamW (which decays before)

sgd.safetensors -- torch.optim.SGD(lr=0.05, momentum=0.9, dampening=0, weight_decay=0.01, nesterov=False,
        foreach=False), 20 steps, shape [16, 24]:
    p0, grads ([20, 16, 24]), p (final), momentum_buffer (final)

clip.safetensors -- torch.nn.utils.clip_grad_norm_(max_norm=1.0, norm_type=2) over three gradients of shapes
        [7, 13], [64], [3, 5, 11]; case `big` (pre-clip norm > 1) and `small` (norm < 1, grads unchanged):
    <case>.grad.<i>, <case>.clipped.<i>   (i = 0, 1, 2)
    <case>.total_norm                f32[1] the returned pre-clip total norm
    <case>.clip_coef                 f32[1] clamp(max_norm / (total_norm + 1e-6), max=1)
    <case>.total_norm_f64            f64[1] the exact norm computed in float64 (for tolerance checks)

schedules.json -- the learning rate of every optimizer update k = 1..total (scheduler.get_last_lr() before
        optimizer.step(), so update 1 uses lambda(0)), from transformers.get_scheduler with a torch SGD optimizer of
        base lr 2e-4, num_warmup_steps resolved by TrainingArguments(warmup_steps=...).get_warmup_steps(total) (>= 1:
        int count, < 1: ceil(total * ratio) in float64 -- linear (100, 0.07) resolves to 8). lr = base_lr * lambda
        in float64. Entries: type, kwargs (lr_scheduler_kwargs), total, warmup_arg, warmup (resolved), base_lr, lrs.
        get_scheduler ignores warmup/kwargs for `constant` and total/kwargs for `constant_with_warmup`.
"""
import json
import math
import os
import struct
import sys
import tempfile
import warnings

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import transformers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "optim")

f32 = np.float32
STEPS = 20
LR = 2e-3
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
BLOCK = 256
SIZES_8BIT = [1000, 4096, 5000, 8448]
SIZES_32BIT = [1000, 5000]
SPECIAL_BLOCKS = {4096: [(1792, 2048)], 8448: [(1024, 1536)]}  # excluded from the `_ordinary` comparison stats
NONFINITE = {"row": 6, "nan": 17, "pinf": 2600, "ninf": 4999}

# bitsandbytes 0.50.2 create_dynamic_map with torch 2.15's AVX2 (FMA) linspace: float32 bit patterns, index order.
# Copied from the reference spec (section 2.2); the generated tables must equal these.
QMAP1_HEX = """
bf7e3333 bf7a999a bf770000 bf736666 bf6fcccd bf6c3333 bf68999a bf650000 bf616666 bf5dcccd bf5a3333 bf56999a bf530000
bf4f6666 bf4bcccd bf483333 bf44999a bf410000 bf3d6666 bf39cccd bf363334 bf32999a bf2f0000 bf2b6666 bf27cccd bf243334
bf20999a bf1d0000 bf196666 bf15cccd bf123334 bf0e999a bf0b0000 bf076666 bf03cccc bf003333 bef93332 bef20000 beeacccc
bee3999a bedc6666 bed53333 bece0000 bec6cccc bebf999a beb86666 beb13333 beaa0000 bea2cccc be9b999a be946666 be8d3334
be860000 be7d9999 be6f3333 be60cccd be526666 be440000 be35999a be273333 be18cccd be0a6666 bdf80000 bddb3334 bdc9eb85
bdc428f7 bdbe6667 bdb8a3d7 bdb2e148 bdad1eb8 bda75c2a bda1999a bd9bd70a bd96147b bd9051eb bd8a8f5d bd84cccd bd7e147b
bd728f5d bd670a3d bd5b851f bd500000 bd447ae1 bd38f5c3 bd2d70a3 bd21eb85 bd166667 bd0ae148 bcfeb852 bce7ae15 bcd0a3d7
bcb9999a bca28f5d bc8b851f bc68f5c3 bc3ae148 bc1f3b64 bc160418 bc0ccccd bc039581 bbf4bc6a bbe24dd3 bbcfdf3b bbbd70a4
bbab020d bb989374 bb8624dd bb676c8a bb428f5c bb1db22d baf1a9fc baa7ef9d ba7765ff ba59e83e ba3c6a80 ba1eecc1 ba016f01
b9c7e283 b98ce705 b923d70b b8ba1f4b b88aefb3 b8378034 b7b24206 b70205ff b65a1a94 b513a3b7 00000000 3513a3b7 365a1a94
370205ff 37b24206 38378034 388aefb3 38ba1f4b 3923d70b 398ce705 39c7e283 3a016f01 3a1eecc1 3a3c6a80 3a59e83e 3a7765ff
3aa7ef9d 3af1a9fc 3b1db22d 3b428f5c 3b676c8a 3b8624dd 3b989374 3bab020d 3bbd70a4 3bcfdf3b 3be24dd3 3bf4bc6a 3c039581
3c0ccccd 3c160418 3c1f3b64 3c3ae148 3c68f5c3 3c8b851f 3ca28f5d 3cb9999a 3cd0a3d7 3ce7ae15 3cfeb852 3d0ae148 3d166667
3d21eb85 3d2d70a3 3d38f5c3 3d447ae1 3d500000 3d5b851f 3d670a3d 3d728f5d 3d7e147b 3d84cccd 3d8a8f5d 3d9051eb 3d96147b
3d9bd70a 3da1999a 3da75c2a 3dad1eb8 3db2e148 3db8a3d7 3dbe6667 3dc428f7 3dc9eb85 3ddb3334 3df80000 3e0a6666 3e18cccd
3e273333 3e35999a 3e440000 3e526666 3e60cccd 3e6f3333 3e7d9999 3e860000 3e8d3334 3e946666 3e9b999a 3ea2cccc 3eaa0000
3eb13333 3eb86666 3ebf999a 3ec6cccc 3ece0000 3ed53333 3edc6666 3ee3999a 3eeacccc 3ef20000 3ef93332 3f003333 3f03cccc
3f076666 3f0b0000 3f0e999a 3f123334 3f15cccd 3f196666 3f1d0000 3f20999a 3f243334 3f27cccd 3f2b6666 3f2f0000 3f32999a
3f363334 3f39cccd 3f3d6666 3f410000 3f44999a 3f483333 3f4bcccd 3f4f6666 3f530000 3f56999a 3f5a3333 3f5dcccd 3f616666
3f650000 3f68999a 3f6c3333 3f6fcccd 3f736666 3f770000 3f7a999a 3f7e3333 3f800000
"""
QMAP2_HEX = """
00000000 34ae7baa 35500998 360e9b38 3692ccf6 36de4c51 3714e5d5 3783126e 37e171a0 381fe868 384f1800 387e479a 3896bb99
38ae5364 38c5eb31 3906594b 394154ca 397c5049 399ba5e4 39b923a2 39d6a163 39f41f22 3a08ce71 3a178d50 3a264c30 3a350b10
3a43c9ef 3a5288d0 3a6147af 3a70068e 3a7ec56e 3a958106 3aba5e35 3adf3b64 3b020c4a 3b147ae1 3b26e978 3b395810 3b4bc6a7
3b5e3540 3b70a3d7 3b818937 3b8ac082 3b93f7cf 3b9d2f1a 3ba66666 3baf9db2 3bb8d4fd 3bc20c4a 3bcb4395 3bd47ae1 3bddb22e
3be6e978 3bf020c5 3bf9580f 3c0147ae 3c05e354 3c0a7ef9 3c0f1aa0 3c13b645 3c1851eb 3c1ced92 3c218937 3c2f5c2a 3c466667
3c5d70a3 3c747ae2 3c85c28f 3c9147af 3c9ccccd 3ca851eb 3cb3d70b 3cbf5c29 3ccae147 3cd66667 3ce1eb87 3ced70a3 3cf8f5c3
3d023d70 3d080000 3d0dc28f 3d13851f 3d1947af 3d1f0a3d 3d24cccd 3d2a8f5c 3d3051eb 3d36147b 3d3bd70a 3d41999a 3d475c28
3d4d1eb8 3d52e147 3d58a3d7 3d5e6667 3d6428f7 3d69eb87 3d6fae15 3d7570a3 3d7b3333 3d807ae2 3d835c2a 3d863d71 3d891eb8
3d8c0000 3d8ee148 3d91c290 3d94a3d7 3d97851f 3d9a6667 3d9d47af 3da028f6 3da30a3e 3da5eb85 3da8cccd 3dabae15 3dae8f5c
3db170a4 3db451eb 3db73333 3dba147b 3dbcf5c3 3dbfd70b 3dc2b852 3dc5999a 3dc87ae2 3dcb5c29 3dd40000 3de26666 3df0cccd
3dff3333 3e06cccc 3e0e0000 3e153334 3e1c6666 3e23999a 3e2acccc 3e320000 3e393334 3e406666 3e47999a 3e4ecccc 3e560000
3e5d3334 3e646666 3e6b999a 3e72cccc 3e7a0000 3e809999 3e843333 3e87cccd 3e8b6666 3e8f0000 3e92999a 3e963333 3e99cccc
3e9d6666 3ea10000 3ea4999a 3ea83333 3eabcccc 3eaf6666 3eb30000 3eb6999a 3eba3333 3ebdcccc 3ec16666 3ec50000 3ec8999a
3ecc3333 3ecfcccc 3ed36666 3ed70000 3eda999a 3ede3333 3ee1cccc 3ee56666 3ee90000 3eec999a 3ef03333 3ef3cccc 3ef76666
3efb0000 3efe9999 3f01199a 3f02e666 3f04b333 3f068000 3f084ccc 3f0a199a 3f0be666 3f0db334 3f0f8000 3f114ccd 3f13199a
3f14e666 3f16b334 3f188000 3f1a4ccd 3f1c199a 3f1de666 3f1fb334 3f218000 3f234ccd 3f25199a 3f26e666 3f28b334 3f2a8000
3f2c4ccd 3f2e199a 3f2fe666 3f31b334 3f338000 3f354ccd 3f37199a 3f38e666 3f3ab334 3f3c8000 3f3e4ccd 3f40199a 3f41e666
3f43b334 3f458000 3f474ccc 3f49199a 3f4ae666 3f4cb334 3f4e8000 3f504ccc 3f52199a 3f53e666 3f55b334 3f578000 3f594ccc
3f5b199a 3f5ce666 3f5eb334 3f608000 3f624ccc 3f64199a 3f65e666 3f67b334 3f698000 3f6b4ccc 3f6d199a 3f6ee666 3f70b334
3f728000 3f744ccc 3f76199a 3f77e666 3f79b334 3f7b8000 3f7d4ccc 3f7f199a 3f800000
"""


def versions():
    return {"torch": torch.__version__, "bitsandbytes": bnb.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "safetensors": safetensors.__version__}


def save_sorted(tensors, path, metadata):
    """safetensors' save_file with the header's metadata keys sorted, so reruns are byte-identical."""
    data = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


# ---------------------------------------------------------------------------------------------------- quant maps

def qmaps():
    q1 = F.create_dynamic_map(signed=True).numpy().astype(f32)
    q2 = F.create_dynamic_map(signed=False).numpy().astype(f32)
    for q, hx, name in [(q1, QMAP1_HEX, "signed"), (q2, QMAP2_HEX, "unsigned")]:
        ref = np.array([int(h, 16) for h in hx.split()], dtype=np.uint32).view(f32)
        assert ref.size == 256
        assert np.array_equal(q.view(np.uint32), ref.view(np.uint32)), f"{name} dynamic map != spec FMA table"
    nested = os.path.join(ROOT, "tests", "data", "quant", "nf4_f32_128x128_b64_dq.safetensors")
    if os.path.exists(nested):
        with safetensors.safe_open(nested, "pt") as f:
            nq = f.get_tensor("cpu.nested_quant_map").numpy()
        assert np.array_equal(nq.view(np.uint32), q1.view(np.uint32)), "signed map != golden_quant nested_quant_map"
    return q1, q2


def quantize_2d(code, x, signed):
    """bitsandbytes' CUDA quantize_2D<SIGNED> binary search (no code[0]/code[255] adjustment; NaN -> 0)."""
    x = x.astype(f32)
    pivot = np.full(x.shape, 127, dtype=np.int64)
    upper_pivot = np.full(x.shape, 255, dtype=np.int64)
    lower_pivot = np.zeros(x.shape, dtype=np.int64)
    lower = np.full(x.shape, -1.0 if signed else 0.0, dtype=f32)
    upper = np.ones(x.shape, dtype=f32)
    val = code[pivot]
    for step in [64, 32, 16, 8, 4, 2, 1]:
        gt = x > val
        lower_pivot = np.where(gt, pivot, lower_pivot)
        lower = np.where(gt, val, lower)
        upper_pivot = np.where(gt, upper_pivot, pivot)
        upper = np.where(gt, upper, val)
        pivot = np.where(gt, pivot + step, pivot - step)
        val = code[pivot]
    gt = x > val
    up_mid = ((upper + val).astype(f32) * f32(0.5)).astype(f32)
    lo_mid = ((lower + val).astype(f32) * f32(0.5)).astype(f32)
    res = np.where(gt, np.where(x > up_mid, upper_pivot, pivot), np.where(x < lo_mid, lower_pivot, pivot))
    return res.astype(np.uint8)


def check_search(code, x, got):
    """quantize_2D must equal round-to-nearest with float32 midpoints except at exact midpoints; returns #ties."""
    mids = ((code[:-1] + code[1:]).astype(f32) * f32(0.5)).astype(f32)
    ok = ~np.isnan(x)
    ties = np.isin(x, mids) & ok
    nearest = np.searchsorted(mids, x, side="left")
    bad = ok & ~ties & (nearest != got)
    assert not bad.any(), f"quantize_2D emulation != nearest at {int(bad.sum())} non-tie values"
    return int(ties.sum())


# ---------------------------------------------------------------------------------------------------- emulations

def corrections(step):
    """f32 bias corrections: beta^step as an f64 product loop, rounded to f32."""
    pw1, pw2 = 1.0, 1.0
    for _ in range(step):
        pw1 *= float(f32(BETA1))
        pw2 *= float(f32(BETA2))
    c1 = f32(f32(1.0) - f32(pw1))
    c2 = f32(np.sqrt(f32(f32(1.0) - f32(pw2))))
    step_size = f32(f32(f32(-f32(LR)) * c2) / c1)
    return c1, c2, step_size


class Adam8bitBlockwise:
    """kOptimizerStatic8bit2StateBlockwise<float, ADAM, 256, 1> in numpy float32."""

    def __init__(self, n, q1, q2, weight_decay):
        self.n, self.q1, self.q2, self.wd = n, q1, q2, f32(weight_decay)
        self.nb = -(-n // BLOCK)
        self.state1 = np.zeros(n, dtype=np.uint8)
        self.state2 = np.zeros(n, dtype=np.uint8)
        self.absmax1 = np.zeros(self.nb, dtype=f32)
        self.absmax2 = np.zeros(self.nb, dtype=f32)
        self.step = 0
        self.counts = {"ties": 0, "sign_fixes": 0, "sign_fix_wraps": 0, "nan_scaled": 0}

    def update(self, p, g):
        self.step += 1
        n, nb = self.n, self.nb
        b1, b2, eps, lr = f32(BETA1), f32(BETA2), f32(EPS), f32(LR)
        c1, c2, step_size = corrections(self.step)
        pad = nb * BLOCK
        gp = np.zeros(pad, dtype=f32)
        gp[:n] = g
        c1s = np.full(pad, 128, dtype=np.uint8)
        c1s[:n] = self.state1
        c2s = np.zeros(pad, dtype=np.uint8)
        c2s[:n] = self.state2
        gp, c1s, c2s = gp.reshape(nb, BLOCK), c1s.reshape(nb, BLOCK), c2s.reshape(nb, BLOCK)
        finite = np.isfinite(gp)
        gz = np.where(finite, gp, f32(0)).astype(f32)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            s2 = (self.q2[c2s] * self.absmax2[:, None]).astype(f32)
            s2 = ((s2 * b2).astype(f32) + ((f32(f32(1) - b2) * gz).astype(f32) * gz).astype(f32)).astype(f32)
            s1 = (self.q1[c1s] * self.absmax1[:, None]).astype(f32)
            s1 = ((s1 * b1).astype(f32) + (f32(f32(1) - b1) * gz).astype(f32)).astype(f32)
            s1 = np.where(finite, s1, f32(0)).astype(f32)
            s2 = np.where(finite, s2, f32(0)).astype(f32)
            am1 = np.maximum(np.float32(-np.finfo(f32).max), np.abs(s1).max(axis=1)).astype(f32)
            am2 = np.maximum(np.float32(-np.finfo(f32).max), np.abs(s2).max(axis=1)).astype(f32)
            # parameters (real elements only)
            denom = (np.sqrt(s2) + f32(c2 * eps)).astype(f32)
            upd = (step_size * (s1 / denom).astype(f32)).astype(f32).reshape(-1)[:n]
            fin = finite.reshape(-1)[:n]
            newp = np.where(fin, (p + upd).astype(f32), p).astype(f32)
            if self.wd > 0:
                decay = f32(f32(1) - f32(lr * self.wd))
                newp = np.where(fin, (newp * decay).astype(f32), newp).astype(f32)
            # requantize
            x1 = (s1 / am1[:, None]).astype(f32)
            x2 = (s2 / am2[:, None]).astype(f32)
            q1c = quantize_2d(self.q1, x1, True)
            q2c = quantize_2d(self.q2, x2, False)
        real = (np.arange(nb * BLOCK) < n).reshape(nb, BLOCK)
        self.counts["ties"] += check_search(self.q1, x1[real], q1c[real]) + check_search(self.q2, x2[real], q2c[real])
        self.counts["nan_scaled"] += int(np.isnan(x1[real]).sum() + np.isnan(x2[real]).sum())
        fix = np.signbit(self.q1[q1c]) != np.signbit(s1)
        self.counts["sign_fixes"] += int((fix & real).sum())
        wrap = ((q1c == 0) & ~(s1 > 0)) | ((q1c == 255) & (s1 > 0))
        self.counts["sign_fix_wraps"] += int((fix & real & wrap).sum())
        q1c = np.where(fix, np.where(s1 > 0, q1c.astype(np.int64) + 1, q1c.astype(np.int64) - 1) % 256,
                       q1c).astype(np.uint8)
        self.absmax1, self.absmax2 = am1, am2
        self.state1 = q1c.reshape(-1)[:n].copy()
        self.state2 = q2c.reshape(-1)[:n].copy()
        return newp

    def dequant(self):
        blk = np.arange(self.n) // BLOCK
        m = (self.q1[self.state1] * self.absmax1[blk]).astype(f32)
        v = (self.q2[self.state2] * self.absmax2[blk]).astype(f32)
        return m, v


def bnb32_emulate(p0, grads, weight_decay):
    """kOptimizer32bit2State<float, ADAM> (update_scale 1, gnorm_scale 1, skip_zeros false) in numpy float32."""
    b1, b2, eps, lr, wd = f32(BETA1), f32(BETA2), f32(EPS), f32(LR), f32(weight_decay)
    p = p0.astype(f32).copy()
    s1 = np.zeros_like(p)
    s2 = np.zeros_like(p)
    for k in range(grads.shape[0]):
        g = grads[k].astype(f32)
        c1, c2, step_size = corrections(k + 1)
        s1 = ((s1 * b1).astype(f32) + (f32(f32(1) - b1) * g).astype(f32)).astype(f32)
        s2 = ((s2 * b2).astype(f32) + (f32(f32(1) - b2) * (g * g).astype(f32)).astype(f32)).astype(f32)
        denom = (np.sqrt(s2) + f32(eps * c2)).astype(f32)
        p = (p + (f32(f32(1) * step_size) * (s1 / denom).astype(f32)).astype(f32)).astype(f32)
        if wd > 0:
            p = (p * f32(f32(1) - f32(lr * wd))).astype(f32)
    return p, s1, s2


# ---------------------------------------------------------------------------------------------------- inputs

def make_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g, dtype=torch.float32) * 0.5
    grads = torch.randn(STEPS, n, generator=g, dtype=torch.float32) * 0.1
    k = max(1, n // 1000)
    for s in range(STEPS):
        idx = torch.randint(0, n, (k,), generator=g)
        grads[s, idx] *= 30
    if n == 4096:
        # tiny gradients next to one large one: |s1| / absmax1 falls below half of the smallest code, so negative
        # moments round to +0.0 and the sign fix moves them to code 126
        grads[:, 1792:2048] = torch.randn(STEPS, 256, generator=g) * 1e-8
        grads[:, 1792] = 1.0
    if n == 8448:
        grads[:, 1024:1280] = 0
        grads[10:, 1280:1536] = 0
    return p0.numpy(), grads.numpy()


def with_nonfinite(grads):
    g = grads.copy()
    r = NONFINITE["row"]
    g[r, NONFINITE["nan"]] = np.nan
    g[r, NONFINITE["pinf"]] = np.inf
    g[r, NONFINITE["ninf"]] = -np.inf
    return g


def stats_f(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    d = np.abs(a - b)
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "max_rel": float((d / np.maximum(np.abs(b), 1e-12)).max()), "equal_frac": float((a == b).mean())}


def bnb_cpu_8bit(p0, grads, steps):
    """bitsandbytes' own CPU AdamW8bit (weight_decay 0); returns the state after each step in `steps`."""
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = bnb.optim.AdamW8bit([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=0.0, min_8bit_size=0)
    out = {}
    for k in range(grads.shape[0]):
        p.grad = torch.from_numpy(grads[k].copy())
        opt.step()
        if k + 1 in steps:
            st = opt.state[p]
            out[k + 1] = {"p": p.detach().numpy().copy(), "state1": st["state1"].numpy().copy(),
                          "state2": st["state2"].numpy().copy(), "absmax1": st["absmax1"].numpy().copy(),
                          "absmax2": st["absmax2"].numpy().copy()}
    assert opt.state[p]["state1"].dtype == torch.uint8
    return out


def cpu_formula_cuda_quantizer(p0, grads, q1, q2):
    """bitsandbytes' CPU AdamW8bit arithmetic (torch ops, f64 constants, weight decay 0) with the CUDA requantization
    (padding, quantize_2D, sign fix) swapped in: isolates the quantizer as the cause of the CPU/CUDA difference."""
    n = p0.size
    nb = -(-n // BLOCK)
    p = torch.from_numpy(p0.copy())
    c1, c2 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    a1, a2 = torch.zeros(nb), torch.zeros(nb)
    tq1, tq2 = torch.from_numpy(q1), torch.from_numpy(q2)
    for k in range(grads.shape[0]):
        g = torch.from_numpy(grads[k].copy())
        s1 = torch.ops.bitsandbytes.dequantize_blockwise(c1, a1, tq1, BLOCK, torch.float32)
        s2 = torch.ops.bitsandbytes.dequantize_blockwise(c2, a2, tq2, BLOCK, torch.float32)
        s1.mul_(BETA1).add_(g, alpha=1.0 - BETA1)
        s2.mul_(BETA2).addcmul_(g, g, value=1.0 - BETA2)
        corr1, corr2 = 1.0 - BETA1 ** (k + 1), math.sqrt(1.0 - BETA2 ** (k + 1))
        p.addcdiv_(s1, (s2.sqrt() / corr2).add_(EPS), value=-LR / corr1)
        m = np.zeros(nb * BLOCK, dtype=f32)
        v = np.zeros(nb * BLOCK, dtype=f32)
        m[:n], v[:n] = s1.numpy(), s2.numpy()
        m[n:] = f32(q1[128] * a1.numpy()[-1] * f32(BETA1))  # the kernel's padding (negligible)
        m, v = m.reshape(nb, BLOCK), v.reshape(nb, BLOCK)
        am1, am2 = np.abs(m).max(axis=1), np.abs(v).max(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            k1 = quantize_2d(q1, (m / am1[:, None]).astype(f32), True).astype(np.int64)
            k2 = quantize_2d(q2, (v / am2[:, None]).astype(f32), False)
        fix = np.signbit(q1[k1]) != np.signbit(m)
        k1 = np.where(fix, np.where(m > 0, k1 + 1, k1 - 1) % 256, k1).astype(np.uint8)
        c1, c2 = torch.from_numpy(k1.reshape(-1)[:n].copy()), torch.from_numpy(k2.reshape(-1)[:n].copy())
        a1, a2 = torch.from_numpy(am1), torch.from_numpy(am2)
    return p.numpy(), c1.numpy(), c2.numpy()


# ---------------------------------------------------------------------------------------------------- files

def gen_adamw8bit(q1, q2, inputs):
    tensors = {"qmap1": t(q1), "qmap2": t(q2)}
    comparison = {}
    counts = {}
    for n in SIZES_8BIT:
        p0, grads, clean = inputs[n]
        tensors[f"p0.{n}"] = t(p0)
        tensors[f"grads.{n}"] = t(grads)
        for prefix, wd in [("wd0", 0.0), ("wd001", 0.01)]:
            opt = Adam8bitBlockwise(n, q1, q2, wd)
            p = p0.copy()
            for k in range(STEPS):
                p = opt.update(p, grads[k])
            assert np.isfinite(p).all()
            counts[f"{prefix}.{n}"] = opt.counts
            tensors[f"{prefix}.p.{n}"] = t(p)
            tensors[f"{prefix}.state1.{n}"] = t(opt.state1)
            tensors[f"{prefix}.state2.{n}"] = t(opt.state2)
            tensors[f"{prefix}.absmax1.{n}"] = t(opt.absmax1)
            tensors[f"{prefix}.absmax2.{n}"] = t(opt.absmax2)
        # Cross-check against bitsandbytes' CPU implementation (weight decay 0, finite grads).
        check_steps = {1, 2, 5, STEPS}
        ours = {}
        opt = Adam8bitBlockwise(n, q1, q2, 0.0)
        p = p0.copy()
        for k in range(STEPS):
            p = opt.update(p, clean[k])
            if k + 1 in check_steps:
                ours[k + 1] = {"p": p.copy(), "state1": opt.state1.copy(), "state2": opt.state2.copy(),
                               "absmax1": opt.absmax1.copy(), "absmax2": opt.absmax2.copy(), "deq": opt.dequant()}
        theirs = bnb_cpu_8bit(p0, clean, check_steps)
        per = {}
        ordinary = np.ones(n, dtype=bool)
        for lo, hi in SPECIAL_BLOCKS.get(n, []):
            ordinary[lo:hi] = False
        for s in sorted(check_steps):
            o, b = ours[s], theirs[s]
            blk = np.arange(n) // BLOCK
            bdeq1 = (q1[b["state1"]] * b["absmax1"][blk]).astype(f32)
            bdeq2 = (q2[b["state2"]] * b["absmax2"][blk]).astype(f32)
            per[f"step{s}"] = {
                "p": stats_f(o["p"], b["p"]),
                "p_update_rel": float(np.abs(o["p"].astype(np.float64) - b["p"]).max()
                                      / np.abs(o["p"].astype(np.float64) - p0).max()),
                "p_ordinary": stats_f(o["p"][ordinary], b["p"][ordinary]),
                "state1_code_equal_frac_ordinary": float((o["state1"] == b["state1"])[ordinary].mean()),
                "state1_code_equal_frac": float((o["state1"] == b["state1"]).mean()),
                "state2_code_equal_frac": float((o["state2"] == b["state2"]).mean()),
                "state1_max_code_diff": int(np.abs(o["state1"].astype(int) - b["state1"]).max()),
                "state2_max_code_diff": int(np.abs(o["state2"].astype(int) - b["state2"]).max()),
                "absmax1": stats_f(o["absmax1"], b["absmax1"]),
                "absmax2": stats_f(o["absmax2"], b["absmax2"]),
                "m_dequant_max_abs": float(np.abs(o["deq"][0].astype(np.float64) - bdeq1).max()),
                "v_dequant_max_abs": float(np.abs(o["deq"][1].astype(np.float64) - bdeq2).max()),
            }
        xp, x1, x2 = cpu_formula_cuda_quantizer(p0, clean, q1, q2)
        per["cpu_formula_with_cuda_quantizer_step20"] = {
            "p": stats_f(xp, ours[STEPS]["p"]), "state1_code_equal_frac": float((x1 == ours[STEPS]["state1"]).mean()),
            "state2_code_equal_frac": float((x2 == ours[STEPS]["state2"]).mean())}
        comparison[str(n)] = per
        s20 = per[f"step{STEPS}"]
        cq = per["cpu_formula_with_cuda_quantizer_step20"]
        print(f"adamw8bit n={n}: CPU formula + CUDA quantizer vs emulation: p max_abs {cq['p']['max_abs']:.3e}, "
              f"codes equal {cq['state1_code_equal_frac']:.4f}/{cq['state2_code_equal_frac']:.4f}")
        print(f"adamw8bit n={n}: vs bnb CPU after {STEPS} steps: p max_abs {s20['p']['max_abs']:.3e} "
              f"(ordinary elements {s20['p_ordinary']['max_abs']:.3e}) "
              f"(rel to update {s20['p_update_rel']:.3e}), state1 eq {s20['state1_code_equal_frac']:.4f}, "
              f"state2 eq {s20['state2_code_equal_frac']:.4f}, absmax1 max_rel {s20['absmax1']['max_rel']:.3e}")
    meta = dict(versions())
    meta.update({"lr": repr(LR), "betas": json.dumps([BETA1, BETA2]), "eps": repr(EPS), "steps": str(STEPS),
                 "blocksize": str(BLOCK), "weight_decay": json.dumps({"wd0": 0.0, "wd001": 0.01}),
                 "sizes": json.dumps(SIZES_8BIT), "nonfinite_5000": json.dumps(NONFINITE),
                 "kernel": "kOptimizerStatic8bit2StateBlockwise (csrc/kernels.cu), numpy float32 emulation",
                 "emulation_counts": json.dumps(counts, sort_keys=True),
                 "bnb_cpu_comparison": json.dumps(comparison, sort_keys=True)})
    print(f"adamw8bit emulation counts (ties, sign fixes, u8 wraps, NaN scaled values): {counts}")
    save_sorted(tensors, os.path.join(OUT, "adamw8bit.safetensors"), meta)
    return comparison


def torch_adamw(p0, grads):
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=0.01, foreach=False)
    for k in range(grads.shape[0]):
        p.grad = torch.from_numpy(grads[k].copy())
        opt.step()
    st = opt.state[p]
    return p.detach().numpy().copy(), st["exp_avg"].numpy().copy(), st["exp_avg_sq"].numpy().copy()


def bnb_cpu_32(p0, grads):
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = bnb.optim.AdamW([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=0.01, optim_bits=32)
    for k in range(grads.shape[0]):
        p.grad = torch.from_numpy(grads[k].copy())
        opt.step()
    st = opt.state[p]
    assert st["state1"].dtype == torch.float32
    return p.detach().numpy().copy(), st["state1"].numpy().copy(), st["state2"].numpy().copy()


def gen_adamw32(inputs):
    tensors = {}
    stats = {}
    for n in SIZES_32BIT:
        p0, _, clean = inputs[n]
        if n == 5000:
            tensors["grads_clean.5000"] = t(clean)
        tp, tm, tv = torch_adamw(p0, clean)
        tensors[f"torch.p.{n}"], tensors[f"torch.exp_avg.{n}"], tensors[f"torch.exp_avg_sq.{n}"] = t(tp), t(tm), t(tv)
        ep, e1, e2 = bnb32_emulate(p0, clean, 0.01)
        tensors[f"bnb32.p.{n}"], tensors[f"bnb32.state1.{n}"], tensors[f"bnb32.state2.{n}"] = t(ep), t(e1), t(e2)
        cp, c1, c2 = bnb_cpu_32(p0, clean)
        stats[str(n)] = {"bnb32_vs_torch": {"p": stats_f(ep, tp), "m": stats_f(e1, tm), "v": stats_f(e2, tv)},
                         "bnb32_vs_bnb_cpu": {"p": stats_f(ep, cp), "m": stats_f(e1, c1), "v": stats_f(e2, c2)},
                         "torch_vs_bnb_cpu": {"p": stats_f(tp, cp)}}
        print(f"adamw32 n={n}: bnb32 emu vs torch p max_abs {stats[str(n)]['bnb32_vs_torch']['p']['max_abs']:.3e}, "
              f"vs bnb CPU {stats[str(n)]['bnb32_vs_bnb_cpu']['p']['max_abs']:.3e}; "
              f"torch vs bnb CPU {stats[str(n)]['torch_vs_bnb_cpu']['p']['max_abs']:.3e}")
    meta = dict(versions())
    meta.update({"lr": repr(LR), "betas": json.dumps([BETA1, BETA2]), "eps": repr(EPS), "weight_decay": "0.01",
                 "steps": str(STEPS), "sizes": json.dumps(SIZES_32BIT),
                 "inputs": "p0.<n> and grads.1000 from adamw8bit.safetensors; grads_clean.5000 here",
                 "bnb32_kernel": "kOptimizer32bit2State<float, ADAM>: decoupled decay p *= 1 - lr*wd AFTER the update",
                 "comparison": json.dumps(stats, sort_keys=True)})
    save_sorted(tensors, os.path.join(OUT, "adamw32.safetensors"), meta)
    return stats


def gen_sgd():
    g = torch.Generator().manual_seed(4242)
    shape = (16, 24)
    p0 = torch.randn(shape, generator=g) * 0.5
    grads = torch.randn((STEPS,) + shape, generator=g) * 0.1
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9, dampening=0, weight_decay=0.01, nesterov=False, foreach=False)
    for k in range(STEPS):
        p.grad = grads[k].clone()
        opt.step()
    tensors = {"p0": p0, "grads": grads, "p": p.detach().clone(), "momentum_buffer": opt.state[p]["momentum_buffer"]}
    meta = dict(versions())
    meta.update({"lr": "0.05", "momentum": "0.9", "dampening": "0", "weight_decay": "0.01", "nesterov": "false",
                 "steps": str(STEPS)})
    save_sorted(tensors, os.path.join(OUT, "sgd.safetensors"), meta)


def gen_clip():
    shapes = [(7, 13), (64,), (3, 5, 11)]
    tensors = {}
    summary = {}
    g = torch.Generator().manual_seed(99)
    for case, scale in [("big", 1.0), ("small", 0.01)]:
        params = []
        for i, s in enumerate(shapes):
            gr = torch.randn(s, generator=g) * scale
            tensors[f"{case}.grad.{i}"] = gr.clone()
            prm = torch.nn.Parameter(torch.zeros(s))
            prm.grad = gr.clone()
            params.append(prm)
        exact = math.sqrt(sum(float((tensors[f"{case}.grad.{i}"].double() ** 2).sum()) for i in range(3)))
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        for i, prm in enumerate(params):
            tensors[f"{case}.clipped.{i}"] = prm.grad.clone()
            assert torch.equal(prm.grad, tensors[f"{case}.grad.{i}"] * coef)
        tensors[f"{case}.total_norm"] = total.reshape(1).float()
        tensors[f"{case}.clip_coef"] = coef.reshape(1).float()
        tensors[f"{case}.total_norm_f64"] = torch.tensor([exact], dtype=torch.float64)
        summary[case] = {"total_norm": float(total), "clip_coef": float(coef)}
        print(f"clip {case}: total_norm {float(total):.7g} (f64 {exact:.9g}), coef {float(coef):.7g}")
    assert summary["big"]["total_norm"] > 1.0 and summary["small"]["total_norm"] < 1.0
    meta = dict(versions())
    meta.update({"max_norm": "1.0", "norm_type": "2", "shapes": json.dumps([list(s) for s in shapes]),
                 "summary": json.dumps(summary, sort_keys=True)})
    save_sorted(tensors, os.path.join(OUT, "clip.safetensors"), meta)


SCHEDULES = [
    # type, [(total, warmup_arg, kwargs), ...]
    # (100, 0.07): 100 * 0.07 = 7.000000000000001 in float64, so ceil gives 8 warmup steps, not 7.
    ("linear", [(10, 2, {}), (37, 0.1, {}), (100, 0, {}), (100, 0.07, {})]),
    ("cosine", [(10, 2, {}), (37, 0.1, {}), (100, 0, {"num_cycles": 1.5})]),
    ("cosine_with_restarts", [(10, 2, {}), (37, 0.1, {"num_cycles": 2}), (100, 0, {"num_cycles": 3})]),
    ("polynomial", [(10, 2, {}), (37, 0.1, {"power": 2.0, "lr_end": 1e-5}), (100, 0, {"power": 0.5, "lr_end": 0.0})]),
    ("constant", [(10, 2, {}), (37, 0.1, {}), (100, 0, {})]),
    ("constant_with_warmup", [(10, 2, {}), (37, 0.1, {}), (100, 0, {})]),
    ("inverse_sqrt", [(10, 2, {}), (37, 0.1, {"timescale": 10}), (100, 0, {"timescale": 7})]),
    ("cosine_with_min_lr", [(10, 2, {"min_lr_rate": 0.1}), (37, 0.1, {"min_lr": 1e-5}),
                            (100, 0, {"min_lr_rate": 0.05, "num_cycles": 0.5})]),
    ("warmup_stable_decay", [(10, 2, {"num_decay_steps": 3}),
                             (37, 0.1, {"num_decay_steps": 10, "decay_type": "linear", "min_lr_ratio": 0.1}),
                             (100, 0, {"num_decay_steps": 20, "num_stable_steps": 50, "decay_type": "1-sqrt",
                                       "min_lr_ratio": 0.05})]),
]
BASE_LR = 2e-4


def gen_schedules():
    from transformers import TrainingArguments, get_scheduler

    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        for typ, configs in SCHEDULES:
            for total, warmup_arg, kwargs in configs:
                args = TrainingArguments(output_dir=tmp, learning_rate=BASE_LR, max_steps=total,
                                         warmup_steps=warmup_arg, lr_scheduler_type=typ,
                                         lr_scheduler_kwargs=dict(kwargs), report_to="none")
                warmup = args.get_warmup_steps(total)
                p = torch.nn.Parameter(torch.zeros(1))
                opt = torch.optim.SGD([p], lr=BASE_LR)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    sched = get_scheduler(args.lr_scheduler_type, optimizer=opt, num_warmup_steps=warmup,
                                          num_training_steps=total, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
                    lrs = []
                    for _ in range(total):
                        lrs.append(float(sched.get_last_lr()[0]))
                        assert lrs[-1] == opt.param_groups[0]["lr"]
                        opt.step()
                        sched.step()
                entries.append({"type": typ, "kwargs": kwargs, "total": total, "warmup_arg": warmup_arg,
                                "warmup": warmup, "base_lr": BASE_LR, "lrs": lrs})
                print(f"schedule {typ} T={total} warmup {warmup_arg}->{warmup} {kwargs}: "
                      f"first {lrs[:3]} last {lrs[-1]:.6g}")
    doc = {"versions": versions(),
           "note": "lrs[k-1] is the learning rate used by optimizer update k (scheduler.get_last_lr() before "
                   "optimizer.step()) = base_lr * lambda(k-1) in float64 (torch LambdaLR); warmup = "
                   "TrainingArguments(warmup_steps=warmup_arg).get_warmup_steps(total); get_scheduler ignores "
                   "warmup and kwargs for 'constant' and total and kwargs for 'constant_with_warmup'",
           "schedules": entries}
    with open(os.path.join(OUT, "schedules.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def generate():
    os.makedirs(OUT, exist_ok=True)
    q1, q2 = qmaps()
    inputs = {}
    for i, n in enumerate(SIZES_8BIT):
        p0, clean = make_inputs(n, seed=500 + i)
        grads = with_nonfinite(clean) if n == 5000 else clean
        inputs[n] = (p0, grads, clean)
    gen_adamw8bit(q1, q2, inputs)
    gen_adamw32(inputs)
    gen_sgd()
    gen_clip()
    gen_schedules()
    for f in sorted(os.listdir(OUT)):
        print(f"{f}: {os.path.getsize(os.path.join(OUT, f))} bytes")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "generate":
        generate()
    else:
        print(__doc__)
        sys.exit(2)
