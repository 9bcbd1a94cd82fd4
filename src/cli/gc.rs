//! `berth gc`: reclaims containers whose berth process died (cgroups and state directories).

use std::time::Duration;

use clap::Args;

use super::Failure;
use crate::config::Config;
use crate::runtime::state;

/// Reclaim leftovers of berth processes that were killed (their cgroups and state)
#[derive(Debug, Args)]
pub struct GcArgs {}

pub fn execute(_args: &GcArgs, config: &Config) -> Result<i32, Failure> {
    let ids = state::reclaim(
        &config.runtime.state_dir,
        Duration::from_secs(config.runtime.kill_timeout_s),
    );
    for id in &ids {
        println!("reclaimed {id}");
    }
    Ok(0)
}
