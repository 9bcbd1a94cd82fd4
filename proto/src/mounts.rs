//! Pyxis's `--container-mounts=SRC[:DST[:FLAGS]][,…]` syntax: flags `+`-separated, `tmpfs` as a
//! source for an empty tmpfs.
//!
//! FLAGS are those of Enroot's mount syntax (fstab options, which Pyxis hands to Enroot): every
//! one Enroot accepts is accepted here. Those that change what the container sees are applied
//! (`ro`, `noexec`, a tmpfs's atime flags, `size=`, `mode=`, `huge=`, …); the others are
//! accepted and change nothing because berth's mounts already behave so or, for `suid` and
//! `dev`, must never behave otherwise: every bind mount is recursive, private, nosuid and nodev,
//! and keeps the atime behaviour of the mount it shows.
//!
//! A relative SRC (`./data`) is relative to the step's working directory, as in Pyxis; the path
//! is kept as written under that directory (the kernel resolves it when the runtime opens it with
//! the user's credentials, never root's).
//!
//! `umount:DST` (Pyxis's and Enroot's syntax) unmounts DST inside the container: berth leaves out
//! every mount it would make at DST or beneath it, except those of later entries.

use std::path::{Path, PathBuf};

use crate::ProtoError;

/// One entry of `--container-mounts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mount {
    Bind {
        source: PathBuf,
        destination: PathBuf,
        readonly: bool,
        /// Mount flags to apply on top of berth's (`noexec`), kernel names.
        flags: Vec<String>,
    },
    Tmpfs {
        destination: PathBuf,
        /// `ro`, `noexec`, atime flags and tmpfs options (`size=…`, `mode=…`, …), kernel names.
        flags: Vec<String>,
    },
    /// `umount:DST`: nothing stays mounted at DST or beneath it (but what later entries mount).
    Umount { destination: PathBuf },
}

/// Where berth's own /proc, /dev and /sys are mounted: `umount:` may not take them away (the
/// container's processes, device nodes and masked kernel files rely on them), nor anything
/// above them.
const KEPT: [&str; 3] = ["/proc", "/dev", "/sys"];

/// Flags accepted for compatibility that change nothing here: berth's bind mounts are always
/// recursive, private, nosuid and nodev, and it creates every destination itself. `suid`, `dev`
/// and `exec` are Enroot's defaults spelled out; `suid` and `dev` are never granted.
const NEUTRAL_FLAGS: [&str; 25] = [
    "rbind",
    "bind",
    "rprivate",
    "private",
    "rslave",
    "slave",
    "rshared",
    "shared",
    "runbindable",
    "unbindable",
    "nosuid",
    "nodev",
    "suid",
    "dev",
    "exec",
    "defaults",
    "auto",
    "noauto",
    "nofail",
    "async",
    "norelatime",
    "nostrictatime",
    "diratime",
    "lazytime",
    "nolazytime",
];

/// Atime flags: applied to a tmpfs; a bind mount keeps those of the mount it shows.
const ATIME_FLAGS: [&str; 4] = ["noatime", "relatime", "strictatime", "nodiratime"];

/// Enroot's own `x-` options: berth creates destinations (files or directories, as the source
/// is) and never moves or detaches a mount.
const X_OPTIONS: [&str; 6] = [
    "x-create=dir",
    "x-create=file",
    "x-create=auto",
    "x-move",
    "x-detach",
    "x-create",
];

/// Parses `--container-mounts` for a step whose working directory is `cwd` (relative sources
/// are joined to it; without one they are refused). An error names the entry and what is wrong.
pub fn parse_in(text: &str, cwd: Option<&Path>) -> Result<Vec<Mount>, ProtoError> {
    text.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            parse_entry_in(entry, cwd).map_err(|why| {
                ProtoError::Mount(format!("invalid --container-mounts entry '{entry}': {why}"))
            })
        })
        .collect()
}

/// [`parse_in`] without a working directory: relative sources are refused.
pub fn parse(text: &str) -> Result<Vec<Mount>, ProtoError> {
    parse_in(text, None)
}

/// One `SRC[:DST[:FLAGS]]` entry, as written (a relative source stays relative): what the SPANK
/// plugin checks before the job is queued. The error says what is wrong with it.
pub fn parse_entry(entry: &str) -> Result<Mount, ProtoError> {
    parse_entry_in(entry, Some(Path::new("")))
}

/// `SRC[:DST[:FLAGS]]` with a relative SRC joined to `cwd`.
fn parse_entry_in(entry: &str, cwd: Option<&Path>) -> Result<Mount, ProtoError> {
    let parts: Vec<&str> = entry.split(':').collect();
    if parts.len() > 3 {
        return Err(ProtoError::Mount("expected SRC[:DST[:FLAGS]]".into()));
    }
    let source_text = parts[0];
    if source_text == "umount" && parts.len() > 1 {
        return umount_entry(&parts);
    }
    let tmpfs = source_text == "tmpfs";
    let source: PathBuf = if tmpfs || source_text.starts_with('/') {
        PathBuf::from(source_text)
    } else if source_text.is_empty() {
        return Err(ProtoError::Mount(
            "the source must be a path or 'tmpfs'".into(),
        ));
    } else {
        let Some(cwd) = cwd else {
            return Err(ProtoError::Mount(
                "a relative source needs the step's working directory, which is unknown: \
                 give an absolute path"
                    .into(),
            ));
        };
        relative_to(cwd, source_text)
    };
    let destination = match parts.get(1) {
        Some(d) => PathBuf::from(d),
        None => source.clone(),
    };
    let mut readonly = false;
    let mut flags = Vec::new();
    for flag in parts
        .get(2)
        .copied()
        .unwrap_or("")
        .split('+')
        .filter(|f| !f.is_empty())
    {
        match flag {
            "ro" => readonly = true,
            "rw" => readonly = false,
            f if NEUTRAL_FLAGS.contains(&f) || X_OPTIONS.contains(&f) => {}
            "noexec" => push_flag(&mut flags, flag),
            // A bind mount keeps the atime behaviour of the mount it shows.
            f if ATIME_FLAGS.contains(&f) => {
                if tmpfs {
                    push_flag(&mut flags, f);
                }
            }
            f if tmpfs_option(f).is_some() => {
                if !tmpfs {
                    return Err(ProtoError::Mount(format!(
                        "'{f}' is an option of tmpfs mounts only"
                    )));
                }
                tmpfs_option(f).unwrap_or(Ok(())).map_err(|why| {
                    ProtoError::Mount(format!("invalid tmpfs option '{f}': {why}"))
                })?;
                push_flag(&mut flags, f);
            }
            f => {
                return Err(ProtoError::Mount(format!(
                    "unknown flag '{f}' (use ro, rw, noexec, rprivate, unbindable, x-create=dir, \
                     or for tmpfs size=, mode=, huge=, …)"
                )));
            }
        }
    }
    // Relative destinations come only from a relative source checked without a directory.
    let relative_ok = cwd.is_some_and(|c| c.as_os_str().is_empty()) && parts.get(1).is_none();
    if !destination.is_absolute() && !relative_ok {
        return Err(ProtoError::Mount(
            "the destination must be an absolute path".into(),
        ));
    }
    if destination
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(ProtoError::Mount(
            "failed to resolve path: the destination must not contain '..' (it could leave the \
             container's root)"
                .into(),
        ));
    }
    if tmpfs {
        if readonly {
            flags.insert(0, "ro".into());
        }
        return Ok(Mount::Tmpfs { destination, flags });
    }
    Ok(Mount::Bind {
        source,
        destination,
        readonly,
        flags,
    })
}

/// `umount:DST`: DST absolute, without `..`, and none of berth's own [`KEPT`] mounts.
fn umount_entry(parts: &[&str]) -> Result<Mount, ProtoError> {
    if parts.len() > 2 {
        return Err(ProtoError::Mount("umount:DST takes no flags".into()));
    }
    let destination = PathBuf::from(parts[1]);
    if !destination.is_absolute() {
        return Err(ProtoError::Mount(
            "the destination must be an absolute path".into(),
        ));
    }
    if destination
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(ProtoError::Mount(
            "failed to resolve path: the destination must not contain '..' (it could leave the \
             container's root)"
                .into(),
        ));
    }
    if KEPT.iter().any(|k| Path::new(k).starts_with(&destination)) {
        return Err(ProtoError::Mount(format!(
            "berth keeps the container's {} mounted (its processes, device nodes and \
             masked kernel files rely on them): unmount a path beneath them or elsewhere",
            KEPT.join(", ")
        )));
    }
    Ok(Mount::Umount { destination })
}

/// `cwd` joined with `rel`, `.` components dropped (`..` is kept for the kernel to resolve as
/// the user: lexical removal could name another file than the one the user meant).
fn relative_to(cwd: &Path, rel: &str) -> PathBuf {
    let mut out = cwd.to_path_buf();
    for c in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
        out.push(c);
    }
    out
}

fn push_flag(flags: &mut Vec<String>, flag: &str) {
    // A later option of the same key replaces the earlier (size=1g+size=2g: 2g), as mount does.
    let key = flag.split('=').next().unwrap_or(flag);
    flags.retain(|f| f.split('=').next() != Some(key));
    flags.push(flag.to_string());
}

/// Whether `flag` is a tmpfs option (`Some`), and whether its value is valid.
fn tmpfs_option(flag: &str) -> Option<Result<(), &'static str>> {
    let (key, value) = match flag.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (flag, None),
    };
    let size = |v: Option<&str>| {
        let v = v.unwrap_or("");
        let digits = v.trim_end_matches([
            'k', 'K', 'm', 'M', 'g', 'G', 't', 'T', 'p', 'P', 'e', 'E', '%',
        ]);
        let ok = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && v.len() - digits.len() <= 1;
        if ok {
            Ok(())
        } else {
            Err("expected a number with an optional k, m, g or % suffix")
        }
    };
    Some(match key {
        "size" | "nr_blocks" | "nr_inodes" => size(value),
        "mode" => match value {
            // Permission bits and the sticky bit; set-id bits on a directory grant nothing
            // and are refused rather than silently dropped.
            Some(v)
                if !v.is_empty()
                    && v.len() <= 5
                    && u32::from_str_radix(v, 8).is_ok_and(|m| m & !0o1777 == 0) =>
            {
                Ok(())
            }
            _ => Err("expected octal permission bits, e.g. 1777 or 700"),
        },
        "uid" | "gid" => match value {
            Some(v) if !v.is_empty() && v.len() <= 10 && v.bytes().all(|b| b.is_ascii_digit()) => {
                Ok(())
            }
            _ => Err("expected a number"),
        },
        "huge" => match value {
            Some("never" | "always" | "within_size" | "advise" | "deny" | "force") => Ok(()),
            _ => Err("expected never, always, within_size, advise, deny or force"),
        },
        // A node list would need ':' and ',', which separate entries here: the policy only.
        "mpol" => match value {
            Some("default" | "prefer" | "bind" | "interleave" | "local") => Ok(()),
            _ => Err("expected default, prefer, bind, interleave or local"),
        },
        "noswap" | "inode32" | "inode64" if value.is_none() => Ok(()),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(source: &str, destination: &str, readonly: bool) -> Mount {
        Mount::Bind {
            source: source.into(),
            destination: destination.into(),
            readonly,
            flags: Vec::new(),
        }
    }

    #[test]
    fn pyxis_forms() {
        let m = parse("/data:/data:ro,/home/a,/scratch:/mnt/s:rw+rprivate, tmpfs:/tmp/x").unwrap();
        assert_eq!(
            m,
            vec![
                bind("/data", "/data", true),
                bind("/home/a", "/home/a", false),
                bind("/scratch", "/mnt/s", false),
                Mount::Tmpfs {
                    destination: "/tmp/x".into(),
                    flags: Vec::new(),
                },
            ]
        );
    }

    #[test]
    fn every_enroot_flag_is_accepted_and_the_effective_ones_applied() {
        let m = parse(
            "/d:/d:ro+rbind+unbindable+runbindable+rshared+x-create=dir+nosuid+suid+dev+exec,\
             /e:/e:noexec+noatime+rprivate,\
             tmpfs:/t:size=1g+huge=within_size+mode=700+nr_inodes=10k+noexec+uid=1000+noatime,\
             tmpfs:/r:ro+size=50%+size=2g",
        )
        .unwrap();
        assert_eq!(m[0], bind("/d", "/d", true));
        assert_eq!(
            m[1],
            Mount::Bind {
                source: "/e".into(),
                destination: "/e".into(),
                readonly: false,
                flags: vec!["noexec".into()],
            }
        );
        assert_eq!(
            m[2],
            Mount::Tmpfs {
                destination: "/t".into(),
                flags: [
                    "size=1g",
                    "huge=within_size",
                    "mode=700",
                    "nr_inodes=10k",
                    "noexec",
                    "uid=1000",
                    "noatime"
                ]
                .map(String::from)
                .to_vec(),
            }
        );
        assert_eq!(
            m[3],
            Mount::Tmpfs {
                destination: "/r".into(),
                flags: vec!["ro".into(), "size=2g".into()],
            }
        );
    }

    #[test]
    fn relative_sources_are_the_steps_working_directorys() {
        let cwd = Path::new("/home/a/run");
        assert_eq!(
            parse_in("./data:/data,out,../x:/x:ro", Some(cwd)).unwrap(),
            vec![
                bind("/home/a/run/data", "/data", false),
                bind("/home/a/run/out", "/home/a/run/out", false),
                bind("/home/a/run/../x", "/x", true),
            ]
        );
        // The plugin's check, before the working directory is known.
        parse_entry("./data:/data").unwrap();
        parse_entry("data").unwrap();
        parse_entry("data:rel").unwrap_err();
        // A destination taken from a relative source may not climb out.
        let e = parse_in("../x", Some(cwd)).unwrap_err();
        assert!(e.to_string().contains("'..'"), "{e}");
        let e = parse("./data:/data").unwrap_err();
        assert!(e.to_string().contains("working directory"), "{e}");
    }

    #[test]
    fn umount_entries_name_a_destination_to_unmount() {
        let m = parse_in(
            "umount:/root,/d:/root/x,umount:/dev/shm",
            Some(Path::new("/w")),
        )
        .unwrap();
        assert_eq!(
            m,
            vec![
                Mount::Umount {
                    destination: "/root".into()
                },
                bind("/d", "/root/x", false),
                Mount::Umount {
                    destination: "/dev/shm".into()
                },
            ]
        );
        // As the plugin checks it, before the job is queued.
        parse_entry("umount:/root").unwrap();
        // Alone, `umount` is still a relative source (a directory of that name).
        assert_eq!(
            parse_in("umount", Some(Path::new("/w"))).unwrap(),
            vec![bind("/w/umount", "/w/umount", false)]
        );
        for (bad, why) in [
            ("umount:/", "keeps"),
            ("umount:/proc", "keeps"),
            ("umount:/dev", "keeps"),
            ("umount:/sys", "keeps"),
            ("umount:rel", "absolute"),
            ("umount:/a/../proc", "'..'"),
            ("umount:/x:ro", "no flags"),
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_entries_name_themselves() {
        for (bad, why) in [
            ("/a:b", "absolute"),
            ("/a:/b:rx", "unknown flag 'rx'"),
            ("/a:/../b", "'..'"),
            ("/a:/b:ro:x", "SRC[:DST[:FLAGS]]"),
            ("tmpfs", "absolute"),
            ("/a:/b:size=1g", "tmpfs mounts only"),
            ("tmpfs:/b:size=lots", "number"),
            ("tmpfs:/b:mode=4777", "octal"),
            ("tmpfs:/b:mode=abc", "octal"),
            ("tmpfs:/b:huge=sometimes", "within_size"),
            ("tmpfs:/b:uid=-1", "number"),
            (":/b", "source"),
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{bad}: {err}");
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
