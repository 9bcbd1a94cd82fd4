//! The delegated cgroup v2 subtree berth owns (`cgroup.root` in the config): checking it is
//! really cgroup v2, creating it, and enabling the controllers its children need on every level
//! between the cgroup2 mount and the root.
//!
//! Which writes to make is decided by [`plan_delegation`] from a snapshot of each level's
//! `cgroup.controllers` and `cgroup.subtree_control`, so the rules are unit-tested without a
//! cgroup2 mount; [`Hierarchy::open`] only takes the snapshot and performs the writes.

use std::io;
use std::path::{Path, PathBuf};

use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, statfs};

use super::{Cgroup, CgroupError, Controller, files};

/// A delegated cgroup v2 subtree root, validated and with the needed controllers enabled for
/// its children.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    root: PathBuf,
}

/// One directory on the way from the cgroup2 mount root down to the hierarchy root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Level {
    pub dir: PathBuf,
    /// Contents of `cgroup.controllers`: what this level may hand to its children.
    pub controllers: String,
    /// Contents of `cgroup.subtree_control`: what it already hands to them.
    pub subtree_control: String,
}

/// A write enabling controllers for a level's children, e.g. `"+memory +pids"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SubtreeWrite {
    pub file: PathBuf,
    pub value: String,
}

/// Decide the `cgroup.subtree_control` writes that give `root`'s children every controller in
/// `needed`. `levels` runs from the cgroup2 mount root (first) to `root` (last).
///
/// A controller is usable at a level when its `cgroup.controllers` lists it, or when the level
/// above has it and hands it down (already, or by a write planned here). The first level where
/// it is not usable is where the delegation is broken: that is a [`CgroupError::MissingController`].
/// Levels that already hand a controller down get no write: re-enabling would fail with EBUSY
/// on a level that has processes (systemd slices, slurmd's own cgroup), and skipping it keeps
/// `open` idempotent.
pub(crate) fn plan_delegation(
    levels: &[Level],
    needed: &[Controller],
    root: &Path,
) -> Result<Vec<SubtreeWrite>, CgroupError> {
    let mut wanted: Vec<Controller> = needed.to_vec();
    wanted.sort();
    wanted.dedup();

    for &c in &wanted {
        let mut handed_down = false;
        for level in levels {
            if !(handed_down || files::lists(&level.controllers, c.name())) {
                return Err(CgroupError::MissingController {
                    controller: c,
                    root: root.to_path_buf(),
                });
            }
            // Every level from here down will hand it to its children (that is the plan).
            handed_down = true;
        }
    }

    let mut writes = Vec::new();
    for level in levels {
        let missing: Vec<String> = wanted
            .iter()
            .filter(|c| !files::lists(&level.subtree_control, c.name()))
            .map(|c| format!("+{c}"))
            .collect();
        if !missing.is_empty() {
            writes.push(SubtreeWrite {
                file: level.dir.join("cgroup.subtree_control"),
                value: missing.join(" "),
            });
        }
    }
    Ok(writes)
}

/// The cgroup root berth uses when the config names none: `berth` under the host's cgroup2
/// mount, which is /sys/fs/cgroup on cgroup v2 hosts and /sys/fs/cgroup/unified on hybrid ones.
pub fn default_root() -> PathBuf {
    let unified = Path::new("/sys/fs/cgroup/unified");
    let mount = if !is_cgroup2_dir(Path::new("/sys/fs/cgroup")).unwrap_or(false)
        && is_cgroup2_dir(unified).unwrap_or(false)
    {
        unified
    } else {
        Path::new("/sys/fs/cgroup")
    };
    mount.join("berth")
}

fn is_cgroup2_dir(path: &Path) -> Result<bool, nix::Error> {
    let fs = statfs(path)?;
    Ok(fs.filesystem_type() == CGROUP2_SUPER_MAGIC && path.is_dir())
}

/// The top of the cgroup2 mount holding `dir`: walk up while the parent is still cgroup2.
fn mount_root(dir: &Path) -> PathBuf {
    let mut top = dir.to_path_buf();
    while let Some(parent) = top.parent() {
        if !matches!(is_cgroup2_dir(parent), Ok(true)) {
            break;
        }
        top = parent.to_path_buf();
    }
    top
}

/// Make sure `root` exists and is a cgroup2 directory; create it (one level only) when its
/// parent is one. Returns the canonical path.
fn prepare_root(root: &Path) -> Result<PathBuf, CgroupError> {
    if !root.is_absolute() {
        return Err(CgroupError::not_cgroup2(root, "the path is not absolute"));
    }
    match is_cgroup2_dir(root) {
        Ok(true) => {}
        Ok(false) => {
            return Err(CgroupError::not_cgroup2(
                root,
                "it is not a directory on a cgroup2 filesystem",
            ));
        }
        Err(nix::Error::ENOENT) => {
            let parent = root.parent().unwrap_or(Path::new("/"));
            if !matches!(is_cgroup2_dir(parent), Ok(true)) {
                return Err(CgroupError::not_cgroup2(
                    root,
                    format!(
                        "it does not exist and its parent {} is not a cgroup2 directory",
                        parent.display()
                    ),
                ));
            }
            match std::fs::create_dir(root) {
                Ok(()) => {}
                // Another berth process created it first.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(CgroupError::io(
                        "create cgroup root",
                        root,
                        e,
                        "run berth as root or create the directory and delegate it to berth",
                    ));
                }
            }
        }
        Err(e) => {
            return Err(CgroupError::not_cgroup2(
                root,
                format!("statfs failed: {}", e.desc()),
            ));
        }
    }
    root.canonicalize().map_err(|e| {
        CgroupError::io(
            "resolve",
            root,
            e,
            "check the cgroup root path and its permissions",
        )
    })
}

fn read_level(dir: &Path) -> Result<Level, CgroupError> {
    const HINT: &str = "check that the cgroup root is on a cgroup v2 mount";
    Ok(Level {
        dir: dir.to_path_buf(),
        controllers: files::read(&dir.join("cgroup.controllers"), HINT)?,
        subtree_control: files::read(&dir.join("cgroup.subtree_control"), HINT)?,
    })
}

/// A child name must be one path component, so a job or step id can never escape the root.
fn check_child_name(name: &str) -> Result<(), CgroupError> {
    let reason = if name.is_empty() {
        "it is empty"
    } else if name == "." || name == ".." {
        "it refers to a directory outside the cgroup"
    } else if name.contains('/') {
        "it contains '/'"
    } else if name.contains('\0') || name.contains('\n') {
        "it contains a NUL or newline character"
    } else if name.len() > 255 {
        "it is longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(CgroupError::InvalidName {
        name: name.to_string(),
        reason,
    })
}

impl Hierarchy {
    /// Validate and prepare the root, and enable `needed` for its children on every level from
    /// the cgroup2 mount root down to and including `root`. Safe to call from several berth
    /// processes at once: creating an existing root and re-enabling enabled controllers are
    /// no-ops.
    pub fn open(root: &Path, needed: &[Controller]) -> Result<Hierarchy, CgroupError> {
        let root = prepare_root(root)?;
        let top = mount_root(&root);
        let mut dirs: Vec<PathBuf> = root
            .ancestors()
            .take_while(|d| d.starts_with(&top))
            .map(Path::to_path_buf)
            .collect();
        dirs.reverse();
        let levels = dirs
            .iter()
            .map(|d| read_level(d))
            .collect::<Result<Vec<_>, _>>()?;
        for write in plan_delegation(&levels, needed, &root)? {
            files::write(&write.file, &write.value)?;
        }
        Ok(Hierarchy { root })
    }

    /// The root directory (canonical path).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Create the child cgroup `name`. It must not exist yet: a leftover from a crashed run
    /// still holds its old limits and device filter.
    pub fn create(&self, name: &str) -> Result<Cgroup, CgroupError> {
        check_child_name(name)?;
        let path = self.root.join(name);
        match std::fs::create_dir(&path) {
            Ok(()) => Ok(Cgroup::at(path)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(CgroupError::io(
                "create cgroup",
                path,
                e,
                "a cgroup of that name is left over: kill and remove it first, or use another name",
            )),
            Err(e) => Err(CgroupError::io(
                "create cgroup",
                path,
                e,
                "run berth as root or delegate the cgroup root to berth",
            )),
        }
    }

    /// The child cgroups that exist under the root, sorted by path, for garbage collection of
    /// leftovers.
    pub fn children(&self) -> Result<Vec<Cgroup>, CgroupError> {
        let hint = "check the cgroup root exists and is readable";
        let entries = std::fs::read_dir(&self.root)
            .map_err(|e| CgroupError::io("list", &self.root, e, hint))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| CgroupError::io("list", &self.root, e, hint))?;
            // Interface files are regular files; cgroups are the only directories.
            match entry.file_type() {
                Ok(t) if t.is_dir() => out.push(entry.path()),
                Ok(_) => {}
                Err(e) if files::is_not_found(&e) => {}
                Err(e) => return Err(CgroupError::io("list", &self.root, e, hint)),
            }
        }
        out.sort();
        Ok(out.into_iter().map(Cgroup::at).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(dir: &str, controllers: &str, subtree: &str) -> Level {
        Level {
            dir: PathBuf::from(dir),
            controllers: controllers.into(),
            subtree_control: subtree.into(),
        }
    }

    fn sw(file: &str, value: &str) -> SubtreeWrite {
        SubtreeWrite {
            file: PathBuf::from(file),
            value: value.into(),
        }
    }

    const ROOT: &str = "/cg/berth";

    #[test]
    fn nothing_needed_writes_nothing() {
        let levels = [level("/cg", "hugetlb\n", ""), level(ROOT, "", "")];
        assert_eq!(
            plan_delegation(&levels, &[], Path::new(ROOT)).unwrap(),
            vec![]
        );
    }

    #[test]
    fn fresh_root_gets_controllers_enabled_top_down() {
        let levels = [
            level("/cg", "cpuset cpu io memory hugetlb pids rdma misc\n", "\n"),
            level(ROOT, "\n", "\n"),
        ];
        let plan = plan_delegation(
            &levels,
            &[Controller::Pids, Controller::Memory, Controller::Memory],
            Path::new(ROOT),
        )
        .unwrap();
        assert_eq!(
            plan,
            vec![
                sw("/cg/cgroup.subtree_control", "+memory +pids"),
                sw("/cg/berth/cgroup.subtree_control", "+memory +pids"),
            ]
        );
    }

    #[test]
    fn already_delegated_levels_are_not_rewritten() {
        // systemd-style: the slice already hands memory and pids down; only the new root
        // (and cpu on every level) needs writes.
        let levels = [
            level("/cg", "cpu memory pids\n", "cpu memory pids\n"),
            level("/cg/slurm.slice", "cpu memory pids\n", "memory pids\n"),
            level("/cg/slurm.slice/berth", "memory pids\n", "memory\n"),
        ];
        let plan = plan_delegation(
            &levels,
            &[Controller::Memory, Controller::Pids, Controller::Cpu],
            Path::new("/cg/slurm.slice/berth"),
        )
        .unwrap();
        assert_eq!(
            plan,
            vec![
                sw("/cg/slurm.slice/cgroup.subtree_control", "+cpu"),
                sw("/cg/slurm.slice/berth/cgroup.subtree_control", "+cpu +pids"),
            ]
        );
    }

    #[test]
    fn fully_delegated_tree_needs_no_writes() {
        let levels = [
            level("/cg", "memory pids\n", "memory pids\n"),
            level(ROOT, "memory pids\n", "pids memory\n"),
        ];
        let plan = plan_delegation(
            &levels,
            &[Controller::Memory, Controller::Pids],
            Path::new(ROOT),
        )
        .unwrap();
        assert_eq!(plan, vec![]);
    }

    #[test]
    fn controller_missing_at_the_mount_root_is_reported_for_the_root() {
        // This host: cgroup2 at /sys/fs/cgroup/unified with only hugetlb.
        let root = "/sys/fs/cgroup/unified/berth";
        let levels = [
            level("/sys/fs/cgroup/unified", "hugetlb\n", ""),
            level(root, "", ""),
        ];
        let err = plan_delegation(&levels, &[Controller::Memory], Path::new(root)).unwrap_err();
        match &err {
            CgroupError::MissingController {
                controller,
                root: r,
            } => {
                assert_eq!(*controller, Controller::Memory);
                assert_eq!(r, Path::new(root));
            }
            other => panic!("unexpected error {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("'memory'") && msg.contains(root), "{msg}");
    }

    #[test]
    fn first_missing_controller_in_enabling_order_is_reported() {
        let levels = [level("/cg", "memory\n", ""), level(ROOT, "", "")];
        let err = plan_delegation(
            &levels,
            &[Controller::Pids, Controller::Memory, Controller::Cpu],
            Path::new(ROOT),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            CgroupError::MissingController {
                controller: Controller::Cpu,
                ..
            }
        ));
    }

    #[test]
    fn mount_root_alone_is_a_valid_hierarchy() {
        let levels = [level("/cg", "memory io\n", "")];
        let plan = plan_delegation(&levels, &[Controller::Io], Path::new("/cg")).unwrap();
        assert_eq!(plan, vec![sw("/cg/cgroup.subtree_control", "+io")]);
    }

    #[test]
    fn child_names_are_single_components() {
        for ok in ["job-12", "12.0", "step_3.batch", "a b"] {
            check_child_name(ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../x",
            "a\nb",
            "a\0b",
            &"x".repeat(256),
        ] {
            assert!(
                matches!(check_child_name(bad), Err(CgroupError::InvalidName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn relative_root_is_refused() {
        let err = Hierarchy::open(Path::new("sys/fs/cgroup"), &[]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("not absolute") && msg.contains("cgroup.root"),
            "{msg}"
        );
    }

    #[test]
    fn non_cgroup_directory_is_refused_with_the_config_hint() {
        let dir = tempfile::tempdir().unwrap();
        let err = Hierarchy::open(dir.path(), &[]).unwrap_err();
        assert!(matches!(err, CgroupError::NotCgroup2 { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("set cgroup.root in /etc/berth/berth.toml"),
            "{msg}"
        );
        let missing = dir.path().join("berth");
        let err = Hierarchy::open(&missing, &[]).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
        assert!(!missing.exists(), "must not create a root outside cgroup2");
    }
}
