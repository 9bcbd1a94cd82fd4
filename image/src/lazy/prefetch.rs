//! The Prolog's prefetch of a lazy image: the chunks its first command reads, not the whole
//! image. Once the node's server has the image mounted (super::server), the Prolog reads,
//! through that mount, the program the job's step will start (the image's Entrypoint and Cmd,
//! else `/bin/sh`), the script arguments among them that are files of the image, each script's
//! interpreter (`#!`, through `env`), and each ELF file's loader (PT_INTERP) and libraries
//! (DT_NEEDED, found by its RUNPATH/RPATH and the usual library directories), breadth first.
//! Each read misses into the server, which fetches, verifies and caches the chunks, so the
//! step's exec finds them on the node. It is bounded ([`BYTES_LIMIT`], [`FILES_LIMIT`]): what
//! a program reads later (its data, modules it opens at run time) still comes as it is read.
//!
//! The files are opened as root in the image's squashfs (read-only, nosuid, nodev), resolved
//! within its root (`openat2` RESOLVE_IN_ROOT: an absolute symlink of the image stays in the
//! image), non-blocking and read only when they are regular files.

use std::collections::{BTreeSet, VecDeque};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};

use crate::ImageError;

/// Bytes read at most: a program and its libraries, not a framework's data.
pub const BYTES_LIMIT: u64 = 256 << 20;
/// Files read at most.
pub const FILES_LIMIT: usize = 64;
/// The PATH searched when the image's config gives none (Docker's default).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What [`prefetch`] read.
#[derive(Debug, Default)]
pub struct Prefetched {
    /// The image's paths read, in order.
    pub files: Vec<String>,
    pub bytes: u64,
    /// Whether a bound stopped it.
    pub bounded: bool,
}

/// The command the job's first step starts by default: the image config's Entrypoint and Cmd,
/// else the shell.
pub fn program(config: &oci_spec::image::ImageConfiguration) -> Vec<String> {
    let c = config.config().as_ref();
    let mut words: Vec<String> = c.and_then(|c| c.entrypoint().clone()).unwrap_or_default();
    words.extend(c.and_then(|c| c.cmd().clone()).unwrap_or_default());
    if words.is_empty() {
        words.push("/bin/sh".into());
    }
    words
}

/// The image config's PATH, if it sets one.
pub fn path_of(config: &oci_spec::image::ImageConfiguration) -> Option<String> {
    config
        .config()
        .as_ref()
        .and_then(|c| c.env().as_ref())
        .and_then(|env| {
            env.iter()
                .find_map(|e| e.strip_prefix("PATH=").map(str::to_string))
        })
}

/// Reads, within the image mounted at `root`, the files `command` starts with (see the module
/// header), at most `limit` bytes; `path` is the image's PATH for a command without a `/`.
pub fn prefetch(
    root: &Path,
    command: &[String],
    path: Option<&str>,
    limit: u64,
) -> Result<Prefetched, ImageError> {
    let root_fd: OwnedFd = File::open(root)
        .map_err(|source| ImageError::Io {
            path: root.to_path_buf(),
            source,
        })?
        .into();
    let search = path.unwrap_or(DEFAULT_PATH);
    let mut queue: VecDeque<String> = VecDeque::new();
    if let Some(first) = command.first() {
        queue.extend(find_program(&root_fd, first, search));
    }
    // Script arguments (`/bin/sh /etc/rc`): the words that are absolute paths of the image.
    queue.extend(
        command
            .iter()
            .skip(1)
            .filter(|w| w.starts_with('/'))
            .cloned(),
    );
    let mut seen = BTreeSet::new();
    let mut done = Prefetched::default();
    while let Some(name) = queue.pop_front() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if done.files.len() >= FILES_LIMIT || done.bytes >= limit {
            done.bounded = true;
            break;
        }
        let Some(file) = open_regular(&root_fd, &name) else {
            continue;
        };
        let read = read_some(&file, limit - done.bytes);
        done.bytes += read;
        done.files.push(name.clone());
        for next in wants(&root_fd, &file, &name, search) {
            if !seen.contains(&next) {
                queue.push_back(next);
            }
        }
    }
    Ok(done)
}

/// `name` relative to the image's root, for openat2 (`..` is resolved by the kernel, in root).
fn relative(name: &str) -> PathBuf {
    Path::new(name)
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::Prefix(_)))
        .collect()
}

/// The image's regular file `name`, opened read-only within its root; `None` for anything else.
fn open_regular(root: &OwnedFd, name: &str) -> Option<File> {
    let rel = relative(name);
    if rel.as_os_str().is_empty() {
        return None;
    }
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let file = File::from(openat2(root.as_fd(), &rel, how).ok()?);
    file.metadata().ok()?.is_file().then_some(file)
}

/// Reads `file` from its start, at most `limit` bytes; the bytes read (a failing read ends it:
/// the step will see the same failure and say it).
fn read_some(mut file: &File, limit: u64) -> u64 {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    while total < limit {
        let want = usize::try_from((limit - total).min(buf.len() as u64)).unwrap_or(buf.len());
        match file.read(&mut buf[..want]) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n as u64,
        }
    }
    total
}

/// `program` as the step's exec finds it: itself when it has a `/`, else the first regular file
/// of that name in `search`'s directories.
fn find_program(root: &OwnedFd, program: &str, search: &str) -> Option<String> {
    if program.contains('/') {
        return Some(program.to_string());
    }
    search
        .split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| format!("{}/{program}", d.trim_end_matches('/')))
        .find(|p| open_regular(root, p).is_some())
}

/// What running the file `name` reads next: a script's interpreter, an ELF file's loader and
/// libraries.
fn wants(root: &OwnedFd, file: &File, name: &str, search: &str) -> Vec<String> {
    let mut head = [0u8; 256];
    let n = file.read_at(&mut head, 0).unwrap_or(0);
    let head = &head[..n];
    if let Some(line) = head.strip_prefix(b"#!") {
        return interpreter(root, line, search);
    }
    match crate::elf::read(file) {
        Ok(crate::elf::Dynamic {
            interp,
            needed,
            search: dirs,
            ..
        }) => {
            let origin = Path::new(name)
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "/".into());
            let mut out: Vec<String> = interp.into_iter().collect();
            let dirs: Vec<String> = dirs
                .iter()
                .map(|d| d.replace("$ORIGIN", &origin).replace("${ORIGIN}", &origin))
                .chain(library_dirs())
                .collect();
            for lib in needed {
                if lib.contains('/') {
                    out.push(lib);
                    continue;
                }
                if let Some(found) = dirs
                    .iter()
                    .map(|d| format!("{}/{lib}", d.trim_end_matches('/')))
                    .find(|p| open_regular(root, p).is_some())
                {
                    out.push(found);
                }
            }
            out
        }
        Err(_) => Vec::new(),
    }
}

/// The program of a `#!` line (its first line after `#!`): the interpreter, and for `env` the
/// program it runs, found in `search`.
fn interpreter(root: &OwnedFd, line: &[u8], search: &str) -> Vec<String> {
    let line = line.split(|b| *b == b'\n').next().unwrap_or_default();
    let text = String::from_utf8_lossy(line);
    let mut words = text.split_whitespace();
    let Some(interp) = words.next() else {
        return Vec::new();
    };
    let mut out = vec![interp.to_string()];
    if interp.ends_with("/env")
        && let Some(prog) = words.find(|w| !w.starts_with('-'))
        && let Some(found) = find_program(root, prog, search)
    {
        out.push(found);
    }
    out
}

/// The directories the dynamic loader searches by default, for this machine's architecture.
fn library_dirs() -> Vec<String> {
    let triplet = format!("{}-linux-gnu", std::env::consts::ARCH);
    vec![
        format!("/lib/{triplet}"),
        format!("/usr/lib/{triplet}"),
        "/lib64".into(),
        "/usr/lib64".into(),
        "/lib".into(),
        "/usr/lib".into(),
        "/usr/local/lib".into(),
    ]
}

/// The chunks of the index `index_hex` the node's cache under `store_root` holds, and all its
/// chunks (its map: a byte per chunk, 1 once cached and verified); `None` when it has none.
pub fn cached_chunks(store_root: &Path, index_hex: &str) -> Option<(u64, u64)> {
    let (_, map) = super::cache_names(index_hex);
    let marks = std::fs::read(store_root.join("lazy").join(map)).ok()?;
    let cached = marks.iter().filter(|m| **m == 1).count();
    Some((cached as u64, marks.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree standing in for a mounted image: a dynamic ELF found through PATH, its loader and
    /// library behind absolute symlinks, a script through `env`, and a big file no one runs.
    #[test]
    fn the_program_its_loader_libraries_and_interpreters_are_read_and_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let host_sh = std::fs::canonicalize("/bin/sh").unwrap();
        let elf = std::fs::read(&host_sh).unwrap();
        let Ok(crate::elf::Dynamic {
            interp: Some(interp),
            needed,
            ..
        }) = crate::elf::read(&File::open(&host_sh).unwrap())
        else {
            panic!("{} is not a dynamic ELF64", host_sh.display());
        };
        let put = |p: &str, bytes: &[u8]| {
            let path = root.join(p.trim_start_matches('/'));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        };
        put("/usr/bin/tool", &elf);
        // The loader's path is a symlink to an absolute path: resolved in the image.
        put("/real/loader", b"loader");
        let interp_path = root.join(interp.trim_start_matches('/'));
        std::fs::create_dir_all(interp_path.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink("/real/loader", &interp_path).unwrap();
        let triplet = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
        for lib in &needed {
            put(&format!("{triplet}/{lib}"), b"lib");
        }
        put("/opt/run.py", b"#!/usr/bin/env -S python3\nprint()\n");
        put("/usr/bin/env", b"env");
        put("/usr/local/bin/python3", b"python");
        put("/data/big.bin", &vec![7u8; 4 << 20]);
        // A symlink out of the image resolves inside it: no host file is read.
        std::os::unix::fs::symlink("/etc/passwd", root.join("opt/escape")).unwrap();

        let got = prefetch(
            root,
            &["tool".into(), "/opt/run.py".into(), "/opt/escape".into()],
            Some("/usr/local/bin:/usr/bin"),
            BYTES_LIMIT,
        )
        .unwrap();
        let mut want = vec!["/usr/bin/tool".to_string(), "/opt/run.py".into()];
        want.push(interp.clone());
        want.extend(needed.iter().map(|l| format!("{triplet}/{l}")));
        want.push("/usr/bin/env".into());
        want.push("/usr/local/bin/python3".into());
        let mut files = got.files.clone();
        files.sort();
        want.sort();
        assert_eq!(files, want);
        assert!(!got.bounded);
        assert!(got.bytes < 1 << 20, "{got:?}");

        // The bound holds: a tight one stops after the first file.
        let tight = prefetch(
            root,
            &["/data/big.bin".into(), "/opt/run.py".into()],
            None,
            1 << 20,
        )
        .unwrap();
        assert_eq!(tight.files, ["/data/big.bin"]);
        assert_eq!(tight.bytes, 1 << 20);
        assert!(tight.bounded);
    }

    #[test]
    fn the_default_program_is_the_entrypoint_and_cmd_else_the_shell() {
        let mut config = oci_spec::image::ImageConfiguration::default();
        assert_eq!(program(&config), ["/bin/sh"]);
        let mut c = oci_spec::image::Config::default();
        c.set_entrypoint(Some(vec!["/bin/sh".into(), "/etc/rc".into()]));
        c.set_cmd(Some(vec!["python3".into()]));
        c.set_env(Some(vec!["A=1".into(), "PATH=/opt/bin:/bin".into()]));
        config.set_config(Some(c));
        assert_eq!(program(&config), ["/bin/sh", "/etc/rc", "python3"]);
        assert_eq!(path_of(&config).as_deref(), Some("/opt/bin:/bin"));
    }
}
