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

pub fn parse(text: &str) -> Result<Vec<Mount>, String> {
    let mut out = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: &str| format!("invalid --container-mounts entry '{entry}': {why}");
        let parts: Vec<&str> = entry.split(':').collect();
        if parts.len() > 3 {
            return Err(bad("expected SRC[:DST[:FLAGS]]"));
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
                f => {
                    return Err(bad(&format!(
                        "unknown flag '{f}' (use ro, rw, rprivate, ...)"
                    )));
                }
            }
        }
        if !destination.starts_with('/') {
            return Err(bad("the destination must be an absolute path"));
        }
        if destination.split('/').any(|c| c == "..") {
            return Err(bad("the destination must not contain '..'"));
        }
        if source == "tmpfs" {
            out.push(Mount::Tmpfs {
                destination: destination.into(),
            });
            continue;
        }
        if !source.starts_with('/') {
            return Err(bad("the source must be an absolute path or 'tmpfs'"));
        }
        out.push(Mount::Bind {
            source: source.into(),
            destination: destination.into(),
            readonly,
        });
    }
    Ok(out)
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
