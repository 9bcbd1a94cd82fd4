//! A Slurm job's staging requests, as the SPANK plugin hands them to the Prolog and Epilog
//! (`--stage-in=SRC[:DST][,…]`, `--stage-out=SRC:DST[,…]`), and their execution as the job's
//! user: stage-in from shared storage into the job's scratch before its first step, stage-out
//! from the scratch to shared storage after its last.

use std::path::{Path, PathBuf};

use super::{Options, Report, StageError, scratch, stage_as};
use berth_sys::UserIds;

/// Copy `src` (absolute) into `scratch/dst`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageIn {
    pub src: PathBuf,
    /// Relative to the scratch; `None`: the source's name for a directory, the scratch itself
    /// for a file (as `berth stage in` does).
    pub dst: Option<PathBuf>,
}

/// Copy `scratch/src` into the directory `dst` (absolute).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageOut {
    pub src: PathBuf,
    pub dst: PathBuf,
}

/// A path inside the scratch: relative and without `..`.
fn in_scratch(p: &str) -> bool {
    !p.is_empty() && !p.starts_with('/') && !p.split('/').any(|c| c == "..")
}

/// Parses `SRC[:DST][,…]`; the error is the part of one line that says what is wrong.
pub fn parse_in(text: &str) -> Result<Vec<StageIn>, StageError> {
    text.split(',')
        .map(|entry| {
            let (src, dst) = match entry.split_once(':') {
                Some((s, d)) => (s, Some(d)),
                None => (entry, None),
            };
            if !src.starts_with('/') || dst.is_some_and(|d| !in_scratch(d)) {
                return Err(StageError::Refused(format!(
                    "--stage-in entry {entry:?} is not SRC[:DST] with SRC absolute and DST relative to the scratch"
                )));
            }
            Ok(StageIn {
                src: PathBuf::from(src),
                dst: dst.map(PathBuf::from),
            })
        })
        .collect()
}

/// Parses `SRC:DST[,…]`.
pub fn parse_out(text: &str) -> Result<Vec<StageOut>, StageError> {
    text.split(',')
        .map(|entry| match entry.split_once(':') {
            Some((src, dst)) if in_scratch(src) && dst.starts_with('/') => Ok(StageOut {
                src: PathBuf::from(src),
                dst: PathBuf::from(dst),
            }),
            _ => Err(StageError::Refused(format!(
                "--stage-out entry {entry:?} is not SRC:DST with SRC relative to the scratch and DST absolute"
            ))),
        })
        .collect()
}

/// Whether `path` is a directory, as `user` sees it.
pub(crate) fn is_dir_as(user: &UserIds, path: &Path) -> bool {
    berth_sys::privfs::as_user(user, || std::fs::metadata(path).is_ok_and(|m| m.is_dir()))
        .unwrap_or(false)
}

/// Stages every request into `scratch` as `user`, in order, stopping at the first failure.
/// `cap`: the per-job scratch cap, checked against what the scratch already holds before each
/// copy (the engine also checks the filesystem's free space).
pub fn stage_in(
    user: &UserIds,
    scratch_dir: &Path,
    requests: &[StageIn],
    opts: &Options,
    cap: Option<u64>,
) -> Result<Vec<Report>, StageError> {
    let mut reports = Vec::new();
    for r in requests {
        let fail = |e: StageError| StageError::Request {
            what: format!("stage-in of {}", r.src.display()),
            source: Box::new(e),
        };
        let rel = match &r.dst {
            Some(d) => d.clone(),
            None => match r.src.file_name() {
                // Looked at as the user: root never stats a path the user named.
                Some(n) if is_dir_as(user, &r.src) => PathBuf::from(n),
                _ => PathBuf::new(),
            },
        };
        let mut opts = opts.clone();
        if let Some(cap) = cap {
            opts.cap = Some(scratch::remaining(scratch_dir, cap).map_err(fail)?);
        }
        reports.push(stage_as(user, &r.src, scratch_dir, &rel, &opts).map_err(fail)?);
    }
    Ok(reports)
}

/// Stages every request out of `scratch` as `user`; stops at the first failure.
pub fn stage_out(
    user: &UserIds,
    scratch_dir: &Path,
    requests: &[StageOut],
    opts: &Options,
) -> Result<Vec<Report>, StageError> {
    let mut reports = Vec::new();
    for r in requests {
        let src = scratch_dir.join(&r.src);
        let report =
            stage_as(user, &src, &r.dst, Path::new(""), opts).map_err(|e| StageError::Request {
                what: format!("stage-out of {} to {}", r.src.display(), r.dst.display()),
                source: Box::new(e),
            })?;
        reports.push(report);
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_in("/data/a:in/a,/data/f").unwrap(),
            [
                StageIn {
                    src: "/data/a".into(),
                    dst: Some("in/a".into())
                },
                StageIn {
                    src: "/data/f".into(),
                    dst: None
                },
            ]
        );
        assert_eq!(
            parse_out("results:/shared/out").unwrap(),
            [StageOut {
                src: "results".into(),
                dst: "/shared/out".into()
            }]
        );
        for bad in ["rel", "/a:/abs", "/a:../x", "/a:"] {
            assert!(
                parse_in(bad).unwrap_err().to_string().contains(bad),
                "{bad}"
            );
        }
        for bad in ["results", "/abs:/out", "r:rel", "../r:/out"] {
            assert!(
                parse_out(bad).unwrap_err().to_string().contains(bad),
                "{bad}"
            );
        }
    }

    #[test]
    fn stage_in_respects_the_cap_before_copying() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("set");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("big"), vec![7u8; 256 * 1024]).unwrap();
        let uid = nix::unistd::Uid::current().as_raw();
        let gid = nix::unistd::Gid::current().as_raw();
        let dir = scratch::create(&tmp.path().join("root"), "5", uid, gid, None).unwrap();
        let user = berth_sys::user::by_id(uid, gid);
        let req = parse_in(&format!("{}", src.display())).unwrap();
        let e = stage_in(&user, &dir, &req, &Options::default(), Some(4096))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("stage-in of {}: ", src.display())),
            "{e}"
        );
        assert!(e.contains("needs") && e.contains("available"), "{e}");
        assert!(!dir.join("set/big").exists(), "copied past the cap");
        let reports = stage_in(&user, &dir, &req, &Options::default(), Some(1 << 30)).unwrap();
        assert_eq!(reports.len(), 1);
        assert_eq!(
            std::fs::read(dir.join("set/big")).unwrap().len(),
            256 * 1024
        );
        let out = tmp.path().join("out");
        let back = parse_out(&format!("set:{}", out.display())).unwrap();
        stage_out(&user, &dir, &back, &Options::default()).unwrap();
        assert_eq!(std::fs::read(out.join("big")).unwrap().len(), 256 * 1024);
    }
}
