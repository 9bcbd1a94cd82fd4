//! Synthesises an image's config (Env, Entrypoint, WorkingDir, Labels) from the files Enroot and
//! Apptainer leave inside their images, since a `.sqsh` or SIF carries no OCI config:
//!
//! - Enroot (`enroot import` writes them from the OCI config): `/etc/environment` holds one
//!   `KEY=VALUE` per line, taken literally as Enroot does; `/etc/rc` starts with the labels as
//!   `# key value` comments, changes to the working directory and execs the entrypoint. Enroot
//!   runs it as `sh /etc/rc ARGS` (it is not executable), so the entrypoint is
//!   `["/bin/sh", "/etc/rc"]`, used only when asked (Pyxis `--container-entrypoint`).
//! - Apptainer: `/.singularity.d/env/*.sh` are shell scripts sourced in name order; they are
//!   evaluated here as far as is safe (assignments, `export`, `unset`, `$X`, `${X:-word}`,
//!   `${X:+word}`, quoting); a line using anything else (commands, control flow, substitutions,
//!   variables the scripts never set) is skipped with a debug log, never guessed. As in the shell,
//!   only exported variables reach the environment. `/.singularity.d/runscript` is the entrypoint
//!   and `/.singularity.d/labels.json` holds the labels.

use std::collections::BTreeMap;

/// Read-only access to the files of an image that is not mounted.
pub trait FileSource {
    /// The content of a regular file (symlinks followed inside the image), if it exists and is at
    /// most `limit` bytes.
    fn read(&self, path: &str, limit: u64) -> Option<Vec<u8>>;
    /// Names in a directory (symlinks followed), empty if it is not one.
    fn list(&self, dir: &str) -> Vec<String>;
    /// Whether `path` exists (symlinks followed).
    fn exists(&self, path: &str) -> bool;
}

/// Config files are small; anything larger is not what Enroot or Apptainer wrote.
const FILE_LIMIT: u64 = 1 << 20;

/// The config fields an Enroot or Apptainer image implies.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Synthesised {
    /// `KEY=VALUE`, in first-definition order.
    pub env: Vec<String>,
    pub entrypoint: Option<Vec<String>>,
    pub workdir: Option<String>,
    pub labels: BTreeMap<String, String>,
}

pub const ENROOT_RC: &str = "/etc/rc";
pub const APPTAINER_RUNSCRIPT: &str = "/.singularity.d/runscript";
const APPTAINER_ENV_DIR: &str = "/.singularity.d/env";
const APPTAINER_LABELS: &str = "/.singularity.d/labels.json";

/// The config of an Enroot image; `use_rc` makes `/etc/rc` the entrypoint.
pub fn enroot(files: &dyn FileSource, use_rc: bool) -> Synthesised {
    let mut out = Synthesised::default();
    if let Some(text) = files.read("/etc/environment", FILE_LIMIT) {
        out.env = environment_file(&String::from_utf8_lossy(&text))
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
    }
    if let Some(text) = files.read(ENROOT_RC, FILE_LIMIT) {
        let rc = enroot_rc(&String::from_utf8_lossy(&text));
        out.labels = rc.labels;
        out.workdir = rc.workdir;
        if use_rc {
            out.entrypoint = Some(vec!["/bin/sh".into(), ENROOT_RC.into()]);
        }
    }
    out
}

/// The config of an Apptainer image.
pub fn apptainer(files: &dyn FileSource) -> Synthesised {
    let mut out = Synthesised::default();
    let mut names: Vec<String> = files
        .list(APPTAINER_ENV_DIR)
        .into_iter()
        .filter(|n| n.ends_with(".sh"))
        .collect();
    names.sort();
    let mut shell = ShellEnv::new();
    for name in &names {
        let path = format!("{APPTAINER_ENV_DIR}/{name}");
        match files.read(&path, FILE_LIMIT) {
            Some(text) => shell.source(&path, &String::from_utf8_lossy(&text)),
            None => tracing::debug!("{path}: not a readable file of at most {FILE_LIMIT} bytes"),
        }
    }
    out.env = shell
        .exported()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if files.exists(APPTAINER_RUNSCRIPT) {
        out.entrypoint = Some(vec![APPTAINER_RUNSCRIPT.into()]);
    }
    if let Some(json) = files.read(APPTAINER_LABELS, FILE_LIMIT) {
        match serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(&json) {
            Ok(map) => {
                out.labels = map
                    .into_iter()
                    .map(|(k, v)| match v {
                        serde_json::Value::String(s) => (k, s),
                        other => (k, other.to_string()),
                    })
                    .collect()
            }
            Err(e) => tracing::debug!("{APPTAINER_LABELS}: not a JSON object: {e}"),
        }
    }
    out
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Enroot's `/etc/environment`: `KEY=VALUE` lines, values literal (Enroot writes the OCI Env
/// entries one per line, unquoted); blank lines, comments and lines without a valid name are
/// skipped. A later line for the same key replaces the earlier value in place.
pub fn environment_file(text: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            tracing::debug!("/etc/environment: no '=' in {line:?}; skipped");
            continue;
        };
        if !is_name(key) {
            tracing::debug!("/etc/environment: invalid name {key:?}; skipped");
            continue;
        }
        match env.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value.to_string(),
            None => env.push((key.to_string(), value.to_string())),
        }
    }
    env
}

/// What an Enroot `/etc/rc` says about the image.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct EnrootRc {
    pub labels: BTreeMap<String, String>,
    pub workdir: Option<String>,
}

/// Reads the labels and working directory out of an `/etc/rc` that `enroot import` generated
/// (recognised by its `cd "DIR" && unset OLDPWD || exit 1` line); any other rc yields nothing.
pub fn enroot_rc(text: &str) -> EnrootRc {
    let mut rc = EnrootRc::default();
    for line in text.lines() {
        if let Some(dir) = line
            .strip_prefix("cd \"")
            .and_then(|r| r.strip_suffix("\" && unset OLDPWD || exit 1"))
        {
            rc.workdir = Some(dir.to_string());
        }
    }
    if rc.workdir.is_none() {
        return rc;
    }
    for line in text.lines() {
        let Some(label) = line.strip_prefix("# ") else {
            break;
        };
        if let Some((key, value)) = label.split_once(' ') {
            rc.labels.insert(key.to_string(), value.to_string());
        }
    }
    rc
}

/// Why a line of an env script is not evaluated.
#[derive(Debug, PartialEq, Eq)]
enum Skip {
    Syntax(&'static str),
    Unset(String),
    Command(String),
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::Syntax(what) => write!(f, "uses {what}"),
            Skip::Unset(name) => write!(f, "reads ${name}, which no script sets"),
            Skip::Command(cmd) => write!(f, "runs the command {cmd:?}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Lit {
        text: String,
        quoted: bool,
    },
    Param {
        name: String,
        op: Option<(Op, Vec<Part>)>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// `${X:-w}` (colon: also when empty) / `${X-w}`
    Default { colon: bool },
    /// `${X:+w}` / `${X+w}`
    Alternative { colon: bool },
}

type Word = Vec<Part>;

/// Parses one line into commands (split at `;`), each a list of words.
struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }
    fn next(&mut self) -> Option<char> {
        let c = self.peek();
        self.at += 1;
        c
    }

    fn line(text: &str) -> Result<Vec<Vec<Word>>, Skip> {
        let mut p = Parser {
            chars: text.chars().collect(),
            at: 0,
        };
        let mut commands = vec![Vec::new()];
        loop {
            while p.peek().is_some_and(|c| c == ' ' || c == '\t') {
                p.at += 1;
            }
            match p.peek() {
                None | Some('#') => break,
                Some(';') => {
                    p.at += 1;
                    commands.push(Vec::new());
                }
                Some(_) => {
                    let word = p.word(false)?;
                    commands.last_mut().expect("never empty").push(word);
                }
            }
        }
        Ok(commands.into_iter().filter(|c| !c.is_empty()).collect())
    }

    /// One word; `in_brace` ends it at the `}` of `${X:-word}` (left unconsumed).
    fn word(&mut self, in_brace: bool) -> Result<Word, Skip> {
        let mut parts = Vec::new();
        let mut lit = String::new();
        let flush = |lit: &mut String, parts: &mut Vec<Part>, quoted| {
            if !lit.is_empty() {
                parts.push(Part::Lit {
                    text: std::mem::take(lit),
                    quoted,
                });
            }
        };
        while let Some(c) = self.peek() {
            match c {
                '}' if in_brace => break,
                ' ' | '\t' | ';' if !in_brace => break,
                '|' | '&' | '<' | '>' | '(' | ')' => {
                    return Err(Skip::Syntax("pipes, redirections or subshells"));
                }
                '`' => return Err(Skip::Syntax("command substitution")),
                '~' => return Err(Skip::Syntax("tilde expansion")),
                '\'' => {
                    flush(&mut lit, &mut parts, false);
                    self.at += 1;
                    let mut text = String::new();
                    loop {
                        match self.next() {
                            Some('\'') => break,
                            Some(c) => text.push(c),
                            None => return Err(Skip::Syntax("an unterminated quote")),
                        }
                    }
                    parts.push(Part::Lit { text, quoted: true });
                }
                '"' => {
                    flush(&mut lit, &mut parts, false);
                    self.at += 1;
                    self.double_quoted(&mut parts)?;
                }
                '\\' => {
                    flush(&mut lit, &mut parts, false);
                    self.at += 1;
                    let Some(c) = self.next() else {
                        return Err(Skip::Syntax("a trailing backslash"));
                    };
                    parts.push(Part::Lit {
                        text: c.to_string(),
                        quoted: true,
                    });
                }
                '$' => {
                    flush(&mut lit, &mut parts, false);
                    self.at += 1;
                    match self.dollar()? {
                        Some(p) => parts.push(p),
                        None => lit.push('$'),
                    }
                }
                c => {
                    lit.push(c);
                    self.at += 1;
                }
            }
        }
        flush(&mut lit, &mut parts, false);
        Ok(parts)
    }

    fn double_quoted(&mut self, parts: &mut Vec<Part>) -> Result<(), Skip> {
        let mut text = String::new();
        let push = |text: &mut String, parts: &mut Vec<Part>| {
            parts.push(Part::Lit {
                text: std::mem::take(text),
                quoted: true,
            })
        };
        // An empty "" still makes a (quoted, empty) literal, as in `export X=""`.
        let mut any = false;
        loop {
            match self.next() {
                None => return Err(Skip::Syntax("an unterminated quote")),
                Some('"') => break,
                Some('`') => return Err(Skip::Syntax("command substitution")),
                Some('\\') => match self.next() {
                    Some(c @ ('$' | '`' | '"' | '\\')) => text.push(c),
                    Some(c) => {
                        text.push('\\');
                        text.push(c);
                    }
                    None => return Err(Skip::Syntax("an unterminated quote")),
                },
                Some('$') => match self.dollar()? {
                    Some(p) => {
                        push(&mut text, parts);
                        parts.push(p);
                        any = true;
                    }
                    None => text.push('$'),
                },
                Some(c) => text.push(c),
            }
        }
        if !text.is_empty() || !any {
            push(&mut text, parts);
        }
        Ok(())
    }

    /// After a `$`: a parameter, or `None` for a literal `$`.
    fn dollar(&mut self) -> Result<Option<Part>, Skip> {
        match self.peek() {
            Some('{') => {
                self.at += 1;
                let name = self.name();
                if name.is_empty() {
                    return Err(Skip::Syntax("special parameters or ${#...}"));
                }
                let op = match (self.next(), self.peek()) {
                    (Some('}'), _) => return Ok(Some(Part::Param { name, op: None })),
                    (Some(':'), Some('-')) => Op::Default { colon: true },
                    (Some(':'), Some('+')) => Op::Alternative { colon: true },
                    (Some('-'), _) => {
                        self.at -= 1;
                        Op::Default { colon: false }
                    }
                    (Some('+'), _) => {
                        self.at -= 1;
                        Op::Alternative { colon: false }
                    }
                    _ => return Err(Skip::Syntax("a parameter expansion other than :- and :+")),
                };
                self.at += 1;
                let word = self.word(true)?;
                if self.next() != Some('}') {
                    return Err(Skip::Syntax("an unterminated ${"));
                }
                Ok(Some(Part::Param {
                    name,
                    op: Some((op, word)),
                }))
            }
            Some('(') => Err(Skip::Syntax("command or arithmetic substitution")),
            Some(c) if c.is_ascii_alphabetic() || c == '_' => Ok(Some(Part::Param {
                name: self.name(),
                op: None,
            })),
            Some(c) if c.is_ascii_digit() || "@*#?$!-".contains(c) => {
                Err(Skip::Syntax("special parameters"))
            }
            _ => Ok(None),
        }
    }

    fn name(&mut self) -> String {
        let mut name = String::new();
        while let Some(c) = self.peek() {
            let ok = if name.is_empty() {
                c.is_ascii_alphabetic() || c == '_'
            } else {
                c.is_ascii_alphanumeric() || c == '_'
            };
            if !ok {
                break;
            }
            name.push(c);
            self.at += 1;
        }
        name
    }
}

#[derive(Debug, Clone)]
struct Var {
    value: Option<String>,
    exported: bool,
    /// Set by a script (not only seeded from the runtime's defaults).
    assigned: bool,
}

/// The variables of the shell that sources the env scripts.
#[derive(Debug, Clone)]
pub struct ShellEnv {
    vars: Vec<(String, Var)>,
}

/// The PATH a container starts with when the image sets none (berth's runtime default), so
/// `PATH=/opt/bin:$PATH` evaluates as it would at run time.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl Default for ShellEnv {
    fn default() -> Self {
        Self::new()
    }
}

impl ShellEnv {
    pub fn new() -> Self {
        ShellEnv {
            vars: vec![(
                "PATH".into(),
                Var {
                    value: Some(DEFAULT_PATH.into()),
                    exported: true,
                    assigned: false,
                },
            )],
        }
    }

    fn get(&self, name: &str) -> Option<&Var> {
        self.vars.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    fn slot(&mut self, name: &str) -> &mut Var {
        if let Some(i) = self.vars.iter().position(|(n, _)| n == name) {
            return &mut self.vars[i].1;
        }
        self.vars.push((
            name.to_string(),
            Var {
                value: None,
                exported: false,
                assigned: false,
            },
        ));
        &mut self.vars.last_mut().expect("just pushed").1
    }

    fn eval(&self, word: &[Part]) -> Result<String, Skip> {
        let mut out = String::new();
        for part in word {
            match part {
                Part::Lit { text, .. } => out.push_str(text),
                Part::Param { name, op } => {
                    let value = self.get(name).and_then(|v| v.value.as_deref());
                    match (op, value) {
                        (None, Some(v)) => out.push_str(v),
                        (None, None) => return Err(Skip::Unset(name.clone())),
                        (Some((Op::Default { colon }, w)), v) => match v {
                            Some(v) if !(*colon && v.is_empty()) => out.push_str(v),
                            _ => out.push_str(&self.eval(w)?),
                        },
                        (Some((Op::Alternative { colon }, w)), v) => match v {
                            Some(v) if !(*colon && v.is_empty()) => out.push_str(&self.eval(w)?),
                            _ => {}
                        },
                    }
                }
            }
        }
        Ok(out)
    }

    /// `NAME=value` words: the name and the value's parts.
    fn assignment(word: &[Part]) -> Option<(String, Word)> {
        let Some(Part::Lit {
            text,
            quoted: false,
        }) = word.first()
        else {
            return None;
        };
        let (name, rest) = text.split_once('=')?;
        if !is_name(name) {
            return None;
        }
        let mut value = Vec::new();
        if !rest.is_empty() {
            value.push(Part::Lit {
                text: rest.to_string(),
                quoted: false,
            });
        }
        value.extend_from_slice(&word[1..]);
        Some((name.to_string(), value))
    }

    fn plain(word: &[Part]) -> Option<&str> {
        match word {
            [
                Part::Lit {
                    text,
                    quoted: false,
                },
            ] => Some(text),
            _ => None,
        }
    }

    fn command(&mut self, words: &[Word]) -> Result<(), Skip> {
        let head = Self::plain(&words[0]);
        match head {
            Some("export") => {
                // The shell expands every argument before export runs: `export A=1 B=$A` reads
                // the old A.
                let mut args = Vec::new();
                for w in &words[1..] {
                    if let Some((name, value)) = Self::assignment(w) {
                        args.push((name, Some(self.eval(&value)?)));
                    } else if let Some(name) = Self::plain(w).filter(|n| is_name(n)) {
                        args.push((name.to_string(), None));
                    } else {
                        return Err(Skip::Syntax("export options"));
                    }
                }
                for (name, value) in args {
                    let v = self.slot(&name);
                    v.exported = true;
                    if value.is_some() {
                        (v.value, v.assigned) = (value, true);
                    }
                }
                Ok(())
            }
            Some("unset") => {
                for w in &words[1..] {
                    let name = Self::plain(w)
                        .filter(|n| is_name(n))
                        .ok_or(Skip::Syntax("unset options"))?;
                    self.vars.retain(|(n, _)| n != name);
                }
                Ok(())
            }
            Some(":" | "true") if words.len() == 1 => Ok(()),
            _ => {
                let mut assigned = Vec::new();
                for w in words {
                    match Self::assignment(w) {
                        Some((name, value)) => assigned.push((name, self.eval(&value)?)),
                        None => {
                            let cmd = head.map(str::to_string).unwrap_or_else(|| "?".into());
                            return Err(Skip::Command(cmd));
                        }
                    }
                }
                for (name, value) in assigned {
                    let v = self.slot(&name);
                    (v.value, v.assigned) = (Some(value), true);
                }
                Ok(())
            }
        }
    }

    /// Evaluates one sourced script (`origin` names it in debug logs).
    pub fn source(&mut self, origin: &str, text: &str) {
        let mut depth = 0usize;
        let mut lines = text.lines().enumerate().peekable();
        while let Some((n, first)) = lines.next() {
            let mut line = first.to_string();
            while line.ends_with('\\') {
                line.pop();
                match lines.next() {
                    Some((_, more)) => line.push_str(more),
                    None => break,
                }
            }
            let trimmed = line.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            // Control structures are skipped whole: what they would set depends on run time.
            let (opens, closes) = control_words(trimmed);
            if depth > 0 || opens > 0 || closes > 0 || trimmed.ends_with('{') {
                depth = (depth + opens).saturating_sub(closes);
                if trimmed.ends_with('{') {
                    depth += 1;
                }
                if trimmed == "}" {
                    depth = depth.saturating_sub(1);
                }
                tracing::debug!(
                    "{origin}:{}: skipped (inside a control structure or function)",
                    n + 1
                );
                continue;
            }
            let result = Parser::line(trimmed).and_then(|commands| {
                let mut next = self.clone();
                for words in &commands {
                    next.command(words)?;
                }
                Ok(next)
            });
            match result {
                Ok(next) => *self = next,
                Err(why) => tracing::debug!("{origin}:{}: skipped: the line {why}", n + 1),
            }
        }
    }

    /// The exported variables the scripts set, in the order they were first defined.
    pub fn exported(&self) -> Vec<(String, String)> {
        self.vars
            .iter()
            .filter(|(_, v)| v.exported && v.assigned)
            .filter_map(|(n, v)| v.value.clone().map(|val| (n.clone(), val)))
            .collect()
    }
}

/// How many control structures a line opens and closes (counted by their keywords).
fn control_words(line: &str) -> (usize, usize) {
    let mut opens = 0;
    let mut closes = 0;
    for w in line.split(|c: char| c.is_whitespace() || c == ';') {
        match w {
            "if" | "case" | "for" | "while" | "until" => opens += 1,
            "fi" | "esac" | "done" => closes += 1,
            _ => {}
        }
    }
    (opens, closes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// An image's files held in memory.
    #[derive(Default)]
    struct Files(HashMap<String, Vec<u8>>);

    impl Files {
        fn with(mut self, path: &str, text: &str) -> Self {
            self.0.insert(path.into(), text.as_bytes().to_vec());
            self
        }
    }

    impl FileSource for Files {
        fn read(&self, path: &str, limit: u64) -> Option<Vec<u8>> {
            self.0
                .get(path)
                .filter(|b| b.len() as u64 <= limit)
                .cloned()
        }
        fn list(&self, dir: &str) -> Vec<String> {
            let prefix = format!("{dir}/");
            self.0
                .keys()
                .filter_map(|k| k.strip_prefix(&prefix))
                .filter(|rest| !rest.contains('/'))
                .map(String::from)
                .collect()
        }
        fn exists(&self, path: &str) -> bool {
            self.0.contains_key(path)
        }
    }

    fn eval(scripts: &[&str]) -> Vec<(String, String)> {
        let mut shell = ShellEnv::new();
        for (i, s) in scripts.iter().enumerate() {
            shell.source(&format!("script{i}"), s);
        }
        shell.exported()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn environment_file_is_literal_key_value_lines() {
        let text = "PATH=/usr/local/bin:/usr/bin\n\n# comment\nCUDA_VERSION=12.4\n\
                    QUOTED=\"kept as is\"\nEMPTY=\nbad line\n1BAD=x\nA=b=c\nCUDA_VERSION=12.5\n";
        assert_eq!(
            environment_file(text),
            pairs(&[
                ("PATH", "/usr/local/bin:/usr/bin"),
                ("CUDA_VERSION", "12.5"),
                ("QUOTED", "\"kept as is\""),
                ("EMPTY", ""),
                ("A", "b=c"),
            ])
        );
    }

    /// What `enroot import` writes for an image with labels, a workdir, an entrypoint and a cmd.
    const ENROOT_RC_TEXT: &str = "# com.nvidia.volumes.needed nvidia_driver\n\
# org.opencontainers.image.version 22.04\n\
\n\
mkdir -p \"/workspace\" 2> /dev/null\n\
cd \"/workspace\" && unset OLDPWD || exit 1\n\
\n\
if [ -s /etc/rc.local ]; then\n\
    . /etc/rc.local\n\
fi\n\
\n\
if [ $# -gt 0 ]; then\n\
    exec '/opt/nvidia/nvidia_entrypoint.sh' \"$@\"\n\
else\n\
    exec '/opt/nvidia/nvidia_entrypoint.sh' '/bin/bash'\n\
fi\n";

    #[test]
    fn enroot_rc_gives_labels_and_workdir() {
        let rc = enroot_rc(ENROOT_RC_TEXT);
        assert_eq!(rc.workdir.as_deref(), Some("/workspace"));
        assert_eq!(
            rc.labels,
            BTreeMap::from([
                ("com.nvidia.volumes.needed".into(), "nvidia_driver".into()),
                ("org.opencontainers.image.version".into(), "22.04".into()),
            ])
        );
        assert_eq!(
            enroot_rc("# my own rc\nexec \"$@\"\n"),
            EnrootRc::default(),
            "a hand-written rc is not mistaken for labels"
        );
    }

    #[test]
    fn enroot_image_config() {
        let files = Files::default()
            .with("/etc/environment", "PATH=/opt/bin:/usr/bin\nLANG=C.UTF-8\n")
            .with("/etc/rc", ENROOT_RC_TEXT);
        let plain = enroot(&files, false);
        assert_eq!(plain.env, ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8"]);
        assert_eq!(plain.entrypoint, None);
        assert_eq!(plain.workdir.as_deref(), Some("/workspace"));
        assert_eq!(plain.labels.len(), 2);
        let with_rc = enroot(&files, true);
        assert_eq!(
            with_rc.entrypoint,
            Some(vec!["/bin/sh".to_string(), "/etc/rc".to_string()])
        );
        assert_eq!(enroot(&Files::default(), true), Synthesised::default());
    }

    /// Written by `apptainer build` from a docker image whose Env is
    /// PATH, LANG, NV_CUDA_LIB_VERSION and an empty-valued EMPTY.
    const DOCKER2SINGULARITY: &str = "#!/bin/sh\n\
export PATH=\"/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"\n\
export LANG=\"${LANG:-\"C.UTF-8\"}\"\n\
export NV_CUDA_LIB_VERSION=\"${NV_CUDA_LIB_VERSION:-\"12.4.1-1\"}\"\n\
export EMPTY=\"${EMPTY:-}\"\n";

    /// Apptainer's own 99-base.sh.
    const BASE: &str = "#!/bin/sh\n\
# Copyright (c) Contributors to the Apptainer project\n\
\n\
if [ -z \"$LD_LIBRARY_PATH\" ]; then\n\
    LD_LIBRARY_PATH=\"/.singularity.d/libs\"\n\
else\n\
    LD_LIBRARY_PATH=\"$LD_LIBRARY_PATH:/.singularity.d/libs\"\n\
fi\n\
\n\
PS1=\"Apptainer> \"\n\
export LD_LIBRARY_PATH PS1\n";

    #[test]
    fn apptainer_docker_env_script() {
        assert_eq!(
            eval(&[DOCKER2SINGULARITY, BASE]),
            pairs(&[
                (
                    "PATH",
                    "/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                ),
                ("LANG", "C.UTF-8"),
                ("NV_CUDA_LIB_VERSION", "12.4.1-1"),
                ("EMPTY", ""),
                ("PS1", "Apptainer> "),
            ])
        );
    }

    #[test]
    fn shell_assignments_quotes_and_expansions() {
        let env = eval(&["\
export A=plain B='single $quoted'\n\
export C=\"double ${A} \\$ \\\" \\n\"\n\
export SAME_LINE=1 SEES_OLD=${SAME_LINE:-old}\n\
D=not-exported\n\
E=later; export E\n\
export F=$A-${A}/${UNSET:-dflt}${UNSET:+alt}${A:+alt}${A-x}${UNSET-y}\n\
export PATH=/opt/bin:$PATH\n\
G=\"\"\n\
export G\n\
export H=a\\ b\\\"c  # trailing comment\n\
export I=one J=two; unset J\n\
export K\n\
"]);
        assert_eq!(
            env,
            pairs(&[
                (
                    "PATH",
                    "/opt/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                ),
                ("A", "plain"),
                ("B", "single $quoted"),
                ("C", "double plain $ \" \\n"),
                ("SAME_LINE", "1"),
                ("SEES_OLD", "old"),
                ("E", "later"),
                ("F", "plain-plain/dfltaltplainy"),
                ("G", ""),
                ("H", "a b\"c"),
                ("I", "one"),
            ])
        );
    }

    #[test]
    fn unsafe_lines_are_skipped_whole() {
        let env = eval(&["\
export OK=1\n\
export SUB=$(hostname)\n\
export TICK=`date`\n\
export HOMEDIR=$HOME/x\n\
export TILDE=~/x\n\
export ARGS=$1\n\
export LEN=${#OK}\n\
export TRIM=${OK%1}\n\
export PIPE=1 | tee /x\n\
export BOTH=1; export SUB2=$(id)\n\
source /etc/profile\n\
echo hi\n\
function f() {\n\
  export INFUNC=1\n\
}\n\
for x in a b; do\n\
  export LOOP=$x\n\
done\n\
case $OK in 1) export CASE=1;; esac\n\
export UNTERMINATED=\"abc\n\
export LAST=2\n\
"]);
        assert_eq!(env, pairs(&[("OK", "1"), ("LAST", "2")]));
    }

    #[test]
    fn continuation_lines_join() {
        assert_eq!(
            eval(&["export LONG=a\\\nb\nexport NEXT=c\n"]),
            pairs(&[("LONG", "ab"), ("NEXT", "c")])
        );
    }

    #[test]
    fn apptainer_image_config() {
        let files = Files::default()
            .with(
                "/.singularity.d/env/10-docker2singularity.sh",
                DOCKER2SINGULARITY,
            )
            .with("/.singularity.d/env/99-base.sh", BASE)
            .with(
                "/.singularity.d/env/90-environment.sh",
                "#!/bin/sh\nexport LANG=en_US.UTF-8\nexport MY_TOOL=/opt/tool\n",
            )
            .with("/.singularity.d/env/README", "export NOT_A_SCRIPT=1\n")
            .with("/.singularity.d/runscript", "#!/bin/sh\nexec \"$@\"\n")
            .with(
                "/.singularity.d/labels.json",
                "{\"org.label-schema.build-date\": \"2024\", \"n\": 3}",
            );
        let s = apptainer(&files);
        assert!(
            s.env.contains(&"LANG=en_US.UTF-8".to_string()),
            "{:?}",
            s.env
        );
        assert!(s.env.contains(&"MY_TOOL=/opt/tool".to_string()));
        assert!(!s.env.iter().any(|e| e.starts_with("NOT_A_SCRIPT")));
        assert_eq!(
            s.entrypoint,
            Some(vec!["/.singularity.d/runscript".to_string()])
        );
        assert_eq!(s.labels["org.label-schema.build-date"], "2024");
        assert_eq!(s.labels["n"], "3");
        assert_eq!(s.workdir, None);
    }
}
