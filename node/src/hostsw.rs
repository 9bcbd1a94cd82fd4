//! The node's own software inside a container, as the site configures it (`[host_software]`):
//! the host's Slurm client (`--container-slurm`, `berth run --slurm`), so that `srun`, `sbatch`
//! and `squeue` work from inside a job's container as from the host; and Lmod with the site's
//! module trees and software (`--container-modules`, `berth run --modules`), so that `module
//! load` works in the container's `bash -l` and in batch scripts (BASH_ENV). The host's MPI
//! (`--container-mpi=host`) is crate::mpi's, on the helpers here.
//!
//! Only what the configuration names is bound, read-only, at the path the configuration gives:
//! a user chooses whether, never what. The host's binaries run on the image's C library (they
//! are bound at their own paths, with their own libraries beside the image's), so the image's
//! glibc must be at least the host's: checked before the container is made, refused in one line
//! otherwise. The alternative, a private loader path with wrappers, would put the host's glibc
//! under programs the image built against its own.

use std::fs::File;
use std::path::{Path, PathBuf};

use berth_spec::BindMount;

use crate::NodeError;
use berth_config::Config;

pub(crate) mod memo;

/// The variables of Lmod's state and setup that `berth run --modules` carries from the caller
/// (a Slurm step has the job's environment already): the module search path, what is loaded,
/// and BASH_ENV, which defines `module` in non-interactive bash.
pub fn module_env(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    const NAMES: [&str; 6] = [
        "MODULEPATH",
        "MODULEPATH_ROOT",
        "MODULESHOME",
        "LOADEDMODULES",
        "_LMFILES_",
        "BASH_ENV",
    ];
    const PREFIXES: [&str; 3] = ["LMOD_", "_ModuleTable", "__LMOD_REF_COUNT_"];
    vars.filter(|(k, _)| NAMES.contains(&k.as_str()) || PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect()
}

/// Names of files that must never reach a container: munge's key, slurmdbd's configuration
/// (its database password), and keys and certificates in general (JWT keys beside slurm.conf).
fn is_secret(name: &str) -> bool {
    name == "munge.key"
        || name == "slurmdbd.conf"
        || name.ends_with(".key")
        || name.ends_with(".pem")
}

/// The read-only binds that bring the host's Slurm client into a container whose image layers
/// are `lowers` (topmost first). `what` names the request in errors (`--container-slurm`).
pub fn slurm_binds(
    config: &Config,
    lowers: &[PathBuf],
    what: &str,
) -> Result<Vec<BindMount>, NodeError> {
    let binds = configured_kept(config, &config.host_software.slurm_paths, "slurm_paths")?;
    if binds.is_empty() {
        return Err(NodeError::input(format!(
            "{what}: none of host_software.slurm_paths exists on this node: ask the site to \
             name its Slurm client files in berth.toml, or drop {what}"
        )));
    }
    check_glibc(config, lowers, what, "the host's Slurm commands")?;
    Ok(binds)
}

/// The read-only binds of Lmod, the module trees and their software; refused for an image
/// without bash (Lmod's `module` is a bash function there: a `sh` would get a broken one) or
/// with an older glibc than the host's Lua.
pub fn module_binds(
    config: &Config,
    lowers: &[PathBuf],
    what: &str,
) -> Result<Vec<BindMount>, NodeError> {
    let binds = configured_kept(config, &config.host_software.module_paths, "module_paths")?;
    if binds.is_empty() {
        return Err(NodeError::input(format!(
            "{what}: none of host_software.module_paths exists on this node: ask the site to \
             name Lmod and its module trees in berth.toml, or drop {what}"
        )));
    }
    let has_bash = lowers.iter().any(|layer| {
        let Ok(dir) = std::fs::File::open(layer) else {
            return false;
        };
        ["usr/bin/bash", "bin/bash"].iter().any(|rel| {
            berth_runtime::mounts::path_beneath(&dir, Path::new(rel))
                .ok()
                .and_then(|fd| std::fs::File::from(fd).metadata().ok())
                .is_some_and(|m| m.is_file())
        })
    });
    if !has_bash {
        return Err(NodeError::input(format!(
            "{what}: the image has no bash (/usr/bin/bash), which Lmod's module command needs: \
             use an image with bash, or drop {what}"
        )));
    }
    check_glibc(config, lowers, what, "the host's Lmod and Lua")?;
    Ok(binds)
}

/// `pattern` with `*` and `?` matched against `text`.
fn wildcard(pattern: &[u8], text: &[u8]) -> bool {
    match (pattern.split_first(), text.split_first()) {
        (None, None) => true,
        (Some((b'*', rest)), _) => {
            wildcard(rest, text) || (!text.is_empty() && wildcard(pattern, &text[1..]))
        }
        (Some((b'?', rest)), Some((_, trest))) => wildcard(rest, trest),
        (Some((p, rest)), Some((t, trest))) if p == t => wildcard(rest, trest),
        _ => false,
    }
}

/// The names in each directory a pattern was matched in, read once for all the entries of a
/// list (the default MPI libraries are 22 patterns in one directory of ~1,400 names).
type Listings = std::collections::HashMap<PathBuf, Vec<std::ffi::OsString>>;

/// The existing paths an absolute `entry` names, `*` and `?` in any component expanded (in
/// name order); an entry without them as itself.
fn expand(entry: &Path, listings: &mut Listings, inputs: &mut memo::Inputs) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::from("/")];
    for comp in entry.components().skip(1) {
        let name = comp.as_os_str();
        let bytes = name.as_encoded_bytes();
        if !bytes.contains(&b'*') && !bytes.contains(&b'?') {
            found = found.into_iter().map(|p| p.join(name)).collect();
            continue;
        }
        // The literal start of the pattern settles most names without the matcher.
        let literal = &bytes[..bytes
            .iter()
            .position(|b| *b == b'*' || *b == b'?')
            .unwrap_or(bytes.len())];
        let mut next = Vec::new();
        for dir in found {
            let listing = listings.entry(dir.clone()).or_insert_with(|| {
                inputs.note_host(&dir, memo::sig_host(&dir));
                std::fs::read_dir(&dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.file_name())
                    .collect()
            });
            let mut names: Vec<_> = listing
                .iter()
                .filter(|n| {
                    let n = n.as_encoded_bytes();
                    n.starts_with(literal) && wildcard(bytes, n)
                })
                .cloned()
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| dir.join(n)));
        }
        found = next;
    }
    found
}

/// [`configured`], kept in the state directory with the directories it listed and the paths it
/// found or missed ([`memo`]): a start then stats them instead of listing and scanning
/// directories. A refusal is never kept.
pub(crate) fn configured_kept(
    config: &Config,
    entries: &[String],
    key: &str,
) -> Result<Vec<BindMount>, NodeError> {
    const PAIR: char = '\u{1f}';
    const NEXT: char = '\u{1e}';
    let memo = memo::Memo::new(&config.runtime.state_dir, "paths", (key, entries));
    if let Some(answer) = memo.recall(&[]) {
        return Ok(answer
            .split(NEXT)
            .filter(|b| !b.is_empty())
            .filter_map(|b| b.split_once(PAIR))
            .map(|(source, destination)| BindMount {
                source: PathBuf::from(source),
                destination: PathBuf::from(destination),
                readonly: true,
            })
            .collect());
    }
    let mut inputs = memo::Inputs::default();
    let binds = configured(entries, key, &mut inputs)?;
    let texts: Vec<(String, String)> = binds
        .iter()
        .map(|b| {
            let text = |p: &Path| p.to_str().unwrap_or("\n").to_string();
            (text(&b.source), text(&b.destination))
        })
        .collect();
    if texts
        .iter()
        .all(|(s, d)| !s.contains([PAIR, NEXT, '\n']) && !d.contains([PAIR, NEXT, '\n']))
    {
        let answer: Vec<String> = texts.iter().map(|(s, d)| format!("{s}{PAIR}{d}")).collect();
        memo.keep(&inputs, &answer.join(&NEXT.to_string()));
    }
    Ok(binds)
}

/// The entries of `[host_software].key` that exist here, as read-only binds; an entry that is not
/// absolute, or that is or holds a secret, is the configuration's error. What the answer was
/// read from is noted in `inputs`.
pub(crate) fn configured(
    entries: &[String],
    key: &str,
    inputs: &mut memo::Inputs,
) -> Result<Vec<BindMount>, NodeError> {
    let mut out = Vec::new();
    let mut listings = Listings::new();
    for entry in entries {
        let pairs = match entry.split_once(':') {
            Some((s, d)) => vec![(PathBuf::from(s), PathBuf::from(d))],
            None => expand(Path::new(entry), &mut listings, inputs)
                .into_iter()
                .map(|p| (p.clone(), p))
                .collect(),
        };
        let absolute = entry.starts_with('/')
            && entry
                .split_once(':')
                .is_none_or(|(_, d)| d.starts_with('/'));
        if !absolute {
            return Err(NodeError::host(format!(
                "host_software.{key}: '{entry}' is not an absolute PATH or SOURCE:DESTINATION: \
                 fix berth.toml"
            )));
        }
        for (source, destination) in pairs {
            let meta = std::fs::metadata(&source);
            inputs.note_host(&source, meta.as_ref().ok().map(memo::Sig::of_meta));
            let Ok(meta) = meta else {
                tracing::debug!(
                    "host_software.{key}: {} is missing: skipped",
                    source.display()
                );
                continue;
            };
            if let Some(secret) = secret_in(&source, meta.is_dir(), inputs) {
                return Err(NodeError::host(format!(
                    "host_software.{key}: {} holds {}, which no container may see: name the \
                 files themselves (or a directory without it) in berth.toml",
                    source.display(),
                    secret.display()
                )));
            }
            out.push(BindMount {
                source,
                destination,
                readonly: true,
            });
        }
    }
    Ok(out)
}

/// The secret `path` is (or, a directory, holds directly or one level down).
fn secret_in(path: &Path, is_dir: bool, inputs: &mut memo::Inputs) -> Option<PathBuf> {
    let named = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_secret)
    };
    if named(path) {
        return Some(path.to_path_buf());
    }
    if !is_dir {
        return None;
    }
    // The type readdir gives (no stat of each of a plugin directory's hundreds of files).
    let entries = |dir: &Path| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.path(), e.file_type().is_ok_and(|t| t.is_dir())))
            .collect::<Vec<_>>()
    };
    for (child, child_is_dir) in entries(path) {
        if named(&child) {
            return Some(child);
        }
        // Includes of slurm.conf often live one directory down (conf.d).
        if child_is_dir {
            inputs.note_host(&child, memo::sig_host(&child));
            if let Some((found, _)) = entries(&child).into_iter().find(|(p, _)| named(p)) {
                return Some(found);
            }
        }
    }
    None
}

/// Where glibc's libc.so.6 is in the usual layouts.
const LIBC_PATHS: [&str; 6] = [
    "usr/lib/x86_64-linux-gnu/libc.so.6",
    "usr/lib/aarch64-linux-gnu/libc.so.6",
    "usr/lib64/libc.so.6",
    "lib/x86_64-linux-gnu/libc.so.6",
    "lib/aarch64-linux-gnu/libc.so.6",
    "lib64/libc.so.6",
];

/// Refuses an image whose glibc is older than the host's (or that has none): the host's
/// binaries would fail inside with "GLIBC_2.x not found", long after the container started.
/// Both versions come from answers kept in the state directory ([`memo`]) while their files are
/// unchanged (an image's by its digest alone).
fn check_glibc(
    config: &Config,
    lowers: &[PathBuf],
    what: &str,
    needs: &str,
) -> Result<(), NodeError> {
    let host = glibc_of(config, &[PathBuf::from("/")]).ok_or_else(|| {
        NodeError::host(format!(
            "{what}: this node's glibc version is unknown (no libc.so.6 in {}): {needs} cannot \
             be brought into containers here",
            LIBC_PATHS[0]
        ))
    })?;
    match glibc_of(config, lowers) {
        Some(image) if image >= host => Ok(()),
        Some(image) => Err(NodeError::input(format!(
            "{what}: the image's glibc {}.{} is older than this node's {}.{}, which {needs} \
             need: use an image with glibc {}.{} or newer, or drop {what}",
            image.0, image.1, host.0, host.1, host.0, host.1
        ))),
        None => Err(NodeError::input(format!(
            "{what}: the image has no glibc (libc.so.6), which {needs} need \
             ({}.{} or newer): use a glibc image (Debian, Ubuntu, RHEL), or drop {what}",
            host.0, host.1
        ))),
    }
}

/// The most bytes of a libc.so.6 read for its version banner.
const LIBC_MAX: u64 = 16 << 20;

/// [`glibc_version`] of `roots`, kept in the state directory with the libc.so.6 files it looked
/// at.
pub(crate) fn glibc_of(config: &Config, roots: &[PathBuf]) -> Option<(u32, u32)> {
    let dirs: Vec<Option<File>> = roots.iter().map(|r| File::open(r).ok()).collect();
    let fixed = memo::fixed_roots(&config.squashfs.mount_dir, roots);
    let key = memo::root_ids(roots, &dirs, &fixed);
    let memo = memo::Memo::new(&config.runtime.state_dir, "glibc", key);
    if let Some(answer) = memo.recall(&dirs) {
        let mut words = answer.split(' ');
        return match (words.next(), words.next()) {
            (Some(major), Some(minor)) => Some((major.parse().ok()?, minor.parse().ok()?)),
            _ => None,
        };
    }
    let mut inputs = memo::Inputs::new(fixed);
    let version = glibc_version(&dirs, &mut inputs);
    let answer = version.map_or("none".to_string(), |(a, b)| format!("{a} {b}"));
    memo.keep(&inputs, &answer);
    version
}

/// The glibc version of the first of `roots` (image layers, topmost first, opened) that has one,
/// read from libc.so.6's "release version X.Y" banner; each file looked at is noted in `inputs`.
/// Each layer's file is opened beneath it, following none of the image's symlinks, so an image
/// cannot steer root to a host file.
pub(crate) fn glibc_version(
    roots: &[Option<File>],
    inputs: &mut memo::Inputs,
) -> Option<(u32, u32)> {
    roots.iter().enumerate().find_map(|(i, dir)| {
        let Some(dir) = dir.as_ref() else {
            inputs.note(i, Path::new("."), None);
            return None;
        };
        LIBC_PATHS.iter().find_map(|rel| {
            let rel = Path::new(rel);
            // Non-blocking and regular files only (a FIFO there must not hold a step's start),
            // and bounded (glibc's libc.so.6 is ~2 MiB; an image's may be anything).
            let flags = nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_NONBLOCK;
            let Ok(fd) = berth_sys::privfs::open_beneath(dir, rel, flags, 0, false) else {
                inputs.note(i, rel, memo::sig_beneath(Some(dir), rel));
                return None;
            };
            let mut file = File::from(fd);
            inputs.note(i, rel, memo::sig_of(&file));
            if !file.metadata().ok()?.is_file() {
                return None;
            }
            let bytes = berth_sys::privfs::read_bounded(&mut file, LIBC_MAX).ok()?;
            release_version(&bytes)
        })
    })
}

/// `X.Y` after glibc's "release version " banner in `bytes`.
fn release_version(bytes: &[u8]) -> Option<(u32, u32)> {
    const BANNER: &[u8] = b"release version ";
    let at = bytes.windows(BANNER.len()).position(|w| w == BANNER)? + BANNER.len();
    let rest = &bytes[at..bytes.len().min(at + 16)];
    let text: String = rest
        .iter()
        .take_while(|b| b.is_ascii_digit() || **b == b'.')
        .map(|b| char::from(*b))
        .collect();
    let mut parts = text.trim_end_matches('.').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_banner_is_read() {
        let banner =
            b"\0GNU C Library (Debian GLIBC 2.36-9+deb12u4) stable release version 2.36.\n";
        assert_eq!(release_version(banner), Some((2, 36)));
        assert_eq!(release_version(b"release version 2.9."), Some((2, 9)));
        assert_eq!(release_version(b"musl libc"), None);
    }

    #[test]
    fn image_glibc_is_compared_with_the_hosts() {
        let state = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.runtime.state_dir = state.path().to_path_buf();
        let state = &config;
        let host = glibc_of(state, &[PathBuf::from("/")]).expect("the test host has glibc");
        let image = tempfile::tempdir().unwrap();
        let lib = image.path().join("usr/lib64");
        std::fs::create_dir_all(&lib).unwrap();
        let what = "--container-slurm";
        let e = check_glibc(state, &[image.path().to_path_buf()], what, "x").unwrap_err();
        assert!(e.to_string().contains("the image has no glibc"), "{e}");
        let old = format!("release version {}.{}.", host.0, host.1 - 1);
        std::fs::write(lib.join("libc.so.6"), old).unwrap();
        let e = check_glibc(state, &[image.path().to_path_buf()], what, "x").unwrap_err();
        assert!(e.to_string().contains("is older than this node's"), "{e}");
        assert_eq!(e.to_string().lines().count(), 1);
        std::fs::write(
            lib.join("libc.so.6"),
            format!("release version {}.{}.", host.0, host.1),
        )
        .unwrap();
        check_glibc(state, &[image.path().to_path_buf()], what, "x").unwrap();
        // A symlink in the image is not followed to the host's file.
        std::fs::remove_file(lib.join("libc.so.6")).unwrap();
        std::os::unix::fs::symlink("/usr/lib/x86_64-linux-gnu/libc.so.6", lib.join("libc.so.6"))
            .unwrap();
        assert!(check_glibc(state, &[image.path().to_path_buf()], what, "x").is_err());
        // A FIFO in its place is not read (the check would otherwise block the step's start).
        std::fs::remove_file(lib.join("libc.so.6")).unwrap();
        nix::unistd::mkfifo(&lib.join("libc.so.6"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = check_glibc(state, &[image.path().to_path_buf()], what, "x").unwrap_err();
        assert!(e.to_string().contains("the image has no glibc"), "{e}");
    }

    #[test]
    fn wildcards_expand_to_existing_paths_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for d in ["x86_64-linux-gnu", "aarch64-linux-gnu", "other"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
            std::fs::write(dir.path().join(d).join("liblua5.3.so.0"), "").unwrap();
        }
        let pattern = dir.path().join("*-linux-gnu/liblua5.3*.so*");
        let found = expand(&pattern, &mut Listings::new(), &mut memo::Inputs::default());
        assert_eq!(
            found,
            [
                dir.path().join("aarch64-linux-gnu/liblua5.3.so.0"),
                dir.path().join("x86_64-linux-gnu/liblua5.3.so.0"),
            ]
        );
        assert!(wildcard(b"a?c*", b"abcdef"));
        assert!(!wildcard(b"a?c", b"ac"));
    }

    #[test]
    fn lmods_state_is_carried_and_nothing_else() {
        let vars = [
            ("MODULEPATH", "/m"),
            ("LMOD_CMD", "/l"),
            ("_ModuleTable001_", "x"),
            ("BASH_ENV", "/usr/share/lmod/lmod/init/bash"),
            ("HOME", "/h"),
            ("PATH", "/bin"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let names: Vec<String> = module_env(vars.into_iter())
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            names,
            ["MODULEPATH", "LMOD_CMD", "_ModuleTable001_", "BASH_ENV"]
        );
    }

    #[test]
    fn only_existing_configured_paths_are_bound_read_only_and_secrets_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("etc-slurm");
        std::fs::create_dir_all(conf.join("conf.d")).unwrap();
        std::fs::write(conf.join("slurm.conf"), "").unwrap();
        let entries = vec![
            conf.display().to_string(),
            format!("{}:/etc/slurm", conf.display()),
            "/nonexistent/srun".to_string(),
        ];
        let binds = configured(&entries, "slurm_paths", &mut memo::Inputs::default()).unwrap();
        assert_eq!(binds.len(), 2);
        assert!(binds.iter().all(|b| b.readonly));
        assert_eq!(binds[1].destination, Path::new("/etc/slurm"));
        std::fs::write(conf.join("conf.d/jwt_hs256.key"), "k").unwrap();
        let e = configured(&entries, "slurm_paths", &mut memo::Inputs::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("jwt_hs256.key, which no container may see"),
            "{e}"
        );
        let e = configured(
            &["relative".to_string()],
            "slurm_paths",
            &mut memo::Inputs::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not an absolute"), "{e}");
    }

    #[test]
    fn kept_configured_paths_follow_the_hosts_directories() {
        let host = tempfile::tempdir().unwrap();
        let conf = host.path().join("etc-slurm");
        std::fs::create_dir_all(conf.join("conf.d")).unwrap();
        std::fs::write(conf.join("slurm.conf"), "").unwrap();
        std::fs::write(host.path().join("libx.so.1"), "").unwrap();
        let state = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.runtime.state_dir = state.path().to_path_buf();
        let entries = vec![
            conf.display().to_string(),
            format!("{}/libx.so*", host.path().display()),
            format!("{}/missing:/m", host.path().display()),
        ];
        let kept = || -> Vec<PathBuf> {
            std::fs::read_dir(state.path().join(memo::DIR))
                .map(|d| d.flatten().map(|e| e.path()).collect())
                .unwrap_or_default()
        };
        let sources = |binds: Vec<BindMount>| -> Vec<PathBuf> {
            binds.into_iter().map(|b| b.source).collect()
        };
        let first = configured_kept(&config, &entries, "slurm_paths").unwrap();
        assert!(kept().is_empty(), "just made: not kept");
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(
            configured_kept(&config, &entries, "slurm_paths").unwrap(),
            first
        );
        assert_eq!(kept().len(), 1);
        let recalled = configured_kept(&config, &entries, "slurm_paths").unwrap();
        assert_eq!(recalled, first);
        assert!(recalled.iter().all(|b| b.readonly));
        // A key one directory down: refused, not recalled.
        std::fs::write(conf.join("conf.d/jwt.key"), "k").unwrap();
        let e = configured_kept(&config, &entries, "slurm_paths").unwrap_err();
        assert!(
            e.to_string()
                .contains("jwt.key, which no container may see"),
            "{e}"
        );
        std::fs::remove_file(conf.join("conf.d/jwt.key")).unwrap();
        // A new match of a pattern, a missing source that appears.
        std::fs::write(host.path().join("libx.so.1.2"), "").unwrap();
        std::fs::write(host.path().join("missing"), "").unwrap();
        assert_eq!(
            sources(configured_kept(&config, &entries, "slurm_paths").unwrap()),
            [
                conf.clone(),
                host.path().join("libx.so.1"),
                host.path().join("libx.so.1.2"),
                host.path().join("missing"),
            ]
        );
    }
}
