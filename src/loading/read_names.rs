//! Which stored tensors a model has read, so a loader can report those it left unread.

use std::collections::HashSet;
use std::sync::Mutex;

/// The names of the tensors read from one set of weight files.
#[derive(Default)]
pub struct ReadNames(Mutex<HashSet<String>>);

impl ReadNames {
    /// Records that tensor `name` was read.
    pub fn mark(&self, name: &str) {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(name.to_string());
    }

    /// Those of `stored` starting with `prefix` that were not read, sorted.
    pub fn unread<'a>(&self, stored: impl Iterator<Item = &'a str>, prefix: &str) -> Vec<String> {
        let read = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut unread: Vec<String> = stored
            .filter(|n| n.starts_with(prefix) && !read.contains(*n))
            .map(str::to_string)
            .collect();
        unread.sort();
        unread
    }
}
