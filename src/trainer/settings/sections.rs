//! Reading one section of a TOML config as a serde type: an unknown key is an error that suggests the closest valid
//! name (a plausible slip only: a typo, or the same words give or take one), and a value of the wrong type names its
//! key (and the range of an unsigned integer). Every section of a run config, and `TrainingArguments`, is read so.

use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// The field names serde knows for struct `T` (its derived `Deserialize` lists them).
pub(crate) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};

    /// Carries the field list out of the probe.
    #[derive(Debug)]
    struct Fields(&'static [&'static str]);
    impl std::fmt::Display for Fields {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "fields {:?}", self.0)
        }
    }
    impl std::error::Error for Fields {}
    impl de::Error for Fields {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Fields(&[])
        }
    }
    /// A deserializer that answers every request with an error, and a struct request with its field list.
    struct Probe;
    impl<'de> de::Deserializer<'de> for Probe {
        type Error = Fields;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> std::result::Result<V::Value, Fields> {
            Err(Fields(&[]))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> std::result::Result<V::Value, Fields> {
            Err(Fields(fields))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
            unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }
    match T::deserialize(Probe) {
        Err(Fields(fields)) => fields,
        Ok(_) => &[],
    }
}

/// How plausibly `candidate` is the key meant by `key`, higher being closer; `None` when it is not a plausible
/// slip: a typo (one edit, two in a longer key; digits unchanged, as `load_in_8bit` is no `load_in_4bit`), or the
/// same words with at most one word more or fewer, each word equal, one typo off or shortened (`num_epochs` →
/// `num_train_epochs`, `max_seq_len` → `max_length`, `evaluation_strategy` → `eval_strategy`). A word swapped for
/// another is another setting (`eval_accumulation_steps` is no `gradient_accumulation_steps`), and so is a single
/// shared word (`rank` is no `rank_pattern`).
fn plausibility(key: &str, candidate: &str) -> Option<f64> {
    let digits = |s: &str| s.chars().filter(char::is_ascii_digit).collect::<String>();
    let same_digits = |a: &str, b: &str| digits(a) == digits(b);
    let distance = strsim::damerau_levenshtein(key, candidate);
    let (short, long) = (
        key.len().min(candidate.len()),
        key.len().max(candidate.len()),
    );
    let typos = if long <= 5 { 1 } else { 2 };
    if short >= 3 && distance <= typos && same_digits(key, candidate) {
        return Some(2.0 - distance as f64 / long as f64);
    }
    let word_match = |a: &str, b: &str| {
        let (short, long) = if a.len() <= b.len() { (a, b) } else { (b, a) };
        a == b
            || (short.len() >= 4 && strsim::damerau_levenshtein(a, b) <= 1 && same_digits(a, b))
            || (short.len() >= 3 && long.starts_with(short))
    };
    let (words, theirs): (Vec<&str>, Vec<&str>) =
        (key.split('_').collect(), candidate.split('_').collect());
    let mut used = vec![false; theirs.len()];
    let (mut matched, mut ours_len, mut theirs_len) = (0, 0, 0);
    for w in &words {
        if let Some(i) = (0..theirs.len()).find(|&i| !used[i] && word_match(w, theirs[i])) {
            used[i] = true;
            matched += 1;
            ours_len += w.len();
            theirs_len += theirs[i].len();
        }
    }
    let (extra, missing) = (words.len() - matched, theirs.len() - matched);
    let letters = |ws: &[&str]| ws.iter().map(|w| w.len()).sum::<usize>().max(1) as f64;
    let (ours, theirs) = (
        ours_len as f64 / letters(&words),
        theirs_len as f64 / letters(&theirs),
    );
    (matched >= 2
        && extra.max(missing) <= 1
        && extra.min(missing) == 0
        && ours >= 0.65
        && theirs >= 0.6)
        .then_some(ours.min(theirs))
}

/// The valid names `key` plausibly meant (see [`plausibility`]): the closest, and any about as close.
pub(super) fn closest<'a>(key: &str, candidates: &[&'a str]) -> Vec<&'a str> {
    let scored: Vec<(f64, &str)> = candidates
        .iter()
        .filter_map(|c| plausibility(key, c).map(|p| (p, *c)))
        .collect();
    let best = scored.iter().map(|(p, _)| *p).fold(f64::MIN, f64::max);
    scored
        .into_iter()
        .filter(|(p, _)| *p >= best - 0.05)
        .map(|(_, c)| c)
        .collect()
}

/// "`a`", "`a` or `b`", … for a suggestion.
pub(super) fn either(names: &[String]) -> String {
    names.join(" or ")
}

/// An error for unknown `key` in `section` of `path`, suggesting the closest of `candidates`.
pub(super) fn unknown_key(path: &str, section: &str, key: &str, candidates: &[&str]) -> Error {
    let close: Vec<String> = closest(key, candidates)
        .iter()
        .map(|c| format!("`{c}`"))
        .collect();
    let hint = match close.is_empty() {
        false => format!("did you mean {}?", either(&close)),
        true => format!("valid keys: {}", candidates.join(", ")),
    };
    Error::InvalidInput(format!(
        "{path}: unknown key `{key}` in [{section}]; {hint}"
    ))
}

/// An error for the first key of `table` that is neither a field of `T` nor one of `extra_keys`, suggesting the
/// closest field.
pub(super) fn check_keys<T: DeserializeOwned>(
    table: &toml::Table,
    path: &str,
    section: &str,
    extra_keys: &[&str],
) -> Result<()> {
    let fields = field_names::<T>();
    match table
        .keys()
        .find(|k| !fields.contains(&k.as_str()) && !extra_keys.contains(&k.as_str()))
    {
        Some(key) => Err(unknown_key(path, section, key, fields)),
        None => Ok(()),
    }
}

/// serde's message for an integer its unsigned type cannot hold, with the range the key takes.
fn with_range(message: &str) -> String {
    let max = [
        ("usize", usize::MAX as u64),
        ("u64", u64::MAX),
        ("u32", u32::MAX as u64),
        ("u16", u16::MAX as u64),
        ("u8", u8::MAX as u64),
    ]
    .into_iter()
    .find(|(ty, _)| message.ends_with(&format!("expected {ty}")));
    match max {
        Some((_, max)) if message.starts_with("invalid value: integer") => {
            format!("{message}: must be an integer from 0 to {max}")
        }
        _ => message.to_string(),
    }
}

/// Reads `[section]` of the config at `path` as `T`: an unknown key (other than `extra_keys`, accepted and
/// ignored) is an error suggesting the closest field, a wrong value an error naming its key.
pub(crate) fn read_section<T: DeserializeOwned>(
    value: &toml::Value,
    path: &str,
    section: &str,
    extra_keys: &[&str],
) -> Result<T> {
    let toml::Value::Table(table) = value else {
        return Err(Error::InvalidInput(format!(
            "{path}: [{section}] must be a table"
        )));
    };
    check_keys::<T>(table, path, section, extra_keys)?;
    let fields = field_names::<T>();
    let mut table = table.clone();
    table.retain(|key, _| fields.contains(&key));
    serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
        let key = e.path().to_string();
        let message = with_range(e.into_inner().message());
        let at = if key == "." {
            String::new()
        } else {
            format!(" {key}")
        };
        Error::InvalidInput(format!("{path}: [{section}]{at}: {message}"))
    })
}
