//! The layering of `src/` (../shared/DESIGN.md, issue #22), checked on the source text:
//! the modules under `src/` import each other without a cycle, and the routing core
//! (`routing/`, `prefix/`) stays plain Rust that imports neither the edges (`kv_events`,
//! `proxy`, `runtime`) nor the configuration, nor any network crate.
//!
//! An import is any `crate::NAME` path in code (comments and test-only code are left
//! out: a test may reach anywhere). Test-only code is a file named `tests.rs` and any
//! item marked `#[cfg(test)]`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module → the top-level modules its production code names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/routing/placement.rs` → `routing`).
fn top_module(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src/");
    let first = rel.components().next().expect("non-empty path");
    let name = first.as_os_str().to_string_lossy();
    name.strip_suffix(".rs").unwrap_or(&name).to_string()
}

/// The production code of a file: no comment lines, no item marked `#[cfg(test)]` (a
/// `mod x;` line, or everything up to the brace that closes the item).
fn production_code(text: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    let mut depth = 0i64;
    let mut opened = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        if !skipping && trimmed.starts_with("#[cfg(test)]") {
            (skipping, depth, opened) = (true, 0, false);
            continue;
        }
        if skipping {
            for c in trimmed.chars() {
                match c {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if (opened && depth <= 0) || (!opened && trimmed.ends_with(';')) {
                skipping = false;
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Every identifier following `crate::` in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        // `rolter_loadtest::crate::` cannot occur; `$crate::` (macros) names no module.
        if code[..i].ends_with('$') {
            continue;
        }
        let rest = &code[i + "crate::".len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end > 0 {
            names.insert(rest[..end].to_string());
        }
    }
    names
}

/// The import graph of `src/`, and each module's production code.
fn graph() -> (Graph, BTreeMap<String, String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut code: BTreeMap<String, String> = BTreeMap::new();
    for file in &files {
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("readable source");
        code.entry(top_module(&src, file))
            .or_default()
            .push_str(&production_code(&text));
    }
    let modules: BTreeSet<String> = code.keys().cloned().collect();
    let mut g = Graph::new();
    for (module, text) in &code {
        let uses = crate_paths(text)
            .into_iter()
            .filter(|m| m != module && modules.contains(m))
            .collect();
        g.insert(module.clone(), uses);
    }
    (g, code)
}

/// A cycle in `g`, if there is one (depth-first search with an on-stack colour).
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        node: &str,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        stack.push(node.to_string());
        for next in g.get(node).into_iter().flatten() {
            match state.get(next.as_str()).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|n| n == next).expect("on the stack");
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(g, next, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in g.keys() {
        if state.get(node.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(g, node, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn the_checker_sees_imports_and_cycles() {
    let code =
        "use crate::prefix::PrefixTrie;\n// crate::proxy in a comment\nlet x = crate::config::X;";
    let names = crate_paths(&production_code(code));
    assert_eq!(
        names,
        BTreeSet::from(["prefix".to_string(), "config".to_string()])
    );
    assert_eq!(
        production_code(
            "use crate::a;\n#[cfg(test)]\nmod tests {\n    use crate::b;\n}\nuse crate::c;\n#[cfg(test)]\nmod t;\n"
        ),
        "use crate::a;\nuse crate::c;\n"
    );
    let mut g = Graph::new();
    g.insert("a".into(), BTreeSet::from(["b".to_string()]));
    g.insert("b".into(), BTreeSet::from(["c".to_string()]));
    g.insert("c".into(), BTreeSet::new());
    assert_eq!(find_cycle(&g), None);
    g.get_mut("c").unwrap().insert("a".into());
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}

#[test]
fn src_modules_import_each_other_without_a_cycle() {
    let (g, _) = graph();
    assert!(g.len() > 10, "found the modules: {g:?}");
    for (module, uses) in &g {
        eprintln!(
            "{module} -> {}",
            uses.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    if let Some(cycle) = find_cycle(&g) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn the_routing_core_imports_no_edge_and_no_config() {
    let (g, code) = graph();
    for core in ["routing", "prefix"] {
        let uses = &g[core];
        for edge in [
            "kv_events",
            "config",
            "proxy",
            "runtime",
            "server",
            "lmcache_poll",
            "peering",
        ] {
            assert!(!uses.contains(edge), "{core}/ imports {edge}");
        }
        for io in ["pingora", "tokio", "zmq"] {
            let named = code[core]
                .lines()
                .any(|l| l.contains(&format!("{io}::")) || l.contains(&format!("use {io}")));
            assert!(!named, "{core}/ uses {io}");
        }
    }
}
