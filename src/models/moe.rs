//! The mixture-of-experts feed-forward block of Mixtral, Qwen2-MoE and Qwen3-MoE, as transformers computes it: a
//! router (`gate`, a linear layer to one logit per expert), its softmax in float32 (float64 in a float64 model, as
//! everything of the routing and the auxiliary loss there), each token's `top_k` experts
//! (their probabilities renormalized to sum to 1 where the family says so: `norm_topk_prob`, always for Mixtral),
//! each expert a gated MLP, and Qwen2-MoE's shared expert added under a sigmoid gate. Plus transformers'
//! auxiliary load-balancing loss over the layers' router logits ([`load_balancing_loss`]).
//!
//! The compute scales with the active parameters: tokens are grouped by expert, each expert that got tokens runs
//! once over exactly those rows (one product per projection), and the results are scaled by their routing weights
//! and added back to their tokens in one indexed sum. Experts that got no token are not touched (a 4-bit expert is
//! not dequantized). Gradients flow to the input, to every expert that ran, and to the router through the selected
//! probabilities (the choice of experts itself has no gradient, as in PyTorch).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor, D};

use super::mlp::{Linear, Mlp, MlpTiling};
use crate::ops::Pass;
use crate::precision::master_dtype;

/// Qwen2-MoE's shared expert: an MLP every token goes through, scaled by `sigmoid(gate(x))`.
#[derive(Clone, Debug)]
pub struct SharedExpert {
    /// The MLP (`shared_expert`).
    pub mlp: Mlp,
    /// Its gate (`shared_expert_gate`), hidden → 1.
    pub gate: Linear,
}

/// A sparse mixture-of-experts block.
#[derive(Clone, Debug)]
pub struct SparseMoe {
    /// The router (`gate`): hidden → one logit per expert.
    pub gate: Linear,
    /// The experts.
    pub experts: Vec<Mlp>,
    /// Qwen2-MoE's shared expert.
    pub shared_expert: Option<SharedExpert>,
    /// The router's name in the layer (`mlp.gate`; gpt-oss's `mlp.router`).
    pub router_name: &'static str,
    top_k: usize,
    norm_topk_prob: bool,
}

/// Which experts each token goes to: per expert, its tokens (rows of the flattened input) and, for each, the
/// position of its routing weight in the `[tokens, top_k]` selection (flattened).
struct Assignment {
    tokens: Vec<Vec<u32>>,
    slots: Vec<Vec<u32>>,
}

impl SparseMoe {
    /// A block routing each token to `top_k` of `experts`, renormalizing their probabilities when
    /// `norm_topk_prob`.
    pub fn new(
        gate: Linear,
        experts: Vec<Mlp>,
        shared_expert: Option<SharedExpert>,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> crate::Result<Self> {
        if top_k == 0 || top_k > experts.len() {
            return Err(crate::Error::Model(format!(
                "num_experts_per_tok = {top_k}: a token goes to 1 to {} experts (the model has {})",
                experts.len(),
                experts.len()
            )));
        }
        Ok(SparseMoe {
            gate,
            experts,
            shared_expert,
            router_name: "mlp.gate",
            top_k,
            norm_topk_prob,
        })
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The block's output for `x` (`[..., hidden]`, the same shape) and the router's logits (`[tokens, experts]`,
    /// float32, float64 for a float64 `x`; for the auxiliary loss).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (out, logits, _) = self.forward_with_choices(x, None)?;
        Ok((out, logits))
    }

    /// [`SparseMoe::forward`], with the experts each token went to (`[tokens · top_k]`, row-major, highest
    /// probability first), read on the host once for the routing and kept for the auxiliary loss. With `tiling`,
    /// each expert (and the shared expert) runs over slices of its own token rows ([`Mlp::forward_tiled`]).
    pub(crate) fn forward_with_choices(
        &self,
        x: &Tensor,
        tiling: Option<&MlpTiling>,
    ) -> Result<(Tensor, Tensor, Vec<u32>)> {
        let expert_of = |mlp: &Mlp, rows: &Tensor| match tiling {
            Some(t) => mlp.forward_tiled(rows, None, Pass::Forward, t),
            None => mlp.apply(rows),
        };
        let shape = x.shape().clone();
        let hidden = x.dim(D::Minus1)?;
        let rows = x.reshape(((), hidden))?;
        let logits = at_least_f32(&self.gate.forward(&rows)?)?;
        if rows.dim(0)? == 0 {
            return Ok((x.clone(), logits, vec![]));
        }
        let probs = softmax_rows(&logits)?;
        let (assignment, choices) = self.select(&probs)?;
        let selected = Tensor::from_slice(&choices, (rows.dim(0)?, self.top_k), probs.device())?;
        let mut weights = probs.gather(&selected, 1)?;
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?.flatten_all()?;
        let device = x.device();
        let (mut outputs, mut tokens, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (expert, (mine, my_slots)) in self
            .experts
            .iter()
            .zip(assignment.tokens.iter().zip(&assignment.slots))
        {
            if mine.is_empty() {
                continue;
            }
            let index = Tensor::new(mine.as_slice(), device)?;
            outputs.push(expert_of(expert, &rows.index_select(&index, 0)?)?);
            tokens.extend_from_slice(mine);
            slots.extend_from_slice(my_slots);
        }
        let mut out = rows.zeros_like()?;
        if !outputs.is_empty() {
            let scale = weights.index_select(&Tensor::new(slots.as_slice(), device)?, 0)?;
            let routed = Tensor::cat(&outputs, 0)?.broadcast_mul(&scale.unsqueeze(1)?)?;
            out = out.index_add(&Tensor::new(tokens.as_slice(), device)?, &routed, 0)?;
        }
        if let Some(shared) = &self.shared_expert {
            let gate = sigmoid(&shared.gate.forward(&rows)?)?;
            out = (out + expert_of(&shared.mlp, &rows)?.broadcast_mul(&gate)?)?;
        }
        Ok((out.reshape(shape)?, logits, choices))
    }

    /// Each token's `top_k` experts by probability (highest first, as `torch.topk`), grouped by expert, and the
    /// experts of each token in order (`[tokens · top_k]`).
    fn select(&self, probs: &Tensor) -> Result<(Assignment, Vec<u32>)> {
        let experts = self.experts.len();
        let choices = top_k_choices(probs, self.top_k)?;
        let mut assignment = Assignment {
            tokens: vec![Vec::new(); experts],
            slots: vec![Vec::new(); experts],
        };
        for (slot, &e) in choices.iter().enumerate() {
            assignment.tokens[e as usize].push((slot / self.top_k) as u32);
            assignment.slots[e as usize].push(slot as u32);
        }
        Ok((assignment, choices))
    }
}

/// `t` in float32, or float64 when it is (the router's softmax and the auxiliary loss are never computed in half
/// precision; a float64 model computes them in float64 throughout).
fn at_least_f32(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(master_dtype(t.dtype()))
}

/// `t` on the host in float64 (exact for float32 values; converted on the host whatever the device).
fn host_f64(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)?.to_dtype(DType::F64)
}

/// `values` as a `dtype` tensor on `device` (rounded on the host).
fn tensor_of(values: &[f64], dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::new(values, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// Each row's `k` experts of highest probability in `probs` (`[tokens, experts]`), highest first: `[tokens · k]`.
/// Compared at the probabilities' own precision (float32 values widen to float64 exactly, in the same order).
fn top_k_choices(probs: &Tensor, k: usize) -> Result<Vec<u32>> {
    let rows: Vec<Vec<f64>> = host_f64(probs)?.to_vec2()?;
    Ok(rows
        .iter()
        .flat_map(|p| top_k_indices(p, k).into_iter().map(|e| e as u32))
        .collect())
}

/// The indices of the `k` largest values of `p`, largest first (ties: the lower index first).
fn top_k_indices(p: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Softmax over the last dimension of `[rows, n]` from differentiable ops (Candle's fused softmax has no backward).
fn softmax_rows(x: &Tensor) -> Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
    let e = shifted.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// `1 / (1 + e^−x)` from differentiable ops.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// transformers' auxiliary load-balancing loss (Switch Transformer, eq. 4–6) over the router logits of the layers
/// (`[tokens, experts]` each): `experts · Σₑ fₑ · Pₑ`, where `fₑ` is the share of the layers' top-`top_k`
/// assignments that went to expert `e` per token and `Pₑ` its mean router probability, both over every layer's
/// tokens together. Only `Pₑ` carries a gradient. Multiplied by `router_aux_loss_coef` it joins the training loss.
pub fn load_balancing_loss(router_logits: &[Tensor], top_k: usize) -> Result<Tensor> {
    let layers = router_logits
        .iter()
        .map(|logits| {
            let probs = softmax_rows(&at_least_f32(logits)?)?;
            Ok((logits.clone(), top_k_choices(&probs, top_k)?))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(balance(&layers, top_k, None)?.0)
}

/// The load-balancing loss of `layers` (each layer's router logits and the experts each token went to, `top_k`
/// per token) over the tokens whose `mask` is 1 (all when `None`; transformers' attention mask), and its derivative
/// with respect to each counted token's router probability of each expert (`experts · fₑ / n`, `n` the counted rows
/// of all layers). In float32, or float64 for float64 logits.
fn balance(
    layers: &[(Tensor, Vec<u32>)],
    top_k: usize,
    mask: Option<&Tensor>,
) -> Result<(Tensor, Vec<f64>)> {
    let Some((first, _)) = layers.first() else {
        candle_core::bail!("load_balancing_loss: no router logits");
    };
    let experts = first.dim(1)?;
    let device = first.device();
    let dtype = master_dtype(first.dtype());
    let mask = mask.map(|m| m.to_dtype(dtype)).transpose()?;
    let token_mask: Option<Vec<f64>> = mask.as_ref().map(|m| host_f64(m)?.to_vec1()).transpose()?;
    let mut counts = vec![0f64; experts];
    let mut prob_sum = Tensor::zeros(experts, dtype, device)?;
    let mut rows = 0f64;
    for (logits, choices) in layers {
        let probs = softmax_rows(&logits.to_dtype(dtype)?)?;
        for (t, chosen) in choices.chunks(top_k.max(1)).enumerate() {
            let m = token_mask.as_ref().map_or(1.0, |m| m[t]);
            rows += m;
            for &e in chosen {
                counts[e as usize] += m;
            }
        }
        let counted = match &mask {
            Some(m) => probs.broadcast_mul(&m.unsqueeze(1)?)?,
            None => probs,
        };
        prob_sum = (prob_sum + counted.sum(0)?)?;
    }
    let rows = rows.max(1.0);
    let share: Vec<f64> = counts.iter().map(|c| c / rows).collect();
    let tokens_per_expert = tensor_of(&share, dtype, device)?;
    let prob_per_expert = (prob_sum / rows)?;
    let loss = ((tokens_per_expert * prob_per_expert)?.sum_all()? * experts as f64)?;
    let derivative = counts
        .iter()
        .map(|c| experts as f64 * c / rows / rows)
        .collect();
    Ok((loss, derivative))
}

/// The router logits of one forward's sparse layers, recorded for the auxiliary load-balancing loss
/// ([`RouterLogits::aux_loss`]). A checkpointed layer records its logits without their graph; its recomputation in
/// the backward then adds its share of the loss's gradient itself (from the weights `aux_loss` leaves here), so
/// the gradients equal an uncheckpointed run's.
#[derive(Clone, Debug, Default)]
pub struct RouterLogits(Arc<Mutex<RouterState>>);

#[derive(Debug, Default)]
struct RouterState {
    /// Each sparse layer's router logits `[tokens, experts]` and the experts each token went to, by layer index.
    layers: BTreeMap<usize, (Tensor, Vec<u32>)>,
    /// The objective's derivative with respect to each token's router probabilities `[tokens, experts]`.
    weights: Option<Tensor>,
}

impl RouterLogits {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> Result<std::sync::MutexGuard<'_, RouterState>> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("router record poisoned".into()))
    }

    /// Records layer `layer`'s logits and the experts its tokens went to (`top_k` per token, row-major).
    pub(crate) fn record(&self, layer: usize, logits: Tensor, choices: Vec<u32>) -> Result<()> {
        self.state()?.layers.insert(layer, (logits, choices));
        Ok(())
    }

    /// Whether no sparse layer ran.
    pub fn is_empty(&self) -> bool {
        self.state().map(|s| s.layers.is_empty()).unwrap_or(true)
    }

    /// A recomputed checkpointed layer's share of the auxiliary loss, as a scalar whose gradient is the
    /// objective's (`None` before [`RouterLogits::aux_loss`]).
    pub(crate) fn recomputed_loss(&self, logits: &Tensor) -> Result<Option<Tensor>> {
        let Some(weights) = self.state()?.weights.clone() else {
            return Ok(None);
        };
        let probs = softmax_rows(&at_least_f32(logits)?)?;
        Ok(Some((probs * weights)?.sum_all()?))
    }

    /// transformers' load-balancing loss over the recorded layers (see [`load_balancing_loss`]), counting only the
    /// tokens whose `token_mask` is 1 (`[tokens]`: padding 0, as transformers reads its attention mask). In float32,
    /// or float64 for a float64 model's logits.
    /// `scale` is the factor it enters the differentiated objective with (`router_aux_loss_coef`, over the ranks):
    /// the checkpointed layers' recomputations use it. `None` when no sparse layer ran.
    pub fn aux_loss(
        &self,
        top_k: usize,
        token_mask: Option<&Tensor>,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let layers: Vec<(Tensor, Vec<u32>)> = self.state()?.layers.values().cloned().collect();
        let Some((first, _)) = layers.first() else {
            return Ok(None);
        };
        let (loss, derivative) = balance(&layers, top_k, token_mask)?;
        let (device, dtype) = (first.device(), master_dtype(first.dtype()));
        let per_expert: Vec<f64> = derivative.iter().map(|d| d * scale).collect();
        let per_expert = tensor_of(&per_expert, dtype, device)?.unsqueeze(0)?;
        let weights = match token_mask {
            Some(m) => m
                .to_dtype(dtype)?
                .unsqueeze(1)?
                .broadcast_mul(&per_expert)?,
            None => per_expert.broadcast_as(first.shape())?.contiguous()?,
        };
        self.state()?.weights = Some(weights);
        Ok(Some(loss))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{DType, Tensor, Var};

    use super::*;
    use crate::lora::{LoraAdapter, LoraLinear};
    use crate::models::mlp::GateUpProjections;
    use crate::ops::autograd::gradcheck::{check, max_abs_diff, rand_f64};
    use crate::ops::{FrozenLinear, FrozenWeight, GateActivation, GradSink};

    const HIDDEN: usize = 4;
    const EXPERTS: usize = 3;
    const WIDTH: usize = 5;

    fn frozen(out: usize, inp: usize, seed: u64) -> Linear {
        LoraLinear::new(Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[out, inp], seed)),
            None,
        )))
    }

    fn mlp(seed: u64) -> Mlp {
        Mlp::new(
            GateUpProjections::Separate {
                gate_proj: frozen(WIDTH, HIDDEN, seed),
                up_proj: frozen(WIDTH, HIDDEN, seed + 1),
            },
            frozen(HIDDEN, WIDTH, seed + 2),
            GateActivation::Silu,
        )
    }

    /// A block (top-2 of 3, renormalized or not, with a shared expert) whose router carries a LoRA adapter with
    /// factors `a` and `b`.
    fn block(a: &Tensor, b: &Tensor, norm_topk_prob: bool) -> SparseMoe {
        let mut router = frozen(EXPERTS, HIDDEN, 1);
        router.adapters.insert(
            "default".into(),
            Arc::new(LoraAdapter {
                a: Var::from_tensor(a).unwrap(),
                b: Var::from_tensor(b).unwrap(),
                scaling: 0.5,
                dropout: 0.0,
                magnitude: None,
                module_id: 0,
                runtime: Arc::default(),
            }),
        );
        router.active = Some("default".into());
        let experts = (0..EXPERTS as u64).map(|e| mlp(10 + 3 * e)).collect();
        let shared = SharedExpert {
            mlp: mlp(30),
            gate: frozen(1, HIDDEN, 40),
        };
        SparseMoe::new(router, experts, Some(shared), 2, norm_topk_prob).unwrap()
    }

    /// The same block computed densely: every expert on every token, weighted by the router's probabilities where
    /// the token chose the expert (the choice read from the values, as the block makes it) and zero elsewhere.
    fn dense_reference(block: &SparseMoe, x: &Tensor, norm_topk_prob: bool) -> Result<Tensor> {
        let probs = softmax_rows(&block.gate.forward(x)?)?;
        let chosen: Vec<f64> = probs
            .to_vec2::<f64>()?
            .iter()
            .flat_map(|p| {
                let top = top_k_indices(p, 2);
                (0..EXPERTS).map(move |e| if top.contains(&e) { 1.0 } else { 0.0 })
            })
            .collect();
        let mask = Tensor::from_vec(chosen, probs.shape(), x.device())?;
        let mut weights = (probs * mask)?;
        if norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let mut out = x.zeros_like()?;
        for (e, expert) in block.experts.iter().enumerate() {
            out = (out + expert.apply(x)?.broadcast_mul(&weights.narrow(1, e, 1)?)?)?;
        }
        let shared = block
            .shared_expert
            .as_ref()
            .expect("the test block has one");
        out + shared
            .mlp
            .apply(x)?
            .broadcast_mul(&sigmoid(&shared.gate.forward(x)?)?)?
    }

    /// Gradients of the block for its input and the router's adapter against finite differences and the dense
    /// composite, with and without renormalization.
    #[test]
    fn moe_block_gradients() {
        for norm_topk_prob in [false, true] {
            let f =
                move |xs: &[Tensor]| Ok(block(&xs[1], &xs[2], norm_topk_prob).forward(&xs[0])?.0);
            let r = move |xs: &[Tensor]| {
                dense_reference(
                    &block(&xs[1], &xs[2], norm_topk_prob),
                    &xs[0],
                    norm_topk_prob,
                )
            };
            let inputs = [
                rand_f64(&[6, HIDDEN], 2),
                rand_f64(&[2, HIDDEN], 3),
                rand_f64(&[EXPERTS, 2], 4),
            ];
            check(&f, &r, &inputs, &[true, true, true], 20, 1e-5, 1e-10);
        }
    }

    /// With tiling, each expert (and the shared expert) runs over slices of its own tokens: the block's output,
    /// its input gradient and the gradients of adapters on an expert's, the shared expert's and the router's
    /// projections equal the untiled block's within 1e-12 in float64 (summation order only: see the tiled MLP's
    /// test in `models/mlp.rs`), with slices of at most 1, 2 and 3 of each expert's rows.
    #[test]
    fn tiled_experts_equal_the_untiled_block() {
        let mut b = block(
            &rand_f64(&[2, HIDDEN], 3),
            &rand_f64(&[EXPERTS, 2], 4),
            true,
        );
        let mut params = vec![];
        let mut adapt = |l: &mut Linear, seed: u64| {
            let (out, inp) = l.base.weight.dims2().unwrap();
            let a = Var::from_tensor(&rand_f64(&[2, inp], seed)).unwrap();
            let bb = Var::from_tensor(&rand_f64(&[out, 2], seed + 1)).unwrap();
            params.extend([a.clone(), bb.clone()]);
            l.adapters.insert(
                "default".into(),
                Arc::new(LoraAdapter {
                    a,
                    b: bb,
                    scaling: 0.5,
                    dropout: 0.0,
                    magnitude: None,
                    module_id: seed,
                    runtime: Arc::default(),
                }),
            );
            l.active = Some("default".into());
        };
        adapt(&mut b.experts[1].down_proj, 50);
        if let GateUpProjections::Separate { gate_proj, .. } = &mut b.experts[0].gate_up {
            adapt(gate_proj, 60);
        }
        let shared = b.shared_expert.as_mut().expect("the test block has one");
        adapt(&mut shared.mlp.down_proj, 70);
        params.extend(
            b.gate
                .active_adapter()
                .map(|ad| [ad.a.clone(), ad.b.clone()])
                .into_iter()
                .flatten(),
        );
        let x = Var::from_tensor(&rand_f64(&[2, 5, HIDDEN], 8)).unwrap();
        let w = rand_f64(&[2, 5, HIDDEN], 9);
        let run = |slice_rows: Option<usize>| {
            let sink = GradSink::new();
            let tiling = slice_rows.map(|rows| MlpTiling {
                sink: sink.clone(),
                params: params.clone(),
                slice_rows: Some(rows),
            });
            let (y, _, _) = b
                .forward_with_choices(x.as_tensor(), tiling.as_ref())
                .unwrap();
            let mut g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            sink.merge_into(&mut g).unwrap();
            (y, g)
        };
        let (y0, g0) = run(None);
        for rows in [1, 2, 3] {
            let (y, g) = run(Some(rows));
            assert!(
                max_abs_diff(&y0, &y) < 1e-12,
                "output, {rows} rows per slice"
            );
            let dx = max_abs_diff(g0.get(&x).unwrap(), g.get(&x).unwrap());
            assert!(dx < 1e-12, "input gradient: {dx:e}, {rows} rows per slice");
            for (i, p) in params.iter().enumerate() {
                let d = max_abs_diff(g0.get(p).unwrap(), g.get(p).unwrap());
                assert!(d < 1e-12, "factor {i}: {d:e}, {rows} rows per slice");
            }
        }
    }

    /// Softmax rows sum to one, top-k takes the largest values first, and a block with no tokens gives none.
    #[test]
    fn routing_helpers() {
        let p = softmax_rows(&rand_f64(&[3, 5], 7)).unwrap();
        let sums: Vec<f64> = p.sum(1).unwrap().to_vec1().unwrap();
        assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-12));
        assert_eq!(top_k_indices(&[0.1, 0.5, 0.2, 0.5], 3), vec![1, 3, 2]);
        let b = block(
            &rand_f64(&[2, HIDDEN], 3),
            &rand_f64(&[EXPERTS, 2], 4),
            true,
        );
        let empty = Tensor::zeros((0, HIDDEN), DType::F64, &candle_core::Device::Cpu).unwrap();
        let (out, logits) = b.forward(&empty).unwrap();
        assert_eq!(
            (out.dims(), logits.dims()),
            (&[0, HIDDEN][..], &[0, EXPERTS][..])
        );
    }
}
