//! `--set section.key=value`: each override parsed as a TOML value (text that is none is taken as a string, unless
//! it looks like a broken value) and set in the config's table, and an error about a string an override made
//! explained by naming the argument.

use crate::error::{Error, Result};

/// A `--set` value that is not TOML, kept as a string: the argument and its text.
pub(super) struct RawOverride<'a> {
    assignment: &'a str,
    text: String,
}

/// Parses `text`, the value of `--set assignment`, as TOML (numbers, booleans, strings, arrays, inline tables).
/// Text that is no TOML value is taken as a string (`training.optim=adamw_8bit`), unless it looks like a broken
/// one — an unclosed array, table or string, or an integer beyond TOML's 64 bits — which is an error naming the
/// argument. The flag is true for such a string (see [`explain_raw`]).
fn parse_value(assignment: &str, text: &str) -> Result<(toml::Value, bool)> {
    let parsed = format!("v = {text}").parse::<toml::Table>();
    let err = match parsed.map(|mut t| t.remove("v")) {
        Ok(Some(value)) => return Ok((value, false)),
        Ok(None) => "no value".to_string(),
        Err(e) => e.message().trim().replace('\n', ": "),
    };
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    if !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit() || c == '_') {
        return Err(Error::InvalidInput(format!(
            "--set `{assignment}`: {text} is out of range: a TOML integer is from {} to {}",
            i64::MIN,
            i64::MAX
        )));
    }
    if text.starts_with(['[', '{', '"', '\'']) {
        return Err(Error::InvalidInput(format!(
            "--set `{assignment}`: `{text}` is not a valid TOML value ({err}); close the array, table or \
             string, or quote the whole value to mean a string (key='\"…\"')"
        )));
    }
    Ok((toml::Value::String(text.into()), true))
}

/// `err` from reading the config, explained when a `--set` value taken as a string (see [`parse_value`]) went to
/// a key that takes no string: the message names the argument.
pub(super) fn explain_raw(err: Error, raw: &[RawOverride<'_>]) -> Error {
    let message = err.to_string();
    match raw
        .iter()
        .find(|r| message.contains(&format!("invalid type: string {:?}", r.text)))
    {
        Some(r) => Error::InvalidInput(format!(
            "--set `{}`: `{}` is not a TOML value, and the key takes no string ({message}); write a number \
             (e.g. 1e-3), true or false, or an array, as TOML",
            r.assignment, r.text
        )),
        None => err,
    }
}

/// Sets `section.key[.key…] = value` in `root` (a `--set` override); returns the value's text when it is no
/// TOML value and was taken as a string.
pub(super) fn apply_override<'a>(
    root: &mut toml::Table,
    assignment: &'a str,
) -> Result<Option<RawOverride<'a>>> {
    let (key, value) = assignment.split_once('=').ok_or_else(|| {
        Error::InvalidInput(format!("--set `{assignment}`: expected section.key=value"))
    })?;
    let mut parts: Vec<&str> = key.trim().split('.').collect();
    let last = parts.pop().filter(|_| !parts.is_empty()).ok_or_else(|| {
        Error::InvalidInput(format!(
            "--set `{assignment}`: the key needs a section, e.g. training.learning_rate"
        ))
    })?;
    let mut table = root;
    for p in parts {
        table = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .ok_or_else(|| {
                Error::InvalidInput(format!("--set `{assignment}`: `{p}` is not a table"))
            })?;
    }
    let text = value.trim();
    let (value, raw) = parse_value(assignment, text)?;
    table.insert(last.to_string(), value);
    Ok(raw.then(|| RawOverride {
        assignment,
        text: text.to_string(),
    }))
}
