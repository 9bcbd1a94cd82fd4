//! The step's own cgroups as the container shows them at /sys/fs/cgroup: Slurm's limits for the
//! step (cpuset, memory, …) are what a program inside must read, not berth's holder cgroup.
//!
//! `berth step create` runs as a child of slurmstepd and so starts in the step's cgroups (or the
//! job's, for hierarchies where slurmstepd itself stays at job level). For each hierarchy whose
//! path passes through Slurm's `job_<id>` directory, the step's directory under it is bound
//! read-only into the container: on a cgroup v2 host at /sys/fs/cgroup itself, on a v1 or
//! hybrid host at /sys/fs/cgroup/<hierarchy> as docker lays it out.

use std::path::{Path, PathBuf};

/// A host cgroup directory and where it appears, relative to /sys/fs/cgroup ("" is itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    pub host: PathBuf,
    pub inside: PathBuf,
}

/// The directory name Slurm gives a step's cgroup.
pub fn step_dir_name(step_id: u64) -> String {
    match step_id {
        0xffff_fffa => "step_interactive".into(),
        0xffff_fffb => "step_batch".into(),
        0xffff_fffc => "step_extern".into(),
        id => format!("step_{id}"),
    }
}

/// A cgroup hierarchy mounted on the host: its mount point and, for v1, its controllers (and
/// `name=` options).
struct Hierarchy {
    mount_point: PathBuf,
    /// Empty for cgroup v2.
    controllers: Vec<String>,
}

/// Cgroup mounts from /proc/self/mountinfo whose root is the hierarchy's root.
fn hierarchies(mountinfo: &str) -> Vec<Hierarchy> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fields: Vec<&str> = left.split(' ').collect();
            let (root, mount_point) = (fields.get(3)?, fields.get(4)?);
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let options = right.nth(1).unwrap_or("");
            if *root != "/" {
                return None;
            }
            let controllers = match fstype {
                "cgroup2" => Vec::new(),
                "cgroup" => options
                    .split(',')
                    .filter(|o| {
                        !matches!(*o, "rw" | "ro" | "xattr" | "noprefix" | "clone_children")
                    })
                    .map(String::from)
                    .collect(),
                _ => return None,
            };
            Some(Hierarchy {
                mount_point: PathBuf::from(unescape(mount_point)),
                controllers,
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 4);
        match code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            Some(b) => {
                out.push(b as char);
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The views of the step `step_id` of job `job_id`, from this process's /proc/self/cgroup and
/// /proc/self/mountinfo; `is_dir` tells which candidate directories exist. Empty when Slurm
/// keeps no cgroup for the step (no cgroup plugin): the container then shows its own.
pub fn views(
    job_id: u64,
    step_id: u64,
    proc_cgroup: &str,
    mountinfo: &str,
    is_dir: impl Fn(&Path) -> bool,
) -> Vec<View> {
    let hierarchies = hierarchies(mountinfo);
    let job = format!("job_{job_id}");
    let step = step_dir_name(step_id);
    let mut found = Vec::new();
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        let Some(at) = components.iter().position(|c| *c == job) else {
            continue;
        };
        let rel: PathBuf = components[..=at].iter().collect::<PathBuf>().join(&step);
        let hierarchy = if id == "0" && controllers.is_empty() {
            hierarchies.iter().find(|h| h.controllers.is_empty())
        } else {
            let wanted: Vec<&str> = controllers.split(',').collect();
            hierarchies.iter().find(|h| {
                !h.controllers.is_empty()
                    && wanted.iter().all(|w| h.controllers.iter().any(|c| c == w))
            })
        };
        let Some(h) = hierarchy else { continue };
        let host = h.mount_point.join(&rel);
        if !is_dir(&host) {
            continue;
        }
        found.push((h, host));
    }
    // A pure v2 host (cgroup2 mounted at /sys/fs/cgroup) shows the step's directory as the
    // whole of /sys/fs/cgroup; otherwise each hierarchy keeps its name under it.
    if let [(h, host)] = found.as_slice()
        && h.controllers.is_empty()
        && h.mount_point == Path::new("/sys/fs/cgroup")
    {
        return vec![View {
            host: host.clone(),
            inside: PathBuf::new(),
        }];
    }
    found
        .into_iter()
        .filter_map(|(h, host)| {
            let name = h.mount_point.file_name()?.to_owned();
            Some(View {
                host,
                inside: PathBuf::from(name),
            })
        })
        .collect()
}

/// [`views`] for this process.
pub fn current_views(job_id: u64, step_id: u64) -> Vec<View> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    views(
        job_id,
        step_id,
        &read("/proc/self/cgroup"),
        &read("/proc/self/mountinfo"),
        |p| p.is_dir(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn hybrid_hosts_show_each_slurm_hierarchy_under_its_name() {
        // slurmstepd as measured on this host: cpuset at step level, freezer at job level,
        // memory somewhere else entirely.
        let cgroup = "\
6:freezer:/slurm_b34317e/uid_0/job_3
4:memory:/process_api/53cd
3:cpuset:/slurm_b34317e/uid_0/job_3/step_0
2:cpu,cpuacct:/
1:name=systemd:/
0::/
";
        let views = views(3, 0, cgroup, HYBRID_MOUNTINFO, |_| true);
        assert_eq!(
            views,
            [
                View {
                    host: "/sys/fs/cgroup/freezer/slurm_b34317e/uid_0/job_3/step_0".into(),
                    inside: "freezer".into(),
                },
                View {
                    host: "/sys/fs/cgroup/cpuset/slurm_b34317e/uid_0/job_3/step_0".into(),
                    inside: "cpuset".into(),
                },
            ]
        );
        // A step directory that does not exist (yet) is left out.
        let only_cpuset = super::views(3, 0, cgroup, HYBRID_MOUNTINFO, |p| {
            p.starts_with("/sys/fs/cgroup/cpuset")
        });
        assert_eq!(only_cpuset.len(), 1);
        // Another job's cgroups are not this step's.
        assert!(super::views(4, 0, cgroup, HYBRID_MOUNTINFO, |_| true).is_empty());
    }

    #[test]
    fn v2_hosts_show_the_step_directory_as_the_whole_tree() {
        let mountinfo = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        let cgroup = "0::/system.slice/slurmstepd.scope/job_12/step_batch/slurm\n";
        assert_eq!(
            views(12, 0xffff_fffb, cgroup, mountinfo, |_| true),
            [View {
                host: "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_12/step_batch".into(),
                inside: PathBuf::new(),
            }]
        );
        // Not in a Slurm cgroup at all (proctrack/linuxproc): nothing to show.
        assert!(views(12, 1, "0::/user.slice\n", mountinfo, |_| true).is_empty());
    }

    #[test]
    fn step_names_follow_slurm() {
        assert_eq!(step_dir_name(0), "step_0");
        assert_eq!(step_dir_name(0xffff_fffb), "step_batch");
        assert_eq!(step_dir_name(0xffff_fffc), "step_extern");
        assert_eq!(unescape(r"/a\040b"), "/a b");
    }
}
