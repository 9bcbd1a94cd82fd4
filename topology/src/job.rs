//! What a Slurm job step asks of this node, from its environment: the GPUs it was given
//! (SLURM_STEP_GPUS, SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES), how many tasks run here
//! (SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE) and which one this
//! process is (SLURM_LOCALID).

use serde::Serialize;

use super::{Bdf, TopologyError};

/// One GPU as a job names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuId {
    /// NVML index (what Slurm's SLURM_JOB_GPUS and an unconstrained CUDA_VISIBLE_DEVICES hold).
    Index(u32),
    /// `GPU-...`.
    Uuid(String),
    Bus(Bdf),
}

impl std::fmt::Display for GpuId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuId::Index(i) => write!(f, "{i}"),
            GpuId::Uuid(u) => f.write_str(u),
            GpuId::Bus(b) => write!(f, "{b}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Job {
    /// The GPUs the step may use; `None`: every GPU of the node (not under Slurm).
    pub gpus: Option<Vec<GpuId>>,
    /// The variable `gpus` came from.
    pub gpus_from: Option<String>,
    /// Tasks of the step on this node.
    pub tasks: u32,
    pub tasks_from: Option<String>,
    /// This task's rank on the node.
    pub local_id: Option<u32>,
    pub in_slurm: bool,
}

fn job_err(var: &str, value: &str, why: impl Into<String>) -> TopologyError {
    TopologyError::Job {
        var: var.to_string(),
        value: value.to_string(),
        why: why.into(),
    }
}

/// Parses a GPU list: comma-separated indices (ranges allowed), UUIDs or PCI addresses.
pub fn parse_gpus(var: &str, value: &str) -> Result<Vec<GpuId>, TopologyError> {
    let mut out = Vec::new();
    let value_t = value.trim();
    // Slurm's marker for "GPUs allocated but no device files", and an empty list: none.
    if value_t.is_empty() || value_t == "NoDevFiles" {
        return Ok(out);
    }
    for part in value_t.split(',') {
        let part = part.trim();
        if part.starts_with("GPU-") || part.starts_with("MIG-") {
            out.push(GpuId::Uuid(part.to_string()));
        } else if part.contains(':') {
            out.push(GpuId::Bus(part.parse().map_err(|e: TopologyError| {
                job_err(var, value, e.to_string())
            })?));
        } else if let Some((a, b)) = part.split_once('-') {
            let (a, b) = (a.parse::<u32>(), b.parse::<u32>());
            match (a, b) {
                (Ok(a), Ok(b)) if a <= b && b - a < 4096 => out.extend((a..=b).map(GpuId::Index)),
                _ => {
                    return Err(job_err(
                        var,
                        value,
                        format!("'{part}' is not a GPU index range such as 0-3"),
                    ));
                }
            }
        } else {
            out.push(GpuId::Index(part.parse().map_err(|_| {
                job_err(
                    var,
                    value,
                    format!("'{part}' is not a GPU index, GPU-UUID or PCI address"),
                )
            })?));
        }
    }
    Ok(out)
}

/// Parses Slurm's compressed tasks-per-node list (`4(x2),2`) and returns entry `node`.
pub fn tasks_on_node(var: &str, value: &str, node: usize) -> Result<u32, TopologyError> {
    let mut counts: Vec<u32> = Vec::new();
    for part in value.trim().split(',') {
        let part = part.trim();
        let bad = || job_err(var, value, format!("'{part}' is not N or N(xM)"));
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (
                n,
                rest.strip_suffix(')')
                    .and_then(|t| t.parse::<usize>().ok())
                    .filter(|t| *t > 0 && *t <= 1 << 20)
                    .ok_or_else(bad)?,
            ),
            None => (part, 1),
        };
        let n = n.parse::<u32>().map_err(|_| bad())?;
        counts.extend(std::iter::repeat_n(n, times));
        if counts.len() > node {
            break;
        }
    }
    counts.get(node).copied().ok_or_else(|| {
        job_err(
            var,
            value,
            format!("no entry for node {node} (SLURM_NODEID)"),
        )
    })
}

/// Reads the job from an environment lookup (`std::env::var` in production).
pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Job, TopologyError> {
    let in_slurm = get("SLURM_JOB_ID").is_some_and(|v| !v.is_empty());
    let mut gpus = None;
    let mut gpus_from = None;
    for var in ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"] {
        if let Some(value) = get(var) {
            gpus = Some(parse_gpus(var, &value)?);
            gpus_from = Some(var.to_string());
            break;
        }
    }
    // Under Slurm, no GPU variable means the step has no GPU.
    if gpus.is_none() && in_slurm {
        gpus = Some(Vec::new());
    }
    let node_id = match get("SLURM_NODEID") {
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map_err(|_| job_err("SLURM_NODEID", &v, "not a number"))?,
        None => 0,
    };
    let mut tasks = None;
    let mut tasks_from = None;
    for var in [
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
    ] {
        if let Some(value) = get(var).filter(|v| !v.trim().is_empty()) {
            let n = if var == "SLURM_NTASKS_PER_NODE" {
                value
                    .trim()
                    .parse::<u32>()
                    .map_err(|_| job_err(var, &value, "not a number"))?
            } else {
                tasks_on_node(var, &value, node_id)?
            };
            tasks = Some(n);
            tasks_from = Some(var.to_string());
            break;
        }
    }
    let local_id = match get("SLURM_LOCALID") {
        Some(v) => Some(
            v.trim()
                .parse::<u32>()
                .map_err(|_| job_err("SLURM_LOCALID", &v, "not a number"))?,
        ),
        None => None,
    };
    let tasks = match tasks {
        Some(0) => {
            return Err(job_err(
                tasks_from.as_deref().unwrap_or("tasks"),
                "0",
                "a step needs at least one task",
            ));
        }
        Some(n) => n,
        // Outside Slurm: one rank per listed GPU, or one rank.
        None if !in_slurm => gpus
            .as_ref()
            .map(|g| u32::try_from(g.len().max(1)).unwrap_or(u32::MAX))
            .unwrap_or(0),
        None => 1,
    };
    Ok(Job {
        gpus,
        gpus_from,
        tasks,
        tasks_from,
        local_id,
        in_slurm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn step_gpus_win_over_job_gpus_and_cuda() {
        let job = from_env(&env(&[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_JOB_GPUS", "0,1,2,3"),
            ("SLURM_STEP_GPUS", "2,5"),
            ("CUDA_VISIBLE_DEVICES", "0,1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2),2"),
            ("SLURM_NODEID", "2"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap();
        assert_eq!(job.gpus, Some(vec![GpuId::Index(2), GpuId::Index(5)]));
        assert_eq!(job.gpus_from.as_deref(), Some("SLURM_STEP_GPUS"));
        assert_eq!(job.tasks, 2);
        assert_eq!(job.local_id, Some(1));
    }

    #[test]
    fn gpu_lists_take_indices_ranges_uuids_and_addresses() {
        assert_eq!(
            parse_gpus("X", "0-2,GPU-abc,0000:1b:00.0").unwrap(),
            vec![
                GpuId::Index(0),
                GpuId::Index(1),
                GpuId::Index(2),
                GpuId::Uuid("GPU-abc".into()),
                GpuId::Bus("0000:1b:00.0".parse().unwrap())
            ]
        );
        assert!(parse_gpus("X", "NoDevFiles").unwrap().is_empty());
        let err = parse_gpus("SLURM_JOB_GPUS", "0,x").unwrap_err().to_string();
        assert_eq!(
            err,
            "SLURM_JOB_GPUS=0,x: 'x' is not a GPU index, GPU-UUID or PCI address"
        );
    }

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(tasks_on_node("V", "4(x2),2", 0).unwrap(), 4);
        assert_eq!(tasks_on_node("V", "4(x2),2", 1).unwrap(), 4);
        assert_eq!(tasks_on_node("V", "4(x2),2", 2).unwrap(), 2);
        tasks_on_node("V", "4(x2),2", 3).unwrap_err();
        tasks_on_node("V", "4(x", 0).unwrap_err();
        let job = from_env(&env(&[
            ("SLURM_JOB_ID", "1"),
            ("SLURM_NTASKS_PER_NODE", "8"),
        ]))
        .unwrap();
        assert_eq!(job.tasks, 8);
        assert_eq!(
            job.gpus,
            Some(vec![]),
            "a Slurm step without GPU variables has none"
        );
    }

    #[test]
    fn outside_slurm_every_gpu_and_one_rank_per_listed_gpu() {
        let job = from_env(&env(&[])).unwrap();
        assert_eq!(job.gpus, None);
        assert!(!job.in_slurm);
        let job = from_env(&env(&[("CUDA_VISIBLE_DEVICES", "1,3")])).unwrap();
        assert_eq!(job.tasks, 2);
        from_env(&env(&[("SLURM_LOCALID", "x")])).unwrap_err();
    }
}
