//! `berth cluster prewarm REF`: gets a registry image onto many nodes before jobs need it
//! (`berth_agent::prewarm`).

use std::time::Duration;

use clap::Args;

use super::Failure;
use crate::config::Config;

#[derive(Debug, Args)]
pub struct PrewarmArgs {
    /// The registry image: [REGISTRY/]IMAGE[:TAG][@DIGEST] or docker://…
    #[arg(value_name = "REF")]
    pub reference: String,

    /// Nodes to warm, comma-separated [default: every node whose agent serves peers]
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub nodes: Vec<String>,

    /// Most nodes one node serves at once
    #[arg(long, default_value_t = 4, value_name = "K")]
    pub fanout: usize,

    /// Seconds one node's import may take
    #[arg(long, default_value_t = 3600, value_name = "S")]
    pub timeout: u64,
}

pub fn execute(args: &PrewarmArgs, config: &Config, json: bool) -> Result<i32, Failure> {
    let req = berth_agent::prewarm::Request {
        reference: args.reference.clone(),
        nodes: args.nodes.clone(),
        fanout: args.fanout,
        timeout: Duration::from_secs(args.timeout.max(1)),
    };
    let line = |o: &berth_agent::prewarm::Outcome| {
        if json {
            return;
        }
        match &o.error {
            None => outln!(
                "{:<20} warmed from {} in {:.1} s",
                o.node,
                o.from,
                o.seconds
            ),
            Some(e) => outln!("{:<20} FAILED (from {}): {e}", o.node, o.from),
        }
    };
    let report = berth_agent::prewarm::run(config, &req, &line)?;
    let all = &report.outcomes;
    let ok = all.iter().filter(|o| o.error.is_none()).count();
    if json {
        outln!("{}", serde_json::to_string_pretty(all).expect("serializes"));
    } else {
        outln!(
            "{ok} of {} nodes hold {} ({:.1} s, fan-out {})",
            all.len(),
            report.key,
            report.seconds,
            args.fanout.max(1)
        );
    }
    Ok(if ok == all.len() { 0 } else { 1 })
}
