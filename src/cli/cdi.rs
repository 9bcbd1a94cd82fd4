//! `berth cdi`: list the CDI devices the spec directories define, and write CDI specs for this
//! node's GPUs and HCAs.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::Failure;
use super::topo::Source;
use crate::config::Config;
use crate::topology::cdi::{self, Registry};

/// Container Device Interface specs: list devices, generate specs for this node
#[derive(Debug, Args)]
pub struct CdiArgs {
    #[command(subcommand)]
    pub command: CdiCommand,
}

#[derive(Debug, Subcommand)]
pub enum CdiCommand {
    List(ListArgs),
    Generate(GenerateArgs),
}

/// List the devices of the CDI spec directories (topology.cdi_dirs), with the file of each
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON
    #[arg(long)]
    pub json: bool,
}

/// Write CDI specs for this node's GPUs (one device per index and per UUID, and `all`) and HCAs
/// (one per RDMA device, and `all` for the compute ones)
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub source: Source,

    /// Directory to write berth-gpu.json and berth-hca.json into [default: the last of
    /// topology.cdi_dirs]
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Print the specs instead of writing them
    #[arg(long)]
    pub stdout: bool,

    /// CDI kind of the GPU devices
    #[arg(long, value_name = "VENDOR/CLASS", default_value = "nvidia.com/gpu", value_parser = super::values::cdi_kind)]
    pub gpu_kind: String,

    /// CDI kind of the HCA devices
    #[arg(long, value_name = "VENDOR/CLASS", default_value = "berth.io/hca", value_parser = super::values::cdi_kind)]
    pub hca_kind: String,
}

pub fn execute(args: &CdiArgs, config: &Config) -> Result<i32, Failure> {
    let (text, code) = output(args, config)?;
    out!("{text}");
    Ok(code)
}

/// What `berth cdi` prints (problems go to stderr as they are found), and its exit status.
pub fn output(args: &CdiArgs, config: &Config) -> Result<(String, i32), Failure> {
    let mut out = String::new();
    match &args.command {
        CdiCommand::List(l) => {
            let registry = Registry::load(&config.topology.cdi_dirs);
            let names = registry.names();
            if l.json {
                let list: Vec<serde_json::Value> = names
                    .iter()
                    .map(|n| {
                        serde_json::json!({
                            "name": n,
                            "spec": registry.source(n).map(|p| p.display().to_string()),
                        })
                    })
                    .collect();
                out = serde_json::to_string_pretty(&serde_json::json!({
                    "devices": list,
                    "errors": registry.errors,
                }))
                .expect("JSON")
                    + "\n";
            } else {
                for n in &names {
                    out.push_str(&format!(
                        "{n}  {}\n",
                        registry
                            .source(n)
                            .map(|p| p.display().to_string())
                            .unwrap_or_default()
                    ));
                }
                for e in &registry.errors {
                    eprintln!("berth: {e}");
                }
                if names.is_empty() {
                    eprintln!(
                        "berth: no CDI devices in {}",
                        config
                            .topology
                            .cdi_dirs
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
            }
            Ok((out, 0))
        }
        CdiCommand::Generate(g) => {
            let (host, node) = crate::node::source::discover(&g.source.lib(), config)?;
            let specs = cdi::generate_node(&host, &node, &g.gpu_kind, &g.hca_kind)?;
            if specs.is_empty() {
                eprintln!("berth: no GPU and no RDMA device on this node: no CDI spec written");
            } else if g.stdout {
                for (_, spec) in &specs {
                    out.push_str(
                        &(serde_json::to_string_pretty(spec).expect("a CDI spec serializes")
                            + "\n"),
                    );
                }
            } else {
                let Some(dir) = g.dir.as_ref().or(config.topology.cdi_dirs.last()) else {
                    return Err(Failure::input(
                        "topology.cdi_dirs is empty: give --dir DIR or --stdout",
                    ));
                };
                for (path, (_, spec)) in cdi::write_into(&specs, dir)?.iter().zip(&specs) {
                    out.push_str(&format!(
                        "wrote {} ({} devices of kind {})\n",
                        path.display(),
                        spec.devices.len(),
                        spec.kind
                    ));
                }
            }
            Ok((out, 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::topo::tests::dgx;

    #[test]
    fn generate_then_list() {
        let (_f, source) = dgx();
        let dir = tempfile::tempdir().unwrap();
        let gen_args = CdiArgs {
            command: CdiCommand::Generate(GenerateArgs {
                source,
                dir: Some(dir.path().to_path_buf()),
                stdout: false,
                gpu_kind: "nvidia.com/gpu".into(),
                hca_kind: "berth.io/hca".into(),
            }),
        };
        let (text, code) = output(&gen_args, &Config::default()).unwrap();
        assert_eq!(code, 0);
        assert_eq!(
            text,
            format!(
                "wrote {0}/berth-gpu.json (17 devices of kind nvidia.com/gpu)\nwrote {0}/berth-hca.json (13 devices of kind berth.io/hca)\n",
                dir.path().display()
            )
        );
        let mut config = Config::default();
        config.topology.cdi_dirs = vec![dir.path().to_path_buf()];
        let (list, _) = output(
            &CdiArgs {
                command: CdiCommand::List(ListArgs { json: false }),
            },
            &config,
        )
        .unwrap();
        assert_eq!(list.lines().count(), 30);
        assert!(list.contains(&format!(
            "nvidia.com/gpu=7  {}/berth-gpu.json",
            dir.path().display()
        )));
        assert!(list.contains("berth.io/hca=mlx5_11  "));
    }

    #[test]
    fn bad_kinds_are_refused() {
        let args = CdiArgs {
            command: CdiCommand::Generate(GenerateArgs {
                source: Source::default(),
                dir: None,
                stdout: true,
                gpu_kind: "gpu".into(),
                hca_kind: "berth.io/hca".into(),
            }),
        };
        let err = output(&args, &Config::default()).unwrap_err();
        assert_eq!(err.message, "CDI kind 'gpu': use vendor.com/class");
    }
}
