//! Step traces in Chrome's trace-event format — what `torch.profiler`'s `export_chrome_trace` writes, opened by
//! Perfetto (ui.perfetto.dev) and chrome://tracing: nested spans ("complete" events) for a traced step, its data
//! loading, each micro-batch's forward with one span per layer, the loss, the backward with each checkpointed
//! layer's recomputation and backward, the optimizer and checkpoint saving, and a memory counter at the end of
//! every span.
//!
//! The tracer is global and off by default; the trainer turns it on for the steps `trace_steps` names. A span is a
//! guard: [`span`] notes the start, dropping it records the event. With tracing off a span costs one atomic load.

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::files::write_file_atomically;

static ON: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<TraceEvent>> = Mutex::new(Vec::new());
/// What the memory counter reads (the trainer's device's bytes in use), while tracing.
static MEMORY: Mutex<Option<MemoryReader>> = Mutex::new(None);

/// Reads the bytes in use on the traced device, after waiting for the work queued on it: a GPU runs the work a span
/// queued after the span's code has returned, so without the wait a span would time the queueing.
pub type MemoryReader = Box<dyn Fn() -> Option<u64> + Send>;

/// The trace's time origin.
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Microseconds since the origin.
fn now_us(at: Instant) -> f64 {
    at.duration_since(origin()).as_nanos() as f64 / 1e3
}

/// One trace event (Chrome's JSON trace-event format).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TraceEvent {
    /// The span's or counter's name.
    pub name: String,
    /// Its category (`step`, `forward`, `backward`, …).
    pub cat: &'static str,
    /// `X`: a complete event (a span); `C`: a counter.
    pub ph: &'static str,
    /// Start, in microseconds.
    pub ts: f64,
    /// Duration in microseconds (spans only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// Process id (0).
    pub pid: u32,
    /// Thread id (0: the thread that drives training).
    pub tid: u32,
    /// Counter values (`bytes`) or a span's details.
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub args: serde_json::Map<String, serde_json::Value>,
}

/// Turns tracing on or off; `memory` reads the bytes in use for the counters.
pub fn set_enabled(on: bool, memory: Option<MemoryReader>) {
    origin();
    if let Ok(mut m) = MEMORY.lock() {
        *m = memory;
    }
    ON.store(on, Ordering::Relaxed);
}

/// Tracing on while the guard lives when `on` (off again when it drops, whatever ends the scope).
#[must_use]
pub struct Tracing(bool);

/// Turns tracing on for the guard's life when `on`, its counters read by `memory`.
pub fn trace_if(on: bool, memory: impl FnOnce() -> MemoryReader) -> Tracing {
    if on {
        set_enabled(true, Some(memory()));
    }
    Tracing(on)
}

impl Drop for Tracing {
    fn drop(&mut self) {
        if self.0 {
            set_enabled(false, None);
        }
    }
}

/// Whether spans are recorded now.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The events recorded so far, taken out.
pub fn take_events() -> Vec<TraceEvent> {
    EVENTS
        .lock()
        .map(|mut e| std::mem::take(&mut *e))
        .unwrap_or_default()
}

/// Bytes in use on the traced device.
fn memory_in_use() -> Option<u64> {
    MEMORY.lock().ok()?.as_ref()?()
}

/// A span being timed; recorded when dropped.
#[must_use]
pub struct Span {
    open: Option<(Instant, Cow<'static, str>, &'static str)>,
}

/// A span named `name` in category `cat`, from now until the guard drops (nothing when tracing is off).
pub fn span(name: impl Into<Cow<'static, str>>, cat: &'static str) -> Span {
    Span {
        open: enabled().then(|| (start(), name.into(), cat)),
    }
}

/// A span's start: after the work queued before it has run (the reader waits for it), so that a span times its own
/// work only.
fn start() -> Instant {
    memory_in_use();
    Instant::now()
}

/// [`span`] with a name built only when tracing is on.
pub fn span_with(name: impl FnOnce() -> String, cat: &'static str) -> Span {
    Span {
        open: enabled().then(|| (start(), Cow::Owned(name()), cat)),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some((start, name, cat)) = self.open.take() else {
            return;
        };
        // The reader waits for the device's queued work first (see `MemoryReader`), so the span ends when its work
        // has run, not when it was queued.
        let memory = memory_in_use();
        let end = Instant::now();
        let (ts, end_us) = (now_us(start), now_us(end));
        let mut events = vec![TraceEvent {
            name: name.into_owned(),
            cat,
            ph: "X",
            ts,
            dur: Some(end_us - ts),
            pid: 0,
            tid: 0,
            args: Default::default(),
        }];
        if let Some(bytes) = memory {
            let mut args = serde_json::Map::new();
            args.insert("bytes".into(), bytes.into());
            events.push(TraceEvent {
                name: "memory".into(),
                cat: "memory",
                ph: "C",
                ts: end_us,
                dur: None,
                pid: 0,
                tid: 0,
                args,
            });
        }
        if let Ok(mut all) = EVENTS.lock() {
            all.extend(events);
        }
    }
}

/// Writes `events` to `path` as a Chrome trace (`{"traceEvents": [...], "displayTimeUnit": "ms"}`), atomically.
pub fn write_chrome_trace(path: &Path, events: &[TraceEvent]) -> Result<()> {
    let json = serde_json::json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "candle-qlora"},
    });
    let text = serde_json::to_string(&json).map_err(|e| Error::InvalidInput(e.to_string()))?;
    write_file_atomically(path, |tmp| {
        std::fs::write(tmp, &text).map_err(|e| Error::io("cannot write", tmp, e))
    })
}
