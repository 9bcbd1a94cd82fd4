//! Layer extraction: one uncompressed OCI/Docker layer tar, streamed into a directory in the form
//! kernel overlayfs stacks, while the stream is hashed (its sha256 is the layer's diff_id).
//!
//! What the directory gets:
//! - regular files, directories, symlinks and hardlinks (to files earlier in the same layer),
//!   with their mode (setuid/setgid/sticky included: images are mounted nosuid), numeric owner,
//!   mtime and extended attributes (`security.capability` included);
//! - OCI whiteouts `.wh.NAME` become a 0/0 character device `NAME` (overlayfs' whiteout), and
//!   `.wh..wh..opq` sets `trusted.overlay.opaque=y` on its directory. Other `.wh..wh.*` entries
//!   and everything under them (AUFS bookkeeping such as `.wh..wh.plnk/`) are skipped.
//!
//! Nothing is ever written outside the directory:
//! - names are made relative (a leading `/` is dropped, `.` components are ignored) and any
//!   name with a `..` component is refused, for entries and hardlink targets alike;
//! - parent directories are opened with `openat2(RESOLVE_IN_ROOT)`: a symlink created by an
//!   earlier entry is followed as if the layer directory were `/` (what the container will see,
//!   and what Docker does), so `a -> /` then `a/etc/x` writes `<layer>/etc/x`;
//! - the last component is never followed: an existing entry is removed first (a directory only
//!   when the new entry is not one) and files are created with `O_CREAT|O_EXCL|O_NOFOLLOW`;
//! - hardlink targets are resolved the same way, so they can only name files in the layer; a
//!   hardlink whose target is not in this layer is not created here but listed in
//!   [`Extracted::external_links`]: the store copies the file up from the image's lower layers
//!   (as overlayfs does, and containerd and umoci when they apply such a layer);
//! - device nodes and fifos (other than whiteouts) are skipped with a note: images are mounted
//!   nodev, and the runtime builds the container's /dev itself;
//! - `trusted.overlay.*` attributes from the image are dropped, so a layer cannot steer
//!   overlayfs (redirects, metacopy); `security.selinux` labels are dropped too.
//!
//! The tar reader is berth's own header loop over the `tar` crate's header parser: it accepts a
//! stream that ends without the two zero blocks (as `umoci insert` writes), reads GNU long names
//! and PAX records (path, linkpath, size, uid, gid, mtime, `SCHILY.xattr.*`), and is shared with
//! the archive readers (`archive.rs`) through [`TarInput`].

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::unistd::Uid;
use sha2::Digest as _;

use self::reader::HashingInput;
pub(crate) use self::reader::{Kind, TarInput, TarReader};
use self::write::Extractor;
use crate::ImageError;
use crate::record::ContentHash;

const BLOCK: u64 = 512;
/// [`BLOCK`] as a buffer length.
const BLOCK_LEN: usize = 512;
/// Long names and PAX headers larger than this are refused (a hostile size would be allocated).
const MAX_META: u64 = 1 << 20;

/// Which bound an extraction reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// The layer's uncompressed stream passed [`Limits::max_bytes`].
    Layer,
    /// The image's layers together passed [`Limits::max_image_bytes`].
    Image,
    /// The file system's free space would drop below [`Limits::reserve_bytes`]; the bytes free.
    Reserve(u64),
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::Layer => write!(f, "the layer expands past its size bound"),
            Bound::Image => write!(f, "the image's layers expand past its size bound"),
            Bound::Reserve(free) => write!(
                f,
                "the file system's free space ({free} bytes) reached the reserve"
            ),
        }
    }
}

/// Bounds on one extraction (a hostile layer may expand a thousandfold).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most bytes of the uncompressed layer stream.
    pub max_bytes: u64,
    /// Bytes extracted so far by the whole image import (shared by its layers), and the most
    /// it may reach.
    pub image_bytes: Option<Arc<AtomicU64>>,
    pub max_image_bytes: u64,
    /// Free bytes the destination's file system keeps: extraction stops before going below.
    pub reserve_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_bytes: u64::MAX,
            image_bytes: None,
            max_image_bytes: u64::MAX,
            reserve_bytes: 0,
        }
    }
}

/// Free space is checked after this many bytes written (a quarter of the reserve when that is
/// less, so a small reserve still holds) and every [`RESERVE_CHECK_ENTRIES`] entries: a statvfs
/// costs about a microsecond.
const RESERVE_CHECK_BYTES: u64 = 8 << 20;
const RESERVE_CHECK_ENTRIES: u64 = 1024;

/// What one extraction produced.
#[derive(Clone, Debug, Default)]
pub struct Extracted {
    /// `sha256:<hex>` of the whole uncompressed stream: the layer's diff_id.
    pub diff_id: String,
    /// Length of the tar stream in bytes.
    pub tar_bytes: u64,
    /// Disk use estimate: regular files rounded up to 4 KiB blocks, plus a block per directory.
    pub disk_bytes: u64,
    /// Entries or attributes not extracted, each with the reason.
    pub skipped: Vec<String>,
    /// Every path of the extracted directory, as written (see `crate::record`).
    pub files: std::collections::BTreeMap<Vec<u8>, crate::record::FileRecord>,
    /// Hardlinks (link path, target path) whose target is not in this layer: to be copied up
    /// from the image's lower layers.
    pub external_links: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Extracts the tar stream `tar` into `dest` (an existing, empty directory) and returns its
/// diff_id. The whole stream is read, trailing blocks included, so the hash covers all of it.
pub fn extract(tar: &mut dyn Read, dest: &Path) -> Result<Extracted, ImageError> {
    extract_bounded(tar, dest, &Limits::default())
}

/// [`extract`] within `limits`: on reaching one, [`ImageError::Bound`] (the caller removes the
/// partial directory).
pub fn extract_bounded(
    tar: &mut dyn Read,
    dest: &Path,
    limits: &Limits,
) -> Result<Extracted, ImageError> {
    let root = nix::fcntl::open(
        dest,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ImageError::LayerWrite {
        path: dest.display().to_string(),
        op: "open",
        source: e.into(),
    })?;
    let mut input = HashingInput::new(tar);
    input.max = limits.max_bytes;
    input.image = limits
        .image_bytes
        .clone()
        .map(|c| (c, limits.max_image_bytes));
    let mut reader = TarReader::new(input);
    let mut x = Extractor {
        root,
        is_root: Uid::effective().is_root(),
        dirs: Vec::new(),
        out: Extracted::default(),
        buf: vec![0; 256 * 1024],
        cached: None,
        reserve: limits.reserve_bytes,
        unchecked_bytes: RESERVE_CHECK_BYTES,
        unchecked_entries: 0,
        digests: std::collections::HashMap::new(),
        pending: std::collections::BTreeMap::new(),
    };
    let result = (|| {
        while let Some(entry) = reader.next_entry().map_err(ImageError::in_layer)? {
            x.entry(&entry, &mut reader)?;
        }
        x.finish_dirs()
    })();
    let result = result.and_then(|()| reader.input.drain().map_err(ImageError::LayerRead));
    if let Err(e) = result {
        // A bound reached while reading shows up as a read error: name the bound instead.
        return Err(match reader.input.hit {
            Some(b) => ImageError::Bound(b),
            None => e,
        });
    }
    let input = reader.into_input();
    x.out.tar_bytes = input.pos;
    x.out.diff_id = format!("sha256:{:x}", input.hasher.finalize());
    let digests = std::mem::take(&mut x.digests);
    x.out.files = crate::record::walk(dest, ContentHash::default(), &|ino| {
        digests.get(&ino).cloned()
    })
    .map_err(|e| ImageError::LayerWrite {
        path: dest.display().to_string(),
        op: "record",
        source: e,
    })?;
    x.out.external_links = std::mem::take(&mut x.pending).into_iter().collect();
    Ok(x.out)
}

/// Reads the whole stream and returns its diff_id without extracting anything (used when the
/// layer is already in the store but the stream must still be consumed and verified).
pub fn hash_only(tar: &mut dyn Read) -> Result<(String, u64), ImageError> {
    let mut input = HashingInput::new(tar);
    input.drain().map_err(ImageError::LayerRead)?;
    Ok((format!("sha256:{:x}", input.hasher.finalize()), input.pos))
}

mod reader;
mod write;

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::path::PathBuf;

    use sha2::Sha256;
    use tar::{EntryType, Header};

    /// Builds tar streams entry by entry, names written raw so hostile names are possible.
    struct Tar(Vec<u8>);

    impl Tar {
        fn new() -> Self {
            Tar(Vec::new())
        }

        fn header(kind: EntryType, name: &[u8], link: &[u8], size: u64, mode: u32) -> Header {
            let mut h = Header::new_ustar();
            h.set_entry_type(kind);
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
            h.set_size(size);
            h.set_mode(mode);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_000_000);
            h.set_cksum();
            h
        }

        fn push(&mut self, h: &Header, data: &[u8]) -> &mut Self {
            self.0.extend_from_slice(h.as_bytes());
            self.0.extend_from_slice(data);
            let pad = (512 - data.len() % 512) % 512;
            self.0.extend(std::iter::repeat_n(0u8, pad));
            self
        }

        fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
            self.file_mode(name, data, 0o644)
        }

        fn file_mode(&mut self, name: &str, data: &[u8], mode: u32) -> &mut Self {
            let h = Self::header(
                EntryType::Regular,
                name.as_bytes(),
                b"",
                data.len() as u64,
                mode,
            );
            self.push(&h, data)
        }

        fn file_owned(&mut self, name: &str, data: &[u8], mode: u32, owner: u64) -> &mut Self {
            let mut h = Self::header(
                EntryType::Regular,
                name.as_bytes(),
                b"",
                data.len() as u64,
                mode,
            );
            h.set_uid(owner);
            h.set_gid(owner);
            h.set_cksum();
            self.push(&h, data)
        }

        fn dir(&mut self, name: &str) -> &mut Self {
            let h = Self::header(EntryType::Directory, name.as_bytes(), b"", 0, 0o755);
            self.push(&h, b"")
        }

        fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
            let h = Self::header(
                EntryType::Symlink,
                name.as_bytes(),
                target.as_bytes(),
                0,
                0o777,
            );
            self.push(&h, b"")
        }

        fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
            let h = Self::header(
                EntryType::Link,
                name.as_bytes(),
                target.as_bytes(),
                0,
                0o644,
            );
            self.push(&h, b"")
        }

        fn device(&mut self, kind: EntryType, name: &str, major: u32, minor: u32) -> &mut Self {
            let mut h = Self::header(kind, name.as_bytes(), b"", 0, 0o666);
            h.set_device_major(major).unwrap();
            h.set_device_minor(minor).unwrap();
            h.set_cksum();
            self.push(&h, b"")
        }

        fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Self {
            let mut data = Vec::new();
            for (k, v) in records {
                let body_len = k.len() + v.len() + 3;
                let mut len = body_len + 1;
                while len != body_len + len.to_string().len() {
                    len = body_len + len.to_string().len();
                }
                data.extend_from_slice(format!("{len} {k}=").as_bytes());
                data.extend_from_slice(v);
                data.push(b'\n');
            }
            let h = Self::header(
                EntryType::XHeader,
                b"././@PaxHeader",
                b"",
                data.len() as u64,
                0o644,
            );
            self.push(&h, &data)
        }

        fn end(&mut self) -> Vec<u8> {
            let mut v = self.0.clone();
            v.extend(std::iter::repeat_n(0u8, 1024));
            v
        }

        fn no_end(&self) -> Vec<u8> {
            self.0.clone()
        }
    }

    fn sha(bytes: &[u8]) -> String {
        format!("sha256:{:x}", Sha256::digest(bytes))
    }

    fn run(bytes: &[u8]) -> (tempfile::TempDir, PathBuf, Result<Extracted, ImageError>) {
        let tmp = tempfile::tempdir().unwrap();
        let layer = tmp.path().join("layer");
        std::fs::create_dir(&layer).unwrap();
        let r = extract(&mut &bytes[..], &layer);
        (tmp, layer, r)
    }

    #[test]
    fn files_dirs_links_modes_times_and_the_diff_id() {
        let bytes = Tar::new()
            .dir("./usr/")
            .dir("usr/bin/")
            .file_mode("usr/bin/su", b"#!/bin/sh\n", 0o4755)
            .file("etc/hosts", b"127.0.0.1 localhost\n")
            .symlink("bin", "usr/bin")
            .hardlink("usr/bin/su2", "usr/bin/su")
            .end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        assert_eq!(x.diff_id, sha(&bytes));
        assert_eq!(x.tar_bytes, bytes.len() as u64);
        assert!(x.skipped.is_empty(), "{:?}", x.skipped);
        let su = std::fs::metadata(layer.join("usr/bin/su")).unwrap();
        assert_eq!(su.permissions().mode() & 0o7777, 0o4755, "setuid bit kept");
        assert_eq!(su.mtime(), 1_000_000);
        assert_eq!(su.nlink(), 2, "su2 is a hardlink to su");
        assert_eq!(
            std::fs::read_link(layer.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        assert_eq!(
            std::fs::read_to_string(layer.join("etc/hosts")).unwrap(),
            "127.0.0.1 localhost\n"
        );
        let usr = std::fs::metadata(layer.join("usr")).unwrap();
        assert_eq!(
            usr.mtime(),
            1_000_000,
            "directory mtimes are set after their children"
        );
        assert_eq!(usr.permissions().mode() & 0o7777, 0o755);
        // A parent missing from the archive is created.
        assert!(layer.join("etc").is_dir());
    }

    #[test]
    fn dot_dot_names_are_refused_and_nothing_is_written_outside() {
        let bytes = Tar::new().file("../x", b"escape").end();
        let (t, layer, r) = run(&bytes);
        assert!(matches!(r, Err(ImageError::Refused { .. })), "{r:?}");
        assert!(!t.path().join("x").exists());
        assert_eq!(std::fs::read_dir(&layer).unwrap().count(), 0);

        let bytes = Tar::new().file("a/../../x", b"escape").end();
        let (t, _layer, r) = run(&bytes);
        assert!(matches!(r, Err(ImageError::Refused { .. })), "{r:?}");
        assert!(!t.path().join("x").exists());
    }

    #[test]
    fn absolute_names_are_made_relative_to_the_layer() {
        let host = format!("/tmp/berth-layer-test-{}-abs", std::process::id());
        let bytes = Tar::new().file(&format!("{host}/x"), b"inside").end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        assert!(!Path::new(&host).exists(), "the host's {host} was written");
        assert_eq!(
            std::fs::read(layer.join(host.trim_start_matches('/')).join("x")).unwrap(),
            b"inside"
        );
    }

    #[test]
    fn writes_through_a_symlink_to_slash_stay_in_the_layer() {
        let tmp = tempfile::tempdir().unwrap();
        let layer = tmp.path().join("layer");
        std::fs::create_dir(&layer).unwrap();
        // If `a -> /` were followed on the host, this would write <tmp>/escaped.
        let through = format!("a{}/escaped", tmp.path().display());
        let bytes = Tar::new().symlink("a", "/").file(&through, b"x").end();
        extract(&mut &bytes[..], &layer).unwrap();
        assert!(
            !tmp.path().join("escaped").exists(),
            "wrote outside the layer"
        );
        let inside = layer
            .join(tmp.path().strip_prefix("/").unwrap())
            .join("escaped");
        assert!(
            inside.is_file(),
            "resolved inside the layer: {}",
            inside.display()
        );
        // A relative symlink climbing out is clamped at the layer's root too.
        let bytes = Tar::new()
            .symlink("up", "../../../../..")
            .file(&format!("up{}/escaped2", tmp.path().display()), b"x")
            .end();
        let layer2 = tmp.path().join("layer2");
        std::fs::create_dir(&layer2).unwrap();
        extract(&mut &bytes[..], &layer2).unwrap();
        assert!(!tmp.path().join("escaped2").exists());
    }

    #[test]
    fn a_symlink_replaced_by_a_directory_is_not_followed() {
        let host = tempfile::tempdir().unwrap();
        let target = host.path().display().to_string();
        let bytes = Tar::new()
            .symlink("a", &target)
            .dir("a")
            .file("a/x", b"x")
            .end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        assert!(!host.path().join("x").exists());
        assert!(layer.join("a").is_dir() && layer.join("a/x").is_file());
    }

    #[test]
    fn hardlinks_out_of_the_layer_are_listed_for_copy_up_and_never_reach_the_host() {
        // A target outside this layer (through a symlink, or absolute) is not linked here but
        // listed: the store copies it up from the image's lower layers, read without following
        // symlinks, so /etc/passwd of the host is never linked.
        let before = std::fs::metadata("/etc/passwd").unwrap().nlink();
        let bytes = Tar::new()
            .symlink("s", "/etc")
            .hardlink("h", "s/passwd")
            .end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        assert_eq!(
            x.external_links,
            vec![(b"h".to_vec(), b"s/passwd".to_vec())]
        );
        assert!(!layer.join("h").exists());
        assert_eq!(std::fs::metadata("/etc/passwd").unwrap().nlink(), before);

        let bytes = Tar::new().hardlink("h", "../../x").end();
        let (_t, layer, r) = run(&bytes);
        assert!(matches!(r, Err(ImageError::Refused { .. })), "{r:?}");
        assert!(!layer.join("h").exists());

        let bytes = Tar::new().hardlink("h", "/etc/passwd").end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        assert_eq!(
            x.external_links,
            vec![(b"h".to_vec(), b"etc/passwd".to_vec())]
        );
        assert!(!layer.join("h").exists());
        assert_eq!(std::fs::metadata("/etc/passwd").unwrap().nlink(), before);

        // A link to such a link follows it to the lower file; a later file of the same name
        // replaces a pending link.
        let bytes = Tar::new()
            .hardlink("a", "usr/bin/x")
            .hardlink("b", "a")
            .hardlink("c", "usr/bin/y")
            .file("c", b"own")
            .end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        assert_eq!(
            x.external_links,
            vec![
                (b"a".to_vec(), b"usr/bin/x".to_vec()),
                (b"b".to_vec(), b"usr/bin/x".to_vec())
            ]
        );
        assert_eq!(std::fs::read(layer.join("c")).unwrap(), b"own");
    }

    #[test]
    fn extraction_records_every_path_with_its_digest() {
        let bytes = Tar::new()
            .dir("d")
            .file_mode("d/f", b"hello", 0o4755)
            .hardlink("d/g", "d/f")
            .symlink("l", "d/f")
            .end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        let f = &x.files[&b"d/f".to_vec()];
        assert_eq!((f.kind, f.size, f.mode), ('f', 5, 0o4755));
        assert_eq!(f.digest, Some(ContentHash::default().digest(b"hello")));
        assert_eq!(x.files[&b"d/g".to_vec()].digest, f.digest);
        assert_eq!(x.files[&b"l".to_vec()].kind, 'l');
        assert_eq!(x.files[&b"d".to_vec()].kind, 'd');
        // What verification computes by reading the files agrees.
        let read = crate::record::walk(&layer, ContentHash::default(), &|_| None).unwrap();
        assert_eq!(read, x.files);
    }

    #[test]
    fn bounds_stop_extraction() {
        let big = vec![7u8; 100_000];
        let bytes = Tar::new().file("a", &big).file("b", &big).end();
        let (_t, layer, r) = {
            let t = tempfile::tempdir().unwrap();
            let layer = t.path().join("layer");
            std::fs::create_dir(&layer).unwrap();
            let limits = Limits {
                max_bytes: 150_000,
                ..Limits::default()
            };
            let r = extract_bounded(&mut &bytes[..], &layer, &limits);
            (t, layer, r)
        };
        assert!(matches!(r, Err(ImageError::Bound(Bound::Layer))), "{r:?}");
        drop(layer);
        let total = Arc::new(AtomicU64::new(0));
        let limits = Limits {
            image_bytes: Some(total.clone()),
            max_image_bytes: 300_000,
            ..Limits::default()
        };
        let t = tempfile::tempdir().unwrap();
        let (l1, l2) = (t.path().join("1"), t.path().join("2"));
        std::fs::create_dir(&l1).unwrap();
        std::fs::create_dir(&l2).unwrap();
        extract_bounded(&mut &bytes[..], &l1, &limits).unwrap();
        let r = extract_bounded(&mut &bytes[..], &l2, &limits);
        assert!(matches!(r, Err(ImageError::Bound(Bound::Image))), "{r:?}");
        let limits = Limits {
            reserve_bytes: u64::MAX,
            ..Limits::default()
        };
        let l3 = t.path().join("3");
        std::fs::create_dir(&l3).unwrap();
        let r = extract_bounded(&mut &bytes[..], &l3, &limits);
        assert!(
            matches!(r, Err(ImageError::Bound(Bound::Reserve(_)))),
            "{r:?}"
        );
    }

    #[test]
    fn a_hardlink_to_a_symlink_links_the_symlink_itself() {
        let bytes = Tar::new()
            .symlink("s", "/etc/passwd")
            .hardlink("h", "s")
            .end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        let m = std::fs::symlink_metadata(layer.join("h")).unwrap();
        assert!(m.file_type().is_symlink());
        assert_eq!(m.nlink(), 2);
    }

    #[test]
    fn device_nodes_and_fifos_are_skipped_with_a_note() {
        let bytes = Tar::new()
            .device(EntryType::Char, "dev/mem", 1, 1)
            .device(EntryType::Block, "dev/sda", 8, 0)
            .device(EntryType::Fifo, "run/fifo", 0, 0)
            .file("ok", b"ok")
            .end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        assert!(!layer.join("dev/mem").exists());
        assert!(!layer.join("dev/sda").exists());
        assert!(!layer.join("run/fifo").exists());
        assert!(layer.join("ok").exists());
        assert_eq!(x.skipped.len(), 3, "{:?}", x.skipped);
        assert!(x.skipped[0].contains("dev/mem") && x.skipped[0].contains("1:1"));
        assert!(x.skipped[2].contains("fifo"));
    }

    #[test]
    fn a_stream_without_end_blocks_is_accepted_and_hashed_whole() {
        let t = {
            let mut t = Tar::new();
            t.dir("d").file("d/f", b"hello");
            t
        };
        let bytes = t.no_end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        assert_eq!(x.diff_id, sha(&bytes));
        assert_eq!(std::fs::read(layer.join("d/f")).unwrap(), b"hello");
        // Even the last entry's padding may be missing.
        let unpadded = &bytes[..bytes.len() - (512 - 5)];
        let (_t, layer, r) = run(unpadded);
        assert_eq!(r.unwrap().diff_id, sha(unpadded));
        assert_eq!(std::fs::read(layer.join("d/f")).unwrap(), b"hello");
    }

    #[test]
    fn a_stream_cut_inside_a_file_is_an_error() {
        let bytes = Tar::new().file("big", &[7u8; 2000]).end();
        let (_t, _layer, r) = run(&bytes[..512 + 1000]);
        assert!(matches!(r, Err(ImageError::LayerFormat { .. })), "{r:?}");
        let (_t, _layer, r) = run(&bytes[..300]);
        assert!(matches!(r, Err(ImageError::LayerFormat { .. })), "{r:?}");
    }

    #[test]
    fn trailing_blocks_after_the_end_are_part_of_the_diff_id() {
        let mut bytes = Tar::new().file("f", b"x").end();
        bytes.extend(std::iter::repeat_n(0u8, 8192));
        let (_t, _layer, r) = run(&bytes);
        let x = r.unwrap();
        assert_eq!(x.diff_id, sha(&bytes));
        assert_eq!(x.tar_bytes, bytes.len() as u64);
    }

    #[test]
    fn a_file_replaces_an_earlier_directory_and_vice_versa() {
        let bytes = Tar::new()
            .dir("d")
            .file("d/inner", b"1")
            .file("d", b"now a file")
            .file("e", b"file first")
            .dir("e")
            .file("e/x", b"2")
            .end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        assert_eq!(std::fs::read(layer.join("d")).unwrap(), b"now a file");
        assert!(layer.join("e").is_dir() && layer.join("e/x").is_file());
    }

    #[test]
    fn modes_and_owners_the_create_does_not_give_are_set_after() {
        let bytes = Tar::new()
            .file_mode("open", b"1", 0o666)
            .file_mode("none", b"2", 0o000)
            .file_owned("setgid", b"3", 0o2755, 1000)
            .file_owned("user", b"4", 0o644, 1000)
            .file("plain", b"5")
            .end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        let meta = |n: &str| std::fs::metadata(layer.join(n)).unwrap();
        assert_eq!(
            meta("open").permissions().mode() & 0o7777,
            0o666,
            "past the umask"
        );
        assert_eq!(meta("none").permissions().mode() & 0o7777, 0o000);
        assert_eq!(
            meta("setgid").permissions().mode() & 0o7777,
            0o2755,
            "after the chown"
        );
        assert_eq!(meta("plain").permissions().mode() & 0o7777, 0o644);
        if nix::unistd::Uid::effective().is_root() {
            for n in ["setgid", "user"] {
                assert_eq!((meta(n).uid(), meta(n).gid()), (1000, 1000), "{n}");
            }
            assert_eq!((meta("plain").uid(), meta("plain").gid()), (0, 0));
        }
    }

    #[test]
    fn a_file_replacing_a_file_or_a_symlink_never_writes_through_it() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, b"host").unwrap();
        let bytes = Tar::new()
            .file("f", b"first")
            .file("f", b"second")
            .symlink("l", outside.to_str().unwrap())
            .file("l", b"replaced")
            .end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        assert_eq!(std::fs::read(layer.join("f")).unwrap(), b"second");
        assert_eq!(std::fs::read(layer.join("l")).unwrap(), b"replaced");
        assert!(!layer.join("l").is_symlink());
        assert_eq!(std::fs::read(&outside).unwrap(), b"host");
    }

    #[test]
    fn a_file_replacing_a_hardlinked_file_gets_a_new_inode() {
        let bytes = Tar::new()
            .file("a", b"original")
            .hardlink("b", "a")
            .file("b", b"replaced")
            .end();
        let (_t, layer, r) = run(&bytes);
        r.unwrap();
        assert_eq!(std::fs::read(layer.join("a")).unwrap(), b"original");
        assert_eq!(std::fs::read(layer.join("b")).unwrap(), b"replaced");
    }

    #[test]
    fn pax_and_gnu_long_names_and_xattrs() {
        let long = format!("{}/file", "d".repeat(150));
        let mut t = Tar::new();
        t.pax(&[
            ("path", long.as_bytes()),
            ("mtime", b"1234.5"),
            ("SCHILY.xattr.user.origin", b"berth"),
            ("SCHILY.xattr.trusted.overlay.redirect", b"/etc"),
        ])
        .file("placeholder", b"pax");
        // The tar crate writes a GNU long-name record for names over 100 bytes.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(EntryType::Regular);
        let gnu_long = format!("{}/gnu", "g".repeat(120));
        b.append_data(&mut h, &gnu_long, &b"gnu"[..]).unwrap();
        t.0.extend_from_slice(&b.into_inner().unwrap());
        let bytes = t.end();
        let (_t, layer, r) = run(&bytes);
        let x = r.unwrap();
        let f = layer.join(&long);
        assert_eq!(std::fs::read(&f).unwrap(), b"pax");
        assert_eq!(std::fs::metadata(&f).unwrap().mtime(), 1234);
        assert_eq!(std::fs::metadata(&f).unwrap().mtime_nsec(), 500_000_000);
        assert_eq!(std::fs::read(layer.join(&gnu_long)).unwrap(), b"gnu");
        assert!(
            x.skipped
                .iter()
                .any(|s| s.contains("trusted.overlay.redirect")),
            "{:?}",
            x.skipped
        );
        let mut value = [0u8; 16];
        let path = CString::new(f.as_os_str().as_bytes()).unwrap();
        // SAFETY: path and name are NUL-terminated; value is a writable buffer of its length.
        let n = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                c"user.origin".as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        // tmpfs before 6.6 has no user xattrs: then the attribute is noted as skipped.
        if n >= 0 {
            assert_eq!(&value[..usize::try_from(n).unwrap()], b"berth");
        } else {
            assert!(x.skipped.iter().any(|s| s.contains("user.origin")));
        }
        // SAFETY: as above.
        let n = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                c"trusted.overlay.redirect".as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        assert!(n < 0, "trusted.overlay.* from an image must not be set");
    }

    #[test]
    fn garbage_is_not_a_tar_stream() {
        let bytes = vec![b'x'; 4096];
        let (_t, _layer, r) = run(&bytes);
        assert!(matches!(r, Err(ImageError::LayerFormat { .. })), "{r:?}");
    }

    #[test]
    fn sparse_files_are_refused() {
        let h = Tar::header(EntryType::GNUSparse, b"sparse", b"", 0, 0o644);
        let bytes = Tar::new().push(&h, b"").end();
        let (_t, _layer, r) = run(&bytes);
        assert!(matches!(r, Err(ImageError::LayerFormat { .. })), "{r:?}");
    }

    #[test]
    fn hash_only_matches_extract() {
        let bytes = Tar::new().file("f", b"abc").end();
        let (id, n) = hash_only(&mut &bytes[..]).unwrap();
        assert_eq!(id, sha(&bytes));
        assert_eq!(n, bytes.len() as u64);
    }
}
