//! The crate's error type. Every failure of an image operation is one line naming the image,
//! file or store and saying what to do; the variants are grouped by what failed, and
//! [`ImageError::kind`] says which group, so the binary can map kinds to exit statuses. A module
//! whose failures form a closed set of its own keeps them in its enum, held by one variant here
//! ([`crate::mount::MountError`], [`crate::squashfs::SquashfsError`]).

use std::io;
use std::path::PathBuf;

use crate::export::ExportError;
use crate::layer::Bound;
use crate::mount::MountError;
use crate::registry::RegistryError;
use crate::sif::Fault;
use crate::squashfs::SquashfsError;
use crate::store::StoreError;

/// What failed, for callers that decide on the group and not the variant (exit statuses, whose
/// fault a failure is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The image reference the user wrote does not parse.
    Reference,
    /// Talking to a registry failed (network, auth, missing tag, digest mismatch, ...).
    Registry,
    /// The store could not import, find, mount or remove an image (space, locks, corrupt
    /// entries), or a layer could not be extracted into it.
    Store,
    /// A file is not a valid image of its kind (tar, archive, layout, squashfs, SIF).
    Format,
    /// Reading or writing a named file failed.
    Io,
    /// `berth export` could not write the image file.
    Export,
    /// A configuration value or an argument (a duration, a compression level) is invalid.
    Config,
}

/// Image errors: one line each, naming the image or file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    // ---- Any part: a reference, a free-form message of a group, a file.
    #[error("invalid image reference '{0}': {1}")]
    Reference(String, String),
    /// What is wrong with part of a reference, before [`ImageError::in_reference`] names the
    /// whole reference.
    #[error("{0}")]
    ReferenceSyntax(String),
    /// A file that is not a valid image of its kind, told in words.
    #[error("{0}")]
    Format(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    /// What is wrong with a document or value, before the caller names which one (a manifest,
    /// a login file, a layer record, an image's platform).
    #[error("{0}")]
    Detail(String),

    // ---- The registry client (`registry`).
    #[error(transparent)]
    Registry(#[from] RegistryError),

    // ---- Reading tar streams (`layer::reader`), before a layer or archive gives them context.
    #[error("{0}")]
    TarRead(io::Error),
    #[error("at byte {offset}: {why}")]
    TarFormat { offset: u64, why: String },

    // ---- Extracting one layer (`layer`); the store adds which layer and image.
    /// Reading the stream failed (decompression, network, file).
    #[error("reading the layer stream: {0}")]
    LayerRead(#[source] io::Error),
    /// The stream is not a tar archive berth can read.
    #[error("not a valid tar stream at byte {offset}: {why}")]
    LayerFormat { offset: u64, why: String },
    /// An entry was refused because it would reach outside the layer or is malformed.
    #[error("refused tar entry '{path}': {why}")]
    Refused { path: String, why: String },
    /// A bound of the store was reached; the store names the key.
    #[error("{0}")]
    Bound(Bound),
    /// Writing the entry into the layer directory failed.
    #[error("writing '{path}' ({op}): {source}")]
    LayerWrite {
        path: String,
        op: &'static str,
        source: io::Error,
    },

    // ---- The image store (`store`).
    #[error(transparent)]
    Store(#[from] StoreError),

    // ---- Archives, OCI layouts and local engines (`archive`), each naming the archive.
    #[error("{what}: {path}: {source}")]
    ArchiveIo {
        what: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{what}: {why}")]
    Invalid { what: String, why: String },
    #[error(
        "{what}: blob {digest} is corrupt: its content has digest {actual}; nothing was kept: re-create or re-download the archive"
    )]
    BlobMismatch {
        what: String,
        digest: String,
        actual: String,
    },
    #[error("{what}: no image named '{name}' in it (it has: {names})")]
    NoSuchName {
        what: String,
        name: String,
        names: String,
    },
    #[error("{what} holds several images ({names}): add one of the names, e.g. {what}:{example}")]
    AmbiguousName {
        what: String,
        names: String,
        example: String,
    },
    #[error("{what}: {tool} is not installed: install it or import an archive file instead")]
    NoTool { what: String, tool: String },
    #[error("{what}: {command} failed: {message}")]
    Tool {
        what: String,
        command: String,
        message: String,
    },

    // ---- Squashfs files (`squashfs`).
    #[error(transparent)]
    Squashfs(#[from] SquashfsError),

    // ---- Apptainer SIF files (`sif`).
    #[error("SIF file {path}: {fault}")]
    Sif { path: PathBuf, fault: Fault },
    /// Reading a SIF file failed; an import reports it as [`ImageError::Io`].
    #[error("reading SIF file {path}: {source}")]
    SifIo { path: PathBuf, source: io::Error },

    // ---- Mounting stored squashfs images (`mount`).
    #[error(transparent)]
    Mount(#[from] MountError),

    // ---- Exporting an image to a file (`export`).
    #[error(transparent)]
    Export(#[from] ExportError),

    /// A lazily loaded image (`lazy:`): its manifest, index, chunks or mounts, told in words.
    #[error("{0}")]
    Lazy(String),

    // ---- Values of the configuration and arguments.
    /// A configuration value serde took but berth cannot use.
    #[error("{0}")]
    Setting(String),
    #[error("invalid duration '{0}': use a number with s, m, h, d or w, e.g. 30m, 12h, 7d")]
    Duration(String),
    #[error("[squashfs] compression_level = {level}: {compressor} takes {min}-{max}")]
    CompressionLevel {
        level: u32,
        compressor: &'static str,
        min: u32,
        max: u32,
    },
}

impl ImageError {
    /// Which group of failures this is.
    pub fn kind(&self) -> Kind {
        use ImageError as E;
        match self {
            E::Reference(..) | E::ReferenceSyntax(_) => Kind::Reference,
            E::Registry(_) | E::Lazy(_) => Kind::Registry,
            E::Format(_)
            | E::Detail(_)
            | E::TarFormat { .. }
            | E::ArchiveIo { .. }
            | E::Invalid { .. }
            | E::BlobMismatch { .. }
            | E::NoSuchName { .. }
            | E::AmbiguousName { .. }
            | E::NoTool { .. }
            | E::Tool { .. }
            | E::Sif { .. } => Kind::Format,
            E::Io { .. }
            | E::TarRead(_)
            | E::Squashfs(SquashfsError::Io { .. })
            | E::SifIo { .. } => Kind::Io,
            E::Squashfs(_) => Kind::Format,
            E::Export(_) => Kind::Export,
            E::Setting(_) | E::Duration(_) | E::CompressionLevel { .. } => Kind::Config,
            E::Store(_)
            | E::LayerRead(_)
            | E::LayerFormat { .. }
            | E::Refused { .. }
            | E::Bound(_)
            | E::LayerWrite { .. }
            | E::Mount(_) => Kind::Store,
        }
    }

    /// A squashfs or SIF read failure as an import reports it: the file and the error, without
    /// the file kind (the import's message names the image already). Others pass unchanged.
    pub fn plain_io(e: impl Into<Self>) -> Self {
        match e.into() {
            ImageError::Squashfs(SquashfsError::Io { path, source })
            | ImageError::SifIo { path, source } => ImageError::Io { path, source },
            other => other,
        }
    }

    /// A failure of part of the reference `text` as the whole reference's. Others pass
    /// unchanged.
    pub fn in_reference(self, text: &str) -> Self {
        match self {
            ImageError::ReferenceSyntax(why) => ImageError::Reference(text.to_string(), why),
            other => other,
        }
    }

    /// A tar reader's failure as the layer extraction reports it. Others pass unchanged.
    pub fn in_layer(self) -> Self {
        match self {
            ImageError::TarRead(e) => ImageError::LayerRead(e),
            ImageError::TarFormat { offset, why } => ImageError::LayerFormat { offset, why },
            other => other,
        }
    }

    /// The file system ran out of space (or quota) while writing a layer.
    pub fn is_no_space(&self) -> bool {
        matches!(self, ImageError::LayerWrite { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_import_reports_a_read_failure_without_the_file_kind() {
        let e = ImageError::from(SquashfsError::Io {
            path: "/x.sqsh".into(),
            source: io::Error::from_raw_os_error(libc::ENOENT),
        });
        assert!(e.to_string().starts_with("reading /x.sqsh: "), "{e}");
        assert_eq!(e.kind(), Kind::Io);
        let plain = ImageError::plain_io(e);
        assert!(plain.to_string().starts_with("/x.sqsh: "), "{plain}");
        assert_eq!(plain.kind(), Kind::Io);
    }

    #[test]
    fn parts_take_the_context_of_what_they_are_part_of() {
        let e = ImageError::ReferenceSyntax("empty tag after ':'".into()).in_reference("ubuntu:");
        assert_eq!(
            e.to_string(),
            "invalid image reference 'ubuntu:': empty tag after ':'"
        );
        assert_eq!(e.kind(), Kind::Reference);
        let e = ImageError::TarFormat {
            offset: 512,
            why: "bad".into(),
        }
        .in_layer();
        assert_eq!(e.to_string(), "not a valid tar stream at byte 512: bad");
    }

    #[test]
    fn files_that_are_not_images_are_format_failures() {
        let not_sqsh = ImageError::from(SquashfsError::NotSquashfs {
            path: "/x".into(),
            offset: 0,
        });
        assert_eq!(not_sqsh.kind(), Kind::Format);
        let sif = ImageError::Sif {
            path: "/x.sif".into(),
            fault: Fault::BadMagic,
        };
        assert_eq!(sif.kind(), Kind::Format);
        assert_eq!(
            ImageError::from(StoreError::NotStored("x".into())).kind(),
            Kind::Store
        );
        assert_eq!(
            ImageError::from(RegistryError::Aborted).kind(),
            Kind::Registry
        );
    }

    #[test]
    fn a_loop_device_failure_names_the_image_file_and_keeps_its_cause() {
        use crate::loopdev::LoopError;
        use nix::errno::Errno;
        let e = ImageError::from(MountError::Loop {
            file: "/store/x.sqsh".into(),
            source: LoopError::NoFree(Errno::ENOSPC),
        });
        assert_eq!(
            e.to_string(),
            "attaching /store/x.sqsh to a loop device: no free loop device: ENOSPC: No space left on device"
        );
        assert_eq!(e.kind(), Kind::Store);
        let cause = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(
            cause.as_deref(),
            Some("no free loop device: ENOSPC: No space left on device")
        );
    }
}
