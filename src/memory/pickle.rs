//! A writer of Python pickles (protocol 2) for plain data — `None`, booleans, integers, floats, strings, lists,
//! tuples and string-keyed dicts — what a PyTorch memory snapshot holds. Python's `pickle.load` reads the bytes back
//! as the same objects.

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int` (any 64-bit value; addresses too).
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<PyValue>),
    /// A `tuple`.
    Tuple(Vec<PyValue>),
    /// A `dict` with `str` keys, in insertion order.
    Dict(Vec<(String, PyValue)>),
}

impl PyValue {
    /// A dict of `(key, value)` pairs.
    pub fn dict<K: Into<String>>(items: impl IntoIterator<Item = (K, PyValue)>) -> Self {
        PyValue::Dict(items.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// A `str`.
    pub fn str(s: impl Into<String>) -> Self {
        PyValue::Str(s.into())
    }

    /// An `int` from an unsigned count (saturating at `i64::MAX`).
    pub fn uint(n: u64) -> Self {
        PyValue::Int(i64::try_from(n).unwrap_or(i64::MAX))
    }
}

// The protocol-2 opcodes used (CPython's `Lib/pickle.py` names).
const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const MARK: u8 = b'(';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const TUPLE: u8 = b't';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';

/// Items per `APPENDS` / `SETITEMS` batch (as CPython's pickler batches them).
const BATCH: usize = 1000;

/// `value` pickled with protocol 2.
pub fn to_pickle(value: &PyValue) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write(&mut out, value);
    out.push(STOP);
    out
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(BINUNICODE);
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write(out: &mut Vec<u8>, value: &PyValue) {
    match value {
        PyValue::None => out.push(NONE),
        PyValue::Bool(b) => out.push(if *b { NEWTRUE } else { NEWFALSE }),
        PyValue::Int(n) => match i32::try_from(*n) {
            Ok(small) => {
                out.push(BININT);
                out.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                // Two's complement, little-endian, as few bytes as keep the sign.
                let bytes = n.to_le_bytes();
                let mut len = 8;
                while len > 1 {
                    let (top, next) = (bytes[len - 1], bytes[len - 2]);
                    let redundant =
                        (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
                    if !redundant {
                        break;
                    }
                    len -= 1;
                }
                out.extend_from_slice(&[LONG1, len as u8]);
                out.extend_from_slice(&bytes[..len]);
            }
        },
        PyValue::Float(f) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        PyValue::Str(s) => write_str(out, s),
        PyValue::List(items) => {
            out.push(EMPTY_LIST);
            for chunk in items.chunks(BATCH) {
                out.push(MARK);
                chunk.iter().for_each(|v| write(out, v));
                out.push(APPENDS);
            }
        }
        PyValue::Tuple(items) => {
            out.push(MARK);
            items.iter().for_each(|v| write(out, v));
            out.push(TUPLE);
        }
        PyValue::Dict(items) => {
            out.push(EMPTY_DICT);
            for chunk in items.chunks(BATCH) {
                out.push(MARK);
                for (k, v) in chunk {
                    write_str(out, k);
                    write(out, v);
                }
                out.push(SETITEMS);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte for byte what CPython 3.11's `pickle.dumps(obj, protocol=2)` writes for small values.
    #[test]
    fn matches_cpython_protocol_2() {
        assert_eq!(to_pickle(&PyValue::None), b"\x80\x02N.");
        assert_eq!(to_pickle(&PyValue::Int(5)), b"\x80\x02J\x05\x00\x00\x00.");
        assert_eq!(to_pickle(&PyValue::Int(-1)), b"\x80\x02J\xff\xff\xff\xff.");
        // 2**40 and -(2**40) - 1
        assert_eq!(
            to_pickle(&PyValue::Int(1 << 40)),
            b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01."
        );
        assert_eq!(
            to_pickle(&PyValue::Int(-(1 << 40) - 1)),
            b"\x80\x02\x8a\x06\xff\xff\xff\xff\xff\xfe."
        );
        // 2**31 needs a sixth bit of sign: 5 bytes.
        assert_eq!(
            to_pickle(&PyValue::Int(1 << 31)),
            b"\x80\x02\x8a\x05\x00\x00\x00\x80\x00."
        );
        assert_eq!(
            to_pickle(&PyValue::Float(1.5)),
            b"\x80\x02G?\xf8\x00\x00\x00\x00\x00\x00."
        );
        // {"a": [True, "x"], "b": ()}: CPython memoizes containers (q\x00 …); without memo opcodes the
        // stream is the same value.
        let v = PyValue::dict([
            (
                "a",
                PyValue::List(vec![PyValue::Bool(true), PyValue::str("x")]),
            ),
            ("b", PyValue::Tuple(vec![])),
        ]);
        assert_eq!(
            to_pickle(&v),
            b"\x80\x02}(X\x01\x00\x00\x00a](\x88X\x01\x00\x00\x00xeX\x01\x00\x00\x00b(tu."
        );
    }
}
