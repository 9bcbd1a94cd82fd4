//! Which verbs need root: a user who runs one gets one line saying what to do instead, before
//! berth reads a config or touches any state.

use super::{Command, cdi, export, images, lazy};

/// The one line a verb that needs root gives another user, before it reads a config or touches
/// a state directory, a store or a cgroup; `None` when `uid` may run it. Verbs that work as a
/// user (`ps`, `topo`, `health` without job marks, `cdi`, `stage`, `export --rootfs` or of an
/// image file, `--help`, `--version`) are not listed. `exec` and `rm` look the container up
/// first (container.rs): another user's container must read exactly like a missing one, so
/// they refuse only a user's own. `step`, `agent` and `cluster` check for themselves.
pub fn needs_root(command: &Command, uid: u32) -> Option<String> {
    if uid == 0 {
        return None;
    }
    let containers = "run it through Slurm (srun --container-image, --container-name) or sudo";
    let store = "the image store is root's: run it with sudo";
    let (verb, how): (String, &str) = match command {
        Command::Run(_) => (
            "run".into(),
            "run it through Slurm (srun --container-image) or sudo",
        ),
        Command::Create(_) => ("create".into(), containers),
        Command::Gc(_) => (
            "gc".into(),
            "it reclaims every user's leftovers: run it with sudo (berth-gc.timer runs it hourly)",
        ),
        Command::Import(_) => (
            invoked_as(&["pull", "import"]).unwrap_or("import").into(),
            "the image store is root's: run it with sudo, or let Slurm import the image \
             (srun --container-image)",
        ),
        Command::Images(a) => (format!("images {}", images::verb(&a.command)), store),
        Command::Export(a) if export::needs_root(a) => (
            "export".into(),
            "containers and the image store are root's: run it with sudo, or export a \
             directory (--rootfs DIR) or an image file you can read",
        ),
        Command::Health(a) if a.job_start || a.job_end => (
            format!(
                "health {}",
                if a.job_start {
                    "--job-start"
                } else {
                    "--job-end"
                }
            ),
            "its job marks are root's: run it from Slurm's Prolog/Epilog",
        ),
        Command::Cdi(cdi::CdiArgs {
            command: cdi::CdiCommand::Generate(g),
        }) if !g.stdout && g.dir.is_none() => (
            "cdi generate".into(),
            "it writes the node's specs into topology.cdi_dirs: run it with sudo, or give \
             --dir DIR or --stdout",
        ),
        Command::Lazy(lazy::LazyArgs {
            command: lazy::LazyCommand::Serve(_),
        }) => (
            "lazy serve".into(),
            "berth starts it for a node's containers",
        ),
        Command::Prolog(_) => ("prolog".into(), "Slurm runs it as root (Prolog=)"),
        Command::Epilog(_) => ("epilog".into(), "Slurm runs it as root (Epilog=)"),
        _ => return None,
    };
    // main prints it as `berth: run needs root ...`.
    Some(format!("{verb} needs root (you are uid {uid}): {how}"))
}

/// Which of `names` the command line used for its verb (an alias's name), for messages.
fn invoked_as(names: &[&'static str]) -> Option<&'static str> {
    std::env::args()
        .skip(1)
        .find_map(|a| names.iter().find(|n| **n == a).copied())
}
