//! `LoraLinear`: a frozen base layer (dense or 4-bit) plus named LoRA adapters, one of them active.
//!
//! `y = base(x) + scaling · B·A·dropout(x)` with `A: [r, in]`, `B: [out, r]` float32 masters (PEFT's layout). Only
//! the adapter branch is scaled, and dropout applies only to the adapter's input and only in training. DoRA adds a
//! trainable magnitude per output row: `y = base(x) + (m/‖W + s·BA‖ − 1)·(x·Wᵀ) + (m/‖W + s·BA‖)·s·B·A·x`, the norm
//! detached as in PEFT.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{Result, Tensor, Var, D};

use crate::ops::low_rank_linear::dropout_mask;
use crate::ops::{
    frozen_linear, low_rank_linear, low_rank_linear_from_heads, low_rank_linear_plus,
    low_rank_linear_to_heads, merge_heads, rope_split_heads, split_heads, BranchDropout,
    FrozenLinear, LowRank, OutputValue, Pass,
};
use crate::rng::splitmix;

/// Training state shared by every adapter of a model: whether dropout is on, and the seed of the current step
/// (a checkpointed layer recomputed in the backward replays the same dropout masks from it).
#[derive(Debug, Default)]
pub struct LoraRuntime {
    training: AtomicBool,
    step_seed: AtomicU64,
}

impl LoraRuntime {
    /// Turns dropout on or off.
    pub fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    /// Sets the seed dropout masks derive from (call once per micro-batch).
    pub fn set_step_seed(&self, seed: u64) {
        self.step_seed.store(seed, Ordering::Relaxed);
    }

    fn training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
}

/// One adapter on one module.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    /// `[r, in_features]`, float32.
    pub a: Var,
    /// `[out_features, r]`, float32.
    pub b: Var,
    /// `lora_alpha / r` (or `/ sqrt(r)`).
    pub scaling: f64,
    /// Dropout probability on the adapter's input.
    pub dropout: f64,
    /// DoRA magnitude `[out_features]`, float32.
    pub magnitude: Option<Var>,
    /// Distinguishes this module's dropout stream.
    pub module_id: u64,
    /// Shared training switch and step seed.
    pub runtime: Arc<LoraRuntime>,
}

/// A frozen base layer with its adapters.
#[derive(Clone, Debug)]
pub struct LoraLinear {
    /// The frozen base.
    pub base: Arc<FrozenLinear>,
    /// Adapters by name.
    pub adapters: BTreeMap<String, Arc<LoraAdapter>>,
    /// The adapter in use, if any.
    pub active: Option<String>,
}

impl LoraAdapter {
    /// The dropout of this step (probability and mask seed), or `None` outside training or without dropout.
    /// The seed is a pure function of (step seed, module), so a recomputed step draws the same mask.
    fn branch_dropout(&self) -> Option<BranchDropout> {
        (self.dropout > 0.0 && self.runtime.training()).then(|| BranchDropout {
            p: self.dropout,
            seed: splitmix(
                self.runtime.step_seed.load(Ordering::Relaxed) ^ splitmix(self.module_id),
            ),
        })
    }

    /// The adapter as the low-rank branch of the fused op.
    fn branch(&self) -> LowRank<'_> {
        LowRank {
            a: self.a.as_tensor(),
            b: self.b.as_tensor(),
            scaling: self.scaling,
            dropout: self.branch_dropout(),
        }
    }

    /// Inverted dropout of the adapter input (mask from [`dropout_mask`]).
    fn dropout(&self, x: &Tensor) -> Result<Tensor> {
        match self.branch_dropout() {
            Some(d) => x * dropout_mask(d.seed, d.p, x.dims(), x.dtype(), x.device())?,
            None => Ok(x.clone()),
        }
    }

    /// `scaling · B·A·x` in the masters' dtype (float32; f64 in gradient checks) for `x: [..., in]`.
    fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let inp = *dims.last().unwrap_or(&0);
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let h = x
            .to_dtype(self.a.dtype())?
            .reshape((rows, inp))?
            .matmul(&self.a.as_tensor().t()?)?;
        let y = (h.matmul(&self.b.as_tensor().t()?)? * self.scaling)?;
        let mut out = dims;
        if let Some(last) = out.last_mut() {
            *last = self.b.dim(0)?;
        }
        y.reshape(out)
    }

    /// `‖W + s·B·A‖` per output row, detached, in the masters' dtype.
    pub fn weight_norm(&self, base: &FrozenLinear) -> Result<Tensor> {
        let w = base.weight.to_dense(self.a.dtype())?;
        let ba = self
            .b
            .as_tensor()
            .detach()
            .matmul(&self.a.as_tensor().detach())?;
        (w + (ba * self.scaling)?)?.sqr()?.sum(D::Minus1)?.sqrt()
    }
}

impl LoraLinear {
    /// A layer with no adapters.
    pub fn new(base: Arc<FrozenLinear>) -> Self {
        LoraLinear {
            base,
            adapters: BTreeMap::new(),
            active: None,
        }
    }

    /// The active adapter, if any.
    pub fn active_adapter(&self) -> Option<&Arc<LoraAdapter>> {
        self.active.as_ref().and_then(|n| self.adapters.get(n))
    }

    /// Base output plus the active adapter's update (LoRA as one fused op; DoRA composed from ops).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, OutputValue::Computed)
    }

    /// `residual + forward(x)`: a residual connection around the projection. With a LoRA adapter one fused op, so
    /// that the graph keeps no separate projection output. In a [`Pass::Recompute`] (whose output is only
    /// differentiated) the fused op skips computing the value; the graph and the gradients are the same.
    pub fn forward_plus(&self, x: &Tensor, residual: &Tensor, pass: Pass) -> Result<Tensor> {
        let output = match pass {
            Pass::Forward => OutputValue::Computed,
            Pass::Recompute => OutputValue::Skipped,
        };
        match self.plain_lora() {
            Some(ad) => low_rank_linear_plus(x, &self.base, &ad.branch(), output, residual),
            None => residual + self.run(x, output)?,
        }
    }

    /// [`LoraLinear::forward`] of `x: [b, t, in]` split into `heads` attention heads `[b, heads, t, d]`, rotated by
    /// RoPE when `rope` (cos, sin) is given. With a LoRA adapter one fused op, so that the graph does not keep the
    /// unsplit projection.
    pub fn forward_to_heads(
        &self,
        x: &Tensor,
        heads: usize,
        rope: Option<(&Tensor, &Tensor)>,
    ) -> Result<Tensor> {
        if let Some(ad) = self.plain_lora() {
            return low_rank_linear_to_heads(x, &self.base, &ad.branch(), heads, rope);
        }
        let y = self.forward(x)?;
        match rope {
            Some((cos, sin)) => rope_split_heads(&y, heads, cos, sin),
            None => split_heads(&y, heads),
        }
    }

    /// `residual + forward(merge_heads(y))` for attention heads `y: [b, h, t, d]`. With a LoRA adapter one fused
    /// op, so that the graph keeps neither the merged copy nor a separate projection output.
    pub fn forward_from_heads_plus(&self, y: &Tensor, residual: &Tensor) -> Result<Tensor> {
        match self.plain_lora() {
            Some(ad) => low_rank_linear_from_heads(y, &self.base, &ad.branch(), Some(residual)),
            None => residual + self.forward(&merge_heads(y)?)?,
        }
    }

    /// `forward(merge_heads(y))` for attention heads `y: [b, h, t, d]` (one fused op with a LoRA adapter).
    pub fn forward_from_heads(&self, y: &Tensor) -> Result<Tensor> {
        match self.plain_lora() {
            Some(ad) => low_rank_linear_from_heads(y, &self.base, &ad.branch(), None),
            None => self.forward(&merge_heads(y)?),
        }
    }

    /// Whether the active adapter draws a dropout mask now (training with `lora_dropout > 0`). The mask is indexed
    /// by each element's place in the whole input, so a call on a slice of the rows would draw another one.
    pub fn dropout_active(&self) -> bool {
        self.active_adapter()
            .is_some_and(|ad| ad.branch_dropout().is_some())
    }

    /// The active adapter when it is plain LoRA (no DoRA magnitude): the case the fused op computes.
    fn plain_lora(&self) -> Option<&Arc<LoraAdapter>> {
        self.active_adapter().filter(|ad| ad.magnitude.is_none())
    }

    fn run(&self, x: &Tensor, output: OutputValue) -> Result<Tensor> {
        if let Some(ad) = self.plain_lora() {
            return low_rank_linear(x, &self.base, &ad.branch(), output);
        }
        let Some(ad) = self.active_adapter() else {
            return frozen_linear(x, &self.base);
        };
        let base = frozen_linear(x, &self.base)?;
        let xd = ad.dropout(x)?;
        let delta = ad.delta(&xd)?;
        let update = match &ad.magnitude {
            None => delta,
            Some(m) => {
                // PEFT: with dropout active the base term is recomputed from the dropped-out input.
                let master = ad.a.dtype();
                let base_m = if ad.dropout > 0.0 && ad.runtime.training() {
                    frozen_linear(&xd, &self.base)?.to_dtype(master)?
                } else {
                    base.to_dtype(master)?
                };
                let base_no_bias = match &self.base.bias {
                    Some(b) => base_m.broadcast_sub(&b.to_dtype(master)?)?,
                    None => base_m,
                };
                let scale = m.as_tensor().broadcast_div(&ad.weight_norm(&self.base)?)?;
                (base_no_bias.broadcast_mul(&(&scale - 1.0)?)? + delta.broadcast_mul(&scale)?)?
            }
        };
        let dtype = base.dtype();
        base + update.to_dtype(dtype)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};
    use crate::ops::FrozenWeight;
    use candle_core::DType;

    fn layer(
        w: &Tensor,
        a: &Tensor,
        b: &Tensor,
        magnitude: Option<&Tensor>,
        dropout: f64,
    ) -> LoraLinear {
        let base = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(w.clone()),
            Some(rand_f64(&[w.dim(0).unwrap()], 9)),
        ));
        let adapter = LoraAdapter {
            a: Var::from_tensor(a).unwrap(),
            b: Var::from_tensor(b).unwrap(),
            scaling: 1.5,
            dropout,
            magnitude: magnitude.map(|m| Var::from_tensor(m).unwrap()),
            module_id: 3,
            runtime: Arc::default(),
        };
        let mut l = LoraLinear::new(base);
        l.adapters.insert("default".into(), Arc::new(adapter));
        l.active = Some("default".into());
        l
    }

    /// Gradients for x, A and B (and the DoRA magnitude) against finite differences and a composite reference.
    #[test]
    fn lora_and_dora_gradients() {
        let w = rand_f64(&[5, 4], 1);
        let bias = rand_f64(&[5], 9);
        for dora in [false, true] {
            let w2 = w.clone();
            // The layer wraps the checker's tensors (a Var made from a Var is the same variable).
            let f = move |xs: &[Tensor]| {
                layer(&w2, &xs[1], &xs[2], dora.then(|| &xs[3]), 0.0).forward(&xs[0])
            };
            let (w3, b3) = (w.clone(), bias.clone());
            let r = move |xs: &[Tensor]| {
                let base = xs[0].matmul(&w3.t()?)?;
                let delta = (xs[0].matmul(&xs[1].t()?)?.matmul(&xs[2].t()?)? * 1.5)?;
                if !dora {
                    return (base + delta)?.broadcast_add(&b3);
                }
                let merged = (&w3 + (xs[2].matmul(&xs[1])? * 1.5)?)?;
                let norm = merged.sqr()?.sum(1)?.sqrt()?.detach();
                let scale = xs[3].broadcast_div(&norm)?;
                let with_bias =
                    (base.broadcast_add(&b3)? + base.broadcast_mul(&(&scale - 1.0)?)?)?;
                with_bias + delta.broadcast_mul(&scale)?
            };
            let m = (rand_f64(&[5], 4) + 2.0).unwrap();
            let mut inputs = vec![
                rand_f64(&[3, 4], 2),
                rand_f64(&[2, 4], 3),
                rand_f64(&[5, 2], 5),
            ];
            let mut diff = vec![true, true, true];
            if dora {
                inputs.push(m);
                diff.push(true);
            }
            if dora {
                // PEFT detaches the weight norm, which depends on A and B: the DoRA gradient for A and B is not the
                // true derivative, so those are checked against the composite reference only (0 samples), while
                // x and the magnitude (which the norm does not depend on) are checked against finite differences.
                check(&f, &r, &inputs, &diff, 0, 1e-5, 1e-10);
                check(
                    &f,
                    &r,
                    &inputs,
                    &[true, false, false, true],
                    20,
                    1e-5,
                    1e-10,
                );
            } else {
                check(&f, &r, &inputs, &diff, 20, 1e-5, 1e-10);
            }
        }
    }

    #[test]
    fn dropout_only_on_the_adapter_branch_and_only_in_training() {
        let w = rand_f64(&[4, 6], 1).to_dtype(DType::F32).unwrap();
        let a = rand_f64(&[2, 6], 2).to_dtype(DType::F32).unwrap();
        let b = rand_f64(&[4, 2], 3).to_dtype(DType::F32).unwrap();
        let l = layer(&w, &a, &b, None, 0.5);
        let x = rand_f64(&[64, 6], 4).to_dtype(DType::F32).unwrap();
        let eval = l.forward(&x).unwrap();
        let rt = l.active_adapter().unwrap().runtime.clone();
        rt.set_training(true);
        rt.set_step_seed(7);
        let t1 = l.forward(&x).unwrap();
        let t2 = l.forward(&x).unwrap();
        rt.set_step_seed(8);
        let t3 = l.forward(&x).unwrap();
        let d = |p: &Tensor, q: &Tensor| {
            (p - q)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(
            d(&t1, &t2),
            0.0,
            "same step seed, same mask (checkpoint replay)"
        );
        assert!(d(&t1, &t3) > 0.0 && d(&t1, &eval) > 0.0);
        // The base path is never dropped: with B = 0 training and eval outputs are equal.
        let l0 = layer(&w, &a, &b.zeros_like().unwrap(), None, 0.5);
        l0.active_adapter().unwrap().runtime.set_training(true);
        assert_eq!(
            d(
                &l0.forward(&x).unwrap(),
                &frozen_linear(&x, &l0.base).unwrap()
            ),
            0.0
        );
    }
}
