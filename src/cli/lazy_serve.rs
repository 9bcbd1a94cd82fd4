//! `berth lazy serve` (internal): the node's server of one lazy image, started detached by the
//! first container that needs it (image::lazy::server); `berth gc` stops it when no container
//! uses it.

use std::path::PathBuf;

use clap::Args;

use super::Failure;
use crate::config::Config;
use crate::image::lazy::server;

/// Serve a lazy image to this node's containers (started by berth itself)
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The sha256 (hex) of the image's index the starting container verified
    #[arg(long, value_name = "HEX")]
    pub index: String,
    /// The user whose credentials fetch the image
    #[arg(long, value_name = "UID")]
    pub uid: u32,
    /// That user's home (for their registry logins)
    #[arg(long, value_name = "DIR")]
    pub home: Option<PathBuf>,
    /// The lazy image: docker://REGISTRY/REPO:TAG
    #[arg(value_name = "REF")]
    pub reference: String,
}

pub fn execute(args: &ServeArgs, config: &Config) -> Result<i32, Failure> {
    server::serve(
        &server::ServeArgs {
            reference: args.reference.clone(),
            index_hex: args.index.clone(),
            uid: args.uid,
            home: args.home.clone(),
        },
        &config.image(),
        &crate::node::container::lazy_node(config),
    )?;
    Ok(0)
}
