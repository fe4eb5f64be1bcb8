#!/usr/bin/env python3
"""Golden files for candle-qlora's mixture-of-experts block (`models::moe`), produced by Hugging Face transformers'
own sparse blocks: Mixtral (`MixtralSparseMoeBlock`, top-k always renormalized), Qwen2-MoE
(`Qwen2MoeSparseMoeBlock`: a shared expert with a sigmoid gate, top-k not renormalized) and Qwen3-MoE
(`Qwen3MoeSparseMoeBlock`, `norm_topk_prob = true` as Qwen3-30B-A3B sets it), and transformers'
`load_balancing_loss_func` (the auxiliary loss).

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, peft 0.21.2, bitsandbytes 0.50.2 (the NF4
goldens), gguf 0.19.0, safetensors 0.8.0, all on the CPU with PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, set
below: rerunning any command reproduces every committed tensor bit for bit).
    pip install torch==2.15.0 transformers==5.23.0 peft==0.21.2 bitsandbytes==0.50.2 gguf==0.19.0 safetensors numpy

Usage:
    python3 scripts/golden_moe.py            # (re)writes tests/data/moe/*.safetensors
    python3 scripts/golden_moe.py models     # (re)writes tests/data/models/tiny-{mixtral,qwen2-moe,qwen3-moe,gpt-oss}/
    python3 scripts/golden_moe.py gpt-oss    # (re)writes tiny-gpt-oss/ and tiny-gpt-oss-mxfp4/
    python3 scripts/golden_moe.py gguf       # (re)writes tiny-{mixtral,qwen2-moe}/model.gguf and tests/data/models/tiny-qwen3-moe-gguf/
    python3 scripts/golden_moe.py float64    # only the float64 goldens (see "Float64"), added to the committed files
    python3 scripts/golden_moe.py check-ours ADAPTER_DIR BASE_DIR LOGITS_FILE
        loads our adapter onto BASE_DIR with PEFT and compares its logits on the golden input_ids with the float32
        tensor `logits` of LOGITS_FILE (what our model computed), printing the largest difference

Whole tiny models (`models`): vocab 128, hidden 64, 4 heads / 2 kv heads, 4 experts of width 32, top-2, the same
word-level tokenizer as scripts/golden_model.py (copied from tiny-llama); weights 0.1 * randn, norms 1 + 0.1 * randn.
    tiny-mixtral     MixtralForCausalLM, 2 layers, saved by save_pretrained (the Hub layout:
                     block_sparse_moe.experts.{e}.w1/w2/w3)
    tiny-qwen2-moe   Qwen2MoeForCausalLM, 2 layers, shared expert of width 48, output_router_logits = true and
                     router_aux_loss_coef = 0.1 (the loss includes the auxiliary loss), Hub layout
                     (mlp.experts.{e}.gate_proj/up_proj/down_proj)
    tiny-qwen3-moe   Qwen3MoeForCausalLM, 3 layers, layer 1 dense (mlp_only_layers = [1], width 96),
                     norm_topk_prob = true, saved in transformers 5's fused layout (mlp.experts.gate_up_proj
                     [4, 64, 64], mlp.experts.down_proj [4, 64, 32]), which from_pretrained reads back (asserted)
    tiny-gpt-oss     GptOssForCausalLM, 2 layers, head_dim 16, layer 0 sliding over 6 keys, attention sinks (randn),
                     swiglu_limit 0.6 (reached), YaRN as its config defaults it, output_router_logits = true and
                     router_aux_loss_coef = 0.1; its adapter targets mlp.router.weight instead of mlp.gate.weight
    golden.safetensors: input_ids [2, 19]; logits [2, 19, 128]; loss [1] (model(ids, labels=ids).loss: the mean
    token loss, plus router_aux_loss_coef * aux_loss where the config asks); lm_loss [1]; aux_loss [1] (all three
    configs' load_balancing_loss_func over their sparse layers); grad_inputs_embeds [2, 19, 64] (d loss / d the
    embeddings); logits_adapter [2, 19, 128] (with adapter/ loaded by PEFT); logits_merged (the same merged by
    merge_and_unload); and their float64 twins (`*_f64`, see "Float64"), with for Mixtral, Qwen2-MoE and Qwen3-MoE
    logits_nf4_f64 [2, 19, 128] and loss_nf4_f64 [1]: the float64 model on bitsandbytes' NF4 of every weight we
    quantize on load (the layers' linear projections, Qwen2-MoE's shared expert and its gate, each expert's
    gate/up [2 * width, hidden] and down projection on its own; not the routers, embeddings or head), quantized by
    its CPU kernels (blocksize 64, double quantization) and dequantized by its reference kernel
    (golden_model.py's ReferenceDequant4bit: its native CPU kernel misreads the down projections' blocks, whose
    32 columns are less than a block).
    adapter/: PEFT 0.21.2 LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", target_parameters=
    ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), every lora_A / lora_B 0.1 * randn.

GGUF (`gguf`; gguf 0.19.0): the files llama.cpp's convert_hf_to_gguf.py writes for these architectures (LlamaModel for
Mixtral, Qwen2MoeModel, Qwen3MoeModel), all f32: names from gguf-py's tensor name map (router `ffn_gate_inp`, each projection's experts
stacked as `ffn_{gate,up,down}_exps` [experts, out, in], the shared expert `ffn_*_shexp` and its gate
`ffn_gate_inp_shexp` as a vector [hidden], as llama.cpp's loader expects it), the metadata of the dense Qwen files
plus `expert_count`, `expert_used_count`, `expert_feed_forward_length` and (Qwen2-MoE) `expert_shared_feed_forward_length`.
llama.cpp fixes per architecture what the file does not say: qwen2moe does not renormalize the top-k weights, qwen3moe
does, and neither has dense layers among the sparse ones.
    tiny-mixtral/model.gguf      the tiny Mixtral above as `llama` with experts: q/k rows permuted as LlamaModel.permute
                                 does, `rope.dimension_count`, the experts' width as `feed_forward_length`
    tiny-qwen2-moe/model.gguf    the tiny Qwen2-MoE above (its golden logits apply)
    tiny-qwen3-moe-gguf/         a Qwen3-MoE llama.cpp can express: as tiny-qwen3-moe but 2 layers, both sparse
                                 (mlp_only_layers = []), seed 40: config.json (for transformers' check), model.gguf,
                                 golden.safetensors (input_ids [2, 19], logits [2, 19, 128] of the HF model, and
                                 logits_f64: transformers' reading of the GGUF, in float64)
Verified for the Qwen files: transformers loads the GGUF into the HF config's model with every tensor equal to the HF
model's, and its logits equal the golden logits to 1e-5. transformers has no GGUF reader for Mixtral: its file is read
back with gguf-py and every tensor, q/k un-permuted by transformers' `LlamaTensorProcessor._reverse_permute_weights`,
equals the HF folder's.

Each family's file (tests/data/moe/{mixtral,qwen2_moe,qwen3_moe}.safetensors), float32, hidden 64, 8 experts of
width 48, top-2 (Qwen2-MoE: a shared expert of width 80), the weights under the names a checkpoint on the Hub uses
(one tensor per expert; the Rust test reads them as a loader would):
    {gate}.weight                    [8, 64]     the router
    {experts}.{e}.{gate,up,down}     per expert  Mixtral: w1 (gate), w3 (up), w2 (down); Qwen: *_proj
    shared_expert.*_proj.weight, shared_expert_gate.weight     Qwen2-MoE only
    x                 [2, 7, 64]    the block's input (randn)
    out               [2, 7, 64]    block(x), eval mode
    router_logits     [14, 8]       the router's logits
    upstream          [2, 7, 64]    a fixed random cotangent g
    grad_x            [2, 7, 64]    d sum(out * g) / dx
    grad_router       [8, 64]       d sum(out * g) / d router weight
    grad_expert0_down [64, 48]      d sum(out * g) / d the down projection of expert 0
and the auxiliary loss of two layers' router logits (both files hold the same):
    aux_logits_0, aux_logits_1   [14, 8]   randn
    aux_loss          [1]       load_balancing_loss_func((l0, l1), 8, 2) (no attention mask)
    grad_aux_logits_0 [14, 8]   its gradient with respect to aux_logits_0
and the float64 twins of the computed ones (out_f64, router_logits_f64, grad_x_f64, grad_router_f64,
grad_expert0_down_f64, aux_loss_f64, grad_aux_logits_0_f64; see "Float64"), whose routing is asserted to be the
float32 run's.
metadata: versions, family, top_k, norm_topk_prob, experts_hit (how many experts got at least one token: the block
skips the rest).

tiny-gpt-oss-mxfp4/golden.safetensors: input_ids, logits (of the HF model on transformers' dequantization of the
MXFP4 bytes, `convert_moe_packed_tensors`) and logits_f64.

Float64: every golden computed by transformers (and PEFT) also has a `_f64` twin computed in float64 from end to end
(float64_reference.py: the block built, or the model read from a float64 copy of its folder, inside a dispatch mode
that widens the steps transformers keeps in float32 — the routers' softmax, RMSNorm, RoPE and YaRN, the attention's
softmax with gpt-oss's sinks, the loss — and fails if any float32 result remains), on the same float32 weights and
inputs, exact in float64: the tiny models with eager attention and eager experts (the grouped matmul transformers
picks by default takes no float64), PEFT's adapters from a float64 copy; MXFP4 and NF4 weights are dequantized in
float32 as transformers and bitsandbytes do (exact values) and then widened. The Rust tests compare these at ~1e-9,
where neither side's float32 rounding nor the CPU's choice of matrix kernels can decide a result (the float32 goldens
stay for reference; each is asserted within float32 rounding of its twin, which a routing decided otherwise would not
be). `python3 scripts/golden_moe.py float64` adds them to the committed files without touching anything else; every
other command writes them with the files it writes.
"""

import contextlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile

# The committed files were written with PyTorch's AVX2 kernels (an AVX-512 host's round the float32 goldens
# otherwise at a few places; the float64 ones do not depend on it).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from transformers.models.mixtral.configuration_mixtral import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import (  # noqa: E402
    Qwen2MoeSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import float64_copy, float64_everywhere  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "moe")
HIDDEN, EXPERTS, WIDTH, TOP_K, SHARED = 64, 8, 48, 2, 80
VERSIONS = {
    "torch": torch.__version__,
    "transformers": importlib.metadata.version("transformers"),
    "safetensors": importlib.metadata.version("safetensors"),
}


def families():
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, hidden_act="silu")
    yield "mixtral", MixtralSparseMoeBlock(
        MixtralConfig(intermediate_size=WIDTH, num_local_experts=EXPERTS, **common)
    ), ("w1", "w3", "w2"), True
    yield "qwen2_moe", Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            moe_intermediate_size=WIDTH,
            shared_expert_intermediate_size=SHARED,
            num_experts=EXPERTS,
            norm_topk_prob=False,
            **common,
        )
    ), ("gate_proj", "up_proj", "down_proj"), False
    yield "qwen3_moe", Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(moe_intermediate_size=WIDTH, num_experts=EXPERTS, norm_topk_prob=True, **common)
    ), ("gate_proj", "up_proj", "down_proj"), True


def per_expert_weights(block, names):
    """The block's weights as a Hub checkpoint names them: the router, then one tensor per expert projection."""
    gate_name, up_name, down_name = names
    out = {"gate.weight": block.gate.weight.detach().clone()}
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    for e in range(EXPERTS):
        out[f"experts.{e}.{gate_name}.weight"] = gate_up[e, :WIDTH].clone()
        out[f"experts.{e}.{up_name}.weight"] = gate_up[e, WIDTH:].clone()
        out[f"experts.{e}.{down_name}.weight"] = down[e].clone()
    if hasattr(block, "shared_expert"):
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_expert.{p}.weight"] = getattr(block.shared_expert, p).weight.detach().clone()
        out["shared_expert_gate.weight"] = block.shared_expert_gate.weight.detach().clone()
    return out


def set_per_expert_weights(block, tensors, names):
    """The inverse of per_expert_weights: `block`'s weights from a golden file's tensors (in the block's dtype)."""
    gate_name, up_name, down_name = names
    with torch.no_grad():
        block.gate.weight.copy_(tensors["gate.weight"])
        for e in range(EXPERTS):
            block.experts.gate_up_proj[e, :WIDTH].copy_(tensors[f"experts.{e}.{gate_name}.weight"])
            block.experts.gate_up_proj[e, WIDTH:].copy_(tensors[f"experts.{e}.{up_name}.weight"])
            block.experts.down_proj[e].copy_(tensors[f"experts.{e}.{down_name}.weight"])
        if hasattr(block, "shared_expert"):
            for p in ("gate_proj", "up_proj", "down_proj"):
                getattr(block.shared_expert, p).weight.copy_(tensors[f"shared_expert.{p}.weight"])
            block.shared_expert_gate.weight.copy_(tensors["shared_expert_gate.weight"])
    assert all(torch.equal(v.double(), tensors[k].double()) for k, v in per_expert_weights(block, names).items())


def block_outputs(block, x, g):
    """block(x) (eval mode), the router's logits, and the gradients of sum(block(x) * g) with respect to x, the
    router's weight and expert 0's down projection."""
    x = x.detach().clone().requires_grad_(True)
    logits = []
    handle = block.gate.register_forward_hook(lambda _m, _i, o: logits.append(o[0]))
    out = block(x)
    handle.remove()
    (out * g).sum().backward()
    return {
        "out": out.detach(),
        "router_logits": logits[0].detach(),
        "grad_x": x.grad,
        "grad_router": block.gate.weight.grad,
        "grad_expert0_down": block.experts.down_proj.grad[0].clone(),
    }


def aux_outputs(aux_logits):
    """load_balancing_loss_func over two layers' router logits, and its gradient with respect to the first's."""
    aux = [t.detach().clone().requires_grad_(True) for t in aux_logits]
    loss = load_balancing_loss_func(tuple(aux), EXPERTS, TOP_K)
    loss.backward()
    return {"aux_loss": loss.detach().reshape(1), "grad_aux_logits_0": aux[0].grad}


def selected_experts(router_logits):
    """Each token's top-k experts (as a set per token: the block sums their outputs in any order)."""
    indices = torch.topk(torch.softmax(router_logits, -1), TOP_K, -1).indices
    return [sorted(row) for row in indices.tolist()]


def block_float64(family, tensors):
    """The `*_f64` twins of a family's golden tensors (`tensors`, as the file holds them): its block built in float64
    from end to end (see "Float64") with the file's weights, run on the file's x and upstream, and the auxiliary loss
    of the file's logits. The routing must be the float32 run's."""
    with float64_everywhere():
        block, names = next((b, n) for f, b, n, _ in families() if f == family)
        set_per_expert_weights(block, tensors, names)
        block.eval()
        out = block_outputs(block, tensors["x"].double(), tensors["upstream"].double())
        out.update(aux_outputs([tensors["aux_logits_0"].double(), tensors["aux_logits_1"].double()]))
    assert selected_experts(out["router_logits"]) == selected_experts(tensors["router_logits"].double()), family
    assert all(t.dtype == torch.float64 for t in out.values())
    return {k + "_f64": v.detach().contiguous() for k, v in out.items()}


def read_golden(path):
    """The tensors of a golden file, copied out of the file's memory map (it is rewritten next), and its metadata."""
    with safetensors.safe_open(path, "pt") as f:
        metadata = dict(f.metadata())
    return {k: v.clone() for k, v in safetensors.torch.load_file(path).items()}, metadata


def add_float64(path, twins):
    """Adds the float64 goldens `twins` (`*_f64`) to golden file `path`, whose other tensors and metadata stay as they
    are. A twin's float32 golden must be within float32 rounding of it (a routing decided otherwise would not be)."""
    golden, metadata = read_golden(path)
    off = {}
    for k, v in twins.items():
        plain = golden.get(k[:-len("_f64")])
        if plain is not None:
            off[k] = float((plain.double() - v).abs().max())
            assert off[k] < 1e-3 * (1 + float(v.abs().max())), (path, k, off[k])
    safetensors.torch.save_file({**golden, **twins}, path, metadata=metadata)
    back, back_metadata = read_golden(path)
    assert back_metadata == metadata and all(torch.equal(back[k], v) for k, v in {**golden, **twins}.items())
    print(f"{os.path.relpath(path, ROOT)}: float64 goldens "
          + ", ".join(f"{k} (f32 golden off by {d:.2g})" if k in off else k for k, d in
                      ((k, off.get(k)) for k in twins)))


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    aux_logits = [torch.randn(14, EXPERTS) for _ in range(2)]
    for family, block, names, normalized in families():
        torch.manual_seed(1)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(0.2 * torch.randn_like(p))
        block.eval()
        x = torch.randn(2, 7, HIDDEN)
        g = torch.randn(2, 7, HIDDEN)  # the cotangent: drawn right after x, as before the forward (which draws none)
        outputs = block_outputs(block, x, g)
        tensors = {
            **per_expert_weights(block, names),
            "x": x,
            "upstream": g,
            **outputs,
            "aux_logits_0": aux_logits[0],
            "aux_logits_1": aux_logits[1],
            **aux_outputs(aux_logits),
        }
        metadata = {
            "versions": json.dumps(VERSIONS, sort_keys=True),
            "family": family,
            "top_k": str(TOP_K),
            "norm_topk_prob": str(normalized).lower(),
            "experts_hit": str(len({e for row in selected_experts(outputs["router_logits"]) for e in row})),
        }
        path = os.path.join(OUT, f"{family}.safetensors")
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
        print(f"wrote {path}: |out| max {outputs['out'].abs().max():.4f}, experts hit {metadata['experts_hit']}")
        add_float64(path, block_float64(family, read_golden(path)[0]))


MODEL_SIZES = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
TARGET_PARAMETERS = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
GPT_OSS_TARGETS = ["mlp.router.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_models():
    from transformers import GptOssConfig, GptOssForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    experts = dict(num_experts_per_tok=2)
    yield "tiny-mixtral", MixtralForCausalLM, MixtralConfig(
        num_hidden_layers=2, num_local_experts=4, intermediate_size=32, **experts, **MODEL_SIZES), "hub"
    yield "tiny-qwen2-moe", Qwen2MoeForCausalLM, Qwen2MoeConfig(
        num_hidden_layers=2, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        intermediate_size=96, output_router_logits=True, router_aux_loss_coef=0.1, **experts, **MODEL_SIZES), "hub"
    yield "tiny-qwen3-moe", Qwen3MoeForCausalLM, Qwen3MoeConfig(
        num_hidden_layers=3, mlp_only_layers=[1], num_experts=4, moe_intermediate_size=32, intermediate_size=96,
        norm_topk_prob=True, head_dim=16, **experts, **MODEL_SIZES), "fused"
    # gpt-oss with a short window (layer 0 slides over 6 keys of the 19), a clamp the tiny activations reach and
    # the aux loss in the loss; YaRN as its config defaults it.
    yield "tiny-gpt-oss", GptOssForCausalLM, GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, intermediate_size=32, head_dim=16, sliding_window=6,
        swiglu_limit=0.6, output_router_logits=True, router_aux_loss_coef=0.1, **experts, **MODEL_SIZES), "hub"


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


# The tiny models whose goldens include NF4 twins (logits_nf4_f64, loss_nf4_f64).
NF4_MODELS = ("tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe")


@contextlib.contextmanager
def float64_model(folder, replace=None):
    """transformers' model of `folder` in float64 from end to end (see "Float64"; eager attention and experts: the
    grouped-matmul experts transformers picks by default take no float64), read from a
    float64 copy of the folder inside float64_everywhere(), which stays active meanwhile. `replace` (state-dict name
    -> float32 values) puts other weights in place of the stored ones: MXFP4's or NF4's dequantized values."""
    from transformers import AutoModelForCausalLM

    copy_dir = float64_copy(folder)
    try:
        with float64_everywhere():
            model = AutoModelForCausalLM.from_pretrained(copy_dir, dtype=torch.float64, attn_implementation="eager",
                                                         experts_implementation="eager")
            model.eval()
            if replace:
                state = model.state_dict()
                assert all(k in state and state[k].shape == v.shape for k, v in replace.items()), folder
                model.load_state_dict({**state, **{k: v.double() for k, v in replace.items()}})
            assert all(p.dtype == torch.float64 for p in model.parameters())
            yield model
    finally:
        shutil.rmtree(copy_dir)


def nf4_round_trip(w):
    """bitsandbytes' NF4 of float32 `w` (blocksize 64, double quantization, its CPU kernels), dequantized by its
    reference kernel (golden_model.py's ReferenceDequant4bit): float32 values, exact in float64."""
    import bitsandbytes as bnb
    from golden_model import ReferenceDequant4bit

    q, state = bnb.functional.quantize_4bit(w.float().contiguous(), blocksize=64, compress_statistics=True,
                                            quant_type="nf4")
    with ReferenceDequant4bit():
        return bnb.functional.dequantize_4bit(q, state).float().clone()


def nf4_weights(folder):
    """Every weight of `folder`'s model that candle-qlora quantizes on load, through nf4_round_trip: the layers'
    linear projections (attention, a dense layer's MLP, Qwen2-MoE's shared expert and its gate) and each expert's
    gate/up `[2 * width, hidden]` (gate rows first) and down projection on its own; not the routers (no nn.Linear in
    transformers), the embeddings or the head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers."):
            out[f"{name}.weight"] = nf4_round_trip(m.weight.detach())
        elif name.endswith(".mlp.experts"):
            assert m.gate_up_proj.shape[1] == 2 * m.down_proj.shape[2], "[experts, 2 * width, hidden] expected"
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}"] = torch.stack([nf4_round_trip(w) for w in getattr(m, p).detach()])
    return out


def model_float64(folder, ids, nf4=False):
    """The `*_f64` twins of a tiny model's goldens, from its float64 model (float64_model): logits, loss (with the
    auxiliary loss where the config asks), lm_loss, aux_loss, grad_inputs_embeds, and with `adapter/` (PEFT, read from
    a float64 copy) logits_adapter and logits_merged; with `nf4`, logits_nf4 and loss_nf4 (nf4_weights)."""
    import peft

    adapter = float64_copy(os.path.join(folder, "adapter"))  # read before the float64 mode
    try:
        with float64_model(folder) as model:
            with torch.no_grad():
                plain = model(ids, labels=ids, output_router_logits=True)
            embeds = model.model.embed_tokens(ids).detach().clone().requires_grad_(True)
            total = model(inputs_embeds=embeds, labels=ids)
            total.loss.backward()
            vocab = plain.logits.shape[-1]
            out = {
                "logits": plain.logits,
                "loss": total.loss.reshape(1),
                "lm_loss": torch.nn.functional.cross_entropy(plain.logits[:, :-1].reshape(-1, vocab),
                                                             ids[:, 1:].reshape(-1)).reshape(1),
                "aux_loss": plain.aux_loss.reshape(1),
                "grad_inputs_embeds": embeds.grad,
            }
            peft_model = peft.PeftModel.from_pretrained(model, adapter).eval()
            assert all(p.dtype == torch.float64 for p in peft_model.parameters())
            with torch.no_grad():
                out["logits_adapter"] = peft_model(ids).logits
                out["logits_merged"] = peft_model.merge_and_unload()(ids).logits
    finally:
        shutil.rmtree(adapter)
    if nf4:
        with float64_model(folder, replace=nf4_weights(folder)) as quantized, torch.no_grad():
            result = quantized(ids, labels=ids)
            out["logits_nf4"], out["loss_nf4"] = result.logits, result.loss.reshape(1)
    assert all(t.dtype == torch.float64 for t in out.values())
    return {k + "_f64": v.detach().contiguous() for k, v in out.items()}


def mxfp4_float64(folder, src, ids):
    """logits_f64 of tiny-gpt-oss-mxfp4: the float64 model of `src` (tiny-gpt-oss, the same config) holding the MXFP4
    folder's tensors, its experts dequantized by transformers (exact values in float32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    tensors = {k: v for k, v in stored.items() if not k.endswith(("_blocks", "_scales"))}
    for k in stored:
        if k.endswith("_blocks"):
            name = k[:-len("_blocks")]
            tensors[name] = convert_moe_packed_tensors(stored[k], stored[name + "_scales"], dtype=torch.float32)
    with float64_model(src, replace=tensors) as model, torch.no_grad():
        return {"logits_f64": model(ids).logits.detach().contiguous()}


def gguf_float64(folder, ids):
    """logits_f64 of a GGUF-only folder (config.json, model.gguf): the float64 model of transformers' reading of the
    file (every tensor the HF model's, as gguf_files verifies), saved as a float32 folder first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf",
                                                 config=AutoConfig.from_pretrained(folder), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(folder, "config.json"), tmp)
        safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                    os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with float64_model(tmp) as f64, torch.no_grad():
            return {"logits_f64": f64(ids).logits.detach().contiguous()}


def generate_float64():
    """Only the float64 goldens, added to the committed files (see "Float64")."""
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        path = os.path.join(OUT, f"{family}.safetensors")
        add_float64(path, block_float64(family, read_golden(path)[0]))
    models_dir = os.path.join(OUT, "..", "models")
    for name, *_ in tiny_models():
        folder = os.path.join(models_dir, name)
        path = os.path.join(folder, "golden.safetensors")
        add_float64(path, model_float64(folder, read_golden(path)[0]["input_ids"], nf4=name in NF4_MODELS))
    path = os.path.join(models_dir, "tiny-gpt-oss-mxfp4", "golden.safetensors")
    ids = read_golden(path)[0]["input_ids"]
    add_float64(path, mxfp4_float64(os.path.dirname(path), os.path.join(models_dir, "tiny-gpt-oss"), ids))
    folder = os.path.join(models_dir, "tiny-qwen3-moe-gguf")
    path = os.path.join(folder, "golden.safetensors")
    add_float64(path, gguf_float64(folder, read_golden(path)[0]["input_ids"]))


def models(only=None):
    import copy

    from transformers import AutoModelForCausalLM
    import peft

    # scripts/golden_model.py's word-level tokenizer over t1 .. t127
    tokenizer = os.path.join(OUT, "..", "models", "tiny-llama", "tokenizer.json")

    torch.set_num_threads(1)
    for seed, (name, cls, cfg, layout) in enumerate(tiny_models()):
        if only is not None and name not in only:
            continue
        folder = os.path.join(OUT, "..", "models", name)
        os.makedirs(folder, exist_ok=True)
        torch.manual_seed(seed)
        model = cls(cfg).float().eval()
        randomize(model, 10 + seed)
        with torch.no_grad():  # gpt-oss's attention sinks, large enough to matter
            for n, p in model.named_parameters():
                if n.endswith("sinks"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(50 + seed)))
        if layout == "hub":
            model.save_pretrained(folder, safe_serialization=True)
            os.remove(os.path.join(folder, "generation_config.json"))
        else:
            cfg.save_pretrained(folder)
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            safetensors.torch.save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        keys = safetensors.torch.load_file(os.path.join(folder, "model.safetensors")).keys()
        shutil.copy(tokenizer, os.path.join(folder, "tokenizer.json"))
        ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(100 + seed))
        with torch.no_grad():
            out = model(ids, labels=ids, output_router_logits=True)
            reread = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            assert torch.equal(reread(ids).logits, out.logits), f"{name}: the saved folder does not read back"
        embeds = model.model.embed_tokens(ids).detach().requires_grad_(True)
        total = model(inputs_embeds=embeds, labels=ids)  # with aux_loss where the config asks
        total.loss.backward()
        lm_loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
        with_aux = cfg.output_router_logits
        expected = lm_loss.detach() + (cfg.router_aux_loss_coef * out.aux_loss if with_aux else 0.0)
        assert abs(float(total.loss) - float(expected)) < 1e-5, (float(total.loss), float(expected))

        peft_model = peft.get_peft_model(
            copy.deepcopy(model),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                            target_parameters=GPT_OSS_TARGETS if "gpt-oss" in name else TARGET_PARAMETERS),
        )
        g = torch.Generator().manual_seed(200 + seed)
        with torch.no_grad():
            for n, p in sorted(peft_model.named_parameters()):
                if "lora_" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        peft_model.eval()
        adapter_dir = os.path.join(folder, "adapter")
        peft_model.save_pretrained(adapter_dir)
        os.remove(os.path.join(adapter_dir, "README.md"))  # PEFT's model card
        with torch.no_grad():
            logits_adapter = peft_model(ids).logits
            merged = peft_model.merge_and_unload()
            logits_merged = merged(ids).logits
        reloaded = peft.PeftModel.from_pretrained(cls.from_pretrained(folder, dtype=torch.float32).eval(), adapter_dir)
        with torch.no_grad():
            assert torch.allclose(reloaded(ids).logits, logits_adapter, atol=1e-5), f"{name}: the adapter reloads"
        tensors = {
            "input_ids": ids,
            "logits": out.logits,
            "loss": total.loss.detach().reshape(1),
            "lm_loss": lm_loss.reshape(1),
            "aux_loss": out.aux_loss.reshape(1),
            "grad_inputs_embeds": embeds.grad,
            "logits_adapter": logits_adapter,
            "logits_merged": logits_merged,
        }
        metadata = {"versions": json.dumps({**VERSIONS, "peft": peft.__version__}, sort_keys=True), "layout": layout,
                    "expert_keys": json.dumps(sorted(k for k in keys if "experts" in k)[:4])}
        path = os.path.join(folder, "golden.safetensors")
        safetensors.torch.save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path, metadata=metadata)
        add_float64(path, model_float64(folder, ids, nf4=name in NF4_MODELS))
        print(f"{name}: loss {float(total.loss):.5f} (aux {float(out.aux_loss):.5f}), |adapter - base| "
              f"{float((logits_adapter - out.logits).abs().max()):.4f}, keys {metadata['expert_keys']}")


def gguf_files():
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeForCausalLM

    def llama_permute(w, n_head):
        """convert_hf_to_gguf.py's LlamaModel.permute: rows of each head from HF's halves to interleaved pairs."""
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def write(folder, arch, cfg, state, file="model.gguf"):
        names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
        llama = arch == gguf.MODEL_ARCH.LLAMA
        tensors = {}
        experts = {}
        for hf_name, t in sorted(state.items()):
            base, suffix = hf_name.rsplit(".", 1)
            parts = base.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():  # per-expert: stacked
                i = parts.index("experts")
                experts.setdefault((".".join(parts[:i + 1] + parts[i + 2:]), suffix), {})[int(parts[i + 1])] = t
                continue
            if base.endswith("experts.gate_up_proj") or base.endswith("experts.down_proj"):
                raise ValueError("write from the per-expert layout")
            mapped = names.get_name(base)
            assert mapped is not None, hf_name
            array = t.float().numpy()
            if base.endswith("shared_expert_gate"):
                array = array.reshape(-1)  # llama.cpp's loader: a vector [n_embd]
            if llama and base.endswith("self_attn.q_proj"):
                array = llama_permute(array, cfg.num_attention_heads)
            if llama and base.endswith("self_attn.k_proj"):
                array = llama_permute(array, cfg.num_key_value_heads)
            tensors[f"{mapped}.{suffix}"] = array
        for (base, suffix), per_expert in experts.items():
            stacked = np.stack([per_expert[e].float().numpy() for e in range(len(per_expert))])
            tensors[f"{names.get_name(base)}.{suffix}"] = stacked
        path = os.path.join(folder, file)
        writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
        writer.add_type("model")
        writer.add_name(os.path.basename(folder))
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        if arch == gguf.MODEL_ARCH.QWEN3MOE:
            writer.add_key_length(cfg.head_dim)
            writer.add_value_length(cfg.head_dim)
        if llama:  # LlamaModel: the rotated width; the experts' width is `feed_forward_length`
            writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        writer.add_expert_count(cfg.num_local_experts if llama else cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if not llama:
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == gguf.MODEL_ARCH.QWEN2MOE:
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        for name, array in tensors.items():
            writer.add_tensor(name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def verify(folder, reference_state, golden):
        hf_cfg = AutoConfig.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", config=hf_cfg,
                                                     dtype=torch.float32).eval()
        loaded = model.state_dict()
        for k, v in reference_state.items():
            assert torch.equal(loaded[k], v), k
        with torch.no_grad():
            diff = float((model(golden["input_ids"]).logits - golden["logits"]).abs().max())
        assert diff <= 1e-5, diff
        return diff

    torch.set_num_threads(1)
    models_dir = os.path.join(OUT, "..", "models")
    # Qwen2-MoE: the tiny model as it is (GGUF-expressible).
    folder = os.path.join(models_dir, "tiny-qwen2-moe")
    state = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    cfg = AutoConfig.from_pretrained(folder)
    write(folder, gguf.MODEL_ARCH.QWEN2MOE, cfg, state)
    golden = safetensors.torch.load_file(os.path.join(folder, "golden.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    print("tiny-qwen2-moe/model.gguf: transformers' logits from it differ by", verify(folder, reference, golden))

    # Qwen3-MoE: every layer sparse.
    folder = os.path.join(models_dir, "tiny-qwen3-moe-gguf")
    os.makedirs(folder, exist_ok=True)
    cfg = Qwen3MoeConfig(num_hidden_layers=2, mlp_only_layers=[], num_experts=4, moe_intermediate_size=32,
                         intermediate_size=96, norm_topk_prob=True, head_dim=16, num_experts_per_tok=2,
                         **MODEL_SIZES)
    torch.manual_seed(40)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    randomize(model, 40)
    cfg.save_pretrained(folder)
    # The per-expert names of a Hub checkpoint, from transformers' fused parameters (gate rows first).
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            width = cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                state[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :width]
                state[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, width:]
        elif k.endswith("experts.down_proj"):
            for e in range(cfg.num_experts):
                state[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            state[k] = v
    write(folder, gguf.MODEL_ARCH.QWEN3MOE, cfg, state)
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(140))
    with torch.no_grad():
        golden = {"input_ids": ids, "logits": model(ids).logits}
    safetensors.torch.save_file({k: v.contiguous() for k, v in golden.items()},
                                os.path.join(folder, "golden.safetensors"),
                                metadata={"versions": json.dumps(VERSIONS, sort_keys=True)})
    print("tiny-qwen3-moe-gguf: transformers' logits from it differ by",
          verify(folder, model.state_dict(), golden))
    add_float64(os.path.join(folder, "golden.safetensors"), gguf_float64(folder, ids))

    # Mixtral: llama.cpp writes it as `llama` with experts, q/k permuted as for Llama. transformers has no GGUF
    # reader for it, so the file is checked tensor by tensor against the HF folder through gguf-py's reader and
    # transformers' own inverse of the permutation (its Llama GGUF loader's `_reverse_permute_weights`).
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    folder = os.path.join(models_dir, "tiny-mixtral")
    state = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    cfg = AutoConfig.from_pretrained(folder)
    path = write(folder, gguf.MODEL_ARCH.LLAMA, cfg, state)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    read = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    unpermute = LlamaTensorProcessor()._reverse_permute_weights
    checked = 0
    for hf_name, t in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        parts = base.split(".")
        expert = None
        if "experts" in parts:
            i = parts.index("experts")
            expert = int(parts[i + 1])
            base = ".".join(parts[:i + 1] + parts[i + 2:])
        array = read[f"{names.get_name(base)}.{suffix}"]
        array = array[expert] if expert is not None else array
        if base.endswith("q_proj"):
            array = unpermute(array, cfg.num_attention_heads, cfg.num_attention_heads)
        if base.endswith("k_proj"):
            array = unpermute(array, cfg.num_attention_heads, cfg.num_key_value_heads)
        assert np.array_equal(array, t.numpy()), hf_name
        checked += 1
    print(f"tiny-mixtral/model.gguf: {checked} tensors equal the HF folder's after transformers' un-permutation")


def mxfp4_quantize(w):
    """[..., out, in] float32 -> MXFP4 (blocks [..., out, in/32, 16] u8, scales [..., out, in/32] u8): per 32 values
    the smallest power of two that puts the largest magnitude within E2M1's 6, each value rounded to the nearest
    E2M1 value (ties to the lower code), two codes per byte, the even element in the low nibble."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES[:8])
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()


def mxfp4_folder():
    """tiny-gpt-oss-mxfp4/: tiny-gpt-oss with its experts stored as the gpt-oss checkpoints store them (MXFP4
    `*_blocks` / `*_scales`, `[experts, out, in/32, 16]`, `quantization_config.quant_method = "mxfp4"`), and the
    logits of the HF model whose experts are transformers' own dequantization of those bytes
    (`convert_moe_packed_tensors`)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = os.path.join(OUT, "..", "models", "tiny-gpt-oss")
    folder = os.path.join(OUT, "..", "models", "tiny-gpt-oss-mxfp4")
    os.makedirs(folder, exist_ok=True)
    state = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
    stored, dequantized = {}, {}
    for k, v in state.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            blocks, scales = mxfp4_quantize(v.float().transpose(1, 2))  # [experts, out, in]
            stored[k + "_blocks"], stored[k + "_scales"] = blocks, scales
            dequantized[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            stored[k] = v
    safetensors.torch.save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=2)
    shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.load_state_dict({**model.state_dict(), **dequantized})
    ids = safetensors.torch.load_file(os.path.join(src, "golden.safetensors"))["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    moved = max(float((dequantized[k] - state[k]).abs().max()) for k in dequantized)
    path = os.path.join(folder, "golden.safetensors")
    safetensors.torch.save_file({"input_ids": ids, "logits": logits.contiguous()}, path,
                                metadata={"versions": json.dumps(VERSIONS, sort_keys=True)})
    add_float64(path, mxfp4_float64(folder, src, ids))
    print(f"tiny-gpt-oss-mxfp4: MXFP4 moves the expert weights by up to {moved:.3g}")


def check_ours(adapter_dir, base_dir, logits_file):
    from transformers import AutoModelForCausalLM
    import peft

    golden = safetensors.torch.load_file(os.path.join(base_dir, "golden.safetensors"))
    ours = safetensors.torch.load_file(logits_file)["logits"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        theirs = model(golden["input_ids"]).logits
    diff = float((theirs - ours).abs().max())
    moved = float((theirs - golden["logits"]).abs().max())
    print(f"PEFT loaded {adapter_dir}: max |PEFT - ours| = {diff:.3g} (the adapter moves the logits by {moved:.3g})")
    assert diff < 1e-4, diff


if __name__ == "__main__":
    if sys.argv[1:2] == ["models"]:
        models()
    elif sys.argv[1:2] == ["gpt-oss"]:
        models(only={"tiny-gpt-oss"})
        mxfp4_folder()
    elif sys.argv[1:2] == ["gguf"]:
        gguf_files()
    elif sys.argv[1:2] == ["float64"]:
        torch.set_num_threads(1)
        generate_float64()
    elif sys.argv[1:2] == ["check-ours"]:
        check_ours(*sys.argv[2:5])
    else:
        main()
