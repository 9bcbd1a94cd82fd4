//! The `/metrics` of the watch on Slurm (issue 17): the daemons' states, takeovers, and the
//! leftovers of ended jobs. Registered by server.rs's `/metrics` handler; the families exist on
//! every controller (so alert rules always find their names), their members on the leader.

use std::sync::atomic::{AtomicU64, Ordering};

use berth_api::DaemonState;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::server::App;
use crate::state::State;

type Labels = Vec<(String, String)>;

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub fn register(app: &App, state: &State, leader: bool, reg: &mut Registry) {
    let up = Family::<Labels, Gauge>::default();
    // Always a sample (NaN while unknown: no comparison is true of it), so the alert rules
    // that name it find it on every controller.
    let age = Gauge::<f64, AtomicU64>::default();
    age.set(f64::NAN);
    let fails: Gauge = Gauge::default();
    let node_up = Family::<Labels, Gauge>::default();
    let orphaned = Family::<Labels, Gauge>::default();
    let oldest = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    if leader {
        let (daemons, hb_age, f) = super::watch::metrics(app);
        for (d, v) in daemons {
            up.get_or_create(&vec![("daemon".into(), d)]).set(v);
        }
        if let Some(a) = hb_age {
            age.set(a);
        }
        fails.set(i64::from(f));
        let beats = app.beats_now();
        for (node, b) in &beats {
            for d in b
                .daemons
                .iter()
                .filter(|d| d.state != DaemonState::NotConfigured)
            {
                node_up
                    .get_or_create(&vec![
                        ("node".into(), node.clone()),
                        ("daemon".into(), d.daemon.clone()),
                    ])
                    .set(i64::from(d.state == DaemonState::Up));
            }
        }
        let orphans = super::watch::orphaned(app, &beats);
        for node in beats.keys() {
            let ls = orphans.get(node);
            let labels = vec![("node".into(), node.clone())];
            orphaned
                .get_or_create(&labels)
                .set(count(ls.map_or(0, Vec::len)));
            oldest.get_or_create(&labels).set(
                ls.and_then(|ls| ls.iter().map(|(_, a)| *a).reduce(f64::max))
                    .unwrap_or(0.0),
            );
        }
    }
    reg.register(
        "slurm_daemon_up",
        "1 when the leader's check finds the Slurm daemon up (slurmctld, slurmctld-backup, \
         slurmdbd), 0 when down or unknown; absent when not configured",
        up,
    );
    reg.register(
        "slurmctld_heartbeat_age_seconds",
        "Seconds since slurmctld last wrote StateSaveLocation/heartbeat (as the leader reads it; \
         NaN when it cannot)",
        age,
    );
    reg.register(
        "slurmctld_primary_failed_pings",
        "Failed pings of the primary slurmctld in a row",
        fails,
    );
    let total: Counter = Counter::default();
    total.inc_by(state.takeovers.total);
    reg.register(
        "takeovers",
        "slurmctld takeovers decided (committed to the Raft log)",
        total,
    );
    let run: Counter = Counter::default();
    run.inc_by(app.takeovers_run.load(Ordering::Relaxed));
    reg.register(
        "takeover_calls",
        "scontrol takeover calls this controller made that succeeded",
        run,
    );
    reg.register(
        "node_daemon_up",
        "1 when the node's agent found the daemon (slurmd, munge) up, 0 when down or unknown",
        node_up,
    );
    reg.register(
        "leftovers_orphaned",
        "Leftovers of ended jobs per node: squeue no longer runs their job, or they have none",
        orphaned,
    );
    reg.register(
        "leftover_age_seconds",
        "Seconds the leader has seen the node's oldest leftover of an ended job",
        oldest,
    );
}
