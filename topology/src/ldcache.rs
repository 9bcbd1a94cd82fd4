//! The dynamic loader's cache, `/etc/ld.so.cache` (glibc's "glibc-ld.so.cache1.1" format):
//! read the host's to find the NVIDIA driver's libraries, and write a container's, which is the
//! image's cache plus the injected libraries, so that `dlopen("libcuda.so.1")` finds them
//! without running `ldconfig` inside the container.
//!
//! Layout (little-endian on the hosts berth runs on): a 48-byte header (magic, version, number
//! of entries, string table length, endianness flag, extension offset), 24-byte entries (flags,
//! key and value string offsets, OS version, hwcap), then the strings. String offsets count
//! from the header. Entries are sorted by `_dl_cache_libcmp`, descending, because the loader
//! binary-searches them. Files from glibc before 2.32 may start with the old libc5 table,
//! followed by the new one at the next 8-byte boundary; both are read.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::path::Path;

use crate::TopologyError;

const MAGIC_OLD: &[u8] = b"ld.so-1.7.0";
const MAGIC_NEW: &[u8] = b"glibc-ld.so.cache1.1";
const HEADER: usize = 48;
const ENTRY: usize = 24;
const OLD_ENTRY: usize = 12;

/// A library for glibc (libc6).
pub const FLAG_ELF_LIBC6: i32 = 0x0003;
/// The entry names a glibc-hwcaps subdirectory through the extension berth does not write.
const HWCAP_EXTENSION: u64 = 1 << 62;
/// cache_file_new_flags_endian_little.
const ENDIAN_LITTLE: u8 = 2;

/// The architecture bits of this machine's 64-bit libraries (`(libc6,x86-64)` in `ldconfig -p`).
pub const fn native_arch() -> i32 {
    if cfg!(target_arch = "x86_64") {
        0x0300
    } else if cfg!(target_arch = "aarch64") {
        0x0a00
    } else if cfg!(target_arch = "powerpc64") {
        0x0500
    } else {
        0
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub flags: i32,
    /// The name programs ask for (`libcuda.so.1`).
    pub key: String,
    /// The file the loader opens.
    pub value: String,
    pub osversion: u32,
    pub hwcap: u64,
}

impl Entry {
    /// A native 64-bit glibc library.
    pub fn native(key: &str, value: &str) -> Self {
        Self {
            flags: FLAG_ELF_LIBC6 | native_arch(),
            key: key.to_string(),
            value: value.to_string(),
            osversion: 0,
            hwcap: 0,
        }
    }

    pub fn is_native(&self) -> bool {
        self.flags == FLAG_ELF_LIBC6 | native_arch()
    }
}

/// glibc's `_dl_cache_libcmp`: runs of digits compare as numbers, so `libfoo.so.10` sorts after
/// `libfoo.so.9`; a digit sorts after any other character.
pub fn libcmp(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < a.len() {
        if j >= b.len() {
            return Ordering::Greater;
        }
        let (x, y) = (a[i], b[j]);
        if x.is_ascii_digit() {
            if !y.is_ascii_digit() {
                return Ordering::Greater;
            }
            let (mut v1, mut v2) = (0u64, 0u64);
            while i < a.len() && a[i].is_ascii_digit() {
                v1 = v1.saturating_mul(10).saturating_add(u64::from(a[i] - b'0'));
                i += 1;
            }
            while j < b.len() && b[j].is_ascii_digit() {
                v2 = v2.saturating_mul(10).saturating_add(u64::from(b[j] - b'0'));
                j += 1;
            }
            if v1 != v2 {
                return v1.cmp(&v2);
            }
        } else if y.is_ascii_digit() {
            return Ordering::Less;
        } else if x != y {
            return x.cmp(&y);
        } else {
            i += 1;
            j += 1;
        }
    }
    if j < b.len() {
        Ordering::Less
    } else {
        Ordering::Equal
    }
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

fn string_at(b: &[u8], off: usize) -> Option<String> {
    let rest = b.get(off..)?;
    let end = rest.iter().position(|&c| c == 0)?;
    String::from_utf8(rest[..end].to_vec()).ok()
}

/// Reads a cache file's entries; `origin` names it in errors.
pub fn parse(bytes: &[u8], origin: &Path) -> Result<Vec<Entry>, TopologyError> {
    let err = |what: &str| TopologyError::LdCache {
        path: origin.to_path_buf(),
        what: what.to_string(),
    };
    let start = if bytes.starts_with(MAGIC_NEW) {
        0
    } else if bytes.starts_with(MAGIC_OLD) {
        let nlibs = u32_at(bytes, 12).ok_or_else(|| err("truncated old header"))? as usize;
        let end = 16usize
            .checked_add(
                nlibs
                    .checked_mul(OLD_ENTRY)
                    .ok_or_else(|| err("bad size"))?,
            )
            .ok_or_else(|| err("bad size"))?;
        let aligned = (end + 7) & !7;
        if !bytes
            .get(aligned..)
            .is_some_and(|b| b.starts_with(MAGIC_NEW))
        {
            return Err(err(
                "only the pre-2.2 libc5 format: regenerate it with a newer ldconfig",
            ));
        }
        aligned
    } else {
        return Err(err("not a glibc loader cache (bad magic)"));
    };
    let b = &bytes[start..];
    let nlibs = u32_at(b, 20).ok_or_else(|| err("truncated header"))? as usize;
    if b.len() < HEADER || nlibs > (b.len() - HEADER) / ENTRY {
        return Err(err("truncated: fewer entries than the header says"));
    }
    if b[28] & 3 == 3 && cfg!(target_endian = "little") {
        return Err(err("big-endian cache on a little-endian machine"));
    }
    let mut out = Vec::with_capacity(nlibs);
    for i in 0..nlibs {
        let e = HEADER + i * ENTRY;
        let flags = u32_at(b, e)
            .ok_or_else(|| err("truncated entry"))?
            .cast_signed();
        let key = u32_at(b, e + 4).ok_or_else(|| err("truncated entry"))? as usize;
        let value = u32_at(b, e + 8).ok_or_else(|| err("truncated entry"))? as usize;
        out.push(Entry {
            flags,
            key: string_at(b, key).ok_or_else(|| err("entry name outside the file"))?,
            value: string_at(b, value).ok_or_else(|| err("entry path outside the file"))?,
            osversion: u32_at(b, e + 12).unwrap_or(0),
            hwcap: u64_at(b, e + 16).unwrap_or(0),
        });
    }
    Ok(out)
}

/// Writes a cache holding `entries`, sorted here (stably: of two entries with one name, the
/// first listed wins, as with ldconfig); glibc-hwcaps entries are dropped because their
/// extension is not written, and the loader then uses the plain entries.
#[expect(
    clippy::cast_possible_truncation,
    reason = "entries come from a cache read through the same u32 format (and the host's \
              libraries): the table and string offsets stay far below 4 GiB"
)]
pub fn write<'a>(entries: &'a [Entry]) -> Vec<u8> {
    let mut entries: Vec<&'a Entry> = entries
        .iter()
        .filter(|e| e.hwcap & HWCAP_EXTENSION == 0)
        .collect();
    entries.sort_by(|a, b| {
        libcmp(&b.key, &a.key)
            .then(b.flags.cmp(&a.flags))
            .then(b.hwcap.cmp(&a.hwcap))
    });
    let strings_at = HEADER + entries.len() * ENTRY;
    let mut strings: Vec<u8> = Vec::new();
    let mut offsets: BTreeMap<&str, u32> = BTreeMap::new();
    let mut table = Vec::with_capacity(entries.len() * ENTRY);
    for e in &entries {
        let mut intern = |s: &'a str| -> u32 {
            *offsets.entry(s).or_insert_with(|| {
                let o = (strings_at + strings.len()) as u32;
                strings.extend_from_slice(s.as_bytes());
                strings.push(0);
                o
            })
        };
        let k = intern(&e.key);
        let v = intern(&e.value);
        table.extend_from_slice(&e.flags.to_le_bytes());
        table.extend_from_slice(&k.to_le_bytes());
        table.extend_from_slice(&v.to_le_bytes());
        table.extend_from_slice(&e.osversion.to_le_bytes());
        table.extend_from_slice(&e.hwcap.to_le_bytes());
    }
    let mut out = Vec::with_capacity(strings_at + strings.len());
    out.extend_from_slice(MAGIC_NEW);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    out.push(if cfg!(target_endian = "little") {
        ENDIAN_LITTLE
    } else {
        3
    });
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&0u32.to_le_bytes()); // no extension
    out.extend_from_slice(&[0; 12]);
    debug_assert_eq!(out.len(), HEADER);
    out.extend_from_slice(&table);
    out.extend_from_slice(&strings);
    out
}

/// `base` with `add` laid over it: an added entry replaces base entries of the same name and
/// flags (an image's stub libnvidia-ml.so.1 gives way to the host driver's).
pub fn merge(base: Vec<Entry>, add: &[Entry]) -> Vec<Entry> {
    let mut out: Vec<Entry> = base
        .into_iter()
        .filter(|b| !add.iter().any(|a| a.key == b.key && a.flags == b.flags))
        .collect();
    out.extend(add.iter().cloned());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn libcmp_compares_numbers_as_numbers() {
        assert_eq!(libcmp("libfoo.so.10", "libfoo.so.9"), Ordering::Greater);
        assert_eq!(libcmp("libfoo.so", "libfoo.so.1"), Ordering::Less);
        assert_eq!(libcmp("libc.so.6", "libc.so.6"), Ordering::Equal);
        assert_eq!(libcmp("lib1", "liba"), Ordering::Greater);
        assert_eq!(libcmp("libz.so.1", "libcuda.so.1"), Ordering::Greater);
    }

    /// `ldconfig -p -C FILE`: glibc's own reading of a cache file, as (key, flags text, value).
    fn ldconfig_print(file: &Path) -> Vec<(String, String, String)> {
        let out = Command::new("ldconfig")
            .arg("-p")
            .arg("-C")
            .arg(file)
            .output()
            .expect("ldconfig (libc-bin) runs");
        assert!(out.status.success(), "{:?}", out);
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .skip(1)
            .filter_map(|l| {
                let (left, value) = l.trim().split_once(" => ")?;
                let (key, flags) = left.split_once(" (")?;
                Some((
                    key.to_string(),
                    flags.trim_end_matches(')').to_string(),
                    value.to_string(),
                ))
            })
            .collect()
    }

    #[test]
    fn reads_what_ldconfig_writes() {
        // A cache built by the real ldconfig, in a root of its own, from copies of real
        // libraries.
        let dir = tempfile::tempdir().unwrap();
        let libdir = dir.path().join("lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&libdir).unwrap();
        std::fs::create_dir_all(dir.path().join("usr/lib")).unwrap();
        let mut copied = 0;
        for entry in std::fs::read_dir("/lib/x86_64-linux-gnu")
            .unwrap()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().to_string();
            if (name.starts_with("libz.so.") || name.starts_with("libm.so."))
                && entry.file_type().unwrap().is_file()
            {
                std::fs::copy(entry.path(), libdir.join(&name)).unwrap();
                copied += 1;
            }
        }
        assert!(copied >= 2, "libz and libm exist on Debian");
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::write(dir.path().join("etc/ld.so.conf"), "/lib/x86_64-linux-gnu\n").unwrap();
        let st = Command::new("ldconfig")
            .arg("-r")
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(st.success());
        let cache = dir.path().join("etc/ld.so.cache");
        let entries = parse(&std::fs::read(&cache).unwrap(), &cache).unwrap();
        let ours: Vec<(String, String)> = entries
            .iter()
            .map(|e| (e.key.clone(), e.value.clone()))
            .collect();
        let theirs: Vec<(String, String)> = ldconfig_print(&cache)
            .into_iter()
            .map(|(k, _, v)| (k, v))
            .collect();
        assert_eq!(ours, theirs);
        assert!(ours.iter().any(|(k, _)| k == "libz.so.1"), "{ours:?}");
        // Writing what was read gives a file ldconfig reads the same, in the same order.
        let again = dir.path().join("again.cache");
        std::fs::write(&again, write(&entries)).unwrap();
        let (a, b) = (ldconfig_print(&again), ldconfig_print(&cache));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x, y, "entry {i}");
        }
        assert_eq!(a.len(), b.len());
    }

    #[test]
    fn written_caches_are_sorted_for_the_loader_and_read_by_ldconfig() {
        let entries = vec![
            Entry::native(
                "libcuda.so.1",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
            ),
            Entry::native(
                "libcuda.so",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
            ),
            Entry::native(
                "libnvidia-ml.so.1",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            ),
            Entry::native("libfoo.so.10", "/opt/libfoo.so.10"),
            Entry::native("libfoo.so.9", "/opt/libfoo.so.9"),
            Entry {
                flags: FLAG_ELF_LIBC6,
                ..Entry::native("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1")
            },
            Entry {
                hwcap: HWCAP_EXTENSION | 1,
                ..Entry::native("libz.so.1", "/usr/lib/glibc-hwcaps/x86-64-v3/libz.so.1")
            },
        ];
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c");
        std::fs::write(&file, write(&entries)).unwrap();
        let printed = ldconfig_print(&file);
        let keys: Vec<&str> = printed.iter().map(|(k, _, _)| k.as_str()).collect();
        // Descending in libcmp order, 64-bit before 32-bit, the hwcaps entry gone.
        assert_eq!(
            keys,
            [
                "libnvidia-ml.so.1",
                "libfoo.so.10",
                "libfoo.so.9",
                "libcuda.so.1",
                "libcuda.so.1",
                "libcuda.so"
            ]
        );
        assert_eq!(printed[3].1, "libc6,x86-64");
        assert_eq!(printed[4].1, "libc6");
        let back = parse(&std::fs::read(&file).unwrap(), &file).unwrap();
        assert_eq!(back.len(), 6);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let p = Path::new("/x");
        parse(b"", p).unwrap_err();
        parse(b"glibc-ld.so.cache1.1", p).unwrap_err();
        let mut bad = write(&[Entry::native("a", "/a")]);
        bad[20] = 0xff; // nlibs far beyond the file
        assert!(
            parse(&bad, p)
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
        let mut bad = write(&[Entry::native("a", "/a")]);
        let n = bad.len();
        bad[HEADER + 4..HEADER + 8]
            .copy_from_slice(&(u32::try_from(n).unwrap() + 10).to_le_bytes());
        parse(&bad, p).unwrap_err();
        parse(b"ld.so-1.7.0\0\x01\0\0\0", p).unwrap_err();
    }

    #[test]
    fn merge_replaces_same_name_and_flags() {
        let base = vec![
            Entry::native("libnvidia-ml.so.1", "/usr/lib/stub/libnvidia-ml.so.1"),
            Entry::native("libc.so.6", "/lib/libc.so.6"),
        ];
        let add = [Entry::native(
            "libnvidia-ml.so.1",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15",
        )];
        let m = merge(base, &add);
        assert_eq!(m.len(), 2);
        assert!(m.iter().any(|e| e.value.ends_with("550.54.15")));
        assert!(!m.iter().any(|e| e.value.contains("stub")));
    }
}
