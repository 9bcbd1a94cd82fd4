//! Security tests: images. Every image a user names by path (a directory, `.sqsh`, `oci:`,
//! `oci-archive:`, `docker-archive:`) is read only as that user could read it; a squashfs mount
//! is shared only when no user but root can change its file; mounts and the store are root's.

use super::*;

use std::os::unix::fs::symlink;
use std::process::{Command, Output, Stdio};

use sha2::{Digest, Sha256};

/// A marker no earlier run (of this or an older binary) can have cached.
fn nonce(what: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{what}-{}-{t}", std::process::id())
}

fn ids((uid, gid): (u32, u32)) -> String {
    format!("{uid}:{gid}")
}

/// `berth run --user WHO --image IMAGE -- sh -c SCRIPT` as root, as Slurm runs it.
fn run_as(who: (u32, u32), image: &str, script: &str) -> Output {
    berth(&[
        "run",
        "--user",
        &ids(who),
        "--image",
        image,
        "--",
        "sh",
        "-c",
        script,
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap()
}

fn sh(script: &str) -> Output {
    let o = Command::new("/bin/sh")
        .args(["-c", script])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{script}: {}", stderr(&o));
    o
}

fn q(p: &Path) -> String {
    format!("'{}'", p.display())
}

/// A copy of the busybox rootfs with `extra` files (path, text).
fn tree(dir: &Path, extra: &[(&str, &str)]) -> PathBuf {
    let tree = dir.join("tree");
    sh(&format!("cp -a {} {}", q(rootfs()), q(&tree)));
    for (path, text) in extra {
        std::fs::write(tree.join(path), text).unwrap();
    }
    tree
}

fn tar_bytes(dir: &Path) -> Vec<u8> {
    let o = Command::new("tar")
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=@0",
            "-C",
        ])
        .arg(dir)
        .args(["-cf", "-", "."])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "tar: {}", stderr(&o));
    o.stdout
}

fn hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

fn config_json(diff_id: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
    }))
    .unwrap()
}

/// An OCI layout at `layout` whose image `v1` has `tree` as its only (uncompressed) layer;
/// returns the layer blob's path.
fn oci_layout(layout: &Path, tree: &Path) -> PathBuf {
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let layer = tar_bytes(tree);
    let layer_hex = hex(&layer);
    std::fs::write(blobs.join(&layer_hex), &layer).unwrap();
    let config = config_json(&layer_hex);
    std::fs::write(blobs.join(hex(&config)), &config).unwrap();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{}", hex(&config)), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": format!("sha256:{layer_hex}"), "size": layer.len()}],
    }))
    .unwrap();
    std::fs::write(blobs.join(hex(&manifest)), &manifest).unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": format!("sha256:{}", hex(&manifest)), "size": manifest.len(),
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]});
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    blobs.join(layer_hex)
}

/// A `docker save` archive at `out` of `tree` as image `test/secret:v1`.
fn docker_archive(work: &Path, tree: &Path, out: &Path) {
    let dir = work.join("docker");
    std::fs::create_dir_all(dir.join("layer")).unwrap();
    let layer = tar_bytes(tree);
    std::fs::write(dir.join("layer/layer.tar"), &layer).unwrap();
    let config = config_json(&hex(&layer));
    let config_name = format!("{}.json", hex(&config));
    std::fs::write(dir.join(&config_name), &config).unwrap();
    let manifest = serde_json::json!([{"Config": config_name,
        "RepoTags": ["test/secret:v1"], "Layers": ["layer/layer.tar"]}]);
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    std::fs::write(out, tar_bytes(&dir)).unwrap();
}

/// An uncompressed squashfs of `tree` without fragments: each file's bytes appear as they are,
/// and reading one file reads no other's block.
fn mksquashfs(tree: &Path, out: &Path) {
    let o = Command::new("mksquashfs")
        .arg(tree)
        .arg(out)
        .args([
            "-noappend",
            "-quiet",
            "-no-progress",
            "-noI",
            "-noD",
            "-noF",
            "-noX",
            "-no-fragments",
            "-all-root",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "mksquashfs: {}", stderr(&o));
}

/// A directory of `who`'s, 0700, with everything in it theirs and private (files 0600).
fn make_private(dir: &Path, who: (u32, u32)) {
    give(dir, who);
    sh(&format!(
        "find {} -type d -exec chmod 0700 {{}} + && find {} -type f -exec chmod 0600 {{}} +",
        q(dir),
        q(dir)
    ));
}

fn one_line_refusal(o: &Output, what: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "{what}: berth succeeded: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{what}: not one line: {err}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_archives_and_layouts_are_never_read() {
    let dir = workdir("images-archives");
    let secret = nonce("victim-archive-secret");
    let tree = tree(&dir, &[("secret", &secret)]);
    let vdir = dir.join("victim");
    std::fs::create_dir(&vdir).unwrap();
    let layout = vdir.join("layout");
    oci_layout(&layout, &tree);
    let oci_tar = vdir.join("private.oci.tar");
    std::fs::write(&oci_tar, tar_bytes(&layout)).unwrap();
    let docker_tar = vdir.join("private.docker.tar");
    docker_archive(&dir, &tree, &docker_tar);
    make_private(&vdir, victim());

    let refs = [
        format!("oci-archive:{}:v1", oci_tar.display()),
        format!("docker-archive:{}", docker_tar.display()),
        format!("oci:{}:v1", layout.display()),
    ];
    // The victim's own job runs it (and the store now holds it).
    let o = run_as(victim(), &refs[0], "cat /secret");
    assert!(stdout(&o).contains(&secret), "victim: {}", stderr(&o));
    for r in &refs {
        let o = run_as(attacker(), r, "cat /secret");
        assert!(
            !stdout(&o).contains(&secret),
            "the attacker's job read the victim's {r}"
        );
        one_line_refusal(&o, r);
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_layout_whose_blob_links_to_another_users_file_is_refused() {
    let dir = workdir("images-blob-link");
    let secret = nonce("victim-blob-secret");
    let tree = tree(&dir, &[("secret", &secret)]);
    let adir = dir.join("attacker");
    let vdir = dir.join("victim");
    std::fs::create_dir(&adir).unwrap();
    std::fs::create_dir(&vdir).unwrap();
    let layout = adir.join("layout");
    let blob = oci_layout(&layout, &tree);
    // The layer is the victim's private file; the attacker's layout only links to it.
    let private = vdir.join("layer.tar");
    std::fs::rename(&blob, &private).unwrap();
    make_private(&vdir, victim());
    symlink(&private, &blob).unwrap();
    give(&adir, attacker());
    sh(&format!("chown -h {} {}", ids(attacker()), q(&blob)));

    let r = format!("oci:{}:v1", layout.display());
    let o = run_as(attacker(), &r, "cat /secret");
    assert!(
        !stdout(&o).contains(&secret),
        "the attacker's layout read the victim's blob through a symlink"
    );
    one_line_refusal(&o, &r);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_patched_copy_of_a_site_image_never_reaches_another_user() {
    let dir = workdir("images-site");
    let marker = nonce("site-original");
    let evil = marker.replace("site-original", "evil-patched!");
    assert_eq!(marker.len(), evil.len());
    let tree = tree(&dir, &[("marker", &marker)]);
    let site = dir.join("site.sqsh");
    mksquashfs(&tree, &site);
    chmod(&site, 0o644);
    let adir = dir.join("attacker");
    std::fs::create_dir(&adir).unwrap();
    give(&adir, attacker());
    let mine = adir.join("mine.sqsh");
    let o = attacker_sh(&format!("cp {} {}", q(&site), q(&mine)));
    assert!(o.status.success(), "{}", stderr(&o));

    // The attacker's job runs her copy (without reading /marker), then she patches it in place.
    let o = run_as(attacker(), mine.to_str().unwrap(), "true");
    assert!(o.status.success(), "attacker's run: {}", stderr(&o));
    let patch = format!(
        "import sys\nf=open(sys.argv[1],'r+b')\nd=f.read()\ni=d.index(b'{marker}')\n\
         f.seek(i)\nf.write(b'{evil}')\nf.close()\n"
    );
    let o = as_uid(
        Command::new("/usr/bin/python3")
            .args(["-c", &patch])
            .arg(&mine),
        attacker(),
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "patching: {}", stderr(&o));

    // Another user's job with the site's unchanged image.
    let o = run_as(victim(), site.to_str().unwrap(), "cat /marker");
    // Both mounts are unused now: leave none behind in the checkout.
    let _ = berth(&["gc"]).output();
    let out = stdout(&o);
    assert!(
        !out.contains(&evil),
        "the victim's job ran the attacker's patched copy"
    );
    assert!(out.contains(&marker), "victim's run: {out} {}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_private_image_mounted_for_its_owner_is_not_readable_on_the_host() {
    let dir = workdir("images-private-mount");
    let marker = nonce("victim-private-marker");
    let tree = tree(&dir, &[("marker", &marker)]);
    let vdir = dir.join("victim");
    std::fs::create_dir(&vdir).unwrap();
    let image = vdir.join("private.sqsh");
    mksquashfs(&tree, &image);
    make_private(&vdir, victim());

    // A mount directory of its own, as berth makes it on a fresh node.
    let mnt = dir.join("mnt");
    let store = std::fs::read_to_string(config())
        .unwrap()
        .lines()
        .skip_while(|l| *l != "[store]")
        .find_map(|l| l.strip_prefix("root = "))
        .unwrap()
        .trim_matches('"')
        .to_string();
    let cfg = config_with(&dir, Path::new(&store), &mnt);
    let berth_cfg = |args: &[&str]| {
        Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let o = berth_cfg(&[
        "run",
        "--user",
        &ids(victim()),
        "--image",
        image.to_str().unwrap(),
        "--",
        "cat",
        "/marker",
    ]);
    assert!(stdout(&o).contains(&marker), "victim: {}", stderr(&o));
    // The mount stays until gc: the attacker looks for it on the host.
    let m = mnt.display();
    let o = attacker_sh(&format!(
        "cat '{m}'/*/marker '{m}'/*/*/marker 2>/dev/null; \
         find '{m}' -name marker -exec cat {{}} + 2>/dev/null; true"
    ));
    let _ = berth_cfg(&["gc"]);
    assert!(
        !stdout(&o).contains(&marker),
        "the attacker read the victim's private image through {m}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_directory_image_swapped_during_the_check_is_never_used() {
    let dir = workdir("images-dir-swap");
    let secret = nonce("root-only-secret");
    // Root's private root filesystem, with a secret.
    let private = dir.join("rootonly");
    std::fs::create_dir(&private).unwrap();
    chmod(&private, 0o700);
    sh(&format!(
        "cp -a {} {}",
        q(rootfs()),
        q(&private.join("rootfs"))
    ));
    std::fs::write(private.join("rootfs/secret"), &secret).unwrap();
    // The attacker's own image, and a link to root's, swapped as fast as she can.
    let adir = dir.join("attacker");
    std::fs::create_dir(&adir).unwrap();
    sh(&format!("cp -a {} {}", q(rootfs()), q(&adir.join("mine"))));
    symlink(private.join("rootfs"), adir.join("link")).unwrap();
    give(&adir, attacker());
    let _swap = swapper(&adir.join("mine"), &adir.join("link"));
    let image = adir.join("mine");
    let image = image.to_str().unwrap();
    let started = std::time::Instant::now();
    let mut wins = 0;
    let mut tries = 0;
    let mut ran = 0;
    while tries < TRIES && started.elapsed() < std::time::Duration::from_secs(90) {
        tries += 1;
        let o = run_as(attacker(), image, "cat /secret 2>/dev/null; echo ran");
        ran += usize::from(stdout(&o).contains("ran"));
        if stdout(&o).contains(&secret) {
            wins += 1;
            break;
        }
    }
    assert_eq!(
        wins, 0,
        "the attacker's job saw root's directory ({tries} tries)"
    );
    // Her own image ran in some tries: the race was real, not every run refused.
    assert!(
        ran > 0,
        "no run of the attacker's own image in {tries} tries"
    );
    eprintln!("{tries} tries, {ran} ran the attacker's own image, {wins} wins");
}

/// A config like the test config with the store root and squashfs mount dir replaced.
fn config_with(dir: &Path, store: &Path, mount_dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(config()).unwrap();
    let mut out = String::new();
    let mut section = "";
    for line in text.lines() {
        if line.starts_with('[') {
            section = if line == "[store]" {
                "store"
            } else if line == "[squashfs]" {
                "squashfs"
            } else {
                ""
            };
        }
        if section == "store" && line.starts_with("root = ") {
            out.push_str(&format!("root = \"{}\"\n", store.display()));
        } else if section == "squashfs" && line.starts_with("mount_dir = ") {
            out.push_str(&format!("mount_dir = \"{}\"\n", mount_dir.display()));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    let path = dir.join(format!("berth-{}.toml", std::process::id()));
    std::fs::write(&path, out).unwrap();
    path
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_store_or_mount_dir_another_user_could_change_is_refused() {
    let dir = workdir("images-root-dirs");
    let tree = tree(&dir, &[("marker", "site")]);
    let image = dir.join("site.sqsh");
    mksquashfs(&tree, &image);
    chmod(&image, 0o644);
    // Directories the attacker made (or links she made to her own).
    let hers = dir.join("hers");
    std::fs::create_dir(&hers).unwrap();
    give(&hers, attacker());
    let made = |name: &str| {
        let p = dir.join(name);
        std::fs::create_dir(&p).unwrap();
        give(&p, attacker());
        p
    };
    let linked = |name: &str| {
        let p = dir.join(name);
        symlink(&hers, &p).unwrap();
        sh(&format!("chown -h {} {}", ids(attacker()), q(&p)));
        p
    };
    let cases = [
        (
            "store owned by the attacker",
            made("store-a"),
            dir.join("mnt-ok1"),
        ),
        ("store a symlink", linked("store-l"), dir.join("mnt-ok2")),
        (
            "mount dir owned by the attacker",
            dir.join("store-ok1"),
            made("mnt-a"),
        ),
        (
            "mount dir a symlink",
            dir.join("store-ok2"),
            linked("mnt-l"),
        ),
    ];
    for (what, store, mnt) in &cases {
        let cfg = config_with(&dir, store, mnt);
        let o = Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(["run", "--image", image.to_str().unwrap(), "--", "true"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let _ = Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .arg("gc")
            .stdin(Stdio::null())
            .output();
        let theirs = if std::fs::symlink_metadata(store).unwrap().uid() != 0 {
            store
        } else {
            mnt
        };
        let written: Vec<_> = std::fs::read_dir(theirs).unwrap().flatten().collect();
        assert!(
            written.is_empty(),
            "{what}: berth wrote {:?} into {}",
            written.iter().map(|e| e.file_name()).collect::<Vec<_>>(),
            theirs.display()
        );
        one_line_refusal(&o, what);
        let err = stderr(&o);
        assert!(err.contains(theirs.to_str().unwrap()), "{what}: {err}");
    }
}

use std::os::unix::fs::MetadataExt;
