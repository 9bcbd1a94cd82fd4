//! The per-layer record of what extraction wrote (`layers/<hex>.files`): every path of the layer
//! directory with its type, mode, owner, size and content digest, plus the hardlinks whose
//! target lies in a lower layer (applied per image by copying the file up, see
//! `Store::copy_up`). `berth images verify` compares a layer directory against it.
//!
//! Format, one entry a line (text, so a damaged record is readable by people):
//! ```text
//! berth-layer-record 2 <tar bytes>
//! E <type> <mode octal> <uid> <gid> <size> <digest hex or -> <path>
//! L <link path> <target path>
//! ```
//! The digest is xxh3-128 in version 2 records and sha256 in version 1 (still read and
//! verified as they are).
//! Paths are relative to the layer (`.` is its root) with bytes outside printable ASCII, space
//! and `%` written as `%XX`. Regular files' digests are computed while extraction writes them
//! (the bytes pass through anyway); a symlink's is the digest of its target text.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::Xxh3;

use crate::ImageError;

const MAGIC: &str = "berth-layer-record";

/// How a record hashes file contents and symlink targets. Version 1 records used sha256, which
/// took ≈ 18 % of an import's CPU for this hash alone; version 2 uses xxh3-128, a tenth of
/// that. The digests catch damage to a stored layer (a disk error, a stray write), not an
/// attacker: the store and its records are root's alone, and whoever could change a layer could
/// rewrite its record too. Images are verified by their blob and diff_id sha256s on import.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContentHash {
    Sha256,
    #[default]
    Xxh3,
}

/// A running [`ContentHash`].
pub enum Hasher {
    Sha256(Sha256),
    Xxh3(Box<Xxh3>),
}

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Sha256(_) => "Hasher(sha256)",
            Self::Xxh3(_) => "Hasher(xxh3-128)",
        })
    }
}

impl ContentHash {
    pub fn hasher(self) -> Hasher {
        match self {
            Self::Sha256 => Hasher::Sha256(Sha256::new()),
            Self::Xxh3 => Hasher::Xxh3(Box::new(Xxh3::new())),
        }
    }

    /// The digest of `bytes`, hex.
    pub fn digest(self, bytes: &[u8]) -> String {
        let mut h = self.hasher();
        h.update(bytes);
        h.finish()
    }

    fn version(self) -> u32 {
        match self {
            Self::Sha256 => 1,
            Self::Xxh3 => 2,
        }
    }
}

impl Hasher {
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Sha256(h) => h.update(bytes),
            Self::Xxh3(h) => h.update(bytes),
        }
    }

    /// The digest, hex.
    pub fn finish(self) -> String {
        match self {
            Self::Sha256(h) => format!("{:x}", h.finalize()),
            Self::Xxh3(h) => format!("{:032x}", h.digest128()),
        }
    }
}

/// One path of a layer directory as extraction left it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRecord {
    /// `f` file, `d` directory, `l` symlink, `c`/`b` device (a `c` 0/0 is a whiteout), `p`
    /// fifo, `s` socket.
    pub kind: char,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// The [`ContentHash`] hex of a file's content or a symlink's target; `None` for other
    /// types.
    pub digest: Option<String>,
}

/// A layer's whole record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerRecord {
    /// Length of the uncompressed layer stream (counted against `store.max_image_bytes`).
    pub tar_bytes: u64,
    pub files: BTreeMap<Vec<u8>, FileRecord>,
    /// Hardlinks (link path, target path) whose target is not in this layer.
    pub external_links: Vec<(Vec<u8>, Vec<u8>)>,
    /// How `files`' digests were made (the record's version).
    pub hash: ContentHash,
}

fn escape(path: &[u8]) -> String {
    let mut s = String::with_capacity(path.len());
    for &b in path {
        if (0x21..=0x7e).contains(&b) && b != b'%' {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    if s.is_empty() { ".".into() } else { s }
}

fn unescape(text: &str) -> Option<Vec<u8>> {
    if text == "." {
        return Some(Vec::new());
    }
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

impl LayerRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!("{MAGIC} {} {}\n", self.hash.version(), self.tar_bytes);
        for (path, r) in &self.files {
            s.push_str(&format!(
                "E {} {:o} {} {} {} {} {}\n",
                r.kind,
                r.mode,
                r.uid,
                r.gid,
                r.size,
                r.digest.as_deref().unwrap_or("-"),
                escape(path)
            ));
        }
        for (link, target) in &self.external_links {
            s.push_str(&format!("L {} {}\n", escape(link), escape(target)));
        }
        s.into_bytes()
    }

    /// Parses a record; `Err` says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Self, ImageError> {
        let text =
            std::str::from_utf8(bytes).map_err(|_| ImageError::Detail("not text".to_string()))?;
        let mut lines = text.lines();
        let head: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
        let hash = match head.as_slice() {
            [MAGIC, "1", _] => ContentHash::Sha256,
            [MAGIC, "2", _] => ContentHash::Xxh3,
            _ => {
                return Err(ImageError::Detail(
                    "not a berth layer record (version 1 or 2)".into(),
                ));
            }
        };
        let mut rec = LayerRecord {
            hash,
            tar_bytes: head[2]
                .parse()
                .map_err(|_| ImageError::Detail("bad header".to_string()))?,
            ..Default::default()
        };
        for (n, line) in lines.enumerate() {
            let bad = || ImageError::Detail(format!("line {} is malformed", n + 2));
            let f: Vec<&str> = line.split(' ').collect();
            match f.as_slice() {
                ["E", kind, mode, uid, gid, size, digest, path] => {
                    let kind = kind
                        .chars()
                        .next()
                        .filter(|_| kind.len() == 1)
                        .ok_or_else(bad)?;
                    rec.files.insert(
                        unescape(path).ok_or_else(bad)?,
                        FileRecord {
                            kind,
                            mode: u32::from_str_radix(mode, 8).map_err(|_| bad())?,
                            uid: uid.parse().map_err(|_| bad())?,
                            gid: gid.parse().map_err(|_| bad())?,
                            size: size.parse().map_err(|_| bad())?,
                            digest: (*digest != "-").then(|| digest.to_string()),
                        },
                    );
                }
                ["L", link, target] => rec.external_links.push((
                    unescape(link).ok_or_else(bad)?,
                    unescape(target).ok_or_else(bad)?,
                )),
                _ => return Err(bad()),
            }
        }
        Ok(rec)
    }
}

fn kind_of(m: &std::fs::Metadata) -> char {
    let t = m.file_type();
    if t.is_file() {
        'f'
    } else if t.is_dir() {
        'd'
    } else if t.is_symlink() {
        'l'
    } else if t.is_char_device() {
        'c'
    } else if t.is_block_device() {
        'b'
    } else if t.is_fifo() {
        'p'
    } else {
        's'
    }
}

/// The `hash` hex of everything `r` yields.
pub fn hash_reader(r: &mut dyn Read, hash: ContentHash) -> io::Result<String> {
    let mut h = hash.hasher();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => h.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(h.finish())
}

/// Walks the layer directory `dir` (never following symlinks; the store is root's alone, so
/// nothing changes it underneath) and records every path. `file_digest` gives a regular file's
/// digest by inode: from extraction, which hashed while writing; `None` there means "read and
/// hash the file with `hash`" (what verification does).
pub fn walk(
    dir: &Path,
    hash: ContentHash,
    file_digest: &dyn Fn(u64) -> Option<String>,
) -> io::Result<BTreeMap<Vec<u8>, FileRecord>> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(rel) = stack.pop() {
        let path = if rel.is_empty() {
            dir.to_path_buf()
        } else {
            dir.join(std::ffi::OsStr::from_bytes(&rel))
        };
        let m = std::fs::symlink_metadata(&path)?;
        let kind = kind_of(&m);
        let (size, digest) = match kind {
            'f' => {
                let d = match file_digest(m.ino()) {
                    Some(d) => d,
                    None => {
                        // O_NOFOLLOW: the entry was a file a moment ago; never follow a link.
                        let mut f = std::fs::OpenOptions::new()
                            .read(true)
                            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                            .open(&path)?;
                        hash_reader(&mut f, hash)?
                    }
                };
                (m.len(), Some(d))
            }
            'l' => {
                let target = std::fs::read_link(&path)?;
                let bytes = target.as_os_str().as_bytes();
                (bytes.len() as u64, Some(hash.digest(bytes)))
            }
            _ => (0, None),
        };
        if kind == 'd' {
            for e in std::fs::read_dir(&path)? {
                let e = e?;
                let mut child = rel.clone();
                if !child.is_empty() {
                    child.push(b'/');
                }
                child.extend_from_slice(e.file_name().as_bytes());
                stack.push(child);
            }
        }
        out.insert(
            rel,
            FileRecord {
                kind,
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
                size,
                digest,
            },
        );
    }
    Ok(out)
}

/// How a layer directory differs from its record: one line per path, at most `max` lines
/// (then a count of the rest).
pub fn compare(
    recorded: &BTreeMap<Vec<u8>, FileRecord>,
    found: &BTreeMap<Vec<u8>, FileRecord>,
    max: usize,
) -> Vec<String> {
    let mut out = Vec::new();
    let show = |p: &[u8]| {
        if p.is_empty() {
            "/".to_string()
        } else {
            format!("/{}", String::from_utf8_lossy(p))
        }
    };
    for (path, want) in recorded {
        let line = match found.get(path) {
            None => Some(format!("{}: missing", show(path))),
            Some(have) if have.kind != want.kind => Some(format!(
                "{}: type {} (recorded {})",
                show(path),
                have.kind,
                want.kind
            )),
            Some(have) if have.size != want.size => Some(format!(
                "{}: size {} (recorded {})",
                show(path),
                have.size,
                want.size
            )),
            Some(have) if have.digest != want.digest => Some(format!(
                "{}: content differs from the recorded digest",
                show(path)
            )),
            Some(have) if have.mode != want.mode => Some(format!(
                "{}: mode {:o} (recorded {:o})",
                show(path),
                have.mode,
                want.mode
            )),
            Some(have) if (have.uid, have.gid) != (want.uid, want.gid) => Some(format!(
                "{}: owner {}:{} (recorded {}:{})",
                show(path),
                have.uid,
                have.gid,
                want.uid,
                want.gid
            )),
            Some(_) => None,
        };
        out.extend(line);
    }
    for path in found.keys() {
        if !recorded.contains_key(path) {
            out.push(format!("{}: not in the record (added)", show(path)));
        }
    }
    if out.len() > max {
        let more = out.len() - max;
        out.truncate(max);
        out.push(format!("and {more} more"));
    }
    out
}

/// Reads a record file (bounded: a record is small next to its layer, but a damaged one must
/// not exhaust memory).
pub fn read(path: &Path) -> io::Result<Option<LayerRecord>> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    f.take(1 << 30).read_to_end(&mut bytes)?;
    LayerRecord::decode(&bytes)
        .map(Some)
        .map_err(|why| io::Error::other(format!("{}: {why}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_with_odd_names() {
        let mut rec = LayerRecord {
            tar_bytes: 4096,
            ..Default::default()
        };
        rec.files.insert(
            Vec::new(),
            FileRecord {
                kind: 'd',
                mode: 0o755,
                uid: 0,
                gid: 0,
                size: 0,
                digest: None,
            },
        );
        rec.files.insert(
            b"a b/%\xff\n".to_vec(),
            FileRecord {
                kind: 'f',
                mode: 0o4755,
                uid: 1,
                gid: 2,
                size: 3,
                digest: Some("ab".into()),
            },
        );
        rec.external_links
            .push((b"x y".to_vec(), b"usr/bin/z".to_vec()));
        let back = LayerRecord::decode(&rec.encode()).unwrap();
        assert_eq!(back, rec);
        LayerRecord::decode(b"garbage").unwrap_err();
        LayerRecord::decode(b"berth-layer-record 1 0\nE f\n").unwrap_err();
        LayerRecord::decode(b"berth-layer-record 3 0\n").unwrap_err();
        let old = LayerRecord {
            hash: ContentHash::Sha256,
            ..rec
        };
        assert!(old.encode().starts_with(b"berth-layer-record 1 4096\n"));
        assert_eq!(LayerRecord::decode(&old.encode()).unwrap(), old);
    }

    /// A layer recorded by an older berth (version 1, sha256) verifies as it is; read with the
    /// other hash, every file would differ.
    #[test]
    fn version_1_records_verify_with_sha256() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), b"hello").unwrap();
        std::os::unix::fs::symlink("a", dir.path().join("l")).unwrap();
        let v1 = walk(dir.path(), ContentHash::Sha256, &|_| None).unwrap();
        assert_eq!(
            v1[&b"a".to_vec()].digest.as_deref(),
            Some("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
        );
        let text = LayerRecord {
            tar_bytes: 1,
            files: v1,
            external_links: Vec::new(),
            hash: ContentHash::Sha256,
        }
        .encode();
        let recorded = LayerRecord::decode(&text).unwrap();
        assert_eq!(recorded.hash, ContentHash::Sha256);
        let found = walk(dir.path(), recorded.hash, &|_| None).unwrap();
        assert!(compare(&recorded.files, &found, 10).is_empty());
        let other = walk(dir.path(), ContentHash::Xxh3, &|_| None).unwrap();
        assert_eq!(compare(&recorded.files, &other, 10).len(), 2);
        assert_eq!(
            other[&b"a".to_vec()].digest.as_deref().map(str::len),
            Some(32)
        );
    }

    #[test]
    fn compare_names_each_difference() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), b"hello").unwrap();
        std::fs::write(dir.path().join("b"), b"same").unwrap();
        let before = walk(dir.path(), ContentHash::Xxh3, &|_| None).unwrap();
        std::fs::write(dir.path().join("a"), b"hel").unwrap();
        std::fs::write(dir.path().join("c"), b"new").unwrap();
        let after = walk(dir.path(), ContentHash::Xxh3, &|_| None).unwrap();
        let diff = compare(&before, &after, 10);
        assert_eq!(
            diff,
            vec!["/a: size 3 (recorded 5)", "/c: not in the record (added)"]
        );
    }
}
