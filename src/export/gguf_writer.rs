//! The GGUF container (version 3) written as a stream: the header — metadata and every tensor's record, whose
//! offsets follow from the tensors' types and shapes — first, then each tensor's data in the records' order, so a
//! model is written one tensor at a time and never held whole.

use std::io::{self, Write};

use candle_core::quantized::gguf_file::Value;

use super::ggml::GgmlType;

/// The alignment of the data section and of each tensor in it (GGUF's default, `general.alignment` unset).
pub const ALIGNMENT: u64 = 32;

/// A tensor's record in the header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRecord {
    /// Its llama.cpp name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Its shape, outermost first as PyTorch writes it (`[out, in]` for a linear weight); GGUF stores it
    /// innermost first.
    pub shape: Vec<usize>,
    /// How its elements are stored.
    pub ggml_type: GgmlType,
}

impl TensorRecord {
    /// The bytes of its data.
    pub fn bytes(&self) -> u64 {
        self.ggml_type.bytes(self.shape.iter().product()) as u64
    }
}

/// A GGUF file being written: the header is out, the tensors' data follows with [`GgufWriter::write_tensor`].
pub struct GgufWriter<W: Write> {
    out: W,
    records: Vec<TensorRecord>,
    /// The next tensor to write.
    next: usize,
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header of a file with `metadata` (in this order) and `tensors` (their data to follow in this
    /// order), padded to the data section's alignment.
    pub fn start(
        mut out: W,
        metadata: &[(String, Value)],
        tensors: Vec<TensorRecord>,
    ) -> io::Result<Self> {
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value_type(value).to_le_bytes());
            put_value(&mut header, value)?;
        }
        let mut offset = 0u64;
        for t in &tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in t.shape.iter().rev() {
                header.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset = aligned(offset + t.bytes());
        }
        header.resize(aligned(header.len() as u64) as usize, 0);
        out.write_all(&header)?;
        Ok(GgufWriter {
            out,
            records: tensors,
            next: 0,
        })
    }

    /// The record of the tensor whose data comes next, if any is left.
    pub fn next_record(&self) -> Option<&TensorRecord> {
        self.records.get(self.next)
    }

    /// Writes the next tensor's data (its encoding, as long as its record says), padded to the alignment.
    pub fn write_tensor(&mut self, data: &[u8]) -> io::Result<()> {
        let record = self.records.get(self.next).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "more tensors than the header lists",
            )
        })?;
        if data.len() as u64 != record.bytes() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "tensor `{}`: {} bytes of data, its record says {}",
                    record.name,
                    data.len(),
                    record.bytes()
                ),
            ));
        }
        self.out.write_all(data)?;
        let padding = aligned(data.len() as u64) - data.len() as u64;
        self.out.write_all(&vec![0u8; padding as usize])?;
        self.next += 1;
        Ok(())
    }

    /// Checks that every listed tensor was written and returns the output.
    pub fn finish(self) -> io::Result<W> {
        match self.records.get(self.next) {
            Some(missing) => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("tensor `{}` was listed but not written", missing.name),
            )),
            None => Ok(self.out),
        }
    }
}

/// `n` rounded up to the alignment.
fn aligned(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// GGUF's number of a value's type.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_string(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(items) => {
            // GGUF arrays hold one type: that of the first element (an empty array's is immaterial).
            let element = items.first().map_or(0, value_type);
            if let Some(other) = items.iter().find(|i| value_type(i) != element) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "a GGUF array mixes types ({other:?} among elements of type {element})"
                    ),
                ));
            }
            out.extend_from_slice(&element.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file written here reads back with Candle's GGUF reader: metadata, records, and each tensor's bytes at its
    /// offset.
    #[test]
    fn a_written_file_reads_back() {
        use candle_core::quantized::gguf_file::Content;
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("llama".into()),
            ),
            ("llama.block_count".to_string(), Value::U32(2)),
            ("x.eps".to_string(), Value::F32(1e-5)),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]),
            ),
        ];
        let tensors = vec![
            TensorRecord {
                name: "a.weight".into(),
                shape: vec![3, 32],
                ggml_type: GgmlType::Q8_0,
            },
            TensorRecord {
                name: "b.weight".into(),
                shape: vec![5],
                ggml_type: GgmlType::F32,
            },
        ];
        let a: Vec<f32> = (0..96).map(|i| (i as f32 - 40.0) / 7.0).collect();
        let b = [1.0f32, -2.0, 3.5, 0.25, 8.0];
        let mut w = GgufWriter::start(Vec::new(), &metadata, tensors).unwrap();
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        GgmlType::Q8_0.encode(&a, &mut ea);
        GgmlType::F32.encode(&b, &mut eb);
        w.write_tensor(&ea).unwrap();
        assert!(
            w.write_tensor(&ea).is_err(),
            "a second tensor of the wrong size"
        );
        w.write_tensor(&eb).unwrap();
        let bytes = w.finish().unwrap();
        let mut cursor = std::io::Cursor::new(&bytes);
        let content = Content::read(&mut cursor).unwrap();
        assert_eq!(content.metadata["llama.block_count"].to_u32().unwrap(), 2);
        assert_eq!(content.metadata["x.eps"].to_f32().unwrap(), 1e-5);
        assert_eq!(
            content.metadata["tokenizer.ggml.tokens"]
                .to_vec()
                .unwrap()
                .len(),
            2
        );
        let info = &content.tensor_infos["a.weight"];
        assert_eq!(info.shape.dims(), &[3, 32]);
        let start = (content.tensor_data_offset + info.offset) as usize;
        assert_eq!(&bytes[start..start + ea.len()], &ea[..]);
        let q = content
            .tensor(&mut cursor, "a.weight", &candle_core::Device::Cpu)
            .unwrap()
            .dequantize(&candle_core::Device::Cpu)
            .unwrap();
        let back: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
        // Half a step of the block's scale, plus 127 steps of its float16 rounding (2⁻¹¹ relative).
        for (block, back) in a.chunks(32).zip(back.chunks(32)) {
            let d = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (x, y) in block.iter().zip(back) {
                assert!((x - y).abs() <= d * (0.5 + 127.0 / 2048.0), "{x} vs {y}");
            }
        }
        let b_back: Vec<f32> = content
            .tensor(&mut cursor, "b.weight", &candle_core::Device::Cpu)
            .unwrap()
            .dequantize(&candle_core::Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(b_back, b);
    }
}
