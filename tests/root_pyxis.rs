//! Root tier: what Pyxis users' job scripts rely on (issue 20), on a real one-host Slurm of this
//! file's own (integration/slurm/start.sh with its own state directory and free ports, started
//! once per test binary, stopped at exit) with `pyxis_messages=1`, and a loopback registry.
//! Run by integration/test.sh as root:
//! `cargo test --test root_pyxis -- --ignored --test-threads=1`. `BERTH_TEST_BIN` and
//! `BERTH_TEST_PLUGIN` run it against an older berth binary and SPANK plugin;
//! `BERTH_TEST_PYXIS_STATE` gives the cluster another state directory.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use common::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Distinct from tests/root_slurm.rs's cluster (another hash input), per checkout.
fn checkout_hash() -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&(env!("CARGO_MANIFEST_DIR"), "root_pyxis"), &mut h);
    u32::try_from(std::hash::Hasher::finish(&h) & u64::from(u32::MAX)).unwrap()
}

fn state_path() -> PathBuf {
    // Another directory for a run beside one from the same checkout (start.sh restarts the
    // cluster of a state directory, and each run writes its own berth.toml there).
    if let Some(dir) = std::env::var_os("BERTH_TEST_PYXIS_STATE") {
        return PathBuf::from(dir);
    }
    PathBuf::from(format!("/tmp/berth-root-pyxis-{:08x}", checkout_hash()))
}

struct Cluster {
    state: PathBuf,
    conf: PathBuf,
    /// A directory every user can use as the working directory of srun.
    cwd: PathBuf,
    /// `HOST:PORT` of a plain-HTTP registry holding `test/busybox:1`.
    registry: String,
    /// The berth configuration the cluster's nodes use.
    berth_config: PathBuf,
}

static REGISTRY_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn start_registry(state: &Path) -> String {
    use harness::{Compression, Entry, Registry, Uploader};
    let registry = Registry::start(
        &harness::Mode::Plain,
        &state.join("registry/storage"),
        &state.join("registry"),
    );
    let up = Uploader::new(&registry.host(), None);
    let mut entries = harness::busybox_entries("amd64");
    entries.push(Entry::File(
        "etc/os-release".into(),
        b"PRETTY_NAME=\"busybox from the pyxis test registry\"\n".to_vec(),
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
    std::mem::forget(registry);
    host
}

/// Two consecutive free TCP ports on the loopback (slurmctld's and slurmd's).
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let p = harness::free_port();
        if p < 65000 && std::net::TcpListener::bind(("0.0.0.0", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports found");
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let berth = PathBuf::from(berth_bin());
        let built = PathBuf::from(BERTH);
        let profile_dir = built.parent().unwrap();
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "-p", "berth-spank"]);
        if profile_dir.file_name().and_then(|n| n.to_str()) == Some("release") {
            build.arg("--release");
        }
        let status = build
            .current_dir(repo())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("running cargo");
        assert!(status.success(), "building the SPANK plugin failed");
        // $BERTH_TEST_PLUGIN: an older build of the plugin, to show that a test fails without
        // the fix it covers (as $BERTH_TEST_BIN for the binary).
        let plugin = std::env::var_os("BERTH_TEST_PLUGIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| profile_dir.join("libspank_berth.so"));

        let state = state_path();
        let berth_config = PathBuf::from(format!("{}.toml", state.display()));
        let registry_dir = PathBuf::from(format!("{}-registry", state.display()));
        let _ = std::fs::remove_dir_all(&registry_dir);
        let registry = start_registry(&registry_dir);
        std::fs::write(
            &berth_config,
            format!(
                "[cgroup]\nroot = \"{}-pyxis\"\n[runtime]\nstate_dir = \"{s}/berth/state\"\n\
                 [store]\nroot = \"{s}/berth/store\"\n[squashfs]\nmount_dir = \"{s}/berth/images\"\n\
                 [scratch]\nroot = \"{s}/berth/scratch\"\n\
                 [registry]\ninsecure = [\"{registry}\"]\n",
                cgroup_root(),
                s = state.display(),
            ),
        )
        .unwrap();
        extern "C" fn stop_cluster() {
            let pid = REGISTRY_PID.load(std::sync::atomic::Ordering::Relaxed);
            if pid > 0 {
                // SAFETY: killing the registry this process started.
                unsafe { libc::kill(i32::try_from(pid).unwrap(), libc::SIGKILL) };
            }
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(state_path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
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
            .args(["--plugstack-arg", "pyxis_messages=1"])
            .env("BERTH_SLURM_PORT", free_port_pair().to_string())
            .stdin(Stdio::null())
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
        std::fs::set_permissions(&cwd, std::fs::Permissions::from_mode(0o1777)).unwrap();
        Cluster {
            conf: state.join("etc/slurm.conf"),
            state,
            cwd,
            registry,
            berth_config,
        }
    })
}

/// A Slurm client command as root, from the cluster's shared working directory (PWD set as a
/// shell sets it).
fn slurm(cmd: &str, args: &[&str]) -> Command {
    let c = cluster();
    let mut command = Command::new(cmd);
    command
        .args(args)
        .env("SLURM_CONF", &c.conf)
        .env_remove("BERTH_CONTAINER_IMAGE")
        .env_remove("PYXIS_CONTAINER_IMAGE")
        .env("PWD", &c.cwd)
        .current_dir(&c.cwd)
        .stdin(Stdio::null());
    command
}

/// The user of these tests: berthpyxis, with a home directory of its own.
fn pyxis_user() -> (u32, u32, PathBuf) {
    static USER: OnceLock<(u32, u32, PathBuf)> = OnceLock::new();
    USER.get_or_init(|| {
        let home = PathBuf::from("/var/tmp/berthpyxis-home");
        if !Command::new("id")
            .arg("berthpyxis")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
        {
            let out = Command::new("useradd")
                .args(["-M", "-s", "/bin/sh", "-d"])
                .arg(&home)
                .arg("berthpyxis")
                .output()
                .unwrap();
            assert!(out.status.success(), "useradd: {}", stderr(&out));
        }
        let id = |flag: &str| -> u32 {
            let out = Command::new("id")
                .args([flag, "berthpyxis"])
                .output()
                .unwrap();
            stdout(&out).trim().parse().unwrap()
        };
        let (uid, gid) = (id("-u"), id("-g"));
        std::fs::create_dir_all(&home).unwrap();
        std::os::unix::fs::chown(&home, Some(uid), Some(gid)).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        (uid, gid, home)
    })
    .clone()
}

/// A Slurm client command as berthpyxis, from `cwd` (runuser keeps SLURM_CONF and PWD).
fn slurm_as_user_in(cwd: &Path, cmd: &str, args: &[&str]) -> Command {
    let _ = pyxis_user();
    let mut command = slurm("runuser", &["-u", "berthpyxis", "--", cmd]);
    command.args(args).env("PWD", cwd).current_dir(cwd);
    command
}

fn run(mut cmd: impl std::borrow::BorrowMut<Command>) -> Output {
    cmd.borrow_mut().output().expect("running a Slurm client")
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

fn image() -> String {
    format!("--container-image={}", rootfs().display())
}

/// The Debian minbase image with Open MPI (integration/slurm/mpi-image.sh, cached).
fn debian_image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/mpi-image.sh"))
            .stdin(Stdio::null())
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

/// A directory of berthpyxis's under the cluster's state, with `files` in it.
fn user_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let (uid, gid, _) = pyxis_user();
    let dir = cluster().state.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (path, text) in files {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    }
    chown_tree(&dir, uid, gid);
    dir
}

fn chown_tree(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).unwrap();
    if path.is_dir() && !path.is_symlink() {
        for e in std::fs::read_dir(path).unwrap() {
            chown_tree(&e.unwrap().path(), uid, gid);
        }
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_submitting_shells_locale_stays_out_of_the_container_unless_named() {
    // perl in a Debian image without that locale warns on every start when it gets it.
    let img = format!("--container-image={}", debian_image());
    let script = "echo \"L=${LANG-unset} A=${LC_ALL-unset} G=${LANGUAGE-unset}\"; perl -e 'print qq(perl ok\\n)'";
    let locale = |mut c: Command| -> Output {
        c.env("LANG", "de_DE.UTF-8")
            .env("LC_ALL", "de_DE.UTF-8")
            .env("LANGUAGE", "de_DE:de");
        run(c)
    };
    let out = locale(slurm("srun", &[&img, "sh", "-c", script]));
    let text = succeeded(out.clone());
    assert!(text.contains("L=unset A=unset G=unset"), "{text}");
    assert!(text.contains("perl ok"), "{text}");
    assert!(
        !stderr(&out).contains("Setting locale failed"),
        "{}",
        stderr(&out)
    );
    // Named, it passes (and perl warns, as it would under Pyxis).
    let out = locale(slurm(
        "srun",
        &[&img, "--container-env=LANG", "sh", "-c", script],
    ));
    let text = succeeded(out);
    assert!(text.contains("L=de_DE.UTF-8 A=unset G=unset"), "{text}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn pmix_mca_variables_are_derived_from_slurms() {
    let out = succeeded(run(slurm(
        "srun",
        &[
            &image(),
            "sh",
            "-c",
            "echo psec=${PMIX_MCA_psec-unset} gds=${PMIX_MCA_gds-unset} ptl=${PMIX_MCA_ptl-unset}",
        ],
    )
    .env("PMIX_SECURITY_MODE", "native")
    .env("PMIX_GDS_MODULE", "ds21,ds12,hash")));
    assert!(
        out.contains("psec=native gds=ds21,ds12,hash ptl=unset"),
        "{out}"
    );
    // A value the user set is kept.
    let out = succeeded(run(slurm(
        "srun",
        &[&image(), "sh", "-c", "echo psec=$PMIX_MCA_psec"],
    )
    .env("PMIX_SECURITY_MODE", "native")
    .env("PMIX_MCA_psec", "none")));
    assert!(out.contains("psec=none"), "{out}");
    // Under Slurm's PMIx plugin: whatever its server sets, the MCA names carry it.
    let out = succeeded(run(slurm(
        "srun",
        &[
            "--mpi=pmix",
            &image(),
            "sh",
            "-c",
            "echo \"mode=${PMIX_SECURITY_MODE-unset} psec=${PMIX_MCA_psec-unset} \
             gdsmod=${PMIX_GDS_MODULE-unset} gds=${PMIX_MCA_gds-unset}\"",
        ],
    )));
    let line = out.lines().find(|l| l.starts_with("mode=")).unwrap();
    let field = |k: &str| {
        line.split(' ')
            .find_map(|f| f.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_string()
    };
    assert_eq!(field("psec"), field("mode"), "{line}");
    assert_eq!(field("gds"), field("gdsmod"), "{line}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn docker_style_references_pull_from_the_registry_they_name() {
    let c = cluster();
    for reference in [
        format!("{}/test/busybox:1", c.registry),
        format!("{}#test/busybox:1", c.registry),
    ] {
        let out = succeeded(run(slurm(
            "srun",
            &[
                &format!("--container-image={reference}"),
                "busybox",
                "cat",
                "/etc/os-release",
            ],
        )));
        assert!(
            out.contains("busybox from the pyxis test registry"),
            "{reference}: {out}"
        );
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_failed_import_prints_pyxis_lines_and_berths_one_line() {
    let c = cluster();
    let reference = format!("{}#test/nonexistent:1", c.registry);
    let out = run(slurm(
        "srun",
        &[&format!("--container-image={reference}"), "true"],
    ));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&format!("pyxis: importing docker image: {reference}")),
        "{err}"
    );
    assert!(
        err.contains("pyxis: failed to import docker image"),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.contains("berth: ") && l.contains("test/nonexistent")),
        "{err}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn every_enroot_mount_flag_is_accepted_and_tmpfs_options_apply() {
    let dir = user_dir("flags", &[("f", "data\n")]);
    let mounts = format!(
        "--container-mounts={d}:/d:ro+rbind+rprivate+unbindable+runbindable+x-create=dir+nosuid+suid+dev,\
         {d}:/e:noexec+noatime+rslave,\
         tmpfs:/t:size=1m+huge=within_size+mode=700+noexec+noatime",
        d = dir.display()
    );
    let out = succeeded(run(slurm(
        "srun",
        &[
            &image(),
            &mounts,
            "sh",
            "-c",
            "cat /d/f; touch /d/x 2>/dev/null && echo d-writable; grep ' /t ' /proc/mounts; \
             grep ' /e ' /proc/mounts; grep ' /d ' /proc/mounts; \
             dd if=/dev/zero of=/t/big bs=1k count=2048 2>/dev/null && echo t-unbounded || echo t-full",
        ],
    )));
    assert!(out.contains("data"), "{out}");
    assert!(!out.contains("d-writable"), "{out}");
    let t = out.lines().find(|l| l.contains(" /t ")).unwrap();
    for opt in [
        "noatime",
        "size=1024k",
        "huge=within_size",
        "mode=700",
        "noexec",
        "nosuid",
        "nodev",
    ] {
        assert!(t.contains(opt), "{opt} missing: {t}");
    }
    assert!(out.contains("t-full"), "{out}");
    let e = out.lines().find(|l| l.contains(" /e ")).unwrap();
    assert!(e.contains("noexec"), "{e}");
    // suid and dev are never granted.
    let d = out.lines().find(|l| l.contains(" /d ")).unwrap();
    assert!(d.contains("nosuid") && d.contains("nodev"), "{d}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn relative_mounts_saves_and_workdirs_follow_pyxis() {
    let (uid, _, _) = pyxis_user();
    let dir = user_dir("relative", &[("data/f", "relative data\n")]);
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &[
            &image(),
            "--container-mounts=./data:/data,data:/data2:ro",
            "--container-save=./out.sqsh",
            "--container-workdir=etc",
            "sh",
            "-c",
            "cat /data/f /data2/f; pwd; touch /data/made",
        ],
    )));
    assert_eq!(out.matches("relative data").count(), 2, "{out}");
    assert!(out.lines().any(|l| l == "/etc"), "{out}");
    let made = std::fs::metadata(dir.join("data/made")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&made), uid);
    let saved = std::fs::metadata(dir.join("out.sqsh")).expect("the relative save path");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&saved), uid);
    // The user's credentials still decide: a relative source the user cannot read is refused.
    let secret = dir.join("secret");
    std::fs::create_dir(&secret).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();
    let out = run(slurm_as_user_in(
        &dir,
        "srun",
        &[&image(), "--container-mounts=./secret:/s", "true"],
    ));
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mount_home_with_remap_root_is_also_at_root() {
    let (_, _, home) = pyxis_user();
    std::fs::write(home.join(".marker"), "home marker\n").unwrap();
    let (uid, gid, _) = pyxis_user();
    std::os::unix::fs::chown(home.join(".marker"), Some(uid), Some(gid)).unwrap();
    let out = succeeded(run(slurm_as_user_in(
        &cluster().cwd,
        "srun",
        &[
            &image(),
            "--container-mount-home",
            "--container-remap-root",
            "sh",
            "-c",
            &format!("id -u; cat /root/.marker {}/.marker", home.display()),
        ],
    )));
    assert_eq!(out.lines().next(), Some("0"), "{out}");
    assert_eq!(out.matches("home marker").count(), 2, "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn steps_share_the_hosts_ipc_and_uts_namespaces_unless_unshared() {
    let host = |ns: &str| std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
    let (ipc, uts) = (host("ipc"), host("uts"));
    let script = "for n in ipc uts; do readlink /proc/self/ns/$n; done";
    let out = succeeded(run(slurm("srun", &[&image(), "sh", "-c", script])));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], ipc.to_str().unwrap(), "{out}");
    assert_eq!(lines[1], uts.to_str().unwrap(), "{out}");
    let out = succeeded(run(slurm(
        "srun",
        &[&image(), "--container-unshare=ipc,uts", "sh", "-c", script],
    )));
    let lines: Vec<&str> = out.lines().collect();
    assert_ne!(lines[0], ipc.to_str().unwrap(), "{out}");
    assert_ne!(lines[1], uts.to_str().unwrap(), "{out}");
    // System V IPC of the host reaches the step's tasks by default (MPI's shared memory
    // transports between containers and the host, as under Pyxis).
    let out = succeeded(run(slurm(
        "srun",
        &[
            &image(),
            "sh",
            "-c",
            "hostname; ls /dev/mqueue 2>&1 | head -1",
        ],
    )));
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(out.lines().next(), Some(hostname.trim()), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_sites_default_gives_every_step_its_own_ipc_and_uts() {
    let c = cluster();
    let strict = c.state.join("strict.toml");
    let base = std::fs::read_to_string(&c.berth_config).unwrap();
    std::fs::write(
        &strict,
        base.replace(
            "[runtime]\n",
            "[runtime]\nstep_unshare = [\"ipc\", \"uts\"]\n",
        ),
    )
    .unwrap();
    // `berth step create` as slurmstepd runs it, with a request as the plugin writes it.
    let request = serde_json::json!({
        "job_id": 990001, "step_id": 0, "uid": 0, "gid": 0, "local_task_count": 1,
        "options": {"container-image": rootfs().display().to_string(), "container-bind": "none"},
        "plugin": {"container_scope": "job", "execute_entrypoint": false, "sbatch_support": true},
        "job_env": ["PATH=/usr/bin:/bin"],
    });
    let create = |config: &Path| {
        let mut child = Command::new(berth_bin())
            .arg("--config")
            .arg(config)
            .args(["step", "create"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(request.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let destroy = Command::new(berth_bin())
            .arg("--config")
            .arg(config)
            .args(["step", "destroy", "--job-id", "990001", "--step-id", "0"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(destroy.status.success(), "{}", stderr(&destroy));
        let answer: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
        answer["namespaces"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    let strict_ns = create(&strict);
    assert!(
        strict_ns.contains(&"ipc".to_string()) && strict_ns.contains(&"uts".to_string()),
        "{strict_ns:?}"
    );
    let default_ns = create(&c.berth_config);
    assert!(
        !default_ns.contains(&"ipc".to_string()) && !default_ns.contains(&"uts".to_string()),
        "{default_ns:?}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_running_steps_container_is_joined_by_job_and_step_ids() {
    let (uid, gid, _) = pyxis_user();
    let dir = user_dir("attach", &[]);
    let out_file = dir.join("job.out");
    let ready = dir.join("ready");
    let script = format!(
        "#!/bin/sh\n\
         srun -n1 --overlap {img} --container-mounts={dir} sh -c 'echo first-step > /tmp/marker; touch {ready}; \
           while [ ! -e {dir}/done ]; do sleep 0.2; done' &\n\
         while [ ! -e {ready} ]; do sleep 0.2; done\n\
         srun -n1 --overlap --container-name=$SLURM_JOB_ID.0 --container-mounts={dir}:/m cat /tmp/marker\n\
         echo join=$?\n\
         srun -n1 --overlap --container-name=$SLURM_JOB_ID.0 --container-unshare=net true\n\
         echo unshare=$?\n\
         srun -n1 --overlap --container-name=$SLURM_JOB_ID.7 true\n\
         echo missing=$?\n\
         touch {dir}/done\n\
         wait\n",
        img = image(),
        ready = ready.display(),
        dir = dir.display(),
    );
    let script_path = dir.join("job.sh");
    std::fs::write(&script_path, script).unwrap();
    std::os::unix::fs::chown(&script_path, Some(uid), Some(gid)).unwrap();
    let out = run(slurm_as_user_in(
        &dir,
        "sbatch",
        &[
            "--wait",
            "-n1",
            "-o",
            &out_file.display().to_string(),
            &script_path.display().to_string(),
        ],
    ));
    let log = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert!(out.status.success(), "{}\n{log}", stderr(&out));
    assert!(log.contains("first-step\njoin=0"), "{log}");
    assert!(
        log.contains("ignoring --container-mounts"),
        "no warning: {log}"
    );
    assert!(log.contains("unshare=1"), "{log}");
    assert!(log.contains("--container-unshare=net"), "{log}");
    assert!(!log.contains("missing=0"), "{log}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_users_writable_container_owns_the_images_root_files_and_saves_them_as_roots() {
    // Issue 20, point 2: under Enroot the unpacked root is the user's, so `pip install` into the
    // image's system paths works without --container-remap-root.
    let (uid, gid, _) = pyxis_user();
    let img = format!("--container-image={}", debian_image());
    // A root-owned host file and directory, readable by everyone: bound in, they stay root's.
    let host = cluster().state.join("writable-host");
    let _ = std::fs::remove_dir_all(&host);
    std::fs::create_dir_all(host.join("dir")).unwrap();
    std::fs::write(host.join("file"), "root's host file\n").unwrap();
    for (p, mode) in [(host.clone(), 0o755), (host.join("dir"), 0o755)] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    std::fs::set_permissions(host.join("file"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let mounts = format!(
        "--container-mounts={h}/file:/hostfile,{h}/dir:/hostdir",
        h = host.display()
    );
    let dir = user_dir("writable", &[]);
    let saved = dir.join("saved.sqsh");
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &[
            &img,
            "--container-writable",
            &mounts,
            &format!("--container-save={}", saved.display()),
            "sh",
            "-c",
            "echo \"id $(id -u)\"; echo \"root $(stat -c '%u %g' /)\"; \
             echo \"lib $(stat -c %u /usr/lib)\"; \
             touch /newfile && echo top-ok; \
             mkdir -p /usr/lib/python3/dist-packages/berthpkg && \
             echo 'x = 1' > /usr/lib/python3/dist-packages/berthpkg/__init__.py && echo pip-ok; \
             echo x >> /hostfile 2>/dev/null && echo hostfile-writable; \
             touch /hostdir/x 2>/dev/null && echo hostdir-writable; \
             echo \"host $(stat -c %u /hostfile /hostdir | tr '\\n' ' ')\"; \
             grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; grep ' / ' /proc/self/mounts",
        ],
    )));
    let has = |line: &str| out.lines().any(|l| l == line);
    assert!(has(&format!("id {uid}")), "{out}");
    assert!(
        has(&format!("root {uid} {gid}")),
        "`/` is not the user's: {out}"
    );
    assert!(has(&format!("lib {uid}")), "{out}");
    assert!(has("top-ok") && has("pip-ok"), "{out}");
    assert!(!out.contains("hostfile-writable"), "{out}");
    assert!(!out.contains("hostdir-writable"), "{out}");
    // Root's on the host; nobody's inside (the container's user namespace maps the user alone).
    assert!(has("host 65534 65534 "), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    let root = out.lines().find(|l| l.contains(" / ")).unwrap();
    assert!(root.contains("nosuid") && root.contains("nodev"), "{root}");
    // The saved image keeps the image's root files root's; what the user wrote is saved as
    // root's too, as Enroot's export saves every file.
    let listing = Command::new("unsquashfs")
        .arg("-lln")
        .arg(&saved)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let listing = stdout(&listing);
    for path in [
        "newfile",
        "usr/lib/python3/dist-packages/berthpkg/__init__.py",
        "usr/lib",
        "usr/bin/perl",
    ] {
        let line = listing
            .lines()
            .find(|l| l.ends_with(&format!("squashfs-root/{path}")))
            .unwrap_or_else(|| panic!("{path} not in the saved image"));
        assert!(line.contains(" 0/0 "), "{path} is not root's: {line}");
    }
    assert!(
        !listing.contains(&format!(" {uid}/")),
        "the user's uid is in the saved image"
    );
    // A read-only container is unchanged: the image's system files are root's (nobody's in the
    // user's namespace, which maps the user alone), not the user's.
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &[&img, "--container-readonly", "stat", "-c", "%u", "/usr/lib"],
    )));
    assert_eq!(out.trim(), "65534", "{out}");
}

// --- --container-remap-root + apt-get install (issue 20, point 1) ---

/// A flat apt repository (`deb [trusted=yes] file:/repo ./`, no network) with one package,
/// berth-hello: /usr/bin/berth-hello, and /usr/share/berth-hello/daemons-file owned by uid and
/// gid 1 in the package, which dpkg chowns on install. Root's, readable by everyone.
fn apt_test_repo() -> &'static Path {
    static REPO: OnceLock<PathBuf> = OnceLock::new();
    REPO.get_or_init(|| {
        use sha2::Digest;
        let top = repo().join("target/root-tier/apt-repo");
        let _ = std::fs::remove_dir_all(&top);
        let pkg = top.join("build");
        for dir in ["DEBIAN", "usr/bin", "usr/share/berth-hello"] {
            std::fs::create_dir_all(pkg.join(dir)).unwrap();
        }
        let write = |rel: &str, text: &str, mode: u32| {
            std::fs::write(pkg.join(rel), text).unwrap();
            std::fs::set_permissions(pkg.join(rel), std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write(
            "DEBIAN/control",
            "Package: berth-hello\nVersion: 1.0\nArchitecture: all\n\
             Maintainer: berth tests <root@localhost>\nDescription: berth's apt test package\n",
            0o644,
        );
        write(
            "usr/bin/berth-hello",
            "#!/bin/sh\necho hello from berth-hello\n",
            0o755,
        );
        write("usr/share/berth-hello/daemons-file", "daemon's\n", 0o644);
        std::os::unix::fs::chown(
            pkg.join("usr/share/berth-hello/daemons-file"),
            Some(1),
            Some(1),
        )
        .unwrap();
        let dir = top.join("repo");
        std::fs::create_dir_all(&dir).unwrap();
        let deb = dir.join("berth-hello_1.0_all.deb");
        let out = Command::new("dpkg-deb")
            .arg("--build")
            .arg(&pkg)
            .arg(&deb)
            .stdin(Stdio::null())
            .output()
            .expect("running dpkg-deb (the dpkg package)");
        assert!(out.status.success(), "dpkg-deb: {}", stderr(&out));
        let bytes = std::fs::read(&deb).unwrap();
        let sha: String = sha2::Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        std::fs::write(
            dir.join("Packages"),
            format!(
                "Package: berth-hello\nVersion: 1.0\nArchitecture: all\n\
                 Maintainer: berth tests <root@localhost>\nFilename: ./berth-hello_1.0_all.deb\n\
                 Size: {}\nSHA256: {sha}\nDescription: berth's apt test package\n\n",
                bytes.len()
            ),
        )
        .unwrap();
        std::fs::remove_dir_all(&pkg).unwrap();
        for p in [&top, &dir] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        for f in [&deb, &dir.join("Packages")] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        dir
    })
}

/// What a Pyxis user runs with --container-remap-root: apt-get update and install from
/// /repo (only), the package's command, then a chown to an id the namespace does not map and
/// the process's seccomp mode.
const APT_SCRIPT: &str = "set -e; echo 'deb [trusted=yes] file:/repo ./' > /etc/apt/sources.list; \
    rm -f /etc/apt/sources.list.d/*; apt-get update -q >/dev/null; \
    apt-get install -y -q berth-hello >/dev/null; berth-hello; \
    stat -c 'owned %u:%g' /usr/share/berth-hello/daemons-file; \
    touch /tmp/f; chown 42:42 /tmp/f && echo chown-ok; grep Seccomp: /proc/self/status";

fn assert_apt_installed(out: &str) {
    for needle in [
        "hello from berth-hello",
        // dpkg's chown to 1:1 reported success and changed nothing: the file is root's (the
        // user's) like everything else it unpacked.
        "owned 0:0",
        "chown-ok",
        "Seccomp:\t2",
    ] {
        assert!(out.contains(needle), "{needle} missing: {out}");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn remap_root_apt_get_install_works_in_a_debian_image() {
    let img = format!("--container-image={}", debian_image());
    let mounts = format!("--container-mounts={}:/repo:ro", apt_test_repo().display());
    let out = succeeded(run(slurm_as_user_in(
        &cluster().cwd,
        "srun",
        &[
            &img,
            "--container-remap-root",
            &mounts,
            "sh",
            "-c",
            APT_SCRIPT,
        ],
    )));
    assert_apt_installed(&out);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn berth_run_remap_root_apt_get_install_works_too() {
    let img = debian_image();
    let mount = format!("{}:/repo:ro", apt_test_repo().display());
    let out = ok(berth(&[
        "run",
        "--image",
        img,
        "--user",
        "berthpyxis",
        "--remap-root",
        "--mount",
        &mount,
        "--",
        "sh",
        "-c",
        APT_SCRIPT,
    ])
    .stdin(Stdio::null())
    .output()
    .expect("running berth"));
    assert_apt_installed(&out);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_remap_root_filter_stays_out_of_normal_containers_and_changes_nothing_on_the_host() {
    let (uid, gid, _) = pyxis_user();
    let img = format!("--container-image={}", debian_image());
    // The normal case: no filter, no apt setting; chown fails as it must (EINVAL: the
    // container's user namespace maps no id 42, as Pyxis's).
    let out = run(slurm_as_user_in(
        &cluster().cwd,
        "srun",
        &[
            &img,
            "sh",
            "-c",
            "touch /tmp/f; chown 42:42 /tmp/f; echo rc=$?; grep Seccomp: /proc/self/status; \
             ls -A /etc/apt/apt.conf.d",
        ],
    ));
    let text = stdout(&out);
    assert!(text.contains("rc=1"), "{text}");
    assert!(text.contains("Seccomp:\t0"), "{text}");
    assert!(!text.contains("berth"), "{text}");
    assert!(
        stderr(&out).contains("Invalid argument"),
        "{}",
        stderr(&out)
    );
    // Remapped: a faked chown of a host file changes nothing on the host, and the apt setting
    // is never written into a host directory bound over apt.conf.d.
    let data = user_dir("apt-remap-data", &[("f", "the user's\n")]);
    let conf = user_dir("apt-remap-conf", &[("00mine", "// the user's\n")]);
    let mounts = format!(
        "--container-mounts={}:/data,{}:/etc/apt/apt.conf.d",
        data.display(),
        conf.display()
    );
    let out = succeeded(run(slurm_as_user_in(
        &cluster().cwd,
        "srun",
        &[
            &img,
            "--container-remap-root",
            &mounts,
            "sh",
            "-c",
            "chown 42:42 /data/f && echo chown-ok; chown -h 7:7 /data && echo chown-dir-ok; \
             ls -A /etc/apt/apt.conf.d",
        ],
    )));
    assert!(
        out.contains("chown-ok") && out.contains("chown-dir-ok"),
        "{out}"
    );
    assert!(!out.contains("berth"), "{out}");
    for path in [data.join("f"), data.clone()] {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(
            (
                std::os::unix::fs::MetadataExt::uid(&meta),
                std::os::unix::fs::MetadataExt::gid(&meta)
            ),
            (uid, gid),
            "{} changed owner",
            path.display()
        );
    }
    let names: Vec<String> = std::fs::read_dir(&conf)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["00mine"], "the host directory was written");
}

/// A copy of the busybox root with `/etc/apt` laid out by `prepare` (paths relative to it).
fn apt_hook_rootfs(name: &str, prepare: impl FnOnce(&Path)) -> PathBuf {
    let dir = repo().join("target/root-tier").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "cp: {}", stderr(&out));
    std::fs::create_dir_all(dir.join("etc/apt")).unwrap();
    prepare(&dir);
    dir
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_apt_setting_is_written_beneath_the_root_and_never_through_a_symlink() {
    let _ = pyxis_user();
    let remapped = |root: &Path, script: &str| {
        ok(berth(&[
            "run",
            "--rootfs",
            root.to_str().unwrap(),
            "--user",
            "berthpyxis",
            "--remap-root",
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("running berth"))
    };
    // A real apt.conf.d: the setting is there, the container's root's, in the writable layer
    // only (the image directory stays empty).
    let plain = apt_hook_rootfs("apt-hook-plain", |d| {
        std::fs::create_dir(d.join("etc/apt/apt.conf.d")).unwrap();
    });
    let out = remapped(
        &plain,
        "stat -c '%u:%g %a' /etc/apt/apt.conf.d/99berth-remap-root; \
         cat /etc/apt/apt.conf.d/99berth-remap-root",
    );
    assert!(out.contains("0:0 644"), "{out}");
    assert!(out.contains("APT::Sandbox::User \"root\";"), "{out}");
    assert_eq!(
        std::fs::read_dir(plain.join("etc/apt/apt.conf.d"))
            .unwrap()
            .count(),
        0
    );
    // apt.conf.d a symlink (within the image): not followed, nothing written where it leads.
    let linked = apt_hook_rootfs("apt-hook-linked", |d| {
        std::fs::create_dir(d.join("tmp/aptconf")).unwrap();
        std::os::unix::fs::symlink("../../tmp/aptconf", d.join("etc/apt/apt.conf.d")).unwrap();
    });
    let out = remapped(&linked, "ls -A /tmp/aptconf; echo listed");
    assert_eq!(out.trim(), "listed", "{out}");
    // The file's name taken by a symlink: left as it is, its target never created.
    let taken = apt_hook_rootfs("apt-hook-taken", |d| {
        std::fs::create_dir(d.join("etc/apt/apt.conf.d")).unwrap();
        std::os::unix::fs::symlink(
            "/tmp/victim",
            d.join("etc/apt/apt.conf.d/99berth-remap-root"),
        )
        .unwrap();
    });
    let out = remapped(
        &taken,
        "test -e /tmp/victim && echo victim-written; \
         readlink /etc/apt/apt.conf.d/99berth-remap-root",
    );
    assert_eq!(out.trim(), "/tmp/victim", "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn processes_exec_d_into_a_remapped_container_get_the_filter_too() {
    let _ = pyxis_user();
    let root = apt_hook_rootfs("apt-hook-exec", |d| {
        std::fs::create_dir(d.join("etc/apt/apt.conf.d")).unwrap();
    });
    let name = "apt-hook-exec";
    let _ = berth(&["rm", name]).output();
    struct Remove(&'static str);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = berth(&["rm", self.0]).output();
        }
    }
    ok(berth(&[
        "create",
        "--rootfs",
        root.to_str().unwrap(),
        "--user",
        "berthpyxis",
        "--remap-root",
        "--name",
        name,
    ])
    .stdin(Stdio::null())
    .output()
    .expect("running berth"));
    let _remove = Remove(name);
    let out = ok(berth(&[
        "exec",
        name,
        "--",
        "sh",
        "-c",
        "touch /tmp/f; chown 42:42 /tmp/f && echo chown-ok; grep Seccomp: /proc/self/status; \
         cat /etc/apt/apt.conf.d/99berth-remap-root",
    ])
    .stdin(Stdio::null())
    .output()
    .expect("running berth"));
    for needle in ["chown-ok", "Seccomp:\t2", "APT::Sandbox::User \"root\";"] {
        assert!(out.contains(needle), "{needle} missing: {out}");
    }
}

// --- Issue 27: Pyxis drop-in, round 2 ---

/// Runs `script` (sh) as a one-task batch job of berthpyxis from `dir`; its output file.
fn batch_as_user(dir: &Path, script: &str) -> String {
    let (uid, gid, _) = pyxis_user();
    let out_file = dir.join("job.out");
    let path = dir.join("job.sh");
    std::fs::write(&path, format!("#!/bin/sh\n{script}")).unwrap();
    std::os::unix::fs::chown(&path, Some(uid), Some(gid)).unwrap();
    let out = run(slurm_as_user_in(
        dir,
        "sbatch",
        &[
            "--wait",
            "-n1",
            "-o",
            &out_file.display().to_string(),
            &path.display().to_string(),
        ],
    ));
    let log = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert!(out.status.success(), "{}\n{log}", stderr(&out));
    log
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_joining_steps_remap_choice_is_applied_or_refused_in_one_line() {
    let (uid, _, _) = pyxis_user();
    let dir = user_dir("remap-join", &[]);
    let log = batch_as_user(
        &dir,
        &format!(
            "srun {img} --container-name=remapped --container-remap-root sh -c 'echo made=$(id -u)'\n\
             srun --container-name=remapped --no-container-remap-root sh -c 'echo noremap=$(id -u)'\n\
             srun --container-name=remapped sh -c 'echo default=$(id -u)'\n\
             srun {img} --container-name=plain sh -c 'echo plain=$(id -u)'\n\
             srun --container-name=plain --container-remap-root sh -c 'echo remapped-into-plain=$(id -u)'\n\
             echo remap=$?\n",
            img = image()
        ),
    );
    for line in [
        "made=0".to_string(),
        format!("noremap={uid}"),
        "default=0".to_string(),
        format!("plain={uid}"),
    ] {
        assert!(log.lines().any(|l| l == line), "{line} missing: {log}");
    }
    assert!(!log.contains("remapped-into-plain="), "{log}");
    assert!(
        log.lines()
            .any(|l| l.starts_with("remap=") && l != "remap=0"),
        "{log}"
    );
    let refusal: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("was made without --container-remap-root"))
        .collect();
    assert_eq!(refusal.len(), 1, "{log}");
    assert!(refusal[0].contains("container 'plain'"), "{log}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn relative_image_paths_are_the_steps_working_directorys() {
    let dir = user_dir("relative-image", &[]);
    let sqsh = dir.join("img.sqsh");
    let out = Command::new("mksquashfs")
        .arg(rootfs())
        .arg(&sqsh)
        .args(["-quiet", "-noappend"])
        .stdin(Stdio::null())
        .output()
        .expect("running mksquashfs");
    assert!(out.status.success(), "mksquashfs: {}", stderr(&out));
    let (uid, gid, _) = pyxis_user();
    std::os::unix::fs::chown(&sqsh, Some(uid), Some(gid)).unwrap();
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &["--container-image=./img.sqsh", "echo", "from-flag"],
    )));
    assert!(out.contains("from-flag"), "{out}");
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "env",
        &[
            "PYXIS_CONTAINER_IMAGE=./img.sqsh",
            "srun",
            "echo",
            "from-env",
        ],
    )));
    assert!(out.contains("from-env"), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn umount_entries_unmount_a_path_inside_the_container() {
    let dir = user_dir("umount", &[("f", "bound\n")]);
    let mounts = format!(
        "--container-mounts=umount:/tmp,umount:/dev/shm,{}:/tmp/x",
        dir.display()
    );
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &[
            &image(),
            &mounts,
            "sh",
            "-c",
            "grep -E ' /(tmp|dev/shm|tmp/x) ' /proc/self/mounts | cut -d' ' -f2; cat /tmp/x/f",
        ],
    )));
    let points: Vec<&str> = out.lines().filter(|l| l.starts_with('/')).collect();
    assert_eq!(points, ["/tmp/x"], "{out}");
    assert!(out.contains("bound"), "{out}");
    // Berth's /proc, /dev and /sys stay: refused before the job is queued.
    let out = run(slurm_as_user_in(
        &dir,
        "srun",
        &[&image(), "--container-mounts=umount:/proc", "true"],
    ));
    assert!(!out.status.success());
    assert!(stderr(&out).contains("umount:/proc"), "{}", stderr(&out));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mount_home_binds_the_jobs_home() {
    let dir = user_dir("job-home", &[("marker", "the job's home\n")]);
    let home = format!("HOME={}", dir.display());
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "env",
        &[
            &home,
            "srun",
            &image(),
            "--container-mount-home",
            "sh",
            "-c",
            &format!("cat {}/marker; echo HOME=$HOME", dir.display()),
        ],
    )));
    assert!(out.contains("the job's home"), "{out}");
    assert!(out.contains(&home), "{out}");
    // A HOME the user cannot read is refused as any mount source.
    let secret = cluster().state.join("job-home-secret");
    let _ = std::fs::remove_dir_all(&secret);
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();
    let out = run(slurm_as_user_in(
        &dir,
        "env",
        &[
            &format!("HOME={}", secret.display()),
            "srun",
            &image(),
            "--container-mount-home",
            "true",
        ],
    ));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.lines().any(|l| l.contains("--container-mount-home")
            && l.contains("cannot read")
            && l.contains(&secret.display().to_string())),
        "{err}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn exec_joins_only_a_running_named_container() {
    let dir = user_dir("exec-stopped", &[]);
    let log = batch_as_user(
        &dir,
        &format!(
            "srun {img} --container-name=ex true\n\
             srun --container-name=ex:exec echo joined-stopped\n\
             echo exec_stopped=$?\n\
             srun -n1 --overlap {img} --container-name=ex2 --container-mounts={d} sh -c 'touch {d}/ready; \
               while [ ! -e {d}/done ]; do sleep 0.2; done' &\n\
             i=0; while [ ! -e {d}/ready ] && [ $i -lt 300 ]; do sleep 0.2; i=$((i+1)); done\n\
             srun -n1 --overlap --container-name=ex2:exec echo joined-running\n\
             echo exec_running=$?\n\
             touch {d}/done\n\
             wait\n\
             srun --container-name=ex echo joined-auto\n",
            img = image(),
            d = dir.display(),
        ),
    );
    assert!(!log.contains("joined-stopped"), "{log}");
    assert!(!log.contains("exec_stopped=0"), "{log}");
    assert!(log.contains("container 'ex' is not running"), "{log}");
    assert!(log.contains("joined-running\nexec_running=0"), "{log}");
    assert!(log.contains("joined-auto"), "{log}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn pyxis_messages_and_key_phrases() {
    let c = cluster();
    // A registry image: Pyxis's two lines around the import, from slurmstepd.
    let reference = format!("{}#test/busybox:1", c.registry);
    let out = run(slurm(
        "srun",
        &[&format!("--container-image={reference}"), "busybox", "true"],
    ));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let importing = err
        .find(&format!("pyxis: importing docker image: {reference}"))
        .unwrap_or_else(|| panic!("no importing line: {err}"));
    let imported = err
        .find(&format!("pyxis: imported docker image: {reference}"))
        .unwrap_or_else(|| panic!("no imported line: {err}"));
    assert!(importing < imported, "{err}");
    // A squashfs or directory image is no docker image.
    let out = run(slurm("srun", &[&image(), "true"]));
    assert!(!stderr(&out).contains("pyxis:"), "{}", stderr(&out));
    // The phrases job scripts grep.
    let dir = user_dir("phrases", &[]);
    let failing = |args: &[&str]| -> String {
        let out = run(slurm_as_user_in(&dir, "srun", args));
        assert!(!out.status.success(), "{args:?} succeeded");
        stderr(&out)
    };
    let err = failing(&[&image(), "--container-mounts=/nonexistent/src:/x", "true"]);
    assert!(err.contains("source path does not exist"), "{err}");
    let err = failing(&[&image(), "--container-unshare=pid", "true"]);
    assert!(err.contains("unknown namespace"), "{err}");
    let err = failing(&[&image(), "--container-workdir=/nonexistent/wd", "true"]);
    assert!(
        err.contains("/nonexistent/wd: No such file or directory"),
        "{err}"
    );
    let err = failing(&[&image(), "--container-mounts=/tmp:/a/../../etc", "true"]);
    assert!(err.contains("failed to resolve path"), "{err}");
    let log = batch_as_user(
        &dir,
        &format!(
            "srun {img} --container-name=noipc true\n\
             srun --container-name=noipc --container-unshare=ipc true\n\
             srun --container-name=noipc --container-unshare=uts true\n\
             exit 0\n",
            img = image()
        ),
    );
    assert!(log.contains("not in a separate IPC namespace"), "{log}");
    assert!(log.contains("not in a separate UTS namespace"), "{log}");
}

// --- Issue 27, points 4 and 9 (runtime side) ---

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn character_devices_bind_as_mount_sources_and_block_devices_are_refused() {
    // Point 4: Pyxis binds `--container-mounts=/dev/null:/null`; berth refused it ("not a regular
    // file or directory"). A block device stays refused (runtime.mount_block_devices is off).
    let (uid, _, _) = pyxis_user();
    let dir = user_dir("devices", &[]);
    let block = dir.join("local-block");
    // Major 60 is for local use, never a real driver's.
    let status = Command::new("mknod")
        .args(["-m", "666"])
        .arg(&block)
        .args(["b", "60", "0"])
        .status()
        .unwrap();
    assert!(status.success());
    std::os::unix::fs::lchown(&block, Some(uid), None).unwrap();
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &[
            &image(),
            "--container-mounts=/dev/null:/null",
            "sh",
            "-c",
            "echo discarded > /null && echo wrote-null; wc -c < /null",
        ],
    )));
    assert!(out.contains("wrote-null\n0\n"), "{out}");
    let out = run(slurm_as_user_in(
        &dir,
        "srun",
        &[
            &image(),
            &format!("--container-mounts={}:/disk", block.display()),
            "echo",
            "ran",
        ],
    ));
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(!stdout(&out).contains("ran"));
    let said: Vec<&str> = err.lines().filter(|l| l.contains("block device")).collect();
    assert_eq!(said.len(), 1, "{err}");
    assert!(said[0].contains("runtime.mount_block_devices"), "{err}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_users_own_directory_image_runs_with_container_remap_root() {
    // Point 9: a directory image owned by the user, with --container-remap-root, failed with
    // `creating mount point /etc/hosts: EACCES` (a root-owned copy worked).
    let (uid, gid, _) = pyxis_user();
    let dir = user_dir("own-image", &[]);
    let img = dir.join("img");
    let status = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&img)
        .status()
        .unwrap();
    assert!(status.success());
    chown_tree(&img, uid, gid);
    let out = succeeded(run(slurm_as_user_in(
        &dir,
        "srun",
        &[
            &format!("--container-image={}", img.display()),
            "--container-remap-root",
            "sh",
            "-c",
            "id -u; stat -c %u /etc; grep -c . /etc/hosts >/dev/null && echo hosts; \
             touch /etc/new-file && echo writes-ok",
        ],
    )));
    assert_eq!(out.lines().take(2).collect::<Vec<_>>(), ["0", "0"], "{out}");
    assert!(out.contains("hosts\nwrites-ok"), "{out}");
    assert!(
        !img.join("etc/new-file").exists(),
        "the user's image changed"
    );
}

// --- a user namespace that maps the user to themselves (issue 27, point 3) ---

/// Pyxis runs every container in a user namespace: without --container-remap-root it maps the
/// user (and their group) to themselves, so `/proc/self/uid_map` reads `UID UID 1`. berth's is
/// the container's, joined by every later step of a named container, maps nothing else (root's
/// files show as nobody's), and grants nothing on the host: what the step writes into
/// a host directory is the user's there.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_step_without_remap_runs_in_a_user_namespace_of_the_user_alone() {
    let (uid, gid, _) = pyxis_user();
    let dir = user_dir("own-userns", &[]);
    let data = user_dir("own-userns-data", &[]);
    let host_ns = std::fs::read_link("/proc/self/ns/user").unwrap();
    let ids = "read u1 u2 u3 < /proc/self/uid_map; read g1 g2 g3 < /proc/self/gid_map; \
               echo $u1,$u2,$u3 $g1,$g2,$g3";
    let log = batch_as_user(
        &dir,
        &format!(
            "srun {img} --container-name=own --container-mounts={data}:/data sh -c \
             'echo made=$({ids}) $(readlink /proc/self/ns/user) id=$(id -u):$(id -g); \
              touch /data/made'\n\
             srun --container-name=own sh -c 'echo joined=$({ids}) $(readlink /proc/self/ns/user)'\n\
             srun {img} --container-remap-root sh -c 'echo remapped=$({ids})'\n",
            img = image(),
            data = data.display(),
        ),
    );
    let value = |key: &str| -> String {
        log.lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in: {log}"))
            .to_string()
    };
    let own = format!("{uid},{uid},1 {gid},{gid},1");
    let made = value("made=");
    assert!(made.starts_with(&format!("{own} user:[")), "{log}");
    assert!(made.ends_with(&format!("id={uid}:{gid}")), "{log}");
    let ns = made.split_whitespace().nth(2).unwrap().to_string();
    assert_ne!(ns, host_ns.display().to_string(), "{log}");
    // A later step of the named container joins the same namespace.
    assert_eq!(value("joined="), format!("{own} {ns}"), "{log}");
    assert_eq!(value("remapped="), format!("0,{uid},1 0,{gid},1"), "{log}");
    let made_on_host = std::fs::metadata(data.join("made")).unwrap();
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&made_on_host),
            std::os::unix::fs::MetadataExt::gid(&made_on_host)
        ),
        (uid, gid),
        "{log}"
    );
}
