//! `berth-controller`: berth's cluster controller. One instance (a single Raft voter) or three
//! (two head nodes and a login node) keep a replicated record of the nodes, their health
//! verdicts and the drain/resume decisions those lead to, and the rolling maintenances
//! (rollout.rs); the leader applies the decisions to Slurm with `scontrol`. Raft is openraft
//! (0.9), its log and state machine in one redb file under the data directory. See docs/admin-guide.md, "Cluster controller".

mod error;
mod listen;
mod network;
mod node;
mod rollout;
mod server;
mod sim;
mod state;
mod store;
mod takeover;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use openraft::{BasicNode, Raft};
use serde::Deserialize;

openraft::declare_raft_types!(
    /// The controller's Raft types: commands in, replies out, nodes addressed by host:port.
    pub TypeConfig:
        D = state::Command,
        R = state::Reply,
        SnapshotData = std::io::Cursor<Vec<u8>>,
);

/// The `[controller]` section of berth.toml. Every field has a default; flags override.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// This controller's Raft id, one of `peers`.
    pub id: u64,
    /// Address the HTTP API (agents, CLI, peers) listens on.
    pub listen: String,
    /// The Raft voters, `ID=HOST:PORT` each; empty: this controller alone (id at `listen`).
    pub peers: Vec<String>,
    /// Where the redb file lives (`raft.redb`).
    pub data_dir: PathBuf,
    /// The shared key file; every request proves it holds its content (berth_api::auth).
    pub key_file: PathBuf,
    pub sinfo: PathBuf,
    pub scontrol: PathBuf,
    /// How often the leader reconciles Slurm with the decisions.
    pub reconcile_interval_ms: u64,
    /// At most this many `scontrol update` calls per reconcile round.
    pub max_updates_per_round: usize,
    /// At most this many nodes in one `scontrol update` call (the nodes of one reason go
    /// together, `NodeName=a,b,c`).
    pub nodes_per_call: usize,
    /// At least this many milliseconds between two `scontrol update` calls (the rate limit).
    pub scontrol_interval_ms: u64,
    /// Test only (the hidden `serve --failpoint-file`; no configuration file sets it).
    #[serde(skip)]
    pub failpoint_file: Option<PathBuf>,
    /// The agents' heartbeat interval; a node is lost after 3 without a heartbeat.
    pub heartbeat_interval_s: u64,
    pub raft_heartbeat_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    pub soft_fails: u32,
    pub resume_passes: u32,
    pub flap_drains: u32,
    pub breaker_min: u32,
    pub breaker_percent: u32,
    pub breaker_window_s: u64,
    /// The slurm.conf the leader's watch reads (SlurmctldHost, StateSaveLocation, slurmdbd);
    /// empty: $SLURM_CONF, else /etc/slurm/slurm.conf.
    pub slurm_conf: PathBuf,
    pub squeue: PathBuf,
    /// How often the leader pings the slurmctlds (and checks slurmdbd).
    pub watch_interval_ms: u64,
    /// A ping not answered within this long failed.
    pub ping_timeout_ms: u64,
    /// Whether the leader runs `scontrol takeover` when the primary fails and the backup
    /// answers (only with a backup in slurm.conf).
    pub takeover: bool,
    /// Failed pings of the primary in a row that make a takeover.
    pub takeover_after: u32,
    /// How often the leader asks squeue which jobs ended, to judge the agents' leftovers.
    pub audit_interval_s: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            id: 1,
            listen: "0.0.0.0:6820".into(),
            peers: Vec::new(),
            data_dir: "/var/lib/berth-controller".into(),
            key_file: "/etc/berth/cluster.key".into(),
            sinfo: "sinfo".into(),
            scontrol: "scontrol".into(),
            reconcile_interval_ms: 1000,
            max_updates_per_round: 50,
            nodes_per_call: 100,
            scontrol_interval_ms: 200,
            failpoint_file: None,
            heartbeat_interval_s: 5,
            raft_heartbeat_ms: 50,
            election_timeout_min_ms: 250,
            election_timeout_max_ms: 500,
            soft_fails: 2,
            resume_passes: 3,
            flap_drains: 3,
            breaker_min: 2,
            breaker_percent: 10,
            breaker_window_s: 600,
            slurm_conf: PathBuf::new(),
            squeue: "squeue".into(),
            watch_interval_ms: 1000,
            ping_timeout_ms: 1000,
            takeover: true,
            takeover_after: 3,
            audit_interval_s: 30,
        }
    }
}

impl Settings {
    pub fn rules(&self) -> state::Rules {
        state::Rules {
            soft_fails: self.soft_fails.max(1),
            resume_passes: self.resume_passes.max(1),
            flap_drains: self.flap_drains,
            flap_window_ms: 3_600_000,
            breaker_min: self.breaker_min,
            breaker_percent: self.breaker_percent,
            breaker_window_ms: self.breaker_window_s * 1000,
        }
    }

    /// The voters: id → API address.
    pub fn voters(&self) -> anyhow::Result<BTreeMap<u64, BasicNode>> {
        let mut out = BTreeMap::new();
        for p in &self.peers {
            let (id, addr) = p
                .split_once('=')
                .with_context(|| format!("controller peer {p:?}: write it as ID=HOST:PORT"))?;
            let id: u64 = id
                .trim()
                .parse()
                .with_context(|| format!("controller peer {p:?}: the id is not a number"))?;
            out.insert(id, BasicNode::new(addr.trim()));
        }
        if out.is_empty() {
            out.insert(self.id, BasicNode::new(self.listen.clone()));
        }
        if !out.contains_key(&self.id) {
            bail!(
                "controller id {} is not among the peers ({}): set controller.id to one of them",
                self.id,
                self.peers.join(", ")
            );
        }
        Ok(out)
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "berth-controller",
    version,
    about = "berth's cluster controller"
)]
struct Cli {
    /// berth's configuration file; its [controller] section [default: /etc/berth/berth.toml
    /// when it exists]
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a controller
    Serve(ServeArgs),
    /// Drive simulated agents against running controllers; print a JSON summary
    Sim(SimArgs),
}

#[derive(Debug, clap::Args)]
struct SimArgs {
    /// Simulated agents (nodes sim00000, sim00001, ...)
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// A controller's API address; repeat for each
    #[arg(long = "controller", required = true)]
    controllers: Vec<String>,
    /// The shared key file
    #[arg(long)]
    key_file: PathBuf,
    /// Each agent's heartbeat interval
    #[arg(long, default_value_t = 5000)]
    interval_ms: u64,
    /// Share of agents whose GPU check fails
    #[arg(long, default_value_t = 0)]
    failing_percent: u32,
    /// How long to run
    #[arg(long, default_value_t = 30)]
    duration_s: u64,
    /// Sending threads
    #[arg(long, default_value_t = 32)]
    threads: usize,
    /// Seconds after the start when the failing share starts failing (each sends at once)
    #[arg(long, default_value_t = 0)]
    fail_after_s: u64,
    /// Drive a rollout over every agent's node instead, each step taking this long (the
    /// controllers must know the agents' nodes in their sinfo)
    #[arg(long)]
    rollout_per_node_ms: Option<u64>,
    /// The rollout's max unavailable (a count or a percentage)
    #[arg(long, default_value = "10%")]
    rollout_max_unavailable: String,
    /// The rollout's health gate (passing heartbeats in a row)
    #[arg(long, default_value_t = 1)]
    rollout_gate_passes: u32,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Raft id [default: controller.id]
    #[arg(long)]
    id: Option<u64>,
    /// API address [default: controller.listen]
    #[arg(long)]
    listen: Option<String>,
    /// A voter, ID=HOST:PORT; repeat for each [default: controller.peers]
    #[arg(long = "peer")]
    peers: Vec<String>,
    /// [default: controller.data_dir]
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// [default: controller.key_file]
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// [default: controller.sinfo]
    #[arg(long)]
    sinfo: Option<PathBuf>,
    /// [default: controller.scontrol]
    #[arg(long)]
    scontrol: Option<PathBuf>,
    /// [default: controller.reconcile_interval_ms]
    #[arg(long)]
    reconcile_interval_ms: Option<u64>,
    /// [default: controller.heartbeat_interval_s]
    #[arg(long)]
    heartbeat_interval_s: Option<u64>,
    /// Tests only: exit, as a crash would, when this file exists as the leader is about to
    /// apply committed decisions to Slurm (the failpoint between commit and apply; it removes
    /// the file, so one arming fires once)
    #[arg(long, hide = true, value_name = "PATH")]
    failpoint_file: Option<PathBuf>,
}

fn load_settings(path: Option<&Path>) -> anyhow::Result<Settings> {
    let (path, explicit) = match path {
        Some(p) => (p.to_path_buf(), true),
        None => (PathBuf::from("/etc/berth/berth.toml"), false),
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if !explicit && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Settings::default());
        }
        Err(e) => bail!("reading {}: {e}", path.display()),
    };
    #[derive(Deserialize, Default)]
    struct File {
        #[serde(default)]
        controller: Option<toml::Value>,
    }
    let file: File = toml::from_str::<toml::Table>(&text)
        .and_then(|t| toml::Value::Table(t).try_into())
        .with_context(|| format!("{}: not valid TOML", path.display()))?;
    match file.controller {
        None => Ok(Settings::default()),
        Some(v) => v
            .try_into()
            .with_context(|| format!("{}: [controller]", path.display())),
    }
}

/// Reads the shared key: bounded, not empty, and only from a file owned by root or this
/// controller's user that group and others cannot touch (berth_api::key_file_problem);
/// otherwise the controller refuses to start in one line.
pub fn read_key(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::MetadataExt;
    let f = std::fs::File::open(path).with_context(|| {
        format!(
            "reading the key file {}: create it (the same on every controller and node), \
             e.g. `head -c 32 /dev/urandom | base64 > {0}; chmod 600 {0}`",
            path.display()
        )
    })?;
    // Checked on the open file: what is read is what was checked.
    let meta = f
        .metadata()
        .with_context(|| format!("reading the key file {}", path.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if let Some(why) = berth_api::key_file_problem(meta.uid(), meta.mode(), euid) {
        bail!("the key file {}: {why}", path.display());
    }
    let mut key = String::new();
    f.take(berth_api::KEY_MAX as u64 + 1)
        .read_to_string(&mut key)
        .with_context(|| format!("reading the key file {}", path.display()))?;
    if key.len() > berth_api::KEY_MAX || key.trim().is_empty() {
        bail!(
            "the key file {} is empty or longer than {} bytes",
            path.display(),
            berth_api::KEY_MAX
        );
    }
    Ok(key.trim().to_string())
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BERTH_CONTROLLER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let result = match cli.command {
        Command::Serve(args) => serve(cli.config.as_deref(), args),
        Command::Sim(args) => read_key(&args.key_file).map(|key| {
            let summary = sim::run(sim::SimOptions {
                controllers: args.controllers,
                key: berth_api::auth::Key::new(&key),
                agents: args.agents,
                interval: std::time::Duration::from_millis(args.interval_ms.max(1)),
                failing_percent: args.failing_percent.min(100),
                duration: std::time::Duration::from_secs(args.duration_s),
                threads: args.threads,
                fail_after: std::time::Duration::from_secs(args.fail_after_s),
                rollout: args.rollout_per_node_ms.map(|ms| sim::RolloutSim {
                    per_node: std::time::Duration::from_millis(ms),
                    max_unavailable: args.rollout_max_unavailable,
                    gate_passes: args.rollout_gate_passes,
                }),
            });
            println!("{summary}");
        }),
    };
    if let Err(e) = result {
        eprintln!("berth-controller: {e:#}");
        std::process::exit(1);
    }
}

/// Raises the soft limit on open files to the hard limit: every agent's heartbeat and every
/// admin call is a connection, and the default soft limit (1024) is near what listen.rs admits.
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct it is given, which lives on this stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0
        || lim.rlim_cur >= lim.rlim_max
    {
        return;
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct it is given; raising the soft limit to the hard one
    // needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        tracing::warn!(
            "raising the open files limit: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn serve(config: Option<&Path>, args: ServeArgs) -> anyhow::Result<()> {
    let mut s = load_settings(config)?;
    if let Some(v) = args.id {
        s.id = v;
    }
    if let Some(v) = args.listen {
        s.listen = v;
    }
    if !args.peers.is_empty() {
        s.peers = args.peers;
    }
    if let Some(v) = args.data_dir {
        s.data_dir = v;
    }
    if let Some(v) = args.key_file {
        s.key_file = v;
    }
    if let Some(v) = args.sinfo {
        s.sinfo = v;
    }
    if let Some(v) = args.scontrol {
        s.scontrol = v;
    }
    if let Some(v) = args.reconcile_interval_ms {
        s.reconcile_interval_ms = v;
    }
    if let Some(v) = args.heartbeat_interval_s {
        s.heartbeat_interval_s = v;
    }
    s.failpoint_file = args.failpoint_file;
    let key = read_key(&s.key_file)?;
    raise_nofile_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run(s, key))
}

async fn run(s: Settings, key: String) -> anyhow::Result<()> {
    let voters = s.voters()?;
    std::fs::create_dir_all(&s.data_dir)
        .with_context(|| format!("creating the data directory {}", s.data_dir.display()))?;
    let store = store::Store::open(&s.data_dir.join("raft.redb"))?;
    let config = openraft::Config {
        cluster_name: "berth".into(),
        heartbeat_interval: s.raft_heartbeat_ms,
        election_timeout_min: s.election_timeout_min_ms,
        election_timeout_max: s.election_timeout_max_ms,
        ..Default::default()
    };
    let config = Arc::new(config.validate().context("the Raft settings")?);
    let (log, sm) = openraft::storage::Adaptor::new(store.clone());
    let net = network::Network {
        key: berth_api::auth::Key::new(&key),
    };
    let raft = Raft::new(s.id, config, net, log, sm)
        .await
        .context("starting Raft")?;
    // Every voter may initialize with the same membership; a voter that already has one (a
    // restart, or a peer's initialize got here first) is not asked again: openraft would refuse
    // and log the refusal as an error.
    let initialized = raft
        .is_initialized()
        .await
        .context("reading the Raft state")?;
    if !initialized && let Err(e) = raft.initialize(voters.clone()).await {
        tracing::debug!("initialize: {e}");
    }
    let listener = tokio::net::TcpListener::bind(&s.listen)
        .await
        .with_context(|| format!("listening on {}", s.listen))?;
    server::serve(s, key, raft, store, voters, listener).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_and_a_lone_controller_is_its_own_voter() {
        let s = Settings::default();
        let v = s.voters().unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[&1].addr, "0.0.0.0:6820");
        let s = Settings {
            id: 2,
            peers: vec!["1=a:1".into(), "2=b:2".into(), "3=c:3".into()],
            ..Default::default()
        };
        assert_eq!(s.voters().unwrap()[&3].addr, "c:3");
        let s = Settings { id: 4, ..s };
        assert!(s.voters().unwrap_err().to_string().contains("not among"));
    }
}
