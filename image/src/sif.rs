//! The Singularity Image Format (SIF) of Apptainer and SingularityCE: a header, a table of object
//! descriptors and the objects they point to. berth reads it to find the root filesystem, the
//! squashfs partition that is then loop-mounted at its offset (never copied), and writes it for
//! `berth export --format sif`.
//!
//! Layout (sylabs/sif v2, little-endian, packed): a 128-byte header (launch script, `SIF_MAGIC`,
//! version `01`, arch, UUID, times, descriptor and data extents), then `descriptors_total`
//! descriptors of 585 bytes each, then the data objects. A partition's descriptor keeps its file
//! system type, partition type and architecture in its `extra` bytes.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use super::ImageError;

pub const HEADER_LEN: usize = 128;
pub const DESCRIPTOR_LEN: usize = 585;
const NAME_LEN: usize = 128;
const EXTRA_LEN: usize = 384;
const MAGIC: &[u8; 10] = b"SIF_MAGIC\0";
const VERSION: &[u8; 3] = b"01\0";
/// Group ids are stored with this mask; a descriptor in no group holds the mask alone.
pub const GROUP_MASK: u32 = 0xf000_0000;
/// The launch script Apptainer writes, so `./image.sif` runs the image with Apptainer.
const LAUNCH: &[u8] = b"#!/usr/bin/env run-singularity\n";
/// Where the descriptor table starts and how many descriptors it has, as sylabs/sif writes them.
const DESCRIPTORS_OFFSET: u64 = 4096;
const DESCRIPTORS_CAPACITY: usize = 48;
/// Start of the data area in a SIF file written with the default table.
pub const DATA_OFFSET: u64 = DESCRIPTORS_OFFSET + (DESCRIPTORS_CAPACITY * DESCRIPTOR_LEN) as u64;
/// Partitions start at page boundaries (sylabs aligns them to the page size).
pub const PARTITION_ALIGNMENT: u64 = 4096;
/// Far above the 48 descriptors every known writer uses; bounds what a corrupt header can make
/// berth read.
const MAX_DESCRIPTORS: i64 = 4096;

/// What is wrong with a SIF file, without the file's name: the reason inside
/// [`ImageError::Sif`](crate::ImageError::Sif), which names the file (the crate's one error
/// type; this only words the reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    BadMagic,
    Truncated(String),
    Corrupt(String),
    Version(String),
    NoPrimary(String),
    ManyPrimaries(usize),
    Encrypted,
    NotSquashfs(String),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadMagic => write!(f, "not a SIF file (no SIF_MAGIC at byte 32)"),
            Self::Truncated(what) => {
                write!(
                    f,
                    "truncated: {what}; the copy is incomplete, fetch it again"
                )
            }
            Self::Corrupt(what) => write!(f, "corrupt: {what}; rebuild or fetch the image again"),
            Self::Version(v) => write!(
                f,
                "SIF version {v:?} is not supported (berth reads version 01, written by Apptainer and SingularityCE)"
            ),
            Self::NoPrimary(what) => write!(
                f,
                "no root file system: no primary system partition ({what}); build it with `apptainer build` from a container image"
            ),
            Self::ManyPrimaries(n) => {
                write!(
                    f,
                    "{n} primary system partitions; a runnable SIF has exactly one"
                )
            }
            Self::Encrypted => write!(
                f,
                "the root file system is an encrypted squashfs, which berth cannot decrypt; build the image without --encrypt"
            ),
            Self::NotSquashfs(what) => write!(
                f,
                "the root file system is {what}, not squashfs; berth runs squashfs root file systems only: rebuild it with `apptainer build`"
            ),
        }
    }
}

/// A data object's type (the descriptor's `type` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    Deffile,
    EnvVar,
    Labels,
    Partition,
    Signature,
    GenericJson,
    Generic,
    CryptoMessage,
    Sbom,
    OciRootIndex,
    OciBlob,
    Unknown(i32),
}

const DATA_TYPES: [(i32, DataType); 11] = [
    (0x4001, DataType::Deffile),
    (0x4002, DataType::EnvVar),
    (0x4003, DataType::Labels),
    (0x4004, DataType::Partition),
    (0x4005, DataType::Signature),
    (0x4006, DataType::GenericJson),
    (0x4007, DataType::Generic),
    (0x4008, DataType::CryptoMessage),
    (0x4009, DataType::Sbom),
    (0x400a, DataType::OciRootIndex),
    (0x400b, DataType::OciBlob),
];

impl DataType {
    pub fn from_raw(raw: i32) -> Self {
        DATA_TYPES
            .iter()
            .find(|(r, _)| *r == raw)
            .map(|(_, t)| *t)
            .unwrap_or(DataType::Unknown(raw))
    }

    pub fn raw(self) -> i32 {
        match self {
            DataType::Unknown(raw) => raw,
            known => {
                DATA_TYPES
                    .iter()
                    .find(|(_, t)| *t == known)
                    .expect("every known type is in DATA_TYPES")
                    .0
            }
        }
    }
}

/// A partition's file system (`Fstype` in sylabs/sif).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsType {
    Squashfs,
    Ext3,
    ImmutableObjects,
    Raw,
    EncryptedSquashfs,
    Unknown(i32),
}

impl FsType {
    pub fn from_raw(raw: i32) -> Self {
        match raw {
            1 => FsType::Squashfs,
            2 => FsType::Ext3,
            3 => FsType::ImmutableObjects,
            4 => FsType::Raw,
            5 => FsType::EncryptedSquashfs,
            other => FsType::Unknown(other),
        }
    }

    pub fn raw(self) -> i32 {
        match self {
            FsType::Squashfs => 1,
            FsType::Ext3 => 2,
            FsType::ImmutableObjects => 3,
            FsType::Raw => 4,
            FsType::EncryptedSquashfs => 5,
            FsType::Unknown(raw) => raw,
        }
    }

    fn describe(self) -> String {
        match self {
            FsType::Squashfs => "squashfs".into(),
            FsType::Ext3 => "an ext3 image".into(),
            FsType::ImmutableObjects => "an object archive".into(),
            FsType::Raw => "raw data".into(),
            FsType::EncryptedSquashfs => "an encrypted squashfs".into(),
            FsType::Unknown(raw) => format!("an unknown file system type ({raw})"),
        }
    }
}

/// A partition's role (`Parttype` in sylabs/sif).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartType {
    System,
    PrimarySystem,
    Data,
    Overlay,
    Unknown(i32),
}

impl PartType {
    pub fn from_raw(raw: i32) -> Self {
        match raw {
            1 => PartType::System,
            2 => PartType::PrimarySystem,
            3 => PartType::Data,
            4 => PartType::Overlay,
            other => PartType::Unknown(other),
        }
    }

    pub fn raw(self) -> i32 {
        match self {
            PartType::System => 1,
            PartType::PrimarySystem => 2,
            PartType::Data => 3,
            PartType::Overlay => 4,
            PartType::Unknown(raw) => raw,
        }
    }
}

/// The extra fields of a partition descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    pub fs_type: FsType,
    pub part_type: PartType,
    /// SIF architecture code: "01" 386, "02" amd64, "03" arm, "04" arm64, ...
    pub arch: String,
}

impl Partition {
    /// The descriptor's `extra` bytes for this partition.
    pub fn extra(&self) -> Vec<u8> {
        let mut extra = Vec::with_capacity(11);
        extra.extend_from_slice(&self.fs_type.raw().to_le_bytes());
        extra.extend_from_slice(&self.part_type.raw().to_le_bytes());
        extra.extend_from_slice(&arch_bytes(&self.arch));
        extra
    }
}

/// The SIF code of the machine berth runs on (the arch of partitions it writes).
pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86" => "01",
        "x86_64" => "02",
        "arm" => "03",
        "aarch64" => "04",
        "powerpc64" if cfg!(target_endian = "big") => "05",
        "powerpc64" => "06",
        "s390x" => "11",
        "riscv64" => "12",
        _ => "00",
    }
}

fn arch_bytes(arch: &str) -> [u8; 3] {
    let mut b = [0u8; 3];
    for (dst, src) in b.iter_mut().zip(arch.bytes().take(2)) {
        *dst = src;
    }
    b
}

/// The global header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub arch: String,
    pub id: [u8; 16],
    pub created: i64,
    pub modified: i64,
    pub descriptors_free: i64,
    pub descriptors_total: i64,
    pub descriptors_offset: i64,
    pub descriptors_size: i64,
    pub data_offset: i64,
    pub data_size: i64,
}

/// One used descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub data_type: DataType,
    pub id: u32,
    /// Group id as stored (with [`GROUP_MASK`]).
    pub group: u32,
    pub link: u32,
    pub offset: u64,
    pub size: u64,
    pub size_with_padding: u64,
    pub created: i64,
    pub modified: i64,
    pub name: String,
    pub extra: Vec<u8>,
}

impl Descriptor {
    /// The partition fields, for a partition descriptor.
    pub fn partition(&self) -> Option<Partition> {
        if self.data_type != DataType::Partition {
            return None;
        }
        Some(Partition {
            fs_type: FsType::from_raw(i32_at(&self.extra, 0)),
            part_type: PartType::from_raw(i32_at(&self.extra, 4)),
            arch: cstr(&self.extra[8..11]),
        })
    }

    /// One line for messages and `berth` listings.
    pub fn describe(&self) -> String {
        match self.partition() {
            Some(p) => format!(
                "object {}: partition ({}, {:?}) of {} bytes",
                self.id,
                p.fs_type.describe(),
                p.part_type,
                self.size
            ),
            None => format!(
                "object {}: {:?} of {} bytes",
                self.id, self.data_type, self.size
            ),
        }
    }
}

/// A parsed SIF file: its header and used descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sif {
    pub header: Header,
    pub descriptors: Vec<Descriptor>,
    pub file_len: u64,
}

fn i32_at(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn i64_at(b: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Parses the 128-byte global header.
pub fn parse_header(b: &[u8], file_len: u64) -> Result<Header, Fault> {
    if b.len() < HEADER_LEN || file_len < HEADER_LEN as u64 {
        if b.len() >= 42 && &b[32..42] != MAGIC {
            return Err(Fault::BadMagic);
        }
        return Err(Fault::Truncated(format!(
            "{file_len} bytes, shorter than the {HEADER_LEN}-byte header"
        )));
    }
    if &b[32..42] != MAGIC {
        return Err(Fault::BadMagic);
    }
    if &b[42..45] != VERSION {
        return Err(Fault::Version(cstr(&b[42..45])));
    }
    let header = Header {
        arch: cstr(&b[45..48]),
        id: b[48..64].try_into().expect("16 bytes"),
        created: i64_at(b, 64),
        modified: i64_at(b, 72),
        descriptors_free: i64_at(b, 80),
        descriptors_total: i64_at(b, 88),
        descriptors_offset: i64_at(b, 96),
        descriptors_size: i64_at(b, 104),
        data_offset: i64_at(b, 112),
        data_size: i64_at(b, 120),
    };
    if !(0..=MAX_DESCRIPTORS).contains(&header.descriptors_total) {
        return Err(Fault::Corrupt(format!(
            "the header claims {} descriptors",
            header.descriptors_total
        )));
    }
    if !u64::try_from(header.descriptors_offset).is_ok_and(|o| o >= HEADER_LEN as u64) {
        return Err(Fault::Corrupt(format!(
            "the descriptor table starts at byte {}, inside the header",
            header.descriptors_offset
        )));
    }
    let (start, len) = header.table_extent();
    if start + len > file_len {
        return Err(Fault::Truncated(format!(
            "the descriptor table ends at byte {} but the file has {file_len} bytes",
            start + len
        )));
    }
    Ok(header)
}

impl Header {
    /// Byte offset and length of the descriptor table (validated by [`parse_header`]).
    #[expect(
        clippy::cast_sign_loss,
        reason = "parse_header refuses an offset below HEADER_LEN and a count outside 0..=MAX_DESCRIPTORS"
    )]
    pub fn table_extent(&self) -> (u64, u64) {
        (
            self.descriptors_offset as u64,
            self.descriptors_total as u64 * DESCRIPTOR_LEN as u64,
        )
    }
}

/// Parses one 585-byte descriptor; `None` when the slot is unused.
pub fn parse_descriptor(b: &[u8], file_len: u64) -> Result<Option<Descriptor>, Fault> {
    if b[4] == 0 {
        return Ok(None);
    }
    let raw_offset = i64_at(b, 17);
    let raw_size = i64_at(b, 25);
    let data_type = DataType::from_raw(i32_at(b, 0));
    let id = u32_at(b, 5);
    if raw_offset < 0 || raw_size < 0 {
        return Err(Fault::Corrupt(format!(
            "object {id} has a negative offset or size"
        )));
    }
    let (offset, size) = (raw_offset.unsigned_abs(), raw_size.unsigned_abs());
    if offset.checked_add(size).is_none_or(|end| end > file_len) {
        return Err(Fault::Truncated(format!(
            "object {id} ({data_type:?}) spans bytes {offset}..{} but the file has {file_len} bytes",
            offset.saturating_add(size)
        )));
    }
    Ok(Some(Descriptor {
        data_type,
        id,
        group: u32_at(b, 9),
        link: u32_at(b, 13),
        offset,
        size,
        size_with_padding: u64::try_from(i64_at(b, 33)).unwrap_or(0),
        created: i64_at(b, 41),
        modified: i64_at(b, 49),
        name: cstr(&b[73..73 + NAME_LEN]),
        extra: b[201..201 + EXTRA_LEN].to_vec(),
    }))
}

impl Sif {
    /// Parses a SIF held in memory (all of it, or at least its header and descriptor table);
    /// `file_len` is the whole file's length.
    pub fn parse(bytes: &[u8], file_len: u64) -> Result<Sif, Fault> {
        let header = parse_header(bytes, file_len)?;
        let (start, len) = header.table_extent();
        let table = bytes
            .get(
                usize::try_from(start).unwrap_or(usize::MAX)
                    ..usize::try_from(start + len).unwrap_or(usize::MAX),
            )
            .ok_or_else(|| Fault::Truncated("the descriptor table is incomplete".into()))?;
        Sif::with_table(header, table, file_len)
    }

    /// A SIF from its parsed header and the bytes of its descriptor table.
    fn with_table(header: Header, table: &[u8], file_len: u64) -> Result<Sif, Fault> {
        let mut descriptors = Vec::new();
        for raw in table.chunks_exact(DESCRIPTOR_LEN) {
            if let Some(d) = parse_descriptor(raw, file_len)? {
                descriptors.push(d);
            }
        }
        Ok(Sif {
            header,
            descriptors,
            file_len,
        })
    }

    /// Reads the header and descriptor table of the SIF file at `path`.
    pub fn open(path: &Path) -> Result<Sif, ImageError> {
        let io = |source| ImageError::SifIo {
            path: path.to_path_buf(),
            source,
        };
        let fault = |fault| ImageError::Sif {
            path: path.to_path_buf(),
            fault,
        };
        let mut file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut head =
            vec![0u8; usize::try_from(file_len).map_or(HEADER_LEN, |n| HEADER_LEN.min(n))];
        file.read_exact(&mut head).map_err(io)?;
        let header = parse_header(&head, file_len).map_err(fault)?;
        // Only the table is read: its offset comes from the file and may be anywhere in it.
        let (start, len) = header.table_extent();
        #[expect(
            clippy::cast_possible_truncation,
            reason = "parse_header caps the table at MAX_DESCRIPTORS * DESCRIPTOR_LEN bytes (2.4 MB)"
        )]
        let mut table = vec![0u8; len as usize];
        file.seek(SeekFrom::Start(start)).map_err(io)?;
        file.read_exact(&mut table).map_err(io)?;
        Sif::with_table(header, &table, file_len).map_err(fault)
    }

    /// The root file system: the one primary system partition, which must be a plain squashfs.
    pub fn primary_partition(&self) -> Result<&Descriptor, Fault> {
        let primaries: Vec<&Descriptor> = self
            .descriptors
            .iter()
            .filter(|d| {
                d.partition()
                    .is_some_and(|p| p.part_type == PartType::PrimarySystem)
            })
            .collect();
        let d = match primaries.as_slice() {
            [] => {
                let found = if self.descriptors.is_empty() {
                    "the file holds no objects".to_string()
                } else if self
                    .descriptors
                    .iter()
                    .any(|d| d.data_type == DataType::OciRootIndex)
                {
                    "it is an OCI-SIF of SingularityCE --oci, which holds OCI layers".to_string()
                } else {
                    let objects: Vec<String> =
                        self.descriptors.iter().map(|d| d.describe()).collect();
                    format!("it holds {}", objects.join("; "))
                };
                return Err(Fault::NoPrimary(found));
            }
            [d] => *d,
            many => return Err(Fault::ManyPrimaries(many.len())),
        };
        match d.partition().map(|p| p.fs_type) {
            Some(FsType::Squashfs) => Ok(d),
            Some(FsType::EncryptedSquashfs) => Err(Fault::Encrypted),
            Some(other) => Err(Fault::NotSquashfs(other.describe())),
            None => unreachable!("filtered on partitions"),
        }
    }
}

/// What a new object is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectKind {
    Partition(Partition),
    /// Any other object: its type and extra bytes.
    Other {
        data_type: DataType,
        extra: Vec<u8>,
    },
}

impl ObjectKind {
    fn data_type(&self) -> DataType {
        match self {
            ObjectKind::Partition(_) => DataType::Partition,
            ObjectKind::Other { data_type, .. } => *data_type,
        }
    }
    fn extra(&self) -> Vec<u8> {
        match self {
            ObjectKind::Partition(p) => p.extra(),
            ObjectKind::Other { extra, .. } => extra.clone(),
        }
    }
}

/// Writes a SIF file: objects first (each at the next offset its alignment allows), then the
/// descriptor table and the header, so a reader never sees a header whose objects are missing.
/// Every object goes into group 1, as `apptainer build` does.
#[derive(Debug)]
pub struct Writer<W: Write + Seek> {
    out: W,
    descriptors: Vec<Descriptor>,
    end: u64,
    arch: String,
}

impl<W: Write + Seek> Writer<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            descriptors: Vec::new(),
            end: DATA_OFFSET,
            arch: "00".into(),
        }
    }

    /// Where the next object with this alignment would start.
    pub fn next_offset(&self, alignment: u64) -> u64 {
        self.end.next_multiple_of(alignment.max(1))
    }

    /// Copies `data` into the file as a new object; returns its descriptor.
    pub fn add(
        &mut self,
        kind: ObjectKind,
        name: &str,
        data: &mut dyn Read,
        alignment: u64,
    ) -> std::io::Result<&Descriptor> {
        let offset = self.next_offset(alignment);
        self.out.seek(SeekFrom::Start(offset))?;
        let size = std::io::copy(data, &mut self.out)?;
        self.record(kind, name, offset, size)
    }

    /// Records an object that something else (mksquashfs `-offset`) already wrote at `offset`,
    /// which must be [`Self::next_offset`] for its alignment or later.
    pub fn add_written(
        &mut self,
        kind: ObjectKind,
        name: &str,
        offset: u64,
        size: u64,
    ) -> std::io::Result<&Descriptor> {
        if offset < self.end {
            return Err(std::io::Error::other(format!(
                "SIF object at {offset} overlaps the previous one ending at {}",
                self.end
            )));
        }
        self.record(kind, name, offset, size)
    }

    fn record(
        &mut self,
        kind: ObjectKind,
        name: &str,
        offset: u64,
        size: u64,
    ) -> std::io::Result<&Descriptor> {
        if self.descriptors.len() == DESCRIPTORS_CAPACITY {
            return Err(std::io::Error::other("too many SIF objects"));
        }
        if let ObjectKind::Partition(p) = &kind
            && p.part_type == PartType::PrimarySystem
        {
            self.arch = p.arch.clone();
        }
        let id = u32::try_from(self.descriptors.len()).map_err(std::io::Error::other)? + 1;
        self.descriptors.push(Descriptor {
            data_type: kind.data_type(),
            id,
            group: GROUP_MASK | 1,
            link: 0,
            offset,
            size,
            size_with_padding: offset - self.end + size,
            created: 0,
            modified: 0,
            name: name.into(),
            extra: kind.extra(),
        });
        self.end = offset + size;
        Ok(self.descriptors.last().expect("just pushed"))
    }

    /// Writes the descriptor table and the header; `time` is the creation time (Unix seconds)
    /// and `id` the image UUID.
    #[expect(
        clippy::cast_possible_wrap,
        reason = "offsets and sizes are of the file being written, which the kernel caps at i64::MAX \
                  (off_t); the rest are small constants"
    )]
    pub fn finish(mut self, time: i64, id: [u8; 16]) -> std::io::Result<W> {
        let mut table = vec![0u8; DESCRIPTORS_CAPACITY * DESCRIPTOR_LEN];
        for (d, raw) in self
            .descriptors
            .iter()
            .zip(table.chunks_exact_mut(DESCRIPTOR_LEN))
        {
            raw[0..4].copy_from_slice(&d.data_type.raw().to_le_bytes());
            raw[4] = 1;
            raw[5..9].copy_from_slice(&d.id.to_le_bytes());
            raw[9..13].copy_from_slice(&d.group.to_le_bytes());
            raw[13..17].copy_from_slice(&d.link.to_le_bytes());
            raw[17..25].copy_from_slice(&(d.offset as i64).to_le_bytes());
            raw[25..33].copy_from_slice(&(d.size as i64).to_le_bytes());
            raw[33..41].copy_from_slice(&(d.size_with_padding as i64).to_le_bytes());
            raw[41..49].copy_from_slice(&time.to_le_bytes());
            raw[49..57].copy_from_slice(&time.to_le_bytes());
            // uid and gid (57..73) are deprecated and stay zero.
            let name = d.name.as_bytes();
            let n = name.len().min(NAME_LEN - 1);
            raw[73..73 + n].copy_from_slice(&name[..n]);
            let n = d.extra.len().min(EXTRA_LEN);
            raw[201..201 + n].copy_from_slice(&d.extra[..n]);
        }
        let mut header = [0u8; HEADER_LEN];
        header[..LAUNCH.len()].copy_from_slice(LAUNCH);
        header[32..42].copy_from_slice(MAGIC);
        header[42..45].copy_from_slice(VERSION);
        header[45..48].copy_from_slice(&arch_bytes(&self.arch));
        header[48..64].copy_from_slice(&id);
        let data_size: u64 = self.descriptors.iter().map(|d| d.size_with_padding).sum();
        let fields: [i64; 8] = [
            time,
            time,
            (DESCRIPTORS_CAPACITY - self.descriptors.len()) as i64,
            DESCRIPTORS_CAPACITY as i64,
            DESCRIPTORS_OFFSET as i64,
            (DESCRIPTORS_CAPACITY * DESCRIPTOR_LEN) as i64,
            DATA_OFFSET as i64,
            data_size as i64,
        ];
        for (i, v) in fields.iter().enumerate() {
            header[64 + 8 * i..72 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        self.out.seek(SeekFrom::Start(DESCRIPTORS_OFFSET))?;
        self.out.write_all(&table)?;
        self.out.seek(SeekFrom::Start(0))?;
        self.out.write_all(&header)?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A random (version 4) UUID for a new image.
pub fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    // Falls back to the time and pid if getrandom fails: the id only needs to differ between
    // images, it protects nothing.
    // SAFETY: getrandom writes at most id.len() bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if usize::try_from(n).ok() != Some(id.len()) {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        #[expect(
            clippy::cast_possible_truncation,
            reason = "only the low 64 bits of the time are wanted: the id only needs to differ"
        )]
        let t = t as u64;
        id[..8].copy_from_slice(&t.to_le_bytes());
        id[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    id[6] = (id[6] & 0x0f) | 0x40;
    id[8] = (id[8] & 0x3f) | 0x80;
    id
}

/// A SIF file of the shared test data (sylabs/sif's test images, see its README), found next to
/// the checkout or inside it. For tests (the `testdata` feature lends it to berth's).
#[cfg(any(test, feature = "testdata"))]
pub fn testdata_sif(name: &str) -> std::path::PathBuf {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let candidates = [
        manifest.join("../shared/testdata/sif"),
        manifest.join("../../shared/testdata/sif"),
        std::path::PathBuf::from("/work/shared/testdata/sif"),
    ];
    candidates
        .iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("SIF test data {name} not found in {candidates:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use std::path::PathBuf;

    fn testdata(name: &str) -> PathBuf {
        testdata_sif(name)
    }

    fn load(name: &str) -> (Vec<u8>, Sif) {
        let bytes = std::fs::read(testdata(name)).unwrap();
        let sif = Sif::parse(&bytes, bytes.len() as u64).unwrap();
        assert_eq!(Sif::open(&testdata(name)).unwrap(), sif);
        (bytes, sif)
    }

    #[test]
    fn empty_sif_has_a_header_and_no_objects() {
        let (_, sif) = load("empty.sif");
        assert_eq!(sif.header.descriptors_total, 48);
        assert_eq!(sif.header.descriptors_free, 48);
        assert_eq!(sif.header.descriptors_offset, 4096);
        assert_eq!(u64::try_from(sif.header.data_offset).unwrap(), DATA_OFFSET);
        assert_eq!(sif.header.created, -62135596800);
        assert!(sif.descriptors.is_empty());
        let err = sif.primary_partition().unwrap_err();
        assert!(
            matches!(err, Fault::NoPrimary(ref w) if w.contains("no objects")),
            "{err}"
        );
    }

    #[test]
    fn one_group_sif_has_a_raw_partition_and_a_primary_squashfs() {
        let (bytes, sif) = load("one-group.sif");
        assert_eq!(sif.header.arch, "01");
        assert_eq!(sif.descriptors.len(), 2);
        let raw = &sif.descriptors[0];
        assert_eq!(raw.id, 1);
        assert_eq!(raw.group, GROUP_MASK | 1);
        assert_eq!((raw.offset, raw.size), (32768, 4));
        assert_eq!(
            raw.partition().unwrap(),
            Partition {
                fs_type: FsType::Raw,
                part_type: PartType::System,
                arch: "01".into()
            }
        );
        assert_eq!(&bytes[32768..32772], &[0xfa, 0xce, 0xfe, 0xed]);
        let root = sif.primary_partition().unwrap();
        assert_eq!(root.id, 2);
        assert_eq!(
            (root.offset, root.size, root.size_with_padding),
            (36864, 4096, 8188)
        );
        assert_eq!(&bytes[36864..36868], b"hsqs");
    }

    #[test]
    fn signed_sif_keeps_its_signature_object() {
        let (_, sif) = load("one-group-signed-pgp.sif");
        assert_eq!(sif.descriptors.len(), 3);
        let sig = &sif.descriptors[2];
        assert_eq!(sig.data_type, DataType::Signature);
        assert_eq!(sig.group, GROUP_MASK);
        assert_eq!(sig.link, GROUP_MASK | 1, "signs group 1");
        assert_eq!(sif.primary_partition().unwrap().id, 2);
    }

    #[test]
    fn two_groups_sif_has_an_ext3_system_partition_beside_the_primary() {
        let (bytes, sif) = load("two-groups.sif");
        assert_eq!(sif.descriptors.len(), 3);
        let second = &sif.descriptors[2];
        assert_eq!(second.group, GROUP_MASK | 2);
        let p = second.partition().unwrap();
        assert_eq!((p.fs_type, p.part_type), (FsType::Ext3, PartType::System));
        // The ext2/3 superblock magic 0xEF53 sits 1080 bytes into the partition.
        let magic = usize::try_from(second.offset).unwrap() + 1080;
        assert_eq!(&bytes[magic..magic + 2], &[0x53, 0xef]);
        assert_eq!(sif.primary_partition().unwrap().id, 2);
    }

    #[test]
    fn oci_sif_has_no_primary_partition() {
        let (_, sif) = load("one-object-oci-root-index.sif");
        assert_eq!(sif.descriptors[0].data_type, DataType::OciRootIndex);
        let err = sif.primary_partition().unwrap_err();
        assert!(
            matches!(err, Fault::NoPrimary(ref w) if w.contains("OCI-SIF")),
            "{err}"
        );
    }

    #[test]
    fn bad_input_gives_the_right_fault() {
        let (good, _) = load("one-group.sif");
        let len = good.len() as u64;

        let mut bad = good.clone();
        bad[32] = b'X';
        assert_eq!(Sif::parse(&bad, len).unwrap_err(), Fault::BadMagic);
        assert_eq!(
            Sif::parse(b"hello", 5).unwrap_err(),
            Fault::Truncated("5 bytes, shorter than the 128-byte header".into())
        );
        assert_eq!(Sif::parse(&[0u8; 64], 64).unwrap_err(), Fault::BadMagic);

        let mut bad = good.clone();
        bad[42..45].copy_from_slice(b"02\0");
        assert_eq!(
            Sif::parse(&bad, len).unwrap_err(),
            Fault::Version("02".into())
        );

        // Cut inside the descriptor table, then inside the squashfs partition.
        let cut = 5000;
        assert!(matches!(
            Sif::parse(&good[..cut], cut as u64),
            Err(Fault::Truncated(_))
        ));
        let cut = 38000;
        let err = Sif::parse(&good[..cut], cut as u64).unwrap_err();
        assert!(
            matches!(err, Fault::Truncated(ref w) if w.contains("object 2")),
            "{err}"
        );

        let mut bad = good.clone();
        bad[88..96].copy_from_slice(&1_000_000i64.to_le_bytes());
        assert!(matches!(Sif::parse(&bad, len), Err(Fault::Corrupt(_))));
        let mut bad = good.clone();
        bad[88..96].copy_from_slice(&(-1i64).to_le_bytes());
        assert!(matches!(Sif::parse(&bad, len), Err(Fault::Corrupt(_))));
        let mut bad = good.clone();
        bad[96..104].copy_from_slice(&8i64.to_le_bytes());
        assert!(matches!(Sif::parse(&bad, len), Err(Fault::Corrupt(_))));

        // Object 2's offset pointing far past the end, and wrapping around.
        let d2 = 4096 + DESCRIPTOR_LEN;
        let mut bad = good.clone();
        bad[d2 + 17..d2 + 25].copy_from_slice(&(1i64 << 40).to_le_bytes());
        assert!(matches!(Sif::parse(&bad, len), Err(Fault::Truncated(_))));
        let mut bad = good.clone();
        bad[d2 + 17..d2 + 25].copy_from_slice(&i64::MAX.to_le_bytes());
        bad[d2 + 25..d2 + 33].copy_from_slice(&i64::MAX.to_le_bytes());
        assert!(matches!(Sif::parse(&bad, len), Err(Fault::Truncated(_))));
        let mut bad = good.clone();
        bad[d2 + 25..d2 + 33].copy_from_slice(&(-4i64).to_le_bytes());
        assert!(matches!(Sif::parse(&bad, len), Err(Fault::Corrupt(_))));
    }

    #[test]
    fn every_byte_prefix_and_flip_of_a_real_file_parses_or_faults_without_panicking() {
        let (good, _) = load("one-group-signed-pgp.sif");
        for cut in (0..good.len()).step_by(97) {
            let _ = Sif::parse(&good[..cut], cut as u64);
        }
        for at in (0..4096 + 3 * DESCRIPTOR_LEN).step_by(7) {
            let mut bad = good.clone();
            bad[at] ^= 0xff;
            if let Ok(sif) = Sif::parse(&bad, bad.len() as u64) {
                let _ = sif.primary_partition();
            }
        }
    }

    fn build(objects: Vec<(ObjectKind, Vec<u8>)>) -> Vec<u8> {
        let mut w = Writer::new(Cursor::new(Vec::new()));
        for (kind, data) in objects {
            let align = match kind {
                ObjectKind::Partition(_) => PARTITION_ALIGNMENT,
                _ => 1,
            };
            w.add(kind, "", &mut data.as_slice(), align).unwrap();
        }
        w.finish(1_700_000_000, random_id()).unwrap().into_inner()
    }

    fn part(fs_type: FsType, part_type: PartType) -> ObjectKind {
        ObjectKind::Partition(Partition {
            fs_type,
            part_type,
            arch: host_arch().into(),
        })
    }

    #[test]
    fn written_sif_matches_the_sylabs_layout() {
        let bytes = build(vec![
            (
                part(FsType::Raw, PartType::System),
                vec![0xfa, 0xce, 0xfe, 0xed],
            ),
            (
                part(FsType::Squashfs, PartType::PrimarySystem),
                b"hsqs-and-more".to_vec(),
            ),
        ]);
        let sif = Sif::parse(&bytes, bytes.len() as u64).unwrap();
        let reference = load("one-group.sif").1;
        assert_eq!(
            sif.header.descriptors_offset,
            reference.header.descriptors_offset
        );
        assert_eq!(
            sif.header.descriptors_size,
            reference.header.descriptors_size
        );
        assert_eq!(sif.header.data_offset, reference.header.data_offset);
        assert_eq!(sif.header.descriptors_free, 46);
        assert_eq!(sif.header.arch, host_arch());
        assert_eq!(sif.header.created, 1_700_000_000);
        for (mine, theirs) in sif.descriptors.iter().zip(&reference.descriptors) {
            assert_eq!(
                (
                    mine.id,
                    mine.group,
                    mine.link,
                    mine.offset,
                    mine.size_with_padding - mine.size
                ),
                (
                    theirs.id,
                    theirs.group,
                    theirs.link,
                    theirs.offset,
                    theirs.size_with_padding - theirs.size
                )
            );
        }
        assert_eq!(
            u64::try_from(sif.header.data_size).unwrap(),
            sif.descriptors
                .iter()
                .map(|d| d.size_with_padding)
                .sum::<u64>()
        );
        let root = sif.primary_partition().unwrap();
        assert_eq!(
            &bytes[usize::try_from(root.offset).unwrap()..][..usize::try_from(root.size).unwrap()],
            b"hsqs-and-more"
        );
        assert_eq!(&bytes[..LAUNCH.len()], LAUNCH);
    }

    #[test]
    fn written_sif_faults_on_refused_partitions() {
        let cases = [
            (
                part(FsType::EncryptedSquashfs, PartType::PrimarySystem),
                Fault::Encrypted,
            ),
            (
                part(FsType::Ext3, PartType::PrimarySystem),
                Fault::NotSquashfs("an ext3 image".into()),
            ),
        ];
        for (kind, fault) in cases {
            let bytes = build(vec![(kind, b"data".to_vec())]);
            let sif = Sif::parse(&bytes, bytes.len() as u64).unwrap();
            assert_eq!(sif.primary_partition().unwrap_err(), fault);
        }
        let bytes = build(vec![(
            part(FsType::Squashfs, PartType::System),
            b"data".to_vec(),
        )]);
        let sif = Sif::parse(&bytes, bytes.len() as u64).unwrap();
        let err = sif.primary_partition().unwrap_err();
        assert!(
            matches!(err, Fault::NoPrimary(ref w) if w.contains("squashfs, System")),
            "{err}"
        );
        let bytes = build(vec![
            (
                part(FsType::Squashfs, PartType::PrimarySystem),
                b"a".to_vec(),
            ),
            (
                part(FsType::Squashfs, PartType::PrimarySystem),
                b"b".to_vec(),
            ),
        ]);
        let sif = Sif::parse(&bytes, bytes.len() as u64).unwrap();
        assert_eq!(
            sif.primary_partition().unwrap_err(),
            Fault::ManyPrimaries(2)
        );
    }

    #[test]
    fn errors_are_one_line_and_name_the_file() {
        let err = ImageError::Sif {
            path: "/images/x.sif".into(),
            fault: Fault::Encrypted,
        };
        let text = err.to_string();
        assert!(text.starts_with("SIF file /images/x.sif: "), "{text}");
        assert!(!text.contains('\n'));
    }

    #[test]
    fn random_ids_differ_and_are_version_4() {
        let (a, b) = (random_id(), random_id());
        assert_ne!(a, b);
        assert_eq!(a[6] >> 4, 4);
    }
}
