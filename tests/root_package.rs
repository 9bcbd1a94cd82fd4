//! Root tier: berth as an admin installs it. packaging/build.sh builds the .deb and .rpm (once
//! per test binary); the .deb is installed on this machine with dpkg and a one-host Slurm
//! (integration/slurm/start.sh) runs a containerized srun with the installed plugin, binary and
//! Prolog/Epilog wrappers; the packaged systemd units pass `systemd-analyze verify`; `rpm -qlp`
//! lists the RHEL-family paths. The logging tests read berth's syslog lines back from a unix
//! datagram socket the test binds (`[log] syslog_socket`).
//!
//! Run by integration/test.sh as root: `cargo test --test root_package -- --ignored
//! --test-threads=1`. The first run builds the release binary (minutes); later runs reuse it.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{BERTH, berth_bin, rootfs, stderr, stdout};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn checkout_hash() -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(env!("CARGO_MANIFEST_DIR"), &mut h);
    u32::try_from(std::hash::Hasher::finish(&h) & u64::from(u32::MAX)).unwrap()
}

fn work_dir(name: &str) -> PathBuf {
    let dir = repo().join("target/root-tier/package").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn succeeded(cmd: &mut Command) -> String {
    let o = run(cmd);
    assert!(
        o.status.success(),
        "{cmd:?} failed: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// A syslog socket of the test's own, as journald's /dev/log is: a bound unix datagram socket.
struct SyslogSocket {
    path: PathBuf,
    socket: UnixDatagram,
}

impl SyslogSocket {
    fn bind(dir: &Path) -> Self {
        let path = dir.join("log.sock");
        let socket = UnixDatagram::bind(&path).unwrap();
        socket.set_nonblocking(true).unwrap();
        Self { path, socket }
    }

    /// The lines received so far, waiting up to `wait` for one containing `needle`.
    fn lines_until(&self, needle: &str, wait: Duration) -> Vec<String> {
        let deadline = Instant::now() + wait;
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 65536];
        loop {
            match self.socket.recv(&mut buf) {
                Ok(n) => lines.push(String::from_utf8_lossy(&buf[..n]).into_owned()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if lines.iter().any(|l| l.contains(needle)) || Instant::now() > deadline {
                        return lines;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("reading the test's syslog socket: {e}"),
            }
        }
    }
}

/// A berth config for the logging tests: every directory under `dir`, the registry at
/// 127.0.0.1:1 (nothing listens there) spoken to over HTTP without retries.
fn log_config(dir: &Path, log: &str) -> PathBuf {
    let path = dir.join("berth.toml");
    std::fs::write(
        &path,
        format!(
            "[cgroup]\nroot = \"{cg}\"\n[runtime]\nstate_dir = \"{d}/state\"\n\
             [store]\nroot = \"{d}/store\"\n[squashfs]\nmount_dir = \"{d}/images\"\n\
             [scratch]\nroot = \"{d}/scratch\"\n\
             [registry]\ninsecure = [\"127.0.0.1:1\"]\nretries = 0\n\
             [topology]\nepilog_health = false\n[log]\n{log}",
            cg = common::cgroup_root(),
            d = dir.display()
        ),
    )
    .unwrap();
    path
}

fn prolog(config: &Path, image: &str) -> Output {
    run(Command::new(berth_bin())
        .arg("--config")
        .arg(config)
        .arg("prolog")
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_JOB_UID", "65534")
        .env("SLURM_JOB_GID", "65534")
        .env("SPANK_BERTH_IMAGE", image))
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_prologs_image_failure_reaches_syslog_with_the_job_id() {
    let dir = work_dir("syslog-prolog");
    let syslog = SyslogSocket::bind(&dir);
    let config = log_config(
        &dir,
        &format!(
            "target = \"both\"\nsyslog_socket = \"{}\"\n",
            syslog.path.display()
        ),
    );
    let image = "127.0.0.1:1/nothing/here:1";
    let out = prolog(&config, image);
    // An image the Prolog cannot fetch does not fail it (the step reports it to the user)...
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("preparing image"), "{}", stderr(&out));
    // ...but the admin finds why in syslog: daemon.err, tagged berth[PID], with the job.
    let lines = syslog.lines_until("preparing image", Duration::from_secs(5));
    let line = lines
        .iter()
        .find(|l| l.contains("preparing image"))
        .unwrap_or_else(|| panic!("no syslog line about the image; got {lines:?}"));
    assert!(line.starts_with("<27>"), "not daemon.err: {line}");
    assert!(line.contains(" berth["), "{line}");
    assert!(
        line.contains("]: prolog job=4242: job 4242: preparing image 127.0.0.1:1/nothing/here:1"),
        "{line}"
    );
    // A verb's failure (main's one line) goes there too.
    let out = run(Command::new(berth_bin())
        .arg("--config")
        .arg(&config)
        .arg("epilog")
        .env_remove("SLURM_JOB_ID"));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let lines = syslog.lines_until("SLURM_JOB_ID is not set", Duration::from_secs(5));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<27>") && l.contains("]: epilog: SLURM_JOB_ID is not set")),
        "{lines:?}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn log_target_stderr_keeps_syslog_quiet_and_syslog_keeps_stderr_to_slurms_line() {
    let dir = work_dir("syslog-targets");
    let syslog = SyslogSocket::bind(&dir);
    let config = log_config(
        &dir,
        &format!(
            "target = \"stderr\"\nlevel = \"info\"\nsyslog_socket = \"{}\"\n",
            syslog.path.display()
        ),
    );
    let out = prolog(&config, "127.0.0.1:1/nothing/here:1");
    assert!(out.status.success(), "{}", stderr(&out));
    // level = info: the scratch line is logged, on stderr only, with a timestamp (RFC 3339).
    let err = stderr(&out);
    let scratch = err
        .lines()
        .find(|l| l.contains("scratch"))
        .unwrap_or_else(|| panic!("no info line about the scratch: {err}"));
    assert!(
        scratch.starts_with("20") && scratch.as_bytes().get(10) == Some(&b'T'),
        "{scratch}"
    );
    assert_eq!(syslog.lines_until("", Duration::ZERO), Vec::<String>::new());

    let config = log_config(
        &dir,
        &format!(
            "target = \"syslog\"\nlevel = \"info\"\nsyslog_socket = \"{}\"\n",
            syslog.path.display()
        ),
    );
    let out = prolog(&config, "127.0.0.1:1/nothing/here:1");
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    // Slurm's line stays on stderr; the log lines go to syslog only, at their level.
    assert!(err.contains("berth: job 4242: preparing image"), "{err}");
    assert!(!err.contains("scratch"), "{err}");
    let lines = syslog.lines_until("preparing image", Duration::from_secs(5));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<30>") && l.contains("prolog job=4242: job 4242: scratch")),
        "no daemon.info scratch line: {lines:?}"
    );
}

/// The packages, built once per test binary by packaging/build.sh with the profile of this
/// test build's target directory (`release` unless BERTH_PACKAGE_PROFILE says otherwise).
struct Packages {
    deb: PathBuf,
    rpm: Option<PathBuf>,
}

fn packages() -> &'static Packages {
    static PACKAGES: OnceLock<Packages> = OnceLock::new();
    PACKAGES.get_or_init(|| {
        // <target>/<profile>/berth: build into the same target directory.
        let target = Path::new(BERTH).parent().unwrap().parent().unwrap();
        let profile =
            std::env::var("BERTH_PACKAGE_PROFILE").unwrap_or_else(|_| "release".to_string());
        let out_dir = work_dir("out");
        let started = Instant::now();
        let out = run(Command::new("bash")
            .arg(repo().join("packaging/build.sh"))
            .arg("--out")
            .arg(&out_dir)
            .arg("--profile")
            .arg(&profile)
            .env("CARGO_TARGET_DIR", target)
            .env("CARGO", env!("CARGO"))
            .current_dir(repo()));
        assert!(
            out.status.success(),
            "packaging/build.sh failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        eprintln!(
            "packaging/build.sh --profile {profile}: {:.0} s",
            started.elapsed().as_secs_f64()
        );
        let files: Vec<PathBuf> = stdout(&out).lines().map(PathBuf::from).collect();
        let deb = files
            .iter()
            .find(|f| f.extension().is_some_and(|e| e == "deb"))
            .expect("build.sh printed no .deb")
            .clone();
        let rpm = files
            .iter()
            .find(|f| f.extension().is_some_and(|e| e == "rpm"))
            .cloned();
        Packages { deb, rpm }
    })
}

const DEB_PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/slurm-wlm/spank_berth.so";

/// The .deb installed on this machine for one test: removed (purged) on drop, with any file it
/// replaced put back, and the test's Slurm stopped.
struct Installed {
    /// (path, saved copy) of files that existed before the install.
    saved: Vec<(PathBuf, PathBuf)>,
    slurm_state: Option<PathBuf>,
}

impl Installed {
    fn install(deb: &Path, backup: &Path) -> Self {
        let status = run(Command::new("dpkg-query").args(["-W", "-f=${Status}", "berth"]));
        assert!(
            !stdout(&status).contains("installed"),
            "a berth package is installed on this machine already: this test installs and \
             purges its own, so remove it first (dpkg --purge berth)"
        );
        // Files the package ships that exist already (a hand install): saved, then put back.
        let contents = succeeded(Command::new("dpkg-deb").arg("-c").arg(deb));
        let mut saved = Vec::new();
        for line in contents.lines() {
            let Some(path) = line.split_whitespace().nth(5) else {
                continue;
            };
            let path = PathBuf::from(path.trim_start_matches('.'));
            if path.is_file() || path.is_symlink() {
                let copy = backup.join(format!("{}", saved.len()));
                std::fs::copy(&path, &copy).unwrap();
                std::fs::remove_file(&path).unwrap();
                saved.push((path, copy));
            }
        }
        let installed = Self {
            saved,
            slurm_state: None,
        };
        succeeded(
            Command::new("dpkg")
                .args(["-i", "--force-confnew"])
                .arg(deb)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        );
        installed
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(state) = &self.slurm_state {
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(state)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        let purge = Command::new("dpkg")
            .args(["--purge", "berth"])
            .stdin(Stdio::null())
            .output();
        if let Ok(o) = &purge
            && !o.status.success()
        {
            eprintln!("dpkg --purge berth failed: {}", stderr(o));
        }
        for (path, copy) in &self.saved {
            if let Some(parent) = path.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            let _ = std::fs::copy(copy, path);
        }
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_installed_deb_runs_a_containerized_srun_and_logs_its_failures() {
    let pkgs = packages();
    let dir = work_dir("deb");
    let backup = dir.join("backup");
    std::fs::create_dir_all(&backup).unwrap();
    let had = |p: &str| Path::new(p).exists();
    let before = [
        had(DEB_PLUGIN),
        had("/usr/bin/berth"),
        had("/usr/bin/berth-controller"),
        had("/etc/berth/berth.toml"),
    ];
    let mut installed = Installed::install(&pkgs.deb, &backup);

    // The files an admin relies on, where the distribution expects them.
    for path in [
        "/usr/bin/berth",
        "/usr/bin/berth-controller",
        DEB_PLUGIN,
        "/usr/libexec/berth/prolog.sh",
        "/usr/libexec/berth/epilog.sh",
        "/etc/berth/berth.toml",
        "/etc/slurm/plugstack.conf.d/berth.conf",
        "/usr/lib/systemd/system/berth-agent.service",
        "/usr/lib/systemd/system/berth-controller.service",
        "/usr/lib/systemd/system/berth-gc.service",
        "/usr/lib/systemd/system/berth-gc.timer",
        "/usr/lib/systemd/system/berth-cgroup.service",
        "/usr/lib/tmpfiles.d/berth.conf",
        "/usr/share/bash-completion/completions/berth",
        "/usr/share/zsh/vendor-completions/_berth",
        "/usr/share/fish/vendor_completions.d/berth.fish",
        "/usr/share/man/man1/berth.1.gz",
        "/usr/share/man/man1/berth-run.1.gz",
        "/usr/share/doc/berth/LICENSE",
        "/usr/share/doc/berth/copyright",
    ] {
        assert!(Path::new(path).exists(), "the .deb did not install {path}");
    }
    let conffiles = succeeded(Command::new("dpkg-query").args(["-W", "-f=${Conffiles}", "berth"]));
    assert!(conffiles.contains("/etc/berth/berth.toml"), "{conffiles}");
    assert!(
        conffiles.contains("/etc/slurm/plugstack.conf.d/berth.conf"),
        "{conffiles}"
    );
    let plugstack = std::fs::read_to_string("/etc/slurm/plugstack.conf.d/berth.conf").unwrap();
    assert!(
        plugstack.contains(&format!("required {DEB_PLUGIN} berth=/usr/bin/berth")),
        "{plugstack}"
    );
    // The shipped example is berth's defaults, and the installed binary reads it.
    let version = succeeded(Command::new("/usr/bin/berth").arg("--version"));
    assert!(version.starts_with("berth "), "{version}");
    succeeded(Command::new("/usr/bin/berth").args(["--config", "/etc/berth/berth.toml", "ps"]));
    let tmpfiles = std::fs::read_to_string("/usr/lib/tmpfiles.d/berth.conf").unwrap();
    assert!(
        tmpfiles
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["d", "/run/berth", "0711", "root", "root", "-"]),
        "{tmpfiles}"
    );
    let wrapper = std::fs::read_to_string("/usr/libexec/berth/prolog.sh").unwrap();
    assert!(wrapper.contains("\nBERTH=/usr/bin/berth\n"), "{wrapper}");

    // The controller's binary runs and its unit's data directory is its default one.
    let help = succeeded(Command::new("/usr/bin/berth-controller").arg("--help"));
    assert!(help.contains("serve"), "{help}");
    let unit = std::fs::read_to_string("/usr/lib/systemd/system/berth-controller.service").unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/berth-controller serve")
            && unit.contains("StateDirectory=berth-controller"),
        "{unit}"
    );
    // systemd accepts the units (the verbs aside: verify checks files, not arguments).
    // setup.sh installs systemd: without systemd-analyze this test cannot do its job.
    assert!(
        Path::new("/usr/bin/systemd-analyze").exists(),
        "systemd-analyze missing: integration/setup.sh installs systemd"
    );
    {
        let o = run(Command::new("systemd-analyze").args([
            "verify",
            "--man=no",
            "/usr/lib/systemd/system/berth-agent.service",
            "/usr/lib/systemd/system/berth-controller.service",
            "/usr/lib/systemd/system/berth-gc.service",
            "/usr/lib/systemd/system/berth-gc.timer",
            "/usr/lib/systemd/system/berth-cgroup.service",
        ]));
        let text = format!("{}{}", stdout(&o), stderr(&o));
        let about_berth: Vec<&str> = text.lines().filter(|l| l.contains("berth")).collect();
        assert!(
            o.status.success() && about_berth.is_empty(),
            "systemd-analyze verify: {:?}\n{text}",
            o.status
        );
    }

    // A one-host Slurm with the installed plugin, binary and Prolog/Epilog wrappers; berth's
    // configuration is a test one (directories under the cluster's state, syslog to the test).
    let hash = checkout_hash();
    let state = PathBuf::from(format!("/tmp/berth-root-package-{hash:08x}"));
    let syslog = SyslogSocket::bind(&dir);
    let config = dir.join("cluster.toml");
    std::fs::write(
        &config,
        format!(
            "[cgroup]\nroot = \"{cg}-package\"\n[runtime]\nstate_dir = \"{s}/berth/state\"\n\
             [store]\nroot = \"{s}/berth/store\"\n[squashfs]\nmount_dir = \"{s}/berth/images\"\n\
             [scratch]\nroot = \"{s}/berth/scratch\"\n[topology]\nepilog_health = false\n\
             [log]\ntarget = \"both\"\nsyslog_socket = \"{sock}\"\n",
            cg = common::cgroup_root(),
            s = state.display(),
            sock = syslog.path.display()
        ),
    )
    .unwrap();
    installed.slurm_state = Some(state.clone());
    let port = 21000 + (hash % 500) * 4;
    succeeded(
        Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .args(["--plugin", DEB_PLUGIN, "--berth", "/usr/bin/berth"])
            .args(["--wrappers", "/usr/libexec/berth"])
            .arg("--berth-config")
            .arg(&config)
            .env("BERTH_SLURM_PORT", port.to_string()),
    );
    let plugstack = std::fs::read_to_string(state.join("etc/plugstack.conf")).unwrap();
    assert!(
        plugstack.starts_with(&format!("required {DEB_PLUGIN} berth=/usr/bin/berth ")),
        "{plugstack}"
    );
    let cwd = state.join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let srun = |args: &[&str]| {
        let mut c = Command::new("srun");
        c.args(args)
            .env("SLURM_CONF", state.join("etc/slurm.conf"))
            .env_remove("BERTH_CONTAINER_IMAGE")
            .env_remove("PYXIS_CONTAINER_IMAGE")
            .current_dir(&cwd);
        c
    };
    let image = rootfs().display().to_string();
    let out = succeeded(&mut srun(&[
        &format!("--container-image={image}"),
        "cat",
        "/etc/os-release",
    ]));
    assert!(out.contains("ID=berth-busybox"), "{out}");

    // An image that does not exist: the Prolog and the step both log why to syslog, with the
    // job id (and the step's id).
    let missing = dir.join("no-such-image.sqsh");
    let o = run(&mut srun(&[
        &format!("--container-image={}", missing.display()),
        "true",
    ]));
    assert!(!o.status.success(), "srun with a missing image succeeded");
    let lines = syslog.lines_until("step create job=", Duration::from_secs(20));
    let needle = missing.display().to_string();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<27>") && l.contains("]: prolog job=") && l.contains(&needle)),
        "no Prolog line about the image in syslog: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("<27>")
            && l.contains("]: step create job=")
            && l.contains(" step=0: ")),
        "no step line in syslog: {lines:?}"
    );
    drop(installed);
    // Purged, and what was there before (nothing, on a test machine) is back.
    let after = [
        had(DEB_PLUGIN),
        had("/usr/bin/berth"),
        had("/usr/bin/berth-controller"),
        had("/etc/berth/berth.toml"),
    ];
    assert_eq!(after, before, "dpkg --purge left the package's files");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_rpm_lists_the_rhel_paths() {
    let pkgs = packages();
    let Some(rpm) = &pkgs.rpm else {
        panic!("no .rpm built: rpmbuild missing (integration/setup.sh installs rpm)");
    };
    let list = succeeded(Command::new("rpm").arg("-qlp").arg(rpm));
    for path in [
        "/usr/bin/berth",
        "/usr/lib64/slurm/spank_berth.so",
        "/usr/libexec/berth/prolog.sh",
        "/usr/libexec/berth/epilog.sh",
        "/etc/berth/berth.toml",
        "/etc/slurm/plugstack.conf.d/berth.conf",
        "/usr/lib/systemd/system/berth-agent.service",
        "/usr/lib/systemd/system/berth-controller.service",
        "/usr/bin/berth-controller",
        "/usr/lib/systemd/system/berth-gc.timer",
        "/usr/lib/tmpfiles.d/berth.conf",
        "/usr/share/zsh/site-functions/_berth",
        "/usr/share/man/man1/berth.1.gz",
        "/usr/share/doc/berth/LICENSE",
    ] {
        assert!(
            list.lines().any(|l| l == path),
            "rpm -qlp lacks {path}:\n{list}"
        );
    }
    assert!(
        !list.contains("x86_64-linux-gnu"),
        "Debian paths in the rpm:\n{list}"
    );
    let config = succeeded(Command::new("rpm").args(["-qp", "--configfiles"]).arg(rpm));
    assert!(config.contains("/etc/berth/berth.toml"), "{config}");
    assert!(
        config.contains("/etc/slurm/plugstack.conf.d/berth.conf"),
        "{config}"
    );
    // It refuses a Slurm other than the one the plugin was built for.
    let conflicts = succeeded(Command::new("rpm").args(["-qp", "--conflicts"]).arg(rpm));
    assert!(conflicts.contains("slurm <"), "{conflicts}");
}
