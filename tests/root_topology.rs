//! Root tier for `berth::topology`: GPU/HCA injection into a real container on this host, with
//! stand-in device nodes (real character devices under other names) and stand-in driver files
//! in a fixture host root; the device allow-list enforced by the kernel's BPF filter; overlay
//! whiteouts of an image's loader cache; `berth topo exec` pinning; `berth health` marks for a
//! job. Run by integration/test.sh as root:
//! `cargo test --test root_topology -- --ignored --test-threads=1`.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use berth::runtime::{self, Exit};
use berth::spec::{self, BindMount, Request};
use berth::topology::Host;
use berth::topology::gpu::Recorded;
use berth::topology::inject::{self, DriverFiles};
use berth::topology::ldcache::{self, Entry};
use berth::topology::node::{self, NicPolicy};

use common::*;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn symlink(target: &str, link: &Path) {
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(target, link).unwrap();
}

fn mknod(path: &Path, major: u32, minor: u32) {
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
    assert_eq!(
        rc,
        0,
        "mknod {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
}

fn pci(root: &Path, rel: &str, class: &str, vendor: &str) {
    let dir = root.join("sys/devices").join(rel);
    for (name, value) in [
        ("class", class),
        ("vendor", vendor),
        ("device", "0x2330"),
        ("numa_node", "-1"),
        ("current_link_speed", "32.0 GT/s PCIe"),
        ("current_link_width", "16"),
        ("max_link_speed", "32.0 GT/s PCIe"),
        ("max_link_width", "16"),
    ] {
        write(&dir.join(name), &format!("{value}\n"));
    }
    let bdf = rel.rsplit('/').next().unwrap();
    symlink(
        &format!("../../../devices/{rel}"),
        &root.join("sys/bus/pci/devices").join(bdf),
    );
}

/// A host with two GPUs (minors 0 and 1) and one HCA whose device nodes are stand-ins:
/// nvidia0 = /dev/fuse's numbers, nvidia1 = /dev/net/tun's, the control nodes and the HCA's
/// nodes are /dev/null, zero, full, random and urandom. The driver's libcuda and nvidia-smi are
/// small files (nvidia-smi a shell script).
fn host_fixture(root: &Path) {
    write(&root.join("sys/devices/system/cpu/online"), "0\n");
    write(&root.join("sys/devices/system/node/node0/cpulist"), "0\n");
    let gpu0 = "pci0000:00/0000:00:01.0/0000:01:00.0";
    let gpu1 = "pci0000:00/0000:00:02.0/0000:02:00.0";
    let hca = "pci0000:00/0000:00:03.0/0000:03:00.0";
    for rel in [gpu0, gpu1] {
        pci(root, rel, "0x030200", "0x10de");
    }
    pci(root, hca, "0x020700", "0x15b3");
    let ib = format!("sys/devices/{hca}/infiniband/mlx5_0");
    write(&root.join(&ib).join("ports/1/state"), "4: ACTIVE\n");
    symlink("../..", &root.join(&ib).join("device"));
    symlink(
        &format!("../../devices/{hca}/infiniband/mlx5_0"),
        &root.join("sys/class/infiniband/mlx5_0"),
    );
    write(
        &root.join("sys/class/infiniband_verbs/uverbs0/ibdev"),
        "mlx5_0\n",
    );
    write(
        &root.join("sys/class/infiniband_verbs/uverbs0/dev"),
        "231:192\n",
    );
    for (bdf, minor) in [("0000:01:00.0", 0), ("0000:02:00.0", 1)] {
        write(
            &root.join(format!("proc/driver/nvidia/gpus/{bdf}/information")),
            &format!(
                "Model: \t Stand-in\nGPU UUID: \t GPU-{minor:08x}-test\nDevice Minor: \t {minor}\n"
            ),
        );
    }
    write(
        &root.join("proc/devices"),
        "Character devices:\n195 nvidia-frontend\n",
    );
    mknod(&root.join("dev/nvidia0"), 10, 229);
    mknod(&root.join("dev/nvidia1"), 10, 200);
    mknod(&root.join("dev/nvidiactl"), 1, 3);
    mknod(&root.join("dev/nvidia-uvm"), 1, 5);
    mknod(&root.join("dev/nvidia-uvm-tools"), 1, 7);
    mknod(&root.join("dev/infiniband/uverbs0"), 1, 8);
    mknod(&root.join("dev/infiniband/rdma_cm"), 1, 9);
    let lib = "usr/lib/x86_64-linux-gnu";
    write(
        &root.join(lib).join("libcuda.so.550.54.15"),
        "stand-in libcuda\n",
    );
    symlink("libcuda.so.550.54.15", &root.join(lib).join("libcuda.so.1"));
    std::fs::write(
        root.join("etc/ld.so.cache"),
        ldcache::write(&[Entry::native(
            "libcuda.so.1",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        )]),
    )
    .unwrap();
    write(
        &root.join("usr/bin/nvidia-smi"),
        "#!/bin/sh\necho \"stand-in nvidia-smi sees $CUDA_VISIBLE_DEVICES\"\n",
    );
    std::fs::set_permissions(
        root.join("usr/bin/nvidia-smi"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
}

fn options() -> runtime::Options {
    runtime::Options {
        cgroup_root: PathBuf::from(cgroup_root()),
        state_dir: state_dir(),
        timeout: Some(Duration::from_secs(30)),
        kill_timeout: Duration::from_secs(10),
        block_device_mounts: false,
        user_namespace: true,
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_container_sees_exactly_its_gpu_and_hca() {
    let fx = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(fx.path().join("etc")).unwrap();
    host_fixture(fx.path());
    let host = Host::new(fx.path());
    let node = node::discover(&host, &Recorded::no_driver(), &NicPolicy::default()).unwrap();
    assert_eq!(node.gpus.len(), 2);
    let plan = inject::plan(
        &host,
        &node,
        &[0],
        &["mlx5_0".to_string()],
        &DriverFiles::default(),
    )
    .unwrap();
    let numbers: Vec<String> = plan
        .devices
        .iter()
        .map(|d| format!("{} {}:{}", d.path.display(), d.major, d.minor))
        .collect();
    assert_eq!(
        numbers,
        [
            "/dev/nvidia0 10:229",
            "/dev/nvidiactl 1:3",
            "/dev/nvidia-uvm 1:5",
            "/dev/nvidia-uvm-tools 1:7",
            "/dev/infiniband/uverbs0 1:8",
            "/dev/infiniband/rdma_cm 1:9",
        ],
        "the host's nodes were stat'ed"
    );

    let out = tempfile::tempdir().unwrap();
    let mut s = spec::build(&Request {
        rootfs: rootfs().to_path_buf(),
        args: vec![
            "/bin/sh".into(),
            "-c".into(),
            r#"exec > /out/report 2>&1
for d in nvidia0 nvidia1 nvidiactl nvidia-uvm infiniband/uverbs0 infiniband/rdma_cm; do
  if [ -e /dev/$d ]; then
    if (exec 3</dev/$d) 2>/dev/null; then echo "$d opens $(stat -c %t:%T /dev/$d)"; else echo "$d denied"; fi
  else echo "$d absent"; fi
done
cat /usr/lib/x86_64-linux-gnu/libcuda.so.1
(echo x >> /usr/lib/x86_64-linux-gnu/libcuda.so.1) 2>/dev/null && echo "library writable" || echo "library read-only"
/usr/bin/nvidia-smi
md5sum /etc/ld.so.cache | cut -d' ' -f1
echo "env $CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES"
"#
            .into(),
        ],
        user: berth::user::current().unwrap(),
        env: vec![("CUDA_VISIBLE_DEVICES".into(), "1".into())],
        mounts: vec![BindMount {
            source: out.path().to_path_buf(),
            destination: "/out".into(),
            readonly: false,
        }],
        ..Default::default()
    })
    .unwrap();
    inject::apply(&mut s, &plan).unwrap();
    let image_cache = inject::read_image_loader_cache(&[rootfs().to_path_buf()]).unwrap();
    let (cache, warning) = inject::container_loader_cache(image_cache.as_deref(), &plan);
    assert_eq!(warning, None);
    let cache_file = out.path().join("ld.so.cache.generated");
    std::fs::write(&cache_file, &cache).unwrap();
    inject::mount_loader_cache(&mut s, &cache_file).unwrap();

    let outcome = runtime::run(&s, &[rootfs().to_path_buf()], &options()).unwrap();
    let report = std::fs::read_to_string(out.path().join("report")).unwrap();
    assert_eq!(outcome.exit, Exit::Code(0), "{report}");
    let md5 = Command::new("md5sum").arg(&cache_file).output().unwrap();
    let md5 = String::from_utf8(md5.stdout).unwrap();
    let md5 = md5.split_whitespace().next().unwrap();
    assert_eq!(
        report,
        format!(
            "nvidia0 opens a:e5\n\
             nvidia1 absent\n\
             nvidiactl opens 1:3\n\
             nvidia-uvm opens 1:5\n\
             infiniband/uverbs0 opens 1:8\n\
             infiniband/rdma_cm opens 1:9\n\
             stand-in libcuda\n\
             library read-only\n\
             stand-in nvidia-smi sees 0\n\
             {md5}\n\
             env 0 GPU-00000000-test\n"
        )
    );

    // A device node the plan does not allow cannot even be created: the cgroup's device filter
    // holds exactly the plan's rules (and berth's defaults).
    let mut linux = s.linux().clone().unwrap();
    let mut devices = linux.devices().clone().unwrap();
    devices.push(
        oci_spec::runtime::LinuxDeviceBuilder::default()
            .path("/dev/nvidia1")
            .typ(oci_spec::runtime::LinuxDeviceType::C)
            .major(10)
            .minor(200)
            .file_mode(0o666u32)
            .build()
            .unwrap(),
    );
    linux.set_devices(Some(devices));
    s.set_linux(Some(linux));
    let err = runtime::run(&s, &[rootfs().to_path_buf()], &options()).unwrap_err();
    assert!(
        err.to_string()
            .contains("creating device /dev/nvidia1: EPERM"),
        "{err}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_whiteout_hides_a_lower_layers_loader_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (top, bottom) = (dir.path().join("top"), dir.path().join("bottom"));
    write(&bottom.join("etc/ld.so.cache"), "bottom");
    mknod(&top.join("etc/ld.so.cache"), 0, 0);
    assert_eq!(
        inject::read_image_loader_cache(&[top.clone(), bottom.clone()]).unwrap(),
        None
    );
    assert_eq!(
        inject::read_image_loader_cache(&[bottom])
            .unwrap()
            .as_deref(),
        Some(&b"bottom"[..])
    );
}

/// A fixture host of two CPUs on one NUMA node, for `berth topo exec`.
fn two_cpu_host(root: &Path) {
    write(&root.join("sys/devices/system/cpu/online"), "0-1\n");
    write(&root.join("sys/devices/system/node/node0/cpulist"), "0-1\n");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn topo_exec_pins_the_command_to_its_rank() {
    let fx = tempfile::tempdir().unwrap();
    two_cpu_host(fx.path());
    let out = berth(&[
        "topo",
        "--host-root",
        fx.path().to_str().unwrap(),
        "exec",
        "--tasks",
        "2",
        "--rank",
        "1",
        "--",
        "sh",
        "-c",
        "grep Cpus_allowed_list /proc/self/status; grep -c . /proc/self/numa_maps >/dev/null; echo done",
    ])
    .env_remove("SLURM_JOB_ID")
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("Cpus_allowed_list:\t1\n"), "{stdout}");
    let out = berth(&["topo", "exec", "--", "/nonexistent/cmd"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("berth: running /nonexistent/cmd: "),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn health_marks_the_kernel_log_at_job_start_and_checks_xids_at_job_end() {
    let fx = tempfile::tempdir().unwrap();
    two_cpu_host(fx.path());
    let log = fx.path().join("kmsg");
    write(
        &log,
        "4,7,100,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n",
    );
    let health = |flag: &str| {
        berth(&[
            "health",
            "--host-root",
            fx.path().to_str().unwrap(),
            "--kmsg",
            log.to_str().unwrap(),
            flag,
        ])
        .env("SLURM_JOB_ID", "4242")
        .output()
        .unwrap()
    };
    let start = health("--job-start");
    assert!(start.status.success(), "{:?}", start);
    assert_eq!(
        std::fs::read_to_string(state_dir().join("health/job-4242.kmsg-seq")).unwrap(),
        "7\n",
        "the Prolog noted where the log stood"
    );
    // An XID before the job does not count; one during it drains the node.
    let before_end = std::fs::read_to_string(&log).unwrap();
    write(
        &log,
        &format!("{before_end}4,8,200,-;NVRM: Xid (PCI:0000:43:00): 48, pid=2, DBE\n"),
    );
    let end = health("--job-end");
    assert_eq!(end.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&end.stdout),
        "GPU 0000:43:00: Xid 48\n"
    );
    assert!(!state_dir().join("health/job-4242.kmsg-seq").exists());
    // The live kernel log is readable as root.
    let live = berth(&["health", "--all-xids"]).output().unwrap();
    let text = String::from_utf8_lossy(&live.stdout);
    assert!(
        text.contains("xid:") || live.status.code() == Some(1),
        "{text}"
    );
    assert!(!text.contains("not checked"), "{text}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn topo_runs_on_this_host() {
    let out = berth(&["topo"]).output().unwrap();
    assert!(out.status.success(), "{:?}", out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("NUMA nodes:"), "{text}");
    let out = berth(&["topo", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["gpus"].is_array());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_dynamic_loader_finds_libraries_through_a_written_cache() {
    // The host's cache plus one library under a name only the new cache knows, bound over
    // /etc/ld.so.cache in a private mount namespace: the real loader must find every library
    // python3 needs (binary search over ~800 sorted entries) and the added one.
    let dir = tempfile::tempdir().unwrap();
    let libz = std::fs::canonicalize("/lib/x86_64-linux-gnu/libz.so.1").unwrap();
    let added = dir.path().join("libberth-test.so.7");
    std::fs::copy(&libz, &added).unwrap();
    let host = std::fs::read("/etc/ld.so.cache").unwrap();
    let entries = ldcache::parse(&host, Path::new("/etc/ld.so.cache")).unwrap();
    let merged = ldcache::merge(
        entries,
        &[Entry::native("libberth-test.so.7", added.to_str().unwrap())],
    );
    let cache = dir.path().join("ld.so.cache");
    std::fs::write(&cache, ldcache::write(&merged)).unwrap();
    let script = format!(
        "mount --bind {} /etc/ld.so.cache && /usr/bin/python3 -c \"import ctypes, zlib; \
         l = ctypes.CDLL('libberth-test.so.7'); print(l.zlibVersion is not None, zlib.ZLIB_VERSION != '')\"",
        cache.display()
    );
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "True True\n");
    // Without the new cache the name is unknown.
    let out = Command::new("/usr/bin/python3")
        .args(["-c", "import ctypes; ctypes.CDLL('libberth-test.so.7')"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// The test configuration with `[topology]` lines added, in `dir`.
fn config_with_topology(dir: &Path, topology: &str) -> PathBuf {
    let path = dir.join("berth.toml");
    let base = std::fs::read_to_string(config()).unwrap();
    std::fs::write(&path, format!("{base}[topology]\n{topology}")).unwrap();
    path
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_epilog_fails_with_the_health_reason_on_an_unfit_node() {
    let job = format!("{}", 700_000 + std::process::id() % 1000);
    let verb = |cfg: &Path, verb: &str| {
        Command::new(BERTH)
            .arg("--config")
            .arg(cfg)
            .arg(verb)
            .env("SLURM_JOB_ID", &job)
            .env_remove("SLURM_JOB_UID")
            .env_remove("SPANK_BERTH_IMAGE")
            .output()
            .unwrap()
    };

    // No GPU, no RDMA NIC: fit. An XID logged during the job (after the Prolog's mark) is not.
    let fx = tempfile::tempdir().unwrap();
    two_cpu_host(fx.path());
    let log = fx.path().join("dev/kmsg");
    write(&log, "6,1,10,-;Linux version\n");
    let cfg = config_with_topology(
        fx.path(),
        &format!("host_root = \"{}\"\n", fx.path().display()),
    );
    let prolog = verb(&cfg, "prolog");
    assert!(prolog.status.success(), "{prolog:?}");
    let epilog = verb(&cfg, "epilog");
    assert!(epilog.status.success(), "{epilog:?}");
    assert!(verb(&cfg, "prolog").status.success());
    write(
        &log,
        "6,1,10,-;Linux version\n4,2,20,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n",
    );
    let epilog = verb(&cfg, "epilog");
    assert_eq!(epilog.status.code(), Some(1), "{epilog:?}");
    assert_eq!(stderr(&epilog), "berth: GPU 0000:1b:00: Xid 79\n");
    // The mark is gone with the job: a later Epilog without a Prolog judges no XIDs.
    assert!(verb(&cfg, "epilog").status.success());

    // Two GPUs on the bus that no driver answers for: the drain reason says so, in one line.
    let gpus = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(gpus.path().join("etc")).unwrap();
    host_fixture(gpus.path());
    let cfg = config_with_topology(
        gpus.path(),
        &format!("host_root = \"{}\"\n", gpus.path().display()),
    );
    let epilog = verb(&cfg, "epilog");
    assert_eq!(epilog.status.code(), Some(1), "{epilog:?}");
    let err = stderr(&epilog);
    assert!(
        err.starts_with("berth: 2 NVIDIA GPUs but NVML cannot load"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // topology.epilog_health = false leaves node health to another tool.
    let cfg = config_with_topology(
        gpus.path(),
        &format!(
            "host_root = \"{}\"\nepilog_health = false\n",
            gpus.path().display()
        ),
    );
    assert!(verb(&cfg, "epilog").status.success());
}
