//! Root tier: bounds on what an import writes, `berth images verify`, and hardlinks to a lower
//! layer's file, against the real binary, kernel overlayfs and a tmpfs-backed store (issue 14,
//! points 3, 4, 5 and 9). Images are OCI layouts written here: layer tars from the `tar` crate
//! (hardlinks to files of no earlier entry are possible that way) or GNU tar of the busybox
//! rootfs, gzip from flate2. Run by integration/test.sh as root:
//! `cargo test --test root_store_bounds -- --ignored --test-threads=1`.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{berth_bin, cgroup_root, rootfs, stderr, stdout};
use sha2::{Digest as _, Sha256};

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// What a layer tar holds: a file (path, content, mode) or a hardlink (path, target).
enum E<'a> {
    File(&'a str, &'a [u8], u32),
    Link(&'a str, &'a str),
}

fn layer(entries: &[E<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(1_000_000);
        h.set_uid(0);
        h.set_gid(0);
        match e {
            E::File(path, data, mode) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).unwrap();
            }
            E::Link(path, target) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_mode(0o644);
                h.set_size(0);
                b.append_link(&mut h, path, target).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// GNU tar of the busybox rootfs (a lower layer containers can run).
fn busybox_layer() -> Vec<u8> {
    let out = Command::new("tar")
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=@0",
            "-C",
        ])
        .arg(rootfs())
        .args(["-cf", "-", "."])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

fn write_blob(layout: &Path, bytes: &[u8]) -> String {
    let d = sha(bytes);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(&d[7..]), bytes).unwrap();
    d
}

/// Writes an OCI layout with one image of these (uncompressed) layers, gzipped; returns the
/// `oci:` reference.
fn layout(dir: &Path, layers: &[Vec<u8>]) -> String {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let diff_ids: Vec<String> = layers.iter().map(|t| sha(t)).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let config_digest = write_blob(dir, &config);
    let descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|t| {
            let blob = gzip(t);
            let d = write_blob(dir, &blob);
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                               "digest": d, "size": blob.len()})
        })
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": descs,
    }))
    .unwrap();
    let digest = write_blob(dir, &manifest);
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": digest, "size": manifest.len()}]});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    format!("oci:{}", dir.display())
}

/// A temporary directory with a config whose store (and container state) live in it, plus
/// `extra` lines under `[store]`.
struct Env {
    dir: tempfile::TempDir,
    store: PathBuf,
}

impl Env {
    fn new(store_at: Option<&Path>, store_extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = store_at
            .map(Path::to_path_buf)
            .unwrap_or_else(|| dir.path().join("store"));
        std::fs::write(
            dir.path().join("berth.toml"),
            format!(
                "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[store]\nroot = \"{}\"\n{store_extra}\n\
                 [squashfs]\nmount_dir = \"{}\"\n[scratch]\nroot = \"{}\"\n",
                cgroup_root(),
                dir.path().join("state").display(),
                store.display(),
                dir.path().join("mnt").display(),
                dir.path().join("scratch").display(),
            ),
        )
        .unwrap();
        Self { dir, store }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn berth(&self, args: &[&str]) -> Output {
        Command::new(berth_bin())
            .arg("--config")
            .arg(self.path().join("berth.toml"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    }

    fn names(&self, sub: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.store.join(sub))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Files left in any workspace under tmp/.
    fn tmp_contents(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(self.store.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
        {
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

/// A tmpfs mounted for one test, unmounted (lazily) when dropped.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn new(size: &str) -> Self {
        let t = Tmpfs(tempfile::tempdir().unwrap());
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(t.0.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "mounting a tmpfs");
        t
    }

    fn free(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(self.0.path()).unwrap();
        st.blocks_available() as u64 * st.fragment_size() as u64
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The error lines of a failed command (progress lines left out).
fn errors(o: &Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| {
            // Progress: "berth: importing …", "berth: layer 1/2 …".
            let progress = l.strip_prefix("berth: layer ").is_some_and(|r| {
                r.split(' ')
                    .next()
                    .is_some_and(|n| n.contains('/') && n.starts_with(|c: char| c.is_ascii_digit()))
            });
            !l.starts_with("berth: importing") && !progress
        })
        .map(String::from)
        .collect()
}

fn one_error(o: &Output) -> String {
    assert!(!o.status.success(), "succeeded: {}", stdout(o));
    let e = stderr(o);
    let lines: Vec<&str> = e.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {e}");
    assert!(
        lines[0].len() < 1000,
        "a long line: {} bytes",
        lines[0].len()
    );
    lines[0].to_string()
}

// ---------------------------------------------------------------------------------------------
// Point 3: layer count

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_with_more_layers_than_overlayfs_stacks_is_refused_before_extracting() {
    // Default config: store.max_layers = 500.
    let env = Env::new(None, "");
    let layers: Vec<Vec<u8>> = (0..501)
        .map(|i| layer(&[E::File(&format!("f{i}"), b"x", 0o644)]))
        .collect();
    let r = layout(&env.path().join("many"), &layers);
    let out = env.berth(&["import", &r]);
    let e = one_error(&out);
    assert!(
        e.contains("501 layers") && e.contains("store.max_layers (500)"),
        "{e}"
    );
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));
    assert!(env.names("images").is_empty());

    // The bound is the key's: with a higher one, 501 layers import.
    let env = Env::new(None, "max_layers = 600");
    let r = layout(&env.path().join("many"), &layers);
    let out = env.berth(&["import", &r]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn registry_images_are_bounded_before_and_while_fetching() {
    let dir = tempfile::tempdir().unwrap();
    let registry = harness::Registry::start(
        &harness::Mode::Plain,
        &dir.path().join("storage"),
        &dir.path().join("reg"),
    );
    let up = harness::Uploader::new(&registry.host(), None);
    let gz = |e: Vec<harness::Entry>| {
        harness::blob_of(harness::tar_of(&e), harness::Compression::Gzip, false)
    };
    up.image(
        "test/four",
        Some("1"),
        "amd64",
        (0..4)
            .map(|i| {
                gz(vec![harness::Entry::File(
                    format!("f{i}"),
                    vec![b'x'; i + 1],
                    0o644,
                )])
            })
            .collect(),
        false,
    );
    up.image(
        "test/bomb",
        Some("1"),
        "amd64",
        vec![gz(vec![harness::Entry::File(
            "zeros".into(),
            vec![0u8; 16 << 20],
            0o644,
        )])],
        false,
    );
    let insecure = format!("[registry]\ninsecure = [\"{}\"]\n", registry.host());
    let env = Env::new(None, "max_layers = 3\nmax_layer_bytes = 2097152");
    let config = env.path().join("berth.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}{insecure}")).unwrap();

    let four = format!("{}#test/four:1", registry.host());
    let e = one_error(&env.berth(&["import", &four]));
    assert!(
        e.contains("4 layers")
            && e.contains("store.max_layers (3)")
            && e.contains("nothing was fetched"),
        "{e}"
    );
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));

    let bomb = format!("{}#test/bomb:1", registry.host());
    let out = env.berth(&["import", &bomb]);
    let e = errors(&out);
    assert!(!out.status.success());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("store.max_layer_bytes (2.0 MiB)"), "{e:?}");
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));
    assert!(env.tmp_contents().is_empty(), "{:?}", env.tmp_contents());
}

// ---------------------------------------------------------------------------------------------
// Point 5: expanded bytes and the free-space reserve

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_gzip_bomb_stops_at_the_layer_and_image_bounds_and_leaves_nothing() {
    // 32 MiB of zeros gzip to about 32 KiB: the compressed-size estimate lets it through.
    let zeros = vec![0u8; 32 << 20];
    let bomb = layer(&[E::File("zeros", &zeros, 0o644)]);
    let env = Env::new(None, "max_layer_bytes = 4194304");
    let r = layout(&env.path().join("bomb"), std::slice::from_ref(&bomb));
    let out = env.berth(&["import", &r]);
    let e = errors(&out);
    assert!(!out.status.success());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].contains("store.max_layer_bytes (4.0 MiB)") && e[0].contains("nothing partial"),
        "{e:?}"
    );
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));
    assert!(env.tmp_contents().is_empty(), "{:?}", env.tmp_contents());

    // Two layers of 3 MiB each: each under max_layer_bytes, together over max_image_bytes.
    let env = Env::new(None, "max_image_bytes = 5242880");
    let three = vec![1u8; 3 << 20];
    let r = layout(
        &env.path().join("two"),
        &[
            layer(&[E::File("a", &three, 0o644)]),
            layer(&[E::File("b", &three, 0o644)]),
        ],
    );
    let out = env.berth(&["import", &r]);
    let e = errors(&out);
    assert!(!out.status.success());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("store.max_image_bytes (5.0 MiB)"), "{e:?}");
    assert!(env.names("images").is_empty());
    assert!(env.tmp_contents().is_empty(), "{:?}", env.tmp_contents());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn extraction_stops_at_the_free_space_reserve_of_a_small_store() {
    let fs = Tmpfs::new("64m");
    let zeros = vec![0u8; 48 << 20];
    let bomb = layer(&[E::File("zeros", &zeros, 0o644)]);

    // The default reserve (1 GiB) is more than this file system holds: refused up front, and
    // the store's file system is left as it was (the old berth filled it to ENOSPC).
    let env = Env::new(Some(&fs.0.path().join("store")), "");
    let r = layout(&env.path().join("bomb"), std::slice::from_ref(&bomb));
    let out = env.berth(&["import", &r]);
    let e = errors(&out);
    assert!(!out.status.success());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("store.reserve_bytes (1.0 GiB)"), "{e:?}");
    assert!(fs.free() > 60 << 20, "{} free", fs.free());

    // A 24 MiB reserve: the estimate passes (the layer is 48 KiB gzipped), extraction stops
    // when the free space reaches the reserve, and the partial layer is removed.
    let env = Env::new(
        Some(&fs.0.path().join("store2")),
        "reserve_bytes = 25165824",
    );
    let r = layout(&env.path().join("bomb"), &[bomb]);
    let out = env.berth(&["import", &r]);
    let e = errors(&out);
    assert!(!out.status.success());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].contains("extracting layer")
            && e[0].contains("store.reserve_bytes (24.0 MiB)")
            && e[0].contains("nothing partial was kept")
            && !e[0].contains("ran out of space"),
        "{e:?}"
    );
    assert!(env.names("layers").is_empty(), "{:?}", env.names("layers"));
    assert!(env.tmp_contents().is_empty(), "{:?}", env.tmp_contents());
    assert!(fs.free() > 60 << 20, "{} free", fs.free());
}

// ---------------------------------------------------------------------------------------------
// Point 4: verify

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn verify_names_a_truncated_file_and_a_reimport_repairs_it() {
    let env = Env::new(None, "");
    let r = layout(
        &env.path().join("img"),
        &[
            busybox_layer(),
            layer(&[E::File("data/file", b"0123456789abcdef", 0o640)]),
        ],
    );
    let out = env.berth(&["import", &r]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = env.berth(&["images", "verify"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(": ok (2 layers"), "{}", stdout(&out));

    // Truncate the file in the store, as a failing disk or a careless admin could.
    let layers = env.store.join("layers");
    let file = std::fs::read_dir(&layers)
        .unwrap()
        .flatten()
        .map(|e| e.path().join("data/file"))
        .find(|p| p.exists())
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(4)
        .unwrap();
    let out = env.berth(&["images", "verify", &r]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let e = stderr(&out);
    assert!(
        e.contains(&format!("{r}: layer "))
            && e.contains("/data/file: size 4 (recorded 16)")
            && e.contains("berth images gc")
            && e.contains("re-import"),
        "{e}"
    );

    // A run now imports again: the damaged layer is extracted anew and replaces the bad one.
    let out = env.berth(&["run", "--image", &r, "--", "cat", "/data/file"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "0123456789abcdef");
    let out = env.berth(&["images", "verify"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Damaged again, then gc: the image goes, and the next import brings it back whole.
    std::fs::write(&file, b"other").unwrap();
    assert_eq!(env.berth(&["images", "verify"]).status.code(), Some(1));
    let out = env.berth(&["images", "gc"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(env.names("images").is_empty(), "{:?}", env.names("images"));
    let out = env.berth(&["import", &r]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = env.berth(&["images", "verify"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

// ---------------------------------------------------------------------------------------------
// Point 9: hardlinks to a lower layer's file

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_hardlink_to_a_lower_layers_file_is_copied_up_and_seen_under_both_names() {
    let env = Env::new(None, "");
    let lower = layer(&[E::File("data/orig", b"from the lower layer\n", 0o750)]);
    let upper = layer(&[
        E::Link("data/link", "data/orig"),
        E::File("data/own", b"own\n", 0o644),
    ]);
    let r = layout(
        &env.path().join("img"),
        &[busybox_layer(), lower, upper.clone()],
    );
    let out = env.berth(&["import", &r]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = env.berth(&[
        "run",
        "--image",
        &r,
        "--",
        "sh",
        "-c",
        "cat /data/orig /data/link; stat -c %a /data/link",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "from the lower layer\nfrom the lower layer\n750\n"
    );
    let out = env.berth(&["images", "verify"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A link to a file of no layer at all is still refused, in one line.
    let r = layout(&env.path().join("dangling"), &[busybox_layer(), upper]);
    let out = env.berth(&["import", &r]);
    let e = errors(&out);
    assert!(!out.status.success());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].contains("hardlink '/data/link' to '/data/orig'")
            && e[0].contains("neither this layer nor a lower one"),
        "{e:?}"
    );
}
