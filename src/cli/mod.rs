//! The command line: one file per verb. Each verb turns its arguments into library calls and
//! returns the process exit status.
//!
//! Exit status of every verb (`berth run`/`exec` add the command's own: see run.rs):
//!
//! | status | meaning |
//! |---|---|
//! | 0 | done |
//! | 1 | the verb's answer is "no" or it failed on its object (an image import, `health` unfit, `stage status` incomplete, `images verify` differences) |
//! | 2 | usage: a bad flag or value (refused by the parser before anything is read or fetched), bad input, or a verb that needs root run by another user ([`needs_root`]) |
//! | 125 | the host could not do what was asked (state directory, cgroup, mounts) |
//! | 141 | stdout's reader went away |

/// `print!` for the verbs' output: see [`write_stdout`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!($($arg)*)) };
}

/// `println!` for the verbs' output: see [`write_stdout`].
macro_rules! outln {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

pub mod access;
pub mod agent;
pub mod cdi;
pub mod cluster;
pub mod cluster_slurm;
pub mod container;
#[cfg(test)]
mod doc_check;
pub mod exit;
pub mod export;
pub mod gc;
pub mod health;
pub mod images;
pub mod import;
pub mod lazy;
pub mod lazy_serve;
pub mod prewarm;
pub mod prolog;
pub mod run;
pub mod stage;
pub mod step;
pub mod topo;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{self, Config};

/// `berth --version`: the crate's version and the commit it was built from (build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("BERTH_GIT_COMMIT"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version = VERSION,
    about = "Run commands and Slurm job steps in containers isolated by cgroup v2 and namespaces",
    long_about = "berth runs commands and Slurm job steps in containers: their own mount, UTS, IPC, \
cgroup (and PID) namespaces, an overlay of an image that is never modified, cgroup v2 limits and a \
device allow-list, as an unprivileged user. Images come from OCI/Docker registries, Enroot .sqsh \
and Apptainer .sif files, OCI layouts and Docker/Podman archives, imported once per node. It is the \
node-side runtime behind berth's Slurm SPANK plugin (srun --container-image=...) and can be used on \
its own."
)]
pub struct Cli {
    /// Configuration file [default: /etc/berth/berth.toml, or $BERTH_CONFIG]
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Print setup stage timings and a resource summary (-vv: debug logs)
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    Run(Box<run::RunArgs>),
    Create(Box<container::CreateArgs>),
    Exec(container::ExecArgs),
    Rm(container::RmArgs),
    Ps(container::PsArgs),
    Gc(gc::GcArgs),
    Step(step::StepArgs),
    Prolog(prolog::PrologArgs),
    Epilog(prolog::EpilogArgs),
    #[command(visible_alias = "pull")]
    Import(import::ImportArgs),
    Images(images::ImagesArgs),
    Export(export::ExportArgs),
    Lazy(lazy::LazyArgs),
    Topo(topo::TopoArgs),
    Health(health::HealthArgs),
    Cdi(cdi::CdiArgs),
    Stage(stage::StageArgs),
    Agent(agent::AgentArgs),
    Cluster(cluster::ClusterArgs),
}

pub use access::needs_root;
pub use exit::Failure;

impl Cli {
    /// The command line, parsed; a usage error is printed as clap words it, with each value
    /// longer than a line elided ([`elide`]): clap quotes the offending value whole.
    pub fn parse_args() -> Cli {
        use clap::error::ErrorKind;
        match Cli::try_parse() {
            Ok(mut cli) => {
                match &mut cli.command {
                    Command::Run(args) => args.take_positional_image(),
                    Command::Create(args) => args.take_positional_image(),
                    _ => {}
                }
                cli
            }
            // A value a flag's parser refused: one line, as berth words every error.
            Err(e) if e.kind() == ErrorKind::ValueValidation => {
                let line = berth_sys::text::one_line(&elide_words(&value_error_line(&e)));
                eprintln!("berth: {line}");
                std::process::exit(e.exit_code());
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::DisplayHelp
                        | ErrorKind::DisplayVersion
                        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                ) =>
            {
                e.exit()
            }
            Err(e) => {
                let text = e.render().to_string();
                eprint!("{}", elide_words(&text));
                std::process::exit(e.exit_code());
            }
        }
    }

    pub fn load_config(&self) -> Result<Config, Failure> {
        let (path, explicit) = match (&self.config, std::env::var_os("BERTH_CONFIG")) {
            (Some(p), _) => (p.clone(), true),
            (None, Some(p)) => (PathBuf::from(p), true),
            (None, None) => (PathBuf::from(config::DEFAULT_PATH), false),
        };
        // The lazy image servers a container starts (from /) read the same file.
        if explicit && let Ok(abs) = std::path::absolute(&path) {
            let _ = crate::image::lazy::server::CONFIG_PATH.set(abs);
        }
        Ok(Config::load(&path, explicit)?)
    }

    /// What logging needs to know of this command line. A configuration that cannot be read
    /// logs with the defaults; the verb then reports that error itself.
    pub fn log_setup(&self, config: Option<&Config>) -> crate::log::Setup {
        crate::log::Setup {
            config: config.map(|c| c.log.clone()).unwrap_or_default(),
            verbose: self.verbose,
            slurm: self.slurm_path(),
        }
    }

    /// The verb of a Slurm path, with the job and step its arguments or environment name.
    fn slurm_path(&self) -> Option<(&'static str, Option<String>, Option<u64>)> {
        let job_env = || {
            std::env::var("SLURM_JOB_ID")
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        };
        match &self.command {
            Command::Prolog(_) => Some(("prolog", job_env(), None)),
            Command::Epilog(_) => Some(("epilog", job_env(), None)),
            Command::Step(args) => match &args.command {
                step::StepCommand::Create => Some(("step create", None, None)),
                step::StepCommand::Destroy(d) => {
                    Some(("step destroy", Some(d.job_id.to_string()), Some(d.step_id)))
                }
            },
            _ => None,
        }
    }

    /// Runs the verb with `config`, [`Cli::load_config`]'s answer (read once, before logging
    /// starts): a verb that needs root refuses another user first, whatever the file says.
    pub fn execute(self, config: Result<Config, Failure>) -> Result<i32, Failure> {
        if let Some(line) = needs_root(&self.command, nix::unistd::geteuid().as_raw()) {
            return Err(Failure::input(line));
        }
        let config = config?;
        berth_agent::peer::install(&config);
        match &self.command {
            Command::Run(args) => run::execute(args, &config, self.verbose > 0),
            Command::Create(args) => container::create(args, &config),
            Command::Exec(args) => container::exec(args, &config),
            Command::Rm(args) => container::rm(args, &config),
            Command::Ps(args) => container::ps(args, &config),
            Command::Gc(args) => gc::execute(args, &config),
            Command::Step(args) => step::execute(args, &config),
            Command::Prolog(args) => prolog::prolog(args, &config),
            Command::Epilog(args) => prolog::epilog(args, &config),
            Command::Import(args) => import::execute(args, &config),
            Command::Images(args) => images::execute(args, &config),
            Command::Export(args) => export::execute(args, &config),
            Command::Lazy(args) => lazy::execute(args, &config),
            Command::Topo(args) => topo::execute(args, &config),
            Command::Health(args) => health::execute(args, &config),
            Command::Cdi(args) => cdi::execute(args, &config),
            Command::Stage(args) => stage::execute(args, &config),
            Command::Agent(args) => {
                agent::execute(args, &config, &agent::config_path(self.config.as_deref()))
            }
            Command::Cluster(args) => cluster::execute(args, &config),
        }
    }
}

/// A refused value as one line: `--memory: invalid size '5Q': use ...` (the flag, then what its
/// parser said), or clap's first line when it gives no parser's error.
fn value_error_line(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(a)) => a.split(' ').next().unwrap_or(a).to_string(),
        _ => String::new(),
    };
    match std::error::Error::source(e) {
        // A parser that words the flag itself (`--pids -3: use ...`).
        Some(source) if !arg.is_empty() && source.to_string().starts_with(&arg) => {
            source.to_string()
        }
        Some(source) if !arg.is_empty() => format!("{arg}: {source}"),
        _ => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        }
    }
}

pub mod values;

pub use berth_sys::text::elide;

/// `text` with every space-separated word longer than a line elided.
fn elide_words(text: &str) -> String {
    text.split('\n')
        .map(|line| {
            line.split(' ')
                .map(|w| elide(w).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Writes a verb's output to stdout. A reader that went away (`berth images | head -1`) ends
/// berth quietly with 141, as SIGPIPE ends other tools; `println!` would panic. berth keeps
/// SIGPIPE ignored (Rust's runtime does) so that a child or a socket closing on it is an error
/// it reports and cleans up after, not its death.
#[expect(
    clippy::exit,
    reason = "stdout failing ends berth wherever a verb prints: 141 on a closed pipe, as SIGPIPE \
              would, else 1"
)]
pub fn write_stdout(args: std::fmt::Arguments) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("berth: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests;
