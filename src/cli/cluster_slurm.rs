//! `berth cluster status`'s Slurm part (issue 17): the leader's watch on slurmctld, its backup
//! and slurmdbd, the takeovers it decided, node daemons that are not up, and the leftovers of
//! ended jobs (`GET /v1/slurm`, leader only).

use berth_api::{DaemonState, SlurmView};

/// The lines `berth cluster status` prints for `v`.
pub fn lines(v: &SlurmView) -> Vec<String> {
    let mut out = Vec::new();
    for d in &v.daemons {
        let mut line = format!("{:<11} {}", format!("{}:", d.daemon), d.state.word());
        if d.state != DaemonState::NotConfigured || d.daemon == "slurmdbd" {
            line.push_str(&format!(" ({})", d.message));
        }
        out.push(line);
    }
    if let Some(age) = v.ctld_heartbeat_age_s {
        out.push(format!(
            "ctld beat:  written {age:.0} s ago (StateSaveLocation/heartbeat)"
        ));
    }
    out.push(format!(
        "takeover:   {}{}",
        if v.takeover_armed {
            "armed"
        } else {
            "off (no backup, or controller.takeover = false)"
        },
        if v.primary_fails > 0 {
            format!(", primary failed {} pings in a row", v.primary_fails)
        } else {
            String::new()
        }
    ));
    out.push(format!("takeovers:  {}", v.takeovers_total));
    for t in v.takeovers.iter().rev().take(5) {
        out.push(format!(
            "  {} by controller {} (term {}): {} -> {}",
            utc(t.at_unix_ms),
            t.by,
            t.term,
            t.reason,
            t.outcome.as_deref().unwrap_or("(no outcome recorded)")
        ));
    }
    if v.node_daemons_down.is_empty() {
        out.push("daemons:    slurmd and munge up on every node reporting them".into());
    } else {
        out.push(format!("daemons:    {} not up", v.node_daemons_down.len()));
        for d in &v.node_daemons_down {
            out.push(format!("  {d}"));
        }
    }
    out.push(format!("leftovers:  {} of ended jobs", v.orphaned.len()));
    for l in v.orphaned.iter().take(20) {
        out.push(format!("  {l}"));
    }
    if v.orphaned.len() > 20 {
        out.push(format!(
            "  … {} more (berth cluster nodes --json)",
            v.orphaned.len() - 20
        ));
    }
    out
}

/// Unix milliseconds as `YYYY-MM-DD HH:MM:SS UTC` (days to civil date: Howard Hinnant's
/// algorithm).
fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_796_385_735_000), "2026-12-04 12:02:15 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }
}
