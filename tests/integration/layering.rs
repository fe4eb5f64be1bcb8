//! The module graph has one direction: every module of `src/` imports only from modules below it (ARCHITECTURE.md,
//! "Layers"). This test reads the sources and fails on an import that goes up or sideways, and on a top-level module
//! missing from the table (so the table stays the whole picture).

use std::path::{Path, PathBuf};

/// Top-level modules by layer, bottom first. A module may import from lower layers only (and from itself).
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["names", "rng"],
    &["cuda", "files", "plot"],
    &["precision", "profile", "quant"],
    &["ops"],
    &["lora"],
    &["models"],
    &["loading"],
    &["adapter"],
    &["optim", "data"],
    &["memory"],
    &["distributed"],
    &["trainer"],
];

/// The layer of top-level module `name`.
fn layer(name: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&name))
}

/// The module path of a source file relative to `src/` (`ops/attention/cpu.rs` → `[ops, attention, cpu]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The source without `//` comments (doc links name modules without importing them).
fn code(source: &str) -> String {
    source
        .lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The top-level modules a file at `path` (module path) names through `crate::`, `$crate::` or `super::` chains
/// that reach the crate root, including grouped imports (`crate::{a::x, b}`).
fn imported_modules(path: &[String], source: &str) -> Vec<String> {
    let code = code(source);
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let root_tail = if !boundary {
            None
        } else if let Some(tail) = rest.strip_prefix("crate::") {
            Some(tail)
        } else if rest.starts_with("super::") {
            // `super::` n times from `path` (a file's own module is the last element).
            let mut tail = rest;
            let mut ups = 0;
            while let Some(t) = tail.strip_prefix("super::") {
                tail = t;
                ups += 1;
            }
            (ups >= path.len()).then_some(tail)
        } else {
            None
        };
        if let Some(tail) = root_tail {
            let tail = tail.trim_start();
            if let Some(group) = tail.strip_prefix('{') {
                // Top-level names in the group: those at brace depth 0.
                let mut depth = 0;
                let mut start = true;
                for (k, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => start = true,
                        c if start && !c.is_whitespace() => {
                            found.push(ident(&group[k..]).to_string());
                            start = false;
                        }
                        _ => {}
                    }
                }
            } else {
                found.push(ident(tail).to_string());
            }
        }
        i += rest.chars().next().map_or(1, char::len_utf8);
    }
    found.retain(|m| !m.is_empty() && m != "self");
    // The crate root re-exports `error`'s `Error` and `Result`.
    for m in &mut found {
        if m == "Error" || m == "Result" {
            *m = "error".into();
        }
    }
    found
}

/// Every import in `files` (`(path relative to src/, source)`) that goes up or sideways, or names a module the
/// table lacks, as a readable line.
fn violations(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (rel, source) in files {
        let path = module_path(rel);
        let Some(top) = path.first() else { continue };
        if top == "bin" || top == "lib" {
            continue; // the command sits above the library, and the crate root re-exports it
        }
        let Some(own) = layer(top) else {
            out.push(format!(
                "{}: module `{top}` is not in the layer table",
                rel.display()
            ));
            continue;
        };
        for m in imported_modules(&path, source) {
            if m == *top {
                continue;
            }
            match layer(&m) {
                None => out.push(format!(
                    "{}: imports `{m}`, which is not in the layer table",
                    rel.display()
                )),
                Some(l) if l >= own => out.push(format!(
                    "{}: `{top}` (layer {own}) imports `{m}` (layer {l})",
                    rel.display()
                )),
                Some(_) => {}
            }
        }
    }
    out
}

/// Every `.rs` file under `dir`, with its path relative to `root`.
fn sources(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            sources(root, &p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            out.push((p.strip_prefix(root).unwrap().to_path_buf(), text));
        }
    }
}

#[test]
fn no_module_imports_a_higher_one() {
    let src = crate::common::repo_root().join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    assert!(files.len() > 50, "read {} files", files.len());
    let found = violations(&files);
    assert!(found.is_empty(), "back-edges:\n{}", found.join("\n"));
}

#[test]
fn the_check_catches_back_edges_in_every_form() {
    let file = |path: &str, text: &str| (PathBuf::from(path), text.to_string());
    let bad = [
        file("quant/tensor.rs", "use crate::trainer::Trainer;"),
        file(
            "ops/rope.rs",
            "use crate::{error::Result, lora::LoraLinear};",
        ),
        file(
            "ops/attention/cpu.rs",
            "use super::super::super::models::X;",
        ),
        file(
            "memory/oom.rs",
            "fn f(a: &crate::trainer::TrainingArguments) {}",
        ),
        file("optim/mod.rs", "use crate::data::Dataset;"),
        file("newthing.rs", "use crate::error::Result;"),
    ];
    let found = violations(&bad);
    assert_eq!(found.len(), bad.len(), "{found:#?}");
    let fine = [
        file(
            "trainer/run.rs",
            "use crate::{adapter::Adapters, data::{Dataset, collate}};",
        ),
        file(
            "ops/attention/cpu.rs",
            "use super::super::cpu::gemm; use crate::ops::cpu::CpuFloat;",
        ),
        file(
            "quant/mod.rs",
            "// see crate::trainer::Trainer\nuse crate::error::Result;",
        ),
        file(
            "models/llama.rs",
            "fn f() -> crate::Result<()> { Err(crate::Error::Model(String::new())) }",
        ),
    ];
    assert_eq!(violations(&fine), Vec::<String>::new());
}
