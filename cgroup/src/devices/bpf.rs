//! The `bpf()` syscalls the device filter needs: load a cgroup-device program, list, attach and
//! detach the programs on a cgroup. Hand-written attribute structs instead of libbpf: five
//! commands do not justify a C dependency (see notes/crates.md). Each struct is the prefix of
//! the kernel's `union bpf_attr` for its command; the kernel zero-fills the rest. The structs
//! must have no padding: padding bytes are uninitialized, and the kernel rejects non-zero bytes
//! in fields it knows (EINVAL), e.g. `relative_fd` right after `replace_bpf_fd` since Linux 6.6.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::sys::resource::{Resource, getrlimit, setrlimit};

use super::program::Insn;

const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_PROG_DETACH: libc::c_int = 9;
const BPF_PROG_GET_FD_BY_ID: libc::c_int = 13;
const BPF_PROG_QUERY: libc::c_int = 16;

const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
/// Several programs may sit on one cgroup (ours, systemd's on an ancestor): all must allow.
const BPF_F_ALLOW_MULTI: u32 = 1 << 1;

/// Same license as berth; the program calls no GPL-only helper.
const LICENSE: &[u8] = b"Apache-2.0\0";
/// Shows up in `bpftool prog`; at most 15 bytes plus NUL.
const PROG_NAME: &[u8] = b"berth_devices";
/// Enough for the verifier's complaint about a program of a few hundred instructions.
const LOG_SIZE: usize = 64 * 1024;
/// How much of the verifier log goes into the one-line error.
const LOG_TAIL: usize = 600;

#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
#[derive(Default)]
struct AttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
}

#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
}

#[repr(C)]
#[derive(Default)]
struct GetFdByIdAttr {
    prog_id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `bpf(cmd, attr, sizeof attr)`. Every `T` here is one of the `#[repr(C)]` attr prefixes above.
fn sys_bpf<T>(cmd: libc::c_int, attr: &mut T) -> io::Result<libc::c_long> {
    let size = u32::try_from(std::mem::size_of::<T>()).unwrap_or(u32::MAX);
    // SAFETY: `attr` is a live, exclusively borrowed, correctly laid out prefix of `union
    // bpf_attr` for `cmd`, and `size` is its size, so the kernel reads and writes only inside
    // it. Pointers stored in it (instructions, license, log, id array) are set by the callers
    // to buffers that outlive this call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr).cast::<c_void>(),
            size,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn fd_from_ret(ret: libc::c_long) -> io::Result<OwnedFd> {
    let raw = libc::c_int::try_from(ret)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bpf() returned a bad fd"))?;
    // SAFETY: on success these bpf() commands return a new file descriptor that nothing else
    // owns; wrapping it makes us its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn u32_fd(fd: BorrowedFd<'_>) -> u32 {
    // Open descriptors are never negative.
    u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX)
}

fn try_load(insns: &[Insn], log: Option<&mut [u8]>) -> io::Result<OwnedFd> {
    let mut name = [0u8; 16];
    name[..PROG_NAME.len()].copy_from_slice(PROG_NAME);
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: u32::try_from(insns.len())
            .map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
        insns: insns.as_ptr() as u64,
        license: LICENSE.as_ptr() as u64,
        prog_name: name,
        ..ProgLoadAttr::default()
    };
    if let Some(buf) = log {
        attr.log_level = 1;
        attr.log_size = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        attr.log_buf = buf.as_mut_ptr() as u64;
    }
    fd_from_ret(sys_bpf(BPF_PROG_LOAD, &mut attr)?)
}

/// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK (default 64 KiB or 8 MiB) and say
/// EPERM when it runs out. Raised only after such a failure, so newer kernels leave the process
/// limit (which containers inherit) alone.
fn raise_memlock() {
    let target = libc::RLIM_INFINITY;
    if setrlimit(Resource::RLIMIT_MEMLOCK, target, target).is_err() {
        // Without CAP_SYS_RESOURCE the hard limit cannot move; the soft one still can.
        if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_MEMLOCK) {
            let _ = setrlimit(Resource::RLIMIT_MEMLOCK, hard, hard);
        }
    }
}

/// Load the program. On failure, returns the error and the verifier log as one line.
pub(crate) fn load_device_program(insns: &[Insn]) -> Result<OwnedFd, (io::Error, String)> {
    let first = match try_load(insns, None) {
        Ok(fd) => return Ok(fd),
        Err(e) => e,
    };
    if first.raw_os_error() == Some(libc::EPERM) {
        raise_memlock();
        if let Ok(fd) = try_load(insns, None) {
            return Ok(fd);
        }
    }
    // Load again with a log buffer only now: logging slows every successful load.
    let mut log = vec![0u8; LOG_SIZE];
    match try_load(insns, Some(&mut log)) {
        Ok(fd) => Ok(fd),
        Err(e) => Err((e, one_line_log(&log))),
    }
}

/// The end of the verifier log (where the reason is), newlines folded so the error stays one
/// line.
fn one_line_log(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    let joined = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    if joined.len() <= LOG_TAIL {
        return joined;
    }
    let mut start = joined.len() - LOG_TAIL;
    while !joined.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &joined[start..])
}

pub(crate) fn attach(prog: BorrowedFd<'_>, cgroup: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = AttachAttr {
        target_fd: u32_fd(cgroup),
        attach_bpf_fd: u32_fd(prog),
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: BPF_F_ALLOW_MULTI,
        ..AttachAttr::default()
    };
    sys_bpf(BPF_PROG_ATTACH, &mut attr).map(|_| ())
}

/// Detach `prog` from `cgroup`; a program that is already gone counts as detached.
pub(crate) fn detach(prog: BorrowedFd<'_>, cgroup: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = AttachAttr {
        target_fd: u32_fd(cgroup),
        attach_bpf_fd: u32_fd(prog),
        attach_type: BPF_CGROUP_DEVICE,
        ..AttachAttr::default()
    };
    match sys_bpf(BPF_PROG_DETACH, &mut attr) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Fds of the device programs attached directly to `cgroup` (not inherited from ancestors).
pub(crate) fn attached_programs(cgroup: BorrowedFd<'_>) -> io::Result<Vec<OwnedFd>> {
    let mut ids = vec![0u32; 16];
    loop {
        let mut attr = QueryAttr {
            target_fd: u32_fd(cgroup),
            attach_type: BPF_CGROUP_DEVICE,
            prog_ids: ids.as_mut_ptr() as u64,
            prog_cnt: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            ..QueryAttr::default()
        };
        match sys_bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => {
                let n = usize::try_from(attr.prog_cnt).unwrap_or(0).min(ids.len());
                ids.truncate(n);
                break;
            }
            // The kernel set prog_cnt to how many there are.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && ids.len() < 1 << 16 => {
                let want = usize::try_from(attr.prog_cnt).unwrap_or(0);
                ids = vec![0u32; want.max(ids.len() * 2)];
            }
            Err(e) => return Err(e),
        }
    }
    let mut fds = Vec::with_capacity(ids.len());
    for id in ids {
        let mut attr = GetFdByIdAttr {
            prog_id: id,
            ..GetFdByIdAttr::default()
        };
        match sys_bpf(BPF_PROG_GET_FD_BY_ID, &mut attr) {
            Ok(ret) => fds.push(fd_from_ret(ret)?),
            // Detached and freed since the query.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_layouts_match_the_kernel() {
        // Offsets from include/uapi/linux/bpf.h.
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, insns), 8);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, log_buf), 32);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, prog_name), 48);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(AttachAttr, attach_flags), 12);
        assert_eq!(std::mem::offset_of!(QueryAttr, prog_ids), 16);
        assert_eq!(std::mem::offset_of!(QueryAttr, prog_cnt), 24);
        assert_eq!(std::mem::offset_of!(QueryAttr, prog_attach_flags), 32);
    }

    #[test]
    fn attrs_have_no_padding() {
        use std::mem::size_of;
        assert_eq!(size_of::<ProgLoadAttr>(), 72);
        assert_eq!(size_of::<AttachAttr>(), 5 * 4);
        assert_eq!(size_of::<QueryAttr>(), 40);
        assert_eq!(size_of::<GetFdByIdAttr>(), 3 * 4);
    }

    #[test]
    fn prog_name_fits() {
        assert!(PROG_NAME.len() < 16);
    }

    #[test]
    fn log_is_folded_and_trimmed() {
        let mut buf = b"func#0 @0\n0: R1=ctx() R10=fp0\n\ninvalid bpf_context access\n".to_vec();
        buf.extend([0u8; 8]);
        assert_eq!(
            one_line_log(&buf),
            "func#0 @0; 0: R1=ctx() R10=fp0; invalid bpf_context access"
        );
        let long = "x".repeat(5000) + "\nthe reason";
        let s = one_line_log(long.as_bytes());
        assert!(s.len() <= LOG_TAIL + 3 && s.ends_with("the reason"), "{s}");
        assert_eq!(one_line_log(&[0u8; 4]), "");
    }
}
