//! Staging progress on stderr, through indicatif like an import's: a line rewritten in place on a
//! terminal (every half second), else a plain line every `stage.progress_interval_s` (Slurm job
//! logs), and nothing for a stage shorter than that. The copy workers only count (two atomics);
//! indicatif's ticker draws.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle, TermLike};

use super::Options;

/// What the copy workers have done so far.
pub(super) struct Progress {
    pub files: AtomicU64,
    pub bytes: AtomicU64,
}

/// Runs `f` with progress counters, reported while it runs when `opts.progress` asks for it:
/// `files` is (already done, total), `bytes` the total to copy.
pub(super) fn with_progress<R>(
    opts: &Options,
    files: (u64, u64),
    bytes: u64,
    f: impl FnOnce(&Progress) -> R,
) -> R {
    let progress = Arc::new(Progress {
        files: AtomicU64::new(files.0),
        bytes: AtomicU64::new(0),
    });
    let bar = opts.progress.then(|| {
        let err = std::io::stderr();
        let tty = err.is_terminal();
        start(
            &progress,
            (files.1, bytes),
            opts.progress_interval,
            tty,
            err,
        )
    });
    let r = f(&progress);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    r
}

/// Starts reporting `progress` on `out` until the returned bar is finished: a line rewritten in
/// place every half second on a terminal (`tty`), else a line every `interval`.
pub(super) fn start(
    progress: &Arc<Progress>,
    (total_files, total_bytes): (u64, u64),
    interval: Duration,
    tty: bool,
    out: impl Write + Send + 'static,
) -> ProgressBar {
    let interval = if tty {
        Duration::from_millis(500)
    } else {
        interval
    };
    let started = Instant::now();
    let progress = Arc::clone(progress);
    let line = move |_: &ProgressState, w: &mut dyn std::fmt::Write| {
        // The first report after one period, as a stage shorter than that shows none.
        if started.elapsed() < interval {
            return;
        }
        let (f, b) = (
            progress.files.load(Ordering::Relaxed),
            progress.bytes.load(Ordering::Relaxed),
        );
        let rate = b as f64 / started.elapsed().as_secs_f64();
        let eta = if rate > 0.0 {
            format!("{:.0} s", total_bytes.saturating_sub(b) as f64 / rate)
        } else {
            "?".into()
        };
        let _ = write!(
            w,
            "staging: {f}/{total_files} files, {:.2}/{:.2} GB, {:.2} GB/s, ETA {eta}",
            b as f64 / 1e9,
            total_bytes as f64 / 1e9,
            rate / 1e9
        );
    };
    let style = ProgressStyle::with_template("{line}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
        .with_key("line", line);
    let term = Lines {
        out: Mutex::new(Box::new(out)),
        in_place: tty,
        pending: Mutex::new((String::new(), false)),
    };
    let bar = ProgressBar::with_draw_target(
        Some(total_bytes),
        ProgressDrawTarget::term_like(Box::new(term)),
    )
    .with_style(style);
    bar.enable_steady_tick(interval);
    bar
}

/// indicatif's terminal for staging: each drawn line written whole when indicatif flushes it,
/// rewritten in place (`\r…\x1b[K`) on a terminal or as a plain line otherwise; cursor moves and
/// indicatif's padding are dropped. Progress is best effort: a closed stderr does not fail the
/// stage.
struct Lines {
    out: Mutex<Box<dyn Write + Send>>,
    in_place: bool,
    /// The line drawn since the last flush, and whether a clear came before it.
    pending: Mutex<(String, bool)>,
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lines")
            .field("in_place", &self.in_place)
            .finish_non_exhaustive()
    }
}

impl TermLike for Lines {
    fn width(&self) -> u16 {
        // Wide enough never to wrap the line (a terminal wraps it itself, as it always did).
        512
    }

    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }

    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }

    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }

    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }

    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.write_str(s)
    }

    fn write_str(&self, s: &str) -> std::io::Result<()> {
        let s = s.trim();
        if !s.is_empty() {
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .push_str(s);
        }
        Ok(())
    }

    fn clear_line(&self) -> std::io::Result<()> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        Ok(())
    }

    fn flush(&self) -> std::io::Result<()> {
        let (line, cleared) =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let _ = match (line.is_empty(), self.in_place) {
            (false, true) => write!(out, "\r{line}\x1b[K"),
            (false, false) => writeln!(out, "{line}"),
            (true, true) if cleared => write!(out, "\r\x1b[K"),
            (true, _) => Ok(()),
        };
        let _ = out.flush();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer the test can read back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn progress_is_reported_while_work_goes_on_as_lines_or_in_place() {
        for tty in [false, true] {
            let sink = Sink::default();
            let progress = Arc::new(Progress {
                files: AtomicU64::new(3),
                bytes: AtomicU64::new(0),
            });
            let every = Duration::from_millis(20);
            let bar = start(&progress, (10, 2_000_000_000), every, tty, sink.clone());
            progress.files.store(5, Ordering::Relaxed);
            progress.bytes.store(1_000_000_000, Ordering::Relaxed);
            // Long enough for several lines, and for the terminal's half-second period.
            std::thread::sleep(Duration::from_millis(700));
            bar.finish_and_clear();
            drop(bar);
            let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
            assert!(
                text.contains("staging: 5/10 files, 1.00/2.00 GB, "),
                "{text:?}"
            );
            assert!(text.contains(" GB/s, ETA "), "{text:?}");
            if tty {
                assert!(
                    !text.contains('\n') && text.ends_with("\r\x1b[K"),
                    "{text:?}"
                );
            } else {
                assert!(text.lines().count() >= 5, "{text:?}");
            }
        }
    }

    #[test]
    fn a_stage_shorter_than_the_period_reports_nothing() {
        let sink = Sink::default();
        let progress = Arc::new(Progress {
            files: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        let bar = start(
            &progress,
            (1, 1),
            Duration::from_secs(10),
            false,
            sink.clone(),
        );
        std::thread::sleep(Duration::from_millis(100));
        bar.finish_and_clear();
        drop(bar);
        assert!(sink.0.lock().unwrap().is_empty());
    }
}
