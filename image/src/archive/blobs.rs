//! Where an archive's blobs come from: an OCI layout directory opened as the user, or a tar
//! (OCI or docker archive) read in place, each member by seeking to it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::invalid;
use crate::ImageError;
use crate::layer::{Kind, TarInput, TarReader};

pub(super) trait Blobs: Sync {
    fn open(&self, name: &str) -> Result<Box<dyn Read + Send + '_>, ImageError>;
    fn size(&self, name: &str) -> Option<u64>;
}

/// An OCI layout directory, opened as the user who named it. Each blob is opened beneath it with
/// that user's credentials and without following any symlink (a blob linked to a file of
/// someone else's is refused), never blocking on a FIFO.
pub(super) struct DirBlobs {
    pub(super) dir: File,
    /// Who opens the blobs: the user who named the layout (root when root named it).
    pub(super) user: Option<berth_spec::UserIds>,
    pub(super) what: String,
}

impl DirBlobs {
    pub(super) fn open_file(&self, name: &str) -> io::Result<File> {
        let flags = nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_NONBLOCK;
        let open = || berth_sys::privfs::open_beneath(&self.dir, Path::new(name), flags, 0, true);
        let fd = match &self.user {
            Some(user) => berth_sys::privfs::as_user(user, open)??,
            None => open()?,
        };
        let file = File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        nix::fcntl::fcntl(
            &file,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
        )?;
        Ok(file)
    }
}

impl Blobs for DirBlobs {
    fn open(&self, name: &str) -> Result<Box<dyn Read + Send + '_>, ImageError> {
        let f = self
            .open_file(name)
            .map_err(|source| ImageError::ArchiveIo {
                what: self.what.clone(),
                path: PathBuf::from(name),
                source,
            })?;
        Ok(Box::new(BufReader::with_capacity(256 * 1024, f)))
    }

    fn size(&self, name: &str) -> Option<u64> {
        self.open_file(name).ok()?.metadata().ok().map(|m| m.len())
    }
}

/// Reads `len` bytes of a shared file from `offset` with `pread`, so several threads read one
/// open file at once without sharing a file position.
pub(super) struct RangeReader<'a> {
    pub(super) file: &'a File,
    pub(super) pos: u64,
    pub(super) end: u64,
}

impl Read for RangeReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let left = self.end.saturating_sub(self.pos);
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        let got = self.file.read_at(&mut buf[..n], self.pos)?;
        self.pos += got as u64;
        Ok(got)
    }
}

#[derive(Clone, Debug)]
pub(super) struct Member {
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) kind: Kind,
    pub(super) link: String,
}

impl Seek for RangeReader<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let base = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            SeekFrom::End(d) => self.end.checked_add_signed(d),
        };
        self.pos = base.ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        Ok(self.pos)
    }
}

/// A tar file read in place, through the one fd opened for it (as the user who named it): an
/// index of its members, and a positioned reader per blob (so layers can be read by several
/// threads at once).
pub(super) struct TarBlobs {
    pub(super) file: File,
    pub(super) what: String,
    pub(super) members: HashMap<String, Member>,
}

/// A seekable file as tar input: skipping data is a seek.
pub(super) struct FileInput<'a> {
    pub(super) r: BufReader<RangeReader<'a>>,
    pub(super) pos: u64,
    pub(super) len: u64,
}

impl TarInput for FileInput<'_> {
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.r.read(&mut buf[done..]) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.pos += done as u64;
        Ok(done)
    }

    fn skip(&mut self, n: u64) -> io::Result<u64> {
        let n = n.min(self.len.saturating_sub(self.pos));
        self.r
            .seek_relative(i64::try_from(n).map_err(io::Error::other)?)?;
        self.pos += n;
        Ok(n)
    }

    fn position(&self) -> u64 {
        self.pos
    }
}

/// Normalises a member name: no leading `/` or `./`, `..` resolved lexically (`None` if it
/// climbs out of the archive).
pub(super) fn member_name(raw: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for c in raw.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    Some(parts.join("/"))
}

impl TarBlobs {
    pub(super) fn index(file: File, what: &str) -> Result<Self, ImageError> {
        let io_err = |e: io::Error| invalid(what, format!("cannot read the archive: {e}"));
        let meta = file.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(invalid(what, "the archive is not a regular file"));
        }
        let len = meta.len();
        let mut reader = TarReader::new(FileInput {
            r: BufReader::with_capacity(
                64 * 1024,
                RangeReader {
                    file: &file,
                    pos: 0,
                    end: len,
                },
            ),
            pos: 0,
            len,
        });
        let mut members = HashMap::new();
        loop {
            let entry = match reader.next_entry() {
                Ok(Some(e)) => e,
                Ok(None) => break,
                Err(e) => return Err(invalid(what, format!("not a readable tar archive: {e}"))),
            };
            let Some(name) = member_name(&String::from_utf8_lossy(&entry.path)) else {
                continue;
            };
            if matches!(entry.kind, Kind::File | Kind::Symlink | Kind::Hardlink) {
                members.insert(
                    name,
                    Member {
                        offset: entry.data_offset,
                        size: if entry.kind == Kind::File {
                            entry.size
                        } else {
                            0
                        },
                        kind: entry.kind,
                        link: String::from_utf8_lossy(&entry.link).into_owned(),
                    },
                );
            }
        }
        drop(reader);
        Ok(Self {
            file,
            what: what.to_string(),
            members,
        })
    }

    /// The regular file a name leads to, following symlinks and hardlinks inside the archive.
    pub(super) fn resolve(&self, name: &str) -> Option<&Member> {
        let mut name = member_name(name)?;
        for _ in 0..16 {
            let m = self.members.get(&name)?;
            name = match m.kind {
                Kind::File => return Some(m),
                Kind::Hardlink => member_name(&m.link)?,
                Kind::Symlink => {
                    let base = name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                    if m.link.starts_with('/') {
                        member_name(&m.link)?
                    } else {
                        member_name(&format!("{base}/{}", m.link))?
                    }
                }
                _ => return None,
            };
        }
        None
    }
}

impl Blobs for TarBlobs {
    fn open(&self, name: &str) -> Result<Box<dyn Read + Send + '_>, ImageError> {
        let m = self
            .resolve(name)
            .ok_or_else(|| invalid(&self.what, format!("'{name}' is missing from the archive")))?;
        Ok(Box::new(BufReader::with_capacity(
            256 * 1024,
            RangeReader {
                file: &self.file,
                pos: m.offset,
                end: m.offset.saturating_add(m.size),
            },
        )))
    }

    fn size(&self, name: &str) -> Option<u64> {
        self.resolve(name).map(|m| m.size)
    }
}
