//! Embedding lookup. A frozen table (a plain tensor) builds no graph; a trainable table (a `Var`, e.g.
//! `modules_to_save = ["embed_tokens"]`) gets its gradient by scatter-add (Candle's `index_select` backward).

use candle_core::{Result, Tensor};

/// Rows of `table` (`[vocab, hidden]`) for `ids` (`[batch, seq]`, u32): `[batch, seq, hidden]`, on the table's
/// device. The ids are range-checked where they are — give them on the host to spare a GPU table a read back — and
/// then moved to the table's device.
pub fn embedding(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    let (b, t) = ids.dims2()?;
    let hidden = table.dim(1)?;
    let vocab = table.dim(0)?;
    let flat = ids.flatten_all()?;
    if let Some(bad) = flat
        .to_vec1::<u32>()?
        .into_iter()
        .find(|i| *i as usize >= vocab)
    {
        candle_core::bail!("token id {bad} is out of range for a vocabulary of {vocab}");
    }
    let flat = flat.to_device(table.device())?;
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() && crate::cuda::fused_kernels() && !table.track_op() {
        return cuda_rows(table, &flat)?.reshape((b, t, hidden));
    }
    table.index_select(&flat, 0)?.reshape((b, t, hidden))
}

/// The rows of a frozen table on a CUDA device for range-checked `ids` there (`kernels/embedding.cu`).
#[cfg(feature = "cuda")]
fn cuda_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    use crate::cuda::{
        alloc, device_of, hold, kernel, rows_grid, run, suffix, tensor, with_float_type, EMBEDDING,
    };
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    let (table, ids) = (
        table.contiguous()?,
        ids.to_dtype(candle_core::DType::U32)?.contiguous()?,
    );
    let (n, hidden) = (ids.elem_count(), table.dim(1)?);
    let device = device_of(&table)?;
    let func = kernel(
        &device,
        &EMBEDDING,
        &format!("embedding_rows{}", suffix(table.dtype())?),
    )?;
    let (th, ih) = (hold(&table)?, hold(&ids)?);
    let iv = ih.view::<u32>()?;
    let (n_u, hidden_u) = (n as u64, hidden as u64);
    Ok(with_float_type!(table.dtype(), T => {
        let tv = th.view::<T>()?;
        let mut out = alloc::<T>(&device, n * hidden)?;
        let mut args = func.builder();
        args.arg(&tv).arg(&iv).arg(&n_u).arg(&hidden_u).arg(&mut out);
        run(&mut args, rows_grid(n_u))?;
        tensor(out, &device, (n, hidden))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};

    #[test]
    fn trainable_table_gradient_is_a_scatter_add() {
        let ids = Tensor::new(&[[1u32, 3, 1], [0, 2, 3]], &candle_core::Device::Cpu).unwrap();
        let ids2 = ids.clone();
        let f = move |xs: &[Tensor]| embedding(&ids, &xs[0]);
        let r = move |xs: &[Tensor]| {
            let oh = candle_nn::encoding::one_hot(ids2.clone(), 4, 1f64, 0f64)?;
            oh.broadcast_matmul(&xs[0])
        };
        check(&f, &r, &[rand_f64(&[4, 5], 1)], &[true], 20, 1e-6, 1e-12);
    }

    #[test]
    fn out_of_range_ids_are_an_error() {
        let ids = Tensor::new(&[[7u32]], &candle_core::Device::Cpu).unwrap();
        let err = embedding(&ids, &rand_f64(&[4, 2], 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("token id 7 is out of range"), "{err}");
    }
}
