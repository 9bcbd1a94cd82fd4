//! Parsers for the values users type on the command line: sizes, CPU counts, CPU lists, mount
//! specs and users. Each error names the value and the accepted form.

use std::path::PathBuf;

use super::SpecError;

/// Parses a byte size: a plain number of bytes or a number with a binary suffix
/// (`k`, `m`, `g`, `t`, case-insensitive, optional trailing `b`/`ib`), as docker and Slurm accept.
pub fn size(text: &str) -> Result<u64, SpecError> {
    let bad = || SpecError::Size(text.to_string());
    let lower = text.trim().to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, shift) = match body.chars().last().ok_or_else(bad)? {
        'k' => (&body[..body.len() - 1], 10),
        'm' => (&body[..body.len() - 1], 20),
        'g' => (&body[..body.len() - 1], 30),
        't' => (&body[..body.len() - 1], 40),
        _ => (body, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift)
        .filter(|&v| v > 0)
        .ok_or_else(bad)
}

/// Parses a CPU count such as `0.5` or `2` into a CFS quota for the given period (µs).
pub fn cpus(text: &str, period_us: u64) -> Result<i64, SpecError> {
    let bad = || SpecError::Cpus(text.to_string());
    let value: f64 = text.trim().parse().map_err(|_| bad())?;
    if !value.is_finite() || value <= 0.0 || value > 65536.0 {
        return Err(bad());
    }
    #[expect(
        clippy::cast_possible_truncation,
        reason = "value is at most 65536 (checked above) and callers pass CPU_PERIOD_US \
                  (100 000 µs): the quota is below 2^33; float-to-int `as` saturates anyway"
    )]
    let quota = (value * period_us as f64).round() as i64;
    // The kernel refuses quotas under 1 ms.
    if quota < 1000 {
        return Err(bad());
    }
    Ok(quota)
}

/// Validates a CPU list (`1`, `0-3`, `0-3,8,10-11`) and returns it normalised (no spaces).
pub fn cpu_list(text: &str) -> Result<String, SpecError> {
    let bad = || SpecError::CpuList(text.to_string());
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(bad());
    }
    for part in trimmed.split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo, hi),
            None => (part, part),
        };
        let lo: u32 = lo.trim().parse().map_err(|_| bad())?;
        let hi: u32 = hi.trim().parse().map_err(|_| bad())?;
        if lo > hi || hi > 8191 {
            return Err(bad());
        }
    }
    Ok(trimmed
        .split(',')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(","))
}

/// A `--mount SRC:DST[:ro|rw]` request: a bind mount of a host path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindMount {
    pub source: PathBuf,
    pub destination: PathBuf,
    pub readonly: bool,
}

/// Parses `SRC:DST[:ro|rw]`; both paths absolute, DST without `..`.
pub fn bind_mount(text: &str) -> Result<BindMount, SpecError> {
    let bad = |why: &str| SpecError::Mount(text.to_string(), why.to_string());
    let parts: Vec<&str> = text.split(':').collect();
    let (src, dst, readonly) = match parts.as_slice() {
        [src, dst] => (*src, *dst, false),
        [src, dst, "ro"] => (*src, *dst, true),
        [src, dst, "rw"] => (*src, *dst, false),
        [_, _, flag] => return Err(bad(&format!("unknown flag '{flag}' (use ro or rw)"))),
        _ => return Err(bad("expected SRC:DST[:ro|rw]")),
    };
    if !src.starts_with('/') || !dst.starts_with('/') {
        return Err(bad("SRC and DST must be absolute paths"));
    }
    let destination = PathBuf::from(dst);
    if is_root(&destination) {
        return Err(bad(ONTO_ROOT));
    }
    if destination
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(bad("DST must not contain '..'"));
    }
    Ok(BindMount {
        source: PathBuf::from(src),
        destination,
        readonly,
    })
}

/// Why a mount onto the container's `/` is refused.
pub const ONTO_ROOT: &str =
    "DST must not be / (it would hide the container's root filesystem); mount under a directory";

/// Whether `path` names the root (`/`, `//`, `/.`, ...).
pub fn is_root(path: &std::path::Path) -> bool {
    path.components().all(|c| {
        matches!(
            c,
            std::path::Component::RootDir | std::path::Component::CurDir
        )
    })
}

/// Parses `KEY=VAL` (VAL may be empty; KEY may not, nor contain `=`).
pub fn env_pair(text: &str) -> Result<(String, String), SpecError> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() && !k.contains('\0') && !v.contains('\0') => {
            Ok((k.to_string(), v.to_string()))
        }
        _ => Err(SpecError::Env(text.to_string())),
    }
}

/// Validates a hostname: 1–64 bytes, letters, digits, `-` and `.`.
pub fn hostname(text: &str) -> Result<String, SpecError> {
    let ok = !text.is_empty()
        && text.len() <= 64
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if ok {
        Ok(text.to_string())
    } else {
        Err(SpecError::Hostname(text.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size("4096").unwrap(), 4096);
        assert_eq!(size("32M").unwrap(), 32 << 20);
        assert_eq!(size("32m").unwrap(), 32 << 20);
        assert_eq!(size("1G").unwrap(), 1 << 30);
        assert_eq!(size("1GiB").unwrap(), 1 << 30);
        assert_eq!(size("512kb").unwrap(), 512 << 10);
        for bad in ["", "M", "-1M", "1.5G", "12Q", "0", "99999999999T", "1 G"] {
            let err = size(bad).unwrap_err().to_string();
            assert!(err.contains("size"), "{bad}: {err}");
        }
    }

    #[test]
    fn cpu_counts() {
        assert_eq!(cpus("0.5", 100_000).unwrap(), 50_000);
        assert_eq!(cpus("2", 100_000).unwrap(), 200_000);
        for bad in ["0", "-1", "abc", "0.001", "nan", "inf"] {
            assert!(cpus(bad, 100_000).is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list("1").unwrap(), "1");
        assert_eq!(cpu_list("0-3, 8").unwrap(), "0-3,8");
        for bad in ["", "3-1", "a", "1,,2", "0-", "9000"] {
            assert!(cpu_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn mounts() {
        let m = bind_mount("/data:/mnt/data:ro").unwrap();
        assert_eq!(m.source, PathBuf::from("/data"));
        assert_eq!(m.destination, PathBuf::from("/mnt/data"));
        assert!(m.readonly);
        assert!(!bind_mount("/a:/b").unwrap().readonly);
        assert!(!bind_mount("/a:/b:rw").unwrap().readonly);
        for bad in ["/a", "a:/b", "/a:b", "/a:/b:rx", "/a:/../etc", "/a:/b:ro:x"] {
            let err = bind_mount(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{bad}: {err}");
        }
    }

    #[test]
    fn env_and_hostname() {
        assert_eq!(env_pair("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(env_pair("A=").unwrap(), ("A".into(), String::new()));
        env_pair("=x").unwrap_err();
        env_pair("novalue").unwrap_err();
        assert_eq!(hostname("node-1.local").unwrap(), "node-1.local");
        hostname("bad host").unwrap_err();
        hostname("").unwrap_err();
    }
}
