#!/usr/bin/env python3
"""Golden files for candle-qlora's mixture-of-experts block (`models::moe`), produced by Hugging Face transformers'
own sparse blocks: Mixtral (`MixtralSparseMoeBlock`, top-k always renormalized), Qwen2-MoE
(`Qwen2MoeSparseMoeBlock`: a shared expert with a sigmoid gate, top-k not renormalized) and Qwen3-MoE
(`Qwen3MoeSparseMoeBlock`, `norm_topk_prob = true` as Qwen3-30B-A3B sets it), and transformers'
`load_balancing_loss_func` (the auxiliary loss).

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, safetensors 0.8.0, all on the CPU.
    pip install torch==2.15.0 transformers==5.23.0 safetensors numpy

Usage:
    python3 scripts/golden_moe.py        # (re)writes tests/data/moe/*.safetensors

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
metadata: versions, family, top_k, norm_topk_prob, experts_hit (how many experts got at least one token: the block
skips the rest).
"""

import importlib.metadata
import json
import os

import safetensors.torch
import torch
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, load_balancing_loss_func
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "moe")
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


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    aux = [torch.randn(14, EXPERTS, requires_grad=True) for _ in range(2)]
    aux_loss = load_balancing_loss_func(tuple(aux), EXPERTS, TOP_K)
    aux_loss.backward()
    for family, block, names, normalized in families():
        torch.manual_seed(1)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(0.2 * torch.randn_like(p))
        block.eval()
        x = torch.randn(2, 7, HIDDEN, requires_grad=True)
        logits = []
        handle = block.gate.register_forward_hook(lambda _m, _i, o: logits.append(o[0]))
        out = block(x)
        handle.remove()
        g = torch.randn_like(out)
        (out * g).sum().backward()
        selected = torch.topk(torch.softmax(logits[0].float(), -1), TOP_K, -1).indices
        tensors = {
            **per_expert_weights(block, names),
            "x": x.detach(),
            "out": out.detach(),
            "router_logits": logits[0].detach(),
            "upstream": g,
            "grad_x": x.grad,
            "grad_router": block.gate.weight.grad,
            "grad_expert0_down": block.experts.down_proj.grad[0].clone(),
            "aux_logits_0": aux[0].detach(),
            "aux_logits_1": aux[1].detach(),
            "aux_loss": aux_loss.detach().reshape(1),
            "grad_aux_logits_0": aux[0].grad,
        }
        metadata = {
            "versions": json.dumps(VERSIONS, sort_keys=True),
            "family": family,
            "top_k": str(TOP_K),
            "norm_topk_prob": str(normalized).lower(),
            "experts_hit": str(len(selected.unique())),
        }
        path = os.path.join(OUT, f"{family}.safetensors")
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
        print(f"wrote {path}: |out| max {out.abs().max():.4f}, experts hit {metadata['experts_hit']}")


if __name__ == "__main__":
    main()
