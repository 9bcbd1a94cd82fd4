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

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat, openat2};
use nix::sys::stat::{
    Mode, SFlag, UtimensatFlags, fchmod, fstatat, futimens, makedev, mkdirat, mknodat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, symlinkat, unlinkat};
use sha2::{Digest as _, Sha256};
use tar::{EntryType, Header};

const BLOCK: u64 = 512;
/// [`BLOCK`] as a buffer length.
const BLOCK_LEN: usize = 512;
/// Long names and PAX headers larger than this are refused (a hostile size would be allocated).
const MAX_META: u64 = 1 << 20;

/// Why a layer could not be extracted. The store adds which layer and image.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Reading the stream failed (decompression, network, file).
    #[error("reading the layer stream: {0}")]
    Read(#[source] io::Error),
    /// The stream is not a tar archive berth can read.
    #[error("not a valid tar stream at byte {offset}: {why}")]
    Format { offset: u64, why: String },
    /// An entry was refused because it would reach outside the layer or is malformed.
    #[error("refused tar entry '{path}': {why}")]
    Refused { path: String, why: String },
    /// A bound of the store was reached; the store names the key.
    #[error("{0}")]
    Bound(Bound),
    /// Writing the entry into the layer directory failed.
    #[error("writing '{path}' ({op}): {source}")]
    Write {
        path: String,
        op: &'static str,
        source: io::Error,
    },
}

impl LayerError {
    /// The file system ran out of space (or quota) while writing.
    pub fn is_no_space(&self) -> bool {
        matches!(self, LayerError::Write { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

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
    /// Every path of the extracted directory, as written (see `store::record`).
    pub files: std::collections::BTreeMap<Vec<u8>, crate::store::record::FileRecord>,
    /// Hardlinks (link path, target path) whose target is not in this layer: to be copied up
    /// from the image's lower layers.
    pub external_links: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Extracts the tar stream `tar` into `dest` (an existing, empty directory) and returns its
/// diff_id. The whole stream is read, trailing blocks included, so the hash covers all of it.
pub fn extract(tar: &mut dyn Read, dest: &Path) -> Result<Extracted, LayerError> {
    extract_bounded(tar, dest, &Limits::default())
}

/// [`extract`] within `limits`: on reaching one, [`LayerError::Bound`] (the caller removes the
/// partial directory).
pub fn extract_bounded(
    tar: &mut dyn Read,
    dest: &Path,
    limits: &Limits,
) -> Result<Extracted, LayerError> {
    let root = nix::fcntl::open(
        dest,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| LayerError::Write {
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
        while let Some(entry) = reader.next_entry().map_err(LayerError::from)? {
            x.entry(&entry, &mut reader)?;
        }
        x.finish_dirs()
    })();
    let result = result.and_then(|()| reader.input.drain().map_err(LayerError::Read));
    if let Err(e) = result {
        // A bound reached while reading shows up as a read error: name the bound instead.
        return Err(match reader.input.hit {
            Some(b) => LayerError::Bound(b),
            None => e,
        });
    }
    let input = reader.into_input();
    x.out.tar_bytes = input.pos;
    x.out.diff_id = format!("sha256:{:x}", input.hasher.finalize());
    let digests = std::mem::take(&mut x.digests);
    x.out.files =
        crate::store::record::walk(dest, &|ino| digests.get(&ino).cloned()).map_err(|e| {
            LayerError::Write {
                path: dest.display().to_string(),
                op: "record",
                source: e,
            }
        })?;
    x.out.external_links = std::mem::take(&mut x.pending).into_iter().collect();
    Ok(x.out)
}

/// Reads the whole stream and returns its diff_id without extracting anything (used when the
/// layer is already in the store but the stream must still be consumed and verified).
pub fn hash_only(tar: &mut dyn Read) -> Result<(String, u64), LayerError> {
    let mut input = HashingInput::new(tar);
    input.drain().map_err(LayerError::Read)?;
    Ok((format!("sha256:{:x}", input.hasher.finalize()), input.pos))
}

// ---------------------------------------------------------------------------------------------
// The tar header loop

/// A byte source for [`TarReader`]: a stream that must be hashed as it is read (a layer), or a
/// seekable archive file where skipping is free.
pub(crate) trait TarInput {
    /// Reads until `buf` is full or the input ends; returns the bytes read.
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Skips up to `n` bytes; returns how many were skipped before the input ended.
    fn skip(&mut self, n: u64) -> io::Result<u64>;
    /// Bytes consumed so far.
    fn position(&self) -> u64;
}

/// Hashes and counts everything read from a stream.
struct HashingInput<'a> {
    inner: &'a mut dyn Read,
    hasher: Sha256,
    pos: u64,
    scratch: Vec<u8>,
    /// Most bytes this stream may have.
    max: u64,
    /// The image's running total and its bound.
    image: Option<(Arc<AtomicU64>, u64)>,
    /// The bound reached, if any (reads fail from then on).
    hit: Option<Bound>,
}

impl<'a> HashingInput<'a> {
    fn new(inner: &'a mut dyn Read) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            pos: 0,
            scratch: Vec::new(),
            max: u64::MAX,
            image: None,
            hit: None,
        }
    }

    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.inner.read(buf) {
                Ok(n) => {
                    self.hasher.update(&buf[..n]);
                    self.pos += n as u64;
                    if self.pos > self.max {
                        self.hit = Some(Bound::Layer);
                    }
                    if let Some((total, max)) = &self.image
                        && total.fetch_add(n as u64, Ordering::Relaxed) + n as u64 > *max
                    {
                        self.hit = Some(Bound::Image);
                    }
                    if self.hit.is_some() {
                        return Err(io::Error::other("a bound of the image store was reached"));
                    }
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn drain(&mut self) -> io::Result<()> {
        while self.skip(u64::MAX)? == u64::MAX {}
        Ok(())
    }
}

impl TarInput for HashingInput<'_> {
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let n = self.read_some(&mut buf[done..])?;
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(done)
    }

    fn skip(&mut self, n: u64) -> io::Result<u64> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(64 * 1024, 0);
        let mut left = n;
        let result = loop {
            if left == 0 {
                break Ok(n);
            }
            let want = usize::try_from(left)
                .unwrap_or(usize::MAX)
                .min(scratch.len());
            match self.read_some(&mut scratch[..want]) {
                Ok(0) => break Ok(n - left),
                Ok(got) => left -= got as u64,
                Err(e) => break Err(e),
            }
        };
        self.scratch = scratch;
        result
    }

    fn position(&self) -> u64 {
        self.pos
    }
}

/// A tar format problem or a read error, before it is given layer or archive context.
#[derive(Debug)]
pub(crate) enum TarError {
    Io(io::Error),
    Format { offset: u64, why: String },
}

impl From<TarError> for LayerError {
    fn from(e: TarError) -> Self {
        match e {
            TarError::Io(e) => LayerError::Read(e),
            TarError::Format { offset, why } => LayerError::Format { offset, why },
        }
    }
}

impl std::fmt::Display for TarError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TarError::Io(e) => write!(f, "{e}"),
            TarError::Format { offset, why } => write!(f, "at byte {offset}: {why}"),
        }
    }
}

/// The kind of a tar entry, after the extension headers are folded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    File,
    Dir,
    Symlink,
    Hardlink,
    Char,
    Block,
    Fifo,
    Other(u8),
}

/// One tar entry's header, with GNU long names and PAX records applied.
#[derive(Clone, Debug)]
pub(crate) struct TarEntry {
    pub path: Vec<u8>,
    pub link: Vec<u8>,
    pub kind: Kind,
    pub size: u64,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: (i64, u32),
    pub dev: (u32, u32),
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Offset of the entry's data in the input.
    pub data_offset: u64,
}

impl TarEntry {
    pub fn path_lossy(&self) -> String {
        String::from_utf8_lossy(&self.path).into_owned()
    }
}

#[derive(Default)]
struct Extensions {
    path: Option<Vec<u8>>,
    link: Option<Vec<u8>>,
    size: Option<u64>,
    uid: Option<u64>,
    gid: Option<u64>,
    mtime: Option<(i64, u32)>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    sparse: bool,
}

/// Iterates the entries of a tar stream. After [`TarReader::next_entry`] returns an entry, its
/// data can be read with [`TarReader::read_data`]; whatever is not read is skipped.
pub(crate) struct TarReader<I> {
    input: I,
    data_left: u64,
    pad_left: u64,
    ended: bool,
}

impl<I: TarInput> TarReader<I> {
    pub fn new(input: I) -> Self {
        Self {
            input,
            data_left: 0,
            pad_left: 0,
            ended: false,
        }
    }

    pub fn into_input(self) -> I {
        self.input
    }

    fn bad(&self, why: impl Into<String>) -> TarError {
        TarError::Format {
            offset: self.input.position(),
            why: why.into(),
        }
    }

    /// Reads from the current entry's data; 0 at its end.
    pub fn read_data(&mut self, buf: &mut [u8]) -> Result<usize, TarError> {
        if self.data_left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = usize::try_from(self.data_left)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.input.fill(&mut buf[..want]).map_err(TarError::Io)?;
        if n == 0 {
            return Err(self.bad(format!(
                "the stream ends {} bytes before the end of an entry",
                self.data_left
            )));
        }
        self.data_left -= n as u64;
        Ok(n)
    }

    fn read_meta(&mut self, size: u64) -> Result<Vec<u8>, TarError> {
        if size > MAX_META {
            return Err(self.bad(format!("extension header of {size} bytes is too large")));
        }
        #[expect(
            clippy::cast_possible_truncation,
            reason = "size is at most MAX_META (1 MiB), checked above"
        )]
        let mut data = vec![0; size as usize];
        let n = self.input.fill(&mut data).map_err(TarError::Io)?;
        if n < data.len() {
            return Err(self.bad("the stream ends inside an extension header"));
        }
        self.data_left = 0;
        self.skip_padding(size)?;
        Ok(data)
    }

    fn skip_padding(&mut self, size: u64) -> Result<(), TarError> {
        let pad = (BLOCK - size % BLOCK) % BLOCK;
        // A stream may end right after the last entry's data, without padding or end blocks.
        if self.input.skip(pad).map_err(TarError::Io)? < pad {
            self.ended = true;
        }
        Ok(())
    }

    /// The next entry, or `None` at the end of the archive (end blocks or the stream's end).
    pub fn next_entry(&mut self) -> Result<Option<TarEntry>, TarError> {
        if self.data_left > 0 {
            let left = self.data_left;
            if self.input.skip(left).map_err(TarError::Io)? < left {
                return Err(self.bad("the stream ends inside an entry's data"));
            }
            self.data_left = 0;
        }
        if self.pad_left > 0 {
            let pad = self.pad_left;
            self.pad_left = 0;
            if self.input.skip(pad).map_err(TarError::Io)? < pad {
                self.ended = true;
            }
        }
        let mut ext = Extensions::default();
        loop {
            if self.ended {
                return Ok(None);
            }
            let header_offset = self.input.position();
            let mut block = [0u8; BLOCK_LEN];
            let n = self.input.fill(&mut block).map_err(TarError::Io)?;
            if n == 0 {
                // No end-of-archive blocks: accepted (umoci insert writes such layers).
                self.ended = true;
                return Ok(None);
            }
            if n < block.len() {
                return Err(self.bad("the stream ends inside a header block"));
            }
            if block.iter().all(|b| *b == 0) {
                self.ended = true;
                return Ok(None);
            }
            let header = Header::from_byte_slice(&block);
            check_checksum(&block).map_err(|why| TarError::Format {
                offset: header_offset,
                why,
            })?;
            // Empty numeric fields (all NUL or spaces) mean 0, as Go's and GNU's readers take them.
            let field = |r: io::Result<u64>, raw: &[u8], what: &str| {
                if raw.iter().all(|b| *b == 0 || *b == b' ') {
                    return Ok(0);
                }
                r.map_err(|e| TarError::Format {
                    offset: header_offset,
                    why: format!("bad {what} field: {e}"),
                })
            };
            let old = header.as_old();
            let size = field(header.entry_size(), &old.size, "size")?;
            match header.entry_type() {
                EntryType::GNULongName => {
                    let mut data = self.read_meta(size)?;
                    trim_nul(&mut data);
                    ext.path = Some(data);
                    continue;
                }
                EntryType::GNULongLink => {
                    let mut data = self.read_meta(size)?;
                    trim_nul(&mut data);
                    ext.link = Some(data);
                    continue;
                }
                EntryType::XHeader => {
                    let data = self.read_meta(size)?;
                    parse_pax(&data, &mut ext).map_err(|why| TarError::Format {
                        offset: header_offset,
                        why,
                    })?;
                    continue;
                }
                EntryType::XGlobalHeader => {
                    // Global records (git archive's comment) carry nothing berth applies.
                    self.read_meta(size)?;
                    continue;
                }
                EntryType::GNUSparse => {
                    return Err(TarError::Format {
                        offset: header_offset,
                        why: format!(
                            "'{}' is a GNU sparse file, which berth does not support",
                            String::from_utf8_lossy(&header.path_bytes())
                        ),
                    });
                }
                _ => {}
            }
            if ext.sparse {
                return Err(TarError::Format {
                    offset: header_offset,
                    why: "PAX sparse files are not supported".into(),
                });
            }
            let path = ext
                .path
                .take()
                .unwrap_or_else(|| header.path_bytes().into_owned());
            let link = ext
                .link
                .take()
                .or_else(|| header.link_name_bytes().map(|l| l.into_owned()))
                .unwrap_or_default();
            let size = ext.size.unwrap_or(size);
            let kind = match header.entry_type() {
                EntryType::Regular | EntryType::Continuous if path.ends_with(b"/") => Kind::Dir,
                EntryType::Regular | EntryType::Continuous => Kind::File,
                EntryType::Directory => Kind::Dir,
                EntryType::Symlink => Kind::Symlink,
                EntryType::Link => Kind::Hardlink,
                EntryType::Char => Kind::Char,
                EntryType::Block => Kind::Block,
                EntryType::Fifo => Kind::Fifo,
                other => Kind::Other(other.as_byte()),
            };
            let dev = if matches!(kind, Kind::Char | Kind::Block) {
                (
                    header.device_major().ok().flatten().unwrap_or(0),
                    header.device_minor().ok().flatten().unwrap_or(0),
                )
            } else {
                (0, 0)
            };
            let entry = TarEntry {
                path,
                link,
                kind,
                // Only regular files carry data; a size on other kinds is still skipped.
                size,
                mode: header.mode().unwrap_or(0o644),
                uid: match ext.uid {
                    Some(u) => u,
                    None => field(header.uid(), &old.uid, "uid")?,
                },
                gid: match ext.gid {
                    Some(g) => g,
                    None => field(header.gid(), &old.gid, "gid")?,
                },
                mtime: match ext.mtime {
                    Some(m) => m,
                    None => (
                        i64::try_from(field(header.mtime(), &old.mtime, "mtime")?).map_err(
                            |_| TarError::Format {
                                offset: header_offset,
                                why: "bad mtime field: out of range".into(),
                            },
                        )?,
                        0,
                    ),
                },
                dev,
                xattrs: std::mem::take(&mut ext.xattrs),
                data_offset: self.input.position(),
            };
            // Hardlinks, symlinks and directories have no data even if a size is recorded
            // (POSIX lets hardlinks carry one; readers skip it like any other data).
            self.data_left = size;
            self.pad_left = (BLOCK - size % BLOCK) % BLOCK;
            return Ok(Some(entry));
        }
    }
}

fn trim_nul(data: &mut Vec<u8>) {
    while data.last() == Some(&0) {
        data.pop();
    }
}

fn check_checksum(block: &[u8; BLOCK_LEN]) -> Result<(), String> {
    let field = &block[148..156];
    let text: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|b| *b == b' ')
        .take_while(|b| (b'0'..=b'7').contains(b))
        .collect();
    let stored = std::str::from_utf8(&text)
        .ok()
        .and_then(|t| u32::from_str_radix(t, 8).ok())
        .ok_or_else(|| "header checksum field is not a number (not a tar stream?)".to_string())?;
    let unsigned: u32 = block
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if (148..156).contains(&i) {
                32
            } else {
                u32::from(*b)
            }
        })
        .sum();
    let signed: i32 = block
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if (148..156).contains(&i) {
                32
            } else {
                i32::from(b.cast_signed())
            }
        })
        .sum();
    if stored == unsigned || i64::from(stored) == i64::from(signed) {
        Ok(())
    } else {
        Err("header checksum mismatch (not a tar stream, or a corrupt one)".into())
    }
}

fn parse_pax(data: &[u8], ext: &mut Extensions) -> Result<(), String> {
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest
            .iter()
            .position(|b| *b == b' ')
            .ok_or("PAX record without a length")?;
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("PAX record with a bad length")?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err("PAX record with a bad length".into());
        }
        let record = &rest[space + 1..len - 1];
        rest = &rest[len..];
        let eq = record
            .iter()
            .position(|b| *b == b'=')
            .ok_or("PAX record without '='")?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        let number = |v: &[u8]| -> Result<u64, String> {
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("PAX {} is not a number", String::from_utf8_lossy(key)))
        };
        match key {
            b"path" => ext.path = Some(value.to_vec()),
            b"linkpath" => ext.link = Some(value.to_vec()),
            b"size" => ext.size = Some(number(value)?),
            b"uid" => ext.uid = Some(number(value)?),
            b"gid" => ext.gid = Some(number(value)?),
            b"mtime" => ext.mtime = Some(parse_pax_time(value)?),
            _ if key.starts_with(b"SCHILY.xattr.") => ext
                .xattrs
                .push((key[b"SCHILY.xattr.".len()..].to_vec(), value.to_vec())),
            _ if key.starts_with(b"GNU.sparse.") => ext.sparse = true,
            _ => {}
        }
    }
    Ok(())
}

fn parse_pax_time(v: &[u8]) -> Result<(i64, u32), String> {
    let text = std::str::from_utf8(v).map_err(|_| "PAX mtime is not text".to_string())?;
    let bad = || format!("PAX mtime '{text}' is not a time");
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    let secs: i64 = secs.parse().map_err(|_| bad())?;
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let mut nanos = 0u32;
    for (i, d) in (0u32..).zip(frac.bytes().take(9)) {
        nanos += u32::from(d - b'0') * 10u32.pow(8 - i);
    }
    Ok((secs, nanos))
}

// ---------------------------------------------------------------------------------------------
// Writing entries

/// Splits an entry name into safe components: no leading `/`, no `.`, never `..`.
fn components(raw: &[u8]) -> Result<Vec<&[u8]>, String> {
    if raw.contains(&0) {
        return Err("the name contains a NUL byte".into());
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("the name has a '..' component".into()),
            _ => out.push(c),
        }
    }
    Ok(out)
}

fn join(comps: &[&[u8]]) -> Vec<u8> {
    comps.join(&b'/')
}

fn cstr(bytes: &[u8]) -> CString {
    // Components never contain NUL: `components` refuses such names.
    CString::new(bytes).unwrap_or_default()
}

/// A tar entry's uid or gid as the kernel's 32-bit id; a larger one is refused.
fn id32(id: u64, what: &str, rel: &[u8]) -> Result<u32, LayerError> {
    u32::try_from(id).map_err(|_| LayerError::Refused {
        path: String::from_utf8_lossy(rel).into_owned(),
        why: format!("{what} {id} is out of range (ids are 32-bit)"),
    })
}

fn io_err(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

fn proc_path(fd: BorrowedFd<'_>, name: &[u8]) -> PathBuf {
    let mut p = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    if !name.is_empty() {
        p.push(std::ffi::OsStr::from_bytes(name));
    }
    p
}

/// Whether an image may set this extended attribute.
fn xattr_allowed(name: &[u8]) -> bool {
    if name.starts_with(b"trusted.overlay.") {
        return false;
    }
    name.starts_with(b"user.")
        || name.starts_with(b"trusted.")
        || name == b"security.capability"
        || name == b"system.posix_acl_access"
        || name == b"system.posix_acl_default"
}

fn set_xattr_fd(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: fd is an open descriptor, name is NUL-terminated and value/len describe a valid
    // slice that the kernel only reads.
    let rc = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn set_xattr_nofollow(path: &Path, name: &CStr, value: &[u8]) -> io::Result<()> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: path and name are NUL-terminated strings and value/len a valid slice; lsetxattr
    // does not follow the final symlink.
    let rc = unsafe {
        libc::lsetxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

struct Extractor {
    root: OwnedFd,
    is_root: bool,
    /// Directories whose mode and mtime are set at the end (writing children changes mtimes).
    dirs: Vec<(Vec<u8>, u32, (i64, u32))>,
    out: Extracted,
    buf: Vec<u8>,
    /// The last parent directory opened, by relative path.
    cached: Option<(Vec<u8>, OwnedFd)>,
    /// Free bytes the file system keeps, and the bytes and entries written since it was last
    /// checked.
    reserve: u64,
    unchecked_bytes: u64,
    unchecked_entries: u64,
    /// sha256 hex of each regular file written, by inode (hardlinks share it).
    digests: std::collections::HashMap<u64, String>,
    /// Hardlinks to targets outside this layer: link path → target path.
    pending: std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Extractor {
    /// Fails when the file system's free space is below the reserve (checked every few MiB
    /// written and every few entries, so a bomb stops near the reserve, not at ENOSPC).
    fn check_reserve(&mut self, written: u64) -> Result<(), LayerError> {
        if self.reserve == 0 {
            return Ok(());
        }
        self.unchecked_bytes += written;
        if written == 0 {
            self.unchecked_entries += 1;
        }
        let every = RESERVE_CHECK_BYTES.min((self.reserve / 4).max(64 << 10));
        if self.unchecked_bytes < every && self.unchecked_entries < RESERVE_CHECK_ENTRIES {
            return Ok(());
        }
        self.unchecked_bytes = 0;
        self.unchecked_entries = 0;
        let st = nix::sys::statvfs::fstatvfs(&self.root)
            .map_err(|e| Self::write_err(b".", "statvfs", io_err(e)))?;
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        if free < self.reserve {
            return Err(LayerError::Bound(Bound::Reserve(free)));
        }
        Ok(())
    }

    fn refuse(entry: &TarEntry, why: impl Into<String>) -> LayerError {
        LayerError::Refused {
            path: entry.path_lossy(),
            why: why.into(),
        }
    }

    fn write_err(path: &[u8], op: &'static str, e: impl Into<io::Error>) -> LayerError {
        LayerError::Write {
            path: String::from_utf8_lossy(path).into_owned(),
            op,
            source: e.into(),
        }
    }

    fn open_in_root(&self, rel: &[u8], flags: OFlag) -> Result<OwnedFd, Errno> {
        if rel.is_empty() {
            return self
                .root
                .try_clone()
                .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)));
        }
        let how = OpenHow::new().flags(flags | OFlag::O_CLOEXEC).resolve(
            ResolveFlag::RESOLVE_IN_ROOT
                | ResolveFlag::RESOLVE_NO_MAGICLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        );
        openat2(self.root.as_fd(), &cstr(rel)[..], how)
    }

    /// Opens the directory `comps` (relative to the layer, symlinks resolved inside it),
    /// creating missing directories (0755, root-owned) when `create` is set.
    fn dir(&mut self, comps: &[&[u8]], create: bool) -> Result<OwnedFd, LayerError> {
        let rel = join(comps);
        if let Some((path, fd)) = &self.cached
            && *path == rel
        {
            return fd.try_clone().map_err(|e| Self::write_err(&rel, "dup", e));
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
        let fd = match self.open_in_root(&rel, flags) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) if create => {
                let mut cur = self
                    .open_in_root(b"", flags)
                    .map_err(|e| Self::write_err(b"", "open", io_err(e)))?;
                for i in 0..comps.len() {
                    let prefix = join(&comps[..=i]);
                    cur = match self.open_in_root(&prefix, flags) {
                        Ok(fd) => fd,
                        Err(Errno::ENOENT) => {
                            match mkdirat(
                                cur.as_fd(),
                                &cstr(comps[i])[..],
                                Mode::from_bits_truncate(0o755),
                            ) {
                                Ok(()) | Err(Errno::EEXIST) => {}
                                Err(e) => return Err(Self::write_err(&prefix, "mkdir", io_err(e))),
                            }
                            self.open_in_root(&prefix, flags).map_err(|e| {
                                Self::write_err(&prefix, "open directory", io_err(e))
                            })?
                        }
                        Err(e) => {
                            return Err(Self::write_err(&prefix, "open directory", io_err(e)));
                        }
                    };
                }
                cur
            }
            Err(e) => return Err(Self::write_err(&rel, "open directory", io_err(e))),
        };
        let copy = fd
            .try_clone()
            .map_err(|e| Self::write_err(&rel, "dup", e))?;
        self.cached = Some((rel, copy));
        Ok(fd)
    }

    /// Removes whatever is at `parent/name` unless it is a directory and `keep_dir` is set;
    /// returns whether a directory was kept.
    fn clear(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        rel: &[u8],
        keep_dir: bool,
    ) -> Result<bool, LayerError> {
        let c = cstr(name);
        match fstatat(parent.as_fd(), &c[..], AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(Self::write_err(rel, "stat", io_err(e))),
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
                if keep_dir {
                    return Ok(true);
                }
                // The cached parent may be inside the tree being removed.
                self.cached = None;
                // remove_dir_all never follows symlinks; the parent is pinned by its fd.
                std::fs::remove_dir_all(proc_path(parent.as_fd(), name))
                    .map_err(|e| Self::write_err(rel, "remove directory", e))?;
                Ok(false)
            }
            Ok(_) => {
                // A cached parent may have been resolved through a symlink being replaced.
                self.cached = None;
                unlinkat(parent.as_fd(), &c[..], UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| Self::write_err(rel, "remove", io_err(e)))?;
                Ok(false)
            }
        }
    }

    fn chown(
        &self,
        fd: BorrowedFd<'_>,
        name: Option<&[u8]>,
        e: &TarEntry,
        rel: &[u8],
    ) -> Result<(), LayerError> {
        let (uid, gid) = (
            Some(Uid::from_raw(id32(e.uid, "uid", rel)?)),
            Some(Gid::from_raw(id32(e.gid, "gid", rel)?)),
        );
        let r = match name {
            None => fchown(fd, uid, gid),
            Some(n) => fchownat(fd, &cstr(n)[..], uid, gid, AtFlags::AT_SYMLINK_NOFOLLOW),
        };
        match r {
            Ok(()) => Ok(()),
            // Without root, files keep the extracting user as owner (like GNU tar).
            Err(Errno::EPERM) | Err(Errno::EINVAL) if !self.is_root => Ok(()),
            Err(err) => Err(Self::write_err(rel, "chown", io_err(err))),
        }
    }

    fn xattrs(&mut self, e: &TarEntry, rel: &[u8], set: impl Fn(&CStr, &[u8]) -> io::Result<()>) {
        for (name, value) in &e.xattrs {
            let shown = String::from_utf8_lossy(name);
            if !xattr_allowed(name) {
                self.out.skipped.push(format!(
                    "{}: extended attribute {shown} (not allowed from images)",
                    String::from_utf8_lossy(rel)
                ));
                continue;
            }
            let Ok(cname) = CString::new(name.clone()) else {
                continue;
            };
            if let Err(err) = set(&cname, value) {
                self.out.skipped.push(format!(
                    "{}: extended attribute {shown}: {err}",
                    String::from_utf8_lossy(rel)
                ));
            }
        }
    }

    fn entry<I: TarInput>(
        &mut self,
        e: &TarEntry,
        reader: &mut TarReader<I>,
    ) -> Result<(), LayerError> {
        self.check_reserve(0)?;
        let comps = components(&e.path).map_err(|why| Self::refuse(e, why))?;
        let rel = join(&comps);
        // A later entry of the same name replaces a pending copied-up hardlink.
        if e.kind != Kind::Hardlink {
            self.pending.remove(&rel);
        }
        let Some((name, parent_comps)) = comps.split_last() else {
            if e.kind == Kind::Dir {
                let root = self.dir(&[], false)?;
                self.chown(root.as_fd(), None, e, b".")?;
                self.xattrs(e, b".", |n, v| set_xattr_fd(root.as_fd(), n, v));
                self.dirs.push((Vec::new(), e.mode, e.mtime));
            } else {
                self.out
                    .skipped
                    .push(format!("'{}': an entry without a name", e.path_lossy()));
            }
            return Ok(());
        };
        let name: &[u8] = name;

        if parent_comps.iter().any(|c| c.starts_with(b".wh..wh.")) {
            self.out
                .skipped
                .push(format!("{}: AUFS metadata", String::from_utf8_lossy(&rel)));
            return Ok(());
        }
        if let Some(target) = name.strip_prefix(b".wh.") {
            if target.is_empty() {
                return Err(Self::refuse(e, "a whiteout without a name"));
            }
            let parent = self.dir(parent_comps, true)?;
            if target == b".wh..opq" {
                set_xattr_fd(parent.as_fd(), c"trusted.overlay.opaque", b"y").map_err(|err| {
                    Self::write_err(
                        &join(parent_comps),
                        "mark opaque (trusted.overlay.opaque)",
                        err,
                    )
                })?;
            } else if target.starts_with(b".wh.") {
                self.out
                    .skipped
                    .push(format!("{}: AUFS metadata", String::from_utf8_lossy(&rel)));
            } else {
                let mut hidden = parent_comps.to_vec();
                hidden.push(target);
                let hidden_rel = join(&hidden);
                self.clear(&parent, target, &hidden_rel, false)?;
                mknodat(
                    parent.as_fd(),
                    &cstr(target)[..],
                    SFlag::S_IFCHR,
                    Mode::empty(),
                    makedev(0, 0),
                )
                .map_err(|err| Self::write_err(&hidden_rel, "create whiteout", io_err(err)))?;
            }
            return Ok(());
        }

        match e.kind {
            Kind::Dir => {
                let parent = self.dir(parent_comps, true)?;
                let kept = self.clear(&parent, name, &rel, true)?;
                if !kept {
                    mkdirat(
                        parent.as_fd(),
                        &cstr(name)[..],
                        Mode::from_bits_truncate(0o700),
                    )
                    .map_err(|err| Self::write_err(&rel, "mkdir", io_err(err)))?;
                }
                let fd = openat(
                    parent.as_fd(),
                    &cstr(name)[..],
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|err| Self::write_err(&rel, "open directory", io_err(err)))?;
                self.chown(fd.as_fd(), None, e, &rel)?;
                self.xattrs(e, &rel, |n, v| set_xattr_fd(fd.as_fd(), n, v));
                self.dirs.push((rel, e.mode, e.mtime));
                self.out.disk_bytes += 4096;
            }
            Kind::File => {
                let parent = self.dir(parent_comps, true)?;
                self.clear(&parent, name, &rel, false)?;
                let fd = openat(
                    parent.as_fd(),
                    &cstr(name)[..],
                    OFlag::O_WRONLY
                        | OFlag::O_CREAT
                        | OFlag::O_EXCL
                        | OFlag::O_NOFOLLOW
                        | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(|err| Self::write_err(&rel, "create", io_err(err)))?;
                let mut file = File::from(fd);
                let mut left = e.size;
                let mut hasher = Sha256::new();
                let mut flushed = 0;
                while left > 0 {
                    let want = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(self.buf.len());
                    let n = reader
                        .read_data(&mut self.buf[..want])
                        .map_err(LayerError::from)?;
                    hasher.update(&self.buf[..n]);
                    file.write_all(&self.buf[..n])
                        .map_err(|err| Self::write_err(&rel, "write", err))?;
                    left -= n as u64;
                    self.check_reserve(n as u64)?;
                    if e.size - left - flushed >= WRITEBACK_EVERY {
                        start_writeback(&file, flushed, e.size - left - flushed);
                        flushed = e.size - left;
                    }
                }
                if e.size - flushed >= WRITEBACK_MIN {
                    start_writeback(&file, flushed, e.size - flushed);
                }
                let ino = nix::sys::stat::fstat(&file)
                    .map_err(|err| Self::write_err(&rel, "stat", io_err(err)))?
                    .st_ino;
                self.digests.insert(ino, format!("{:x}", hasher.finalize()));
                self.chown(file.as_fd(), None, e, &rel)?;
                // After chown, which clears setuid/setgid bits and file capabilities.
                fchmod(file.as_fd(), Mode::from_bits_truncate(e.mode & 0o7777))
                    .map_err(|err| Self::write_err(&rel, "chmod", io_err(err)))?;
                self.xattrs(e, &rel, |n, v| set_xattr_fd(file.as_fd(), n, v));
                let t = timespec(e.mtime);
                futimens(file.as_fd(), &t, &t)
                    .map_err(|err| Self::write_err(&rel, "set times", io_err(err)))?;
                self.out.disk_bytes += e.size.div_ceil(4096) * 4096;
            }
            Kind::Symlink => {
                if e.link.is_empty() || e.link.contains(&0) {
                    return Err(Self::refuse(e, "symlink with an empty or invalid target"));
                }
                let parent = self.dir(parent_comps, true)?;
                self.clear(&parent, name, &rel, false)?;
                symlinkat(&cstr(&e.link)[..], parent.as_fd(), &cstr(name)[..])
                    .map_err(|err| Self::write_err(&rel, "symlink", io_err(err)))?;
                self.chown(parent.as_fd(), Some(name), e, &rel)?;
                if !e.xattrs.is_empty() {
                    let path = proc_path(parent.as_fd(), name);
                    self.xattrs(e, &rel, |n, v| set_xattr_nofollow(&path, n, v));
                }
                let t = timespec(e.mtime);
                utimensat(
                    parent.as_fd(),
                    &cstr(name)[..],
                    &t,
                    &t,
                    UtimensatFlags::NoFollowSymlink,
                )
                .map_err(|err| Self::write_err(&rel, "set times", io_err(err)))?;
            }
            Kind::Hardlink => {
                let target = components(&e.link).map_err(|why| {
                    Self::refuse(
                        e,
                        format!(
                            "hardlink target '{}': {why}",
                            String::from_utf8_lossy(&e.link)
                        ),
                    )
                })?;
                let Some((tname, tparent)) = target.split_last() else {
                    return Err(Self::refuse(e, "hardlink without a target"));
                };
                let tjoined = join(&target);
                if tjoined == rel {
                    return Err(Self::refuse(e, "a hardlink to itself"));
                }
                // A link to a name that is itself a link to a lower layer's file.
                if let Some(lower) = self.pending.get(&tjoined).cloned() {
                    let parent = self.dir(parent_comps, true)?;
                    self.clear(&parent, name, &rel, false)?;
                    self.pending.insert(rel, lower);
                    return Ok(());
                }
                let tparent_fd = self.dir(tparent, false).ok();
                let parent = self.dir(parent_comps, true)?;
                let linked = match &tparent_fd {
                    // Cleared only once the target is known to exist in this layer (below).
                    Some(tfd) => {
                        match fstatat(tfd.as_fd(), &cstr(tname)[..], AtFlags::AT_SYMLINK_NOFOLLOW) {
                            Ok(_) => {
                                self.clear(&parent, name, &rel, false)?;
                                let tfd = self
                                    .dir(tparent, false)
                                    .map_err(|_| Self::refuse(e, "hardlink target vanished"))?;
                                match linkat(
                                    tfd.as_fd(),
                                    &cstr(tname)[..],
                                    parent.as_fd(),
                                    &cstr(name)[..],
                                    AtFlags::empty(),
                                ) {
                                    Ok(()) => true,
                                    Err(Errno::ENOENT) => false,
                                    Err(err) => {
                                        return Err(Self::write_err(&rel, "hardlink", io_err(err)));
                                    }
                                }
                            }
                            Err(Errno::ENOENT) => false,
                            Err(err) => return Err(Self::write_err(&rel, "stat", io_err(err))),
                        }
                    }
                    None => false,
                };
                if !linked {
                    // Not in this layer: the store copies it up from the lower layers.
                    self.clear(&parent, name, &rel, false)?;
                    self.pending.insert(rel, tjoined);
                }
            }
            Kind::Char | Kind::Block => self.out.skipped.push(format!(
                "{}: {} device {}:{} (images are mounted nodev; the runtime creates /dev)",
                String::from_utf8_lossy(&rel),
                if e.kind == Kind::Char {
                    "character"
                } else {
                    "block"
                },
                e.dev.0,
                e.dev.1
            )),
            Kind::Fifo => self.out.skipped.push(format!(
                "{}: fifo (not extracted)",
                String::from_utf8_lossy(&rel)
            )),
            Kind::Other(t) => self.out.skipped.push(format!(
                "{}: unknown tar entry type '{}'",
                String::from_utf8_lossy(&rel),
                t as char
            )),
        }
        Ok(())
    }

    /// Sets directory modes and mtimes, deepest last-written first.
    fn finish_dirs(&mut self) -> Result<(), LayerError> {
        self.cached = None;
        let dirs = std::mem::take(&mut self.dirs);
        for (rel, mode, mtime) in dirs.iter().rev() {
            // A later entry may have replaced the directory: then there is nothing to set.
            let Ok(fd) = self.open_in_root(
                rel,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            ) else {
                continue;
            };
            fchmod(fd.as_fd(), Mode::from_bits_truncate(mode & 0o7777))
                .map_err(|err| Self::write_err(rel, "chmod", io_err(err)))?;
            let t = timespec(*mtime);
            futimens(fd.as_fd(), &t, &t)
                .map_err(|err| Self::write_err(rel, "set times", io_err(err)))?;
        }
        Ok(())
    }
}

/// A file's bytes are sent to the disk in runs of this size while it is written...
const WRITEBACK_EVERY: u64 = 8 << 20;
/// ...and a file's last run when it is at least this long (smaller files are left to the
/// store's one flush of the layer, which writes them in fewer, larger requests).
const WRITEBACK_MIN: u64 = 32 << 10;

/// Starts writing `len` bytes of `file` from `offset` to the disk, without waiting. The store
/// flushes a layer before publishing it; begun here, that writeback overlaps the download and
/// extraction of the rest, and the final flush is left only what was written last (not the
/// whole layer, which at a disk's speed is seconds for a large image). Advisory: an error only
/// means the flush does the work.
fn start_writeback(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: sync_file_range only reads its integer arguments; the fd is open for the call.
    let _ = unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
    };
}

fn timespec((secs, nanos): (i64, u32)) -> TimeSpec {
    TimeSpec::new(secs, nanos.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

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

    fn run(bytes: &[u8]) -> (tempfile::TempDir, PathBuf, Result<Extracted, LayerError>) {
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
        assert!(matches!(r, Err(LayerError::Refused { .. })), "{r:?}");
        assert!(!t.path().join("x").exists());
        assert_eq!(std::fs::read_dir(&layer).unwrap().count(), 0);

        let bytes = Tar::new().file("a/../../x", b"escape").end();
        let (t, _layer, r) = run(&bytes);
        assert!(matches!(r, Err(LayerError::Refused { .. })), "{r:?}");
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
        assert!(matches!(r, Err(LayerError::Refused { .. })), "{r:?}");
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
        assert_eq!(f.digest.as_deref(), Some(&sha(b"hello")["sha256:".len()..]));
        assert_eq!(x.files[&b"d/g".to_vec()].digest, f.digest);
        assert_eq!(x.files[&b"l".to_vec()].kind, 'l');
        assert_eq!(x.files[&b"d".to_vec()].kind, 'd');
        // What verification computes by reading the files agrees.
        let read = crate::store::record::walk(&layer, &|_| None).unwrap();
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
        assert!(matches!(r, Err(LayerError::Bound(Bound::Layer))), "{r:?}");
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
        assert!(matches!(r, Err(LayerError::Bound(Bound::Image))), "{r:?}");
        let limits = Limits {
            reserve_bytes: u64::MAX,
            ..Limits::default()
        };
        let l3 = t.path().join("3");
        std::fs::create_dir(&l3).unwrap();
        let r = extract_bounded(&mut &bytes[..], &l3, &limits);
        assert!(
            matches!(r, Err(LayerError::Bound(Bound::Reserve(_)))),
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
        assert!(matches!(r, Err(LayerError::Format { .. })), "{r:?}");
        let (_t, _layer, r) = run(&bytes[..300]);
        assert!(matches!(r, Err(LayerError::Format { .. })), "{r:?}");
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
        assert!(matches!(r, Err(LayerError::Format { .. })), "{r:?}");
    }

    #[test]
    fn sparse_files_are_refused() {
        let h = Tar::header(EntryType::GNUSparse, b"sparse", b"", 0, 0o644);
        let bytes = Tar::new().push(&h, b"").end();
        let (_t, _layer, r) = run(&bytes);
        assert!(matches!(r, Err(LayerError::Format { .. })), "{r:?}");
    }

    #[test]
    fn hash_only_matches_extract() {
        let bytes = Tar::new().file("f", b"abc").end();
        let (id, n) = hash_only(&mut &bytes[..]).unwrap();
        assert_eq!(id, sha(&bytes));
        assert_eq!(n, bytes.len() as u64);
    }
}
