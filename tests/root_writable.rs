//! Root tier: a user's writable container owns the image's root files, as under Enroot (whose
//! unpacked root belongs to the user), without remap-root and without any host privilege (issue
//! 20, point 2). `berth run --user` and `berth create`/`exec`/`export` here; the Slurm step's
//! `--container-writable` in tests/root_pyxis.rs. Run by integration/test.sh as root:
//! `cargo test --test root_writable -- --ignored --test-threads=1`.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use common::*;

/// A directory every user can reach, under this checkout's root-tier work directory.
fn public_dir(name: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/root-tier");
    let dir = base.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// The busybox rootfs plus a setuid-root program that prints its effective uid (static, so it
/// runs in the image; not busybox, which drops a setuid bit by itself) and a file of another
/// image user (uid/gid 4242).
fn image() -> &'static Path {
    static IMAGE: OnceLock<PathBuf> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let dir = public_dir("writable-image");
        let root = dir.join("rootfs");
        let status = Command::new("cp")
            .arg("-a")
            .arg(rootfs())
            .arg(&root)
            .status()
            .unwrap();
        assert!(status.success(), "copying the busybox rootfs");
        let src = dir.join("euid.c");
        std::fs::write(
            &src,
            "#include <stdio.h>\n#include <unistd.h>\n\
             int main(void) { printf(\"euid=%d\\n\", (int)geteuid()); return 0; }\n",
        )
        .unwrap();
        let bin = root.join("bin/euid-suid");
        let out = Command::new("cc")
            .args(["-static", "-O", "-o"])
            .arg(&bin)
            .arg(&src)
            .stdin(Stdio::null())
            .output()
            .expect("running cc");
        assert!(out.status.success(), "cc: {}", stderr(&out));
        std::os::unix::fs::chown(&bin, Some(0), Some(0)).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o4755)).unwrap();
        let other = root.join("opt/other");
        std::fs::create_dir_all(other.parent().unwrap()).unwrap();
        std::fs::write(&other, "another image user's\n").unwrap();
        std::os::unix::fs::chown(&other, Some(4242), Some(4242)).unwrap();
        root
    })
}

fn run_in(extra: &[&str], script: &str) -> std::process::Output {
    let image = image().to_str().unwrap().to_string();
    let mut args = vec!["run", "--rootfs", &image];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    berth(&args)
        .stdin(Stdio::null())
        .output()
        .expect("running berth")
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_users_writable_container_owns_the_images_root_files_and_nothing_of_the_hosts() {
    let (uid, gid, _) = test_user();
    let host = public_dir("writable-host");
    // Root's on the host, readable by all (so the user may bind it), writable by root only.
    let file = host.join("file");
    std::fs::write(&file, "root's host file\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let dir = host.join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file_mount = format!("{}:/hostfile", file.display());
    let dir_mount = format!("{}:/hostdir", dir.display());
    let out = ok(run_in(
        &[
            "--user",
            "berthtest",
            "--mount",
            &file_mount,
            "--mount",
            &dir_mount,
        ],
        "echo \"id $(id -u)\"; echo \"root $(stat -c '%u %g' /)\"; \
         echo \"image $(stat -c %u /etc /bin/busybox | tr '\\n' ' ')\"; \
         touch /newfile && echo top-ok; \
         mkdir -p /usr/lib/python3/dist-packages/berthpkg && \
         echo 'x = 1' > /usr/lib/python3/dist-packages/berthpkg/__init__.py && echo lib-ok; \
         echo more >> /etc/group && echo etc-ok; \
         echo x >> /hostfile 2>/dev/null && echo hostfile-writable; \
         echo \"hostfile $(stat -c %u /hostfile)\"; \
         touch /hostdir/x 2>/dev/null && echo hostdir-writable; \
         echo \"hostdir $(stat -c %u /hostdir)\"; \
         echo \"dev $(stat -c %u /dev/null) proc $(stat -c %u /proc/sys/kernel)\"; \
         echo \"suid $(stat -c '%u %a' /bin/euid-suid)\"; /bin/euid-suid; \
         grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; \
         grep ' / ' /proc/self/mounts",
    ));
    let has = |line: &str| out.lines().any(|l| l == line);
    assert!(has(&format!("id {uid}")), "{out}");
    assert!(
        has(&format!("root {uid} {gid}")),
        "`/` is not the user's: {out}"
    );
    assert!(
        has(&format!("image {uid} {uid} ")),
        "the image's root files are not the user's: {out}"
    );
    for needle in ["top-ok", "lib-ok", "etc-ok"] {
        assert!(has(needle), "{needle} missing: {out}");
    }
    // Nothing bound from the host is idmapped: root's host files stay root's and unwritable
    // (inside, nobody's: the container's user namespace maps the user alone, as Pyxis's).
    assert!(!out.contains("hostfile-writable"), "{out}");
    assert!(!out.contains("hostdir-writable"), "{out}");
    assert!(has("hostfile 65534") && has("hostdir 65534"), "{out}");
    assert!(has("dev 65534 proc 65534"), "{out}");
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "root's host file\n"
    );
    assert!(!dir.join("x").exists());
    // The image's setuid-root program is the user's now, and gives no root: nosuid, and no
    // capability, under no_new_privs.
    assert!(has(&format!("suid {uid} 4755")), "{out}");
    assert!(has(&format!("euid={uid}")), "{out}");
    assert!(!has("euid=0"), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    let root_mount = out.lines().find(|l| l.contains(" / ")).unwrap();
    assert!(
        root_mount.contains("nosuid") && root_mount.contains("nodev"),
        "{root_mount}"
    );
    // The image on the host is untouched and still root's.
    assert!(!image().join("newfile").exists());
    assert!(!image().join("usr/lib/python3").exists());
    assert_eq!(std::fs::metadata(image().join("etc")).unwrap().uid(), 0);
    // Another image user's file keeps its owner, and stays out of the user's reach.
    let out = run_in(
        &["--user", "berthtest"],
        "stat -c 'other %u' /opt/other; echo x >> /opt/other 2>/dev/null && echo other-writable",
    );
    let text = stdout(&out);
    // (4242 is outside the container's user namespace: nobody's inside, never the user's.)
    assert!(text.contains("other 65534"), "{text}{}", stderr(&out));
    assert!(!text.contains("other-writable"), "{text}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn read_only_and_root_containers_keep_the_images_owners() {
    let out = run_in(
        &["--user", "berthtest", "--readonly"],
        "stat -c %u / /etc /bin/busybox; touch /newfile 2>/dev/null && echo top-writable",
    );
    let text = stdout(&out);
    // Root's, so nobody's in the user's namespace (which maps the user alone), not the user's.
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["65534", "65534", "65534"],
        "{text}{}",
        stderr(&out)
    );
    let out = ok(run_in(&[], "stat -c %u / /etc; id -u"));
    assert_eq!(out.lines().collect::<Vec<_>>(), ["0", "0", "0"], "{out}");
}

/// `unsquashfs -lln`'s listing of `sqsh`: path (without the `squashfs-root` prefix) to
/// `(mode, "uid/gid")`.
fn listing(sqsh: &Path) -> std::collections::BTreeMap<String, (String, String)> {
    let out = Command::new("unsquashfs")
        .arg("-lln")
        .arg(sqsh)
        .stdin(Stdio::null())
        .output()
        .expect("running unsquashfs");
    assert!(out.status.success(), "unsquashfs: {}", stderr(&out));
    stdout(&out)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = f.iter().find(|p| p.starts_with("squashfs-root"))?;
            let path = path.trim_start_matches("squashfs-root").to_string();
            Some((
                if path.is_empty() { "/".into() } else { path },
                (f[0].to_string(), f[1].to_string()),
            ))
        })
        .collect()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn exporting_a_users_writable_container_keeps_the_images_root_files_roots() {
    let (uid, _, _) = test_user();
    let image = image().to_str().unwrap();
    let id = ok(berth(&["create", "--rootfs", image, "--user", "berthtest"])
        .stdin(Stdio::null())
        .output()
        .unwrap());
    let id = id.trim().to_string();
    struct Remove(String);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = berth(&["rm", &self.0])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    let _rm = Remove(id.clone());
    let out = berth(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "touch /newfile && mkdir -p /usr/lib/pkg && echo p > /usr/lib/pkg/f && \
         echo more >> /etc/group && echo written",
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap();
    assert!(
        stdout(&out).contains("written"),
        "the user could not write the image's root paths: {}{}",
        stdout(&out),
        stderr(&out)
    );
    let dir = public_dir("writable-export");
    let sqsh = dir.join("saved.sqsh");
    ok(berth(&["export", &id, "-o", sqsh.to_str().unwrap()])
        .stdin(Stdio::null())
        .output()
        .unwrap());
    let list = listing(&sqsh);
    let owner = |p: &str| {
        list.get(p)
            .unwrap_or_else(|| panic!("{p} not in the saved image: {list:?}"))
            .clone()
    };
    // The image's root files stay root's; what the user made or changed is saved as root's, as
    // Enroot's export saves every file; another image user's file keeps its owner.
    for path in [
        "/",
        "/etc",
        "/bin/busybox",
        "/etc/group",
        "/newfile",
        "/usr/lib/pkg/f",
    ] {
        assert_eq!(owner(path).1, "0/0", "{path}: {:?}", owner(path));
    }
    assert_eq!(owner("/bin/euid-suid"), ("-rwsr-xr-x".into(), "0/0".into()));
    assert_eq!(owner("/opt/other").1, "4242/4242");
    assert!(
        !list
            .values()
            .any(|(_, o)| o.starts_with(&format!("{uid}/"))),
        "the user's uid leaked into the saved image: {list:?}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn where_layers_cannot_be_idmapped_the_container_starts_with_the_images_owners() {
    // ramfs takes no idmapped mount: the container still runs (its /tmp, binds and home work),
    // with the image's owners as before and a warning saying why.
    let dir = public_dir("writable-ramfs");
    let status = Command::new("mount")
        .args(["-t", "ramfs", "-o", "mode=755", "ramfs"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success(), "mounting a ramfs on {}", dir.display());
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let _unmount = Unmount(dir.clone());
    let root = dir.join("rootfs");
    let status = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&root)
        .status()
        .unwrap();
    assert!(status.success());
    let out = berth(&[
        "run",
        "--rootfs",
        root.to_str().unwrap(),
        "--user",
        "berthtest",
        "--",
        "sh",
        "-c",
        "stat -c %u / /etc; touch /newfile 2>/dev/null && echo top-writable; \
         touch /tmp/x && echo tmp-ok",
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    // Root's (nobody's in the user's namespace), not the user's.
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["65534", "65534", "tmp-ok"],
        "{text}"
    );
    assert!(
        stderr(&out).contains("the image's root-owned files stay root's"),
        "{}",
        stderr(&out)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn exporting_never_reads_a_bind_whose_parent_the_user_renames() {
    // A remapped container's user (the owner of its files) could do the same before.
    for extra in [&[][..], &["--remap-root"][..]] {
        export_while_renaming(extra);
    }
}

fn export_while_renaming(extra: &[&str]) {
    // The user owns `/` now, so can rename a directory berth made above a mount point while the
    // container is exported. Export used to detach the binds by their paths, read a moment
    // before: a bind that moved in between stayed, and mksquashfs (root, in the idmapping's
    // namespace, where other users' ids are mapped) read another user's private file into the
    // user's image.
    let host = public_dir("writable-rename");
    let shared = host.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = shared.join("secret");
    std::fs::write(&secret, "another user's secret\n").unwrap();
    std::os::unix::fs::chown(&secret, Some(4343), Some(4343)).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mount = format!("{}:/a/shared", shared.display());
    let image = image().to_str().unwrap();
    let mut args = vec![
        "create",
        "--rootfs",
        image,
        "--user",
        "berthtest",
        "--mount",
        &mount,
    ];
    args.extend_from_slice(extra);
    let id = ok(berth(&args).stdin(Stdio::null()).output().unwrap());
    let id = id.trim().to_string();
    struct Remove(String);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = berth(&["rm", &self.0])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    let _rm = Remove(id.clone());
    // Renames /a back and forth until the container is removed (or 120 s pass).
    let mut flipper = berth(&[
        "exec",
        &id,
        "--",
        "timeout",
        "120",
        "sh",
        "-c",
        "while :; do mv /a /b 2>/dev/null; mv /b /a 2>/dev/null; done",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let flipper = Kill(&mut flipper);
    let out_dir = public_dir("writable-rename-out");
    for round in 0..12 {
        let sqsh = out_dir.join(format!("{round}.sqsh"));
        let o = berth(&["export", &id, "-o", sqsh.to_str().unwrap()])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{extra:?} round {round}: {}",
            stderr(&o)
        );
        let list = listing(&sqsh);
        assert!(
            list.contains_key("/bin/busybox"),
            "{extra:?} round {round}: {list:?}"
        );
        assert!(
            !list.keys().any(|p| p.ends_with("/shared/secret")),
            "{extra:?} round {round}: the bind was read into the image: {:?}",
            list.keys()
                .filter(|p| p.contains("shared"))
                .collect::<Vec<_>>()
        );
    }
    drop(flipper);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_the_user_unpacked_as_themselves_stays_theirs() {
    // Enroot's way: every file is the user's already. Idmapped, they would be nobody's (the
    // mapping gives the image's id 0 the user's id and leaves the user's own out), and even
    // root could not make a mount point in /etc.
    let (uid, gid, _) = test_user();
    let dir = public_dir("writable-own-image");
    let own = dir.join("rootfs");
    let status = Command::new("cp")
        .arg("-a")
        .arg(image())
        .arg(&own)
        .status()
        .unwrap();
    assert!(status.success());
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{gid}"))
        .arg(&own)
        .status()
        .unwrap();
    assert!(status.success());
    let out = ok(berth(&[
        "run",
        "--rootfs",
        own.to_str().unwrap(),
        "--user",
        "berthtest",
        "--hostname",
        "own",
        "--",
        "sh",
        "-c",
        "stat -c %u /etc /bin/busybox; cat /etc/hostname; touch /etc/new && echo etc-ok",
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap());
    let u = uid.to_string();
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [u.as_str(), u.as_str(), "own", "etc-ok"],
        "{out}"
    );
}
