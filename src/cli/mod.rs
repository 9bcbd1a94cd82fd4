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

    pub fn execute(self) -> Result<i32, Failure> {
        if let Some(line) = needs_root(&self.command, nix::unistd::geteuid().as_raw()) {
            return Err(Failure::input(line));
        }
        let config = self.load_config()?;
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

/// The flags' value parsers: each value is checked when the command line is parsed, before a
/// config is read, an image fetched or any state touched, so a typo costs nothing and fails with
/// exit 2 and one line. Each returns the text unchanged (the verbs parse it again with the same
/// library function, which keeps its own checks for callers other than the command line).
pub mod values {
    use crate::spec::{self, parse};

    /// A byte size: `--memory`, `--memory-swap`, `images gc --max-size`.
    pub fn size(text: &str) -> Result<u64, String> {
        parse::size(text).map_err(|e| e.to_string())
    }

    /// A CPU count: `--cpus 0.5`.
    pub fn cpus(text: &str) -> Result<i64, String> {
        parse::cpus(text, spec::CPU_PERIOD_US).map_err(|e| e.to_string())
    }

    /// A cgroup CPU list: `--cpuset 0-3,8`.
    pub fn cpu_list(text: &str) -> Result<String, String> {
        parse::cpu_list(text).map_err(|e| e.to_string())
    }

    /// A kernel CPU list with strides (`topo --cpus 0-15:2`).
    pub fn cpu_set(text: &str) -> Result<String, String> {
        crate::topology::cpuset::CpuSet::parse(text)
            .map(|_| text.to_string())
            .map_err(|e| e.to_string().replace(text, &super::elide(text)))
    }

    /// A positive number of tasks: `--pids`.
    pub fn pids(text: &str) -> Result<i64, String> {
        match text.parse::<i64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "--pids {}: use a positive number of tasks",
                super::elide(text)
            )),
        }
    }

    /// A positive number of seconds: `--timeout`.
    pub fn seconds(text: &str) -> Result<std::time::Duration, String> {
        text.trim()
            .parse::<f64>()
            .ok()
            .and_then(crate::time::duration_from_secs)
            .ok_or_else(|| {
                format!(
                    "--timeout {}: use a positive number of seconds",
                    super::elide(text)
                )
            })
    }

    /// A duration with a unit: `images gc --unused-for 7d`.
    pub fn duration(text: &str) -> Result<std::time::Duration, String> {
        crate::image::store::parse_duration(text)
            .map_err(|e| e.to_string().replace(text, &super::elide(text)))
    }

    /// `--mount SRC:DST[:ro|rw]`.
    pub fn mount(text: &str) -> Result<String, String> {
        parse::bind_mount(text)
            .map(|_| text.to_string())
            .map_err(|e| e.to_string())
    }

    /// `--env KEY=VAL`, or `KEY` alone (the caller's value, looked up when the verb runs). A
    /// KEY with a control character is refused (a value may hold any but NUL: certificates,
    /// exported shell functions).
    pub fn env(text: &str) -> Result<String, String> {
        if text.contains('=') || text.is_empty() || text.contains('\0') {
            parse::env_pair(text).map_err(|e| e.to_string())?;
        }
        let key = text.split('=').next().unwrap_or_default();
        if berth_sys::text::control_char(key).is_some()
            && let Some(line) = berth_sys::text::refuse_control("--env", text)
        {
            return Err(line);
        }
        Ok(text.to_string())
    }

    /// `create --name`: not empty, and no control character (`berth ps` shows it in a row).
    pub fn name(text: &str) -> Result<String, String> {
        if text.is_empty() {
            return Err("--name: give a name, or leave --name out".into());
        }
        match berth_sys::text::refuse_control("--name", text) {
            Some(line) => Err(line),
            None => Ok(text.to_string()),
        }
    }

    /// `--workdir`'s parser: [`workdir`] on the argument's bytes.
    pub fn workdir_parser() -> impl clap::builder::TypedValueParser<Value = std::path::PathBuf> {
        use clap::builder::TypedValueParser;
        clap::builder::OsStringValueParser::new().try_map(workdir)
    }

    /// `--workdir`: an absolute path the kernel can take (any bytes, as a path may hold).
    pub fn workdir(text: std::ffi::OsString) -> Result<std::path::PathBuf, String> {
        let path = std::path::PathBuf::from(text);
        if path.is_absolute() && path.as_os_str().len() < libc::PATH_MAX as usize {
            Ok(path)
        } else {
            Err(format!(
                "--workdir {}: must be an absolute path, shorter than PATH_MAX",
                super::elide(&path.to_string_lossy())
            ))
        }
    }

    /// `--hostname`.
    pub fn hostname(text: &str) -> Result<String, String> {
        parse::hostname(text).map_err(|e| e.to_string())
    }

    /// `--gpus`: all, none, or indexes (ranges), GPU-UUIDs and PCI addresses; whether the node
    /// has them is checked when the container is built.
    pub fn gpus(text: &str) -> Result<String, String> {
        match text.trim() {
            "all" | "none" | "" => Ok(text.to_string()),
            list => crate::topology::job::parse_gpus("--gpus", list)
                .map(|_| text.to_string())
                .map_err(|e| e.to_string().replace(text, &super::elide(text))),
        }
    }

    /// `topo --gpus`: indexes (ranges), GPU-UUIDs and PCI addresses, as Slurm lists them.
    pub fn gpu_list(text: &str) -> Result<String, String> {
        crate::topology::job::parse_gpus("--gpus", text)
            .map(|_| text.to_string())
            .map_err(|e| e.to_string().replace(text, &super::elide(text)))
    }

    /// `--device`: a device node path under /dev, or a CDI name `vendor.com/class=name`.
    pub fn device(text: &str) -> Result<String, String> {
        if text.starts_with("/dev/") || crate::topology::cdi::is_qualified(text) {
            Ok(text.to_string())
        } else {
            Err(format!(
                "--device {}: must be a device node under /dev, or a CDI name \
                 (vendor.com/class=name)",
                super::elide(text)
            ))
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
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let mut cli = Cli::try_parse_from(std::iter::once("berth").chain(args.iter().copied()))?;
        match &mut cli.command {
            Command::Run(a) => a.take_positional_image(),
            Command::Create(a) => a.take_positional_image(),
            _ => {}
        }
        Ok(cli)
    }

    fn run_args(args: &[&str]) -> run::RunArgs {
        match parse(args).unwrap().command {
            Command::Run(a) => *a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn run_takes_the_first_positional_as_image_only_without_image_or_rootfs() {
        let a = run_args(&["run", "ubuntu:24.04", "ls", "-l", "--memory", "1G"]);
        assert_eq!(a.container.image.as_deref(), Some("ubuntu:24.04"));
        assert_eq!(a.command, ["ls", "-l", "--memory", "1G"]);
        assert_eq!(a.container.memory, None);
        let a = run_args(&["run", "--memory", "1G", "--", "ubuntu", "true"]);
        assert_eq!(a.container.image.as_deref(), Some("ubuntu"));
        assert_eq!(a.command, ["true"]);
        // With --image or --rootfs every positional is the command, `--` or not.
        for args in [
            &["run", "--image", "ubuntu", "--", "echo", "hi"][..],
            &["run", "--image", "ubuntu", "echo", "hi"][..],
        ] {
            let a = run_args(args);
            assert_eq!(a.container.image.as_deref(), Some("ubuntu"));
            assert_eq!(a.command, ["echo", "hi"]);
        }
        let a = run_args(&["run", "--rootfs", "/r", "--", "echo", "-n", "hi"]);
        assert_eq!((a.container.image, a.command.len()), (None, 3));
        let a = run_args(&["run", "--rootfs", "/r", "echo", "-n", "hi"]);
        assert_eq!(a.command, ["echo", "-n", "hi"]);
        // An image alone: its Entrypoint + Cmd.
        let a = run_args(&["run", "--entrypoint", "--arch", "arm64", "ubuntu"]);
        assert_eq!(a.container.image.as_deref(), Some("ubuntu"));
        assert!(a.command.is_empty() && a.container.entrypoint);
        parse(&["run", "--rootfs", "/r", "--image", "x", "--", "true"]).unwrap_err();
        let Command::Create(c) = parse(&["create", "--name", "n", "ubuntu"]).unwrap().command
        else {
            panic!()
        };
        assert_eq!(c.container.image.as_deref(), Some("ubuntu"));
        parse(&["create", "--image", "a", "b"]).unwrap_err();
    }

    #[test]
    fn pull_is_import() {
        let Command::Import(a) = parse(&["pull", "--arch", "arm64", "busybox"])
            .unwrap()
            .command
        else {
            panic!("pull is not import")
        };
        assert_eq!(
            (a.reference.as_str(), a.arch.as_deref()),
            ("busybox", Some("arm64"))
        );
    }

    #[test]
    fn the_parser_refuses_bad_values_in_one_line() {
        use clap::error::ErrorKind;
        for (args, line) in [
            (
                &["run", "--memory", "5Q", "img"][..],
                "--memory: invalid size '5Q'",
            ),
            (
                &["run", "--memory-swap", "0", "img"][..],
                "--memory-swap: invalid size",
            ),
            (
                &["run", "--cpus=-1", "img"][..],
                "--cpus: invalid CPU count",
            ),
            (
                &["run", "--cpus", "0.0001", "img"][..],
                "--cpus: invalid CPU count",
            ),
            (
                &["run", "--cpuset", "3-1", "img"][..],
                "--cpuset: invalid CPU list",
            ),
            (&["run", "--pids", "-5", "img"][..], "--pids "),
            (&["run", "--pids", "x", "img"][..], "--pids "),
            (
                &["run", "--timeout", "0", "img"][..],
                "--timeout 0: use a positive number of seconds",
            ),
            (
                &["run", "--mount", "rel:/x", "img"][..],
                "--mount: invalid mount",
            ),
            (
                &["run", "--mount", "/a:/", "img"][..],
                "--mount: invalid mount",
            ),
            (
                &["run", "--env", "=v", "img"][..],
                "--env: invalid environment variable",
            ),
            (
                &["run", "--hostname", "a b", "img"][..],
                "--hostname: invalid hostname",
            ),
            (
                &["run", "--workdir", "rel", "img"][..],
                "--workdir rel: must be an absolute",
            ),
            (&["run", "--gpus", "3-1", "img"][..], "--gpus"),
            (
                &["run", "--device", "/etc/passwd", "img"][..],
                "--device /etc/passwd: must be a device node",
            ),
            (
                &["create", "--memory", "1X", "--rootfs", "/"][..],
                "--memory: invalid size",
            ),
            (
                &["images", "gc", "--max-size", "lots"][..],
                "--max-size: invalid size",
            ),
            (
                &["images", "gc", "--unused-for", "7y"][..],
                "--unused-for: invalid duration",
            ),
            (
                &["topo", "plan", "--cpus", "x"][..],
                "--cpus: invalid CPU list",
            ),
            (&["topo", "plan", "--gpus", "all"][..], "--gpus"),
            (&["stage", "in", "--workers=-1", "a"][..], "--workers"),
            (&["health", "--expect-gpus", "many"][..], "--expect-gpus"),
            (
                &["run", "-e", "A\nB=1", "img"][..],
                "--env 'A\\nB=1': has a control character",
            ),
            (
                &["run", "-e", "A\u{1b}[2J", "img"][..],
                "--env 'A\\u{1b}[2J': has a control character",
            ),
            (
                &["exec", "-e", "A\rB=1", "c", "--", "true"][..],
                "--env 'A\\rB=1': has a control character",
            ),
            (
                &["create", "--name", "x\nforged", "--rootfs", "/"][..],
                "--name 'x\\nforged': has a control character (\\u{a}) at byte 1",
            ),
            (
                &["create", "--name", "", "--rootfs", "/"][..],
                "--name: give a name",
            ),
        ] {
            let e = parse(args).expect_err(&format!("{args:?} was accepted"));
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{args:?}");
            assert_eq!(e.exit_code(), 2);
            let text = value_error_line(&e);
            assert!(text.starts_with(line), "{args:?}: {text}");
            assert!(!text.contains('\n'), "{args:?}: {text}");
        }
        let long = format!("{}Q", "9".repeat(100_000));
        let e = parse(&["run", "--memory", &long, "img"]).unwrap_err();
        assert!(elide_words(&value_error_line(&e)).len() < 300);
        // What the parsers accept, the verbs get unchanged.
        let a = run_args(&[
            "run",
            "--memory",
            "512M",
            "--memory-swap",
            "1g",
            "--cpus",
            "0.5",
            "--cpuset",
            "0-3,8",
            "--pids",
            "64",
            "--timeout",
            "1.5",
            "--mount",
            "/a:/b:ro",
            "-e",
            "K=V",
            "-e",
            "HOME",
            "--hostname",
            "h.x",
            "--gpus",
            "0,2",
            "--device",
            "/dev/null",
            "--device",
            "nvidia.com/gpu=0",
            "img",
        ]);
        // Parsed once, by clap: the verb gets the values, not the text to check again.
        assert_eq!(a.container.memory, Some(512 << 20));
        assert_eq!(a.container.cpus, Some(50_000));
        assert_eq!(a.container.cpuset.as_deref(), Some("0-3,8"));
        assert_eq!(a.container.pids, Some(64));
        assert_eq!(a.timeout, Some(std::time::Duration::from_millis(1500)));
        assert_eq!(a.container.env, ["K=V", "HOME"]);
        // A value may hold newlines (a certificate, an exported shell function); a name may hold
        // any printable character.
        let cert = run_args(&["run", "-e", "CERT=-----BEGIN\nabc\n-----END", "img"]);
        assert_eq!(cert.container.env, ["CERT=-----BEGIN\nabc\n-----END"]);
        let Command::Create(c) = parse(&["create", "--name", "my box-ü", "--rootfs", "/"])
            .unwrap()
            .command
        else {
            panic!("not create")
        };
        assert_eq!(c.name.as_deref(), Some("my box-ü"));
        assert_eq!(a.container.devices.len(), 2);
        for gpus in [
            "all",
            "none",
            "GPU-8f6c0b2e-0000-0000-0000-000000000000",
            "0000:3b:00.0",
        ] {
            run_args(&["run", "--gpus", gpus, "img"]);
        }
    }

    #[test]
    fn verbs_that_need_root_say_so_and_others_do_not() {
        let refused = |args: &[&str]| needs_root(&parse(args).unwrap().command, 1000);
        for (args, verb) in [
            (&["run", "img", "true"][..], "run needs root"),
            (&["create", "--rootfs", "/"][..], "create needs root"),
            (&["gc"][..], "gc needs root"),
            (&["import", "busybox"][..], "import needs root"),
            (&["images", "ls"][..], "images ls needs root"),
            (&["images", "gc"][..], "images gc needs root"),
            (
                &["export", "c1", "-o", "/tmp/x.sqsh"][..],
                "export needs root",
            ),
            (&["health", "--job-end"][..], "health --job-end needs root"),
            (&["cdi", "generate"][..], "cdi generate needs root"),
            (
                &[
                    "lazy",
                    "serve",
                    "--index",
                    "ab",
                    "--uid",
                    "1000",
                    "docker://r/a:1",
                ][..],
                "lazy serve needs root",
            ),
        ] {
            let line = refused(args).unwrap_or_else(|| panic!("{args:?} allowed"));
            assert!(line.starts_with(verb), "{line}");
            assert!(line.contains("uid 1000") && !line.contains('\n'), "{line}");
            assert!(needs_root(&parse(args).unwrap().command, 0).is_none());
        }
        for args in [
            &["ps"][..],
            &["ps", "--json"][..],
            &["topo"][..],
            &["health", "--all-xids"][..],
            &["cdi", "list"][..],
            &["cdi", "generate", "--stdout"][..],
            &["cdi", "generate", "--dir", "/home/u/cdi"][..],
            &["stage", "status", "/tmp"][..],
            &["export", "--rootfs", "/r", "-o", "/tmp/x.sqsh"][..],
            &["export", "/home/u/x.sqsh", "-o", "/tmp/y.sif"][..],
            &[
                "lazy",
                "publish",
                "/home/u/x.sqsh",
                "docker://r.example/a:1",
            ][..],
        ] {
            assert_eq!(refused(args), None, "{args:?}");
        }
    }

    #[test]
    fn gc_and_images_gc_say_which_cleans_what() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let gc = cli.find_subcommand_mut("gc").unwrap();
        let about = gc.get_about().unwrap().to_string();
        let long = gc.render_long_help().to_string();
        let long = long.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            about.contains("containers") && about.contains("scratch"),
            "{about}"
        );
        assert!(long.contains("never removes an image") && long.contains("berth images gc"));
        let images = cli.find_subcommand_mut("images").unwrap();
        let igc = images.find_subcommand_mut("gc").unwrap();
        let about = igc.get_about().unwrap().to_string();
        assert!(about.starts_with("Clean the image store"), "{about}");
        assert!(about.contains("`berth gc`'s"), "{about}");
    }

    #[test]
    fn version_names_the_commit() {
        let e = parse(&["--version"]).unwrap_err();
        let text = e.render().to_string();
        assert!(text.starts_with(&format!("berth {} (commit ", env!("CARGO_PKG_VERSION"))));
        assert_eq!(text.trim_end(), format!("berth {VERSION}"));
    }

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
