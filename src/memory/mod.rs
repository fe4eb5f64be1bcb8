//! Memory of the training process: what the operating system says the process holds (resident set, its peak, the
//! machine's total and available memory). Linux reads `/proc`; elsewhere the values are `None`.

/// A process-level memory reading, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ProcessMemory {
    /// Resident set size now (`VmRSS`).
    pub rss: Option<u64>,
    /// Peak resident set size since the process started, or since [`reset_peak`] (`VmHWM`).
    pub peak_rss: Option<u64>,
    /// Physical memory of the machine (`MemTotal`).
    pub total: Option<u64>,
    /// Memory the kernel could still give without swapping (`MemAvailable`).
    pub available: Option<u64>,
}

/// The value of `key` (in KiB in the file) from a `/proc` file, in bytes.
fn proc_kib(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Reads the process' memory now.
pub fn process_memory() -> ProcessMemory {
    ProcessMemory {
        rss: proc_kib("/proc/self/status", "VmRSS:"),
        peak_rss: proc_kib("/proc/self/status", "VmHWM:"),
        total: proc_kib("/proc/meminfo", "MemTotal:"),
        available: proc_kib("/proc/meminfo", "MemAvailable:"),
    }
}

/// Resets the peak resident set size to the current one (Linux: writes 5 to `/proc/self/clear_refs`). Returns
/// false where the system does not allow it.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// `bytes` as a short human string (`1.23 GiB`, `512.0 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_formats_sizes() {
        let m = process_memory();
        if cfg!(target_os = "linux") {
            let (rss, peak, total) = (m.rss.unwrap(), m.peak_rss.unwrap(), m.total.unwrap());
            assert!(rss > 1 << 20 && peak >= rss && total > rss, "{m:?}");
        }
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
        assert_eq!(human_bytes(5 << 30), "5.00 GiB");
    }
}
