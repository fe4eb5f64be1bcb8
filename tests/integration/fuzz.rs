//! Fuzzing with proptest: every parser a user feeds files to answers `Ok` or `Err` on any input; it never panics.
//! (An absurd allocation from a length field would abort the whole test binary, so that fails too.) One test per kind
//! of input:
//!
//! - GGUF (`load_model` / `load_model_config` on a `.gguf`, then its tokenizer and chat template): a valid tiny
//!   GGUF from a small writer, with its metadata and tensor infos edited (random types, absurd lengths and counts),
//!   random headers, arbitrary bytes, and byte-level mutations of the valid file.
//! - safetensors (`MappedSafetensors`, `read_bnb_file`, `load_model` on a folder, `load_adapter`): the 8-byte length
//!   and JSON header with random dtypes, shapes and offsets, bitsandbytes quant states, arbitrary bytes, and
//!   mutations of real model, bitsandbytes and adapter files.
//! - JSONL (`read_jsonl` in every format, `Dataset::train_and_eval`, `PreferenceDataset::train_and_eval`): lines of arbitrary bytes, random JSON and
//!   records of each format.
//! - TOML run configs (`RunConfig::load` with `--set` overrides, then the schedule the trainer builds from them):
//!   a valid config with keys set to random-typed values, removed or added, and random overrides.
//! - `adapter_config.json` (`LoraConfig::from_json` / `from_file`, then the adapter it describes on a model).
//! - chat templates (`render_chat_template`, `apply_chat_template`, chat tokenization): mutations of real templates
//!   and random messages.
//!
//! Each test runs a fixed number of cases, the module within a minute in a debug build; set `PROPTEST_CASES` to run
//! more (`PROPTEST_CASES=100000 cargo test --test integration fuzz::`). A failure prints the minimal input it
//! shrinks to, and proptest records its seed in `tests/proptest-regressions/fuzz.txt`, replayed first on the next
//! run (`PROPTEST_RNG_SEED` fixes the seed of a whole run).

use std::path::Path;

use candle_core::safetensors::Load;
use candle_core::Device;
use candle_qlora::adapter::{load_adapter, Adapters};
use candle_qlora::data::{
    read_jsonl, DataConfig, DataFormat, Dataset, Example, PreferenceDataset, TruncationMode,
};
use candle_qlora::files::{view_to_f32, MappedSafetensors};
use candle_qlora::loading::bnb::{quantize_file, read_bnb_file, QuantizeOptions};
use candle_qlora::loading::{load_model, load_model_config, LoadOptions};
use candle_qlora::lora::LoraConfig;
use candle_qlora::models::tokenizer::render_chat_template;
use candle_qlora::models::{ChatMessage, LlamaModel, TextTokenizer};
use candle_qlora::optim::Schedule;
use candle_qlora::quant::QuantConfig;
use candle_qlora::trainer::{RunConfig, TrainingArguments};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::{select, Index};
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};

use crate::common::data_path;

/// Cases per test (with `PROPTEST_CASES` unset), chosen so the module runs in under a minute in a debug build.
const GGUF_CASES: u32 = 6000;
const SAFETENSORS_CASES: u32 = 5000;
const JSONL_CASES: u32 = 8000;
const TOML_CASES: u32 = 8000;
const LORA_CASES: u32 = 6000;
const CHAT_TEMPLATE_CASES: u32 = 10000;

/// Runs `test` on `cases` inputs drawn from `strategy` (`PROPTEST_CASES` overrides the count). A panic or failed
/// assertion fails the test with the minimal input proptest shrinks it to.
fn fuzz<S: Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let defaults = Config::default();
    let config = Config {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            defaults.cases
        } else {
            cases
        },
        source_file: Some(file!()),
        ..defaults
    };
    if let Err(e) = TestRunner::new(config).run(&strategy, test) {
        panic!("{e}");
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Values shared by the generators.

/// Lengths, counts and sizes around the edges parsers get wrong, and some random ones.
fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => select(vec![
            0u64, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, 255, 256, 4096, 65535, 65536, 1 << 24, (1 << 30) - 1,
            1 << 30, (1 << 30) + 1, 1 << 31, u32::MAX as u64, 1 << 32, 1 << 40, 1 << 60, i64::MAX as u64,
            u64::MAX - 1, u64::MAX,
        ]),
        1 => any::<u64>(),
    ]
}

fn interesting_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => select(vec![
            0i64, 1, -1, 2, 3, 4, 7, 8, 16, 64, 100, 4096, 1 << 31, 1 << 32, 1 << 53, i64::MAX, i64::MIN, -64,
        ]),
        1 => any::<i64>(),
    ]
}

fn interesting_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => select(vec![
            0.0f64, -0.0, 1.0, -1.0, 0.5, 0.05, 1e-8, 2e-4, 0.999, 1.5, 3.0, 100.0, 1e15, 1e300, -1e300, f64::MAX,
            f64::MIN, f64::MIN_POSITIVE, 5e-324, f64::NAN, f64::INFINITY, f64::NEG_INFINITY,
        ]),
        1 => any::<f64>(),
    ]
}

/// Short text: names parsers look for, template-like text, and arbitrary characters.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => select(vec![
            "", " ", "llama", "qwen2", "qwen3moe", "qwen2moe", "mistral", "gpt2", "llama3", "smaug-bpe", "a b", "ab c", "<s>", "</s>", "nf4",
            "fp4", "float32", "bfloat16", "user", "assistant", "system", "{{ x }}", "{% if %}", "é漢字🦀", "\u{0}",
            "\u{feff}", "\\", "\"", "a\nb",
        ])
        .prop_map(String::from),
        2 => ".{0,12}",
        1 => "[ -~]{0,40}",
    ]
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..max)
}

/// Any JSON value, nested a few levels; object keys are often ones the parsers read.
fn json_value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        interesting_i64().prop_map(Value::from),
        interesting_u64().prop_map(Value::from),
        interesting_f64().prop_map(Value::from),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..5).prop_map(Value::Array),
            vec((json_key(), inner), 0..5).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

fn json_key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => select(vec![
            "text", "instruction", "input", "output", "messages", "conversations", "role", "content", "from",
            "value", "prompt", "completion", "r", "lora_alpha", "target_modules", "dtype", "shape", "data_offsets",
            "__metadata__", "quant_type", "blocksize",
        ])
        .prop_map(String::from),
        1 => text(),
    ]
}

/// One change to a byte string; `header` aims it at the first `header_len` bytes (where the lengths are).
#[derive(Clone, Debug)]
enum ByteEdit {
    Xor {
        header: bool,
        at: Index,
        mask: u8,
    },
    PutU64 {
        header: bool,
        at: Index,
        value: u64,
    },
    Insert {
        header: bool,
        at: Index,
        bytes: Vec<u8>,
    },
    Remove {
        header: bool,
        at: Index,
        len: u8,
    },
    Truncate {
        at: Index,
    },
}

fn byte_edits() -> impl Strategy<Value = Vec<ByteEdit>> {
    let header = || prop::bool::weighted(0.85);
    let edit = prop_oneof![
        4 => (header(), any::<Index>(), 1u8..=255).prop_map(|(header, at, mask)| ByteEdit::Xor { header, at, mask }),
        2 => (header(), any::<Index>(), interesting_u64())
            .prop_map(|(header, at, value)| ByteEdit::PutU64 { header, at, value }),
        1 => (header(), any::<Index>(), bytes(16))
            .prop_map(|(header, at, bytes)| ByteEdit::Insert { header, at, bytes }),
        1 => (header(), any::<Index>(), any::<u8>()).prop_map(|(header, at, len)| ByteEdit::Remove { header, at, len }),
        1 => any::<Index>().prop_map(|at| ByteEdit::Truncate { at }),
    ];
    vec(edit, 1..5)
}

fn apply_byte_edits(mut data: Vec<u8>, header_len: usize, edits: &[ByteEdit]) -> Vec<u8> {
    for edit in edits {
        let pos = |header: bool, at: &Index, len: usize| {
            let n = if header { header_len.min(len) } else { len };
            (n > 0).then(|| at.index(n))
        };
        match edit {
            ByteEdit::Xor { header, at, mask } => {
                if let Some(i) = pos(*header, at, data.len()) {
                    data[i] ^= mask;
                }
            }
            ByteEdit::PutU64 { header, at, value } => {
                if let Some(i) = pos(*header, at, data.len()) {
                    let end = (i + 8).min(data.len());
                    data[i..end].copy_from_slice(&value.to_le_bytes()[..end - i]);
                }
            }
            ByteEdit::Insert { header, at, bytes } => {
                let i = pos(*header, at, data.len()).unwrap_or(0);
                data.splice(i..i, bytes.iter().copied());
            }
            ByteEdit::Remove { header, at, len } => {
                if let Some(i) = pos(*header, at, data.len()) {
                    let end = (i + *len as usize).min(data.len());
                    data.drain(i..end);
                }
            }
            ByteEdit::Truncate { at } => {
                if let Some(i) = pos(false, at, data.len()) {
                    data.truncate(i);
                }
            }
        }
    }
    data
}

/// A fresh temporary folder.
fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary folder")
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) {
    std::fs::write(path, bytes).expect("writing a temporary file");
}

/// The tiny random Llama of the tests (its weights, config and tokenizer).
fn tiny_model() -> LlamaModel {
    let folder = data_path("models/tiny-llama");
    load_model(folder.to_str().unwrap(), None, &LoadOptions::default())
        .expect("the tiny model loads")
        .model
}

fn tiny_tokenizer() -> TextTokenizer {
    TextTokenizer::from_folder(&data_path("models/tiny-llama")).expect("the tiny tokenizer loads")
}

// ------------------------------------------------------------------------------------------------------------------
// Chat templates (used by the GGUF, JSONL and template tests).

/// SmolLM2's template (ChatML with a default system prompt).
const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Llama 3's template.
const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Mistral's template: roles must alternate, else `raise_exception`.
const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

/// A Qwen-like template with whitespace control, a namespace, Python string methods and `strftime_now`.
const QWEN_LIKE: &str = "{%- set ns = namespace(sys=false) -%}\n{%- for m in messages -%}\n  {%- if m.role == 'system' -%}{%- set ns.sys = true -%}{%- endif -%}\n{%- endfor -%}\n{%- if not ns.sys -%}\n{{ '<|im_start|>system\\nToday is ' + strftime_now('%d %b %Y') + '<|im_end|>\\n' }}\n{%- endif -%}\n{%- for m in messages -%}\n{{ '<|im_start|>' + m.role + '\\n' + m.content.strip() + '<|im_end|>\\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

const TEMPLATES: [&str; 4] = [CHATML, LLAMA3, MISTRAL, QWEN_LIKE];

/// Pieces of Jinja to splice into templates: unbalanced tags, undefined names, errors, and expensive expressions.
/// Every loop here is short (`range(5)`) and every large value bounded, so a template of a few of them stays fast and
/// small. Templates built to be slow or huge are left out on purpose: minijinja (without its `fuel` feature) runs
/// nested `range(100000)` loops for hours, and `'x'|indent(10**11)` or `'{:>99999999999}'.format(1)` ask for 100 GB,
/// which aborts the process, so no test here could survive them.
const JINJA_PIECES: &[&str] = &[
    "{%",
    "%}",
    "{{",
    "}}",
    "{#",
    "#}",
    "{%-",
    "-%}",
    "{% endfor %}",
    "{% endif %}",
    "{% else %}",
    "{% elif x %}",
    "{% for m in messages %}",
    "{% for i in range(5) %}",
    "{% if x %}",
    "{% if messages %}",
    "{% set x = 1 %}",
    "{% set ns = namespace(x=1) %}{{ ns.x }}",
    "{{ raise_exception('refused') }}",
    "{{ raise_exception() }}",
    "{{ raise_exception(1) }}",
    "{{ undefined.attr.deeper }}",
    "{{ undefined() }}",
    "{{ messages[5]['content'] }}",
    "{{ messages[-1].content }}",
    "{{ messages[0].role.upper() }}",
    "{{ range(100000) | length }}",
    "{{ range(100001) }}",
    "{{ range(0, 10, 0) }}",
    "{{ range(-5) | list }}",
    "{{ 'ab' * 1000 }}",
    "{{ 'ab' * 10**12 }}",
    "{{ [1, 2] * 100 }}",
    "{{ 1 / 0 }}",
    "{{ 1 // 0 }}",
    "{{ 1 % 0 }}",
    "{{ 10 ** 1000 }}",
    "{{ 2 ** 64 }}",
    "{{ 2 ** -1 }}",
    "{{ 9223372036854775807 + 1 }}",
    "{{ -9223372036854775808 // -1 }}",
    "{{ -9223372036854775808 % -1 }}",
    "{{ 1.5e308 * 10 }}",
    "{{ messages[99999999999999999999] }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ messages | tojson }}",
    "{{ messages | map(attribute='role') | join(',') }}",
    "{{ messages | selectattr('role', 'eq', 'user') | list }}",
    "{% raw %}",
    "{% endraw %}",
    "{% filter upper %}",
    "{% endfilter %}",
    "{{ x | nosuchfilter }}",
    "{{ strftime_now('%Y') }}",
    "{{ strftime_now() }}",
    "{% include 'other' %}",
    "{% extends 'base' %}",
    "{% block b %}",
    "{% endblock %}",
    "{{ bos_token }}",
    "{{ eos_token }}",
    "{% if add_generation_prompt %}",
    "{{ loop.index }}",
    "{{ loop.previtem }}",
    "{{ message['content'][::-1] }}",
    "{{ 'abc'[::0] }}",
    "{{ range(3)[::0] }}",
    "{{ 'a'[5] }}",
    "{{ 'é'[0:1] }}",
    "{{ 'x'.ljust(10000) }}",
    "{{ 'x'.center(-5) }}",
    "{{ 'a b'.split(' ', -5) }}",
    "{{ 'ab'.replace('', 'x') }}",
    "{{ 'abc'.count('') }}",
    "{{ 'ab'.find('b', 10, 2) }}",
    "{{ 'ab'.startswith(('a', 1)) }}",
    "{{ messages[0].keys() | list }}",
    "{{ messages[0].items() | list }}",
    "{{ range(5) | batch(0) | list }}",
    "{{ range(5) | slice(0) | list }}",
    "{{ 'abc' | truncate(-1) }}",
    "{{ 'x' | indent(-3) }}",
    "{{ 'x' | wordwrap(0) }}",
    "{{ [] | first }}",
    "{{ [] | max }}",
    "{{ {} | dictsort }}",
    "{{ none.x }}",
    "{{ x is defined }}",
    "{{ 'a' ~ none }}",
    "{{ messages | length > 0 }}",
    "{{ '%s' % 1 }}",
    "{{ 'a' if x else 'b' }}",
    "{{ 1 if }}",
    "{{ (((( }}",
    "{{ [[[[1]]]] }}",
    "{{ {'a': {'b': {}}} }}",
    "\n",
    " ",
    "{{- ' ' -}}",
    "{% for i in range(5) recursive %}",
    "{{ loop(messages) }}",
    "{{ 'abc'.split('') }}",
    "{{ 'abc'.rfind('') }}",
    "{{ 'abc'.replace('', 'x', 2) }}",
    "{{ [1, 1].count(1) }}",
    "{{ '{}'.format() }}",
    "{{ '{0}{1}'.format(1) }}",
    "{{ '{:>1000}'.format(1) }}",
    "{{ '{:.0g}'.format(1.5) }}",
    "{{ '{:,.3e}'.format(-0.0) }}",
    "{{ 'x' | indent(1000) }}",
    "{{ '{:.70000f}'.format(1.5) }}",
    "{{ '{:.70000e}'.format(1.5) }}",
    "{{ '%.100000f' | format(1.5) }}",
    "{{ messages[0].get('role') }}",
    "{% for m in messages %}{{ m['content'].strip().count('') }}{% endfor %}",
    "{% if messages %}{{ messages[0]['content'] }}{% else %}{{ raise_exception('no messages') }}{% endif %}",
    "{% for i in range(5) %}{{ loop.index }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% continue %}",
    "{% break %}",
    "{% call f() %}x{% endcall %}",
];

/// One change to a template.
#[derive(Clone, Debug)]
enum TemplateEdit {
    /// Inserts a piece between two tags (or at either end), where it parses more often.
    Splice(Index, &'static str),
    Insert(Index, &'static str),
    Delete(Index, u8),
    Duplicate(Index, u8),
    Char(Index, char),
}

fn template_edits() -> impl Strategy<Value = Vec<TemplateEdit>> {
    let edit = prop_oneof![
        6 => (any::<Index>(), select(JINJA_PIECES)).prop_map(|(at, piece)| TemplateEdit::Splice(at, piece)),
        2 => (any::<Index>(), select(JINJA_PIECES)).prop_map(|(at, piece)| TemplateEdit::Insert(at, piece)),
        2 => (any::<Index>(), 1u8..24).prop_map(|(at, n)| TemplateEdit::Delete(at, n)),
        1 => (any::<Index>(), 1u8..40).prop_map(|(at, n)| TemplateEdit::Duplicate(at, n)),
        1 => (any::<Index>(), any::<char>()).prop_map(|(at, c)| TemplateEdit::Char(at, c)),
    ];
    vec(edit, 0..5)
}

/// Applies `edits` to `template` (at character boundaries).
fn edit_template(template: &str, edits: &[TemplateEdit]) -> String {
    let mut chars: Vec<char> = template.chars().collect();
    for edit in edits {
        let at = |i: &Index, len: usize| if len == 0 { 0 } else { i.index(len + 1) };
        match edit {
            TemplateEdit::Splice(i, piece) => {
                let ends: Vec<usize> = (0..=chars.len())
                    .filter(|&p| {
                        p == 0 || (p >= 2 && matches!(chars[p - 2..p], ['%', '}'] | ['}', '}']))
                    })
                    .collect();
                let p = ends[i.index(ends.len())];
                chars.splice(p..p, piece.chars());
            }
            TemplateEdit::Insert(i, piece) => {
                let p = at(i, chars.len());
                chars.splice(p..p, piece.chars());
            }
            TemplateEdit::Delete(i, n) => {
                let p = at(i, chars.len()).min(chars.len());
                let end = (p + *n as usize).min(chars.len());
                chars.drain(p..end);
            }
            TemplateEdit::Duplicate(i, n) => {
                let p = at(i, chars.len()).min(chars.len());
                let end = (p + *n as usize).min(chars.len());
                let copy: Vec<char> = chars[p..end].to_vec();
                chars.splice(end..end, copy);
            }
            TemplateEdit::Char(i, c) => {
                if !chars.is_empty() {
                    let p = i.index(chars.len());
                    chars[p] = *c;
                }
            }
        }
    }
    chars.into_iter().collect()
}

fn chat_messages() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop_oneof![
        4 => select(vec!["system", "user", "assistant"]).prop_map(String::from),
        1 => text(),
    ];
    vec(
        (role, text()).prop_map(|(role, content)| ChatMessage { role, content }),
        0..6,
    )
}

// ------------------------------------------------------------------------------------------------------------------
// 1. GGUF.

const GGUF_MAGIC: u32 = 0x4655_4747;
const GGUF_ALIGNMENT: usize = 32;

/// A GGUF metadata value as the writer puts it on disk (type id, then payload). The `Lying*` and `Unknown` variants
/// write what no valid file has.
#[derive(Clone, Debug)]
enum Meta {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    /// A bool byte (only 0 and 1 are valid).
    Bool(u8),
    Str(String),
    /// Declared element type, then the elements, written each as itself (so they may not match the type).
    Array(u32, Vec<Meta>),
    U64(u64),
    I64(i64),
    F64(f64),
    /// A string whose length field says `declared` bytes, followed by `bytes`.
    LyingStr {
        declared: u64,
        bytes: Vec<u8>,
    },
    /// An array of `elem_type` whose count says `declared`, followed by `bytes`.
    LyingArray {
        elem_type: u32,
        declared: u64,
        bytes: Vec<u8>,
    },
    /// An unknown type id, followed by `bytes`.
    Unknown {
        type_id: u32,
        bytes: Vec<u8>,
    },
}

impl Meta {
    fn type_id(&self) -> u32 {
        match self {
            Meta::U8(_) => 0,
            Meta::I8(_) => 1,
            Meta::U16(_) => 2,
            Meta::I16(_) => 3,
            Meta::U32(_) => 4,
            Meta::I32(_) => 5,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) | Meta::LyingStr { .. } => 8,
            Meta::Array(..) | Meta::LyingArray { .. } => 9,
            Meta::U64(_) => 10,
            Meta::I64(_) => 11,
            Meta::F64(_) => 12,
            Meta::Unknown { type_id, .. } => *type_id,
        }
    }
}

/// A tensor info: name, dimensions (GGUF order: innermost first), ggml type id, offset in the data section.
#[derive(Clone, Debug)]
struct GgufTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

/// A GGUF file to write; the declared counts are the true ones unless set.
#[derive(Clone, Debug)]
struct Gguf {
    magic: u32,
    version: u32,
    tensor_count: Option<u64>,
    kv_count: Option<u64>,
    metadata: Vec<(String, Meta)>,
    tensors: Vec<GgufTensor>,
    /// The data section (after the header, padded to the alignment).
    data: Vec<u8>,
}

struct GgufWriter {
    out: Vec<u8>,
    /// Version 1 writes lengths and dimensions as u32.
    v1: bool,
}

impl GgufWriter {
    fn u32(&mut self, x: u32) {
        self.out.extend(x.to_le_bytes());
    }

    fn len(&mut self, n: u64) {
        if self.v1 {
            self.out.extend((n as u32).to_le_bytes());
        } else {
            self.out.extend(n.to_le_bytes());
        }
    }

    fn string(&mut self, s: &[u8]) {
        self.len(s.len() as u64);
        self.out.extend(s);
    }

    fn value(&mut self, v: &Meta) {
        match v {
            Meta::U8(x) => self.out.push(*x),
            Meta::I8(x) => self.out.extend(x.to_le_bytes()),
            Meta::U16(x) => self.out.extend(x.to_le_bytes()),
            Meta::I16(x) => self.out.extend(x.to_le_bytes()),
            Meta::U32(x) => self.out.extend(x.to_le_bytes()),
            Meta::I32(x) => self.out.extend(x.to_le_bytes()),
            Meta::F32(x) => self.out.extend(x.to_le_bytes()),
            Meta::Bool(x) => self.out.push(*x),
            Meta::Str(s) => self.string(s.as_bytes()),
            Meta::Array(t, items) => {
                self.u32(*t);
                self.len(items.len() as u64);
                for item in items {
                    self.value(item);
                }
            }
            Meta::U64(x) => self.out.extend(x.to_le_bytes()),
            Meta::I64(x) => self.out.extend(x.to_le_bytes()),
            Meta::F64(x) => self.out.extend(x.to_le_bytes()),
            Meta::LyingStr { declared, bytes } => {
                self.len(*declared);
                self.out.extend(bytes);
            }
            Meta::LyingArray {
                elem_type,
                declared,
                bytes,
            } => {
                self.u32(*elem_type);
                self.len(*declared);
                self.out.extend(bytes);
            }
            Meta::Unknown { bytes, .. } => self.out.extend(bytes),
        }
    }
}

impl Gguf {
    /// The file's bytes, and where its data section starts.
    fn to_bytes(&self) -> (Vec<u8>, usize) {
        let mut w = GgufWriter {
            out: Vec::new(),
            v1: self.version == 1,
        };
        w.u32(self.magic);
        w.u32(self.version);
        w.len(self.tensor_count.unwrap_or(self.tensors.len() as u64));
        w.len(self.kv_count.unwrap_or(self.metadata.len() as u64));
        for (key, value) in &self.metadata {
            w.string(key.as_bytes());
            w.u32(value.type_id());
            w.value(value);
        }
        for t in &self.tensors {
            w.string(t.name.as_bytes());
            w.u32(t.dims.len() as u32);
            for d in &t.dims {
                w.len(*d);
            }
            w.u32(t.ggml_type);
            w.out.extend(t.offset.to_le_bytes());
        }
        let header = w.out.len().next_multiple_of(GGUF_ALIGNMENT);
        w.out.resize(header, 0);
        w.out.extend(&self.data);
        (w.out, header)
    }
}

const TINY_TOKENS: [&str; 8] = ["a", "b", "c", "ab", "abc", "Ġ", "<s>", "</s>"];

/// A valid GGUF of a one-layer Llama (hidden 8, 2 heads of 4, 1 KV head, MLP 16, vocabulary 8) with a GPT-2 BPE
/// tokenizer and a chat template, float32 weights.
fn tiny_gguf() -> Gguf {
    let strings = |v: &[&str]| Meta::Array(8, v.iter().map(|s| Meta::Str(s.to_string())).collect());
    let metadata: Vec<(&str, Meta)> = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.embedding_length", Meta::U32(8)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(16)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.context_length", Meta::U32(16)),
        ("llama.rope.dimension_count", Meta::U32(4)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&TINY_TOKENS)),
        ("tokenizer.ggml.merges", strings(&["a b", "ab c"])),
        (
            "tokenizer.ggml.token_type",
            Meta::Array(5, [1, 1, 1, 1, 1, 1, 3, 3].map(Meta::I32).to_vec()),
        ),
        ("tokenizer.ggml.bos_token_id", Meta::U32(6)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(7)),
        ("tokenizer.chat_template", Meta::Str(CHATML.into())),
    ];
    // GGUF lists dimensions innermost first: [in, out] for a weight of Hugging Face shape [out, in].
    let shapes: [(&str, &[u64]); 11] = [
        ("token_embd.weight", &[8, 8]),
        ("output_norm.weight", &[8]),
        ("blk.0.attn_norm.weight", &[8]),
        ("blk.0.ffn_norm.weight", &[8]),
        ("blk.0.attn_q.weight", &[8, 8]),
        ("blk.0.attn_k.weight", &[8, 4]),
        ("blk.0.attn_v.weight", &[8, 4]),
        ("blk.0.attn_output.weight", &[8, 8]),
        ("blk.0.ffn_gate.weight", &[8, 16]),
        ("blk.0.ffn_up.weight", &[8, 16]),
        ("blk.0.ffn_down.weight", &[16, 8]),
    ];
    let mut tensors = Vec::new();
    let mut data = Vec::new();
    for (name, dims) in shapes {
        let offset = data.len() as u64;
        for i in 0..dims.iter().product::<u64>() {
            let v = if dims.len() == 1 {
                1.0f32
            } else {
                ((i * 37 % 101) as f32 - 50.0) / 500.0
            };
            data.extend(v.to_le_bytes());
        }
        // Every tensor is a multiple of 8 floats, so each starts aligned.
        assert_eq!(data.len() % GGUF_ALIGNMENT, 0);
        tensors.push(GgufTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type: 0,
            offset,
        });
    }
    Gguf {
        magic: GGUF_MAGIC,
        version: 3,
        tensor_count: None,
        kv_count: None,
        metadata: metadata
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        tensors,
        data,
    }
}

const GGUF_KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "general.name",
    "llama.embedding_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.feed_forward_length",
    "llama.block_count",
    "llama.context_length",
    "llama.rope.dimension_count",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.vocab_size",
    "llama.expert_count",
    "llama.expert_used_count",
    "qwen3moe.expert_count",
    "qwen3moe.expert_used_count",
    "qwen3moe.expert_feed_forward_length",
    "qwen2.embedding_length",
    "qwen2.block_count",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unk_token_id",
    "tokenizer.ggml.pad_token_id",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.byte_fallback",
    "tokenizer.ggml.ignore_merges",
    "tokenizer.chat_template",
];

const GGUF_TENSOR_NAMES: &[&str] = &[
    "token_embd.weight",
    "output.weight",
    "output_norm.weight",
    "blk.0.attn_norm.weight",
    "blk.0.ffn_norm.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_v.weight",
    "blk.0.attn_output.weight",
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
    "blk.0.attn_q.bias",
];

fn meta_value() -> BoxedStrategy<Meta> {
    let small_u32 = prop_oneof![2 => 0u32..64, 1 => interesting_u64().prop_map(|x| x as u32)];
    let leaf = prop_oneof![
        1 => any::<u8>().prop_map(Meta::U8),
        1 => any::<i8>().prop_map(Meta::I8),
        1 => any::<u16>().prop_map(Meta::U16),
        1 => any::<i16>().prop_map(Meta::I16),
        3 => small_u32.prop_map(Meta::U32),
        1 => any::<i32>().prop_map(Meta::I32),
        2 => interesting_u64().prop_map(Meta::U64),
        1 => interesting_i64().prop_map(Meta::I64),
        1 => interesting_f64().prop_map(|x| Meta::F32(x as f32)),
        1 => interesting_f64().prop_map(Meta::F64),
        1 => prop_oneof![0u8..2, any::<u8>()].prop_map(Meta::Bool),
        3 => text().prop_map(Meta::Str),
        2 => (interesting_u64(), bytes(16)).prop_map(|(declared, bytes)| Meta::LyingStr { declared, bytes }),
        2 => (0u32..14, interesting_u64(), bytes(32))
            .prop_map(|(elem_type, declared, bytes)| Meta::LyingArray { elem_type, declared, bytes }),
        1 => (13u32..=u32::MAX, bytes(8)).prop_map(|(type_id, bytes)| Meta::Unknown { type_id, bytes }),
    ];
    leaf.prop_recursive(2, 24, 6, |inner| {
        prop_oneof![
            vec(text().prop_map(Meta::Str), 0..8).prop_map(|v| Meta::Array(8, v)),
            vec(any::<i32>().prop_map(Meta::I32), 0..8).prop_map(|v| Meta::Array(5, v)),
            (0u32..14, vec(inner, 0..5)).prop_map(|(t, v)| Meta::Array(t, v)),
        ]
    })
    .boxed()
}

/// Numbers of each integer type, as sizes, counts, ids and the alignment take.
fn numeric_meta() -> impl Strategy<Value = Meta> {
    prop_oneof![
        3 => interesting_u64().prop_map(|x| Meta::U32(x as u32)),
        2 => interesting_u64().prop_map(Meta::U64),
        1 => interesting_i64().prop_map(|x| Meta::I32(x as i32)),
        1 => interesting_i64().prop_map(Meta::I64),
        1 => (0u8..3).prop_map(Meta::U8),
        1 => interesting_f64().prop_map(|x| Meta::F32(x as f32)),
    ]
}

fn gguf_key() -> impl Strategy<Value = String> {
    prop_oneof![4 => select(GGUF_KEYS).prop_map(String::from), 1 => text()]
}

fn ggml_type() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => select(vec![0u32, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30]),
        1 => any::<u32>(),
    ]
}

fn gguf_dims() -> impl Strategy<Value = Vec<u64>> {
    vec(prop_oneof![3 => 0u64..20, 1 => interesting_u64()], 0..6)
}

/// One change to the tiny GGUF.
#[derive(Clone, Debug)]
enum GgufEdit {
    /// Sets (or adds) a metadata key, or removes it.
    Meta(String, Option<Meta>),
    TensorDims(Index, Vec<u64>),
    TensorType(Index, u32),
    TensorOffset(Index, u64),
    TensorName(Index, String),
    DropTensor(Index),
    Counts(Option<u64>, Option<u64>),
    Version(u32),
    TruncateData(Index),
}

fn gguf_edit() -> impl Strategy<Value = GgufEdit> {
    let count = || option::weighted(0.5, interesting_u64());
    prop_oneof![
        5 => (gguf_key(), option::weighted(0.85, meta_value())).prop_map(|(k, v)| GgufEdit::Meta(k, v)),
        4 => (gguf_key(), numeric_meta()).prop_map(|(k, v)| GgufEdit::Meta(k, Some(v))),
        1 => numeric_meta().prop_map(|v| GgufEdit::Meta("general.alignment".into(), Some(v))),
        2 => (any::<Index>(), gguf_dims()).prop_map(|(i, d)| GgufEdit::TensorDims(i, d)),
        2 => (any::<Index>(), ggml_type()).prop_map(|(i, t)| GgufEdit::TensorType(i, t)),
        1 => (any::<Index>(), interesting_u64()).prop_map(|(i, o)| GgufEdit::TensorOffset(i, o)),
        1 => (any::<Index>(), prop_oneof![select(GGUF_TENSOR_NAMES).prop_map(String::from), text()])
            .prop_map(|(i, n)| GgufEdit::TensorName(i, n)),
        1 => any::<Index>().prop_map(GgufEdit::DropTensor),
        1 => (count(), count()).prop_map(|(t, k)| GgufEdit::Counts(t, k)),
        1 => prop_oneof![select(vec![1u32, 2, 3]), any::<u32>()].prop_map(GgufEdit::Version),
        1 => any::<Index>().prop_map(GgufEdit::TruncateData),
    ]
}

fn edit_gguf(mut g: Gguf, edits: &[GgufEdit]) -> Gguf {
    for edit in edits {
        let n = g.tensors.len();
        let tensor = |i: &Index| (n > 0).then(|| i.index(n));
        match edit {
            GgufEdit::Meta(key, value) => {
                let at = g.metadata.iter().position(|(k, _)| k == key);
                match (at, value) {
                    (Some(i), Some(v)) => g.metadata[i].1 = v.clone(),
                    (None, Some(v)) => g.metadata.push((key.clone(), v.clone())),
                    (Some(i), None) => {
                        g.metadata.remove(i);
                    }
                    (None, None) => {}
                }
            }
            GgufEdit::TensorDims(i, dims) => {
                if let Some(i) = tensor(i) {
                    g.tensors[i].dims = dims.clone();
                }
            }
            GgufEdit::TensorType(i, t) => {
                if let Some(i) = tensor(i) {
                    g.tensors[i].ggml_type = *t;
                }
            }
            GgufEdit::TensorOffset(i, o) => {
                if let Some(i) = tensor(i) {
                    g.tensors[i].offset = *o;
                }
            }
            GgufEdit::TensorName(i, name) => {
                if let Some(i) = tensor(i) {
                    g.tensors[i].name = name.clone();
                }
            }
            GgufEdit::DropTensor(i) => {
                if let Some(i) = tensor(i) {
                    g.tensors.remove(i);
                }
            }
            GgufEdit::Counts(t, k) => {
                g.tensor_count = *t;
                g.kv_count = *k;
            }
            GgufEdit::Version(v) => g.version = *v,
            GgufEdit::TruncateData(i) => {
                if !g.data.is_empty() {
                    let len = i.index(g.data.len());
                    g.data.truncate(len);
                }
            }
        }
    }
    g
}

fn random_gguf() -> impl Strategy<Value = Gguf> {
    let magic = prop_oneof![8 => Just(GGUF_MAGIC), 1 => Just(0x4747_5546u32), 1 => any::<u32>()];
    let version = prop_oneof![1 => Just(1u32), 3 => Just(2), 3 => Just(3), 1 => any::<u32>()];
    let tensor = (
        prop_oneof![select(GGUF_TENSOR_NAMES).prop_map(String::from), text()],
        gguf_dims(),
        ggml_type(),
        prop_oneof![3 => (0u64..8).prop_map(|i| i * 32), 1 => interesting_u64()],
    )
        .prop_map(|(name, dims, ggml_type, offset)| GgufTensor {
            name,
            dims,
            ggml_type,
            offset,
        });
    (
        magic,
        version,
        option::weighted(0.2, interesting_u64()),
        option::weighted(0.2, interesting_u64()),
        vec((gguf_key(), meta_value()), 0..8),
        vec(tensor, 0..6),
        bytes(512),
    )
        .prop_map(
            |(magic, version, tensor_count, kv_count, metadata, tensors, data)| Gguf {
                magic,
                version,
                tensor_count,
                kv_count,
                metadata,
                tensors,
                data,
            },
        )
}

/// What the GGUF test feeds: the tiny GGUF edited, a random header, arbitrary bytes, or the tiny GGUF's bytes
/// mutated; and whether to quantize on load.
#[derive(Clone, Debug)]
enum GgufInput {
    Edited(Vec<GgufEdit>),
    Random(Gguf),
    Bytes(Vec<u8>),
    Mutated(Vec<ByteEdit>),
}

fn gguf_input() -> impl Strategy<Value = (GgufInput, bool)> {
    let input = prop_oneof![
        5 => vec(gguf_edit(), 1..5).prop_map(GgufInput::Edited),
        2 => random_gguf().prop_map(GgufInput::Random),
        1 => prop_oneof![
            bytes(256),
            bytes(64).prop_map(|b| [&b"GGUF\x03\0\0\0"[..], &b].concat()),
        ]
        .prop_map(GgufInput::Bytes),
        4 => byte_edits().prop_map(GgufInput::Mutated),
    ];
    (input, prop::bool::weighted(0.2))
}

/// Loads `bytes` as a `.gguf` the ways the crate does: the config alone, then the model with its tokenizer, which
/// then encodes, decodes and renders its chat template.
fn load_gguf(dir: &Path, bytes: &[u8], quantize: bool) -> candle_qlora::Result<()> {
    let path = dir.join("model.gguf");
    write(&path, bytes);
    let spec = path.to_str().unwrap();
    let config = load_model_config(spec, None);
    let options = LoadOptions {
        quantization: quantize.then(QuantConfig::nf4),
        ..Default::default()
    };
    let loaded = load_model(spec, None, &options)?;
    config?;
    let tokenizer = loaded.tokenizer()?;
    let ids = tokenizer.encode("abc ab <s>c xyz", true)?;
    tokenizer.decode(&ids, false)?;
    let _ = tokenizer.decode(&[0, 7, 8, 1000, u32::MAX], true);
    let message = ChatMessage {
        role: "user".into(),
        content: "ab".into(),
    };
    let _ = tokenizer.apply_chat_template(&[message], true);
    Ok(())
}

#[test]
fn gguf_loading_never_panics() {
    let tiny = tiny_gguf();
    let (tiny_bytes, tiny_header) = tiny.to_bytes();
    let dir = temp_dir();
    // The file the edits start from loads, so edited files reach every step of loading.
    load_gguf(dir.path(), &tiny_bytes, false).expect("the tiny GGUF loads");
    load_gguf(dir.path(), &tiny_bytes, true).expect("the tiny GGUF loads quantized");
    fuzz(GGUF_CASES, gguf_input(), |(input, quantize)| {
        let bytes = match input {
            GgufInput::Edited(edits) => edit_gguf(tiny.clone(), &edits).to_bytes().0,
            GgufInput::Random(g) => g.to_bytes().0,
            GgufInput::Bytes(b) => b,
            GgufInput::Mutated(edits) => apply_byte_edits(tiny_bytes.clone(), tiny_header, &edits),
        };
        let _ = load_gguf(dir.path(), &bytes, quantize);
        Ok(())
    });
}

// ------------------------------------------------------------------------------------------------------------------
// 2. safetensors.

/// A tensor entry of a safetensors header and its data.
#[derive(Clone)]
struct StTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    /// The data; with `fit`, resized (by repetition) to what dtype and shape need, when that is small.
    data: Vec<u8>,
    fit: bool,
    /// `data_offsets` to declare instead of the true ones.
    offsets: Option<(u64, u64)>,
}

/// Data that is text (a quant state's JSON) shows as text in a failing input.
impl std::fmt::Debug for StTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("StTensor");
        s.field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape);
        match std::str::from_utf8(&self.data) {
            Ok(text) if !text.is_empty() => s.field("data", &text),
            _ => s.field("data", &self.data),
        };
        s.field("fit", &self.fit)
            .field("offsets", &self.offsets)
            .finish()
    }
}

/// A safetensors file: 8-byte header length, JSON header, data.
#[derive(Clone, Debug)]
struct StFile {
    /// Header length to declare instead of the true one.
    length: Option<u64>,
    tensors: Vec<StTensor>,
    metadata: Option<Value>,
    /// A JSON value to write as the whole header instead.
    header: Option<Value>,
    /// Appended to the header text (safetensors pads it with spaces).
    padding: Vec<u8>,
    trailing: Vec<u8>,
}

fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" | "C64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "E8M0" => 1,
        _ => return None,
    })
}

impl StFile {
    fn to_bytes(&self) -> Vec<u8> {
        let mut data: Vec<u8> = Vec::new();
        let mut entries = Vec::new();
        for t in &self.tensors {
            let mut bytes = t.data.clone();
            if t.fit {
                let need = t
                    .shape
                    .iter()
                    .try_fold(1u64, |a, d| a.checked_mul(*d))
                    .zip(dtype_size(&t.dtype))
                    .and_then(|(n, s)| n.checked_mul(s))
                    .filter(|n| *n <= 1 << 16);
                if let Some(need) = need {
                    let source = if bytes.is_empty() { vec![0u8] } else { bytes };
                    bytes = source.iter().copied().cycle().take(need as usize).collect();
                }
            }
            let begin = data.len() as u64;
            data.extend(&bytes);
            let (begin, end) = t.offsets.unwrap_or((begin, data.len() as u64));
            entries.push(format!(
                "{}:{{\"dtype\":{},\"shape\":{},\"data_offsets\":[{begin},{end}]}}",
                Value::String(t.name.clone()),
                Value::String(t.dtype.clone()),
                json!(t.shape),
            ));
        }
        if let Some(m) = &self.metadata {
            entries.push(format!("\"__metadata__\":{m}"));
        }
        let mut header = match &self.header {
            Some(h) => h.to_string().into_bytes(),
            None => format!("{{{}}}", entries.join(",")).into_bytes(),
        };
        header.extend(&self.padding);
        let length = self.length.unwrap_or(header.len() as u64);
        let mut out = length.to_le_bytes().to_vec();
        out.extend(header);
        out.extend(data);
        out.extend(&self.trailing);
        out
    }
}

/// Linear weights of the tiny Llama, by which adapters and bitsandbytes entries are named.
const LINEAR_WEIGHTS: &[&str] = &[
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "w",
];

const ST_NAMES: &[&str] = &[
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.self_attn.q_proj.weight.absmax",
    "model.layers.0.self_attn.q_proj.weight.quant_map",
    "model.layers.0.self_attn.q_proj.weight.nested_absmax",
    "model.layers.0.self_attn.q_proj.weight.nested_quant_map",
    "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4",
    "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__fp4",
    "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__int8",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    "base_model.model.lm_head.weight",
    "__metadata__",
    "",
];

const ST_DTYPES: &[&str] = &[
    "F32", "F16", "BF16", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F64", "BOOL",
    "F8_E4M3", "F8_E5M2", "F4", "F6_E2M3", "E8M0", "C64", "f32", "", "XYZ",
];

fn st_tensor() -> impl Strategy<Value = StTensor> {
    let name = prop_oneof![4 => select(ST_NAMES).prop_map(String::from), 1 => text()];
    let dtype = prop_oneof![4 => select(ST_DTYPES).prop_map(String::from), 1 => text()];
    let shape = vec(
        prop_oneof![6 => 0u64..16, 1 => 16u64..300, 1 => interesting_u64()],
        0..4,
    );
    let offsets = option::weighted(
        0.15,
        (interesting_u64(), interesting_u64()).prop_map(|(a, b)| (a % 1024, b)),
    );
    (
        name,
        dtype,
        shape,
        bytes(64),
        prop::bool::weighted(0.85),
        offsets,
    )
        .prop_map(|(name, dtype, shape, data, fit, offsets)| StTensor {
            name,
            dtype,
            shape,
            data,
            fit,
            offsets,
        })
}

/// bitsandbytes' quant-state JSON, with random fields.
fn quant_state_json(kind: &'static str) -> impl Strategy<Value = Value> {
    let int = || {
        prop_oneof![
            6 => Just(json!(64)),
            3 => select(vec![256i64, 128, 32, 4096, 0, 7, -1, 1 << 40, i64::MAX]).prop_map(Value::from),
            1 => json_value(),
        ]
    };
    let dims = vec(
        prop_oneof![
            4 => (0u64..130).prop_map(Value::from),
            2 => select(vec![1u64 << 32, 1 << 33, 1 << 62, u64::MAX]).prop_map(Value::from),
            1 => interesting_u64().prop_map(Value::from),
            1 => Just(json!(-1)),
        ],
        0..4,
    )
    .prop_map(Value::Array);
    (
        prop_oneof![
            4 => Just(Value::from(kind)),
            1 => select(vec!["nf4", "fp4", "int8", ""]).prop_map(Value::from),
            1 => json_value(),
        ],
        int(),
        prop_oneof![
            6 => select(vec!["float32", "bfloat16", "float16"]).prop_map(Value::from),
            1 => select(vec!["int8", "torch.float32", ""]).prop_map(Value::from),
            1 => json_value(),
        ],
        prop_oneof![6 => dims, 1 => json_value()],
        option::of(int()),
        option::of(interesting_f64().prop_map(Value::from)),
        option::of(select(vec!["float32", "float16"]).prop_map(Value::from)),
    )
        .prop_map(
            |(qt, bs, dtype, shape, nested_bs, nested_offset, nested_dtype)| {
                let mut state =
                    json!({"quant_type": qt, "blocksize": bs, "dtype": dtype, "shape": shape});
                if let Some(v) = nested_bs {
                    state["nested_blocksize"] = v;
                }
                if let Some(v) = nested_offset {
                    state["nested_offset"] = v;
                }
                if let Some(v) = nested_dtype {
                    state["nested_dtype"] = v;
                }
                state
            },
        )
}

/// The entries of one bitsandbytes weight (`name`, `.absmax`, `.quant_map`, `.quant_state…`, nested state), each
/// with a plausible dtype and random size.
fn bnb_weight() -> impl Strategy<Value = Vec<StTensor>> {
    // Each entry with a plausible dtype, and usually the size bitsandbytes gives it for 64 elements.
    let part = |suffix: &'static str, dtypes: Vec<&'static str>, typical: u64| {
        let shape = prop_oneof![2 => Just(vec![typical]), 1 => vec(0u64..300, 1..3)];
        (select(dtypes), shape, bytes(16))
            .prop_map(move |(dtype, shape, data)| (suffix, dtype.to_string(), shape, data))
    };
    let kind = select(vec!["nf4", "fp4", "int8"]);
    (
        select(LINEAR_WEIGHTS),
        kind.prop_flat_map(|kind| (Just(kind), quant_state_json(kind))),
        part("", vec!["U8", "U8", "F32"], 32),
        part(".absmax", vec!["F32", "F32", "U8", "F16"], 1),
        part(".quant_map", vec!["F32", "F32", "F16"], 16),
        option::of(part(".nested_absmax", vec!["F32", "U8"], 1)),
        option::of(part(".nested_quant_map", vec!["F32", "F32", "F16"], 256)),
    )
        .prop_map(
            |(weight, (kind, state), packed, absmax, map, nested_absmax, nested_map)| {
                let state_bytes = state.to_string().into_bytes();
                let mut tensors = vec![StTensor {
                    name: format!("{weight}.quant_state.bitsandbytes__{kind}"),
                    dtype: "U8".into(),
                    shape: vec![state_bytes.len() as u64],
                    data: state_bytes,
                    fit: false,
                    offsets: None,
                }];
                let parts = [
                    Some(packed),
                    Some(absmax),
                    Some(map),
                    nested_absmax,
                    nested_map,
                ];
                for (suffix, dtype, shape, data) in parts.into_iter().flatten() {
                    tensors.push(StTensor {
                        name: format!("{weight}{suffix}"),
                        dtype,
                        shape,
                        data,
                        fit: true,
                        offsets: None,
                    });
                }
                tensors
            },
        )
}

fn st_file() -> impl Strategy<Value = StFile> {
    let tensors = prop_oneof![
        2 => vec(st_tensor(), 0..6),
        2 => bnb_weight(),
        1 => (bnb_weight(), vec(st_tensor(), 0..3)).prop_map(|(mut a, b)| {
            a.extend(b);
            a
        }),
    ];
    let metadata = option::weighted(
        0.3,
        prop_oneof![
            Just(json!({"format": "pt"})),
            vec((text(), text()), 0..3).prop_map(|kv| Value::Object(
                kv.into_iter().map(|(k, v)| (k, Value::String(v))).collect()
            )),
            json_value(),
        ],
    );
    (
        option::weighted(0.1, interesting_u64()),
        tensors,
        metadata,
        option::weighted(0.05, json_value()),
        prop_oneof![8 => Just(Vec::new()), 2 => Just(b"  ".to_vec()), 1 => bytes(4)],
        prop_oneof![4 => Just(Vec::new()), 1 => bytes(32)],
    )
        .prop_map(
            |(length, tensors, metadata, header, padding, trailing)| StFile {
                length,
                tensors,
                metadata,
                header,
                padding,
                trailing,
            },
        )
}

/// The real safetensors files the mutations start from.
struct StBases {
    /// (bytes, header length, adapter config to load it with if it is an adapter).
    files: Vec<(Vec<u8>, usize, Option<Vec<u8>>)>,
}

fn st_header_len(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

fn st_bases(scratch: &Path) -> StBases {
    let model = data_path("models/tiny-llama/model.safetensors");
    let bnb = scratch.join("bnb.safetensors");
    quantize_file(&model, &bnb, &QuantizeOptions::default()).expect("the tiny model quantizes");
    let mut files = Vec::new();
    for (path, adapter) in [
        (model, None),
        (bnb, None),
        (
            data_path("peft/lora_all_linear/adapter_model.safetensors"),
            Some("peft/lora_all_linear/adapter_config.json"),
        ),
        (
            data_path("peft/dora/adapter_model.safetensors"),
            Some("peft/dora/adapter_config.json"),
        ),
    ] {
        let bytes = std::fs::read(&path).unwrap();
        let header = st_header_len(&bytes);
        files.push((
            bytes,
            header,
            adapter.map(|a| std::fs::read(data_path(a)).unwrap()),
        ));
    }
    StBases { files }
}

#[derive(Clone, Debug)]
enum StInput {
    File(StFile),
    Bytes(Vec<u8>),
    /// Mutations of base file `usize` of [`StBases`].
    Mutated(usize, Vec<ByteEdit>),
}

fn st_input() -> impl Strategy<Value = StInput> {
    prop_oneof![
        4 => st_file().prop_map(StInput::File),
        1 => prop_oneof![
            bytes(128),
            (interesting_u64(), bytes(96)).prop_map(|(n, b)| [&n.to_le_bytes()[..], &b].concat()),
        ]
        .prop_map(StInput::Bytes),
        4 => (0usize..4, byte_edits()).prop_map(|(base, edits)| StInput::Mutated(base, edits)),
    ]
}

/// Reads `bytes` as a safetensors file every way the crate does: mapped (with its metadata, every tensor loaded),
/// as a bitsandbytes file, as a model folder's weights, and as an adapter's weights on `model`.
fn read_safetensors(dir: &Path, bytes: &[u8], adapter_config: &[u8], model: &LlamaModel) {
    let file = dir.join("model.safetensors");
    write(&file, bytes);
    if let Ok(mapped) = MappedSafetensors::open(&file) {
        let _ = mapped.metadata();
        if let Ok(st) = mapped.tensors() {
            for (_, view) in st.tensors() {
                let _ = view_to_f32(&view);
                let _ = view.load(&Device::Cpu);
            }
        }
    }
    let _ = read_bnb_file(&file);
    if !dir.join("config.json").exists() {
        std::fs::copy(
            data_path("models/tiny-llama/config.json"),
            dir.join("config.json"),
        )
        .unwrap();
    }
    let _ = load_model(dir.to_str().unwrap(), None, &LoadOptions::default());
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    write(&adapter.join("adapter_config.json"), adapter_config);
    write(&adapter.join("adapter_model.safetensors"), bytes);
    let _ = load_adapter(&mut model.clone(), &adapter, "fuzz");
}

#[test]
fn safetensors_reading_never_panics() {
    let scratch = temp_dir();
    let bases = st_bases(scratch.path());
    // One folder for every case (files overwritten): creating and removing folders costs more than a case.
    let work = temp_dir();
    let model = tiny_model();
    let lora_config = bases.files[2].2.clone().unwrap();
    // The unmutated bases load, so their mutations reach every step.
    for (bytes, _, adapter) in &bases.files {
        let dir = temp_dir();
        match adapter {
            Some(config) => {
                let adapter = dir.path();
                write(&adapter.join("adapter_config.json"), config);
                write(&adapter.join("adapter_model.safetensors"), bytes);
                load_adapter(&mut model.clone(), adapter, "fuzz").expect("the adapter loads");
            }
            None => {
                write(&dir.path().join("model.safetensors"), bytes);
                std::fs::copy(
                    data_path("models/tiny-llama/config.json"),
                    dir.path().join("config.json"),
                )
                .unwrap();
                load_model(dir.path().to_str().unwrap(), None, &LoadOptions::default())
                    .expect("the model loads");
            }
        }
    }
    fuzz(SAFETENSORS_CASES, st_input(), |input| {
        let (bytes, config) = match input {
            StInput::File(f) => (f.to_bytes(), &lora_config),
            StInput::Bytes(b) => (b, &lora_config),
            StInput::Mutated(base, edits) => {
                let (bytes, header, adapter) = &bases.files[base];
                (
                    apply_byte_edits(bytes.clone(), *header, &edits),
                    adapter.as_ref().unwrap_or(&lora_config),
                )
            }
        };
        read_safetensors(work.path(), &bytes, config, &model);
        Ok(())
    });
}

// ------------------------------------------------------------------------------------------------------------------
// 3. JSONL.

fn field_value() -> impl Strategy<Value = Value> {
    prop_oneof![6 => text().prop_map(Value::String), 1 => json_value()]
}

fn chat_turn(role_key: &'static str, content_key: &'static str) -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        6 => select(vec!["system", "user", "assistant", "human", "gpt", "model", "tool", ""]).prop_map(Value::from),
        1 => json_value(),
    ];
    (role, field_value(), prop::bool::weighted(0.95)).prop_map(
        move |(role, content, has_content)| {
            let mut turn = serde_json::Map::new();
            turn.insert(role_key.into(), role);
            if has_content {
                turn.insert(content_key.into(), content);
            }
            Value::Object(turn)
        },
    )
}

/// A record of one of the formats (or of one the crate does not read), with random-typed fields.
fn jsonl_record() -> impl Strategy<Value = Value> {
    prop_oneof![
        field_value().prop_map(|t| json!({ "text": t })),
        (field_value(), option::of(field_value()), field_value()).prop_map(|(i, input, o)| {
            let mut record = json!({"instruction": i, "output": o});
            if let Some(x) = input {
                record["input"] = x;
            }
            record
        }),
        vec(chat_turn("role", "content"), 0..5).prop_map(|m| json!({ "messages": m })),
        vec(chat_turn("from", "value"), 0..5).prop_map(|m| json!({ "conversations": m })),
        (field_value(), field_value()).prop_map(|(p, c)| json!({"prompt": p, "completion": c})),
        (option::of(field_value()), field_value(), field_value()).prop_map(|(p, c, r)| {
            let mut record = json!({"chosen": c, "rejected": r});
            if let Some(p) = p {
                record["prompt"] = p;
            }
            record
        }),
        (
            option::of(vec(chat_turn("role", "content"), 0..3)),
            vec(chat_turn("role", "content"), 0..3),
            vec(chat_turn("role", "content"), 0..3),
        )
            .prop_map(|(p, c, r)| {
                let mut record = json!({"chosen": c, "rejected": r});
                if let Some(p) = p {
                    record["prompt"] = json!(p);
                }
                record
            }),
    ]
}

/// Lines no generator above writes: bad escapes, truncation, deep nesting, out-of-range numbers, a BOM.
fn odd_lines() -> Vec<String> {
    vec![
        r#"{"text": "\ud800"}"#.into(),
        r#"{"text": "a""#.into(),
        "[".into(),
        r#"{"text": 1e400}"#.into(),
        format!("{}{}", "[".repeat(300), "]".repeat(300)),
        format!("{{\"text\": {}1{}}}", "[".repeat(100), "]".repeat(100)),
        r#"{"text":"a","text":"b"}"#.into(),
        "\u{feff}{\"text\": \"bom\"}".into(),
        r#"{"messages": []}"#.into(),
        r#"{"messages": [{"role": "assistant", "content": ""}]}"#.into(),
        r#"{"messages": [{"role": "user", "content": "t3"}, {"role": "assistant", "content": "t4"}]}"#.into(),
        "null".into(),
        "\"text\"".into(),
        "{}".into(),
        " \t ".into(),
        r#"{"text": "\u0000"}"#.into(),
        r#"{"instruction": "t5", "output": "t6", "input": null}"#.into(),
        r#"{"text": "t3 t4 t5"}"#.into(),
        r#"{"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": [{"role": "assistant", "content": "b"}]}"#.into(),
        r#"{"prompt": "p", "chosen": 5, "rejected": "r"}"#.into(),
    ]
}

fn jsonl_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => jsonl_record().prop_map(|v| v.to_string().into_bytes()),
        1 => json_value().prop_map(|v| v.to_string().into_bytes()),
        2 => select(odd_lines()).prop_map(String::into_bytes),
        1 => bytes(40),
    ]
}

fn jsonl_file() -> impl Strategy<Value = Vec<u8>> {
    (
        vec(jsonl_line(), 0..8),
        select(vec!["\n", "\r\n", "\n\n", "\r"]),
        any::<bool>(),
    )
        .prop_map(|(lines, sep, trailing)| {
            let mut out = lines.join(sep.as_bytes());
            if trailing {
                out.extend(sep.as_bytes());
            }
            out
        })
}

const FORMATS: [DataFormat; 6] = [
    DataFormat::Auto,
    DataFormat::Text,
    DataFormat::Alpaca,
    DataFormat::Messages,
    DataFormat::ShareGpt,
    DataFormat::Preference,
];

fn data_config() -> impl Strategy<Value = DataConfig> {
    (
        select(FORMATS.to_vec()),
        prop_oneof![0usize..40, Just(usize::MAX)],
        option::of(select(vec![0.0, 0.25, 0.5, 0.99, 1.0, -1.0, f64::NAN])),
        any::<[bool; 5]>(),
    )
        .prop_map(|(format, max_length, eval_split, flags)| DataConfig {
            format,
            max_length,
            eval_split,
            packing: flags[0],
            completion_only_loss: flags[1],
            assistant_only_loss: flags[2],
            skip_bad_lines: flags[3],
            ..Default::default()
        })
}

#[test]
fn jsonl_reading_never_panics() {
    let plain = tiny_tokenizer();
    let dir = temp_dir();
    let mut chat = plain.clone();
    chat.chat_template = Some(CHATML.into());
    fuzz(
        JSONL_CASES,
        (jsonl_file(), data_config(), any::<bool>()),
        |(file, mut config, with_template)| {
            let path = dir.path().join("data.jsonl");
            write(&path, &file);
            for format in FORMATS {
                let strict = read_jsonl(&path, format, false);
                let lenient = read_jsonl(&path, format, true);
                // A file read without skipping reads the same with skipping, and nothing is skipped.
                if let Ok((examples, report)) = strict {
                    prop_assert!(report.skipped.is_empty());
                    let (again, report) = lenient.expect("a file read strictly reads leniently");
                    prop_assert_eq!(examples, again);
                    prop_assert!(report.skipped.is_empty());
                }
            }
            config.train_file = Some(path);
            let tokenizer = if with_template { &chat } else { &plain };
            let _ = Dataset::train_and_eval(tokenizer, &config);
            for truncation in [TruncationMode::KeepStart, TruncationMode::KeepEnd] {
                let _ = PreferenceDataset::train_and_eval(tokenizer, &config, truncation);
            }
            Ok(())
        },
    );
}

// ------------------------------------------------------------------------------------------------------------------
// 4. TOML run configs.

/// A valid run config, which the edits start from.
const RECIPE: &str = r#"
[model]
name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
[model.quantization]
load_in_4bit = true
bnb_4bit_quant_type = "nf4"
bnb_4bit_use_double_quant = true
bnb_4bit_compute_dtype = "bfloat16"
[lora]
r = 16
lora_alpha = 32
lora_dropout = 0.05
target_modules = "all-linear"
task_type = "CAUSAL_LM"
[data]
train_file = "data/train.jsonl"
max_length = 512
[training]
output_dir = "runs/smollm2"
learning_rate = 2e-4
optim = "paged_adamw_8bit"
warmup_steps = 0.03
lr_scheduler_type = "cosine"
eval_strategy = "steps"
[callbacks]
early_stopping_patience = 3
"#;

const TRAINING_KEYS: &[&str] = &[
    "output_dir",
    "overwrite_output_dir",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "warmup_steps",
    "warmup_ratio",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "weight_decay",
    "max_grad_norm",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "logging_steps",
    "logging_first_step",
    "eval_strategy",
    "eval_steps",
    "eval_on_start",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "activation_memory_budget_mib",
    "tiled_mlp",
    "seed",
    "data_seed",
    "resume_from_checkpoint",
    "ignore_base_model_mismatch",
    "report_to",
    "neftune_noise_alpha",
    "group_by_length",
    "train_sampling_strategy",
    "dataloader_drop_last",
    "disable_tqdm",
    "metric_for_best_model",
    "greater_is_better",
    "load_best_model_at_end",
    "use_cpu",
    "max_consecutive_nonfinite_losses",
    "use_liger_kernel",
];

/// The sections of a run config with their keys (and a section that does not exist).
const SECTIONS: &[(&str, &[&str])] = &[
    (
        "model",
        &["name_or_path", "revision", "quantization", "adapter"],
    ),
    (
        "model.quantization",
        &[
            "load_in_4bit",
            "bnb_4bit_quant_type",
            "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype",
            "bnb_4bit_quant_storage",
            "bnb_4bit_blocksize",
        ],
    ),
    (
        "lora",
        &[
            "r",
            "lora_alpha",
            "lora_dropout",
            "target_modules",
            "exclude_modules",
            "bias",
            "use_rslora",
            "rank_pattern",
            "alpha_pattern",
            "init_lora_weights",
            "use_dora",
            "modules_to_save",
            "base_model_name_or_path",
            "revision",
            "task_type",
        ],
    ),
    (
        "data",
        &[
            "train_file",
            "eval_file",
            "eval_split",
            "format",
            "max_length",
            "packing",
            "completion_only_loss",
            "assistant_only_loss",
            "skip_bad_lines",
        ],
    ),
    ("training", TRAINING_KEYS),
    (
        "callbacks",
        &[
            "early_stopping_patience",
            "early_stopping_threshold",
            "memory_monitor",
            "memory_warn_fraction",
        ],
    ),
    (
        "dpo",
        &[
            "beta",
            "label_smoothing",
            "loss_type",
            "loss_weights",
            "rpo_alpha",
            "reference_free",
            "precompute_ref_log_probs",
            "precompute_ref_batch_size",
            "truncation_mode",
            "disable_dropout",
        ],
    ),
];

const SCHEDULER_KWARGS: &[&str] = &[
    "num_cycles",
    "lr_end",
    "power",
    "timescale",
    "min_lr",
    "min_lr_rate",
    "num_decay_steps",
    "num_stable_steps",
    "warmup_type",
    "decay_type",
    "min_lr_ratio",
];

const MODULE_NAMES: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
    "embed_tokens",
    "model.layers.0.self_attn.q_proj",
    "nothing",
];

/// The kind of value a key takes.
enum Kind {
    Float,
    Int,
    Bool,
    Choice(&'static [&'static str]),
    Modules,
    Table(&'static [&'static str]),
    Text,
}

fn kind_of(key: &str) -> Kind {
    match key {
        "learning_rate"
        | "num_train_epochs"
        | "warmup_steps"
        | "warmup_ratio"
        | "weight_decay"
        | "max_grad_norm"
        | "adam_beta1"
        | "adam_beta2"
        | "adam_epsilon"
        | "logging_steps"
        | "eval_steps"
        | "save_steps"
        | "activation_memory_budget_mib"
        | "neftune_noise_alpha"
        | "lora_alpha"
        | "lora_dropout"
        | "eval_split"
        | "early_stopping_threshold"
        | "memory_warn_fraction"
        | "beta"
        | "label_smoothing"
        | "rpo_alpha" => Kind::Float,
        "per_device_train_batch_size"
        | "per_device_eval_batch_size"
        | "gradient_accumulation_steps"
        | "max_steps"
        | "save_total_limit"
        | "seed"
        | "data_seed"
        | "max_consecutive_nonfinite_losses"
        | "r"
        | "max_length"
        | "bnb_4bit_blocksize"
        | "early_stopping_patience"
        | "precompute_ref_batch_size" => Kind::Int,
        "overwrite_output_dir"
        | "logging_first_step"
        | "bf16"
        | "fp16"
        | "gradient_checkpointing"
        | "activation_checkpointing"
        | "group_by_length"
        | "dataloader_drop_last"
        | "disable_tqdm"
        | "use_cpu"
        | "use_liger_kernel"
        | "tiled_mlp"
        | "ignore_base_model_mismatch"
        | "use_rslora"
        | "use_dora"
        | "packing"
        | "completion_only_loss"
        | "assistant_only_loss"
        | "skip_bad_lines"
        | "load_in_4bit"
        | "bnb_4bit_use_double_quant"
        | "memory_monitor"
        | "reference_free"
        | "precompute_ref_log_probs"
        | "disable_dropout"
        | "greater_is_better"
        | "load_best_model_at_end"
        | "eval_on_start" => Kind::Bool,
        "lr_scheduler_type" => Kind::Choice(&[
            "linear",
            "cosine",
            "cosine_with_restarts",
            "polynomial",
            "constant",
            "constant_with_warmup",
            "inverse_sqrt",
            "cosine_with_min_lr",
            "warmup_stable_decay",
            "reduce_lr_on_plateau",
        ]),
        "optim" => Kind::Choice(&[
            "adamw_torch",
            "adamw_torch_fused",
            "adamw_8bit",
            "paged_adamw_8bit",
            "paged_adamw_32bit",
            "sgd",
            "adafactor",
        ]),
        "eval_strategy" | "save_strategy" => Kind::Choice(&["no", "steps", "epoch", "best"]),
        "train_sampling_strategy" => {
            Kind::Choice(&["random", "sequential", "group_by_length", "x"])
        }
        "format" => Kind::Choice(&["auto", "text", "alpaca", "messages", "sharegpt", "chatml"]),
        "bnb_4bit_quant_type" => Kind::Choice(&["nf4", "fp4", "int4"]),
        "bnb_4bit_compute_dtype" => Kind::Choice(&[
            "float32", "bfloat16", "float16", "bf16", "fp16", "auto", "int8",
        ]),
        "report_to" => Kind::Choice(&["none", "wandb", "all", "tensorboard"]),
        "loss_type" => Kind::Choice(&["sigmoid", "ipo", "hinge", "robust", "sft", "exo_pair"]),
        "truncation_mode" => Kind::Choice(&["keep_start", "keep_end", "middle"]),
        "adapter" => Kind::Choice(&["/nonexistent/adapter", "adapter", ""]),
        "metric_for_best_model" => Kind::Choice(&["eval_loss", "loss", "accuracy"]),
        "resume_from_checkpoint" => {
            Kind::Choice(&["false", "true", "latest", "/nonexistent/checkpoint-1"])
        }
        "bias" => Kind::Choice(&["none", "all", "lora_only"]),
        "init_lora_weights" => Kind::Choice(&["gaussian", "pissa", "true"]),
        "task_type" => Kind::Choice(&["CAUSAL_LM", "SEQ_CLS"]),
        "target_modules" | "exclude_modules" | "modules_to_save" => Kind::Modules,
        "lr_scheduler_kwargs" => Kind::Table(SCHEDULER_KWARGS),
        "gradient_checkpointing_kwargs" | "activation_checkpointing_kwargs" => {
            Kind::Table(&["use_reentrant"])
        }
        "rank_pattern" | "alpha_pattern" => Kind::Table(&["q_proj", ".*", "(", "layers\\.0\\..*"]),
        "quantization" => Kind::Table(SECTIONS[1].1),
        _ => Kind::Text,
    }
}

fn toml_float() -> impl Strategy<Value = toml::Value> {
    interesting_f64().prop_map(toml::Value::Float)
}

fn toml_int() -> impl Strategy<Value = toml::Value> {
    interesting_i64().prop_map(toml::Value::Integer)
}

fn toml_string() -> impl Strategy<Value = toml::Value> {
    text().prop_map(toml::Value::String)
}

/// Any TOML value, nested a few levels.
fn toml_value() -> BoxedStrategy<toml::Value> {
    let datetime: toml::value::Datetime = "1979-05-27T07:32:00Z".parse().unwrap();
    let leaf = prop_oneof![
        toml_int(),
        toml_float(),
        any::<bool>().prop_map(toml::Value::Boolean),
        toml_string(),
        Just(toml::Value::Datetime(datetime)),
    ];
    leaf.prop_recursive(2, 16, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(toml::Value::Array),
            vec((json_key(), inner), 0..4)
                .prop_map(|kv| toml::Value::Table(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// A value for `key`: usually of the type it takes (with edge values), sometimes anything.
fn toml_for(key: &str) -> BoxedStrategy<toml::Value> {
    let typed = match kind_of(key) {
        Kind::Float => prop_oneof![4 => toml_float(), 1 => toml_int()].boxed(),
        Kind::Int => toml_int().boxed(),
        Kind::Bool => any::<bool>().prop_map(toml::Value::Boolean).boxed(),
        Kind::Choice(names) => select(names)
            .prop_map(|s| toml::Value::String(s.into()))
            .boxed(),
        Kind::Modules => prop_oneof![
            select(vec!["all-linear", ".*_proj", "(", "model\\.layers\\.0\\..*", ""])
                .prop_map(|s| toml::Value::String(s.into())),
            vec(select(MODULE_NAMES), 0..4).prop_map(|v| toml::Value::Array(
                v.into_iter().map(|s| toml::Value::String(s.into())).collect()
            )),
        ]
        .boxed(),
        Kind::Table(keys) => vec(
            (
                select(keys),
                prop_oneof![
                    3 => toml_float(),
                    2 => toml_int(),
                    1 => select(vec!["linear", "cosine", "1-sqrt", "x"]).prop_map(|s| toml::Value::String(s.into())),
                    1 => any::<bool>().prop_map(toml::Value::Boolean),
                ],
            ),
            0..4,
        )
        .prop_map(|kv| toml::Value::Table(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
        .boxed(),
        Kind::Text => prop_oneof![
            select(vec!["runs/x", "data/train.jsonl", "", "/", "main", "HuggingFaceTB/SmolLM2-135M"])
                .prop_map(|s| toml::Value::String(s.into())),
            toml_string(),
        ]
        .boxed(),
    };
    prop_oneof![5 => typed, 1 => toml_value()].boxed()
}

/// A section and key of a run config (usually real), with a value for it (`None` removes the key).
fn section_key_value() -> impl Strategy<Value = (&'static str, String, Option<toml::Value>)> {
    select(SECTIONS)
        .prop_flat_map(|(section, keys)| {
            let key = prop_oneof![12 => select(keys).prop_map(String::from), 1 => "[a-z_]{1,14}"];
            (Just(section), key)
        })
        .prop_flat_map(|(section, key)| {
            let value = option::weighted(0.9, toml_for(&key));
            (Just(section), Just(key), value)
        })
}

/// One change to the recipe.
#[derive(Clone, Debug)]
enum TomlEdit {
    Set(&'static str, String, Option<toml::Value>),
    /// Replaces (or adds) a whole section.
    Section(&'static str, toml::Value),
    RemoveSection(&'static str),
    /// Sets the schedule: `lr_scheduler_type`, `warmup_steps` and `lr_scheduler_kwargs` together (the kwargs
    /// matter only with their scheduler, which edits of one key at a time rarely pair).
    Schedule(toml::Value, toml::Value, toml::Value),
}

fn toml_edit() -> impl Strategy<Value = TomlEdit> {
    let section = || {
        prop_oneof![
            8 => select(SECTIONS).prop_map(|(s, _)| s),
            1 => Just("nonexistent"),
        ]
    };
    prop_oneof![
        10 => section_key_value().prop_map(|(s, k, v)| TomlEdit::Set(s, k, v)),
        1 => (section(), toml_value()).prop_map(|(s, v)| TomlEdit::Section(s, v)),
        1 => section().prop_map(TomlEdit::RemoveSection),
        3 => schedule_edit(),
    ]
}

/// Schedulers with the `lr_scheduler_kwargs` each takes.
const SCHEDULERS: &[(&str, &[&str])] = &[
    ("linear", &[]),
    ("constant_with_warmup", &[]),
    ("cosine", &["num_cycles"]),
    ("cosine_with_restarts", &["num_cycles"]),
    ("polynomial", &["lr_end", "power"]),
    ("inverse_sqrt", &["timescale"]),
    (
        "cosine_with_min_lr",
        &["num_cycles", "min_lr", "min_lr_rate"],
    ),
    (
        "warmup_stable_decay",
        &[
            "num_decay_steps",
            "num_stable_steps",
            "warmup_type",
            "decay_type",
            "min_lr_ratio",
            "num_cycles",
        ],
    ),
];

/// A scheduler with warmup and the kwargs it takes (random-valued), sometimes any kwargs.
fn schedule_edit() -> impl Strategy<Value = TomlEdit> {
    select(SCHEDULERS).prop_flat_map(|(kind, keys)| {
        let kwargs = if keys.is_empty() {
            toml_for("lr_scheduler_kwargs")
        } else {
            let value = prop_oneof![
                3 => toml_float(),
                2 => toml_int(),
                1 => select(vec!["linear", "cosine", "1-sqrt", "x"]).prop_map(|s| toml::Value::String(s.into())),
            ];
            let own = vec((select(keys), value), 0..4).prop_map(|kv| {
                toml::Value::Table(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            });
            prop_oneof![4 => own, 1 => toml_for("lr_scheduler_kwargs")].boxed()
        };
        (toml_for("warmup_steps"), kwargs).prop_map(move |(warmup, kwargs)| {
            TomlEdit::Schedule(toml::Value::String(kind.into()), warmup, kwargs)
        })
    })
}

/// The table at `section` (`a.b` nests), made a table if it is missing or something else.
fn section_table<'a>(root: &'a mut toml::Table, section: &str) -> &'a mut toml::Table {
    let mut table = root;
    for part in section.split('.') {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        if !entry.is_table() {
            *entry = toml::Value::Table(Default::default());
        }
        table = entry.as_table_mut().unwrap();
    }
    table
}

fn apply_toml_edits(root: &mut toml::Table, edits: &[TomlEdit]) {
    for edit in edits {
        match edit {
            TomlEdit::Set(section, key, value) => {
                let table = section_table(root, section);
                match value {
                    Some(v) => {
                        table.insert(key.clone(), v.clone());
                    }
                    None => {
                        table.remove(key);
                    }
                }
            }
            TomlEdit::Section(section, value) => match section.split_once('.') {
                Some((outer, inner)) => {
                    section_table(root, outer).insert(inner.into(), value.clone());
                }
                None => {
                    root.insert(section.to_string(), value.clone());
                }
            },
            TomlEdit::Schedule(kind, warmup, kwargs) => {
                let training = section_table(root, "training");
                training.insert("lr_scheduler_type".into(), kind.clone());
                training.insert("warmup_steps".into(), warmup.clone());
                training.insert("lr_scheduler_kwargs".into(), kwargs.clone());
            }
            TomlEdit::RemoveSection(section) => match section.split_once('.') {
                Some((outer, inner)) => {
                    section_table(root, outer).remove(inner);
                }
                None => {
                    root.remove(*section);
                }
            },
        }
    }
}

/// `value` as the inline TOML a `--set` takes.
fn inline_toml(value: &toml::Value) -> String {
    match value {
        toml::Value::Array(items) => format!(
            "[{}]",
            items.iter().map(inline_toml).collect::<Vec<_>>().join(", ")
        ),
        toml::Value::Table(t) => format!(
            "{{{}}}",
            t.iter()
                .map(|(k, v)| format!("{} = {}", toml::Value::String(k.clone()), inline_toml(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        scalar => scalar.to_string(),
    }
}

/// A `--set` argument: a real key with a value, or something malformed.
fn toml_override() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => section_key_value().prop_map(|(section, key, value)| {
            let value = value.map(|v| inline_toml(&v)).unwrap_or_default();
            format!("{section}.{key}={value}")
        }),
        2 => select(vec![
            "=", "a=b", ".=1", "training.=1", "training..x=1", "=training.seed", "lora.r.x=1", "training.seed=",
            "training.learning_rate=nan", "training.learning_rate=inf", "training.max_steps=9223372036854775807",
            "training.max_steps=-9223372036854775808", "data.max_length=-1", "x.y.z.w=[1,2",
            "training.lr_scheduler_kwargs={num_decay_steps=1e300}", "training.lr_scheduler_type=\"warmup_stable_decay\"",
            "training.warmup_steps=1e30", "training.lr_scheduler_kwargs={num_decay_steps=5, num_stable_steps=1e300}",
            "model.quantization=1", "model=1", "lora={}", "training.output_dir=\"\\u0000\"",
        ])
        .prop_map(String::from),
        1 => ".{0,30}",
    ]
}

/// What the trainer computes from `[training]` before the first step: step counts, warmup, intervals, and the
/// learning-rate schedule at the steps where its formulas change.
fn use_training_args(args: &TrainingArguments) {
    let _ = args.sampling();
    for batches in [0usize, 1, 7, 1000] {
        let total = args.total_steps(batches);
        let warmup = args.warmup_for(total);
        for value in [
            Some(args.logging_steps),
            Some(args.save_steps),
            args.eval_steps,
        ]
        .into_iter()
        .flatten()
        {
            let _ = TrainingArguments::interval(value, total);
        }
        let schedule = Schedule::new(
            args.lr_scheduler_type,
            args.learning_rate,
            warmup,
            total,
            args.lr_scheduler_kwargs.as_ref(),
        );
        if let Ok(schedule) = schedule {
            for step in [
                0,
                1,
                warmup.saturating_sub(1),
                warmup,
                warmup.saturating_add(1),
                total / 2,
                total.saturating_sub(1),
                total,
                total.saturating_add(1),
            ] {
                let _ = schedule.multiplier(step);
                let _ = schedule.lr_for_update(step);
            }
        }
    }
}

#[test]
fn run_config_parsing_never_panics() {
    let recipe: toml::Table = RECIPE.parse().unwrap();
    let dir = temp_dir();
    let path = dir.path().join("run.toml");
    write(&path, RECIPE);
    RunConfig::load(&path, &[]).expect("the recipe parses");
    fuzz(
        TOML_CASES,
        (
            vec(toml_edit(), 0..6),
            option::weighted(0.6, schedule_edit()),
            vec(toml_override(), 0..3),
            bytes(48),
            0u8..20,
        ),
        |(edits, schedule, overrides, garbage, how)| {
            let mut root = recipe.clone();
            apply_toml_edits(&mut root, &edits);
            apply_toml_edits(&mut root, schedule.as_slice());

            let text = match how {
                // Arbitrary bytes sometimes, and sometimes the text cut short.
                0 => garbage,
                1 => {
                    let t = toml::to_string(&root).unwrap_or_default();
                    t.as_bytes()[..t.len() / 2].to_vec()
                }
                _ => match toml::to_string(&root) {
                    Ok(t) => t.into_bytes(),
                    Err(_) => return Ok(()),
                },
            };
            write(&path, &text);
            if let Ok(config) = RunConfig::load(&path, &overrides) {
                let _ = config.quant_config();
                let _ = config.quant_compute_dtype();
                use_training_args(&config.training);
            }
            if let Ok(config) = RunConfig::from_table(&root, &path) {
                use_training_args(&config.training);
            }
            let training = root
                .get("training")
                .cloned()
                .unwrap_or(toml::Value::Table(Default::default()));
            if let Ok(args) = TrainingArguments::from_toml_value(&training, "run.toml") {
                use_training_args(&args);
            }
            Ok(())
        },
    );
}

// ------------------------------------------------------------------------------------------------------------------
// 5. adapter_config.json.

const LORA_KEYS: &[&str] = &[
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "exclude_modules",
    "bias",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "init_lora_weights",
    "use_dora",
    "modules_to_save",
    "base_model_name_or_path",
    "revision",
    "peft_type",
    "fan_in_fan_out",
    "lora_bias",
    "layers_to_transform",
    "layer_replication",
    "trainable_token_indices",
    "task_type",
    "inference_mode",
];

/// A JSON value for an `adapter_config.json` key: usually of its type (with edge values), sometimes anything.
fn lora_json_for(key: &'static str) -> BoxedStrategy<Value> {
    let int = || {
        prop_oneof![
            4 => select(vec![1i64, 2, 4, 8, 16, 64, 0, -1, 1 << 20, 1 << 40, i64::MAX]).prop_map(Value::from),
            1 => Just(json!(u64::MAX)),
            1 => Just(json!(1.5)),
            1 => Just(json!("8")),
        ]
    };
    let modules = || {
        prop_oneof![
            select(vec![
                "all-linear",
                ".*_proj",
                "(",
                "model\\.layers\\.0\\..*",
                "",
                "a{1000000}"
            ])
            .prop_map(Value::from),
            vec(
                prop_oneof![4 => select(MODULE_NAMES).prop_map(Value::from), 1 => json_value()],
                0..4
            )
            .prop_map(Value::Array),
        ]
    };
    let patterns = |value: BoxedStrategy<Value>| {
        vec(
            (
                select(vec![
                    "q_proj",
                    ".*",
                    "(",
                    "layers\\.0\\..*",
                    "model.layers.1.mlp.up_proj",
                ]),
                value,
            ),
            0..3,
        )
        .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
    };
    let typed: BoxedStrategy<Value> = match key {
        "r" => int().boxed(),
        "lora_alpha" | "lora_dropout" => prop_oneof![
            4 => interesting_f64().prop_map(Value::from),
            1 => int(),
        ]
        .boxed(),
        "target_modules" | "exclude_modules" | "modules_to_save" => modules().boxed(),
        "rank_pattern" => patterns(int().boxed()).boxed(),
        "alpha_pattern" => patterns(interesting_f64().prop_map(Value::from).boxed()).boxed(),
        "bias" => select(vec!["none", "all", "lora_only"])
            .prop_map(Value::from)
            .boxed(),
        "init_lora_weights" => prop_oneof![
            any::<bool>().prop_map(Value::from),
            select(vec!["gaussian", "pissa", "olora"]).prop_map(Value::from),
        ]
        .boxed(),
        "peft_type" => select(vec!["LORA", "LOHA", "PREFIX_TUNING"])
            .prop_map(Value::from)
            .boxed(),
        "use_rslora" | "use_dora" | "fan_in_fan_out" | "lora_bias" | "inference_mode" => {
            any::<bool>().prop_map(Value::from).boxed()
        }
        "layers_to_transform" | "layer_replication" | "trainable_token_indices" => prop_oneof![
            Just(Value::Null),
            Just(json!([0, 1])),
            Just(json!([[0, 1]])),
        ]
        .boxed(),
        _ => field_value().boxed(),
    };
    prop_oneof![5 => typed, 1 => json_value()].boxed()
}

#[derive(Clone, Debug)]
enum LoraInput {
    /// The real config with keys set (`None` removes them) or added.
    Edited(Vec<(String, Option<Value>)>),
    Json(Value),
    Bytes(Vec<u8>),
}

fn lora_input() -> impl Strategy<Value = LoraInput> {
    let edit = prop_oneof![
        6 => select(LORA_KEYS).prop_flat_map(|key| {
            (Just(key.to_string()), option::weighted(0.85, lora_json_for(key)))
        }),
        1 => (text(), option::of(json_value())),
    ];
    prop_oneof![
        8 => vec(edit, 1..5).prop_map(LoraInput::Edited),
        1 => json_value().prop_map(LoraInput::Json),
        1 => bytes(64).prop_map(LoraInput::Bytes),
    ]
}

#[test]
fn adapter_config_parsing_never_panics() {
    let base: Value = serde_json::from_slice(
        &std::fs::read(data_path("peft/lora_all_linear/adapter_config.json")).unwrap(),
    )
    .unwrap();
    let model = tiny_model();
    let dir = temp_dir();
    let path = dir.path().join("adapter_config.json");
    fuzz(LORA_CASES, lora_input(), |input| {
        let text = match input {
            LoraInput::Edited(edits) => {
                let mut v = base.clone();
                for (key, value) in edits {
                    let obj = v.as_object_mut().unwrap();
                    match value {
                        Some(value) => obj.insert(key, value),
                        None => obj.remove(&key),
                    };
                }
                v.to_string().into_bytes()
            }
            LoraInput::Json(v) => v.to_string().into_bytes(),
            LoraInput::Bytes(b) => b,
        };
        write(&path, &text);
        let from_file = LoraConfig::from_file(&path);
        if let Ok(value) = serde_json::from_slice::<Value>(&text) {
            let from_json = LoraConfig::from_json(&value, &path);
            prop_assert_eq!(from_json.is_ok(), from_file.is_ok());
        }
        let Ok(config) = from_file else {
            return Ok(());
        };
        // What the crate writes back, it reads.
        let written = config.to_json();
        let reread = LoraConfig::from_json(&written, &path);
        prop_assert!(
            reread.is_ok(),
            "{written} does not re-read: {:?}",
            reread.err()
        );
        // The adapter it describes, on the tiny model (with a small rank: a huge one is a size, not a parser, matter).
        if model.adapter_slots(&config).is_ok()
            && config.r <= 64
            && config.rank_pattern.values().all(|r| *r <= 64)
        {
            let _ = model.clone().add_adapter("fuzz", &config, 0);
        }
        Ok(())
    });
}

// ------------------------------------------------------------------------------------------------------------------
// 6. Chat templates.

#[test]
fn chat_template_rendering_never_panics() {
    let mut tokenizer = tiny_tokenizer();
    fuzz(
        CHAT_TEMPLATE_CASES,
        (
            select(TEMPLATES.to_vec()),
            template_edits(),
            chat_messages(),
            any::<bool>(),
            option::of(text()),
            option::of(text()),
        ),
        |(template, edits, messages, add_generation_prompt, bos, eos)| {
            let template = edit_template(template, &edits);
            let rendered = render_chat_template(
                &template,
                &messages,
                add_generation_prompt,
                bos.as_deref(),
                eos.as_deref(),
            );
            let mut tokenizer = tokenizer.clone();
            tokenizer.chat_template = Some(template);
            tokenizer.bos_token = bos;
            tokenizer.eos_token = eos;
            // The tokenizer renders as the function does.
            let applied = tokenizer.apply_chat_template(&messages, add_generation_prompt);
            prop_assert_eq!(rendered.is_ok(), applied.is_ok());
            if let (Ok(a), Ok(b)) = (&rendered, &applied) {
                prop_assert_eq!(a, b);
            }
            // Chat examples render every prefix of the conversation to find the assistant turns.
            let _ = Example::Chat(messages).tokenize(&tokenizer, 64, false);
            Ok(())
        },
    );
    tokenizer.chat_template = None;
    let message = ChatMessage {
        role: "user".into(),
        content: "t3".into(),
    };
    assert!(tokenizer.apply_chat_template(&[message], true).is_err());
}
