//! The host's MPI in a container (`--container-mpi=host`, `berth run --mpi=host`): the site's
//! MPI libraries and the libraries they load (`[host_software].mpi_libraries`), gathered once
//! per node into a directory of the state directory (copies, each under its own names), are
//! bound read-only as one directory of the container, [`LIB_DIR`], which is put first in the
//! container's LD_LIBRARY_PATH; the MPI's plugin trees and configuration files (`mpi_paths`)
//! are bound at their own paths, where the host's libraries look for them. The image's files
//! are never written: its libmpi stays where it is, found after LD_LIBRARY_PATH.
//!
//! Before anything is bound the pairing is checked as Sarus checks it: the image's libmpi
//! (found from its library files, opened beneath each layer without following a symlink, read
//! with bounded reads) has the host's ABI (the SONAME's major: `libmpi.so.12` of the MPICH ABI,
//! `libmpi.so.40` of Open MPI) and a minor no newer than the host's; the image's glibc is at
//! least the newest `GLIBC_x.y` the host's libraries need (their ELF version needs, not the
//! host's glibc version: an image older than the host still takes an MPI built for older
//! systems); and every library the host's libraries need is either bound too or in the image.
//! A compatible pairing's answer is kept (crate::hostsw's memo) with the image files it was
//! read from, and recalled while they are unchanged; the host's side is the gathered
//! directory's, whose name changes with the host's files. `berth gc` removes gathered
//! directories no longer current and bound by no container ([`reclaim`]).

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use berth_image::elf;
use berth_spec::BindMount;

use crate::NodeError;
use crate::hostsw::memo::{self, Inputs, Memo};
use berth_config::Config;

/// Where the host's MPI libraries appear in the container, first in its LD_LIBRARY_PATH.
pub const LIB_DIR: &str = "/usr/lib/berth/host-mpi";

/// What `--container-mpi` asks for: `host` or `image` (the image's own MPI, nothing bound).
pub fn parse_choice(value: &str, what: &str) -> Result<bool, NodeError> {
    match value {
        "host" => Ok(true),
        "image" | "none" => Ok(false),
        other => Err(NodeError::input(format!(
            "{what}={other}: unknown MPI choice: use host (the node's MPI) or image (the \
             image's own)"
        ))),
    }
}

/// Puts [`LIB_DIR`] first in `env`'s LD_LIBRARY_PATH (the last entry of the name, which is the
/// one the container gets), keeping what the job or image had after it.
pub fn with_library_path(env: &mut Vec<(String, String)>) {
    match env.iter_mut().rev().find(|(k, _)| k == "LD_LIBRARY_PATH") {
        Some((_, v)) if !v.is_empty() => *v = format!("{LIB_DIR}:{v}"),
        Some((_, v)) => *v = LIB_DIR.to_string(),
        None => env.push(("LD_LIBRARY_PATH".into(), LIB_DIR.into())),
    }
}

/// An MPI library's ABI: its SONAME's major and the minor of its file's name (`libmpi.so.40.30.4`:
/// 40, 30; `None` when the file is named by its SONAME only).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Abi {
    file: String,
    major: u32,
    minor: Option<u32>,
}

impl Abi {
    fn family(&self) -> &'static str {
        match self.major {
            12 => "MPICH ABI",
            40 => "Open MPI",
            _ => "an MPI",
        }
    }

    /// The family and the library's file, whose name carries the version
    /// (`Open MPI (libmpi.so.40.30.4)`).
    fn shown(&self) -> String {
        format!("{} ({})", self.family(), self.file)
    }
}

/// The read-only binds of the host's MPI for a container on `lowers` (image layers, topmost
/// first), after the ABI, glibc and dependency checks; `what` names the request in errors.
pub fn mpi_binds(
    config: &Config,
    lowers: &[PathBuf],
    what: &str,
) -> Result<Vec<BindMount>, NodeError> {
    let hs = &config.host_software;
    let (names, binds) = library_binds(config)?;
    // What the host's libraries are is read from them once per set of files (as their
    // gathered copies are made), then from the facts file beside the copies.
    let stage = Stage::new(&config.runtime.state_dir, &binds);
    let facts = match stage.as_ref().ok().and_then(Stage::facts) {
        Some(facts) => facts,
        None => HostFacts::read(&binds, what)?,
    };
    let host = facts.mpi.clone().ok_or_else(|| {
        NodeError::host(format!(
            "{what}: no libmpi.so of this node among host_software.mpi_libraries: ask the site \
             to name its MPI in berth.toml, or use the image's MPI ({what} left out)"
        ))
    })?;
    // The image's side is read only when no answer for this pairing is kept with its files
    // unchanged (the image's library directories, its libmpi and libc.so.6; a store image's
    // digest names all of them).
    let dirs: Vec<Option<File>> = lowers.iter().map(|l| File::open(l).ok()).collect();
    let fixed = memo::fixed_roots(&config.squashfs.mount_dir, lowers);
    let key = (
        facts.to_text(),
        &names,
        memo::root_ids(lowers, &dirs, &fixed),
    );
    let memo = Memo::new(&config.runtime.state_dir, "mpi", key);
    if memo.recall(&dirs).as_deref() != Some(COMPATIBLE) {
        let mut inputs = Inputs::new(fixed);
        let image = Image::read(&dirs, &mut inputs);
        check_pairing(&host, &facts, &names, &image, what)?;
        memo.keep(&inputs, COMPATIBLE);
    }
    // One bind of a directory instead of one per library: each bind costs the step's start
    // about a millisecond, and a site's MPI is tens of files.
    let mut binds = match stage.and_then(|st| st.make(&facts)) {
        Ok(dir) => vec![BindMount {
            source: dir,
            destination: PathBuf::from(LIB_DIR),
            readonly: true,
        }],
        Err(e) => {
            tracing::warn!(
                "{what}: gathering the host's MPI libraries under {}: {e}: binding each",
                config.runtime.state_dir.join("host-mpi").display()
            );
            binds
        }
    };
    binds.extend(crate::hostsw::configured_kept(
        config,
        &hs.mpi_paths,
        "mpi_paths",
    )?);
    Ok(binds)
}

/// The configured MPI libraries that exist here, each a bind into [`LIB_DIR`] under its own
/// name, and those names.
fn library_binds(
    config: &Config,
) -> Result<(BTreeSet<std::ffi::OsString>, Vec<BindMount>), NodeError> {
    let mut names = BTreeSet::new();
    let mut binds = Vec::new();
    for lib in crate::hostsw::configured_kept(
        config,
        &config.host_software.mpi_libraries,
        "mpi_libraries",
    )? {
        let Some(name) = lib.destination.file_name().map(|n| n.to_os_string()) else {
            continue;
        };
        // Of two files of one name (two architectures' directories), the first listed wins.
        if names.insert(name.clone()) {
            binds.push(BindMount {
                source: lib.source,
                destination: Path::new(LIB_DIR).join(name),
                readonly: true,
            });
        }
    }
    Ok((names, binds))
}

/// How long a gathered directory is kept after it was made, current or not: a step may have
/// chosen it a moment ago and not yet bound it.
const GATHERED_GRACE: std::time::Duration = std::time::Duration::from_secs(120);

/// How long a kept check answer ([`memo`]) that no step recalled stays.
const MEMO_AGE: std::time::Duration = std::time::Duration::from_secs(2 * 24 * 3600);

/// `berth gc`'s part: removes the gathered copies of the host's MPI
/// (`<state_dir>/host-mpi/<hash>` and its facts) that are not the current libraries' and that
/// no container has bound (no mount namespace of a process shows them), and the check answers
/// no step used for two days. One line for each copy removed.
pub fn reclaim(config: &Config) -> Vec<String> {
    let state_dir = &config.runtime.state_dir;
    let mut out = Vec::new();
    let removed = memo::reclaim(state_dir, MEMO_AGE);
    if removed > 0 {
        out.push(format!(
            "removed {removed} unused host-software check answers"
        ));
    }
    let base = state_dir.join("host-mpi");
    let Ok(meta) = std::fs::symlink_metadata(&base) else {
        return out;
    };
    if memo::own_dir(&base).is_err() || !meta.is_dir() {
        return out;
    }
    let current = library_binds(config)
        .ok()
        .and_then(|(_, binds)| Stage::new(state_dir, &binds).ok())
        .and_then(|st| st.dir.file_name().map(|n| n.to_string_lossy().into_owned()));
    // A namespace whose mounts cannot be read whole might bind any copy: keep them all.
    let Some(bound) = bound_gathered() else {
        return out;
    };
    let now = std::time::SystemTime::now();
    let mut gone = BTreeSet::new();
    for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let hash = name.split('.').next().unwrap_or_default().to_string();
        let young = entry
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
            .is_none_or(|age| age < GATHERED_GRACE);
        if current.as_deref() == Some(hash.as_str()) || bound.contains(&hash) || young {
            continue;
        }
        let path = entry.path();
        let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Ok(()) if gone.insert(hash.clone()) => {
                out.push(format!(
                    "removed the host MPI copy {}",
                    base.join(&hash).display()
                ));
            }
            Ok(()) => {}
            Err(e) => tracing::warn!("removing {}: {e}", path.display()),
        }
    }
    out
}

/// The most of one process's /proc/<pid>/mountinfo read (thousands of mounts fit many times).
const MOUNTINFO_LIMIT: u64 = 64 << 20;

/// The names of the gathered directories some mount namespace has bound: the last component of
/// a mount's root (its 4th field in mountinfo) under a `host-mpi` directory, read once per
/// namespace; `None` when a namespace's mounts could not be read whole.
fn bound_gathered() -> Option<BTreeSet<String>> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = BTreeSet::new();
    let mut bound = BTreeSet::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let proc = entry.path();
        let Ok(ns) = std::fs::metadata(proc.join("ns/mnt")) else {
            continue;
        };
        if !seen.insert((ns.dev(), ns.ino())) {
            continue;
        }
        // A process gone since the listing has no mounts to keep; any other failure (a
        // mountinfo past the bound: a user's namespace with very many mounts) means unknown.
        let text = match File::open(proc.join("mountinfo")) {
            Ok(mut f) => match berth_sys::privfs::read_bounded(&mut f, MOUNTINFO_LIMIT) {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(_) => return None,
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return None,
        };
        for line in text.lines() {
            let Some(root) = line.split(' ').nth(3) else {
                continue;
            };
            if let Some((parent, name)) = root.rsplit_once('/')
                && parent.ends_with("/host-mpi")
            {
                bound.insert(name.to_string());
            }
        }
    }
    Some(bound)
}

/// What the checks' answer for a compatible pairing is kept as.
const COMPATIBLE: &str = "compatible";

/// Refuses an image whose MPI is not the host's ABI or is newer than the host's, whose glibc is
/// older than the host's libraries need, or which lacks a library they need that is not bound.
fn check_pairing(
    host: &Abi,
    facts: &HostFacts,
    names: &BTreeSet<std::ffi::OsString>,
    image: &Image,
    what: &str,
) -> Result<(), NodeError> {
    let theirs = image.mpi.clone().ok_or_else(|| {
        NodeError::input(format!(
            "{what}: the image has no MPI library (libmpi.so or libmpich.so in its library \
             directories) for {} to replace: use an image whose programs link libmpi, or drop \
             {what}",
            host.shown()
        ))
    })?;
    if theirs.major != host.major {
        return Err(NodeError::input(format!(
            "{what}: the image's MPI is {}, this node's is {}: their ABIs differ; use an image \
             built with {} (libmpi.so.{}), or drop {what}",
            theirs.shown(),
            host.shown(),
            host.family(),
            host.major
        )));
    }
    if let (Some(mine), Some(its)) = (host.minor, theirs.minor)
        && its > mine
    {
        return Err(NodeError::input(format!(
            "{what}: the image's MPI is {}, newer than this node's {}: programs built on it may \
             call what the node's lacks; use an image with libmpi.so.{}.{mine} or older, or drop \
             {what}",
            theirs.shown(),
            host.shown(),
            host.major
        )));
    }
    if let Some(need) = facts.glibc {
        match image.glibc {
            Some(have) if have >= need => {}
            Some(have) => {
                return Err(NodeError::input(format!(
                    "{what}: the image's glibc {}.{} is older than the {}.{} this node's MPI \
                     libraries need (GLIBC_{}.{}): use an image with glibc {}.{} or newer, or \
                     drop {what}",
                    have.0, have.1, need.0, need.1, need.0, need.1, need.0, need.1
                )));
            }
            None => {
                return Err(NodeError::input(format!(
                    "{what}: the image has no glibc (libc.so.6), which this node's MPI libraries \
                     need ({}.{} or newer): use a glibc image, or drop {what}",
                    need.0, need.1
                )));
            }
        }
    }
    let missing: Vec<String> = facts
        .needed
        .iter()
        .filter(|n| !names.contains(std::ffi::OsStr::new(n.as_str())) && !image.has(n))
        .cloned()
        .collect();
    if !missing.is_empty() {
        return Err(NodeError::input(format!(
            "{what}: this node's MPI libraries need {}, which neither the image nor \
             host_software.mpi_libraries has: ask the site to add them to \
             host_software.mpi_libraries, or use an image that has them",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// What the checks need of the host's MPI libraries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct HostFacts {
    mpi: Option<Abi>,
    /// The newest `GLIBC_x.y` they need.
    glibc: Option<(u32, u32)>,
    /// The libraries they need (DT_NEEDED).
    needed: BTreeSet<String>,
}

impl HostFacts {
    /// Reads the libraries `libs` bind.
    fn read(libs: &[BindMount], what: &str) -> Result<HostFacts, NodeError> {
        let mut facts = HostFacts::default();
        for lib in libs {
            let info = elf_info_host(&lib.source).map_err(|e| {
                NodeError::host(format!(
                    "{what}: reading the host's {}: {e}: fix host_software.mpi_libraries",
                    lib.source.display()
                ))
            })?;
            facts.glibc = facts.glibc.max(info.glibc);
            facts.needed.extend(info.needed);
            let text = lib
                .destination
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if facts.mpi.is_none() && text.starts_with("libmpi.so.") && lib.source.is_file() {
                let real = std::fs::canonicalize(&lib.source).unwrap_or(lib.source.clone());
                let real_name = real.file_name().map(|n| n.to_string_lossy().into_owned());
                facts.mpi = info
                    .soname
                    .as_deref()
                    .and_then(|s| abi(s, real_name.as_deref().unwrap_or(&text)));
            }
        }
        Ok(facts)
    }

    /// One line each: `mpi FILE MAJOR MINOR|-`, `glibc MAJOR MINOR`, `needed NAME`.
    fn to_text(&self) -> String {
        let mut out = String::new();
        if let Some(a) = &self.mpi {
            let minor = a.minor.map_or("-".to_string(), |m| m.to_string());
            out.push_str(&format!("mpi {} {} {minor}\n", a.file, a.major));
        }
        if let Some((major, minor)) = self.glibc {
            out.push_str(&format!("glibc {major} {minor}\n"));
        }
        for n in &self.needed {
            out.push_str(&format!("needed {n}\n"));
        }
        out
    }

    fn parse(text: &str) -> Option<HostFacts> {
        let mut facts = HostFacts::default();
        for line in text.lines() {
            let words: Vec<&str> = line.split(' ').collect();
            match words.as_slice() {
                ["mpi", file, major, minor] => {
                    facts.mpi = Some(Abi {
                        file: (*file).to_string(),
                        major: major.parse().ok()?,
                        minor: if *minor == "-" {
                            None
                        } else {
                            Some(minor.parse().ok()?)
                        },
                    });
                }
                ["glibc", major, minor] => {
                    facts.glibc = Some((major.parse().ok()?, minor.parse().ok()?));
                }
                ["needed", name] => {
                    facts.needed.insert((*name).to_string());
                }
                _ => return None,
            }
        }
        Some(facts)
    }
}

/// The directory of the state directory holding copies of the libraries a set of binds names
/// (each real file once, under its own name, and a relative symlink for each other name of it,
/// which resolves inside the container too), and beside it what they are ([`HostFacts`]);
/// made once per set of host files: named by a hash of their paths, inodes, sizes, mtimes and
/// ctimes, so an upgrade of the host's MPI makes a new one and a running container keeps the
/// one it has (`berth gc` removes old ones no container binds: [`reclaim`]).
struct Stage {
    dir: PathBuf,
    /// (name in the directory, the host's file of that name)
    files: Vec<(std::ffi::OsString, PathBuf)>,
}

impl Stage {
    fn new(state_dir: &Path, libs: &[BindMount]) -> std::io::Result<Stage> {
        use std::hash::{Hash, Hasher};
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let mut hash = std::collections::hash_map::DefaultHasher::new();
        let mut files = Vec::with_capacity(libs.len());
        // One stat each (of the file a symlink names): the step's start pays for this every
        // time, the real paths are resolved only when the directory is made.
        for lib in libs {
            let meta = std::fs::metadata(&lib.source)?;
            let Some(name) = lib.destination.file_name() else {
                continue;
            };
            (name, &lib.source, meta.dev(), meta.ino(), meta.len()).hash(&mut hash);
            (
                meta.mtime(),
                meta.mtime_nsec(),
                meta.ctime(),
                meta.ctime_nsec(),
            )
                .hash(&mut hash);
            files.push((name.to_os_string(), lib.source.clone()));
        }
        let base = state_dir.join("host-mpi");
        match std::fs::DirBuilder::new().mode(0o755).create(&base) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let meta = std::fs::symlink_metadata(&base)?;
        if !meta.is_dir()
            || meta.uid() != nix::unistd::geteuid().as_raw()
            || meta.mode() & 0o022 != 0
        {
            return Err(std::io::Error::other(
                "not a directory of berth's that only berth writes",
            ));
        }
        Ok(Stage {
            dir: base.join(format!("{:016x}", hash.finish())),
            files,
        })
    }

    fn facts_path(&self) -> PathBuf {
        self.dir.with_extension("facts")
    }

    /// The facts of a directory made before (the facts file is written before the directory
    /// is renamed into place).
    fn facts(&self) -> Option<HostFacts> {
        if !self.dir.is_dir() {
            return None;
        }
        HostFacts::parse(&std::fs::read_to_string(self.facts_path()).ok()?)
    }

    /// The directory, made now unless it was.
    fn make(self, facts: &HostFacts) -> std::io::Result<PathBuf> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        if self.dir.is_dir() && self.facts_path().is_file() {
            return Ok(self.dir);
        }
        let tmp = self
            .dir
            .with_extension(format!("tmp{}", std::process::id()));
        let facts_tmp = self
            .dir
            .with_extension(format!("facts.tmp{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::DirBuilder::new().mode(0o755).create(&tmp)?;
        let filled = (|| {
            for (name, source) in &self.files {
                let real = std::fs::canonicalize(source)?;
                let Some(real_name) = real.file_name() else {
                    continue;
                };
                let copy = tmp.join(real_name);
                if copy.symlink_metadata().is_err() {
                    std::fs::copy(&real, &copy)?;
                    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o644))?;
                }
                let alias = tmp.join(name);
                if name != real_name && alias.symlink_metadata().is_err() {
                    std::os::unix::fs::symlink(real_name, &alias)?;
                }
            }
            std::fs::write(&facts_tmp, facts.to_text())?;
            std::fs::rename(&facts_tmp, self.facts_path())?;
            std::fs::rename(&tmp, &self.dir)
        })();
        match filled {
            Ok(()) => Ok(self.dir),
            // Another step made it meanwhile.
            Err(_) if self.dir.is_dir() => {
                let _ = std::fs::remove_dir_all(&tmp);
                let _ = std::fs::remove_file(&facts_tmp);
                Ok(self.dir)
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                let _ = std::fs::remove_file(&facts_tmp);
                Err(e)
            }
        }
    }
}

/// The ABI of an MPI library whose SONAME is `soname` and whose file is `file`.
fn abi(soname: &str, file: &str) -> Option<Abi> {
    let rest = soname
        .strip_prefix("libmpi.so.")
        .or_else(|| soname.strip_prefix("libmpich.so."))?;
    let major = rest.split('.').next()?.parse().ok()?;
    let minor = file
        .strip_prefix(soname)
        .and_then(|r| r.strip_prefix('.'))
        .and_then(|r| r.split('.').next())
        .and_then(|m| m.parse().ok());
    Some(Abi {
        file: file.to_string(),
        major,
        minor,
    })
}

/// The library directories of the usual layouts, relative to an image's root.
const LIB_DIRS: [&str; 8] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
    "usr/local/lib",
];

/// What the check needs of an image: the names in its library directories, its MPI, its glibc.
struct Image {
    names: BTreeSet<String>,
    mpi: Option<Abi>,
    glibc: Option<(u32, u32)>,
}

impl Image {
    /// Reads the image's layers (`roots`, opened, topmost first), noting in `inputs` each
    /// directory and file it looked at.
    fn read(roots: &[Option<File>], inputs: &mut Inputs) -> Image {
        let mut names = BTreeSet::new();
        let mut mpi: Option<Abi> = None;
        for (i, root) in roots.iter().enumerate() {
            let Some(root) = root else {
                inputs.note(i, Path::new("."), None);
                continue;
            };
            for rel in LIB_DIRS {
                let rel = Path::new(rel);
                let flags = nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY;
                let Ok(fd) = berth_sys::privfs::open_beneath(root, rel, flags, 0, false) else {
                    inputs.note(i, rel, memo::sig_beneath(Some(root), rel));
                    continue;
                };
                // A directory's mtime and ctime change with each name made, removed or renamed.
                inputs.note(i, rel, memo::sig_of(&fd));
                let Ok(mut dir) = nix::dir::Dir::from_fd(fd) else {
                    continue;
                };
                let here: Vec<String> = dir
                    .iter()
                    .flatten()
                    .filter_map(|e| e.file_name().to_str().ok().map(String::from))
                    .collect();
                if mpi.is_none() {
                    mpi = here
                        .iter()
                        .filter(|n| n.starts_with("libmpi.so.") || n.starts_with("libmpich.so."))
                        .filter_map(|n| image_mpi(root, &rel.join(n), n, i, inputs))
                        .max_by_key(|a| (a.major == 40 || a.major == 12, a.minor));
                }
                names.extend(here);
            }
        }
        Image {
            names,
            mpi,
            glibc: crate::hostsw::glibc_version(roots, inputs),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.names.contains(name)
    }
}

/// The ABI of the image's MPI library at `rel` beneath `root` (layer `layer`, noted in
/// `inputs`): a regular file only (a symlink is not followed; the file it names is listed too),
/// non-blocking, its SONAME read bounded.
fn image_mpi(
    root: &File,
    rel: &Path,
    name: &str,
    layer: usize,
    inputs: &mut Inputs,
) -> Option<Abi> {
    let flags = nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_NONBLOCK;
    let Ok(fd) = berth_sys::privfs::open_beneath(root, rel, flags, 0, false) else {
        inputs.note(layer, rel, memo::sig_beneath(Some(root), rel));
        return None;
    };
    inputs.note(layer, rel, memo::sig_of(&fd));
    let file = File::from(fd);
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let info = elf::read(&file).ok()?;
    abi(info.soname.as_deref()?, name)
}

fn elf_info_host(path: &Path) -> Result<elf::Dynamic, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    elf::read(&file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A shared library compiled here with `soname`, which calls `call` from libc.
    fn library(dir: &Path, file: &str, soname: &str, call: &str) -> PathBuf {
        let src = dir.join(format!("{file}.c"));
        std::fs::write(&src, format!("#include <string.h>\n#include <stdio.h>\nint f(const char *s) {{ return (int){call}; }}\n")).unwrap();
        let out = dir.join(file);
        let st = Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&out)
            .arg(format!("-Wl,-soname,{soname}"))
            .arg(&src)
            .status()
            .expect("cc runs");
        assert!(st.success());
        out
    }

    #[test]
    fn sonames_needs_and_glibc_versions_are_read_from_the_library() {
        let dir = tempfile::tempdir().unwrap();
        let lib = library(dir.path(), "libmpi.so.12.1.8", "libmpi.so.12", "strlen(s)");
        let info = elf::read(&File::open(&lib).unwrap()).unwrap();
        assert_eq!(info.soname.as_deref(), Some("libmpi.so.12"));
        assert!(info.needed.iter().any(|n| n == "libc.so.6"), "{info:?}");
        assert!(info.glibc.is_some_and(|v| v >= (2, 2)), "{info:?}");
        assert_eq!(
            abi("libmpi.so.12", "libmpi.so.12.1.8"),
            Some(Abi {
                file: "libmpi.so.12.1.8".into(),
                major: 12,
                minor: Some(1)
            })
        );
        assert_eq!(abi("libmpi.so.40", "libmpi.so.40").unwrap().minor, None);
        assert_eq!(abi("libfoo.so.1", "libfoo.so.1"), None);
    }

    #[test]
    fn the_images_mpi_is_found_without_following_its_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let libdir = dir.path().join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&libdir).unwrap();
        library(&libdir, "libmpich.so.12.3.0", "libmpich.so.12", "strlen(s)");
        std::os::unix::fs::symlink("libmpich.so.12.3.0", libdir.join("libmpi.so.12")).unwrap();
        let image = Image::read(&[File::open(dir.path()).ok()], &mut Inputs::default());
        let mpi = image.mpi.clone().unwrap();
        assert_eq!((mpi.major, mpi.minor), (12, Some(3)));
        assert!(image.has("libmpi.so.12"));
        // A symlink out of the image is listed, never opened.
        let other = tempfile::tempdir().unwrap();
        let outside = library(
            other.path(),
            "libmpi.so.40.30.4",
            "libmpi.so.40",
            "strlen(s)",
        );
        std::fs::remove_file(libdir.join("libmpich.so.12.3.0")).unwrap();
        std::os::unix::fs::symlink(&outside, libdir.join("libmpi.so.40.30.4")).unwrap();
        assert_eq!(
            Image::read(&[File::open(dir.path()).ok()], &mut Inputs::default()).mpi,
            None
        );
    }

    /// A host MPI of `libmpi.so.40.30.4` (and `libdep.so.1`, which it needs) under `host`, and
    /// the configuration naming them.
    fn host_mpi(host: &Path) -> Config {
        let dep = library(host, "libdep.so.1", "libdep.so.1", "strlen(s)");
        let src = host.join("mpi.c");
        std::fs::write(
            &src,
            "int f(const char *s); int MPI_Init(void) { return f(\"x\"); }\n",
        )
        .unwrap();
        let st = Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(host.join("libmpi.so.40.30.4"))
            .arg("-Wl,-soname,libmpi.so.40")
            .arg(&src)
            .arg(&dep)
            .status()
            .expect("cc runs");
        assert!(st.success());
        std::os::unix::fs::symlink("libmpi.so.40.30.4", host.join("libmpi.so.40")).unwrap();
        let mut config = Config::default();
        config.host_software.mpi_libraries = vec![
            format!("{}/libmpi.so.40*", host.display()),
            format!("{}/nothing.so", host.display()),
        ];
        config.host_software.mpi_paths = vec![format!("{}/mpi.c", host.display())];
        config
    }

    /// An image whose library directory holds an Open MPI `libmpi.so.40.{minor}.0`, and a
    /// libc.so.6 of `glibc`.
    fn image_with(minor: u32, glibc: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib64");
        std::fs::create_dir_all(&lib).unwrap();
        library(
            &lib,
            &format!("libmpi.so.40.{minor}.0"),
            "libmpi.so.40",
            "strlen(s)",
        );
        std::fs::write(lib.join("libc.so.6"), format!("release version {glibc}.")).unwrap();
        dir
    }

    #[test]
    fn the_hosts_mpi_is_bound_only_when_abi_minor_glibc_and_dependencies_fit() {
        let host = tempfile::tempdir().unwrap();
        let mut config = host_mpi(host.path());
        let what = "--container-mpi=host";
        // libdep.so.1 is in neither the image nor the configuration.
        let image = image_with(30, "2.99");
        let lowers = [image.path().to_path_buf()];
        let e = mpi_binds(&config, &lowers, what).unwrap_err().to_string();
        assert!(
            e.contains("need libdep.so.1, which neither the image"),
            "{e}"
        );
        config
            .host_software
            .mpi_libraries
            .push(format!("{}/libdep.so.1", host.path().display()));
        let state = tempfile::tempdir().unwrap();
        config.runtime.state_dir = state.path().to_path_buf();
        let binds = mpi_binds(&config, &lowers, what).unwrap();
        let dests: Vec<_> = binds.iter().map(|b| b.destination.clone()).collect();
        assert_eq!(dests, [PathBuf::from(LIB_DIR), host.path().join("mpi.c")]);
        // One directory of copies, the SONAME's name a symlink inside it.
        let staged = &binds[0].source;
        assert!(staged.starts_with(state.path().join("host-mpi")));
        assert_eq!(
            std::fs::read_link(staged.join("libmpi.so.40")).unwrap(),
            Path::new("libmpi.so.40.30.4")
        );
        for file in ["libmpi.so.40.30.4", "libdep.so.1"] {
            assert_eq!(
                std::fs::read(staged.join(file)).unwrap(),
                std::fs::read(host.path().join(file)).unwrap()
            );
        }
        let again = mpi_binds(&config, &lowers, what).unwrap();
        assert_eq!(&again[0].source, staged, "made once");
        // What the host's libraries are is kept beside the copies, read back as it was.
        let facts = std::fs::read_to_string(staged.with_extension("facts")).unwrap();
        let parsed = HostFacts::parse(&facts).unwrap();
        assert_eq!(
            parsed.mpi.as_ref().map(|a| (a.major, a.minor)),
            Some((40, Some(30)))
        );
        assert!(parsed.needed.contains("libdep.so.1"), "{facts}");
        assert_eq!(parsed.to_text(), facts);
        assert!(binds.iter().all(|b| b.readonly));
        // An image built on a newer Open MPI than the host's.
        let newer = image_with(31, "2.99");
        let e = mpi_binds(&config, &[newer.path().to_path_buf()], what)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the image's MPI is Open MPI (libmpi.so.40.31.0), newer than this node's Open MPI (libmpi.so.40.30.4)"),
            "{e}"
        );
        // An image whose glibc is older than what the host's libraries need.
        let old = image_with(30, "2.1");
        let e = mpi_binds(&config, &[old.path().to_path_buf()], what)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the image's glibc 2.1 is older than the 2."),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1);
        // No MPI in the image at all.
        let none = tempfile::tempdir().unwrap();
        let e = mpi_binds(&config, &[none.path().to_path_buf()], what)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the image has no MPI library"), "{e}");
    }

    /// The answers kept under `state` (host-sw/mpi-*).
    fn kept(state: &Path) -> Vec<PathBuf> {
        let Ok(dir) = std::fs::read_dir(state.join(memo::DIR)) else {
            return Vec::new();
        };
        dir.flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("mpi-"))
            })
            .collect()
    }

    #[test]
    fn a_kept_answer_is_checked_again_when_the_image_or_the_hosts_mpi_changes() {
        let host = tempfile::tempdir().unwrap();
        let mut config = host_mpi(host.path());
        config
            .host_software
            .mpi_libraries
            .push(format!("{}/libdep.so.1", host.path().display()));
        let state = tempfile::tempdir().unwrap();
        config.runtime.state_dir = state.path().to_path_buf();
        let what = "--container-mpi=host";
        let image = image_with(30, "2.99");
        std::fs::write(image.path().join("usr/lib64/libdep.so.1"), "").unwrap();
        let lowers = [image.path().to_path_buf()];
        // Files changed within the last second are read again rather than trusted.
        mpi_binds(&config, &lowers, what).unwrap();
        assert!(
            kept(state.path()).is_empty(),
            "a just-made image is not kept"
        );
        std::thread::sleep(std::time::Duration::from_millis(1100));
        mpi_binds(&config, &lowers, what).unwrap();
        assert_eq!(
            kept(state.path()).len(),
            1,
            "the compatible pairing is kept"
        );
        let text = std::fs::read_to_string(&kept(state.path())[0]).unwrap();
        assert!(text.starts_with("answer compatible\n"), "{text}");
        assert!(text.contains(" usr/lib64/libmpi.so.40.30.0\n"), "{text}");
        assert!(text.contains(" usr/lib64/libc.so.6\n"), "{text}");
        mpi_binds(&config, &lowers, what).unwrap();
        // The image's libmpi replaced by a newer Open MPI's: refused, not recalled.
        let lib = image.path().join("usr/lib64");
        let newer = library(&lib, "newer.so", "libmpi.so.40", "strlen(s)");
        std::fs::rename(&newer, lib.join("libmpi.so.40.31.0")).unwrap();
        std::fs::remove_file(lib.join("libmpi.so.40.30.0")).unwrap();
        let e = mpi_binds(&config, &lowers, what).unwrap_err().to_string();
        assert!(
            e.contains("libmpi.so.40.31.0), newer than this node's"),
            "{e}"
        );
        // Back to a compatible one; then the image's libc.so.6 rewritten in place (same
        // inode, same directory) with an older glibc: refused, not recalled.
        std::fs::rename(lib.join("libmpi.so.40.31.0"), lib.join("libmpi.so.40.30.0")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        mpi_binds(&config, &lowers, what).unwrap();
        std::fs::write(lib.join("libc.so.6"), "release version 2.1.").unwrap();
        let e = mpi_binds(&config, &lowers, what).unwrap_err().to_string();
        assert!(e.contains("the image's glibc 2.1 is older"), "{e}");
        std::fs::write(lib.join("libc.so.6"), "release version 2.99.").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        mpi_binds(&config, &lowers, what).unwrap();
        let before = mpi_binds(&config, &lowers, what).unwrap()[0].source.clone();
        // The host's MPI downgraded below the image's: a new gathered directory, and the
        // pairing checked again (refused).
        std::fs::remove_file(host.path().join("libmpi.so.40.30.4")).unwrap();
        std::fs::remove_file(host.path().join("libmpi.so.40")).unwrap();
        // (Built aside: its C source would match the configured libmpi.so.40* too.)
        let build = tempfile::tempdir().unwrap();
        let older = host.path().join("libmpi.so.40.29.0");
        let built = library(
            build.path(),
            "libmpi.so.40.29.0",
            "libmpi.so.40",
            "strlen(s)",
        );
        std::fs::rename(built, &older).unwrap();
        std::os::unix::fs::symlink("libmpi.so.40.29.0", host.path().join("libmpi.so.40")).unwrap();
        let e = mpi_binds(&config, &lowers, what).unwrap_err().to_string();
        assert!(
            e.contains("newer than this node's Open MPI (libmpi.so.40.29.0)"),
            "{e}"
        );
        // Back to a compatible host MPI of new files: another directory than before.
        std::fs::remove_file(&older).unwrap();
        std::fs::remove_file(host.path().join("libmpi.so.40")).unwrap();
        let built = library(
            build.path(),
            "libmpi.so.40.30.4",
            "libmpi.so.40",
            "strlen(s)",
        );
        std::fs::rename(built, host.path().join("libmpi.so.40.30.4")).unwrap();
        std::os::unix::fs::symlink("libmpi.so.40.30.4", host.path().join("libmpi.so.40")).unwrap();
        let after = mpi_binds(&config, &lowers, what).unwrap()[0].source.clone();
        assert_ne!(before, after, "a changed host MPI is gathered again");
    }

    #[test]
    fn gc_removes_old_gathered_copies_but_not_the_current_one() {
        let host = tempfile::tempdir().unwrap();
        let mut config = host_mpi(host.path());
        config
            .host_software
            .mpi_libraries
            .push(format!("{}/libdep.so.1", host.path().display()));
        let state = tempfile::tempdir().unwrap();
        config.runtime.state_dir = state.path().to_path_buf();
        let image = image_with(30, "2.99");
        std::fs::write(image.path().join("usr/lib64/libdep.so.1"), "").unwrap();
        let lowers = [image.path().to_path_buf()];
        let current = mpi_binds(&config, &lowers, "--mpi=host").unwrap()[0]
            .source
            .clone();
        let base = state.path().join("host-mpi");
        let old = base.join("00000000000000aa");
        std::fs::create_dir(&old).unwrap();
        std::fs::write(old.join("libmpi.so.40.1.0"), "").unwrap();
        std::fs::write(old.with_extension("facts"), "").unwrap();
        // Young ones stay (a step may be about to bind it).
        assert!(
            reclaim(&config)
                .iter()
                .all(|l| !l.contains("host MPI copy"))
        );
        assert!(old.is_dir());
        let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for p in [&old, &old.with_extension("facts"), &current] {
            std::fs::File::open(p)
                .unwrap()
                .set_modified(long_ago)
                .unwrap();
        }
        let lines = reclaim(&config);
        assert_eq!(
            lines,
            [format!("removed the host MPI copy {}", old.display())]
        );
        assert!(!old.exists() && !old.with_extension("facts").exists());
        assert!(current.is_dir(), "the current copy stays");
        assert!(current.with_extension("facts").is_file());
    }

    #[test]
    fn ld_library_path_gets_the_host_mpi_first() {
        let mut env = vec![("LD_LIBRARY_PATH".to_string(), "/opt/x".to_string())];
        with_library_path(&mut env);
        assert_eq!(env[0].1, format!("{LIB_DIR}:/opt/x"));
        let mut env = Vec::new();
        with_library_path(&mut env);
        assert_eq!(env, [("LD_LIBRARY_PATH".to_string(), LIB_DIR.to_string())]);
        assert!(parse_choice("host", "--mpi").unwrap());
        assert!(!parse_choice("image", "--mpi").unwrap());
        let e = parse_choice("hots", "--mpi").unwrap_err().to_string();
        assert!(e.contains("use host") && e.lines().count() == 1, "{e}");
    }
}
