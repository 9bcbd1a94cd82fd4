//! The stages of one layer download, each on its own thread so that they overlap: the download
//! (with the blob's sha256), the decompression, and the extraction (with the diff_id's sha256
//! and the files' writes), joined by bounded pipes of recycled buffers.
//!
//! One pass over a layer on one thread costs the sum of the three stages; here it costs the
//! slowest one, and a big layer uses both CPUs of a small node once the small layers are done.
//! What is checked does not change: the download stage hashes every byte of the blob, in order,
//! and reads the blob to its end even when a later stage stopped early (so a corrupt blob is
//! reported as such, never as the extraction error it caused); the sink hashes the whole
//! uncompressed stream.

use std::io::{self, BufRead, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};
use std::time::{Duration, Instant};

/// Bytes per buffer handed between stages: large enough that a hand-off (a channel message,
/// perhaps a wake-up) is rare next to the work on the bytes, small enough to stay in cache.
pub const CHUNK: usize = 256 * 1024;
/// Buffers in flight per pipe: how far a stage may run ahead of the next (4 MiB).
const DEPTH: usize = 16;

enum Msg {
    Data(Vec<u8>),
    /// The writer reached the end of its stream.
    End,
    /// The writer failed; the reader reports this error.
    Failed(io::Error),
}

/// Where a pipe's two ends waited for each other (for the debug log's account of a layer).
#[derive(Debug, Default)]
pub struct Waits {
    /// Nanoseconds the writer waited for room (the reader was slower).
    writer_ns: AtomicU64,
    /// Nanoseconds the reader waited for data (the writer was slower).
    reader_ns: AtomicU64,
}

impl Waits {
    pub fn writer(&self) -> Duration {
        Duration::from_nanos(self.writer_ns.load(Ordering::Relaxed))
    }

    pub fn reader(&self) -> Duration {
        Duration::from_nanos(self.reader_ns.load(Ordering::Relaxed))
    }
}

fn add(counter: &AtomicU64, since: Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counter.fetch_add(ns, Ordering::Relaxed);
}

/// The sending end of a pipe.
pub struct PipeWriter {
    full: SyncSender<Msg>,
    empty: Receiver<Vec<u8>>,
    waits: Arc<Waits>,
}

/// The receiving end: a [`BufRead`] over the chunks sent. A writer that goes away without
/// [`PipeWriter::finish`] leaves the reader an error, never a clean (truncated) end.
pub struct PipeReader {
    full: Receiver<Msg>,
    empty: Sender<Vec<u8>>,
    cur: Vec<u8>,
    pos: usize,
    /// The end was reached (`None`) or the writer failed (the error, repeated on each read).
    done: Option<Option<(io::ErrorKind, String)>>,
    waits: Arc<Waits>,
}

/// A pipe of [`DEPTH`] chunks.
pub fn pipe() -> (PipeWriter, PipeReader) {
    let (full_tx, full_rx) = sync_channel(DEPTH);
    let (empty_tx, empty_rx) = channel();
    let waits = Arc::new(Waits::default());
    (
        PipeWriter {
            full: full_tx,
            empty: empty_rx,
            waits: waits.clone(),
        },
        PipeReader {
            full: full_rx,
            empty: empty_tx,
            cur: Vec::new(),
            pos: 0,
            done: None,
            waits,
        },
    )
}

impl PipeWriter {
    /// An empty buffer of [`CHUNK`] bytes to fill: one the reader gave back, or a new one.
    pub fn buffer(&self) -> Vec<u8> {
        let mut b = self.empty.try_recv().unwrap_or_default();
        b.resize(CHUNK, 0);
        b
    }

    /// Hands `data` to the reader; `Err` when the reader is gone (it stopped reading).
    pub fn send(&self, data: Vec<u8>) -> Result<(), ()> {
        if data.is_empty() {
            return Ok(());
        }
        let since = Instant::now();
        let sent = self.full.send(Msg::Data(data)).map_err(|_| ());
        add(&self.waits.writer_ns, since);
        sent
    }

    /// Ends the stream cleanly.
    pub fn finish(self) {
        let _ = self.full.send(Msg::End);
    }

    /// Ends the stream with an error the reader reports.
    pub fn fail(self, e: io::Error) {
        let _ = self.full.send(Msg::Failed(e));
    }
}

impl PipeReader {
    /// The waits on this pipe, readable after both ends are gone.
    pub fn waits(&self) -> Arc<Waits> {
        self.waits.clone()
    }

    fn next_chunk(&mut self) -> io::Result<()> {
        if let Some(done) = &self.done {
            return match done {
                None => Ok(()),
                Some((kind, text)) => Err(io::Error::new(*kind, text.clone())),
            };
        }
        let used = std::mem::take(&mut self.cur);
        if used.capacity() > 0 {
            // The writer may be gone (it finished): the buffer is then simply dropped.
            let _ = self.empty.send(used);
        }
        self.pos = 0;
        let since = Instant::now();
        let msg = self.full.recv();
        add(&self.waits.reader_ns, since);
        match msg {
            Ok(Msg::Data(d)) => {
                self.cur = d;
                Ok(())
            }
            Ok(Msg::End) => {
                self.done = Some(None);
                Ok(())
            }
            Ok(Msg::Failed(e)) => {
                self.done = Some(Some((e.kind(), e.to_string())));
                Err(e)
            }
            Err(_) => {
                let text = "the stage before this one ended without finishing its stream";
                self.done = Some(Some((io::ErrorKind::BrokenPipe, text.to_string())));
                Err(io::Error::new(io::ErrorKind::BrokenPipe, text))
            }
        }
    }
}

impl Read for PipeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let avail = self.fill_buf()?;
        let n = avail.len().min(buf.len());
        buf[..n].copy_from_slice(&avail[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for PipeReader {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        while self.pos >= self.cur.len() && !matches!(self.done, Some(None)) {
            self.next_chunk()?;
        }
        Ok(&self.cur[self.pos..])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.cur.len());
    }
}

/// A reader that fails once `abort` is set: a later stage stops as soon as another layer of the
/// pull failed, as the download does, rather than finishing from what the pipes still hold.
pub struct Abortable<'a, R> {
    pub inner: R,
    pub abort: &'a AtomicBool,
}

impl<R: Read> Read for Abortable<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.abort.load(Ordering::Relaxed) {
            return Err(io::Error::other("pull aborted"));
        }
        self.inner.read(buf)
    }
}

/// Reads `r` until `buf` is full or `r` ends; returns the bytes read.
pub fn fill(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Copies `r` into `to` chunk by chunk until `r` ends (the stream is finished), fails (the
/// error is passed on) or the reader of `to` is gone (returns; `r` is left unread).
pub fn pump(r: &mut dyn Read, to: PipeWriter) {
    loop {
        let mut chunk = to.buffer();
        match fill(r, &mut chunk) {
            Ok(0) => return to.finish(),
            Ok(n) => {
                chunk.truncate(n);
                if to.send(chunk).is_err() {
                    return;
                }
            }
            Err(e) => return to.fail(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pass_in_order_across_threads() {
        let data: Vec<u8> = (0..3 * CHUNK + 17)
            .map(|i| u8::try_from(i * 7 % 251).unwrap())
            .collect();
        let (w, mut r) = pipe();
        let src = data.clone();
        let t = std::thread::spawn(move || pump(&mut &src[..], w));
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        t.join().unwrap();
        assert_eq!(out, data);
        // The end stays the end.
        assert_eq!(r.read(&mut [0u8; 8]).unwrap(), 0);
    }

    #[test]
    fn a_failed_or_vanished_writer_is_an_error_not_an_end() {
        let (w, mut r) = pipe();
        w.send(b"abc".to_vec()).unwrap();
        w.fail(io::Error::other("registry went away"));
        let mut out = Vec::new();
        let e = r.read_to_end(&mut out).unwrap_err();
        assert!(e.to_string().contains("registry went away"), "{e}");
        assert_eq!(out, b"abc");
        r.read(&mut [0u8; 8]).unwrap_err();

        let (w, mut r) = pipe();
        w.send(b"abc".to_vec()).unwrap();
        drop(w);
        let e = r.read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_writer_learns_that_its_reader_stopped() {
        let (w, r) = pipe();
        drop(r);
        assert!(w.send(vec![1]).is_err());
        // pump returns instead of blocking on a full pipe nobody reads.
        let big = vec![0u8; (DEPTH + 4) * CHUNK];
        pump(&mut &big[..], w);
    }
}
