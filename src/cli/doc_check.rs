//! The documentation cannot drift from the command line: every `berth …` line in a fenced block of
//! README.md and docs/ parses with this build's parser (a synopsis, with `[…]`, `|` or `...`,
//! names only verbs and flags that exist), and every relative link names a file that exists.

use std::path::{Path, PathBuf};

use clap::CommandFactory;

use super::Cli;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown file under docs/.
fn doc_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![repo().join("README.md")];
    walk(&repo().join("docs"), &mut files);
    files.sort();
    files
}

/// The `berth …` lines of fenced code blocks (a line ending in `\` joined with the next), with
/// their line numbers, without a shell prompt, `sudo` or a trailing `# comment`.
fn command_lines(text: &str) -> Vec<(usize, String)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    let mut joined: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            continue;
        }
        let (n, line) = match joined.take() {
            Some((first, head)) => (first, format!("{} {}", head.trim_end(), line.trim())),
            None => (n, line.to_string()),
        };
        if let Some(head) = line.trim_end().strip_suffix('\\') {
            joined = Some((n, head.to_string()));
            continue;
        }
        let mut l = line.trim();
        for prompt in ["$ ", "# ", "sudo "] {
            l = l.strip_prefix(prompt).unwrap_or(l);
        }
        if !l.starts_with("berth ") {
            continue;
        }
        let l = match l.find("  #").or_else(|| l.find(" # ")) {
            Some(i) => &l[..i],
            None => l,
        };
        lines.push((n + 1, l.trim().to_string()));
    }
    lines
}

/// Words as a POSIX shell splits them (quotes, no expansions).
fn shell_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some(q) if q == c => break,
                        Some(ch) => word.push(ch),
                        None => return Err(format!("unterminated {c} quote")),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(ch) = chars.next() {
                    word.push(ch);
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

fn is_synopsis(line: &str) -> bool {
    line.contains('[') || line.contains(" | ") || line.contains("...") || line.contains('(')
}

/// A synopsis line's verbs and flags, checked against the parser (`--a|--b`: each of them):
/// each segment between ` | ` continues in the verb reached so far, or starts again at its parent's verb it names (or at
/// the top with `berth`). Words after a bare `--` are the container's command.
fn check_synopsis(line: &str) -> Result<(), String> {
    let root = Cli::command();
    let mut path: Vec<clap::Command> = vec![root.clone()];
    for segment in line.split(" | ") {
        let words: Vec<String> = segment
            .split_whitespace()
            .flat_map(|w| w.split('|'))
            .map(|w| {
                w.trim_matches(|c| matches!(c, '[' | ']' | '(' | ')'))
                    .trim_end_matches("...")
                    .trim_matches(|c| matches!(c, '[' | ']' | '(' | ')'))
                    .to_string()
            })
            .collect();
        let mut words = words.as_slice();
        if words.first().is_some_and(|w| w == "berth") {
            path.truncate(1);
            words = &words[1..];
        } else if let Some(first) = words.first()
            && path.len() > 1
            && path[path.len() - 2].find_subcommand(first).is_some()
        {
            path.pop();
        }
        for word in words {
            if word == "--" {
                break;
            }
            if let Some(flag) = word.strip_prefix("--") {
                let name = flag.split('=').next().unwrap_or(flag);
                let known = path.iter().any(|cmd| {
                    cmd.get_arguments().any(|a| {
                        a.get_long() == Some(name)
                            || a.get_all_aliases().is_some_and(|v| v.contains(&name))
                    })
                });
                if !known && name != "help" && name != "version" {
                    return Err(format!("--{name} is not a flag of `{}`", names(&path)));
                }
            } else if let Some(short) = word.strip_prefix('-')
                && let Some(c) = short.chars().next()
                && short.chars().count() == 1
            {
                let known = path
                    .iter()
                    .any(|cmd| cmd.get_arguments().any(|a| a.get_short() == Some(c)));
                if !known && c != 'h' {
                    return Err(format!("-{c} is not a flag of `{}`", names(&path)));
                }
            } else if let Some(sub) = path
                .last()
                .and_then(|cmd| cmd.find_subcommand(word.as_str()))
                .cloned()
            {
                path.push(sub);
            }
        }
    }
    Ok(())
}

fn names(path: &[clap::Command]) -> String {
    path.iter()
        .map(|c| c.get_name().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn check_line(line: &str) -> Result<(), String> {
    if is_synopsis(line) {
        return check_synopsis(line);
    }
    let words = shell_words(line)?;
    match Cli::command().try_get_matches_from(&words) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => Ok(()),
        Err(e) => Err(e.to_string().lines().next().unwrap_or_default().to_string()),
    }
}

/// Relative link targets (`[text](path)` and `[text](path#anchor)`) that name no file.
fn broken_links(doc: &Path, text: &str) -> Vec<String> {
    let dir = doc.parent().unwrap_or(Path::new("."));
    let mut broken = Vec::new();
    for (i, _) in text.match_indices("](") {
        let rest = &text[i + 2..];
        let Some(end) = rest.find(')') else { continue };
        let target = &rest[..end];
        let file = target.split('#').next().unwrap_or_default();
        if file.is_empty() || file.contains("://") || file.starts_with("mailto:") {
            continue;
        }
        if file.contains(char::is_whitespace) {
            continue;
        }
        if !dir.join(file).exists() {
            broken.push(target.to_string());
        }
    }
    broken
}

#[test]
fn every_berth_command_line_in_the_docs_parses() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for doc in doc_files() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (n, line) in command_lines(&text) {
            checked += 1;
            if let Err(e) = check_line(&line) {
                failures.push(format!("{}:{n}: {line}\n    {e}", doc.display()));
            }
        }
    }
    assert!(
        checked >= 30,
        "only {checked} command lines found in the docs"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_relative_link_in_the_docs_names_a_file() {
    let mut failures = Vec::new();
    for doc in doc_files() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for target in broken_links(&doc, &text) {
            failures.push(format!("{}: ({target})", doc.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_checks_catch_drift() {
    // A flag, a verb or a value the parser refuses is reported, in a synopsis too.
    assert!(check_line("berth run --no-such-flag ubuntu true").is_err());
    assert!(check_line("berth images ls [--nope]").is_err());
    assert!(check_line("berth images ls [--json] | inspect REF | verify [--bogus]").is_err());
    check_line("berth images ls [--json] | inspect REF | verify [--json] [REF...]").unwrap();
    check_line("berth cluster drain gpu017 --reason \"fan replaced\"").unwrap();
    check_line("berth exec CONTAINER [-e KEY=VAL]... -- CMD [ARG...]").unwrap();
    assert!(check_line("berth exec CONTAINER [-Q KEY=VAL]... -- CMD").is_err());
    check_line("berth topo plan [--rank N] [--env|--json]").unwrap();
    assert!(check_line("berth topo plan [--rank N] [--env|--jsn]").is_err());
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("a.md");
    std::fs::write(dir.path().join("b.md"), "").unwrap();
    let text = "[ok](b.md#x) [web](https://example.com) [gone](c.md) [self](#top)";
    assert_eq!(broken_links(&doc, text), ["c.md"]);
    let block = "```\nberth run --rootfs /r \\\n  --pids 0 -- true\n```\n";
    let lines = command_lines(block);
    assert_eq!(
        lines,
        [(2, "berth run --rootfs /r --pids 0 -- true".to_string())]
    );
    assert!(
        check_line(&lines[0].1).is_err(),
        "a continued line is checked whole"
    );
    assert_eq!(
        shell_words("a 'b c' \"d\\e\" f\\ g").unwrap(),
        ["a", "b c", "d\\e", "f g"]
    );
}
