//! The security tier: each test plays a hostile non-root user (berthtest, the attacker) against
//! the real berth binary run as root the way Slurm runs it, and checks that the user reaches
//! nothing the user could not reach on the host (DESIGN.md, "Privilege model"). Races run in
//! bounded loops of [`TRIES`] tries with a swapper the attacker runs.

#[path = "../common/mod.rs"]
mod common;

mod images;
mod inputs;
mod lazy;
mod network;
mod runtime;
mod save;
mod stage;
mod state;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;

pub use common::*;

/// Tries per race: every one must lose.
pub const TRIES: usize = 200;

/// The hostile user: (uid, gid).
pub fn attacker() -> (u32, u32) {
    let (u, g, _) = test_user();
    (u, g)
}

/// A second user whose files the attacker must never reach: (uid, gid).
pub fn victim() -> (u32, u32) {
    static V: OnceLock<(u32, u32)> = OnceLock::new();
    *V.get_or_init(|| {
        let exists = Command::new("id")
            .arg("berthvictim")
            .output()
            .is_ok_and(|o| o.status.success());
        if !exists {
            let o = Command::new("useradd")
                .args(["-M", "-s", "/bin/sh", "berthvictim"])
                .output()
                .unwrap();
            assert!(o.status.success(), "useradd berthvictim: {}", stderr(&o));
        }
        let id = |flag: &str| -> u32 {
            let o = Command::new("id")
                .args([flag, "berthvictim"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
        };
        (id("-u"), id("-g"))
    })
}

/// A fresh directory for one test, root's, 0755, under the root tier's work directory.
pub fn workdir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/root-tier/security")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    chmod(dir.parent().unwrap(), 0o755);
    chmod(&dir, 0o755);
    dir
}

pub fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Hands `path` (recursively) to uid:gid.
pub fn give(path: &Path, (uid, gid): (u32, u32)) {
    let o = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{gid}"))
        .arg(path)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "chown {}: {}",
        path.display(),
        stderr(&o)
    );
}

/// `cmd` made to run as uid:gid; std drops the supplementary groups when root sets a uid.
pub fn as_uid(cmd: &mut Command, (uid, gid): (u32, u32)) -> &mut Command {
    cmd.uid(uid).gid(gid).stdin(Stdio::null())
}

/// `sh -c SCRIPT` as the attacker, waited for.
pub fn attacker_sh(script: &str) -> Output {
    as_uid(Command::new("/bin/sh").args(["-c", script]), attacker())
        .output()
        .unwrap()
}

/// berth (test config) as root, with `input` on stdin: how slurmstepd's plugin calls `step create`.
pub fn berth_with_stdin(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = berth(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    child.wait_with_output().unwrap()
}

/// A process of the attacker's that swaps `a` and `b` (renameat2 RENAME_EXCHANGE) as fast as it
/// can until dropped: what a user racing a path check does. Killed and reaped on drop, with its
/// whole process group, so nothing outlives the test.
#[derive(Debug)]
pub struct Swapper(Child);

pub fn swapper(a: &Path, b: &Path) -> Swapper {
    let script = "import ctypes,os,sys\n\
        libc=ctypes.CDLL(None,use_errno=True)\n\
        a=os.fsencode(sys.argv[1]); b=os.fsencode(sys.argv[2])\n\
        while True: libc.renameat2(-100,a,-100,b,2)\n";
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", script]).arg(a).arg(b);
    as_uid(&mut cmd, attacker())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    Swapper(cmd.spawn().expect("starting the swapper"))
}

impl Drop for Swapper {
    fn drop(&mut self) {
        // SAFETY: signalling the swapper's own process group, which it leads.
        unsafe { libc::kill(-i32::try_from(self.0.id()).unwrap(), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}
