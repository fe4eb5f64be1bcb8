//! bitsandbytes' 8-bit dynamic quantization maps and its 8-bit search.
//!
//! The signed map quantizes the nested absmax of double quantization (and the first Adam moment); the unsigned
//! map quantizes the second Adam moment. The tables are the float32 values bitsandbytes computes with
//! `torch.linspace` on an AVX2/FMA host; a loader always prefers the table stored in a checkpoint.

/// bitsandbytes `create_dynamic_map(signed=True)` as float32 bit patterns (torch AVX2/FMA build).
pub(crate) const SIGNED_FMA_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];
/// Entries where the scalar (non-FMA) torch build differs from [`SIGNED_FMA_BITS`]: (index, bits).
pub(crate) const SIGNED_NON_FMA_DIFFS: [(usize, u32); 42] = [
    (18, 0xbf3d6667),
    (20, 0xbf363333),
    (23, 0xbf2b6667),
    (25, 0xbf243333),
    (28, 0xbf196667),
    (30, 0xbf123333),
    (34, 0xbf03cccd),
    (39, 0xbee39999),
    (41, 0xbed53332),
    (46, 0xbeb13332),
    (51, 0xbe8d3333),
    (58, 0xbe359999),
    (72, 0xbd9bd70b),
    (80, 0xbd5b8520),
    (83, 0xbd38f5c2),
    (87, 0xbd0ae147),
    (89, 0xbce7ae13),
    (92, 0xbca28f5c),
    (102, 0xbbcfdf3c),
    (116, 0xba016f00),
    (117, 0xb9c7e282),
    (137, 0x39c7e282),
    (138, 0x3a016f00),
    (152, 0x3bcfdf3c),
    (162, 0x3ca28f5c),
    (165, 0x3ce7ae13),
    (167, 0x3d0ae147),
    (171, 0x3d38f5c2),
    (174, 0x3d5b8520),
    (182, 0x3d9bd70b),
    (196, 0x3e359999),
    (203, 0x3e8d3333),
    (208, 0x3eb13332),
    (213, 0x3ed53332),
    (215, 0x3ee39999),
    (220, 0x3f03cccd),
    (224, 0x3f123333),
    (226, 0x3f196667),
    (229, 0x3f243333),
    (231, 0x3f2b6667),
    (234, 0x3f363333),
    (236, 0x3f3d6667),
];
/// bitsandbytes `create_dynamic_map(signed=False)` as float32 bit patterns (torch AVX2/FMA build).
pub(crate) const UNSIGNED_FMA_BITS: [u32; 256] = [
    0x00000000, 0x34ae7baa, 0x35500998, 0x360e9b38, 0x3692ccf6, 0x36de4c51, 0x3714e5d5, 0x3783126e,
    0x37e171a0, 0x381fe868, 0x384f1800, 0x387e479a, 0x3896bb99, 0x38ae5364, 0x38c5eb31, 0x3906594b,
    0x394154ca, 0x397c5049, 0x399ba5e4, 0x39b923a2, 0x39d6a163, 0x39f41f22, 0x3a08ce71, 0x3a178d50,
    0x3a264c30, 0x3a350b10, 0x3a43c9ef, 0x3a5288d0, 0x3a6147af, 0x3a70068e, 0x3a7ec56e, 0x3a958106,
    0x3aba5e35, 0x3adf3b64, 0x3b020c4a, 0x3b147ae1, 0x3b26e978, 0x3b395810, 0x3b4bc6a7, 0x3b5e3540,
    0x3b70a3d7, 0x3b818937, 0x3b8ac082, 0x3b93f7cf, 0x3b9d2f1a, 0x3ba66666, 0x3baf9db2, 0x3bb8d4fd,
    0x3bc20c4a, 0x3bcb4395, 0x3bd47ae1, 0x3bddb22e, 0x3be6e978, 0x3bf020c5, 0x3bf9580f, 0x3c0147ae,
    0x3c05e354, 0x3c0a7ef9, 0x3c0f1aa0, 0x3c13b645, 0x3c1851eb, 0x3c1ced92, 0x3c218937, 0x3c2f5c2a,
    0x3c466667, 0x3c5d70a3, 0x3c747ae2, 0x3c85c28f, 0x3c9147af, 0x3c9ccccd, 0x3ca851eb, 0x3cb3d70b,
    0x3cbf5c29, 0x3ccae147, 0x3cd66667, 0x3ce1eb87, 0x3ced70a3, 0x3cf8f5c3, 0x3d023d70, 0x3d080000,
    0x3d0dc28f, 0x3d13851f, 0x3d1947af, 0x3d1f0a3d, 0x3d24cccd, 0x3d2a8f5c, 0x3d3051eb, 0x3d36147b,
    0x3d3bd70a, 0x3d41999a, 0x3d475c28, 0x3d4d1eb8, 0x3d52e147, 0x3d58a3d7, 0x3d5e6667, 0x3d6428f7,
    0x3d69eb87, 0x3d6fae15, 0x3d7570a3, 0x3d7b3333, 0x3d807ae2, 0x3d835c2a, 0x3d863d71, 0x3d891eb8,
    0x3d8c0000, 0x3d8ee148, 0x3d91c290, 0x3d94a3d7, 0x3d97851f, 0x3d9a6667, 0x3d9d47af, 0x3da028f6,
    0x3da30a3e, 0x3da5eb85, 0x3da8cccd, 0x3dabae15, 0x3dae8f5c, 0x3db170a4, 0x3db451eb, 0x3db73333,
    0x3dba147b, 0x3dbcf5c3, 0x3dbfd70b, 0x3dc2b852, 0x3dc5999a, 0x3dc87ae2, 0x3dcb5c29, 0x3dd40000,
    0x3de26666, 0x3df0cccd, 0x3dff3333, 0x3e06cccc, 0x3e0e0000, 0x3e153334, 0x3e1c6666, 0x3e23999a,
    0x3e2acccc, 0x3e320000, 0x3e393334, 0x3e406666, 0x3e47999a, 0x3e4ecccc, 0x3e560000, 0x3e5d3334,
    0x3e646666, 0x3e6b999a, 0x3e72cccc, 0x3e7a0000, 0x3e809999, 0x3e843333, 0x3e87cccd, 0x3e8b6666,
    0x3e8f0000, 0x3e92999a, 0x3e963333, 0x3e99cccc, 0x3e9d6666, 0x3ea10000, 0x3ea4999a, 0x3ea83333,
    0x3eabcccc, 0x3eaf6666, 0x3eb30000, 0x3eb6999a, 0x3eba3333, 0x3ebdcccc, 0x3ec16666, 0x3ec50000,
    0x3ec8999a, 0x3ecc3333, 0x3ecfcccc, 0x3ed36666, 0x3ed70000, 0x3eda999a, 0x3ede3333, 0x3ee1cccc,
    0x3ee56666, 0x3ee90000, 0x3eec999a, 0x3ef03333, 0x3ef3cccc, 0x3ef76666, 0x3efb0000, 0x3efe9999,
    0x3f01199a, 0x3f02e666, 0x3f04b333, 0x3f068000, 0x3f084ccc, 0x3f0a199a, 0x3f0be666, 0x3f0db334,
    0x3f0f8000, 0x3f114ccd, 0x3f13199a, 0x3f14e666, 0x3f16b334, 0x3f188000, 0x3f1a4ccd, 0x3f1c199a,
    0x3f1de666, 0x3f1fb334, 0x3f218000, 0x3f234ccd, 0x3f25199a, 0x3f26e666, 0x3f28b334, 0x3f2a8000,
    0x3f2c4ccd, 0x3f2e199a, 0x3f2fe666, 0x3f31b334, 0x3f338000, 0x3f354ccd, 0x3f37199a, 0x3f38e666,
    0x3f3ab334, 0x3f3c8000, 0x3f3e4ccd, 0x3f40199a, 0x3f41e666, 0x3f43b334, 0x3f458000, 0x3f474ccc,
    0x3f49199a, 0x3f4ae666, 0x3f4cb334, 0x3f4e8000, 0x3f504ccc, 0x3f52199a, 0x3f53e666, 0x3f55b334,
    0x3f578000, 0x3f594ccc, 0x3f5b199a, 0x3f5ce666, 0x3f5eb334, 0x3f608000, 0x3f624ccc, 0x3f64199a,
    0x3f65e666, 0x3f67b334, 0x3f698000, 0x3f6b4ccc, 0x3f6d199a, 0x3f6ee666, 0x3f70b334, 0x3f728000,
    0x3f744ccc, 0x3f76199a, 0x3f77e666, 0x3f79b334, 0x3f7b8000, 0x3f7d4ccc, 0x3f7f199a, 0x3f800000,
];
/// Entries where the scalar (non-FMA) torch build differs from [`UNSIGNED_FMA_BITS`]: (index, bits).
pub(crate) const UNSIGNED_NON_FMA_DIFFS: [(usize, u32); 31] = [
    (9, 0x381fe867),
    (17, 0x397c5048),
    (20, 0x39d6a162),
    (24, 0x3a264c31),
    (34, 0x3b020c49),
    (37, 0x3b39580f),
    (39, 0x3b5e353e),
    (43, 0x3b93f7ce),
    (46, 0x3baf9db3),
    (54, 0x3bf95810),
    (68, 0x3c9147ae),
    (75, 0x3ce1eb85),
    (85, 0x3d2a8f5b),
    (92, 0x3d52e148),
    (96, 0x3d69eb85),
    (98, 0x3d7570a5),
    (101, 0x3d835c29),
    (103, 0x3d891eb9),
    (106, 0x3d91c28f),
    (138, 0x3e393333),
    (143, 0x3e5d3333),
    (146, 0x3e72cccd),
    (148, 0x3e80999a),
    (150, 0x3e87cccc),
    (163, 0x3eb69999),
    (168, 0x3ec89999),
    (173, 0x3eda9999),
    (174, 0x3ede3332),
    (178, 0x3eec9999),
    (179, 0x3ef03332),
    (186, 0x3f04b334),
];

/// Which floating-point build of `torch.linspace` a dynamic map reproduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinspaceVariant {
    /// AVX2 kernels with fused multiply-add (what typical x86 GPU hosts produce).
    Fma,
    /// The scalar kernel (`ATEN_CPU_CAPABILITY=default`).
    Scalar,
}

/// A dynamic map as one `torch.linspace` build computes it, from the stored bit patterns.
pub fn dynamic_map(signed: bool, variant: LinspaceVariant) -> [f32; 256] {
    let (fma, diffs) = if signed {
        (SIGNED_FMA_BITS, &SIGNED_NON_FMA_DIFFS[..])
    } else {
        (UNSIGNED_FMA_BITS, &UNSIGNED_NON_FMA_DIFFS[..])
    };
    let mut bits = fma;
    if variant == LinspaceVariant::Scalar {
        for (i, b) in diffs {
            bits[*i] = *b;
        }
    }
    bits.map(f32::from_bits)
}

/// The signed dynamic map (`create_dynamic_map(signed=True)`, FMA build): 256 sorted values in [-0.99296875, 1].
pub fn signed_map() -> [f32; 256] {
    dynamic_map(true, LinspaceVariant::Fma)
}

/// The unsigned dynamic map (`create_dynamic_map(signed=False)`, FMA build): 256 sorted values in [0, 1].
pub fn unsigned_map() -> [f32; 256] {
    dynamic_map(false, LinspaceVariant::Fma)
}

/// Recomputes a dynamic map with bitsandbytes' algorithm (`create_dynamic_map(signed, 7, 8)`), reproducing the
/// float32 rounding of either `torch.linspace` build. Used to check the tables; also documents where they come from.
pub fn create_dynamic_map(signed: bool, variant: LinspaceVariant) -> [f32; 256] {
    const MAX_EXPONENT_BITS: i32 = 7;
    const NON_SIGN_BITS: i32 = 7;
    let mut data: Vec<f32> = Vec::with_capacity(256);
    for i in 0..MAX_EXPONENT_BITS {
        let n = if signed {
            (1usize << (i + NON_SIGN_BITS - MAX_EXPONENT_BITS)) + 1
        } else {
            (1usize << (i + NON_SIGN_BITS - MAX_EXPONENT_BITS + 1)) + 1
        };
        let boundaries = torch_linspace(0.1, 1.0, n, variant);
        // Python: (10 ** k) * means, an f32 tensor times a Python scalar -> f32 multiply.
        let scale = 10f64.powi(-(MAX_EXPONENT_BITS - 1) + i) as f32;
        let means: Vec<f32> = boundaries.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
        data.extend(means.iter().map(|m| scale * m));
        if signed {
            data.extend(means.iter().map(|m| -scale * m));
        }
    }
    data.push(0.0);
    data.push(1.0);
    while data.len() < 256 {
        data.push(0.0);
    }
    data.sort_by(|a, b| a.total_cmp(b));
    let mut out = [0.0f32; 256];
    out.copy_from_slice(&data);
    // `sort` in torch puts -0.0 and 0.0 as equal; only one zero exists in these maps.
    out
}

/// `torch.linspace(start, end, n, dtype=float32)` on CPU: the first half counts up from `start`, the second half
/// counts down from `end`, with or without fused multiply-add.
fn torch_linspace(start: f32, end: f32, n: usize, variant: LinspaceVariant) -> Vec<f32> {
    let step = (end - start) / (n - 1) as f32;
    let halfway = n / 2;
    (0..n)
        .map(|i| match variant {
            LinspaceVariant::Fma if i < halfway => step.mul_add(i as f32, start),
            LinspaceVariant::Fma => (-step).mul_add((n - 1 - i) as f32, end),
            LinspaceVariant::Scalar if i < halfway => start + step * i as f32,
            LinspaceVariant::Scalar => end - step * (n - 1 - i) as f32,
        })
        .collect()
}

/// bitsandbytes' CUDA 8-bit search (`dQuantize<0>` / `quantize_2D`): a 7-step binary search from index 127,
/// then a choice between the last probe and its neighbour by the float32 midpoint. `code` must be sorted.
///
/// Agrees with "nearest code" except for inputs exactly on a float32 midpoint, which go to the final probe.
/// NaN goes to index 0.
#[inline]
pub fn quantize_dynamic(code: &[f32; 256], x: f32) -> u8 {
    let mut pivot: usize = 127;
    let mut upper_pivot: usize = 255;
    let mut lower_pivot: usize = 0;
    let mut lower = if code[0] < 0.0 { -1.0f32 } else { 0.0 };
    let mut upper = 1.0f32;
    let mut val = code[pivot];
    for step in [64usize, 32, 16, 8, 4, 2, 1] {
        if x > val {
            lower_pivot = pivot;
            lower = val;
            pivot += step;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= step;
        }
        val = code[pivot];
    }
    if upper_pivot == 255 {
        upper = code[255];
    }
    if lower_pivot == 0 {
        lower = code[0];
    }
    let chosen = if x > val {
        if x > (upper + val) * 0.5 {
            upper_pivot
        } else {
            pivot
        }
    } else if x < (lower + val) * 0.5 {
        lower_pivot
    } else {
        pivot
    };
    chosen as u8
}

/// bitsandbytes' CPU 8-bit quantizer (`csrc/cpu_ops.cpp`): instead of searching, it rounds the scaled value to one
/// of 65536 bins over [-1, 1] and looks the code up in a table built from the float32 midpoints. Codes differ
/// from [`quantize_dynamic`] for values whose bin straddles a midpoint; this reproduces the CPU results.
pub struct CpuLutQuantizer {
    lut: Vec<u8>,
}

impl CpuLutQuantizer {
    const BINS: usize = 65536;

    /// Builds the table for a sorted 256-entry `code` map (`build_quantize_lut`).
    pub fn new(code: &[f32; 256]) -> Self {
        let mut midpoints = [0.0f32; 255];
        for (i, m) in midpoints.iter_mut().enumerate() {
            *m = 0.5 * (code[i] + code[i + 1]);
        }
        let mut lut = vec![0u8; Self::BINS];
        let mut code_idx = 0usize;
        for (i, slot) in lut.iter_mut().enumerate() {
            let val = -1.0f32 + (2.0f32 * i as f32) / (Self::BINS - 1) as f32;
            while code_idx < 255 && midpoints[code_idx] < val {
                code_idx += 1;
            }
            *slot = code_idx as u8;
        }
        CpuLutQuantizer { lut }
    }

    /// The code for a value already scaled by the block's reciprocal absmax.
    #[inline]
    pub fn quantize(&self, x: f32) -> u8 {
        let v = x.clamp(-1.0, 1.0);
        // GCC contracts `a * 65535 + 0.5` into one fused multiply-add in bitsandbytes' build (avx2,fma target).
        let idx = ((v + 1.0) * 0.5).mul_add((Self::BINS - 1) as f32, 0.5) as u16;
        self.lut[idx as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_match_the_generator_for_both_linspace_builds() {
        for signed in [true, false] {
            for variant in [LinspaceVariant::Fma, LinspaceVariant::Scalar] {
                let stored = dynamic_map(signed, variant).map(f32::to_bits);
                assert_eq!(
                    create_dynamic_map(signed, variant).map(f32::to_bits),
                    stored,
                    "{signed} {variant:?}"
                );
            }
        }
    }

    #[test]
    fn maps_have_the_documented_shape() {
        let s = signed_map();
        assert_eq!(s[127], 0.0);
        assert_eq!(s[255], 1.0);
        assert_eq!(s[0].to_bits(), 0xbf7e3333);
        let u = unsigned_map();
        assert_eq!(u[0], 0.0);
        assert_eq!(u[255], 1.0);
    }

    /// The search picks the nearest code everywhere but on exact midpoints.
    #[test]
    fn search_is_nearest_code() {
        for map in [signed_map(), unsigned_map()] {
            let mut x = -1.0f32;
            while x <= 1.0 {
                let q = quantize_dynamic(&map, x) as usize;
                let best = (0..256)
                    .min_by(|a, b| (map[*a] - x).abs().total_cmp(&(map[*b] - x).abs()))
                    .unwrap();
                assert!(
                    (map[q] - x).abs() <= (map[best] - x).abs(),
                    "x={x} q={q} best={best}"
                );
                x += 0.000_37;
            }
        }
        assert_eq!(quantize_dynamic(&signed_map(), f32::NAN), 0);
    }

    #[test]
    fn cpu_lut_agrees_with_search_away_from_bin_edges() {
        let map = signed_map();
        let lut = CpuLutQuantizer::new(&map);
        assert_eq!(lut.quantize(1.0), 255);
        assert_eq!(lut.quantize(-1.0), 0);
        assert_eq!(lut.quantize(0.5), quantize_dynamic(&map, 0.5));
    }
}
