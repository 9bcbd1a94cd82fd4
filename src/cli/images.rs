//! `berth images ls|inspect|rm|gc|verify`: what the node's image store holds, and keeping it bounded.

use std::time::SystemTime;

use clap::{Args, Subcommand};

use super::Failure;
use super::import::{open_store, parse_reference};
use crate::config::Config;
use crate::image::store::{self, Entry, GcPolicy, LayerCheck, Removed, Store, VerifyReport};

/// List, inspect and remove the images in the node's store, or collect its garbage
///
/// `berth images gc` cleans the image store (images, layers, killed imports); `berth gc` cleans
/// up after containers and jobs (cgroups, state, image mounts, scratch). Every `images` verb
/// needs root: the store is root's.
#[derive(Debug, Args)]
pub struct ImagesArgs {
    #[command(subcommand)]
    pub command: ImagesCommand,
}

#[derive(Debug, Subcommand)]
pub enum ImagesCommand {
    /// List stored images: reference, digest, size, last use
    Ls {
        /// Print a JSON array, one object per image: digest, references, size, last_used,
        /// in_use, source (docs/user-guide.md, "JSON output")
        #[arg(long)]
        json: bool,
    },
    /// Print an image's record, references, size and use as JSON
    Inspect {
        /// A reference as `ls` shows it or as imported, or a digest (a unique prefix will do)
        #[arg(value_name = "REF|DIGEST")]
        target: String,
    },
    /// Remove a reference (and its image when no other reference keeps it), or an image by
    /// digest; refuses an image a running container uses
    Rm {
        #[arg(value_name = "REF|DIGEST")]
        target: String,
    },
    /// Check every stored file against what was recorded when its layer was extracted (path,
    /// type, size, mode, owner, content digest); exit 1 when any differ
    Verify {
        /// Images to check (references as `ls` shows them, or digests); none: every image
        #[arg(value_name = "REF|DIGEST")]
        targets: Vec<String>,
        /// Print a JSON array, one object per image: digest, references, status, layers
        /// (docs/user-guide.md, "JSON output"); the exit status is the same
        #[arg(long)]
        json: bool,
    },
    /// Clean the image store: leftovers of killed imports, layers no image uses, and (with
    /// options) the least recently used images; never an image in use. Containers, mounts and
    /// scratch are `berth gc`'s
    Gc {
        /// Remove least recently used images until the store holds at most SIZE (e.g. 50G)
        #[arg(long, value_name = "SIZE", value_parser = super::values::size)]
        max_size: Option<u64>,
        /// Remove images, and lazy images' chunk caches, not used for DURATION (e.g. 30m, 12h,
        /// 7d)
        #[arg(long, value_name = "DURATION", value_parser = super::values::duration)]
        unused_for: Option<std::time::Duration>,
    },
}

/// The sub-verb's name, for messages (`berth images ls needs root`).
pub fn verb(command: &ImagesCommand) -> &'static str {
    match command {
        ImagesCommand::Ls { .. } => "ls",
        ImagesCommand::Inspect { .. } => "inspect",
        ImagesCommand::Rm { .. } => "rm",
        ImagesCommand::Verify { .. } => "verify",
        ImagesCommand::Gc { .. } => "gc",
    }
}

/// One image as `berth images ls --json` prints it.
#[derive(Debug, serde::Serialize)]
pub struct LsEntry {
    /// The manifest digest (`sha256:...`); a squashfs or SIF file's sha256.
    pub digest: String,
    /// The references it goes by, as `ls` shows them; empty when none is left.
    pub references: Vec<String>,
    /// Bytes on disk: its layers (a layer shared with another image counts for both).
    pub size: u64,
    /// Last use, seconds since the epoch.
    pub last_used: u64,
    /// Whether a running container uses it.
    pub in_use: bool,
    /// The reference it was imported from.
    pub source: String,
}

impl From<&Entry> for LsEntry {
    fn from(e: &Entry) -> Self {
        Self {
            digest: e.image.digest.to_string(),
            references: e.references.clone(),
            size: e.size,
            last_used: e
                .last_used
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
            in_use: e.in_use,
            source: e.image.source.to_string(),
        }
    }
}

fn select(store: &Store, text: &str) -> Result<store::Selector, Failure> {
    store.select(text, &parse_reference).map_err(Failure::from)
}

/// `5 minutes ago`
fn ago(t: SystemTime) -> String {
    let s = SystemTime::now()
        .duration_since(t)
        .unwrap_or_default()
        .as_secs();
    let plural = |n: u64, unit: &str| format!("{n} {unit}{} ago", if n == 1 { "" } else { "s" });
    match s {
        0..60 => "just now".into(),
        60..3600 => plural(s / 60, "minute"),
        3600..86400 => plural(s / 3600, "hour"),
        _ => plural(s / 86400, "day"),
    }
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

fn table(entries: &[Entry]) -> String {
    let mut rows = vec![[
        "REFERENCE".to_string(),
        "DIGEST".to_string(),
        "SIZE".to_string(),
        "LAST USED".to_string(),
    ]];
    for e in entries {
        let refs = if e.references.is_empty() {
            vec!["<none>".to_string()]
        } else {
            e.references.clone()
        };
        for r in refs {
            rows.push([
                r,
                short(&e.image.digest).to_string(),
                store::human_size(e.size),
                if e.in_use {
                    "in use".into()
                } else {
                    ago(e.last_used)
                },
            ]);
        }
    }
    let widths: Vec<usize> = (0..4)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            format!(
                "{:w0$}  {:w1$}  {:>w2$}  {}\n",
                r[0],
                r[1],
                r[2],
                r[3],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2]
            )
        })
        .collect()
}

fn inspect_json(e: &Entry) -> serde_json::Value {
    let mut v = serde_json::to_value(&e.image).unwrap_or_default();
    if let Some(map) = v.as_object_mut() {
        map.insert("references".into(), e.references.clone().into());
        map.insert("size".into(), e.size.into());
        let secs = e
            .last_used
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        map.insert("last_used".into(), secs.into());
        map.insert("in_use".into(), e.in_use.into());
    }
    v
}

/// The name an image goes by in `verify`'s lines: its first reference, else its digest.
fn image_name(e: &Entry) -> String {
    e.references
        .first()
        .cloned()
        .unwrap_or_else(|| e.image.digest.clone())
}

/// One image as `berth images verify --json` prints it.
#[derive(Debug, serde::Serialize)]
pub struct VerifyEntry {
    pub digest: String,
    pub references: Vec<String>,
    /// `ok`, `differs`, `unrecorded` (a layer imported by an older berth) or `not-verifiable`
    /// (a squashfs/SIF image).
    pub status: &'static str,
    pub layers: Vec<VerifyLayer>,
}

/// One layer of a [`VerifyEntry`].
#[derive(Debug, serde::Serialize)]
pub struct VerifyLayer {
    /// The layer's directory name in the store (its diff_id's hex).
    pub layer: String,
    /// `ok`, `differs` or `unrecorded`.
    pub status: &'static str,
    /// Paths checked, for an `ok` layer.
    pub paths: Option<usize>,
    /// One line per difference (path and what differs).
    pub differences: Vec<String>,
}

fn verify_json(report: &VerifyReport) -> Vec<VerifyEntry> {
    report
        .images
        .iter()
        .map(|(entry, layers)| {
            let layers: Vec<VerifyLayer> = layers
                .iter()
                .map(|(dir, check)| {
                    let (status, paths, differences) = match check {
                        LayerCheck::Ok(n) => ("ok", Some(*n), Vec::new()),
                        LayerCheck::Unrecorded => ("unrecorded", None, Vec::new()),
                        LayerCheck::Differs(lines) => ("differs", None, lines.clone()),
                    };
                    VerifyLayer {
                        layer: dir
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                        status,
                        paths,
                        differences,
                    }
                })
                .collect();
            let status = if layers.is_empty() {
                "not-verifiable"
            } else if layers.iter().any(|l| l.status == "differs") {
                "differs"
            } else if layers.iter().any(|l| l.status == "unrecorded") {
                "unrecorded"
            } else {
                "ok"
            };
            VerifyEntry {
                digest: entry.image.digest.to_string(),
                references: entry.references.clone(),
                status,
                layers,
            }
        })
        .collect()
}

/// `verify`'s output: one line per image that is whole, one per difference otherwise, and the
/// exit code (1 when a layer differs).
fn verify_lines(report: &VerifyReport) -> (Vec<String>, Vec<String>, i32) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut bad = 0;
    for (entry, layers) in &report.images {
        let name = image_name(entry);
        if layers.is_empty() {
            out.push(format!(
                "{name}: not verifiable: a squashfs/SIF image (its file is checked by digest when imported)"
            ));
            continue;
        }
        let mut files = 0;
        let mut ok = true;
        for (dir, check) in layers {
            let layer = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let layer = &layer[..layer.len().min(12)];
            match check {
                LayerCheck::Ok(n) => files += n,
                LayerCheck::Unrecorded => {
                    ok = false;
                    err.push(format!(
                        "{name}: layer {layer}: not verifiable: imported by an older berth; re-import to record (berth images rm {name}, then import it again)"
                    ));
                }
                LayerCheck::Differs(lines) => {
                    ok = false;
                    bad += 1;
                    for l in lines {
                        err.push(format!("{name}: layer {layer}: {l}"));
                    }
                }
            }
        }
        if ok {
            out.push(format!(
                "{name}: ok ({} layers, {files} paths)",
                layers.len()
            ));
        }
    }
    if bad > 0 {
        err.push(format!(
            "{bad} layer(s) differ from what was recorded when they were extracted and are marked damaged: re-import the images (berth import REF replaces the damaged layers) or run berth images gc (removes the images that have them, so their next use imports them again)"
        ));
    }
    (out, err, if bad > 0 { 1 } else { 0 })
}

pub fn execute(args: &ImagesArgs, config: &Config) -> Result<i32, Failure> {
    let store = open_store(config)?;
    match &args.command {
        ImagesCommand::Ls { json: false } => out!("{}", table(&store.list())),
        ImagesCommand::Ls { json: true } => {
            let entries: Vec<LsEntry> = store.list().iter().map(LsEntry::from).collect();
            let text = serde_json::to_string_pretty(&entries)
                .map_err(|e| Failure::system(e.to_string()))?;
            outln!("{text}");
        }
        ImagesCommand::Inspect { target } => {
            let entry = store
                .inspect(&select(&store, target)?)
                .map_err(Failure::from)?;
            let text = serde_json::to_string_pretty(&inspect_json(&entry)).unwrap_or_default();
            outln!("{text}");
        }
        ImagesCommand::Rm { target } => {
            match store
                .remove(&select(&store, target)?)
                .map_err(Failure::from)?
            {
                Removed::Untagged(r) => outln!("untagged {r}"),
                Removed::Image {
                    digest, references, ..
                } => {
                    outln!("removed {digest} {}", references.join(" "));
                }
            }
        }
        ImagesCommand::Verify { targets, json } => {
            let entries = if targets.is_empty() {
                store.list()
            } else {
                targets
                    .iter()
                    .map(|t| store.inspect(&select(&store, t)?).map_err(Failure::from))
                    .collect::<Result<Vec<_>, Failure>>()?
            };
            let report = store.verify(entries).map_err(Failure::from)?;
            let (out, err, code) = verify_lines(&report);
            if *json {
                let text = serde_json::to_string_pretty(&verify_json(&report))
                    .map_err(|e| Failure::system(e.to_string()))?;
                outln!("{text}");
            } else {
                for l in out {
                    outln!("{l}");
                }
            }
            for l in err {
                eprintln!("berth: {l}");
            }
            return Ok(code);
        }
        ImagesCommand::Gc {
            max_size,
            unused_for,
        } => {
            let policy = GcPolicy {
                max_size: *max_size,
                unused_for: *unused_for,
            };
            let report = store.gc(&policy).map_err(Failure::from)?;
            for (digest, refs, size) in &report.removed {
                outln!(
                    "removed {digest} {} ({})",
                    refs.join(" "),
                    store::human_size(*size)
                );
            }
            for digest in &report.kept_in_use {
                eprintln!("berth: kept {digest}: in use by a running container");
            }
            let lazy = if report.lazy_caches_removed > 0 {
                format!(
                    ", {} lazy image chunk caches ({})",
                    report.lazy_caches_removed,
                    store::human_size(report.lazy_bytes_freed)
                )
            } else {
                String::new()
            };
            eprintln!(
                "berth: gc removed {} images, {} layers and {} leftover workspaces{lazy}, freed {}; the store holds {}",
                report.removed.len(),
                report.layers_removed,
                report.workspaces_removed,
                store::human_size(report.bytes_freed),
                store::human_size(report.size_after)
            );
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_times() {
        let now = SystemTime::now();
        assert_eq!(ago(now), "just now");
        assert_eq!(
            ago(now - std::time::Duration::from_secs(61)),
            "1 minute ago"
        );
        assert_eq!(
            ago(now - std::time::Duration::from_secs(7300)),
            "2 hours ago"
        );
        assert_eq!(
            ago(now - std::time::Duration::from_secs(3 * 86400)),
            "3 days ago"
        );
    }
}
