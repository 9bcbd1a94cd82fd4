//! `berth images verify`: every stored layer compared with what extraction recorded
//! (`layers/<hex>.files`, see record.rs). A layer that differs is marked damaged
//! (`layers/<hex>.damaged`): the next import of an image that has it extracts it again and
//! replaces it, and `berth images gc` removes the images that have it, so their next use
//! imports them again.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::Store;
use super::fs::LockMode;
use super::gc::Entry;
use crate::record;
use crate::{ImageError, Rootfs};

/// What checking one layer found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerCheck {
    /// As recorded (number of paths).
    Ok(usize),
    /// Extracted by a berth that kept no record.
    Unrecorded,
    /// Differences, one line each (path and what differs).
    Differs(Vec<String>),
}

/// The checks of the images asked for: (entry, [(layer directory, check)]).
#[derive(Debug, Default)]
pub struct VerifyReport {
    pub images: Vec<(Entry, Vec<(PathBuf, LayerCheck)>)>,
}

impl VerifyReport {
    /// Whether any layer differs from its record.
    pub fn damaged(&self) -> bool {
        self.images
            .iter()
            .flat_map(|(_, l)| l)
            .any(|(_, c)| matches!(c, LayerCheck::Differs(_)))
    }
}

/// Differences shown per layer before "and N more".
const MAX_LINES: usize = 20;

impl Store {
    /// Checks the layers of `entries` (each layer once), marking those that differ.
    pub fn verify(&self, entries: Vec<Entry>) -> Result<VerifyReport, ImageError> {
        // Shared, as imports: gc (exclusive) does not remove layers under the check.
        let _store = self.lock("store", LockMode::Shared)?;
        let mut seen: BTreeMap<PathBuf, LayerCheck> = BTreeMap::new();
        let mut report = VerifyReport::default();
        for entry in entries {
            let mut checks = Vec::new();
            if let Rootfs::Layers(dirs) = &entry.image.rootfs {
                for dir in super::dedup_layers(dirs.clone()) {
                    if let Some(c) = seen.get(&dir) {
                        checks.push((dir, c.clone()));
                        continue;
                    }
                    let c = self.verify_layer(&dir)?;
                    seen.insert(dir.clone(), c.clone());
                    checks.push((dir, c));
                }
            }
            report.images.push((entry, checks));
        }
        Ok(report)
    }

    fn verify_layer(&self, dir: &std::path::Path) -> Result<LayerCheck, ImageError> {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Held while reading: a re-import replacing this layer waits.
        let _lock = self.lock(&format!("layer-{name}"), LockMode::Exclusive)?;
        let recorded = match record::read(&dir.with_extension("files")) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(LayerCheck::Unrecorded),
            Err(e) => {
                let lines = vec![format!("its record is unreadable: {e}")];
                self.mark_damaged(dir)?;
                return Ok(LayerCheck::Differs(lines));
            }
        };
        let found = if dir.is_dir() {
            record::walk(dir, recorded.hash, &|_| None)
                .map_err(|e| self.io(format!("reading layer {}", dir.display()), e))?
        } else {
            BTreeMap::new()
        };
        let lines = record::compare(&recorded.files, &found, MAX_LINES);
        if lines.is_empty() {
            return Ok(LayerCheck::Ok(found.len()));
        }
        self.mark_damaged(dir)?;
        Ok(LayerCheck::Differs(lines))
    }

    fn mark_damaged(&self, dir: &std::path::Path) -> Result<(), ImageError> {
        std::fs::File::create(dir.with_extension("damaged"))
            .map(drop)
            .map_err(|e| self.io(format!("marking {} damaged", dir.display()), e))
    }
}
