//! One run per output folder: an advisory lock file, `output_dir/.qlora.lock`, holding the owner's process id.
//! It is created exclusively when a run starts and removed when the run ends (also when it fails); a lock whose
//! process is gone (a killed run) is taken over.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The lock file's name in the output folder.
pub const LOCK_FILE: &str = ".qlora.lock";

/// A held lock on an output folder; dropping it releases the folder.
#[derive(Debug)]
pub struct OutputLock {
    path: PathBuf,
}

impl OutputLock {
    /// Takes the lock on `dir` (which must exist), or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        // Twice at most: a stale lock is removed and the creation tried again.
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    write!(file, "{}", std::process::id())
                        .map_err(|e| Error::io("cannot write", &path, e))?;
                    return Ok(OutputLock { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let owner = std::fs::read_to_string(&path)
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok());
                    if let Some(pid) = owner.filter(|pid| process_is_alive(*pid)) {
                        return Err(Error::InvalidInput(format!(
                            "`{}` is the output folder of a run in progress (process {pid}); wait for it to end or \
                             pick another output_dir (a lock left by a process that is gone is taken over: {})",
                            dir.display(),
                            path.display()
                        )));
                    }
                    std::fs::remove_file(&path)
                        .map_err(|e| Error::io("cannot remove stale lock", &path, e))?;
                }
                Err(e) => return Err(Error::io("cannot create", &path, e)),
            }
        }
        Err(Error::InvalidInput(format!(
            "`{}`: another run took the output folder's lock at the same moment; pick another output_dir",
            dir.display()
        )))
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether process `pid` exists (signal 0 checks without signalling; EPERM means it exists under another user).
fn process_is_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 sends nothing; it only reports whether the process exists.
    let result = unsafe { libc::kill(pid, 0) };
    result == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_run_is_refused_and_a_stale_lock_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let lock = OutputLock::acquire(dir.path()).unwrap();
        let err = OutputLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("process {}", std::process::id())),
            "{err}"
        );
        drop(lock);
        assert!(!dir.path().join(LOCK_FILE).exists(), "released on drop");
        // A lock left by a process that has ended.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), gone.to_string()).unwrap();
        let taken = OutputLock::acquire(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap(),
            std::process::id().to_string()
        );
        drop(taken);
    }
}
