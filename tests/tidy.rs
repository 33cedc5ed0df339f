//! The layering of `src/`, checked on the real tree (after rust-analyzer's `xtask/src/tidy.rs`,
//! which keeps such rules as tests): every top-level module has a layer ([`LAYERS`]), and the
//! production code of a module names (`crate::x`, `use crate::{x::..}`, `super::`...`::x`
//! reaching the crate root, `$crate::x`) only modules of lower layers; a few modules may not
//! name some lower modules or symbols either ([`FORBIDDEN_MODULES`], [`FORBIDDEN_SYMBOLS`]);
//! and the top-level modules have no import cycle. Comments, doc comments, string and char
//! literals and `#[cfg(test)] mod ... { }` blocks are not read. The binary-only modules
//! ([`BINARY_ONLY`]) may import anything. Violations that are known and being fixed are in
//! [`ALLOWED`], which can only shrink: an entry that no longer occurs fails the test.
//!
//! `a_planted_upward_import_is_reported` is the proof that the checker sees a violation: it
//! adds `use crate::planner::Cluster;` to an in-memory copy of `src/dtype/mod.rs`.
//!
//! std only; reads the ~140 files of `src/` in about 0.1 s.

#[path = "tidy/tokens.rs"]
mod tokens;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tokens::{Tok, Token, is_ident, is_punct, skip_group, tokens, without_test_modules};

/// The top-level modules of `src/`, bottom to top: `(layer, module)`. Production code of a
/// module may name only modules of a lower layer. Modules listed here may be absent.
const LAYERS: &[(usize, &str)] = &[
    // The crate's error enum and `Result` alias.
    (0, "error"),
    // Numeric comparisons of two result vectors (NMSE, max-abs), used by every checker above.
    (0, "metrics"),
    // Element types, ggml block layouts, reference (de)quantizers.
    (1, "dtype"),
    // `Layout`: shapes and byte strides.
    (2, "tensor"),
    // The typed op enum.
    (3, "op"),
    // File formats: GGUF, safetensors, JSON configs.
    (4, "io"),
    // Tokenizers and chat templates.
    (5, "tokenizer"),
    // BufferType/Buffer traits, storage, byte ranges, the backend-neutral host buffer (below
    // graph: a graph binds its tensors to `Storage`).
    (6, "buffer"),
    // The graph arena and its checked builders.
    (7, "graph"),
    // Registry/Device/Backend/GraphPlan/Event traits and the Communicator traits.
    (8, "backend"),
    // The graph allocator.
    (9, "alloc"),
    // Split states, their per-op rules and view derivation.
    (10, "split_state"),
    // One worker thread per device with bounded waiting.
    (11, "workers"),
    // Communicator implementations (in-process host memory, MPI) and their rank-order sums.
    (12, "collectives"),
    // The CPU backend.
    (13, "cpu"),
    // The CUDA backend.
    (14, "cuda"),
    // The meta device and its backend (sharding, rewrite).
    (15, "meta"),
    // The multi-backend scheduler.
    (16, "sched"),
    // Ranks as processes (MPI).
    (17, "dist"),
    // The built-in registries and device strings: the only place that names every backend.
    (18, "devices"),
    // Architectures, graph builders, loaders, split callbacks.
    (19, "models"),
    // The sharding planner's cost model and search (no backend).
    (20, "planner"),
    // Opening models on device sets (tensor, layer, hybrid).
    (21, "runtime"),
    // Checking one run against another.
    (22, "verify"),
    // The measuring half of calibration.
    (23, "calibrate"),
];

/// The `metashard` binary's modules (feature `cli`): not part of the library, may import
/// anything (and nothing in the library may import them).
const BINARY_ONLY: &[&str] = &["cli", "bench", "main"];

/// Lower modules a module may still not name: `(module, forbidden modules, why)`.
const FORBIDDEN_MODULES: &[(&str, &[&str], &str)] = &[
    (
        "meta",
        &["cpu", "cuda"],
        "the meta device works through the device traits",
    ),
    ("sched", &["cpu", "cuda"], "the scheduler names no backend"),
    (
        "models",
        &["cpu", "cuda", "devices", "dist", "sched"],
        "models build graphs and split callbacks; opening them on devices is runtime's",
    ),
    (
        "planner",
        &["cpu", "cuda", "collectives", "devices", "dist"],
        "the planner is a cost model: it runs no backend (measuring is calibrate's)",
    ),
];

/// Symbols a module may not name: `(module, symbol, why)`. A symbol is a token sequence
/// (`Sched::new`, `cpu::`), matched whole-word in code.
const FORBIDDEN_SYMBOLS: &[(&str, &str, &str)] = &[
    (
        "models",
        "MetaDevice",
        "models never build a meta device (runtime does)",
    ),
    (
        "models",
        "Sched",
        "models never build a scheduler (runtime does)",
    ),
    (
        "models",
        "DeviceSet",
        "models do not open device sets (runtime does)",
    ),
    ("planner", "CpuBackend", "the planner runs no backend"),
    ("planner", "cpu::", "the planner names no backend"),
];

/// Known violations, each being fixed: `(file, module or symbol it names)`. Every entry must
/// still occur (so the list only shrinks).
const ALLOWED: &[(&str, &str)] = &[];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().find(|(_, m)| *m == module).map(|(l, _)| *l)
}

// ---- the tree ----------------------------------------------------------------------------

/// One source file: its path (`src/...`, with `/`) and text.
struct File {
    path: String,
    text: String,
}

/// Every `.rs` file under `src/`, sorted.
fn read_tree(root: &Path) -> Vec<File> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for e in entries {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut paths = Vec::new();
    walk(&root.join("src"), &mut paths);
    paths.sort();
    paths
        .into_iter()
        .map(|p| File {
            text: std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
            path: p
                .strip_prefix(root)
                .expect("under the root")
                .to_string_lossy()
                .replace('\\', "/"),
        })
        .collect()
}

/// The top-level module of `src/x.rs` or `src/x/...` (`lib` for `src/lib.rs`), and how many
/// `super`s reach the crate root from it.
fn module_of(path: &str) -> (String, usize) {
    let rest = path.strip_prefix("src/").unwrap_or(path);
    let parts: Vec<&str> = rest.split('/').collect();
    let top = parts[0].trim_end_matches(".rs").to_string();
    let last = parts[parts.len() - 1];
    let depth = if last == "mod.rs" {
        parts.len() - 1
    } else {
        parts.len()
    };
    (top, depth)
}

/// What the crate root offers besides modules: `pub use x::{A, B}` re-exports and exported
/// macros, each mapped to the top-level module it comes from.
fn root_names(files: &[File]) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for f in files {
        let toks = tokens(&f.text);
        let (module, _) = module_of(&f.path);
        for (i, t) in toks.iter().enumerate() {
            if module == "lib"
                && i > 0
                && is_ident(Some(t), "use")
                && is_ident(toks.get(i - 1), "pub")
            {
                let Some((Tok::Ident(src), _)) = toks.get(i + 1) else {
                    continue;
                };
                let mut k = i + 2;
                while k < toks.len() && !is_punct(toks.get(k), ';') {
                    if let (Tok::Ident(name), _) = &toks[k]
                        && !is_ident(toks.get(k + 1), "as")
                        && matches!(toks.get(k + 1), Some((Tok::Punct(',' | '}' | ';'), _)))
                    {
                        names.insert(name.clone(), src.clone());
                    }
                    k += 1;
                }
            }
            if is_ident(Some(t), "macro_export") {
                let mut k = i;
                while k < toks.len() && !is_ident(toks.get(k), "macro_rules") {
                    k += 1;
                }
                if let Some((Tok::Ident(name), _)) = toks.get(k + 2) {
                    names.insert(name.clone(), module.clone());
                }
            }
        }
    }
    names
}

/// A name of a top-level module (or a crate-root item of one) in a file's code.
#[derive(Clone, Debug)]
struct Reference {
    line: usize,
    /// The top-level module named.
    module: String,
    /// The path as written, shortened (`crate::cpu::CpuBufferType`).
    text: String,
}

/// Every reference of `toks` (from a file `depth` modules below the root) to the crate root.
fn references(toks: &[Token], depth: usize, root: &BTreeMap<String, String>) -> Vec<Reference> {
    let mut out = Vec::new();
    let resolve = |name: &str| -> Option<String> {
        if layer_of(name).is_some() || BINARY_ONLY.contains(&name) {
            Some(name.to_string())
        } else {
            root.get(name).cloned()
        }
    };
    let mut push = |line: usize, name: &str, text: String, strict: bool| match resolve(name) {
        Some(module) => out.push(Reference { line, module, text }),
        // An unknown name after `crate::` is reported as a module missing from the table.
        None if strict && name != "self" => out.push(Reference {
            line,
            module: name.to_string(),
            text,
        }),
        None => {}
    };
    let mut i = 0;
    while i < toks.len() {
        // `crate::`, `$crate::`, or `super::` repeated `depth` times.
        let (start, prefix, strict) = if is_ident(toks.get(i), "crate") {
            (i + 1, "crate".to_string(), true)
        } else if depth > 0 && (0..depth).all(|k| is_ident(toks.get(i + 2 * k), "super")) {
            let supers = (0..depth).map(|_| "super").collect::<Vec<_>>().join("::");
            (i + 2 * depth - 1, supers, false)
        } else {
            i += 1;
            continue;
        };
        if toks.get(start).map(|t| &t.0) != Some(&Tok::Path) {
            i += 1;
            continue;
        }
        let line = toks[i].1;
        match toks.get(start + 1) {
            Some((Tok::Ident(name), _)) => {
                let mut text = format!("{prefix}::{name}");
                if toks.get(start + 2).map(|t| &t.0) == Some(&Tok::Path)
                    && let Some((Tok::Ident(next), _)) = toks.get(start + 3)
                {
                    text = format!("{text}::{next}");
                }
                push(line, name, text, strict);
            }
            Some((Tok::Punct('{'), _)) => {
                // A group: the first name of each element at depth 1.
                let end = skip_group(toks, start + 1);
                let mut depth_in = 0;
                let mut expect = true;
                for (t, l) in &toks[start + 1..end] {
                    match t {
                        Tok::Punct('{') => {
                            depth_in += 1;
                            if depth_in > 1 {
                                expect = false;
                            }
                        }
                        Tok::Punct('}') => depth_in -= 1,
                        Tok::Punct(',') if depth_in == 1 => expect = true,
                        Tok::Ident(name) if depth_in == 1 && expect => {
                            push(*l, name, format!("{prefix}::{{{name}, ..}}"), strict);
                            expect = false;
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        i = start + 1;
    }
    out
}

/// Where a token sequence (a symbol such as `Sched::new` or `cpu::`) occurs: the lines.
fn symbol_lines(toks: &[Token], symbol: &str) -> Vec<usize> {
    let want: Vec<Tok> = tokens(symbol).into_iter().map(|t| t.0).collect();
    if want.is_empty() || want.len() > toks.len() {
        return Vec::new();
    }
    toks.windows(want.len())
        .filter(|w| w.iter().map(|t| &t.0).eq(want.iter()))
        .map(|w| w[0].1)
        .collect()
}

// ---- the checker -------------------------------------------------------------------------

/// A rule broken at one place.
#[derive(Clone, Debug)]
struct Violation {
    file: String,
    line: usize,
    /// The module or symbol named (what [`ALLOWED`] lists).
    target: String,
    message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.message)
    }
}

/// The edges of the module graph, each with every place (file, line) that makes it.
type Edges = BTreeMap<(String, String), Vec<(String, usize)>>;

/// What the checker found in a tree: every violation (allowed or not) and the module graph.
struct Report {
    violations: Vec<Violation>,
    edges: Edges,
}

/// Check `files` (every `.rs` of `src/`) against the layer table and the rules.
fn check(files: &[File]) -> Report {
    let root = root_names(files);
    let mut violations = Vec::new();
    let mut edges = Edges::new();
    for f in files {
        let (module, depth) = module_of(&f.path);
        if module == "lib" || BINARY_ONLY.contains(&module.as_str()) {
            continue;
        }
        let mut v = |line: usize, target: &str, message: String| {
            violations.push(Violation {
                file: f.path.clone(),
                line,
                target: target.to_string(),
                message,
            })
        };
        let Some(layer) = layer_of(&module) else {
            v(
                1,
                &module,
                format!("module `{module}` is not in the layer table (tests/tidy.rs LAYERS)"),
            );
            continue;
        };
        let toks = without_test_modules(tokens(&f.text));
        for r in references(&toks, depth, &root) {
            if r.module == module {
                continue;
            }
            edges
                .entry((module.clone(), r.module.clone()))
                .or_default()
                .push((f.path.clone(), r.line));
            let target = &r.module;
            match layer_of(target) {
                None if BINARY_ONLY.contains(&target.as_str()) => v(
                    r.line,
                    target,
                    format!(
                        "{module} (layer {layer}) imports the binary-only module {target} \
                         (`{}`): the library cannot",
                        r.text
                    ),
                ),
                None => v(
                    r.line,
                    target,
                    format!(
                        "{module} (layer {layer}) names `{}`: {target} is not a module in the \
                         layer table (tests/tidy.rs LAYERS)",
                        r.text
                    ),
                ),
                Some(l) if l >= layer => v(
                    r.line,
                    target,
                    format!(
                        "{module} (layer {layer}) imports {target} (layer {l}) through `{}`: a \
                         module may import only modules of lower layers (tests/tidy.rs LAYERS)",
                        r.text
                    ),
                ),
                Some(_) => {
                    for (m, banned, why) in FORBIDDEN_MODULES {
                        if *m == module && banned.contains(&target.as_str()) {
                            v(
                                r.line,
                                target,
                                format!(
                                    "{module} imports {target} through `{}`, which it must not: \
                                     {why}",
                                    r.text
                                ),
                            );
                        }
                    }
                }
            }
        }
        for (m, symbol, why) in FORBIDDEN_SYMBOLS {
            if *m == module {
                for line in symbol_lines(&toks, symbol) {
                    v(
                        line,
                        symbol,
                        format!("{module} names `{symbol}`, which it must not: {why}"),
                    );
                }
            }
        }
    }
    Report { violations, edges }
}

/// The violations [`ALLOWED`] does not list, then one error per allowed entry that no longer
/// occurs.
fn unallowed(report: &Report, allowed: &[(&str, &str)]) -> Vec<String> {
    let is_allowed = |v: &Violation| allowed.iter().any(|(f, t)| v.file == *f && v.target == *t);
    let mut errors: Vec<String> = report
        .violations
        .iter()
        .filter(|v| !is_allowed(v))
        .map(|v| v.to_string())
        .collect();
    for (f, t) in allowed {
        if !report
            .violations
            .iter()
            .any(|v| v.file == *f && v.target == *t)
        {
            errors.push(format!(
                "{f}: the allowed violation `{t}` no longer occurs: remove it from ALLOWED in \
                 tests/tidy.rs"
            ));
        }
    }
    errors
}

/// Cycles among the top-level modules, over the edges not made only by allowed violations;
/// each as `a -> b (file:line) -> ... -> a`.
fn cycles(report: &Report, allowed: &[(&str, &str)]) -> Vec<String> {
    // An edge stays if some place that makes it is not allowed.
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for ((from, to), places) in &report.edges {
        if places
            .iter()
            .any(|(file, _)| !allowed.contains(&(file.as_str(), to.as_str())))
        {
            graph.entry(from).or_default().insert(to);
        }
    }
    // For each edge a -> b, the shortest path from b back to a (breadth-first) closes the
    // shortest cycle through that edge; each cycle is reported once (by its set of modules).
    let mut found: Vec<Vec<&str>> = Vec::new();
    let mut seen: BTreeSet<Vec<&str>> = BTreeSet::new();
    for (&a, outs) in &graph {
        for &b in outs {
            let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([b]);
            while let Some(m) = queue.pop_front() {
                if m == a {
                    break;
                }
                for &next in graph.get(m).into_iter().flatten() {
                    if next != b && !prev.contains_key(next) {
                        prev.insert(next, m);
                        queue.push_back(next);
                    }
                }
            }
            if !prev.contains_key(a) {
                continue;
            }
            // b -> ... -> a, read back from a.
            let mut back = vec![a];
            let mut m = a;
            while m != b {
                m = prev[m];
                back.push(m);
            }
            let mut cycle = vec![a];
            cycle.extend(back.into_iter().rev());
            let mut key = cycle[1..].to_vec();
            key.sort_unstable();
            if seen.insert(key) {
                found.push(cycle);
            }
        }
    }
    found.sort_by_key(|c| c.len());
    found
        .into_iter()
        .map(|cycle| {
            let mut s = cycle[0].to_string();
            for w in cycle.windows(2) {
                let places = &report.edges[&(w[0].to_string(), w[1].to_string())];
                let (file, line) = places
                    .iter()
                    .find(|(f, _)| !allowed.contains(&(f.as_str(), w[1])))
                    .unwrap_or(&places[0]);
                s.push_str(&format!(" -> {} ({file}:{line})", w[1]));
            }
            s
        })
        .collect()
}

fn tree() -> Vec<File> {
    read_tree(Path::new(env!("CARGO_MANIFEST_DIR")))
}

// ---- the tests ---------------------------------------------------------------------------

#[test]
fn layers_hold() {
    let t = std::time::Instant::now();
    let files = tree();
    let report = check(&files);
    let mut errors = unallowed(&report, ALLOWED);
    errors.extend(
        cycles(&report, ALLOWED)
            .into_iter()
            .map(|c| format!("import cycle among top-level modules: {c}")),
    );
    assert!(
        errors.is_empty(),
        "tidy: {} layering error(s):\n{}",
        errors.len(),
        errors.join("\n")
    );
    assert!(files.len() > 50, "read only {} files", files.len());
    // About 0.05 s in release on the 2-core test machine.
    println!("checked {} files in {:?}", files.len(), t.elapsed());
}

#[test]
fn every_module_of_the_crate_is_in_the_table() {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs"))
        .expect("src/lib.rs");
    let toks = tokens(&lib);
    for (i, t) in toks.iter().enumerate() {
        if is_ident(Some(t), "mod")
            && let Some((Tok::Ident(name), _)) = toks.get(i + 1)
        {
            assert!(
                layer_of(name).is_some(),
                "src/lib.rs declares `mod {name}`, which has no layer in tests/tidy.rs LAYERS"
            );
        }
    }
}

#[test]
fn a_planted_upward_import_is_reported() {
    let mut files = tree();
    let dtype = files
        .iter_mut()
        .find(|f| f.path == "src/dtype/mod.rs")
        .expect("src/dtype/mod.rs");
    let line = dtype.text.lines().count() + 1;
    dtype.text.push_str("use crate::planner::Cluster;\n");
    let report = check(&files);
    let errors = unallowed(&report, ALLOWED);
    let planted: Vec<&String> = errors
        .iter()
        .filter(|e| e.starts_with(&format!("src/dtype/mod.rs:{line}: ")))
        .collect();
    assert_eq!(planted.len(), 1, "{errors:#?}");
    println!("{}", planted[0]);
    assert!(planted[0].contains("dtype (layer 1) imports planner (layer 20)"));
    // The planted edge closes a cycle with the planner's own imports of dtype.
    let cycles = cycles(&report, ALLOWED);
    let through: Vec<&String> = cycles
        .iter()
        .filter(|c| c.contains(&format!("planner (src/dtype/mod.rs:{line})")))
        .collect();
    assert!(!through.is_empty(), "{cycles:#?}");
    println!("import cycle among top-level modules: {}", through[0]);
}

#[test]
fn an_allowed_violation_that_no_longer_occurs_fails() {
    let report = check(&tree());
    let errors = unallowed(&report, &[("src/dtype/mod.rs", "cuda")]);
    assert!(
        errors.iter().any(|e| e
            == "src/dtype/mod.rs: the allowed violation `cuda` no longer occurs: remove it from \
                ALLOWED in tests/tidy.rs"),
        "{errors:#?}"
    );
    // An allowed edge is left out of the cycle check; the same edge not allowed is a cycle.
    let mut files = tree();
    let dtype = files
        .iter_mut()
        .find(|f| f.path == "src/dtype/mod.rs")
        .expect("src/dtype/mod.rs");
    dtype
        .text
        .push_str("fn f() -> crate::planner::Cluster { todo!() }\n");
    let report = check(&files);
    let mut allowed = ALLOWED.to_vec();
    assert!(
        cycles(&report, &allowed)
            .iter()
            .any(|c| c.starts_with("dtype -> planner"))
    );
    allowed.push(("src/dtype/mod.rs", "planner"));
    assert!(cycles(&report, &allowed).is_empty());
    assert!(unallowed(&report, &allowed).is_empty());
}

#[test]
fn the_reader_skips_comments_strings_and_test_modules() {
    let src = r##"//! crate::models in a doc comment
/* crate::cpu /* nested */ crate::cuda */
const S: &str = "crate::devices";
const R: &str = r#"crate::dist "quoted""#;
const C: char = '"';
fn f<'a>(x: &'a str) -> &'a str { x }
use crate::{graph::Graph, tensor::{self, Layout}};
use crate::op::Op;
#[cfg(test)]
mod tests {
    use crate::verify::nmse;
}
fn g() { crate::bail!("no") }
"##;
    let toks = without_test_modules(tokens(src));
    let mut root = BTreeMap::new();
    root.insert("bail".to_string(), "error".to_string());
    let refs: Vec<(usize, String)> = references(&toks, 1, &root)
        .into_iter()
        .map(|r| (r.line, r.module))
        .collect();
    let want = [(7, "graph"), (7, "tensor"), (8, "op"), (13, "error")];
    assert_eq!(
        refs,
        want.map(|(l, m)| (l, m.to_string())).to_vec(),
        "{toks:?}"
    );
    // `super::super` from a file two modules deep reaches the crate root.
    let toks = tokens("use super::super::meta::MetaDevice;\nuse super::Sibling;");
    let refs = references(&toks, 2, &root);
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].module, "meta");
    // Symbols match whole tokens.
    let toks = tokens("let s = Sched::new(); let t: SchedBufferType; cpu::x(); mycpu::y();");
    assert_eq!(symbol_lines(&toks, "Sched").len(), 1);
    assert_eq!(symbol_lines(&toks, "cpu::").len(), 1);
}
