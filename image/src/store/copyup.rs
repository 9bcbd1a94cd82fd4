//! Hardlinks to a lower layer's file, applied the way overlayfs itself treats such a link (and
//! containerd and umoci apply these layers): the file is copied up, with its metadata.
//!
//! A layer directory is named by its diff_id and shared by every image that has it, while the
//! file a link names depends on the layers below it in one image. So the layer keeps only the
//! record of its links ([`crate::record::LayerRecord::external_links`]) and each image gets, right
//! above that layer, a small layer of the copied files, named by the chain of layers below
//! it (`sha256("berth copy-up 1\n" + layer names)`): same chain, same copies, shared again.
//! The copies sit between the layer and the next one, so the next layers cover them as they
//! would cover the layer's own files.
//!
//! Lower layers are read beneath their directory fds without following symlinks (a layer's
//! content is the image's, not berth's): a target reached only through a symlink counts as
//! missing, and a missing target is refused in one line.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::{Mode, fchmod, futimens, mkdirat};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, fchown};
use sha2::{Digest as _, Sha256};

use super::{ImageError, Store, fs};
use crate::record::{self, ContentHash, LayerRecord};
use crate::store::StoreError;

fn beneath(dir: &OwnedFd, rel: &[u8], flags: OFlag, mode: u32) -> io::Result<OwnedFd> {
    berth_sys::privfs::open_beneath(dir, Path::new(OsStr::from_bytes(rel)), flags, mode, true)
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io::Error::from)
}

/// `lstat` of `rel` beneath `dir`, without following any symlink (`None`: not there, or only
/// through a symlink). The parent is opened beneath `dir`, the last component `fstatat`-ed.
fn lstat_beneath(dir: &OwnedFd, rel: &[u8]) -> Option<std::fs::Metadata> {
    let (parent, name) = split(rel);
    if name.is_empty() {
        return None;
    }
    let pfd = beneath(dir, parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0).ok()?;
    // Opened O_PATH through the parent fd so the metadata comes as std's type; O_PATH with
    // O_NOFOLLOW on the last component names a symlink itself, never its target.
    let fd = nix::fcntl::openat(
        &pfd,
        OsStr::from_bytes(name),
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    File::from(fd).metadata().ok()
}

/// (parent, last component) of a relative path.
fn split(rel: &[u8]) -> (&[u8], &[u8]) {
    match rel.iter().rposition(|b| *b == b'/') {
        Some(p) => (&rel[..p], &rel[p + 1..]),
        None => (&rel[..0], rel),
    }
}

fn is_whiteout(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    m.file_type().is_char_device() && m.rdev() == 0
}

fn is_opaque(dir: &OwnedFd, rel: &[u8]) -> bool {
    let Ok(fd) = beneath(dir, rel, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0) else {
        return false;
    };
    let mut v = [0u8; 2];
    // SAFETY: fd is open, the name is NUL-terminated and v is a writable buffer of v.len().
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            c"trusted.overlay.opaque".as_ptr(),
            v.as_mut_ptr().cast(),
            v.len(),
        )
    };
    n == 1 && v[0] == b'y'
}

/// Where `rel` is in the stack `layers` (topmost first), as overlayfs would find it: the layer
/// and its metadata, or `None` (absent, whited out, hidden by an opaque directory or a file).
fn find(layers: &[(PathBuf, OwnedFd)], rel: &[u8]) -> Option<(usize, std::fs::Metadata)> {
    let comps: Vec<&[u8]> = rel
        .split(|b| *b == b'/')
        .filter(|c| !c.is_empty())
        .collect();
    for (i, (_, fd)) in layers.iter().enumerate() {
        let mut opaque = false;
        for n in 1..=comps.len() {
            let prefix = comps[..n].join(&b'/');
            match lstat_beneath(fd, &prefix) {
                None => break,
                Some(m) if is_whiteout(&m) => return None,
                Some(m) if n == comps.len() => return Some((i, m)),
                Some(m) if !m.is_dir() => return None,
                Some(_) => opaque |= is_opaque(fd, &prefix),
            }
        }
        if opaque {
            return None;
        }
    }
    None
}

fn copy_xattrs(from: &OwnedFd, to: &OwnedFd) {
    let mut names = vec![0u8; 64 * 1024];
    // SAFETY: from is open; names is a writable buffer of names.len() bytes.
    let n = unsafe { libc::flistxattr(from.as_raw_fd(), names.as_mut_ptr().cast(), names.len()) };
    let n = match usize::try_from(n) {
        Ok(n) if n > 0 => n,
        _ => return,
    };
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if name.starts_with(b"trusted.overlay.") || name == b"security.selinux" {
            continue;
        }
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 64 * 1024];
        // SAFETY: from is open, cname NUL-terminated, value writable for value.len() bytes.
        let len = unsafe {
            libc::fgetxattr(
                from.as_raw_fd(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        let Ok(len) = usize::try_from(len) else {
            continue;
        };
        // SAFETY: to is open, cname NUL-terminated, value readable for len bytes.
        unsafe {
            libc::fsetxattr(
                to.as_raw_fd(),
                cname.as_ptr(),
                value.as_ptr().cast(),
                len,
                0,
            )
        };
    }
}

fn set_meta(fd: &OwnedFd, m: &std::fs::Metadata) -> io::Result<()> {
    fchown(
        fd,
        Some(Uid::from_raw(m.uid())),
        Some(Gid::from_raw(m.gid())),
    )?;
    // After chown, which clears setuid/setgid bits.
    fchmod(fd, Mode::from_bits_truncate(m.mode() & 0o7777))?;
    let t = TimeSpec::new(m.mtime(), m.mtime_nsec() as _);
    futimens(fd, &t, &t)?;
    Ok(())
}

impl Store {
    /// Inserts, above each layer of `dirs` (bottom first) that has hardlinks to lower layers'
    /// files, the layer of their copies (made once per chain, see the module header).
    pub(super) fn copy_up(&self, dirs: Vec<PathBuf>) -> Result<Vec<PathBuf>, ImageError> {
        let mut out: Vec<PathBuf> = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let rec = record::read(&dir.with_extension("files"))
                .map_err(|e| self.io("reading a layer record", e))?;
            out.push(dir.clone());
            let Some(rec) = rec.filter(|r| !r.external_links.is_empty()) else {
                continue;
            };
            let mut h = Sha256::new();
            h.update(b"berth copy-up 1\n");
            for d in &out {
                h.update(d.file_name().map(|n| n.as_bytes()).unwrap_or_default());
                h.update(b"\n");
            }
            let hex = format!("{:x}", h.finalize());
            let _lock = self.lock(&format!("layer-{hex}"), fs::LockMode::Exclusive)?;
            let dest = self.dir("layers").join(&hex);
            if !self.layer_usable(&dest) {
                self.make_copy_layer(&dir, &out, &rec, &dest)?;
            }
            out.push(dest);
        }
        Ok(out)
    }

    /// Builds the copy-up layer of `layer` at `dest`: every hardlink of the layer to a file of a
    /// lower layer (`rec.external_links`) becomes a copy of that file, in a staging directory of
    /// the workspace published only when complete.
    fn make_copy_layer(
        &self,
        layer: &Path,
        stack: &[PathBuf],
        rec: &LayerRecord,
        dest: &Path,
    ) -> Result<(), ImageError> {
        let name = layer.display().to_string();
        let io = |op: &str, e: io::Error| self.io(format!("{op} for layer {name}"), e);
        // Topmost first; [0] is the layer itself (parents' metadata), [1..] its lowers.
        let layers: Vec<(PathBuf, OwnedFd)> = stack
            .iter()
            .rev()
            .map(|d| open_dir(d).map(|fd| (d.clone(), fd)))
            .collect::<io::Result<_>>()
            .map_err(|e| io("opening the layers below", e))?;
        let ws = self.workspace()?;
        let staging = ws.path("copy-up");
        std::fs::create_dir(&staging).map_err(|e| io("creating a copy-up layer", e))?;
        let result = (|| {
            let root = open_dir(&staging).map_err(|e| io("opening a copy-up layer", e))?;
            let mut up = CopyUp {
                name: &name,
                layers: &layers,
                root: &root,
                digests: HashMap::new(),
                copied: BTreeMap::new(),
            };
            for (link, target) in &rec.external_links {
                self.copy_link(&mut up, link, target)?;
            }
            let digests = up.digests;
            let files = record::walk(&staging, ContentHash::default(), &|ino| {
                digests.get(&ino).cloned()
            })
            .map_err(|e| io("recording a copy-up layer", e))?;
            let rec = LayerRecord {
                tar_bytes: 0,
                files,
                external_links: Vec::new(),
                hash: ContentHash::default(),
            };
            super::publish_dir(
                &self.root,
                &ws,
                &staging,
                dest,
                fs::disk_usage(&staging),
                &rec,
            )
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        result
    }

    /// Copies the lower layers' `target` up as `link`; a second link to a file already copied
    /// shares its inode, as the links did.
    fn copy_link(&self, up: &mut CopyUp<'_>, link: &[u8], target: &[u8]) -> Result<(), ImageError> {
        let io = |op: &str, e: io::Error| self.io(format!("{op} for layer {}", up.name), e);
        let shown = format!(
            "layer {}: hardlink '/{}' to '/{}'",
            up.name,
            String::from_utf8_lossy(link),
            String::from_utf8_lossy(target)
        );
        let Some((at, meta)) = find(&up.layers[1..], target) else {
            return Err(ImageError::Store(StoreError::HardlinkMissing(shown)));
        };
        let from = &up.layers[1 + at].1;
        self.make_parents(up, link)?;
        let (lparent, lname) = split(link);
        let parent_fd = beneath(up.root, lparent, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)
            .map_err(|e| io("opening a directory", e))?;
        if let Some(first) = up.copied.get(target) {
            let (fparent, fname) = split(first);
            let ffd = beneath(up.root, fparent, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)
                .map_err(|e| io("opening a directory", e))?;
            return nix::unistd::linkat(
                &ffd,
                OsStr::from_bytes(fname),
                &parent_fd,
                OsStr::from_bytes(lname),
                nix::fcntl::AtFlags::empty(),
            )
            .map_err(|e| io("linking a copied file", e.into()));
        }
        if meta.file_type().is_symlink() {
            let (tparent, tname) = split(target);
            let tfd = beneath(from, tparent, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)
                .map_err(|e| io("opening a directory", e))?;
            let text = nix::fcntl::readlinkat(&tfd, OsStr::from_bytes(tname))
                .map_err(|e| io("reading a symlink", e.into()))?;
            nix::unistd::symlinkat(text.as_os_str(), &parent_fd, OsStr::from_bytes(lname))
                .map_err(|e| io("copying a symlink", e.into()))?;
            nix::unistd::fchownat(
                &parent_fd,
                OsStr::from_bytes(lname),
                Some(Uid::from_raw(meta.uid())),
                Some(Gid::from_raw(meta.gid())),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io("copying a symlink's owner", e.into()))?;
        } else if meta.is_file() {
            let (ino, digest) = self.copy_file(up, from, target, link, &meta)?;
            up.digests.insert(ino, digest);
        } else {
            return Err(ImageError::Store(StoreError::HardlinkMissing(format!(
                "{shown} (a {} there, not a file)",
                if meta.is_dir() {
                    "directory"
                } else {
                    "special file"
                }
            ))));
        }
        up.copied.insert(target.to_vec(), link.to_vec());
        Ok(())
    }

    /// Makes the directories above `link` in the copy-up layer, each with the owner, mode and
    /// extended attributes the image shows for it at this layer (not 0755 root: an upper
    /// directory's metadata is what the container sees).
    fn make_parents(&self, up: &CopyUp<'_>, link: &[u8]) -> Result<(), ImageError> {
        let io = |op: &str, e: io::Error| self.io(format!("{op} for layer {}", up.name), e);
        let comps: Vec<&[u8]> = link.split(|b| *b == b'/').collect();
        for n in 1..comps.len() {
            let prefix = comps[..n].join(&b'/');
            if lstat_beneath(up.root, &prefix).is_some() {
                continue;
            }
            let parent = beneath(
                up.root,
                &comps[..n - 1].join(&b'/'),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                0,
            )
            .map_err(|e| io("opening a directory", e))?;
            mkdirat(
                &parent,
                OsStr::from_bytes(comps[n - 1]),
                Mode::from_bits_truncate(0o755),
            )
            .map_err(|e| io("creating a directory", e.into()))?;
            let fd = beneath(up.root, &prefix, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)
                .map_err(|e| io("opening a directory", e))?;
            if let Some((i, m)) = find(up.layers, &prefix).filter(|(_, m)| m.is_dir()) {
                set_meta(&fd, &m).map_err(|e| io("setting a directory's owner", e))?;
                if let Ok(src) = beneath(
                    &up.layers[i].1,
                    &prefix,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                    0,
                ) {
                    copy_xattrs(&src, &fd);
                }
            }
        }
        Ok(())
    }

    /// Copies the regular file `target` of the lower layer `from` to `link`, with its owner,
    /// mode and extended attributes; returns the copy's inode and sha256 for the layer record.
    fn copy_file(
        &self,
        up: &CopyUp<'_>,
        from: &OwnedFd,
        target: &[u8],
        link: &[u8],
        meta: &std::fs::Metadata,
    ) -> Result<(u64, String), ImageError> {
        let io = |op: &str, e: io::Error| self.io(format!("{op} for layer {}", up.name), e);
        let src = beneath(from, target, OFlag::O_RDONLY | OFlag::O_NONBLOCK, 0)
            .map_err(|e| io("opening a lower layer's file", e))?;
        let dst = beneath(
            up.root,
            link,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
            0o600,
        )
        .map_err(|e| io("creating a copied file", e))?;
        let (mut r, mut w) = (
            File::from(src.try_clone().map_err(|e| io("dup", e))?),
            File::from(dst.try_clone().map_err(|e| io("dup", e))?),
        );
        let mut hasher = ContentHash::default().hasher();
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io("reading a lower layer's file", e)),
            };
            hasher.update(&buf[..n]);
            w.write_all(&buf[..n])
                .map_err(|e| self.write_error("copying a file up", e))?;
        }
        set_meta(&dst, meta).map_err(|e| io("setting a copied file's owner", e))?;
        copy_xattrs(&src, &dst);
        let ino = w.metadata().map_err(|e| io("stat", e))?.ino();
        Ok((ino, hasher.finish()))
    }
}

/// A copy-up layer being built: the layer's name (for errors), its stack of open layers
/// (topmost first), the staging directory, and what was copied so far.
struct CopyUp<'a> {
    name: &'a str,
    layers: &'a [(PathBuf, OwnedFd)],
    root: &'a OwnedFd,
    /// Inode of each copied file → its sha256, for the layer record.
    digests: HashMap<u64, String>,
    /// Lower path → the link it was first copied to.
    copied: BTreeMap<Vec<u8>, Vec<u8>>,
}
