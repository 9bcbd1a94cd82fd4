//! A layer's way into the store: extracted into a workspace under `tmp/` (bounded, checked
//! against the disk's room), then published by rename; what the store tells a reader of a
//! layer directory it may use.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::fs::{self, LockMode, Workspace};
use super::{Store, digest_hex, human_size};
use crate::layer;
use crate::record;
use crate::store::StoreError;
use crate::{ImageError, LayerSink, StagedLayer};

impl Store {
    /// Extracts one layer stream into the workspace (or, if another import published it
    /// meanwhile, only reads and verifies the stream). Holds the layer's lock until the result
    /// is published or dropped.
    pub fn stage(&self, diff_id: &str, tar: &mut dyn Read) -> Result<Staged, ImageError> {
        let hex = digest_hex(diff_id)?.to_string();
        let lock = self.lock(&format!("layer-{hex}"), LockMode::Exclusive)?;
        let dest = self.layer_dir(diff_id)?;
        let mismatch = |actual: String| {
            ImageError::Store(StoreError::DiffIdMismatch {
                layer: diff_id.to_string(),
                actual,
            })
        };
        // A layer marked damaged by `verify`, or extracted by an older berth (no record), is
        // extracted again and replaces the one in place.
        if self.layer_usable(&dest) {
            let (actual, _) = layer::hash_only(tar).map_err(|source| StoreError::Layer {
                layer: diff_id.to_string(),
                source: Box::new(source),
            })?;
            if actual != diff_id {
                return Err(mismatch(actual));
            }
            return Ok(Staged {
                root: self.root.clone(),
                dest,
                staging: None,
                size: 0,
                tar_bytes: 0,
                skipped: Vec::new(),
                record: None,
                _lock: lock,
                _workspace: None,
            });
        }
        let ws = self.workspace()?;
        let staging = ws.path(&format!("layer-{}", &hex[..12]));
        std::fs::create_dir(&staging)
            .map_err(|e| self.write_error("creating a staging directory", e))?;
        let limits = layer::Limits {
            max_bytes: self.limits.max_layer_bytes,
            image_bytes: self
                .image_bytes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            max_image_bytes: self.limits.max_image_bytes,
            reserve_bytes: self.limits.reserve_bytes,
        };
        let result = layer::extract_bounded(tar, &staging, &limits);
        let x = match result {
            Ok(x) if x.diff_id == diff_id => x,
            Ok(x) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(mismatch(x.diff_id));
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(if let ImageError::Bound(b) = e {
                    self.bound_error(diff_id, b)
                } else if e.is_no_space() {
                    ImageError::Store(StoreError::FullDuringExtract {
                        root: self.root.clone(),
                        layer: diff_id.to_string(),
                        free: self.free_text(),
                    })
                } else {
                    ImageError::Store(StoreError::Layer {
                        layer: diff_id.to_string(),
                        source: Box::new(e),
                    })
                });
            }
        };
        if !x.skipped.is_empty() {
            let shown: Vec<&str> = x.skipped.iter().take(3).map(String::as_str).collect();
            let more = x.skipped.len().saturating_sub(shown.len());
            tracing::warn!(
                "layer {diff_id}: left out {}{}",
                shown.join("; "),
                if more > 0 {
                    format!("; and {more} more")
                } else {
                    String::new()
                }
            );
        }
        let record = record::LayerRecord {
            tar_bytes: x.tar_bytes,
            files: x.files,
            external_links: x.external_links,
            hash: record::ContentHash::default(),
        };
        Ok(Staged {
            root: self.root.clone(),
            dest,
            staging: Some(staging),
            size: x.disk_bytes,
            tar_bytes: x.tar_bytes,
            skipped: x.skipped,
            record: Some(record),
            _lock: lock,
            _workspace: Some(ws),
        })
    }
}

impl Store {
    /// Whether the layer directory `dir` can be used as it is: present, recorded, not marked
    /// damaged.
    pub(crate) fn layer_usable(&self, dir: &Path) -> bool {
        dir.is_dir()
            && dir.with_extension("files").is_file()
            && !dir.with_extension("damaged").exists()
    }

    fn bound_error(&self, layer: &str, b: layer::Bound) -> ImageError {
        match b {
            layer::Bound::Layer => ImageError::Store(StoreError::LayerTooLarge {
                layer: layer.to_string(),
                max: human_size(self.limits.max_layer_bytes),
            }),
            layer::Bound::Image => ImageError::Store(StoreError::ImageTooLarge {
                layer: layer.to_string(),
                max: human_size(self.limits.max_image_bytes),
            }),
            layer::Bound::Reserve(free) => ImageError::Store(StoreError::Reserve {
                root: self.root.clone(),
                what: format!("extracting layer {layer}"),
                reserve: human_size(self.limits.reserve_bytes),
                free: human_size(free),
            }),
        }
    }

    /// `store.max_image_bytes` on the whole image, layers already in the store included (the
    /// extraction itself stopped at the bound counting only the layers it extracted).
    pub(super) fn check_image_bytes(&self, dirs: &[PathBuf]) -> Result<(), ImageError> {
        let mut total: u64 = 0;
        for d in dedup_layers(dirs.to_vec()) {
            if let Ok(Some(r)) = record::read(&d.with_extension("files")) {
                total = total.saturating_add(r.tar_bytes);
            }
        }
        if total > self.limits.max_image_bytes {
            return Err(ImageError::Store(StoreError::ImageTooLarge {
                layer: dirs
                    .last()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                max: human_size(self.limits.max_image_bytes),
            }));
        }
        Ok(())
    }
}

/// Publishes the directory `staging` as `dest` in the store at `root`: its size and record
/// first, then the flushed directory, by rename, or by an atomic exchange with a damaged or
/// unrecorded layer in place (removed after).
pub(crate) fn publish_dir(
    root: &Path,
    ws: &Workspace,
    staging: &Path,
    dest: &Path,
    size: u64,
    rec: &record::LayerRecord,
) -> Result<(), ImageError> {
    {
        let io = |op: &str, e: std::io::Error| {
            if matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)) {
                ImageError::Store(StoreError::FullDuringExtract {
                    root: root.to_path_buf(),
                    layer: dest.display().to_string(),
                    free: fs::free_bytes(root).map(human_size).unwrap_or_default(),
                })
            } else {
                ImageError::Store(StoreError::StoreIo {
                    root: root.to_path_buf(),
                    op: format!("{op} {}", dest.display()),
                    source: e,
                })
            }
        };
        fs::write_atomic(
            ws,
            &dest.with_extension("size"),
            size.to_string().as_bytes(),
        )
        .map_err(|e| io("writing the size of", e))?;
        let write_record = || {
            fs::write_atomic(ws, &dest.with_extension("files"), &rec.encode())
                .map_err(|e| io("writing the record of", e))
        };
        // A layer in place that an older berth extracted (no record, not marked damaged) may
        // be in use by running containers: when it holds what this extraction wrote, it only
        // gets the record, and stays.
        if dest.is_dir()
            && !dest.with_extension("damaged").exists()
            && record::walk(dest, rec.hash, &|_| None).is_ok_and(|found| found == rec.files)
        {
            write_record()?;
            let _ = std::fs::remove_dir_all(staging);
            return Ok(());
        }
        fs::syncfs(staging).map_err(|e| io("flushing", e))?;
        if dest.exists() {
            // The record after the exchange: a crash between them leaves the layer marked
            // damaged or unrecorded, so it is extracted again.
            fs::exchange(staging, dest).map_err(|e| io("replacing", e))?;
            write_record()?;
            // `staging` now holds the old layer.
            let _ = std::fs::remove_dir_all(staging);
        } else {
            // The record first: a layer directory is never visible without it.
            write_record()?;
            std::fs::rename(staging, dest).map_err(|e| io("publishing", e))?;
        }
        match std::fs::remove_file(dest.with_extension("damaged")) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("clearing the damage mark of", e)),
        }
        fs::sync_dir(dest.parent().unwrap_or(Path::new("/"))).map_err(|e| io("flushing", e))
    }
}

impl LayerSink for Store {
    fn existing_layer(&self, diff_id: &str) -> Option<PathBuf> {
        self.layer_dir(diff_id)
            .ok()
            .filter(|d| self.layer_usable(d))
    }

    fn stage_layer(
        &self,
        diff_id: &str,
        tar: &mut dyn Read,
    ) -> Result<Box<dyn StagedLayer>, ImageError> {
        Ok(Box::new(self.stage(diff_id, tar)?))
    }
}

/// A layer extracted into the workspace and verified, not yet visible; dropping it removes it.
#[derive(Debug)]
pub struct Staged {
    root: PathBuf,
    dest: PathBuf,
    /// `None` when the layer was already in the store.
    staging: Option<PathBuf>,
    size: u64,
    tar_bytes: u64,
    skipped: Vec<String>,
    /// What extraction wrote (written next to the layer when it is published).
    record: Option<record::LayerRecord>,
    _lock: File,
    _workspace: Option<Arc<Workspace>>,
}

impl Staged {
    /// Whether this import extracted the layer (false: another import already had).
    pub fn extracted(&self) -> bool {
        self.staging.is_some()
    }

    /// Estimated disk use of the extracted layer.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Length of the uncompressed tar stream.
    pub fn tar_bytes(&self) -> u64 {
        self.tar_bytes
    }

    /// Entries left out of the layer (device nodes, fifos, refused attributes).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// Makes the layer visible: its size and record first, then the flushed directory by
    /// rename (see [`Store::publish_dir`]).
    pub fn publish_layer(mut self) -> Result<PathBuf, ImageError> {
        let Some(staging) = self.staging.take() else {
            return Ok(self.dest.clone());
        };
        let result = (|| {
            let ws = self
                ._workspace
                .as_ref()
                .ok_or_else(|| StoreError::StoreIo {
                    root: self.root.clone(),
                    op: format!("publishing {}", self.dest.display()),
                    source: std::io::Error::other("no workspace"),
                })?;
            let rec = self.record.take().unwrap_or_default();
            publish_dir(&self.root, ws, &staging, &self.dest, self.size, &rec)
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
        Ok(self.dest.clone())
    }
}

impl StagedLayer for Staged {
    fn publish(self: Box<Self>) -> Result<PathBuf, ImageError> {
        self.publish_layer()
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(staging) = self.staging.take() {
            let _ = std::fs::remove_dir_all(staging);
        }
    }
}

/// Keeps only the topmost occurrence of a layer listed twice (overlayfs refuses a directory
/// twice in lowerdir; the lower copy is fully shadowed by the upper one, so the view is the
/// same).
pub(crate) fn dedup_layers(dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut seen = BTreeSet::new();
    let mut out: Vec<PathBuf> = dirs
        .into_iter()
        .rev()
        .filter(|d| seen.insert(d.clone()))
        .collect();
    out.reverse();
    out
}
