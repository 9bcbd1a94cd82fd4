//! Root tier: the registry client against Debian's docker-registry (distribution 2.8) on
//! 127.0.0.1 — anonymous, Basic and Bearer-token auth, TLS, plain-HTTP refusal, missing tags,
//! corrupt blobs, a registry killed mid-pull (and restarted), zstd and uncompressed layers, OCI
//! indexes and Docker manifest lists. Test images are built from busybox-static and pushed by
//! the harness in integration/registry/harness.rs.
//!
//! Run alone: `cargo test --test root_registry -- --ignored --test-threads=1`.

#[path = "../integration/registry/harness.rs"]
mod harness;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use berth::config::RegistryConfig;
use berth::image::registry::RegistryError;
use berth::image::registry::{Client, ProgressMode, PullOptions, Pulled};
use berth::image::store::Store;
use berth::image::{ImageError, LayerSink, RegistryRef, StagedLayer, reference};
use harness::{Compression, Entry, Mode, Pki, Proxy, Registry, TokenServer, Uploader};

// ---------------------------------------------------------------------------------------------
// The layers go into the real store (image/src/store), wrapped to count what the client asks.

/// The real store in a temporary directory, counting what the client asks of it.
struct TestSink {
    root: tempfile::TempDir,
    store: Store,
    stage_calls: AtomicUsize,
    published: Arc<Mutex<Vec<String>>>,
}

impl TestSink {
    fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open_at(&root.path().join("store"), 4).unwrap();
        Self {
            root,
            store,
            stage_calls: AtomicUsize::new(0),
            published: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn layer_dir(&self, diff_id: &str) -> PathBuf {
        self.store.layer_dir(diff_id).unwrap()
    }

    fn published(&self) -> Vec<String> {
        self.published.lock().unwrap().clone()
    }

    /// Layer directories present (published) in the store.
    fn stored(&self) -> usize {
        std::fs::read_dir(self.root.path().join("store/layers"))
            .unwrap()
            .count()
    }

    /// Staging areas left behind in the store's import workspaces (must be none).
    fn leftovers(&self) -> usize {
        std::fs::read_dir(self.root.path().join("store/tmp"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| std::fs::read_dir(e.path()).map(|w| w.count()).unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0)
    }
}

/// Records which layers were published.
struct Recorded {
    inner: Box<dyn StagedLayer>,
    diff_id: String,
    published: Arc<Mutex<Vec<String>>>,
}

impl StagedLayer for Recorded {
    fn publish(self: Box<Self>) -> Result<PathBuf, ImageError> {
        let dir = self.inner.publish()?;
        self.published.lock().unwrap().push(self.diff_id.clone());
        Ok(dir)
    }
}

impl LayerSink for TestSink {
    fn existing_layer(&self, diff_id: &str) -> Option<PathBuf> {
        self.store.existing_layer(diff_id)
    }

    fn stage_layer(
        &self,
        diff_id: &str,
        tar: &mut dyn Read,
    ) -> Result<Box<dyn StagedLayer>, ImageError> {
        self.stage_calls.fetch_add(1, Ordering::Relaxed);
        let inner = self.store.stage_layer(diff_id, tar)?;
        Ok(Box::new(Recorded {
            inner,
            diff_id: diff_id.to_string(),
            published: self.published.clone(),
        }))
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures: one registry storage with every test image, built once per test process.

struct Images {
    busybox: harness::Pushed,
    layers: harness::Pushed,
    zstd: harness::Pushed,
    multi_amd64: harness::Pushed,
    multi_arm64: harness::Pushed,
    multi_index: String,
    list_amd64: harness::Pushed,
    list_arm64: harness::Pushed,
    big: harness::Pushed,
    corrupt: harness::Pushed,
}

struct Fixture {
    base: PathBuf,
    storage: PathBuf,
    pki: Pki,
    images: Images,
}

const USER: &str = "alice";
const PASSWORD: &str = "s3cret-pw";
const SERVICE: &str = "berth-test-registry";
const ISSUER: &str = "berth-test-issuer";

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("root-registry");
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let storage = base.join("seed-storage");
        let pki = Pki::create(&base.join("pki"));
        let seed = Registry::start(&Mode::Plain, &storage, &base.join("seed"));
        let up = Uploader::new(&seed.host(), None);
        let gz = |entries: Vec<Entry>| {
            harness::blob_of(harness::tar_of(&entries), Compression::Gzip, false)
        };

        let busybox = up.image(
            "test/busybox",
            Some("1"),
            "amd64",
            vec![gz(harness::busybox_entries("amd64"))],
            false,
        );

        let mut base_layer = harness::busybox_entries("amd64");
        base_layer.extend([
            Entry::File("etc/a".into(), b"a\n".to_vec(), 0o644),
            Entry::File("etc/b".into(), b"b\n".to_vec(), 0o644),
            Entry::Dir("d"),
            Entry::File("d/x".into(), b"x\n".to_vec(), 0o644),
            Entry::File("d/y".into(), b"y\n".to_vec(), 0o644),
        ]);
        let layers = up.image(
            "test/layers",
            Some("1"),
            "amd64",
            vec![
                gz(base_layer),
                gz(vec![
                    Entry::Dir("etc"),
                    Entry::Whiteout("etc/a"),
                    Entry::File("etc/c".into(), b"c\n".to_vec(), 0o644),
                ]),
                gz(vec![
                    Entry::Dir("d"),
                    Entry::Opaque("d"),
                    Entry::File("d/z".into(), b"z\n".to_vec(), 0o600),
                ]),
            ],
            false,
        );

        let zstd = up.image(
            "test/zstd",
            Some("1"),
            "amd64",
            vec![
                harness::blob_of(
                    harness::tar_of(&harness::busybox_entries("amd64")),
                    Compression::Zstd,
                    false,
                ),
                harness::blob_of(
                    harness::tar_of(&[
                        Entry::Dir("opt"),
                        Entry::File("opt/plain".into(), b"uncompressed layer\n".to_vec(), 0o644),
                    ]),
                    Compression::None,
                    false,
                ),
            ],
            false,
        );

        let multi_amd64 = up.image(
            "test/multi",
            None,
            "amd64",
            vec![gz(harness::busybox_entries("amd64"))],
            false,
        );
        let multi_arm64 = up.image(
            "test/multi",
            None,
            "arm64",
            vec![gz(harness::busybox_entries("arm64"))],
            false,
        );
        let multi_index = up.index(
            "test/multi",
            "1",
            &[
                (&multi_arm64, "arm64", Some("v8")),
                (&multi_amd64, "amd64", None),
            ],
            false,
        );

        let dgz = |entries: Vec<Entry>| {
            harness::blob_of(harness::tar_of(&entries), Compression::Gzip, true)
        };
        let list_amd64 = up.image(
            "test/dockerlist",
            None,
            "amd64",
            vec![dgz(harness::busybox_entries("amd64"))],
            true,
        );
        let list_arm64 = up.image(
            "test/dockerlist",
            None,
            "arm64",
            vec![dgz(harness::busybox_entries("arm64"))],
            true,
        );
        up.index(
            "test/dockerlist",
            "1",
            &[(&list_arm64, "arm64", None), (&list_amd64, "amd64", None)],
            true,
        );

        // 48 MiB of noise, uncompressed: slow enough through the throttling proxy to act
        // mid-transfer.
        let big = up.image(
            "test/big",
            Some("1"),
            "amd64",
            vec![
                gz(harness::busybox_entries("amd64")),
                harness::blob_of(
                    harness::tar_of(&[Entry::File(
                        "noise".into(),
                        harness::noise(48 << 20, 7),
                        0o644,
                    )]),
                    Compression::None,
                    false,
                ),
            ],
            false,
        );

        let corrupt = up.image(
            "test/corrupt",
            Some("1"),
            "amd64",
            vec![gz(vec![
                Entry::Dir("data"),
                Entry::File("data/payload".into(), harness::noise(256 << 10, 3), 0o644),
            ])],
            false,
        );
        drop(seed);
        Fixture {
            base,
            storage,
            pki,
            images: Images {
                busybox,
                layers,
                zstd,
                multi_amd64,
                multi_arm64,
                multi_index,
                list_amd64,
                list_arm64,
                big,
                corrupt,
            },
        }
    })
}

static RUN: AtomicUsize = AtomicUsize::new(0);

/// A registry over the seed storage, its files in a fresh directory.
fn registry(mode: &Mode) -> Registry {
    let f = fixture();
    let dir = f
        .base
        .join(format!("run-{}", RUN.fetch_add(1, Ordering::Relaxed)));
    Registry::start(mode, &f.storage, &dir)
}

fn config() -> RegistryConfig {
    RegistryConfig {
        credentials: String::new(),
        enroot_credentials: false,
        connect_timeout_s: 5,
        read_timeout_s: 5,
        retries: 4,
        retry_backoff_ms: 100,
        ..RegistryConfig::default()
    }
}

fn insecure(host: &str) -> RegistryConfig {
    RegistryConfig {
        insecure: vec![host.to_string()],
        ..config()
    }
}

fn reference(text: &str) -> RegistryRef {
    match reference::parse(text).unwrap() {
        berth::image::Reference::Registry(r) => r,
        other => panic!("{text} parsed as {other:?}"),
    }
}

fn quiet() -> PullOptions {
    PullOptions {
        arch: None,
        progress: ProgressMode::Quiet,
    }
}

fn pull(cfg: &RegistryConfig, text: &str, sink: &TestSink) -> Result<Pulled, ImageError> {
    Client::new(cfg, None)
        .unwrap()
        .pull(&reference(text), &quiet(), sink)
}

fn diff_ids(p: &harness::Pushed) -> Vec<String> {
    p.layers.iter().map(|l| l.diff_id.clone()).collect()
}

fn read(dir: &Path, rel: &str) -> String {
    std::fs::read_to_string(dir.join(rel))
        .unwrap_or_else(|e| panic!("{}/{rel}: {e}", dir.display()))
}

/// What a user sees for `e` (via ImageError); it must be one line.
fn one_line(e: &ImageError) -> String {
    let text = RegistryError::Message(e.to_string()).to_string();
    assert!(!text.contains('\n'), "{text}");
    eprintln!("error seen: {text}");
    text
}

// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn anonymous_pull_of_one_layer() {
    let r = registry(&Mode::Plain);
    let sink = TestSink::new();
    let img = &fixture().images.busybox;
    let options = PullOptions {
        arch: None,
        progress: ProgressMode::Lines,
    };
    let pulled = Client::new(&insecure(&r.host()), None)
        .unwrap()
        .pull(
            &reference(&format!("{}#test/busybox:1", r.host())),
            &options,
            &sink,
        )
        .unwrap();
    assert_eq!(pulled.manifest_digest, img.manifest_digest);
    assert_eq!(pulled.config_digest, img.config_digest);
    assert!(pulled.anonymous);
    assert_eq!(pulled.index_digest, None);
    assert_eq!(pulled.layers.len(), 1);
    assert_eq!(sink.published(), diff_ids(img));
    let dir = &pulled.layers[0];
    assert_eq!(
        std::fs::read(dir.join("bin/busybox")).unwrap(),
        std::fs::read("/bin/busybox").unwrap()
    );
    assert_eq!(read(dir, "etc/berth-platform"), "amd64\n");
    let config = pulled.config.config().as_ref().unwrap();
    assert_eq!(config.cmd().as_ref().unwrap(), &vec!["/bin/sh".to_string()]);
    assert_eq!(config.working_dir().as_deref(), Some("/tmp"));

    // Pinned by digest, through docker:// syntax: same image, layers already stored.
    let pinned = format!("docker://{}/test/busybox@{}", r.host(), img.manifest_digest);
    let again = pull(&insecure(&r.host()), &pinned, &sink).unwrap();
    assert_eq!(again.layers, pulled.layers);
    assert_eq!(
        sink.stage_calls.load(Ordering::Relaxed),
        1,
        "existing layer re-staged"
    );
    assert_eq!(sink.leftovers(), 0);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn multi_layer_pull_keeps_order_whiteouts_and_opaque_dirs() {
    let r = registry(&Mode::Plain);
    let sink = TestSink::new();
    let img = &fixture().images.layers;
    let pulled = pull(
        &insecure(&r.host()),
        &format!("{}#test/layers:1", r.host()),
        &sink,
    )
    .unwrap();
    let want: Vec<PathBuf> = diff_ids(img).iter().map(|d| sink.layer_dir(d)).collect();
    assert_eq!(
        pulled.layers, want,
        "layers bottom first, each under its diff_id"
    );
    let mut published = sink.published();
    published.sort();
    let mut expected = diff_ids(img);
    expected.sort();
    assert_eq!(published, expected);
    assert_eq!(read(&pulled.layers[0], "etc/a"), "a\n");
    // The store keeps layers in overlayfs form: a whiteout is a 0/0 character device, an
    // opaque directory carries trusted.overlay.opaque=y.
    let whiteout = std::fs::symlink_metadata(pulled.layers[1].join("etc/a")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&whiteout.file_type())
            && std::os::unix::fs::MetadataExt::rdev(&whiteout) == 0,
        "whiteout of etc/a"
    );
    assert_eq!(read(&pulled.layers[1], "etc/c"), "c\n");
    let dir = std::ffi::CString::new(
        pulled.layers[2]
            .join("d")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    let mut value = [0u8; 8];
    // SAFETY: lgetxattr writes at most `value.len()` bytes into the buffer.
    let n = unsafe {
        libc::lgetxattr(
            dir.as_ptr(),
            c"trusted.overlay.opaque".as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    assert_eq!(n, 1, "opaque xattr on d/");
    assert_eq!(value[0], b'y');
    assert_eq!(read(&pulled.layers[2], "d/z"), "z\n");
    assert_eq!(
        pulled.config.rootfs().diff_ids(),
        &diff_ids(img),
        "config handed back"
    );
}

fn home_with(file: &str, text: &str) -> tempfile::TempDir {
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join(file);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, text).unwrap();
    home
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn basic_auth_from_credentials_files() {
    let r2 = registry(&Mode::Basic {
        user: USER.into(),
        password: PASSWORD.into(),
    });
    let image = format!("{}#test/busybox:1", r2.host());
    let cfg2 = RegistryConfig {
        credentials: "~/.config/berth/credentials".into(),
        ..insecure(&r2.host())
    };

    // No credentials at all: says which line to add where.
    let empty = tempfile::tempdir().unwrap();
    let err = Client::new(&cfg2, Some(empty.path()))
        .unwrap()
        .pull(&reference(&image), &quiet(), &TestSink::new())
        .unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(
            err,
            ImageError::Registry(RegistryError::CredentialsRequired { .. })
        ),
        "{text}"
    );
    assert!(text.contains(&format!("machine {}", r2.host())), "{text}");
    assert!(text.contains(".config/berth/credentials"), "{text}");

    // Right password in berth's file (an entry for another user first: USER@ picks).
    let home = home_with(
        ".config/berth/credentials",
        &format!(
            "machine {h} login bob password wrong\nmachine {h}\n  login {USER}\n  password {PASSWORD}\n",
            h = r2.host()
        ),
    );
    let sink = TestSink::new();
    let pulled = Client::new(&cfg2, Some(home.path()))
        .unwrap()
        .pull(
            &reference(&format!("{USER}@{}#test/busybox:1", r2.host())),
            &quiet(),
            &sink,
        )
        .unwrap();
    assert!(!pulled.anonymous, "a login was used: not anonymous");
    assert_eq!(sink.published().len(), 1);

    // Without USER@ the first entry (bob, wrong password) is used: refused, naming the file.
    let err = Client::new(&cfg2, Some(home.path()))
        .unwrap()
        .pull(
            &reference(&format!("{}#test/busybox:1", r2.host())),
            &quiet(),
            &TestSink::new(),
        )
        .unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(
            err,
            ImageError::Registry(RegistryError::LoginRejected { .. })
        ),
        "{text}"
    );
    assert!(text.contains("'bob'"), "{text}");
    assert!(text.contains(&r2.host()), "{text}");
    assert!(
        text.contains(
            &home
                .path()
                .join(".config/berth/credentials")
                .display()
                .to_string()
        ),
        "{text}"
    );
    assert!(text.contains("check the credentials"), "{text}");

    // A USER@ with no entry is an error, not an anonymous pull.
    let err = Client::new(&cfg2, Some(home.path()))
        .unwrap()
        .pull(
            &reference(&format!("carol@{}#test/busybox:1", r2.host())),
            &quiet(),
            &TestSink::new(),
        )
        .unwrap_err();
    assert!(
        matches!(err, ImageError::Registry(RegistryError::NoSuchLogin { .. })),
        "{err}"
    );

    // Enroot's credentials file ($ENROOT_CONFIG_PATH/.credentials), wrong password there.
    let enroot = home_with(
        ".credentials",
        &format!("machine {} login {USER} password nope\n", r2.host()),
    );
    let cfg3 = RegistryConfig {
        enroot_credentials: true,
        ..insecure(&r2.host())
    };
    let err = Client::with_enroot_config(&cfg3, Some(enroot.path()), Some(enroot.path()))
        .unwrap()
        .pull(
            &reference(&format!("{}#test/busybox:1", r2.host())),
            &quiet(),
            &TestSink::new(),
        )
        .unwrap_err();
    let text = one_line(&err);
    assert!(
        text.contains(&enroot.path().join(".credentials").display().to_string()),
        "{text}"
    );
    let good = home_with(
        ".credentials",
        &format!("machine {} login {USER} password {PASSWORD}\n", r2.host()),
    );
    Client::with_enroot_config(&cfg3, Some(good.path()), Some(good.path()))
        .unwrap()
        .pull(
            &reference(&format!("{}#test/busybox:1", r2.host())),
            &quiet(),
            &TestSink::new(),
        )
        .unwrap();

    // check_access: a HEAD with the user's login.
    let client = |h: &Path| Client::with_enroot_config(&cfg3, Some(h), Some(h)).unwrap();
    let r_ref = reference(&format!("{}#test/busybox:1", r2.host()));
    assert!(client(good.path()).check_access(&r_ref).unwrap());
    assert!(!client(enroot.path()).check_access(&r_ref).unwrap());
    assert!(!client(empty.path()).check_access(&r_ref).unwrap());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn bearer_token_auth_with_a_token_server() {
    let f = fixture();
    let tokens = TokenServer::start(
        ISSUER,
        SERVICE,
        &f.pki.token_cert,
        &f.pki.token_key,
        Some((USER, "tok3n")),
    );
    let r = registry(&Mode::Token {
        realm: tokens.realm(),
        service: SERVICE.into(),
        issuer: ISSUER.into(),
        rootcertbundle: f.pki.token_cert.clone(),
    });
    let image = format!("{}#test/layers:1", r.host());

    // Anonymous: the token server refuses; the error says to add a login.
    let err = pull(&insecure(&r.host()), &image, &TestSink::new()).unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::Registry(RegistryError::CredentialsRequired { .. })
        ),
        "{err}"
    );

    // Enroot-style entry for the token server's host (as `machine auth.docker.io`).
    let home = home_with(
        ".config/berth/credentials",
        &format!(
            "machine 127.0.0.1:{} login {USER} password tok3n\n",
            tokens.port
        ),
    );
    let cfg = RegistryConfig {
        credentials: "~/.config/berth/credentials".into(),
        ..insecure(&r.host())
    };
    tokens.requests.lock().unwrap().clear();
    let sink = TestSink::new();
    let pulled = Client::new(&cfg, Some(home.path()))
        .unwrap()
        .pull(&reference(&image), &quiet(), &sink)
        .unwrap();
    assert_eq!(pulled.layers.len(), 3);
    assert!(!pulled.anonymous);
    let requests = tokens.requests.lock().unwrap().clone();
    assert_eq!(
        requests.len(),
        1,
        "one token for the whole pull (cached): {requests:?}"
    );
    assert_eq!(requests[0].service.as_deref(), Some(SERVICE));
    assert_eq!(
        requests[0].scope.as_deref(),
        Some("repository:test/layers:pull")
    );
    assert!(
        requests[0]
            .authorization
            .as_deref()
            .unwrap_or_default()
            .starts_with("Basic ")
    );

    // A wrong password for the token server: refused, naming the file.
    let bad = home_with(
        ".config/berth/credentials",
        &format!(
            "machine 127.0.0.1:{} login {USER} password nope\n",
            tokens.port
        ),
    );
    let err = Client::new(&cfg, Some(bad.path()))
        .unwrap()
        .pull(&reference(&image), &quiet(), &TestSink::new())
        .unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::Registry(RegistryError::LoginRejected { .. })
        ),
        "{err}"
    );

    // An anonymous token server (no login required): the pull counts as anonymous.
    let open = TokenServer::start(ISSUER, SERVICE, &f.pki.token_cert, &f.pki.token_key, None);
    let r2 = registry(&Mode::Token {
        realm: open.realm(),
        service: SERVICE.into(),
        issuer: ISSUER.into(),
        rootcertbundle: f.pki.token_cert.clone(),
    });
    let pulled = pull(
        &insecure(&r2.host()),
        &format!("{}#test/busybox:1", r2.host()),
        &TestSink::new(),
    )
    .unwrap();
    assert!(pulled.anonymous);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn tls_needs_the_ca_and_plain_http_must_be_listed() {
    let f = fixture();
    let r = registry(&Mode::Tls {
        cert: f.pki.leaf_cert.clone(),
        key: f.pki.leaf_key.clone(),
    });
    let image = format!("{}#test/busybox:1", r.host());
    let err = pull(&config(), &image, &TestSink::new()).unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(err, ImageError::Registry(RegistryError::Tls { .. })),
        "{text}"
    );
    assert!(text.contains("registry.ca_files"), "{text}");

    let with_ca = RegistryConfig {
        ca_files: vec![f.pki.ca_cert.clone()],
        ..config()
    };
    let pulled = pull(&with_ca, &image, &TestSink::new()).unwrap();
    assert_eq!(pulled.manifest_digest, f.images.busybox.manifest_digest);
    // `localhost` is in the leaf's SAN too.
    pull(
        &with_ca,
        &format!("localhost:{}#test/busybox:1", r.port),
        &TestSink::new(),
    )
    .unwrap();

    // A CA file that is not PEM is a configuration error.
    let junk = f.base.join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let err = Client::new(
        &RegistryConfig {
            ca_files: vec![junk],
            ..config()
        },
        None,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("no PEM certificate"), "{err}");

    // Plain HTTP: refused (TLS fails) unless the registry is listed as insecure.
    let plain = registry(&Mode::Plain);
    let image = format!("{}#test/busybox:1", plain.host());
    let err = pull(&config(), &image, &TestSink::new()).unwrap_err();
    let text = one_line(&err);
    assert!(text.contains("registry.insecure"), "{text}");
    pull(&insecure(&plain.host()), &image, &TestSink::new()).unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn unknown_tag_and_repository_are_one_line() {
    let r = registry(&Mode::Plain);
    let err = pull(
        &insecure(&r.host()),
        &format!("{}#test/busybox:nope", r.host()),
        &TestSink::new(),
    )
    .unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(err, ImageError::Registry(RegistryError::NotFound { .. })),
        "{text}"
    );
    assert!(text.contains("test/busybox:nope"), "{text}");
    assert!(text.contains("check the tag"), "{text}");
    let err = pull(
        &insecure(&r.host()),
        &format!("{}#test/absent:1", r.host()),
        &TestSink::new(),
    )
    .unwrap_err();
    let text = one_line(&err);
    assert!(text.contains("test/absent"), "{text}");
    assert!(text.contains("check the image name"), "{text}");
    // An unreachable registry: bounded retries, then one line.
    let closed = harness::free_port();
    let start = Instant::now();
    let err = pull(
        &insecure(&format!("127.0.0.1:{closed}")),
        &format!("127.0.0.1:{closed}#a/b:1"),
        &TestSink::new(),
    )
    .unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(
            err,
            ImageError::Registry(RegistryError::Unreachable { attempts: 4, .. })
        ),
        "{text}"
    );
    // Backoff 100 + 200 + 400 ms between the four attempts.
    assert!(
        start.elapsed() >= Duration::from_millis(700),
        "{:?}",
        start.elapsed()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn corrupt_blob_is_a_digest_mismatch_and_nothing_is_published() {
    let f = fixture();
    let storage = f.base.join("corrupt-storage");
    let _ = std::fs::remove_dir_all(&storage);
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&f.storage)
        .arg(&storage)
        .status()
        .unwrap();
    assert!(status.success());
    let layer = &f.images.corrupt.layers[0];
    let data = harness::blob_data_path(&storage, &layer.digest);
    let mut bytes = std::fs::read(&data).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&data, bytes).unwrap();
    let r = Registry::start(&Mode::Plain, &storage, &f.base.join("corrupt-run"));
    let sink = TestSink::new();
    let err = pull(
        &insecure(&r.host()),
        &format!("{}#test/corrupt:1", r.host()),
        &sink,
    )
    .unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(
            err,
            ImageError::Registry(RegistryError::DigestMismatch { what: "layer", .. })
        ),
        "{text}"
    );
    assert!(text.contains(&layer.digest), "{text}");
    assert!(text.contains("nothing was stored"), "{text}");
    assert!(sink.published().is_empty());
    assert_eq!(sink.stored(), 0);
    assert_eq!(sink.leftovers(), 0, "staging directory removed");
}

/// Starts a pull of test/big through a throttling proxy in a thread; returns once the proxy
/// has forwarded `after` bytes of it.
fn pull_through_proxy(
    proxy: &Proxy,
    sink: Arc<TestSink>,
    after: u64,
) -> std::thread::JoinHandle<Result<Pulled, ImageError>> {
    let host = proxy.host();
    let handle = std::thread::spawn(move || {
        let cfg = RegistryConfig {
            retries: 5,
            retry_backoff_ms: 250,
            ..insecure(&host)
        };
        pull(&cfg, &format!("{host}#test/big:1"), &sink)
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.downstream.load(Ordering::Relaxed) < after {
        assert!(Instant::now() < deadline, "pull made no progress");
        assert!(!handle.is_finished(), "pull finished before the cut");
        std::thread::sleep(Duration::from_millis(10));
    }
    handle
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn registry_killed_mid_pull_retries_then_fails_clearly() {
    let mut r = registry(&Mode::Plain);
    let proxy = Proxy::start(r.port, 12 << 20);
    let sink = Arc::new(TestSink::new());
    let handle = pull_through_proxy(&proxy, sink.clone(), 8 << 20);
    let killed_at = Instant::now();
    r.kill();
    let err = handle.join().unwrap().unwrap_err();
    let text = one_line(&err);
    assert!(
        matches!(err, ImageError::Registry(RegistryError::Unreachable { .. })),
        "{text}"
    );
    assert!(text.contains("unreachable after"), "{text}");
    // Backoff 250 + 500 + 1000 + 2000 ms before giving up.
    assert!(
        killed_at.elapsed() >= Duration::from_millis(3000),
        "{:?}",
        killed_at.elapsed()
    );
    let big = &fixture().images.big.layers[1];
    assert!(
        !sink.published().contains(&big.diff_id),
        "interrupted layer published"
    );
    assert_eq!(sink.leftovers(), 0);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn registry_restarted_mid_pull_resumes_with_range() {
    let mut r = registry(&Mode::Plain);
    let proxy = Proxy::start(r.port, 12 << 20);
    let sink = Arc::new(TestSink::new());
    let handle = pull_through_proxy(&proxy, sink.clone(), 8 << 20);
    r.kill();
    std::thread::sleep(Duration::from_millis(600));
    r.restart();
    let pulled = handle.join().unwrap().unwrap();
    let img = &fixture().images.big;
    assert_eq!(pulled.layers.len(), 2);
    assert_eq!(sink.published().len(), 2);
    let noise = std::fs::read(pulled.layers[1].join("noise")).unwrap();
    assert_eq!(noise.len(), 48 << 20);
    assert!(
        noise == harness::noise(48 << 20, 7),
        "resumed layer content differs"
    );
    let requests = proxy.requests.lock().unwrap().join("");
    let resumed = requests
        .lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("range: bytes="))
        .map(|l| l[13..].trim_end_matches('-').parse::<u64>().unwrap())
        .collect::<Vec<_>>();
    assert!(
        resumed.iter().any(|&from| from > 0),
        "no Range request after the restart: {resumed:?}"
    );
    assert_eq!(pulled.manifest_digest, img.manifest_digest);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn zstd_and_uncompressed_layers() {
    let r = registry(&Mode::Plain);
    let sink = TestSink::new();
    let img = &fixture().images.zstd;
    assert!(img.layers[0].media_type.ends_with("+zstd"));
    let pulled = pull(
        &insecure(&r.host()),
        &format!("{}#test/zstd:1", r.host()),
        &sink,
    )
    .unwrap();
    assert_eq!(
        pulled.layers,
        diff_ids(img)
            .iter()
            .map(|d| sink.layer_dir(d))
            .collect::<Vec<_>>()
    );
    assert_eq!(read(&pulled.layers[0], "etc/berth-platform"), "amd64\n");
    assert_eq!(read(&pulled.layers[1], "opt/plain"), "uncompressed layer\n");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn oci_index_picks_the_platform() {
    let r = registry(&Mode::Plain);
    let f = fixture();
    let image = format!("{}#test/multi:1", r.host());
    let sink = TestSink::new();
    let host = pull(&insecure(&r.host()), &image, &sink).unwrap();
    assert_eq!(host.manifest_digest, f.images.multi_amd64.manifest_digest);
    assert_eq!(
        host.index_digest.as_deref(),
        Some(f.images.multi_index.as_str())
    );
    assert_eq!(read(&host.layers[0], "etc/berth-platform"), "amd64\n");

    let arm = Client::new(&insecure(&r.host()), None)
        .unwrap()
        .pull(
            &reference(&image),
            &PullOptions {
                arch: Some("arm64".into()),
                progress: ProgressMode::Quiet,
            },
            &sink,
        )
        .unwrap();
    assert_eq!(arm.manifest_digest, f.images.multi_arm64.manifest_digest);
    assert_eq!(read(&arm.layers[0], "etc/berth-platform"), "arm64\n");

    let err = Client::new(&insecure(&r.host()), None)
        .unwrap()
        .pull(
            &reference(&image),
            &PullOptions {
                arch: Some("s390x".into()),
                progress: ProgressMode::Quiet,
            },
            &sink,
        )
        .unwrap_err();
    let text = one_line(&err);
    assert!(text.contains("linux/s390x"), "{text}");
    assert!(text.contains("linux/arm64/v8, linux/amd64"), "{text}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn docker_manifest_list_and_v2_manifests() {
    let r = registry(&Mode::Plain);
    let f = fixture();
    let sink = TestSink::new();
    let image = format!("docker://{}/test/dockerlist:1", r.host());
    let pulled = pull(&insecure(&r.host()), &image, &sink).unwrap();
    assert_eq!(pulled.manifest_digest, f.images.list_amd64.manifest_digest);
    assert!(
        f.images.list_amd64.layers[0]
            .media_type
            .starts_with("application/vnd.docker")
    );
    assert_eq!(read(&pulled.layers[0], "etc/berth-platform"), "amd64\n");
    let arm = Client::new(&insecure(&r.host()), None)
        .unwrap()
        .pull(
            &reference(&image),
            &PullOptions {
                arch: Some("aarch64".into()),
                progress: ProgressMode::Quiet,
            },
            &sink,
        )
        .unwrap();
    assert_eq!(arm.manifest_digest, f.images.list_arm64.manifest_digest);
    assert_eq!(read(&arm.layers[0], "etc/berth-platform"), "arm64\n");
}
