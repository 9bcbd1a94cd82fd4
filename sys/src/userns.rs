//! User namespaces with a given mapping: a remapped container's (root is the user), the one its
//! image layers are idmapped through, and the one every other user's container runs in (the user
//! and their groups mapped to themselves, as under Pyxis and Enroot).

use std::os::fd::{FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, fork};

use crate::SysError;

/// One line of /proc/PID/uid_map or gid_map: `size` ids from `inside` map to ids from `outside`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub inside: u32,
    pub outside: u32,
    pub size: u32,
}

fn map_text(ranges: &[Range]) -> String {
    ranges
        .iter()
        .map(|r| format!("{} {} {}\n", r.inside, r.outside, r.size))
        .collect()
}

/// The mapping image layers are idmapped with when the container maps its id 0 to `host`: the
/// image's id 0 becomes `host` and every other id stays itself, so files of the image's other
/// users keep their owners (and can be copied up) while its root's files become the user's.
/// The image's own id `host` and the host's id 0 are left out: they have no counterpart.
pub fn layer_map(host: u32) -> Vec<Range> {
    if host == 0 {
        return vec![Range {
            inside: 0,
            outside: 0,
            size: u32::MAX - 1,
        }];
    }
    let mut ranges = vec![Range {
        inside: 0,
        outside: host,
        size: 1,
    }];
    if host > 1 {
        ranges.push(Range {
            inside: 1,
            outside: 1,
            size: host - 1,
        });
    }
    // Ids go up to 2^32 - 2: (uid_t)-1 is never a valid id.
    if host < u32::MAX - 1 {
        ranges.push(Range {
            inside: host + 1,
            outside: host + 1,
            size: u32::MAX - 1 - host,
        });
    }
    ranges
}

/// The most lines a uid_map or gid_map takes (Linux 4.15 and later).
const MAX_EXTENTS: usize = 340;

/// The mappings of a container whose user keeps their own ids (no remap-root): the user's uid to
/// itself, and each of their groups to itself (consecutive gids in one line), so `setgroups`
/// keeps every group inside. Every other id, root's included, is unmapped: it shows as the
/// overflow id (nobody) and no process inside can become it. `None` for root (its containers
/// keep the host's namespace) and for a user in more groups than a gid_map can hold.
pub fn self_map(uid: u32, gid: u32, groups: &[u32]) -> Option<(Vec<Range>, Vec<Range>)> {
    if uid == 0 {
        return None;
    }
    let mut ids: Vec<u32> = groups.iter().copied().chain([gid]).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut gids: Vec<Range> = Vec::new();
    for id in ids {
        match gids.last_mut() {
            Some(r) if u64::from(r.inside) + u64::from(r.size) == u64::from(id) => r.size += 1,
            _ => gids.push(Range {
                inside: id,
                outside: id,
                size: 1,
            }),
        }
    }
    let uids = vec![Range {
        inside: uid,
        outside: uid,
        size: 1,
    }];
    (gids.len() <= MAX_EXTENTS).then_some((uids, gids))
}

/// Whether `pid`'s user namespace maps id 0 to another host id (a remapped container).
fn maps_root_elsewhere(pid: i32) -> Option<bool> {
    let mut map = std::fs::File::open(format!("/proc/{pid}/uid_map")).ok()?;
    let map = crate::privfs::read_bounded(&mut map, 64 << 10).ok()?;
    Some(String::from_utf8_lossy(&map).lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() == 3 && f[0] == "0" && f[1] != "0"
    }))
}

/// For `berth export` and `--container-save` of a running container: the (uid, gid) its image
/// layers were idmapped to by [`user_layer_ids`], so the export reads its files through the
/// inverse mapping and the saved image keeps the image's root files root's (files the user made
/// or changed are saved as root's too, as Enroot's export writes every file as root's). Told by
/// the kernel, not by a record: init (`pid`) is not remapped (its user namespace, the host's or one
/// of [`self_map`], maps no one to root), runs as a uid other than 0, and the container's `/`
/// belongs to that uid, which berth makes it only when it idmapped the layers (a user cannot
/// give a file away, and a read-only container's or one whose layers could not be idmapped keeps
/// root's).
pub fn idmapped_user_of(pid: i32) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    if maps_root_elsewhere(pid)? {
        return None;
    }
    let mut status = std::fs::File::open(format!("/proc/{pid}/status")).ok()?;
    let status = crate::privfs::read_bounded(&mut status, 64 << 10).ok()?;
    let status = String::from_utf8_lossy(&status);
    // "Uid:\treal\teffective\tsaved\tfs": init runs with all four the same.
    let id = |key: &str| -> Option<u32> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().nth(1)?.parse().ok()
    };
    let (uid, gid) = (id("Uid:")?, id("Gid:")?);
    let root = std::fs::metadata(format!("/proc/{pid}/root")).ok()?;
    (uid != 0 && root.uid() == uid).then_some((uid, gid))
}

/// Makes a user namespace with these mappings and returns a descriptor of it (which keeps it
/// alive). Needs CAP_SETUID/CAP_SETGID on the host for mappings to other ids than the caller's.
pub fn create(uids: &[Range], gids: &[Range]) -> Result<OwnedFd, SysError> {
    let fail = |what: &'static str, e: &dyn std::fmt::Display| SysError::Userns {
        what,
        detail: e.to_string(),
    };
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| fail("creating a pipe", &e))?;
    let (go_r, go_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| fail("creating a pipe", &e))?;
    // SAFETY: the child makes only async-signal-safe syscalls (unshare, write, read) and _exits,
    // so forking is sound even if the caller has other threads.
    match unsafe { fork() }.map_err(|e| fail("forking for a user namespace", &e))? {
        ForkResult::Child => {
            drop(ready_r);
            drop(go_w);
            // SAFETY: plain syscalls on fds this process owns; _exit never returns.
            unsafe {
                let ok = libc::unshare(libc::CLONE_NEWUSER) == 0;
                let byte = [u8::from(ok)];
                libc::write(
                    std::os::fd::AsRawFd::as_raw_fd(&ready_w),
                    byte.as_ptr().cast(),
                    1,
                );
                // Wait until the parent has written the maps and opened the namespace.
                let mut b = [0u8; 1];
                libc::read(
                    std::os::fd::AsRawFd::as_raw_fd(&go_r),
                    b.as_mut_ptr().cast(),
                    1,
                );
                libc::_exit(0)
            }
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            drop(go_r);
            let result = (|| {
                let mut byte = [0u8; 1];
                match nix::unistd::read(&ready_r, &mut byte) {
                    Ok(1) if byte[0] == 1 => {}
                    _ => {
                        return Err(SysError::Unshare);
                    }
                }
                let proc = format!("/proc/{child}");
                std::fs::write(format!("{proc}/uid_map"), map_text(uids))
                    .map_err(|e| fail("writing the user namespace's uid_map", &e))?;
                std::fs::write(format!("{proc}/gid_map"), map_text(gids))
                    .map_err(|e| fail("writing the user namespace's gid_map", &e))?;
                let path = std::ffi::CString::new(format!("{proc}/ns/user")).expect("no NUL");
                // SAFETY: open with a valid NUL-terminated path.
                let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
                if fd < 0 {
                    return Err(fail("opening the user namespace", &Errno::last()));
                }
                // SAFETY: a fresh fd that nothing else owns.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            })();
            drop(go_w);
            let _ = waitpid(child, None);
            result
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_map_root_to_the_user_and_keep_every_other_id() {
        let map = layer_map(1000);
        assert_eq!(map_text(&map), "0 1000 1\n1 1 999\n1001 1001 4294966294\n");
        // Ranges neither overlap inside nor outside, and the last id is (uid_t)-2.
        let last = map.last().unwrap();
        assert_eq!(
            u64::from(last.inside) + u64::from(last.size) - 1,
            u64::from(u32::MAX) - 1
        );
        assert_eq!(map_text(&layer_map(1)), "0 1 1\n2 2 4294967293\n");
        assert_eq!(layer_map(0).len(), 1);
    }

    #[test]
    fn a_users_own_map_keeps_the_user_and_each_group_and_nothing_else() {
        let (uids, gids) = self_map(1000, 1000, &[27, 1000, 1001, 1002, 4294967294]).unwrap();
        assert_eq!(map_text(&uids), "1000 1000 1\n");
        assert_eq!(
            map_text(&gids),
            "27 27 1\n1000 1000 3\n4294967294 4294967294 1\n"
        );
        assert!(
            self_map(0, 0, &[]).is_none(),
            "root keeps the host's namespace"
        );
        // One line per group that has no neighbour: past the kernel's 340, no namespace.
        let sparse: Vec<u32> = (0..341).map(|g| 2000 + 2 * g).collect();
        assert!(self_map(1000, 1000, &sparse).is_none());
        assert!(self_map(1000, 1000, &sparse[..339]).is_some());
    }
}
