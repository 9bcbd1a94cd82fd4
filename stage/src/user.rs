//! Staging as the job's user: a forked child with the user's credentials.

use std::io::{Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Options, Report, StageError, cache, stage};
use berth_sys::UserIds;

/// Runs [`stage`] in a child process with `user`'s uid, gid and groups (when berth runs as
/// root; otherwise as the caller). Call it from a single-threaded process (the Prolog/Epilog and
/// the CLI are): the child starts its own worker threads after the fork. The child dies with
/// its parent (PR_SET_PDEATHSIG), so killing berth stops the copy; staging again resumes it.
///
/// With a cache configured (`opts.cache`) and run by root, a directory under one of the cache's
/// prefixes is staged through the dataset cache ([`cache::stage_cached`]).
pub fn stage_as(
    user: &UserIds,
    source: &Path,
    base: &Path,
    rel: &Path,
    opts: &Options,
) -> Result<Report, StageError> {
    if !nix::unistd::Uid::current().is_root() {
        return stage(source, base, rel, opts);
    }
    // Whether the cache covers the source is looked at as the user: root resolves no path the
    // user named.
    if let Some(cache) = &opts.cache
        && let Some(canon) = berth_sys::privfs::as_user(user, || cache.covers(source))
            .ok()
            .flatten()
    {
        return cache::stage_cached(user, &canon, base, rel, opts, cache);
    }
    as_user(user, || stage(source, base, rel, opts))
}

/// What the staging child sends the parent through the pipe: its value, or its failure as the
/// one line the parent reports ([`StageError::Child`]); the error's own type (an `io::Error`
/// inside) does not cross a process boundary.
#[derive(Serialize, Deserialize)]
enum ChildResult<T> {
    Done(T),
    Failed { message: String },
}

/// Runs `f` in a forked child with `user`'s uid, gid and groups and returns its result (the
/// caller must be root and single-threaded; see [`stage_as`]). `berth step` writes
/// `--container-save` through it too.
pub fn as_user<T, E, F>(user: &UserIds, f: F) -> Result<T, StageError>
where
    T: Serialize + serde::de::DeserializeOwned,
    E: std::fmt::Display,
    F: FnOnce() -> Result<T, E>,
{
    use nix::sys::wait::waitpid;
    use nix::unistd::{ForkResult, Gid, Uid, fork, setgroups, setresgid, setresuid};
    let cred_err = |message: String| StageError::Credentials {
        uid: user.uid,
        message,
    };
    let parent = nix::unistd::getpid();
    let (reader, writer) = nix::unistd::pipe().map_err(|e| cred_err(format!("pipe: {e}")))?;
    // SAFETY: the caller is single-threaded (documented above); the child drops privileges,
    // runs `f`, writes its result to the pipe and exits without returning.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            drop(reader);
            let groups: Vec<Gid> = user.groups.iter().map(|g| Gid::from_raw(*g)).collect();
            let gid = Gid::from_raw(user.gid);
            let uid = Uid::from_raw(user.uid);
            let result = setgroups(&groups)
                .and_then(|_| setresgid(gid, gid, gid))
                .and_then(|_| setresuid(uid, uid, uid))
                .map_err(|e| format!("staging as uid {}: dropping privileges: {e}", user.uid))
                .map(|_| {
                    // After the credential change, which clears the parent-death signal; and if
                    // the parent is already gone, nobody waits for this stage.
                    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
                    // The user must not ptrace this child or reach its pipe through /proc: root
                    // trusts what it reports (the dataset cache serves by its manifest). The
                    // kernel clears the flag on the uid change already; this does not rely on it.
                    let _ = nix::sys::prctl::set_dumpable(false);
                    if nix::unistd::getppid() != parent {
                        // SAFETY: exiting the child without running the parent's exit handlers.
                        unsafe { libc::_exit(1) }
                    }
                })
                .and_then(|_| f().map_err(|e| e.to_string()));
            let ok = result.is_ok();
            let result = match result {
                Ok(value) => ChildResult::Done(value),
                Err(message) => ChildResult::Failed { message },
            };
            let mut w = std::fs::File::from(writer);
            let _ = w.write_all(&serde_json::to_vec(&result).unwrap_or_default());
            drop(w);
            // SAFETY: leaving the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) }
        }
        Ok(ForkResult::Parent { child }) => {
            drop(writer);
            let mut buf = Vec::new();
            let _ = std::fs::File::from(reader).read_to_end(&mut buf);
            let status = waitpid(child, None);
            match serde_json::from_slice::<ChildResult<T>>(&buf) {
                Ok(ChildResult::Done(value)) => Ok(value),
                Ok(ChildResult::Failed { message }) => Err(StageError::Child(message)),
                Err(_) => Err(cred_err(format!(
                    "the staging process ended without a result ({status:?})",
                ))),
            }
        }
        Err(e) => Err(cred_err(format!("fork: {e}"))),
    }
}
