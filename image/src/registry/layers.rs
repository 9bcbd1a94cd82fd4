//! A layer's way from the registry into the store: every missing layer of a pull, several at
//! once, each downloaded, inflated and extracted on three threads (`pipeline`), checked by
//! digest before it is published.

use std::collections::HashMap;
use std::io::{BufRead, Read};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::http::Target;
use super::manifest::Descriptor;
use super::{Client, ProgressMode, blob, pipeline, progress};
use crate::registry::RegistryError;
use crate::{ImageError, LayerSink};

impl Client {
    /// Streams every layer the sink lacks into it, `parallel` at once; returns the layer
    /// directories bottom first. On the first failure the other downloads stop; layers already
    /// verified stay published (they are complete and content-addressed).
    pub(super) fn fetch_layers(
        &self,
        t: &Target,
        layers: &[Descriptor],
        diff_ids: &[String],
        mode: ProgressMode,
        sink: &dyn LayerSink,
    ) -> Result<Vec<PathBuf>, ImageError> {
        let total: u64 = layers.iter().map(|l| l.size).sum();
        let progress = progress::Progress::new(mode, &t.image, layers.len(), total);
        // The same layer twice in one image (empty layers are common) is fetched once.
        let mut unique: Vec<usize> = Vec::new();
        let mut first_of: HashMap<&str, usize> = HashMap::new();
        let mut done: Vec<Option<PathBuf>> = vec![None; layers.len()];
        for (i, diff_id) in diff_ids.iter().enumerate() {
            if first_of.contains_key(diff_id.as_str()) {
                continue;
            }
            first_of.insert(diff_id, i);
            match sink.existing_layer(diff_id) {
                Some(path) => {
                    progress.skipped(i, &layers[i].digest, layers[i].size);
                    done[i] = Some(path);
                }
                None => unique.push(i),
            }
        }
        let next = AtomicUsize::new(0);
        let abort = AtomicBool::new(false);
        let results: Mutex<Vec<(usize, Result<PathBuf, ImageError>)>> = Mutex::new(Vec::new());
        let workers = self.parallel.min(unique.len());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = unique.get(k) else { break };
                        if abort.load(Ordering::Relaxed) {
                            break;
                        }
                        let lp = progress.layer(i, &layers[i].digest, layers[i].size);
                        let r = self.fetch_layer(t, &layers[i], &diff_ids[i], sink, &abort, &lp);
                        match &r {
                            Ok(_) => lp.done(),
                            Err(_) => {
                                lp.failed();
                                abort.store(true, Ordering::Relaxed);
                            }
                        }
                        results.lock().expect("results").push((i, r));
                    }
                });
            }
        });
        progress.finish();
        let mut results = results.into_inner().expect("results");
        results.sort_by_key(|(i, _)| *i);
        let mut first_error = None;
        for (i, r) in results {
            match r {
                Ok(path) => done[i] = Some(path),
                Err(ImageError::Registry(RegistryError::Aborted)) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        diff_ids
            .iter()
            .map(|d| {
                done[first_of[d.as_str()]]
                    .clone()
                    .ok_or(ImageError::Registry(RegistryError::Aborted))
            })
            .collect()
    }

    /// Download → sha256 → decompress → sink, in one pass; publish only when the blob's digest
    /// matched too.
    pub(super) fn fetch_layer(
        &self,
        t: &Target,
        layer: &Descriptor,
        diff_id: &str,
        sink: &dyn LayerSink,
        abort: &AtomicBool,
        lp: &progress::LayerProgress,
    ) -> Result<PathBuf, ImageError> {
        let on_bytes = |n: u64| lp.inc(n);
        let mut stream = blob::BlobStream::new(
            &self.transport,
            t,
            &layer.digest,
            layer.size,
            abort,
            &on_bytes,
        );
        // A node serving peers keeps the verified blob (committed below, after the digest).
        stream.tee = self
            .keep
            .as_ref()
            .and_then(|k| k.begin(&layer.digest, layer.size));
        // Download, decompression and extraction on three threads (see pipeline.rs).
        let start = std::time::Instant::now();
        let (to_inflate, compressed) = pipeline::pipe();
        let (to_extract, tar) = pipeline::pipe();
        let (compressed_waits, tar_waits) = (compressed.waits(), tar.waits());
        let mut tar = pipeline::Abortable { inner: tar, abort };
        let (staged, failure, actual, size, tee, downloaded) = std::thread::scope(|scope| {
            let download = scope.spawn(move || {
                let r = download_blob(stream, to_inflate);
                (r, start.elapsed())
            });
            scope.spawn(move || {
                let mut compressed = compressed;
                let head = match compressed.fill_buf() {
                    Ok(head) => head.get(..4).unwrap_or(head).to_vec(),
                    Err(e) => return to_extract.fail(e),
                };
                pipeline::pump(&mut decompressor(&head, compressed), to_extract);
            });
            let staged = sink.stage_layer(diff_id, &mut tar);
            // The stages before stop at their next hand-off; the download reads on to the end.
            drop(tar);
            let ((failure, (actual, size), tee), downloaded) = download
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (staged, failure, actual, size, tee, downloaded)
        });
        let extracted = start.elapsed();
        // A transfer failure explains a sink error (it saw a broken stream): report it first.
        if let Some(e) = failure {
            return Err(e);
        }
        // Another layer failed and this one's extraction stopped for it: that failure is the
        // pull's error, not this.
        if staged.is_err() && abort.load(Ordering::Relaxed) {
            return Err(ImageError::Registry(RegistryError::Aborted));
        }
        if actual != layer.digest || size != layer.size {
            return Err(ImageError::Registry(RegistryError::DigestMismatch {
                image: t.image.clone(),
                registry: t.registry.clone(),
                what: "layer",
                expected: layer.digest.clone(),
                actual,
                size,
            }));
        }
        if let Some(tee) = tee {
            tee.commit();
        }
        let layer_error = |source| {
            ImageError::Registry(RegistryError::PullLayer {
                image: t.image.clone(),
                digest: layer.digest.clone(),
                source: Box::new(source),
            })
        };
        let published = match staged {
            Ok(staged) => staged.publish().map_err(layer_error)?,
            Err(e) => return Err(layer_error(e)),
        };
        let secs = |d: std::time::Duration| format!("{:.3}", d.as_secs_f64());
        tracing::debug!(
            layer = %layer.digest,
            bytes = size,
            downloaded_s = secs(downloaded),
            download_waited_for_inflate_s = secs(compressed_waits.writer()),
            inflate_waited_for_download_s = secs(compressed_waits.reader()),
            inflate_waited_for_extract_s = secs(tar_waits.writer()),
            extract_waited_for_inflate_s = secs(tar_waits.reader()),
            extracted_s = secs(extracted),
            flushed_and_published_s = secs(start.elapsed() - extracted),
            "layer stages"
        );
        Ok(published)
    }
}

/// The download stage of a layer: the blob's bytes, hashed in order, into `to`. Once the reader
/// of `to` is gone (extraction ended, done or failed) the rest of the blob is still read, so the
/// digest covers the whole blob and a corrupt blob is reported as such. Returns the transfer's
/// failure, if any, the blob's digest and length as read, and the copy kept for peers (to be
/// committed only once the digest is checked).
pub(super) fn download_blob(
    mut stream: blob::BlobStream<'_>,
    to: pipeline::PipeWriter,
) -> (
    Option<ImageError>,
    (String, u64),
    Option<crate::peers::Keeper>,
) {
    let mut to = Some(to);
    let mut spare = Vec::new();
    let mut failure = None;
    loop {
        let mut chunk = match &to {
            Some(w) => w.buffer(),
            None => std::mem::take(&mut spare),
        };
        chunk.resize(pipeline::CHUNK, 0);
        match pipeline::fill(&mut stream, &mut chunk) {
            Ok(0) => {
                if let Some(w) = to.take() {
                    w.finish();
                }
                break;
            }
            Ok(n) => {
                chunk.truncate(n);
                match &to {
                    Some(w) => {
                        if w.send(chunk).is_err() {
                            to = None;
                        }
                    }
                    None => spare = chunk,
                }
            }
            Err(e) => {
                failure = Some(stream.failure_of(&e));
                if let Some(w) = to.take() {
                    w.fail(e);
                }
                break;
            }
        }
    }
    let tee = stream.tee.take();
    (failure, stream.finish(), tee)
}

/// The decompressor for a layer, chosen by its first bytes rather than its media type (some
/// registries and tools mislabel layers; the magic numbers are unambiguous).
pub(super) fn decompressor<'r, R: BufRead + 'r>(head: &[u8], reader: R) -> Box<dyn Read + 'r> {
    if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(reader))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        match zstd::stream::read::Decoder::with_buffer(reader) {
            Ok(d) => Box::new(d),
            Err(e) => Box::new(FailingReader(Some(e))),
        }
    } else {
        Box::new(reader)
    }
}

pub(super) struct FailingReader(Option<std::io::Error>);

impl Read for FailingReader {
    fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
        Err(self
            .0
            .take()
            .unwrap_or_else(|| std::io::Error::other("decompressor failed")))
    }
}
