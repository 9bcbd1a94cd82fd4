//! Root tier: held containers (`berth create`, `exec`, `rm`, `ps`) and the step containers the
//! SPANK plugin asks for (`berth step create|destroy`). Run by integration/test.sh.

mod common;

use std::process::{Command, Stdio};

use common::*;

/// Whether a process runs (a zombie waiting for its reaper does not).
fn running(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s[s.rfind(')').unwrap() + 2..].chars().next().unwrap();
            state != 'Z' && state != 'X'
        })
        .unwrap_or(false)
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn create_exec_rm_share_one_container() {
    let rootfs = rootfs().to_str().unwrap();
    let out = ok(berth(&[
        "create",
        "--rootfs",
        rootfs,
        "--name",
        "t1",
        "--hostname",
        "held",
        "--json",
    ])
    .output()
    .unwrap());
    let desc = json(&out);
    let id = desc["id"].as_str().unwrap().to_string();
    let pid = desc["pid"].as_i64().unwrap();
    assert!(
        desc["namespaces"]["mnt"]
            .as_str()
            .unwrap()
            .ends_with("/ns/mnt")
    );
    assert!(running(pid), "init is not running");
    // Two execs see the same filesystem, hostname and IPC, and run in the container's cgroup.
    ok(berth(&[
        "exec",
        "t1",
        "--",
        "sh",
        "-c",
        "echo shared > /dev/shm/f; echo x > /root/w",
    ])
    .output()
    .unwrap());
    let out = ok(berth(&[
        "exec",
        "t1",
        "--",
        "sh",
        "-c",
        "cat /dev/shm/f /root/w; hostname; echo pid=$$",
    ])
    .output()
    .unwrap());
    assert!(out.starts_with("shared\nx\nheld\n"), "{out}");
    let cgroup = std::path::Path::new(cgroup_root()).join(&id);
    assert!(cgroup.is_dir());
    let o = berth(&["exec", &id, "--", "sh", "-c", "exit 9"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(9));
    let o = berth(&["exec", &id, "--", "no-such-cmd"]).output().unwrap();
    assert_eq!(o.status.code(), Some(127));
    let ps = ok(berth(&["ps"]).output().unwrap());
    assert!(ps.contains(&id) && ps.contains("t1"), "{ps}");
    // berth itself exited long ago: the container lives on its own until rm.
    ok(berth(&["rm", "t1"]).output().unwrap());
    assert!(!cgroup.exists(), "cgroup left after rm");
    assert!(!running(pid), "init survived rm");
    let o = berth(&["exec", "t1", "--", "true"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no container 't1'"), "{}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn exec_runs_as_the_containers_user_without_privileges() {
    let (uid, _, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let id = ok(
        berth(&["create", "--rootfs", rootfs, "--user", "berthtest"])
            .output()
            .unwrap(),
    );
    let id = id.trim();
    let out = ok(berth(&[
        "exec",
        id,
        "--",
        "sh",
        "-c",
        "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status",
    ])
    .output()
    .unwrap());
    ok(berth(&["rm", id]).output().unwrap());
    assert!(out.starts_with(&format!("{uid}\n")), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn step_containers_follow_the_plugin_contract() {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("in.txt"), "input\n").unwrap();
    std::fs::set_permissions(
        data.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let request = format!(
        r#"{{"job_id": 4242, "step_id": 3, "uid": {uid}, "gid": {gid}, "local_task_count": 2,
            "options": {{"container-image": "{rootfs}", "container-mounts": "{}:/data:ro,tmpfs:/scratch",
                         "container-workdir": "/scratch", "container-env": "KEEP"}},
            "job_env": ["SLURM_JOB_ID=4242", "PATH=/usr/bin:/bin", "KEEP=job"]}}"#,
        data.path().display()
    );
    let o = step_create(&request);
    let desc = json(&ok(o));
    let id = desc["id"].as_str().unwrap().to_string();
    assert_eq!(desc["cwd"], "/scratch");
    let env: Vec<String> = serde_json::from_value(desc["env"].clone()).unwrap();
    assert!(env.contains(&"SLURM_JOB_ID=4242".to_string()), "{env:?}");
    assert!(env.contains(&"KEEP=job".to_string()), "{env:?}");
    for ns in ["mnt", "cgroup"] {
        assert!(desc["namespaces"][ns].is_string(), "{ns} missing: {desc}");
    }
    // Like Pyxis, a step shares the host's network, IPC and UTS unless --container-unshare says
    // otherwise (runtime.step_unshare is the site's stricter default).
    for ns in ["net", "ipc", "uts"] {
        assert!(
            desc["namespaces"].get(ns).is_none(),
            "{ns} is shared unless unshared: {desc}"
        );
    }
    // A task joining the mount namespace sees the image and the mounts.
    let ns = desc["namespaces"]["mnt"].as_str().unwrap();
    let o = Command::new("nsenter")
        .arg(format!("--mount={ns}"))
        .args([
            "--",
            "/bin/sh",
            "-c",
            "cat /etc/os-release /data/in.txt; touch /data/x 2>&1; ls -d /scratch",
        ])
        .output()
        .unwrap();
    let out = stdout(&o) + &stderr(&o);
    assert!(out.contains("berth-busybox"), "{out}");
    assert!(out.contains("input"), "{out}");
    assert!(out.contains("Read-only file system"), "{out}");
    let labels = ok(berth(&["ps"]).output().unwrap());
    assert!(
        labels.contains("job=4242") && labels.contains("step=3"),
        "{labels}"
    );
    ok(
        berth(&["step", "destroy", "--job-id", "4242", "--step-id", "3"])
            .output()
            .unwrap(),
    );
    assert!(!std::path::Path::new(cgroup_root()).join(&id).exists());
    // Idempotent.
    ok(
        berth(&["step", "destroy", "--job-id", "4242", "--step-id", "3"])
            .output()
            .unwrap(),
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn step_mounts_are_checked_with_the_users_credentials() {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let secret = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        secret.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let request = format!(
        r#"{{"job_id": 4243, "step_id": 0, "uid": {uid}, "gid": {gid},
            "options": {{"container-image": "{rootfs}", "container-mounts": "{}:/secret"}}}}"#,
        secret.path().display()
    );
    let o = step_create(&request);
    assert_ne!(o.status.code(), Some(0));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot read") && err.contains(secret.path().to_str().unwrap()),
        "{err}"
    );
    // The same request as root (uid 0) is allowed.
    let request = request.replace(
        &format!("\"uid\": {uid}, \"gid\": {gid}"),
        "\"uid\": 0, \"gid\": 0",
    );
    let desc = json(&ok(step_create(&request)));
    ok(
        berth(&["step", "destroy", "--job-id", "4243", "--step-id", "0"])
            .output()
            .unwrap(),
    );
    assert!(desc["id"].is_string());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn named_step_containers_persist_across_steps_of_a_job() {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let req = |step: u32, name: &str| {
        format!(
            r#"{{"job_id": 4244, "step_id": {step}, "uid": {uid}, "gid": {gid},
                "options": {{"container-image": "{rootfs}", "container-name": "{name}"}}}}"#
        )
    };
    let first = json(&ok(step_create(&req(0, "dev"))));
    let id = first["id"].as_str().unwrap().to_string();
    ok(
        berth(&["exec", &id, "--", "sh", "-c", "echo kept > /tmp/marker"])
            .output()
            .unwrap(),
    );
    ok(
        berth(&["step", "destroy", "--job-id", "4244", "--step-id", "0"])
            .output()
            .unwrap(),
    );
    let second = json(&ok(step_create(&req(1, "dev"))));
    assert_eq!(second["id"], first["id"], "a named container is reused");
    let out = ok(berth(&["exec", &id, "--", "cat", "/tmp/marker"])
        .output()
        .unwrap());
    assert_eq!(out, "kept\n");
    let o = step_create(&req(2, "dev:create"));
    assert!(stderr(&o).contains("exists already"), "{}", stderr(&o));
    let o = step_create(&req(2, "other:exec"));
    assert!(
        stderr(&o).contains("no container named 'other'"),
        "{}",
        stderr(&o)
    );
    ok(berth(&["rm", &id]).output().unwrap());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn epilog_removes_the_jobs_containers_but_not_global_ones() {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let req = |step: u32, name: Option<&str>, scope: &str| {
        let name = name
            .map(|n| format!(r#", "container-name": "{n}""#))
            .unwrap_or_default();
        format!(
            r#"{{"job_id": 4245, "step_id": {step}, "uid": {uid}, "gid": {gid},
                "options": {{"container-image": "{rootfs}"{name}}},
                "plugin": {{"container_scope": "{scope}"}}}}"#
        )
    };
    let a = json(&ok(step_create(&req(0, None, "job"))));
    let b = json(&ok(step_create(&req(1, Some("jobnamed"), "job"))));
    let g = json(&ok(step_create(&req(2, Some("globalnamed"), "global"))));
    let other = json(&ok(step_create(
        &req(0, None, "job").replace("4245", "4246"),
    )));
    let o = berth(&["epilog"])
        .env("SLURM_JOB_ID", "4245")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let ps = ok(berth(&["ps"]).output().unwrap());
    for gone in [&a, &b] {
        assert!(!ps.contains(gone["id"].as_str().unwrap()), "{ps}");
    }
    for kept in [&g, &other] {
        assert!(ps.contains(kept["id"].as_str().unwrap()), "{ps}");
    }
    ok(berth(&[
        "rm",
        g["id"].as_str().unwrap(),
        other["id"].as_str().unwrap(),
    ])
    .output()
    .unwrap());
    let o = berth(&["epilog"])
        .env_remove("SLURM_JOB_ID")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("SLURM_JOB_ID"), "{}", stderr(&o));
    let o = berth(&["prolog"])
        .env("SLURM_JOB_ID", "4245")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_named_container_is_invisible() {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let req = |uid: u32, gid: u32, name: &str| {
        format!(
            r#"{{"job_id": 4250, "step_id": 0, "uid": {uid}, "gid": {gid},
                "options": {{"container-image": "{rootfs}", "container-name": "{name}"}},
                "plugin": {{"container_scope": "global"}}}}"#
        )
    };
    let mine = json(&ok(step_create(&req(0, 0, "shared-name"))));
    // The other user asks for a container of that name: it is not theirs to join.
    let o = step_create(&req(uid, gid, "shared-name:exec"));
    assert!(
        !o.status.success(),
        "another user's container was handed out"
    );
    assert!(
        stderr(&o).contains("no container named 'shared-name'"),
        "{}",
        stderr(&o)
    );
    // With auto, the other user gets a container of their own.
    let theirs = json(&ok(step_create(&req(uid, gid, "shared-name"))));
    assert_ne!(theirs["id"], mine["id"]);
    ok(berth(&[
        "rm",
        mine["id"].as_str().unwrap(),
        theirs["id"].as_str().unwrap(),
    ])
    .output()
    .unwrap());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_jobs_scratch_is_made_by_the_prolog_mounted_in_steps_and_removed_by_the_epilog() {
    let (uid, gid, _) = test_user();
    let rootfs = rootfs().to_str().unwrap();
    let job = "4260";
    let slurm_env = |cmd: &str| {
        berth(&[cmd])
            .env("SLURM_JOB_ID", job)
            .env("SLURM_JOB_UID", uid.to_string())
            .env("SLURM_JOB_GID", gid.to_string())
            .env_remove("SPANK_BERTH_IMAGE")
            .output()
            .unwrap()
    };
    let o = slurm_env("prolog");
    assert!(o.status.success(), "{}", stderr(&o));
    let scratch = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/root-tier/scratch")
        .join(job);
    let meta = std::fs::metadata(&scratch).expect("the Prolog made no scratch");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
    assert_eq!(std::os::unix::fs::MetadataExt::mode(&meta) & 0o777, 0o700);
    let desc = json(&ok(step_create(&format!(
        r#"{{"job_id": {job}, "step_id": 0, "uid": {uid}, "gid": {gid},
            "options": {{"container-image": "{rootfs}"}}}}"#
    ))));
    let env: Vec<String> = serde_json::from_value(desc["env"].clone()).unwrap();
    assert!(
        env.contains(&"BERTH_SCRATCH=/scratch".to_string()),
        "{env:?}"
    );
    let id = desc["id"].as_str().unwrap();
    ok(
        berth(&["exec", id, "--", "sh", "-c", "echo result > /scratch/out"])
            .output()
            .unwrap(),
    );
    assert_eq!(
        std::fs::read_to_string(scratch.join("out")).unwrap(),
        "result\n"
    );
    let o = slurm_env("epilog");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!scratch.exists(), "the Epilog left the scratch");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_prolog_stages_in_as_the_user_within_the_cap_and_the_epilog_stages_out() {
    let (uid, gid, _) = test_user();
    let work = config().parent().unwrap();
    let scratch_root = work.join("scratch");
    // A config with a 64 KiB per-job cap (the [scratch] table is the test config's last).
    let capped = work.join("berth-cap.toml");
    std::fs::write(
        &capped,
        format!(
            "{}cap_bytes = 65536\n",
            std::fs::read_to_string(config()).unwrap()
        ),
    )
    .unwrap();
    // Root's, world-readable: the user can read it.
    let data = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        data.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::write(data.path().join("big"), vec![1u8; 300 * 1024]).unwrap();
    let out = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(out.path(), Some(uid), Some(gid)).unwrap();
    let hook = |config: &std::path::Path, verb: &str, job: &str, var: &str, value: String| {
        Command::new(BERTH)
            .arg("--config")
            .arg(config)
            .arg(verb)
            .env("SLURM_JOB_ID", job)
            .env("SLURM_JOB_UID", uid.to_string())
            .env("SLURM_JOB_GID", gid.to_string())
            .env_remove("SPANK_BERTH_IMAGE")
            .env(var, value)
            .output()
            .unwrap()
    };
    let stage_in = format!("{}:data", data.path().display());

    // Over the cap: the Prolog succeeds (a user's request must not drain the node), copies
    // nothing and records the one line the job's steps fail with.
    let o = hook(
        &capped,
        "prolog",
        "4271",
        "SPANK_BERTH_STAGE_IN",
        stage_in.clone(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let record = std::fs::read_to_string(scratch_root.join("4271.stage-in-failed"))
        .expect("no stage-in failure recorded");
    assert_eq!(record.lines().count(), 1, "{record}");
    assert!(
        record.starts_with("berth: job 4271: stage-in of "),
        "{record}"
    );
    assert!(
        record.contains("needs") && record.contains("65536 available"),
        "{record}"
    );
    assert!(!scratch_root.join("4271/data/big").exists());
    let o = hook(
        &capped,
        "epilog",
        "4271",
        "SPANK_BERTH_STAGE_OUT",
        String::new(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!scratch_root.join("4271").exists());
    assert!(!scratch_root.join("4271.stage-in-failed").exists());

    // Without the cap: staged as the user; staged out again by the Epilog, as the user.
    let o = hook(config(), "prolog", "4272", "SPANK_BERTH_STAGE_IN", stage_in);
    assert!(o.status.success(), "{}", stderr(&o));
    let staged = scratch_root.join("4272/data/big");
    let meta = std::fs::metadata(&staged).expect("nothing staged in");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
    let o = hook(
        config(),
        "epilog",
        "4272",
        "SPANK_BERTH_STAGE_OUT",
        format!("data:{}", out.path().display()),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let meta = std::fs::metadata(out.path().join("big")).expect("nothing staged out");
    assert_eq!(meta.len(), 300 * 1024);
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
    assert!(!scratch_root.join("4272").exists());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn output_into_a_closed_pipe_ends_berth_quietly_with_141() {
    // `berth ps | head -0`: the reader is gone before berth writes. Rust's println! panicked
    // there ("failed printing to stdout: Broken pipe") with a backtrace and status 101.
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    let out = berth(&["ps"]).stdout(Stdio::from(write)).output().unwrap();
    assert_eq!(
        (out.status.code(), stderr(&out).as_str()),
        (Some(141), ""),
        "{out:?}"
    );
}
