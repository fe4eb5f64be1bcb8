//! With the `cuda` feature, compiles the CUDA kernels in `kernels/*.cu` to PTX with `nvcc` (found through
//! `CUDA_HOME`/`CUDA_PATH` or `PATH`), for the compute capability `CUDA_COMPUTE_CAP` (default 80; PTX runs on that
//! GPU generation and every later one). `src/cuda.rs` embeds the PTX and loads it once per device. Without the
//! feature it does nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo::rerun-if-changed=kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let arch = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let arch: String = arch.chars().filter(char::is_ascii_digit).collect();
    // What the crate checks the GPU and its driver against at start (src/cuda.rs, `check_device`).
    println!("cargo::rustc-env=QLORA_CUDA_COMPUTE_CAP={arch}");
    println!(
        "cargo::rustc-env=QLORA_CUDA_TOOLKIT={}",
        toolkit_version(&nvcc)
    );
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("the kernels folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    for source in &sources {
        let stem = source
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a file name");
        let ptx = out.join(format!("{stem}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-std=c++17", "-O3", "--expt-relaxed-constexpr"])
            // No fused multiply-adds unless a kernel asks for one: the kernels must round as the CPU path does.
            .arg("-fmad=false")
            .arg(format!("-arch=compute_{arch}"))
            .arg("-Ikernels")
            .arg(source)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e} (set CUDA_HOME, or see scripts/build-cuda.sh)",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed on {}", source.display());
    }
}

/// The CUDA version of `nvcc` ("13.0"), as `nvcc --version` prints it ("… release 13.0, V13.0.88").
fn toolkit_version(nvcc: &Path) -> String {
    let output = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
    let text = String::from_utf8_lossy(&output.stdout);
    text.split("release ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .map(str::to_owned)
        .unwrap_or_else(|| {
            panic!(
                "cannot read the CUDA version from `{} --version`: {text}",
                nvcc.display()
            )
        })
}

/// `nvcc` of `CUDA_HOME`/`CUDA_PATH`, else the one on `PATH`.
fn nvcc() -> PathBuf {
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let candidate = Path::new(&home).join("bin").join("nvcc");
            if candidate.exists() {
                return candidate;
            }
        }
    }
    PathBuf::from("nvcc")
}
