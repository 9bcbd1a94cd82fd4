//! Pyxis's `--container-mounts=SRC[:DST[:FLAGS]][,…]` syntax: flags `+`-separated, `tmpfs` as a
//! source for an empty tmpfs.

use std::path::PathBuf;

/// One entry of `--container-mounts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mount {
    Bind {
        source: PathBuf,
        destination: PathBuf,
        readonly: bool,
    },
    Tmpfs {
        destination: PathBuf,
    },
}

/// Flags accepted for compatibility that change nothing here: berth's bind mounts are always
/// recursive, private, nosuid and nodev.
const NEUTRAL_FLAGS: [&str; 8] = [
    "rbind", "bind", "rprivate", "private", "rslave", "slave", "nosuid", "nodev",
];

/// Parses `--container-mounts`; an error names the entry and what is wrong with it.
pub fn parse(text: &str) -> Result<Vec<Mount>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            parse_entry(entry)
                .map_err(|why| format!("invalid --container-mounts entry '{entry}': {why}"))
        })
        .collect()
}

/// One `SRC[:DST[:FLAGS]]` entry; the error says what is wrong with it. The SPANK plugin
/// shares this file, so that `srun` refuses a bad entry before the job is even queued.
pub fn parse_entry(entry: &str) -> Result<Mount, String> {
    let parts: Vec<&str> = entry.split(':').collect();
    if parts.len() > 3 {
        return Err("expected SRC[:DST[:FLAGS]]".into());
    }
    let source = parts[0];
    let destination = parts.get(1).copied().unwrap_or(source);
    let mut readonly = false;
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
            f if NEUTRAL_FLAGS.contains(&f) => {}
            f => return Err(format!("unknown flag '{f}' (use ro, rw, rprivate, ...)")),
        }
    }
    if !destination.starts_with('/') {
        return Err("the destination must be an absolute path".into());
    }
    if destination.split('/').any(|c| c == "..") {
        return Err("the destination must not contain '..'".into());
    }
    if source == "tmpfs" {
        return Ok(Mount::Tmpfs {
            destination: destination.into(),
        });
    }
    if !source.starts_with('/') {
        return Err("the source must be an absolute path or 'tmpfs'".into());
    }
    Ok(Mount::Bind {
        source: source.into(),
        destination: destination.into(),
        readonly,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pyxis_forms() {
        let m = parse("/data:/data:ro,/home/a,/scratch:/mnt/s:rw+rprivate, tmpfs:/tmp/x").unwrap();
        assert_eq!(
            m,
            vec![
                Mount::Bind {
                    source: "/data".into(),
                    destination: "/data".into(),
                    readonly: true
                },
                Mount::Bind {
                    source: "/home/a".into(),
                    destination: "/home/a".into(),
                    readonly: false
                },
                Mount::Bind {
                    source: "/scratch".into(),
                    destination: "/mnt/s".into(),
                    readonly: false
                },
                Mount::Tmpfs {
                    destination: "/tmp/x".into()
                },
            ]
        );
    }

    #[test]
    fn bad_entries_name_themselves() {
        for bad in [
            "rel:/x",
            "/a:b",
            "/a:/b:rx",
            "/a:/../b",
            "/a:/b:ro:x",
            "tmpfs",
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(bad), "{bad}: {err}");
        }
    }
}
