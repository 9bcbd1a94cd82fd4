//! Discovery, distances, pairing and per-rank plans on the fixture layouts: a DGX H100-like
//! node, a PCIe box whose NICs are PIX with their GPUs, a 4-GPU PCIe box with its NICs on one
//! socket, and a CPU node. The plans asserted here are the ones documented in the issue note.

use super::distance::Link;
use super::fixture::{self, Fixture};
use super::gpu::Recorded;
use super::job::{self, Job};
use super::node::{self, NicPolicy, NicRole, Node};
use super::plan::{self, NodePlan, Numbering, PlanOptions};
use super::{CpuSet, render};

fn discover(f: &Fixture, rec: Recorded, policy: &NicPolicy) -> Node {
    node::discover(&f.host(), &rec, policy).unwrap()
}

fn dgx() -> (Fixture, Node) {
    fixture::dgx_h100_node()
}

fn pcie_policy() -> NicPolicy {
    NicPolicy {
        compute: vec![],
        exclude: vec!["eno*".into()],
    }
}

fn job(pairs: &[(&str, &str)]) -> Job {
    let map: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    job::from_env(&move |k: &str| map.get(k).cloned()).unwrap()
}

fn plan_for(n: &Node, env: &[(&str, &str)], opts: &PlanOptions) -> NodePlan {
    plan::plan(n, &job(env), opts).unwrap()
}

/// One line per rank: GPUs, NICs:ports, CPUs, memory nodes, then the variables.
fn summary(p: &NodePlan) -> Vec<String> {
    p.ranks
        .iter()
        .map(|r| {
            let gpus: Vec<String> = r.gpus.iter().map(|g| g.index.to_string()).collect();
            let nics: Vec<String> = r
                .nics
                .iter()
                .map(|n| {
                    format!(
                        "{}{}",
                        n.name,
                        n.link.map(|l| format!("({l})")).unwrap_or_default()
                    )
                })
                .collect();
            let env: Vec<String> = r
                .env
                .iter()
                .filter(|(k, _)| k != "CUDA_DEVICE_ORDER" && k != "NCCL_IB_HCA")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            format!(
                "rank {}: gpu {} nic {} cpus {} mem {} | {}",
                r.rank,
                gpus.join(","),
                nics.join(","),
                r.cpus,
                r.mems,
                env.join(" ")
            )
        })
        .collect()
}

fn same_for_all(p: &NodePlan, key: &str) -> Option<String> {
    let first = p.ranks[0].env_value(key).map(str::to_string);
    assert!(
        p.ranks
            .iter()
            .all(|r| r.env_value(key).map(str::to_string) == first),
        "{key} differs between ranks"
    );
    first
}

const DGX_ALL: [(&str, &str); 3] = [
    ("SLURM_JOB_ID", "42"),
    ("SLURM_JOB_GPUS", "0,1,2,3,4,5,6,7"),
    ("SLURM_STEP_TASKS_PER_NODE", "8"),
];

#[test]
fn dgx_discovery() {
    let (_f, n) = dgx();
    assert_eq!(
        n.gpus.len(),
        8,
        "NVSwitches and the Ethernet NIC are not GPUs"
    );
    let buses: Vec<String> = n.gpus.iter().map(|g| g.bdf.to_string()).collect();
    assert_eq!(
        buses,
        [
            "0000:1b:00.0",
            "0000:43:00.0",
            "0000:52:00.0",
            "0000:61:00.0",
            "0000:9d:00.0",
            "0000:c3:00.0",
            "0000:d1:00.0",
            "0000:df:00.0"
        ]
    );
    let g0 = &n.gpus[0];
    assert_eq!(g0.minor, Some(0));
    assert_eq!(g0.uuid.as_deref(), Some(fixture::uuid(0).as_str()));
    assert_eq!(g0.model.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(g0.numa, Some(0));
    assert_eq!(n.gpus[4].numa, Some(1));
    assert_eq!(g0.pci.current_link.width, Some(16));
    assert_eq!(g0.pci.max_link.speed_gts, Some(32.0));
    // The GPU sits two switches below the root port: rp, U1, D1, U2, D2.
    assert_eq!(g0.pci.root, "pci0000:15");
    assert_eq!(g0.pci.chain.len(), 5);
    assert_eq!(n.cpus.online.len(), 224);
    assert_eq!(n.cpus.cores.len(), 112);
    assert_eq!(
        n.cpus.cores[0].threads,
        CpuSet::parse("0,112").unwrap(),
        "hyperthread siblings share a core"
    );
    assert_eq!(n.cpus.numa[1].cpus.to_string(), "56-111,168-223");
    assert_eq!(n.cpus.distance(0, 1), 21);
    let roles: Vec<String> = n
        .nics
        .iter()
        .map(|x| format!("{}={:?}", x.name, x.role))
        .collect();
    assert_eq!(
        roles,
        [
            "mlx5_0=Compute",
            "mlx5_1=Storage",
            "mlx5_2=Storage",
            "mlx5_3=Compute",
            "mlx5_4=Compute",
            "mlx5_5=Compute",
            "mlx5_6=Compute",
            "mlx5_7=Storage",
            "mlx5_8=Storage",
            "mlx5_9=Compute",
            "mlx5_10=Compute",
            "mlx5_11=Compute"
        ]
    );
    let m0 = n.nic("mlx5_0").unwrap();
    assert_eq!(m0.device.ports[0].state, "ACTIVE");
    assert_eq!(m0.device.ports[0].rate, "400 Gb/sec (4X NDR)");
    assert_eq!(m0.device.ports[0].link_layer, "InfiniBand");
    assert_eq!(m0.device.ports[0].netdev.as_deref(), Some("ibp24s0"));
    assert_eq!(
        m0.device
            .uverbs
            .as_ref()
            .map(|(u, d)| (u.as_str(), d.major, d.minor)),
        Some(("uverbs0", 231, 192))
    );
    assert_eq!(
        n.nic("mlx5_1").unwrap().device.ports[0].link_layer,
        "Ethernet"
    );
    n.driver.nvml.as_ref().unwrap();
    assert_eq!(n.driver.kernel_module.as_deref(), Some("550.54.15"));
    assert!(n.warnings.is_empty(), "{:?}", n.warnings);
}

#[test]
fn dgx_distances_match_nvidia_smi() {
    let (_f, n) = dgx();
    let g = |i: u32| n.gpu(i).unwrap();
    let nic = |name: &str| n.nic(name).unwrap();
    assert_eq!(n.gpu_gpu(g(0), g(7)), Link::Nv(18), "NVSwitch fabric");
    assert_eq!(n.gpu_gpu(g(0), g(0)), Link::X);
    assert_eq!(n.gpu_nic(g(0), nic("mlx5_0")), Some(Link::Pxb));
    assert_eq!(n.gpu_nic(g(0), nic("mlx5_3")), Some(Link::Node));
    assert_eq!(n.gpu_nic(g(0), nic("mlx5_1")), Some(Link::Node));
    assert_eq!(n.gpu_nic(g(0), nic("mlx5_11")), Some(Link::Sys));
    assert_eq!(n.gpu_nic(g(7), nic("mlx5_11")), Some(Link::Pxb));
    assert_eq!(n.nic_nic(nic("mlx5_1"), nic("mlx5_2")), Some(Link::Phb));
    // Without NVML the GPUs are only PCIe neighbours.
    let (f, _) = fixture::dgx_h100();
    let bare = discover(&f, Recorded::no_driver(), &NicPolicy::default());
    assert_eq!(
        bare.gpu_gpu(bare.gpu(0).unwrap(), bare.gpu(1).unwrap()),
        Link::Node
    );
    assert_eq!(
        bare.gpu_gpu(bare.gpu(0).unwrap(), bare.gpu(4).unwrap()),
        Link::Sys
    );
    let text = render::topology(&n);
    assert!(
        text.contains("GPU0   X     NV18  NV18"),
        "matrix row of GPU0:\n{text}"
    );
    assert!(text.contains("-> mlx5_11 (PXB)  -> NUMA 1 (CPUs 56-111,168-223)"));
}

#[test]
fn dgx_pairs_each_gpu_with_the_nic_on_its_switch() {
    let (_f, n) = dgx();
    let pairs: Vec<String> = plan::pairing(&n)
        .iter()
        .map(|p| format!("{}:{}", p.bdf.bus, p.nic.clone().unwrap()))
        .collect();
    // GPU 1b <-> NIC 18 ... GPU df <-> NIC dc.
    let want: Vec<String> = [
        (0x1b, "mlx5_0"),
        (0x43, "mlx5_3"),
        (0x52, "mlx5_4"),
        (0x61, "mlx5_5"),
        (0x9d, "mlx5_6"),
        (0xc3, "mlx5_9"),
        (0xd1, "mlx5_10"),
        (0xdf, "mlx5_11"),
    ]
    .iter()
    .map(|(b, m)| format!("{b}:{m}"))
    .collect();
    assert_eq!(pairs, want);
    for p in plan::pairing(&n) {
        let nic = n.nic(p.nic.as_deref().unwrap()).unwrap();
        assert_eq!(
            nic.bdf.unwrap().bus + 3,
            p.bdf.bus,
            "the NIC is three buses above its GPU"
        );
    }
}

#[test]
fn dgx_eight_ranks_on_eight_gpus() {
    let (_f, n) = dgx();
    let p = plan_for(&n, &DGX_ALL, &PlanOptions::default());
    assert_eq!(
        summary(&p),
        [
            "rank 0: gpu 0 nic mlx5_0(PXB) cpus 0-13,112-125 mem 0 | CUDA_VISIBLE_DEVICES=0 UCX_NET_DEVICES=mlx5_0:1",
            "rank 1: gpu 1 nic mlx5_3(PXB) cpus 14-27,126-139 mem 0 | CUDA_VISIBLE_DEVICES=1 UCX_NET_DEVICES=mlx5_3:1",
            "rank 2: gpu 2 nic mlx5_4(PXB) cpus 28-41,140-153 mem 0 | CUDA_VISIBLE_DEVICES=2 UCX_NET_DEVICES=mlx5_4:1",
            "rank 3: gpu 3 nic mlx5_5(PXB) cpus 42-55,154-167 mem 0 | CUDA_VISIBLE_DEVICES=3 UCX_NET_DEVICES=mlx5_5:1",
            "rank 4: gpu 4 nic mlx5_6(PXB) cpus 56-69,168-181 mem 1 | CUDA_VISIBLE_DEVICES=4 UCX_NET_DEVICES=mlx5_6:1",
            "rank 5: gpu 5 nic mlx5_9(PXB) cpus 70-83,182-195 mem 1 | CUDA_VISIBLE_DEVICES=5 UCX_NET_DEVICES=mlx5_9:1",
            "rank 6: gpu 6 nic mlx5_10(PXB) cpus 84-97,196-209 mem 1 | CUDA_VISIBLE_DEVICES=6 UCX_NET_DEVICES=mlx5_10:1",
            "rank 7: gpu 7 nic mlx5_11(PXB) cpus 98-111,210-223 mem 1 | CUDA_VISIBLE_DEVICES=7 UCX_NET_DEVICES=mlx5_11:1",
        ]
    );
    assert_eq!(
        same_for_all(&p, "NCCL_IB_HCA").as_deref(),
        Some("=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"),
        "exact names, storage NICs left out"
    );
    assert_eq!(
        same_for_all(&p, "CUDA_DEVICE_ORDER").as_deref(),
        Some("PCI_BUS_ID")
    );
    assert!(p.warnings.is_empty());
    // No two ranks share a CPU, and together they use the whole node.
    let mut all = CpuSet::new();
    for r in &p.ranks {
        assert!(all.intersection(&r.cpus).is_empty());
        all = all.union(&r.cpus);
    }
    assert_eq!(all, n.cpus.online);
}

#[test]
fn dgx_four_ranks_with_two_gpus_each() {
    let (_f, n) = dgx();
    let p = plan_for(
        &n,
        &[
            ("SLURM_JOB_ID", "42"),
            ("SLURM_STEP_GPUS", "0-7"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ],
        &PlanOptions::default(),
    );
    assert_eq!(
        summary(&p),
        [
            "rank 0: gpu 0,1 nic mlx5_0(PXB),mlx5_3(PXB) cpus 0-27,112-139 mem 0 | CUDA_VISIBLE_DEVICES=0,1 UCX_NET_DEVICES=mlx5_0:1,mlx5_3:1",
            "rank 1: gpu 2,3 nic mlx5_4(PXB),mlx5_5(PXB) cpus 28-55,140-167 mem 0 | CUDA_VISIBLE_DEVICES=2,3 UCX_NET_DEVICES=mlx5_4:1,mlx5_5:1",
            "rank 2: gpu 4,5 nic mlx5_6(PXB),mlx5_9(PXB) cpus 56-83,168-195 mem 1 | CUDA_VISIBLE_DEVICES=4,5 UCX_NET_DEVICES=mlx5_6:1,mlx5_9:1",
            "rank 3: gpu 6,7 nic mlx5_10(PXB),mlx5_11(PXB) cpus 84-111,196-223 mem 1 | CUDA_VISIBLE_DEVICES=6,7 UCX_NET_DEVICES=mlx5_10:1,mlx5_11:1",
        ]
    );
}

#[test]
fn dgx_partial_allocation_of_gpus_2_and_5() {
    let (_f, n) = dgx();
    let env = [
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_GPUS", "2,5"),
        ("SLURM_STEP_TASKS_PER_NODE", "2"),
        ("SLURM_LOCALID", "1"),
    ];
    let p = plan_for(&n, &env, &PlanOptions::default());
    assert_eq!(
        summary(&p),
        [
            "rank 0: gpu 2 nic mlx5_4(PXB) cpus 0-55,112-167 mem 0 | CUDA_VISIBLE_DEVICES=0 UCX_NET_DEVICES=mlx5_4:1",
            "rank 1: gpu 5 nic mlx5_9(PXB) cpus 56-111,168-223 mem 1 | CUDA_VISIBLE_DEVICES=1 UCX_NET_DEVICES=mlx5_9:1",
        ]
    );
    assert_eq!(
        same_for_all(&p, "NCCL_IB_HCA").as_deref(),
        Some("=mlx5_4,mlx5_9")
    );
    // On bare metal without a device cgroup, CUDA numbers the GPUs as the node does.
    let host = plan_for(
        &n,
        &env,
        &PlanOptions {
            numbering: Numbering::Host,
            ..Default::default()
        },
    );
    assert_eq!(host.ranks[0].env_value("CUDA_VISIBLE_DEVICES"), Some("2"));
    assert_eq!(host.ranks[1].env_value("CUDA_VISIBLE_DEVICES"), Some("5"));
    // A job given half of socket 0 only: GPU 5's rank shares it, and the plan says so.
    let narrow = plan_for(
        &n,
        &env,
        &PlanOptions {
            allowed_cpus: Some(CpuSet::parse("0-27,112-139").unwrap()),
            ..Default::default()
        },
    );
    assert_eq!(
        summary(&narrow),
        [
            "rank 0: gpu 2 nic mlx5_4(PXB) cpus 0-13,112-125 mem 0 | CUDA_VISIBLE_DEVICES=0 UCX_NET_DEVICES=mlx5_4:1",
            "rank 1: gpu 5 nic mlx5_9(PXB) cpus 14-27,126-139 mem 0 | CUDA_VISIBLE_DEVICES=1 UCX_NET_DEVICES=mlx5_9:1",
        ]
    );
    assert_eq!(
        narrow.warnings,
        ["rank 1: the step has no CPU on NUMA node 1; using node 0"]
    );
}

#[test]
fn gpus_may_be_named_by_uuid_and_unknown_ones_are_refused() {
    let (_f, n) = dgx();
    let uuid = fixture::uuid(6);
    let p = plan_for(
        &n,
        &[("CUDA_VISIBLE_DEVICES", &format!("{uuid},0000:1b:00.0"))],
        &PlanOptions::default(),
    );
    let gpus: Vec<u32> = p.gpus.iter().map(|g| g.index).collect();
    assert_eq!(gpus, [0, 6], "in bus order");
    assert_eq!(p.ranks.len(), 2, "outside Slurm: one rank per listed GPU");
    let err = plan::plan(
        &n,
        &job(&[("SLURM_JOB_ID", "1"), ("SLURM_JOB_GPUS", "3,9")]),
        &PlanOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "SLURM_JOB_GPUS=3,9: GPU 9 is not on this node (it has GPUs 0-7); check the job's GPU allocation and gres.conf"
    );
}

#[test]
fn pix_box_shares_nics_and_splits_cores_without_smt() {
    let (f, snap) = fixture::pix_box();
    let n = discover(&f, Recorded::new(snap), &NicPolicy::default());
    let g = |i: u32| n.gpu(i).unwrap();
    assert_eq!(n.gpu_nic(g(0), n.nic("mlx5_0").unwrap()), Some(Link::Pix));
    assert_eq!(n.gpu_nic(g(1), n.nic("mlx5_0").unwrap()), Some(Link::Pix));
    assert_eq!(n.gpu_gpu(g(0), g(1)), Link::Nv(12), "NVLink bridge");
    assert_eq!(n.gpu_gpu(g(0), g(2)), Link::Sys);
    assert!(n.nics.iter().all(|x| x.role == NicRole::Compute));
    let p = plan_for(
        &n,
        &[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_JOB_GPUS", "0,1,2,3"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ],
        &PlanOptions::default(),
    );
    assert_eq!(
        summary(&p),
        [
            "rank 0: gpu 0 nic mlx5_0(PIX) cpus 0-7 mem 0 | CUDA_VISIBLE_DEVICES=0 UCX_NET_DEVICES=mlx5_0:1",
            "rank 1: gpu 1 nic mlx5_0(PIX) cpus 8-15 mem 0 | CUDA_VISIBLE_DEVICES=1 UCX_NET_DEVICES=mlx5_0:1",
            "rank 2: gpu 2 nic mlx5_1(PIX) cpus 16-23 mem 1 | CUDA_VISIBLE_DEVICES=2 UCX_NET_DEVICES=mlx5_1:1",
            "rank 3: gpu 3 nic mlx5_1(PIX) cpus 24-31 mem 1 | CUDA_VISIBLE_DEVICES=3 UCX_NET_DEVICES=mlx5_1:1",
        ]
    );
    assert_eq!(
        same_for_all(&p, "NCCL_IB_HCA").as_deref(),
        Some("=mlx5_0,mlx5_1")
    );
    // More ranks than GPUs: two ranks per GPU, each with its own cores.
    let p = plan_for(
        &n,
        &[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_JOB_GPUS", "0,1,2,3"),
            ("SLURM_NTASKS_PER_NODE", "8"),
        ],
        &PlanOptions::default(),
    );
    let short: Vec<String> = p
        .ranks
        .iter()
        .map(|r| {
            format!(
                "{}:{}",
                r.env_value("CUDA_VISIBLE_DEVICES").unwrap(),
                r.cpus
            )
        })
        .collect();
    assert_eq!(
        short,
        [
            "0:0-3", "0:4-7", "1:8-11", "1:12-15", "2:16-19", "2:20-23", "3:24-27", "3:28-31"
        ]
    );
}

#[test]
fn pcie_box_with_nics_on_one_socket() {
    let f = fixture::pcie_box();
    let n = discover(&f, Recorded::no_driver(), &pcie_policy());
    // Minors come from the driver, out of bus order; indices follow the bus.
    let minors: Vec<Option<u32>> = n.gpus.iter().map(|g| g.minor).collect();
    assert_eq!(minors, [Some(2), Some(3), Some(0), Some(1)]);
    assert_eq!(n.gpus[0].uuid.as_deref(), Some(fixture::uuid(0).as_str()));
    n.driver.nvml.as_ref().unwrap_err();
    assert_eq!(n.cpus.cores[1].threads, CpuSet::parse("2-3").unwrap());
    let roles: Vec<String> = n
        .nics
        .iter()
        .map(|x| format!("{}={:?}: {}", x.name, x.role, x.role_reason))
        .collect();
    assert_eq!(
        roles,
        [
            "mlx5_0=Compute: no NIC shares a PCIe switch with a GPU",
            "mlx5_2=Excluded: matches exclude_nics 'eno*'",
            "mlx5_1=Compute: no NIC shares a PCIe switch with a GPU",
        ]
    );
    let g = |i: u32| n.gpu(i).unwrap();
    assert_eq!(n.gpu_nic(g(0), n.nic("mlx5_0").unwrap()), Some(Link::Phb));
    assert_eq!(n.gpu_nic(g(0), n.nic("mlx5_1").unwrap()), Some(Link::Node));
    assert_eq!(n.gpu_nic(g(2), n.nic("mlx5_0").unwrap()), Some(Link::Sys));
    let p = plan_for(
        &n,
        &[
            ("SLURM_JOB_ID", "9"),
            ("SLURM_JOB_GPUS", "0,1,2,3"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_NODEID", "1"),
        ],
        &PlanOptions::default(),
    );
    assert_eq!(
        summary(&p),
        [
            "rank 0: gpu 0 nic mlx5_0(PHB) cpus 0-7 mem 0 | CUDA_VISIBLE_DEVICES=0 UCX_NET_DEVICES=mlx5_0:1",
            "rank 1: gpu 1 nic mlx5_1(PHB) cpus 8-15 mem 0 | CUDA_VISIBLE_DEVICES=1 UCX_NET_DEVICES=mlx5_1:1",
            "rank 2: gpu 2 nic mlx5_0(SYS) cpus 16-23 mem 1 | CUDA_VISIBLE_DEVICES=2 UCX_NET_DEVICES=mlx5_0:1",
            "rank 3: gpu 3 nic mlx5_1(SYS) cpus 24-31 mem 1 | CUDA_VISIBLE_DEVICES=3 UCX_NET_DEVICES=mlx5_1:1",
        ]
    );
    assert_eq!(
        same_for_all(&p, "NCCL_IB_HCA").as_deref(),
        Some("=mlx5_0,mlx5_1")
    );
    // Configured compute NICs win over detection.
    let n = discover(
        &f,
        Recorded::no_driver(),
        &NicPolicy {
            compute: vec!["ibp66s0".into()],
            exclude: vec![],
        },
    );
    let compute: Vec<&str> = n.compute_nics().map(|x| x.name.as_str()).collect();
    assert_eq!(compute, ["mlx5_1"]);
}

/// Only GPUs 0 and 1 share a switch with a NIC; GPUs 2 and 3 and mlx5_2 hang off root ports of
/// socket 1. mlx5_2 is those GPUs' NIC, not storage: with `compute_nics` empty it must be paired
/// with them and be in NCCL_IB_HCA, whether or not the admin excluded the real storage NIC.
#[test]
fn mixed_box_gives_switchless_gpus_their_socket_nic() {
    let f = fixture::mixed_box();
    let four = [
        ("SLURM_JOB_ID", "11"),
        ("SLURM_JOB_GPUS", "0,1,2,3"),
        ("SLURM_NTASKS_PER_NODE", "4"),
    ];
    let want = [
        "rank 0: gpu 0 nic mlx5_0(PIX) cpus 0-7,32-39 mem 0 | CUDA_VISIBLE_DEVICES=0 UCX_NET_DEVICES=mlx5_0:1",
        "rank 1: gpu 1 nic mlx5_0(PIX) cpus 8-15,40-47 mem 0 | CUDA_VISIBLE_DEVICES=1 UCX_NET_DEVICES=mlx5_0:1",
        "rank 2: gpu 2 nic mlx5_2(PHB) cpus 16-23,48-55 mem 1 | CUDA_VISIBLE_DEVICES=2 UCX_NET_DEVICES=mlx5_2:1",
        "rank 3: gpu 3 nic mlx5_2(PHB) cpus 24-31,56-63 mem 1 | CUDA_VISIBLE_DEVICES=3 UCX_NET_DEVICES=mlx5_2:1",
    ];
    let roles = |n: &Node| -> Vec<String> {
        n.nics
            .iter()
            .map(|x| format!("{}={:?}: {}", x.name, x.role, x.role_reason))
            .collect()
    };
    let pairs = |n: &Node| -> Vec<String> {
        plan::pairing(n)
            .iter()
            .map(|p| format!("{}:{}({})", p.gpu, p.nic.clone().unwrap(), p.link.unwrap()))
            .collect()
    };

    // The admin named the storage NIC (by its netdev).
    let excluded = NicPolicy {
        compute: vec![],
        exclude: vec!["ens3*".into()],
    };
    let n = discover(&f, Recorded::no_driver(), &excluded);
    assert_eq!(
        roles(&n),
        [
            "mlx5_0=Compute: PIX to GPU 0",
            "mlx5_1=Excluded: matches exclude_nics 'ens3*'",
            "mlx5_2=Compute: GPU 2 has no NIC on its PCIe switch",
        ]
    );
    assert_eq!(
        pairs(&n),
        [
            "0:mlx5_0(PIX)",
            "1:mlx5_0(PIX)",
            "2:mlx5_2(PHB)",
            "3:mlx5_2(PHB)"
        ]
    );
    let p = plan_for(&n, &four, &PlanOptions::default());
    assert_eq!(summary(&p), want);
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    assert_eq!(p.hcas, ["mlx5_0", "mlx5_2"]);
    assert_eq!(
        same_for_all(&p, "NCCL_IB_HCA").as_deref(),
        Some("=mlx5_0,mlx5_2")
    );
    // A step on GPU 3 alone uses socket 1's NIC only.
    let p = plan_for(
        &n,
        &[
            ("SLURM_JOB_ID", "12"),
            ("SLURM_JOB_GPUS", "3"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ],
        &PlanOptions::default(),
    );
    assert_eq!(same_for_all(&p, "NCCL_IB_HCA").as_deref(), Some("=mlx5_2"));
    assert_eq!(p.ranks[0].nics[0].link, Some(Link::Phb));

    // Nothing configured: the storage NIC is not excluded, so it is a candidate too (GPUs 2 and
    // 3 lack a switch NIC), but every GPU has a closer one: it is in no rank and not in NCCL_IB_HCA.
    let n = discover(&f, Recorded::no_driver(), &NicPolicy::default());
    assert_eq!(
        roles(&n),
        [
            "mlx5_0=Compute: PIX to GPU 0",
            "mlx5_1=Compute: GPU 2 has no NIC on its PCIe switch",
            "mlx5_2=Compute: GPU 2 has no NIC on its PCIe switch",
        ]
    );
    assert_eq!(
        pairs(&n),
        [
            "0:mlx5_0(PIX)",
            "1:mlx5_0(PIX)",
            "2:mlx5_2(PHB)",
            "3:mlx5_2(PHB)"
        ]
    );
    let p = plan_for(&n, &four, &PlanOptions::default());
    assert_eq!(summary(&p), want);
    assert_eq!(
        same_for_all(&p, "NCCL_IB_HCA").as_deref(),
        Some("=mlx5_0,mlx5_2")
    );

    // Once every GPU has a NIC on its switch, root-port NICs are storage again (the DGX rule).
    let (_f, dgx) = dgx();
    let storage: Vec<&str> = dgx
        .nics
        .iter()
        .filter(|x| x.role == NicRole::Storage)
        .map(|x| x.name.as_str())
        .collect();
    assert_eq!(storage, ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"]);
}

#[test]
fn cpu_node_without_gpus() {
    let f = fixture::cpu_node();
    let n = discover(&f, Recorded::no_driver(), &NicPolicy::default());
    assert!(n.gpus.is_empty());
    assert_eq!(n.driver.kernel_module, None);
    let p = plan_for(
        &n,
        &[("SLURM_JOB_ID", "3"), ("SLURM_NTASKS_PER_NODE", "4")],
        &PlanOptions::default(),
    );
    assert_eq!(
        summary(&p),
        [
            "rank 0: gpu  nic mlx5_0 cpus 0-1,8-9 mem 0 | UCX_NET_DEVICES=mlx5_0:1",
            "rank 1: gpu  nic mlx5_0 cpus 2-3,10-11 mem 0 | UCX_NET_DEVICES=mlx5_0:1",
            "rank 2: gpu  nic mlx5_0 cpus 4-5,12-13 mem 1 | UCX_NET_DEVICES=mlx5_0:1",
            "rank 3: gpu  nic mlx5_0 cpus 6-7,14-15 mem 1 | UCX_NET_DEVICES=mlx5_0:1",
        ]
    );
    assert_eq!(same_for_all(&p, "NCCL_IB_HCA").as_deref(), Some("=mlx5_0"));
    assert!(
        p.ranks
            .iter()
            .all(|r| r.env_value("CUDA_VISIBLE_DEVICES").is_none()),
        "no CUDA variables on a node without GPUs"
    );
    let one = plan_for(&n, &[("SLURM_JOB_ID", "3")], &PlanOptions::default());
    assert_eq!(
        summary(&one),
        ["rank 0: gpu  nic mlx5_0 cpus 0-15 mem 0-1 | UCX_NET_DEVICES=mlx5_0:1"]
    );
    let text = render::topology(&n);
    assert!(!text.contains("GPU0"), "{text}");
    assert!(
        text.contains("NIC0  mlx5_0  0000:81:00.0  compute"),
        "{text}"
    );
    // A GPU node whose job got no GPU: the ranks see none.
    let (_f, dgx) = dgx();
    let p = plan_for(
        &dgx,
        &[("SLURM_JOB_ID", "3"), ("SLURM_NTASKS_PER_NODE", "2")],
        &PlanOptions::default(),
    );
    assert!(p.gpus.is_empty());
    assert_eq!(p.ranks[0].env_value("CUDA_VISIBLE_DEVICES"), Some(""));
    assert_eq!(p.ranks[0].cpus.to_string(), "0-55,112-167");
}

#[test]
fn nccl_topology_file_holds_the_pcie_tree() {
    let (_f, n) = dgx();
    let xml = super::nccl::topology_xml(&n);
    assert!(xml.starts_with("<system version=\"1\">\n  <cpu numaid=\"0\" affinity=\"00000000,000000ff,ffffffff,ffff0000,00000000,00ffffff,ffffffff\""), "{xml}");
    // GPU 0 under its second switch (upstream port 19:00.0), inside the first (16:00.0),
    // next to its NIC; storage NICs are not in it.
    let want = "    <pci busid=\"0000:16:00.0\" class=\"0x060400\"";
    let at = xml.find(want).expect("first-level switch");
    let rest = &xml[at..];
    let nic = rest
        .find("<pci busid=\"0000:18:00.0\" class=\"0x020700\"")
        .unwrap();
    let sw2 = rest.find("      <pci busid=\"0000:19:00.0\"").unwrap();
    let gpu = rest
        .find("        <pci busid=\"0000:1b:00.0\" class=\"0x030200\" vendor=\"0x10de\" device=\"0x2330\"")
        .unwrap();
    assert!(nic < sw2 && sw2 < gpu, "{rest}");
    assert!(xml.contains("link_speed=\"32.0 GT/s PCIe\" link_width=\"16\""));
    assert!(!xml.contains("0000:2a:00.0"), "storage NICs are not NCCL's");
    assert_eq!(xml.matches("<cpu ").count(), 2);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("topo.xml");
    super::nccl::write(&n, &path).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), xml);
}

#[test]
fn damaged_sysfs_is_survived_or_named() {
    let (f, snap) = fixture::dgx_h100();
    // A device unplugged mid-scan, and attributes that do not parse.
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:ee/0000:ee:00.0",
        f.root().join("sys/bus/pci/devices/0000:ee:00.0"),
    )
    .unwrap();
    let g0 = fixture::bdf("0000:1b:00.0");
    f.pci_attr(g0, "numa_node", "garbage");
    f.pci_attr(g0, "current_link_speed", "fast");
    f.pci_attr(g0, "local_cpulist", "zz");
    f.write("sys/class/infiniband/mlx5_0/ports/1/state", "weird\n");
    let n = discover(&f, Recorded::new(snap), &NicPolicy::default());
    assert_eq!(n.gpus.len(), 8);
    assert_eq!(n.gpus[0].pci.numa_node, None);
    assert_eq!(
        n.gpus[0].numa, None,
        "no NUMA node and no CPU list to infer it from"
    );
    assert_eq!(n.gpus[0].pci.current_link.speed_gts, None);
    assert_eq!(n.nic("mlx5_0").unwrap().device.ports[0].state, "weird");
    // A rank whose GPU has no known NUMA node shares every node, and the plan says so.
    let p = plan_for(&n, &DGX_ALL, &PlanOptions::default());
    assert_eq!(
        p.warnings,
        ["rank 0: the NUMA node of GPU 0 is unknown; the rank shares every node"]
    );
    f.write("sys/devices/system/cpu/online", "0-x\n");
    let err = node::discover(&f.host(), &Recorded::no_driver(), &NicPolicy::default())
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "{}/sys/devices/system/cpu/online: invalid CPU list '0-x': '0-x' is not N or N-M",
            f.root().display()
        )
    );
}
