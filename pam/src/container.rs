//! Into the job's berth container: its mount, UTS and IPC namespaces, joined by sshd's process
//! for the connection before it forks the session, so the shell, commands, `internal-sftp` and the
//! session's ptys (the container's own devpts) are the container's. The network stays the node's,
//! so port forwarding works as on the host.
//!
//! A container is joined only when berth's root-only state says it belongs to this job and this
//! user, and its init process, checked now, is this user's and in the container's cgroup (a pid
//! reused since is not joined). Of several, the one the user named in `~/.config/berth/
//! ssh-container` (read with the user's own file system ids), else the newest: sshd opens the PAM
//! session before the client's `SendEnv` variables arrive, so no per-connection variable can
//! choose. The session's environment is the container's process environment from the Spec berth
//! keeps in its root-only state directory, less the login's own variables (HOME, USER, ...).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::PamError;

/// The parts of berth's container record (runtime/src/state.rs's `Record`) the module reads.
#[derive(Debug, serde::Deserialize)]
struct Record {
    id: String,
    cgroup: PathBuf,
    #[serde(default)]
    init_pid: i32,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// A container of the user's job on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    /// `--container-name`, when it has one.
    pub name: Option<String>,
    pub init_pid: i32,
    /// Its state directory (root's): `config.json` holds the process's environment.
    pub dir: PathBuf,
    /// The init's start time (clock ticks after boot): the newest is joined.
    start: u64,
}

impl Container {
    /// How the user reads it: the name, else the id.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.id)
    }
}

/// Owner and mode checks: root's, writable by no one else.
fn roots(meta: &std::fs::Metadata) -> bool {
    meta.uid() == 0 && meta.mode() & 0o022 == 0
}

/// The live container of `job` whose process runs as `uid`, from berth's state directory: the
/// one named `want` when there is one, else the newest; None when there is none (or the state
/// cannot be read).
pub fn find(state_dir: &Path, uid: u32, job: u64, want: Option<&str>) -> Option<Container> {
    if !std::fs::symlink_metadata(state_dir).is_ok_and(|m| m.is_dir() && roots(&m)) {
        return None;
    }
    let job = job.to_string();
    let uid_text = uid.to_string();
    let all: Vec<Container> = std::fs::read_dir(state_dir)
        .ok()?
        .flatten()
        .take(4096)
        .filter(|e| e.file_name() != OsStr::new("users"))
        .filter_map(|e| {
            let dir = e.path();
            let meta = std::fs::symlink_metadata(&dir).ok()?;
            if !meta.is_dir() || !roots(&meta) {
                return None;
            }
            let record = read_record(&dir.join("state.json"))?;
            let label = |k: &str| record.labels.get(k).map(String::as_str);
            if label("job") != Some(job.as_str()) || label("uid") != Some(uid_text.as_str()) {
                return None;
            }
            let start = live_init(record.init_pid, uid, &record.cgroup)?;
            Some(Container {
                name: record.labels.get("name").cloned(),
                id: record.id,
                init_pid: record.init_pid,
                dir,
                start,
            })
        })
        .collect();
    let newest = |c: &&Container, d: &&Container| c.start.cmp(&d.start).then(c.id.cmp(&d.id));
    want.and_then(|w| {
        all.iter()
            .filter(|c| c.name.as_deref() == Some(w))
            .max_by(newest)
    })
    .or_else(|| all.iter().max_by(newest))
    .cloned()
}

/// A root-owned file of berth's state, not writable by others, at most `limit` bytes.
fn read_root_file(path: &Path, limit: u64) -> Option<Vec<u8>> {
    let file = File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || !roots(&meta) {
        return None;
    }
    let mut text = Vec::new();
    file.take(limit).read_to_end(&mut text).ok()?;
    Some(text)
}

fn read_record(path: &Path) -> Option<Record> {
    serde_json::from_slice(&read_root_file(path, 1 << 20)?).ok()
}

/// How much of a container's environment a session takes: the Spec is berth's own, but the
/// values came from the image and the job's user.
const MAX_ENV_VARS: usize = 1024;
const MAX_ENV_BYTES: usize = 1 << 20;

/// Variables that stay the login's (sshd sets them for this session), not the container's.
const LOGIN_VARS: &[&str] = &[
    "HOME", "USER", "LOGNAME", "SHELL", "MAIL", "TERM", "DISPLAY", "PWD", "OLDPWD", "SHLVL", "_",
];

/// The container's process environment (`process.env` of the Spec in its state directory,
/// root's), less the login's own variables: what the session's shell and commands get.
pub fn environment(c: &Container) -> Vec<String> {
    let Some(bytes) = read_root_file(&c.dir.join("config.json"), 16 << 20) else {
        return Vec::new();
    };
    let Ok(spec) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return Vec::new();
    };
    let Some(env) = spec.pointer("/process/env").and_then(|e| e.as_array()) else {
        return Vec::new();
    };
    session_env(env.iter().filter_map(|v| v.as_str()))
}

fn session_env<'a>(env: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out = Vec::new();
    let mut bytes = 0;
    for var in env {
        let Some((name, _)) = var.split_once('=') else {
            continue;
        };
        let valid = name
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
        if name.is_empty()
            || !valid
            || var.contains('\0')
            || LOGIN_VARS.contains(&name)
            || name.starts_with("SSH_")
        {
            continue;
        }
        bytes += var.len();
        if out.len() >= MAX_ENV_VARS || bytes > MAX_ENV_BYTES {
            break;
        }
        out.push(var.to_string());
    }
    out
}

/// The container name the user chose for their logins: the first line of `~/.config/berth/
/// ssh-container` (a name only: letters, digits, `.`, `_`, `-`), opened with the user's file
/// system ids (so root's rights are never used on a path the user controls), not through a final
/// symlink, only a regular file of the user's own that no one else may write.
pub fn chosen_name(home: &Path, uid: u32, gid: u32) -> Option<String> {
    let path = home.join(".config/berth/ssh-container");
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: setfsuid/setfsgid change this thread's file system ids only; set back below.
    let (old_gid, old_uid) = unsafe { (libc::setfsgid(gid), libc::setfsuid(uid)) };
    // SAFETY: cpath is a NUL-terminated path; O_NONBLOCK keeps a FIFO from holding the login.
    let fd = unsafe {
        libc::open(
            cpath.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    // SAFETY: back to the ids this thread had.
    unsafe {
        libc::setfsuid(u32::try_from(old_uid).unwrap_or(0));
        libc::setfsgid(u32::try_from(old_gid).unwrap_or(0));
    }
    if fd < 0 {
        return None;
    }
    // SAFETY: fd was just opened and is owned by nothing else.
    let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return None;
    }
    let mut text = String::new();
    file.take(256).read_to_string(&mut text).ok()?;
    valid_name(text.lines().next()?.trim()).map(str::to_string)
}

/// `name` when it is a container name berth accepts: 1 to 64 of letters, digits, `.`, `_`, `-`.
pub fn valid_name(name: &str) -> Option<&str> {
    let ok = (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    ok.then_some(name)
}

/// The start time of `pid` when it is `uid`'s and in `cgroup` (its cgroup v2 path ends the
/// record's), else None.
fn live_init(pid: i32, uid: u32, cgroup: &Path) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let status = std::fs::read_to_string(proc.join("status")).ok()?;
    let real_uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse::<u32>()
        .ok()?;
    if real_uid != uid {
        return None;
    }
    let cgroups = std::fs::read_to_string(proc.join("cgroup")).ok()?;
    let v2 = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?;
    let inside = v2.trim_start_matches('/');
    if inside.is_empty() || !cgroup.ends_with(inside) {
        return None;
    }
    let stat = std::fs::read_to_string(proc.join("stat")).ok()?;
    // Field 22, counted after the command's closing parenthesis (a name may hold spaces).
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Joins `c`'s IPC, UTS and mount namespaces (all opened before any is joined), moves to its
/// root and sets no_new_privs, which the session's processes inherit.
pub fn join(c: &Container) -> Result<(), PamError> {
    let open = |ns: &str| {
        let path = PathBuf::from(format!("/proc/{}/ns/{ns}", c.init_pid));
        File::open(&path).map_err(|source| PamError::Join { path, source })
    };
    let namespaces = [
        (open("ipc")?, libc::CLONE_NEWIPC),
        (open("uts")?, libc::CLONE_NEWUTS),
        (open("mnt")?, libc::CLONE_NEWNS),
    ];
    for (file, kind) in &namespaces {
        // SAFETY: setns on a namespace fd this function holds open.
        if unsafe { libc::setns(file.as_raw_fd(), *kind) } != 0 {
            return Err(PamError::Join {
                path: PathBuf::from(format!("/proc/{}/ns", c.init_pid)),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    // The old working directory is the host's; the container's root is the session's start.
    std::env::set_current_dir("/").map_err(|source| PamError::Join {
        path: PathBuf::from("/"),
        source,
    })?;
    // SAFETY: prctl with PR_SET_NO_NEW_PRIVS and constant arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(PamError::Join {
            path: PathBuf::from("no_new_privs"),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_others_may_write_is_not_read() {
        let d = std::env::temp_dir().join(format!("pam-berth-state-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        assert_eq!(find(&d, 0, 1, None), None);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn records_of_another_job_or_user_or_a_dead_init_are_skipped() {
        let d = std::env::temp_dir().join(format!("pam-berth-state2-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
        // This process stands for a container's init: its own cgroup v2 path is the record's.
        let me = std::process::id();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let v2 = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap()
            .to_string();
        let cgroup = format!("/sys/fs/cgroup{v2}");
        let write = |id: &str, job: &str, uid: &str, pid: u32| {
            let dir = d.join(id);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
            let json = format!(
                r#"{{"id":"{id}","owner_pid":1,"owner_start":1,"cgroup":"{cgroup}","init_pid":{pid},"labels":{{"job":"{job}","uid":"{uid}","name":"dev"}}}}"#
            );
            std::fs::write(dir.join("state.json"), json).unwrap();
        };
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        write("a", "7", &uid.to_string(), me);
        write("b", "8", &uid.to_string(), me);
        write("c", "7", "4242", me);
        write("d", "7", &uid.to_string(), 0);
        let found = find(&d, uid, 7, None);
        if v2 != "/" {
            let found = found.unwrap();
            assert_eq!((found.id.as_str(), found.label()), ("a", "dev"));
            // A name of no container of the job's: the newest, as without one.
            assert_eq!(find(&d, uid, 7, Some("x")).unwrap().id, "a");
            assert_eq!(find(&d, uid, 7, Some("dev")).unwrap().id, "a");
        }
        assert_eq!(find(&d, uid, 9, None), None);
        // Another job's container is never picked by its name.
        assert_eq!(find(&d, uid, 9, Some("dev")), None);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_session_gets_the_containers_variables_but_not_the_logins() {
        let env = session_env(
            [
                "PATH=/opt/image/bin:/usr/bin",
                "HOME=/root",
                "USER=root",
                "SSH_AUTH_SOCK=/x",
                "1BAD=x",
                "BAD-NAME=x",
                "NOEQUALS",
                "LANG=C.UTF-8",
                "EMPTY=",
            ]
            .into_iter(),
        );
        assert_eq!(
            env,
            ["PATH=/opt/image/bin:/usr/bin", "LANG=C.UTF-8", "EMPTY="]
        );
        let many: Vec<String> = (0..5000).map(|i| format!("V{i}=x")).collect();
        assert_eq!(
            session_env(many.iter().map(String::as_str)).len(),
            MAX_ENV_VARS
        );
    }

    #[test]
    fn only_a_plain_name_is_a_choice() {
        for ok in ["dev", "a.b_c-1"] {
            assert_eq!(valid_name(ok), Some(ok));
        }
        for bad in ["", ".hidden", "../x", "a/b", "a b", "x\0", &"n".repeat(65)] {
            assert_eq!(valid_name(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_choice_file_must_be_the_users_own_regular_file() {
        let home = std::env::temp_dir().join(format!("pam-berth-home-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&home);
        let conf = home.join(".config/berth");
        std::fs::create_dir_all(&conf).unwrap();
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        assert_eq!(chosen_name(&home, uid, gid), None);
        let file = conf.join("ssh-container");
        std::fs::write(&file, "dev\nignored\n").unwrap();
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        assert_eq!(chosen_name(&home, uid, gid).as_deref(), Some("dev"));
        // Not the user's: refused (uid + 1 stands for another user).
        assert_eq!(chosen_name(&home, uid + 1, gid), None);
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .unwrap();
        assert_eq!(chosen_name(&home, uid, gid), None);
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        std::fs::write(&file, "../etc\n").unwrap();
        assert_eq!(chosen_name(&home, uid, gid), None);
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &file).unwrap();
        assert_eq!(chosen_name(&home, uid, gid), None);
        std::fs::remove_dir_all(&home).unwrap();
    }
}
