//! `berth lazy`: publishes an image's lazy form (image::lazy), which `berth run --image
//! lazy:REF` (and `berth create`, Slurm's `--container-image=lazy:REF`) then runs before the
//! image is on the node; `berth lazy serve` (hidden) is lazy_serve.rs.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::Failure;
use crate::config::Config;
use crate::image::lazy;

/// Publish an image's lazily loaded form to a registry
///
/// `berth lazy publish FILE.sqsh docker://REGISTRY/REPO:TAG` pushes the squashfs (as `berth
/// export` writes it) and an index of its chunks (a sha256 per chunk) as an OCI artifact at
/// that reference. `berth run --image lazy:docker://REGISTRY/REPO:TAG` then starts the
/// container at once: a node fetches only the chunks the container reads, verifies each, and
/// keeps them in the store for the next run.
#[derive(Debug, Args)]
pub struct LazyArgs {
    #[command(subcommand)]
    pub command: LazyCommand,
}

#[derive(Debug, Subcommand)]
pub enum LazyCommand {
    /// Push FILE.sqsh as the lazy image REF (docker://REGISTRY/REPO:TAG)
    Publish(PublishArgs),
    #[command(hide = true)]
    Serve(super::lazy_serve::ServeArgs),
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The squashfs image (berth export IMAGE -o FILE.sqsh writes one)
    #[arg(value_name = "FILE.sqsh")]
    pub file: PathBuf,
    /// Where to publish it: docker://REGISTRY/REPO:TAG
    #[arg(value_name = "REF")]
    pub reference: String,
    /// Chunk size in KiB: what one miss fetches (4 to 65536)
    #[arg(long, value_name = "KIB", default_value_t = 1024)]
    pub chunk_kib: u64,
}

pub fn execute(args: &LazyArgs, config: &Config) -> Result<i32, Failure> {
    match &args.command {
        LazyCommand::Publish(p) => publish(p, config),
        LazyCommand::Serve(s) => super::lazy_serve::execute(s, config),
    }
}

fn publish(args: &PublishArgs, config: &Config) -> Result<i32, Failure> {
    if !(4..=65536).contains(&args.chunk_kib) {
        return Err(Failure::input(format!(
            "--chunk-kib {}: give 4 to 65536",
            args.chunk_kib
        )));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let (r, p) = lazy::publish_to(
        &args.file,
        &args.reference,
        args.chunk_kib << 10,
        config.image().registry,
        home.as_deref(),
    )?;
    println!(
        "published {} ({} bytes, {} chunks of {} KiB{}) as {}@{}",
        p.index.blob,
        p.index.size,
        p.index.chunks.len(),
        args.chunk_kib,
        if p.uploaded {
            ""
        } else {
            "; the registry had the squashfs"
        },
        r.image_name(),
        p.manifest_digest
    );
    Ok(0)
}
