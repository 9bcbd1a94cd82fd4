//! `berth export`: writes an image, a root file system directory or a running container out as
//! an Enroot squashfs (`.sqsh`) or an Apptainer SIF that Enroot, Apptainer and berth can run.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::Failure;
use crate::config::Config;
use crate::image::ImageError;
use crate::image::export::{self, ExportError, Format};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// squashfs, as Enroot imports and runs (`.sqsh`)
    Sqsh,
    /// Apptainer/Singularity SIF with the squashfs as its root partition
    Sif,
}

/// Write an image or a running container out as a squashfs (.sqsh) or SIF file
///
/// SOURCE is the id of a running container (its root as the container sees it, including what it
/// wrote, without /proc, /sys, /dev, /tmp and bind mounts), or a .sqsh/.squashfs/.sif file
/// (copied without recompressing). --rootfs DIR exports a root file system directory instead.
/// Modes, times and extended attributes are kept, and owners as the image has them: in a
/// container whose image files were mapped to its user (`--remap-root`, or a user's writable
/// container), what that user owns is saved as root's, as Enroot's export does. The file is
/// written under a temporary
/// name and renamed when complete. Compression comes from the [squashfs] config section.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Container id, or a .sqsh/.squashfs/.sif file
    #[arg(
        value_name = "SOURCE",
        required_unless_present = "rootfs",
        conflicts_with = "rootfs"
    )]
    pub source: Option<String>,

    /// Export this root file system directory
    #[arg(long, value_name = "DIR")]
    pub rootfs: Option<PathBuf>,

    /// The file to write
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,

    /// File format [default: sif for a .sif FILE, else sqsh]
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,

    /// Replace FILE if it exists
    #[arg(short, long)]
    pub force: bool,
}

/// Whether this export needs root (a container or a stored image; not a file or a directory).
pub fn needs_root(args: &ExportArgs) -> bool {
    berth_node::export::needs_root(args.rootfs.as_deref(), args.source.as_deref())
}

pub fn execute(args: &ExportArgs, config: &Config) -> Result<i32, Failure> {
    let source = berth_node::export::source(
        args.rootfs.as_deref(),
        args.source.as_deref().unwrap_or_default(),
        config,
    )?;
    let format = match args.format {
        Some(FormatArg::Sqsh) => Format::Sqsh,
        Some(FormatArg::Sif) => Format::Sif,
        None => Format::for_path(&args.output),
    };
    if args.output.exists() && !args.force {
        return Err(Failure::input(format!(
            "{} exists; use --force to replace it",
            args.output.display()
        )));
    }
    let started = std::time::Instant::now();
    let written =
        export::export(&source, &args.output, format, &config.squashfs).map_err(|e| match e {
            ImageError::Export(ExportError::Invalid(_)) => Failure::input(e.to_string()),
            other => Failure::system(other.to_string()),
        })?;
    tracing::info!(
        "wrote {} ({} bytes, {:?}) in {:.2} s",
        written.path.display(),
        written.bytes,
        written.format,
        started.elapsed().as_secs_f64()
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<ExportArgs, clap::Error> {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            export: ExportArgs,
        }
        Cli::try_parse_from(std::iter::once("export").chain(args.iter().copied())).map(|c| c.export)
    }

    #[test]
    fn arguments() {
        assert!(parse(&["-o", "x.sqsh"]).is_err(), "a source is required");
        parse(&["c1", "--rootfs", "/r", "-o", "x"]).unwrap_err();
        assert!(parse(&["c1"]).is_err(), "-o is required");
        let a = parse(&["--rootfs", "/r", "-o", "x.sif", "--format", "sqsh", "-f"]).unwrap();
        assert_eq!(a.format, Some(FormatArg::Sqsh));
        assert!(a.force);
    }
}
