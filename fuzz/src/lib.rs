//! Fuzz targets for every parser of input from outside berth: image references, registry
//! manifests and image configs, the layer tar extractor, SIF and squashfs headers, credential
//! files and auth challenges, Pyxis mounts, stage specs, CDI specs, the SPANK plugin's options,
//! plugstack arguments and berth's answer, the step request, berth.toml and the command line.
//!
//! Each target is a plain `fn(&[u8])` that must return (never panic, hang or allocate without
//! bound) whatever the bytes. `src/main.rs` runs one under AFL++ (`cargo afl`); the crate's
//! tests replay every file of `corpus/<target>/` through it on stable Rust with plain
//! `cargo test`. The parsers' results are consumed (formatted, walked) so that the code the
//! callers run next on a parsed value is exercised too.

use std::path::Path;

use berth::image::registry::{auth, manifest};
use berth::image::{archive, layer, reference, sif, squashfs};

// The SPANK plugin's parsers, from its rlib; the mount syntax it checks comes from the protocol
// crate both sides share.
use berth_proto::mounts;
use spank_berth::{config, options, request};

/// One fuzz target: takes any bytes, must return.
pub type Target = fn(&[u8]);

/// Every target, by the name its corpus directory and the runner use.
pub const TARGETS: &[(&str, Target)] = &[
    ("reference", fuzz_reference),
    ("manifest", fuzz_manifest),
    ("image_config", fuzz_image_config),
    ("layer_tar", fuzz_layer_tar),
    ("sif", fuzz_sif),
    ("squashfs", fuzz_squashfs),
    ("netrc", fuzz_netrc),
    ("auth_challenge", fuzz_auth_challenge),
    ("auth_file", fuzz_auth_file),
    ("pyxis_mounts", fuzz_pyxis_mounts),
    ("stage_spec", fuzz_stage_spec),
    ("cdi", fuzz_cdi),
    ("spank_options", fuzz_spank_options),
    ("spank_plugstack", fuzz_spank_plugstack),
    ("spank_created", fuzz_spank_created),
    ("step_request", fuzz_step_request),
    ("berth_toml", fuzz_berth_toml),
    ("cli", fuzz_cli),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The input as text, as the callers see it (they read files and arguments as UTF-8 and refuse
/// the rest before parsing).
fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// Splits `data` at its first NUL: a second input for targets that take two.
fn split_nul(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// `--container-image` and `berth import/run IMAGE` values: registry, Enroot, file and archive
/// references, resolved against a fixed working directory (nothing is opened).
pub fn fuzz_reference(data: &[u8]) {
    let Some(t) = text(data) else { return };
    if let Ok(r) = reference::parse_in(t, Path::new("/home/user/work")) {
        let _ = format!("{r:?}");
    }
    if let Some(Ok(r)) = archive::parse_local(t) {
        let _ = format!("{r:?}");
    }
    let _ = reference::check_digest(t);
    let _ = manifest::Wanted::parse(t);
}

/// A registry's manifest or index (with an optional Content-Type after a NUL), then the platform
/// choice berth makes from an index.
pub fn fuzz_manifest(data: &[u8]) {
    let (body, content_type) = split_nul(data);
    let content_type = text(content_type).filter(|t| !t.is_empty());
    match manifest::parse(body, content_type) {
        Ok(manifest::Manifest::Index(entries)) => {
            for arch in ["amd64", "arm64", "arm/v7", "ppc64le"] {
                if let Ok(want) = manifest::Wanted::parse(arch) {
                    let _ = manifest::select(&entries, &want);
                }
            }
            let _ = manifest::platforms(&entries);
        }
        Ok(other) => {
            let _ = format!("{other:?}");
        }
        Err(e) => {
            let _ = e.to_string().len();
        }
    }
}

/// An image config blob: what berth reads of it to start a container.
pub fn fuzz_image_config(data: &[u8]) {
    let Ok(config) = serde_json::from_slice::<oci_spec::image::ImageConfiguration>(data) else {
        return;
    };
    let defaults = berth::spec::image::ImageDefaults::from_config(&config);
    let _ = defaults.command_line(&[], true);
    let _ = defaults.command_line(&["sh".to_string()], true);
    let _ = defaults.command_line(&["sh".to_string()], false);
}

/// A layer's tar stream, extracted into a fresh temporary directory (as the store does, as
/// root when run as root). The directory is removed after each input.
pub fn fuzz_layer_tar(data: &[u8]) {
    // /dev/shm keeps the per-input directory off the disk where it exists.
    let base = Path::new("/dev/shm");
    let dir = if base.is_dir() {
        tempfile::tempdir_in(base)
    } else {
        tempfile::tempdir()
    };
    let Ok(dir) = dir else { return };
    let mut input = data;
    let _ = layer::extract(&mut input, dir.path());
    let mut input = data;
    let _ = layer::hash_only(&mut input);
    // Extracted entries may have taken away the owner's write bit on directories: removal is
    // best effort (tempfile ignores errors), and make_writable first lets it succeed.
    make_writable(dir.path());
}

/// Gives the owner rwx on every directory below `dir`, without following symlinks, so that
/// the temporary root can be removed.
fn make_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let path = entry.path();
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700));
            make_writable(&path);
        }
    }
}

/// An Apptainer SIF file's header and descriptor table (the whole file in memory).
pub fn fuzz_sif(data: &[u8]) {
    let len = data.len() as u64;
    if let Ok(s) = sif::Sif::parse(data, len) {
        for d in &s.descriptors {
            let _ = d.describe();
            let _ = d.partition();
        }
        if let Ok(p) = s.primary_partition() {
            let _ = p.describe();
        }
    }
    // The header alone, against a file said to be larger than what was read.
    let _ = sif::parse_header(data, len.saturating_mul(2));
}

/// A squashfs superblock (an Enroot .sqsh file's first bytes).
pub fn fuzz_squashfs(data: &[u8]) {
    if let Ok(sb) = squashfs::parse_superblock(data) {
        let _ = format!("{sb:?}");
    }
}

/// A netrc-syntax credentials file, then the lookups berth makes in it.
pub fn fuzz_netrc(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let logins = auth::parse_netrc(t, Path::new("/home/user/.config/enroot/.credentials"));
    for l in &logins {
        let _ = l.basic_header();
    }
    let creds = auth::Credentials {
        logins,
        ..auth::Credentials::default()
    };
    for host in [
        "registry-1.docker.io",
        "ghcr.io",
        "localhost:5000",
        "auth.docker.io",
    ] {
        let _ = creds.find(host, None);
        let _ = creds.find(host, Some("user"));
    }
}

/// A docker `config.json` or podman `auth.json` login file, as a user writes it.
pub fn fuzz_auth_file(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let Ok(parsed) = auth::parse_auth_file(t, Path::new("/home/user/.docker/config.json")) else {
        return;
    };
    let _ = parsed.skipped.join(", ");
    for l in &parsed.logins {
        let _ = l.basic_header();
    }
    let creds = auth::Credentials {
        logins: parsed.logins,
        ..auth::Credentials::default()
    };
    for host in [
        "registry-1.docker.io",
        "ghcr.io",
        "127.0.0.1:5000",
        "quay.io",
    ] {
        let _ = creds.find(host, None);
        let _ = creds.find(host, Some("user"));
    }
}

/// A registry's `WWW-Authenticate` header, and the realm URL berth would fetch a token from.
pub fn fuzz_auth_challenge(data: &[u8]) {
    let Some(t) = text(data) else { return };
    if let Some(c) = auth::parse_challenge(t) {
        let _ = format!("{c:?}");
    }
    let _ = auth::url_host(t);
    let _ = auth::strip_port(t);
    let _ = auth::is_docker_hub(t);
    let _ = auth::query_escape(t);
}

/// `--container-mounts` (Pyxis syntax), as berth parses it and as the plugin checks it.
pub fn fuzz_pyxis_mounts(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let _ = berth::slurm::mounts::parse(t);
    let _ = mounts::parse(t);
    // `--container-mounts` is FLAGS[0]; every flag's checker is covered by spank_options.
    let mut o = options::Options::default();
    let _ = o.apply_flag(0, Some(t));
}

/// `--container-stage-in` / `--container-stage-out` specs.
pub fn fuzz_stage_spec(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let _ = berth::stage::job::parse_in(t);
    let _ = berth::stage::job::parse_out(t);
}

/// A CDI spec file, as JSON or as YAML (the first byte picks), then its device names and edits.
pub fn fuzz_cdi(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let Some(t) = text(rest) else { return };
    let path = if first & 1 == 0 {
        Path::new("/etc/cdi/vendor.json")
    } else {
        Path::new("/etc/cdi/vendor.yaml")
    };
    if let Ok(spec) = berth::topology::cdi::CdiSpec::parse(t, path) {
        let _ = format!("{spec:?}");
    }
    let _ = berth::topology::cdi::split_name(t);
    let _ = berth::topology::cdi::is_qualified(t);
}

/// The plugin's option callbacks: lines of `INDEX VALUE` (an option of the table and its
/// argument), then the same values taken from `BERTH_CONTAINER_*` variables, then the JSON
/// request it builds.
pub fn fuzz_spank_options(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let mut o = options::Options::default();
    let mut env = std::collections::BTreeMap::new();
    for line in t.lines() {
        let (index, arg) = line.split_once(' ').unwrap_or((line, ""));
        let Ok(index) = index.parse::<usize>() else {
            continue;
        };
        let arg = (!arg.is_empty()).then_some(arg);
        let _ = o.apply_flag(index % (options::FLAGS.len() + 1), arg);
        if let Some(flag) = options::FLAGS.get(index % options::FLAGS.len()) {
            let name = flag.name.to_string_lossy().replace('-', "_").to_uppercase();
            env.insert(format!("BERTH_{name}"), arg.unwrap_or("").to_string());
        }
    }
    let _ = o.apply_env(|name| env.get(name).cloned());
    let _ = o.enabled();
    let _ = o.ignored();
    let _ = o.stage_env();
    let _ = serde_json::to_string(&o.to_json());
    let mut env_only = options::Options::default();
    let _ = env_only.apply_env(|name| env.get(name).cloned());
    let _ = o.add_batch_script(t);
}

/// plugstack.conf arguments (whitespace-separated, as Slurm splits them).
pub fn fuzz_spank_plugstack(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let args: Vec<&str> = t.split_whitespace().collect();
    if let Ok(c) = config::PluginConfig::parse(&args) {
        let _ = format!("{c:?}");
    }
    let _ = config::scratch_root(Some(t));
}

/// berth's answer to `berth step create`, as the plugin reads it from the subprocess, and the
/// one-line failure it shows from berth's stderr.
pub fn fuzz_spank_created(data: &[u8]) {
    if let Ok(c) = request::Created::parse(data) {
        let _ = request::join_order(&c);
        for rank in [0, 1, u32::MAX] {
            if let Some(b) = c.bind.as_ref() {
                let _ = b.rank(rank);
            }
        }
        let current: Vec<String> = vec!["PATH=/usr/bin".into(), "HOME=/root".into()];
        let _ = request::env_changes(&current, &c.env);
    }
    let _ = request::failure_line(data, "create", "exit 1");
}

/// The JSON step request `berth step create` reads on stdin from the plugin, and the pure
/// translation of it into a container request.
pub fn fuzz_step_request(data: &[u8]) {
    use berth::slurm::request::{self as step, StepExt, StepRequest};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(parsed) = StepRequest::parse(text) else {
        return;
    };
    let req = parsed.request;
    let _ = req.node_name();
    let _ = req.cwd();
    if let Some(save) = &req.options.container_save {
        let _ = req.host_path(save);
    }
    let _ = req.bind_mode(berth::topology::plan::BindMode::default());
    let _ = req.topology_job();
    if let Some(name) = &req.options.container_name {
        let _ = step::parse_name(name);
    }
    let user = berth::spec::UserIds {
        uid: req.uid,
        gid: req.gid,
        groups: vec![req.gid],
        home: Some("/home/user".into()),
        name: Some("user".into()),
        group_name: None,
    };
    let image = berth::spec::image::ImageDefaults::default();
    let _ = step::to_request(&req, user, &["/lower".into()], &image, Vec::new());
}

/// berth.toml, then the checks berth runs on a loaded configuration.
pub fn fuzz_berth_toml(data: &[u8]) {
    let Some(t) = text(data) else { return };
    if let Ok(c) = berth::config::Config::parse(t) {
        let _ = c.squashfs.check();
        let _ = c.stage.options();
        let _ = c.cgroup.root();
    }
}

/// berth's command line: NUL-separated arguments after `berth`, parsed by clap with every value
/// parser; each argument also goes through the value parsers the verbs call themselves.
pub fn fuzz_cli(data: &[u8]) {
    use clap::Parser;
    let args: Vec<std::ffi::OsString> = std::iter::once("berth".into())
        .chain(data.split(|&b| b == 0).map(|a| {
            use std::os::unix::ffi::OsStrExt;
            std::ffi::OsStr::from_bytes(a).to_os_string()
        }))
        .collect();
    match berth::cli::Cli::try_parse_from(&args) {
        Ok(cli) => {
            let _ = format!("{cli:?}");
        }
        Err(e) => {
            let _ = e.render().to_string();
        }
    }
    for a in args.iter().skip(1).filter_map(|a| a.to_str()) {
        let _ = berth::spec::parse::size(a);
        let _ = berth::spec::parse::cpus(a, 100_000);
        let _ = berth::spec::parse::cpu_list(a);
        let _ = berth::spec::parse::bind_mount(a);
        let _ = berth::spec::parse::env_pair(a);
        let _ = berth::spec::parse::hostname(a);
    }
}
