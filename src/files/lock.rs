//! One writer per folder: an advisory operating-system lock (`flock`) on a lock file.
//!
//! The lock belongs to the open file, so the system releases it when its process ends, however it ends: a lock file
//! left by a killed run, or one whose process id a new process reuses after a restart, never blocks anyone. What
//! the file holds (the holder's process id) is written for people and messages only; nothing is decided by it.
//!
//! A training run holds its output folder's lock (`output_dir/.qlora.lock`, [`OutputLock`]) for as long as it
//! runs; a command that replaces a folder (`merge`, `quantize`: [`super::replace_dir`]) takes the same lock before
//! moving the folder aside, so it never replaces a folder a run is writing into; and a folder being built in a
//! staging sibling is locked by its builder, so a later command can tell a dead builder's leftovers from a live one's.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The lock file's name in an output folder.
pub const LOCK_FILE: &str = ".qlora.lock";

/// A held lock; dropping it removes the lock file and releases the lock.
#[derive(Debug)]
pub struct FileLock {
    /// The locked file: the lock lasts while it is open.
    _file: File,
    path: PathBuf,
}

impl FileLock {
    /// Takes the lock on `path` (creating the file) without waiting: `None` when another holder has it.
    pub fn try_acquire(path: &Path) -> Result<Option<Self>> {
        loop {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map_err(|e| Error::io("cannot create", path, e))?;
            // SAFETY: flock on a descriptor this function owns; it only changes the file's lock state.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Ok(None);
                }
                return Err(Error::io("cannot lock", path, e));
            }
            // The previous holder removes the file as it lets go: if it did so after this open, the lock is on a
            // file nobody else will open, so take the one at `path` again.
            let locked = file
                .metadata()
                .map_err(|e| Error::io("cannot read", path, e))?;
            match std::fs::metadata(path) {
                Ok(now) if now.dev() == locked.dev() && now.ino() == locked.ino() => {}
                _ => continue,
            }
            file.set_len(0)
                .and_then(|()| write!(file, "{}", std::process::id()))
                .map_err(|e| Error::io("cannot write", path, e))?;
            return Ok(Some(FileLock {
                _file: file,
                path: path.to_path_buf(),
            }));
        }
    }

    /// The process id the lock file at `path` names, for messages (it may be stale or garbage: never trusted).
    pub fn named_holder(path: &Path) -> Option<u32> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Removed while still held (see `try_acquire`); the lock goes when `_file` closes, after this.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The lock on an output folder: one run (or one command replacing it) at a time.
#[derive(Debug)]
pub struct OutputLock {
    _lock: FileLock,
}

impl OutputLock {
    /// Takes the lock on `dir` (which must exist), or says that a run holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        match FileLock::try_acquire(&path)? {
            Some(lock) => Ok(OutputLock { _lock: lock }),
            None => {
                let holder = FileLock::named_holder(&path)
                    .map(|pid| format!(" (process {pid})"))
                    .unwrap_or_default();
                Err(Error::InvalidInput(format!(
                    "`{}` is the output folder of a run in progress{holder}; wait for it to end or pick another \
                     output folder",
                    dir.display()
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held lock refuses a second holder (another open of the file, as another process would make) and is free
    /// again once dropped, with its file gone.
    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let lock = OutputLock::acquire(dir.path()).unwrap();
        let err = OutputLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("process {}", std::process::id())),
            "{err}"
        );
        drop(lock);
        assert!(!dir.path().join(LOCK_FILE).exists(), "removed on release");
        drop(OutputLock::acquire(dir.path()).unwrap());
    }

    /// A lock file that no process holds — left by a killed run, naming a live process id (a reused one), or
    /// holding garbage — does not block, and is rewritten with the new holder.
    #[test]
    fn a_lock_file_nobody_holds_never_blocks_whatever_it_says() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        for content in ["1", &std::process::id().to_string(), "garbage\u{0}", ""] {
            std::fs::write(&path, content).unwrap();
            let lock = OutputLock::acquire(dir.path()).unwrap();
            assert_eq!(
                std::fs::read_to_string(&path).unwrap(),
                std::process::id().to_string()
            );
            drop(lock);
        }
    }
}
