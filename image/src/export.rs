//! Writing a root file system out as an image file (`berth export`): an Enroot-compatible
//! squashfs (`.sqsh`) or an Apptainer SIF holding one. What is written:
//!
//! - layer directories (a rootfs directory, or a store image's layers): their merged view. As
//!   root, the layers are stacked as a read-only overlay in a private mount namespace, so
//!   whiteouts apply and overlayfs's own `trusted.overlay.*` attributes stay out; one directory
//!   exported by a non-root user is read directly;
//! - a running container: its root as the container sees it (the overlay of image and writes),
//!   without what is mounted on top (`/proc`, `/sys`, `/dev`, `/tmp`, bind mounts): a child
//!   joins the container's mount namespace, clones its root mount alone (open_tree without
//!   AT_RECURSIVE), and runs mksquashfs on that bare root while the container keeps running
//!   untouched;
//! - an existing squashfs (a `.sqsh`, or a SIF's partition): copied byte for byte.
//!
//! mksquashfs keeps owners, modes, times and extended attributes (`-xattrs`), never
//! `-all-root`. The output is written under a temporary name next to the target and renamed
//! into place when complete, so a failure (a full disk) leaves no partial file.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::ImageError;
use super::sif::{self, FsType, ObjectKind, PartType, Partition};
use super::squashfs::probe_squashfs_magic;
use crate::config::{Compression, SquashfsConfig};

/// The file format written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A plain squashfs, as Enroot writes and runs.
    Sqsh,
    /// A SIF whose primary system partition is the squashfs, as Apptainer runs.
    Sif,
}

impl Format {
    /// `.sif` files are SIF, anything else squashfs.
    pub fn for_path(path: &Path) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("sif") => Format::Sif,
            _ => Format::Sqsh,
        }
    }
}

/// What to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Root file system layers, bottom first (one for a plain rootfs directory).
    Layers(Vec<PathBuf>),
    /// A running container, by the host pid of a process inside it (its init).
    Container { pid: i32 },
    /// An existing squashfs of `size` bytes at `offset` in `file`.
    Squashfs {
        file: PathBuf,
        offset: u64,
        size: u64,
    },
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub path: PathBuf,
    pub bytes: u64,
    pub format: Format,
}

/// The mksquashfs compression arguments for the configured compressor and level.
pub fn compression_args(config: &SquashfsConfig) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    match config.compression {
        Compression::None => {
            for a in ["-noI", "-noD", "-noF", "-noX"] {
                args.push(a.into());
            }
        }
        c => {
            args.push("-comp".into());
            args.push(c.name().into());
            if c.takes_level() {
                args.push("-Xcompression-level".into());
                args.push(config.compression_level.to_string());
            }
        }
    }
    args
}

/// The mksquashfs command line for `source_dir` into `out` (at byte `offset`, for a SIF).
pub fn mksquashfs_args(
    source_dir: &Path,
    out: &Path,
    offset: u64,
    config: &SquashfsConfig,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        source_dir.as_os_str().to_owned(),
        out.as_os_str().to_owned(),
        "-noappend".into(),
        "-xattrs".into(),
        "-no-progress".into(),
        "-quiet".into(),
    ];
    args.extend(compression_args(config).into_iter().map(OsString::from));
    if offset > 0 {
        args.push("-offset".into());
        args.push(offset.to_string().into());
    }
    args
}

/// The mksquashfs binary: on PATH, else where Debian and others install it (a Slurm prolog
/// runs with no PATH).
pub fn find_mksquashfs() -> Result<PathBuf, ImageError> {
    let dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let fallback = ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"];
    dirs.iter()
        .map(PathBuf::as_path)
        .chain(fallback.iter().map(Path::new))
        .map(|d| d.join("mksquashfs"))
        .find(|p| p.is_file())
        .ok_or_else(|| ImageError::NoMksquashfs(format!("PATH, {}", fallback.join(", "))))
}

/// The partially written output: removed on drop unless committed.
struct TempOutput {
    path: PathBuf,
    committed: bool,
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A scratch directory next to the output, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_name(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(".{name}.berth-tmp.{}", std::process::id()))
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Free and total space of the file system holding `dir`.
fn space(dir: &Path) -> (String, String) {
    match nix::sys::statvfs::statvfs(dir) {
        Ok(s) => {
            let unit = s.fragment_size();
            (human(s.blocks_available() * unit), human(s.blocks() * unit))
        }
        Err(_) => ("?".into(), "?".into()),
    }
}

fn no_space(out: &Path) -> ImageError {
    let dir = out.parent().unwrap_or(Path::new("/")).to_path_buf();
    let (free, total) = space(&dir);
    ImageError::ExportNoSpace {
        out: out.to_path_buf(),
        dir,
        free,
        total,
    }
}

fn io_err(out: &Path, what: String) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            no_space(out)
        } else {
            ImageError::ExportIo { what, source }
        }
    }
}

/// Exports `source` to `out` as `format`.
pub fn export(
    source: &Source,
    out: &Path,
    format: Format,
    config: &SquashfsConfig,
) -> Result<Written, ImageError> {
    config
        .check()
        .map_err(|e| ImageError::ExportInvalid(e.to_string()))?;
    let out = absolute(out)?;
    let mut tmp = TempOutput {
        path: temp_name(&out),
        committed: false,
    };
    let _ = std::fs::remove_file(&tmp.path);
    let bytes = match write_temp(source, &tmp.path, &out, format, config) {
        Ok(bytes) => bytes,
        Err(ImageError::ExportNoSpace { .. }) => {
            // Report the space there is once the partial output is gone.
            drop(tmp);
            return Err(no_space(&out));
        }
        Err(e) => return Err(e),
    };
    std::fs::rename(&tmp.path, &out)
        .map_err(io_err(&out, format!("renaming into {}", out.display())))?;
    tmp.committed = true;
    if let Some(dir) = out.parent()
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
    Ok(Written {
        path: out,
        bytes,
        format,
    })
}

/// Writes the complete file at `tmp` and flushes it to disk; returns its length.
fn write_temp(
    source: &Source,
    tmp: &Path,
    out: &Path,
    format: Format,
    config: &SquashfsConfig,
) -> Result<u64, ImageError> {
    let offset = match format {
        Format::Sqsh => 0,
        Format::Sif => sif::DATA_OFFSET.next_multiple_of(sif::PARTITION_ALIGNMENT),
    };
    match source {
        Source::Squashfs {
            file,
            offset: at,
            size,
        } => {
            probe_squashfs_magic(file, *at)?;
            copy_range(file, *at, *size, tmp, offset, out)?;
        }
        Source::Layers(layers) => squash_layers(layers, tmp, offset, config, out)?,
        Source::Container { pid } => squash_container(*pid, tmp, offset, config, out)?,
    }
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(tmp)
        .map_err(io_err(out, format!("opening {}", tmp.display())))?;
    let len = file
        .metadata()
        .map_err(io_err(out, format!("reading {}", tmp.display())))?
        .len();
    // Not even a superblock: nothing a reader could mount.
    if len < offset + 96 {
        return Err(ImageError::ExportInvalid(format!(
            "{}: only {len} bytes were written, too few for a squashfs",
            tmp.display()
        )));
    }
    if format == Format::Sif {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        let mut writer = sif::Writer::new(&mut file);
        let partition = ObjectKind::Partition(Partition {
            fs_type: FsType::Squashfs,
            part_type: PartType::PrimarySystem,
            arch: sif::host_arch().into(),
        });
        let header = match writer.add_written(partition, "", offset, len - offset) {
            Ok(_) => writer.finish(now, sif::random_id()).map(|_| ()),
            Err(e) => Err(e),
        };
        header.map_err(io_err(
            out,
            format!("writing the SIF header of {}", out.display()),
        ))?;
    }
    file.sync_all()
        .map_err(io_err(out, format!("flushing {}", tmp.display())))?;
    Ok(len)
}

fn absolute(out: &Path) -> Result<PathBuf, ImageError> {
    let out = std::path::absolute(out).map_err(|source| ImageError::ExportIo {
        what: format!("resolving {}", out.display()),
        source,
    })?;
    let dir = out.parent().unwrap_or(Path::new("/"));
    if !dir.is_dir() {
        return Err(ImageError::ExportInvalid(format!(
            "{}: directory {} does not exist",
            out.display(),
            dir.display()
        )));
    }
    if out.is_dir() {
        return Err(ImageError::ExportInvalid(format!(
            "{} is a directory; give a file name such as {}/image.sqsh",
            out.display(),
            out.display()
        )));
    }
    Ok(out)
}

fn copy_range(
    file: &Path,
    at: u64,
    size: u64,
    tmp: &Path,
    offset: u64,
    out: &Path,
) -> Result<(), ImageError> {
    let mut src = File::open(file).map_err(io_err(out, format!("opening {}", file.display())))?;
    src.seek(SeekFrom::Start(at))
        .map_err(io_err(out, format!("reading {}", file.display())))?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(io_err(out, format!("creating {}", tmp.display())))?;
    dst.seek(SeekFrom::Start(offset))
        .map_err(io_err(out, format!("writing {}", tmp.display())))?;
    let copied = std::io::copy(&mut (&mut src).take(size), &mut dst).map_err(io_err(
        out,
        format!("copying {} into {}", file.display(), tmp.display()),
    ))?;
    if copied != size {
        return Err(ImageError::ExportInvalid(format!(
            "{}: expected {size} bytes at byte {at}, found {copied}",
            file.display()
        )));
    }
    dst.flush()
        .map_err(io_err(out, format!("writing {}", tmp.display())))
}

fn cstring(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        ImageError::ExportInvalid(format!("{}: path contains a NUL byte", p.display()))
    })
}

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Runs mksquashfs and turns its failure into one line.
/// `setup` names what the child does before exec, for the error if that fails.
fn run_mksquashfs(mut cmd: Command, setup: &str, tmp: &Path, out: &Path) -> Result<(), ImageError> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ImageError::ExportIo {
            what: format!("starting mksquashfs ({setup})"),
            source,
        })?;
    let output = child
        .wait_with_output()
        .map_err(|source| ImageError::ExportIo {
            what: "waiting for mksquashfs".into(),
            source,
        })?;
    if output.status.success() && tmp.exists() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    tracing::debug!("mksquashfs: {stderr}");
    if stderr.contains("No space left on device") {
        return Err(no_space(out));
    }
    let message = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .find(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("fatal") || l.contains("error") || l.contains("failed")
        })
        .or_else(|| stderr.lines().map(str::trim).rfind(|l| !l.is_empty()))
        .map(str::to_string)
        .unwrap_or_else(|| format!("it exited with {}", output.status));
    Err(ImageError::Mksquashfs {
        out: out.to_path_buf(),
        message,
    })
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn squash_layers(
    layers: &[PathBuf],
    tmp: &Path,
    offset: u64,
    config: &SquashfsConfig,
    out: &Path,
) -> Result<(), ImageError> {
    let Some(top) = layers.last() else {
        return Err(ImageError::ExportInvalid("no layers to export".into()));
    };
    for l in layers {
        if !l.is_dir() {
            return Err(ImageError::ExportInvalid(format!(
                "root file system {} is not a directory",
                l.display()
            )));
        }
    }
    let mksquashfs = find_mksquashfs()?;
    if !is_root() {
        if layers.len() > 1 {
            return Err(ImageError::ExportInvalid(
                "exporting several layers needs root (it mounts an overlay)".into(),
            ));
        }
        let mut cmd = Command::new(&mksquashfs);
        cmd.args(mksquashfs_args(top, tmp, offset, config));
        return run_mksquashfs(cmd, "reading the directory", tmp, out);
    }
    // A private mount namespace in the child holds the overlay: nothing appears on the host,
    // and the two empty directories it needs go with the scratch guard.
    let scratch = Scratch(tmp.with_extension("scratch"));
    let merged = scratch.0.join("merged");
    let empty = scratch.0.join("empty");
    for d in [&scratch.0, &merged, &empty] {
        std::fs::create_dir(d).map_err(io_err(out, format!("creating {}", d.display())))?;
    }
    // Top layer first; the empty directory at the bottom lets a single layer form an overlay.
    let lowerdir: Vec<String> = layers
        .iter()
        .rev()
        .chain(std::iter::once(&empty))
        .map(|p| berth_sys::mount::overlay_escape(p))
        .collect();
    let data = CString::new(format!("lowerdir={}", lowerdir.join(":")))
        .map_err(|_| ImageError::ExportInvalid("layer path contains a NUL byte".into()))?;
    let target = cstring(&merged)?;
    let mut cmd = Command::new(&mksquashfs);
    cmd.args(mksquashfs_args(&merged, tmp, offset, config));
    // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls on
    // strings prepared beforehand; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"overlay".as_ptr(),
                target.as_ptr(),
                c"overlay".as_ptr(),
                libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
                data.as_ptr().cast(),
            ))
        });
    }
    run_mksquashfs(
        cmd,
        "mounting a read-only overlay of the layers in a private mount namespace",
        tmp,
        out,
    )
}

/// open_tree(2)'s flag for a detached copy of the mount (not in libc).
const OPEN_TREE_CLONE: libc::c_int = 1;

fn squash_container(
    pid: i32,
    tmp: &Path,
    offset: u64,
    config: &SquashfsConfig,
    out: &Path,
) -> Result<(), ImageError> {
    let mksquashfs = find_mksquashfs()?;
    let open = |path: String, flags: nix::fcntl::OFlag| -> Result<OwnedFd, ImageError> {
        nix::fcntl::open(path.as_str(), flags, nix::sys::stat::Mode::empty()).map_err(|e| {
            ImageError::ExportIo {
                what: format!("opening {path}"),
                source: e.into(),
            }
        })
    };
    use nix::fcntl::OFlag;
    let mnt_ns = open(
        format!("/proc/{pid}/ns/mnt"),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
    )?;
    let host_root = open(
        "/".into(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
    )?;
    // The container's root: the namespace's top mount after pivot_root, but a mount above a
    // tmpfs when the container was moved onto an initramfs root (runtime::init::move_root).
    let container_root = open(
        format!("/proc/{pid}/root"),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
    )?;
    // A descriptor number the child can rely on: it replaces this inherited placeholder with its
    // handle on the container's root, and mksquashfs reads /proc/self/fd/N/.
    let placeholder: OwnedFd = File::open("/dev/null")
        .map_err(|source| ImageError::ExportIo {
            what: "opening /dev/null".into(),
            source,
        })?
        .into();
    // SAFETY: fcntl F_SETFD on a descriptor owned here: clears FD_CLOEXEC so the child inherits it.
    check(unsafe { libc::fcntl(placeholder.as_raw_fd(), libc::F_SETFD, 0) }).map_err(|source| {
        ImageError::ExportIo {
            what: "preparing a descriptor".into(),
            source,
        }
    })?;
    let slot = placeholder.as_raw_fd();
    let source_dir = PathBuf::from(format!("/proc/self/fd/{slot}/."));
    let (ns_fd, root_fd) = (mnt_ns.as_raw_fd(), host_root.as_raw_fd());
    let container_fd = container_root.as_raw_fd();
    // A remapped container's files belong to the user on the host (its root's, through the
    // idmapped image) and are the image's root's in the container: mksquashfs reads them through
    // the inverse of that idmapping so the image keeps its owners. So does a user's writable
    // container, whose image root files are the user's (runtime::userns::idmapped_user_of).
    let idmap = remapped_root(pid)
        .or_else(|| berth_sys::userns::idmapped_user_of(pid))
        .map(|(uid, gid)| {
            berth_sys::userns::create(
                &berth_sys::userns::layer_map(uid),
                &berth_sys::userns::layer_map(gid),
            )
        })
        .transpose()
        .map_err(|e| ImageError::ExportIo {
            what: "reading the remapped container's files".into(),
            source: std::io::Error::other(e),
        })?;
    let idmap_fd = idmap.as_ref().map(|fd| fd.as_raw_fd());
    let mut cmd = Command::new(&mksquashfs);
    cmd.args(mksquashfs_args(&source_dir, tmp, offset, config));
    // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls on
    // descriptors and strings prepared beforehand; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // In the container's mount namespace, a copy of its root mount alone (open_tree
            // without AT_RECURSIVE): nothing mounted on it comes along, whatever the paths of
            // those mounts are by now. (Detaching them by the paths mountinfo gave a moment
            // before missed a bind whose parent directory the user had just renamed, and root
            // read the host's files there into the image.)
            check(libc::setns(ns_fd, libc::CLONE_NEWNS))?;
            #[expect(
                clippy::cast_possible_truncation,
                reason = "open_tree returns an int (an fd or -1), widened to syscall()'s long"
            )]
            let bare = libc::syscall(
                libc::SYS_open_tree,
                container_fd,
                c"".as_ptr(),
                (libc::AT_EMPTY_PATH | OPEN_TREE_CLONE) as libc::c_uint,
            ) as libc::c_int;
            check(bare)?;
            check(libc::dup2(bare, slot))?;
            libc::close(bare);
            // Back to the host's file system for mksquashfs, its libraries and the output.
            check(libc::fchdir(root_fd))?;
            check(libc::chroot(c".".as_ptr()))?;
            check(libc::chdir(c"/".as_ptr()))?;
            if let Some(fd) = idmap_fd {
                // Last: it ends the host's privileges the steps above need.
                check(libc::setns(fd, libc::CLONE_NEWUSER))?;
            }
            Ok(())
        });
    }
    let result = run_mksquashfs(
        cmd,
        "cloning the container's root mount in its mount namespace",
        tmp,
        out,
    );
    drop(placeholder);
    result
}

/// The host uid and gid that root of `pid`'s user namespace is, when that namespace maps root
/// to someone else (a remapped container).
fn remapped_root(pid: i32) -> Option<(u32, u32)> {
    let root_of = |file: &str| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
        text.lines().find_map(|line| {
            let f: Vec<u32> = line
                .split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect();
            (f.len() == 3 && f[0] == 0).then_some(f[1])
        })
    };
    match (root_of("uid_map")?, root_of("gid_map")?) {
        (0, 0) => None,
        ids => Some(ids),
    }
}

/// Whether a `setns`-based export can read a process's root: the caller must be root.
pub fn can_export_containers() -> Result<(), ImageError> {
    if is_root() {
        Ok(())
    } else {
        Err(ImageError::ExportInvalid(
            "exporting a running container needs root (it joins the container's mount namespace)"
                .into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(compression: Compression, level: u32) -> SquashfsConfig {
        SquashfsConfig {
            compression,
            compression_level: level,
            ..SquashfsConfig::default()
        }
    }

    #[test]
    fn formats_follow_the_extension() {
        assert_eq!(Format::for_path(Path::new("/x/a.sif")), Format::Sif);
        assert_eq!(Format::for_path(Path::new("/x/a.SIF")), Format::Sif);
        assert_eq!(Format::for_path(Path::new("/x/a.sqsh")), Format::Sqsh);
        assert_eq!(Format::for_path(Path::new("/x/a")), Format::Sqsh);
    }

    #[test]
    fn mksquashfs_command_lines() {
        let args = mksquashfs_args(
            Path::new("/src"),
            Path::new("/out/.x.tmp"),
            0,
            &SquashfsConfig::default(),
        );
        let args: Vec<&str> = args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "/src",
                "/out/.x.tmp",
                "-noappend",
                "-xattrs",
                "-no-progress",
                "-quiet",
                "-comp",
                "zstd",
                "-Xcompression-level",
                "3"
            ]
        );
        assert!(!args.contains(&"-all-root"), "owners are kept");
        let sif = mksquashfs_args(
            Path::new("/s"),
            Path::new("/o"),
            32768,
            &config(Compression::Gzip, 6),
        );
        let sif: Vec<&str> = sif.iter().map(|a| a.to_str().unwrap()).collect();
        assert!(sif.ends_with(&[
            "-comp",
            "gzip",
            "-Xcompression-level",
            "6",
            "-offset",
            "32768"
        ]));
        assert_eq!(
            compression_args(&config(Compression::Lz4, 9)),
            ["-comp", "lz4"]
        );
        assert_eq!(
            compression_args(&config(Compression::Xz, 9)),
            ["-comp", "xz"]
        );
        assert_eq!(
            compression_args(&config(Compression::None, 3)),
            ["-noI", "-noD", "-noF", "-noX"]
        );
    }

    #[test]
    fn temp_names_sit_next_to_the_target_and_are_hidden() {
        let t = temp_name(Path::new("/data/images/app.sqsh"));
        assert_eq!(t.parent(), Some(Path::new("/data/images")));
        assert!(
            t.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(".app.sqsh.berth-tmp.")
        );
    }

    #[test]
    fn copying_a_squashfs_into_a_sif_and_back_preserves_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let sif_in = crate::sif::testdata_sif("one-group.sif");
        let cfg = SquashfsConfig::default();
        // SIF partition -> .sqsh
        let sqsh = dir.path().join("hello.sqsh");
        let w = export(
            &Source::Squashfs {
                file: sif_in.clone(),
                offset: 36864,
                size: 4096,
            },
            &sqsh,
            Format::Sqsh,
            &cfg,
        )
        .unwrap();
        let bytes = std::fs::read(&sqsh).unwrap();
        let original = std::fs::read(&sif_in).unwrap();
        assert_eq!(bytes, &original[36864..36864 + 4096]);
        assert_eq!(w.bytes, 4096);
        // .sqsh -> SIF, which berth then reads back.
        let sif_out = dir.path().join("hello.sif");
        export(
            &Source::Squashfs {
                file: sqsh.clone(),
                offset: 0,
                size: 4096,
            },
            &sif_out,
            Format::Sif,
            &cfg,
        )
        .unwrap();
        let image = crate::squashfs::inspect_sif(&sif_out).unwrap();
        let crate::Rootfs::Squashfs { offset, size, .. } = image.rootfs else {
            panic!()
        };
        assert_eq!((offset, size), (32768, 4096));
        let out = std::fs::read(&sif_out).unwrap();
        assert_eq!(&out[32768..], &bytes[..]);
        // Nothing but the two outputs in the directory: no temporary left over.
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["hello.sif", "hello.sqsh"]);
    }

    #[test]
    fn bad_sources_and_targets_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SquashfsConfig::default();
        let notes = dir.path().join("notes.txt");
        std::fs::write(&notes, "text").unwrap();
        let err = export(
            &Source::Squashfs {
                file: notes.clone(),
                offset: 0,
                size: 4,
            },
            &dir.path().join("x.sqsh"),
            Format::Sqsh,
            &cfg,
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a squashfs image"), "{err}");
        let err = export(
            &Source::Layers(vec![notes.clone()]),
            &dir.path().join("x.sqsh"),
            Format::Sqsh,
            &cfg,
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a directory"), "{err}");
        let err = export(
            &Source::Layers(vec![dir.path().to_path_buf()]),
            &dir.path().join("missing/x.sqsh"),
            Format::Sqsh,
            &cfg,
        )
        .unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
