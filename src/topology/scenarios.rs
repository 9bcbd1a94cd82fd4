//! Discovery, distances, pairing and per-rank plans on the fixture layouts.

use super::fixture::{self, Fixture};
use super::gpu::Recorded;
use super::job::{self, Job};
use super::node::{self, NicPolicy, Node};
use super::plan::{self, PlanOptions};

fn node_of(f: &Fixture, rec: Recorded, policy: &NicPolicy) -> Node {
    node::discover(&f.host(), &rec, policy).unwrap()
}

fn job(pairs: &[(&str, &str)]) -> Job {
    let map: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    job::from_env(&move |k: &str| map.get(k).cloned()).unwrap()
}

#[test]
fn debug_print() {
    let (f, snap) = fixture::dgx_h100();
    let n = node_of(&f, Recorded::new(snap), &NicPolicy::default());
    println!("{}", super::render::topology(&n));
    for env in [
        vec![
            ("SLURM_JOB_ID", "1"),
            ("SLURM_JOB_GPUS", "0,1,2,3,4,5,6,7"),
            ("SLURM_NTASKS_PER_NODE", "8"),
        ],
        vec![
            ("SLURM_JOB_ID", "1"),
            ("SLURM_JOB_GPUS", "0,1,2,3,4,5,6,7"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ],
        vec![
            ("SLURM_JOB_ID", "1"),
            ("SLURM_JOB_GPUS", "2,5"),
            ("SLURM_STEP_TASKS_PER_NODE", "2"),
        ],
    ] {
        let p = plan::plan(&n, &job(&env), &PlanOptions::default()).unwrap();
        println!("{}", super::render::plan(&p));
    }
    let (f, snap) = fixture::pix_box();
    let n = node_of(&f, Recorded::new(snap), &NicPolicy::default());
    println!("{}", super::render::topology(&n));
    let f = fixture::pcie_box();
    let n = node_of(
        &f,
        Recorded::no_driver(),
        &NicPolicy {
            compute: vec![],
            exclude: vec!["eno*".into()],
        },
    );
    println!("{}", super::render::topology(&n));
    let f = fixture::cpu_node();
    let n = node_of(&f, Recorded::no_driver(), &NicPolicy::default());
    println!("{}", super::render::topology(&n));
    let p = plan::plan(
        &n,
        &job(&[("SLURM_JOB_ID", "1"), ("SLURM_NTASKS_PER_NODE", "4")]),
        &PlanOptions::default(),
    )
    .unwrap();
    println!("{}", super::render::plan(&p));
}
