//! An import's overall deadline and minimum transfer rate (`registry.import_deadline_s`,
//! `registry.min_rate_bytes_per_s` over `registry.min_rate_window_s`).
//!
//! The per-read timeout (`registry.read_timeout_s`) only catches a registry that goes silent: one
//! that trickles a byte every few seconds never trips it, and an import from it (the Slurm
//! Prolog's included) would hang until something outside berth killed it. So every request of
//! an import checks the deadline before it is sent and carries what is left of it as ureq's
//! global timeout (which also bounds the reading of its body), and every body is metered: the
//! bytes that arrived while berth waited on the network (time spent in reads, not time a slow
//! extraction kept the download waiting) must reach the minimum rate in each window.
//!
//! A client normally serves one import, so its deadline runs from its creation; a lazy image's
//! client serves chunk fetches for as long as its container runs, and each of those requests
//! gets a deadline of its own, `registry.lazy_read_deadline_s` ([`Limits::per_request`]).

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::ImageError;
use crate::config::RegistryConfig;
use crate::registry::RegistryError;

/// The config keys named when a limit is hit.
const DEADLINE_KEY: &str = "registry.import_deadline_s";
const PROLOG_DEADLINE_KEY: &str = "registry.prolog_import_deadline_s";
const LAZY_DEADLINE_KEY: &str = "registry.lazy_read_deadline_s";
const RATE_KEY: &str = "registry.min_rate_bytes_per_s";

/// The deadline and minimum rate of one client's imports.
#[derive(Debug)]
pub struct Limits {
    /// When the client was made: an import's deadline runs from here.
    start: Instant,
    /// Seconds an import may take.
    deadline: Duration,
    /// Which key set `deadline`.
    deadline_key: &'static str,
    /// Each request gets `lazy_deadline` from when it is sent (a lazy image's chunks).
    per_request: AtomicBool,
    lazy_deadline: Duration,
    /// Bytes per second a transfer must average over each window; 0: no minimum.
    min_rate: u64,
    window: Duration,
}

impl Limits {
    pub fn new(config: &RegistryConfig) -> Self {
        let (secs, key) = if config.in_prolog {
            (
                config
                    .prolog_import_deadline_s
                    .min(config.import_deadline_s),
                PROLOG_DEADLINE_KEY,
            )
        } else {
            (config.import_deadline_s, DEADLINE_KEY)
        };
        Self {
            start: Instant::now(),
            deadline: Duration::from_secs(secs.max(1)),
            deadline_key: key,
            per_request: AtomicBool::new(false),
            lazy_deadline: Duration::from_secs(config.lazy_read_deadline_s.max(1)),
            min_rate: config.min_rate_bytes_per_s,
            window: Duration::from_secs(config.min_rate_window_s.max(1)),
        }
    }

    /// From now on each request has `registry.lazy_read_deadline_s` from when it is sent.
    pub fn per_request(&self) {
        self.per_request.store(true, Ordering::Relaxed);
    }

    /// The deadline of a request sent now.
    pub fn deadline(&self) -> Deadline {
        let (from, len, key) = if self.per_request.load(Ordering::Relaxed) {
            (Instant::now(), self.lazy_deadline, LAZY_DEADLINE_KEY)
        } else {
            (self.start, self.deadline, self.deadline_key)
        };
        Deadline {
            at: from + len,
            secs: len.as_secs(),
            key,
        }
    }

    /// A meter for one transfer's body.
    pub fn meter(&self) -> Meter {
        Meter {
            min_rate: self.min_rate,
            window: self.window,
            bytes: 0,
            waited: Duration::ZERO,
        }
    }
}

/// When a request must be done.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: Instant,
    secs: u64,
    key: &'static str,
}

impl Deadline {
    /// Time left; `None` once it passed.
    pub fn remaining(&self) -> Option<Duration> {
        self.at
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    /// Fails, in one line naming the registry and `what`, once the deadline passed.
    pub fn check(&self, registry: &str, what: &str) -> Result<Duration, ImageError> {
        self.remaining().ok_or_else(|| {
            ImageError::Registry(RegistryError::DeadlinePassed {
                registry: registry.to_string(),
                what: what.to_string(),
                secs: self.secs,
                key: self.key,
            })
        })
    }
}

/// Bytes that did not come fast enough: `bytes` in `secs` of waiting, below `rate` per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slow {
    pub bytes: u64,
    pub secs: u64,
    pub rate: u64,
}

impl Slow {
    /// The one-line error for a transfer of `what` from `registry`.
    pub fn error(self, registry: &str, what: &str) -> ImageError {
        ImageError::Registry(RegistryError::TooSlow {
            registry: registry.to_string(),
            what: what.to_string(),
            bytes: self.bytes,
            secs: self.secs,
            rate: crate::store::human_size(self.rate),
            key: RATE_KEY,
        })
    }
}

/// The rate of one transfer, window by window of time spent waiting on the network.
#[derive(Clone, Debug)]
pub struct Meter {
    min_rate: u64,
    window: Duration,
    /// Bytes and waiting in the current window.
    bytes: u64,
    waited: Duration,
}

impl Meter {
    /// Counts `n` bytes that took `waited` to arrive (0 bytes: a wait that ended in an error or
    /// the end). Fails once a whole window of waiting brought less than the minimum rate.
    pub fn add(&mut self, n: u64, waited: Duration) -> Result<(), Slow> {
        if self.min_rate == 0 {
            return Ok(());
        }
        self.bytes = self.bytes.saturating_add(n);
        self.waited = self.waited.saturating_add(waited);
        if self.waited < self.window {
            return Ok(());
        }
        let secs = self.waited.as_secs().max(1);
        if self.bytes < self.min_rate.saturating_mul(secs) {
            return Err(Slow {
                bytes: self.bytes,
                secs,
                rate: self.min_rate,
            });
        }
        self.bytes = 0;
        self.waited = Duration::ZERO;
        Ok(())
    }

    /// Times one read of `r` into `buf` and counts it.
    pub fn read(&mut self, r: &mut dyn Read, buf: &mut [u8]) -> io::Result<Result<usize, Slow>> {
        let since = Instant::now();
        let got = r.read(buf);
        let n = got.as_ref().map_or(0, |n| *n as u64);
        match self.add(n, since.elapsed()) {
            Err(slow) => Ok(Err(slow)),
            Ok(()) => got.map(Ok),
        }
    }
}

/// A body reader whose reads are metered: one too slow fails with [`Metered::slow`] set.
pub struct Metered<R> {
    pub inner: R,
    pub meter: Meter,
    pub slow: Option<Slow>,
}

impl<R> Metered<R> {
    pub fn new(inner: R, meter: Meter) -> Self {
        Self {
            inner,
            meter,
            slow: None,
        }
    }
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(s) = self.slow {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("{s:?}")));
        }
        match self.meter.read(&mut self.inner, buf)? {
            Ok(n) => Ok(n),
            Err(s) => {
                self.slow = Some(s);
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "below the minimum transfer rate",
                ))
            }
        }
    }
}

/// Reads a body to its end through a meter: too slow is [`RegistryError::TooSlow`] (of `what`
/// from `registry`), any other failure what `other` makes of ureq's error.
pub fn read_metered(
    body: impl Read,
    meter: Meter,
    registry: &str,
    what: &str,
    other: impl FnOnce(ureq::Error) -> ImageError,
) -> Result<Vec<u8>, ImageError> {
    let mut body = Metered::new(body, meter);
    let mut out = Vec::new();
    match body.read_to_end(&mut out) {
        Ok(_) => Ok(out),
        Err(e) => match body.slow {
            Some(slow) => Err(slow.error(registry, what)),
            None => Err(other(ureq::Error::from(e))),
        },
    }
}

/// What a request to `url` fetches, for messages: a blob or manifest of `image`.
pub fn what(image: &str, url: &str) -> String {
    if let Some((_, digest)) = url.rsplit_once("/blobs/") {
        format!("blob {digest} of {image}")
    } else if url.contains("/manifests/") {
        format!("the manifest of {image}")
    } else {
        image.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rate: u64, window: u64, deadline: u64) -> RegistryConfig {
        RegistryConfig {
            min_rate_bytes_per_s: rate,
            min_rate_window_s: window,
            import_deadline_s: deadline,
            ..RegistryConfig::default()
        }
    }

    #[test]
    fn a_trickle_fails_once_a_window_of_waiting_brought_too_little() {
        let limits = Limits::new(&config(4096, 30, 1800));
        let mut m = limits.meter();
        // A byte every 2 s: nothing is said before the window is full.
        for _ in 0..14 {
            m.add(1, Duration::from_secs(2)).unwrap();
        }
        let slow = m.add(1, Duration::from_secs(2)).unwrap_err();
        assert_eq!(
            slow,
            Slow {
                bytes: 15,
                secs: 30,
                rate: 4096
            }
        );
        let e = slow.error("127.0.0.1:5000", "blob sha256:ab").to_string();
        assert_eq!(
            e,
            "registry 127.0.0.1:5000: blob sha256:ab: 15 bytes in 30 s, below the minimum \
             4.0 KiB/s (registry.min_rate_bytes_per_s); check the registry or raise the limit"
        );
    }

    #[test]
    fn a_transfer_at_the_rate_passes_window_after_window() {
        let mut m = Limits::new(&config(4096, 30, 1800)).meter();
        for _ in 0..10 {
            m.add(4096 * 30, Duration::from_secs(30)).unwrap();
        }
        // A burst then a pause is judged over the whole window, not read by read.
        m.add(4096 * 30, Duration::from_millis(1)).unwrap();
        m.add(0, Duration::from_secs(30)).unwrap();
        // Time the download spent waiting on a slow extraction is not counted: only `waited`.
        let mut m = Limits::new(&config(4096, 30, 1800)).meter();
        m.add(1 << 20, Duration::from_secs(1)).unwrap();
        // No minimum: never fails.
        let mut m = Limits::new(&config(0, 30, 1800)).meter();
        m.add(0, Duration::from_secs(3600)).unwrap();
    }

    #[test]
    fn a_metered_reader_stops_for_good_once_too_slow() {
        let mut m = Limits::new(&config(1 << 20, 1, 1800)).meter();
        // The window is already spent waiting: the next read settles it.
        m.waited = Duration::from_secs(1);
        let mut r = Metered::new(&b"abc"[..], m);
        let e = r.read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(r.slow.is_some());
        r.read(&mut [0u8; 8]).unwrap_err();
    }

    #[test]
    fn the_deadline_runs_from_the_client_or_from_each_request() {
        let limits = Limits::new(&config(0, 30, 1800));
        let d = limits.deadline();
        assert!(d.check("r", "blob").unwrap() <= Duration::from_secs(1800));
        let passed = Deadline {
            at: Instant::now(),
            secs: 5,
            key: DEADLINE_KEY,
        };
        assert_eq!(
            passed
                .check("127.0.0.1:5000", "the manifest of x:1")
                .unwrap_err()
                .to_string(),
            "registry 127.0.0.1:5000: the manifest of x:1: the import did not finish within its \
             deadline of 5 s (registry.import_deadline_s); check the registry or raise the limit"
        );
        // Per request: a later request gets the whole deadline again.
        let mut old = Limits::new(&config(0, 30, 1));
        old.start -= Duration::from_secs(5);
        assert!(old.deadline().remaining().is_none());
        old.per_request();
        assert!(old.deadline().remaining().is_some());
        // ... and that is registry.lazy_read_deadline_s, named in its failure.
        assert_eq!(old.deadline().secs, 30);
        assert_eq!(old.deadline().key, LAZY_DEADLINE_KEY);
        // The Prolog's deadline is the smaller one, and named by its own key.
        let prolog = Limits::new(&RegistryConfig {
            in_prolog: true,
            prolog_import_deadline_s: 300,
            ..config(0, 30, 1800)
        });
        assert_eq!(prolog.deadline.as_secs(), 300);
        assert_eq!(prolog.deadline_key, PROLOG_DEADLINE_KEY);
    }
}
