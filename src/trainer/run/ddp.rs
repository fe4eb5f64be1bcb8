//! Data-parallel training over NCCL (feature `nccl`), as PyTorch's DistributedDataParallel under the HF Trainer:
//! every rank holds the whole model and its own micro-batches; after the backward the LoRA gradients are summed over
//! the ranks in buckets (each rank's gradients are already divided by the whole window's label tokens, so the sum
//! is one process's gradient over the same window), and every rank then takes the same optimizer step. The loss
//! sum and a stop request (Ctrl-C on any rank) are agreed the same way, and at each checkpoint the adapters of all
//! ranks are compared (a per-parameter checksum: a mismatch stops the run).

use std::sync::Arc;
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::distributed::{Communicator, Reduce, WorldEnv};
use crate::error::{Error, Result};
use crate::memory::DDP_BUCKET_CAP_MB;
use crate::trainer::settings::args::TrainingArguments;

/// This rank's part in a distributed run.
pub(super) struct Ddp {
    comm: Arc<Communicator>,
    /// This rank's GPU.
    device: Device,
    bucket_bytes: usize,
}

impl Ddp {
    /// Joins the job `world` describes on `device` (this rank's GPU), through `communicator` when this rank made
    /// it already ([`Ddp::connect`]).
    pub(super) fn join(
        device: &Device,
        world: &WorldEnv,
        args: &TrainingArguments,
        communicator: Option<Arc<Communicator>>,
    ) -> Result<Self> {
        let comm = match communicator {
            Some(c) => c,
            None => Self::connect(device, world, args)?,
        };
        Ok(Ddp {
            comm,
            device: device.clone(),
            bucket_bytes: (args.ddp_bucket_cap_mb.unwrap_or(DDP_BUCKET_CAP_MB) * (1 << 20) as f64)
                as usize,
        })
    }

    /// The communicator of the job `world` describes, on `device` (this rank's GPU), with `args`' `ddp_timeout`.
    pub(super) fn connect(
        device: &Device,
        world: &WorldEnv,
        args: &TrainingArguments,
    ) -> Result<Arc<Communicator>> {
        let Device::Cuda(gpu) = device else {
            return Err(Error::InvalidInput(format!(
                "rank {} of {}: distributed training runs on GPUs (one per rank, over NCCL), but this rank has \
                 none{}",
                world.rank,
                world.world_size,
                if args.use_cpu { " (use_cpu = true)" } else { "" }
            )));
        };
        let timeout = Duration::from_secs(args.ddp_timeout);
        Ok(Arc::new(Communicator::new(gpu, world, timeout)?))
    }

    /// The communicator, for the layers of a sharded base to gather through (FSDP).
    pub(super) fn exchange(&self) -> Arc<Communicator> {
        self.comm.clone()
    }

    /// Sums the gradients of `vars` over the ranks in place, in buckets of about `ddp_bucket_cap_mb` (in reverse
    /// parameter order, as DDP fills them), for `step`.
    pub(super) fn reduce_gradients(
        &self,
        vars: &[Var],
        grads: &mut GradStore,
        step: usize,
    ) -> Result<()> {
        let mut bucket: Vec<(&Var, Tensor)> = Vec::new();
        let mut bytes = 0;
        for var in vars.iter().rev() {
            let Some(g) = grads.get(var).cloned() else {
                continue;
            };
            if bucket
                .first()
                .is_some_and(|(_, first)| first.dtype() != g.dtype())
            {
                self.reduce_bucket(&mut bucket, grads, step)?;
                bytes = 0;
            }
            bytes += g.elem_count() * g.dtype().size_in_bytes();
            bucket.push((var, g));
            if bytes >= self.bucket_bytes {
                self.reduce_bucket(&mut bucket, grads, step)?;
                bytes = 0;
            }
        }
        self.reduce_bucket(&mut bucket, grads, step)
    }

    fn reduce_bucket(
        &self,
        bucket: &mut Vec<(&Var, Tensor)>,
        grads: &mut GradStore,
        step: usize,
    ) -> Result<()> {
        if bucket.is_empty() {
            return Ok(());
        }
        let flat: Vec<Tensor> = bucket
            .iter()
            .map(|(_, g)| g.flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let summed = self.comm.all_reduce(
            &Tensor::cat(&flat, 0)?,
            Reduce::Sum,
            &format!("step {step}'s gradients"),
        )?;
        let mut offset = 0;
        for (var, g) in bucket.drain(..) {
            let n = g.elem_count();
            grads.insert(var, summed.narrow(0, offset, n)?.reshape(g.shape())?);
            offset += n;
        }
        Ok(())
    }

    /// `[loss sum, stop]` summed over the ranks, on the device (read with the gradient norm): the window's loss
    /// sum of all ranks (`loss_sum`, a float64 scalar) and a positive value when any rank was asked to `stop`.
    pub(super) fn agree(&self, loss_sum: &Tensor, stop: bool, step: usize) -> Result<Tensor> {
        let stop = Tensor::new(&[if stop { 1f64 } else { 0.0 }], loss_sum.device())?;
        let both = Tensor::cat(&[&loss_sum.reshape(1)?, &stop], 0)?;
        self.comm
            .all_reduce(&both, Reduce::Sum, &format!("step {step}'s loss"))
    }

    /// `values` summed over the ranks in place (in float64, exact for counts below 2^53); `what` names them in
    /// errors.
    pub(super) fn sum(&self, values: &mut [f64], what: &str) -> Result<()> {
        let summed = self
            .comm
            .all_reduce(&Tensor::new(&*values, &self.device)?, Reduce::Sum, what)?
            .to_vec1::<f64>()?;
        for (value, sum) in values.iter_mut().zip(summed) {
            *value = sum;
        }
        Ok(())
    }

    /// An error unless every rank holds the same values of `vars` (each parameter's sum, compared by the largest
    /// and smallest over the ranks), checked before `step`'s checkpoint.
    pub(super) fn check_same_adapter(&self, vars: &[Var], step: usize) -> Result<()> {
        if vars.is_empty() {
            return Ok(());
        }
        let sums: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().to_dtype(DType::F64)?.sum_all())
            .collect::<candle_core::Result<_>>()?;
        let sums = Tensor::stack(&sums, 0)?;
        let what = format!("the adapter checksums of step {step}");
        let high = self.comm.all_reduce(&sums, Reduce::Max, &what)?;
        let low = self.comm.all_reduce(&sums, Reduce::Min, &what)?;
        let differ = high
            .ne(&low)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()?;
        if differ > 0 {
            return Err(Error::Distributed(format!(
                "rank {}: before the checkpoint of step {step}, {differ} of {} adapter parameters differ between the \
                 ranks (they must stay identical: same seed, same reduced gradients); the run stops so that no \
                 checkpoint mixes them",
                self.comm.rank(),
                vars.len()
            )));
        }
        Ok(())
    }
}
