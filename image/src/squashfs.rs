//! Enroot squashfs files (`.sqsh`, `.squashfs`) and the root partition of Apptainer SIF files as
//! store entries. The squashfs is the image's only layer: it stays where it is and is loop-mounted
//! read-only (see [`mount_shared`]), never copied or unpacked. Inspecting one checks its
//! superblock, hashes the file and synthesises the image config from the files inside, which are
//! read in user space (the `backhand` crate), so inspecting needs no root and no mount.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use backhand::{FilesystemReader, InnerNode, Node, SquashfsFileReader};
use sha2::{Digest as _, Sha256};

use super::sif::Sif;
use super::synth::{self, FileSource, Synthesised};
use super::{Image, ImageError, Reference, Rootfs};

/// Why a file cannot be loop-mounted as a squashfs (not one, a version or compressor Linux cannot
/// mount, damaged, unreadable); callers get it as [`ImageError::Squashfs`].
#[derive(Debug, thiserror::Error)]
pub enum SquashfsError {
    #[error(
        "{path}: not a squashfs image (no 'hsqs' magic at byte {offset}); use an Enroot .sqsh, a squashfs file or an Apptainer .sif"
    )]
    NotSquashfs { path: PathBuf, offset: u64 },
    #[error(
        "{path}: squashfs version {major}.{minor} at byte {offset} cannot be mounted by Linux (it mounts 4.0); rebuild it with a current mksquashfs"
    )]
    Version {
        path: PathBuf,
        offset: u64,
        major: u16,
        minor: u16,
    },
    #[error("{path}: the squashfs at byte {offset} is damaged: {why}; fetch or rebuild the image")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    #[error(
        "{path}: the squashfs is compressed with {compression}, which Linux cannot mount; rebuild it with -comp zstd (or gzip, xz, lzo, lz4)"
    )]
    Compression { path: PathBuf, compression: String },
    #[error("{path}: not a regular file; give the path of a .sqsh or .sif file")]
    NotAFile { path: PathBuf },
    /// Reading a squashfs file failed; an import reports it as [`ImageError::Io`] (see
    /// [`ImageError::plain_io`]).
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The first four bytes of every squashfs (little-endian 0x73717368).
pub const MAGIC: &[u8; 4] = b"hsqs";
const SUPERBLOCK_LEN: usize = 96;

/// The compressor named in a superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Lzma,
    Lzo,
    Xz,
    Lz4,
    Zstd,
    Unknown(u16),
}

impl Compression {
    fn from_id(id: u16) -> Self {
        match id {
            1 => Compression::Gzip,
            2 => Compression::Lzma,
            3 => Compression::Lzo,
            4 => Compression::Xz,
            5 => Compression::Lz4,
            6 => Compression::Zstd,
            other => Compression::Unknown(other),
        }
    }

    pub fn name(self) -> String {
        match self {
            Compression::Gzip => "gzip".into(),
            Compression::Lzma => "lzma".into(),
            Compression::Lzo => "lzo".into(),
            Compression::Xz => "xz".into(),
            Compression::Lz4 => "lz4".into(),
            Compression::Zstd => "zstd".into(),
            Compression::Unknown(id) => format!("unknown compressor {id}"),
        }
    }
}

/// What the superblock says about a squashfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub inodes: u32,
    pub mkfs_time: u32,
    pub block_size: u32,
    pub compression: Compression,
    /// Bytes of the file system proper; the file may be longer (mksquashfs pads to 4 KiB).
    pub bytes_used: u64,
}

/// Why 96 bytes are not a mountable squashfs superblock.
#[derive(Debug, PartialEq, Eq)]
pub enum SuperblockFault {
    Magic,
    Version(u16, u16),
    Corrupt(String),
    Compression(Compression),
}

/// Parses and checks a squashfs superblock.
pub fn parse_superblock(b: &[u8]) -> Result<Superblock, SuperblockFault> {
    if b.len() < SUPERBLOCK_LEN || &b[0..4] != MAGIC {
        return Err(SuperblockFault::Magic);
    }
    let u16_at = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
    let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let (major, minor) = (u16_at(28), u16_at(30));
    if (major, minor) != (4, 0) {
        return Err(SuperblockFault::Version(major, minor));
    }
    let block_size = u32_at(12);
    let block_log = u16_at(22);
    if !(4096..=1 << 20).contains(&block_size)
        || !block_size.is_power_of_two()
        || u32::from(block_log) != block_size.trailing_zeros()
    {
        return Err(SuperblockFault::Corrupt(format!(
            "block size {block_size} (log {block_log}) is invalid"
        )));
    }
    let bytes_used = u64_at(40);
    if bytes_used < SUPERBLOCK_LEN as u64 {
        return Err(SuperblockFault::Corrupt(format!(
            "it claims {bytes_used} bytes"
        )));
    }
    let compression = Compression::from_id(u16_at(20));
    if matches!(compression, Compression::Lzma | Compression::Unknown(_)) {
        return Err(SuperblockFault::Compression(compression));
    }
    Ok(Superblock {
        inodes: u32_at(4),
        mkfs_time: u32_at(8),
        block_size,
        compression,
        bytes_used,
    })
}

/// Checks that `path` holds a mountable squashfs at `offset` that fits in the file (a sanity
/// check before loop-mounting: a clear error instead of the kernel's "wrong fs type").
pub fn probe_squashfs_magic(path: &Path, offset: u64) -> Result<Superblock, SquashfsError> {
    let io = |source| SquashfsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(SquashfsError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let mut b = [0u8; SUPERBLOCK_LEN];
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    let n = read_full(&mut file, &mut b).map_err(io)?;
    let sb = parse_superblock(&b[..n]).map_err(|fault| match fault {
        SuperblockFault::Magic => SquashfsError::NotSquashfs {
            path: path.to_path_buf(),
            offset,
        },
        SuperblockFault::Version(major, minor) => SquashfsError::Version {
            path: path.to_path_buf(),
            offset,
            major,
            minor,
        },
        SuperblockFault::Corrupt(why) => SquashfsError::Corrupt {
            path: path.to_path_buf(),
            offset,
            why,
        },
        SuperblockFault::Compression(c) => SquashfsError::Compression {
            path: path.to_path_buf(),
            compression: c.name(),
        },
    })?;
    let available = meta.len().saturating_sub(offset);
    if sb.bytes_used > available {
        return Err(SquashfsError::Corrupt {
            path: path.to_path_buf(),
            offset,
            why: format!(
                "it needs {} bytes but the file holds {available} (truncated copy?)",
                sb.bytes_used
            ),
        });
    }
    Ok(sb)
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// `sha256:<hex>` of a whole file, streamed.
pub fn sha256_file(path: &Path) -> Result<String, SquashfsError> {
    let io = |source| SquashfsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(e)),
        }
    }
    Ok(format!("sha256:{}", hex(&hasher.finalize())))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// How to synthesise the config of squashfs images.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InspectOptions {
    /// Make Enroot's `/etc/rc` the entrypoint (`[squashfs] enroot_entrypoint`, Pyxis
    /// `--container-entrypoint`).
    pub enroot_entrypoint: bool,
}

fn absolute_file(path: &Path) -> Result<PathBuf, SquashfsError> {
    let file = std::fs::canonicalize(path).map_err(|source| SquashfsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !std::fs::metadata(&file).is_ok_and(|m| m.is_file()) {
        return Err(SquashfsError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    Ok(file)
}

/// An Enroot `.sqsh` (any squashfs file) as an image: one squashfs layer, the whole file.
/// The digest is the sha256 of the file.
pub fn inspect_squashfs(path: &Path) -> Result<Image, ImageError> {
    inspect_squashfs_with(path, &InspectOptions::default())
}

pub fn inspect_squashfs_with(path: &Path, opts: &InspectOptions) -> Result<Image, ImageError> {
    let file = absolute_file(path).map_err(ImageError::plain_io)?;
    inspect_squashfs_at(&file, &file, opts)
}

/// [`inspect_squashfs_with`] reading `read` (an opened file's `/proc/self/fd/N`) for the image
/// the user named `shown`: every byte, the digest's included, comes from that one file.
pub fn inspect_squashfs_at(
    read: &Path,
    shown: &Path,
    opts: &InspectOptions,
) -> Result<Image, ImageError> {
    probe_squashfs_magic(read, 0).map_err(ImageError::plain_io)?;
    let size = std::fs::metadata(read)
        .map_err(|source| ImageError::Io {
            path: shown.to_path_buf(),
            source,
        })?
        .len();
    let files = SquashfsFiles::open(read, 0).map_err(ImageError::plain_io)?;
    let config = image_config(synth::enroot(&files, opts.enroot_entrypoint));
    let digest = sha256_file(read).map_err(ImageError::plain_io)?;
    Ok(Image {
        digest,
        source: Reference::Squashfs(shown.to_path_buf()),
        rootfs: Rootfs::Squashfs {
            file: shown.to_path_buf(),
            offset: 0,
            size,
        },
        config,
        anonymous: false,
    })
}

/// An Apptainer SIF as an image: its primary squashfs partition, at its offset in the file.
/// The digest is the sha256 of the whole SIF file.
pub fn inspect_sif(path: &Path) -> Result<Image, ImageError> {
    let file = absolute_file(path).map_err(ImageError::plain_io)?;
    inspect_sif_at(&file, &file)
}

/// [`inspect_sif`] reading `read` (an opened file's `/proc/self/fd/N`) for the image the user
/// named `shown`.
pub fn inspect_sif_at(read: &Path, shown: &Path) -> Result<Image, ImageError> {
    let file = read.to_path_buf();
    let sif = Sif::open(&file).map_err(ImageError::plain_io)?;
    let part = sif
        .primary_partition()
        .map_err(|fault| ImageError::Sif {
            path: file.clone(),
            fault,
        })?
        .clone();
    let sb = probe_squashfs_magic(&file, part.offset).map_err(ImageError::plain_io)?;
    if sb.bytes_used > part.size {
        return Err(SquashfsError::Corrupt {
            path: file,
            offset: part.offset,
            why: format!(
                "it needs {} bytes but its SIF partition holds {}",
                sb.bytes_used, part.size
            ),
        }
        .into());
    }
    let files = SquashfsFiles::open(&file, part.offset).map_err(ImageError::plain_io)?;
    let config = image_config(synth::apptainer(&files));
    let digest = sha256_file(&file).map_err(ImageError::plain_io)?;
    Ok(Image {
        digest,
        source: Reference::Sif(shown.to_path_buf()),
        rootfs: Rootfs::Squashfs {
            file: shown.to_path_buf(),
            offset: part.offset,
            size: part.size,
        },
        config,
        anonymous: false,
    })
}

/// An OCI image config holding what was synthesised.
pub fn image_config(s: Synthesised) -> oci_spec::image::ImageConfiguration {
    let mut config = oci_spec::image::Config::default();
    if !s.env.is_empty() {
        config.set_env(Some(s.env));
    }
    config.set_entrypoint(s.entrypoint);
    config.set_working_dir(s.workdir);
    if !s.labels.is_empty() {
        config.set_labels(Some(s.labels.into_iter().collect()));
    }
    let mut image = oci_spec::image::ImageConfiguration::default();
    image.set_config(Some(config));
    image
}

/// Files of a squashfs read in user space, at an offset in its file.
pub struct SquashfsFiles {
    fs: FilesystemReader<'static>,
    path: PathBuf,
}

impl std::fmt::Debug for SquashfsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SquashfsFiles")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SquashfsFiles {
    pub fn open(path: &Path, offset: u64) -> Result<Self, ImageError> {
        let file = File::open(path).map_err(|source| SquashfsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let corrupt = |why: String| SquashfsError::Corrupt {
            path: path.to_path_buf(),
            offset,
            why: format!("reading its directory tree failed: {why}"),
        };
        // The image is untrusted input to a parser berth does not own: a panic in it is a
        // corrupt image, not a crash.
        let parsed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            FilesystemReader::from_reader_with_offset(BufReader::new(file), offset)
        }))
        .map_err(|_| corrupt("the squashfs reader gave up".into()))?;
        let fs = parsed.map_err(|e| corrupt(e.to_string()))?;
        Ok(Self {
            fs,
            path: path.to_path_buf(),
        })
    }

    fn node(&self, path: &Path) -> Option<&Node<SquashfsFileReader>> {
        let nodes = &self.fs.root.nodes;
        nodes
            .binary_search_by(|n| n.fullpath.as_path().cmp(path))
            .ok()
            .map(|i| &nodes[i])
    }

    /// The node at `path`, following symlinks (within the image) on every component.
    fn resolve(&self, path: &str) -> Option<&Node<SquashfsFileReader>> {
        let mut pending: VecDeque<String> = path
            .split('/')
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect();
        let mut cur = PathBuf::from("/");
        let mut hops = 0;
        while let Some(comp) = pending.pop_front() {
            match comp.as_str() {
                "." => continue,
                ".." => {
                    cur.pop();
                    continue;
                }
                _ => {}
            }
            let next = cur.join(&comp);
            let node = self.node(&next)?;
            if let InnerNode::Symlink(link) = &node.inner {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                let target = link.link.to_string_lossy().into_owned();
                if target.starts_with('/') {
                    cur = PathBuf::from("/");
                }
                for c in target.split('/').filter(|c| !c.is_empty()).rev() {
                    pending.push_front(c.to_string());
                }
                continue;
            }
            cur = next;
        }
        self.node(&cur)
    }
}

impl FileSource for SquashfsFiles {
    fn read(&self, path: &str, limit: u64) -> Option<Vec<u8>> {
        let node = self.resolve(path)?;
        let InnerNode::File(file) = &node.inner else {
            return None;
        };
        if file.file_len() as u64 > limit {
            tracing::debug!(
                "{}: {path} is larger than {limit} bytes; ignored",
                self.path.display()
            );
            return None;
        }
        let mut out = Vec::with_capacity(file.file_len());
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.fs.file(file).reader().read_to_end(&mut out)
        }))
        .unwrap_or_else(|_| Err(std::io::Error::other("the squashfs reader gave up")));
        match read {
            Ok(_) => Some(out),
            Err(e) => {
                tracing::warn!(
                    "{}: reading {path} inside the squashfs failed: {e}",
                    self.path.display()
                );
                None
            }
        }
    }

    fn list(&self, dir: &str) -> Vec<String> {
        let Some(node) = self.resolve(dir) else {
            return Vec::new();
        };
        if !matches!(node.inner, InnerNode::Dir(_)) {
            return Vec::new();
        }
        let dir = node.fullpath.clone();
        let nodes = &self.fs.root.nodes;
        let start = nodes.partition_point(|n| n.fullpath <= dir);
        nodes[start..]
            .iter()
            .take_while(|n| n.fullpath.starts_with(&dir))
            .filter(|n| n.fullpath.parent() == Some(dir.as_path()))
            .filter_map(|n| n.fullpath.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect()
    }

    fn exists(&self, path: &str) -> bool {
        self.resolve(path).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::process::Command;

    fn testdata(name: &str) -> PathBuf {
        crate::sif::testdata_sif(name)
    }

    /// Builds a squashfs of `tree` with mksquashfs (squashfs-tools, see integration/setup.sh).
    fn mksquashfs(tree: &Path, out: &Path, comp: &[&str]) {
        let status = Command::new("mksquashfs")
            .arg(tree)
            .arg(out)
            .args(["-noappend", "-quiet", "-no-progress"])
            .args(comp)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("mksquashfs (apt-get install squashfs-tools)");
        assert!(status.success());
    }

    fn enroot_tree(dir: &Path) -> PathBuf {
        let tree = dir.join("tree");
        std::fs::create_dir_all(tree.join("etc")).unwrap();
        std::fs::create_dir_all(tree.join("usr/share/env")).unwrap();
        std::fs::write(
            tree.join("usr/share/env/environment"),
            "PATH=/opt/bin:/usr/bin:/bin\nCUDA_HOME=/usr/local/cuda\n",
        )
        .unwrap();
        // Through a relative symlink, as distributions link /etc files.
        symlink("../usr/share/env/environment", tree.join("etc/environment")).unwrap();
        std::fs::write(
            tree.join("etc/rc"),
            "# maintainer berth\n\ncd \"/work\" && unset OLDPWD || exit 1\nexec \"$@\"\n",
        )
        .unwrap();
        tree
    }

    #[test]
    fn superblock_checks() {
        let sif = std::fs::read(testdata("one-group.sif")).unwrap();
        let sb = parse_superblock(&sif[36864..36864 + 96]).unwrap();
        assert_eq!(sb.compression, Compression::Gzip);
        assert!(sb.bytes_used <= 4096, "{sb:?}");
        assert_eq!(parse_superblock(b"hsq"), Err(SuperblockFault::Magic));
        assert_eq!(parse_superblock(&[0u8; 96]), Err(SuperblockFault::Magic));
        let mut v3 = sif[36864..36864 + 96].to_vec();
        v3[28] = 3;
        assert_eq!(parse_superblock(&v3), Err(SuperblockFault::Version(3, 0)));
        let mut lzma = sif[36864..36864 + 96].to_vec();
        lzma[20] = 2;
        assert_eq!(
            parse_superblock(&lzma),
            Err(SuperblockFault::Compression(Compression::Lzma))
        );
        let mut bad = sif[36864..36864 + 96].to_vec();
        bad[12..16].copy_from_slice(&1000u32.to_le_bytes());
        assert!(matches!(
            parse_superblock(&bad),
            Err(SuperblockFault::Corrupt(_))
        ));
    }

    #[test]
    fn probe_finds_the_sif_partition_and_rejects_other_bytes() {
        let path = testdata("one-group.sif");
        probe_squashfs_magic(&path, 36864).unwrap();
        let err = probe_squashfs_magic(&path, 32768).unwrap_err();
        assert!(matches!(
            err,
            SquashfsError::NotSquashfs { offset: 32768, .. }
        ));
        let text = err.to_string();
        assert!(
            text.contains("not a squashfs image") && !text.contains('\n'),
            "{text}"
        );
        assert!(matches!(
            probe_squashfs_magic(Path::new("/"), 0),
            Err(SquashfsError::NotAFile { .. })
        ));
        assert!(matches!(
            probe_squashfs_magic(&path, 1 << 30),
            Err(SquashfsError::NotSquashfs { .. })
        ));
    }

    #[test]
    fn real_sif_reads_hello_txt_at_its_offset() {
        let image = inspect_sif(&testdata("one-group.sif")).unwrap();
        assert_eq!(
            image.rootfs,
            Rootfs::Squashfs {
                file: std::fs::canonicalize(testdata("one-group.sif")).unwrap(),
                offset: 36864,
                size: 4096
            }
        );
        let files = SquashfsFiles::open(&testdata("one-group.sif"), 36864).unwrap();
        assert_eq!(
            files.read("/hello.txt", 100).unwrap(),
            b"Hello from Sylabs!\n"
        );
        assert_eq!(files.read("/hello.txt", 5), None, "over the limit");
        assert_eq!(files.list("/"), ["hello.txt"]);
        // No /.singularity.d in this test image: nothing to synthesise.
        assert_eq!(image.config.config().as_ref().unwrap().env(), &None);
        let expected = sha256_file(&testdata("one-group.sif")).unwrap();
        assert_eq!(image.digest, expected);
        assert_eq!(expected.len(), 7 + 64);
    }

    #[test]
    fn real_sifs_without_a_usable_root_are_refused_in_one_line() {
        for (name, needle) in [
            ("empty.sif", "no primary system partition"),
            ("one-object-oci-root-index.sif", "OCI-SIF"),
        ] {
            let err = inspect_sif(&testdata(name)).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains(name), "{err}");
            assert!(!err.contains('\n'));
        }
        // The two-groups image's primary partition is the same 4 KiB squashfs.
        let image = inspect_sif(&testdata("two-groups.sif")).unwrap();
        assert!(matches!(
            image.rootfs,
            Rootfs::Squashfs { offset: 36864, .. }
        ));
    }

    #[test]
    fn enroot_sqsh_config_from_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let tree = enroot_tree(dir.path());
        for comp in [
            &["-comp", "zstd", "-Xcompression-level", "3"][..],
            &["-comp", "gzip"][..],
            // Enroot's default ENROOT_SQUASH_OPTIONS.
            &["-comp", "lzo", "-noD"][..],
            &["-comp", "xz"][..],
            &["-comp", "lz4"][..],
        ] {
            let sqsh = dir.path().join("image.sqsh");
            mksquashfs(&tree, &sqsh, comp);
            let image = inspect_squashfs(&sqsh).unwrap();
            let config = image.config.config().clone().unwrap();
            assert_eq!(
                config.env().as_deref().unwrap(),
                ["PATH=/opt/bin:/usr/bin:/bin", "CUDA_HOME=/usr/local/cuda"],
                "{comp:?}"
            );
            assert_eq!(config.working_dir().as_deref(), Some("/work"));
            assert_eq!(config.labels().as_ref().unwrap()["maintainer"], "berth");
            assert_eq!(config.entrypoint(), &None);
            let with_rc = inspect_squashfs_with(
                &sqsh,
                &InspectOptions {
                    enroot_entrypoint: true,
                },
            )
            .unwrap();
            assert_eq!(
                with_rc
                    .config
                    .config()
                    .as_ref()
                    .unwrap()
                    .entrypoint()
                    .as_deref(),
                Some(&["/bin/sh".to_string(), "/etc/rc".to_string()][..])
            );
            let len = std::fs::metadata(&sqsh).unwrap().len();
            assert_eq!(
                image.rootfs,
                Rootfs::Squashfs {
                    file: sqsh.clone(),
                    offset: 0,
                    size: len
                }
            );
            assert_eq!(image.source, Reference::Squashfs(sqsh.clone()));
            assert_eq!(image.digest, sha256_file(&sqsh).unwrap());
        }
    }

    #[test]
    fn apptainer_sif_config_from_its_partition() {
        use crate::sif::{self, FsType, ObjectKind, PartType, Partition};
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join(".singularity.d/env")).unwrap();
        std::fs::write(
            tree.join(".singularity.d/env/10-docker2singularity.sh"),
            "#!/bin/sh\nexport PATH=\"/opt/bin:/usr/bin\"\nexport LANG=\"${LANG:-\"C.UTF-8\"}\"\n",
        )
        .unwrap();
        std::fs::write(
            tree.join(".singularity.d/runscript"),
            "#!/bin/sh\nexec \"$@\"\n",
        )
        .unwrap();
        std::fs::write(tree.join(".singularity.d/labels.json"), "{\"a\": \"b\"}").unwrap();
        // Apptainer images link /environment and /singularity to their .singularity.d files.
        symlink(".singularity.d/runscript", tree.join("singularity")).unwrap();
        let sqsh = dir.path().join("root.sqsh");
        mksquashfs(&tree, &sqsh, &["-comp", "xz"]);
        let path = dir.path().join("image.sif");
        let mut w = sif::Writer::new(File::create(&path).unwrap());
        let mut labels: &[u8] = b"{}";
        let labels_kind = ObjectKind::Other {
            data_type: sif::DataType::Labels,
            extra: Vec::new(),
        };
        w.add(labels_kind, "", &mut labels, 1).unwrap();
        let partition = ObjectKind::Partition(Partition {
            fs_type: FsType::Squashfs,
            part_type: PartType::PrimarySystem,
            arch: sif::host_arch().into(),
        });
        let mut data = File::open(&sqsh).unwrap();
        w.add(partition, "", &mut data, sif::PARTITION_ALIGNMENT)
            .unwrap();
        w.finish(0, sif::random_id()).unwrap();
        let image = inspect_sif(&path).unwrap();
        let config = image.config.config().clone().unwrap();
        assert_eq!(
            config.env().as_deref().unwrap(),
            ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8"]
        );
        assert_eq!(
            config.entrypoint().as_deref().unwrap(),
            ["/.singularity.d/runscript"]
        );
        assert_eq!(config.labels().as_ref().unwrap()["a"], "b");
        assert_eq!(
            image.source,
            Reference::Sif(std::fs::canonicalize(&path).unwrap())
        );
        assert_eq!(
            image.digest,
            sha256_file(&path).unwrap(),
            "the whole SIF is hashed"
        );
        let Rootfs::Squashfs { offset, size, .. } = image.rootfs else {
            panic!("{:?}", image.rootfs)
        };
        assert_eq!(
            (offset, size),
            (32768, std::fs::metadata(&sqsh).unwrap().len())
        );
    }

    #[test]
    fn damaged_images_fail_without_panicking() {
        let dir = tempfile::tempdir().unwrap();
        let sif = std::fs::read(testdata("one-group.sif")).unwrap();
        let good = &sif[36864..36864 + 4096];
        let path = dir.path().join("damaged.sqsh");
        let mut failures = 0;
        for at in (0..700).step_by(3) {
            for value in [0x00u8, 0xff, 0x80] {
                let mut b = good.to_vec();
                b[at] = value;
                std::fs::write(&path, &b).unwrap();
                match inspect_squashfs(&path) {
                    Ok(_) => {}
                    Err(e) => {
                        failures += 1;
                        assert!(!e.to_string().contains('\n'), "{e}");
                    }
                }
            }
        }
        assert!(failures > 0, "some damage must be detected");
    }

    #[test]
    fn digest_is_the_sha256_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("abc");
        std::fs::write(&f, "abc").unwrap();
        assert_eq!(
            sha256_file(&f).unwrap(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn truncated_and_foreign_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tree = enroot_tree(dir.path());
        // Incompressible data, so the image is far larger than mksquashfs's 4 KiB padding.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..64 * 1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect();
        std::fs::write(tree.join("noise"), noise).unwrap();
        let sqsh = dir.path().join("image.sqsh");
        mksquashfs(&tree, &sqsh, &["-noD"]);
        let bytes = std::fs::read(&sqsh).unwrap();
        let cut = dir.path().join("cut.sqsh");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let err = inspect_squashfs(&cut).unwrap_err().to_string();
        assert!(
            err.contains("truncated") && err.contains("cut.sqsh"),
            "{err}"
        );
        let text = dir.path().join("notes.sqsh");
        std::fs::write(&text, "just text, not an image").unwrap();
        let err = inspect_squashfs(&text).unwrap_err().to_string();
        assert!(err.contains("not a squashfs image"), "{err}");
        let err = inspect_squashfs(&dir.path().join("missing.sqsh"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.sqsh"), "{err}");
        // A squashfs is not a SIF.
        let err = inspect_sif(&sqsh).unwrap_err().to_string();
        assert!(err.contains("not a SIF file"), "{err}");
    }

    #[test]
    fn symlink_loops_and_escapes_stay_inside_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("etc")).unwrap();
        symlink("loop2", tree.join("etc/loop1")).unwrap();
        symlink("loop1", tree.join("etc/loop2")).unwrap();
        // Points "outside": resolves against the image root, never the host's /etc/passwd.
        symlink("../../../../etc/hostname", tree.join("etc/environment")).unwrap();
        std::fs::write(tree.join("etc/hostname"), "A=inside\n").unwrap();
        let sqsh = dir.path().join("image.sqsh");
        mksquashfs(&tree, &sqsh, &[]);
        let files = SquashfsFiles::open(&sqsh, 0).unwrap();
        assert_eq!(files.read("/etc/loop1", 100), None);
        assert_eq!(files.read("/etc/environment", 100).unwrap(), b"A=inside\n");
        assert_eq!(files.read("/etc", 100), None, "a directory is not a file");
    }
}
