//! `berth export`: writes an image, a root file system directory or a running container out as
//! an Enroot squashfs (`.sqsh`) or an Apptainer SIF that Enroot, Apptainer and berth can run.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use super::Failure;
use crate::config::Config;
use crate::image::ImageError;
use crate::image::export::{self, Format, Source};
use crate::image::sif::Sif;
use crate::runtime::state::{self, Record};

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

/// Whether this export needs root: a container's root is read through its init, root's to do;
/// a directory (--rootfs) or an image file is read like any file the caller can read.
pub fn needs_root(args: &ExportArgs) -> bool {
    args.rootfs.is_none() && args.source.as_deref().is_some_and(|s| !is_image_file(s))
}

fn is_image_file(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    [".sqsh", ".squashfs", ".sif"]
        .iter()
        .any(|ext| lower.ends_with(ext))
}

/// A container id is a single path component of the state directory.
fn container_record(state_dir: &Path, id: &str) -> Option<Record> {
    state::load(state_dir, id).map(|(record, _)| record)
}

fn container_source(record: &Record) -> Result<Source, Failure> {
    if !state::owner_alive(record) {
        return Err(Failure::input(format!(
            "container {} is not running (the berth that ran it has exited); nothing to export",
            record.id
        )));
    }
    export::can_export_containers().map_err(|e| Failure::input(e.to_string()))?;
    // The recorded init must still be in the container's cgroup: a pid reused by another
    // process since is not.
    let procs = record.cgroup.join("cgroup.procs");
    let listed = std::fs::read_to_string(&procs)
        .map_err(|e| {
            Failure::system(format!(
                "container {}: reading {}: {e}",
                record.id,
                procs.display()
            ))
        })?
        .lines()
        .any(|l| l.trim().parse::<i32>().ok() == Some(record.init_pid));
    if record.init_pid <= 0 || !listed {
        return Err(Failure::input(format!(
            "container {} has no init left; nothing to export",
            record.id
        )));
    }
    let pid = record.init_pid;
    Ok(Source::Container { pid })
}

fn file_source(path: &Path) -> Result<Source, Failure> {
    let file = std::fs::canonicalize(path)
        .map_err(|e| Failure::input(format!("{}: {e}", path.display())))?;
    let size = std::fs::metadata(&file)
        .map_err(|e| Failure::input(format!("{}: {e}", file.display())))?
        .len();
    let mut head = [0u8; 42];
    let is_sif = std::fs::File::open(&file)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .is_ok()
        && &head[32..41] == b"SIF_MAGIC";
    if !is_sif {
        return Ok(Source::Squashfs {
            file,
            offset: 0,
            size,
        });
    }
    let sif = Sif::open(&file).map_err(|e| Failure::input(e.to_string()))?;
    let part = sif
        .primary_partition()
        .map_err(|fault| Failure::input(format!("SIF file {}: {fault}", file.display())))?;
    Ok(Source::Squashfs {
        offset: part.offset,
        size: part.size,
        file,
    })
}

/// Decides what to export from the arguments; an image reference is imported into the store
/// when missing.
pub fn source(args: &ExportArgs, config: &Config) -> Result<Source, Failure> {
    if let Some(dir) = &args.rootfs {
        crate::runtime::check_rootfs(dir)?;
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| Failure::input(format!("{}: {e}", dir.display())))?;
        return Ok(Source::Layers(vec![dir]));
    }
    let text = args.source.as_deref().unwrap_or_default();
    if let Some(record) = container_record(&config.runtime.state_dir, text) {
        return container_source(&record);
    }
    let path = Path::new(text);
    if path.exists() {
        if path.is_dir() {
            return Err(Failure::input(format!(
                "{text} is a directory: use --rootfs {text} to export a root file system"
            )));
        }
        return file_source(path);
    }
    if is_image_file(text) {
        return Err(Failure::input(format!("{text}: no such file")));
    }
    stored_image_source(text, config)
}

/// An image reference: the image from the node's store, imported first when missing.
fn stored_image_source(text: &str, config: &Config) -> Result<Source, Failure> {
    use crate::image::import::{Requester, get_or_import};
    use crate::image::{Rootfs, store::Store};
    let reference = crate::image::reference::parse(text).map_err(|e| {
        Failure::input(format!(
            "{e} (berth export takes a container id, an image reference, a .sqsh/.sif file or --rootfs DIR)"
        ))
    })?;
    let store = Store::open(&config.store).map_err(Failure::from)?;
    let user = crate::spec::user::current().map_err(|e| Failure::input(e.to_string()))?;
    let who = Requester {
        uid: user.uid,
        home: user.home.as_deref(),
        arch: None,
    };
    let progress = |line: &str| eprintln!("berth: {line}");
    // A local file or layout is opened as the caller, and read only through that fd.
    let opened = if crate::image::store::is_local_path(&reference) {
        Some(crate::image::import::Opened::open(&reference, Some(&user)).map_err(Failure::from)?)
    } else {
        None
    };
    let image = get_or_import(
        &store,
        &reference,
        opened.as_ref(),
        &config.image(),
        &who,
        &progress,
    )
    .map_err(Failure::from)?;
    Ok(match image.rootfs {
        Rootfs::Layers(layers) => Source::Layers(layers),
        Rootfs::Squashfs { file, offset, size } => Source::Squashfs { file, offset, size },
    })
}

pub fn execute(args: &ExportArgs, config: &Config) -> Result<i32, Failure> {
    let source = source(args, config)?;
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
            ImageError::ExportInvalid(_) => Failure::input(e.to_string()),
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

    fn config(state_dir: &Path) -> Config {
        let mut c = Config::default();
        c.runtime.state_dir = state_dir.to_path_buf();
        c
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

    #[test]
    fn sources() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir(&rootfs).unwrap();
        let a = parse(&["--rootfs", rootfs.to_str().unwrap(), "-o", "x"]).unwrap();
        assert_eq!(
            source(&a, &cfg).unwrap(),
            Source::Layers(vec![rootfs.clone()])
        );

        let one = crate::image::sif::testdata_sif("one-group.sif");
        let a = parse(&[one.to_str().unwrap(), "-o", "x"]).unwrap();
        assert_eq!(
            source(&a, &cfg).unwrap(),
            Source::Squashfs {
                file: std::fs::canonicalize(&one).unwrap(),
                offset: 36864,
                size: 4096
            }
        );
        let oci = crate::image::sif::testdata_sif("one-object-oci-root-index.sif");
        let a = parse(&[oci.to_str().unwrap(), "-o", "x"]).unwrap();
        assert!(source(&a, &cfg).unwrap_err().message.contains("OCI-SIF"));

        // (nvcr.io/nvidia/pytorch is a valid Docker-style reference now, as Pyxis takes it.)
        let a = parse(&["nvcr.io/nvidia/Not A Name", "-o", "x"]).unwrap();
        let err = source(&a, &cfg).unwrap_err();
        assert!(
            err.message.contains("Not A Name") && err.message.contains("container id"),
            "{}",
            err.message
        );
        assert_eq!(err.code, 2);
        let a = parse(&["/nonexistent/a.sqsh", "-o", "x"]).unwrap();
        assert!(
            source(&a, &cfg)
                .unwrap_err()
                .message
                .contains("no such file")
        );
        let a = parse(&[dir.path().to_str().unwrap(), "-o", "x"]).unwrap();
        assert!(source(&a, &cfg).unwrap_err().message.contains("--rootfs"));

        // A container whose berth is gone is not exported.
        let record = Record {
            id: "c1".into(),
            owner_pid: i32::try_from(std::process::id()).unwrap(),
            owner_start: 1,
            cgroup: dir.path().join("no-cgroup"),
            init_pid: 0,
            labels: Default::default(),
        };
        std::fs::create_dir(dir.path().join("c1")).unwrap();
        std::fs::write(
            dir.path().join("c1/state.json"),
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        let a = parse(&["c1", "-o", "x"]).unwrap();
        assert!(
            source(&a, &cfg)
                .unwrap_err()
                .message
                .contains("not running")
        );
        assert!(container_record(dir.path(), "../c1").is_none());
    }
}
