//! The module graph has one direction (ARCHITECTURE.md, "Layers"). This test reads the sources and fails on
//!
//! - an import that goes up or sideways in the table of top-level modules, or a top-level module missing from it
//!   (so the table stays the whole picture);
//! - the same inside the trainer, whose modules are layers of their own (`TRAINER_LAYERS`);
//! - any circle of imports between files anywhere in `src/`: every `crate::`, `$crate::`, `super::` and `self::`
//!   path, and a path through a child module (`child::item`, a `mod.rs` re-exporting it included), is an edge to
//!   the file that defines the module it names.

use std::collections::{BTreeMap, BTreeSet};
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
    &["optim", "data", "export"],
    &["memory"],
    &["distributed"],
    &["trainer"],
];

/// The trainer's modules by layer, bottom first, as `LAYERS` (`trainer/mod.rs`, the public face, is above them all:
/// nothing inside the trainer imports through its re-exports).
const TRAINER_LAYERS: &[&[&str]] = &[
    &["settings"],
    &["storage"],
    &["reporting"],
    &["window"],
    &["methods"],
    &["run"],
];

/// A module path, `[]` for the crate root (`ops/attention/cpu.rs` is `[ops, attention, cpu]`).
type ModulePath = Vec<String>;

/// The module path of a source file relative to `src/` (`ops/attention/mod.rs` → `[ops, attention]`).
fn module_path(rel: &Path) -> ModulePath {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] {
        parts.clear();
    }
    parts
}

/// The source with comments, string literals and character literals blanked out (spaces; line breaks kept): a doc
/// link or a message names a module without importing it, and a brace in a string is no block.
fn code(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let rest = &chars[i..];
        let starts = |s: &str| s.chars().enumerate().all(|(k, c)| rest.get(k) == Some(&c));
        let ident_before = i > 0 && is_ident(chars[i - 1]);
        // A byte literal's `b` (b'x', b"x") is no identifier before a quote.
        let byte_prefix = ident_before && chars[i - 1] == 'b' && (i < 2 || !is_ident(chars[i - 2]));
        // The end (exclusive) of a comment or literal starting at `i`, if one does.
        let end = if starts("//") {
            Some(
                rest.iter()
                    .position(|&c| c == '\n')
                    .map_or(chars.len(), |n| i + n),
            )
        } else if starts("/*") {
            let close = (i + 2..chars.len().saturating_sub(1))
                .find(|&k| chars[k] == '*' && chars[k + 1] == '/');
            Some(close.map_or(chars.len(), |k| k + 2))
        } else if !ident_before && (starts("r\"") || starts("r#")) {
            // A raw string: r"…" or r#"…"#, as many hashes to close as to open.
            let hashes = rest[1..].iter().take_while(|&&c| c == '#').count();
            let open = i + 1 + hashes;
            (chars.get(open) == Some(&'"')).then(|| {
                let closing: Vec<char> = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                (open + 1..chars.len())
                    .find(|&k| chars[k..].starts_with(&closing))
                    .map_or(chars.len(), |k| k + closing.len())
            })
        } else if starts("\"") {
            let mut k = i + 1;
            while k < chars.len() && chars[k] != '"' {
                k += if chars[k] == '\\' { 2 } else { 1 };
            }
            Some((k + 1).min(chars.len()))
        } else if starts("'") && (!ident_before || byte_prefix) {
            // A character literal ('x', '\n', '\'', '\u{7b}'), not a lifetime ('a).
            match rest.get(1) {
                Some('\\') => (i + 3..chars.len())
                    .find(|&k| chars[k] == '\'')
                    .map(|k| k + 1),
                Some(_) if rest.get(2) == Some(&'\'') => Some(i + 3),
                _ => None,
            }
        } else {
            None
        };
        match end {
            Some(end) => {
                out.extend(chars[i..end].iter().map(|&c| blank(c)));
                i = end;
            }
            None => {
                out.push(chars[i]);
                i += 1;
            }
        }
    }
    out
}

/// Whether `c` can be part of an identifier.
fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    &s[..s.find(|c: char| !is_ident(c)).unwrap_or(s.len())]
}

/// `s` without a leading `::` (and the whitespace around it), if it starts with one.
fn after_colons(s: &str) -> Option<&str> {
    s.trim_start().strip_prefix("::").map(str::trim_start)
}

/// The paths named by `tail`, what follows a path's first `::` (`a::b::C`, `a::{b, c::{d, e}}`, `*`), each as its
/// segments; `self` in a group (`{self, x}`) names the path before it.
fn expand(tail: &str) -> Vec<Vec<String>> {
    let mut segments = Vec::new();
    let mut rest = tail.trim_start();
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start, mut out) = (0, 0, Vec::new());
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth > 0 => depth -= 1,
                    ',' | '}' if depth == 0 => {
                        let item = group[start..k].trim();
                        if !item.is_empty() {
                            for p in expand(item) {
                                out.push([segments.clone(), p].concat());
                            }
                        }
                        start = k + 1;
                        if c == '}' {
                            break;
                        }
                    }
                    _ => {}
                }
            }
            return out;
        }
        let name = if rest.starts_with('*') {
            "*"
        } else {
            ident(rest)
        };
        if name.is_empty() {
            return vec![segments];
        }
        if name != "self" {
            segments.push(name.to_string());
        }
        match after_colons(&rest[name.len()..]) {
            Some(next) => rest = next,
            None => return vec![segments],
        }
    }
}

/// For each byte of `code`, how many inline modules (`mod tests { … }`) enclose it.
fn inline_depths(code: &str) -> Vec<usize> {
    let mut depths = vec![0; code.len() + 1];
    let bytes = code.as_bytes();
    let mut i = 0;
    while let Some(found) = code[i..].find("mod ") {
        let at = i + found;
        i = at + 4;
        if at > 0 && is_ident(bytes[at - 1] as char) {
            continue;
        }
        let name = ident(code[i..].trim_start());
        let after = code[i..].trim_start()[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue; // `mod x;`: a module in a file of its own
        }
        let open = code.len() - after.len();
        let mut depth = 0;
        for (k, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => continue,
            }
            if depth == 0 {
                for d in &mut depths[open..open + k] {
                    *d += 1;
                }
                break;
            }
        }
    }
    depths
}

/// The module paths a file of module `path` imports, each as the whole path it names (`[trainer, run, Trainer]`):
/// `crate::`, `$crate::`, `super::` and `self::` paths, and paths through `path`'s child modules (`child::item`;
/// `children` says which exist), grouped imports expanded. Paths inside an inline module (`mod tests`) that stay
/// in the file are left out.
fn imports(path: &[String], source: &str, children: &BTreeSet<String>) -> Vec<ModulePath> {
    let code = code(source);
    let depths = inline_depths(&code);
    let mut found = Vec::new();
    for (i, c) in code.char_indices() {
        let before = code[..i].chars().next_back();
        if !is_ident(c) || before.is_some_and(|b| is_ident(b) || b == ':') {
            continue; // not the start of a path
        }
        let inline = depths[i];
        let rest = &code[i..];
        let word = ident(rest);
        let Some(tail) = after_colons(&rest[word.len()..]) else {
            continue;
        };
        let base: ModulePath = match word {
            "crate" => vec![],
            "self" if inline == 0 => path.to_vec(),
            "super" => {
                let mut ups = 1;
                let mut tail = tail;
                while ident(tail) == "super" {
                    match after_colons(&tail[5..]) {
                        Some(next) => (tail, ups) = (next, ups + 1),
                        None => break,
                    }
                }
                // Out of the inline modules first; what is left climbs from the file's module.
                if ups <= inline || ups - inline > path.len() {
                    continue;
                }
                let base = path[..path.len() - (ups - inline)].to_vec();
                found.extend(expand(tail).into_iter().map(|p| [base.clone(), p].concat()));
                continue;
            }
            child if inline == 0 && children.contains(child) => {
                [path.to_vec(), vec![child.to_string()]].concat()
            }
            _ => continue,
        };
        found.extend(expand(tail).into_iter().map(|p| [base.clone(), p].concat()));
    }
    found
}

/// Every module path of `files` (`(path relative to src/, source)`), each with the names of its child modules.
fn module_tree(files: &[(PathBuf, String)]) -> BTreeMap<ModulePath, BTreeSet<String>> {
    let mut tree: BTreeMap<ModulePath, BTreeSet<String>> = BTreeMap::new();
    for (rel, _) in files {
        let path = module_path(rel);
        tree.entry(path.clone()).or_default();
        if let Some((name, parent)) = path.split_last() {
            tree.entry(parent.to_vec())
                .or_default()
                .insert(name.clone());
        }
    }
    tree
}

/// Each file of `files` (the command's `bin/` apart) with its module path and the paths it imports.
fn imports_by_file(files: &[(PathBuf, String)]) -> Vec<(&Path, ModulePath, Vec<ModulePath>)> {
    let tree = module_tree(files);
    files
        .iter()
        .filter(|(rel, _)| !rel.starts_with("bin"))
        .map(|(rel, source)| {
            let path = module_path(rel);
            let found = imports(&path, source, &tree[&path]);
            (rel.as_path(), path, found)
        })
        .collect()
}

/// Every import in `files` between the modules directly under `scope` (`[]`: the top-level modules) that goes up or
/// sideways in `layers`, or names a module the table lacks, as a readable line. Files directly in `scope`'s own
/// folder (the crate root, `trainer/mod.rs`) sit above its modules and are not checked.
fn layer_violations(
    files: &[(PathBuf, String)],
    scope: &[&str],
    layers: &[&[&str]],
) -> Vec<String> {
    let layer = |name: &str| layers.iter().position(|l| l.contains(&name));
    let inside =
        |path: &[String]| path.len() > scope.len() && path.iter().zip(scope).all(|(a, b)| a == b);
    let named = match scope.join("::") {
        s if s.is_empty() => String::new(),
        s => format!(" of `{s}`"),
    };
    let mut out = Vec::new();
    for (rel, path, found) in imports_by_file(files) {
        if !inside(&path) {
            continue;
        }
        let own = &path[scope.len()];
        let Some(own_layer) = layer(own) else {
            out.push(format!(
                "{}: module `{own}` is not in the layer table{named}",
                rel.display()
            ));
            continue;
        };
        let mut seen = BTreeSet::new();
        for import in found.iter().filter(|p| inside(p)) {
            // The crate root re-exports `error`'s `Error` and `Result`.
            let m = match import[scope.len()].as_str() {
                "Error" | "Result" if scope.is_empty() => "error",
                m => m,
            };
            if m == own || !seen.insert(m) {
                continue;
            }
            match layer(m) {
                None => out.push(format!(
                    "{}: imports `{m}`, which is not in the layer table{named}",
                    rel.display()
                )),
                Some(l) if l >= own_layer => out.push(format!(
                    "{}: `{own}` (layer {own_layer}) imports `{m}` (layer {l})",
                    rel.display()
                )),
                Some(_) => {}
            }
        }
    }
    out
}

/// [`layer_violations`] of the top-level modules.
fn violations(files: &[(PathBuf, String)]) -> Vec<String> {
    layer_violations(files, &[], LAYERS)
}

/// The graph of imports between the files of `files`: each file (by its path relative to `src/`) with the files
/// it imports from. A path resolves to the file of the longest module it starts with; a path into the crate root
/// resolves through the root's re-exports (`crate::Result` is `error`'s), the root itself being no node.
fn file_graph(files: &[(PathBuf, String)]) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let by_file = imports_by_file(files);
    let file_of: BTreeMap<&ModulePath, &Path> =
        by_file.iter().map(|(rel, p, _)| (p, *rel)).collect();
    // The root's `pub use` re-exports, by the name they export.
    let root_exports: BTreeMap<String, ModulePath> = by_file
        .iter()
        .filter(|(_, path, _)| path.is_empty())
        .flat_map(|(_, _, found)| found.iter())
        .filter_map(|p| Some((p.last()?.clone(), p.clone())))
        .collect();
    let longest = |path: &[String]| {
        (1..=path.len())
            .rev()
            .find_map(|n| file_of.get(&path[..n].to_vec()).copied())
    };
    let resolve = |import: &ModulePath| -> Option<&Path> {
        longest(import).or_else(|| longest(root_exports.get(import.first()?)?))
    };
    by_file
        .iter()
        .filter(|(_, path, _)| !path.is_empty())
        .map(|(rel, _, found)| {
            let targets = found
                .iter()
                .filter_map(resolve)
                .filter(|t| t != rel)
                .map(Path::to_path_buf)
                .collect();
            (rel.to_path_buf(), targets)
        })
        .collect()
}

/// The circles of imports in `graph`: for each set of files that import each other (a strongly connected set),
/// one circle through it — its files in order, the first again at the end — and the set's other files.
fn circles(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<(Vec<PathBuf>, Vec<PathBuf>)> {
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        graph: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a Path, usize>,
        low: BTreeMap<&'a Path, usize>,
        stack: Vec<&'a Path>,
        sets: Vec<Vec<&'a Path>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a Path) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_path();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    self.low.insert(v, self.low[v].min(self.low[w]));
                } else if self.stack.contains(&w) {
                    self.low.insert(v, self.low[v].min(self.index[w]));
                }
            }
            if self.low[v] == self.index[v] {
                let at = self.stack.iter().rposition(|&x| x == v).unwrap_or(0);
                let set = self.stack.split_off(at);
                if set.len() > 1 {
                    self.sets.push(set);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        sets: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_path()) {
            walk.visit(v);
        }
    }
    // One circle through each set: the shortest way from its first file back to it, inside the set.
    walk.sets
        .into_iter()
        .map(|mut set| {
            set.sort();
            let start = set[0];
            let mut came_from: BTreeMap<&Path, &Path> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start]);
            let mut last = start;
            'search: while let Some(v) = queue.pop_front() {
                for w in graph.get(v).into_iter().flatten() {
                    let w = w.as_path();
                    if w == start {
                        last = v;
                        break 'search;
                    }
                    if set.contains(&w) && !came_from.contains_key(w) {
                        came_from.insert(w, v);
                        queue.push_back(w);
                    }
                }
            }
            // Back from the file before `start` to the first after it.
            let mut between = Vec::new();
            let mut v = last;
            while v != start {
                between.push(v.to_path_buf());
                v = came_from[v];
            }
            between.reverse();
            let mut circle = vec![start.to_path_buf()];
            circle.extend(between);
            circle.push(start.to_path_buf());
            let others = set
                .iter()
                .filter(|f| !circle.iter().any(|c| c == **f))
                .map(|f| f.to_path_buf())
                .collect();
            (circle, others)
        })
        .collect()
}

/// The circles of `files` as readable lines: `a.rs → b.rs → a.rs`, and the other files of the same knot.
fn circle_lines(files: &[(PathBuf, String)]) -> Vec<String> {
    let names = |files: &[PathBuf]| -> Vec<String> {
        files.iter().map(|p| p.display().to_string()).collect()
    };
    circles(&file_graph(files))
        .iter()
        .map(|(circle, others)| match others.is_empty() {
            true => names(circle).join(" → "),
            false => format!(
                "{} (in one knot with {})",
                names(circle).join(" → "),
                names(others).join(", ")
            ),
        })
        .collect()
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

/// The sources of `src/`.
fn crate_sources() -> Vec<(PathBuf, String)> {
    let src = crate::common::repo_root().join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    assert!(files.len() > 50, "read {} files", files.len());
    files
}

/// `(path, text)` of a source file in a test.
fn file(path: &str, text: &str) -> (PathBuf, String) {
    (PathBuf::from(path), text.to_string())
}

#[test]
fn no_module_imports_a_higher_one() {
    let found = violations(&crate_sources());
    assert!(found.is_empty(), "back-edges:\n{}", found.join("\n"));
}

#[test]
fn the_trainers_layers_import_downward() {
    let found = layer_violations(&crate_sources(), &["trainer"], TRAINER_LAYERS);
    assert!(
        found.is_empty(),
        "back-edges in the trainer:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_files_import_each_other_in_a_circle() {
    let found = circle_lines(&crate_sources());
    assert!(
        found.is_empty(),
        "circles of imports:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_catches_back_edges_in_every_form() {
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

#[test]
fn the_trainer_check_catches_back_edges_and_imports_through_its_face() {
    let bad = [
        file(
            "trainer/settings/args.rs",
            "use crate::trainer::storage::checkpoint::TRAINER_STATE;",
        ),
        file("trainer/storage/state.rs", "use crate::trainer::Trainer;"),
        file(
            "trainer/methods/dpo/mod.rs",
            "fn f() -> &'static str { crate::trainer::run::trainer::ADAPTER }",
        ),
        file(
            "trainer/reporting/progress.rs",
            "use super::super::window::shard::Shard;",
        ),
        file(
            "trainer/window/shard.rs",
            "use crate::trainer::{settings::args::X, methods::Y};",
        ),
        file("trainer/extra/mod.rs", "use crate::error::Result;"),
    ];
    let found = layer_violations(&bad, &["trainer"], TRAINER_LAYERS);
    assert_eq!(found.len(), bad.len(), "{found:#?}");
    let fine = [
        file(
            "trainer/mod.rs",
            "pub use run::trainer::Trainer; pub mod run;",
        ),
        file(
            "trainer/run/step.rs",
            "use crate::trainer::{methods::method::Method, settings::args::TrainingArguments};",
        ),
        file(
            "trainer/methods/dpo/mod.rs",
            "use super::method::Method; use crate::trainer::window::shard::Shard;",
        ),
        file("trainer/storage/checkpoint.rs", "use crate::data::Dataset;"),
        file("memory/oom.rs", "use crate::error::Result;"),
    ];
    assert_eq!(
        layer_violations(&fine, &["trainer"], TRAINER_LAYERS),
        Vec::<String>::new()
    );
}

#[test]
fn the_circle_check_follows_every_kind_of_path() {
    let circle = |files: &[(PathBuf, String)]| circle_lines(files);
    // A `mod.rs` re-exporting a child that imports the parent's item.
    let reexport = [
        file("t/mod.rs", "mod a;\npub use a::A;\npub struct B;"),
        file("t/a.rs", "pub struct A(super::B);"),
    ];
    assert_eq!(circle(&reexport), ["t/a.rs → t/mod.rs → t/a.rs"]);
    // Nested groups, `super::super::`, `self::`, and `$crate::` in a macro.
    let kinds = [
        file("p/a.rs", "use crate::{q::{b::B, c}, error::Result};"),
        file("q/b.rs", "pub fn f() { self::g(); super::super::r::h() }"),
        file("r/mod.rs", "mod s;\npub fn h() { self::s::k() }"),
        file("r/s.rs", "macro_rules! m { () => { $crate::p::a::A }; }"),
        file("q/mod.rs", "pub mod b;"),
        file("error.rs", "pub enum Error {}"),
    ];
    assert_eq!(
        circle(&kinds),
        ["p/a.rs → q/b.rs → r/mod.rs → r/s.rs → p/a.rs"]
    );
    // Two circles are both named: the crate root's re-export resolves to its module, a path in code through a child
    // module is an edge, and so is `super::*`.
    let two = [
        file(
            "lib.rs",
            "mod error; mod x; pub use error::{Error, Result};",
        ),
        file("error.rs", "use crate::x::X; pub enum Error {}"),
        file("x.rs", "pub fn f() -> crate::Result<()> { Ok(()) }"),
        file("y/mod.rs", "mod z;\nfn f() { z::g() }"),
        file("y/z.rs", "use super::*;"),
    ];
    assert_eq!(
        circle(&two),
        ["error.rs → x.rs → error.rs", "y/mod.rs → y/z.rs → y/mod.rs"]
    );
    // No circle: a test module's `super::*` stays in its file, words in comments and strings import nothing, and
    // a chain runs one way.
    let fine = [
        file(
            "t/mod.rs",
            "mod a;\npub use a::A;\n/// Unlike [`super::x`], see crate::t::a.\npub fn f() {}",
        ),
        file(
            "t/a.rs",
            "pub struct A;\n#[cfg(test)]\nmod tests {\n    use super::*;\n    const S: &str = \"crate::t::f {\";\n    \
             fn g() { let _ = ('{', '\\'', b'{'); }\n}",
        ),
        file("u.rs", "use crate::t::A; use crate::v::{self, w::W};"),
        file("v/mod.rs", "pub mod w;"),
        file("v/w.rs", "pub struct W; fn f<'a>(x: &'a str) -> &'a str { x }"),
    ];
    assert_eq!(circle(&fine), Vec::<String>::new());
}
