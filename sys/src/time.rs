//! Deadlines from durations that users and configs choose: a duration too long for the clock
//! (`--timeout 1e30`, `kill_timeout_s = 18446744073709551615`) is the farthest deadline the
//! clock can represent, never a panic (`Instant + Duration` panics on overflow).

use std::time::{Duration, Instant};

/// `now + after`, or the farthest instant representable when that overflows.
pub fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    let mut d = after;
    loop {
        if let Some(t) = now.checked_add(d) {
            return t;
        }
        // Halving ends: `now + 0` always fits.
        d /= 2;
    }
}

/// Seconds (a user's `--timeout`, fractional) as a duration; a value past what a `Duration`
/// holds is `Duration::MAX` (no deadline in practice). `None` for zero, negative, NaN or
/// infinite values, which are no duration at all.
pub fn duration_from_secs(secs: f64) -> Option<Duration> {
    if !secs.is_finite() || secs <= 0.0 {
        return None;
    }
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d.is_zero() => None,
        Ok(d) => Some(d),
        Err(_) => Some(Duration::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_durations_are_the_farthest_deadline() {
        let far = deadline_after(Duration::MAX);
        assert!(far > Instant::now() + Duration::from_secs(100 * 365 * 86400));
        assert!(deadline_after(Duration::from_secs(u64::MAX)) >= far - Duration::from_secs(1));
        let soon = deadline_after(Duration::from_secs(1));
        assert!(soon <= Instant::now() + Duration::from_secs(1));
    }

    #[test]
    fn seconds_parse_without_panic() {
        assert_eq!(duration_from_secs(1.5), Some(Duration::from_millis(1500)));
        assert_eq!(duration_from_secs(1e26), Some(Duration::MAX));
        assert_eq!(
            duration_from_secs(18446744073709551616.0),
            Some(Duration::MAX)
        );
        assert_eq!(
            duration_from_secs(9223372036854775807.0),
            Some(Duration::from_secs(1 << 63))
        );
        assert_eq!(duration_from_secs(0.0), None);
        assert_eq!(duration_from_secs(1e-12), None);
        assert_eq!(duration_from_secs(-1.0), None);
        assert_eq!(duration_from_secs(f64::NAN), None);
        assert_eq!(duration_from_secs(f64::INFINITY), None);
    }
}
