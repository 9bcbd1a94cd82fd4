//! The module graph of every crate has one direction: no two sibling modules use each other,
//! directly or around a loop (issue 32). A module may use its ancestors (`super::`) and its own
//! children; between siblings, one is below the other. A loop means neither can be read, changed
//! or moved without the other, which is how `image` once re-entered its store seven times on one
//! import.
//!
//! What counts as a use: a `crate::…` or `super::…` path in a module's code (comment lines and
//! its `#[cfg(test)] mod tests` left out, as are `tests.rs` files: tests may reach anywhere).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

/// The module path of a source file under `src` (`store/mod.rs` → `store`, `lib.rs` → root).
fn mod_path(src: &Path, file: &Path) -> ModPath {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: ModPath = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Every path the code of `module` names through `crate::` or `super::`, resolved to a path
/// from the crate root (a group `crate::{a, b::c}` gives each member).
fn uses(module: &[String], code: &str) -> Vec<ModPath> {
    let mut out = Vec::new();
    for line in code.lines() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find(['c', 's']) {
            let tail = &rest[at..];
            let boundary = rest[..at]
                .chars()
                .next_back()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
            let base = if !boundary {
                None
            } else if let Some(t) = tail.strip_prefix("crate::") {
                Some((Vec::<String>::new(), t))
            } else if let Some(mut t) = tail.strip_prefix("super::") {
                let mut base = module[..module.len().saturating_sub(1)].to_vec();
                while let Some(next) = t.strip_prefix("super::") {
                    base.pop();
                    t = next;
                }
                Some((base, t))
            } else {
                None
            };
            let Some((base, path)) = base else {
                rest = &tail[1..];
                continue;
            };
            let end = path
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(path.len());
            let idents = |p: &str| -> ModPath {
                p.trim()
                    .split("::")
                    .take_while(|s| is_ident(s))
                    .map(String::from)
                    .collect()
            };
            let mut full = base;
            full.extend(idents(&path[..end]));
            let group = (end == 0 || path[..end].ends_with("::"))
                .then(|| path[end..].strip_prefix('{'))
                .flatten();
            match group {
                Some(g) => {
                    for member in g[..g.find('}').unwrap_or(g.len())].split(',') {
                        let mut m = full.clone();
                        m.extend(idents(member));
                        out.push(m);
                    }
                }
                None => out.push(full),
            }
            rest = &path[end..];
        }
    }
    out
}

/// The loops between sibling modules of the crate whose sources are under `src`, each as the
/// modules in it (sorted), with the uses that close it.
pub fn loops(src: &Path) -> Vec<(Vec<String>, Vec<String>)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<ModPath, PathBuf> =
        files.into_iter().map(|f| (mod_path(src, &f), f)).collect();
    let mut edges: BTreeMap<ModPath, BTreeMap<ModPath, String>> = BTreeMap::new();
    for (module, file) in &modules {
        if module.last().is_some_and(|m| m == "tests") {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let code = text
            .find("#[cfg(test)]\nmod tests")
            .map_or(text.as_str(), |i| &text[..i]);
        for target in uses(module, code) {
            // The longest prefix that is a module of the crate.
            let Some(target) = (0..=target.len())
                .rev()
                .map(|k| target[..k].to_vec())
                .find(|p| !p.is_empty() && modules.contains_key(p))
            else {
                continue;
            };
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common == module.len() || common == target.len() {
                continue; // an ancestor or a descendant
            }
            let (from, to) = (module[..=common].to_vec(), target[..=common].to_vec());
            edges
                .entry(from)
                .or_default()
                .entry(to)
                .or_insert_with(|| file.display().to_string());
        }
    }
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    for start in edges.keys() {
        if seen.contains(start) {
            continue;
        }
        // The modules on a path from `start` back to `start`: its strongly connected part.
        let reach = |from: &ModPath, reverse: bool| {
            let mut out = BTreeSet::from([from.clone()]);
            let mut todo = vec![from.clone()];
            while let Some(m) = todo.pop() {
                let next: Vec<ModPath> = if reverse {
                    edges
                        .iter()
                        .filter(|(_, to)| to.contains_key(&m))
                        .map(|(f, _)| f.clone())
                        .collect()
                } else {
                    edges
                        .get(&m)
                        .map(|to| to.keys().cloned().collect())
                        .unwrap_or_default()
                };
                for n in next {
                    if out.insert(n.clone()) {
                        todo.push(n);
                    }
                }
            }
            out
        };
        let part: BTreeSet<ModPath> = reach(start, false)
            .intersection(&reach(start, true))
            .cloned()
            .collect();
        seen.extend(part.iter().cloned());
        if part.len() > 1 {
            let names = part.iter().map(|m| m.join("::")).collect();
            let closing =
                part.iter()
                    .flat_map(|m| {
                        edges[m].iter().filter(|(to, _)| part.contains(*to)).map(
                            move |(to, file)| {
                                format!("{} -> {} ({file})", m.join("::"), to.join("::"))
                            },
                        )
                    })
                    .collect();
            found.push((names, closing));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn no_crate_has_an_import_loop() {
        let manifest = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
        let members: Vec<&str> = manifest
            .lines()
            .find(|l| l.starts_with("members"))
            .expect("a members line")
            .split('"')
            .skip(1)
            .step_by(2)
            .collect();
        assert!(members.len() > 10, "{members:?}");
        let mut bad = Vec::new();
        for m in members {
            for (names, closing) in loops(&workspace().join(m).join("src")) {
                bad.push(format!("{m}: {names:?}: {}", closing.join("; ")));
            }
        }
        assert!(bad.is_empty(), "import loops:\n{}", bad.join("\n"));
    }

    #[test]
    fn a_loop_between_siblings_is_found_and_a_parent_child_pair_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path();
        std::fs::create_dir_all(src.join("store")).unwrap();
        std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\nmod store;\n").unwrap();
        std::fs::write(src.join("a.rs"), "use crate::{b::X, store};\n").unwrap();
        std::fs::write(src.join("b.rs"), "fn f() { crate::c::g() }\n").unwrap();
        std::fs::write(
            src.join("c.rs"),
            "// crate::store is not a use\nuse super::a::Y;\n",
        )
        .unwrap();
        std::fs::write(src.join("store/mod.rs"), "mod gc;\npub use gc::X;\n").unwrap();
        std::fs::write(src.join("store/gc.rs"), "use super::super::store::Z;\n").unwrap();
        let found = loops(src);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, vec!["a", "b", "c"]);
        assert!(
            found[0].1.iter().any(|l| l.starts_with("c -> a (")),
            "{found:?}"
        );
        std::fs::write(src.join("c.rs"), "pub fn g() {}\n").unwrap();
        assert!(loops(src).is_empty());
    }
}
