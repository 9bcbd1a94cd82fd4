//! What `berth export` writes out: a running container's root, a `.sqsh`/`.sif` file, a root file
//! system directory, or an image reference from the node's store (imported first when missing).

use std::path::Path;

use berth_image::export::{self, Source};
use berth_image::import::{Requester, get_or_import};
use berth_image::sif::Sif;
use berth_image::{Rootfs, store::Store};
use berth_runtime::state::{self, Record};

use crate::NodeError;
use berth_config::Config;

/// Whether exporting `source` needs root: a container or a stored image does (both are root's);
/// a directory (`--rootfs`) or an image file is read like any file the caller can read.
pub fn needs_root(rootfs: Option<&Path>, source: Option<&str>) -> bool {
    rootfs.is_none() && source.is_some_and(|s| !is_image_file(s))
}

fn is_image_file(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    [".sqsh", ".squashfs", ".sif"]
        .iter()
        .any(|ext| lower.ends_with(ext))
}

/// A container id is a single path component of the state directory.
pub(crate) fn container_record(state_dir: &Path, id: &str) -> Option<Record> {
    state::load(state_dir, id).map(|(record, _)| record)
}

fn container_source(record: &Record) -> Result<Source, NodeError> {
    if !state::owner_alive(record) {
        return Err(NodeError::input(format!(
            "container {} is not running (the berth that ran it has exited); nothing to export",
            record.id
        )));
    }
    export::can_export_containers().map_err(|e| NodeError::input(e.to_string()))?;
    // The recorded init must still be in the container's cgroup: a pid reused by another
    // process since is not.
    let procs = record.cgroup.join("cgroup.procs");
    let listed = std::fs::read_to_string(&procs)
        .map_err(|e| {
            NodeError::host(format!(
                "container {}: reading {}: {e}",
                record.id,
                procs.display()
            ))
        })?
        .lines()
        .any(|l| l.trim().parse::<i32>().ok() == Some(record.init_pid));
    if record.init_pid <= 0 || !listed {
        return Err(NodeError::input(format!(
            "container {} has no init left; nothing to export",
            record.id
        )));
    }
    let pid = record.init_pid;
    Ok(Source::Container { pid })
}

fn file_source(path: &Path) -> Result<Source, NodeError> {
    let file = std::fs::canonicalize(path)
        .map_err(|e| NodeError::input(format!("{}: {e}", path.display())))?;
    let size = std::fs::metadata(&file)
        .map_err(|e| NodeError::input(format!("{}: {e}", file.display())))?
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
    let sif = Sif::open(&file).map_err(|e| NodeError::input(e.to_string()))?;
    let part = sif
        .primary_partition()
        .map_err(|fault| NodeError::input(format!("SIF file {}: {fault}", file.display())))?;
    Ok(Source::Squashfs {
        offset: part.offset,
        size: part.size,
        file,
    })
}

/// Decides what to export from the arguments; an image reference is imported into the store
/// when missing.
pub fn source(rootfs: Option<&Path>, text: &str, config: &Config) -> Result<Source, NodeError> {
    if let Some(dir) = rootfs {
        berth_runtime::check_rootfs(dir)?;
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| NodeError::input(format!("{}: {e}", dir.display())))?;
        return Ok(Source::Layers(vec![dir]));
    }
    if let Some(record) = container_record(&config.runtime.state_dir, text) {
        return container_source(&record);
    }
    let path = Path::new(text);
    if path.exists() {
        if path.is_dir() {
            return Err(NodeError::input(format!(
                "{text} is a directory: use --rootfs {text} to export a root file system"
            )));
        }
        return file_source(path);
    }
    if is_image_file(text) {
        return Err(NodeError::input(format!("{text}: no such file")));
    }
    stored_image_source(text, config)
}

/// An image reference: the image from the node's store, imported first when missing.
fn stored_image_source(text: &str, config: &Config) -> Result<Source, NodeError> {
    let reference = berth_image::reference::parse(text).map_err(|e| {
        NodeError::input(format!(
            "{e} (berth export takes a container id, an image reference, a .sqsh/.sif file or --rootfs DIR)"
        ))
    })?;
    let store = Store::open(&config.store)?;
    let user = berth_sys::user::current().map_err(|e| NodeError::input(e.to_string()))?;
    let who = Requester {
        uid: user.uid,
        home: user.home.as_deref(),
        arch: None,
    };
    let progress = |line: &str| eprintln!("berth: {line}");
    // A local file or layout is opened as the caller, and read only through that fd.
    let opened = if berth_image::local::is_local_path(&reference) {
        Some(berth_image::local::Opened::open(&reference, Some(&user))?)
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
    )?;
    Ok(match image.rootfs {
        Rootfs::Layers(layers) => Source::Layers(layers),
        Rootfs::Squashfs { file, offset, size } => Source::Squashfs { file, offset, size },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(state_dir: &Path) -> Config {
        let mut c = Config::default();
        c.runtime.state_dir = state_dir.to_path_buf();
        c
    }

    fn message(r: Result<Source, NodeError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn sources() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir(&rootfs).unwrap();
        assert_eq!(
            source(Some(&rootfs), "", &cfg).unwrap(),
            Source::Layers(vec![rootfs.clone()])
        );

        let one = berth_image::sif::testdata_sif("one-group.sif");
        assert_eq!(
            source(None, one.to_str().unwrap(), &cfg).unwrap(),
            Source::Squashfs {
                file: std::fs::canonicalize(&one).unwrap(),
                offset: 36864,
                size: 4096
            }
        );
        let oci = berth_image::sif::testdata_sif("one-object-oci-root-index.sif");
        assert!(message(source(None, oci.to_str().unwrap(), &cfg)).contains("OCI-SIF"));

        // (nvcr.io/nvidia/pytorch is a valid Docker-style reference now, as Pyxis takes it.)
        let err = source(None, "nvcr.io/nvidia/Not A Name", &cfg).unwrap_err();
        assert!(matches!(err, NodeError::Input(_)), "{err:?}");
        let err = err.to_string();
        assert!(
            err.contains("Not A Name") && err.contains("container id"),
            "{err}"
        );
        assert!(message(source(None, "/nonexistent/a.sqsh", &cfg)).contains("no such file"));
        assert!(message(source(None, dir.path().to_str().unwrap(), &cfg)).contains("--rootfs"));

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
        assert!(message(source(None, "c1", &cfg)).contains("not running"));
        assert!(container_record(dir.path(), "../c1").is_none());
    }

    #[test]
    fn files_and_directories_do_not_need_root() {
        assert!(!needs_root(Some(Path::new("/r")), None));
        assert!(!needs_root(None, Some("/x/IMAGE.SQSH")));
        assert!(needs_root(None, Some("c1")));
        assert!(needs_root(None, Some("ubuntu:24.04")));
    }
}
