//! Root tier: Enroot squashfs and Apptainer SIF images on this host's real kernel — inspecting,
//! loop-mounting once per node (shared, read-only, nosuid, nodev), running containers on them,
//! refusing bad files, and `berth export` of directories, files and running containers. Run by
//! integration/test.sh as root: `cargo test --test root_squashfs -- --ignored --test-threads=1`.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use berth::image::mount::{self, mount_shared, unmount_unused};
use berth::image::sif::{self, DataType, FsType, ObjectKind, PartType, Partition};
use berth::image::squashfs::{inspect_sif, inspect_squashfs};
use berth::image::{Image, Rootfs, loopdev};
use common::*;

/// A mount directory for one test; whatever is still mounted there is unmounted on drop.
struct MountDir(tempfile::TempDir);

impl MountDir {
    fn new() -> Self {
        MountDir(tempfile::tempdir().unwrap())
    }
    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for MountDir {
    fn drop(&mut self) {
        let _ = unmount_unused(self.0.path(), |_| false);
    }
}

/// A copy of the busybox rootfs with extra files, for building images.
fn tree(dir: &Path, extra: &[(&str, &str)]) -> PathBuf {
    let tree = dir.join("tree");
    let status = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&tree)
        .status()
        .unwrap();
    assert!(status.success());
    for (path, text) in extra {
        let p = tree.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    }
    tree
}

fn mksquashfs(tree: &Path, out: &Path, comp: &[&str]) {
    let o = Command::new("mksquashfs")
        .arg(tree)
        .arg(out)
        .args(["-noappend", "-quiet", "-no-progress"])
        .args(comp)
        .output()
        .expect("mksquashfs (apt-get install squashfs-tools)");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The mountinfo entry at exactly `path`.
fn mount_entry(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut found = None;
    for line in text.lines() {
        if line.split(' ').nth(4) == Some(path.to_str().unwrap()) {
            found = Some(line.to_string());
        }
    }
    found
}

fn mounts_at(path: &Path) -> usize {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines()
        .filter(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
        .count()
}

/// Loop devices attached to `file` (at `offset`), from sysfs.
fn loops_on(file: &Path, offset: u64) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = entry.file_name().into_string().unwrap();
        let Some(n) = name.strip_prefix("loop").and_then(|n| n.parse().ok()) else {
            continue;
        };
        if loopdev::backing(n).is_some_and(|(f, o)| f == file && o == offset) {
            found.push(n);
        }
    }
    found
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn squashfs_parts(image: &Image) -> (PathBuf, u64, u64) {
    match &image.rootfs {
        Rootfs::Squashfs { file, offset, size } => (file.clone(), *offset, *size),
        other => panic!("not a squashfs image: {other:?}"),
    }
}

/// Mounts `image` and checks the mount: a squashfs on a loop device over the right byte range,
/// ro, nosuid, nodev; a second call reuses it.
fn mount_and_check(image: &Image, dir: &MountDir) -> PathBuf {
    let mnt = mount_shared(&image.digest, &image.rootfs, dir.path()).unwrap();
    let hex = image.digest.strip_prefix("sha256:").unwrap();
    assert_eq!(mnt, std::fs::canonicalize(dir.path()).unwrap().join(hex));
    let entry = mount_entry(&mnt).expect("mounted");
    let fields: Vec<&str> = entry.split(' ').collect();
    let opts: Vec<&str> = fields[5].split(',').collect();
    for want in ["ro", "nosuid", "nodev"] {
        assert!(opts.contains(&want), "{want} missing: {entry}");
    }
    let after = entry.split(" - ").nth(1).unwrap();
    assert!(after.starts_with("squashfs /dev/loop"), "{entry}");
    let (file, offset, _) = squashfs_parts(image);
    assert_eq!(loops_on(&file, offset).len(), 1, "one loop device");
    // Idempotent: the same directory, still one mount and one loop device.
    assert_eq!(
        mount_shared(&image.digest, &image.rootfs, dir.path()).unwrap(),
        mnt
    );
    assert_eq!(mounts_at(&mnt), 1);
    assert_eq!(loops_on(&file, offset).len(), 1);
    mnt
}

fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let m = std::fs::symlink_metadata(&path).unwrap();
            map.insert(
                path.strip_prefix(root).unwrap().display().to_string(),
                format!(
                    "{:o} {} {} {} {:?}",
                    m.mode(),
                    m.uid(),
                    m.gid(),
                    if m.is_dir() { 0 } else { m.size() },
                    std::fs::read_link(&path).ok()
                ),
            );
            if m.is_dir() {
                stack.push(path);
            }
        }
    }
    map
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn sqsh_images_mount_once_read_only_and_unmount_when_unused() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &[]);
    // zstd as berth writes, gzip (mksquashfs's default) and lzo -noD (Enroot's default).
    for comp in [
        &["-comp", "zstd", "-Xcompression-level", "3"][..],
        &["-comp", "gzip"][..],
        &["-comp", "lzo", "-noD"][..],
    ] {
        let mounts = MountDir::new();
        let sqsh = dir.path().join("image.sqsh");
        mksquashfs(&tree, &sqsh, comp);
        let image = inspect_squashfs(&sqsh).unwrap();
        let mnt = mount_and_check(&image, &mounts);
        assert_eq!(
            std::fs::read_to_string(mnt.join("etc/os-release")).unwrap(),
            std::fs::read_to_string(tree.join("etc/os-release")).unwrap(),
            "{comp:?}"
        );
        // The kernel refuses writes to it.
        let err = std::fs::write(mnt.join("new"), "x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{comp:?}");
        let (file, _, _) = squashfs_parts(&image);
        let loops = loops_on(&file, 0);
        assert_eq!(
            unmount_unused(mounts.path(), |_| false).unwrap(),
            vec![image.digest.clone()]
        );
        assert!(mount_entry(&mnt).is_none());
        assert!(!mnt.exists(), "its directory is removed");
        // Autoclear detaches the device once the mount is gone.
        wait_for("the loop device to detach", || {
            loops.iter().all(|n| loopdev::backing(*n).is_none())
        });
        assert!(unmount_unused(mounts.path(), |_| false).unwrap().is_empty());
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn concurrent_mounts_of_one_image_make_one_mount() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &[]);
    let sqsh = dir.path().join("image.sqsh");
    mksquashfs(&tree, &sqsh, &[]);
    let image = Arc::new(inspect_squashfs(&sqsh).unwrap());
    let mounts = Arc::new(MountDir::new());
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (image, mounts, barrier) = (image.clone(), mounts.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                mount_shared(&image.digest, &image.rootfs, mounts.path()).unwrap()
            })
        })
        .collect();
    let points: Vec<PathBuf> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(points.windows(2).all(|w| w[0] == w[1]), "{points:?}");
    assert_eq!(mounts_at(&points[0]), 1, "exactly one mount");
    assert_eq!(loops_on(&sqsh, 0).len(), 1, "exactly one loop device");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn unmount_unused_keeps_images_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &[]);
    let mounts = MountDir::new();
    let a = dir.path().join("a.sqsh");
    let b = dir.path().join("b.sqsh");
    mksquashfs(&tree, &a, &["-comp", "zstd"]);
    mksquashfs(&tree, &b, &["-comp", "gzip"]);
    let (a, b) = (inspect_squashfs(&a).unwrap(), inspect_squashfs(&b).unwrap());
    assert_ne!(a.digest, b.digest);
    let ma = mount_shared(&a.digest, &a.rootfs, mounts.path()).unwrap();
    let mb = mount_shared(&b.digest, &b.rootfs, mounts.path()).unwrap();
    let unmounted = unmount_unused(mounts.path(), |d| d == a.digest).unwrap();
    assert_eq!(unmounted, vec![b.digest.clone()]);
    assert!(mount_entry(&ma).is_some());
    assert!(mount_entry(&mb).is_none());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn containers_run_on_the_shared_mount_and_never_write_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &[]);
    let sqsh = dir.path().join("image.sqsh");
    mksquashfs(&tree, &sqsh, &[]);
    let before = std::fs::read(&sqsh).unwrap();
    let image = inspect_squashfs(&sqsh).unwrap();
    let mounts = MountDir::new();
    let mnt = mount_and_check(&image, &mounts);
    let pristine = snapshot(&mnt);
    let rootfs = mnt.to_str().unwrap();
    let out = ok(
        berth(&["run", "--rootfs", rootfs, "--", "cat", "/etc/os-release"])
            .output()
            .unwrap(),
    );
    assert!(out.contains("berth test busybox"), "{out}");
    let out = ok(berth(&[
        "run",
        "--rootfs",
        rootfs,
        "--",
        "sh",
        "-c",
        "echo changed > /etc/os-release && echo new > /newfile && rm /bin/ls && \
         cat /etc/os-release /newfile",
    ])
    .output()
    .unwrap());
    assert_eq!(out, "changed\nnew\n");
    assert_eq!(snapshot(&mnt), pristine, "the mounted image changed");
    assert_eq!(
        std::fs::read(&sqsh).unwrap(),
        before,
        "the .sqsh file changed"
    );
    // Two containers at once share the one mount.
    let a = berth(&["run", "--rootfs", rootfs, "--", "sleep", "1"])
        .spawn()
        .unwrap();
    let out = ok(
        berth(&["run", "--rootfs", rootfs, "--", "cat", "/etc/os-release"])
            .output()
            .unwrap(),
    );
    assert!(out.contains("busybox"));
    assert!(a.wait_with_output().unwrap().status.success());
    assert_eq!(mounts_at(&mnt), 1);
    assert_eq!(loops_on(&sqsh, 0).len(), 1);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn loop_devices_are_read_only_autoclear_with_either_method_and_race_safe() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data");
    std::fs::write(&file, vec![7u8; 3 * 4096]).unwrap();
    for method in [loopdev::Method::Configure, loopdev::Method::SetFd] {
        let dev = loopdev::LoopDevice::attach_with(&file, 4096, 8192, method).unwrap();
        assert_eq!(
            loopdev::backing(dev.number),
            Some((file.clone(), 4096)),
            "{method:?}"
        );
        assert_eq!(
            loopdev::flags(dev.number),
            Some((true, true)),
            "{method:?}: ro, autoclear"
        );
        let size: u64 = std::fs::read_to_string(format!("/sys/block/loop{}/size", dev.number))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(size * 512, 8192, "{method:?}: the size limit applies");
        let n = dev.number;
        // Nothing mounted on it: closing the last handle detaches it.
        drop(dev);
        wait_for("autoclear", || loopdev::backing(n).is_none());
    }
    // Many attaches at once race for the same free device; each gets its own.
    let file = Arc::new(file);
    let barrier = Arc::new(Barrier::new(6));
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let (file, barrier) = (file.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                loopdev::LoopDevice::attach(&file, 0, 4096).unwrap()
            })
        })
        .collect();
    let devices: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut numbers: Vec<u32> = devices.iter().map(|d| d.number).collect();
    numbers.sort();
    numbers.dedup();
    assert_eq!(numbers.len(), 6, "{numbers:?}");
    assert_eq!(loops_on(&file, 0).len(), 6);
    drop(devices);
    wait_for("all six to detach", || loops_on(&file, 0).is_empty());
}

/// A SIF around a squashfs, with a definition file before it so the partition sits at an
/// offset that is not the first aligned one, as `apptainer build` writes them.
fn write_sif(out: &Path, sqsh: &Path, fs: FsType, part: PartType) {
    let file = std::fs::File::create(out).unwrap();
    let mut w = sif::Writer::new(file);
    let text = format!(
        "Bootstrap: docker\nFrom: busybox\n%environment\n{}",
        "    export FILLER=1\n".repeat(40)
    );
    let mut deffile = text.as_bytes();
    w.add(
        ObjectKind::Other {
            data_type: DataType::Deffile,
            extra: Vec::new(),
        },
        "",
        &mut deffile,
        1,
    )
    .unwrap();
    let mut data = std::fs::File::open(sqsh).unwrap();
    w.add(
        ObjectKind::Partition(Partition {
            fs_type: fs,
            part_type: part,
            arch: sif::host_arch().into(),
        }),
        "",
        &mut data,
        sif::PARTITION_ALIGNMENT,
    )
    .unwrap();
    w.finish(1_700_000_000, sif::random_id()).unwrap();
}

const APPTAINER_FILES: [(&str, &str); 3] = [
    (
        "/.singularity.d/env/10-docker2singularity.sh",
        "#!/bin/sh\nexport PATH=\"/opt/tool/bin:/usr/bin:/bin\"\nexport LANG=\"${LANG:-\"C.UTF-8\"}\"\n",
    ),
    (
        "/.singularity.d/env/90-environment.sh",
        "#!/bin/sh\nexport GREETING=\"hello from sif\"\nexport HOSTDEP=$HOME/x\n",
    ),
    (
        "/.singularity.d/runscript",
        "#!/bin/sh\necho runscript \"$@\"\n",
    ),
];

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn sif_partition_mounts_at_its_offset_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &APPTAINER_FILES);
    std::fs::set_permissions(
        tree.join(".singularity.d/runscript"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let sqsh = dir.path().join("root.sqsh");
    mksquashfs(&tree, &sqsh, &["-comp", "zstd"]);
    let sif_path = dir.path().join("image.sif");
    write_sif(&sif_path, &sqsh, FsType::Squashfs, PartType::PrimarySystem);
    let image = inspect_sif(&sif_path).unwrap();
    let (file, offset, size) = squashfs_parts(&image);
    assert_eq!(offset, 36864, "after the definition file, page aligned");
    assert_eq!(size, std::fs::metadata(&sqsh).unwrap().len());
    assert_eq!(file, std::fs::canonicalize(&sif_path).unwrap());
    let config = image.config.config().clone().unwrap();
    assert_eq!(
        config.env().clone().unwrap(),
        [
            "PATH=/opt/tool/bin:/usr/bin:/bin",
            "LANG=C.UTF-8",
            "GREETING=hello from sif"
        ],
        "HOSTDEP depends on the host's HOME: skipped"
    );
    assert_eq!(
        config.entrypoint().clone().unwrap(),
        ["/.singularity.d/runscript"]
    );
    let mounts = MountDir::new();
    let mnt = mount_and_check(&image, &mounts);
    assert_eq!(
        loopdev::backing(loops_on(&file, offset)[0]).unwrap(),
        (file.clone(), offset)
    );
    let out = ok(berth(&[
        "run",
        "--rootfs",
        mnt.to_str().unwrap(),
        "--",
        "/.singularity.d/runscript",
        "a",
        "b",
    ])
    .output()
    .unwrap());
    assert_eq!(out, "runscript a b\n");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn bad_sif_files_are_refused_in_one_line_without_leaking_loop_devices() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &[]);
    let sqsh = dir.path().join("root.sqsh");
    mksquashfs(&tree, &sqsh, &[]);
    let case = |name: &str, fs: FsType, part: PartType| {
        let p = dir.path().join(name);
        write_sif(&p, &sqsh, fs, part);
        p
    };
    let good = case("good.sif", FsType::Squashfs, PartType::PrimarySystem);
    let encrypted = case(
        "encrypted.sif",
        FsType::EncryptedSquashfs,
        PartType::PrimarySystem,
    );
    let ext3 = case("ext3.sif", FsType::Ext3, PartType::PrimarySystem);
    let no_primary = case("data.sif", FsType::Squashfs, PartType::Data);
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.path().join("truncated.sif");
    std::fs::write(&truncated, &bytes[..bytes.len() - 10_000]).unwrap();
    let bad_magic = dir.path().join("magic.sif");
    let mut b = bytes.clone();
    b[32..41].copy_from_slice(b"NOT_MAGIC");
    std::fs::write(&bad_magic, &b).unwrap();
    // The descriptor says squashfs, the bytes are not.
    let corrupt = dir.path().join("corrupt.sif");
    let mut b = bytes.clone();
    b[36864..36868].copy_from_slice(b"XXXX");
    std::fs::write(&corrupt, &b).unwrap();
    for (path, needle) in [
        (&encrypted, "encrypted squashfs"),
        (&ext3, "an ext3 image, not squashfs"),
        (&no_primary, "no primary system partition"),
        (&truncated, "truncated"),
        (&bad_magic, "not a SIF file"),
        (
            &corrupt,
            "not a squashfs image (no 'hsqs' magic at byte 36864)",
        ),
    ] {
        let err = inspect_sif(path).unwrap_err().to_string();
        assert!(err.contains(needle), "{}: {err}", path.display());
        assert!(
            err.contains(path.file_name().unwrap().to_str().unwrap()),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }
    // Mounting bytes that are no squashfs fails before a loop device is taken.
    let mounts = MountDir::new();
    let digest = format!("sha256:{}", "ab".repeat(32));
    let err = mount::mount_shared_at(&digest, &corrupt, 36864, 4096, mounts.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a squashfs image"), "{err}");
    assert!(loops_on(&corrupt, 36864).is_empty());
    // A valid superblock over garbage tables: the kernel refuses it, and the device is freed.
    let mut b = bytes.clone();
    let sb = 36864;
    let inode_table =
        usize::try_from(u64::from_le_bytes(b[sb + 64..sb + 72].try_into().unwrap())).unwrap();
    let used =
        usize::try_from(u64::from_le_bytes(b[sb + 40..sb + 48].try_into().unwrap())).unwrap();
    for x in &mut b[sb + inode_table..sb + used] {
        *x = 0x5a;
    }
    let garbage = dir.path().join("garbage.sif");
    std::fs::write(&garbage, &b).unwrap();
    let size = std::fs::metadata(&sqsh).unwrap().len();
    let err = mount::mount_shared_at(&digest, &garbage, 36864, size, mounts.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("mounting the squashfs of"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    wait_for("the failed mount's loop device to detach", || {
        loops_on(&garbage, 36864).is_empty()
    });
}

/// Kills and reaps a background berth on drop.
struct Background(Child);

impl Drop for Background {
    fn drop(&mut self) {
        // SAFETY: signalling a child this test started and has not reaped.
        unsafe { libc::kill(i32::try_from(self.0.id()).unwrap(), libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn export_of_a_rootfs_keeps_owners_modes_and_xattrs_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(
        dir.path(),
        &[
            ("/data/owned", "owned by 1234\n"),
            ("/data/readable", "exported\n"),
        ],
    );
    std::os::unix::fs::chown(tree.join("data/owned"), Some(1234), Some(5678)).unwrap();
    std::fs::set_permissions(
        tree.join("data/owned"),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
    symlink("readable", tree.join("data/link")).unwrap();
    set_xattr(&tree.join("data/owned"), "user.berth", b"kept");
    set_xattr(&tree.join("data"), "trusted.overlay.opaque", b"y");
    let mounts = MountDir::new();
    for (name, reader) in [
        (
            "out.sqsh",
            inspect_squashfs as fn(&Path) -> Result<Image, berth::image::ImageError>,
        ),
        (
            "out.sif",
            inspect_sif as fn(&Path) -> Result<Image, berth::image::ImageError>,
        ),
    ] {
        let out = dir.path().join(name);
        let o = berth(&["export", "--rootfs", tree.to_str().unwrap(), "-o"])
            .arg(&out)
            .output()
            .unwrap();
        ok(o);
        let image: Image = reader(&out).unwrap();
        let mnt = mount_and_check(&image, &mounts);
        assert_eq!(snapshot(&mnt), snapshot(&tree), "{name}: the tree differs");
        let owned = std::fs::metadata(mnt.join("data/owned")).unwrap();
        assert_eq!(
            (owned.uid(), owned.gid(), owned.mode() & 0o7777),
            (1234, 5678, 0o640)
        );
        assert_eq!(
            get_xattr(&mnt.join("data/owned"), "user.berth").unwrap(),
            b"kept"
        );
        assert_eq!(
            get_xattr(&mnt.join("data"), "trusted.overlay.opaque"),
            None,
            "overlayfs's private attributes stay out"
        );
        let run = ok(berth(&[
            "run",
            "--rootfs",
            mnt.to_str().unwrap(),
            "--",
            "cat",
            "/data/link",
        ])
        .output()
        .unwrap());
        assert_eq!(run, "exported\n");
    }
    // An existing file is kept unless --force; the re-export of a .sif to .sqsh copies its
    // squashfs byte for byte.
    let sif_out = dir.path().join("out.sif");
    let again = dir.path().join("out.sqsh");
    let o = berth(&["export"])
        .arg(&sif_out)
        .arg("-o")
        .arg(&again)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"));
    ok(berth(&["export", "-f"])
        .arg(&sif_out)
        .arg("-o")
        .arg(&again)
        .output()
        .unwrap());
    let sif_bytes = std::fs::read(&sif_out).unwrap();
    assert_eq!(std::fs::read(&again).unwrap(), &sif_bytes[32768..]);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(names.is_empty(), "temporary files left: {names:?}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn export_of_a_running_container_holds_its_writes_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree(dir.path(), &[]);
    let before: Vec<String> = std::fs::read_dir(state_dir())
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    let child = Background(
        berth(&[
            "run",
            "--rootfs",
            tree.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "echo hi > /marker; rm /bin/vi; echo scratch > /tmp/in-tmp; sleep 30",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    // The new state directory is the container's id; its init's root shows /marker.
    let mut id = String::new();
    wait_for("the container to start", || {
        let now: Vec<String> = std::fs::read_dir(state_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        match now.into_iter().find(|n| !before.contains(n)) {
            Some(n) => {
                id = n;
                true
            }
            None => false,
        }
    });
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state_dir().join(&id).join("state.json")).unwrap())
            .unwrap();
    let cgroup = PathBuf::from(record["cgroup"].as_str().unwrap());
    wait_for("/marker", || {
        std::fs::read_to_string(cgroup.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .any(|pid| std::fs::read_to_string(format!("/proc/{pid}/root/tmp/in-tmp")).is_ok())
    });
    let out = dir.path().join("snapshot.sqsh");
    let o = berth(&["export", &id, "-o"]).arg(&out).output().unwrap();
    ok(o);
    // Still running, untouched.
    assert!(std::fs::read_to_string(cgroup.join("cgroup.procs")).is_ok_and(|p| !p.is_empty()));
    let image = inspect_squashfs(&out).unwrap();
    let mounts = MountDir::new();
    let mnt = mount_and_check(&image, &mounts);
    assert_eq!(std::fs::read_to_string(mnt.join("marker")).unwrap(), "hi\n");
    assert!(
        !mnt.join("bin/vi").exists(),
        "the deletion is in the export"
    );
    assert!(mnt.join("bin/busybox").exists());
    for empty in ["proc", "sys", "dev", "tmp"] {
        let d = mnt.join(empty);
        assert!(d.is_dir(), "{empty} missing");
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            0,
            "/{empty} holds what was mounted over it"
        );
    }
    let run = ok(berth(&[
        "run",
        "--rootfs",
        mnt.to_str().unwrap(),
        "--",
        "cat",
        "/marker",
    ])
    .output()
    .unwrap());
    assert_eq!(run, "hi\n");
    drop(child);
}

/// A small tmpfs mounted for one test, unmounted on drop.
struct SmallTmpfs(tempfile::TempDir);

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn export_to_a_full_disk_fails_in_one_line_and_leaves_nothing() {
    let tmpfs = SmallTmpfs(tempfile::tempdir().unwrap());
    nix::mount::mount(
        Some("tmpfs"),
        tmpfs.0.path(),
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=256k"),
    )
    .unwrap();
    for name in ["full.sqsh", "full.sif"] {
        let out = tmpfs.0.path().join(name);
        let o = berth(&["export", "--rootfs", rootfs().to_str().unwrap(), "-o"])
            .arg(&out)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(125), "{}", stderr(&o));
        let err = stderr(&o);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("no space left on device"), "{err}");
        assert!(err.contains(name), "{err}");
        assert_eq!(
            std::fs::read_dir(tmpfs.0.path()).unwrap().count(),
            0,
            "a partial file was left"
        );
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn export_refuses_what_it_cannot_export() {
    // An image that cannot be had (nothing listens on port 1): one line naming it, exit 1,
    // and no file.
    let o = berth(&["export", "127.0.0.1:1#test/missing:1", "-o", "/tmp/x.sqsh"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("test/missing"), "{}", stderr(&o));
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    assert!(!std::path::Path::new("/tmp/x.sqsh").exists());
    // Something that is not a reference at all: exit 2.
    let o = berth(&["export", "Not A Reference", "-o", "/tmp/x.sqsh"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}
