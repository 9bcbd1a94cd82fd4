//! Root tier: the image store on this host's kernel — whiteout devices and opaque directories
//! stacked by a real overlayfs mount, every archive form made by skopeo and podman, corrupt
//! blobs, a full file system, concurrent and killed imports, gc and `berth images`. Images are
//! built from busybox-static with GNU tar, gzip and zstd and hand-written JSON. Run by
//! integration/test.sh as root: `cargo test --test root_store -- --ignored --test-threads=1`.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use berth::image::store::Store;
use common::{get_xattr, set_xattr};
use sha2::{Digest as _, Sha256};

const BERTH: &str = env!("CARGO_BIN_EXE_berth");

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A temporary directory with a berth config whose store lives in it.
struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        Self::with_store_at(None)
    }

    fn with_store_at(root: Option<&Path>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = root
            .map(Path::to_path_buf)
            .unwrap_or_else(|| dir.path().join("store"));
        std::fs::write(
            dir.path().join("berth.toml"),
            format!(
                // reserve_bytes = 0: these tests fill small stores to ENOSPC on purpose (the
                // reserve is tested in root_store_bounds.rs).
                "[store]\nroot = \"{}\"\nparallel_layers = 4\nreserve_bytes = 0\n",
                store.display()
            ),
        )
        .unwrap();
        std::fs::write(dir.path().join("store-root"), store.display().to_string()).unwrap();
        Self { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn store_root(&self) -> PathBuf {
        PathBuf::from(std::fs::read_to_string(self.path().join("store-root")).unwrap())
    }

    fn store(&self) -> Store {
        Store::open_at(&self.store_root(), 4).unwrap()
    }

    fn berth(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BERTH);
        c.arg("--config")
            .arg(self.path().join("berth.toml"))
            .args(args);
        c
    }

    fn import(&self, reference: &str) -> Output {
        self.berth(&["import", reference]).output().unwrap()
    }

    /// Imports and returns the digest printed on stdout.
    fn import_ok(&self, reference: &str) -> String {
        let out = self.import(reference);
        assert!(
            out.status.success(),
            "berth import {reference} failed: {}",
            stderr(&out)
        );
        let digest = stdout(&out).trim().to_string();
        assert!(
            digest.starts_with("sha256:") && digest.len() == 71,
            "stdout: {digest:?}"
        );
        digest
    }

    fn layer(&self, diff_id: &str) -> PathBuf {
        self.store_root().join("layers").join(&diff_id[7..])
    }

    fn names(&self, sub: &str) -> BTreeSet<String> {
        std::fs::read_dir(self.store_root().join(sub))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Files or directories inside any workspace under tmp/.
    fn tmp_contents(&self) -> Vec<PathBuf> {
        let tmp = self.store_root().join("tmp");
        let mut out = Vec::new();
        for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                out.extend(
                    std::fs::read_dir(e.path())
                        .unwrap()
                        .flatten()
                        .map(|e| e.path()),
                );
            }
        }
        out
    }
}

/// GNU tar of a directory, as the test-environment notes build images (xattrs kept).
fn tar_dir(dir: &Path) -> Vec<u8> {
    run(Command::new("tar")
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=@0",
            "--xattrs",
            "--xattrs-include=security.capability",
            "-C",
        ])
        .arg(dir)
        .args(["-cf", "-", "."]))
    .stdout
}

#[derive(Clone, Copy, PartialEq)]
enum Comp {
    None,
    Gzip,
    Zstd,
}

fn compress(data: &[u8], comp: Comp) -> Vec<u8> {
    let tool = match comp {
        Comp::None => return data.to_vec(),
        Comp::Gzip => ["gzip", "-n", "-c"],
        Comp::Zstd => ["zstd", "-q", "-c"],
    };
    let path = std::env::temp_dir().join(format!("berth-compress-{}", std::process::id()));
    std::fs::write(&path, data).unwrap();
    let out = run(Command::new(tool[0]).args(&tool[1..]).arg(&path));
    std::fs::remove_file(&path).unwrap();
    out.stdout
}

fn write_blob(layout: &Path, bytes: &[u8]) -> String {
    let d = sha(bytes);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(&d[7..]), bytes).unwrap();
    d
}

/// An image written into an OCI layout.
struct Img {
    digest: String,
    diff_ids: Vec<String>,
    blobs: Vec<String>,
}

fn add_image(layout: &Path, name: &str, layers: &[(&[u8], Comp)]) -> Img {
    std::fs::create_dir_all(layout).unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let diff_ids: Vec<String> = layers.iter().map(|(t, _)| sha(t)).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let config_digest = write_blob(layout, &config);
    let mut descs = Vec::new();
    let mut blobs = Vec::new();
    for (tar, comp) in layers {
        let blob = compress(tar, *comp);
        let media = match comp {
            Comp::None => "application/vnd.oci.image.layer.v1.tar",
            Comp::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Comp::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
        };
        let d = write_blob(layout, &blob);
        descs.push(serde_json::json!({"mediaType": media, "digest": d, "size": blob.len()}));
        blobs.push(d);
    }
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
        "layers": descs,
    }))
    .unwrap();
    let digest = write_blob(layout, &manifest);
    let index_path = layout.join("index.json");
    let mut index: serde_json::Value = std::fs::read(&index_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({"schemaVersion": 2, "manifests": []}));
    index["manifests"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest, "size": manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": name},
        }));
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    Img {
        digest,
        diff_ids,
        blobs,
    }
}

fn write(path: &Path, data: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, data).unwrap();
}

/// `security.capability` for cap_net_raw, effective and permitted (vfs_cap_data revision 2).
fn net_raw_capability() -> Vec<u8> {
    let mut v = Vec::new();
    for word in [0x0200_0001u32, 1 << 13, 0, 0, 0] {
        v.extend_from_slice(&word.to_le_bytes());
    }
    v
}

/// The three layers of the test image:
/// 1. busybox, /data/{a,b}, /opaque/{x,y}, /gone, /deldir/f, a setuid file and a file with a
///    capability;
/// 2. deletes /gone and /data/a, makes /opaque opaque with a new z, adds /added;
/// 3. deletes the directory /deldir, adds /data/c.
fn test_layers(work: &Path) -> [Vec<u8>; 3] {
    let l1 = work.join("l1");
    write(
        &l1.join("bin/busybox"),
        &std::fs::read("/bin/busybox").unwrap(),
    );
    std::fs::set_permissions(
        l1.join("bin/busybox"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    for applet in ["sh", "ls", "cat"] {
        std::os::unix::fs::symlink("busybox", l1.join("bin").join(applet)).unwrap();
    }
    write(&l1.join("data/a"), b"a\n");
    write(&l1.join("data/b"), b"b\n");
    write(&l1.join("opaque/x"), b"x\n");
    write(&l1.join("opaque/y"), b"y\n");
    write(&l1.join("gone"), b"gone\n");
    write(&l1.join("deldir/f"), b"f\n");
    write(&l1.join("bin/suid"), b"#!/bin/sh\n");
    std::fs::set_permissions(l1.join("bin/suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    write(&l1.join("bin/ping"), b"ping\n");
    set_xattr(
        &l1.join("bin/ping"),
        "security.capability",
        &net_raw_capability(),
    );
    let l2 = work.join("l2");
    write(&l2.join(".wh.gone"), b"");
    write(&l2.join("data/.wh.a"), b"");
    write(&l2.join("opaque/.wh..wh..opq"), b"");
    write(&l2.join("opaque/z"), b"z\n");
    write(&l2.join("added"), b"added\n");
    let l3 = work.join("l3");
    write(&l3.join(".wh.deldir"), b"");
    write(&l3.join("data/c"), b"c\n");
    [tar_dir(&l1), tar_dir(&l2), tar_dir(&l3)]
}

/// The OCI layout `layout` with image `v1` (gzip, zstd, gzip layers) and image `plain` (gzip
/// only, so skopeo can write it as a docker-archive).
fn test_layout(env: &Env) -> (PathBuf, Img, Img) {
    let [l1, l2, l3] = test_layers(env.path());
    let layout = env.path().join("layout");
    let v1 = add_image(
        &layout,
        "v1",
        &[(&l1, Comp::Gzip), (&l2, Comp::Zstd), (&l3, Comp::Gzip)],
    );
    let plain = add_image(&layout, "plain", &[(&l1, Comp::Gzip), (&l3, Comp::Gzip)]);
    (layout, v1, plain)
}

fn skopeo(from: &str, to: &str) {
    run(Command::new("skopeo").args(["copy", "-q", from, to]));
}

/// Unmounts (lazily) on drop.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn layers_get_whiteouts_and_opaque_dirs_and_overlayfs_merges_them() {
    let env = Env::new();
    let (layout, v1, _) = test_layout(&env);
    let digest = env.import_ok(&format!("oci:{}:v1", layout.display()));
    assert_eq!(digest, v1.digest);
    let [d1, d2, d3] = [0, 1, 2].map(|i| env.layer(&v1.diff_ids[i]));

    // Layer 1: modes, setuid and file capabilities kept.
    let suid = std::fs::metadata(d1.join("bin/suid")).unwrap();
    assert_eq!(suid.permissions().mode() & 0o7777, 0o4755);
    assert_eq!((suid.uid(), suid.gid()), (0, 0));
    assert_eq!(
        get_xattr(&d1.join("bin/ping"), "security.capability"),
        Some(net_raw_capability())
    );
    assert_eq!(
        std::fs::read_link(d1.join("bin/sh")).unwrap(),
        Path::new("busybox")
    );
    // Layer 2: whiteouts are 0/0 character devices, the opaque directory has the xattr.
    for w in ["gone", "data/a"] {
        let m = std::fs::symlink_metadata(d2.join(w)).unwrap();
        assert!(m.file_type().is_char_device(), "{w} is not a whiteout");
        assert_eq!(m.rdev(), 0, "{w} is not 0/0");
    }
    assert_eq!(
        get_xattr(&d2.join("opaque"), "trusted.overlay.opaque"),
        Some(b"y".to_vec())
    );
    assert_eq!(get_xattr(&d2.join("data"), "trusted.overlay.opaque"), None);
    assert!(!d2.join("opaque/.wh..wh..opq").exists());
    assert!(!d2.join(".wh.gone").exists());
    // Layer 3: a whiteout of a whole directory.
    assert!(
        std::fs::symlink_metadata(d3.join("deldir"))
            .unwrap()
            .file_type()
            .is_char_device()
    );

    // What overlayfs makes of them, as a container will see it.
    let merged = env.path().join("merged");
    std::fs::create_dir(&merged).unwrap();
    let lower = format!(
        "lowerdir={}:{}:{}",
        d3.display(),
        d2.display(),
        d1.display()
    );
    run(Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &lower])
        .arg(&merged));
    let _m = Mounted(merged.clone());
    let list = |p: &str| -> BTreeSet<String> {
        std::fs::read_dir(merged.join(p))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(
        list(""),
        ["added", "bin", "data", "opaque"].map(String::from).into(),
        "gone and deldir are deleted"
    );
    assert_eq!(list("data"), ["b", "c"].map(String::from).into());
    assert_eq!(
        list("opaque"),
        ["z"].map(String::from).into(),
        "the opaque dir hides x and y"
    );
    assert_eq!(std::fs::read(merged.join("added")).unwrap(), b"added\n");
    assert_eq!(
        std::fs::metadata(merged.join("bin/suid"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o4755
    );
    let sh = run(Command::new(merged.join("bin/busybox")).args(["echo", "busybox runs"]));
    assert_eq!(stdout(&sh), "busybox runs\n");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn every_archive_form_imports_and_shares_layers() {
    let env = Env::new();
    let (layout, v1, plain) = test_layout(&env);
    let p = |name: &str| env.path().join(name).display().to_string();

    let oci_archive = p("v1.oci.tar");
    skopeo(
        &format!("oci:{}:v1", layout.display()),
        &format!("oci-archive:{oci_archive}:v1"),
    );
    let out = env.import(&format!("oci-archive:{oci_archive}"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!("{}\n", v1.digest),
        "stdout is only the digest"
    );
    assert!(
        stderr(&out).contains("extracted layer"),
        "progress on stderr: {}",
        stderr(&out)
    );

    // The layout itself: same manifest, nothing extracted again.
    let out = env.import(&format!("oci:{}:v1", layout.display()));
    assert_eq!(stdout(&out).trim(), v1.digest);
    assert!(
        !stderr(&out).contains("extracted layer"),
        "{}",
        stderr(&out)
    );

    // An OCI layout written by skopeo (from the archive): same manifest digest.
    let copied = p("copied-layout");
    skopeo(
        &format!("oci-archive:{oci_archive}:v1"),
        &format!("oci:{copied}:copy"),
    );
    assert_eq!(env.import_ok(&format!("oci:{copied}:copy")), v1.digest);

    // docker-archive, one image; its layers are shared with v1's.
    let docker = p("plain.docker.tar");
    skopeo(
        &format!("oci:{}:plain", layout.display()),
        &format!("docker-archive:{docker}:test/plain:v1"),
    );
    let layers_before = env.names("layers");
    let d = env.import_ok(&format!("docker-archive:{docker}"));
    assert_ne!(d, v1.digest);
    assert_eq!(
        env.names("layers"),
        layers_before,
        "all of plain's layers were already there"
    );
    let image: serde_json::Value = serde_json::from_slice(
        &env.berth(&["images", "inspect", &d])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let dirs = image["rootfs"]["Layers"].as_array().unwrap();
    assert_eq!(dirs.len(), 2);
    assert_eq!(
        dirs[0].as_str().unwrap(),
        env.layer(&plain.diff_ids[0]).to_str().unwrap()
    );

    // A docker-archive with two images: ambiguous without a name, selected with one.
    let other = p("v1.docker.tar");
    let small_layout = env.path().join("small-layout");
    let tiny = tar_dir(&{
        let d = env.path().join("tiny");
        write(&d.join("tiny"), b"tiny\n");
        d
    });
    let small = add_image(&small_layout, "tiny", &[(&tiny, Comp::Gzip)]);
    skopeo(
        &format!("oci:{}:tiny", small_layout.display()),
        &format!("docker-archive:{other}:test/tiny:v2"),
    );
    let multi = merge_docker_archives(env.path(), &[&docker, &other], &p("multi.docker.tar"));
    let out = env.import(&format!("docker-archive:{multi}"));
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        e.contains("holds several images")
            && e.contains("test/plain:v1")
            && e.contains("test/tiny:v2"),
        "{e}"
    );
    let t = env.import_ok(&format!("docker-archive:{multi}:test/tiny:v2"));
    std::fs::read(env.layer(&small.diff_ids[0]).join("tiny")).unwrap();
    let out = env.import(&format!("docker-archive:{multi}:test/none:v3"));
    assert!(
        stderr(&out).contains("no image named 'test/none:v3'"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        env.import_ok(&format!("docker-archive:{multi}:test/plain:v1")),
        d
    );

    let ls = stdout(&run(&mut env.berth(&["images", "ls"])));
    assert!(ls.starts_with("REFERENCE"), "{ls}");
    for (r, digest) in [
        (format!("oci-archive:{oci_archive}"), &v1.digest),
        (format!("docker-archive:{docker}"), &d),
        (format!("docker-archive:{multi}:test/tiny:v2"), &t),
    ] {
        let line = ls
            .lines()
            .find(|l| l.starts_with(&format!("{r} ")))
            .unwrap_or_else(|| panic!("{r} in {ls}"));
        assert!(line.contains(&digest[7..19]), "{line}");
    }
}

/// Merges `docker save` archives into one multi-image archive (as `docker save a b` writes).
fn merge_docker_archives(work: &Path, archives: &[&str], dest: &str) -> String {
    let dir = work.join("merge");
    let mut manifest = Vec::new();
    for a in archives {
        std::fs::create_dir_all(&dir).unwrap();
        run(Command::new("tar").arg("-xf").arg(a).arg("-C").arg(&dir));
        let m: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        manifest.extend(m);
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    run(Command::new("tar")
        .arg("-cf")
        .arg(dest)
        .arg("-C")
        .arg(&dir)
        .arg("."));
    dest.to_string()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_corrupted_blob_is_a_digest_mismatch_and_nothing_is_published() {
    let env = Env::new();
    let (layout, v1, _) = test_layout(&env);
    // Flip one byte in the middle of the busybox layer's gzip blob.
    let blob = layout.join("blobs/sha256").join(&v1.blobs[0][7..]);
    let mut bytes = std::fs::read(&blob).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&blob, &bytes).unwrap();
    let out = env.import(&format!("oci:{}:v1", layout.display()));
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    let last = e.lines().last().unwrap();
    assert!(
        last.contains(&format!("blob {} is corrupt", v1.blobs[0]))
            && last.contains("nothing was kept"),
        "{e}"
    );
    assert!(
        !env.layer(&v1.diff_ids[0]).exists(),
        "the corrupt layer was published"
    );
    assert!(env.names("images").is_empty());
    assert!(env.names("refs").is_empty());
    assert!(env.tmp_contents().is_empty(), "{:?}", env.tmp_contents());
    assert_eq!(
        stdout(&run(&mut env.berth(&["images", "ls"])))
            .lines()
            .count(),
        1
    );
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut v)
        .unwrap();
    v
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_full_store_fails_with_one_line_and_publishes_nothing() {
    let work = tempfile::tempdir().unwrap();
    let small = work.path().join("small");
    std::fs::create_dir(&small).unwrap();
    run(Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(&small));
    let _m = Mounted(small.clone());
    let env = Env::with_store_at(Some(&small.join("store")));

    // Known too big before starting: 3 MiB of incompressible data.
    let layout = env.path().join("big");
    let big = tar_dir(&{
        let d = env.path().join("bigdir");
        write(&d.join("random"), &random_bytes(3 << 20));
        d
    });
    add_image(&layout, "big", &[(&big, Comp::None)]);
    let out = env.import(&format!("oci:{}", layout.display()));
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        e.starts_with("berth: not enough space in the image store")
            && e.contains("needs about")
            && e.contains("are free"),
        "{e}"
    );

    // Looks small (8 MiB of zeros gzip to a few KiB) but fills the disk while extracting.
    let layout = env.path().join("zeros");
    let zeros = tar_dir(&{
        let d = env.path().join("zerodir");
        write(&d.join("zeros"), &vec![0u8; 8 << 20]);
        d
    });
    let img = add_image(&layout, "zeros", &[(&zeros, Comp::Gzip)]);
    let out = env.import(&format!("oci:{}", layout.display()));
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    let errors: Vec<&str> = e
        .lines()
        .filter(|l| !l.starts_with("berth: importing"))
        .collect();
    assert_eq!(errors.len(), 1, "{e}");
    assert!(
        errors[0].contains("ran out of space while extracting layer"),
        "{e}"
    );
    assert!(errors[0].contains("nothing partial was kept"), "{e}");
    assert!(!env.layer(&img.diff_ids[0]).exists());
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));
    assert!(env.names("images").is_empty());
    assert!(env.tmp_contents().is_empty(), "{:?}", env.tmp_contents());
    // The space is given back.
    let df = stdout(&run(Command::new("df")
        .arg("--output=used")
        .arg("-B1")
        .arg(&small)));
    let used: u64 = df.lines().nth(1).unwrap().trim().parse().unwrap();
    assert!(used < 256 << 10, "{used} bytes still used");
}

/// An image with two big uncompressed layers, slow enough to overlap and interrupt.
fn big_image(env: &Env) -> (String, Img) {
    let layout = env.path().join("big-layout");
    let mut layers = Vec::new();
    for i in 0..2 {
        let d = env.path().join(format!("big{i}"));
        write(&d.join(format!("data{i}")), &random_bytes(48 << 20));
        layers.push(tar_dir(&d));
    }
    let img = add_image(
        &layout,
        "big",
        &[(&layers[0], Comp::None), (&layers[1], Comp::None)],
    );
    (format!("oci:{}", layout.display()), img)
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn concurrent_imports_of_one_image_extract_each_layer_once() {
    let env = Env::new();
    let (reference, img) = big_image(&env);
    let spawn = || {
        env.berth(&["import", &reference])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(
        a.status.success() && b.status.success(),
        "{}\n{}",
        stderr(&a),
        stderr(&b)
    );
    assert_eq!(stdout(&a).trim(), img.digest);
    assert_eq!(stdout(&b).trim(), img.digest);
    let extracted = |o: &Output| stderr(o).matches("extracted layer").count();
    assert_eq!(
        extracted(&a) + extracted(&b),
        2,
        "each layer is extracted exactly once:\n{}\n{}",
        stderr(&a),
        stderr(&b)
    );
    let waited = |o: &Output| {
        let e = stderr(o);
        e.contains("waiting for another import")
            || e.contains("imported by another process")
            || e.contains("already in the store")
    };
    assert!(waited(&a) || waited(&b), "{}\n{}", stderr(&a), stderr(&b));
    assert_eq!(env.names("images").len(), 1);
    assert!(env.tmp_contents().is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_killed_import_leaves_nothing_partial_and_a_reimport_succeeds() {
    let env = Env::new();
    let (reference, img) = big_image(&env);
    let mut child = env
        .berth(&["import", &reference])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until a layer is being extracted into a workspace, then kill -9.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let staging = env.tmp_contents().into_iter().any(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("layer-")
                && std::fs::read_dir(&p)
                    .map(|mut d| d.next().is_some())
                    .unwrap_or(false)
        });
        if staging {
            break;
        }
        assert!(Instant::now() < deadline, "no extraction seen");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the import finished before it could be killed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(30));
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGKILL) };
    child.wait().unwrap();

    // Nothing partial is visible: no image, and any published layer is complete.
    assert!(env.names("images").is_empty());
    for (i, id) in img.diff_ids.iter().enumerate() {
        let d = env.layer(id);
        if d.exists() {
            assert_eq!(
                std::fs::metadata(d.join(format!("data{i}"))).unwrap().len(),
                48 << 20
            );
        }
    }
    assert!(
        !env.tmp_contents().is_empty(),
        "the killed import's workspace is left in tmp/"
    );
    assert!(
        env.store()
            .get(
                &berth::image::archive::parse_local(&reference)
                    .unwrap()
                    .unwrap()
            )
            .is_none()
    );

    let digest = env.import_ok(&reference);
    assert_eq!(digest, img.digest);
    assert!(
        env.tmp_contents().is_empty(),
        "the leftover was cleaned: {:?}",
        env.tmp_contents()
    );
    for (i, id) in img.diff_ids.iter().enumerate() {
        assert_eq!(
            std::fs::metadata(env.layer(id).join(format!("data{i}")))
                .unwrap()
                .len(),
            48 << 20
        );
    }
}

/// Three images sharing a base layer, each with a 1 MiB layer of its own.
fn three_images(env: &Env) -> Vec<(String, String)> {
    let base = tar_dir(&{
        let d = env.path().join("base");
        write(&d.join("base"), &random_bytes(64 << 10));
        d
    });
    let mut out = Vec::new();
    for name in ["a", "b", "c"] {
        let own = tar_dir(&{
            let d = env.path().join(format!("own-{name}"));
            write(&d.join(name), &random_bytes(1 << 20));
            d
        });
        let layout = env.path().join(format!("layout-{name}"));
        add_image(&layout, name, &[(&base, Comp::Gzip), (&own, Comp::Gzip)]);
        let reference = format!("oci:{}", layout.display());
        let digest = env.import_ok(&reference);
        out.push((reference, digest));
    }
    out
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn gc_removes_least_recently_used_first_and_never_an_image_in_use() {
    let env = Env::new();
    let imgs = three_images(&env);
    let store = env.store();
    let (a, b, c) = (&imgs[0].1, &imgs[1].1, &imgs[2].1);
    // Last use: b (taken into use first, and held), then a, then c (most recent).
    let b_guard = store.use_image(b).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(store.use_image(a).unwrap());
    std::thread::sleep(Duration::from_millis(50));
    drop(store.use_image(c).unwrap());
    assert_eq!(
        env.names("layers").len(),
        12,
        "base + 3 own layers, each with a size record and a file record"
    );

    // Room for about two images: the least recently used one not in use (a) goes.
    let out = run(&mut env.berth(&["images", "gc", "--max-size", "2600k"]));
    let text = stdout(&out);
    let removed: Vec<&str> = text.lines().collect();
    assert_eq!(removed.len(), 1, "{}", stdout(&out));
    assert!(
        removed[0].starts_with(&format!("removed {a} ")),
        "{removed:?}"
    );
    assert!(
        stderr(&out).contains(&format!("kept {b}: in use")),
        "{}",
        stderr(&out)
    );
    assert!(store.image(b).is_some() && store.image(c).is_some() && store.image(a).is_none());
    assert_eq!(
        env.names("layers").len(),
        9,
        "a's own layer went, the shared base stayed"
    );

    // Too small for anything: c goes, b is in use and stays.
    let out = run(&mut env.berth(&["images", "gc", "--max-size", "1k"]));
    assert!(
        stdout(&out).contains(&format!("removed {c} ")),
        "{}",
        stdout(&out)
    );
    assert!(store.image(b).is_some());
    let ls = stdout(&run(&mut env.berth(&["images", "ls"])));
    assert!(ls.lines().nth(1).unwrap().ends_with("in use"), "{ls}");

    // Unused for a second: b, once released.
    std::thread::sleep(Duration::from_millis(1100));
    let out = run(&mut env.berth(&["images", "gc", "--unused-for", "1s"]));
    assert!(
        stdout(&out).is_empty(),
        "b is still in use: {}",
        stdout(&out)
    );
    drop(b_guard);
    std::thread::sleep(Duration::from_millis(1100));
    let out = run(&mut env.berth(&["images", "gc", "--unused-for", "1s"]));
    assert!(
        stdout(&out).contains(&format!("removed {b} ")),
        "{}",
        stdout(&out)
    );
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));
    assert!(env.names("images").is_empty());

    let out = env
        .berth(&["images", "gc", "--unused-for", "7y"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("invalid duration"),
        "{}",
        stderr(&out)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn images_ls_inspect_and_rm() {
    let env = Env::new();
    let imgs = three_images(&env);
    let (ref_a, a) = &imgs[0];
    let ls = stdout(&run(&mut env.berth(&["images", "ls"])));
    let lines: Vec<&str> = ls.lines().collect();
    assert_eq!(lines.len(), 4, "{ls}");
    assert!(
        lines[0]
            .split_whitespace()
            .eq(["REFERENCE", "DIGEST", "SIZE", "LAST", "USED"]),
        "{ls}"
    );
    let row = lines
        .iter()
        .find(|l| l.starts_with(ref_a.as_str()))
        .unwrap();
    assert!(
        row.contains(&a[7..19]) && row.contains("MiB") && row.ends_with("just now"),
        "{row}"
    );

    let out = run(&mut env.berth(&["images", "inspect", ref_a]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["digest"], a.as_str());
    assert_eq!(v["references"][0], ref_a.as_str());
    assert!(v["size"].as_u64().unwrap() > 1 << 20);
    assert_eq!(v["in_use"], false);
    assert_eq!(v["anonymous"], true);
    assert_eq!(v["config"]["config"]["Cmd"][0], "/bin/sh");
    assert_eq!(v["rootfs"]["Layers"].as_array().unwrap().len(), 2);
    // By a digest prefix, too.
    let out = run(&mut env.berth(&["images", "inspect", &a[7..19]]));
    assert!(stdout(&out).contains(&a[7..]));

    let store = env.store();
    let guard = store.use_image(a).unwrap();
    let out = env.berth(&["images", "rm", ref_a]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out).trim(),
        format!("berth: image {a} is in use by a running container: stop it first")
    );
    drop(guard);
    let out = run(&mut env.berth(&["images", "rm", ref_a]));
    assert!(
        stdout(&out).starts_with(&format!("removed {a} {ref_a}")),
        "{}",
        stdout(&out)
    );
    assert!(store.image(a).is_none());
    let out = run(&mut env.berth(&["images", "rm", &format!("sha256:{}", &imgs[1].1[7..20])]));
    assert!(stdout(&out).starts_with(&format!("removed {}", imgs[1].1)));
    let out = env
        .berth(&["images", "rm", "oci:/nonexistent"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no image 'oci:/nonexistent'"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        stdout(&run(&mut env.berth(&["images", "ls"])))
            .lines()
            .count(),
        2
    );
    // The shared base layer stays for c; a's and b's own layers are gone.
    // (each with its size and file records)
    assert_eq!(env.names("layers").len(), 6);
}

/// Makes sure podman can run here (see test-environment.md).
fn podman_config() {
    let conf = Path::new("/etc/containers/containers.conf");
    let text = std::fs::read_to_string(conf).unwrap_or_default();
    if !text.contains("cgroup_manager = \"cgroupfs\"") {
        std::fs::create_dir_all("/etc/containers").unwrap();
        std::fs::write(
            conf,
            "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\n\
             [engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n",
        )
        .unwrap();
    }
}

/// Removes a podman image on drop.
struct PodmanImage(&'static str);

impl Drop for PodmanImage {
    fn drop(&mut self) {
        let _ = Command::new("podman").args(["rmi", "-f", self.0]).output();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn podman_images_are_saved_and_imported() {
    podman_config();
    let env = Env::new();
    let (layout, v1, _) = test_layout(&env);
    let archive = env.path().join("v1.oci.tar").display().to_string();
    skopeo(
        &format!("oci:{}:v1", layout.display()),
        &format!("oci-archive:{archive}:v1"),
    );
    let loaded = stdout(&run(
        Command::new("podman").args(["load", "-q", "-i", &archive])
    ));
    let name = loaded.trim().rsplit(' ').next().unwrap().to_string();
    run(Command::new("podman").args(["tag", &name, "localhost/berth-store-test:v1"]));
    let _tag = PodmanImage("localhost/berth-store-test:v1");
    let _orig = PodmanImage(Box::leak(name.into_boxed_str()));
    let out = env.import("podman://localhost/berth-store-test:v1");
    assert!(out.status.success(), "{}", stderr(&out));
    let digest = stdout(&out).trim().to_string();
    assert!(
        stderr(&out).contains("saving podman://localhost/berth-store-test:v1"),
        "{}",
        stderr(&out)
    );
    // Same layers as the image podman was given, whatever manifest podman wrote.
    for id in &v1.diff_ids {
        assert!(env.layer(id).is_dir(), "layer {id} missing");
    }
    let merged_files = std::fs::read(env.layer(&v1.diff_ids[1]).join("added")).unwrap();
    assert_eq!(merged_files, b"added\n");
    let ls = stdout(&run(&mut env.berth(&["images", "ls"])));
    assert!(
        ls.contains("podman://localhost/berth-store-test:v1") && ls.contains(&digest[7..19]),
        "{ls}"
    );
    assert!(
        env.tmp_contents().is_empty(),
        "the saved archive was removed"
    );

    let out = env.import("podman://localhost/berth-no-such-image:1");
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    assert!(
        e.lines()
            .last()
            .unwrap()
            .contains("podman image save failed"),
        "{e}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn dockerd_without_a_daemon_is_a_clear_error() {
    let env = Env::new();
    let out = env.import("dockerd://busybox:latest");
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    let last = e.lines().last().unwrap();
    assert!(
        last.starts_with("berth: dockerd://busybox:latest: ")
            && (last.contains("docker save failed: Cannot connect to the Docker daemon")
                || last.contains("docker is not installed")),
        "{e}"
    );
    assert!(env.names("images").is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn layers_without_end_of_archive_blocks_import() {
    // As `umoci insert` writes them: the two zero blocks at the end are missing.
    let env = Env::new();
    let mut tar = tar_dir(&{
        let d = env.path().join("umoci");
        write(&d.join("inserted"), b"by umoci\n");
        d
    });
    while tar.len() >= 512 && tar[tar.len() - 512..].iter().all(|b| *b == 0) {
        tar.truncate(tar.len() - 512);
    }
    let layout = env.path().join("layout");
    let img = add_image(&layout, "umoci", &[(&tar, Comp::Gzip)]);
    assert_eq!(
        env.import_ok(&format!("oci:{}", layout.display())),
        img.digest
    );
    assert_eq!(
        std::fs::read(env.layer(&img.diff_ids[0]).join("inserted")).unwrap(),
        b"by umoci\n"
    );
}

/// A tar stream entry by entry (tar crate headers), for the extractor itself.
fn raw_tar(entries: &[(&str, tar::EntryType, &[u8])], pax: Option<(&str, &[u8])>) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (i, (name, kind, data)) in entries.iter().enumerate() {
        if i == entries.len() - 1
            && let Some((key, value)) = pax
        {
            // A PAX record is "<length> <key>=<value>\n", the length counting its own digits.
            let mut rec = format!(" {key}=").into_bytes();
            rec.extend_from_slice(value);
            rec.push(b'\n');
            let mut len = rec.len() + 1;
            while rec.len() + len.to_string().len() != len {
                len = rec.len() + len.to_string().len();
            }
            let mut data = len.to_string().into_bytes();
            data.extend_from_slice(&rec);
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(tar::EntryType::XHeader);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, "PaxHeader", &data[..]).unwrap();
        }
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(*kind);
        h.set_size(data.len() as u64);
        h.set_mode(if *kind == tar::EntryType::Directory {
            0o755
        } else {
            0o644
        });
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn whiteouts_replace_earlier_entries_and_images_cannot_set_overlay_xattrs() {
    use tar::EntryType::{Directory, Regular};
    let t = tempfile::tempdir().unwrap();
    let layer = t.path().join("layer");
    std::fs::create_dir(&layer).unwrap();
    let bytes = raw_tar(
        &[
            ("d/", Directory, b""),
            ("d/f", Regular, b"f"),
            (".wh.d", Regular, b""),
            (".wh..wh.plnk/123", Regular, b""),
            ("x/.wh..wh..opq", Regular, b""),
            ("x/kept", Regular, b"kept"),
            ("y", Regular, b"y"),
        ],
        Some(("SCHILY.xattr.trusted.overlay.redirect", b"/etc")),
    );
    let out = berth::image::layer::extract(&mut &bytes[..], &layer).unwrap();
    assert_eq!(out.diff_id, sha(&bytes));
    let d = std::fs::symlink_metadata(layer.join("d")).unwrap();
    assert!(
        d.file_type().is_char_device() && d.rdev() == 0,
        "d is now a whiteout"
    );
    assert!(
        !layer.join(".wh..wh.plnk").exists(),
        "AUFS metadata is skipped"
    );
    assert!(
        out.skipped.iter().any(|s| s.contains("AUFS")),
        "{:?}",
        out.skipped
    );
    assert_eq!(
        get_xattr(&layer.join("x"), "trusted.overlay.opaque"),
        Some(b"y".to_vec())
    );
    assert_eq!(std::fs::read(layer.join("x/kept")).unwrap(), b"kept");
    assert_eq!(
        get_xattr(&layer.join("y"), "trusted.overlay.redirect"),
        None
    );
    assert!(
        out.skipped
            .iter()
            .any(|s| s.contains("trusted.overlay.redirect")),
        "{:?}",
        out.skipped
    );

    let bytes = raw_tar(&[(".wh.", Regular, b"")], None);
    let layer2 = t.path().join("layer2");
    std::fs::create_dir(&layer2).unwrap();
    let e = berth::image::layer::extract(&mut &bytes[..], &layer2).unwrap_err();
    assert!(e.to_string().contains("a whiteout without a name"), "{e}");
}
