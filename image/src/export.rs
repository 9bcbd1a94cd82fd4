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
//!   untouched. The user's processes may swap files for symlinks or FIFOs meanwhile, so
//!   mksquashfs runs with an empty tmpfs as its root ([`Jail`]): it holds mksquashfs and its
//!   libraries, the bare root at `/src` and the output at `/out`, and nothing of the host, so a
//!   path mksquashfs follows never reaches a host file; a deadline bounds a blocked read;
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
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::ImageError;
use super::sif::{self, FsType, ObjectKind, PartType, Partition};
use super::squashfs::probe_squashfs_magic;
use crate::config::{Compression, SquashfsConfig};

/// Why an export failed: one line naming the output or the input, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(
        "writing {out}: no space left on device ({dir} has {free} free of {total}); free some space or export elsewhere with -o"
    )]
    NoSpace {
        out: PathBuf,
        dir: PathBuf,
        free: String,
        total: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(
        "mksquashfs not found (looked for {0}); install squashfs-tools (apt-get install squashfs-tools)"
    )]
    NoMksquashfs(String),
    #[error("mksquashfs failed writing {out}: {message}")]
    Mksquashfs { out: PathBuf, message: String },
    #[error(
        "saving to {out} took longer than {secs} s and was stopped (a file in the container that \
         never ends or blocks, such as a FIFO swapped in mid-save, or a very large container); \
         raise squashfs.export_timeout_s if the container is that large"
    )]
    Timeout { out: PathBuf, secs: u64 },
    /// What to export is not an image berth can export (the user's input).
    #[error("{0}")]
    Invalid(String),
}

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

/// `name` on PATH, else where Debian and others install programs (a Slurm prolog runs with no
/// PATH).
fn find_program(name: &str) -> Option<PathBuf> {
    let dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.iter()
        .map(PathBuf::as_path)
        .chain(PROGRAM_DIRS.iter().map(Path::new))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

const PROGRAM_DIRS: [&str; 5] = ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"];

/// The mksquashfs binary.
pub fn find_mksquashfs() -> Result<PathBuf, ImageError> {
    find_program("mksquashfs").ok_or_else(|| {
        ImageError::Export(ExportError::NoMksquashfs(format!(
            "PATH, {}",
            PROGRAM_DIRS.join(", ")
        )))
    })
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
    ImageError::Export(ExportError::NoSpace {
        out: out.to_path_buf(),
        dir,
        free,
        total,
    })
}

fn io_err(out: &Path, what: String) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            no_space(out)
        } else {
            ImageError::Export(ExportError::Io { what, source })
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
        .map_err(|e| ExportError::Invalid(e.to_string()))?;
    let out = absolute(out)?;
    let mut tmp = TempOutput {
        path: temp_name(&out),
        committed: false,
    };
    let _ = std::fs::remove_file(&tmp.path);
    let bytes = match write_temp(source, &tmp.path, &out, format, config) {
        Ok(bytes) => bytes,
        Err(ImageError::Export(ExportError::NoSpace { .. })) => {
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
        return Err(ImageError::Export(ExportError::Invalid(format!(
            "{}: only {len} bytes were written, too few for a squashfs",
            tmp.display()
        ))));
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
    let out = std::path::absolute(out).map_err(|source| ExportError::Io {
        what: format!("resolving {}", out.display()),
        source,
    })?;
    let dir = out.parent().unwrap_or(Path::new("/"));
    if !dir.is_dir() {
        return Err(ImageError::Export(ExportError::Invalid(format!(
            "{}: directory {} does not exist",
            out.display(),
            dir.display()
        ))));
    }
    if out.is_dir() {
        return Err(ImageError::Export(ExportError::Invalid(format!(
            "{} is a directory; give a file name such as {}/image.sqsh",
            out.display(),
            out.display()
        ))));
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
        return Err(ImageError::Export(ExportError::Invalid(format!(
            "{}: expected {size} bytes at byte {at}, found {copied}",
            file.display()
        ))));
    }
    dst.flush()
        .map_err(io_err(out, format!("writing {}", tmp.display())))
}

fn cstring(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        ImageError::Export(ExportError::Invalid(format!(
            "{}: path contains a NUL byte",
            p.display()
        )))
    })
}

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Runs mksquashfs within `config.export_timeout_s` and turns its failure into one line. Past
/// the deadline it is killed: a step's end never waits on the user's files without limit.
/// `setup` names what the child does before exec, for the error if that fails.
fn run_mksquashfs(
    mut cmd: Command,
    setup: &str,
    tmp: &Path,
    out: &Path,
    config: &SquashfsConfig,
) -> Result<(), ImageError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ExportError::Io {
            what: format!("starting mksquashfs ({setup})"),
            source,
        })?;
    let pid = child.id();
    let stderr = child.stderr.take();
    // A thread owns the child and reaps it: the pid stays the child's (unreaped) until then, so
    // the kill below can never reach another process.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut text = Vec::new();
        if let Some(e) = stderr {
            // Bounded: a message, not a stream to keep.
            let _ = e.take(64 * 1024).read_to_end(&mut text);
        }
        let _ = done.send((child.wait(), text));
    });
    let limit = std::time::Duration::from_secs(config.export_timeout_s);
    let (status, stderr) = match finished.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => {
            let pid = libc::pid_t::try_from(pid).unwrap_or(libc::pid_t::MAX);
            // SAFETY: kill(2) on the child this function started, not yet reaped (above).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = finished.recv();
            return Err(ImageError::Export(ExportError::Timeout {
                out: out.to_path_buf(),
                secs: config.export_timeout_s,
            }));
        }
    };
    let status = status.map_err(|source| ExportError::Io {
        what: "waiting for mksquashfs".into(),
        source,
    })?;
    let written = std::fs::metadata(tmp).is_ok_and(|m| m.len() > 0);
    if status.success() && written {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&stderr);
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
        .unwrap_or_else(|| format!("it exited with {status}"));
    Err(ImageError::Export(ExportError::Mksquashfs {
        out: out.to_path_buf(),
        message,
    }))
}

/// Moves this process into a mount namespace of its own whose mounts propagate nowhere: what
/// it mounts never appears on the host. Allocates nothing (it runs between fork and exec).
fn private_mount_namespace() -> std::io::Result<()> {
    // SAFETY: unshare and mount with static strings and null pointers; no memory of ours is
    // written.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))
    }
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
        return Err(ImageError::Export(ExportError::Invalid(
            "no layers to export".into(),
        )));
    };
    for l in layers {
        if !l.is_dir() {
            return Err(ImageError::Export(ExportError::Invalid(format!(
                "root file system {} is not a directory",
                l.display()
            ))));
        }
    }
    let mksquashfs = find_mksquashfs()?;
    if !is_root() {
        if layers.len() > 1 {
            return Err(ImageError::Export(ExportError::Invalid(
                "exporting several layers needs root (it mounts an overlay)".into(),
            )));
        }
        let mut cmd = Command::new(&mksquashfs);
        cmd.args(mksquashfs_args(top, tmp, offset, config));
        return run_mksquashfs(cmd, "reading the directory", tmp, out, config);
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
        .map_err(|_| ExportError::Invalid("layer path contains a NUL byte".into()))?;
    let target = cstring(&merged)?;
    let mut cmd = Command::new(&mksquashfs);
    cmd.args(mksquashfs_args(&merged, tmp, offset, config));
    // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls on
    // strings prepared beforehand; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            private_mount_namespace()?;
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
        config,
    )
}

/// open_tree(2)'s flag for a detached copy of the mount (not in libc).
const OPEN_TREE_CLONE: libc::c_int = 1;
/// move_mount(2)'s flag: the source is the descriptor itself (not in libc).
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

/// Where the saving child mounts the tmpfs that becomes its root, in its private copy of the
/// host's mount namespace: a directory every system has and no user can replace. Nothing
/// changes there on the host.
const JAIL_AT: &str = "/dev";

/// A program and the shared objects it loads, as `ldd` lists them: what an empty root must hold
/// for the program to run.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tool {
    binary: PathBuf,
    /// The ELF interpreter, at the absolute path the binary names (none when static).
    interpreter: Option<PathBuf>,
    libraries: Vec<PathBuf>,
}

/// The interpreter and libraries in `ldd`'s output (`name => /path (0x…)`, `/interp (0x…)`).
fn parse_ldd(text: &str) -> Result<(Option<PathBuf>, Vec<PathBuf>), String> {
    let mut interpreter = None;
    let mut libraries = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not a dynamic executable") || line.contains("statically linked") {
            return Ok((None, Vec::new()));
        }
        let path = |p: &str| p.split(" (0x").next().unwrap_or(p).trim().to_string();
        match line.split_once("=>") {
            Some((name, target)) => {
                let target = path(target);
                if target == "not found" {
                    return Err(format!("{} is not found", name.trim()));
                }
                if target.starts_with('/') {
                    libraries.push(PathBuf::from(target));
                }
            }
            // The vDSO has no file; the interpreter is the one absolute path without "=>".
            None if line.starts_with('/') => interpreter = Some(PathBuf::from(path(line))),
            None => {}
        }
    }
    Ok((interpreter, libraries))
}

/// The ELF interpreter (`PT_INTERP`) `elf` names, or `None` for a statically linked binary.
fn elf_interpreter(elf: &[u8]) -> Result<Option<PathBuf>, String> {
    if elf.get(..4) != Some(b"\x7fELF") {
        return Err("not an ELF file".into());
    }
    let wide = match elf.get(4) {
        Some(1) => false,
        Some(2) => true,
        _ => return Err("unknown ELF class".into()),
    };
    let little = match elf.get(5) {
        Some(1) => true,
        Some(2) => false,
        _ => return Err("unknown ELF byte order".into()),
    };
    let num = |at: usize, len: usize| -> Result<u64, String> {
        let b = elf.get(at..at + len).ok_or("a truncated ELF header")?;
        let mut v = 0u64;
        for i in 0..len {
            let byte = if little { b[len - 1 - i] } else { b[i] };
            v = (v << 8) | u64::from(byte);
        }
        Ok(v)
    };
    let size = |v: u64| usize::try_from(v).map_err(|_| "an ELF offset out of range".to_string());
    // (e_phoff, e_phentsize, e_phnum) and, in a program header, (p_offset, p_filesz).
    let (phoff, phentsize, phnum) = if wide {
        (num(0x20, 8)?, num(0x36, 2)?, num(0x38, 2)?)
    } else {
        (num(0x1c, 4)?, num(0x2a, 2)?, num(0x2c, 2)?)
    };
    let (phoff, phentsize) = (size(phoff)?, size(phentsize)?);
    for i in 0..size(phnum)? {
        let ph = phoff
            .checked_add(
                i.checked_mul(phentsize)
                    .ok_or("an ELF offset out of range")?,
            )
            .ok_or("an ELF offset out of range")?;
        const PT_INTERP: u64 = 3;
        if num(ph, 4)? != PT_INTERP {
            continue;
        }
        let (offset, len) = if wide {
            (num(ph + 8, 8)?, num(ph + 0x20, 8)?)
        } else {
            (num(ph + 4, 4)?, num(ph + 0x10, 4)?)
        };
        let (offset, len) = (size(offset)?, size(len)?);
        let raw = offset
            .checked_add(len)
            .and_then(|end| elf.get(offset..end))
            .ok_or("a truncated ELF interpreter name")?;
        let name = raw.split(|b| *b == 0).next().unwrap_or_default();
        return Ok(Some(PathBuf::from(std::ffi::OsStr::from_bytes(name))));
    }
    Ok(None)
}

/// mksquashfs's files: its interpreter lists what it loads (`ld.so --list`, what ldd runs; ldd
/// itself, a bash script, is missing from minimal systems such as an initramfs).
fn tool(binary: &Path) -> Result<Tool, ImageError> {
    let fail = |why: String| {
        ExportError::Invalid(format!(
            "listing the libraries of {} for the save's empty root: {why}",
            binary.display()
        ))
    };
    // The program headers sit at the start of the file; 64 KiB holds them with room to spare.
    let mut head = Vec::new();
    File::open(binary)
        .and_then(|f| f.take(64 * 1024).read_to_end(&mut head))
        .map_err(|e| fail(e.to_string()))?;
    let Some(interpreter) = elf_interpreter(&head).map_err(fail)? else {
        return Ok(Tool {
            binary: binary.to_path_buf(),
            interpreter: None,
            libraries: Vec::new(),
        });
    };
    let o = Command::new(&interpreter)
        .arg("--list")
        .arg(binary)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(|e| fail(format!("running {} --list: {e}", interpreter.display())))?;
    if !o.status.success() {
        let why = String::from_utf8_lossy(&o.stderr);
        return Err(fail(format!(
            "{} --list: {}",
            interpreter.display(),
            why.trim().chars().take(200).collect::<String>()
        ))
        .into());
    }
    let (_, mut libraries) = parse_ldd(&String::from_utf8_lossy(&o.stdout)).map_err(fail)?;
    // glibc loads libgcc_s at run time (dlopen, so the list does not hold it) to unwind a
    // thread that exits: mksquashfs's threads do.
    if let Some(dir) = libraries
        .iter()
        .find(|l| l.file_name().is_some_and(|n| n == "libc.so.6"))
        .and_then(|l| l.parent())
    {
        let gcc = dir.join("libgcc_s.so.1");
        if gcc.is_file() && !libraries.contains(&gcc) {
            libraries.push(gcc);
        }
    }
    Ok(Tool {
        binary: binary.to_path_buf(),
        interpreter: Some(interpreter),
        libraries,
    })
}

/// Where each of `tool`'s files goes in the jail: (host path, path in the jail). mksquashfs is
/// `/bin/mksquashfs`, its libraries are in `/lib` (`LD_LIBRARY_PATH`), its interpreter where the
/// binary names it.
fn layout(tool: &Tool) -> Vec<(PathBuf, PathBuf)> {
    let mut places = vec![(tool.binary.clone(), PathBuf::from("/bin/mksquashfs"))];
    if let Some(i) = &tool.interpreter {
        places.push((i.clone(), i.clone()));
    }
    for l in &tool.libraries {
        let name = l.file_name().unwrap_or_default();
        places.push((l.clone(), Path::new("/lib").join(name)));
    }
    let mut taken = std::collections::HashSet::new();
    places.retain(|(_, inside)| taken.insert(inside.clone()));
    places
}

/// The empty root mksquashfs saves a container from: a tmpfs holding only mksquashfs, the shared
/// objects it loads, the container's root mount (alone, at `/src`) and the output file (`/out`).
/// A symlink in the container, whatever it points to and whenever it is swapped in, resolves in
/// there: never to a host file.
#[derive(Debug)]
struct Jail {
    /// Directories to make, parents first.
    dirs: Vec<CString>,
    /// Empty files to make as mount points.
    files: Vec<CString>,
    /// (detached mount, target, read-only): each file cloned here with open_tree from what this
    /// process opened, attached by the child with move_mount (a bind by path would look the
    /// path up again; one from a descriptor of this namespace is refused in the child's).
    binds: Vec<(OwnedFd, CString, bool)>,
    tmpfs_at: CString,
    src: CString,
}

/// A detached copy (open_tree OPEN_TREE_CLONE) of the file `fd` is open on.
fn detached_copy(fd: &OwnedFd, what: &Path) -> Result<OwnedFd, ImageError> {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "open_tree returns an int (an fd or -1), widened to syscall()'s long"
    )]
    // SAFETY: open_tree on a descriptor owned here with a static empty path; it returns a new
    // descriptor or -1 and touches no memory of ours.
    let cloned = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            fd.as_raw_fd(),
            c"".as_ptr(),
            (libc::AT_EMPTY_PATH | OPEN_TREE_CLONE | libc::O_CLOEXEC) as libc::c_uint,
        ) as libc::c_int
    };
    check(cloned).map_err(|source| ExportError::Io {
        what: format!("cloning a mount of {}", what.display()),
        source,
    })?;
    // SAFETY: `cloned` is a descriptor open_tree just returned, owned by nothing else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(cloned) })
}

impl Jail {
    fn new(tool: &Tool, output: &OwnedFd, out: &Path) -> Result<Jail, ImageError> {
        let mut jail = Jail {
            dirs: Vec::new(),
            files: Vec::new(),
            binds: Vec::new(),
            tmpfs_at: cstring(Path::new(JAIL_AT))?,
            src: cstring(&Path::new(JAIL_AT).join("src"))?,
        };
        jail.dirs.push(jail.src.clone());
        for (source, inside) in layout(tool) {
            let fd = nix::fcntl::open(
                &source,
                nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .map_err(|e| ExportError::Io {
                what: format!("opening {}", source.display()),
                source: e.into(),
            })?;
            let mount = detached_copy(&fd, &source)?;
            jail.bind(mount, &inside, true)?;
        }
        jail.bind(detached_copy(output, out)?, Path::new("/out"), false)?;
        Ok(jail)
    }

    /// Mounts `mount` at `inside` (a path in the jail), making its parent directories.
    fn bind(&mut self, mount: OwnedFd, inside: &Path, read_only: bool) -> Result<(), ImageError> {
        let at = Path::new(JAIL_AT);
        let rel = inside.strip_prefix("/").unwrap_or(inside);
        let mut dir = at.to_path_buf();
        for part in rel.parent().into_iter().flat_map(Path::components) {
            dir.push(part);
            let d = cstring(&dir)?;
            if !self.dirs.contains(&d) {
                self.dirs.push(d);
            }
        }
        let target = cstring(&at.join(rel))?;
        self.files.push(target.clone());
        self.binds.push((mount, target, read_only));
        Ok(())
    }
}

fn squash_container(
    pid: i32,
    tmp: &Path,
    offset: u64,
    config: &SquashfsConfig,
    out: &Path,
) -> Result<(), ImageError> {
    let mksquashfs = find_mksquashfs()?;
    let tool = tool(&mksquashfs)?;
    let open = |path: String, flags: nix::fcntl::OFlag| -> Result<OwnedFd, ImageError> {
        nix::fcntl::open(path.as_str(), flags, nix::sys::stat::Mode::empty()).map_err(|e| {
            ImageError::Export(ExportError::Io {
                what: format!("opening {path}"),
                source: e.into(),
            })
        })
    };
    use nix::fcntl::OFlag;
    let mnt_ns = open(
        format!("/proc/{pid}/ns/mnt"),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
    )?;
    let host_ns = open(
        "/proc/self/ns/mnt".into(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
    )?;
    // The container's root: the namespace's top mount after pivot_root, but a mount above a
    // tmpfs when the container was moved onto an initramfs root (runtime::init::move_root).
    let container_root = open(
        format!("/proc/{pid}/root"),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
    )?;
    // Made here, exclusively (never through a link), and bound into the jail by descriptor.
    let output: OwnedFd = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(tmp)
        .map_err(io_err(out, format!("creating {}", tmp.display())))?
        .into();
    let jail = Jail::new(&tool, &output, out)?;
    let (ns_fd, host_ns_fd) = (mnt_ns.as_raw_fd(), host_ns.as_raw_fd());
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
        .map_err(|e| ExportError::Io {
            what: "reading the remapped container's files".into(),
            source: std::io::Error::other(e),
        })?;
    let idmap_fd = idmap.as_ref().map(|fd| fd.as_raw_fd());
    let processors = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let mut cmd = Command::new("/bin/mksquashfs");
    cmd.args(mksquashfs_args(
        Path::new("/src"),
        Path::new("/out"),
        offset,
        config,
    ))
    .args(["-processors", &processors.to_string()])
    .env_clear()
    .env("LD_LIBRARY_PATH", "/lib");
    let ro = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    // The child's copies; `jail` keeps the mounts open until mksquashfs has started.
    let (dirs, files) = (jail.dirs.clone(), jail.files.clone());
    let binds: Vec<(libc::c_int, CString, bool)> = jail
        .binds
        .iter()
        .map(|(fd, target, ro)| (fd.as_raw_fd(), target.clone(), *ro))
        .collect();
    let (tmpfs_at, src) = (jail.tmpfs_at.clone(), jail.src.clone());
    // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls on
    // descriptors and strings prepared beforehand; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // In the container's mount namespace, a copy of its root mount alone (open_tree
            // without AT_RECURSIVE): nothing mounted on it comes along, whatever the paths of
            // those mounts are by now.
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
            // A private copy of the host's namespace to build the jail in.
            check(libc::setns(host_ns_fd, libc::CLONE_NEWNS))?;
            private_mount_namespace()?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                tmpfs_at.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,size=1m".as_ptr().cast(),
            ))?;
            for d in &dirs {
                check(libc::mkdir(d.as_ptr(), 0o755))?;
            }
            for f in &files {
                let fd = libc::open(
                    f.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o600,
                );
                check(fd)?;
                libc::close(fd);
            }
            for (mount, target, read_only) in &binds {
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "move_mount returns 0 or -1, widened to syscall()'s long"
                )]
                let moved = libc::syscall(
                    libc::SYS_move_mount,
                    *mount,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                ) as libc::c_int;
                check(moved)?;
                if *read_only {
                    check(libc::mount(
                        std::ptr::null(),
                        target.as_ptr(),
                        std::ptr::null(),
                        ro,
                        std::ptr::null(),
                    ))?;
                }
            }
            #[expect(
                clippy::cast_possible_truncation,
                reason = "move_mount returns 0 or -1, widened to syscall()'s long"
            )]
            let moved = libc::syscall(
                libc::SYS_move_mount,
                bare,
                c"".as_ptr(),
                libc::AT_FDCWD,
                src.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            ) as libc::c_int;
            check(moved)?;
            libc::close(bare);
            check(libc::mount(
                std::ptr::null(),
                src.as_ptr(),
                std::ptr::null(),
                ro,
                std::ptr::null(),
            ))?;
            // The jail becomes the root; the host's tree is detached from this namespace (a
            // chroot where the host root cannot be pivoted, as from an initramfs).
            check(libc::chdir(tmpfs_at.as_ptr()))?;
            if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) == 0 {
                check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            } else {
                check(libc::chroot(c".".as_ptr()))?;
            }
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
        "building the save's empty root around the container's root mount",
        tmp,
        out,
        config,
    );
    drop(jail);
    drop(output);
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
        Err(ImageError::Export(ExportError::Invalid(
            "exporting a running container needs root (it joins the container's mount namespace)"
                .into(),
        )))
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
    fn ldd_output_names_the_interpreter_and_libraries() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd4b1f4000)\n\
            \tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f0c)\n\
            \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0b)\n\
            \t/lib64/ld-linux-x86-64.so.2 (0x00007f0d)\n";
        let (interp, libs) = parse_ldd(text).unwrap();
        assert_eq!(interp, Some(PathBuf::from("/lib64/ld-linux-x86-64.so.2")));
        assert_eq!(
            libs,
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libz.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6")
            ]
        );
        assert_eq!(
            parse_ldd("\tnot a dynamic executable\n").unwrap(),
            (None, Vec::new())
        );
        let err = parse_ldd("\tliblzo2.so.2 => not found\n").unwrap_err();
        assert!(err.contains("liblzo2.so.2"), "{err}");
    }

    #[test]
    fn the_interpreter_is_read_from_the_elf_program_headers() {
        // A minimal little-endian ELF64 with one PT_INTERP program header.
        let mut elf = vec![0u8; 0x40 + 0x38];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let name = b"/lib64/ld-test.so.2\0";
        let at = u64::try_from(elf.len()).unwrap();
        elf[0x40..0x44].copy_from_slice(&3u32.to_le_bytes());
        elf[0x48..0x50].copy_from_slice(&at.to_le_bytes());
        elf[0x60..0x68].copy_from_slice(&u64::try_from(name.len()).unwrap().to_le_bytes());
        elf.extend_from_slice(name);
        assert_eq!(
            elf_interpreter(&elf).unwrap(),
            Some(PathBuf::from("/lib64/ld-test.so.2"))
        );
        // No PT_INTERP: static.
        elf[0x40..0x44].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(elf_interpreter(&elf).unwrap(), None);
        // Lies are refused, not followed.
        elf[0x40..0x44].copy_from_slice(&3u32.to_le_bytes());
        elf[0x60..0x68].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = elf_interpreter(&elf).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        assert_eq!(
            elf_interpreter(b"#!/bin/sh\n").unwrap_err(),
            "not an ELF file"
        );
        // This machine's mksquashfs, when installed, names its interpreter as ldd does.
        if let Ok(m) = find_mksquashfs() {
            let head = std::fs::read(&m).unwrap();
            let interp = elf_interpreter(&head)
                .unwrap()
                .expect("a dynamic mksquashfs");
            assert!(interp.is_absolute(), "{}", interp.display());
        }
    }

    #[test]
    fn the_jail_holds_the_tool_and_its_libraries_once_each() {
        let tool = Tool {
            binary: PathBuf::from("/usr/bin/mksquashfs"),
            interpreter: Some(PathBuf::from("/lib64/ld-linux-x86-64.so.2")),
            libraries: vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libz.so.1"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libz.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
            ],
        };
        let expected = [
            ("/usr/bin/mksquashfs", "/bin/mksquashfs"),
            ("/lib64/ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2"),
            ("/lib/x86_64-linux-gnu/libz.so.1", "/lib/libz.so.1"),
            ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/libc.so.6"),
        ]
        .map(|(s, i)| (PathBuf::from(s), PathBuf::from(i)));
        assert_eq!(layout(&tool), expected);
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
