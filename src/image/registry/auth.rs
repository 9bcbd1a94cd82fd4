//! Registry credentials and authentication challenges.
//!
//! Credentials come from netrc-syntax files, as Enroot keeps them (`machine HOST login USER
//! password PASS`): berth's own file, then Enroot's `.credentials`. Enroot hands the file to
//! curl, which sends a login to whichever host it talks to, so for a Bearer-token registry the
//! token server's host is looked up before the registry's (Docker Hub logins are written for
//! `auth.docker.io`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use base64::Engine as _;

/// One `machine` entry of a credentials file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Login {
    pub machine: String,
    pub login: String,
    pub password: String,
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
    /// Every file consulted (present or not), for "add your login to …" messages.
    pub files: Vec<PathBuf>,
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
    /// Reads the credential files that exist. With `owner` set (the requesting user's home, whose
    /// owner berth may be acting for as root), a file owned by anyone else or by a symlink is
    /// refused, so that a user cannot point berth at another user's secrets.
    pub fn load(files: Vec<PathBuf>, owner: Option<&Path>) -> Result<Self, String> {
        let owner_uid = match owner {
            Some(home) => Some(
                std::fs::metadata(home)
                    .map_err(|e| format!("{}: {e}", home.display()))?
                    .uid(),
            ),
            None => None,
        };
        let mut logins = Vec::new();
        for file in &files {
            let meta = match std::fs::symlink_metadata(file) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(format!("credentials file {}: {e}", file.display())),
            };
            if let Some(uid) = owner_uid
                && (meta.file_type().is_symlink() || (meta.uid() != uid && meta.uid() != 0))
            {
                return Err(format!(
                    "credentials file {} is a symlink or belongs to another user: make it a \
                     regular file owned by you",
                    file.display()
                ));
            }
            let text = std::fs::read_to_string(file)
                .map_err(|e| format!("credentials file {}: {e}", file.display()))?;
            logins.extend(parse_netrc(&text, file));
        }
        Ok(Self { logins, files })
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
        if names.is_empty() {
            "a credentials file (registry.credentials in berth.toml)".to_string()
        } else {
            names.join(" or ")
        }
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

/// The files a user's registry logins are read from, in order.
pub fn credential_files(
    berth_file: &str,
    enroot: bool,
    enroot_config_path: Option<&Path>,
    home: Option<&Path>,
) -> Vec<PathBuf> {
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
        files.push(p);
    }
    if enroot {
        let dir = match enroot_config_path {
            Some(p) => Some(p.to_path_buf()),
            None => home.map(|h| h.join(".config/enroot")),
        };
        if let Some(dir) = dir {
            files.push(dir.join(".credentials"));
        }
    }
    files
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
            files: vec![],
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
        assert_eq!(
            credential_files("~/.config/berth/credentials", true, None, Some(home)),
            vec![
                PathBuf::from("/home/u/.config/berth/credentials"),
                PathBuf::from("/home/u/.config/enroot/.credentials")
            ]
        );
        assert_eq!(
            credential_files("/etc/berth/creds", true, Some(Path::new("/e")), None),
            vec![
                PathBuf::from("/etc/berth/creds"),
                PathBuf::from("/e/.credentials")
            ]
        );
        assert!(credential_files("~/x", false, None, None).is_empty());
    }

    #[test]
    fn foreign_owned_or_symlinked_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::write(&real, "machine h login a password b").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let c = Credentials::load(
            vec![real.clone(), dir.path().join("absent")],
            Some(dir.path()),
        )
        .unwrap();
        assert_eq!(c.logins.len(), 1);
        let err = Credentials::load(vec![link], Some(dir.path())).unwrap_err();
        assert!(err.contains("symlink"), "{err}");
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
