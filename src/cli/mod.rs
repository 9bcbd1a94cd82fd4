//! The command line: one file per verb. Each verb turns its arguments into library calls and
//! returns the process exit status.

/// `print!` for the verbs' output: see [`write_stdout`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!($($arg)*)) };
}

/// `println!` for the verbs' output: see [`write_stdout`].
macro_rules! outln {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

pub mod agent;
pub mod cdi;
pub mod cluster;
pub mod container;
pub mod export;
pub mod gc;
pub mod health;
pub mod image;
pub mod images;
pub mod import;
pub mod prolog;
pub mod run;
pub mod stage;
pub mod step;
pub mod topo;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{self, Config};

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version,
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
    Import(import::ImportArgs),
    Images(images::ImagesArgs),
    Export(export::ExportArgs),
    Topo(topo::TopoArgs),
    Health(health::HealthArgs),
    Cdi(cdi::CdiArgs),
    Stage(stage::StageArgs),
    Agent(agent::AgentArgs),
    Cluster(cluster::ClusterArgs),
}

/// A failure before or around the container, printed as one line `berth: …`.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    /// Bad input from the user (flags, paths): exit 2, like a usage error.
    pub fn input(message: impl Into<String>) -> Self {
        Self {
            code: 2,
            message: message.into(),
        }
    }
    /// The host could not do what was asked: exit 125.
    pub fn system(message: impl Into<String>) -> Self {
        Self {
            code: 125,
            message: message.into(),
        }
    }
}

impl Cli {
    /// The command line, parsed; a usage error is printed as clap words it, with each value
    /// longer than a line elided ([`elide`]): clap quotes the offending value whole.
    pub fn parse_args() -> Cli {
        use clap::error::ErrorKind;
        match Cli::try_parse() {
            Ok(cli) => cli,
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
        Config::load(&path, explicit).map_err(|e| Failure::input(e.to_string()))
    }

    pub fn execute(self) -> Result<i32, Failure> {
        let config = self.load_config()?;
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
mod tests {
    use super::*;

    #[test]
    fn elide_keeps_short_values_and_cuts_long_ones() {
        assert_eq!(elide("/tmp:/"), "/tmp:/");
        let long = "é".repeat(50_000);
        let e = elide(&long);
        assert!(e.len() < 250, "{e}");
        assert!(e.contains("bytes]"));
        let ascii = "a".repeat(1000) + "END";
        assert!(elide(&ascii).ends_with("END"));
        let line = format!(
            "error: invalid value '{}' for '--net'\n",
            "x".repeat(100_000)
        );
        let short = elide_words(&line);
        assert!(short.len() < 250 && short.ends_with("'--net'\n"), "{short}");
    }
}
