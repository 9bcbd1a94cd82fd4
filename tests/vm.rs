//! VM tier: `berth run` under a real cgroup v2 hierarchy with the memory, pids, cpu, cpuset and io
//! controllers, which this host's hybrid layout does not offer. Each test boots a throwaway VM with
//! `integration/vm/run.sh` (QEMU, TCG, a Debian cloud kernel, busybox userland), with the berth
//! binary at /usr/bin/berth and a busybox rootfs at /rootfs, and runs a shell script in it as
//! root. berth uses its default configuration there: cgroup root /sys/fs/cgroup/berth.
//!
//! Run by integration/test.sh: `cargo test --test vm -- --ignored --test-threads=1`.
//! Needs qemu-system-x86, cpio and busybox-static, and the kernel cached by
//! integration/vm/prepare.sh (run.sh fetches it on first use).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

const BERTH: &str = env!("CARGO_BIN_EXE_berth");
const REPO: &str = env!("CARGO_MANIFEST_DIR");
const WORK: &str = env!("CARGO_TARGET_TMPDIR");

/// The binary under test: this build's, or `$BERTH_TEST_BIN` (an older build, to show that a
/// test fails without the fix it covers).
fn berth_bin() -> String {
    std::env::var("BERTH_TEST_BIN").unwrap_or_else(|_| BERTH.to_string())
}

/// A busybox rootfs built on the host once (the VM has no bash to run the builder).
fn rootfs() -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| {
        let dest = Path::new(WORK).join("vm-busybox-rootfs");
        let status = Command::new("bash")
            .arg(Path::new(REPO).join("integration/busybox-rootfs.sh"))
            .arg(&dest)
            .status()
            .expect("running integration/busybox-rootfs.sh");
        assert!(status.success(), "building the busybox rootfs failed");
        dest
    })
}

/// Runs `script` with /bin/sh as root in a fresh VM (2 CPUs), with berth at /usr/bin/berth and the
/// busybox rootfs at /rootfs. Returns the script's output (stdout and stderr) and exit status.
/// Panics when the VM itself fails (the harness's status 125 with a `vm:` reason).
fn vm(script: &str) -> (String, i32) {
    vm_with(&[], script)
}

fn vm_with(harness_args: &[&str], script: &str) -> (String, i32) {
    static COUNT: AtomicU32 = AtomicU32::new(0);
    let dir = Path::new(WORK).join("vm-scripts");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!(
        "{}-{}.sh",
        std::process::id(),
        COUNT.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::write(&file, script).unwrap();
    let out = Command::new(Path::new(REPO).join("integration/vm/run.sh"))
        .arg("--file")
        .arg(format!("{}:/usr/bin/berth", berth_bin()))
        .arg("--file")
        .arg(format!("{}:/rootfs", rootfs().display()))
        .args(["--smp", "2", "--mem", "1024", "--timeout", "180"])
        .args(harness_args)
        .arg(&file)
        .output()
        .expect("running integration/vm/run.sh");
    let _ = std::fs::remove_file(&file);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let status = out.status.code().unwrap_or(-1);
    eprintln!("--- VM script:\n{script}\n--- VM output (status {status}):\n{stdout}");
    if !stderr.is_empty() {
        eprintln!("--- harness stderr:\n{stderr}");
    }
    assert!(
        !(status == 125 && stderr.contains("vm: ")),
        "the VM failed, not the test: {stderr}\n{stdout}"
    );
    (stdout, status)
}

/// The value of the first `key=value` line of `out`.
fn field<'a>(out: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}=");
    out.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {key}= line in the VM output:\n{out}"))
        .trim()
}

fn num(out: &str, key: &str) -> f64 {
    let v = field(out, key);
    v.parse()
        .unwrap_or_else(|_| panic!("{key}={v} is not a number in the VM output:\n{out}"))
}

/// The text between `BEGIN name` and `END name` lines.
fn section<'a>(out: &'a str, name: &str) -> &'a str {
    let begin = format!("BEGIN {name}\n");
    let end = format!("END {name}");
    let start = out
        .find(&begin)
        .unwrap_or_else(|| panic!("no BEGIN {name} in the VM output:\n{out}"))
        + begin.len();
    let len = out[start..]
        .find(&end)
        .unwrap_or_else(|| panic!("no END {name} in the VM output:\n{out}"));
    &out[start..start + len]
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn harness_boots_with_cgroup2_controllers_and_reports_the_exit_status() {
    let (out, status) = vm(r#"
echo "controllers=$(cat /sys/fs/cgroup/cgroup.subtree_control)"
echo "berth=$(command -v berth)"
test -x /rootfs/bin/busybox && echo rootfs=ok
mkdir -p /tmp/o/l /tmp/o/u /tmp/o/w /tmp/o/m && echo lower > /tmp/o/l/f
mount -t overlay overlay -o lowerdir=/tmp/o/l,upperdir=/tmp/o/u,workdir=/tmp/o/w /tmp/o/m &&
  echo "overlay=$(cat /tmp/o/m/f)"
unshare -m -p -f sh -c 'mount --make-rprivate / && mkdir /tmp/nr && mount -t tmpfs t /tmp/nr &&
  mkdir /tmp/nr/old && cd /tmp/nr && pivot_root . old && echo "pivot_root=ok pid=$$"'
exit 3
"#);
    assert_eq!(status, 3, "the script's exit status comes back:\n{out}");
    let controllers: Vec<&str> = field(&out, "controllers").split(' ').collect();
    for c in ["cpu", "cpuset", "memory", "pids", "io"] {
        assert!(
            controllers.contains(&c),
            "{c} is not enabled: {controllers:?}"
        );
    }
    assert_eq!(field(&out, "berth"), "/usr/bin/berth");
    assert_eq!(field(&out, "rootfs"), "ok");
    assert_eq!(field(&out, "overlay"), "lower");
    assert_eq!(field(&out, "pivot_root"), "ok pid=1");
    assert!(!out.contains('\r'), "CR characters in the output: {out:?}");
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn memory_limit_oom_kills_and_exits_137() {
    let (out, _) = vm(r#"
hog='dd if=/dev/zero of=/dev/null bs=64M count=1'
berth run --rootfs /rootfs --memory 32M -- $hog 2>/tmp/err
echo "limited=$?"
echo "BEGIN limited-stderr"; cat /tmp/err; echo "END limited-stderr"
berth run --rootfs /rootfs --memory 128M -- $hog 2>/tmp/err
echo "control=$?"
echo "BEGIN control-stderr"; cat /tmp/err; echo "END control-stderr"
"#);
    let stderr = section(&out, "limited-stderr");
    assert_eq!(
        field(&out, "limited"),
        "137",
        "a 64 MiB buffer under --memory 32M:\n{out}"
    );
    assert!(
        stderr.contains("out of memory"),
        "berth says the command ran out of memory: {stderr}"
    );
    assert_eq!(
        field(&out, "control"),
        "0",
        "the same command under --memory 128M succeeds:\n{out}"
    );
    assert!(!section(&out, "control-stderr").contains("out of memory"));
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn pids_limit_stops_forks() {
    // The inner shell starts 30 `sleep`s, each announcing itself once forked; forks fail at the
    // limit. The outer shell then reads the cgroup with builtins only, since it cannot fork either
    // while the sleeps hold the slots. berth's init and both shells count against the 16.
    let (out, _) = vm(r#"
berth run --rootfs /rootfs --pids 16 -- sh -c '
  read max < /sys/fs/cgroup/pids.max; echo "pids.max=$max"
  sh -c "i=0; while [ \$i -lt 30 ]; do { echo started; exec sleep 10; } & i=\$((i+1)); done" 2>&1
  read current < /sys/fs/cgroup/pids.current; echo "pids.current=$current"
  while read k v; do echo "events.$k=$v"; done < /sys/fs/cgroup/pids.events
' 2>&1
echo "status=$?"
"#);
    assert_eq!(field(&out, "pids.max"), "16", "{out}");
    let started = out.lines().filter(|l| *l == "started").count();
    assert!(
        (4..=14).contains(&started),
        "started {started} sleeps of 30 under --pids 16:\n{out}"
    );
    assert!(
        out.contains("can't fork") || out.contains("Resource temporarily unavailable"),
        "fork fails at the limit:\n{out}"
    );
    assert!(num(&out, "pids.current") <= 16.0, "{out}");
    assert!(
        num(&out, "events.max") >= 1.0,
        "pids.events counts refused forks:\n{out}"
    );
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn cpu_limit_throttles_a_busy_loop_to_half_a_cpu() {
    let (out, _) = vm(r#"
berth run --rootfs /rootfs --cpus 0.5 -- sh -c '
  echo "cpu.max=$(cat /sys/fs/cgroup/cpu.max)"
  usage() { sed -n "s/^usage_usec //p" /sys/fs/cgroup/cpu.stat; }
  while :; do :; done &
  loop=$!
  sleep 0.2
  u0=$(usage); t0=$(cut -d" " -f1 /proc/uptime)
  sleep 2
  u1=$(usage); t1=$(cut -d" " -f1 /proc/uptime)
  kill $loop
  echo "u0=$u0"; echo "u1=$u1"; echo "t0=$t0"; echo "t1=$t1"
'
echo "status=$?"
"#);
    assert_eq!(field(&out, "cpu.max"), "50000 100000", "{out}");
    assert_eq!(field(&out, "status"), "0", "{out}");
    let used = (num(&out, "u1") - num(&out, "u0")) / 1e6;
    let wall = num(&out, "t1") - num(&out, "t0");
    let share = used / wall;
    eprintln!(
        "busy loop used {used:.3} s of CPU in {wall:.2} s: {:.0}%",
        share * 100.0
    );
    assert!(wall >= 1.9, "the window is 2 s of guest time, was {wall}");
    assert!(
        share <= 0.55,
        "--cpus 0.5 let the loop use {:.0}% of a CPU",
        share * 100.0
    );
    assert!(
        share > 0.20,
        "the loop hardly ran ({:.0}%): the test proves nothing",
        share * 100.0
    );
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn cpuset_pins_the_container() {
    let (out, _) = vm(r#"
echo "vm=$(grep Cpus_allowed_list /proc/self/status | cut -f2)"
berth run --rootfs /rootfs --cpuset 1 -- sh -c 'echo "pinned=$(grep Cpus_allowed_list /proc/self/status | cut -f2)"'
echo "status=$?"
berth run --rootfs /rootfs -- sh -c 'echo "unpinned=$(grep Cpus_allowed_list /proc/self/status | cut -f2)"'
"#);
    assert_eq!(field(&out, "vm"), "0-1", "the VM has two CPUs:\n{out}");
    assert_eq!(field(&out, "status"), "0", "{out}");
    assert_eq!(field(&out, "pinned"), "1", "{out}");
    assert_eq!(field(&out, "unpinned"), "0-1", "{out}");
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn device_filter_denies_devices_outside_the_allow_list() {
    // A process that joins the container's cgroup from outside is subject to its device filter:
    // /dev/kmsg and /dev/mem are not on the allow-list, /dev/null is. Opens are write-only, so
    // that only the device filter (not dmesg_restrict) can refuse them.
    let (out, _) = vm(r#"
: > /dev/kmsg && echo "vm-kmsg=ok"
berth run --rootfs /rootfs -- sleep 5 &
berth=$!
cg=
for i in $(seq 100); do
  for d in /sys/fs/cgroup/berth/*/; do
    grep -q . "$d/cgroup.procs" 2>/dev/null && cg=${d%/}
  done
  [ -n "$cg" ] && break
  sleep 0.1
done
echo "cgroups=$(ls -d /sys/fs/cgroup/berth/*/ | wc -l)"
echo "cg=$cg"
try() { sh -c "echo \$\$ > $cg/cgroup.procs && { : > $1; } 2>&1 && echo ok"; }
echo "kmsg=$(try /dev/kmsg)"
echo "mem=$(try /dev/mem)"
echo "null=$(try /dev/null)"
wait $berth
echo "berth=$?"
"#);
    assert_eq!(
        field(&out, "vm-kmsg"),
        "ok",
        "/dev/kmsg opens outside the container:\n{out}"
    );
    assert_eq!(field(&out, "cgroups"), "1", "one container cgroup:\n{out}");
    assert!(
        field(&out, "cg").starts_with("/sys/fs/cgroup/berth/"),
        "{out}"
    );
    for dev in ["kmsg", "mem"] {
        let v = field(&out, dev);
        assert!(
            v.contains("Operation not permitted") && !v.ends_with("ok"),
            "/dev/{dev} from inside the container's cgroup: {v}"
        );
    }
    assert_eq!(field(&out, "null"), "ok", "/dev/null is allowed:\n{out}");
    assert_eq!(
        field(&out, "berth"),
        "0",
        "the container ran on undisturbed:\n{out}"
    );
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn device_flag_exposes_and_allows_a_device() {
    let (out, _) = vm(r#"
berth run --rootfs /rootfs --device /dev/kmsg -- sh -c '
  test -c /dev/kmsg && echo "with-node=yes"
  : > /dev/kmsg && echo "with-open=ok"
' 2>&1
echo "with-status=$?"
berth run --rootfs /rootfs -- sh -c 'test -e /dev/kmsg && echo without=present || echo without=absent' 2>&1
"#);
    assert_eq!(
        field(&out, "with-node"),
        "yes",
        "--device /dev/kmsg creates the node:\n{out}"
    );
    assert_eq!(
        field(&out, "with-open"),
        "ok",
        "--device /dev/kmsg allows it:\n{out}"
    );
    assert_eq!(field(&out, "with-status"), "0", "{out}");
    assert_eq!(
        field(&out, "without"),
        "absent",
        "no /dev/kmsg without --device:\n{out}"
    );
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn limits_are_visible_inside_the_container() {
    let (out, _) = vm(r#"
berth run --rootfs /rootfs --memory 64M --memory-swap 16M --cpus 1.5 --pids 50 -- sh -c '
  echo "memory.max=$(cat /sys/fs/cgroup/memory.max)"
  echo "memory.swap.max=$(cat /sys/fs/cgroup/memory.swap.max)"
  echo "cpu.max=$(cat /sys/fs/cgroup/cpu.max)"
  echo "pids.max=$(cat /sys/fs/cgroup/pids.max)"
  echo "cgroup=$(cat /proc/self/cgroup)"
'
echo "status=$?"
"#);
    assert_eq!(field(&out, "status"), "0", "{out}");
    assert_eq!(field(&out, "memory.max"), "67108864", "{out}");
    assert_eq!(field(&out, "memory.swap.max"), "16777216", "{out}");
    assert_eq!(field(&out, "cpu.max"), "150000 100000", "{out}");
    assert_eq!(field(&out, "pids.max"), "50", "{out}");
    assert_eq!(
        field(&out, "cgroup"),
        "0::/",
        "the container is the root of its cgroup namespace"
    );
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn nothing_is_left_after_containers_exit() {
    let (out, _) = vm(r#"
cat /proc/mounts > /tmp/mounts.before
berth run --rootfs /rootfs -- true; echo "true=$?"
berth run --rootfs /rootfs -- sh -c 'exit 7'; echo "exit7=$?"
berth run --rootfs /rootfs -- sh -c 'sleep 100 & echo bg'; echo "background=$?"
berth run --rootfs /rootfs --timeout 1 -- sleep 100; echo "timeout=$?"
berth run --rootfs /rootfs --memory 32M -- dd if=/dev/zero of=/dev/null bs=64M count=1 2>/dev/null
echo "oom=$?"
berth run --rootfs /rootfs --pids 8 --cpus 0.5 --cpuset 0 --device /dev/kmsg -- true; echo "limits=$?"
echo "BEGIN cgroups"; find /sys/fs/cgroup/berth -mindepth 1 -type d; echo "END cgroups"
echo "BEGIN mounts"; grep -vxF -f /tmp/mounts.before /proc/mounts; echo "END mounts"
echo "BEGIN state"; ls -A /run/berth 2>/dev/null; echo "END state"
echo "BEGIN processes"
for p in /proc/[0-9]*; do
  c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null)
  case $c in "/bin/sh /berth/script"*) ;; *berth*|*sleep*) echo "${p#/proc/}: $c" ;; esac
done
echo "END processes"
"#);
    assert_eq!(
        section(&out, "cgroups"),
        "",
        "cgroups left under /sys/fs/cgroup/berth"
    );
    assert_eq!(section(&out, "mounts"), "", "mounts left behind");
    assert_eq!(
        section(&out, "state"),
        "",
        "state directories left in /run/berth"
    );
    assert_eq!(section(&out, "processes"), "", "processes left behind");
    // The runs above must have ended the way each was meant to, or the check proves less.
    assert_eq!(field(&out, "true"), "0", "{out}");
    assert_eq!(field(&out, "exit7"), "7", "{out}");
    assert_eq!(field(&out, "background"), "0", "{out}");
    assert_eq!(field(&out, "timeout"), "124", "{out}");
    assert_eq!(field(&out, "oom"), "137", "{out}");
    assert_eq!(field(&out, "limits"), "0", "{out}");
}

/// A fixture host root for `topology.host_root` with two NVIDIA GPUs (minors 0 and 1) in sysfs
/// and the driver's /proc files; the device nodes are made in the VM (a cpio of the host's
/// files carries none).
fn gpu_fixture() -> PathBuf {
    let root = Path::new(WORK).join(format!("vm-gpu-fixture-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let put = |rel: &str, text: &str| {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    put("sys/devices/system/cpu/online", "0-1\n");
    put("sys/devices/system/node/node0/cpulist", "0-1\n");
    for (bus, minor) in [("01", 0), ("02", 1)] {
        let rel = format!("pci0000:00/0000:00:{bus}.0/0000:{bus}:00.0");
        for (name, value) in [
            ("class", "0x030200"),
            ("vendor", "0x10de"),
            ("device", "0x2330"),
            ("numa_node", "-1"),
        ] {
            put(&format!("sys/devices/{rel}/{name}"), &format!("{value}\n"));
        }
        let bdf = format!("0000:{bus}:00.0");
        let link = root.join("sys/bus/pci/devices").join(&bdf);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(format!("../../../devices/{rel}"), link).unwrap();
        put(
            &format!("proc/driver/nvidia/gpus/{bdf}/information"),
            &format!(
                "Model: \t Stand-in\nGPU UUID: \t GPU-{minor:08x}-vm\nDevice Minor: \t {minor}\n"
            ),
        );
    }
    put("proc/devices", "Character devices:\n195 nvidia-frontend\n");
    root
}

#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn gpus_flag_allows_exactly_the_given_gpus_device_nodes() {
    // Stand-in GPU nodes with NVIDIA's major 195 and no driver behind them: a node the device
    // filter allows fails to open with ENXIO (no such device), one it does not with EPERM.
    let fx = gpu_fixture();
    let (out, _) = vm_with(
        &["--file", &format!("{}:/fx", fx.display())],
        r#"
mkdir -p /fx/dev
mknod -m 666 /fx/dev/nvidia0 c 195 0
mknod -m 666 /fx/dev/nvidia1 c 195 1
mknod -m 666 /fx/dev/nvidiactl c 195 255
printf '[topology]\nhost_root = "/fx"\n' > /tmp/berth.toml
opens() { (: < "$1") 2>&1 | sed 's/.*: //'; }
echo "host-nvidia1=$(opens /fx/dev/nvidia1)"
berth --config /tmp/berth.toml run --rootfs /rootfs --gpus 0 -- sh -c '
  for d in nvidia0 nvidia1 nvidiactl; do
    if [ -c /dev/$d ]; then echo "in-$d=$( (: < /dev/$d) 2>&1 | sed "s/.*: //")"; else echo "in-$d=absent"; fi
  done
  echo "in-cuda=$CUDA_VISIBLE_DEVICES"
  sleep 8' &
berth=$!
cg=
for i in $(seq 100); do
  for d in /sys/fs/cgroup/berth/*/; do
    grep -q . "$d/cgroup.procs" 2>/dev/null && cg=${d%/}
  done
  [ -n "$cg" ] && break
  sleep 0.1
done
echo "cg=$cg"
try() { sh -c "echo \$\$ > $cg/cgroup.procs && { : < $1; } 2>&1 | sed 's/.*: //'"; }
echo "out-nvidia0=$(try /fx/dev/nvidia0)"
echo "out-nvidia1=$(try /fx/dev/nvidia1)"
echo "out-nvidiactl=$(try /fx/dev/nvidiactl)"
wait $berth
echo "berth=$?"
"#,
    );
    let _ = std::fs::remove_dir_all(&fx);
    const ENXIO: &str = "No such device or address";
    const EPERM: &str = "Operation not permitted";
    assert_eq!(
        field(&out, "host-nvidia1"),
        ENXIO,
        "outside any container the stand-in opens as far as the missing driver:\n{out}"
    );
    assert!(
        field(&out, "cg").starts_with("/sys/fs/cgroup/berth/"),
        "{out}"
    );
    assert_eq!(field(&out, "in-nvidia0"), ENXIO, "{out}");
    assert_eq!(field(&out, "in-nvidiactl"), ENXIO, "{out}");
    assert_eq!(field(&out, "in-nvidia1"), "absent", "{out}");
    assert_eq!(field(&out, "in-cuda"), "0", "{out}");
    assert_eq!(field(&out, "out-nvidia0"), ENXIO, "allowed GPU:\n{out}");
    assert_eq!(field(&out, "out-nvidiactl"), ENXIO, "control node:\n{out}");
    assert_eq!(
        field(&out, "out-nvidia1"),
        EPERM,
        "the GPU not given is refused by the device filter:\n{out}"
    );
    assert_eq!(field(&out, "berth"), "0", "{out}");
}

/// The absolute path of a program on this host's PATH.
fn which(program: &str) -> String {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} not found on PATH"))
        .display()
        .to_string()
}

/// A diskless node whose root is the initramfs itself (rootfs, which pivot_root(2) refuses with
/// EINVAL): containers run there (berth moves the root onto `/` and chroots, as runc and crun
/// do), see the image's root and none of the host's files or mounts, keep the /proc masks, and
/// have no way back: no chroot (no capability) and no user namespace of their own in which to
/// get one (the kernel counts them as chrooted). A process joining with `berth exec` lands in
/// the container's root too, and nothing is left on the host afterwards.
#[test]
#[ignore = "vm tier: run by integration/test.sh"]
fn containers_run_on_an_initramfs_root_without_pivot_root() {
    // A host mount that only the host uses: a squashfs on a loop device that frees itself when
    // its last mount goes. It must go with the host's unmount even while a container runs: the
    // container's namespace holds no copy of it.
    let probe = Path::new(WORK).join(format!("vm-probe-{}.sqsh", std::process::id()));
    let src = Path::new(WORK).join(format!("vm-probe-{}", std::process::id()));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("probe"), "probe\n").unwrap();
    let _ = std::fs::remove_file(&probe);
    let made = Command::new("mksquashfs")
        .arg(&src)
        .arg(&probe)
        .args(["-quiet", "-no-progress"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("running mksquashfs");
    assert!(made.success(), "mksquashfs failed");
    let file = format!("{}:/probe.sqsh", probe.display());
    let mksquashfs = which("mksquashfs");
    let (out, status) = vm_with(
        &["--initramfs-root", "--file", &file, "--file", &mksquashfs],
        r#"
echo "host_root_fs=$(awk '$2 == "/" {print $3; exit}' /proc/mounts)"
mkdir -p /probe && mount -o loop,ro /probe.sqsh /probe && echo "probe=$(cat /probe/probe)"
unshare -m sh -c 'mount --make-rprivate / && mkdir -p /tmp/nr && mount -t tmpfs t /tmp/nr &&
  mkdir /tmp/nr/old && cd /tmp/nr && pivot_root . old' 2>/dev/null
echo "host_pivot_root=$?"
unshare -U true 2>/dev/null; echo "host_userns=$?"
echo host > /host-only-file
cat /proc/mounts > /tmp/mounts.before
berth run --rootfs /rootfs -- sh -c '
  echo "image=$(. /etc/os-release; echo $ID)"
  test -e /host-only-file && echo host_file=visible || echo host_file=hidden
  test -e /berth/script && echo host_dir=visible || echo host_dir=hidden
  echo "kcore_bytes=$(head -c 1 /proc/kcore 2>/dev/null | wc -c)"
  chroot /bin true 2>/dev/null; echo "chroot=$?"
  unshare -U true 2>/dev/null; echo "userns=$?"
  echo BEGIN mountinfo; cut -d" " -f5 /proc/self/mountinfo; echo END mountinfo
'
echo "run=$?"
id=$(berth create --rootfs /rootfs --name held); echo "create=$?"
umount /probe; echo "BEGIN loops_held"; cat /sys/block/loop*/loop/backing_file 2>/dev/null; echo "END loops_held"
berth exec held -- sh -c 'echo "exec_image=$(. /etc/os-release; echo $ID)"; echo "exec_cwd=$(pwd)";
  test -e /host-only-file && echo exec_host_file=visible || echo exec_host_file=hidden'
echo "exec=$?"
berth exec held -- sh -c 'echo written > /written'
berth export --output /tmp/held.sqsh "$id" >/dev/null; echo "export=$?"
berth run --image /tmp/held.sqsh -- sh -c 'echo "exported=$(cat /written) $(. /etc/os-release; echo $ID)"'
berth rm held >/dev/null; echo "rm=$?"
# The exported image's squashfs stays mounted for later runs until gc.
berth gc >/dev/null 2>&1
echo "BEGIN mounts_left"; grep -vxF -f /tmp/mounts.before /proc/mounts; echo "END mounts_left"
echo "BEGIN state_left"; ls -A /run/berth 2>/dev/null | grep -vx images; echo "END state_left"
"#,
    );
    let _ = std::fs::remove_file(&probe);
    let _ = std::fs::remove_dir_all(&src);
    assert_eq!(status, 0, "{out}");
    // The premise: the VM's root is rootfs, where pivot_root fails, and the kernel allows user
    // namespaces (so the container's refusal below is berth's doing).
    assert_eq!(field(&out, "host_root_fs"), "rootfs", "{out}");
    assert_ne!(field(&out, "host_pivot_root"), "0", "{out}");
    assert_eq!(field(&out, "host_userns"), "0", "{out}");

    assert_eq!(
        field(&out, "run"),
        "0",
        "berth run failed on the initramfs root:\n{out}"
    );
    assert_eq!(field(&out, "image"), "berth-busybox", "{out}");
    assert_eq!(field(&out, "host_file"), "hidden", "{out}");
    assert_eq!(field(&out, "host_dir"), "hidden", "{out}");
    assert_eq!(
        field(&out, "kcore_bytes"),
        "0",
        "/proc/kcore is not masked:\n{out}"
    );
    assert_ne!(
        field(&out, "chroot"),
        "0",
        "the container could chroot:\n{out}"
    );
    assert_ne!(
        field(&out, "userns"),
        "0",
        "the container could make a user namespace (and chroot in it):\n{out}"
    );
    assert_eq!(field(&out, "probe"), "probe", "{out}");
    // Only the container's own mounts (the host's /run, /probe, the image's directory are not),
    // and none of the host's left in its namespace: the probe's loop device went with the
    // host's unmount while the held container was up.
    let mounts: Vec<&str> = section(&out, "mountinfo").lines().collect();
    assert_eq!(mounts.first(), Some(&"/"), "{out}");
    assert_eq!(
        section(&out, "loops_held"),
        "",
        "the container's namespace still holds the host's probe mount"
    );
    for host in ["/run", "/probe", "/rootfs", "/berth"] {
        assert!(
            !mounts.iter().any(|m| m == &host),
            "the container's mount table shows the host's {host}:\n{out}"
        );
    }

    assert_eq!(field(&out, "create"), "0", "{out}");
    assert_eq!(field(&out, "exec"), "0", "{out}");
    assert_eq!(field(&out, "exec_image"), "berth-busybox", "{out}");
    assert_eq!(field(&out, "exec_cwd"), "/", "{out}");
    assert_eq!(field(&out, "exec_host_file"), "hidden", "{out}");
    // `berth export` of the running container writes its root, not the tmpfs below it.
    assert_eq!(field(&out, "export"), "0", "{out}");
    assert_eq!(field(&out, "exported"), "written berth-busybox", "{out}");
    assert_eq!(field(&out, "rm"), "0", "{out}");
    assert_eq!(section(&out, "mounts_left"), "", "mounts left on the host");
    assert_eq!(section(&out, "state_left"), "", "state left in /run/berth");
}
