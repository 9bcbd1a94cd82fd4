//! Where berth's log lines go. Every verb logs to stderr through `tracing`; the Slurm paths
//! (`berth prolog`, `berth epilog`, `berth step …`) also write to syslog/journald (`[log] target`),
//! each line tagged with the verb, the job id and the step, so that an admin finds why a Prolog's
//! image import failed in `journalctl -t berth` instead of slurmd's log of one node.
//!
//! The syslog writer is a small RFC 3164 client over a unix datagram socket (`[log]
//! syslog_socket`, /dev/log by default), the format glibc's `syslog(3)` sends and journald and
//! rsyslog parse (`<PRI>TIMESTAMP berth[PID]: MESSAGE`). It is best effort: a missing, full or
//! slow socket drops the line and never fails or stalls a job.

use std::fmt::Write as _;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::{LogConfig, LogLevel, LogTarget};

/// A syslog datagram longer than this is cut (rsyslog's default maximum is 8 KiB).
const MAX_MESSAGE: usize = 4096;

/// syslog's facility for system daemons (RFC 3164 section 4.1.1).
const FACILITY_DAEMON: u8 = 3;

/// syslog severities (RFC 3164 section 4.1.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Err = 3,
    Warning = 4,
    Info = 6,
    Debug = 7,
}

impl Severity {
    fn of(level: &tracing::Level) -> Self {
        match *level {
            tracing::Level::ERROR => Severity::Err,
            tracing::Level::WARN => Severity::Warning,
            tracing::Level::INFO => Severity::Info,
            _ => Severity::Debug,
        }
    }
}

/// The syslog destination of this process, set once by [`init`] for the Slurm paths.
struct Syslog {
    socket: UnixDatagram,
    path: PathBuf,
    /// `VERB job=J step=S`, the prefix of every line; the step is learned late for
    /// `step create` (from the plugin's request, see [`set_job`]).
    context: Mutex<String>,
    verb: &'static str,
}

static SYSLOG: OnceLock<Syslog> = OnceLock::new();

/// What logging needs of the command line: `[log]`, `-v`s, and which Slurm path this process
/// is (the verb, the job and step its arguments or environment name), if it is one.
#[derive(Debug, Default)]
pub struct Setup {
    pub config: LogConfig,
    pub verbose: u8,
    pub slurm: Option<(&'static str, Option<String>, Option<u64>)>,
}

fn context(verb: &str, job: Option<&str>, step: Option<u64>) -> String {
    let mut s = verb.to_string();
    if let Some(job) = job {
        let _ = write!(s, " job={job}");
    }
    if let Some(step) = step {
        let _ = write!(s, " step={step}");
    }
    s
}

/// Sets up logging for this process.
pub fn init(setup: Setup) {
    let Setup {
        config: log,
        verbose,
        slurm,
    } = setup;
    let verbosity = match verbose {
        0 => LogLevel::Error,
        1 => LogLevel::Info,
        _ => LogLevel::Debug,
    };
    let level = log.level.max(verbosity);
    let filter = tracing_subscriber::EnvFilter::try_from_env("BERTH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level.name()));
    let (to_stderr, to_syslog) = match (&slurm, log.target) {
        (None, _) | (Some(_), LogTarget::Stderr) => (true, false),
        (Some(_), LogTarget::Syslog) => (false, true),
        (Some(_), LogTarget::Both) => (true, true),
    };
    if let (Some((verb, job, step)), true) = (&slurm, to_syslog)
        && let Ok(socket) = UnixDatagram::unbound()
    {
        // A blocked syslog daemon must not hold up a job: drop the line instead.
        let _ = socket.set_nonblocking(true);
        let _ = SYSLOG.set(Syslog {
            socket,
            path: log.syslog_socket.clone(),
            context: Mutex::new(context(verb, job.as_deref(), *step)),
            verb,
        });
    }
    let stderr = to_stderr.then(|| {
        // Colours only on a terminal: slurmd's log and a captured stderr get plain text.
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false);
        // The Slurm paths' stderr ends up in slurmd's log, read long after: give it the time.
        if slurm.is_some() {
            layer.boxed()
        } else {
            layer.without_time().boxed()
        }
    });
    let syslog = SYSLOG.get().map(|_| SyslogLayer);
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(stderr)
        .with(syslog)
        .try_init();
}

/// Names the job and step the log lines are about, once a verb has learned them (`step create`
/// reads them from the plugin's request).
pub fn set_job(job: &str, step: Option<u64>) {
    if let Some(s) = SYSLOG.get()
        && let Ok(mut c) = s.context.lock()
    {
        *c = context(s.verb, Some(job), step);
    }
}

/// A line for Slurm (the user's error, a drain reason) that also belongs in syslog: written to
/// stderr as it is, and to syslog at `err` when the Slurm path logs there.
pub fn stderr_line(args: std::fmt::Arguments) {
    // Bounded and escaped like main's error line: what a user or a registry put in a message
    // reaches srun, slurmd's log and syslog as one line of at most LINE_MAX bytes.
    let line = berth_sys::text::one_line(&args.to_string());
    // The standard macro: this module's `eprintln` is the one that calls this function.
    std::eprintln!("{line}");
    to_syslog(Severity::Err, line.strip_prefix("berth: ").unwrap_or(&line));
}

/// Records in syslog the failure `main` prints as `berth: MESSAGE` on stderr.
pub fn failure(message: &str) {
    to_syslog(Severity::Err, message);
}

/// `eprintln!` for the Slurm verbs: also to syslog. A verb file imports it with
/// `use crate::log::eprintln;`, which shadows the standard macro there.
#[macro_export]
macro_rules! syslog_eprintln {
    ($($arg:tt)*) => { $crate::log::stderr_line(format_args!($($arg)*)) };
}
pub use crate::syslog_eprintln as eprintln;

fn to_syslog(severity: Severity, message: &str) {
    let Some(s) = SYSLOG.get() else { return };
    let context = s.context.lock().map(|c| c.clone()).unwrap_or_default();
    let datagram = format_rfc3164(
        severity,
        SystemTime::now(),
        std::process::id(),
        &format!("{context}: {message}"),
    );
    // Best effort: no listener, a full queue or a missing socket loses the line.
    let _ = s.socket.send_to(datagram.as_bytes(), &s.path);
}

/// `<PRI>Mmm dd hh:mm:ss berth[PID]: MESSAGE`, the message on one line (control characters
/// become spaces, so a value from a user cannot forge a second entry) and cut to
/// [`MAX_MESSAGE`] bytes. The timestamp is UTC: journald and rsyslog stamp local-socket
/// messages with their own time of arrival anyway.
pub fn format_rfc3164(severity: Severity, time: SystemTime, pid: u32, message: &str) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    #[expect(
        clippy::cast_possible_wrap,
        reason = "u64 seconds / 86 400 is below 2^48"
    )]
    let (_, month, day) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    let mut out = format!(
        "<{}>{} {:>2} {:02}:{:02}:{:02} berth[{pid}]: ",
        FACILITY_DAEMON * 8 + severity as u8,
        MONTHS[(month - 1) as usize],
        day,
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    for c in message.chars() {
        if out.len() + c.len_utf8() > MAX_MESSAGE {
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (H. Hinnant's algorithm).
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "doy is 0..=365 and mp 0..=11, so day is 1..=31 and month 1..=12"
)]
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Sends each `tracing` event that passed the filter to syslog.
struct SyslogLayer;

impl<S: tracing::Subscriber> Layer<S> for SyslogLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut visitor = Message::default();
        event.record(&mut visitor);
        to_syslog(Severity::of(event.metadata().level()), &visitor.text);
    }
}

/// An event's message followed by its other fields as ` key=value`.
#[derive(Default)]
struct Message {
    text: String,
}

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let fields = std::mem::take(&mut self.text);
            let _ = write!(self.text, "{value:?}{fields}");
        } else {
            let _ = write!(self.text, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let fields = std::mem::take(&mut self.text);
            self.text = format!("{value}{fields}");
        } else {
            let _ = write!(self.text, " {}={value}", field.name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_line_in_the_format_of_syslog_3() {
        // 2026-12-04 03:52:29 UTC
        let t = UNIX_EPOCH + Duration::from_secs(1_796_356_349);
        assert_eq!(
            format_rfc3164(Severity::Err, t, 42, "prolog job=7: no image"),
            "<27>Dec  4 03:52:29 berth[42]: prolog job=7: no image"
        );
        let w = format_rfc3164(Severity::Warning, UNIX_EPOCH, 1, "x");
        assert_eq!(w, "<28>Jan  1 00:00:00 berth[1]: x");
    }

    #[test]
    fn a_message_stays_one_bounded_line() {
        let forged = "image a\n<27>Jan  1 00:00:00 sshd[1]: accepted";
        let line = format_rfc3164(Severity::Info, UNIX_EPOCH, 1, forged);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("<30>"), "{line}");
        let long = "é".repeat(10_000);
        let line = format_rfc3164(Severity::Info, UNIX_EPOCH, 1, &long);
        assert!(line.len() <= MAX_MESSAGE, "{}", line.len());
    }

    #[test]
    fn calendar_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_791), (2026, 12, 4));
    }

    #[test]
    fn the_context_names_verb_job_and_step() {
        assert_eq!(context("prolog", Some("12"), None), "prolog job=12");
        assert_eq!(
            context("step create", Some("12"), Some(3)),
            "step create job=12 step=3"
        );
        assert_eq!(context("epilog", None, None), "epilog");
    }
}
