//! Python's `json.dumps` for chat templates: transformers replaces Jinja's `tojson` filter (which escapes HTML
//! characters and writes compact JSON) with `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`, so a template that serializes tool calls or arguments writes `{"a": 1, "b": [1, 2]}`, with
//! `<`, `&` and non-ASCII characters as they are. minijinja's own `tojson` writes `{"a":1,"b":[1,2]}` with
//! `\u003c`: this filter writes what Python writes.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Nesting deeper than this is refused (Python raises `RecursionError` near 1000).
const MAX_DEPTH: usize = 512;

/// How to write: `json.dumps`' keyword arguments.
struct Style {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// The `tojson` filter: `value | tojson(indent=2, ensure_ascii=False, separators=(", ", ": "), sort_keys=False)`.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(usize::try_from(v.clone()).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be a count or a string, not {v}"),
                )
            })?),
        }),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_separator, key_separator) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item, key)",
            ))
        }
        // Python's defaults: ", " without indentation, "," with it (the newline follows).
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = Style {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        item_separator,
        key_separator,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&mut out, &value, &style, 0)?;
    Ok(out)
}

fn write_value(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: the value is nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&python_float(f64::try_from(value.clone())?)),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            let entries = keys
                .into_iter()
                .map(|k| {
                    let v = value.get_item(&k)?;
                    Ok((k, v))
                })
                .collect::<Result<Vec<_>, Error>>()?;
            write_container(out, ('{', '}'), entries, style, depth, |out, (k, v)| {
                // Python writes non-string keys as strings (`{1: 2}` → `{"1": 2}`).
                match k.as_str() {
                    Some(s) => write_string(out, s, style),
                    None if k.is_none() => out.push_str("\"null\""),
                    None => write_string(out, &k.to_string(), style),
                }
                out.push_str(&style.key_separator);
                write_value(out, &v, style, depth + 1)
            })?;
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), items, style, depth, |out, v| {
                write_value(out, &v, style, depth + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: {value} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// `[a, b]` / `{...}`, or with indentation one item per line (`[]` and `{}` when empty, as Python).
fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: Vec<T>,
    style: &Style,
    depth: usize,
    mut write_item: impl FnMut(&mut String, T) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    let empty = items.is_empty();
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(&style.item_separator);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        write_item(out, item)?;
    }
    if let (Some(indent), false) = (&style.indent, empty) {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// A JSON string as Python escapes it: quotes, backslashes and control characters; non-ASCII as `\uXXXX` (UTF-16
/// surrogate pairs above U+FFFF) only with `ensure_ascii`.
fn write_string(out: &mut String, s: &str, style: &Style) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (style.ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (also how `json.dumps` and bitsandbytes' quant-state JSON write floats): the shortest digits that read back, positional for exponents −4 … 15 (with at least
/// one decimal), else `1.5e+16` / `1e-05`; `NaN`, `Infinity`.
pub(crate) fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("`{:e}` always writes an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` writes an integer exponent");
    if (-4..16).contains(&exponent) {
        let positional = x.to_string();
        if positional.contains('.') {
            positional
        } else {
            positional + ".0"
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, ctx).unwrap()
    }

    /// The expected strings are what Python 3.11's `json.dumps` writes for the same values.
    #[test]
    fn writes_what_python_writes() {
        let ctx = minijinja::context! {
            call => minijinja::context! { name => "get_weather", arguments => minijinja::context! {
                city => "Zürich <CH> & \"more\"", days => 3, scale => 0.5, big => 1e16, small => 0.00001,
                whole => 2.0, flags => vec![true, false], nothing => Value::from(()) } },
            empty => Vec::<i32>::new(),
            text => "tab\there\u{1}\u{1F600}",
        };
        assert_eq!(
            render("{{ call | tojson }}", ctx.clone()),
            r#"{"name": "get_weather", "arguments": {"city": "Zürich <CH> & \"more\"", "days": 3, "scale": 0.5, "big": 1e+16, "small": 1e-05, "whole": 2.0, "flags": [true, false], "nothing": null}}"#
        );
        assert_eq!(
            render(
                "{{ empty | tojson(indent=2) }}|{{ call.arguments.flags | tojson(indent=2) }}",
                ctx.clone()
            ),
            "[]|[\n  true,\n  false\n]"
        );
        assert_eq!(
            render(
                "{{ text | tojson }}|{{ text | tojson(ensure_ascii=true) }}",
                ctx.clone()
            ),
            "\"tab\\there\\u0001\u{1F600}\"|\"tab\\there\\u0001\\ud83d\\ude00\""
        );
        assert_eq!(
            render(
                "{{ call.arguments | tojson(sort_keys=true, separators=(',', ':')) }}",
                ctx
            ),
            r#"{"big":1e+16,"city":"Zürich <CH> & \"more\"","days":3,"flags":[true,false],"nothing":null,"scale":0.5,"small":1e-05,"whole":2.0}"#
        );
    }

    #[test]
    fn floats_follow_python_repr() {
        for (x, expected) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1e15, "1000000000000000.0"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (1.25e-7, "1.25e-07"),
            (0.051685333251953125, "0.051685333251953125"),
            (1e-5, "1e-05"),
            (-0.00012345, "-0.00012345"),
            (1e16, "1e+16"),
            (123.0, "123.0"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float(x), expected);
        }
    }
}
