//! Build script: records the git commit the binary is built from, for `berth --version`.
//!
//! `BERTH_GIT_COMMIT` is `$BERTH_GIT_COMMIT` when set (a packager building from a tarball can
//! name the commit), else `git rev-parse --short HEAD` when the source tree is a git checkout,
//! else `unknown`. Nothing here fails the build: a tarball, a missing git, or a checkout git
//! refuses to read (another owner) all give `unknown`.

use std::path::Path;
use std::process::{Command, Stdio};

fn main() {
    println!("cargo:rerun-if-env-changed=BERTH_GIT_COMMIT");
    let commit = std::env::var("BERTH_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .map(|c| c.trim().to_string())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BERTH_GIT_COMMIT={commit}");
}

/// The short commit of HEAD, when the package directory is a git checkout and git answers.
fn git_commit() -> Option<String> {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")?;
    let dir = Path::new(&dir);
    if !dir.join(".git").exists() {
        return None;
    }
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (out.status.success() && !text.is_empty()).then_some(text)
    };
    // Rebuild when HEAD moves: HEAD itself (a checkout), the branch it names (a commit), and
    // packed-refs (a branch packed by gc).
    for name in ["HEAD", "packed-refs"] {
        if let Some(p) = git(&["rev-parse", "--git-path", name]) {
            println!("cargo:rerun-if-changed={}", dir.join(p).display());
        }
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(p) = git(&["rev-parse", "--git-path", &branch])
    {
        println!("cargo:rerun-if-changed={}", dir.join(p).display());
    }
    let commit = git(&["rev-parse", "--short", "HEAD"])?;
    // Only a commit id: anything else from git is not one.
    commit
        .bytes()
        .all(|b| b.is_ascii_hexdigit())
        .then_some(commit)
}
