//! Root tier: berth's SPANK plugin on a real one-host Slurm (munged, slurmctld, slurmd started
//! by integration/slurm/start.sh once per test binary and stopped when it exits). Each test runs
//! srun/sbatch as a user would and checks what the job sees. Run by integration/test.sh as root:
//! `cargo test --test root_slurm -- --ignored --test-threads=1`.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A value derived from the checkout, so two checkouts testing at once use distinct ports,
/// state directories and cgroups.
fn checkout_hash() -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(env!("CARGO_MANIFEST_DIR"), &mut h);
    u32::try_from(std::hash::Hasher::finish(&h) & u64::from(u32::MAX)).unwrap()
}

struct Cluster {
    state: PathBuf,
    conf: PathBuf,
    /// A directory every user can use as the working directory of srun.
    cwd: PathBuf,
    /// `HOST:PORT` of a plain-HTTP registry holding `test/busybox:1`.
    registry: String,
}

/// The test registry's pid, killed with the cluster at exit.
static REGISTRY_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A plain registry with `test/busybox:1` (busybox and an os-release naming it), left running
/// for the test binary's life.
fn start_registry(state: &Path) -> String {
    use harness::{Compression, Entry, Mode, Registry, Uploader};
    let registry = Registry::start(
        &Mode::Plain,
        &state.join("registry/storage"),
        &state.join("registry"),
    );
    let up = Uploader::new(&registry.host(), None);
    let mut entries = harness::busybox_entries("amd64");
    entries.push(Entry::File(
        "etc/os-release".into(),
        b"PRETTY_NAME=\"busybox from the test registry\"\n".to_vec(),
        0o644,
    ));
    up.image(
        "test/busybox",
        Some("1"),
        "amd64",
        vec![harness::blob_of(
            harness::tar_of(&entries),
            Compression::Gzip,
            false,
        )],
        false,
    );
    let host = registry.host();
    REGISTRY_PID.store(
        registry.pid().unwrap_or(0),
        std::sync::atomic::Ordering::Relaxed,
    );
    // Dropping the handle would kill it; it is killed at exit instead.
    std::mem::forget(registry);
    host
}

/// The cluster, started on first use; stopped by an atexit handler when the test binary exits.
fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let berth = PathBuf::from(BERTH);
        let profile_dir = berth.parent().unwrap();
        // The plugin is another workspace member: build it with the profile of this test.
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "-p", "berth-spank"]);
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                build.arg("--release");
            }
            Some(other) => {
                build.args(["--profile", other]);
            }
        }
        let status = build.current_dir(repo()).status().expect("running cargo");
        assert!(status.success(), "building the SPANK plugin failed");
        let plugin = profile_dir.join("libspank_berth.so");

        let hash = checkout_hash();
        let state = PathBuf::from(format!("/tmp/berth-root-slurm-{hash:08x}"));
        let port = 18000 + (hash % 500) * 4;
        let berth_config = PathBuf::from(format!("/tmp/berth-root-slurm-{hash:08x}.toml"));
        // Outside the cluster's state directory, which start.sh wipes.
        let registry_dir = PathBuf::from(format!("/tmp/berth-root-slurm-{hash:08x}-registry"));
        let _ = std::fs::remove_dir_all(&registry_dir);
        let registry = start_registry(&registry_dir);
        std::fs::write(
            &berth_config,
            format!(
                "[cgroup]\nroot = \"{}-slurm\"\n[runtime]\nstate_dir = \"{}/berth/state\"\n\
                 [store]\nroot = \"{}/berth/store\"\n[squashfs]\nmount_dir = \"{}/berth/images\"\n\
                 [scratch]\nroot = \"{}/berth/scratch\"\n\
                 [registry]\ninsecure = [\"{registry}\"]\n",
                cgroup_root(),
                state.display(),
                state.display(),
                state.display(),
                state.display()
            ),
        )
        .unwrap();
        // Registered before anything is started, so a failed start still cleans up.
        extern "C" fn stop_cluster() {
            let pid = REGISTRY_PID.load(std::sync::atomic::Ordering::Relaxed);
            if pid > 0 {
                // SAFETY: killing the registry this process started.
                unsafe { libc::kill(i32::try_from(pid).unwrap(), libc::SIGKILL) };
            }
            let state = format!("/tmp/berth-root-slurm-{:08x}", checkout_hash());
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(state)
                .status();
        }
        // SAFETY: registering a plain function to run at process exit.
        unsafe { libc::atexit(stop_cluster) };
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .arg("--plugin")
            .arg(&plugin)
            .arg("--berth")
            .arg(&berth)
            .arg("--berth-config")
            .arg(&berth_config)
            .env("BERTH_SLURM_PORT", port.to_string())
            .output()
            .expect("running integration/slurm/start.sh");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );

        let cwd = state.join("cwd");
        std::fs::create_dir_all(&cwd).unwrap();
        std::fs::set_permissions(&cwd, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .unwrap();
        Cluster {
            conf: state.join("etc/slurm.conf"),
            state,
            cwd,
            registry,
        }
    })
}

/// A Slurm client command (srun, sbatch, …) as root.
fn slurm(cmd: &str, args: &[&str]) -> Command {
    let c = cluster();
    let mut command = Command::new(cmd);
    command
        .args(args)
        .env("SLURM_CONF", &c.conf)
        .env_remove("BERTH_CONTAINER_IMAGE")
        .env_remove("PYXIS_CONTAINER_IMAGE")
        .current_dir(&c.cwd);
    command
}

/// A Slurm client command as the test user (runuser keeps SLURM_CONF).
fn slurm_as_user(cmd: &str, args: &[&str]) -> Command {
    let _ = test_user();
    let mut command = slurm("runuser", &["-u", "berthtest", "--", cmd]);
    command.args(args);
    command
}

fn run(mut cmd: Command) -> Output {
    cmd.output().expect("running a Slurm client")
}

fn image() -> String {
    rootfs().display().to_string()
}

/// stderr without Slurm's informational lines about queueing.
fn errors(o: &Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| !l.contains("queued and waiting for resources"))
        .filter(|l| !l.contains("has been allocated resources"))
        .map(String::from)
        .collect()
}

fn succeeded(o: Output) -> String {
    assert!(
        o.status.success(),
        "Slurm command failed: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// The request the plugin sent for `job.step` (the harness sets debug_request_dir).
fn request(job: &str, step: &str) -> serde_json::Value {
    let path = cluster().state.join(format!("requests/{job}.{step}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("no request at {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn srun_help_describes_every_container_option() {
    let help = succeeded(run(slurm("srun", &["--help"])));
    for flag in [
        "--container-image=",
        "--container-mounts=",
        "--container-workdir=",
        "--container-name=",
        "--container-save=",
        "--container-mount-home",
        "--no-container-mount-home",
        "--container-remap-root",
        "--no-container-remap-root",
        "--container-entrypoint",
        "--no-container-entrypoint",
        "--container-entrypoint-log",
        "--container-writable",
        "--container-readonly",
        "--container-env=",
        "--container-unshare=",
        "--container-bind=",
    ] {
        assert!(help.contains(flag), "srun --help lacks {flag}:\n{help}");
    }
    assert!(help.matches("[berth]").count() >= 17, "{help}");
    // sbatch and salloc take them too (sbatch_support defaults to 1).
    let help = succeeded(run(slurm("sbatch", &["--help"])));
    assert!(help.contains("--container-image="), "{help}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_task_sees_the_images_files() {
    let host = std::fs::read_to_string("/etc/os-release").unwrap();
    let out = succeeded(run(slurm(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "cat",
            "/etc/os-release",
        ],
    )));
    assert!(out.contains("ID=berth-busybox"), "{out}");
    assert_ne!(out, host);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn environment_variables_stand_in_for_flags_and_flags_win() {
    let script = "echo job=$SLURM_JOB_ID; pwd; cat /etc/os-release";
    // BERTH_* and PYXIS_* both enable the container; BERTH_* wins over PYXIS_*.
    let mut cmd = slurm("srun", &["sh", "-c", script]);
    cmd.env("PYXIS_CONTAINER_IMAGE", image())
        .env("BERTH_CONTAINER_WORKDIR", "/etc")
        .env("PYXIS_CONTAINER_WORKDIR", "/tmp")
        .env("PYXIS_CONTAINER_MOUNT_HOME", "0")
        .env("BERTH_CONTAINER_ENV", "FOO,BAR");
    let out = succeeded(run(cmd));
    assert!(out.contains("ID=berth-busybox"), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[1], "/etc", "{out}");
    let job = lines[0].strip_prefix("job=").unwrap();
    let req = request(job, "0");
    assert_eq!(req["options"]["container-image"], image());
    assert_eq!(req["options"]["container-workdir"], "/etc");
    assert_eq!(req["options"]["container-mount-home"], false);
    assert_eq!(req["options"]["container-env"], "FOO,BAR");
    assert_eq!(req["step_id"], 0);
    assert_eq!(req["uid"], 0);
    assert!(
        req["job_env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == &format!("SLURM_JOB_ID={job}")),
        "{req}"
    );

    // A flag wins over both variables.
    let mut cmd = slurm("srun", &["--container-workdir=/bin", "sh", "-c", script]);
    cmd.env("BERTH_CONTAINER_IMAGE", image())
        .env("BERTH_CONTAINER_WORKDIR", "/etc")
        .env("PYXIS_CONTAINER_WORKDIR", "/tmp");
    let out = succeeded(run(cmd));
    assert_eq!(out.lines().nth(1), Some("/bin"), "{out}");

    // A variable with a bad value fails srun before anything runs.
    let mut cmd = slurm("srun", &["true"]);
    cmd.env("BERTH_CONTAINER_IMAGE", image())
        .env("BERTH_CONTAINER_READONLY", "perhaps");
    let o = run(cmd);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("BERTH_CONTAINER_READONLY: 'perhaps' is not a boolean"),
        "{}",
        stderr(&o)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn tasks_of_a_step_share_the_container_and_its_dev_shm() {
    let name = format!("berth-shm-{}", std::process::id());
    // Task 0 writes; task 1 waits for the file (10 s at most) and prints it.
    let script = format!(
        "if [ $SLURM_PROCID = 0 ]; then echo from-task-0 > /dev/shm/{name}; \
         else i=0; while [ ! -e /dev/shm/{name} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
         echo task1 sees $(cat /dev/shm/{name}); fi; cat /etc/os-release | grep ^ID="
    );
    let out = succeeded(run(slurm(
        "srun",
        &[
            "-n",
            "2",
            &format!("--container-image={}", image()),
            "sh",
            "-c",
            &script,
        ],
    )));
    assert!(out.contains("task1 sees from-task-0"), "{out}");
    assert_eq!(out.matches("ID=berth-busybox").count(), 2, "{out}");
    assert!(
        !Path::new(&format!("/dev/shm/{name}")).exists(),
        "the container's /dev/shm is the host's"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn workdir_option_sets_the_tasks_directory() {
    let img = format!("--container-image={}", image());
    let out = succeeded(run(slurm(
        "srun",
        &[&img, "--container-workdir=/etc", "pwd"],
    )));
    assert_eq!(out.trim(), "/etc");
    // Without it: the image's working directory, here the default "/" (the host's working
    // directory does not exist in the image).
    let out = succeeded(run(slurm("srun", &[&img, "pwd"])));
    assert_eq!(out.trim(), "/");
    let o = run(slurm(
        "srun",
        &[&img, "--container-workdir=/no/such/dir", "pwd"],
    ));
    assert!(!o.status.success());
    let berth_lines: Vec<String> = errors(&o)
        .into_iter()
        .filter(|l| l.contains("berth:"))
        .collect();
    assert_eq!(berth_lines.len(), 1, "{}", stderr(&o));
    assert!(
        berth_lines[0].contains("/no/such/dir"),
        "{}",
        berth_lines[0]
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mounts_are_bound_and_read_only_ones_refuse_writes() {
    let c = cluster();
    let ro = c.cwd.join(format!("ro-{}", std::process::id()));
    let rw = c.cwd.join(format!("rw-{}", std::process::id()));
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::create_dir_all(&rw).unwrap();
    std::fs::write(ro.join("f"), "from-host\n").unwrap();
    let mounts = format!(
        "--container-mounts={}:/data:ro,{}:/out",
        ro.display(),
        rw.display()
    );
    let o = run(slurm(
        "srun",
        &[
            &format!("--container-image={}", image()),
            &mounts,
            "sh",
            "-c",
            "cat /data/f; echo written > /out/g && echo wrote-out; \
             echo x > /data/new && echo WROTE-RO || echo refused",
        ],
    ));
    let out = succeeded(o);
    assert!(out.contains("from-host"), "{out}");
    assert!(out.contains("wrote-out"), "{out}");
    assert!(out.contains("refused"), "{out}");
    assert!(!out.contains("WROTE-RO"), "{out}");
    assert_eq!(std::fs::read_to_string(rw.join("g")).unwrap(), "written\n");
    assert!(!ro.join("new").exists());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_bad_image_fails_the_step_with_one_line_naming_it() {
    let o = run(slurm(
        "srun",
        &["--container-image=/no/such/image", "echo", "RAN"],
    ));
    assert!(!o.status.success(), "srun succeeded: {}", stdout(&o));
    assert!(!stdout(&o).contains("RAN"));
    let berth_lines: Vec<String> = errors(&o)
        .into_iter()
        .filter(|l| l.contains("berth:"))
        .collect();
    assert_eq!(berth_lines.len(), 1, "{}", stderr(&o));
    assert!(
        berth_lines[0].contains("/no/such/image"),
        "{}",
        berth_lines[0]
    );
    // A malformed option fails in srun itself, before any job exists.
    let o = run(slurm(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "--container-name=x:sometimes",
            "true",
        ],
    ));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("berth: --container-name: invalid value 'x:sometimes'"),
        "{}",
        stderr(&o)
    );
    // So does a mount the node would refuse (before: only slurmstepd, once the job had run).
    let o = run(slurm(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "--container-mounts=/data:rel",
            "true",
        ],
    ));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(
            "berth: --container-mounts: invalid value '/data:rel': the destination must be an absolute path"
        ) && !stderr(&o).contains("slurmstepd"),
        "{}",
        stderr(&o)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_job_runs_as_its_user_and_cannot_reach_the_hosts_files() {
    let (uid, gid, extra) = test_user();
    let out = succeeded(run(slurm_as_user(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "sh",
            "-c",
            "id -u; id -g; id -G; cat /etc/shadow 2>/dev/null | wc -c",
        ],
    )));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], uid.to_string(), "{out}");
    assert_eq!(lines[1], gid.to_string(), "{out}");
    assert!(
        lines[2].split(' ').any(|g| g == extra.to_string()),
        "supplementary group missing: {out}"
    );
    assert_eq!(
        lines[3].trim(),
        "0",
        "the host's /etc/shadow is readable: {out}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn tasks_have_no_capabilities_and_no_new_privileges() {
    // As root too: the container's tasks get no capability in any set.
    for cmd in [slurm("srun", &[]), slurm_as_user("srun", &[])] {
        let mut cmd = cmd;
        cmd.args([
            &format!("--container-image={}", image()),
            "grep",
            "-E",
            "^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)",
            "/proc/self/status",
        ]);
        let out = succeeded(run(cmd));
        for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert!(
                out.contains(&format!("{cap}:\t0000000000000000")),
                "{cap} not empty: {out}"
            );
        }
        assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_named_container_keeps_its_files_across_the_steps_of_a_job_and_its_modes_hold() {
    let c = cluster();
    // Pyxis's modes: create refuses an existing name, exec a missing one; no_exec makes a
    // missing one and (in berth) joins an existing one, as auto does.
    let script = format!(
        "srun --container-name=keep --container-image={img} sh -c 'echo kept > /tmp/note'; \
         srun --container-name=keep cat /tmp/note; \
         srun --container-name=keep:create --container-image={img} true 2>/dev/null || echo create-refused; \
         srun --container-name=other:exec true 2>/dev/null || echo exec-refused; \
         srun --container-name=other:no_exec --container-image={img} echo made; \
         srun --container-name=keep:no_exec cat /tmp/note; \
         srun --container-image={img} sh -c 'cat /tmp/note 2>/dev/null || echo fresh'",
        img = image()
    );
    let out = succeeded(run(slurm("salloc", &["-Q", "sh", "-c", &script])));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "kept",
            "create-refused",
            "exec-refused",
            "made",
            "kept",
            "fresh"
        ],
        "{out}"
    );
    // The Epilog removes the job's named containers.
    let state = c.state.join("berth/state");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !containers_in(&state).is_empty() {
        assert!(
            Instant::now() < deadline,
            "named container left after the job"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn sbatch_runs_its_script_inside_the_container() {
    let c = cluster();
    let script = c.cwd.join(format!("job-{}.sh", std::process::id()));
    let output = c.cwd.join(format!("job-{}.out", std::process::id()));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n#SBATCH --container-image={}\n#SBATCH --output={}\ncat /etc/os-release\n",
            image(),
            output.display()
        ),
    )
    .unwrap();
    succeeded(run(slurm("sbatch", &["--wait", script.to_str().unwrap()])));
    let out = std::fs::read_to_string(&output).unwrap();
    assert!(out.contains("ID=berth-busybox"), "{out}");
}

/// Host processes whose command line contains `needle`.
/// The container directories (those with a state.json) in berth's state directory; the Prolog
/// and Epilog keep other files there (the health checks' kernel-log marks).
fn containers_in(state: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(state)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().join("state.json").exists())
                .map(|e| e.file_name())
                .collect()
        })
        .unwrap_or_default()
}

fn processes_with(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push(format!(
                "{}: {cmdline}",
                entry.file_name().to_string_lossy()
            ));
        }
    }
    found
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn nothing_of_the_container_is_left_after_the_job() {
    let c = cluster();
    // A background process that would outlive the task if nothing killed it.
    let token = format!("{}", 3000 + std::process::id() % 1000);
    let out = succeeded(run(slurm(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "sh",
            "-c",
            &format!("sleep {token} & echo started"),
        ],
    )));
    assert!(out.contains("started"));
    let state = c.state.join("berth/state");
    let cgroups = PathBuf::from(format!("{}-slurm", cgroup_root()));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let procs = processes_with(&format!("sleep {token}"));
        let records = containers_in(&state);
        let groups: Vec<_> = std::fs::read_dir(&cgroups)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name())
                    .collect()
            })
            .unwrap_or_default();
        let mounts = host_mounts_with(&image());
        let queue = stdout(&run(slurm("squeue", &["-h"])));
        if procs.is_empty()
            && records.is_empty()
            && groups.is_empty()
            && mounts.is_empty()
            && queue.trim().is_empty()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left after the job: processes {procs:?}, state {records:?}, cgroups {groups:?}, \
             mounts {mounts:?}, queue {queue}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The MPI image: Debian minbase with Open MPI and /usr/local/bin/allreduce (a program summing
/// the ranks, 1 + 2 + … + size, with MPI_Allreduce), built once by
/// integration/slurm/mpi-image.sh and cached between runs.
fn mpi_image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/mpi-image.sh"))
            .output()
            .expect("running integration/slurm/mpi-image.sh");
        assert!(
            out.status.success(),
            "integration/slurm/mpi-image.sh failed: {}",
            stderr(&out)
        );
        stdout(&out).trim().to_string()
    })
}

/// `srun --mpi=pmix -n 2` of the MPI program in the Open MPI image, as root or as the test user.
fn mpi_allreduce(as_user: bool) {
    let image = format!("--container-image={}", mpi_image());
    let args = [
        "--mpi=pmix",
        "-n",
        "2",
        image.as_str(),
        "/usr/local/bin/allreduce",
    ];
    let cmd = if as_user {
        slurm_as_user("srun", &args)
    } else {
        slurm("srun", &args)
    };
    let out = succeeded(run(cmd));
    for rank in 0..2 {
        assert!(
            out.contains(&format!("rank {rank} of 2: sum 3")),
            "rank {rank}: {out}"
        );
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mpi_ranks_in_one_container_reach_slurms_pmix_server() {
    mpi_allreduce(false);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mpi_ranks_of_a_user_reach_slurms_pmix_server() {
    mpi_allreduce(true);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn container_save_writes_a_squashfs_that_a_later_step_runs() {
    let (uid, _, _) = test_user();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(dir.path(), Some(uid), None).unwrap();
    let saved = dir.path().join("saved.sqsh");
    // As the user: the file is written with the user's credentials.
    succeeded(run(slurm_as_user(
        "srun",
        &[
            &format!("--container-image={}", image()),
            &format!("--container-save={}", saved.display()),
            "sh",
            "-c",
            "echo from-the-first-step > /tmp/../var/tmp/marker",
        ],
    )));
    let meta = std::fs::metadata(&saved).expect("--container-save wrote nothing");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&meta),
        uid,
        "not written as the user"
    );
    let out = succeeded(run(slurm_as_user(
        "srun",
        &[
            &format!("--container-image={}", saved.display()),
            "cat",
            "/var/tmp/marker",
        ],
    )));
    assert_eq!(out.trim(), "from-the-first-step");
    // A path the user cannot write fails the step before its command runs (before: the command
    // ran, and the save failed only at its end), and nothing is written there.
    let o = run(slurm_as_user(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "--container-save=/root/not-yours.sqsh",
            "sh",
            "-c",
            "echo ran",
        ],
    ));
    assert!(!o.status.success());
    assert!(!stdout(&o).contains("ran"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("--container-save=/root/not-yours.sqsh: uid")
            && stderr(&o).contains("cannot write it"),
        "{}",
        stderr(&o)
    );
    let left: Vec<_> = std::fs::read_dir("/root")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("not-yours"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_setuid_root_binary_in_the_image_gives_no_root() {
    let (uid, _, _) = test_user();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("rootfs");
    assert!(
        Command::new("cp")
            .arg("-a")
            .arg(rootfs())
            .arg(&img)
            .status()
            .unwrap()
            .success()
    );
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // busybox picks the applet from its name: a setuid-root copy named `cat`.
    std::fs::create_dir(img.join("opt")).unwrap();
    let suid = img.join("opt/cat");
    std::fs::copy(img.join("bin/busybox"), &suid).unwrap();
    std::fs::set_permissions(&suid, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
    let out = succeeded(run(slurm_as_user(
        "srun",
        &[
            &format!("--container-image={}", img.display()),
            "/opt/cat",
            "/proc/self/status",
        ],
    )));
    let ids = out.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert_eq!(
        ids.split_whitespace().skip(1).collect::<Vec<_>>(),
        vec![uid.to_string(); 4],
        "the setuid bit raised privileges: {ids}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_registry_image_runs_in_srun_as_root_and_as_a_user() {
    let c = cluster();
    let image = format!("--container-image={}#test/busybox:1", c.registry);
    let out = succeeded(run(slurm(
        "srun",
        &[&image, "busybox", "cat", "/etc/os-release"],
    )));
    assert!(out.contains("busybox from the test registry"), "{out}");
    // The cached image serves the next step; a user gets it too (it was pulled anonymously).
    let out = succeeded(run(slurm_as_user(
        "srun",
        &[
            "-n",
            "2",
            &image,
            "sh",
            "-c",
            "busybox cat /etc/os-release; id -u",
        ],
    )));
    let (uid, _, _) = test_user();
    assert_eq!(
        out.matches("busybox from the test registry").count(),
        2,
        "{out}"
    );
    assert_eq!(out.matches(&format!("{uid}\n")).count(), 2, "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn remap_root_makes_the_user_root_in_the_container_only() {
    let (uid, _, _) = test_user();
    let dir = cluster().state.join("remap-out");
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(uid), None).unwrap();
    let mounts = format!("--container-mounts={}:/out", dir.display());
    let out = succeeded(run(slurm_as_user(
        "srun",
        &[
            "-n",
            "2",
            &format!("--container-image={}", image()),
            "--container-remap-root",
            &mounts,
            "sh",
            "-c",
            // Both tasks: root, owner of the image's files, able to write where root writes,
            // and no capability; a file made in a mounted host directory is the user's.
            "echo \"id $(id -u):$(id -g)\"; stat -c 'etc %u' /etc; \
             echo $SLURM_PROCID > /etc/rank-$SLURM_PROCID && echo wrote-etc; \
             touch /out/f-$SLURM_PROCID; grep CapEff /proc/self/status",
        ],
    )));
    assert_eq!(out.matches("id 0:0").count(), 2, "{out}");
    assert_eq!(out.matches("etc 0").count(), 2, "{out}");
    assert_eq!(out.matches("wrote-etc").count(), 2, "{out}");
    assert_eq!(out.matches("CapEff:\t0000000000000000").count(), 2, "{out}");
    for rank in 0..2 {
        let f = dir.join(format!("f-{rank}"));
        let meta = std::fs::metadata(&f).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(&meta),
            uid,
            "{} is not the user's on the host",
            f.display()
        );
    }
    // Without the flag the same user is itself.
    let out = succeeded(run(slurm_as_user(
        "srun",
        &[&format!("--container-image={}", image()), "id", "-u"],
    )));
    assert_eq!(out.trim(), uid.to_string());
    // Pyxis's workflow: install as the remapped root, save; the saved image's files are root's
    // (the user's on the host while it ran), and the busybox image's own files stay root's.
    let saved = dir.join("saved.sqsh");
    succeeded(run(slurm_as_user(
        "srun",
        &[
            &format!("--container-image={}", image()),
            "--container-remap-root",
            &format!("--container-save={}", saved.display()),
            "sh",
            "-c",
            "echo x > /etc/installed && mkdir -p /opt/app",
        ],
    )));
    let listing = Command::new("unsquashfs")
        .args(["-lln"])
        .arg(&saved)
        .output()
        .unwrap();
    let listing = stdout(&listing);
    for path in ["etc/installed", "opt/app", "bin/busybox"] {
        let line = listing
            .lines()
            .find(|l| l.ends_with(&format!("squashfs-root/{path}")))
            .unwrap_or_else(|| panic!("{path} not in the saved image: {listing}"));
        assert!(line.contains(" 0/0 "), "{path} is not root's: {line}");
    }
}

/// An Enroot-style .sqsh whose /etc/rc prints a line, exports a variable, leaves a file and
/// runs its arguments (or exits `status` first when non-zero).
fn rc_image(name: &str, status: i32) -> PathBuf {
    let dir = cluster().state.join(format!("rc-{name}"));
    let sqsh = cluster().state.join(format!("rc-{name}.sqsh"));
    if sqsh.exists() {
        return sqsh;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let cp = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&dir)
        .status()
        .unwrap();
    assert!(cp.success());
    let exit = if status != 0 {
        format!("exit {status}\n")
    } else {
        String::new()
    };
    std::fs::write(
        dir.join("etc/rc"),
        format!(
            "echo \"rc says hello as $(id -u)\"\n{exit}export FROM_RC=yes\n\
             echo made > /tmp/rc-file\nexec \"$@\"\n"
        ),
    )
    .unwrap();
    let out = Command::new("mksquashfs")
        .arg(&dir)
        .arg(&sqsh)
        .args(["-quiet", "-noappend"])
        .output()
        .unwrap();
    assert!(out.status.success(), "mksquashfs: {}", stderr(&out));
    sqsh
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_entrypoint_runs_once_and_hands_its_environment_to_every_task() {
    let image = format!("--container-image={}", rc_image("ok", 0).display());
    let script = "echo \"task $SLURM_PROCID env=$FROM_RC file=$(cat /tmp/rc-file 2>/dev/null)\"";
    let o = run(slurm_as_user(
        "srun",
        &[
            "-n",
            "2",
            &image,
            "--container-entrypoint",
            "--container-entrypoint-log",
            "sh",
            "-c",
            script,
        ],
    ));
    let out = succeeded(o.clone());
    for rank in 0..2 {
        assert!(
            out.contains(&format!("task {rank} env=yes file=made")),
            "{out}"
        );
    }
    // Printed once, by the node's first task, as the job's user.
    let (uid, _, _) = test_user();
    let log = format!("rc says hello as {uid}");
    assert_eq!(stderr(&o).matches(&log).count(), 1, "{}", stderr(&o));
    // Without the log flag it runs quietly; without the entrypoint flag it does not run.
    let o = run(slurm_as_user(
        "srun",
        &[&image, "--container-entrypoint", "sh", "-c", script],
    ));
    assert!(succeeded(o.clone()).contains("env=yes file=made"));
    assert!(!stderr(&o).contains("rc says hello"), "{}", stderr(&o));
    let out = succeeded(run(slurm_as_user("srun", &[&image, "sh", "-c", script])));
    assert!(out.contains("task 0 env= file="), "{out}");
    // A failing entrypoint fails the step with one line naming it.
    let bad = format!("--container-image={}", rc_image("bad", 3).display());
    let o = run(slurm_as_user(
        "srun",
        &[&bad, "--container-entrypoint", "echo", "RAN"],
    ));
    assert!(!o.status.success());
    assert!(!stdout(&o).contains("RAN"));
    let lines: Vec<String> = errors(&o)
        .into_iter()
        .filter(|l| l.contains("berth:"))
        .collect();
    assert_eq!(lines.len(), 1, "{}", stderr(&o));
    assert!(
        lines[0].contains("/etc/rc") && lines[0].contains("status 3"),
        "{}",
        lines[0]
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_steps_slurm_cgroup_limits_are_visible_inside() {
    // This host's Slurm keeps cgroup v1 hierarchies (cpuset constrained to the step's cores,
    // freezer for tracking); the container shows them at /sys/fs/cgroup/<hierarchy>.
    let out = succeeded(run(slurm(
        "srun",
        &[
            "-n",
            "1",
            "-c",
            "1",
            &format!("--container-image={}", image()),
            "sh",
            "-c",
            "echo cpuset=$(cat /sys/fs/cgroup/cpuset/cpuset.cpus); \
             grep Cpus_allowed_list /proc/self/status; \
             grep -qx $$ /sys/fs/cgroup/cpuset/tasks && echo listed; \
             touch /sys/fs/cgroup/cpuset/x 2>/dev/null || echo read-only",
        ],
    )));
    let cpuset = out
        .lines()
        .find_map(|l| l.strip_prefix("cpuset="))
        .unwrap_or_else(|| panic!("{out}"))
        .to_string();
    assert!(!cpuset.is_empty(), "{out}");
    assert!(
        out.contains(&format!("Cpus_allowed_list:\t{cpuset}")),
        "the step's cpuset is not what the task runs on: {out}"
    );
    assert!(
        out.contains("listed"),
        "the task is not in the shown cgroup: {out}"
    );
    assert!(out.contains("read-only"), "{out}");
}

/// The cluster's scratch root (`[scratch] root` of the harness's berth.toml).
fn scratch_root() -> PathBuf {
    cluster().state.join("berth/scratch")
}

/// A directory under the cluster's working directory owned by the test user, holding `files`.
fn user_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let (uid, gid, _) = test_user();
    let dir = cluster().cwd.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (f, text) in files {
        std::fs::write(dir.join(f), text).unwrap();
        std::os::unix::fs::chown(dir.join(f), Some(uid), Some(gid)).unwrap();
    }
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    dir
}

/// Submits `body` as a batch script of the test user with `directives` and waits for the
/// job's end; returns sbatch's output, the job id and the job's output file.
fn sbatch_as_user(name: &str, directives: &[String], body: &str) -> (Output, String, PathBuf) {
    let dir = user_dir(name, &[]);
    let output = dir.join("job.out");
    let script = dir.join("job.sh");
    let mut text = format!("#!/bin/sh\n#SBATCH --output={}\n", output.display());
    for d in directives {
        text.push_str(&format!("#SBATCH {d}\n"));
    }
    text.push_str(body);
    std::fs::write(&script, text).unwrap();
    let o = run(slurm_as_user(
        "sbatch",
        &["--wait", "--parsable", script.to_str().unwrap()],
    ));
    let job = stdout(&o)
        .trim()
        .split(';')
        .next()
        .unwrap_or("")
        .to_string();
    (o, job, output)
}

/// Waits (15 s at most) until `path` is gone: the Epilog runs after the job's last step.
fn wait_gone(path: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while path.exists() {
        assert!(Instant::now() < deadline, "{what} left: {}", path.display());
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn node_states() -> String {
    stdout(&run(slurm("sinfo", &["-h", "-N", "-o", "%T"])))
}

/// The node's states once no Epilog is running any more (or after 30 s): srun returns before
/// its job's Epilog has finished.
fn settled_node_states() -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let states = node_states();
        if !states.contains("completing") || Instant::now() > deadline {
            return states;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn stage_in_and_out_through_sbatch_with_and_without_a_container() {
    let (uid, _, _) = test_user();
    let data = user_dir("stage-src", &[("f", "staged-data\n"), ("g", "more\n")]);
    let out = user_dir("stage-dst", &[]);
    let script = format!(
        "echo batch: $(cat $BERTH_SCRATCH/data/f)\n\
         srun sh -c 'echo step: $(cat $BERTH_SCRATCH/data/g)'\n\
         srun --container-image={} sh -c 'echo container: $BERTH_SCRATCH $(cat /scratch/data/f); \
         mkdir -p /scratch/results && echo result-$SLURM_JOB_ID > /scratch/results/r'\n\
         echo scratch=$BERTH_SCRATCH\n",
        image()
    );
    let (o, job, output) = sbatch_as_user(
        "stage-job",
        &[
            format!("--stage-in={}:data", data.display()),
            format!("--stage-out=results:{}", out.display()),
        ],
        &script,
    );
    let text = std::fs::read_to_string(&output).unwrap_or_default();
    assert!(o.status.success(), "job failed: {}\n{text}", stderr(&o));
    assert!(text.contains("batch: staged-data"), "{text}");
    assert!(text.contains("step: more"), "{text}");
    assert!(text.contains("container: /scratch staged-data"), "{text}");
    let scratch = scratch_root().join(&job);
    assert!(
        text.contains(&format!("scratch={}", scratch.display())),
        "{text}"
    );
    // Stage-out runs in the Epilog, as the user.
    let result = out.join("r");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !result.exists() {
        assert!(Instant::now() < deadline, "no stage-out: {text}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        std::fs::read_to_string(&result).unwrap(),
        format!("result-{job}\n")
    );
    let meta = std::fs::metadata(&result).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
    wait_gone(&scratch, "the job's scratch");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_failed_stage_out_keeps_the_results_and_tells_the_user_where() {
    let (uid, _, _) = test_user();
    // Root's, 0755: the user cannot write into it.
    let dest = cluster()
        .cwd
        .join(format!("not-writable-{}", std::process::id()));
    std::fs::create_dir_all(&dest).unwrap();
    let (o, job, output) = sbatch_as_user(
        "stage-out-fails",
        &[format!("--stage-out=results:{}", dest.display())],
        "mkdir $BERTH_SCRATCH/results && echo precious > $BERTH_SCRATCH/results/r\n",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let deadline = Instant::now() + Duration::from_secs(15);
    let line = loop {
        let text = std::fs::read_to_string(&output).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains("berth:")) {
            break l.to_string();
        }
        assert!(Instant::now() < deadline, "the user was not told: {text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        line.contains(&format!("job {job}: stage-out of results")),
        "{line}"
    );
    let kept = line
        .split("kept in ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no path in {line}"));
    assert!(kept.starts_with(scratch_root().join("retained")), "{line}");
    assert_eq!(
        std::fs::read_to_string(kept.join("results/r")).unwrap(),
        "precious\n"
    );
    let meta = std::fs::metadata(&kept).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
    assert!(!dest.join("r").exists());
    assert!(!scratch_root().join(&job).exists());
    // The user reaches it by its path (the retention area is 0711).
    let o = run(slurm_as_user(
        "cat",
        &[kept.join("results/r").to_str().unwrap()],
    ));
    assert_eq!(stdout(&o), "precious\n", "{}", stderr(&o));
    std::fs::remove_dir_all(&kept).unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_unreadable_stage_in_fails_the_job_with_one_line_and_not_the_node() {
    // Root's, 0700.
    let secret = cluster().cwd.join(format!("secret-{}", std::process::id()));
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::write(secret.join("f"), "x").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let (o, job, output) = sbatch_as_user(
        "stage-in-fails",
        &[format!("--stage-in={}:data", secret.display())],
        "echo RAN\n",
    );
    assert!(!o.status.success(), "the job succeeded");
    let text = std::fs::read_to_string(&output).unwrap_or_default();
    assert!(!text.contains("RAN"), "{text}");
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("berth:")).collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert!(
        lines[0].contains(&format!("job {job}: stage-in of {}", secret.display())),
        "{text}"
    );
    assert!(lines[0].contains("Permission denied"), "{text}");
    // srun allocating its own job: the line on the terminal.
    let o = run(slurm_as_user(
        "srun",
        &[&format!("--stage-in={}", secret.display()), "echo", "RAN"],
    ));
    assert!(!o.status.success());
    assert!(!stdout(&o).contains("RAN"));
    let berth: Vec<String> = errors(&o)
        .into_iter()
        .filter(|l| l.contains("berth:"))
        .collect();
    assert_eq!(berth.len(), 1, "{}", stderr(&o));
    assert!(berth[0].contains("stage-in of"), "{}", berth[0]);
    wait_gone(&scratch_root().join(&job), "the failed job's scratch");
    // Once the last job's Epilog is done, the node is idle again: not drained, no reason set.
    let states = settled_node_states();
    assert!(
        states.lines().all(|s| s.trim() == "idle"),
        "the node is not idle: {states}"
    );
    let reasons = stdout(&run(slurm("sinfo", &["-h", "-R"])));
    assert!(reasons.trim().is_empty(), "a drain reason: {reasons}");
    assert!(
        !scratch_root()
            .join(format!("{job}.stage-in-failed"))
            .exists()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn scratch_of_jobs_that_ended_without_an_epilog_is_reclaimed_but_a_running_jobs_is_not() {
    let (uid, gid, _) = test_user();
    let root = scratch_root();
    // As an Epilog that never ran would leave it: a job id Slurm does not know.
    let stale = root.join("987654");
    std::fs::create_dir_all(stale.join("sub")).unwrap();
    std::os::unix::fs::chown(&stale, Some(uid), Some(gid)).unwrap();
    // A running job, held until the flag file exists.
    let flag = user_dir("hold", &[]).join("go");
    let dir = user_dir("running", &[]);
    let script = dir.join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nwhile [ ! -e {} ]; do sleep 0.2; done\n",
            flag.display()
        ),
    )
    .unwrap();
    let o = run(slurm_as_user(
        "sbatch",
        &[
            "--parsable",
            &format!("--output={}", dir.join("out").display()),
            script.to_str().unwrap(),
        ],
    ));
    let running = succeeded(o).trim().to_string();
    let mine = root.join(&running);
    let deadline = Instant::now() + Duration::from_secs(15);
    while !mine.exists() {
        assert!(Instant::now() < deadline, "job {running} has no scratch");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The next job's Prolog reclaims what no job runs in.
    succeeded(run(slurm_as_user("srun", &["true"])));
    assert!(!stale.exists(), "the ended job's scratch was not reclaimed");
    assert!(mine.exists(), "the running job's scratch was removed");
    std::fs::write(&flag, "").unwrap();
    wait_gone(&mine, "the held job's scratch");
    // berth gc too.
    std::fs::create_dir_all(&stale).unwrap();
    let out = Command::new(BERTH)
        .args(["--config"])
        .arg(format!(
            "/tmp/berth-root-slurm-{:08x}.toml",
            checkout_hash()
        ))
        .arg("gc")
        .env("SLURM_CONF", &cluster().conf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("reclaimed the scratch of ended job 987654"),
        "{}",
        stdout(&out)
    );
    assert!(!stale.exists());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn srun_help_describes_the_staging_options() {
    let help = succeeded(run(slurm("srun", &["--help"])));
    for flag in ["--stage-in=", "--stage-out="] {
        assert!(help.contains(flag), "srun --help lacks {flag}:\n{help}");
    }
}

fn mknod_char(path: &Path, major: u32, minor: u32) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mknod reads the NUL-terminated path `c`, alive for the call.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    assert_eq!(rc, 0, "mknod {}", path.display());
}

fn put(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn link(target: &str, path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(target, path).unwrap();
}

/// A fixture node for `topology.host_root`: this host's CPUs 0-1 on two NUMA nodes the other way
/// round (node 0 holds CPU 1, node 1 holds CPU 0), GPU 0 on node 0 and GPU 1 on node 1, one HCA,
/// and stand-in device nodes (real character devices: nvidia0 = /dev/null's numbers, nvidia1 =
/// zero's, nvidiactl = full's, uverbs0 = random's, rdma_cm = urandom's). A planned rank 0 thus
/// runs on CPU 1, which Slurm would not pick for it.
fn topology_fixture(root: &Path) {
    put(&root.join("sys/devices/system/cpu/online"), "0-1\n");
    put(&root.join("sys/devices/system/node/node0/cpulist"), "1\n");
    put(&root.join("sys/devices/system/node/node1/cpulist"), "0\n");
    let pci = |rel: &str, class: &str, vendor: &str, numa: &str| {
        let dir = root.join("sys/devices").join(rel);
        for (name, value) in [
            ("class", class),
            ("vendor", vendor),
            ("device", "0x2330"),
            ("numa_node", numa),
            ("current_link_speed", "32.0 GT/s PCIe"),
            ("current_link_width", "16"),
            ("max_link_speed", "32.0 GT/s PCIe"),
            ("max_link_width", "16"),
        ] {
            put(&dir.join(name), &format!("{value}\n"));
        }
        let bdf = rel.rsplit('/').next().unwrap();
        link(
            &format!("../../../devices/{rel}"),
            &root.join("sys/bus/pci/devices").join(bdf),
        );
    };
    pci(
        "pci0000:00/0000:00:01.0/0000:01:00.0",
        "0x030200",
        "0x10de",
        "0",
    );
    pci(
        "pci0000:80/0000:80:01.0/0000:81:00.0",
        "0x030200",
        "0x10de",
        "1",
    );
    let hca = "pci0000:00/0000:00:03.0/0000:03:00.0";
    pci(hca, "0x020700", "0x15b3", "0");
    let ib = root.join(format!("sys/devices/{hca}/infiniband/mlx5_0"));
    put(&ib.join("ports/1/state"), "4: ACTIVE\n");
    link("../..", &ib.join("device"));
    link(
        &format!("../../devices/{hca}/infiniband/mlx5_0"),
        &root.join("sys/class/infiniband/mlx5_0"),
    );
    put(
        &root.join("sys/class/infiniband_verbs/uverbs0/ibdev"),
        "mlx5_0\n",
    );
    put(
        &root.join("sys/class/infiniband_verbs/uverbs0/dev"),
        "231:192\n",
    );
    for (bdf, minor) in [("0000:01:00.0", 0), ("0000:81:00.0", 1)] {
        put(
            &root.join(format!("proc/driver/nvidia/gpus/{bdf}/information")),
            &format!(
                "Model: \t Stand-in\nGPU UUID: \t GPU-{minor:08x}-slurm\nDevice Minor: \t {minor}\n"
            ),
        );
    }
    put(
        &root.join("proc/devices"),
        "Character devices:\n195 nvidia-frontend\n",
    );
    mknod_char(&root.join("dev/nvidia0"), 1, 3);
    mknod_char(&root.join("dev/nvidia1"), 1, 5);
    mknod_char(&root.join("dev/nvidiactl"), 1, 7);
    mknod_char(&root.join("dev/infiniband/uverbs0"), 1, 8);
    mknod_char(&root.join("dev/infiniband/rdma_cm"), 1, 9);
}

/// The cluster's berth configuration with `extra` appended, until dropped (berth reads its
/// configuration at every call, so the following steps see it). Changed only while no Epilog
/// runs, so that no other job's Epilog reads it.
struct ConfigWith {
    path: PathBuf,
    original: String,
}

impl ConfigWith {
    fn new(extra: &str) -> Self {
        cluster();
        let path = PathBuf::from(format!(
            "/tmp/berth-root-slurm-{:08x}.toml",
            checkout_hash()
        ));
        let original = std::fs::read_to_string(&path).unwrap();
        settled_node_states();
        std::fs::write(&path, format!("{original}{extra}")).unwrap();
        Self { path, original }
    }
}

impl Drop for ConfigWith {
    fn drop(&mut self) {
        settled_node_states();
        let _ = std::fs::write(&self.path, &self.original);
    }
}

/// One line per task: its local id, CPUs (from inside the container), variables and GPU nodes.
const PLACEMENT: &str = "echo \"rank=$SLURM_LOCALID cpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2) \
cuda=$CUDA_VISIBLE_DEVICES ucx=$UCX_NET_DEVICES nccl=$NCCL_IB_HCA dev=$(cd /dev && ls -d nvidia* infiniband/* 2>/dev/null | tr '\\n' ' ')\"";

fn placements(out: &str) -> Vec<String> {
    let mut lines: Vec<String> = out
        .lines()
        .filter(|l| l.starts_with("rank="))
        .map(|l| l.trim_end().to_string())
        .collect();
    lines.sort();
    lines
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn container_bind_pins_each_task_to_its_planned_cpus_gpus_and_nics() {
    let fx = tempfile::tempdir().unwrap();
    topology_fixture(fx.path());
    // The fixture's GPUs have no NVML: berth epilog's health checks would drain the node.
    let _config = ConfigWith::new(&format!(
        "[topology]\nhost_root = \"{}\"\nepilog_health = false\n",
        fx.path().display()
    ));
    let srun = |bind: Option<&str>, gpus: &str, tasks: &str| {
        let mut args = vec![
            "-n".to_string(),
            tasks.to_string(),
            format!("--container-image={}", image()),
        ];
        args.extend(bind.map(|b| format!("--container-bind={b}")));
        args.extend(["sh".into(), "-c".into(), PLACEMENT.into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = slurm("srun", &args);
        // Slurm leaves a SLURM_JOB_GPUS it did not set itself alone (no GRES here): it stands
        // for the allocation of a GPU node.
        cmd.env("SLURM_JOB_GPUS", gpus);
        placements(&succeeded(run(cmd)))
    };

    // closest (the default): rank 0 has GPU 0 on NUMA node 0, whose CPU is 1; rank 1 the
    // other way round. Both GPUs' nodes are in the container, and the HCA.
    let closest = srun(None, "0,1", "2");
    assert_eq!(
        closest,
        [
            "rank=0 cpus=1 cuda=0 ucx=mlx5_0:1 nccl==mlx5_0 dev=infiniband/rdma_cm infiniband/uverbs0 nvidia0 nvidia1 nvidiactl",
            "rank=1 cpus=0 cuda=1 ucx=mlx5_0:1 nccl==mlx5_0 dev=infiniband/rdma_cm infiniband/uverbs0 nvidia0 nvidia1 nvidiactl",
        ],
        "{closest:?}"
    );
    assert_eq!(srun(Some("closest"), "0,1", "2"), closest);

    // none: Slurm's placement and the container's variables for the whole step.
    let none = srun(Some("none"), "0,1", "2");
    assert_eq!(none.len(), 2, "{none:?}");
    for (line, rank) in none.iter().zip(["0", "1"]) {
        assert!(line.starts_with(&format!("rank={rank} cpus=")), "{none:?}");
        assert!(
            line.contains(" cuda=0,1 ucx= nccl= dev=infiniband/rdma_cm infiniband/uverbs0 nvidia0 nvidia1 nvidiactl"),
            "{none:?}"
        );
    }
    // Slurm's task affinity here puts rank 0 on CPU 0 (or both on 0-1), never where berth does.
    assert!(!none[0].starts_with("rank=0 cpus=1 "), "{none:?}");
    assert!(!none[1].starts_with("rank=1 cpus=0 "), "{none:?}");

    // One GPU: only its node (and the control node, the HCA paired with it).
    let one = srun(None, "1", "1");
    assert_eq!(
        one,
        [
            "rank=0 cpus=0 cuda=0 ucx=mlx5_0:1 nccl==mlx5_0 dev=infiniband/rdma_cm infiniband/uverbs0 nvidia1 nvidiactl"
        ],
        "{one:?}"
    );
}

/// Resumes the cluster's node when dropped.
struct ResumeNode;

impl Drop for ResumeNode {
    fn drop(&mut self) {
        let node = stdout(&run(slurm("sinfo", &["-h", "-N", "-o", "%N"])));
        let _ = run(slurm(
            "scontrol",
            &[
                "update",
                &format!("nodename={}", node.trim()),
                "state=resume",
            ],
        ));
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_unfit_node_is_drained_with_the_health_checks_reason() {
    // One GPU on the PCI bus that no driver answers for.
    let fx = tempfile::tempdir().unwrap();
    put(&fx.path().join("sys/devices/system/cpu/online"), "0-1\n");
    let gpu = "pci0000:00/0000:00:01.0/0000:01:00.0";
    for (name, value) in [
        ("class", "0x030200"),
        ("vendor", "0x10de"),
        ("device", "0x2330"),
        ("numa_node", "-1"),
    ] {
        put(
            &fx.path().join("sys/devices").join(gpu).join(name),
            &format!("{value}\n"),
        );
    }
    link(
        &format!("../../../devices/{gpu}"),
        &fx.path().join("sys/bus/pci/devices/0000:01:00.0"),
    );
    let _resume = ResumeNode;
    // An earlier test's job whose Epilog read the fixture's config would drain the node before
    // this test's job (ConfigWith waits for Epilogs to end).
    let states = settled_node_states();
    assert!(
        states.lines().all(|s| s.trim() == "idle"),
        "the node is not idle: {states}"
    );
    {
        let _config = ConfigWith::new(&format!(
            "[topology]\nhost_root = \"{}\"\n",
            fx.path().display()
        ));
        // --immediate: fail rather than wait if the node is not available after all.
        succeeded(run(slurm("srun", &["--immediate=60", "true"])));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let reasons = stdout(&run(slurm("sinfo", &["-h", "-R", "-o", "%E"])));
            if reasons.contains("NVIDIA GPUs but NVML cannot load") {
                assert_eq!(
                    reasons.trim(),
                    "1 NVIDIA GPUs but NVML cannot load (recorded: no driver): install or load the NVIDIA driver",
                    "the drain reason is berth's one line"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the node was not drained with the health reason: {reasons:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A second cluster with two slurmd on this host (start.sh --nodes 2), for multi-node steps;
/// started on first use, stopped at exit. Shares the first cluster's berth configuration.
struct TwoNodes {
    conf: PathBuf,
}

fn two_nodes() -> &'static TwoNodes {
    static TWO: OnceLock<TwoNodes> = OnceLock::new();
    TWO.get_or_init(|| {
        // The first cluster builds the plugin and writes berth's configuration.
        let _ = cluster();
        let hash = checkout_hash();
        let state = PathBuf::from(format!("/tmp/berth-root-slurm2-{hash:08x}"));
        let port = 20000 + (hash % 500) * 4;
        extern "C" fn stop_two() {
            let state = format!("/tmp/berth-root-slurm2-{:08x}", checkout_hash());
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(state)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
        // SAFETY: registering a plain function to run at process exit.
        unsafe { libc::atexit(stop_two) };
        let berth = PathBuf::from(BERTH);
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .args(["--nodes", "2"])
            .arg("--plugin")
            .arg(berth.parent().unwrap().join("libspank_berth.so"))
            .arg("--berth")
            .arg(&berth)
            .env("BERTH_SLURM_PORT", port.to_string())
            .output()
            .expect("running integration/slurm/start.sh --nodes 2");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh --nodes 2 failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        TwoNodes {
            conf: state.join("etc/slurm.conf"),
        }
    })
}

/// A Slurm client of the two-node cluster, as root or the test user, bounded by `timeout` so
/// that a hung step fails the test instead of blocking the tier.
fn two_node_client(as_user: bool, cmd: &str, args: &[&str]) -> Command {
    let t = two_nodes();
    let mut command = Command::new("timeout");
    command.args(["-k", "5", "120"]);
    if as_user {
        let _ = test_user();
        command.args(["runuser", "-u", "berthtest", "--"]);
    }
    command
        .arg(cmd)
        .args(args)
        .env("SLURM_CONF", &t.conf)
        .env_remove("BERTH_CONTAINER_IMAGE")
        .env_remove("PYXIS_CONTAINER_IMAGE")
        .current_dir(&cluster().cwd)
        .stdin(std::process::Stdio::null());
    command
}

/// The two nodes' states once their Epilogs are done (30 s at most).
fn two_node_states() -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = run(two_node_client(
            false,
            "sinfo",
            &["-h", "-N", "-o", "%N %T %E"],
        ));
        let states = stdout(&out);
        if !states.contains("completing") || Instant::now() > deadline {
            return states;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `srun -N2 --container-name=…`: each node has a container of that name of its own, which
/// the next step on that node joins (the harness gives each slurmd its own berth state
/// directory, as separate hosts have), and each node's Epilog removes its own; one already gone
/// is done, not a failure that drains the node.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_named_container_on_two_nodes_is_each_nodes_own_and_drains_neither() {
    let script = format!(
        "srun -N2 --container-name=twonode --container-image={img} sh -c 'echo $SLURMD_NODENAME > /tmp/made-on' && \
         srun -N2 --container-name=twonode sh -c 'echo \"$SLURMD_NODENAME has $(cat /tmp/made-on)\"'",
        img = image()
    );
    let out = run(two_node_client(
        false,
        "salloc",
        &["-Q", "-N2", "sh", "-c", &script],
    ));
    let text = format!("{}\n{}", stdout(&out), stderr(&out));
    assert!(
        out.status.success(),
        "salloc failed ({:?}):\n{text}",
        out.status
    );
    let mut lines: Vec<String> = stdout(&out).lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{text}");
    for line in &lines {
        let words: Vec<&str> = line.split(' ').collect();
        assert!(
            words.len() == 3 && words[0] == words[2],
            "a node's step saw another node's container: {line}\n{text}"
        );
    }
    assert_ne!(lines[0], lines[1], "{text}");
    let states = two_node_states();
    assert!(
        !states.contains("drain"),
        "a node was drained after the job:\n{states}"
    );
    assert_eq!(states.lines().count(), 2, "{states}");
}

/// `srun --mpi=pmix -N2` of the MPI program, one rank per node, as root or as the test user.
fn mpi_allreduce_on_two_nodes(as_user: bool) {
    let image = format!("--container-image={}", mpi_image());
    let out = run(two_node_client(
        as_user,
        "srun",
        &[
            "--mpi=pmix",
            "-N2",
            "-n2",
            image.as_str(),
            "/usr/local/bin/allreduce",
        ],
    ));
    let text = format!("{}\n{}", stdout(&out), stderr(&out));
    assert!(
        out.status.success(),
        "srun failed ({:?}):\n{text}",
        out.status
    );
    for rank in 0..2 {
        assert!(
            text.contains(&format!("rank {rank} of 2: sum 3")),
            "rank {rank}: {text}"
        );
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mpi_ranks_on_two_nodes_reach_each_other_as_root() {
    mpi_allreduce_on_two_nodes(false);
}

/// Each node's rank gets its own node's PMIx app directory (TmpFS/%n), not the other's.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mpi_ranks_on_two_nodes_reach_each_other_as_a_user() {
    mpi_allreduce_on_two_nodes(true);
}
