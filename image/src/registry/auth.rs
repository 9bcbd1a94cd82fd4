//! Registry credentials and authentication challenges.
//!
//! Credentials come from netrc-syntax files, as Enroot keeps them (`machine HOST login USER
//! password PASS`): berth's own file, then Enroot's `.credentials`; then from the JSON login
//! files `podman login` and `docker login` write (`auths` → `auth`/`identitytoken`). Enroot
//! hands its file to curl, which sends a login to whichever host it talks to, so for a
//! Bearer-token registry the token server's host is looked up before the registry's (Docker Hub
//! logins are written for `auth.docker.io`).
//!
//! The files belong to the user the image is pulled for, and berth runs as root: every one is
//! opened with that user's credentials ([`berth_sys::privfs::open_readable_as_user`]), so a user
//! cannot make berth read what the user could not (a symlink to another user's file, a path in
//! `$REGISTRY_AUTH_FILE`). Only a site-wide file the admin names by absolute path in berth.toml,
//! root's and in root's directories, is read as root. Reads are bounded.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use nix::fcntl::OFlag;

use berth_spec::UserIds;

use crate::ImageError;
use crate::registry::RegistryError;

/// Credential files larger than this are refused (a login file is a few hundred bytes).
pub const FILE_LIMIT: u64 = 1 << 20;

/// One `machine` entry of a credentials file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Login {
    pub machine: String,
    pub login: String,
    pub password: String,
    /// An OAuth2 refresh token (`identitytoken` of docker's config.json), exchanged at the
    /// token server for an access token instead of sending `login`/`password`.
    pub identity_token: Option<String>,
    /// The file it came from, for error messages.
    pub file: PathBuf,
}

impl Login {
    pub fn basic_header(&self) -> String {
        let raw = format!("{}:{}", self.login, self.password);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }
}

/// The logins of one user, in lookup order.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    pub logins: Vec<Login>,
    /// Every netrc file consulted (present or not), for "add your login to …" messages.
    pub files: Vec<PathBuf>,
    /// Whether docker/podman login files were consulted too.
    pub json_files: bool,
}

/// The syntax of a credentials file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// `machine HOST login USER password PASS` (berth's and Enroot's files).
    Netrc,
    /// docker's config.json or podman's auth.json.
    AuthJson,
}

/// One file logins may be read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredentialFile {
    pub path: PathBuf,
    pub kind: FileKind,
    /// Named by the admin in berth.toml by absolute path: read as root when root owns it and
    /// the directories above it (a site-wide login users cannot read), else as the user.
    pub site: bool,
}

impl CredentialFile {
    fn netrc(path: PathBuf) -> Self {
        Self {
            path,
            kind: FileKind::Netrc,
            site: false,
        }
    }

    fn json(path: PathBuf) -> Self {
        Self {
            path,
            kind: FileKind::AuthJson,
            site: false,
        }
    }
}

/// The environment variables that move a user's login files, as the user's own shell has them;
/// empty (the defaults apply) when berth acts for another user, whose environment it lacks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserEnv {
    pub enroot_config_path: Option<PathBuf>,
    pub registry_auth_file: Option<PathBuf>,
    pub xdg_runtime_dir: Option<PathBuf>,
    pub docker_config: Option<PathBuf>,
}

impl UserEnv {
    /// This process's own variables: for a pull berth does for the user who runs it.
    pub fn of_this_process() -> Self {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        Self {
            enroot_config_path: var("ENROOT_CONFIG_PATH"),
            registry_auth_file: var("REGISTRY_AUTH_FILE"),
            xdg_runtime_dir: var("XDG_RUNTIME_DIR"),
            docker_config: var("DOCKER_CONFIG"),
        }
    }
}

/// What a docker/podman login file holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuthFile {
    pub logins: Vec<Login>,
    /// `credsStore` or `credHelpers` is set: logins kept in helpers berth does not run.
    pub helpers: bool,
    /// Entries skipped, each said in a few words (for one warning line).
    pub skipped: Vec<String>,
}

/// Parses docker's `config.json` / podman's `auth.json`: `{"auths": {"HOST": {"auth":
/// base64("USER:PASS")}}}` or `{"identitytoken": TOKEN}` instead. Keys may be URLs
/// (`https://index.docker.io/v1/`); keys naming a namespace (`quay.io/org`) are skipped.
/// Unknown fields are ignored, as docker does.
pub fn parse_auth_file(text: &str, file: &Path) -> Result<AuthFile, ImageError> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| ImageError::Detail(format!("not valid JSON: {e}")))?;
    let top = value
        .as_object()
        .ok_or_else(|| ImageError::Detail("not a JSON object".to_string()))?;
    let mut out = AuthFile {
        helpers: top.get("credsStore").is_some_and(|v| !v.is_null())
            || top
                .get("credHelpers")
                .and_then(|v| v.as_object())
                .is_some_and(|m| !m.is_empty()),
        ..AuthFile::default()
    };
    let auths = match top.get("auths") {
        None | Some(serde_json::Value::Null) => return Ok(out),
        Some(serde_json::Value::Object(m)) => m,
        Some(_) => return Err(ImageError::Detail("`auths` is not an object".to_string())),
    };
    for (key, entry) in auths {
        let Some(machine) = auth_key_host(key) else {
            out.skipped.push(format!(
                "'{}' (a namespace, not a registry)",
                berth_sys::text::elide(key)
            ));
            continue;
        };
        let get = |k: &str| {
            entry
                .get(k)
                .and_then(|v| v.as_str())
                .filter(|v| !v.is_empty())
        };
        let mut login = Login {
            machine: machine.clone(),
            login: String::new(),
            password: String::new(),
            identity_token: get("identitytoken").map(str::to_string),
            file: file.to_path_buf(),
        };
        if let Some(encoded) = get("auth") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .ok()
                .and_then(|d| String::from_utf8(d).ok());
            match decoded.as_deref().and_then(|d| d.split_once(':')) {
                Some((user, pass)) => {
                    login.login = user.to_string();
                    login.password = pass.to_string();
                }
                None => {
                    out.skipped.push(format!(
                        "'{}' (its `auth` is not base64 of USER:PASSWORD)",
                        berth_sys::text::elide(&machine)
                    ));
                    continue;
                }
            }
        } else if let (Some(u), Some(p)) = (get("username"), get("password")) {
            login.login = u.to_string();
            login.password = p.to_string();
        }
        if login.identity_token.is_some() && login.login.is_empty() {
            // docker writes "<token>" as the user name of an identity-token login.
            login.login = "<token>".to_string();
        }
        if login.login.is_empty() {
            continue;
        }
        out.logins.push(login);
    }
    Ok(out)
}

/// The `HOST[:PORT]` a key of `auths` stands for: `https://index.docker.io/v1/` is
/// `index.docker.io`; `None` for a key with a namespace path (`quay.io/org`).
fn auth_key_host(key: &str) -> Option<String> {
    let rest = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let path = path.trim_end_matches('/');
    if host.is_empty() || !(path.is_empty() || path == "v1" || path == "v2") {
        return None;
    }
    Some(host.to_string())
}

/// Parses netrc text. `default` entries and `macdef` blocks are skipped: a registry login
/// is always for a named machine.
pub fn parse_netrc(text: &str, file: &Path) -> Vec<Login> {
    let mut logins = Vec::new();
    let mut tokens = text.split_whitespace().peekable();
    let mut current: Option<Login> = None;
    let flush = |current: &mut Option<Login>, logins: &mut Vec<Login>| {
        if let Some(l) = current.take()
            && !l.login.is_empty()
        {
            logins.push(l);
        }
    };
    while let Some(token) = tokens.next() {
        match token {
            "machine" => {
                flush(&mut current, &mut logins);
                if let Some(machine) = tokens.next() {
                    current = Some(Login {
                        machine: machine.to_string(),
                        login: String::new(),
                        password: String::new(),
                        identity_token: None,
                        file: file.to_path_buf(),
                    });
                }
            }
            "default" => flush(&mut current, &mut logins),
            "login" => {
                let value = tokens.next().unwrap_or_default();
                if let Some(c) = current.as_mut() {
                    c.login = value.to_string();
                }
            }
            "password" => {
                let value = tokens.next().unwrap_or_default();
                if let Some(c) = current.as_mut() {
                    c.password = value.to_string();
                }
            }
            "account" => {
                tokens.next();
            }
            "macdef" => {
                // A macro runs to the next blank line, which split_whitespace cannot see; no
                // registry file has one, so drop the rest of this entry.
                flush(&mut current, &mut logins);
            }
            _ => {}
        }
    }
    flush(&mut current, &mut logins);
    logins
}

impl Credentials {
    /// Reads the credential files that exist, each opened as `user` (the user the image is
    /// pulled for; see the module header), a site-wide file of the admin's as root.
    pub fn load(files: Vec<CredentialFile>, user: &UserIds) -> Result<Self, ImageError> {
        let mut logins = Vec::new();
        let mut netrc_files = Vec::new();
        let mut json_files = false;
        for file in &files {
            match file.kind {
                FileKind::Netrc => netrc_files.push(file.path.clone()),
                FileKind::AuthJson => json_files = true,
            }
            let Some(bytes) = read_login_file(file, user)? else {
                continue;
            };
            let text = String::from_utf8(bytes).map_err(|_| {
                config_error({
                    format!(
                        "credentials file {} is not UTF-8 text: fix or remove it",
                        file.path.display()
                    )
                })
            })?;
            match file.kind {
                FileKind::Netrc => logins.extend(parse_netrc(&text, &file.path)),
                FileKind::AuthJson => {
                    let parsed = parse_auth_file(&text, &file.path).map_err(|e| {
                        config_error({
                            format!(
                                "registry login file {}: {e}: fix it, or set registry.auth_files = \
                             false in berth.toml",
                                file.path.display()
                            )
                        })
                    })?;
                    if parsed.helpers {
                        tracing::warn!(
                            "{}: credsStore/credHelpers are not run by berth (it pulls as root \
                             for the job): logins kept only in a helper are not used; put them \
                             in `auths` or ~/.config/berth/credentials",
                            file.path.display()
                        );
                    }
                    if !parsed.skipped.is_empty() {
                        tracing::warn!(
                            "{}: skipped {}",
                            file.path.display(),
                            parsed.skipped.join(", ")
                        );
                    }
                    logins.extend(parsed.logins);
                }
            }
        }
        Ok(Self {
            logins,
            files: netrc_files,
            json_files,
        })
    }

    /// The login for `host` (`HOST[:PORT]`): an entry for the exact host and port first, then
    /// for the host alone; `user` (from `USER@`) picks among several.
    pub fn find(&self, host: &str, user: Option<&str>) -> Option<&Login> {
        let bare = strip_port(host);
        let hosts = if is_docker_hub(host) {
            vec![
                host,
                "registry-1.docker.io",
                "index.docker.io",
                "docker.io",
                "auth.docker.io",
            ]
        } else {
            vec![host, bare]
        };
        hosts.into_iter().find_map(|h| {
            self.logins
                .iter()
                .find(|l| l.machine == h && user.is_none_or(|u| l.login == u))
        })
    }

    pub fn files_text(&self) -> String {
        let names: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
        let mut text = if names.is_empty() {
            "a credentials file (registry.credentials in berth.toml)".to_string()
        } else {
            names.join(" or ")
        };
        if self.json_files {
            text.push_str(" (or log in with 'podman login' or 'docker login')");
        }
        text
    }
}

pub fn is_docker_hub(host: &str) -> bool {
    matches!(
        host,
        "registry-1.docker.io" | "docker.io" | "index.docker.io"
    )
}

/// `host` without `:port` (IPv6 brackets kept).
pub fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(i) => &host[..=i],
            None => host,
        };
    }
    host.rsplit_once(':').map_or(host, |(h, _)| h)
}

/// The files a user's registry logins are read from, in order: berth's netrc file
/// (`registry.credentials`), Enroot's `.credentials`, then with `auth_files` podman's
/// (`$REGISTRY_AUTH_FILE`, else `$XDG_RUNTIME_DIR/containers/auth.json` — `/run/user/UID/…`
/// without the variable — then `~/.config/containers/auth.json`) and docker's
/// (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`).
pub fn credential_files(
    berth_file: &str,
    enroot: bool,
    auth_files: bool,
    env: &UserEnv,
    uid: u32,
    home: Option<&Path>,
) -> Vec<CredentialFile> {
    let expand = |p: &str| -> Option<PathBuf> {
        match p.strip_prefix("~/") {
            Some(rest) => home.map(|h| h.join(rest)),
            None if p == "~" => home.map(Path::to_path_buf),
            None => Some(PathBuf::from(p)),
        }
    };
    let mut files = Vec::new();
    if !berth_file.is_empty()
        && let Some(p) = expand(berth_file)
    {
        files.push(CredentialFile {
            path: p,
            kind: FileKind::Netrc,
            site: !berth_file.starts_with('~') && Path::new(berth_file).is_absolute(),
        });
    }
    if enroot {
        let dir = match &env.enroot_config_path {
            Some(p) => Some(p.clone()),
            None => home.map(|h| h.join(".config/enroot")),
        };
        if let Some(dir) = dir {
            files.push(CredentialFile::netrc(dir.join(".credentials")));
        }
    }
    if auth_files {
        match (&env.registry_auth_file, &env.xdg_runtime_dir) {
            (Some(f), _) => files.push(CredentialFile::json(f.clone())),
            (None, Some(run)) => files.push(CredentialFile::json(run.join("containers/auth.json"))),
            (None, None) => files.push(CredentialFile::json(PathBuf::from(format!(
                "/run/user/{uid}/containers/auth.json"
            )))),
        }
        if let Some(h) = home {
            files.push(CredentialFile::json(h.join(".config/containers/auth.json")));
        }
        match (&env.docker_config, home) {
            (Some(d), _) => files.push(CredentialFile::json(d.join("config.json"))),
            (None, Some(h)) => files.push(CredentialFile::json(h.join(".docker/config.json"))),
            (None, None) => {}
        }
    }
    files
}

/// A credentials file berth cannot use: the registry configuration is wrong.
fn config_error(detail: String) -> ImageError {
    ImageError::Registry(RegistryError::RegistryConfig { detail })
}

/// The bytes of one credentials file, `None` when it does not exist. Opened as `user` (see the
/// module header); a site-wide file that root owns, in directories only root can change, as root.
fn read_login_file(file: &CredentialFile, user: &UserIds) -> Result<Option<Vec<u8>>, ImageError> {
    let path = &file.path;
    let failed = |e: std::io::Error| {
        config_error(format!(
            "credentials file {} (read as uid {}): {e}: make it a file you can read, or remove it",
            path.display(),
            user.uid
        ))
    };
    let absent =
        |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR));
    if file.site
        && nix::unistd::geteuid().is_root()
        && let Some(mut f) = open_site_file(path).map_err(failed)?
    {
        return berth_sys::privfs::read_bounded(&mut f, FILE_LIMIT)
            .map(Some)
            .map_err(failed);
    }
    let mut f = match berth_sys::privfs::open_readable_as_user(path, user) {
        Ok(f) => f,
        Err(e) if absent(&e) => return Ok(None),
        Err(e) => return Err(failed(e)),
    };
    if !f.metadata().map_err(failed)?.is_file() {
        return Err(failed(std::io::Error::other("not a regular file")));
    }
    berth_sys::privfs::read_bounded(&mut f, FILE_LIMIT)
        .map(Some)
        .map_err(failed)
}

/// Opens an admin's site-wide file as root when it and every directory above it are root's and
/// writable by no one else (sticky directories aside); `None` otherwise (absent, a symlink,
/// someone else's: the caller then reads it as the user).
fn open_site_file(path: &Path) -> std::io::Result<Option<File>> {
    let trusted = |m: &std::fs::Metadata| {
        m.uid() == 0 && (m.mode() & 0o022 == 0 || (m.is_dir() && m.mode() & 0o1000 != 0))
    };
    for dir in path.ancestors().skip(1) {
        if dir.as_os_str().is_empty() {
            continue;
        }
        match std::fs::symlink_metadata(dir) {
            Ok(m) if m.is_dir() && trusted(&m) => {}
            _ => return Ok(None),
        }
    }
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_CLOEXEC
        | OFlag::O_NOCTTY;
    let fd = match nix::fcntl::open(path, flags, nix::sys::stat::Mode::empty()) {
        Ok(fd) => fd,
        Err(_) => return Ok(None),
    };
    let f = File::from(fd);
    let m = f.metadata()?;
    if !m.is_file() || !trusted(&m) || m.permissions().mode() & 0o002 != 0 {
        return Ok(None);
    }
    Ok(Some(f))
}

/// A `WWW-Authenticate` challenge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic {
        realm: Option<String>,
    },
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

/// Parses `Bearer realm="…",service="…",scope="…"` or `Basic realm="…"`.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, rest) = header
        .split_once(char::is_whitespace)
        .unwrap_or((header, ""));
    let params = parse_params(rest);
    let get = |k: &str| {
        params
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.clone())
    };
    if scheme.eq_ignore_ascii_case("basic") {
        Some(Challenge::Basic {
            realm: get("realm"),
        })
    } else if scheme.eq_ignore_ascii_case("bearer") {
        Some(Challenge::Bearer {
            realm: get("realm")?,
            service: get("service"),
            scope: get("scope"),
        })
    } else {
        None
    }
}

/// `key=value` or `key="quoted, value"` pairs separated by commas.
fn parse_params(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c == ',' {
                break;
            }
            key.push(c);
            chars.next();
        }
        if key.is_empty() {
            return out;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'=') {
            chars.next();
            if chars.peek() == Some(&'"') {
                chars.next();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            if let Some(n) = chars.next() {
                                value.push(n);
                            }
                        }
                        '"' => break,
                        c => value.push(c),
                    }
                }
            } else {
                while let Some(&c) = chars.peek() {
                    if c == ',' {
                        break;
                    }
                    value.push(c);
                    chars.next();
                }
            }
        }
        out.push((key.trim().to_string(), value.trim().to_string()));
    }
}

/// Percent-encodes a query parameter value.
pub fn query_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The host of an `http(s)://host[:port]/…` URL.
pub fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let host = rest.split(['/', '?', '#']).next()?;
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netrc_entries() {
        let text = "machine nvcr.io login $oauthtoken password abc\n\
                    # comment-ish tokens are ignored\n\
                    machine 127.0.0.1:5000\n  login alice\n  password s3cret\n\
                    machine 127.0.0.1:5000 login bob password other\n\
                    machine auth.docker.io login hub password hp\n\
                    default login anon password x\n";
        let c = Credentials {
            logins: parse_netrc(text, Path::new("/f")),
            files: vec!["/f".into()],
            json_files: false,
        };
        assert_eq!(c.logins.len(), 4);
        assert_eq!(c.find("nvcr.io", None).unwrap().login, "$oauthtoken");
        assert_eq!(c.find("127.0.0.1:5000", None).unwrap().password, "s3cret");
        assert_eq!(
            c.find("127.0.0.1:5000", Some("bob")).unwrap().password,
            "other"
        );
        assert!(c.find("127.0.0.1:5000", Some("carol")).is_none());
        assert!(c.find("127.0.0.1:6000", None).is_none());
        assert_eq!(c.find("registry-1.docker.io", None).unwrap().login, "hub");
        assert!(c.find("example.com", None).is_none());
        let host_only = Credentials {
            logins: parse_netrc("machine localhost login l password p", Path::new("/f")),
            ..Credentials::default()
        };
        assert_eq!(host_only.find("localhost:5000", None).unwrap().login, "l");
        assert_eq!(
            c.find("nvcr.io", None).unwrap().basic_header(),
            "Basic JG9hdXRodG9rZW46YWJj"
        );
    }

    #[test]
    fn credential_file_locations() {
        let home = Path::new("/home/u");
        let paths = |files: Vec<CredentialFile>| -> Vec<String> {
            files
                .iter()
                .map(|f| format!("{:?} {}", f.kind, f.path.display()))
                .collect()
        };
        let none = UserEnv::default();
        assert_eq!(
            paths(credential_files(
                "~/.config/berth/credentials",
                true,
                true,
                &none,
                1000,
                Some(home)
            )),
            [
                "Netrc /home/u/.config/berth/credentials",
                "Netrc /home/u/.config/enroot/.credentials",
                "AuthJson /run/user/1000/containers/auth.json",
                "AuthJson /home/u/.config/containers/auth.json",
                "AuthJson /home/u/.docker/config.json",
            ]
        );
        let env = UserEnv {
            enroot_config_path: Some("/e".into()),
            registry_auth_file: Some("/r/auth.json".into()),
            xdg_runtime_dir: Some("/x".into()),
            docker_config: Some("/d".into()),
        };
        let files = credential_files("/etc/berth/creds", true, true, &env, 5, None);
        assert!(files[0].site);
        assert_eq!(
            paths(files),
            [
                "Netrc /etc/berth/creds",
                "Netrc /e/.credentials",
                "AuthJson /r/auth.json",
                "AuthJson /d/config.json",
            ]
        );
        let env = UserEnv {
            xdg_runtime_dir: Some("/x".into()),
            ..UserEnv::default()
        };
        assert_eq!(
            paths(credential_files("", false, true, &env, 5, None)),
            ["AuthJson /x/containers/auth.json"]
        );
        assert!(credential_files("~/x", false, false, &none, 0, None).is_empty());
        assert!(!credential_files("~/x", false, false, &none, 0, Some(home))[0].site);
    }

    #[test]
    fn auth_files() {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let text = format!(
            r#"{{"auths": {{
                "127.0.0.1:5000": {{"auth": "{}"}},
                "https://index.docker.io/v1/": {{"auth": "{}", "email": "x@y"}},
                "ghcr.io": {{"identitytoken": "refresh-me"}},
                "quay.io/org": {{"auth": "{}"}},
                "bad.example": {{"auth": "***"}},
                "empty.example": {{}},
                "old.example": {{"username": "u", "password": "p"}}
            }}, "credsStore": "desktop", "HttpHeaders": {{"X": "y"}}}}"#,
            b64("alice:pa:ss"),
            b64("hub:hp"),
            b64("o:p")
        );
        let f = parse_auth_file(&text, Path::new("/h/.docker/config.json")).unwrap();
        assert!(f.helpers);
        assert_eq!(f.skipped.len(), 2, "{:?}", f.skipped);
        let c = Credentials {
            logins: f.logins,
            ..Credentials::default()
        };
        let l = c.find("127.0.0.1:5000", None).unwrap();
        assert_eq!((l.login.as_str(), l.password.as_str()), ("alice", "pa:ss"));
        assert_eq!(l.file, Path::new("/h/.docker/config.json"));
        assert_eq!(c.find("docker.io", None).unwrap().login, "hub");
        let t = c.find("ghcr.io", None).unwrap();
        assert_eq!(t.identity_token.as_deref(), Some("refresh-me"));
        assert_eq!(c.find("old.example", None).unwrap().password, "p");
        assert!(c.find("quay.io", None).is_none());
        assert!(c.find("empty.example", None).is_none());
        let plain = parse_auth_file("{}", Path::new("/a")).unwrap();
        assert!(!plain.helpers && plain.logins.is_empty());
        parse_auth_file("[]", Path::new("/a")).unwrap_err();
        parse_auth_file(r#"{"auths": 3}"#, Path::new("/a")).unwrap_err();
        parse_auth_file("{", Path::new("/a")).unwrap_err();
    }

    #[test]
    fn files_are_read_with_the_users_permissions_and_bounded() {
        let me = berth_sys::user::current().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::write(&real, "machine h login a password b").unwrap();
        let json = dir.path().join("auth.json");
        std::fs::write(&json, r#"{"auths":{"j":{"auth":"YTpi"}}}"#).unwrap();
        let c = Credentials::load(
            vec![
                CredentialFile::netrc(real.clone()),
                CredentialFile::netrc(dir.path().join("absent")),
                CredentialFile::json(json),
                CredentialFile::json(dir.path().join("no/such/dir/auth.json")),
            ],
            &me,
        )
        .unwrap();
        assert_eq!(c.logins.len(), 2);
        assert!(c.json_files);
        assert!(c.files_text().contains("podman login"));
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b' '; usize::try_from(FILE_LIMIT).unwrap() + 1]).unwrap();
        let err = Credentials::load(vec![CredentialFile::netrc(big)], &me)
            .unwrap_err()
            .to_string();
        assert!(err.contains("larger than"), "{err}");
        let err = Credentials::load(vec![CredentialFile::netrc(dir.path().into())], &me)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let broken = dir.path().join("broken.json");
        std::fs::write(&broken, "{").unwrap();
        let err = Credentials::load(vec![CredentialFile::json(broken)], &me)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not valid JSON") && !err.contains('\n'),
            "{err}"
        );
    }

    #[test]
    fn a_site_wide_file_is_read_as_root_only_when_root_controls_its_path() {
        if !nix::unistd::geteuid().is_root() {
            return; // root only: the point is what root reads for another user
        }
        let nobody = UserIds {
            uid: 65534,
            gid: 65534,
            ..UserIds::default()
        };
        let dir = tempfile::tempdir().unwrap(); // root's, 0700, under /tmp (sticky)
        let site = dir.path().join("site");
        std::fs::write(&site, "machine h login a password b").unwrap();
        std::fs::set_permissions(&site, std::fs::Permissions::from_mode(0o600)).unwrap();
        let file = |path: &Path, site: bool| CredentialFile {
            path: path.to_path_buf(),
            kind: FileKind::Netrc,
            site,
        };
        let c = Credentials::load(vec![file(&site, true)], &nobody).unwrap();
        assert_eq!(c.logins.len(), 1);
        // The same file named by a user (not the admin's site file) is opened as the user.
        let err = Credentials::load(vec![file(&site, false)], &nobody)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Permission denied"), "{err}");
        // In a directory others may write, the admin's path is no longer trusted as root's.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let moved = open.join("site");
        std::fs::copy(&site, &moved).unwrap();
        std::fs::set_permissions(&moved, std::fs::Permissions::from_mode(0o600)).unwrap();
        let err = Credentials::load(vec![file(&moved, true)], &nobody)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Permission denied"), "{err}");
        // A symlink as the site file is not followed as root.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&site, &link).unwrap();
        Credentials::load(vec![file(&link, true)], &nobody).unwrap_err();
    }

    #[test]
    fn challenges() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/ubuntu:pull""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/ubuntu:pull".into()),
            })
        );
        assert_eq!(
            parse_challenge(r#"bearer realm=http://127.0.0.1:1/t, error="invalid_token""#),
            Some(Challenge::Bearer {
                realm: "http://127.0.0.1:1/t".into(),
                service: None,
                scope: None,
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic {
                realm: Some("Registry Realm".into())
            })
        );
        assert_eq!(parse_challenge("Negotiate"), None);
        assert_eq!(parse_challenge("Bearer service=x"), None);
        assert_eq!(parse_challenge(""), None);
    }

    #[test]
    fn urls_and_escaping() {
        assert_eq!(
            query_escape("repository:a/b:pull,push"),
            "repository%3Aa%2Fb%3Apull%2Cpush"
        );
        assert_eq!(
            url_host("https://auth.docker.io/token?x=1"),
            Some("auth.docker.io")
        );
        assert_eq!(url_host("http://127.0.0.1:5001"), Some("127.0.0.1:5001"));
        assert_eq!(url_host("nonsense"), None);
        assert_eq!(strip_port("127.0.0.1:5000"), "127.0.0.1");
        assert_eq!(strip_port("[::1]:5000"), "[::1]");
        assert_eq!(strip_port("nvcr.io"), "nvcr.io");
    }
}
