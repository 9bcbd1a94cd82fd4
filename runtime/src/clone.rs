//! Starts the container's init in new namespaces, placed in its cgroup by the kernel before it
//! runs a single instruction (clone3 with CLONE_INTO_CGROUP), so no process of the container is
//! ever outside its limits.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::unistd::Pid;

/// `struct clone_args` of clone3(2), up to the `cgroup` field (CLONE_ARGS_SIZE_VER2).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Which side of the clone this process is on.
pub enum Forked {
    Parent {
        pid: Pid,
        in_cgroup: bool,
    },
    /// `in_cgroup`: the kernel placed this process in the cgroup (clone3); otherwise it must
    /// wait until the parent has moved it.
    Child {
        in_cgroup: bool,
    },
}

/// Forks with `flags` (CLONE_NEW* namespaces) into `cgroup`. Falls back to a plain clone when the
/// kernel lacks clone3 or CLONE_INTO_CGROUP (before 5.7); then `in_cgroup` is false and the caller
/// must move the child before letting it go on.
///
/// The caller must be single-threaded: the child continues as a copy of this one thread.
pub fn clone_into(flags: libc::c_int, cgroup: BorrowedFd<'_>) -> Result<Forked, Errno> {
    let args = CloneArgs {
        // Sign-extended as the C ABI widens an int: the flags' bits unchanged.
        flags: i64::from(flags).cast_unsigned() | CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD.unsigned_abs().into(),
        // An open fd is never negative.
        cgroup: cgroup.as_raw_fd().unsigned_abs().into(),
        ..Default::default()
    };
    // SAFETY: clone3 with no stack behaves like fork: the child gets a copy of this
    // single-threaded process and returns 0; `args` lives across the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    match ret {
        0 => Ok(Forked::Child { in_cgroup: true }),
        pid if pid > 0 => Ok(Forked::Parent {
            pid: Pid::from_raw(int_of(pid)),
            in_cgroup: true,
        }),
        _ => match Errno::last() {
            Errno::ENOSYS | Errno::E2BIG | Errno::EINVAL => clone_plain(flags),
            e => Err(e),
        },
    }
}

fn clone_plain(flags: libc::c_int) -> Result<Forked, Errno> {
    // SAFETY: the raw clone syscall with a null stack forks this single-threaded process.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone,
            i64::from(flags | libc::SIGCHLD).cast_unsigned(),
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    match ret {
        0 => Ok(Forked::Child { in_cgroup: false }),
        pid if pid > 0 => Ok(Forked::Parent {
            pid: Pid::from_raw(int_of(pid)),
            in_cgroup: false,
        }),
        _ => Err(Errno::last()),
    }
}

/// A pidfd for a child, so waiting composes with poll(2) next to signals and timeouts.
pub fn pidfd_open(pid: Pid) -> Result<OwnedFd, Errno> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(int_of(fd)) })
}

/// A pid or fd that a syscall returned: an int that `syscall()` widens to a long.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the kernel's pids and fds are ints (pid_max is at most 2^22)"
)]
fn int_of(ret: libc::c_long) -> libc::c_int {
    ret as libc::c_int
}
