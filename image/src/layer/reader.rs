//! berth's tar header loop over the `tar` crate's header parser: streams without the two zero
//! blocks, GNU long names and PAX records, for layers (hashed as read) and archives (seekable).

use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest as _, Sha256};
use tar::{EntryType, Header};

use super::{BLOCK, BLOCK_LEN, Bound, MAX_META};
use crate::ImageError;

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
pub(super) struct HashingInput<'a> {
    pub(super) inner: &'a mut dyn Read,
    pub(super) hasher: Sha256,
    pub(super) pos: u64,
    pub(super) scratch: Vec<u8>,
    /// Most bytes this stream may have.
    pub(super) max: u64,
    /// The image's running total and its bound.
    pub(super) image: Option<(Arc<AtomicU64>, u64)>,
    /// The bound reached, if any (reads fail from then on).
    pub(super) hit: Option<Bound>,
}

impl<'a> HashingInput<'a> {
    pub(super) fn new(inner: &'a mut dyn Read) -> Self {
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

    pub(super) fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
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

    pub(super) fn drain(&mut self) -> io::Result<()> {
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
pub(super) struct Extensions {
    pub(super) path: Option<Vec<u8>>,
    pub(super) link: Option<Vec<u8>>,
    pub(super) size: Option<u64>,
    pub(super) uid: Option<u64>,
    pub(super) gid: Option<u64>,
    pub(super) mtime: Option<(i64, u32)>,
    pub(super) xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub(super) sparse: bool,
}

/// Iterates the entries of a tar stream. After [`TarReader::next_entry`] returns an entry, its
/// data can be read with [`TarReader::read_data`]; whatever is not read is skipped.
pub(crate) struct TarReader<I> {
    pub(super) input: I,
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

    pub(super) fn bad(&self, why: impl Into<String>) -> ImageError {
        ImageError::TarFormat {
            offset: self.input.position(),
            why: why.into(),
        }
    }

    /// Reads from the current entry's data; 0 at its end.
    pub fn read_data(&mut self, buf: &mut [u8]) -> Result<usize, ImageError> {
        if self.data_left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = usize::try_from(self.data_left)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self
            .input
            .fill(&mut buf[..want])
            .map_err(ImageError::TarRead)?;
        if n == 0 {
            return Err(self.bad(format!(
                "the stream ends {} bytes before the end of an entry",
                self.data_left
            )));
        }
        self.data_left -= n as u64;
        Ok(n)
    }

    pub(super) fn read_meta(&mut self, size: u64) -> Result<Vec<u8>, ImageError> {
        if size > MAX_META {
            return Err(self.bad(format!("extension header of {size} bytes is too large")));
        }
        #[expect(
            clippy::cast_possible_truncation,
            reason = "size is at most MAX_META (1 MiB), checked above"
        )]
        let mut data = vec![0; size as usize];
        let n = self.input.fill(&mut data).map_err(ImageError::TarRead)?;
        if n < data.len() {
            return Err(self.bad("the stream ends inside an extension header"));
        }
        self.data_left = 0;
        self.skip_padding(size)?;
        Ok(data)
    }

    pub(super) fn skip_padding(&mut self, size: u64) -> Result<(), ImageError> {
        let pad = (BLOCK - size % BLOCK) % BLOCK;
        // A stream may end right after the last entry's data, without padding or end blocks.
        if self.input.skip(pad).map_err(ImageError::TarRead)? < pad {
            self.ended = true;
        }
        Ok(())
    }

    /// The next entry, or `None` at the end of the archive (end blocks or the stream's end).
    // Long by design: GNU long names and PAX records accumulate across headers until the entry
    // they describe; the loop keeps that state in one place.
    pub fn next_entry(&mut self) -> Result<Option<TarEntry>, ImageError> {
        if self.data_left > 0 {
            let left = self.data_left;
            if self.input.skip(left).map_err(ImageError::TarRead)? < left {
                return Err(self.bad("the stream ends inside an entry's data"));
            }
            self.data_left = 0;
        }
        if self.pad_left > 0 {
            let pad = self.pad_left;
            self.pad_left = 0;
            if self.input.skip(pad).map_err(ImageError::TarRead)? < pad {
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
            let n = self.input.fill(&mut block).map_err(ImageError::TarRead)?;
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
            check_checksum(&block, header_offset)?;
            // Empty numeric fields (all NUL or spaces) mean 0, as Go's and GNU's readers take them.
            let field = |r: io::Result<u64>, raw: &[u8], what: &str| {
                if raw.iter().all(|b| *b == 0 || *b == b' ') {
                    return Ok(0);
                }
                r.map_err(|e| ImageError::TarFormat {
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
                    parse_pax(&data, &mut ext, header_offset)?;
                    continue;
                }
                EntryType::XGlobalHeader => {
                    // Global records (git archive's comment) carry nothing berth applies.
                    self.read_meta(size)?;
                    continue;
                }
                EntryType::GNUSparse => {
                    return Err(ImageError::TarFormat {
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
                return Err(ImageError::TarFormat {
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
                            |_| ImageError::TarFormat {
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

pub(super) fn trim_nul(data: &mut Vec<u8>) {
    while data.last() == Some(&0) {
        data.pop();
    }
}

/// Checks the header at `offset` in the stream.
pub(super) fn check_checksum(block: &[u8; BLOCK_LEN], offset: u64) -> Result<(), ImageError> {
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
        .ok_or_else(|| ImageError::TarFormat {
            offset,
            why: "header checksum field is not a number (not a tar stream?)".to_string(),
        })?;
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
        Err(ImageError::TarFormat {
            offset,
            why: "header checksum mismatch (not a tar stream, or a corrupt one)".into(),
        })
    }
}

/// Parses the PAX records of the extension header at `offset` in the stream.
pub(super) fn parse_pax(data: &[u8], ext: &mut Extensions, offset: u64) -> Result<(), ImageError> {
    let bad = |why: &str| ImageError::TarFormat {
        offset,
        why: why.to_string(),
    };
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest
            .iter()
            .position(|b| *b == b' ')
            .ok_or_else(|| bad("PAX record without a length"))?;
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("PAX record with a bad length"))?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err(bad("PAX record with a bad length"));
        }
        let record = &rest[space + 1..len - 1];
        rest = &rest[len..];
        let eq = record
            .iter()
            .position(|b| *b == b'=')
            .ok_or_else(|| bad("PAX record without '='"))?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        let number = |v: &[u8]| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| {
                    bad(&format!(
                        "PAX {} is not a number",
                        String::from_utf8_lossy(key)
                    ))
                })
        };
        match key {
            b"path" => ext.path = Some(value.to_vec()),
            b"linkpath" => ext.link = Some(value.to_vec()),
            b"size" => ext.size = Some(number(value)?),
            b"uid" => ext.uid = Some(number(value)?),
            b"gid" => ext.gid = Some(number(value)?),
            b"mtime" => ext.mtime = Some(parse_pax_time(value, offset)?),
            _ if key.starts_with(b"SCHILY.xattr.") => ext
                .xattrs
                .push((key[b"SCHILY.xattr.".len()..].to_vec(), value.to_vec())),
            _ if key.starts_with(b"GNU.sparse.") => ext.sparse = true,
            _ => {}
        }
    }
    Ok(())
}

/// A PAX `mtime` of the extension header at `offset` in the stream.
pub(super) fn parse_pax_time(v: &[u8], offset: u64) -> Result<(i64, u32), ImageError> {
    let format = |why: String| ImageError::TarFormat { offset, why };
    let text = std::str::from_utf8(v).map_err(|_| format("PAX mtime is not text".to_string()))?;
    let bad = || format(format!("PAX mtime '{text}' is not a time"));
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
