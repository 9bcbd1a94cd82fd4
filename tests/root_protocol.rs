//! Root tier: the plugin ↔ berth protocol as the real binary answers it — plugins one version
//! older (the unversioned protocol 1) and one newer are served, others refused in one line
//! naming both versions — and the step's node, which keeps the containers of several slurmd
//! sharing one host and state directory apart. Run by integration/test.sh.

mod common;

use std::process::Output;

use common::*;

const VERSION: u32 = berth_proto::VERSION;

fn destroy(job: u32, step: u32, node: Option<&str>) {
    let (job, step) = (job.to_string(), step.to_string());
    let mut args = vec!["step", "destroy", "--job-id", &job, "--step-id", &step];
    if let Some(n) = node {
        args.extend(["--node", n]);
    }
    ok(berth(&args).output().unwrap());
}

fn listed(id: &serde_json::Value) -> bool {
    ok(berth(&["ps"]).output().unwrap()).contains(id["id"].as_str().unwrap())
}

/// A request as the plugin of `version` sends it (`None`: the unversioned protocol 1, exactly
/// the shape plugins sent before the field existed), with `extra` top-level fields and
/// `extra_option` inside the options.
fn request(
    job: u32,
    version: Option<u32>,
    node: Option<&str>,
    extra: &str,
    extra_option: &str,
) -> String {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let mut head = String::new();
    if let Some(v) = version {
        head += &format!(r#""protocol": {v}, "#);
    }
    if let Some(n) = node {
        head += &format!(r#""node": "{n}", "#);
    }
    format!(
        r#"{{{head}{extra}"job_id": {job}, "step_id": 0, "uid": {uid}, "gid": {gid},
            "options": {{{extra_option}"container-image": "{rootfs}"}},
            "plugin": {{"container_scope": "job", "execute_entrypoint": false, "sbatch_support": true}},
            "job_env": ["SLURM_JOB_ID={job}"]}}"#
    )
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn plugins_one_version_apart_are_served_and_others_refused_naming_both() {
    // The unversioned (protocol 1) request, from a plugin older than berth.
    let old = json(&ok(step_create(&request(4301, None, None, "", ""))));
    assert_eq!(old["protocol"], VERSION, "{old}");
    assert!(listed(&old));
    destroy(4301, 0, None);
    assert!(!listed(&old));

    // A plugin one version newer: what it added (a field, an option) is ignored, logged.
    let newer = step_create(&request(
        4302,
        Some(VERSION + 1),
        Some("n1"),
        r#""gpu_health": {"ok": true}, "#,
        r#""container-future": "x", "#,
    ));
    let answer = json(&ok(Output {
        status: newer.status,
        stdout: newer.stdout.clone(),
        stderr: Vec::new(),
    }));
    let err = stderr(&newer);
    assert!(
        err.contains(&format!("protocol {}", VERSION + 1))
            && err.contains("gpu_health")
            && err.contains("options.container-future"),
        "{err}"
    );
    destroy(4302, 0, Some("n1"));
    assert!(!listed(&answer));

    // The same unknown field from a plugin of berth's own version is a bug there: refused.
    let same = step_create(&request(
        4303,
        Some(VERSION),
        None,
        r#""gpu_health": {"ok": true}, "#,
        "",
    ));
    assert_eq!(same.status.code(), Some(2), "{}", stderr(&same));
    assert!(
        stderr(&same).contains("unknown field gpu_health"),
        "{}",
        stderr(&same)
    );

    // Two versions apart either way: one line naming both, nothing created.
    for v in [VERSION + 2, 0] {
        let o = step_create(&request(4304, Some(v), None, "", ""));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!(
                "the SPANK plugin speaks protocol {v} and this berth speaks {VERSION}"
            )),
            "{err}"
        );
        assert!(!ok(berth(&["ps"]).output().unwrap()).contains("job=4304"));
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn containers_of_one_step_on_two_nodes_sharing_a_state_directory_stay_apart() {
    // Two slurmd on one host run the same step: each destroy, named lookup and Epilog sees
    // only its own node's container.
    let on = |node: &str| {
        json(&ok(step_create(&request(
            4310,
            Some(VERSION),
            Some(node),
            "",
            "",
        ))))
    };
    let (a, b) = (on("n1"), on("n2"));
    assert_ne!(a["id"], b["id"]);
    destroy(4310, 0, Some("n1"));
    assert!(!listed(&a), "n1's destroy left its container");
    assert!(listed(&b), "n1's destroy removed n2's container");
    // An older plugin's destroy (no node) removes the step's containers as before.
    destroy(4310, 0, None);
    assert!(!listed(&b));

    // A node taken from the job's environment when the request has none (protocol 1).
    let from_env = request(4311, None, None, "", "").replace(
        r#""job_env": ["SLURM_JOB_ID=4311"]"#,
        r#""job_env": ["SLURM_JOB_ID=4311", "SLURM_TOPOLOGY_ADDR=n3", "SLURM_TOPOLOGY_ADDR_PATTERN=node"]"#,
    );
    let c = json(&ok(step_create(&from_env)));
    let ps = ok(berth(&["ps"]).output().unwrap());
    let line = ps
        .lines()
        .find(|l| l.contains(c["id"].as_str().unwrap()))
        .unwrap_or_else(|| panic!("{ps}"));
    assert!(line.contains("node=n3"), "{line}");

    // Named containers: n1's `dev` is not n2's.
    let named = |node: &str, step: u32| {
        request(
            4312,
            Some(VERSION),
            Some(node),
            "",
            r#""container-name": "dev", "#,
        )
        .replace(r#""step_id": 0"#, &format!(r#""step_id": {step}"#))
    };
    let d1 = json(&ok(step_create(&named("n1", 0))));
    let d2 = json(&ok(step_create(&named("n2", 0))));
    assert_ne!(d1["id"], d2["id"], "n2 joined n1's named container");
    let again = json(&ok(step_create(&named("n1", 1))));
    assert_eq!(
        again["id"], d1["id"],
        "n1's later step did not join its own named container"
    );

    // The Epilog of n1 (Slurm names the node in its environment) leaves n2's containers.
    let o = berth(&["epilog"])
        .env("SLURM_JOB_ID", "4312")
        .env("SLURMD_NODENAME", "n1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!listed(&d1));
    assert!(listed(&d2), "n1's Epilog removed n2's container");
    for job in ["4311", "4312"] {
        let o = berth(&["epilog"])
            .env("SLURM_JOB_ID", job)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert!(!listed(&d2) && !listed(&c));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_node_that_cannot_keep_state_exits_125_and_a_bad_request_2() {
    let dir = tempfile::tempdir().unwrap();
    // The state directory is a regular file: the node's failure, nothing the job asked wrongly.
    let state = dir.path().join("state");
    std::fs::write(&state, "").unwrap();
    let config = dir.path().join("berth.toml");
    let shared = std::fs::read_to_string(common::config()).unwrap();
    let broken = shared
        .lines()
        .map(|l| {
            if l.starts_with("state_dir") {
                format!("state_dir = \"{}\"", state.display())
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&config, broken).unwrap();
    let create = |text: &str| step_create_with(&config, text);
    let host = create(&request(4310, Some(VERSION), None, "", ""));
    let err = stderr(&host);
    assert_eq!(host.status.code(), Some(125), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains(&state.display().to_string()), "{err}");
    let bad = create("{\"job_id\": \"not a number\"}");
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
}
