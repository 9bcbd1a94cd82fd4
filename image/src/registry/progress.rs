//! Pull progress on stderr: bars (one per layer in flight plus a total) on a terminal, one plain
//! line per finished layer otherwise (Slurm job logs, CI).

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How a pull reports progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProgressMode {
    /// Bars when stderr is a terminal, lines otherwise.
    #[default]
    Auto,
    /// One line per layer.
    Lines,
    /// Nothing.
    Quiet,
}

pub struct Progress {
    image: String,
    layers: usize,
    bars: Option<(MultiProgress, ProgressBar)>,
    lines: bool,
}

impl Progress {
    pub fn new(mode: ProgressMode, image: &str, layers: usize, total_bytes: u64) -> Self {
        let tty = std::io::stderr().is_terminal();
        let (bars, lines) = match mode {
            ProgressMode::Quiet => (false, false),
            ProgressMode::Lines => (false, true),
            ProgressMode::Auto => (tty, !tty),
        };
        let bars = bars.then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let total = multi.add(ProgressBar::new(total_bytes));
            total.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            total.set_prefix(format!("{image} total"));
            total.enable_steady_tick(Duration::from_millis(200));
            (multi, total)
        });
        Self {
            image: image.to_string(),
            layers,
            bars,
            lines,
        }
    }

    /// A layer the store already holds.
    pub fn skipped(&self, index: usize, digest: &str, size: u64) {
        if let Some((multi, total)) = &self.bars {
            total.inc(size);
            let _ = multi.println(format!(
                "layer {}/{} {} already stored",
                index + 1,
                self.layers,
                short(digest)
            ));
        } else if self.lines {
            eprintln!(
                "berth: {}: layer {}/{} {} already stored",
                self.image,
                index + 1,
                self.layers,
                short(digest)
            );
        }
    }

    pub fn layer(&self, index: usize, digest: &str, size: u64) -> LayerProgress {
        let bar = self.bars.as_ref().map(|(multi, total)| {
            let bar = multi.insert_before(total, ProgressBar::new(size));
            bar.set_style(
                ProgressStyle::with_template("{prefix} [{bar:30}] {bytes}/{total_bytes}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            bar.set_prefix(format!(
                "layer {}/{} {}",
                index + 1,
                self.layers,
                short(digest)
            ));
            (bar, total.clone())
        });
        LayerProgress {
            bar,
            line: self.lines.then(|| {
                format!(
                    "berth: {}: layer {}/{} {} ({})",
                    self.image,
                    index + 1,
                    self.layers,
                    short(digest),
                    human(size)
                )
            }),
            start: Instant::now(),
        }
    }

    pub fn finish(&self) {
        if let Some((_, total)) = &self.bars {
            total.finish_and_clear();
        }
    }
}

pub struct LayerProgress {
    bar: Option<(ProgressBar, ProgressBar)>,
    line: Option<String>,
    start: Instant,
}

impl LayerProgress {
    pub fn inc(&self, n: u64) {
        if let Some((bar, total)) = &self.bar {
            bar.inc(n);
            total.inc(n);
        }
    }

    pub fn done(&self) {
        if let Some((bar, _)) = &self.bar {
            bar.finish_and_clear();
        }
        if let Some(line) = &self.line {
            eprintln!("{line} done in {:.1} s", self.start.elapsed().as_secs_f64());
        }
    }

    pub fn failed(&self) {
        if let Some((bar, _)) = &self.bar {
            bar.abandon();
        }
    }
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

fn human(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes >= 1024 * 1024 {
        format!("{:.1} MiB", bytes as f64 / MIB)
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}
