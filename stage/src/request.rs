//! `berth stage in` and `berth stage out` as a user asks for them: who stages (only root may
//! stage as another user), what a source path names (looked at with that user's rights), and
//! how much room the scratch cap leaves.

use std::path::{Path, PathBuf};

use berth_sys::UserIds;

use crate::{Options, Report, StageError, scratch, stage, stage_as};

/// The user `--user` names, if any. Only root stages as another user: anyone else asking to is
/// refused, never quietly staged as themselves.
pub fn stage_user(name: Option<&str>) -> Result<Option<UserIds>, StageError> {
    let Some(spec) = name else {
        return Ok(None);
    };
    let ids = berth_sys::user::resolve(spec).map_err(|e| StageError::Refused(e.to_string()))?;
    let me = nix::unistd::geteuid().as_raw();
    if me != 0 && ids.uid != me {
        return Err(StageError::Refused(format!(
            "berth stage: only root can stage as another user (--user {spec}, uid {}; you are uid {me}): run it without --user",
            ids.uid
        )));
    }
    Ok(Some(ids))
}

/// Runs `f` as `user` when there is one (root staging for a user: a path the user named is looked
/// at with the user's rights), else as the caller.
fn looked_at_as<T: Send>(
    user: Option<&UserIds>,
    f: impl FnOnce() -> T + Send,
) -> Result<T, StageError> {
    match user {
        Some(u) => berth_sys::privfs::as_user(u, f).map_err(|e| StageError::Credentials {
            uid: u.uid,
            message: e.to_string(),
        }),
        None => Ok(f()),
    }
}

/// `berth stage in SRC[:DST] --to BASE`: SRC copied to BASE/DST, or, without DST, a directory to
/// BASE/<its name> and a file into BASE. `cap_bytes` (the scratch cap) bounds what BASE may
/// hold in all.
pub fn stage_in(
    source: &Path,
    dest: Option<&Path>,
    base: &Path,
    user: Option<&UserIds>,
    cap_bytes: Option<u64>,
    mut opts: Options,
) -> Result<Report, StageError> {
    let rel = match (dest, source.file_name()) {
        (Some(d), _) => d.to_path_buf(),
        (None, Some(n))
            if looked_at_as(user, || std::fs::metadata(source).is_ok_and(|m| m.is_dir()))? =>
        {
            PathBuf::from(n)
        }
        (None, _) => PathBuf::new(),
    };
    if let Some(cap) = cap_bytes {
        opts.cap = Some(looked_at_as(user, || scratch::remaining(base, cap))??);
    }
    run(source, base, &rel, user, &opts)
}

/// `berth stage out SRC:DST`: SRC (relative to the job's scratch when `scratch` is given)
/// copied to DST.
pub fn stage_out(
    source: &Path,
    dest: &Path,
    scratch: Option<&Path>,
    user: Option<&UserIds>,
    opts: &Options,
) -> Result<Report, StageError> {
    let source = match scratch {
        Some(dir) if source.is_relative() => dir.join(source),
        _ => source.to_path_buf(),
    };
    run(&source, dest, Path::new(""), user, opts)
}

fn run(
    source: &Path,
    base: &Path,
    rel: &Path,
    user: Option<&UserIds>,
    opts: &Options,
) -> Result<Report, StageError> {
    match user {
        // The child that copies takes the user's credentials: the user's rights decide.
        Some(ids) => stage_as(ids, source, base, rel, opts),
        // Root's own stage goes through the dataset cache too (`stage_as` uses it when root).
        None if opts.cache.is_some() && nix::unistd::Uid::current().is_root() => {
            let ids =
                berth_sys::user::resolve("0").map_err(|e| StageError::Refused(e.to_string()))?;
            stage_as(&ids, source, base, rel, opts)
        }
        None => stage(source, base, rel, opts),
    }
}
