//! Streaming an archive's layers into the store: decompressed, hashed against the manifest
//! and the config's diff_ids, several at once.

use std::io::{self, BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use sha2::{Digest as _, Sha256};

use super::blobs::Blobs;
use super::invalid;
use super::plan::{Compression, LayerJob, Plan};
use crate::local::FileStamp;
use crate::reference::reference_key;
use crate::store::StoreError;
use crate::store::{self, Progress, Store, human_size};
use crate::{Image, ImageError, LayerSink, Reference, Rootfs};

/// Hashes and counts a blob as it is read; fails fast once another layer has failed.
pub(super) struct Hashed<'a, R> {
    pub(super) inner: R,
    pub(super) hasher: Sha256,
    pub(super) bytes: u64,
    pub(super) cancel: &'a AtomicBool,
}

impl<R: Read> Read for Hashed<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.cancel.load(Ordering::Relaxed) {
            return Err(io::Error::other(
                "cancelled: another layer of the import failed",
            ));
        }
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

pub(super) fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

pub(super) fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

/// Decompresses, extracts and verifies one layer, then publishes it.
pub(super) fn import_layer(
    store: &Store,
    blobs: &dyn Blobs,
    job: &LayerJob,
    what: &str,
    cancel: &AtomicBool,
) -> Result<(PathBuf, Option<(u64, u64)>), ImageError> {
    // A layer the store already has is still read (and only hashed, see Store::stage): a digest
    // is no proof that whoever names this file could read the layer.
    let mut hashed = Hashed {
        inner: blobs.open(&job.blob)?,
        hasher: Sha256::new(),
        bytes: 0,
        cancel,
    };
    let staged = {
        let mut buffered = BufReader::with_capacity(128 * 1024, &mut hashed);
        let kind = match job.compression {
            Compression::Sniff => sniff(buffered.fill_buf().map_err(|e| read_error(what, job, e))?),
            other => other,
        };
        let mut decoder: Box<dyn Read + '_> = match kind {
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buffered)),
            Compression::Zstd => Box::new(
                zstd::stream::read::Decoder::with_buffer(buffered)
                    .map_err(|e| read_error(what, job, e))?,
            ),
            Compression::None | Compression::Sniff => Box::new(buffered),
        };
        store.stage(&job.diff_id, &mut decoder)
    };
    // Read what the decompressor left (trailers, padding) so the digest covers the whole blob.
    let drained = io::copy(&mut hashed, &mut io::sink());
    let actual = format!("sha256:{:x}", hashed.hasher.clone().finalize());
    // A corrupt blob usually also breaks decompression; its digest is the clearer error.
    if let Some(expected) = &job.digest
        && drained.is_ok()
        && &actual != expected
    {
        return Err(ImageError::BlobMismatch {
            what: what.to_string(),
            digest: expected.clone(),
            actual,
        });
    }
    let staged = staged.map_err(|e| StoreError::Message(format!("{what}: {e}")))?;
    drained.map_err(|e| read_error(what, job, e))?;
    if let Some(size) = job.size
        && size != hashed.bytes
    {
        return Err(invalid(
            what,
            format!(
                "layer {} is {} bytes, the manifest says {size}",
                job.blob, hashed.bytes
            ),
        ));
    }
    let extracted = staged
        .extracted()
        .then(|| (staged.size(), staged.tar_bytes()));
    let dir = staged
        .publish_layer()
        .map_err(|e| StoreError::Message(format!("{what}: {e}")))?;
    Ok((dir, extracted))
}

pub(super) fn read_error(what: &str, job: &LayerJob, e: io::Error) -> ImageError {
    ImageError::Format(format!("{what}: reading layer {}: {e}", job.blob))
}

/// Imports the layers, `store.parallel_layers()` at a time; returns their directories in order.
pub(super) fn import_layers(
    store: &Store,
    blobs: &dyn Blobs,
    jobs: &[LayerJob],
    what: &str,
    progress: Progress<'_>,
) -> Result<Vec<PathBuf>, ImageError> {
    let next = AtomicUsize::new(0);
    let cancel = AtomicBool::new(false);
    let failure: Mutex<Option<ImageError>> = Mutex::new(None);
    let dirs: Mutex<Vec<Option<PathBuf>>> = Mutex::new(vec![None; jobs.len()]);
    let workers = store.parallel_layers().min(jobs.len()).max(1);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= jobs.len() || cancel.load(Ordering::Relaxed) {
                        return;
                    }
                    let job = &jobs[i];
                    let started = Instant::now();
                    match import_layer(store, blobs, job, what, &cancel) {
                        Ok((dir, extracted)) => {
                            let line = match extracted {
                                Some((size, _)) => format!(
                                    "layer {}/{} {}: extracted layer ({}) in {:.1} s",
                                    i + 1,
                                    jobs.len(),
                                    short(&job.diff_id),
                                    human_size(size),
                                    started.elapsed().as_secs_f64()
                                ),
                                None => format!(
                                    "layer {}/{} {}: already in the store",
                                    i + 1,
                                    jobs.len(),
                                    short(&job.diff_id)
                                ),
                            };
                            progress(&line);
                            dirs.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(dir);
                        }
                        Err(e) => {
                            let mut slot = failure.lock().unwrap_or_else(|p| p.into_inner());
                            if slot.is_none() {
                                *slot = Some(e);
                            }
                            cancel.store(true, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(dirs
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .flatten()
        .collect())
}

/// Bytes an import of these layers may need: compressed sizes × [`store::COMPRESSED_GROWTH`],
/// uncompressed ones + 10%.
pub(super) fn estimate(jobs: &[&LayerJob]) -> u64 {
    jobs.iter()
        .map(|j| {
            let size = j.size.unwrap_or(0);
            let compressed = match j.compression {
                Compression::Gzip | Compression::Zstd => true,
                Compression::None => false,
                Compression::Sniff => !(j.blob.ends_with(".tar") || j.blob.starts_with("blobs/")),
            };
            if compressed {
                size.saturating_mul(store::COMPRESSED_GROWTH)
            } else {
                size + size / 10
            }
        })
        .sum()
}

pub(super) fn run_plan(
    store: &Store,
    blobs: &dyn Blobs,
    plan: Plan,
    reference: &Reference,
    stamp: Option<&FileStamp>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    let what = reference_key(reference);
    let Plan {
        digest,
        config,
        layers,
    } = plan;
    // Before anything is extracted: an image with more layers than overlayfs stacks can never
    // run.
    store.check_layers(&what, layers.len())?;
    store.import_stamped(&digest, reference, stamp, progress, |store| {
        let missing: Vec<&LayerJob> = layers
            .iter()
            .filter(|j| store.existing_layer(&j.diff_id).is_none())
            .collect();
        let needed = estimate(&missing);
        store.check_space(&what, needed)?;
        progress(&format!(
            "importing {what} as {digest}: {} layer{}, {} to extract (about {})",
            layers.len(),
            if layers.len() == 1 { "" } else { "s" },
            missing.len(),
            human_size(needed)
        ));
        let dirs = import_layers(store, blobs, &layers, &what, progress)?;
        Ok(Image {
            digest: digest.clone(),
            source: reference.clone(),
            rootfs: Rootfs::Layers(store::dedup_layers(dirs)),
            config,
            anonymous: true,
        })
    })
}
