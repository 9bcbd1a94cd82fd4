//! The one error type of the cgroup module. Every variant names the file, directory or value that
//! failed, and its message is one line: what failed, on what, and what to do about it.

use std::io;
use std::path::PathBuf;

use super::Controller;

/// Where berth reads its cgroup root from; every "fix your setup" hint points here.
const CONFIG_HINT: &str =
    "set cgroup.root in /etc/berth/berth.toml to a delegated cgroup v2 directory";

/// A failed cgroup operation.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The configured root is missing (and could not be created) or is not on a cgroup2 mount.
    #[error("cgroup root {} is not usable: {reason}: {CONFIG_HINT}", .root.display())]
    NotCgroup2 { root: PathBuf, reason: String },

    /// A controller a resource request needs is not available at `root`.
    #[error(
        "cgroup controller '{controller}' is not available under {}: enable it in the parent's \
         cgroup.subtree_control or point cgroup.root at a delegated cgroup v2 tree",
        .root.display()
    )]
    MissingController {
        controller: Controller,
        root: PathBuf,
    },

    /// A filesystem operation on a cgroup directory or interface file failed.
    #[error("could not {op} {}: {source}: {hint}", .path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
        hint: &'static str,
    },

    /// Writing a value into a cgroup interface file failed.
    #[error(
        "could not write '{value}' to {}: {source}: {}",
        .path.display(),
        write_hint(.source)
    )]
    Write {
        path: PathBuf,
        value: String,
        #[source]
        source: io::Error,
    },

    /// `rmdir` kept failing with EBUSY.
    #[error(
        "could not remove cgroup {}: it is still busy after retrying: kill its processes first \
         (and check nothing else created cgroups below it)",
        .path.display()
    )]
    Busy { path: PathBuf },

    /// A child cgroup name that would escape the root or clash with interface files.
    #[error(
        "invalid cgroup name {name:?}: {reason}: use a single path component such as a job or step id"
    )]
    InvalidName { name: String, reason: &'static str },

    /// A pid that must not be written into cgroup.procs.
    #[error(
        "refusing to move pid {pid} into cgroup {}: the pid must be positive (0 would move the \
         calling process itself)",
        .path.display()
    )]
    InvalidPid { pid: i32, path: PathBuf },

    /// Sending SIGKILL while emptying a cgroup failed for a reason other than "already gone".
    #[error("could not kill pid {pid} in cgroup {}: {source}: run berth as root", .path.display())]
    Signal {
        pid: i32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// A resource value in the container spec is out of range or malformed.
    #[error("invalid resource {field} = {value}: {reason}: fix the container's resource request")]
    InvalidResource {
        field: &'static str,
        value: String,
        reason: &'static str,
    },

    /// A resource field berth's cgroup v2 code cannot express.
    #[error(
        "resource {field} is not supported on cgroup v2 by berth: remove it from the container's \
         resource request"
    )]
    UnsupportedResource { field: &'static str },

    /// A device cgroup rule that cannot be turned into a BPF program.
    #[error(
        "invalid device rule '{rule}': {reason}: use type a, b or c, numbers or '*', and access from 'rwm'"
    )]
    InvalidDeviceRule { rule: String, reason: String },

    /// A `bpf()` call for the device filter failed.
    #[error(
        "could not {op} the device filter of cgroup {}: {source}: {}",
        .path.display(),
        bpf_advice(.source, .log)
    )]
    Bpf {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
        /// The verifier log (one line, possibly truncated) when the kernel rejected the program.
        log: String,
    },
}

/// What to do after a failed write, judged by errno: the kernel only says "Invalid argument".
fn write_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::ENOENT) => {
            "the file does not exist: its controller is not enabled for this cgroup (check the \
             parent's cgroup.subtree_control)"
        }
        Some(libc::EINVAL | libc::ERANGE) => {
            "the kernel rejected the value: check it is in range for this file"
        }
        Some(libc::EBUSY) => {
            "the cgroup is busy: controllers cannot be enabled on a cgroup that has processes \
             (move them into a leaf cgroup, or point cgroup.root at a delegated tree)"
        }
        Some(libc::EACCES | libc::EPERM) => "run berth as root or delegate the cgroup tree",
        Some(libc::ESRCH) => "the process has already exited",
        Some(libc::EOPNOTSUPP) => "this kernel does not support it",
        _ => "check the value and the cgroup's state",
    }
}

fn bpf_advice(err: &io::Error, log: &str) -> String {
    if log.is_empty() {
        bpf_hint(err).to_string()
    } else {
        // With a verifier log the program itself was refused, whatever the errno says.
        format!("the kernel's verifier rejected the program (a berth bug, please report it): {log}")
    }
}

fn bpf_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => {
            "berth needs CAP_BPF and CAP_SYS_ADMIN (and, before Linux 5.11, a high RLIMIT_MEMLOCK)"
        }
        Some(libc::EINVAL) => "the kernel rejected the program or attach request",
        Some(libc::ENOSYS) => "this kernel was built without BPF support",
        _ => "check that the kernel supports cgroup v2 device programs (Linux 4.15 or later)",
    }
}

impl CgroupError {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
        source: io::Error,
        hint: &'static str,
    ) -> Self {
        CgroupError::Io {
            op,
            path: path.into(),
            source,
            hint,
        }
    }

    pub(crate) fn not_cgroup2(root: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        CgroupError::NotCgroup2 {
            root: root.into(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_controller_message_is_one_line_and_names_everything() {
        let e = CgroupError::MissingController {
            controller: Controller::Memory,
            root: PathBuf::from("/sys/fs/cgroup/unified/berth"),
        };
        assert_eq!(
            e.to_string(),
            "cgroup controller 'memory' is not available under /sys/fs/cgroup/unified/berth: \
             enable it in the parent's cgroup.subtree_control or point cgroup.root at a delegated \
             cgroup v2 tree"
        );
    }

    #[test]
    fn write_error_names_file_value_and_errno() {
        let e = CgroupError::Write {
            path: PathBuf::from("/cg/x/memory.max"),
            value: "12".into(),
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        let s = e.to_string();
        assert!(s.contains("'12'") && s.contains("/cg/x/memory.max"), "{s}");
        assert!(s.contains("os error 22"), "{s}");
        assert!(!s.contains('\n'));
    }

    #[test]
    fn bpf_error_with_log_stays_on_one_line() {
        let e = CgroupError::Bpf {
            op: "load",
            path: PathBuf::from("/cg/x"),
            source: io::Error::from_raw_os_error(libc::EACCES),
            log: "0: (61) r2 = *(u32 *)(r1 +0); invalid access".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("verifier rejected the program") && s.contains(": 0: (61)"),
            "{s}"
        );
        assert!(!s.contains("CAP_BPF"), "{s}");
        assert!(!s.contains('\n'));
    }
}
