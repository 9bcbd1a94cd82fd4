//! What the module decides for one login, apart from libpam: who is exempt, which job, and the
//! line the user reads when refused.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;

use crate::jobs::{self, Pick};
use crate::options::{Failure, NoJobs, Options};

/// The job a login joins and the Slurm name of this node it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    pub job: u64,
    pub node: String,
}

/// The outcome of the account check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// In, into this job (None: in without a job: exempt, or `action_unknown=allow`).
    Allow(Option<Joined>),
    /// Out, with the one line the user reads.
    Deny(String),
    /// PAM_IGNORE: the stack's other modules decide.
    Ignore,
    /// berth could not tell and `action_generic_failure` says deny: log line, user line.
    Fail { log: String, user: String },
}

/// The user of the login, from the password database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: std::path::PathBuf,
}

/// `name`'s entry in the password database.
pub fn lookup_user(name: &str) -> Option<User> {
    let cname = CString::new(name).ok()?;
    // SAFETY: passwd is plain old data; getpwnam_r fills it.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 16 * 1024];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and buf's length is passed with it.
    let rc = unsafe {
        libc::getpwnam_r(
            cname.as_ptr(),
            &raw mut pw,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &raw mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    let home = if pw.pw_dir.is_null() {
        std::path::PathBuf::from("/")
    } else {
        // SAFETY: pw_dir points into buf, NUL-terminated, filled by getpwnam_r.
        let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
        std::path::PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes()))
    };
    Some(User {
        name: name.to_string(),
        uid: pw.pw_uid,
        gid: pw.pw_gid,
        home,
    })
}

/// Whether `user` is in one of `groups` (by name), primary or supplementary.
pub fn in_groups(user: &User, groups: &[String]) -> bool {
    if groups.is_empty() {
        return false;
    }
    let Ok(cname) = CString::new(user.name.as_str()) else {
        return false;
    };
    let mut gids: Vec<libc::gid_t> = vec![0; 256];
    let mut n = libc::c_int::try_from(gids.len()).unwrap_or(0);
    // SAFETY: gids holds n entries; getgrouplist writes at most n and updates n.
    let rc = unsafe { libc::getgrouplist(cname.as_ptr(), user.gid, gids.as_mut_ptr(), &raw mut n) };
    if rc < 0 {
        // More than 256 groups: the first 256 are what was filled.
        n = libc::c_int::try_from(gids.len()).unwrap_or(0);
    }
    gids.truncate(usize::try_from(n).unwrap_or(0));
    groups
        .iter()
        .any(|g| group_gid(g).is_some_and(|gid| gids.contains(&gid)))
}

fn group_gid(name: &str) -> Option<libc::gid_t> {
    if let Ok(gid) = name.parse::<libc::gid_t>() {
        return Some(gid);
    }
    let cname = CString::new(name).ok()?;
    // SAFETY: group is plain old data; getgrnam_r fills it.
    let mut gr: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 64 * 1024];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and buf's length is passed with it.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &raw mut gr,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &raw mut result,
        )
    };
    (rc == 0 && !result.is_null()).then_some(gr.gr_gid)
}

/// This host's short name: Slurm's default node name.
pub fn short_hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its whole length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    name.split('.').next().unwrap_or("").to_string()
}

/// `action_generic_failure` for a failure berth logs as `log`.
fn cannot_tell(opts: &Options, node: &str, log: String, why: &str) -> Verdict {
    match opts.action_generic_failure {
        Failure::Allow => Verdict::Allow(None),
        Failure::Ignore => Verdict::Ignore,
        Failure::Deny => Verdict::Fail {
            log,
            user: format!(
                "berth: access denied: cannot tell whether you have a job on {node} ({why})"
            ),
        },
    }
}

/// The account decision for `user` (not root, not an admin) logging in from `rhost`. `node` is
/// `nodename=`, else this host's short name.
pub fn decide(opts: &Options, user: &User, node: &str, rhost: Option<&str>) -> Verdict {
    let conf = opts.slurm_conf.as_deref();
    let mut jobs = match jobs::running_jobs(&opts.squeue, conf, user.uid, opts.timeout) {
        Ok(jobs) => jobs,
        Err(e) => {
            return cannot_tell(
                opts,
                node,
                e.to_string(),
                "Slurm did not answer; try again later",
            );
        }
    };
    let mut node = node.to_string();
    // This host's name need not be a node name (NodeHostname=): when the user has jobs but none
    // names this host, which node (or nodes: several slurmd) this host is comes from Slurm.
    if opts.nodename.is_none() && !jobs.is_empty() && !jobs.iter().any(|j| j.runs_on(&node)) {
        let here = jobs::nodes_at(&opts.squeue, conf, &node, opts.timeout);
        match here.as_slice() {
            [one] => node.clone_from(one),
            [] => {}
            several => {
                let log = format!(
                    "pam_berth: Slurm nodes {} run on this host ({node}): set nodename= on the \
                     module's PAM lines",
                    several.join(", ")
                );
                let why = "several Slurm nodes run on this host; tell your administrator";
                return cannot_tell(opts, &node, log, why);
            }
        }
    }
    jobs.retain(|j| j.runs_on(&node));
    let node = node.as_str();
    let joined = |job: u64| {
        Verdict::Allow(Some(Joined {
            job,
            node: node.to_string(),
        }))
    };
    // From this node (loopback, or an address of this node's): the job whose processes hold the
    // client's end of the connection.
    let local_caller = || {
        let ids: Vec<u64> = jobs.iter().map(|j| j.id).collect();
        crate::callerid::local_caller_job(&opts.cgroup_mount, node, user.uid, &ids)
    };
    let callers = match (jobs.len(), rhost) {
        (2.., Some(host)) if !is_local(host) => {
            let callers = jobs::nodes_at(&opts.squeue, conf, host, opts.timeout);
            if callers.iter().any(|n| n == node)
                && let Some(id) = local_caller()
            {
                return joined(id);
            }
            callers
        }
        (2.., _) => {
            if let Some(id) = local_caller() {
                return joined(id);
            }
            Vec::new()
        }
        _ => Vec::new(),
    };
    match jobs::pick(&jobs, &callers, opts.action_unknown) {
        Pick::Job(id) => joined(id),
        Pick::AllowUnadopted => Verdict::Allow(None),
        Pick::NoJobs => match opts.action_no_jobs {
            NoJobs::Deny => Verdict::Deny(no_job_line(node)),
            NoJobs::Ignore => Verdict::Ignore,
        },
        Pick::Ambiguous => Verdict::Deny(format!(
            "berth: access denied: you have several jobs on {node} and none is the one you \
             connect from"
        )),
    }
}

/// The line a user with no job here reads.
pub fn no_job_line(node: &str) -> String {
    format!("berth: access denied: you have no running job on {node}")
}

fn is_local(host: &str) -> bool {
    host == "localhost" || host == "::1" || host.starts_with("127.")
}

/// Joins `pid` to `job`'s extern step on this node.
pub fn adopt(
    opts: &Options,
    user: &User,
    node: &str,
    job: u64,
    pid: u32,
) -> Result<(), crate::PamError> {
    let dirs = crate::adopt::extern_step_dirs(&opts.cgroup_mount, node, user.uid, job);
    crate::adopt::adopt(&dirs, job, pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_found_and_in_its_own_group() {
        let root = lookup_user("root").unwrap();
        assert_eq!(root.uid, 0);
        assert!(in_groups(&root, &["0".to_string()]));
        assert!(!in_groups(&root, &[]));
        assert!(lookup_user("no-such-user-berth-pam").is_none());
    }

    #[test]
    fn slurm_that_cannot_run_is_the_configured_failure() {
        let user = lookup_user("root").unwrap();
        let mut opts = Options::parse(["squeue=/nonexistent/squeue"]).unwrap();
        assert!(matches!(
            decide(&opts, &user, "n1", None),
            Verdict::Fail { .. }
        ));
        opts.action_generic_failure = Failure::Ignore;
        assert_eq!(decide(&opts, &user, "n1", None), Verdict::Ignore);
    }

    /// A squeue and an sinfo that print `squeue` and `sinfo`, in a directory of their own.
    fn fake_slurm(tag: &str, squeue: &str, sinfo: &str) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("pam-berth-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in [("squeue", squeue), ("sinfo", sinfo)] {
            let path = dir.join(name);
            std::fs::write(&path, format!("#!/bin/sh\nprintf '{text}'\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        dir
    }

    #[test]
    fn a_host_with_several_slurm_nodes_needs_nodename() {
        let user = lookup_user("root").unwrap();
        let job = "5 2026-01-01T10:00:00 n1\\n";
        let two = fake_slurm("two", job, "n1 127.0.0.1 vm\\nn2 127.0.0.1 vm\\n");
        let opts =
            Options::parse([format!("squeue={}", two.join("squeue").display()).as_str()]).unwrap();
        match decide(&opts, &user, "vm", None) {
            Verdict::Fail { log, .. } => assert!(log.contains("nodename="), "{log}"),
            other => panic!("let in on a host of two nodes: {other:?}"),
        }
        // Told which node it is, the module asks for that node only (the fake answers anyway).
        let mut told = opts.clone();
        told.nodename = Some("n1".into());
        assert_eq!(
            decide(&told, &user, "n1", None),
            Verdict::Allow(Some(Joined {
                job: 5,
                node: "n1".into()
            }))
        );
        let one = fake_slurm("one", job, "n1 127.0.0.1 vm\\n");
        let opts =
            Options::parse([format!("squeue={}", one.join("squeue").display()).as_str()]).unwrap();
        assert_eq!(
            decide(&opts, &user, "vm", None),
            Verdict::Allow(Some(Joined {
                job: 5,
                node: "n1".into()
            }))
        );
        std::fs::remove_dir_all(two).unwrap();
        std::fs::remove_dir_all(one).unwrap();
    }

    #[test]
    fn the_refusal_line_names_the_node() {
        assert_eq!(
            no_job_line("gpu7"),
            "berth: access denied: you have no running job on gpu7"
        );
    }
}
