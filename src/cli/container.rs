//! `berth create`, `berth exec`, `berth rm`, `berth ps`: containers that outlive one command and
//! that other processes join (the model of a Slurm step's container).

use std::collections::BTreeMap;

use clap::Args;
use serde::Serialize;

use super::Failure;
use super::run::{ContainerArgs, request};
use crate::config::Config;
use crate::node::container::options;
use crate::runtime::{self, join, state};
use crate::spec::parse;

/// Create a container that stays up, holding its namespaces, until `berth rm`
///
/// The image is the positional IMAGE (as podman create takes it), --image REF or --rootfs DIR.
#[derive(Debug, Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub container: ContainerArgs,

    /// The image, as --image takes it (instead of --image or --rootfs)
    #[arg(value_name = "IMAGE", conflicts_with_all = ["image", "rootfs"])]
    pub positional_image: Option<String>,

    /// A name to find the container by (unique per user)
    #[arg(long, value_name = "NAME", value_parser = super::values::name)]
    pub name: Option<String>,

    /// Print a JSON description (id, init pid, namespaces, environment, working directory)
    #[arg(long)]
    pub json: bool,
}

/// Run a command in a container made by `berth create`
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Container id or name
    pub container: String,

    /// Add or override an environment variable
    #[arg(short, long = "env", value_name = "KEY=VAL", value_parser = super::values::env)]
    pub env: Vec<String>,

    /// The command and its arguments
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Stop and remove containers made by `berth create`
#[derive(Debug, Args)]
pub struct RmArgs {
    /// Container ids or names
    #[arg(required = true)]
    pub containers: Vec<String>,
}

impl CreateArgs {
    /// Moves the positional IMAGE into --image (they conflict: at most one is set).
    pub fn take_positional_image(&mut self) {
        if let Some(image) = self.positional_image.take() {
            self.container.image = Some(image);
        }
    }
}

/// List containers on this node (every one for root, a user's own for a user)
#[derive(Debug, Args)]
pub struct PsArgs {
    /// Print a JSON array, one object per container: id, uid, name, init_pid, owner_pid,
    /// cgroup, labels (docs/user-guide.md, "JSON output")
    #[arg(long)]
    pub json: bool,
}

/// One container as `berth ps --json` prints it: a stable schema, whatever the state record
/// holds.
#[derive(Debug, Serialize)]
pub struct PsEntry {
    /// The container's id (`berth exec`, `berth rm`).
    pub id: String,
    /// The host uid its process runs as: whose container it is.
    pub uid: u32,
    /// `--name`, or null.
    pub name: Option<String>,
    /// The host pid of its init; 0 while it starts.
    pub init_pid: i32,
    /// The host pid of the berth process that owns it.
    pub owner_pid: i32,
    /// Its cgroup directory.
    pub cgroup: String,
    /// Every label, `uid` and `name` included: `job`, `step` for a Slurm step's container.
    pub labels: BTreeMap<String, String>,
}

impl From<&state::Record> for PsEntry {
    fn from(r: &state::Record) -> Self {
        Self {
            id: r.id.clone(),
            uid: r.uid(),
            name: r.labels.get("name").cloned(),
            init_pid: r.init_pid,
            owner_pid: r.owner_pid,
            cgroup: r.cgroup.display().to_string(),
            labels: r.labels.clone(),
        }
    }
}

pub fn create(args: &CreateArgs, config: &Config) -> Result<i32, Failure> {
    let prepared = request(&args.container, &[], config, true)?;
    let created = crate::node::run::create(&prepared, args.name.as_deref(), config)?;
    if args.json {
        let text = serde_json::to_string(&created).map_err(|e| Failure::system(e.to_string()))?;
        outln!("{text}");
    } else {
        outln!("{}", created.id);
    }
    Ok(0)
}

/// Joining or removing a container takes root's privileges (setns, the cgroup). Checked after
/// the lookup: a user, who can only find their own containers, gets for another user's exactly
/// what a missing one gets; for their own, this line ([`super::needs_root`]'s wording).
fn needs_root(verb: &str, key: &str) -> Result<(), Failure> {
    let me = nix::unistd::geteuid().as_raw();
    if me == 0 {
        return Ok(());
    }
    Err(Failure::input(format!(
        "{verb} {} needs root (you are uid {me}): run it through Slurm (srun --container-name) \
         or sudo",
        super::elide(key)
    )))
}

pub fn exec(args: &ExecArgs, config: &Config) -> Result<i32, Failure> {
    let id = state::find(&config.runtime.state_dir, &args.container).ok_or_else(|| {
        Failure::input(format!(
            "no container '{}' (see berth ps)",
            super::elide(&args.container)
        ))
    })?;
    needs_root("exec", &args.container)?;
    let env = args
        .env
        .iter()
        .map(|e| parse::env_pair(e).map_err(|err| Failure::input(format!("--env: {err}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let exit =
        join::exec(&options(config, None), &id, &args.command, &env).map_err(Failure::from)?;
    Ok(exit.code())
}

pub fn rm(args: &RmArgs, config: &Config) -> Result<i32, Failure> {
    let opts = options(config, None);
    let mut code = 0;
    for key in &args.containers {
        match state::find(&config.runtime.state_dir, key) {
            Some(id) => {
                needs_root("rm", key)?;
                runtime::remove(&opts, &id).map_err(Failure::from)?;
                outln!("{id}");
            }
            None => {
                eprintln!("berth: no container '{}' (see berth ps)", super::elide(key));
                code = 1;
            }
        }
    }
    crate::image::mount::release_unused(&config.image());
    Ok(code)
}

/// Lists the containers the caller may see: every one for root, their own for another user
/// (`state::list`). UID is the host uid the container's process runs as.
pub fn ps(args: &PsArgs, config: &Config) -> Result<i32, Failure> {
    if nix::unistd::geteuid().is_root() {
        state::open_root(&config.runtime.state_dir).map_err(|e| Failure::system(e.to_string()))?;
    }
    let mut records = state::list(&config.runtime.state_dir);
    records.retain(state::owner_alive);
    records.sort_by(|a, b| a.id.cmp(&b.id));
    if args.json {
        let entries: Vec<PsEntry> = records.iter().map(PsEntry::from).collect();
        let text =
            serde_json::to_string_pretty(&entries).map_err(|e| Failure::system(e.to_string()))?;
        outln!("{text}");
        return Ok(0);
    }
    outln!(
        "{:<14} {:>8} {:>8}  {:<16} LABELS",
        "ID",
        "UID",
        "PID",
        "NAME"
    );
    // One row per container whatever its record holds: a name or label with a control
    // character (refused now, possibly kept by an older berth) is shown escaped.
    use berth_sys::text::escape_controls as esc;
    for r in records {
        let labels: Vec<String> = r
            .labels
            .iter()
            .filter(|(k, _)| *k != "name" && *k != "uid")
            .map(|(k, v)| format!("{}={}", esc(k), esc(v)))
            .collect();
        outln!(
            "{:<14} {:>8} {:>8}  {:<16} {}",
            esc(&r.id),
            r.uid(),
            r.init_pid,
            esc(r.labels.get("name").map(String::as_str).unwrap_or("-")),
            labels.join(",")
        );
    }
    Ok(0)
}
