//! The reference model of DPO with LoRA, as TRL computes it for a PEFT model: the base model (the trained adapter
//! switched off) for a new adapter, a frozen copy of the starting adapter when the run continues one — no second
//! copy of the base either way — or nothing at all (`reference_free`: log-probabilities 0). Precomputed values are
//! kept in each checkpoint (`reference_logps.safetensors`).

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::adapter::Adapters;
use crate::data::{chosen_then_rejected, collate, PreferencePair};
use crate::error::{Error, Result};
use crate::files::{write_safetensors, MappedSafetensors, RawTensor};
use crate::models::{Checkpointing, LlamaModel};
use crate::precision::master_dtype;

/// The name of the frozen copy of the starting adapter.
pub const REFERENCE_ADAPTER: &str = "reference";

/// The file holding precomputed reference log-probabilities in a checkpoint.
pub const REFERENCE_FILE: &str = "reference_logps.safetensors";

/// Where the reference log-probabilities come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Reference {
    /// The base model: the adapters switched off (a new adapter starts equal to it).
    Base,
    /// A frozen copy of the adapter the run started from, loaded under [`REFERENCE_ADAPTER`].
    Frozen,
    /// No model: every log-probability is 0 (`reference_free`).
    Uniform,
}

/// Sequence log-probabilities of `pairs` under the model as it is (chosen rows then rejected rows, `[2n]`
/// float32 — float64 for a float64 model —, detached). Layers run checkpointed, so a pass through trainable adapters keeps no more than a training
/// forward does.
pub fn pair_logps(model: &LlamaModel, pairs: &[&PreferencePair]) -> Result<Tensor> {
    let rows = chosen_then_rejected(pairs);
    let batch = collate(&rows, &Device::Cpu)?;
    let ck = Checkpointing {
        enabled: true,
        ..Default::default()
    };
    let hidden = model.forward_embeds(&model.embed(&batch.ids)?, &batch.positions, &ck)?;
    Ok(model
        .sequence_logps(&hidden, &batch.labels.to_device(model.device())?)?
        .detach())
}

impl Reference {
    /// The reference log-probabilities of each of `batches` (see [`pair_logps`]), with the model switched to the
    /// reference for the whole call and back to adapter `trained` after it (also after an error).
    pub fn logps(
        &self,
        model: &mut LlamaModel,
        trained: &str,
        batches: &[Vec<&PreferencePair>],
    ) -> Result<Vec<Tensor>> {
        match self {
            Reference::Uniform => {
                return batches
                    .iter()
                    .map(|b| {
                        Ok(Tensor::zeros(
                            2 * b.len(),
                            logps_dtype(model),
                            model.device(),
                        )?)
                    })
                    .collect()
            }
            Reference::Base => model.disable_adapters(),
            Reference::Frozen => model.set_adapter(REFERENCE_ADAPTER)?,
        }
        model.lora_runtime.set_training(false);
        let result = batches.iter().map(|b| pair_logps(model, b)).collect();
        model.set_adapter(trained)?;
        result
    }

    /// The reference log-probabilities `[chosen, rejected]` of every pair, in batches of `batch_size`.
    pub fn precompute(
        &self,
        model: &mut LlamaModel,
        trained: &str,
        pairs: &[PreferencePair],
        batch_size: usize,
    ) -> Result<Vec<[f64; 2]>> {
        let batches: Vec<Vec<&PreferencePair>> = pairs
            .chunks(batch_size.max(1))
            .map(|c| c.iter().collect())
            .collect();
        let mut values = Vec::with_capacity(pairs.len());
        for (batch, logps) in batches.iter().zip(self.logps(model, trained, &batches)?) {
            let v: Vec<f64> = logps.to_dtype(DType::F64)?.to_vec1()?;
            let n = batch.len();
            values.extend((0..n).map(|i| [v[i], v[n + i]]));
        }
        Ok(values)
    }
}

/// The dtype of `model`'s sequence log-probabilities (see [`pair_logps`]).
fn logps_dtype(model: &LlamaModel) -> DType {
    master_dtype(model.compute_dtype())
}

/// `[2n]` log-probabilities (chosen then rejected) of the pairs at `indices` from precomputed `values`, on
/// `model`'s device in the dtype of its log-probabilities.
pub fn stored_logps(values: &[[f64; 2]], indices: &[usize], model: &LlamaModel) -> Result<Tensor> {
    let v: Vec<f64> = (0..2)
        .flat_map(|side| indices.iter().map(move |&i| values[i][side]))
        .collect();
    let t = Tensor::from_vec(v, 2 * indices.len(), model.device())?;
    Ok(t.to_dtype(logps_dtype(model))?)
}

/// Writes precomputed reference log-probabilities (`train`, and `eval` when there are evaluation pairs) into `dir`,
/// in the dtype of `model`'s log-probabilities (which holds them exactly).
pub fn save_reference(
    dir: &Path,
    train: &[[f64; 2]],
    eval: &[[f64; 2]],
    model: &LlamaModel,
) -> Result<()> {
    let tensor = |values: &[[f64; 2]]| -> Result<RawTensor<'static>> {
        let flat: Vec<f64> = values.iter().flatten().copied().collect();
        let t = Tensor::from_vec(flat, (values.len(), 2), &Device::Cpu)?;
        RawTensor::from_tensor(&t.to_dtype(logps_dtype(model))?)
    };
    let mut tensors = vec![("train".to_string(), tensor(train)?)];
    if !eval.is_empty() {
        tensors.push(("eval".to_string(), tensor(eval)?));
    }
    write_safetensors(&dir.join(REFERENCE_FILE), tensors, None)
}

/// Precomputed `[chosen, rejected]` reference log-probabilities of the training pairs and of the evaluation pairs.
pub type StoredReference = (Vec<[f64; 2]>, Vec<[f64; 2]>);

/// Reads what [`save_reference`] wrote in checkpoint `dir`, checked against the run's `train` and `eval` pair
/// counts; `None` when the checkpoint has no such file.
pub fn load_reference(dir: &Path, train: usize, eval: usize) -> Result<Option<StoredReference>> {
    let path = dir.join(REFERENCE_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let file = MappedSafetensors::open(&path)?;
    let st = file.tensors()?;
    let read = |key: &str, expected: usize| -> Result<Vec<[f64; 2]>> {
        if expected == 0 {
            return Ok(vec![]);
        }
        let view = st
            .tensor(key)
            .map_err(|_| Error::invalid_file(&path, format!("no `{key}` tensor")))?;
        let t = candle_core::safetensors::Load::load(&view, &Device::Cpu)
            .map_err(|e| Error::invalid_file(&path, format!("`{key}`: {e}")))?;
        let values: Vec<Vec<f64>> = t.to_dtype(DType::F64)?.to_vec2()?;
        if values.len() != expected {
            return Err(Error::invalid_file(
                &path,
                format!(
                    "`{key}` holds {} pairs, this run has {expected}: the data changed since the checkpoint; resume \
                     with the same data, or start a new run",
                    values.len()
                ),
            ));
        }
        Ok(values.iter().map(|v| [v[0], v[1]]).collect())
    };
    Ok(Some((read("train", train)?, read("eval", eval)?)))
}
