//! Memory snapshots in PyTorch's format: the allocations of a run recorded as `torch.cuda.memory.
//! _record_memory_history` records them, and written as `torch.cuda.memory._snapshot()` lays them out (`segments`
//! with their `blocks`, `device_traces` of `alloc` / `free_requested` / `free_completed` events), pickled, for
//! PyTorch's memory_viz (pytorch.org/memory_viz) and `torch.cuda._memory_viz`.
//!
//! What is recorded is one [`Source`]: the tracking allocator's heap ([`super::TrackingAllocator`]) — the memory
//! under CPU tensors — or a CUDA device's memory pool (the buffers Candle allocates, seen through
//! `super::cuda_hooks`). Every allocation while recording is on is kept (so replaying the trace gives the source's
//! count exactly), each with its context as frames (the op, the layer, the phase and the step, set by the trainer,
//! the model and the ops through [`crate::profile::context`]).
//! The hooks never allocate: events go to a ring of `max_entries` (the oldest dropped, as PyTorch bounds its
//! trace) and the live allocations to an open-addressing table, both allocated when recording starts.
//!
//! Each live allocation becomes a segment of one block (neither a heap nor Candle's use of the pool has PyTorch's
//! segments); the trace is the recorded device's (device 0 for the heap).

use std::cell::UnsafeCell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::heap::exclude;
use super::pickle::{to_pickle, PyValue};
use crate::error::{Error, Result};
use crate::files::write_file_atomically;
use crate::profile::context::Context;

/// The most live allocations tracked at once (a large tokenizer holds hundreds of thousands of small ones; past
/// it, `untracked_allocations` counts them). The table takes 40 bytes per slot, two slots per allocation.
const MAX_LIVE: usize = 1 << 20;

/// PyTorch's frames of an allocation made in `context`, innermost first: the op in its layer, then the phase of
/// its step.
fn frames(context: &Context) -> PyValue {
    let frame = |name: &str, filename: String, line: i64| {
        PyValue::dict([
            ("name", PyValue::str(name)),
            ("filename", PyValue::Str(filename)),
            ("line", PyValue::Int(line)),
        ])
    };
    let layer = match context.layer() {
        Some(l) => format!("model.layers.{l}"),
        None => "model".to_string(),
    };
    PyValue::List(vec![
        frame(context.op().unwrap_or("candle"), layer, 0),
        frame(
            context.phase().name(),
            format!("step {}", context.step()),
            context.step() as i64,
        ),
    ])
}

/// What a recording sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The heap counted by [`super::TrackingAllocator`] (CPU tensors).
    Heap,
    /// The memory pool of CUDA device `ordinal`: Candle's buffers, allocated with `cuMemAllocAsync` (builds with
    /// the `cuda` feature).
    CudaPool {
        /// The device's ordinal (its index in the snapshot's `device_traces`).
        ordinal: usize,
    },
}

/// [`SOURCE`]'s value while the heap is recorded.
const HEAP: u8 = 1;
/// [`SOURCE`]'s value while a CUDA pool is recorded.
const CUDA_POOL: u8 = 2;

impl Source {
    /// Its value in [`SOURCE`] (0: not recording).
    fn code(self) -> u8 {
        match self {
            Source::Heap => HEAP,
            Source::CudaPool { .. } => CUDA_POOL,
        }
    }

    /// Where the snapshot says its allocations come from.
    fn describe(self) -> &'static str {
        match self {
            Source::Heap => "candle-qlora heap (TrackingAllocator)",
            Source::CudaPool { .. } => "candle-qlora CUDA pool (cuMemAllocAsync)",
        }
    }
}

#[derive(Clone, Copy)]
enum Action {
    Alloc,
    Free,
    /// An allocation of `size` bytes the device refused; `addr` holds the bytes it had free (PyTorch's
    /// `device_free`). Only a CUDA pool refuses: the heap's allocation failure aborts the program.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Oom,
}

/// One recorded event.
#[derive(Clone, Copy)]
struct Event {
    action: Action,
    addr: usize,
    size: usize,
    time_us: u64,
    context: Context,
}

/// A live allocation (`addr` 0: an empty slot).
#[derive(Clone, Copy, Default)]
struct Slot {
    addr: usize,
    size: usize,
    context: Context,
}

struct Recorder {
    source: Source,
    /// The ring: `len` events ending before `head`.
    events: Vec<Event>,
    head: usize,
    len: usize,
    /// Events dropped from the ring's front.
    dropped: u64,
    /// Open addressing with linear probing; `mask + 1` slots.
    live: Vec<Slot>,
    mask: usize,
    live_count: usize,
    /// Allocations not tracked because the table was full.
    untracked: u64,
    start: Instant,
    epoch_us: u64,
}

impl Recorder {
    fn new(source: Source, max_entries: usize, max_live: usize) -> Self {
        let slots = (2 * max_live).next_power_of_two().max(1024);
        let blank = Event {
            action: Action::Alloc,
            addr: 0,
            size: 0,
            time_us: 0,
            context: Context::default(),
        };
        Recorder {
            source,
            events: vec![blank; max_entries.max(1)],
            head: 0,
            len: 0,
            dropped: 0,
            live: vec![Slot::default(); slots],
            mask: slots - 1,
            live_count: 0,
            untracked: 0,
            start: Instant::now(),
            epoch_us: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
        }
    }

    fn buffer_bytes(&self) -> usize {
        self.events.capacity() * std::mem::size_of::<Event>()
            + self.live.capacity() * std::mem::size_of::<Slot>()
    }

    fn home(&self, addr: usize) -> usize {
        ((addr >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15)) & self.mask
    }

    fn push(&mut self, action: Action, addr: usize, size: usize, context: Context) {
        let capacity = self.events.len();
        self.events[self.head] = Event {
            action,
            addr,
            size,
            time_us: self.epoch_us + self.start.elapsed().as_micros() as u64,
            context,
        };
        self.head = (self.head + 1) % capacity;
        if self.len == capacity {
            self.dropped += 1;
        } else {
            self.len += 1;
        }
    }

    fn insert(&mut self, addr: usize, size: usize, context: Context) {
        if self.live_count * 4 >= self.live.len() * 3 {
            self.untracked += 1;
            return;
        }
        let mut i = self.home(addr);
        while self.live[i].addr != 0 {
            i = (i + 1) & self.mask;
        }
        self.live[i] = Slot {
            addr,
            size,
            context,
        };
        self.live_count += 1;
    }

    /// Removes `addr` (backward-shift deletion, so no tombstones build up), returning its size; `None` when it was
    /// not tracked.
    fn remove(&mut self, addr: usize) -> Option<usize> {
        let mut i = self.home(addr);
        loop {
            match self.live[i].addr {
                0 => return None,
                a if a == addr => break,
                _ => i = (i + 1) & self.mask,
            }
        }
        let size = self.live[i].size;
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            if self.live[j].addr == 0 {
                break;
            }
            let home = self.home(self.live[j].addr);
            // Move `j` into the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.live[hole] = self.live[j];
                hole = j;
            }
        }
        self.live[hole] = Slot::default();
        self.live_count -= 1;
        Some(size)
    }
}

/// The recorder, touched only under [`LOCK`].
struct Shared(UnsafeCell<Option<Recorder>>);
// SAFETY: every access goes through `with_recorder`, which holds `LOCK`.
unsafe impl Sync for Shared {}

static RECORDER: Shared = Shared(UnsafeCell::new(None));
static LOCK: AtomicBool = AtomicBool::new(false);
/// The [`Source::code`] being recorded; 0 when not recording.
static SOURCE: AtomicU8 = AtomicU8::new(0);

/// Runs `f` on the recorder under the spin lock (held for a few hundred nanoseconds at most).
fn with_recorder<R>(f: impl FnOnce(&mut Option<Recorder>) -> R) -> R {
    while LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
    // SAFETY: the lock gives exclusive access.
    let r = f(unsafe { &mut *RECORDER.0.get() });
    LOCK.store(false, Ordering::Release);
    r
}

/// Called by the tracking allocator after each allocation. Allocates nothing.
#[inline]
pub(crate) fn on_alloc(addr: usize, size: usize) {
    record(HEAP, Action::Alloc, addr, size);
}

/// Called by the tracking allocator before each free. Allocates nothing.
#[inline]
pub(crate) fn on_free(addr: usize, size: usize) {
    record(HEAP, Action::Free, addr, size);
}

/// Called by the CUDA hooks after the driver allocated `size` bytes at `addr`. Allocates nothing.
#[cfg(feature = "cuda")]
pub(crate) fn on_device_alloc(addr: usize, size: usize) {
    record(CUDA_POOL, Action::Alloc, addr, size);
}

/// Called by the CUDA hooks before the driver frees `addr` (its size is the recorded one). Allocates nothing.
#[cfg(feature = "cuda")]
pub(crate) fn on_device_free(addr: usize) {
    record(CUDA_POOL, Action::Free, addr, 0);
}

/// Called by the CUDA hooks when the driver refused `size` bytes with `free` bytes left. Allocates nothing.
#[cfg(feature = "cuda")]
pub(crate) fn on_device_oom(size: usize, free: usize) {
    record(CUDA_POOL, Action::Oom, free, size);
}

/// Records `action` on the allocation at `addr` (the live table and the ring) while `source` is recorded. A free
/// takes the size recorded with the allocation when it has one.
#[inline]
fn record(source: u8, action: Action, addr: usize, size: usize) {
    if SOURCE.load(Ordering::Relaxed) != source {
        return;
    }
    let context = Context::now();
    with_recorder(|r| {
        if let Some(r) = r
            .as_mut()
            .filter(|_| SOURCE.load(Ordering::Relaxed) == source)
        {
            let size = match action {
                Action::Alloc => {
                    r.insert(addr, size, context);
                    size
                }
                Action::Free => r.remove(addr).unwrap_or(size),
                Action::Oom => size,
            };
            r.push(action, addr, size, context);
        }
    });
}

/// Starts recording the allocations of `source`, keeping the last `max_entries` events (PyTorch's
/// `max_entries`). Replaces a recording in progress. The heap is seen only under the tracking allocator (see
/// [`super::tracking`]), a CUDA pool only where the hooks are linked (`super::cuda_hooks`).
pub fn start_recording(source: Source, max_entries: usize) {
    stop_recording();
    // Allocated before recording turns on, so the hook never sees its own buffers.
    let recorder = Recorder::new(source, max_entries, MAX_LIVE);
    // The recording's own buffers are not the program's memory (see `exclude`).
    exclude(recorder.buffer_bytes(), false);
    with_recorder(|r| *r = Some(recorder));
    SOURCE.store(source.code(), Ordering::Relaxed);
}

/// Records allocations while alive: [`start_recording`] when made, [`stop_recording`] when dropped — unless a
/// recording of the same source was already on, which it joins and leaves running (a program may start recording
/// before it builds the trainer, so the model's loading is in the snapshot).
#[must_use]
pub struct Recording {
    owner: bool,
}

impl Recording {
    /// Starts recording `source`, keeping the last `max_entries` events, or joins its recording already on.
    pub fn start(source: Source, max_entries: usize) -> Self {
        let owner = recording() != Some(source);
        if owner {
            start_recording(source, max_entries);
        }
        Recording { owner }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if self.owner {
            stop_recording();
        }
    }
}

/// Stops recording and drops what was recorded.
pub fn stop_recording() {
    SOURCE.store(0, Ordering::Relaxed);
    // Freed outside the lock (the hooks do not record now).
    if let Some(old) = with_recorder(|r| r.take()) {
        exclude(old.buffer_bytes(), true);
        drop(old);
    }
}

/// What is being recorded, if anything.
pub fn recording() -> Option<Source> {
    if SOURCE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    with_recorder(|r| r.as_ref().map(|r| r.source))
}

/// The snapshot of what is recorded, as `torch.cuda.memory._snapshot()` returns it (`None` when not recording).
/// Recording pauses while it is built, so the snapshot's own allocations are not in it.
pub fn snapshot() -> Option<PyValue> {
    let source = SOURCE.swap(0, Ordering::Relaxed);
    if source == 0 {
        return None;
    }
    // Copied under the lock (the hook records nothing now, so allocating here cannot deadlock).
    let copied = with_recorder(|r| {
        r.as_ref().map(|r| {
            let capacity = r.events.len();
            let first = (r.head + capacity - r.len) % capacity;
            let events: Vec<Event> = (0..r.len)
                .map(|i| r.events[(first + i) % capacity])
                .collect();
            let live: Vec<Slot> = r.live.iter().filter(|s| s.addr != 0).copied().collect();
            (r.source, events, live, r.dropped, r.untracked)
        })
    });
    SOURCE.store(source, Ordering::Relaxed);
    let (source, events, mut live, dropped, untracked) = copied?;
    let device = match source {
        Source::Heap => 0,
        Source::CudaPool { ordinal } => ordinal,
    };
    live.sort_by_key(|s| s.addr);
    let int = |n: usize| PyValue::uint(n as u64);
    let segments = live
        .iter()
        .map(|s| {
            let block = PyValue::dict([
                ("address", int(s.addr)),
                ("size", int(s.size)),
                ("requested_size", int(s.size)),
                ("state", PyValue::str("active_allocated")),
                ("frames", frames(&s.context)),
            ]);
            PyValue::dict([
                ("device", int(device)),
                ("address", int(s.addr)),
                ("total_size", int(s.size)),
                ("allocated_size", int(s.size)),
                ("active_size", int(s.size)),
                ("requested_size", int(s.size)),
                ("stream", PyValue::Int(0)),
                (
                    "segment_type",
                    PyValue::str(if s.size > 1 << 20 { "large" } else { "small" }),
                ),
                (
                    "segment_pool_id",
                    PyValue::Tuple(vec![PyValue::Int(0), PyValue::Int(0)]),
                ),
                ("is_expandable", PyValue::Bool(false)),
                ("frames", frames(&s.context)),
                ("blocks", PyValue::List(vec![block])),
            ])
        })
        .collect();
    let mut trace = Vec::with_capacity(events.len() * 2);
    for e in &events {
        let entry = |action: &str| {
            PyValue::dict([
                ("action", PyValue::str(action)),
                ("addr", int(e.addr)),
                ("size", int(e.size)),
                ("stream", PyValue::Int(0)),
                ("time_us", PyValue::uint(e.time_us)),
                ("frames", frames(&e.context)),
            ])
        };
        match e.action {
            Action::Alloc => trace.push(entry("alloc")),
            // A heap frees at once: the request and its completion are one moment.
            Action::Free => trace.extend([entry("free_requested"), entry("free_completed")]),
            Action::Oom => trace.push(PyValue::dict([
                ("action", PyValue::str("oom")),
                ("addr", PyValue::Int(0)),
                ("size", int(e.size)),
                ("device_free", int(e.addr)),
                ("stream", PyValue::Int(0)),
                ("time_us", PyValue::uint(e.time_us)),
                ("frames", frames(&e.context)),
            ])),
        }
    }
    // One trace per device up to the recorded one, as PyTorch lists them by ordinal.
    let mut traces = vec![PyValue::List(Vec::new()); device];
    traces.push(PyValue::List(trace));
    Some(PyValue::dict([
        ("segments", PyValue::List(segments)),
        ("device_traces", PyValue::List(traces)),
        (
            "allocator_settings",
            PyValue::dict([
                ("source", PyValue::str(source.describe())),
                ("dropped_events", PyValue::uint(dropped)),
                ("untracked_allocations", PyValue::uint(untracked)),
            ]),
        ),
    ]))
}

/// Writes the snapshot of what is recorded to `path` (atomically), pickled as `torch.cuda.memory._dump_snapshot`
/// writes it. False when nothing is being recorded.
pub fn write_snapshot(path: &Path) -> Result<bool> {
    let Some(snapshot) = snapshot() else {
        return Ok(false);
    };
    let bytes = to_pickle(&snapshot);
    write_file_atomically(path, |tmp| {
        std::fs::write(tmp, &bytes).map_err(|e| Error::io("cannot write", tmp, e))
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The live table keeps exactly the allocations not yet freed through insertions and backward-shift
    /// deletions that wrap around the end of the table.
    #[test]
    fn live_table_tracks_inserts_and_removes() {
        let mut r = Recorder::new(Source::Heap, 8, 8);
        let mut expected = std::collections::BTreeMap::new();
        let mut x: u64 = 7;
        for i in 0..4000usize {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let addr = (((x >> 20) as usize) % 512 + 1) * 16;
            if let Some(size) = expected.remove(&addr) {
                assert_eq!(r.remove(addr), Some(size), "{i}: {addr} was live");
            } else if r.live_count * 4 < r.live.len() * 3 {
                r.insert(addr, i, Context::default());
                expected.insert(addr, i);
            }
            assert_eq!(r.live_count, expected.len());
        }
        let mut live: Vec<(usize, usize)> = r
            .live
            .iter()
            .filter(|s| s.addr != 0)
            .map(|s| (s.addr, s.size))
            .collect();
        live.sort();
        assert_eq!(live, expected.into_iter().collect::<Vec<_>>());
        assert_eq!(r.remove(3), None);
    }

    /// The ring keeps the last events in order and counts the dropped ones; frames outside any op, layer or step say so.
    #[test]
    fn ring_keeps_the_last_events_and_frames_name_the_context() {
        let mut r = Recorder::new(Source::Heap, 3, 4);
        for addr in 1..=5 {
            r.push(Action::Alloc, addr * 16, 1024, Context::default());
        }
        let capacity = r.events.len();
        let first = (r.head + capacity - r.len) % capacity;
        let kept: Vec<usize> = (0..r.len)
            .map(|i| r.events[(first + i) % capacity].addr)
            .collect();
        assert_eq!((kept, r.dropped), (vec![48, 64, 80], 2));

        let PyValue::List(frames) = frames(&Context::default()) else {
            panic!("frames are a list")
        };
        let name = |f: &PyValue| match f {
            PyValue::Dict(items) => (items[0].1.clone(), items[1].1.clone()),
            _ => panic!("a frame is a dict"),
        };
        assert_eq!(
            name(&frames[0]),
            (PyValue::str("candle"), PyValue::str("model"))
        );
        assert_eq!(
            name(&frames[1]),
            (PyValue::str("idle"), PyValue::str("step 0"))
        );
    }
}
