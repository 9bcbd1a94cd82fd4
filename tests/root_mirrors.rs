//! Root tier: `registry.mirrors` and the docker/podman login files, through the real binary and
//! Debian's docker-registry on 127.0.0.1 (the harness of tests/root_registry.rs).
//!
//! Mirrors: two loopback registries, each behind the harness's recording proxy, whose request
//! log is the access log that proves where manifests and blobs came from — a mirror with the
//! image (under a path prefix) for an "origin" without it; a mirror that is down with the origin
//! as fallback; the same with `fallback = false` (one line naming the mirror); a mirror serving a
//! tampered blob (refused by digest, then taken from the origin).
//!
//! Logins: the token-auth registry (Bearer tokens from the harness's token server, which only
//! answers the right Basic login), pulled for a job's user by `berth prolog` (berth as root,
//! acting for that user): `~/.docker/config.json` and `~/.config/containers/auth.json` each let
//! the user pull, a wrong password fails in one line naming the file, another user's file
//! (through a symlink) is not used; and `$REGISTRY_AUTH_FILE` for the user running berth.
//!
//! Run alone: `cargo test --test root_mirrors -- --ignored --test-threads=1`.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use base64::Engine as _;
use common::*;
use harness::{Compression, Entry, Mode, Pki, Proxy, Registry, TokenServer, Uploader};

/// The layers of the test image: busybox and a layer with one file.
fn layers() -> Vec<harness::Blob> {
    let gz = |e: Vec<Entry>| harness::blob_of(harness::tar_of(&e), Compression::Gzip, false);
    vec![
        gz(harness::busybox_entries("amd64")),
        gz(vec![
            Entry::Dir("app"),
            Entry::File(
                "app/hello".into(),
                b"hello from a mirror test\n".to_vec(),
                0o644,
            ),
        ]),
    ]
}

/// A plain registry behind a recording proxy (never throttled in practice).
struct Logged {
    registry: Registry,
    proxy: Proxy,
}

impl Logged {
    fn start(dir: &Path, name: &str) -> Self {
        let registry = Registry::start(
            &Mode::Plain,
            &dir.join(format!("{name}-storage")),
            &dir.join(name),
        );
        let proxy = Proxy::start(registry.port, 1 << 40);
        Self { registry, proxy }
    }

    /// `127.0.0.1:PORT` of the proxy: the name berth is given.
    fn host(&self) -> String {
        self.proxy.host()
    }

    /// The request lines (`GET /v2/… HTTP/1.1`) berth sent through the proxy.
    fn requests(&self) -> Vec<String> {
        self.proxy
            .requests
            .lock()
            .unwrap()
            .iter()
            .flat_map(|r| r.lines().map(str::to_string).collect::<Vec<_>>())
            .filter(|l| l.starts_with("GET ") || l.starts_with("HEAD "))
            .collect()
    }

    fn blob_gets(&self, digest: &str) -> usize {
        self.requests()
            .iter()
            .filter(|l| l.starts_with("GET ") && l.contains(&format!("/blobs/{digest}")))
            .count()
    }
}

fn write_config(dir: &Path, registry: &str) -> PathBuf {
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[store]\nroot = \"{}\"\n\
             [squashfs]\nmount_dir = \"{}\"\n[scratch]\nroot = \"{}\"\n{registry}",
            cgroup_root(),
            dir.join("state").display(),
            dir.join("store").display(),
            dir.join("mnt").display(),
            dir.join("scratch").display(),
        ),
    )
    .unwrap();
    config
}

fn berth_with(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(berth_bin())
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("REGISTRY_AUTH_FILE")
        .env_remove("DOCKER_CONFIG")
        .env_remove("XDG_RUNTIME_DIR")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// stderr lines that are not empty.
fn lines(o: &Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// The mirrors part of a config: `[registry]` with every proxy plain-HTTP, few quick retries.
fn registry_section(insecure: &[&str], origin: &str, mirrors: &[&str], fallback: bool) -> String {
    let quote = |v: &[&str]| {
        v.iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "[registry]\ninsecure = [{}]\ncredentials = \"\"\nenroot_credentials = false\n\
         auth_files = false\nretries = 2\nretry_backoff_ms = 50\nconnect_timeout_s = 5\n\
         [registry.mirrors.\"{origin}\"]\nmirrors = [{}]\nfallback = {fallback}\n",
        quote(insecure),
        quote(mirrors)
    )
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_the_origin_lacks_is_pulled_from_the_mirror_under_its_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let origin = Logged::start(dir.path(), "origin");
    let mirror = Logged::start(dir.path(), "mirror");
    // The mirror serves the origin's test/app as cache/test/app (a path prefix, as
    // `mirror.example/dockerhub` serves library/ubuntu as dockerhub/library/ubuntu).
    let pushed = Uploader::new(&mirror.registry.host(), None).image(
        "cache/test/app",
        Some("1"),
        "amd64",
        layers(),
        false,
    );
    let mirror_ref = format!("{}/cache", mirror.host());
    let config = write_config(
        dir.path(),
        &registry_section(
            &[&origin.host(), &mirror.host()],
            &origin.host(),
            &[&mirror_ref],
            true,
        ),
    );
    let image = format!("{}#test/app:1", origin.host());
    let o = berth_with(&config, &["import", &image], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&pushed.manifest_digest),
        "{}",
        stdout(&o)
    );
    // Every blob came from the mirror, under its prefix; the origin served none.
    for l in &pushed.layers {
        assert_eq!(mirror.blob_gets(&l.digest), 1, "{:?}", mirror.requests());
        assert_eq!(origin.blob_gets(&l.digest), 0, "{:?}", origin.requests());
    }
    assert!(
        mirror.requests().iter().all(|r| !r.contains(" /v2/test/")),
        "the mirror was asked without its prefix: {:?}",
        mirror.requests()
    );
    assert!(
        origin.requests().is_empty(),
        "the origin was asked although the mirror had the image: {:?}",
        origin.requests()
    );
    // The stored image runs: its file is there.
    let o = berth_with(
        &config,
        &[
            "run",
            "--image",
            &image,
            "--",
            "busybox",
            "cat",
            "/app/hello",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "hello from a mirror test\n");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_mirror_that_is_down_falls_back_to_the_origin_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let origin = Logged::start(dir.path(), "origin");
    let pushed = Uploader::new(&origin.registry.host(), None).image(
        "test/app",
        Some("1"),
        "amd64",
        layers(),
        false,
    );
    let down = format!("127.0.0.1:{}", harness::free_port());
    let config = write_config(
        dir.path(),
        &registry_section(&[&origin.host(), &down], &origin.host(), &[&down], true),
    );
    let image = format!("{}#test/app:1", origin.host());
    let o = berth_with(&config, &["import", &image], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for l in &pushed.layers {
        assert_eq!(origin.blob_gets(&l.digest), 1, "{:?}", origin.requests());
    }
    // One warning line names the mirror that failed and why.
    let warned: Vec<String> = lines(&o)
        .into_iter()
        .filter(|l| l.contains(&format!("registry mirror {down}")))
        .collect();
    assert_eq!(warned.len(), 1, "{}", stderr(&o));
    eprintln!("warning: {}", warned[0]);
    assert!(
        warned[0].contains("unreachable") && warned[0].contains("itself"),
        "{}",
        warned[0]
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn without_fallback_a_mirror_that_is_down_fails_in_one_line_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let origin = Logged::start(dir.path(), "origin");
    Uploader::new(&origin.registry.host(), None).image(
        "test/app",
        Some("1"),
        "amd64",
        layers(),
        false,
    );
    let down = format!("127.0.0.1:{}", harness::free_port());
    let config = write_config(
        dir.path(),
        &registry_section(&[&origin.host(), &down], &origin.host(), &[&down], false),
    );
    let image = format!("{}#test/app:1", origin.host());
    let o = berth_with(&config, &["import", &image], &[]);
    assert!(
        !o.status.success(),
        "pulled although the only mirror is down"
    );
    let err = lines(&o);
    assert_eq!(err.len(), 1, "{}", stderr(&o));
    eprintln!("error: {}", err[0]);
    assert!(
        err[0].contains(&format!("registry mirror {down}")) && err[0].contains("fallback = false"),
        "{}",
        err[0]
    );
    assert!(
        origin.requests().is_empty(),
        "the origin was asked: {:?}",
        origin.requests()
    );
    let ls = berth_with(&config, &["images", "ls"], &[]);
    assert!(!stdout(&ls).contains("test/app"), "{}", stdout(&ls));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_mirror_serving_a_tampered_blob_is_refused_by_digest() {
    let dir = tempfile::tempdir().unwrap();
    let origin = Logged::start(dir.path(), "origin");
    let mirror = Logged::start(dir.path(), "mirror");
    let blobs = layers();
    let good = Uploader::new(&origin.registry.host(), None).image(
        "test/app",
        Some("1"),
        "amd64",
        blobs.clone(),
        false,
    );
    let copy = Uploader::new(&mirror.registry.host(), None).image(
        "test/app",
        Some("1"),
        "amd64",
        blobs,
        false,
    );
    assert_eq!(good.manifest_digest, copy.manifest_digest);
    // The mirror's copy of the file layer: same size, other bytes.
    let tampered = &copy.layers[1].digest;
    let data = harness::blob_data_path(&mirror.registry.storage, tampered);
    let mut bytes = std::fs::read(&data).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&data, bytes).unwrap();

    // fallback = false: refused, one line naming the mirror and the digest; nothing stored.
    let strict_dir = dir.path().join("strict");
    std::fs::create_dir_all(&strict_dir).unwrap();
    let strict = write_config(
        &strict_dir,
        &registry_section(
            &[&origin.host(), &mirror.host()],
            &origin.host(),
            &[&mirror.host()],
            false,
        ),
    );
    let image = format!("{}#test/app:1", origin.host());
    let o = berth_with(&strict, &["import", &image], &[]);
    assert!(!o.status.success(), "a tampered blob was accepted");
    let err = lines(&o);
    assert_eq!(err.len(), 1, "{}", stderr(&o));
    eprintln!("error: {}", err[0]);
    assert!(
        err[0].contains(tampered.as_str())
            && err[0].contains("corrupt")
            && err[0].contains(&format!("registry mirror {}", mirror.host())),
        "{}",
        err[0]
    );
    assert_eq!(origin.blob_gets(tampered), 0);
    let ls = berth_with(&strict, &["images", "ls"], &[]);
    assert!(!stdout(&ls).contains("test/app"), "{}", stdout(&ls));

    // fallback = true: the mirror is named in one warning line, the blob comes from the origin.
    let config = write_config(
        dir.path(),
        &registry_section(
            &[&origin.host(), &mirror.host()],
            &origin.host(),
            &[&mirror.host()],
            true,
        ),
    );
    let o = berth_with(&config, &["import", &image], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let warned: Vec<String> = lines(&o)
        .into_iter()
        .filter(|l| l.contains(&format!("registry mirror {}", mirror.host())))
        .collect();
    assert_eq!(warned.len(), 1, "{}", stderr(&o));
    eprintln!("warning: {}", warned[0]);
    assert!(warned[0].contains(tampered.as_str()), "{}", warned[0]);
    assert_eq!(origin.blob_gets(tampered), 1, "{:?}", origin.requests());
    assert_eq!(mirror.blob_gets(tampered), 2, "{:?}", mirror.requests());
    let o = berth_with(
        &config,
        &[
            "run",
            "--image",
            &image,
            "--",
            "busybox",
            "cat",
            "/app/hello",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "hello from a mirror test\n");
}

// ---------------------------------------------------------------------------------------------
// docker config.json and podman auth.json logins, against the token-auth registry.

const LOGIN: &str = "alice";
const PASSWORD: &str = "s3cret-pw";

/// The token-auth registry with `team/private:1`; the token server answers only alice's login.
struct TokenRegistry {
    _dir: tempfile::TempDir,
    _plain: Registry,
    registry: Registry,
    tokens: TokenServer,
}

fn token_registry() -> TokenRegistry {
    static PKI: OnceLock<(tempfile::TempDir, Pki)> = OnceLock::new();
    let (_, pki) = PKI.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let pki = Pki::create(&d.path().join("pki"));
        (d, pki)
    });
    let dir = tempfile::tempdir().unwrap();
    let storage = dir.path().join("storage");
    let plain = Registry::start(&Mode::Plain, &storage, &dir.path().join("plain"));
    Uploader::new(&plain.host(), None).image("team/private", Some("1"), "amd64", layers(), false);
    let (service, issuer) = ("berth-h5-registry", "berth-h5-issuer");
    let tokens = TokenServer::start(
        issuer,
        service,
        &pki.token_cert,
        &pki.token_key,
        Some((LOGIN, PASSWORD)),
    );
    let registry = Registry::start(
        &Mode::Token {
            realm: tokens.realm(),
            service: service.into(),
            issuer: issuer.into(),
            rootcertbundle: pki.token_cert.clone(),
        },
        &storage,
        &dir.path().join("token"),
    );
    TokenRegistry {
        _dir: dir,
        _plain: plain,
        registry,
        tokens,
    }
}

/// A host user of these tests with a home of its own (`/home/NAME`, emptied): (uid, gid, home).
fn user(name: &str) -> (u32, u32, PathBuf) {
    let home = PathBuf::from("/home").join(name);
    let exists = Command::new("id")
        .arg(name)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !exists {
        let st = Command::new("useradd")
            .args(["-M", "-s", "/bin/sh", "-d"])
            .arg(&home)
            .arg(name)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "useradd {name}");
    }
    let id = |flag: &str| -> u32 {
        let o = Command::new("id").arg(flag).arg(name).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
    };
    let (uid, gid) = (id("-u"), id("-g"));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(&home, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    (uid, gid, home)
}

/// Removes a test user's home (with the test logins in it) when dropped.
struct HomeGone(PathBuf);

impl Drop for HomeGone {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `text` to `home/rel` as the user's own file (mode 0600, directories 0700).
fn user_file(home: &Path, uid: u32, gid: u32, rel: &str, text: &str) -> PathBuf {
    let path = home.join(rel);
    let mut dir = home.to_path_buf();
    for part in Path::new(rel).parent().unwrap().components() {
        dir.push(part);
        let _ = std::fs::create_dir(&dir);
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    }
    std::fs::write(&path, text).unwrap();
    std::os::unix::fs::chown(&path, Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path
}

fn docker_config(host: &str, user: &str, password: &str) -> String {
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("{{\"auths\": {{\"{host}\": {{\"auth\": \"{auth}\"}}}}, \"credsStore\": \"desktop\"}}")
}

/// `berth prolog` for a job of `uid:gid` that asks for `image` (berth as root, acting for them).
fn prolog(config: &Path, job: &str, uid: u32, gid: u32, image: &str) -> Output {
    Command::new(berth_bin())
        .arg("--config")
        .arg(config)
        .arg("prolog")
        .env("SLURM_JOB_ID", job)
        .env("SLURM_JOB_UID", uid.to_string())
        .env("SLURM_JOB_GID", gid.to_string())
        .env("SPANK_BERTH_IMAGE", image)
        .env_remove("REGISTRY_AUTH_FILE")
        .env_remove("DOCKER_CONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stored(config: &Path) -> String {
    stdout(&berth_with(config, &["images", "ls"], &[]))
}

/// Basic logins the token server was sent.
fn token_logins(t: &TokenRegistry) -> Vec<String> {
    t.tokens
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter_map(|r| r.authorization.clone())
        .collect()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn docker_and_podman_login_files_let_the_jobs_user_pull() {
    let t = token_registry();
    let host = t.registry.host();
    let image = format!("{host}#team/private:1");
    for (n, rel) in [".docker/config.json", ".config/containers/auth.json"]
        .into_iter()
        .enumerate()
    {
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(
            dir.path(),
            &format!("[registry]\ninsecure = [\"{host}\"]\nretries = 2\nretry_backoff_ms = 50\n"),
        );
        let (uid, gid, home) = user("berthh5a");
        let _gone = HomeGone(home.clone());
        // Without a login the registry refuses: the file is what lets the user in.
        let o = prolog(&config, &format!("{}", 501 + 10 * n), uid, gid, &image);
        assert!(
            stderr(&o).contains("requires a login"),
            "{rel}: {}",
            stderr(&o)
        );
        let file = user_file(&home, uid, gid, rel, &docker_config(&host, LOGIN, PASSWORD));
        let o = prolog(&config, &format!("{}", 502 + 10 * n), uid, gid, &image);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stored(&config).contains("team/private"),
            "{rel} did not let the user pull: {}",
            stderr(&o)
        );
        // credsStore is said to be ignored, in one line naming the file.
        let helper: Vec<String> = lines(&o)
            .into_iter()
            .filter(|l| l.contains("credsStore"))
            .collect();
        assert_eq!(helper.len(), 1, "{}", stderr(&o));
        eprintln!("warning: {}", helper[0]);
        assert!(
            helper[0].contains(&file.display().to_string()),
            "{}",
            helper[0]
        );
        // A wrong password: one line naming the login and the file.
        let dir2 = tempfile::tempdir().unwrap();
        let config2 = write_config(
            dir2.path(),
            &format!("[registry]\ninsecure = [\"{host}\"]\nretries = 2\nretry_backoff_ms = 50\n"),
        );
        user_file(&home, uid, gid, rel, &docker_config(&host, LOGIN, "wrong"));
        let o = prolog(&config2, &format!("{}", 503 + 10 * n), uid, gid, &image);
        let rejected: Vec<String> = lines(&o)
            .into_iter()
            .filter(|l| l.contains("team/private"))
            .collect();
        assert_eq!(rejected.len(), 1, "{}", stderr(&o));
        eprintln!("error: {}", rejected[0]);
        assert!(
            rejected[0].contains(&format!("rejected the login '{LOGIN}'"))
                && rejected[0].contains(&file.display().to_string()),
            "{}",
            rejected[0]
        );
        assert!(!stored(&config2).contains("team/private"));
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_login_file_is_not_used() {
    let t = token_registry();
    let host = t.registry.host();
    let image = format!("{host}#team/private:1");
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!("[registry]\ninsecure = [\"{host}\"]\nretries = 2\nretry_backoff_ms = 50\n"),
    );
    let (a_uid, a_gid, a_home) = user("berthh5a");
    let (b_uid, b_gid, b_home) = user("berthh5b");
    let _gone = (HomeGone(a_home.clone()), HomeGone(b_home.clone()));
    let a_file = user_file(
        &a_home,
        a_uid,
        a_gid,
        ".docker/config.json",
        &docker_config(&host, LOGIN, PASSWORD),
    );
    // b points its files at a's (a's home is 0700: b cannot read it, root could).
    for rel in [".docker", ".config/containers"] {
        let link = b_home.join(rel).join(if rel == ".docker" {
            "config.json"
        } else {
            "auth.json"
        });
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&a_file, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(b_uid), Some(b_gid)).unwrap();
    }
    let before = token_logins(&t).len();
    let o = prolog(&config, "601", b_uid, b_gid, &image);
    assert!(
        !stored(&config).contains("team/private"),
        "b pulled with a's login: {}",
        stderr(&o)
    );
    let err: Vec<String> = lines(&o)
        .into_iter()
        .filter(|l| l.contains("team/private"))
        .collect();
    assert_eq!(err.len(), 1, "{}", stderr(&o));
    eprintln!("error: {}", err[0]);
    assert_eq!(
        token_logins(&t).len(),
        before,
        "a's login was sent for b: {}",
        err[0]
    );
    // a itself pulls with the same file.
    let o = prolog(&config, "602", a_uid, a_gid, &image);
    assert!(stored(&config).contains("team/private"), "{}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn registry_auth_file_is_read_for_the_user_running_berth() {
    let t = token_registry();
    let host = t.registry.host();
    let image = format!("{host}#team/private:1");
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!("[registry]\ninsecure = [\"{host}\"]\nretries = 2\nretry_backoff_ms = 50\n"),
    );
    let auth = dir.path().join("auth.json");
    std::fs::write(
        &auth,
        docker_config(&host, LOGIN, PASSWORD).replace(", \"credsStore\": \"desktop\"", ""),
    )
    .unwrap();
    let o = berth_with(
        &config,
        &["import", &image],
        &[("REGISTRY_AUTH_FILE", auth.to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stored(&config).contains("team/private"));
}
