//! The node agent's checks of the node's Slurm daemons (issue 17): slurmd (the pid in its pid
//! file is a running slurmd) and munge (a `munge -n | unmunge` round trip, what every Slurm RPC
//! needs). Reported in the heartbeat's `daemons` and the agent's `/metrics`; never a drain
//! (slurmctld marks a node without slurmd down itself).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use berth_api::{DaemonReport, DaemonState};

use berth_config::AgentConfig;

use crate::AgentError;

/// How long each munge command may take.
const MUNGE_TIMEOUT: Duration = Duration::from_secs(3);

fn report(daemon: &str, state: DaemonState, message: impl Into<String>) -> DaemonReport {
    DaemonReport {
        daemon: daemon.into(),
        state,
        message: message.into(),
    }
}

/// Both checks, slurmd first. The munge round trip runs two processes, so it runs only when
/// `munge_now` (the agent asks once per heartbeat interval); otherwise `last` (the munge report
/// of the round that ran it) is reported again.
pub fn check(cfg: &AgentConfig, munge_now: bool, last: Option<&DaemonReport>) -> Vec<DaemonReport> {
    let munge = match last {
        Some(l) if !munge_now => l.clone(),
        _ => munge(cfg),
    };
    vec![slurmd(&cfg.slurmd_pid_file), munge]
}

/// `/proc/PID/stat`'s state letter and the command name of `pid`.
fn proc_state(pid: i32) -> Option<(char, String)> {
    let mut s = String::new();
    std::fs::File::open(format!("/proc/{pid}/stat"))
        .ok()?
        .take(4096)
        .read_to_string(&mut s)
        .ok()?;
    let open = s.find('(')?;
    let close = s.rfind(')')?;
    let comm = s.get(open + 1..close)?.to_string();
    let state = s.get(close + 1..)?.trim_start().chars().next()?;
    Some((state, comm))
}

fn slurmd(pid_file: &Path) -> DaemonReport {
    if pid_file.as_os_str().is_empty() {
        return report(
            "slurmd",
            DaemonState::NotConfigured,
            "agent.slurmd_pid_file is empty",
        );
    }
    let mut text = String::new();
    let read = std::fs::File::open(pid_file).and_then(|f| f.take(64).read_to_string(&mut text));
    if let Err(e) = read {
        return report(
            "slurmd",
            DaemonState::Down,
            format!("{}: {e}", pid_file.display()),
        );
    }
    let Ok(pid) = text.trim().parse::<i32>() else {
        return report(
            "slurmd",
            DaemonState::Down,
            format!("{}: no pid in it", pid_file.display()),
        );
    };
    match proc_state(pid) {
        None => report(
            "slurmd",
            DaemonState::Down,
            format!("pid {pid} (from {}) is gone", pid_file.display()),
        ),
        Some((_, comm)) if comm != "slurmd" => report(
            "slurmd",
            DaemonState::Down,
            format!("pid {pid} is {comm}, not slurmd (a stale pid file)"),
        ),
        Some(('Z' | 'X', _)) => report("slurmd", DaemonState::Down, format!("pid {pid} exited")),
        Some(('T' | 't', _)) => {
            report("slurmd", DaemonState::Down, format!("pid {pid} is stopped"))
        }
        Some(_) => report("slurmd", DaemonState::Up, format!("pid {pid} runs")),
    }
}

/// Runs `cmd` with `input` on stdin, at most [`MUNGE_TIMEOUT`]; its stdout, or why not.
fn run(mut cmd: Command, input: &[u8]) -> Result<Vec<u8>, AgentError> {
    let name = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| AgentError::Spawn {
            program: name.clone(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(input);
    }
    let deadline = Instant::now() + MUNGE_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(AgentError::host(format!(
                    "{name} did not finish within {} s",
                    MUNGE_TIMEOUT.as_secs()
                )));
            }
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| AgentError::host(format!("{name}: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(AgentError::host(format!(
            "{name}: {}",
            err.lines().next().unwrap_or("failed").trim()
        )));
    }
    Ok(out.stdout)
}

fn munge(cfg: &AgentConfig) -> DaemonReport {
    if !cfg.check_munge {
        return report(
            "munge",
            DaemonState::NotConfigured,
            "agent.check_munge is false",
        );
    }
    let with_socket = |prog: &str| {
        let mut c = Command::new(prog);
        if !cfg.munge_socket.as_os_str().is_empty() {
            c.arg("--socket").arg(&cfg.munge_socket);
        }
        c
    };
    let mut encode = with_socket("munge");
    encode.arg("-n");
    let cred = match run(encode, b"") {
        Ok(c) => c,
        // munge not installed: this check cannot say.
        Err(e @ AgentError::Spawn { .. }) => {
            return report("munge", DaemonState::Unknown, e.to_string());
        }
        Err(e) => return report("munge", DaemonState::Down, e.to_string()),
    };
    match run(with_socket("unmunge"), &cred) {
        Ok(_) => report("munge", DaemonState::Up, "munge -n | unmunge: ok"),
        Err(e) => report("munge", DaemonState::Down, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurmd_from_its_pid_file() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dir.path().join("slurmd.pid");
        assert_eq!(slurmd(Path::new("")).state, DaemonState::NotConfigured);
        assert_eq!(slurmd(&pid).state, DaemonState::Down);
        // This test's own pid is a process, but not slurmd: a stale pid file.
        std::fs::write(&pid, format!("{}\n", std::process::id())).unwrap();
        let r = slurmd(&pid);
        assert_eq!(r.state, DaemonState::Down);
        assert!(r.message.contains("not slurmd"), "{}", r.message);
        std::fs::write(&pid, "x\n").unwrap();
        assert!(slurmd(&pid).message.contains("no pid"));
    }

    #[test]
    fn munge_off_is_not_configured() {
        let cfg = AgentConfig {
            check_munge: false,
            ..AgentConfig::default()
        };
        assert_eq!(munge(&cfg).state, DaemonState::NotConfigured);
        // Between munge rounds the last report stands; without one it is checked.
        let last = report("munge", DaemonState::Down, "earlier");
        assert_eq!(check(&cfg, false, Some(&last))[1].message, "earlier");
        assert_eq!(
            check(&cfg, false, None)[1].state,
            DaemonState::NotConfigured
        );
        assert_eq!(
            check(&cfg, true, Some(&last))[1].state,
            DaemonState::NotConfigured
        );
    }
}
