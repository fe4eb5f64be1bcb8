//! Launching the crate's own CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs`; built with the `cuda`
//! feature only).
//!
//! A kernel module is loaded once per device (Candle caches it by name). Kernels read contiguous tensors through
//! [`Held`] (the storage stays locked for the launch), write into buffers allocated here ([`alloc`]), and those
//! buffers become tensors without a copy ([`tensor`], [`storage`]). Every kernel indexes with 64-bit integers and loops grid-stride, so a
//! tensor of more than 2³² elements is covered whole.

pub(crate) mod side_stream;

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchArgs, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

/// Whether the ops run the crate's own kernels on CUDA (see [`fused_kernels`]).
static FUSED_KERNELS: AtomicBool = AtomicBool::new(true);

/// Whether the ops run the crate's own kernels on a CUDA device — RMSNorm, RoPE and the head moves, SwiGLU/GeGLU,
/// attention, the fused linear cross-entropy, the LoRA projection, 4-bit dequantization and the decoding product —
/// (the default), or Candle's composed ops in their place (`TrainingArguments::use_liger_kernel = false`). Dropout
/// masks, NEFTune noise and the optimizers keep their kernels either way: those make the CPU's exact numbers on the
/// device, and any other route would move every element through the host.
pub(crate) fn fused_kernels() -> bool {
    FUSED_KERNELS.load(Ordering::Relaxed)
}

/// Sets [`fused_kernels`] for the whole process.
pub fn set_fused_kernels(on: bool) {
    FUSED_KERNELS.store(on, Ordering::Relaxed);
}

/// The compute capability this build's kernels target (`CUDA_COMPUTE_CAP` at build time, e.g. "80"): PTX for it runs
/// on that GPU generation and every later one.
pub(crate) const BUILD_COMPUTE_CAP: &str = env!("QLORA_CUDA_COMPUTE_CAP");
/// The CUDA toolkit that compiled the kernels ("13.0"): a driver must support it to compile their PTX.
const BUILD_TOOLKIT: &str = env!("QLORA_CUDA_TOOLKIT");

/// `"13.0"` → 13000, CUDA's integer form of a version.
fn cuda_version_number(version: &str) -> i32 {
    let mut parts = version.split('.').map(|p| p.parse::<i32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    major * 1000 + minor * 10
}

/// The oldest NVIDIA driver branch that runs a CUDA version's PTX (NVIDIA's release notes, table 3).
fn minimum_driver(cuda: i32) -> &'static str {
    match cuda {
        ..=12009 => "525",
        12010..=12019 => "530",
        12020..=12029 => "535",
        12030..=12039 => "545",
        12040..=12049 => "550",
        12050..=12059 => "555",
        12060..=12079 => "560",
        12080..=12089 => "570",
        12090..=12999 => "575",
        _ => "580",
    }
}

/// Checks at start that `device`'s driver compiles PTX of the build's toolkit (its compute capability against the
/// build's target: `precision::check_gpu_capability`). The error says what to update or rebuild, instead of a
/// failure at the first kernel.
pub fn check_device(device: &CudaDevice) -> Result<()> {
    let context = device.cuda_stream().context().clone();
    let name = context.name().unwrap_or_else(|_| "?".into());
    let ordinal = context.ordinal();
    let mut driver = 0;
    // SAFETY: cuDriverGetVersion writes one int.
    unsafe { candle_core::cuda_backend::cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(candle_core::Error::wrap)?;
    let needed = cuda_version_number(BUILD_TOOLKIT);
    if driver < needed {
        candle_core::bail!(
            "GPU {ordinal} ({name}): its NVIDIA driver supports CUDA {}.{}, but this build's kernels are PTX from CUDA \
             {BUILD_TOOLKIT}, which needs a driver for CUDA {BUILD_TOOLKIT} or newer (NVIDIA driver {} or later): \
             update the driver, or build with an older CUDA toolkit (docs/gpu.md, \"GPU builds\")",
            driver / 1000,
            driver % 1000 / 10,
            minimum_driver(needed),
        );
    }
    Ok(())
}

/// A kernel module: the name Candle caches it under, and its PTX.
pub(crate) struct Module {
    name: &'static str,
    ptx: &'static str,
}

macro_rules! module {
    ($file:literal) => {
        Module {
            name: concat!("candle_qlora_", $file),
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $file, ".ptx")),
        }
    };
}

/// `kernels/dequant.cu`: 4-bit dequantization.
pub(crate) const DEQUANT: Module = module!("dequant");
/// `kernels/nf4_matvec.cu`: decoding products straight from 4-bit codes.
pub(crate) const NF4_MATVEC: Module = module!("nf4_matvec");
/// `kernels/embedding.cu`: rows of a frozen embedding table.
pub(crate) const EMBEDDING: Module = module!("embedding");
/// `kernels/dropout.cu`: dropout masks and NEFTune noise from the counter-based generator.
pub(crate) const DROPOUT: Module = module!("dropout");
/// `kernels/norm.cu`: RMSNorm forward and backward.
pub(crate) const NORM: Module = module!("norm");
/// `kernels/swiglu.cu`: SwiGLU forward and backward.
pub(crate) const SWIGLU: Module = module!("swiglu");
/// `kernels/rope.cu`: rotary embeddings while moving rows between token-major and head-major layouts.
pub(crate) const ROPE: Module = module!("rope");
/// `kernels/attention.cu`: causal grouped-query attention on tensor cores, forward and backward.
pub(crate) const ATTENTION: Module = module!("attention");
/// `kernels/adamw.cu`: the optimizers' updates.
pub(crate) const ADAMW: Module = module!("adamw");
/// `kernels/cross_entropy.cu`: token losses and logit gradients of the fused linear cross-entropy.
pub(crate) const CROSS_ENTROPY: Module = module!("cross_entropy");

/// `$body` with the type `$T` bound to the Rust element type of float dtype `$dtype` (f32, bf16 or f16); another
/// dtype is an error.
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => {
                candle_core::bail!("no CUDA kernel for {other:?} (float32, bfloat16 or float16)")
            }
        }
    };
}
pub(crate) use with_float_type;

/// The kernel-name suffix of a float dtype (`_f32`, `_bf16`, `_f16`).
pub(crate) fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "_f32",
        DType::BF16 => "_bf16",
        DType::F16 => "_f16",
        other => candle_core::bail!("no CUDA kernel for {other:?} (float32, bfloat16 or float16)"),
    })
}

/// The CUDA device of `t`.
pub(crate) fn device_of(t: &Tensor) -> Result<CudaDevice> {
    Ok(t.device().as_cuda_device()?.clone())
}

/// A tensor's storage, locked for a kernel launch. The tensor must be contiguous.
pub(crate) struct Held<G> {
    storage: G,
    layout: Layout,
}

/// Locks `t`'s storage (a contiguous CUDA tensor) for reading in a launch.
pub(crate) fn hold(t: &Tensor) -> Result<Held<impl Deref<Target = Storage> + '_>> {
    if !t.is_contiguous() {
        candle_core::bail!("CUDA kernel: a strided input (make it contiguous first)");
    }
    let (storage, layout) = t.storage_and_layout();
    Ok(Held {
        storage,
        layout: layout.clone(),
    })
}

impl<G: Deref<Target = Storage>> Held<G> {
    /// The elements as a device view of `T`.
    pub(crate) fn view<T: CudaDType>(&self) -> Result<CudaView<'_, T>> {
        let Storage::Cuda(cuda) = &*self.storage else {
            candle_core::bail!("CUDA kernel: the input is not on a CUDA device");
        };
        let slice: &CudaSlice<T> = cuda.as_cuda_slice::<T>()?;
        let start = self.layout.start_offset();
        Ok(slice.slice(start..start + self.layout.shape().elem_count()))
    }
}

/// One block of 256 threads per row (grid-stride over rows beyond the grid).
pub(crate) fn rows_grid(rows: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 65_535 * 4) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride launch over `n` items: 256 threads a block, at most 65 535 · 4 blocks.
pub(crate) fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535 * 4) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A loaded kernel and the device's stream it runs on.
pub(crate) struct Kernel {
    stream: Arc<CudaStream>,
    func: CudaFunction,
}

impl Kernel {
    /// A launch of this kernel: push its arguments, in the kernel's order, then [`run`] it.
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// The CUDA function (for its attributes).
    pub(crate) fn function(&self) -> &CudaFunction {
        &self.func
    }
}

/// Kernel `name` of `module` on `device`; Candle loads the module once per device and caches it by name.
pub(crate) fn kernel(device: &CudaDevice, module: &Module, name: &str) -> Result<Kernel> {
    let func = device.get_or_load_custom_func(name, module.name, module.ptx)?;
    Ok(Kernel {
        stream: device.cuda_stream(),
        func: func.into_cuda_function(),
    })
}

/// Launches a kernel with its arguments pushed.
pub(crate) fn run(args: &mut LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    // SAFETY: each caller pushes the arguments its kernel declares, in order, and sizes the buffers it writes to
    // cover every index the kernel reaches for the counts it passes.
    unsafe { args.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// A new device buffer of `len` elements, uninitialized: the kernel that fills it must write every element.
pub(crate) fn alloc<T: DeviceRepr>(device: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: callers launch a kernel that writes all `len` elements before the buffer is read.
    unsafe { device.alloc::<T>(len) }
}

/// `slice` as the storage of a tensor on `device`.
pub(crate) fn storage<T: CudaDType>(slice: CudaSlice<T>, device: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, device.clone())
}

/// `slice` as a tensor of `shape` on `device`, without a copy.
pub(crate) fn tensor<T: CudaDType>(
    slice: CudaSlice<T>,
    device: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(storage(slice, device)),
        shape,
        BackpropOp::none(),
        false,
    )
}

/// A matrix on the device for [`gemm`]: its first element's address and its element dtype (f32, bf16 or f16).
#[derive(Clone, Copy)]
pub(crate) struct Matrix {
    ptr: u64,
    dtype: DType,
}

impl Matrix {
    /// The matrix whose elements `view` holds. Keep the second value (the access record) alive until the launch that
    /// reads the matrix has been queued.
    pub(crate) fn of<'a, T: DeviceRepr>(
        view: &'a CudaView<'_, T>,
        stream: &'a CudaStream,
        dtype: DType,
    ) -> (Self, impl Drop + 'a) {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        let (ptr, record) = view.device_ptr(stream);
        (Matrix { ptr, dtype }, record)
    }

    /// The matrix a kernel or GEMM writes into `slice` (see [`Matrix::of`]).
    pub(crate) fn of_mut<'a, T: DeviceRepr>(
        slice: &'a mut CudaSlice<T>,
        stream: &'a CudaStream,
        dtype: DType,
    ) -> (Self, impl Drop + 'a) {
        use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
        let (ptr, record) = slice.device_ptr_mut(stream);
        (Matrix { ptr, dtype }, record)
    }

    /// The matrix `offset` elements further on (a block of rows).
    pub(crate) fn offset(self, offset: usize) -> Self {
        Matrix {
            ptr: self.ptr + (offset * self.dtype.size_in_bytes()) as u64,
            ..self
        }
    }
}

/// The shape of a [`gemm`]: `c [m, n] = alpha · op(a) · op(b) + beta · c`, row-major, where `a` is stored
/// `[m, k]` (`[k, m]` when `a_t`, and `op(a)` its transpose) and `b` is stored `[k, n]` (`[n, k]` when `b_t`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_t: bool,
    pub b_t: bool,
    pub alpha: f32,
    pub beta: f32,
}

/// [`gemm`] on the device views and buffer given, each with its dtype (see [`GemmShape`]).
pub(crate) fn product<A: DeviceRepr, B: DeviceRepr, C: DeviceRepr>(
    device: &CudaDevice,
    shape: GemmShape,
    a: (&CudaView<'_, A>, DType),
    b: (&CudaView<'_, B>, DType),
    c: (&mut CudaSlice<C>, DType),
) -> Result<()> {
    let stream = device.cuda_stream();
    let (a, _a) = Matrix::of(a.0, &stream, a.1);
    let (b, _b) = Matrix::of(b.0, &stream, b.1);
    let (c, _c) = Matrix::of_mut(c.0, &stream, c.1);
    gemm(device, shape, a, b, c)
}

/// cuBLAS's name of a float dtype.
fn cublas_type(
    dtype: DType,
) -> Result<candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType> {
    use candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t as T;
    Ok(match dtype {
        DType::F32 => T::CUDA_R_32F,
        DType::BF16 => T::CUDA_R_16BF,
        DType::F16 => T::CUDA_R_16F,
        other => candle_core::bail!("cuBLAS GEMM: no {other:?} matrices"),
    })
}

/// `c = alpha · op(a) · op(b) + beta · c` (see [`GemmShape`]) by cuBLAS on `device`'s stream, accumulating in
/// float32 whatever the matrices' dtypes (`a` and `b` share one; `c` has it or is float32).
pub(crate) fn gemm(
    device: &CudaDevice,
    shape: GemmShape,
    a: Matrix,
    b: Matrix,
    c: Matrix,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas::{result::gemm_ex, sys};
    use std::ffi::{c_int, c_void};
    let GemmShape {
        m,
        n,
        k,
        a_t,
        b_t,
        alpha,
        beta,
    } = shape;
    let int = |x: usize| {
        c_int::try_from(x).map_err(|_| {
            candle_core::Error::Msg(format!("cuBLAS GEMM: dimension {x} exceeds 2^31 - 1"))
        })
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS gets B first. A row-major stored matrix
    // read column-major is its transpose, so the operations keep their flags and the leading dimensions are the
    // stored rows' lengths.
    let (ldb, lda) = (if b_t { k } else { n }, if a_t { m } else { k });
    let handle = *device.cublas_handle().handle();
    // SAFETY: the pointers address live device buffers of the sizes the shape implies (callers build them from
    // views and buffers of those sizes, and keep their access records alive across this call); alpha and beta
    // are host floats, as the default pointer mode reads them.
    unsafe {
        gemm_ex(
            handle,
            op(b_t),
            op(a_t),
            int(n)?,
            int(m)?,
            int(k)?,
            (&alpha as *const f32).cast::<c_void>(),
            b.ptr as *const c_void,
            cublas_type(b.dtype)?,
            int(ldb)?,
            a.ptr as *const c_void,
            cublas_type(a.dtype)?,
            int(lda)?,
            (&beta as *const f32).cast::<c_void>(),
            c.ptr as *mut c_void,
            cublas_type(c.dtype)?,
            int(n)?,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(candle_core::Error::wrap)
}
