//! TensorBoard (`report_to = "tensorboard"`): every numeric value of each log entry written as a scalar event under
//! transformers' tags (its `rewrite_logs`: `eval_loss` → `eval/loss`, anything else `x` → `train/x`), plus
//! `train/tokens_per_second`, in an event file TensorBoard reads (`events.out.tfevents.*`: TFRecord framing with
//! masked CRC-32C, `Event` / `Summary` protocol buffers with `simple_value`). No maintained Rust crate writes the
//! format, and the part needed is this small. The folder is transformers' default, `output_dir/runs/<date>_<host>`
//! (the date in UTC), or `TENSORBOARD_LOGGING_DIR` when set and not empty.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::callbacks::TrainerCallback;
use crate::error::{Error, Result};
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::storage::state::{LogEntry, TrainerState};

/// CRC-32C (Castagnoli) of `data`, bit by bit over a table built at compile time.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8)
    })
}

/// TFRecord's masked CRC.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xA282_EAD8)
}

/// One TFRecord: length, its masked CRC, the data, the data's masked CRC.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// A protocol-buffer varint.
fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7F) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (`bytes`, `string` or a message).
fn field_bytes(number: u32, bytes: &[u8], out: &mut Vec<u8>) {
    varint(((number << 3) | 2) as u64, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// `tensorflow.Event { wall_time = 1; step = 2; file_version = 3 | summary = 5 }`.
fn event(wall_time: f64, step: u64, body: EventBody<'_>) -> Vec<u8> {
    let mut out = vec![0x09];
    out.extend_from_slice(&wall_time.to_le_bytes());
    varint(0x10, &mut out);
    varint(step, &mut out);
    match body {
        EventBody::FileVersion(v) => field_bytes(3, v.as_bytes(), &mut out),
        EventBody::Scalar(tag, value) => {
            // Summary { value = 1: Value { tag = 1; simple_value = 2 (float) } }
            let mut v = Vec::new();
            field_bytes(1, tag.as_bytes(), &mut v);
            v.push(0x15);
            v.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::new();
            field_bytes(1, &v, &mut summary);
            field_bytes(5, &summary, &mut out);
        }
        EventBody::Text(tag, text) => {
            // Value { tag = 1; metadata = 9: SummaryMetadata { plugin_data = 1: { plugin_name = 1: "text" } };
            // tensor = 8: TensorProto { dtype = 1: DT_STRING (7); tensor_shape = 2: {}; string_val = 8 } }
            let mut plugin = Vec::new();
            field_bytes(1, b"text", &mut plugin);
            let mut metadata = Vec::new();
            field_bytes(1, &plugin, &mut metadata);
            let mut tensor = vec![0x08, 7];
            field_bytes(2, &[], &mut tensor);
            field_bytes(8, text.as_bytes(), &mut tensor);
            let mut v = Vec::new();
            field_bytes(1, tag.as_bytes(), &mut v);
            field_bytes(9, &metadata, &mut v);
            field_bytes(8, &tensor, &mut v);
            let mut summary = Vec::new();
            field_bytes(1, &v, &mut summary);
            field_bytes(5, &summary, &mut out);
        }
    }
    out
}

/// What an event carries.
enum EventBody<'a> {
    FileVersion(&'a str),
    Scalar(&'a str, f32),
    /// A Markdown text (TensorBoard's text plugin).
    Text(&'a str, &'a str),
}

/// transformers' tag for log key `key`.
pub fn tag_of(key: &str) -> String {
    match key.strip_prefix("eval_") {
        Some(rest) => format!("eval/{rest}"),
        None => format!("train/{key}"),
    }
}

/// The scalars of `entry` as TensorBoard gets them: `(tag, value)` for every number of its `log.jsonl` line but
/// the step, and the step's tokens per second.
pub fn scalars(entry: &LogEntry) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = match serde_json::to_value(entry) {
        Ok(serde_json::Value::Object(map)) => map
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| Some((tag_of(k), v.as_f64()?)))
            .collect(),
        _ => vec![],
    };
    if let (Some(tokens), Some(seconds)) = (entry.tokens, entry.step_seconds) {
        if seconds > 0.0 {
            out.push(("train/tokens_per_second".into(), tokens as f64 / seconds));
        }
    }
    out
}

/// Seconds since the epoch.
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The machine's name (`/proc/sys/kernel/hostname`, else `localhost`).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// transformers' `default_logdir()`: `runs/<%b%d_%H-%M-%S>_<host>`, the time in UTC here.
fn default_logdir(unix_seconds: u64, host: &str) -> String {
    let days = (unix_seconds / 86_400) as i64;
    let secs = unix_seconds % 86_400;
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as usize;
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "runs/{}{day:02}_{:02}-{:02}-{:02}_{host}",
        MONTHS[month - 1],
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
    )
}

/// The folder `TENSORBOARD_LOGGING_DIR` (given as `value`) names: none when unset or empty — an empty one would
/// put the event file in the working directory; transformers then falls back to a default folder too (PyTorch's
/// `SummaryWriter` treats an empty `log_dir` as unset), here the default under `output_dir`.
fn logging_dir(value: Option<std::ffi::OsString>) -> Option<PathBuf> {
    value.filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// Writes the run's log entries as TensorBoard scalars (added by the trainer for `report_to = "tensorboard"`).
pub struct TensorBoardCallback {
    dir: Option<PathBuf>,
    file: Option<(PathBuf, File)>,
}

impl TensorBoardCallback {
    /// A callback writing into `dir`, or into transformers' default folder under `output_dir` when `None`
    /// (`TENSORBOARD_LOGGING_DIR` when set).
    pub fn new(dir: Option<PathBuf>) -> Self {
        let dir = dir.or_else(|| logging_dir(std::env::var_os("TENSORBOARD_LOGGING_DIR")));
        TensorBoardCallback { dir, file: None }
    }

    /// The event file, once the run has begun.
    pub fn event_file(&self) -> Option<&Path> {
        self.file.as_ref().map(|(p, _)| p.as_path())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if let Some((path, file)) = &mut self.file {
            file.write_all(&record(bytes))
                .and_then(|_| file.flush())
                .map_err(|e| Error::io("cannot write", &*path, e))?;
        }
        Ok(())
    }
}

impl TrainerCallback for TensorBoardCallback {
    fn name(&self) -> &str {
        "TensorBoardCallback"
    }

    fn on_train_begin(&mut self, args: &TrainingArguments, state: &TrainerState) -> Result<()> {
        if !state.is_world_process_zero {
            return Ok(());
        }
        let (wall, host) = (now(), hostname());
        let dir = match &self.dir {
            Some(d) => d.clone(),
            None => Path::new(&args.output_dir).join(default_logdir(wall as u64, &host)),
        };
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create", &dir, e))?;
        let path = dir.join(format!(
            "events.out.tfevents.{:010}.{host}.{}.0",
            wall as u64,
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| Error::io("cannot create", &path, e))?;
        self.file = Some((path, file));
        self.write(&event(wall, 0, EventBody::FileVersion("brain.Event:2")))
    }

    fn on_log(&mut self, _: &TrainingArguments, _: &TrainerState, entry: &LogEntry) -> Result<()> {
        let wall = now();
        for (tag, value) in scalars(entry) {
            let bytes = event(
                wall,
                entry.step as u64,
                EventBody::Scalar(&tag, value as f32),
            );
            self.write(&bytes)?;
        }
        for (tag, text) in &entry.texts {
            let bytes = event(wall, entry.step as u64, EventBody::Text(&tag_of(tag), text));
            self.write(&bytes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_logging_dir_is_unset() {
        assert_eq!(logging_dir(None), None);
        assert_eq!(logging_dir(Some("".into())), None);
        assert_eq!(logging_dir(Some("tb".into())), Some(PathBuf::from("tb")));
    }

    #[test]
    fn records_are_framed_as_tfrecord_with_masked_crc32c() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        let mut v = Vec::new();
        varint(300, &mut v);
        assert_eq!(v, [0xAC, 0x02]);
    }

    #[test]
    fn tags_follow_transformers_and_the_log_directory_its_default() {
        assert_eq!(tag_of("loss"), "train/loss");
        assert_eq!(tag_of("eval_rewards/margins"), "eval/rewards/margins");
        let entry = LogEntry {
            step: 3,
            epoch: 0.5,
            loss: Some(1.25),
            tokens: Some(100),
            step_seconds: Some(0.5),
            skipped: false,
            ..Default::default()
        };
        let s = scalars(&entry);
        assert!(s.contains(&("train/loss".into(), 1.25)));
        assert!(s.contains(&("train/epoch".into(), 0.5)));
        assert!(s.contains(&("train/tokens_per_second".into(), 200.0)));
        assert!(!s.iter().any(|(t, _)| t == "train/step"));
        // 2026-11-25 21:55:07 UTC
        assert_eq!(
            default_logdir(1_795_643_707, "box"),
            "runs/Nov25_21-55-07_box"
        );
    }
}
