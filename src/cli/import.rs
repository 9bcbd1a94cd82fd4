//! `berth import REF`: imports an image into the node's store (once) and prints its digest.

use clap::Args;

use super::Failure;
use crate::config::Config;
use crate::image::store::Store;
use crate::image::{ImageError, Reference};

/// Import (pull) an image into the node's image store and print its digest
///
/// `berth pull` is the same verb, as podman and docker name it. The image is imported once per node: layers already in the store are reused, and a second
/// import of the same image (even from another process at the same time) waits for the first
/// and reuses its result. Progress goes to stderr; stdout gets only the digest.
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// [USER@][REGISTRY#]IMAGE[:TAG][@DIGEST], docker://[USER@]REGISTRY/IMAGE[:TAG],
    /// /path/image.sqsh, /path/image.sif, oci:DIR[:REF], oci-archive:FILE[:REF],
    /// docker-archive:FILE[:REF], podman://IMAGE[:TAG] or dockerd://IMAGE[:TAG]
    #[arg(value_name = "REF")]
    pub reference: String,

    /// Platform to pick from a multi-platform image (amd64, arm64, ...) [default: the host's]
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
}

/// Parses an image reference from the command line.
pub fn parse_reference(text: &str) -> Result<Reference, ImageError> {
    crate::image::reference::parse(text)
}

pub fn open_store(config: &Config) -> Result<Store, Failure> {
    Store::open(&config.store).map_err(Failure::from)
}

pub fn execute(args: &ImportArgs, config: &Config) -> Result<i32, Failure> {
    let reference = parse_reference(&args.reference).map_err(Failure::from)?;
    let store = open_store(config)?;
    let progress = |line: &str| eprintln!("berth: {line}");
    let user = crate::user::current().map_err(|e| Failure::input(e.to_string()))?;
    let who = crate::image::import::Requester {
        uid: user.uid,
        home: user.home.as_deref(),
        arch: args.arch.clone(),
    };
    let image = crate::image::import::import(&store, &reference, &config.image(), &who, &progress)
        .map_err(Failure::from)?;
    outln!("{}", image.digest);
    Ok(0)
}
