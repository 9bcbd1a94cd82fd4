//! The module's arguments from the PAM stack line: pam_slurm_adopt's names where it has the same
//! thing, berth's own names otherwise.

use std::path::PathBuf;
use std::time::Duration;

use crate::PamError;

/// What to do when the user has no running job on this node (`action_no_jobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoJobs {
    Deny,
    /// PAM_IGNORE: the stack's other modules decide.
    Ignore,
}

/// What to do when the user has several jobs here and none is the caller's (`action_unknown`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// The job that started last.
    Newest,
    /// Let the user in without adopting the session into any job.
    Allow,
    Deny,
}

/// What to do when berth cannot tell (Slurm does not answer, its answer is unreadable):
/// `action_generic_failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Deny,
    Allow,
    Ignore,
}

/// The parsed module arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub action_no_jobs: NoJobs,
    pub action_unknown: Unknown,
    /// `action_adopt_failure`: true lets the user in when the session cannot join the job.
    pub adopt_failure_allow: bool,
    pub action_generic_failure: Failure,
    /// Accepted for pam_slurm_adopt's stack lines; berth sets no X11 display either way.
    pub disable_x11: bool,
    /// The only PAM service the module acts on; others get PAM_IGNORE.
    pub service: String,
    /// Members of these groups (and root) are never restricted nor adopted.
    pub admin_groups: Vec<String>,
    /// This node's name in Slurm [default: the short host name].
    pub nodename: Option<String>,
    /// squeue's configuration (SLURM_CONF for it) [default: Slurm's own].
    pub slurm_conf: Option<PathBuf>,
    pub squeue: PathBuf,
    /// How long Slurm may take to answer before `action_generic_failure` applies.
    pub timeout: Duration,
    /// The cgroup file systems' mount point.
    pub cgroup_mount: PathBuf,
    /// Whether a session joins the job's berth container when it has one here (`container=0|1`).
    pub container: bool,
    /// berth's `runtime.state_dir`, where the node's containers are recorded.
    pub state_dir: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            action_no_jobs: NoJobs::Deny,
            action_unknown: Unknown::Newest,
            adopt_failure_allow: false,
            action_generic_failure: Failure::Deny,
            disable_x11: false,
            service: "sshd".to_string(),
            admin_groups: Vec::new(),
            nodename: None,
            slurm_conf: None,
            squeue: PathBuf::from("/usr/bin/squeue"),
            timeout: Duration::from_secs(5),
            cgroup_mount: PathBuf::from("/sys/fs/cgroup"),
            container: true,
            state_dir: PathBuf::from("/run/berth"),
        }
    }
}

fn bad(arg: &str, hint: &'static str) -> PamError {
    PamError::Option {
        arg: arg.to_string(),
        hint,
    }
}

/// The service named by `service=` without parsing the rest, so that a stack line of another
/// service costs nothing more.
pub fn service_of<'a>(args: impl IntoIterator<Item = &'a str>) -> &'a str {
    args.into_iter()
        .filter_map(|a| a.strip_prefix("service="))
        .last()
        .unwrap_or("sshd")
}

impl Options {
    pub fn parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Options, PamError> {
        let mut o = Options::default();
        for arg in args {
            let (key, value) = arg.split_once('=').unwrap_or((arg, ""));
            match key {
                "action_no_jobs" => {
                    o.action_no_jobs = match value {
                        "deny" => NoJobs::Deny,
                        "ignore" => NoJobs::Ignore,
                        _ => return Err(bad(arg, "use deny or ignore")),
                    }
                }
                "action_unknown" => {
                    o.action_unknown = match value {
                        "newest" => Unknown::Newest,
                        "allow" => Unknown::Allow,
                        "deny" => Unknown::Deny,
                        _ => return Err(bad(arg, "use newest, allow or deny")),
                    }
                }
                "action_adopt_failure" => {
                    o.adopt_failure_allow = match value {
                        "allow" => true,
                        "deny" => false,
                        _ => return Err(bad(arg, "use allow or deny")),
                    }
                }
                "action_generic_failure" => {
                    o.action_generic_failure = match value {
                        "deny" => Failure::Deny,
                        "allow" => Failure::Allow,
                        "ignore" => Failure::Ignore,
                        _ => return Err(bad(arg, "use deny, allow or ignore")),
                    }
                }
                "disable_x11" => {
                    o.disable_x11 = match value {
                        "1" => true,
                        "0" => false,
                        _ => return Err(bad(arg, "use 0 or 1")),
                    }
                }
                "service" if !value.is_empty() => o.service = value.to_string(),
                "admin_groups" => {
                    o.admin_groups = value
                        .split(',')
                        .filter(|g| !g.is_empty())
                        .map(str::to_string)
                        .collect();
                }
                "nodename" if !value.is_empty() => o.nodename = Some(value.to_string()),
                "slurm_conf" if value.starts_with('/') => {
                    o.slurm_conf = Some(PathBuf::from(value));
                }
                "squeue" if value.starts_with('/') => o.squeue = PathBuf::from(value),
                "cgroup_mount" if value.starts_with('/') => o.cgroup_mount = PathBuf::from(value),
                "state_dir" if value.starts_with('/') => o.state_dir = PathBuf::from(value),
                "container" => {
                    o.container = match value {
                        "1" => true,
                        "0" => false,
                        _ => return Err(bad(arg, "use 0 or 1")),
                    }
                }
                "timeout_ms" => match value.parse::<u64>() {
                    Ok(ms) if (1..=60_000).contains(&ms) => o.timeout = Duration::from_millis(ms),
                    _ => return Err(bad(arg, "use milliseconds from 1 to 60000")),
                },
                "slurm_conf" | "squeue" | "cgroup_mount" | "state_dir" => {
                    return Err(bad(arg, "use an absolute path"));
                }
                "service" | "nodename" => return Err(bad(arg, "give a value")),
                _ => {
                    return Err(bad(
                        arg,
                        "unknown argument: see README, \"Node access (ssh)\"",
                    ));
                }
            }
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn defaults_deny_whenever_berth_cannot_tell() {
        let o = Options::parse([]).unwrap();
        assert_eq!(o.action_no_jobs, NoJobs::Deny);
        assert_eq!(o.action_unknown, Unknown::Newest);
        assert!(!o.adopt_failure_allow);
        assert_eq!(o.action_generic_failure, Failure::Deny);
        assert_eq!(o.service, "sshd");
    }

    #[test]
    fn pam_slurm_adopt_names_parse() {
        let o = Options::parse([
            "action_no_jobs=ignore",
            "action_unknown=deny",
            "action_adopt_failure=allow",
            "action_generic_failure=ignore",
            "disable_x11=1",
            "service=login",
            "admin_groups=wheel,,ops",
            "nodename=n1",
            "slurm_conf=/etc/slurm/slurm.conf",
            "timeout_ms=250",
            "container=0",
            "state_dir=/var/run/berth",
        ])
        .unwrap();
        assert_eq!(o.action_no_jobs, NoJobs::Ignore);
        assert_eq!(o.action_unknown, Unknown::Deny);
        assert!(o.adopt_failure_allow);
        assert_eq!(o.action_generic_failure, Failure::Ignore);
        assert!(o.disable_x11);
        assert_eq!(o.service, "login");
        assert_eq!(o.admin_groups, ["wheel", "ops"]);
        assert_eq!(o.nodename.as_deref(), Some("n1"));
        assert_eq!(o.timeout, Duration::from_millis(250));
        assert!(!o.container);
        assert_eq!(o.state_dir, Path::new("/var/run/berth"));
    }

    #[test]
    fn a_wrong_value_is_refused_with_its_argument() {
        for arg in [
            "action_no_jobs=allow",
            "timeout_ms=0",
            "timeout_ms=x",
            "squeue=squeue",
            "nodename=",
            "join_container=true",
            "container=yes",
        ] {
            let e = Options::parse([arg]).unwrap_err().to_string();
            assert!(e.contains(arg), "{e}");
        }
    }

    #[test]
    fn the_service_is_read_without_the_rest() {
        assert_eq!(service_of(["bogus", "service=login"]), "login");
        assert_eq!(service_of(["action_no_jobs=deny"]), "sshd");
    }
}
