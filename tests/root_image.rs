//! Root tier: running images end to end — `berth import` and `berth run --image` from a real
//! registry (its config applied), concurrent imports, cached runs without the registry, private
//! images refused to users the registry does not know, `.sqsh` and SIF files, and
//! `berth export` of a stored image. Run by integration/test.sh.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use common::*;
use harness::{Compression, Entry, Mode, Registry, Uploader};

struct Env {
    dir: tempfile::TempDir,
    registry: Registry,
    config: PathBuf,
}

/// A plain registry with `test/app:1` (busybox + a layer with a file), and a berth config using
/// a store of its own.
fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(
        &Mode::Plain,
        &dir.path().join("storage"),
        &dir.path().join("reg"),
    );
    let up = Uploader::new(&registry.host(), None);
    let gz = |e: Vec<Entry>| harness::blob_of(harness::tar_of(&e), Compression::Gzip, false);
    up.image(
        "test/app",
        Some("1"),
        "amd64",
        vec![
            gz(harness::busybox_entries("amd64")),
            gz(vec![
                Entry::Dir("app"),
                Entry::File(
                    "app/hello".into(),
                    b"hello from the image\n".to_vec(),
                    0o644,
                ),
            ]),
        ],
        false,
    );
    let config = write_config(dir.path(), &registry.host(), None);
    Env {
        dir,
        registry,
        config,
    }
}

fn write_config(dir: &Path, registry: &str, extra: Option<&str>) -> PathBuf {
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[store]\nroot = \"{}\"\n\
             [squashfs]\nmount_dir = \"{}\"\n[scratch]\nroot = \"{}\"\n\
             [registry]\ninsecure = [\"{registry}\"]\n{}",
            cgroup_root(),
            dir.join("state").display(),
            dir.join("store").display(),
            dir.join("mnt").display(),
            dir.join("scratch").display(),
            extra.unwrap_or("")
        ),
    )
    .unwrap();
    config
}

fn berth_with(config: &Path, args: &[&str]) -> Output {
    Command::new(BERTH)
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn app(e: &Env) -> String {
    format!("{}#test/app:1", e.registry.host())
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn run_image_from_a_registry_applies_its_config_and_runs_cached() {
    let mut e = env();
    let image = app(&e);
    let digest = ok(berth_with(&e.config, &["import", &image]));
    assert!(digest.trim().starts_with("sha256:"), "{digest}");
    let out = ok(berth_with(
        &e.config,
        &[
            "run",
            "--image",
            &image,
            "--",
            "sh",
            "-c",
            "pwd; echo $BERTH_TEST $PATH; cat /app/hello /etc/berth-platform",
        ],
    ));
    assert_eq!(out, "/tmp\n1 /bin\nhello from the image\namd64\n");
    // --env and --workdir win over the image's.
    let out = ok(berth_with(
        &e.config,
        &[
            "run",
            "--image",
            &image,
            "--env",
            "BERTH_TEST=2",
            "--workdir",
            "/app",
            "--",
            "sh",
            "-c",
            "pwd; echo $BERTH_TEST",
        ],
    ));
    assert_eq!(out, "/app\n2\n");
    // No command: the image's Cmd (/bin/sh) runs, reading the script from stdin.
    let o = Command::new(BERTH)
        .arg("--config")
        .arg(&e.config)
        .args(["run", "--image", &image])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b"echo from-cmd\n")?;
            c.wait_with_output()
        })
        .unwrap();
    assert_eq!(ok(o), "from-cmd\n");
    // Cached: the registry can be gone.
    e.registry.kill();
    let out = ok(berth_with(
        &e.config,
        &[
            "run",
            "--image",
            &image,
            "--",
            "busybox",
            "cat",
            "/app/hello",
        ],
    ));
    assert_eq!(out, "hello from the image\n");
    let ls = ok(berth_with(&e.config, &["images", "ls"]));
    assert!(ls.contains("test/app"), "{ls}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn concurrent_imports_download_once_and_agree() {
    let e = env();
    let image = app(&e);
    let spawn = || {
        Command::new(BERTH)
            .arg("--config")
            .arg(&e.config)
            .args(["import", &image])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (da, db) = (ok(a.clone()), ok(b.clone()));
    assert_eq!(da, db);
    let logs = stderr(&a) + &stderr(&b);
    assert!(
        logs.contains("imported by another process") || logs.contains("already in the store"),
        "one import must reuse the other's: {logs}"
    );
    let layers: Vec<String> = std::fs::read_dir(e.dir.path().join("store/layers"))
        .unwrap()
        .flatten()
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .filter(|n| n.len() == 64)
        .collect();
    assert_eq!(layers.len(), 2, "each layer is stored once: {layers:?}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_private_image_is_not_handed_to_a_user_the_registry_does_not_know() {
    let (uid, gid, _) = test_user();
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(
        &Mode::Basic {
            user: "alice".into(),
            password: "pw".into(),
        },
        &dir.path().join("storage"),
        &dir.path().join("reg"),
    );
    let up = Uploader::new(&registry.host(), Some(("alice", "pw")));
    let gz = |e: Vec<Entry>| harness::blob_of(harness::tar_of(&e), Compression::Gzip, false);
    up.image(
        "team/secret",
        Some("1"),
        "amd64",
        vec![gz(harness::busybox_entries("amd64"))],
        false,
    );
    // Credentials are per user (`~` is the requesting user's home): root's file has the login,
    // the job user has none.
    let name = format!(".berth-test-credentials-{}", std::process::id());
    let creds = PathBuf::from("/root").join(&name);
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _remove = Remove(creds.clone());
    std::fs::write(
        &creds,
        format!("machine {} login alice password pw\n", registry.host()),
    )
    .unwrap();
    std::fs::set_permissions(&creds, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let config = write_config(
        dir.path(),
        &registry.host(),
        Some(&format!(
            "credentials = \"~/{name}\"\nenroot_credentials = false\n"
        )),
    );
    let image = format!("{}#team/secret:1", registry.host());
    // Root (with the credentials) imports it; the store records it as not anonymous.
    ok(berth_with(&config, &["import", &image]));
    let inspect = ok(berth_with(&config, &["images", "inspect", &image]));
    assert!(inspect.contains("\"anonymous\": false"), "{inspect}");
    // A job of another user asks for it: the registry does not know that user, so the cached
    // copy is not handed out and the step fails with one line.
    let request = format!(
        r#"{{"job_id": 777, "step_id": 0, "uid": {uid}, "gid": {gid}, "options": {{"container-image": "{image}"}}}}"#
    );
    let mut child = Command::new(BERTH)
        .arg("--config")
        .arg(&config)
        .args(["step", "create"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), request.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(!o.status.success(), "a user without access got the image");
    // One line for the user, and the marker the plugin turns into Pyxis's "failed to import".
    let err = stderr(&o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| *l != berth::cli::step::IMPORT_FAILED_MARKER)
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        err.contains(berth::cli::step::IMPORT_FAILED_MARKER),
        "{err}"
    );
    assert!(err.contains("team/secret"), "{err}");
}

fn busybox_sqsh(dir: &Path, extra: &[(&str, &str)]) -> PathBuf {
    let tree = dir.join("tree");
    Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&tree)
        .status()
        .unwrap();
    for (path, body) in extra {
        let p = tree.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
    let out = dir.join("image.sqsh");
    let st = Command::new("mksquashfs")
        .arg(&tree)
        .arg(&out)
        .args(["-comp", "zstd", "-quiet", "-no-progress", "-noappend"])
        .status()
        .unwrap();
    assert!(st.success());
    out
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn enroot_squashfs_images_run_with_their_environment() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| ());
    let dir = tempfile::tempdir().unwrap();
    let sqsh = busybox_sqsh(
        dir.path(),
        &[("etc/environment", "GREETING=from-enroot\nPATH=/bin\n")],
    );
    let config = write_config(dir.path(), "127.0.0.1:1", None);
    let s = sqsh.to_str().unwrap();
    let out = ok(berth_with(
        &config,
        &[
            "run",
            "--image",
            s,
            "--",
            "sh",
            "-c",
            "echo $GREETING; mount | grep ' / '",
        ],
    ));
    assert!(out.starts_with("from-enroot\n"), "{out}");
    let mnt = dir.path().join("mnt");
    // The runtime attaches each layer (opened before the container's namespace exists) at a short
    // name next to the upper layer: the squashfs mount below is the only lower.
    assert!(
        out.contains("lowerdir=l0,"),
        "the squashfs is the lower: {out}"
    );
    // Mounted once per node, read-only, nosuid, nodev, while a container uses it (a held one
    // here: issue 14 unmounts it with its last container).
    ok(berth_with(
        &config,
        &["run", "--image", s, "--", "sh", "-c", "echo x > /written"],
    ));
    let held = ok(berth_with(&config, &["create", "--image", s]))
        .trim()
        .to_string();
    let mounts: Vec<String> = host_mounts_with(mnt.to_str().unwrap());
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert!(mounts[0].contains("ro,nosuid,nodev"), "{mounts:?}");
    let mountpoint = mounts[0].split(' ').nth(4).unwrap().to_string();
    assert!(
        !Path::new(&mountpoint).join("written").exists(),
        "a container wrote into the image"
    );
    // No container uses it any more: unmounted with the last one.
    ok(berth_with(&config, &["rm", &held]));
    assert!(
        host_mounts_with(mnt.to_str().unwrap()).is_empty(),
        "still mounted after its last container"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_stored_registry_image_exports_to_a_squashfs_that_runs() {
    let e = env();
    let image = app(&e);
    let out = e.dir.path().join("exported.sqsh");
    let o = berth_with(&e.config, &["export", &image, "-o", out.to_str().unwrap()]);
    ok(o);
    let run = ok(berth_with(
        &e.config,
        &[
            "run",
            "--image",
            out.to_str().unwrap(),
            "--",
            "busybox",
            "cat",
            "/app/hello",
        ],
    ));
    assert_eq!(run, "hello from the image\n");
    for m in host_mounts_with(e.dir.path().join("mnt").to_str().unwrap()) {
        let _ = Command::new("umount")
            .arg(m.split(' ').nth(4).unwrap())
            .status();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_in_use_by_a_held_container_is_not_removed() {
    let e = env();
    let image = app(&e);
    let created = ok(berth_with(&e.config, &["create", "--image", &image]));
    let id = created.trim().to_string();
    // The holder keeps the image's in-use lock for as long as the container lives.
    let o = berth_with(&e.config, &["images", "rm", &image]);
    assert!(!o.status.success(), "an image in use was removed");
    assert!(stderr(&o).contains("in use"), "{}", stderr(&o));
    let gc = ok(berth_with(&e.config, &["images", "gc", "--max-size", "1"]));
    let out = ok(berth_with(
        &e.config,
        &["exec", &id, "--", "busybox", "cat", "/app/hello"],
    ));
    assert_eq!(
        out, "hello from the image\n",
        "gc took the image away: {gc}"
    );
    ok(berth_with(&e.config, &["rm", &id]));
    ok(berth_with(&e.config, &["images", "rm", &image]));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_prolog_imports_the_jobs_image_and_never_fails_the_node_for_it() {
    let e = env();
    let image = app(&e);
    let prolog = |img: &str| {
        Command::new(BERTH)
            .arg("--config")
            .arg(&e.config)
            .arg("prolog")
            .env("SLURM_JOB_ID", "31")
            .env("SLURM_JOB_UID", "0")
            .env("SLURM_JOB_GID", "0")
            .env("SPANK_BERTH_IMAGE", img)
            .output()
            .unwrap()
    };
    let o = prolog(&image);
    assert!(o.status.success(), "{}", stderr(&o));
    let ls = ok(berth_with(&e.config, &["images", "ls"]));
    assert!(
        ls.contains("test/app"),
        "the Prolog did not import the image: {ls}"
    );
    // A bad image is the step's problem, not the node's: exit 0, one line in the log.
    let o = prolog(&format!("{}#test/missing:1", e.registry.host()));
    assert!(o.status.success(), "a bad image would drain the node");
    assert!(stderr(&o).contains("test/missing"), "{}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_with_a_hundred_layers_runs_plain_and_remapped() {
    // Store paths of 100 layers are far longer than the page overlayfs takes its options in.
    let e = env();
    let up = Uploader::new(&e.registry.host(), None);
    let gz = |e: Vec<Entry>| harness::blob_of(harness::tar_of(&e), Compression::Gzip, false);
    let mut layers = vec![gz(harness::busybox_entries("amd64"))];
    for i in 0..99 {
        layers.push(gz(vec![
            Entry::Dir("layers"),
            Entry::File(format!("layers/{i}"), format!("{i}\n").into_bytes(), 0o644),
            // Every layer writes `top`: the last one must win.
            Entry::File("top".into(), format!("{i}\n").into_bytes(), 0o644),
        ]));
    }
    up.image("test/tall", Some("1"), "amd64", layers, false);
    let image = format!("{}#test/tall:1", e.registry.host());
    let _ = test_user();
    for extra in [&[][..], &["--user", "berthtest", "--remap-root"][..]] {
        let mut args = vec!["run", "--image", &image];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", "ls /layers | wc -l; cat /top; id -u"]);
        let out = ok(berth_with(&e.config, &args));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[..2], ["99", "98"], "{extra:?}: {out}");
        assert_eq!(lines[2], "0", "{extra:?}: {out}");
    }
}
