//! Which of the user's jobs runs on this node, from Slurm's controller (`squeue`), and which of
//! them a login joins.
//!
//! Why squeue and not the node's own state: it is the one answer a user cannot shape. Job cgroup
//! directories can be made or renamed by the job's user under cgroup v1 and state files are
//! written by processes the user runs, while slurmstepd's sockets answer only in Slurm's private
//! binary protocol, which changes between releases. squeue costs one fork and one RPC; it runs
//! with an empty environment, a fixed PATH and a deadline, after which it is killed and the
//! login gets `action_generic_failure`.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::PamError;
use crate::options::Unknown;

/// One running job of the user on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: u64,
    /// squeue's `%S`, ISO 8601 local time: compares in time order as text.
    pub start: String,
    /// squeue's `%N`: the job's nodes as a Slurm host list (`n[1-3,7],gpu01`), never expanded (a
    /// user's many big jobs must not cost memory).
    pub nodelist: String,
}

impl Job {
    /// Whether `node` is one of the job's nodes.
    pub fn runs_on(&self, node: &str) -> bool {
        hostlist_contains(&self.nodelist, node)
    }
}

/// The job a login joins, or why none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pick {
    Job(u64),
    NoJobs,
    /// Several jobs and `action_unknown=allow`: in, adopted into none.
    AllowUnadopted,
    /// Several jobs and `action_unknown=deny`.
    Ambiguous,
}

/// The job a connection from a node in `caller_nodes` joins: the caller's job (the one job that
/// also runs there), else the only job, else by `unknown`.
pub fn pick(jobs: &[Job], caller_nodes: &[String], unknown: Unknown) -> Pick {
    match jobs {
        [] => return Pick::NoJobs,
        [only] => return Pick::Job(only.id),
        _ => {}
    }
    let mut callers = jobs
        .iter()
        .filter(|j| caller_nodes.iter().any(|n| j.runs_on(n)));
    if let (Some(job), None) = (callers.next(), callers.next()) {
        return Pick::Job(job.id);
    }
    match unknown {
        Unknown::Newest => jobs
            .iter()
            .max_by(|a, b| a.start.cmp(&b.start).then(a.id.cmp(&b.id)))
            .map_or(Pick::NoJobs, |j| Pick::Job(j.id)),
        Unknown::Allow => Pick::AllowUnadopted,
        Unknown::Deny => Pick::Ambiguous,
    }
}

/// The host expressions of a Slurm host list: split at the commas outside brackets.
fn host_expressions(list: &str) -> impl Iterator<Item = &str> {
    let mut depth = 0u32;
    list.split(move |c| {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        c == ',' && depth == 0
    })
    .filter(|h| !h.is_empty())
}

/// Whether Slurm host list `list` (`n[1-3,07],gpu01`) names `name`, without expanding it.
pub fn hostlist_contains(list: &str, name: &str) -> bool {
    host_expressions(list).any(|host| match (host.find('['), host.strip_suffix(']')) {
        (Some(open), Some(inner)) => {
            let Some(digits) = name.strip_prefix(&host[..open]) else {
                return false;
            };
            let Ok(n) = digits.parse::<u64>() else {
                return false;
            };
            if !digits.bytes().all(|b| b.is_ascii_digit()) {
                return false;
            }
            inner[open + 1..].split(',').any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                let (Ok(a), Ok(b)) = (lo.parse::<u64>(), hi.parse::<u64>()) else {
                    return false;
                };
                (a..=b).contains(&n) && format!("{n:0width$}", width = lo.len()) == digits
            })
        }
        _ => host == name,
    })
}

/// squeue's lines `JOBID START NODELIST` as jobs.
pub fn parse_squeue(program: &Path, text: &str) -> Result<Vec<Job>, PamError> {
    let mut jobs = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let bad = || PamError::Parse {
            program: program.to_path_buf(),
            line: line.chars().take(200).collect(),
        };
        let mut fields = line.split_whitespace();
        let (Some(id), Some(start), Some(nodes), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return Err(bad());
        };
        // An array or heterogeneous job prints as 12_3 or 12+1: %A is always the plain id.
        let id = id.parse::<u64>().map_err(|_| bad())?;
        jobs.push(Job {
            id,
            start: start.to_string(),
            nodelist: nodes.to_string(),
        });
    }
    Ok(jobs)
}

/// Runs `cmd` to its end or until `timeout`, whichever is first; stdout and stderr, or an error
/// (killed at the deadline).
pub fn run_bounded(mut cmd: Command, timeout: Duration) -> Result<(String, String), PamError> {
    let program = Path::new(cmd.get_program()).to_path_buf();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| PamError::Spawn {
            program: program.clone(),
            source,
        })?;
    let deadline = Instant::now() + timeout;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let file = |fd: Option<std::os::fd::OwnedFd>| fd.map(std::fs::File::from);
    let mut pipes = [
        file(child.stdout.take().map(Into::into)),
        file(child.stderr.take().map(Into::into)),
    ];
    loop {
        let mut fds: Vec<libc::pollfd> = pipes
            .iter()
            .flatten()
            .map(|p| libc::pollfd {
                fd: p.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if fds.is_empty() {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(PamError::Timeout {
                program,
                ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            });
        }
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        let nfds = libc::nfds_t::try_from(fds.len()).unwrap_or(0);
        // SAFETY: fds is a live array of nfds pollfd structs for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), nfds, ms) };
        if n <= 0 {
            continue;
        }
        let mut k = 0;
        for (i, slot) in pipes.iter_mut().enumerate() {
            let Some(pipe) = slot else { continue };
            let ready = fds[k].revents != 0;
            k += 1;
            if !ready {
                continue;
            }
            let buf = if i == 0 { &mut out } else { &mut err };
            let mut chunk = [0u8; 4096];
            match pipe.read(&mut chunk) {
                // Bounded: a Slurm answer about one user's jobs on one node is small.
                Ok(n) if n > 0 && buf.len() < (1 << 20) => buf.extend_from_slice(&chunk[..n]),
                Ok(n) if n > 0 => {}
                _ => *slot = None,
            }
        }
    }
    // Both pipes closed: the child has exited or is about to.
    let left = deadline.saturating_duration_since(Instant::now());
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if !left.is_zero() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(PamError::Timeout {
                    program,
                    ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                });
            }
            Err(e) => {
                return Err(PamError::Query {
                    program,
                    status: e.to_string(),
                    stderr: String::new(),
                });
            }
        }
    };
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    let (out, err) = (text(out), text(err));
    if !status.success() {
        return Err(PamError::Query {
            program,
            status: status.to_string(),
            stderr: err.lines().next().unwrap_or("").chars().take(300).collect(),
        });
    }
    Ok((out, err))
}

/// A Slurm client command with nothing of sshd's environment.
fn slurm_command(program: &Path, slurm_conf: Option<&Path>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear().env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    if let Some(conf) = slurm_conf {
        cmd.env("SLURM_CONF", conf);
    }
    cmd
}

/// The running jobs of `uid` on any node, from the controller. Not `--nodelist`: it makes
/// squeue load every node's record from the controller too (a second RPC, a third of a login's
/// cost); the caller keeps the jobs of its node.
pub fn running_jobs(
    squeue: &Path,
    slurm_conf: Option<&Path>,
    uid: u32,
    timeout: Duration,
) -> Result<Vec<Job>, PamError> {
    let mut cmd = slurm_command(squeue, slurm_conf);
    cmd.args(["--noheader", "--states=RUNNING", "--format=%A %S %N"])
        .arg(format!("--user={uid}"));
    let (out, _) = run_bounded(cmd, timeout)?;
    parse_squeue(squeue, &out)
}

/// The Slurm nodes whose address or host name is `rhost` (the connection's source), from sinfo
/// beside `squeue`; empty when there are none or sinfo cannot tell, which only loses the
/// caller's-job rule.
pub fn nodes_at(
    squeue: &Path,
    slurm_conf: Option<&Path>,
    rhost: &str,
    timeout: Duration,
) -> Vec<String> {
    let sinfo = squeue.with_file_name("sinfo");
    let mut cmd = slurm_command(&sinfo, slurm_conf);
    cmd.args(["--noheader", "--Node", "--format=%N %o %n"]);
    let Ok((out, _)) = run_bounded(cmd, timeout) else {
        return Vec::new();
    };
    nodes_matching(&out, rhost)
}

fn nodes_matching(sinfo: &str, rhost: &str) -> Vec<String> {
    let mut nodes: Vec<String> = sinfo
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (name, addr, host) = (f.next()?, f.next()?, f.next()?);
            (addr == rhost || host == rhost).then(|| name.to_string())
        })
        .collect();
    nodes.dedup();
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: u64, start: &str, nodes: &str) -> Job {
        Job {
            id,
            start: start.into(),
            nodelist: nodes.into(),
        }
    }

    #[test]
    fn host_lists_are_searched_without_expanding() {
        let list = "n[1-3,07],gpu01,x[9-10],big[1-100000000]";
        for name in ["n1", "n3", "n07", "gpu01", "x9", "x10", "big99999999"] {
            assert!(hostlist_contains(list, name), "{name}");
        }
        for name in [
            "n4", "n7", "n01", "gpu1", "x", "x11", "n", "n+1", "gpu01,n1", "big0",
        ] {
            assert!(!hostlist_contains(list, name), "{name}");
        }
        assert!(hostlist_contains("a,b", "b"));
        assert!(!hostlist_contains("", ""));
    }

    #[test]
    fn squeue_lines_parse_and_garbage_is_an_error() {
        let p = Path::new("squeue");
        let jobs = parse_squeue(
            p,
            "12 2026-01-01T10:00:00 n[1-2]\n\n7 2026-01-01T09:00:00 n1\n",
        )
        .unwrap();
        assert_eq!(jobs[0], job(12, "2026-01-01T10:00:00", "n[1-2]"));
        assert_eq!(jobs[1].id, 7);
        assert!(matches!(
            parse_squeue(
                p,
                "slurm_load_jobs error: Unable to contact slurm controller"
            ),
            Err(PamError::Parse { .. })
        ));
        assert!(matches!(
            parse_squeue(p, "x 2026 n1"),
            Err(PamError::Parse { .. })
        ));
    }

    #[test]
    fn the_callers_job_then_the_only_then_the_newest() {
        let a = job(5, "2026-01-01T10:00:00", "n[1-2]");
        let b = job(9, "2026-01-01T11:00:00", "n1");
        let c = job(8, "2026-01-01T11:00:00", "n[1,3]");
        assert_eq!(pick(&[], &[], Unknown::Newest), Pick::NoJobs);
        assert_eq!(
            pick(std::slice::from_ref(&a), &[], Unknown::Deny),
            Pick::Job(5)
        );
        let both = [a.clone(), b.clone(), c.clone()];
        assert_eq!(pick(&both, &["n2".into()], Unknown::Deny), Pick::Job(5));
        assert_eq!(pick(&both, &["n3".into()], Unknown::Deny), Pick::Job(8));
        // Two jobs of the caller's node: not the caller's job by this rule.
        assert_eq!(pick(&both, &["n1".into()], Unknown::Newest), Pick::Job(9));
        assert_eq!(pick(&both, &[], Unknown::Newest), Pick::Job(9));
        assert_eq!(pick(&both, &[], Unknown::Allow), Pick::AllowUnadopted);
        assert_eq!(pick(&both, &[], Unknown::Deny), Pick::Ambiguous);
    }

    #[test]
    fn sinfo_names_the_nodes_at_an_address() {
        let text = "n1 10.0.0.1 host1\nn2 10.0.0.2 host2\nn3 10.0.0.1 host1\n";
        assert_eq!(nodes_matching(text, "10.0.0.1"), ["n1", "n3"]);
        assert_eq!(nodes_matching(text, "host2"), ["n2"]);
        assert!(nodes_matching(text, "10.9.9.9").is_empty());
    }

    #[test]
    fn a_command_past_its_deadline_is_killed() {
        let mut cmd = Command::new("/bin/sleep");
        cmd.arg("30");
        assert!(matches!(
            run_bounded(cmd, Duration::from_millis(50)),
            Err(PamError::Timeout { .. })
        ));
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let e = run_bounded(cmd, Duration::from_secs(30)).unwrap_err();
        assert!(e.to_string().contains("err"), "{e}");
        let mut cmd = Command::new("/bin/echo");
        cmd.arg("hi");
        assert_eq!(run_bounded(cmd, Duration::from_secs(30)).unwrap().0, "hi\n");
    }
}
