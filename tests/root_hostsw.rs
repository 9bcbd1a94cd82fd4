//! Root tier: the host's software inside containers (issue 29): the host's Slurm client in a
//! step's container (`--container-slurm`) and in `berth run --slurm`; the host's Lmod (Debian's
//! `lmod`, integration/setup.sh) with a module tree made here (`--container-modules`, `berth run
//! --modules`); the host's Open MPI under the image's MPI program (`--container-mpi=host`,
//! `berth run --mpi=host`) and its ABI and glibc refusals (images made here with the host's cc),
//! the check's kept answers following a changed image, `berth gc` removing old copies of the
//! host's MPI, on a real one-host Slurm
//! of this file's own (integration/slurm/start.sh with its own state directory and free ports,
//! started once per test binary, stopped at exit), as a non-root user, in the Debian image of
//! integration/slurm/mpi-image.sh. Run as root:
//! `cargo test --test root_hostsw -- --ignored --test-threads=1`. `BERTH_TEST_BIN` and
//! `BERTH_TEST_PLUGIN` run it against an older berth binary and SPANK plugin.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use common::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Distinct from the other root tests' clusters (another hash input), per checkout.
fn state_path() -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&(env!("CARGO_MANIFEST_DIR"), "root_hostsw"), &mut h);
    let hash = std::hash::Hasher::finish(&h) & u64::from(u32::MAX);
    PathBuf::from(format!("/tmp/berth-root-hostsw-{hash:08x}"))
}

struct Cluster {
    state: PathBuf,
    conf: PathBuf,
    /// A directory every user can use as the working directory of srun.
    cwd: PathBuf,
    /// The berth configuration the cluster's nodes use (host_software.slurm_paths set).
    berth_config: PathBuf,
}

/// Two consecutive free ports (slurmctld's and slurmd's).
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let p = std::net::TcpListener::bind(("0.0.0.0", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
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
        let plugin = std::env::var_os("BERTH_TEST_PLUGIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| profile_dir.join("libspank_berth.so"));
        let state = state_path();
        let berth_config = PathBuf::from(format!("{}.toml", state.display()));
        let lib = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
        // The cluster's slurm.conf, plugstack.conf and the plugin srun loads from inside; its
        // munged's socket through a directory of its own (munged's holds munge.key, which
        // berth refuses to bind), at the path slurm.conf's AuthInfo names.
        std::fs::write(
            &berth_config,
            format!(
                "[cgroup]\nroot = \"{}-hostsw\"\n[runtime]\nstate_dir = \"{s}/berth/state\"\n\
                 [store]\nroot = \"{s}/berth/store\"\n[squashfs]\nmount_dir = \"{s}/berth/images\"\n\
                 [scratch]\nroot = \"{s}/berth/scratch\"\n\
                 [host_software]\nslurm_paths = [\"/usr/bin/srun\", \"/usr/bin/squeue\", \
                 \"/usr/bin/sinfo\", \"/usr/bin/sbatch\", \"{lib}/slurm-wlm\", \"{lib}/libmunge.so.2\", \
                 \"{s}/etc\", \"{s}/munge-client:{s}/munge\", \"{plugin}\"]\n\
                 module_paths = [\"/usr/share/lmod\", \"/usr/lib/lmod\", \"/etc/lmod\", \
                 \"/etc/profile.d/lmod.sh\", \"/usr/bin/lua5.3\", \"{lib}/liblua5.3*.so*\", \"{lib}/libreadline.so.8\", \"{lib}/libtcl8.6.so\", \
                 \"{lib}/lua\", \"/usr/share/lua\", \"{s}/modules\", \"{s}/sw\"]\n",
                cgroup_root(),
                s = state.display(),
                plugin = plugin.display(),
            ),
        )
        .unwrap();
        extern "C" fn stop_cluster() {
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
        // A second name of munged's socket (a hard link reaches the same listening socket) in
        // a directory holding nothing else.
        let client = state.join("munge-client");
        std::fs::create_dir_all(&client).unwrap();
        std::fs::set_permissions(&client, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::hard_link(
            state.join("munge/munge.socket"),
            client.join("munge.socket"),
        )
        .unwrap();
        make_module_tree(&state);
        let cwd = state.join("cwd");
        std::fs::create_dir_all(&cwd).unwrap();
        std::fs::set_permissions(&cwd, std::fs::Permissions::from_mode(0o1777)).unwrap();
        Cluster {
            conf: state.join("etc/slurm.conf"),
            state,
            cwd,
            berth_config,
        }
    })
}

/// A module tree under `state`: `hello/1.0` puts `hello-tool` (in the software tree `sw`) on
/// PATH and sets HELLO_GREETING, which the tool prints.
fn make_module_tree(state: &Path) {
    let modules = state.join("modules/hello");
    let bin = state.join("sw/hello/1.0/bin");
    std::fs::create_dir_all(&modules).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(
        modules.join("1.0.lua"),
        format!(
            "prepend_path(\"PATH\", \"{}\")\nsetenv(\"HELLO_GREETING\", \"hello from a module\")\n",
            bin.display()
        ),
    )
    .unwrap();
    std::fs::write(
        bin.join("hello-tool"),
        "#!/bin/sh\necho \"hello-tool ran: $HELLO_GREETING\"\n",
    )
    .unwrap();
    std::fs::set_permissions(
        bin.join("hello-tool"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
}

/// The user of these tests: berthhostsw, without a home directory.
fn test_user_name() -> &'static str {
    static USER: OnceLock<()> = OnceLock::new();
    USER.get_or_init(|| {
        let exists = Command::new("id")
            .arg("berthhostsw")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success();
        if !exists {
            let out = Command::new("useradd")
                .args(["-M", "-s", "/bin/sh", "-d", "/nonexistent", "berthhostsw"])
                .output()
                .unwrap();
            assert!(out.status.success(), "useradd: {}", stderr(&out));
        }
    });
    "berthhostsw"
}

/// A Slurm client command as the test user, from the cluster's shared working directory,
/// killed after two minutes (a node drained by a failed Prolog would keep srun waiting).
fn slurm_as_user(cmd: &str, args: &[&str]) -> Command {
    let c = cluster();
    let mut command = Command::new("timeout");
    command
        .args([
            "-k",
            "5",
            "120",
            "runuser",
            "-u",
            test_user_name(),
            "--",
            cmd,
        ])
        .args(args)
        .env("SLURM_CONF", &c.conf)
        .env_remove("BERTH_CONTAINER_IMAGE")
        .env_remove("PYXIS_CONTAINER_IMAGE")
        .env_remove("BERTH_CONTAINER_SLURM")
        .env_remove("PYXIS_CONTAINER_SLURM")
        .env("PWD", &c.cwd)
        .current_dir(&c.cwd)
        .stdin(Stdio::null());
    command
}

fn output(mut cmd: Command) -> Output {
    cmd.output().expect("running a command")
}

/// The Debian bookworm image of integration/slurm/mpi-image.sh (cached).
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

fn show(o: &Output) -> String {
    format!(
        "{:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(o),
        stderr(o)
    )
}

#[test]
#[ignore = "root tier: run as root"]
fn squeue_and_srun_work_inside_a_step_with_container_slurm() {
    let img = format!("--container-image={}", debian_image());
    // The image has no Slurm of its own: without the option, nothing to run.
    let o = output(slurm_as_user(
        "srun",
        &[&img, "sh", "-c", "command -v squeue || echo no-squeue"],
    ));
    assert!(stdout(&o).contains("no-squeue"), "{}", show(&o));
    let script = "echo job=$SLURM_JOB_ID; squeue -h -u $(id -un) -o 'queued=%i'; \
                  srun -n1 --overlap sh -c 'echo inner-step=$SLURM_STEP_ID host=$(hostname)'";
    let o = output(slurm_as_user(
        "srun",
        &[&img, "--container-slurm", "bash", "-c", script],
    ));
    let out = stdout(&o);
    assert!(o.status.success(), "{}", show(&o));
    let job = out
        .lines()
        .find_map(|l| l.strip_prefix("job="))
        .unwrap_or_else(|| panic!("no job id: {}", show(&o)));
    assert!(
        out.lines().any(|l| l == format!("queued={job}")),
        "squeue -u does not list job {job}: {}",
        show(&o)
    );
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert!(
        out.lines()
            .any(|l| l.starts_with("inner-step=")
                && l.ends_with(&format!("host={}", hostname.trim()))),
        "srun from inside did not run: {}",
        show(&o)
    );
    // PYXIS-style environment, with a read-only container remapped to root.
    let mut cmd = slurm_as_user(
        "srun",
        &[
            &img,
            "--container-remap-root",
            "--container-readonly",
            "sh",
            "-c",
            "id -u; sinfo -h -o 'partition=%P'; touch /usr/bin/srun 2>/dev/null || echo ro",
        ],
    );
    cmd.env("PYXIS_CONTAINER_SLURM", "1");
    let o = output(cmd);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", show(&o));
    for needle in ["0\n", "partition=debug*", "ro"] {
        assert!(out.contains(needle), "{needle} missing: {}", show(&o));
    }
}

#[test]
#[ignore = "root tier: run as root"]
fn berth_run_slurm_binds_only_what_the_config_names_and_never_munges_key() {
    let c = cluster();
    let img = debian_image();
    let run = |config: &Path| {
        let mut cmd = Command::new(berth_bin());
        cmd.arg("--config")
            .arg(config)
            .args(["run", "--image", img, "--user", test_user_name(), "--slurm"])
            .args(["--", "sinfo", "-h", "-o", "partition=%P"])
            .env("SLURM_CONF", &c.conf)
            .stdin(Stdio::null());
        output(cmd)
    };
    let o = run(&c.berth_config);
    assert!(o.status.success(), "{}", show(&o));
    assert!(stdout(&o).contains("partition=debug*"), "{}", show(&o));
    // A site naming munged's own directory (munge.key beside the socket) is refused.
    let leaky = c.state.join("leaky.toml");
    let text = std::fs::read_to_string(&c.berth_config).unwrap();
    let client = format!("{}/munge-client:", c.state.display());
    std::fs::write(
        &leaky,
        text.replace(&client, &format!("{}/munge:", c.state.display())),
    )
    .unwrap();
    let o = run(&leaky);
    let err = stderr(&o);
    assert!(!o.status.success(), "{}", show(&o));
    assert!(
        err.contains("munge.key, which no container may see") && err.trim().lines().count() == 1,
        "{}",
        show(&o)
    );
}

/// What a user who set Lmod up on the host has in the environment srun passes on.
fn with_modulepath(mut cmd: Command) -> Command {
    cmd.env("MODULEPATH", cluster().state.join("modules"))
        .env("BASH_ENV", "/usr/share/lmod/lmod/init/bash");
    cmd
}

#[test]
#[ignore = "root tier: run as root"]
fn module_load_works_in_bash_inside_a_step_with_container_modules() {
    let img = format!("--container-image={}", debian_image());
    let want = "hello-tool ran: hello from a module";
    // A login shell (/etc/profile.d/lmod.sh) and a batch script's non-interactive bash
    // (BASH_ENV), in a writable and in a read-only container remapped to root.
    for (extra, shell) in [
        (vec![], "-lc"),
        (vec!["--container-readonly", "--container-remap-root"], "-c"),
    ] {
        let mut args = vec![img.as_str(), "--container-modules"];
        args.extend(extra.iter().copied());
        args.extend([
            "bash",
            shell,
            "module load hello/1.0 && hello-tool && module list 2>&1",
        ]);
        let o = output(with_modulepath(slurm_as_user("srun", &args)));
        assert!(o.status.success(), "{}", show(&o));
        assert!(stdout(&o).contains(want), "{}", show(&o));
        assert!(stdout(&o).contains("hello/1.0"), "{}", show(&o));
    }
    // Loaded on the host before srun (a login shell of the host's Lmod), still loaded inside,
    // its PATH entry kept with --container-env=PATH.
    let inner = format!(
        "module load hello/1.0 && srun {img} --container-modules --container-env=PATH \
         bash -c 'module list 2>&1; hello-tool'"
    );
    let o = output(with_modulepath(slurm_as_user("bash", &["-lc", &inner])));
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).contains("hello/1.0") && stdout(&o).contains(want),
        "{}",
        show(&o)
    );
    // Without the option the image has no module command.
    let o = output(with_modulepath(slurm_as_user(
        "srun",
        &[
            &img,
            "bash",
            "-lc",
            "type module >/dev/null 2>&1 || echo no-module",
        ],
    )));
    assert!(stdout(&o).contains("no-module"), "{}", show(&o));
}

#[test]
#[ignore = "root tier: run as root"]
fn an_image_without_bash_gets_a_one_line_refusal_and_berth_run_modules_works() {
    let busybox = format!("--container-image={}", rootfs().display());
    let o = output(with_modulepath(slurm_as_user(
        "srun",
        &[&busybox, "--container-modules", "true"],
    )));
    assert!(!o.status.success(), "{}", show(&o));
    let err = stderr(&o);
    let refusal: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("--container-modules"))
        .collect();
    assert!(
        refusal.len() == 1 && refusal[0].contains("the image has no bash"),
        "{}",
        show(&o)
    );
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config")
        .arg(&cluster().berth_config)
        .args([
            "run",
            "--image",
            debian_image(),
            "--user",
            test_user_name(),
            "--modules",
        ])
        .args(["--", "bash", "-lc", "module load hello && hello-tool"])
        .stdin(Stdio::null());
    let o = output(with_modulepath(cmd));
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).contains("hello-tool ran: hello from a module"),
        "{}",
        show(&o)
    );
}

/// `srun --mpi=pmix` of the image's `mpiwhich` as the test user, with `extra` options.
fn mpiwhich(ranks: &str, extra: &[&str]) -> Output {
    let img = format!("--container-image={}", debian_image());
    // --overcommit: 4 ranks on a 2-CPU node.
    let mut args = vec!["--mpi=pmix", "--overcommit", "-n", ranks, img.as_str()];
    args.extend(extra);
    args.push("/usr/local/bin/mpiwhich");
    output(slurm_as_user("srun", &args))
}

/// The file each rank's libmpi.so was mapped from, checked to be the same for every rank, and
/// the ranks' sum right.
fn mapped_libmpi(o: &Output, ranks: usize) -> String {
    assert!(o.status.success(), "{}", show(o));
    let out = stdout(o);
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("rank ")).collect();
    let sum = ranks * (ranks + 1) / 2;
    assert_eq!(lines.len(), ranks, "{}", show(o));
    let paths: Vec<&str> = lines
        .iter()
        .map(|l| {
            assert!(l.contains(&format!(": sum {sum} ")), "{}", show(o));
            l.split(" libmpi ")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .unwrap_or("")
        })
        .collect();
    assert!(paths.iter().all(|p| *p == paths[0]), "{}", show(o));
    assert!(
        lines.iter().all(|l| l.contains("version Open MPI v")),
        "{}",
        show(o)
    );
    paths[0].to_string()
}

#[test]
#[ignore = "root tier: run as root"]
fn container_mpi_host_runs_the_images_program_on_the_hosts_libmpi() {
    // The image's own Open MPI without the option.
    let o = mpiwhich("4", &[]);
    let own = mapped_libmpi(&o, 4);
    assert!(
        own.starts_with("/usr/lib/x86_64-linux-gnu/libmpi.so.40")
            || own.starts_with("/usr/lib/aarch64-linux-gnu/libmpi.so.40"),
        "{own}: {}",
        show(&o)
    );
    // The SONAME's name in the host's directory is a symlink to the file the maps show.
    let host = "/usr/lib/berth/host-mpi/libmpi.so.40";
    let o = mpiwhich("4", &["--container-mpi=host"]);
    assert!(mapped_libmpi(&o, 4).starts_with(host), "{}", show(&o));
    // PYXIS-style, in a read-only container.
    let img = format!("--container-image={}", debian_image());
    let mut cmd = slurm_as_user(
        "srun",
        &[
            "--mpi=pmix",
            "-n",
            "2",
            &img,
            "--container-readonly",
            "/usr/local/bin/mpiwhich",
        ],
    );
    cmd.env("PYXIS_CONTAINER_MPI", "host");
    let o = output(cmd);
    assert!(mapped_libmpi(&o, 2).starts_with(host), "{}", show(&o));
    // Remapped to root, the loader finds the host's libraries first (not MPI_Init: Slurm's PMIx
    // server refuses a client in a user namespace, whichever MPI it runs on).
    let o = output(slurm_as_user(
        "srun",
        &[
            &img,
            "--container-remap-root",
            "--container-mpi=host",
            "sh",
            "-c",
            "id -u; ldd /usr/local/bin/mpiwhich",
        ],
    ));
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).starts_with("0\n") && stdout(&o).contains(&format!("libmpi.so.40 => {host}")),
        "{}",
        show(&o)
    );
    // berth run --mpi=host: the loader finds the host's libraries first.
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config")
        .arg(&cluster().berth_config)
        .args(["run", "--image", debian_image(), "--user", test_user_name()])
        .args(["--mpi=host", "--", "sh", "-c"])
        .arg("ldd /usr/local/bin/mpiwhich; echo LD_LIBRARY_PATH=$LD_LIBRARY_PATH")
        .stdin(Stdio::null());
    let o = output(cmd);
    assert!(o.status.success(), "{}", show(&o));
    let out = stdout(&o);
    for needle in [
        format!("libmpi.so.40 => {host}"),
        "libopen-pal.so.40 => /usr/lib/berth/host-mpi/".to_string(),
        "LD_LIBRARY_PATH=/usr/lib/berth/host-mpi".to_string(),
    ] {
        assert!(out.contains(&needle), "{needle} missing: {}", show(&o));
    }
}

/// A directory image holding a shared library `file` with the ELF SONAME `soname` (made by the
/// host's cc) in its library directory, and a libc.so.6 whose version banner says `glibc`.
fn fake_mpi_image(name: &str, file: &str, soname: &str, glibc: &str) -> PathBuf {
    let root = cluster().state.join(name);
    let lib = root.join(format!("usr/lib/{}-linux-gnu", std::env::consts::ARCH));
    std::fs::create_dir_all(&lib).unwrap();
    let src = root.join("mpi.c");
    std::fs::write(&src, "int MPI_Init(int *c, char ***v) { return 0; }\n").unwrap();
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(lib.join(file))
        .arg(format!("-Wl,-soname,{soname}"))
        .arg(&src)
        .output()
        .expect("running cc");
    assert!(out.status.success(), "cc: {}", stderr(&out));
    std::fs::write(
        lib.join("libc.so.6"),
        format!("GNU C Library (fake) stable release version {glibc}.\n"),
    )
    .unwrap();
    for dir in [
        root.as_path(),
        root.join("usr").as_path(),
        root.join("usr/lib").as_path(),
    ] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    root
}

/// The one stderr line of `o` naming `--container-mpi=host`.
fn mpi_refusal(o: &Output) -> String {
    assert!(!o.status.success(), "{}", show(o));
    let err = stderr(o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("--container-mpi=host"))
        .collect();
    assert_eq!(lines.len(), 1, "{}", show(o));
    eprintln!("refusal: {}", lines[0]);
    lines[0].to_string()
}

#[test]
#[ignore = "root tier: run as root"]
fn container_mpi_host_refuses_an_mpich_image_and_one_too_old_for_the_hosts_libraries() {
    let mpich = fake_mpi_image("mpich-image", "libmpi.so.12", "libmpi.so.12", "2.36");
    let img = format!("--container-image={}", mpich.display());
    let o = output(slurm_as_user(
        "srun",
        &["-n1", &img, "--container-mpi=host", "true"],
    ));
    let line = mpi_refusal(&o);
    for needle in [
        "the image's MPI is MPICH ABI (libmpi.so.12)",
        "this node's is Open MPI (libmpi.so.40.",
        "use an image built with Open MPI (libmpi.so.40)",
    ] {
        assert!(line.contains(needle), "{needle} missing: {line}");
    }
    // An Open MPI image whose glibc is older than what the host's libraries need.
    let old = fake_mpi_image(
        "old-glibc-image",
        "libmpi.so.40.30.4",
        "libmpi.so.40",
        "2.17",
    );
    let img = format!("--container-image={}", old.display());
    let o = output(slurm_as_user(
        "srun",
        &["-n1", &img, "--container-mpi=host", "true"],
    ));
    let line = mpi_refusal(&o);
    assert!(
        line.contains("the image's glibc 2.17 is older than the 2.")
            && line.contains("this node's MPI libraries need (GLIBC_2."),
        "{line}"
    );
    // The same image with the image's MPI chosen: no check, the step is only refused later for
    // having no programs at all (the fake image has no /bin/true).
    let o = output(slurm_as_user(
        "srun",
        &["-n1", &img, "--container-mpi=image", "true"],
    ));
    assert!(!stderr(&o).contains("--container-mpi"), "{}", show(&o));
}

/// The node's berth state directory (the one-node cluster's).
fn berth_state() -> PathBuf {
    cluster().state.join("berth/state")
}

/// The kept answers of the host-MPI check (`host-sw/mpi-*`) that name `file` beneath an image.
fn kept_mpi_answers(file: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(berth_state().join("host-sw")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("mpi-"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter(|t| t.lines().any(|l| l.ends_with(&format!(" {file}"))))
        .collect()
}

/// The gathered host MPI's facts (`host-mpi/<hash>.facts`, made by a `--container-mpi=host`
/// step here): the host's libmpi minor and the libraries its libraries need.
fn host_mpi_facts() -> (u32, Vec<String>) {
    let img = format!("--container-image={}", debian_image());
    let o = output(slurm_as_user(
        "srun",
        &["-n1", &img, "--container-mpi=host", "true"],
    ));
    assert!(o.status.success(), "{}", show(&o));
    let dir = berth_state().join("host-mpi");
    let facts = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".facts"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .expect("a facts file beside the gathered libraries");
    let minor = facts
        .lines()
        .find_map(|l| l.strip_prefix("mpi "))
        .and_then(|l| l.split(' ').nth(2))
        .and_then(|m| m.parse().ok())
        .expect("the host's libmpi minor");
    let needed = facts
        .lines()
        .filter_map(|l| l.strip_prefix("needed "))
        .map(String::from)
        .collect();
    (minor, needed)
}

#[test]
#[ignore = "root tier: run as root"]
fn a_kept_mpi_check_is_recalled_only_while_the_images_files_are_unchanged() {
    let (minor, needed) = host_mpi_facts();
    // A user's directory image the host's MPI fits: its libmpi no newer, a new enough glibc,
    // every library the host's need (empty files: only their names are checked).
    let file = format!("libmpi.so.40.{minor}.0");
    let image = fake_mpi_image("kept-image", &file, "libmpi.so.40", "2.99");
    let lib = image.join(format!("usr/lib/{}-linux-gnu", std::env::consts::ARCH));
    for name in &needed {
        if !lib.join(name).exists() {
            std::fs::write(lib.join(name), "").unwrap();
        }
    }
    let rel = format!("usr/lib/{}-linux-gnu/{file}", std::env::consts::ARCH);
    let img = format!("--container-image={}", image.display());
    let step = || {
        output(slurm_as_user(
            "srun",
            &["-n1", &img, "--container-mpi=host", "true"],
        ))
    };
    // Passing the check, the step fails only later (the image has no /bin/true).
    let passes = |o: &Output| !stderr(o).contains("--container-mpi=host");
    // An answer read from files changed within the last second is not kept.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let o = step();
    assert!(passes(&o), "{}", show(&o));
    let kept = kept_mpi_answers(&rel);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(kept[0].starts_with("answer compatible\n"), "{}", kept[0]);
    let o = step();
    assert!(passes(&o), "{}", show(&o));
    assert_eq!(kept_mpi_answers(&rel).len(), 1, "recalled, not kept again");
    // The image's libmpi replaced by a newer Open MPI's: checked again, refused.
    let newer = format!("libmpi.so.40.{}.0", minor + 1);
    std::fs::rename(lib.join(&file), lib.join(&newer)).unwrap();
    let line = mpi_refusal(&step());
    assert!(
        line.contains(&format!(
            "the image's MPI is Open MPI ({newer}), newer than this node's"
        )),
        "{line}"
    );
    std::fs::rename(lib.join(&newer), lib.join(&file)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let o = step();
    assert!(passes(&o), "{}", show(&o));
    // Its libc.so.6 rewritten in place (same inode, same directory) with an older glibc.
    std::fs::write(
        lib.join("libc.so.6"),
        "GNU C Library (fake) stable release version 2.17.\n",
    )
    .unwrap();
    let line = mpi_refusal(&step());
    assert!(
        line.contains("the image's glibc 2.17 is older than the 2."),
        "{line}"
    );
}

#[test]
#[ignore = "root tier: run as root"]
fn berth_gc_removes_old_host_mpi_copies_and_keeps_the_current_one() {
    host_mpi_facts();
    let dir = berth_state().join("host-mpi");
    let current: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(current.iter().any(|p| p.is_dir()), "{current:?}");
    // A copy from before an upgrade of the host's MPI, made long ago, bound by no container.
    let old = dir.join("00000000000000aa");
    std::fs::create_dir(&old).unwrap();
    std::fs::write(old.join("libmpi.so.40.1.0"), "").unwrap();
    std::fs::write(old.with_extension("facts"), "").unwrap();
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for p in [&old, &old.with_extension("facts")] {
        std::fs::File::open(p)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
    }
    let gc = || {
        let mut cmd = Command::new(berth_bin());
        cmd.arg("--config")
            .arg(&cluster().berth_config)
            .arg("gc")
            .stdin(Stdio::null());
        output(cmd)
    };
    let o = gc();
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).contains(&format!("removed the host MPI copy {}", old.display())),
        "{}",
        show(&o)
    );
    assert!(!old.exists() && !old.with_extension("facts").exists());
    // The current copy stays, old as it may be, and steps still use it.
    for p in &current {
        std::fs::File::open(p)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
    }
    let o = gc();
    assert!(o.status.success(), "{}", show(&o));
    assert!(current.iter().all(|p| p.exists()), "{}", show(&o));
    host_mpi_facts();
}

/// Where the two-node cluster keeps its state.
fn two_node_state() -> PathBuf {
    PathBuf::from(format!("{}-2nodes", state_path().display()))
}

/// A second cluster, of two slurmd on this host (start.sh --nodes 2, with berth's test
/// configuration: host_software's defaults, Debian's Open MPI), for `-N2` steps; started on
/// first use, stopped at exit. Its slurm.conf.
fn two_node_conf() -> &'static Path {
    static CONF: OnceLock<PathBuf> = OnceLock::new();
    CONF.get_or_init(|| {
        // The first cluster builds the plugin.
        let _ = cluster();
        let plugin = std::env::var_os("BERTH_TEST_PLUGIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(BERTH).parent().unwrap().join("libspank_berth.so"));
        extern "C" fn stop_two() {
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(two_node_state())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // SAFETY: registering a plain function to run at process exit.
        unsafe { libc::atexit(stop_two) };
        // slurmctld's port and one per slurmd, consecutive.
        let port = (0..50)
            .map(|_| free_port_pair())
            .find(|p| std::net::TcpListener::bind(("0.0.0.0", p + 2)).is_ok())
            .expect("three consecutive free ports");
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(two_node_state())
            .args(["--nodes", "2"])
            .arg("--plugin")
            .arg(&plugin)
            .arg("--berth")
            .arg(berth_bin())
            .env("BERTH_SLURM_PORT", port.to_string())
            .stdin(Stdio::null())
            .output()
            .expect("running integration/slurm/start.sh --nodes 2");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh --nodes 2 failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        two_node_state().join("etc/slurm.conf")
    })
}

#[test]
#[ignore = "root tier: run as root"]
fn container_mpi_host_spans_two_nodes() {
    let img = format!("--container-image={}", debian_image());
    let mut cmd = slurm_as_user(
        "srun",
        &[
            "--mpi=pmix",
            "-N2",
            "-n2",
            &img,
            "--container-mpi=host",
            "/usr/local/bin/mpiwhich",
        ],
    );
    cmd.env("SLURM_CONF", two_node_conf());
    let o = output(cmd);
    assert!(
        mapped_libmpi(&o, 2).starts_with("/usr/lib/berth/host-mpi/libmpi.so.40"),
        "{}",
        show(&o)
    );
}

#[test]
#[ignore = "root tier: run as root"]
fn sbatch_wrap_from_inside_a_container_slurm_step_submits_a_job_that_runs() {
    let c = cluster();
    let img = format!("--container-image={}", debian_image());
    let dir = c.cwd.display().to_string();
    let script = format!(
        "sbatch --parsable -D {dir} -o {dir}/wrapped-%j.out --wrap 'echo wrapped ran as $(id -un)'"
    );
    let o = output(slurm_as_user(
        "srun",
        &[&img, "--container-slurm", "bash", "-c", &script],
    ));
    assert!(o.status.success(), "{}", show(&o));
    let job = stdout(&o).trim().to_string();
    assert!(
        !job.is_empty() && job.chars().all(|ch| ch.is_ascii_digit()),
        "{}",
        show(&o)
    );
    let out = c.cwd.join(format!("wrapped-{job}.out"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if text.contains("wrapped ran") || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(
        text.trim(),
        format!("wrapped ran as {}", test_user_name()),
        "job {job}"
    );
}
