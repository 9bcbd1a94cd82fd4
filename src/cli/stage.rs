//! `berth stage in|out|status`: stages a dataset into a directory (a job's scratch by default)
//! or results out of it, with the engine in `crate::stage`, outside Slurm.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::Failure;
use crate::config::Config;
use crate::stage;

/// Stage datasets into node-local scratch, results out of it, or show a staged tree's state
#[derive(Debug, Args)]
pub struct StageArgs {
    #[command(subcommand)]
    pub command: StageCommand,
}

#[derive(Debug, Subcommand)]
pub enum StageCommand {
    /// Copy SRC into DIR/DST (DST defaults to SRC's last component); unchanged files are skipped
    In {
        /// SRC[:DST]: a directory or file; DST is relative to --to
        spec: String,
        /// Destination directory [default: $BERTH_SCRATCH]
        #[arg(long, value_name = "DIR")]
        to: Option<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Copy SRC (relative to $BERTH_SCRATCH unless absolute) to the directory DST
    Out {
        /// SRC:DST
        spec: String,
        #[command(flatten)]
        common: Common,
    },
    /// Say whether DIR is completely staged, and from what (exit 1 when it is not)
    Status {
        dir: PathBuf,
        /// Print one JSON object: dir, complete, and when complete source, files, bytes,
        /// completed_at, verified (docs/user-guide.md, "JSON output")
        #[arg(long)]
        json: bool,
    },
}

/// `berth stage status --json`: a staged tree's state. The marker's fields are null when the
/// tree is not completely staged.
#[derive(Debug, serde::Serialize)]
pub struct StatusJson {
    pub dir: String,
    pub complete: bool,
    pub source: Option<String>,
    pub files: Option<u64>,
    pub bytes: Option<u64>,
    /// Seconds since the epoch.
    pub completed_at: Option<u64>,
    pub verified: Option<bool>,
}

impl StatusJson {
    fn new(dir: &Path, marker: Option<&stage::Marker>) -> Self {
        Self {
            dir: dir.display().to_string(),
            complete: marker.is_some(),
            source: marker.map(|m| m.source.display().to_string()),
            files: marker.map(|m| m.files),
            bytes: marker.map(|m| m.bytes),
            completed_at: marker.map(|m| m.completed_at),
            verified: marker.map(|m| m.verified),
        }
    }
}

#[derive(Debug, Args)]
pub struct Common {
    /// Copy threads [default: stage.workers]
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Compare source and destination by hash after copying
    #[arg(long)]
    verify: bool,
    /// Copy the files' and directories' user.* extended attributes [default: stage.xattrs]
    #[arg(long)]
    xattrs: bool,
    /// Stage as this user (NAME|UID[:GROUP|GID]), with its groups; needs root [default: the
    /// caller]
    #[arg(long, value_name = "USER")]
    user: Option<String>,
}

fn options(common: &Common, config: &Config) -> stage::Options {
    let mut opts = config.stage.options();
    if let Some(n) = common.workers {
        opts.workers = n.max(1);
    }
    opts.verify |= common.verify;
    opts.xattrs |= common.xattrs;
    opts
}

fn scratch_env() -> Option<PathBuf> {
    std::env::var_os("BERTH_SCRATCH").map(PathBuf::from)
}

fn done(report: Result<stage::Report, stage::StageError>) -> Result<i32, Failure> {
    eprintln!("{}", report?.summary());
    Ok(0)
}

pub fn execute(args: &StageArgs, config: &Config) -> Result<i32, Failure> {
    match &args.command {
        StageCommand::In { spec, to, common } => {
            let (src, dst) = match spec.split_once(':') {
                Some((s, d)) => (PathBuf::from(s), Some(PathBuf::from(d))),
                None => (PathBuf::from(spec), None),
            };
            let base = to.clone().or_else(scratch_env).ok_or_else(|| {
                Failure::input("berth stage in: no destination: pass --to DIR or set BERTH_SCRATCH")
            })?;
            let user = stage::stage_user(common.user.as_deref())?;
            done(stage::stage_in(
                &src,
                dst.as_deref(),
                &base,
                user.as_ref(),
                config.scratch.cap_bytes,
                options(common, config),
            ))
        }
        StageCommand::Out { spec, common } => {
            let user = stage::stage_user(common.user.as_deref())?;
            let (src, dst) = spec.split_once(':').ok_or_else(|| {
                Failure::input(format!("berth stage out: {spec:?} is not SRC:DST"))
            })?;
            done(stage::stage_out(
                Path::new(src),
                Path::new(dst),
                scratch_env().as_deref(),
                user.as_ref(),
                &options(common, config),
            ))
        }
        StageCommand::Status { dir, json: true } => {
            let marker = stage::status(dir);
            let text = serde_json::to_string_pretty(&StatusJson::new(dir, marker.as_ref()))
                .map_err(|e| Failure::system(e.to_string()))?;
            outln!("{text}");
            Ok(if marker.is_some() { 0 } else { 1 })
        }
        StageCommand::Status { dir, json: false } => match stage::status(dir) {
            Some(m) => {
                outln!(
                    "{}: complete: {} files, {} bytes from {}, at {} (unix){}",
                    dir.display(),
                    m.files,
                    m.bytes,
                    m.source.display(),
                    m.completed_at,
                    if m.verified { ", verified" } else { "" }
                );
                Ok(0)
            }
            None => {
                outln!(
                    "{}: not completely staged (no {} marker)",
                    dir.display(),
                    stage::MARKER
                );
                Ok(1)
            }
        },
    }
}
