//! `berth gc`: reclaims containers whose berth process died (cgroups and state directories),
//! the lazy image servers no container uses, the scratch of jobs that ended without an Epilog,
//! expired retained scratch, and old copies of the host's MPI (node::mpi::reclaim). The image
//! store's garbage is `berth images gc`'s (images.rs).

use std::time::Duration;

use clap::Args;

use super::Failure;
use crate::config::Config;
use crate::runtime::state;

/// Clean up after containers and jobs: killed containers, unused image mounts, old scratch
///
/// Reclaims the leftovers of berth processes that were killed (their cgroups and state),
/// unmounts squashfs/SIF images no container uses, stops the lazy image servers no container
/// uses, removes the scratch of jobs Slurm no longer runs and retained scratch past
/// scratch.retention_days, and the copies of the host's MPI from before its upgrade that no
/// container binds. It never removes an image: the image
/// store is cleaned by `berth images gc` (least recently used images, unused layers). Needs
/// root; berth-gc.timer runs it hourly.
#[derive(Debug, Args)]
pub struct GcArgs {}

pub fn execute(_args: &GcArgs, config: &Config) -> Result<i32, Failure> {
    // A state directory another user could change is refused in one line, never cleaned.
    state::open_root(&config.runtime.state_dir).map_err(|e| Failure::system(e.to_string()))?;
    let ids = state::reclaim(
        &config.runtime.state_dir,
        Duration::from_secs(config.runtime.kill_timeout_s),
    );
    for id in &ids {
        outln!("reclaimed {id}");
    }
    // Squashfs and SIF images stay mounted for the next container of the image; unmount those
    // no container uses any more. A store that cannot be opened has nothing mounted either.
    if let Ok(store) = crate::image::store::Store::open(&config.store) {
        match crate::image::mount::unmount_unused(&config.squashfs.mount_dir, |digest| {
            store.in_use(digest)
        }) {
            Ok(digests) => {
                for d in digests {
                    outln!("unmounted {d}");
                }
            }
            Err(e) => eprintln!("berth: {e}"),
        }
    }
    // A lazy image's server stays for the next container of the image until then.
    for line in crate::image::lazy::server::stop_unused(
        &config.image(),
        &crate::node::container::lazy_node(config),
    ) {
        outln!("{line}");
    }
    for line in super::prolog::housekeeping(config) {
        outln!("{line}");
    }
    // Copies of the host's MPI from before its upgrade, once no container binds them.
    for line in crate::node::mpi::reclaim(config) {
        outln!("{line}");
    }
    Ok(0)
}
