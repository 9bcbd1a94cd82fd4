//! Per-container state directories under the configured state dir, and reclaiming what a berth
//! killed with SIGKILL left behind: its cgroup and its directory (its mounts died with the
//! container's mount namespace).
//!
//! The state holds secrets (a container's Spec carries its environment: tokens, keys) and what
//! root trusts later (the cgroup a record names is killed and removed), so no other user may read
//! or change any of it (DESIGN.md, "Privilege model"):
//! - `<state>`: root's, 0711, made and checked with [`privfs::root_dir`]: others pass through it
//!   to their own index but cannot list it.
//! - `<state>/<id>/`: root's, 0700: `state.json` (the [`Record`]), `config.json` (the Spec),
//!   `work/` (where init mounts the overlay's upper layer), files 0600.
//! - `<state>/users/<uid>/`: 0500, owned by `uid`, no one else may enter: one root-owned 0444 copy
//!   of the record of each container whose process runs as `uid` on the host. It is what
//!   `berth ps` shows that user; a user can only spoil their own view of it.
//! - other verbs' private subdirectories ([`private_dir`], 0700), e.g. `berth health`'s marks.
//!
//! Files are written with `*at` calls on directory fds (a fresh temporary name opened
//! `O_CREAT|O_EXCL|O_NOFOLLOW`, then `renameat`), and read through fds opened without following
//! symlinks, bounded.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode};
use nix::unistd::UnlinkatFlags;
use serde::{Deserialize, Serialize};

use berth_cgroup::Cgroup;
use berth_sys::privfs;

/// Mode of the state directory: others may pass through (to their own index), not list it.
pub const STATE_MODE: u32 = 0o711;
/// Mode of a container's directory and of other private subdirectories.
const PRIVATE_MODE: u32 = 0o700;
/// The per-user indexes `berth ps` reads.
const USERS: &str = "users";
/// Mode of a user's index directory (owned by the user).
const USER_INDEX_MODE: u32 = 0o500;
const RECORD_LIMIT: u64 = 1 << 20;
/// A Spec carries the environment, which may be large, never unbounded.
const SPEC_LIMIT: u64 = 64 << 20;

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub id: String,
    /// The berth process that owns the container, identified by pid and start time so a reused
    /// pid is not mistaken for it.
    pub owner_pid: i32,
    pub owner_start: u64,
    pub cgroup: PathBuf,
    /// The container's init (its namespaces are /proc/PID/ns/*); 0 before it started.
    #[serde(default)]
    pub init_pid: i32,
    /// What the container belongs to: `job`, `step`, `name`, `uid`, ... `uid` is the host uid
    /// the container's process runs as ([`with_uid`]): whose container it is.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl Record {
    /// The host uid the container's process runs as (0 when unknown).
    pub fn uid(&self) -> u32 {
        self.labels
            .get("uid")
            .and_then(|u| u.parse().ok())
            .unwrap_or(0)
    }
}

/// The host uid `spec`'s process runs as: its uid, mapped through the Spec's user namespace when
/// it has one (an unmapped uid is the overflow uid, nobody).
pub fn host_uid(spec: &oci_spec::runtime::Spec) -> u32 {
    let uid = spec.process().as_ref().map_or(0, |p| p.user().uid());
    let Some(linux) = spec.linux().as_ref() else {
        return uid;
    };
    let userns = linux
        .namespaces()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::User);
    if !userns {
        return uid;
    }
    linux
        .uid_mappings()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| uid >= m.container_id() && uid - m.container_id() < m.size())
        .map_or(65534, |m| m.host_id() + (uid - m.container_id()))
}

/// `labels` with `uid` set to the host uid `spec`'s process runs as, which decides whose
/// container it is (`berth ps`, lookups by name).
pub fn with_uid(
    labels: &BTreeMap<String, String>,
    spec: &oci_spec::runtime::Spec,
) -> BTreeMap<String, String> {
    let mut labels = labels.clone();
    labels.insert("uid".into(), host_uid(spec).to_string());
    labels
}

fn other(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, message)
}

/// Opens the state directory, making it if needed: root's, 0711, and nothing above it another
/// user could change (refused in one line otherwise). For root only.
pub fn open_root(state_dir: &Path) -> std::io::Result<OwnedFd> {
    privfs::root_dir(state_dir, STATE_MODE).map_err(|e| other(e.to_string()))
}

/// A private subdirectory `name` of the state directory (root's, 0700), for other verbs' files
/// (`berth health`'s marks). For root only.
pub fn private_dir(state_dir: &Path, name: &str) -> std::io::Result<OwnedFd> {
    let base = open_root(state_dir)?;
    root_subdir(&base, name, PRIVATE_MODE).map_err(|e| annotate(e, &state_dir.join(name)))
}

fn annotate(e: std::io::Error, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn open_dir_at(dir: &impl AsFd, name: &OsStr, flags: OFlag) -> std::io::Result<OwnedFd> {
    nix::fcntl::openat(
        dir,
        name,
        flags | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(std::io::Error::from)
}

/// Makes (if needed) and opens the directory `name` in the root-owned `base`: root's, `mode`.
/// One that is not root's (left from before berth checked its state directory) is refused.
fn root_subdir(base: &impl AsFd, name: &str, mode: u32) -> std::io::Result<OwnedFd> {
    match nix::sys::stat::mkdirat(base, name, Mode::from_bits_truncate(mode)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let fd = open_dir_at(base, OsStr::new(name), OFlag::O_RDONLY)?;
    let st = nix::sys::stat::fstat(&fd)?;
    if st.st_uid != 0 {
        return Err(other(format!(
            "is owned by uid {}, not root; remove it and retry",
            st.st_uid
        )));
    }
    if st.st_mode & 0o7777 != mode {
        nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(mode))?;
    }
    Ok(fd)
}

/// Writes `bytes` to `name` in `dir` with `mode`: under a fresh temporary name (created, never
/// followed) renamed into place, so readers never see half a file and nothing planted at either
/// name is written through.
pub fn write_at(dir: &impl AsFd, name: &str, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let fd = nix::fcntl::openat(
        dir,
        tmp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(mode),
    )?;
    let written = (|| {
        // The umask must not decide who reads it.
        nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(mode))?;
        File::from(fd).write_all(bytes)?;
        nix::fcntl::renameat(dir, tmp.as_str(), dir, name)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = nix::unistd::unlinkat(dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    }
    written
}

/// Reads the regular file `name` in `dir` without following a symlink, at most `limit` bytes.
pub fn read_at(dir: &impl AsFd, name: &OsStr, limit: u64) -> std::io::Result<(Vec<u8>, FileStat)> {
    let fd = nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let st = nix::sys::stat::fstat(&fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    Ok((privfs::read_bounded(&mut File::from(fd), limit)?, st))
}

/// Removes `name` in `dir` (a file, or a directory and everything in it), following no symlink.
pub fn remove_at(dir: &impl AsFd, name: &str) -> std::io::Result<()> {
    match nix::unistd::unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::EISDIR) | Err(Errno::EPERM) => {}
        Err(e) => return Err(e.into()),
    }
    // std's remove_dir_all opens every level O_NOFOLLOW; /proc/self/fd/N pins `dir` itself.
    let fd = dir.as_fd().try_clone_to_owned()?;
    match std::fs::remove_dir_all(privfs::fd_path(&fd).join(name)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A container id as berth makes them: one plain name, not hidden, not one of the state
/// directory's own subdirectories.
fn is_id(id: &str) -> bool {
    privfs::is_plain_name(id)
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Opens the container directory `id` in the state directory `base` and reads its record: the
/// directory and the record root's and no one else's to change, else `None` (what another user
/// may have left in a state directory that was not yet checked is never trusted). An older
/// berth's 0755 directory is closed to 0700.
fn open_container(base: &impl AsFd, id: &str) -> Option<(OwnedFd, Record)> {
    if !is_id(id) || id == USERS {
        return None;
    }
    let dir = open_dir_at(base, OsStr::new(id), OFlag::O_RDONLY).ok()?;
    let st = nix::sys::stat::fstat(&dir).ok()?;
    if st.st_uid != 0 || st.st_mode & 0o022 != 0 {
        return None;
    }
    let (bytes, file) = read_at(&dir, OsStr::new("state.json"), RECORD_LIMIT).ok()?;
    if file.st_uid != 0 || file.st_mode & 0o022 != 0 {
        return None;
    }
    let record: Record = serde_json::from_slice(&bytes).ok()?;
    if record.id != id {
        return None;
    }
    if st.st_mode & 0o777 != PRIVATE_MODE {
        nix::sys::stat::fchmod(&dir, Mode::from_bits_truncate(PRIVATE_MODE)).ok()?;
    }
    Some((dir, record))
}

/// A container's state directory; removed on drop unless kept.
#[derive(Debug)]
pub struct StateDir {
    pub path: PathBuf,
    base: OwnedFd,
    dir: OwnedFd,
    id: String,
    /// Whose index lists it.
    uid: u32,
    keep: bool,
}

impl StateDir {
    pub fn create(state_dir: &Path, record: &Record) -> std::io::Result<Self> {
        let base = open_root(state_dir)?;
        Self::create_in(base, state_dir, record)
    }

    /// `create` in the state directory `base` (already opened and checked), named `state_dir`.
    fn create_in(base: OwnedFd, state_dir: &Path, record: &Record) -> std::io::Result<Self> {
        if !is_id(&record.id) || record.id == USERS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("'{}' is not a container id", record.id),
            ));
        }
        let path = state_dir.join(&record.id);
        nix::sys::stat::mkdirat(
            &base,
            record.id.as_str(),
            Mode::from_bits_truncate(PRIVATE_MODE),
        )
        .map_err(|e| annotate(e.into(), &path))?;
        let dir = match open_dir_at(&base, OsStr::new(&record.id), OFlag::O_RDONLY) {
            Ok(dir) => dir,
            Err(e) => {
                let _ = remove_at(&base, &record.id);
                return Err(annotate(e, &path));
            }
        };
        let state = StateDir {
            path,
            base,
            dir,
            id: record.id.clone(),
            uid: record.uid(),
            keep: false,
        };
        nix::sys::stat::fchmod(&state.dir, Mode::from_bits_truncate(PRIVATE_MODE))?;
        nix::sys::stat::mkdirat(&state.dir, "work", Mode::from_bits_truncate(PRIVATE_MODE))?;
        state.save_record(record)?;
        Ok(state)
    }

    /// Rewrites the record and stores the Spec (what joining processes run as).
    pub fn save(&self, record: &Record, spec: &oci_spec::runtime::Spec) -> std::io::Result<()> {
        write_json(&self.dir, "config.json", spec)?;
        self.save_record(record)
    }

    /// Rewrites the record alone (once init's pid is known), and the owner's index entry.
    pub fn save_record(&self, record: &Record) -> std::io::Result<()> {
        write_json(&self.dir, "state.json", record)?;
        if let Err(e) = write_index(&self.base, record) {
            // `berth ps` of the container's user misses it; nothing else depends on the index.
            tracing::warn!(
                "cannot list container {} for uid {}: {e}",
                record.id,
                record.uid()
            );
        }
        Ok(())
    }

    /// Leaves the directory in place when this value is dropped.
    pub fn keep(mut self) {
        self.keep = true;
    }

    /// Where init mounts the tmpfs that holds the overlay's upper layer.
    pub fn work(&self) -> PathBuf {
        self.path.join("work")
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        if !self.keep {
            if self.remove_known() {
                remove_index(&self.base, &self.id, self.uid);
            } else {
                remove_container(&self.base, &self.id, self.uid);
            }
        }
    }
}

impl StateDir {
    /// Removes the directory berth laid out (its record, Spec and `work`) with one unlinkat
    /// each, through the fds already open: no listing, no path walk. False when anything else is
    /// in it (then [`remove_at`] removes what is there).
    fn remove_known(&self) -> bool {
        for (name, flags) in [
            ("state.json", UnlinkatFlags::NoRemoveDir),
            ("config.json", UnlinkatFlags::NoRemoveDir),
            ("work", UnlinkatFlags::RemoveDir),
        ] {
            match nix::unistd::unlinkat(&self.dir, name, flags) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(_) => return false,
            }
        }
        nix::unistd::unlinkat(&self.base, self.id.as_str(), UnlinkatFlags::RemoveDir).is_ok()
    }
}

fn write_json(dir: &impl AsFd, name: &str, value: &impl Serialize) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    write_at(dir, name, &bytes, 0o600)
}

/// Removes a container's directory and its index entry.
fn remove_container(base: &impl AsFd, id: &str, uid: u32) {
    if let Err(e) = remove_at(base, id) {
        tracing::warn!("cannot remove the state of container {id}: {e}");
    }
    remove_index(base, id, uid);
}

/// Opens (making it if needed) `uid`'s index directory: owned by `uid`, group root, 0500.
fn user_index(base: &impl AsFd, uid: u32) -> std::io::Result<OwnedFd> {
    let users = root_subdir(base, USERS, STATE_MODE)?;
    let name = uid.to_string();
    match nix::sys::stat::mkdirat(
        &users,
        name.as_str(),
        Mode::from_bits_truncate(USER_INDEX_MODE),
    ) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let fd = open_dir_at(&users, OsStr::new(&name), OFlag::O_RDONLY)?;
    let st = nix::sys::stat::fstat(&fd)?;
    if st.st_uid != uid && st.st_uid != 0 {
        return Err(other(format!(
            "{USERS}/{name} is owned by uid {}; remove it and retry",
            st.st_uid
        )));
    }
    if st.st_uid != uid || st.st_gid != 0 {
        nix::unistd::fchown(&fd, Some(uid.into()), Some(0.into()))?;
    }
    if st.st_mode & 0o7777 != USER_INDEX_MODE {
        nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(USER_INDEX_MODE))?;
    }
    Ok(fd)
}

/// Lists `record` in its user's index (root's containers are listed for root alone).
fn write_index(base: &impl AsFd, record: &Record) -> std::io::Result<()> {
    let uid = record.uid();
    if uid == 0 {
        return Ok(());
    }
    let dir = user_index(base, uid)?;
    let bytes = serde_json::to_vec(record).map_err(std::io::Error::other)?;
    write_at(&dir, &record.id, &bytes, 0o444)
}

fn remove_index(base: &impl AsFd, id: &str, uid: u32) {
    if uid == 0 {
        return;
    }
    let dir = open_dir_at(base, OsStr::new(USERS), OFlag::O_RDONLY)
        .and_then(|users| open_dir_at(&users, OsStr::new(&uid.to_string()), OFlag::O_RDONLY));
    if let Ok(dir) = dir {
        let _ = nix::unistd::unlinkat(&dir, id, UnlinkatFlags::NoRemoveDir);
    }
}

/// Replaces the Spec stored for the held container `id` (its environment after the image's
/// entrypoint ran, say).
pub fn save_spec(
    state_dir: &Path,
    id: &str,
    spec: &oci_spec::runtime::Spec,
) -> std::io::Result<()> {
    let base = open_root(state_dir)?;
    let (dir, _) = open_container(&base, id).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no container {id} in {}", state_dir.display()),
        )
    })?;
    write_json(&dir, "config.json", spec)
}

/// A container's record and Spec (the Spec only for held containers). Root only: the state is
/// no one else's to read.
pub fn load(state_dir: &Path, id: &str) -> Option<(Record, Option<oci_spec::runtime::Spec>)> {
    let base = open_root(state_dir).ok()?;
    load_in(&base, id)
}

fn load_in(base: &impl AsFd, id: &str) -> Option<(Record, Option<oci_spec::runtime::Spec>)> {
    let (dir, record) = open_container(base, id)?;
    let spec = read_at(&dir, OsStr::new("config.json"), SPEC_LIMIT)
        .ok()
        .filter(|(_, st)| st.st_uid == 0)
        .and_then(|(b, _)| serde_json::from_slice(&b).ok());
    Some((record, spec))
}

/// Removes the state of the container `record` (its cgroup is gone already).
pub fn remove(state_dir: &Path, record: &Record) -> std::io::Result<()> {
    let base = open_root(state_dir)?;
    if !is_id(&record.id) || record.id == USERS {
        return Ok(());
    }
    remove_at(&base, &record.id).map_err(|e| annotate(e, &state_dir.join(&record.id)))?;
    remove_index(&base, &record.id, record.uid());
    Ok(())
}

/// The container records the caller may see: every one for root; for another user, those of
/// their own containers (their index), never anyone else's.
pub fn list(state_dir: &Path) -> Vec<Record> {
    let uid = nix::unistd::geteuid().as_raw();
    if uid != 0 {
        return list_own(state_dir, uid).unwrap_or_default();
    }
    match open_root(state_dir) {
        Ok(base) => list_in(&base),
        // The caller that needs the state directory says why it is refused (open_root).
        Err(e) => {
            tracing::debug!("{e}");
            Vec::new()
        }
    }
}

/// Resolves an id or a name to the id of a container the caller may see ([`list`]): another
/// user's container is never found, exactly like a missing one. A name is unique per user: root
/// names another user's container by id, or by name when only one container has that name.
pub fn find(state_dir: &Path, key: &str) -> Option<String> {
    let records = list(state_dir);
    if let Some(r) = records.iter().find(|r| r.id == key) {
        return Some(r.id.clone());
    }
    let named: Vec<&Record> = records
        .iter()
        .filter(|r| r.labels.get("name").map(String::as_str) == Some(key))
        .collect();
    let me = nix::unistd::geteuid().as_raw();
    match named.as_slice() {
        [one] => Some(one.id.clone()),
        // Root asking for a name several users chose: its own, else none (ids are unique).
        many => many.iter().find(|r| r.uid() == me).map(|r| r.id.clone()),
    }
}

/// Whether `uid` has a container named `name` (names are unique per user).
pub fn name_taken(state_dir: &Path, name: &str, uid: u32) -> bool {
    list(state_dir)
        .iter()
        .any(|r| r.uid() == uid && r.labels.get("name").map(String::as_str) == Some(name))
}

/// Names in the directory `dir`.
fn names(dir: &impl AsFd) -> Vec<std::ffi::OsString> {
    let Ok(fd) = dir.as_fd().try_clone_to_owned() else {
        return Vec::new();
    };
    std::fs::read_dir(privfs::fd_path(&fd))
        .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default()
}

fn list_in(base: &impl AsFd) -> Vec<Record> {
    names(base)
        .iter()
        .filter_map(|n| n.to_str())
        .filter_map(|id| open_container(base, id).map(|(_, record)| record))
        .collect()
}

/// A user's own containers, from their index: `<state>` and `users` root's, the index theirs,
/// each entry root's (what the user planted there themselves is skipped).
fn list_own(state_dir: &Path, uid: u32) -> std::io::Result<Vec<Record>> {
    let flags = OFlag::O_PATH;
    let base = nix::fcntl::open(
        state_dir,
        flags | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let owned = |fd: &OwnedFd, owner: u32| -> std::io::Result<()> {
        let st = nix::sys::stat::fstat(fd)?;
        if st.st_uid == owner && st.st_mode & 0o022 == 0 {
            Ok(())
        } else {
            Err(other("not berth's state directory".into()))
        }
    };
    owned(&base, 0)?;
    let users = open_dir_at(&base, OsStr::new(USERS), flags)?;
    owned(&users, 0)?;
    let mine = open_dir_at(&users, OsStr::new(&uid.to_string()), OFlag::O_RDONLY)?;
    owned(&mine, uid)?;
    Ok(names(&mine)
        .iter()
        .filter_map(|n| {
            let (bytes, st) = read_at(&mine, n, RECORD_LIMIT).ok()?;
            let record: Record = serde_json::from_slice(&bytes).ok()?;
            (st.st_uid == 0 && record.uid() == uid && OsStr::new(&record.id) == n.as_os_str())
                .then_some(record)
        })
        .collect())
}

/// Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat).
pub fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

/// Whether the berth that wrote `record` is still running.
pub fn owner_alive(record: &Record) -> bool {
    process_start(record.owner_pid) == Some(record.owner_start)
}

/// Reclaims the containers of dead berth processes; returns the ids reclaimed. Root only.
pub fn reclaim(state_dir: &Path, kill_timeout: Duration) -> Vec<String> {
    match open_root(state_dir) {
        Ok(base) => reclaim_in(&base, kill_timeout),
        // The caller that needs the state directory says why it is refused (open_root).
        Err(e) => {
            tracing::debug!("{e}");
            Vec::new()
        }
    }
}

fn reclaim_in(base: &impl AsFd, kill_timeout: Duration) -> Vec<String> {
    let mut done = Vec::new();
    for record in list_in(base) {
        // A record still being written by a starting berth has its owner alive too.
        if owner_alive(&record) {
            continue;
        }
        let cgroup = Cgroup::at(record.cgroup.clone());
        if cgroup.path().exists() {
            let _ = cgroup.kill();
            let _ = cgroup.wait_empty(kill_timeout);
            if cgroup.remove().is_err() {
                tracing::warn!(
                    "cannot remove leftover cgroup {}; will retry",
                    cgroup.path().display()
                );
                continue;
            }
        }
        if remove_at(base, &record.id).is_ok() {
            remove_index(base, &record.id, record.uid());
            tracing::debug!("reclaimed leftover container {}", record.id);
            done.push(record.id);
        }
    }
    sweep_indexes(base);
    done
}

/// Drops index entries whose container directory is gone (a berth killed between the two).
fn sweep_indexes(base: &impl AsFd) {
    let Ok(users) = open_dir_at(base, OsStr::new(USERS), OFlag::O_RDONLY) else {
        return;
    };
    for uid in names(&users) {
        let Ok(dir) = open_dir_at(&users, &uid, OFlag::O_RDONLY) else {
            continue;
        };
        for entry in names(&dir) {
            let gone = matches!(
                nix::sys::stat::fstatat(base, entry.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW),
                Err(Errno::ENOENT)
            );
            if gone && !entry.as_bytes().starts_with(b".") {
                let _ = nix::unistd::unlinkat(&dir, entry.as_os_str(), UnlinkatFlags::NoRemoveDir);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_stale_record_is_not() {
        let me = nix::unistd::getpid().as_raw();
        let start = process_start(me).unwrap();
        let mut rec = Record {
            id: "x".into(),
            owner_pid: me,
            owner_start: start,
            cgroup: "/nonexistent".into(),
            init_pid: 0,
            labels: Default::default(),
        };
        assert!(owner_alive(&rec));
        rec.owner_start += 1;
        assert!(!owner_alive(&rec));
    }

    fn open(dir: &Path) -> OwnedFd {
        nix::fcntl::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty()).unwrap()
    }

    #[test]
    fn reclaim_removes_dead_owners_only() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::getpid().as_raw();
        let live = Record {
            id: "live".into(),
            owner_pid: me,
            owner_start: process_start(me).unwrap(),
            cgroup: dir.path().join("no-cgroup-live"),
            init_pid: 0,
            labels: Default::default(),
        };
        let dead = Record {
            id: "dead".into(),
            owner_start: 1,
            cgroup: dir.path().join("no-cgroup-dead"),
            ..live_clone(&live)
        };
        let a = StateDir::create_in(open(dir.path()), dir.path(), &live).unwrap();
        let b = StateDir::create_in(open(dir.path()), dir.path(), &dead).unwrap();
        std::mem::forget(b);
        assert_eq!(
            reclaim_in(&open(dir.path()), Duration::from_millis(10)),
            vec!["dead"]
        );
        assert!(a.path.exists());
        assert!(!dir.path().join("dead").exists());
        drop(a);
        assert!(!dir.path().join("live").exists());
    }

    #[test]
    fn state_files_are_private_and_written_through_no_symlink() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::getpid().as_raw();
        let rec = Record {
            id: "c1".into(),
            owner_pid: me,
            owner_start: process_start(me).unwrap(),
            cgroup: dir.path().join("none"),
            init_pid: 0,
            labels: Default::default(),
        };
        let state = StateDir::create_in(open(dir.path()), dir.path(), &rec).unwrap();
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&state.path), 0o700);
        assert_eq!(mode(&state.path.join("state.json")), 0o600);
        assert_eq!(mode(&state.work()), 0o700);
        // A symlink planted at a file's name is replaced, never written through.
        let target = dir.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, state.path.join("x.json")).unwrap();
        write_at(&state.dir, "x.json", b"new", 0o600).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(std::fs::read(state.path.join("x.json")).unwrap(), b"new");
        // Reads follow no symlink either.
        std::os::unix::fs::symlink(&target, state.path.join("y")).unwrap();
        read_at(&state.dir, OsStr::new("y"), 10).unwrap_err();
        // A bad id never names a path outside.
        for bad in ["..", "a/b", ".hidden", "users", ""] {
            let r = Record {
                id: bad.into(),
                ..live_clone(&rec)
            };
            StateDir::create_in(open(dir.path()), dir.path(), &r).unwrap_err();
        }
    }

    #[test]
    fn the_uid_is_the_host_uid_the_process_runs_as() {
        use oci_spec::runtime::*;
        let user = UserBuilder::default().uid(0u32).gid(0u32).build().unwrap();
        let process = ProcessBuilder::default().user(user).build().unwrap();
        let mapping = LinuxIdMappingBuilder::default()
            .container_id(0u32)
            .host_id(1234u32)
            .size(1u32)
            .build()
            .unwrap();
        let userns = LinuxNamespaceBuilder::default()
            .typ(LinuxNamespaceType::User)
            .build()
            .unwrap();
        let linux = LinuxBuilder::default()
            .namespaces(vec![userns])
            .uid_mappings(vec![mapping])
            .build()
            .unwrap();
        let mut spec = SpecBuilder::default()
            .process(process)
            .linux(linux)
            .build()
            .unwrap();
        assert_eq!(host_uid(&spec), 1234);
        assert_eq!(with_uid(&BTreeMap::new(), &spec)["uid"], "1234");
        spec.set_linux(None);
        assert_eq!(host_uid(&spec), 0);
    }

    fn live_clone(r: &Record) -> Record {
        Record {
            id: r.id.clone(),
            owner_pid: r.owner_pid,
            owner_start: r.owner_start,
            cgroup: r.cgroup.clone(),
            init_pid: r.init_pid,
            labels: r.labels.clone(),
        }
    }
}
