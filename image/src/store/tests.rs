use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use super::gc::{Candidate, plan};
use super::*;
use crate::LayerSink;
use crate::RegistryRef;
use crate::archive::test_images::{Comp, add_to_layout, layer, sha};
use crate::registry::RegistryError;

fn store(dir: &Path) -> Store {
    Store::open_at(&dir.join("store"), 2).unwrap()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Files anywhere under the store's tmp/ (workspaces may stay, empty).
fn tmp_files(s: &Store) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![s.root().join("tmp")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
                if d != s.root().join("tmp") {
                    out.push(e.path());
                }
            } else if d != s.root().join("tmp") {
                out.push(e.path());
            }
        }
    }
    out
}

fn layout_image(dir: &Path, files: &[(&str, &[u8])]) -> (Reference, String) {
    let layout = dir.join(format!("layout-{}", files[0].0.replace('/', "_")));
    let digest = add_to_layout(&layout, None, &[(layer(files), Comp::Gzip)]);
    (
        Reference::OciLayout {
            dir: layout,
            name: None,
        },
        digest,
    )
}

#[test]
fn digests_must_be_sha256_hex() {
    digest_hex(&format!("sha256:{}", "a".repeat(64))).unwrap();
    digest_hex("sha256:../../etc").unwrap_err();
    digest_hex(&format!("sha256:{}", "A".repeat(64))).unwrap_err();
    digest_hex(&format!("sha512:{}", "a".repeat(64))).unwrap_err();
}

#[test]
fn durations() {
    assert_eq!(parse_duration("30m").unwrap(), Duration::from_secs(1800));
    assert_eq!(parse_duration("12h").unwrap(), Duration::from_secs(43200));
    assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604800));
    assert_eq!(parse_duration("2w").unwrap(), Duration::from_secs(1209600));
    assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
    parse_duration("7y").unwrap_err();
    parse_duration("m").unwrap_err();
    parse_duration("-1h").unwrap_err();
}

#[test]
fn reference_keys_are_canonical_and_leave_out_the_user() {
    let r = Reference::Registry(RegistryRef {
        registry: "nvcr.io".into(),
        repository: "nvidia/pytorch".into(),
        tag: Some("24.01-py3".into()),
        digest: None,
        user: Some("alice".into()),
    });
    assert_eq!(
        reference_key(&r),
        "docker://nvcr.io/nvidia/pytorch:24.01-py3"
    );
    let r = Reference::OciArchive {
        file: "/x/a.tar".into(),
        name: Some("v1".into()),
    };
    assert_eq!(reference_key(&r), "oci-archive:/x/a.tar:v1");
    assert_eq!(
        reference_key(&Reference::Podman("img:1".into())),
        "podman://img:1"
    );
}

#[test]
fn staged_layers_are_invisible_until_published_and_gone_when_dropped() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let tar = layer(&[("etc/os-release", b"ID=test\n")]);
    let id = sha(&tar);
    let staged = s.stage(&id, &mut &tar[..]).unwrap();
    assert!(staged.extracted());
    assert!(
        s.existing_layer(&id).is_none(),
        "not visible before publish"
    );
    drop(staged);
    assert!(s.existing_layer(&id).is_none());
    assert!(tmp_files(&s).is_empty(), "{:?}", tmp_files(&s));

    let dir = s
        .stage(&id, &mut &tar[..])
        .unwrap()
        .publish_layer()
        .unwrap();
    assert_eq!(s.existing_layer(&id), Some(dir.clone()));
    assert_eq!(
        std::fs::read(dir.join("etc/os-release")).unwrap(),
        b"ID=test\n"
    );
    let size: u64 = std::fs::read_to_string(dir.with_extension("size"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(size >= 4096);
    assert!(tmp_files(&s).is_empty());

    // Through the trait, as the registry client uses it.
    let sink: &dyn LayerSink = &s;
    let tar2 = layer(&[("b", b"b")]);
    let staged = sink.stage_layer(&sha(&tar2), &mut &tar2[..]).unwrap();
    let dir2 = staged.publish().unwrap();
    assert!(dir2.join("b").is_file());
}

#[test]
fn a_layer_whose_content_does_not_match_its_diff_id_is_discarded() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let tar = layer(&[("a", b"a")]);
    let wrong = sha(b"another layer");
    let e = s.stage(&wrong, &mut &tar[..]).unwrap_err().to_string();
    assert!(e.contains("not the expected diff_id"), "{e}");
    assert!(s.existing_layer(&wrong).is_none());
    assert!(tmp_files(&s).is_empty());
    assert!(entries(&s.root().join("layers")).is_empty());
}

#[test]
fn concurrent_stagings_of_one_layer_extract_it_once() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let big = vec![42u8; 4 << 20];
    let tar = layer(&[("big", &big)]);
    let id = sha(&tar);
    let extracted = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let staged = s.stage(&id, &mut &tar[..]).unwrap();
                if staged.extracted() {
                    extracted.fetch_add(1, Ordering::SeqCst);
                }
                staged.publish_layer().unwrap();
            });
        }
    });
    assert_eq!(extracted.load(Ordering::SeqCst), 1);
    // Those that found it present still verified their stream: a wrong one is refused.
    let e = s
        .stage(&id, &mut &layer(&[("x", b"x")])[..])
        .unwrap_err()
        .to_string();
    assert!(e.contains("not the expected diff_id"), "{e}");
}

#[test]
fn import_with_builds_once_and_records_the_reference() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, digest) = layout_image(t.path(), &[("a", b"a")]);
    let first = crate::archive::import(&s, &r, &quiet).unwrap();
    assert_eq!(first.digest, digest);
    let builds = AtomicUsize::new(0);
    let other = Reference::Podman("localhost/same:1".into());
    let again = s
        .import_with(&digest, &other, &quiet, |_| {
            builds.fetch_add(1, Ordering::SeqCst);
            unreachable!("the image is in the store")
        })
        .unwrap();
    assert_eq!(again, first);
    assert_eq!(builds.load(Ordering::SeqCst), 0);
    assert_eq!(s.get(&other).unwrap().digest, digest);
    let listed = s.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].references.len(), 2);
}

#[test]
fn leftover_workspaces_of_dead_imports_are_removed_by_the_next_import() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let dead = s.root().join("tmp/12345-dead");
    std::fs::create_dir_all(dead.join("layer-abc-0/usr")).unwrap();
    std::fs::write(s.root().join("tmp/12345-dead.lock"), b"").unwrap();
    let (r, _) = layout_image(t.path(), &[("a", b"a")]);
    crate::archive::import(&s, &r, &quiet).unwrap();
    assert!(!dead.exists());
    assert!(!s.root().join("tmp/12345-dead.lock").exists());
}

#[test]
fn lookups_by_pinned_digest_and_for_users() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, digest) = layout_image(t.path(), &[("a", b"a")]);
    let mut image = crate::archive::import(&s, &r, &quiet).unwrap();
    let pinned = Reference::Registry(RegistryRef {
        registry: "r.example".into(),
        repository: "x".into(),
        tag: None,
        digest: Some(digest.clone()),
        user: None,
    });
    // A digest names no file a user could read: only a registry's image is found by it.
    assert_eq!(s.get(&pinned), None);

    // A private image: root always, others only when confirmed.
    image.anonymous = false;
    image.source = Reference::Podman("private:1".into());
    s.record(&image).unwrap();
    let private = Reference::Podman("private:1".into());
    let asked = AtomicUsize::new(0);
    let yes = |_: &Image| {
        asked.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    };
    assert!(s.get_for(&private, 1000, yes).unwrap().is_some());
    assert!(s.get_for(&private, 1000, |_| Ok(false)).unwrap().is_none());
    assert!(s.get_for(&private, 0, |_| Ok(false)).unwrap().is_some());
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    let e = s
        .get_for(&private, 1000, |_| {
            Err(RegistryError::Message("registry down".into()).into())
        })
        .unwrap_err();
    assert_eq!(e.to_string(), "registry down");
}

#[test]
fn in_use_images_are_never_removed() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, digest) = layout_image(t.path(), &[("a", b"a")]);
    crate::archive::import(&s, &r, &quiet).unwrap();
    let guard = s.use_image(&digest).unwrap();
    assert!(s.list()[0].in_use);
    let sel = s.select(&digest[7..20], &|_| unreachable!()).unwrap();
    assert_eq!(sel, Selector::Digest(digest.clone()));
    let e = s.remove(&sel).unwrap_err().to_string();
    assert!(e.contains("in use by a running container"), "{e}");
    let report = s
        .gc(&GcPolicy {
            max_size: Some(1),
            unused_for: Some(Duration::ZERO),
        })
        .unwrap();
    assert!(report.removed.is_empty());
    assert_eq!(report.kept_in_use, vec![digest.clone()]);
    drop(guard);
    assert!(!s.list()[0].in_use);
    let removed = s.remove(&sel).unwrap();
    assert!(
        matches!(removed, Removed::Image { layers: 1, .. }),
        "{removed:?}"
    );
    assert!(s.list().is_empty());
    assert_eq!(entries(&s.root().join("layers")), Vec::<String>::new());
    assert_eq!(entries(&s.root().join("refs")), Vec::<String>::new());
    assert!(
        s.use_image(&digest).is_err(),
        "a removed image cannot be used"
    );
}

#[test]
fn removing_one_of_two_references_untags() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, digest) = layout_image(t.path(), &[("a", b"a")]);
    crate::archive::import(&s, &r, &quiet).unwrap();
    let other = Reference::Podman("x:1".into());
    s.import_with(&digest, &other, &quiet, |_| unreachable!())
        .unwrap();
    let sel = s.select("podman://x:1", &|_| unreachable!()).unwrap();
    assert_eq!(
        s.remove(&sel).unwrap(),
        Removed::Untagged("podman://x:1".into())
    );
    assert_eq!(s.list().len(), 1);
    let key = reference_key(&r);
    let sel = s.select(&key, &|_| unreachable!()).unwrap();
    assert!(matches!(s.remove(&sel).unwrap(), Removed::Image { .. }));
    let e = s
        .select(&key, &|_| Err(RegistryError::Message("x".into()).into()))
        .unwrap_err();
    assert!(e.to_string().contains("no image"), "{e}");
}

#[test]
fn ambiguous_digest_prefixes_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    // Two records whose digests share a prefix.
    let (r, digest) = layout_image(t.path(), &[("a", b"a")]);
    let image = crate::archive::import(&s, &r, &quiet).unwrap();
    let mut twin = image.clone();
    twin.digest = format!("{}{}", &digest[..20], "0".repeat(64 - 13));
    twin.source = Reference::Podman("twin:1".into());
    s.record(&twin).unwrap();
    let e = s
        .select(&digest[7..20], &|_| unreachable!())
        .unwrap_err()
        .to_string();
    assert!(e.contains("matches several images"), "{e}");
}

fn cand(name: &str, layers: &[&str], age_s: u64, in_use: bool) -> Candidate {
    Candidate {
        digest: name.into(),
        layers: layers.iter().map(|s| s.to_string()).collect(),
        own_bytes: 0,
        last_used: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 - age_s),
        in_use,
    }
}

#[test]
fn gc_plan_is_least_recently_used_first_and_skips_images_in_use() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let sizes: BTreeMap<String, u64> = [("base", 100), ("a", 10), ("b", 20), ("c", 30)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let images = [
        cand("A", &["base", "a"], 300, false),
        cand("B", &["base", "b"], 200, true),
        cand("C", &["base", "c"], 100, false),
    ];
    // Total 160 (base counted once). To fit 140: A goes (oldest) → 150; B is in use; C goes → 120.
    let (gone, kept) = plan(
        &images,
        &sizes,
        &GcPolicy {
            max_size: Some(140),
            unused_for: None,
        },
        now,
    );
    assert_eq!(gone, vec!["A".to_string(), "C".to_string()]);
    assert_eq!(kept, vec!["B".to_string()]);
    // Fits already: nothing.
    let (gone, _) = plan(
        &images,
        &sizes,
        &GcPolicy {
            max_size: Some(160),
            unused_for: None,
        },
        now,
    );
    assert!(gone.is_empty());
    // Unused for 150 s or more: A (300 s) and B (200 s, in use: kept).
    let (gone, kept) = plan(
        &images,
        &sizes,
        &GcPolicy {
            max_size: None,
            unused_for: Some(Duration::from_secs(150)),
        },
        now,
    );
    assert_eq!(gone, vec!["A".to_string()]);
    assert_eq!(kept, vec!["B".to_string()]);
    // No policy: only garbage, never an image.
    assert!(
        plan(&images, &sizes, &GcPolicy::default(), now)
            .0
            .is_empty()
    );
}

#[test]
fn gc_removes_unreferenced_layers_and_stray_files() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, _) = layout_image(t.path(), &[("a", b"a")]);
    crate::archive::import(&s, &r, &quiet).unwrap();
    // A layer no image references (e.g. its import failed after publishing it).
    let orphan = layer(&[("orphan", b"o")]);
    s.stage(&sha(&orphan), &mut &orphan[..])
        .unwrap()
        .publish_layer()
        .unwrap();
    std::fs::write(s.files_dir().join("stale.sqsh"), b"x").unwrap();
    let report = s.gc(&GcPolicy::default()).unwrap();
    assert_eq!(report.layers_removed, 1);
    assert!(report.removed.is_empty());
    assert!(s.existing_layer(&sha(&orphan)).is_none());
    assert!(!s.files_dir().join("stale.sqsh").exists());
    assert_eq!(s.list().len(), 1, "the image and its layer stay");
    assert!(s.get_local(&r).is_some());
}

#[test]
fn records_from_other_sources_and_their_files() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let sqsh = t.path().join("img.sqsh");
    std::fs::write(&sqsh, b"hsqs....").unwrap();
    let copy = s.files_dir().join("abc.sqsh");
    std::fs::write(&copy, b"hsqs....").unwrap();
    let image = Image {
        digest: sha(b"hsqs...."),
        source: Reference::Squashfs(sqsh.clone()),
        rootfs: Rootfs::Squashfs {
            file: copy.clone(),
            offset: 0,
            size: 8,
        },
        config: Default::default(),
        anonymous: true,
    };
    s.record(&image).unwrap();
    assert_eq!(
        s.get_local(&Reference::Squashfs(sqsh.clone())),
        Some(image.clone())
    );
    // The file changed: a miss, so it gets imported again.
    std::fs::write(&sqsh, b"hsqs...!!").unwrap();
    assert_eq!(s.get_local(&Reference::Squashfs(sqsh.clone())), None);
    s.gc(&GcPolicy::default()).unwrap();
    assert!(copy.exists(), "a referenced file is kept");
    let removed = s.remove(&Selector::Digest(image.digest.clone())).unwrap();
    assert!(matches!(removed, Removed::Image { .. }));
    assert!(!copy.exists(), "the store's copy goes with its image");
}

#[test]
fn the_store_is_private_to_root() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("store");
    std::fs::create_dir_all(root.join("layers")).unwrap();
    std::fs::set_permissions(root.join("layers"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let s = Store::open_at(&root, 1).unwrap();
    for dir in ["layers", "images", "refs", "tmp", "files"] {
        let mode = std::fs::metadata(s.root().join(dir))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "{dir}");
    }
    let fresh = Store::open_at(&t.path().join("fresh"), 1).unwrap();
    let mode = std::fs::metadata(fresh.root())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
}

/// A layer tar whose entries are given as (path, hardlink target or content).
fn layer_with_links(entries: &[(&str, Result<&str, &[u8]>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, what) in entries {
        let mut h = tar::Header::new_ustar();
        h.set_mode(0o751);
        h.set_mtime(1000);
        match what {
            Ok(target) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_size(0);
                b.append_link(&mut h, path, target).unwrap();
            }
            Err(data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

fn layout_of(dir: &Path, name: &str, layers: Vec<Vec<u8>>) -> Reference {
    let layout = dir.join(name);
    let layers: Vec<(Vec<u8>, Comp)> = layers.into_iter().map(|l| (l, Comp::Gzip)).collect();
    add_to_layout(&layout, None, &layers);
    Reference::OciLayout {
        dir: layout,
        name: None,
    }
}

fn limits(s: &Store) -> Limits {
    s.limits().clone()
}

#[test]
fn too_many_layers_are_refused_before_anything_is_extracted() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let s = {
        let l = Limits {
            max_layers: 2,
            ..limits(&s)
        };
        s.with_limits(l)
    };
    let layers = (0..3).map(|i| layer(&[(&format!("f{i}"), b"x")])).collect();
    let r = layout_of(t.path(), "three", layers);
    let e = crate::archive::import(&s, &r, &quiet)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("store.max_layers (2)") && e.contains("3 layers"),
        "{e}"
    );
    assert!(!e.contains('\n'));
    assert!(entries(&s.root().join("layers")).is_empty());
}

#[test]
fn a_layer_expanding_past_its_bound_is_refused_and_nothing_is_kept() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    // 4 MiB of zeros: a few KiB gzipped.
    let zeros = vec![0u8; 4 << 20];
    let r = layout_of(t.path(), "bomb", vec![layer(&[("zeros", &zeros)])]);
    let small = Limits {
        max_layer_bytes: 1 << 20,
        ..limits(&s)
    };
    let s = s.with_limits(small);
    let e = crate::archive::import(&s, &r, &quiet)
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.max_layer_bytes (1.0 MiB)"), "{e}");
    assert!(entries(&s.root().join("layers")).is_empty());
    assert!(tmp_files(&s).is_empty(), "{:?}", tmp_files(&s));

    let l = Limits {
        max_image_bytes: 6 << 20,
        max_layer_bytes: 64 << 20,
        ..limits(&s)
    };
    let s = s.with_limits(l);
    let two = layout_of(
        t.path(),
        "two",
        vec![layer(&[("a", &zeros)]), layer(&[("b", &zeros)])],
    );
    let e = crate::archive::import(&s, &two, &quiet)
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.max_image_bytes (6.0 MiB)"), "{e}");
    assert!(s.get_local(&two).is_none());

    let l = Limits {
        max_image_bytes: 1 << 40,
        reserve_bytes: u64::MAX / 4,
        ..limits(&s)
    };
    let s = s.with_limits(l);
    let e = crate::archive::import(&s, &r, &quiet)
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.reserve_bytes"), "{e}");
}

#[test]
fn verify_finds_a_truncated_file_and_a_reimport_replaces_the_layer() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, _) = layout_image(t.path(), &[("bin/tool", b"0123456789")]);
    let image = crate::archive::import(&s, &r, &quiet).unwrap();
    let Rootfs::Layers(dirs) = &image.rootfs else {
        panic!()
    };
    let report = s.verify(s.list()).unwrap();
    assert!(!report.damaged());
    // Truncated in place, as a disk or a careless admin might.
    std::fs::write(dirs[0].join("bin/tool"), b"0123").unwrap();
    let report = s.verify(s.list()).unwrap();
    assert!(report.damaged());
    let (_, checks) = &report.images[0];
    assert_eq!(
        checks[0].1,
        LayerCheck::Differs(vec!["/bin/tool: size 4 (recorded 10)".into()])
    );
    // The image is no longer whole: the next import extracts the layer again, in place.
    assert!(s.get_local(&r).is_none());
    let again = crate::archive::import(&s, &r, &quiet).unwrap();
    assert_eq!(again.rootfs, image.rootfs);
    assert_eq!(
        std::fs::read(dirs[0].join("bin/tool")).unwrap(),
        b"0123456789"
    );
    assert!(!s.verify(s.list()).unwrap().damaged());
    assert!(tmp_files(&s).is_empty(), "{:?}", tmp_files(&s));
}

#[test]
fn gc_removes_images_with_damaged_layers_and_unrecorded_layers_are_reported() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let (r, _) = layout_image(t.path(), &[("etc/x", b"abc")]);
    let image = crate::archive::import(&s, &r, &quiet).unwrap();
    let Rootfs::Layers(dirs) = &image.rootfs else {
        panic!()
    };
    std::fs::write(dirs[0].join("etc/extra"), b"!").unwrap();
    assert!(s.verify(s.list()).unwrap().damaged());
    let report = s.gc(&GcPolicy::default()).unwrap();
    assert_eq!(report.removed.len(), 1);
    assert!(!dirs[0].exists());
    // As imported by an older berth: no record.
    let image = crate::archive::import(&s, &r, &quiet).unwrap();
    let Rootfs::Layers(dirs) = &image.rootfs else {
        panic!()
    };
    std::fs::remove_file(dirs[0].with_extension("files")).unwrap();
    let report = s.verify(s.list()).unwrap();
    assert_eq!(report.images[0].1[0].1, LayerCheck::Unrecorded);
    assert!(!report.damaged());
}

#[test]
fn a_hardlink_to_a_lower_layer_is_copied_up_above_the_layer() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let lower = layer_with_links(&[("usr/bin/x", Err(b"lower content"))]);
    let upper = layer_with_links(&[
        ("usr/bin/y", Ok("usr/bin/x")),
        ("usr/bin/z", Ok("usr/bin/y")),
        ("own", Err(b"own")),
    ]);
    let r = layout_of(t.path(), "links", vec![lower.clone(), upper.clone()]);
    let image = crate::archive::import(&s, &r, &quiet).unwrap();
    let Rootfs::Layers(dirs) = &image.rootfs else {
        panic!()
    };
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    let copies = &dirs[2];
    let y = copies.join("usr/bin/y");
    assert_eq!(std::fs::read(&y).unwrap(), b"lower content");
    assert_eq!(
        std::fs::read(copies.join("usr/bin/z")).unwrap(),
        b"lower content"
    );
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(&y).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o751);
    assert_eq!(m.nlink(), 2, "the two links share the copy");
    assert_eq!(m.mtime(), 1000);
    assert!(!dirs[1].join("usr/bin/y").exists());
    // The copies' layer is recorded too, and verifies.
    assert!(!s.verify(s.list()).unwrap().damaged());
    // The same chain again reuses them.
    let again = crate::archive::import(&s, &r, &quiet).unwrap();
    assert_eq!(again.rootfs, image.rootfs);

    // A target in no lower layer is refused in one line.
    let r = layout_of(t.path(), "dangling", vec![upper]);
    let e = crate::archive::import(&s, &r, &quiet)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("hardlink '/usr/bin/y' to '/usr/bin/x'")
            && e.contains("neither this layer nor a lower one"),
        "{e}"
    );
    assert!(!e.contains('\n'));
}

#[test]
fn a_layer_from_an_older_berth_gets_its_record_in_place_when_its_content_matches() {
    use std::os::unix::fs::MetadataExt;
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let base = layer(&[("etc/base", b"base")]);
    let r1 = layout_of(t.path(), "one", vec![base.clone()]);
    let image = crate::archive::import(&s, &r1, &quiet).unwrap();
    let Rootfs::Layers(dirs) = &image.rootfs else {
        panic!()
    };
    // As an older berth left it: no record.
    std::fs::remove_file(dirs[0].with_extension("files")).unwrap();
    let ino = std::fs::metadata(&dirs[0]).unwrap().ino();
    let r2 = layout_of(t.path(), "two", vec![base, layer(&[("app", b"app")])]);
    crate::archive::import(&s, &r2, &quiet).unwrap();
    // Recorded, and the same directory (running containers keep theirs).
    assert!(dirs[0].with_extension("files").is_file());
    assert_eq!(std::fs::metadata(&dirs[0]).unwrap().ino(), ino);
    assert!(!s.verify(s.list()).unwrap().damaged());
}

#[test]
fn gc_removes_lazy_chunk_caches_unused_long_enough_and_never_a_mounted_one() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    let lazy = s.root().join("lazy");
    std::fs::create_dir(&lazy).unwrap();
    std::fs::set_permissions(&lazy, std::fs::Permissions::from_mode(0o700)).unwrap();
    let two_hours_ago = SystemTime::now() - Duration::from_secs(7200);
    let make = |hex: &str, used: SystemTime| {
        std::fs::write(lazy.join(format!("{hex}.data")), vec![7u8; 8192]).unwrap();
        let map = lazy.join(format!("{hex}.map"));
        std::fs::write(&map, [1u8, 1]).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&map)
            .unwrap()
            .set_modified(used)
            .unwrap();
    };
    let (old, mounted, recent) = ("a".repeat(64), "b".repeat(64), "c".repeat(64));
    make(&old, two_hours_ago);
    make(&mounted, two_hours_ago);
    make(&recent, SystemTime::now());
    // What a lazy mount holds while it runs.
    let held = std::fs::File::open(lazy.join(format!("{mounted}.map"))).unwrap();
    held.lock_shared().unwrap();

    let left = || entries(&lazy);
    let all = left();
    let r = s.gc(&GcPolicy::default()).unwrap();
    assert_eq!(r.lazy_caches_removed, 0, "no --unused-for: caches stay");
    assert_eq!(left(), all);

    let hour = GcPolicy {
        unused_for: Some(Duration::from_secs(3600)),
        ..Default::default()
    };
    let r = s.gc(&hour).unwrap();
    assert_eq!(r.lazy_caches_removed, 1);
    assert!(r.lazy_bytes_freed >= 8192, "{}", r.lazy_bytes_freed);
    assert!(r.bytes_freed >= r.lazy_bytes_freed);
    let expected: Vec<String> = [&mounted, &recent]
        .iter()
        .flat_map(|h| [format!("{h}.data"), format!("{h}.map")])
        .collect();
    assert_eq!(left(), expected);

    drop(held);
    let r = s.gc(&hour).unwrap();
    assert_eq!(r.lazy_caches_removed, 1, "unmounted now, and old");
    assert_eq!(left(), [format!("{recent}.data"), format!("{recent}.map")]);
}
