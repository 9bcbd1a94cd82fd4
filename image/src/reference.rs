//! Image references as users write them (Pyxis `--container-image`, `berth import`, `berth run
//! --image`), parsed into [`Reference`]. Registry names are validated against the OCI distribution
//! reference grammar so that a typo fails here, with one line naming the problem, rather than as a
//! registry 404 later.
//!
//! Accepted forms:
//! - Pyxis/Enroot: `[USER@][REGISTRY#]IMAGE[:TAG][@sha256:HEX]` — `#` separates the registry from
//!   the image; without `REGISTRY#` the image is on Docker Hub;
//! - `docker://[USER@][REGISTRY/]IMAGE[:TAG][@sha256:HEX]` — the first path component is a
//!   registry when it contains `.` or `:` or is `localhost`, as in Docker;
//! - a path starting with `/` or `.` and ending in `.sqsh`/`.squashfs` (Enroot) or `.sif`;
//! - `oci:DIR[:REF]`, `oci-archive:FILE[:REF]`, `docker-archive:FILE[:REF]` (skopeo's syntax);
//! - `podman://IMAGE[:TAG]`, `dockerd://IMAGE[:TAG]`.
//!
//! [`Reference`]'s `Display` writes the canonical form, which parses back to the same value
//! (`REGISTRY#REPOSITORY:TAG` for registry images).

use std::fmt;
use std::path::{Component, Path, PathBuf};

use super::{ImageError, Reference, RegistryRef};

/// Docker Hub's registry host, used when a reference names no registry.
pub const DOCKER_HUB: &str = "registry-1.docker.io";

/// The tag used when a registry reference has neither tag nor digest.
pub const DEFAULT_TAG: &str = "latest";

/// Repository names longer than this are refused (the distribution spec's limit).
const MAX_NAME_LEN: usize = 255;

const FORMS: &str = "expected [USER@][REGISTRY#]IMAGE[:TAG][@sha256:DIGEST], \
docker://[USER@][REGISTRY/]IMAGE[:TAG][@sha256:DIGEST], an absolute or ./relative path to a \
.sqsh, .squashfs or .sif file, oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE[:REF], \
podman://IMAGE[:TAG] or dockerd://IMAGE[:TAG]";

/// Parses an image reference; relative paths are made absolute against the current directory.
pub fn parse(text: &str) -> Result<Reference, ImageError> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    parse_in(text, &cwd)
}

/// [`parse`] with relative paths resolved against `cwd` (lexically: `..` is not followed through
/// symlinks, as a user reading the command line would expect).
pub fn parse_in(text: &str, cwd: &Path) -> Result<Reference, ImageError> {
    let err = |why: String| ImageError::Reference(text.to_string(), why);
    let part = |e: ImageError| e.in_reference(text);
    if text.is_empty() {
        return Err(err(format!("empty; {FORMS}")));
    }
    if let Some(c) = text.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(err(format!("contains the character {c:?}; {FORMS}")));
    }
    if let Some(rest) = text.strip_prefix("docker://") {
        return parse_docker(rest).map(Reference::Registry).map_err(part);
    }
    if let Some(rest) = text.strip_prefix("podman://") {
        return local_name(rest).map(Reference::Podman).map_err(part);
    }
    if let Some(rest) = text.strip_prefix("dockerd://") {
        return local_name(rest).map(Reference::Dockerd).map_err(part);
    }
    if let Some(rest) = text.strip_prefix("oci:") {
        let (dir, name) = path_and_name(rest, cwd).map_err(part)?;
        return Ok(Reference::OciLayout { dir, name });
    }
    if let Some(rest) = text.strip_prefix("oci-archive:") {
        let (file, name) = path_and_name(rest, cwd).map_err(part)?;
        return Ok(Reference::OciArchive { file, name });
    }
    if let Some(rest) = text.strip_prefix("docker-archive:") {
        let (file, name) = path_and_name(rest, cwd).map_err(part)?;
        return Ok(Reference::DockerArchive { file, name });
    }
    if text.starts_with('/') || text.starts_with('.') {
        return parse_file(text, cwd).map_err(part);
    }
    if let Some((scheme, _)) = text.split_once("://") {
        return Err(err(format!("unknown transport '{scheme}://'; {FORMS}")));
    }
    parse_enroot(text).map(Reference::Registry).map_err(part)
}

fn parse_file(text: &str, cwd: &Path) -> Result<Reference, ImageError> {
    let path = absolute(Path::new(text), cwd);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem_ok = |ext: &str| name.len() > ext.len() && name.ends_with(ext);
    if stem_ok(".sqsh") || stem_ok(".squashfs") {
        Ok(Reference::Squashfs(path))
    } else if stem_ok(".sif") {
        Ok(Reference::Sif(path))
    } else {
        syntax(format!(
            "a path must name a .sqsh, .squashfs or .sif file (use oci:, oci-archive: or \
             docker-archive: for other kinds); {FORMS}"
        ))
    }
}

/// What is wrong with part of a reference; [`parse_in`] names the whole reference.
fn syntax<T>(why: impl Into<String>) -> Result<T, ImageError> {
    Err(ImageError::ReferenceSyntax(why.into()))
}

/// `PATH[:NAME]` of skopeo's `oci:`-style transports: like skopeo, the first `:` ends the path.
fn path_and_name(rest: &str, cwd: &Path) -> Result<(PathBuf, Option<String>), ImageError> {
    let (path, name) = match rest.split_once(':') {
        Some((p, n)) => (p, Some(n)),
        None => (rest, None),
    };
    if path.is_empty() {
        return syntax(format!("no path given; {FORMS}"));
    }
    let name = match name {
        None => None,
        Some("") => return syntax("empty name after ':'".to_string()),
        Some(n) => Some(n.to_string()),
    };
    Ok((absolute(Path::new(path), cwd), name))
}

fn local_name(rest: &str) -> Result<String, ImageError> {
    if rest.is_empty() {
        return syntax(format!("no image name given; {FORMS}"));
    }
    let (name, tag) = split_tag(rest);
    if let Some(tag) = tag {
        check_tag(tag)?;
    }
    for component in name.split('/') {
        if component.is_empty() {
            return syntax(format!("empty path component in '{name}'"));
        }
    }
    Ok(rest.to_string())
}

/// Makes `path` absolute against `cwd` and removes `.`, `..` and repeated separators lexically.
fn absolute(path: &Path, cwd: &Path) -> PathBuf {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        cwd.join(path)
    };
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Splits a leading `USER@`: the first `@` is a user separator unless what follows it is the
/// digest (`IMAGE@sha256:…`).
fn split_user(text: &str) -> Result<(Option<String>, &str), ImageError> {
    let Some((user, rest)) = text.split_once('@') else {
        return Ok((None, text));
    };
    if looks_like_digest(rest) {
        return Ok((None, text));
    }
    if user.is_empty() {
        return syntax("empty user name before '@'".to_string());
    }
    if user.contains(['/', '#', ':']) {
        return syntax(format!("'{user}' is not a user name"));
    }
    Ok((Some(user.to_string()), rest))
}

/// `ALGORITHM:ENCODED` as the distribution grammar shapes a digest (`IMAGE@md5:…` is then refused
/// as an unsupported digest instead of read as user `IMAGE` and image `md5`).
fn looks_like_digest(text: &str) -> bool {
    if text.starts_with("sha256:") {
        return true;
    }
    let Some((algorithm, encoded)) = text.split_once(':') else {
        return false;
    };
    !algorithm.is_empty()
        && algorithm
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b))
        && encoded.len() >= 32
        && encoded
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"=_-".contains(&b))
}

/// `[USER@][REGISTRY#]IMAGE[:TAG][@DIGEST]`.
fn parse_enroot(text: &str) -> Result<RegistryRef, ImageError> {
    let (user, rest) = split_user(text)?;
    let (registry, image) = match rest.split_once('#') {
        Some((registry, image)) => {
            if registry.is_empty() {
                return syntax("empty registry before '#'".to_string());
            }
            check_registry(registry)?;
            (registry.to_string(), image)
        }
        None => {
            // Docker's `REGISTRY/IMAGE` (nvcr.io/nvidia/pytorch:TAG), which Pyxis accepts too:
            // the first component is a registry when Docker would take it for one.
            match rest.split_once('/') {
                Some((first, image)) if looks_like_registry(first) => {
                    check_registry(first)?;
                    (first.to_string(), image)
                }
                _ => (DOCKER_HUB.to_string(), rest),
            }
        }
    };
    registry_ref(user, registry, image)
}

/// Docker Hub's names as users write them (`docker.io#ubuntu`, `docker.io/ubuntu`): the same
/// registry as no registry at all, so `ubuntu` is `library/ubuntu` there too.
fn canonical_registry(registry: String) -> String {
    match registry.as_str() {
        "docker.io" | "index.docker.io" | "registry.hub.docker.com" => DOCKER_HUB.to_string(),
        _ => registry,
    }
}

/// `[USER@][REGISTRY/]IMAGE[:TAG][@DIGEST]` after `docker://`.
fn parse_docker(text: &str) -> Result<RegistryRef, ImageError> {
    if text.is_empty() {
        return syntax(format!("no image after 'docker://'; {FORMS}"));
    }
    let (user, rest) = match text.split_once('/') {
        // Only a '@' in the first component can be a user separator.
        Some((first, _)) if first.contains('@') => split_user(text)?,
        Some(_) => (None, text),
        None => split_user(text)?,
    };
    if rest.contains('#') {
        return syntax(
            "'#' is Enroot syntax: drop 'docker://' or write REGISTRY/IMAGE".to_string(),
        );
    }
    let (registry, image) = match rest.split_once('/') {
        Some((first, image)) if looks_like_registry(first) => {
            check_registry(first)?;
            (first.to_string(), image)
        }
        _ => (DOCKER_HUB.to_string(), rest),
    };
    registry_ref(user, registry, image)
}

/// Docker's rule for telling `host/repo` from `user/repo`.
fn looks_like_registry(component: &str) -> bool {
    component.contains('.') || component.contains(':') || component == "localhost"
}

fn registry_ref(
    user: Option<String>,
    registry: String,
    image: &str,
) -> Result<RegistryRef, ImageError> {
    if image.is_empty() {
        return syntax("no image name given".to_string());
    }
    let (named, digest) = match image.split_once('@') {
        Some((named, digest)) => {
            check_digest(digest)?;
            (named, Some(digest.to_string()))
        }
        None => (image, None),
    };
    let (name, tag) = split_tag(named);
    if let Some(tag) = tag {
        check_tag(tag)?;
    }
    check_repository(name)?;
    let registry = canonical_registry(registry);
    let mut repository = name.to_string();
    if registry == DOCKER_HUB && !repository.contains('/') {
        repository = format!("library/{repository}");
    }
    let tag = match (tag, &digest) {
        (Some(tag), _) => Some(tag.to_string()),
        (None, None) => Some(DEFAULT_TAG.to_string()),
        (None, Some(_)) => None,
    };
    Ok(RegistryRef {
        registry,
        repository,
        tag,
        digest,
        user,
    })
}

/// Splits `NAME[:TAG]`, where the tag follows the last ':' after the last '/'.
fn split_tag(named: &str) -> (&str, Option<&str>) {
    let last_slash = named.rfind('/').map_or(0, |i| i + 1);
    match named[last_slash..].rfind(':') {
        Some(i) => (&named[..last_slash + i], Some(&named[last_slash + i + 1..])),
        None => (named, None),
    }
}

/// `path-component ("/" path-component)*`, each `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`.
fn check_repository(name: &str) -> Result<(), ImageError> {
    if name.is_empty() {
        return syntax("empty image name".to_string());
    }
    if name.len() > MAX_NAME_LEN {
        return syntax(format!("image name longer than {MAX_NAME_LEN} characters"));
    }
    for component in name.split('/') {
        if component.is_empty() {
            return syntax(format!("empty path component in image name '{name}'"));
        }
        if component.chars().any(|c| c.is_ascii_uppercase()) {
            return syntax(format!(
                "image name '{name}' must be lower case (repository names are)"
            ));
        }
        if !path_component_ok(component) {
            return syntax(format!(
                "'{component}' in '{name}' is not a valid image name component (lower-case \
                 letters and digits, separated by '.', '_', '__' or dashes)"
            ));
        }
    }
    Ok(())
}

fn path_component_ok(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator run: '.', '_', '__' or one or more '-'.
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// `[\w][\w.-]{0,127}`.
fn check_tag(tag: &str) -> Result<(), ImageError> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut chars = tag.chars();
    let ok = match chars.next() {
        Some(first) => {
            word(first) && tag.len() <= 128 && chars.all(|c| word(c) || c == '.' || c == '-')
        }
        None => false,
    };
    if ok {
        Ok(())
    } else if tag.is_empty() {
        syntax("empty tag after ':'".to_string())
    } else {
        syntax(format!(
            "'{tag}' is not a valid tag (letters, digits, '_', '.', '-', not starting with '.' \
             or '-', at most 128 characters)"
        ))
    }
}

/// `sha256:` + 64 lower-case hex digits: the only digest algorithm berth verifies.
pub fn check_digest(digest: &str) -> Result<(), ImageError> {
    let Some(hex) = digest.strip_prefix("sha256:") else {
        return syntax(format!(
            "'{digest}' is not a supported digest (expected sha256:<64 hex digits>)"
        ));
    };
    if hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        syntax(format!(
            "'{digest}' is not a valid digest (expected sha256:<64 lower-case hex digits>)"
        ))
    }
}

/// `host[:port]` where host is DNS labels, an IPv4 address or a bracketed IPv6 address.
fn check_registry(registry: &str) -> Result<(), ImageError> {
    let bad = || {
        ImageError::ReferenceSyntax(format!(
            "'{registry}' is not a valid registry (expected HOST[:PORT], e.g. nvcr.io or 127.0.0.1:5000)"
        ))
    };
    let (host, port) = if let Some(rest) = registry.strip_prefix('[') {
        let (v6, after) = rest.split_once(']').ok_or_else(bad)?;
        if v6.is_empty()
            || !v6
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
        {
            return Err(bad());
        }
        match after {
            "" => (registry, None),
            p => (registry, Some(p.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match registry.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (registry, None),
        }
    };
    if let Some(port) = port
        && (port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(bad());
    }
    if host.starts_with('[') {
        return Ok(());
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || !host.split('.').all(label_ok) {
        return Err(bad());
    }
    Ok(())
}

impl RegistryRef {
    /// `REGISTRY/REPOSITORY[:TAG][@DIGEST]`, the image as registries and error messages name it.
    pub fn image_name(&self) -> String {
        let mut s = format!("{}/{}", self.registry, self.repository);
        if let Some(tag) = &self.tag {
            s.push(':');
            s.push_str(tag);
        }
        if let Some(digest) = &self.digest {
            s.push('@');
            s.push_str(digest);
        }
        s
    }
}

/// The canonical form is Enroot's `[USER@]REGISTRY#REPOSITORY[:TAG][@DIGEST]`: unlike
/// `docker://`, it can name any registry (a host without `.` or `:` would read as a Docker Hub
/// user there).
impl fmt::Display for RegistryRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(user) = &self.user {
            write!(f, "{user}@")?;
        }
        write!(f, "{}#{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let with_name = |f: &mut fmt::Formatter<'_>, scheme: &str, p: &Path, n: &Option<String>| {
            write!(f, "{scheme}:{}", p.display())?;
            match n {
                Some(n) => write!(f, ":{n}"),
                None => Ok(()),
            }
        };
        match self {
            Reference::Registry(r) => r.fmt(f),
            Reference::Squashfs(p) | Reference::Sif(p) => write!(f, "{}", p.display()),
            Reference::OciLayout { dir, name } => with_name(f, "oci", dir, name),
            Reference::OciArchive { file, name } => with_name(f, "oci-archive", file, name),
            Reference::DockerArchive { file, name } => with_name(f, "docker-archive", file, name),
            Reference::Podman(n) => write!(f, "podman://{n}"),
            Reference::Dockerd(n) => write!(f, "dockerd://{n}"),
        }
    }
}

/// The canonical text of a reference: the key of its record in `refs/` and what `berth images
/// ls` shows. The registry user (`USER@`) is not part of it: it says whose credentials pulled
/// the image, not which image it is.
pub fn reference_key(r: &Reference) -> String {
    let path = |p: &Path| p.display().to_string();
    let named = |scheme: &str, p: &Path, name: &Option<String>| match name {
        Some(n) => format!("{scheme}:{}:{n}", path(p)),
        None => format!("{scheme}:{}", path(p)),
    };
    match r {
        Reference::Registry(x) => {
            let mut s = format!("docker://{}/{}", x.registry, x.repository);
            if let Some(t) = &x.tag {
                s.push(':');
                s.push_str(t);
            }
            if let Some(d) = &x.digest {
                s.push('@');
                s.push_str(d);
            }
            s
        }
        Reference::Squashfs(p) => path(p),
        Reference::Sif(p) => path(p),
        Reference::OciLayout { dir, name } => named("oci", dir, name),
        Reference::OciArchive { file, name } => named("oci-archive", file, name),
        Reference::DockerArchive { file, name } => named("docker-archive", file, name),
        Reference::Podman(s) => format!("podman://{s}"),
        Reference::Dockerd(s) => format!("dockerd://{s}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn reg(
        registry: &str,
        repository: &str,
        tag: Option<&str>,
        digest: Option<&str>,
        user: Option<&str>,
    ) -> Reference {
        Reference::Registry(RegistryRef {
            registry: registry.into(),
            repository: repository.into(),
            tag: tag.map(Into::into),
            digest: digest.map(Into::into),
            user: user.map(Into::into),
        })
    }

    fn p(text: &str) -> Result<Reference, ImageError> {
        parse_in(text, Path::new("/home/u/work"))
    }

    #[test]
    fn pyxis_024_forms_name_the_same_images() {
        let show = |t: &str| p(t).unwrap().to_string();
        assert_eq!(
            show("docker.io/ubuntu:24.04"),
            "registry-1.docker.io#library/ubuntu:24.04"
        );
        assert_eq!(
            show("docker.io#ubuntu:24.04"),
            "registry-1.docker.io#library/ubuntu:24.04"
        );
        assert_eq!(
            show("index.docker.io#nvidia/cuda"),
            "registry-1.docker.io#nvidia/cuda:latest"
        );
        assert_eq!(
            show("nvcr.io/nvidia/pytorch:24.01-py3"),
            show("nvcr.io#nvidia/pytorch:24.01-py3")
        );
        assert_eq!(show("localhost:5000/a"), "localhost:5000#a:latest");
        assert_eq!(
            show("bob@127.0.0.1:5000/test/busybox:1"),
            show("bob@127.0.0.1:5000#test/busybox:1")
        );
        // A first component that is no registry is a Docker Hub user, as before.
        assert_eq!(
            show("nvidia/cuda:12"),
            "registry-1.docker.io#nvidia/cuda:12"
        );
    }

    #[test]
    fn registry_forms() {
        let hub = DOCKER_HUB;
        let with_digest = format!("ubuntu@{D}");
        let tag_and_digest = format!("nvcr.io#nvidia/pytorch:24.01-py3@{D}");
        let user_digest = format!("alice@nvcr.io#nvidia/pytorch@{D}");
        let docker_digest = format!("docker://127.0.0.1:5000/test/busybox@{D}");
        let docker_user_digest = format!("docker://bob@nvcr.io/nvidia/cuda:12.3@{D}");
        let cases: Vec<(&str, Reference)> = vec![
            (
                "ubuntu",
                reg(hub, "library/ubuntu", Some("latest"), None, None),
            ),
            (
                "ubuntu:22.04",
                reg(hub, "library/ubuntu", Some("22.04"), None, None),
            ),
            (
                "nvidia/cuda:12.3.1-base",
                reg(hub, "nvidia/cuda", Some("12.3.1-base"), None, None),
            ),
            (
                "localhost:5000#a/b:1",
                reg("localhost:5000", "a/b", Some("1"), None, None),
            ),
            (
                "nvcr.io#nvidia/pytorch:24.01-py3",
                reg("nvcr.io", "nvidia/pytorch", Some("24.01-py3"), None, None),
            ),
            (
                "user@nvcr.io#nvidia/pytorch",
                reg(
                    "nvcr.io",
                    "nvidia/pytorch",
                    Some("latest"),
                    None,
                    Some("user"),
                ),
            ),
            ("myreg#img", reg("myreg", "img", Some("latest"), None, None)),
            (
                "127.0.0.1:5000#x",
                reg("127.0.0.1:5000", "x", Some("latest"), None, None),
            ),
            (
                "[::1]:5000#x:y",
                reg("[::1]:5000", "x", Some("y"), None, None),
            ),
            (
                &with_digest,
                reg(hub, "library/ubuntu", None, Some(D), None),
            ),
            (
                &tag_and_digest,
                reg(
                    "nvcr.io",
                    "nvidia/pytorch",
                    Some("24.01-py3"),
                    Some(D),
                    None,
                ),
            ),
            (
                &user_digest,
                reg("nvcr.io", "nvidia/pytorch", None, Some(D), Some("alice")),
            ),
            (
                "docker://ubuntu",
                reg(hub, "library/ubuntu", Some("latest"), None, None),
            ),
            (
                "docker://nvidia/cuda",
                reg(hub, "nvidia/cuda", Some("latest"), None, None),
            ),
            (
                "docker://127.0.0.1:5000/test/busybox:1",
                reg("127.0.0.1:5000", "test/busybox", Some("1"), None, None),
            ),
            (
                "docker://localhost/a",
                reg("localhost", "a", Some("latest"), None, None),
            ),
            (
                "docker://nvcr.io/nvidia/pytorch:24.01-py3",
                reg("nvcr.io", "nvidia/pytorch", Some("24.01-py3"), None, None),
            ),
            (
                &docker_digest,
                reg("127.0.0.1:5000", "test/busybox", None, Some(D), None),
            ),
            (
                &docker_user_digest,
                reg("nvcr.io", "nvidia/cuda", Some("12.3"), Some(D), Some("bob")),
            ),
            (
                "docker://$oauthtoken@nvcr.io/nvidia/cuda",
                reg(
                    "nvcr.io",
                    "nvidia/cuda",
                    Some("latest"),
                    None,
                    Some("$oauthtoken"),
                ),
            ),
            (
                "a__b/c-d--e.f_g:T_1.x-",
                reg(hub, "a__b/c-d--e.f_g", Some("T_1.x-"), None, None),
            ),
        ];
        for (text, want) in cases {
            let got = p(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(got, want, "{text}");
            // The canonical form parses back to the same reference.
            let again = p(&got.to_string()).unwrap_or_else(|e| panic!("{got}: {e}"));
            assert_eq!(again, got, "round trip of {text} via {got}");
        }
    }

    #[test]
    fn canonical_form() {
        let show = |t: &str| p(t).unwrap().to_string();
        assert_eq!(show("ubuntu"), "registry-1.docker.io#library/ubuntu:latest");
        assert_eq!(
            show("docker://u@127.0.0.1:5000/a/b:1"),
            "u@127.0.0.1:5000#a/b:1"
        );
        assert_eq!(show(&format!("myreg#x@{D}")), format!("myreg#x@{D}"));
        assert_eq!(show("./a.sqsh"), "/home/u/work/a.sqsh");
        assert_eq!(show("oci:/l:v1"), "oci:/l:v1");
    }

    #[test]
    fn file_and_transport_forms() {
        let cases: Vec<(&str, Reference)> = vec![
            (
                "/images/a.sqsh",
                Reference::Squashfs("/images/a.sqsh".into()),
            ),
            (
                "./a.squashfs",
                Reference::Squashfs("/home/u/work/a.squashfs".into()),
            ),
            (
                "../x/./y//a.sqsh",
                Reference::Squashfs("/home/u/x/y/a.sqsh".into()),
            ),
            ("/a/../b.sif", Reference::Sif("/b.sif".into())),
            (
                "oci:./layout",
                Reference::OciLayout {
                    dir: "/home/u/work/layout".into(),
                    name: None,
                },
            ),
            (
                "oci:/l:v1",
                Reference::OciLayout {
                    dir: "/l".into(),
                    name: Some("v1".into()),
                },
            ),
            (
                "oci-archive:img.tar:latest",
                Reference::OciArchive {
                    file: "/home/u/work/img.tar".into(),
                    name: Some("latest".into()),
                },
            ),
            (
                "docker-archive:/tmp/s.tar",
                Reference::DockerArchive {
                    file: "/tmp/s.tar".into(),
                    name: None,
                },
            ),
            (
                "podman://busybox:1.36",
                Reference::Podman("busybox:1.36".into()),
            ),
            (
                "dockerd://library/ubuntu",
                Reference::Dockerd("library/ubuntu".into()),
            ),
        ];
        for (text, want) in cases {
            let got = p(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(got, want, "{text}");
            assert_eq!(p(&got.to_string()).unwrap(), got, "round trip of {text}");
        }
    }

    #[test]
    fn rejections_are_one_line_and_say_why() {
        let cases = [
            ("", "empty"),
            ("Ubuntu", "lower case"),
            ("docker://127.0.0.1:5000/Test/busybox", "lower case"),
            ("nvcr.io#NVIDIA/pytorch", "lower case"),
            ("ubuntu:", "empty tag"),
            ("ubuntu:.x", "not a valid tag"),
            ("#ubuntu", "empty registry"),
            ("nvcr.io#", "no image"),
            ("@nvcr.io#a", "empty user"),
            ("a//b", "empty path component"),
            ("a/", "empty path component"),
            ("ubuntu@sha256:abc", "not a valid digest"),
            (
                "ubuntu@md5:0123456789abcdef0123456789abcdef",
                "not a supported digest",
            ),
            (
                "ubuntu@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef",
                "not a valid digest",
            ),
            ("a-/b", "not a valid image name component"),
            ("a...b", "not a valid image name component"),
            ("bad_host.io/a", "not a valid registry"),
            ("bad_host#a", "not a valid registry"),
            ("host:99x#a", "not a valid registry"),
            ("docker://", "no image"),
            ("docker://nvcr.io#a", "Enroot syntax"),
            ("shub://x/y", "unknown transport 'shub://'"),
            ("/tmp/image.tar", ".sqsh, .squashfs or .sif"),
            ("/.sqsh", ".sqsh, .squashfs or .sif"),
            ("oci:", "no path"),
            ("oci:/x:", "empty name"),
            ("podman://", "no image"),
            ("ubuntu latest", "character"),
        ];
        for (text, want) in cases {
            let msg = match p(text) {
                Ok(r) => panic!("{text:?} parsed as {r:?}"),
                Err(e) => e.to_string(),
            };
            assert!(msg.contains(want), "{text:?}: {msg}");
            assert!(!msg.contains('\n'), "{text:?}: {msg}");
            assert!(msg.contains(&format!("'{text}'")), "names the input: {msg}");
        }
        let long = format!("a/{}", "b".repeat(300));
        assert!(p(&long).unwrap_err().to_string().contains("longer than"));
    }

    #[test]
    fn unknown_forms_list_every_accepted_form() {
        let msg = p("shub://x").unwrap_err().to_string();
        for form in [
            "docker://",
            "REGISTRY#",
            ".sqsh",
            ".sif",
            "oci:",
            "oci-archive:",
        ] {
            assert!(msg.contains(form), "{msg}");
        }
        for form in ["docker-archive:", "podman://", "dockerd://"] {
            assert!(msg.contains(form), "{msg}");
        }
    }

    #[test]
    fn component_grammar() {
        for ok in ["a", "a0", "a.b", "a_b", "a__b", "a-b", "a---b", "0"] {
            assert!(path_component_ok(ok), "{ok}");
        }
        for bad in [
            "", "-a", "a-", "_a", "a_", "a___b", "a._b", "a.-b", "a..b", "A", "a:b",
        ] {
            assert!(!path_component_ok(bad), "{bad}");
        }
        check_tag(&"t".repeat(128)).unwrap();
        assert!(check_tag(&"t".repeat(129)).is_err());
    }

    /// A small xorshift generator: the fuzz test must be reproducible and needs no crate.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn random_strings_never_panic() {
        const ALPHABET: &[char] = &[
            'a', 'b', 'Z', '0', '9', '.', '_', '-', '/', ':', '@', '#', ' ', '[', ']', 's', 'h',
            '2', '5', '6', 'é', '\0', '~',
        ];
        const PIECES: &[&str] = &[
            "docker://",
            "oci:",
            "oci-archive:",
            "podman://",
            "dockerd://",
            "sha256:",
            "localhost",
            ".sqsh",
            ".sif",
            "//",
            "::",
            "@@",
            "##",
            "[::1]",
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..50_000 {
            let len = (next(&mut state) % 40) as usize;
            let mut s = String::new();
            for _ in 0..len {
                let r = next(&mut state);
                if r.is_multiple_of(5) {
                    s.push_str(PIECES[(r / 5) as usize % PIECES.len()]);
                } else {
                    s.push(ALPHABET[(r / 5) as usize % ALPHABET.len()]);
                }
            }
            if let Ok(r) = p(&s) {
                // Whatever parses must print in a form that parses to the same thing.
                let again = p(&r.to_string()).unwrap_or_else(|e| panic!("{s:?} -> {r}: {e}"));
                assert_eq!(again, r, "{s:?}");
            }
        }
    }
}
