//! Runs the berth binary from inside slurmstepd: as full root (slurmstepd calls `user_init` with
//! the job user's effective uid but root's real uid), with an empty signal mask, no inherited
//! descriptors, `/` as working directory and a fixed PATH, its stdin fed from memory and its
//! stdout and stderr captured in memory files. Memory files rather than pipes: a process berth
//! leaves running (the container's holder) may keep a copy of stdout open, and the plugin must
//! not wait for an end of file that never comes; it waits for berth itself to exit.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};

/// PATH for berth and anything it runs (mksquashfs, …): slurmstepd's own may be anything.
pub const SAFE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone)]
pub struct Invocation {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub stdin: Vec<u8>,
    /// Extra environment for the child (it starts from an empty one plus PATH).
    pub env: Vec<(OsString, OsString)>,
}

#[derive(Debug)]
pub struct Outcome {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Outcome {
    /// "exited with status N" / "was killed by signal N", for messages.
    pub fn describe(&self) -> String {
        match (self.status.code(), self.status.signal()) {
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            _ => "ended".to_string(),
        }
    }
}

fn memfd(name: &std::ffi::CStr) -> io::Result<File> {
    // SAFETY: memfd_create with a valid NUL-terminated name; the returned descriptor is owned
    // by the File from here on.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Runs `inv` to completion. `Err` only when it could not be started or waited for; a non-zero
/// exit is an `Ok` outcome for the caller to judge.
pub fn run(inv: &Invocation) -> io::Result<Outcome> {
    let mut stdin = memfd(c"berth-stdin")?;
    stdin.write_all(&inv.stdin)?;
    stdin.seek(SeekFrom::Start(0))?;
    let mut stdout = memfd(c"berth-stdout")?;
    let mut stderr = memfd(c"berth-stderr")?;

    let mut cmd = Command::new(&inv.program);
    cmd.args(&inv.args)
        .env_clear()
        .env("PATH", SAFE_PATH)
        .envs(inv.env.iter().map(|(k, v)| (k, v)))
        .current_dir("/")
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout.try_clone()?))
        .stderr(Stdio::from(stderr.try_clone()?));
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // raw system calls (no allocation, no locks).
    unsafe {
        cmd.pre_exec(child_setup);
    }
    let status = cmd.spawn()?.wait()?;

    let mut out = Vec::new();
    stdout.seek(SeekFrom::Start(0))?;
    stdout.read_to_end(&mut out)?;
    let mut err = Vec::new();
    stderr.seek(SeekFrom::Start(0))?;
    stderr.read_to_end(&mut err)?;
    Ok(Outcome {
        status,
        stdout: out,
        stderr: err,
    })
}

/// In the child: become root in full when the real uid is root, unblock signals, and mark every
/// descriptor above stderr close-on-exec (slurmstepd's sockets and pipes must not leak into
/// berth or into a process it leaves running).
fn child_setup() -> io::Result<()> {
    let check = |r: libc::c_long| {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    // SAFETY: plain system calls on this (single-threaded, just forked) process; raw syscalls
    // rather than glibc's wrappers, which would try to synchronise credentials across threads.
    unsafe {
        if libc::getuid() == 0 {
            check(libc::syscall(libc::SYS_setresuid, 0, 0, 0))?;
            check(libc::syscall(libc::SYS_setresgid, 0, 0, 0))?;
            check(libc::syscall(
                libc::SYS_setgroups,
                0,
                std::ptr::null::<libc::gid_t>(),
            ))?;
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        check(libc::c_long::from(libc::sigprocmask(
            libc::SIG_SETMASK,
            &set,
            std::ptr::null_mut(),
        )))?;
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
        if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) < 0 {
            // Kernels before 5.11: walk the descriptor table up to the soft limit.
            let max = libc::sysconf(libc::_SC_OPEN_MAX).clamp(0, 65536) as libc::c_int;
            for fd in 3..max {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, stdin: &str) -> Outcome {
        run(&Invocation {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            stdin: stdin.as_bytes().to_vec(),
            env: vec![("EXTRA".into(), "1".into())],
        })
        .unwrap()
    }

    #[test]
    fn feeds_stdin_and_captures_both_outputs() {
        let o = sh("cat; echo out2; echo err >&2; exit 3", "{\"x\":1}\n");
        assert_eq!(String::from_utf8_lossy(&o.stdout), "{\"x\":1}\nout2\n");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
        assert_eq!(o.status.code(), Some(3));
        assert_eq!(o.describe(), "exited with status 3");
    }

    #[test]
    fn does_not_wait_for_a_background_process_holding_stdout() {
        let start = std::time::Instant::now();
        let o = sh("sleep 5 & echo '{}'; exit 0", "");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(4),
            "waited for the background process"
        );
        assert_eq!(String::from_utf8_lossy(&o.stdout), "{}\n");
    }

    #[test]
    fn child_gets_a_clean_environment_root_cwd_and_no_inherited_descriptors() {
        // A descriptor without close-on-exec in the parent, as slurmstepd has many.
        // SAFETY: dup of stdin; the result is closed below.
        let leaked = unsafe { libc::dup(0) };
        assert!(leaked > 2);
        // SAFETY: clearing FD_CLOEXEC on a descriptor this test owns.
        unsafe { libc::fcntl(leaked, libc::F_SETFD, 0) };
        let o = sh(
            &format!(
                "echo \"$PATH|$EXTRA|$HOME\"; pwd; [ -e /proc/$$/fd/{leaked} ] && echo LEAKED || echo closed"
            ),
            "",
        );
        // SAFETY: closing the descriptor dup'ed above.
        unsafe { libc::close(leaked) };
        let out = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], format!("{SAFE_PATH}|1|"));
        assert_eq!(lines[1], "/");
        assert_eq!(lines[2], "closed", "{out}");
    }

    #[test]
    fn reports_a_signal() {
        let o = sh("kill -9 $$", "");
        assert_eq!(o.describe(), "was killed by signal 9");
    }

    #[test]
    fn missing_program_is_an_error() {
        let e = run(&Invocation {
            program: "/nonexistent/berth".into(),
            args: vec![],
            stdin: vec![],
            env: vec![],
        })
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
