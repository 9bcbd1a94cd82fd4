//! Moving a task into the step's container: `setns` into each namespace berth reported, then no
//! capabilities at all.
//!
//! The task joins in `slurm_spank_task_init`, after slurmstepd has switched it to the job's uid
//! and changed to the job's working directory on the host (joining earlier, in
//! `task_init_privileged`, makes slurmstepd's own `chdir` look for the host directory inside the
//! container and print an error when it is missing). Joining needs CAP_SYS_ADMIN and
//! CAP_SYS_CHROOT, so `task_init_privileged` asks the kernel to keep the permitted capabilities
//! across slurmstepd's switch to the job's uid (`PR_SET_KEEPCAPS`); `enter` raises the ones it
//! needs, joins, and clears every capability set (bounding included) and sets `no_new_privs`
//! before the task's program is executed.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::SpankError;
use crate::request::Namespace;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_V3: u32 = 0x2008_0522;
const CAP_SETPCAP: u32 = 8;
const CAP_SYS_CHROOT: u32 = 18;
const CAP_SYS_ADMIN: u32 = 21;

fn capget() -> io::Result<[CapData; 2]> {
    let mut header = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget with a v3 header and room for the two data words v3 uses.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(data)
}

fn capset(data: &[CapData; 2]) -> io::Result<()> {
    let mut header = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    // SAFETY: capset on this thread with a v3 header and two data words.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn bit(cap: u32) -> u32 {
    1 << cap
}

/// Keeps the permitted capabilities when slurmstepd switches the task to the job's uid, so
/// `enter` can still join the container afterwards. Called as root in `task_init_privileged`.
pub fn keep_caps_across_setuid() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Joins every namespace in `namespaces` (already in joining order), then leaves the task with
/// no capability in any set (bounding and ambient included), no keep-caps flag and
/// `no_new_privs`, so the program Slurm executes next cannot gain privileges by any means. On
/// error the capabilities are cleared too, and the caller fails the task.
pub fn enter(namespaces: &[(Namespace, OwnedFd)]) -> Result<(), SpankError> {
    let result = join(namespaces).and_then(|()| {
        // After the joins: joining a user namespace resets the bounding set to full.
        drop_bounding_set().map_err(SpankError::Caps)?;
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } < 0 {
            return Err(SpankError::Caps(io::Error::last_os_error()));
        }
        // A remapped container's tasks get berth's filter, as Pyxis installs Enroot's here;
        // after no_new_privs, which it needs (see berth-sys's seccomp module for why it grants
        // nothing). Remapped: the joined user namespace makes the task root; one that maps the
        // user to themselves (a container made without remap-root) gets no filter.
        if namespaces
            .iter()
            .any(|(ns, _)| matches!(ns, Namespace::User))
            && is_root()
        {
            berth_sys::seccomp::install().map_err(SpankError::Seccomp)?;
        }
        Ok(())
    });
    let cleared = drop_all_caps();
    result?;
    cleared.map_err(SpankError::Caps)
}

fn is_root() -> bool {
    // SAFETY: getuid takes no arguments and cannot fail.
    unsafe { libc::getuid() == 0 }
}

/// Drops every capability from the bounding set (needs CAP_SETPCAP in the effective set).
fn drop_bounding_set() -> io::Result<()> {
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } < 0 {
            let e = io::Error::last_os_error();
            // EINVAL: past the kernel's last capability.
            if e.raw_os_error() == Some(libc::EINVAL) {
                return Ok(());
            }
            return Err(e);
        }
    }
    Ok(())
}

fn join(namespaces: &[(Namespace, OwnedFd)]) -> Result<(), SpankError> {
    let need = bit(CAP_SYS_ADMIN) | bit(CAP_SYS_CHROOT) | bit(CAP_SETPCAP);
    let mut caps = capget().map_err(SpankError::Caps)?;
    if caps[0].permitted & need != need {
        return Err(SpankError::NoCapability);
    }
    caps[0].effective |= need;
    capset(&caps).map_err(SpankError::Caps)?;
    for (ns, fd) in namespaces {
        // SAFETY: setns on a namespace file descriptor this process owns, checked against its
        // CLONE_NEW* type.
        if unsafe { libc::setns(fd.as_raw_fd(), ns.clone_flag()) } < 0 {
            return Err(SpankError::Setns {
                ns: ns.key(),
                source: io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

/// Clears every capability set of this thread and the keep-caps flag.
pub fn drop_all_caps() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
    }
    capset(&[CapData::default(); 2])?;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` with root as this thread's effective uid. slurmstepd calls `user_init` with the job
/// user's effective uid (real uid root), and the namespace files of berth's root-owned holder
/// process can only be opened by root. Raw `setresuid` changes the calling thread alone (glibc's
/// wrapper would change every thread of slurmstepd); the previous effective uid is restored
/// before returning.
pub fn with_root_euid<T>(f: impl FnOnce() -> T) -> io::Result<T> {
    // SAFETY: reading this thread's ids.
    let (uid, euid) = unsafe { (libc::getuid(), libc::geteuid()) };
    if euid == 0 || uid != 0 {
        return Ok(f());
    }
    let keep = libc::uid_t::MAX;
    // SAFETY: changes only this thread's effective uid; the real uid is root, so it is allowed.
    if unsafe { libc::syscall(libc::SYS_setresuid, keep, 0, keep) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let out = f();
    // SAFETY: back to the effective uid slurmstepd set; root may set any.
    if unsafe { libc::syscall(libc::SYS_setresuid, keep, euid, keep) } < 0 {
        // Continuing as root would run slurmstepd's next steps with the wrong identity.
        std::process::abort();
    }
    Ok(out)
}

/// Opens a namespace file berth reported (in slurmstepd, before any task exists, so a holder
/// that dies cannot be replaced by an unrelated process reusing its pid). Close-on-exec, so the
/// task's program never inherits it.
pub fn open_namespace(path: &str) -> io::Result<OwnedFd> {
    Ok(OwnedFd::from(std::fs::File::open(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` in a forked child and returns its exit status, so capability and namespace
    /// changes never touch the test process.
    fn in_child(f: impl FnOnce() -> i32) -> i32 {
        // SAFETY: fork in a test; the child only runs `f` and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = f();
            // SAFETY: leaving the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        libc::WEXITSTATUS(status)
    }

    #[test]
    fn drop_all_caps_leaves_nothing() {
        let code = in_child(|| {
            if drop_all_caps().is_err() {
                return 10;
            }
            match capget() {
                Ok(c)
                    if c.iter()
                        .all(|d| d.effective | d.permitted | d.inheritable == 0) =>
                {
                    0
                }
                _ => 11,
            }
        });
        assert_eq!(code, 0);
    }

    #[test]
    fn enter_without_permitted_capabilities_fails_cleanly() {
        let code = in_child(|| {
            let _ = drop_all_caps();
            let fd = match open_namespace("/proc/self/ns/uts") {
                Ok(fd) => fd,
                Err(_) => return 12,
            };
            match enter(&[(Namespace::Uts, fd)]) {
                Err(SpankError::NoCapability) => 0,
                _ => 13,
            }
        });
        assert_eq!(code, 0);
    }

    #[test]
    fn keep_caps_is_set_and_then_cleared_by_enter() {
        let code = in_child(|| {
            if keep_caps_across_setuid().is_err() {
                return 10;
            }
            // SAFETY: prctl query with integer arguments.
            if unsafe { libc::prctl(libc::PR_GET_KEEPCAPS, 0, 0, 0, 0) } != 1 {
                return 11;
            }
            let _ = enter(&[]);
            // SAFETY: as above.
            match unsafe { libc::prctl(libc::PR_GET_KEEPCAPS, 0, 0, 0, 0) } {
                0 => 0,
                _ => 12,
            }
        });
        assert_eq!(code, 0);
    }

    #[test]
    fn with_root_euid_runs_the_closure_and_keeps_the_identity() {
        // SAFETY: reading ids.
        let before = unsafe { (libc::getuid(), libc::geteuid()) };
        assert_eq!(with_root_euid(|| 7).unwrap(), 7);
        // SAFETY: reading ids.
        assert_eq!(unsafe { (libc::getuid(), libc::geteuid()) }, before);
        if before.0 != 0 {
            return;
        }
        // As slurmstepd in user_init: real uid root, effective uid the job's.
        let code = in_child(|| {
            let keep = libc::uid_t::MAX;
            // SAFETY: dropping this child's effective uid.
            if unsafe { libc::syscall(libc::SYS_setresuid, keep, 65534, keep) } < 0 {
                return 10;
            }
            // SAFETY: reading ids.
            let inside = with_root_euid(|| unsafe { libc::geteuid() }).unwrap();
            // SAFETY: reading ids.
            match (inside, unsafe { libc::geteuid() }) {
                (0, 65534) => 0,
                _ => 11,
            }
        });
        assert_eq!(code, 0);
    }

    #[test]
    fn open_namespace_names_a_missing_file() {
        let e = open_namespace("/proc/999999999/ns/mnt").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
