//! Reading and writing cgroupfs interface files. Kept apart because cgroupfs differs from a
//! regular filesystem: files must never be created, a write is one syscall the kernel parses as
//! a whole, and errno is the only explanation the kernel gives.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use super::CgroupError;

pub(crate) fn is_not_found(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::NotFound
}

/// Write `value` into an existing interface file in a single `write(2)`.
pub(crate) fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    let wrap = |source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    };
    // No O_CREAT: a missing interface file means a missing controller, never "create it".
    let mut file = OpenOptions::new().write(true).open(path).map_err(wrap)?;
    // cgroupfs parses each write(2) on its own; a split write would be two malformed values.
    let n = file.write(value.as_bytes()).map_err(wrap)?;
    if n != value.len() {
        return Err(wrap(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("short write: {n} of {} bytes", value.len()),
        )));
    }
    Ok(())
}

/// Read an interface file. `hint` says what to do when it fails.
pub(crate) fn read(path: &Path, hint: &'static str) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|e| CgroupError::io("read", path, e, hint))
}

/// Read an interface file that may legitimately be absent (controller not enabled, old kernel).
pub(crate) fn read_optional(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Open a file for reading, keeping the handle to re-read it (poll-based waiting).
pub(crate) fn open(path: &Path) -> io::Result<File> {
    File::open(path)
}

/// The value for `key` in a flat-keyed file ("key value" lines: cpu.stat, memory.events, ...).
pub(crate) fn keyed_u64(content: &str, key: &str) -> Option<u64> {
    content.lines().find_map(|line| {
        let mut it = line.split_ascii_whitespace();
        (it.next()? == key).then_some(())?;
        it.next()?.parse().ok()
    })
}

/// A file holding one number (memory.peak, pids.peak, ...).
pub(crate) fn single_u64(content: &str) -> Option<u64> {
    content.trim().parse().ok()
}

/// Whitespace-separated names (cgroup.controllers, cgroup.subtree_control).
pub(crate) fn lists(content: &str, name: &str) -> bool {
    content.split_ascii_whitespace().any(|n| n == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_values() {
        let s = "usage_usec 12345\nuser_usec 10\nsystem_usec 2\n";
        assert_eq!(keyed_u64(s, "usage_usec"), Some(12345));
        assert_eq!(keyed_u64(s, "system_usec"), Some(2));
        assert_eq!(keyed_u64(s, "usage"), None);
        assert_eq!(keyed_u64("oom_kill x\n", "oom_kill"), None);
        assert_eq!(keyed_u64("", "oom_kill"), None);
    }

    #[test]
    fn single_values() {
        assert_eq!(single_u64("4096\n"), Some(4096));
        assert_eq!(single_u64("max\n"), None);
        assert_eq!(single_u64(""), None);
    }

    #[test]
    fn list_membership_is_by_whole_word() {
        assert!(lists("cpuset cpu io memory\n", "cpu"));
        assert!(lists("cpuset cpu io memory\n", "cpuset"));
        assert!(!lists("cpuset io\n", "cpu"));
        assert!(!lists("", "cpu"));
    }

    #[test]
    fn write_never_creates_files() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("memory.max");
        let err = write(&missing, "100").unwrap_err();
        assert!(!missing.exists());
        let s = err.to_string();
        assert!(s.contains("'100'") && s.contains("memory.max"), "{s}");
        assert!(s.contains("controller is not enabled"), "{s}");
    }

    #[test]
    fn write_into_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pids.max");
        std::fs::write(&f, "").unwrap();
        write(&f, "64").unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "64");
    }
}
