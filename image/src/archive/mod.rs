//! Importing images from files and local engines: OCI image layouts (`oci:DIR[:REF]`), tars of
//! them (`oci-archive:FILE[:REF]`), `docker save`/`podman save` archives
//! (`docker-archive:FILE[:REF]`), and the local Podman store or Docker daemon (`podman://`,
//! `dockerd://`, saved to a temporary archive in the store's `tmp/` first).
//!
//! Archives are read in place: the tar is indexed once (header by header, seeking over the
//! data) and each blob is read by seeking to it, so nothing is unpacked to disk but the layers
//! themselves. Each layer is streamed through its decompressor (gzip, zstd, or none; Docker's
//! media types included, and sniffed from the magic bytes for docker-archive) into the layer
//! extractor, several layers at once (`store.parallel_layers`). The compressed blob's sha256 is
//! checked against the manifest, and the extracted stream's against the config's
//! `rootfs.diff_ids`; a mismatch discards the layer. A docker-archive has no manifest digest: its
//! image is named by its config's digest (Docker's image ID).

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::process::Command;

use self::blobs::{DirBlobs, TarBlobs};
use self::layers::run_plan;
use self::plan::{docker_plan, oci_plan};
use super::reference::reference_key;
use super::store::{Progress, Store};
use super::{Image, ImageError, Reference};
use crate::store::StoreError;

/// JSON documents (index, manifest, config) larger than this are refused.
const MAX_JSON: u64 = 32 << 20;

fn invalid(what: &str, why: impl Into<String>) -> ImageError {
    ImageError::Invalid {
        what: what.to_string(),
        why: why.into(),
    }
}

/// Parses the archive and local-engine reference forms (`oci:`, `oci-archive:`,
/// `docker-archive:`, `podman://`, `dockerd://`); `None` for anything else. Relative paths are
/// made absolute. As in skopeo, the path ends at the first `:`.
pub fn parse_local(text: &str) -> Option<Result<Reference, ImageError>> {
    let bad = |why: &str| ImageError::Reference(text.to_string(), why.to_string());
    let path_and_name = |rest: &str| -> Result<(PathBuf, Option<String>), ImageError> {
        let (path, name) = match rest.split_once(':') {
            Some((p, n)) if !n.is_empty() => (p, Some(n.to_string())),
            Some((p, _)) => (p, None),
            None => (rest, None),
        };
        if path.is_empty() {
            return Err(bad("the path is missing"));
        }
        let abs = std::path::absolute(path).map_err(|e| bad(&e.to_string()))?;
        Ok((std::fs::canonicalize(&abs).unwrap_or(abs), name))
    };
    let engine = |rest: &str| {
        if rest.is_empty() || rest.contains(char::is_whitespace) {
            Err(bad("the image name is missing or has spaces"))
        } else {
            Ok(rest.to_string())
        }
    };
    Some(if let Some(rest) = text.strip_prefix("oci-archive:") {
        path_and_name(rest).map(|(file, name)| Reference::OciArchive { file, name })
    } else if let Some(rest) = text.strip_prefix("docker-archive:") {
        path_and_name(rest).map(|(file, name)| Reference::DockerArchive { file, name })
    } else if let Some(rest) = text.strip_prefix("oci:") {
        path_and_name(rest).map(|(dir, name)| Reference::OciLayout { dir, name })
    } else if let Some(rest) = text.strip_prefix("podman://") {
        engine(rest).map(Reference::Podman)
    } else if let Some(rest) = text.strip_prefix("dockerd://") {
        engine(rest).map(Reference::Dockerd)
    } else {
        return None;
    })
}

mod blobs;
mod layers;
mod plan;

/// Runs a local engine's save command into a file; its last stderr line on failure.
fn save_with(tool: &str, label: &str, args: &[&str], what: &str) -> Result<(), ImageError> {
    let out = Command::new(tool).args(args).output().map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            ImageError::NoTool {
                what: what.to_string(),
                tool: tool.to_string(),
            }
        } else {
            ImageError::Tool {
                what: what.to_string(),
                command: label.to_string(),
                message: e.to_string(),
            }
        }
    })?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let message = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("no error message")
        .trim_start_matches("Error: ")
        .trim_start_matches("Error response from daemon: ")
        .to_string();
    Err(ImageError::Tool {
        what: what.to_string(),
        command: label.to_string(),
        message,
    })
}

/// Imports an archive, layout, Podman or Docker image (see the module's header). A file or
/// layout is opened with this process's own credentials; see [`import_opened`] for one a user
/// named.
pub fn import(
    store: &Store,
    reference: &Reference,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    if crate::local::is_local_path(reference) {
        let opened = crate::local::Opened::open(reference, None)?;
        return import_opened(store, reference, Some(&opened), progress);
    }
    import_opened(store, reference, None, progress)
}

/// [`import`] of a file or layout already opened (as the user who named it): root reads only
/// through that fd, and a layout's blobs are opened beneath it as that user.
pub fn import_opened(
    store: &Store,
    reference: &Reference,
    opened: Option<&crate::local::Opened>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    let what = reference_key(reference);
    let opened_file = || -> Result<&crate::local::Opened, ImageError> {
        opened.ok_or_else(|| {
            ImageError::Store(StoreError::Message(format!(
                "internal error: {what} was not opened before import"
            )))
        })
    };
    match reference {
        Reference::OciLayout { name, .. } => {
            let o = opened_file()?;
            let blobs = DirBlobs {
                dir: o
                    .file
                    .try_clone()
                    .map_err(|e| invalid(&what, e.to_string()))?,
                user: o.user.clone(),
                what: what.clone(),
            };
            let plan = oci_plan(&blobs, name.as_deref(), &what)?;
            run_plan(store, &blobs, plan, reference, Some(&o.stamp), progress)
        }
        Reference::OciArchive { name, .. } => {
            let o = opened_file()?;
            let file = o
                .file
                .try_clone()
                .map_err(|e| invalid(&what, e.to_string()))?;
            let blobs = TarBlobs::index(file, &what)?;
            let plan = oci_plan(&blobs, name.as_deref(), &what)?;
            run_plan(store, &blobs, plan, reference, Some(&o.stamp), progress)
        }
        Reference::DockerArchive { name, .. } => {
            let o = opened_file()?;
            let file = o
                .file
                .try_clone()
                .map_err(|e| invalid(&what, e.to_string()))?;
            let blobs = TarBlobs::index(file, &what)?;
            let plan = docker_plan(&blobs, name.as_deref(), &what)?;
            run_plan(store, &blobs, plan, reference, Some(&o.stamp), progress)
        }
        Reference::Podman(image) | Reference::Dockerd(image) => {
            let podman = matches!(reference, Reference::Podman(_));
            let ws = store.workspace()?;
            let tmp = ws.path(if podman { "podman-save" } else { "docker-save" });
            let tmp_text = tmp.display().to_string();
            progress(&format!("saving {what} to a temporary archive"));
            let saved = if podman {
                save_with(
                    "podman",
                    "podman image save",
                    &[
                        "image",
                        "save",
                        "--format",
                        "oci-archive",
                        "-o",
                        &tmp_text,
                        image,
                    ],
                    &what,
                )
            } else {
                save_with(
                    "docker",
                    "docker save",
                    &["save", "-o", &tmp_text, image],
                    &what,
                )
            };
            let result = saved.and_then(|()| {
                let file = File::open(&tmp).map_err(|e| invalid(&what, e.to_string()))?;
                let blobs = TarBlobs::index(file, &what)?;
                let plan = if podman {
                    oci_plan(&blobs, None, &what)?
                } else {
                    docker_plan(&blobs, None, &what)?
                };
                run_plan(store, &blobs, plan, reference, None, progress)
            });
            let _ = std::fs::remove_file(&tmp);
            result
        }
        other => Err(ImageError::Format(format!(
            "{}: not an archive, layout or local engine reference",
            reference_key(other)
        ))),
    }
}

/// Builders of test images (layer tars, OCI layouts, archives) in memory and in temp dirs.
#[cfg(test)]
pub(crate) mod test_images {
    use std::collections::BTreeMap;
    use std::io::{Read, Write};
    use std::path::Path;

    use sha2::{Digest as _, Sha256};

    use super::plan::REF_NAME;

    pub fn sha(bytes: &[u8]) -> String {
        format!("sha256:{:x}", Sha256::digest(bytes))
    }

    /// A layer tar holding `files` (path, content); directories are implied.
    pub fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in files {
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_mtime(0);
            b.append_data(&mut h, path, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    pub fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    pub fn zstd(data: &[u8]) -> Vec<u8> {
        zstd::stream::encode_all(data, 3).unwrap()
    }

    #[derive(Clone, Copy)]
    pub enum Comp {
        None,
        Gzip,
        Zstd,
    }

    fn write_blob(dir: &Path, bytes: &[u8]) -> String {
        let digest = sha(bytes);
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::write(blobs.join(&digest[7..]), bytes).unwrap();
        digest
    }

    pub fn config(diff_ids: &[String]) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .unwrap()
    }

    /// Adds an image to the OCI layout in `dir` (index.json rewritten); returns its manifest
    /// digest.
    pub fn add_to_layout(dir: &Path, name: Option<&str>, layers: &[(Vec<u8>, Comp)]) -> String {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        let diff_ids: Vec<String> = layers.iter().map(|(t, _)| sha(t)).collect();
        let cfg = config(&diff_ids);
        let cfg_digest = write_blob(dir, &cfg);
        let descs: Vec<serde_json::Value> = layers
            .iter()
            .map(|(tar, comp)| {
                let (blob, mt) = match comp {
                    Comp::None => (tar.clone(), "application/vnd.oci.image.layer.v1.tar"),
                    Comp::Gzip => (gzip(tar), "application/vnd.oci.image.layer.v1.tar+gzip"),
                    Comp::Zstd => (zstd(tar), "application/vnd.oci.image.layer.v1.tar+zstd"),
                };
                let d = write_blob(dir, &blob);
                serde_json::json!({"mediaType": mt, "digest": d, "size": blob.len()})
            })
            .collect();
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg.len()},
            "layers": descs,
        }))
        .unwrap();
        let m_digest = write_blob(dir, &manifest);
        let index_path = dir.join("index.json");
        let mut index: serde_json::Value = std::fs::read(&index_path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_else(|| serde_json::json!({"schemaVersion": 2, "manifests": []}));
        let mut desc = serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": m_digest,
            "size": manifest.len(),
        });
        if let Some(n) = name {
            desc["annotations"] = serde_json::json!({REF_NAME: n});
        }
        index["manifests"].as_array_mut().unwrap().push(desc);
        std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
        m_digest
    }

    /// A tar of a directory (an oci-archive of a layout).
    pub fn tar_dir(dir: &Path) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        b.append_dir_all(".", dir).unwrap();
        b.into_inner().unwrap()
    }

    /// A `docker save` archive with the given images (tags, layer tars); the second copy of a
    /// layer is a symlink to the first, as Docker writes them. Returns the config digests.
    pub fn docker_archive(path: &Path, images: &[(&[&str], &[Vec<u8>])]) -> Vec<String> {
        let mut b = tar::Builder::new(Vec::new());
        let mut manifest = Vec::new();
        let mut written: BTreeMap<String, String> = BTreeMap::new();
        let mut digests = Vec::new();
        let add = |b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8]| {
            let mut h = tar::Header::new_ustar();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, data).unwrap();
        };
        for (i, (tags, layers)) in images.iter().enumerate() {
            // A gzip layer's diff_id is the digest of the tar inside.
            let diff_ids: Vec<String> = layers
                .iter()
                .map(|t| {
                    if t.starts_with(&[0x1f, 0x8b]) {
                        let mut plain = Vec::new();
                        flate2::read::GzDecoder::new(&t[..])
                            .read_to_end(&mut plain)
                            .unwrap();
                        sha(&plain)
                    } else {
                        sha(t)
                    }
                })
                .collect();
            let cfg = config(&diff_ids);
            let cfg_name = format!("{}.json", &sha(&cfg)[7..]);
            digests.push(sha(&cfg));
            add(&mut b, &cfg_name, &cfg);
            let mut names = Vec::new();
            for (j, tar) in layers.iter().enumerate() {
                let name = format!("img{i}-layer{j}/layer.tar");
                let id = sha(tar);
                if let Some(first) = written.get(&id) {
                    let mut h = tar::Header::new_ustar();
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    b.append_link(&mut h, &name, format!("../{first}")).unwrap();
                } else {
                    add(&mut b, &name, tar);
                    written.insert(id, name.clone());
                }
                names.push(name);
            }
            manifest
                .push(serde_json::json!({"Config": cfg_name, "RepoTags": tags, "Layers": names}));
        }
        add(
            &mut b,
            "manifest.json",
            &serde_json::to_vec(&manifest).unwrap(),
        );
        std::fs::write(path, b.into_inner().unwrap()).unwrap();
        digests
    }
}

#[cfg(test)]
mod tests {
    use super::test_images::*;
    use super::*;
    use std::path::Path;
    use std::sync::Mutex;

    use super::blobs::member_name;
    use super::layers::sniff;
    use super::plan::{
        Compression, Descriptor, Platform, REF_NAME, choose, compression, host_platform,
        names_match,
    };
    use crate::Rootfs;
    use crate::store::quiet;

    fn store(dir: &Path) -> Store {
        Store::open_at(&dir.join("store"), 3).unwrap()
    }

    fn layers_in(store: &Store) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(store.root().join("layers"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn tmp_is_clean(store: &Store) -> bool {
        // Only this process's own (empty) workspace may remain.
        std::fs::read_dir(store.root().join("tmp"))
            .unwrap()
            .flatten()
            .all(|e| !e.path().is_dir() || std::fs::read_dir(e.path()).unwrap().count() == 0)
    }

    #[test]
    fn local_references_parse_like_skopeo() {
        let r = parse_local("oci-archive:/x/a.tar:v1").unwrap().unwrap();
        assert_eq!(
            r,
            Reference::OciArchive {
                file: "/x/a.tar".into(),
                name: Some("v1".into())
            }
        );
        let r = parse_local("docker-archive:/x/d.tar:busybox:latest")
            .unwrap()
            .unwrap();
        assert_eq!(
            r,
            Reference::DockerArchive {
                file: "/x/d.tar".into(),
                name: Some("busybox:latest".into())
            }
        );
        let r = parse_local("oci:/x/layout").unwrap().unwrap();
        assert_eq!(
            r,
            Reference::OciLayout {
                dir: "/x/layout".into(),
                name: None
            }
        );
        let r = parse_local("oci:rel").unwrap().unwrap();
        assert!(matches!(r, Reference::OciLayout { dir, .. } if dir.is_absolute()));
        assert_eq!(
            parse_local("podman://localhost/img:1").unwrap().unwrap(),
            Reference::Podman("localhost/img:1".into())
        );
        assert_eq!(
            parse_local("dockerd://busybox").unwrap().unwrap(),
            Reference::Dockerd("busybox".into())
        );
        parse_local("oci:").unwrap().unwrap_err();
        parse_local("podman://").unwrap().unwrap_err();
        assert!(parse_local("ubuntu:22.04").is_none());
    }

    #[test]
    fn names_compare_as_people_write_them() {
        assert!(names_match("docker.io/library/busybox:latest", "busybox"));
        assert!(names_match("localhost/test:v1", "test:v1"));
        assert!(!names_match("test:v1", "test:v2"));
        assert_eq!(
            member_name("./blobs/sha256/ab"),
            Some("blobs/sha256/ab".into())
        );
        assert_eq!(member_name("a/../../x"), None);
        assert_eq!(member_name("a/b/../c"), Some("a/c".into()));
    }

    fn desc(name: Option<&str>, platform: Option<(&str, &str)>) -> Descriptor {
        Descriptor {
            media_type: String::new(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: None,
            annotations: name
                .map(|n| [(REF_NAME.to_string(), n.to_string())].into())
                .unwrap_or_default(),
            platform: platform.map(|(os, arch)| Platform {
                os: os.into(),
                architecture: arch.into(),
            }),
        }
    }

    #[test]
    fn manifests_are_chosen_by_name_or_platform() {
        let two = [desc(Some("v1"), None), desc(Some("v2"), None)];
        assert!(std::ptr::eq(
            choose(&two, Some("v2"), "x").unwrap(),
            &two[1]
        ));
        let e = choose(&two, None, "oci:/l").unwrap_err().to_string();
        assert!(e.contains("v1, v2") && e.contains("oci:/l:v1"), "{e}");
        let e = choose(&two, Some("v3"), "oci:/l").unwrap_err().to_string();
        assert!(
            e.contains("no image named 'v3'") && e.contains("v1, v2"),
            "{e}"
        );
        let plat = [
            desc(None, Some(("linux", "arm64"))),
            desc(None, Some(("linux", host_platform().1))),
        ];
        assert!(std::ptr::eq(choose(&plat, None, "x").unwrap(), &plat[1]));
        let other = [
            desc(None, Some(("linux", "s390x"))),
            desc(None, Some(("windows", "amd64"))),
        ];
        let e = choose(&other, None, "x").unwrap_err().to_string();
        assert!(e.contains("linux/s390x, windows/amd64"), "{e}");
    }

    #[test]
    fn layer_media_types_oci_and_docker() {
        assert_eq!(
            compression("application/vnd.oci.image.layer.v1.tar"),
            Some(Compression::None)
        );
        assert_eq!(
            compression("application/vnd.oci.image.layer.v1.tar+gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            compression("application/vnd.oci.image.layer.v1.tar+zstd"),
            Some(Compression::Zstd)
        );
        assert_eq!(
            compression("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            compression("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            compression("application/vnd.oci.image.layer.v1.tar+bzip2"),
            None
        );
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(sniff(&[0x28, 0xb5, 0x2f, 0xfd]), Compression::Zstd);
        assert_eq!(sniff(b"etc/"), Compression::None);
    }

    #[test]
    fn a_nested_index_resolves_to_the_host_platform() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let arm = add_to_layout(&layout, None, &[(layer(&[("arch", b"arm64")]), Comp::Gzip)]);
        let host = add_to_layout(&layout, None, &[(layer(&[("arch", b"host")]), Comp::Gzip)]);
        let size = |d: &str| {
            std::fs::metadata(layout.join("blobs/sha256").join(&d[7..]))
                .unwrap()
                .len()
        };
        let nested = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm, "size": size(&arm),
                 "platform": {"os": "linux", "architecture": "arm64"}},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": host, "size": size(&host),
                 "platform": {"os": "linux", "architecture": host_platform().1}},
            ],
        }))
        .unwrap();
        let nested_digest = sha(&nested);
        std::fs::write(
            layout.join("blobs/sha256").join(&nested_digest[7..]),
            &nested,
        )
        .unwrap();
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json", "digest": nested_digest,
            "size": nested.len(), "annotations": {REF_NAME: "multi"}}]});
        std::fs::write(
            layout.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
        let s = store(t.path());
        let r = Reference::OciLayout {
            dir: layout,
            name: Some("multi".into()),
        };
        let image = import(&s, &r, &quiet).unwrap();
        assert_eq!(image.digest, host, "the host platform's manifest");
        let Rootfs::Layers(dirs) = &image.rootfs else {
            panic!()
        };
        assert_eq!(std::fs::read(dirs[0].join("arch")).unwrap(), b"host");
    }

    #[test]
    fn layouts_and_oci_archives_import_with_every_compression() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let l1 = layer(&[("bin/tool", b"v1"), ("etc/a", b"a")]);
        let l2 = layer(&[("etc/b", b"b")]);
        let l3 = layer(&[("etc/c", b"c")]);
        let digest = add_to_layout(
            &layout,
            Some("v1"),
            &[
                (l1.clone(), Comp::Gzip),
                (l2.clone(), Comp::Zstd),
                (l3.clone(), Comp::None),
            ],
        );
        let s = store(t.path());
        let r = Reference::OciLayout {
            dir: layout.clone(),
            name: None,
        };
        let image = import(&s, &r, &quiet).unwrap();
        assert_eq!(image.digest, digest);
        let Rootfs::Layers(dirs) = &image.rootfs else {
            panic!()
        };
        assert_eq!(dirs.len(), 3);
        assert_eq!(
            dirs[0],
            s.layer_dir(&sha(&l1)).unwrap(),
            "bottom layer first"
        );
        assert_eq!(std::fs::read(dirs[0].join("bin/tool")).unwrap(), b"v1");
        assert_eq!(std::fs::read(dirs[1].join("etc/b")).unwrap(), b"b");
        assert_eq!(std::fs::read(dirs[2].join("etc/c")).unwrap(), b"c");
        assert_eq!(
            image
                .config
                .config()
                .as_ref()
                .unwrap()
                .cmd()
                .as_ref()
                .unwrap()[0],
            "/bin/sh"
        );
        assert_eq!(s.get_local(&r), Some(image.clone()));

        let archive = t.path().join("a.tar");
        std::fs::write(&archive, tar_dir(&layout)).unwrap();
        let r2 = Reference::OciArchive {
            file: archive.clone(),
            name: Some("v1".into()),
        };
        let again = import(&s, &r2, &quiet).unwrap();
        assert_eq!(again.digest, digest, "same manifest, same image");
        assert_eq!(s.get_local(&r2).unwrap().digest, digest);
        assert!(tmp_is_clean(&s));

        // A rewritten archive is a different file: the cached reference is not used for it.
        std::fs::write(&archive, tar_dir(&layout)).unwrap();
        let f = File::options().append(true).open(&archive).unwrap();
        f.set_len(f.metadata().unwrap().len() + 512).unwrap();
        assert_eq!(s.get_local(&r2), None);
    }

    #[test]
    fn a_corrupt_blob_is_a_digest_error_and_nothing_is_published() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let l1 = layer(&[("data", &big)]);
        add_to_layout(&layout, None, &[(l1.clone(), Comp::Gzip)]);
        // Flip one byte in the middle of the layer blob.
        let path = layout.join("blobs/sha256").join(&sha(&gzip(&l1))[7..]);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let s = store(t.path());
        let e = import(
            &s,
            &Reference::OciLayout {
                dir: layout,
                name: None,
            },
            &quiet,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("is corrupt: its content has digest"), "{e}");
        assert!(!e.contains('\n'));
        assert!(layers_in(&s).is_empty(), "{:?}", layers_in(&s));
        assert!(s.list().is_empty());
        assert!(tmp_is_clean(&s));
    }

    #[test]
    fn a_wrong_diff_id_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let l1 = layer(&[("a", b"a")]);
        add_to_layout(&layout, None, &[(l1, Comp::None)]);
        // Rewrite the config with another diff_id (and the manifest and index to match).
        let other = sha(b"something else");
        let cfg = config(std::slice::from_ref(&other));
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
        let m_digest = index["manifests"][0]["digest"]
            .as_str()
            .unwrap()
            .to_string();
        let mut manifest: serde_json::Value = serde_json::from_slice(
            &std::fs::read(layout.join("blobs/sha256").join(&m_digest[7..])).unwrap(),
        )
        .unwrap();
        std::fs::write(layout.join("blobs/sha256").join(&sha(&cfg)[7..]), &cfg).unwrap();
        manifest["config"]["digest"] = sha(&cfg).into();
        manifest["config"]["size"] = cfg.len().into();
        let mbytes = serde_json::to_vec(&manifest).unwrap();
        std::fs::write(
            layout.join("blobs/sha256").join(&sha(&mbytes)[7..]),
            &mbytes,
        )
        .unwrap();
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(&mbytes), "size": mbytes.len()}]});
        std::fs::write(
            layout.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
        let s = store(t.path());
        let e = import(
            &s,
            &Reference::OciLayout {
                dir: layout,
                name: None,
            },
            &quiet,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not the expected diff_id"), "{e}");
        assert!(layers_in(&s).is_empty());
    }

    #[test]
    fn docker_archives_single_multi_and_ambiguous() {
        let t = tempfile::tempdir().unwrap();
        let base = layer(&[("bin/sh", b"sh")]);
        let app = layer(&[("app", b"app")]);
        let path = t.path().join("d.tar");
        let cfgs = docker_archive(
            &path,
            &[
                (&["base:1"], std::slice::from_ref(&base)),
                (
                    &["localhost/app:2", "app:latest"],
                    &[base.clone(), gzip(&app)],
                ),
            ],
        );
        let s = store(t.path());
        let what = |name: Option<&str>| Reference::DockerArchive {
            file: path.clone(),
            name: name.map(String::from),
        };
        let e = import(&s, &what(None), &quiet).unwrap_err().to_string();
        assert!(
            e.contains("holds several images (base:1, localhost/app:2, app:latest)"),
            "{e}"
        );
        let e = import(&s, &what(Some("nope:1")), &quiet)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no image named 'nope:1'") && e.contains("base:1"),
            "{e}"
        );

        let img = import(&s, &what(Some("app:2")), &quiet).unwrap();
        assert_eq!(
            img.digest, cfgs[1],
            "a docker-archive image is named by its config digest"
        );
        let Rootfs::Layers(dirs) = &img.rootfs else {
            panic!()
        };
        assert_eq!(std::fs::read(dirs[0].join("bin/sh")).unwrap(), b"sh");
        // The gzip layer was recognised by its magic bytes; its diff_id is of the tar inside.
        assert_eq!(std::fs::read(dirs[1].join("app")).unwrap(), b"app");
        let img0 = import(&s, &what(Some("@0")), &quiet).unwrap();
        assert_eq!(img0.digest, cfgs[0]);
        assert_eq!(
            layers_in(&s).len(),
            6,
            "two layers and their size and file records"
        );
    }

    #[test]
    fn many_layers_in_parallel_keep_their_order() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let layers: Vec<(Vec<u8>, Comp)> = (0..7)
            .map(|i| {
                (
                    layer(&[(&format!("f{i}"), format!("{i}").as_bytes())]),
                    Comp::Gzip,
                )
            })
            .collect();
        add_to_layout(&layout, None, &layers);
        let s = store(t.path());
        let lines = Mutex::new(Vec::new());
        let progress = |l: &str| lines.lock().unwrap().push(l.to_string());
        let image = import(
            &s,
            &Reference::OciLayout {
                dir: layout.clone(),
                name: None,
            },
            &progress,
        )
        .unwrap();
        let Rootfs::Layers(dirs) = &image.rootfs else {
            panic!()
        };
        for (i, d) in dirs.iter().enumerate() {
            assert!(d.join(format!("f{i}")).is_file());
        }
        let extracted = lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("extracted layer"))
            .count();
        assert_eq!(extracted, 7);
    }

    #[test]
    fn repeated_layers_are_stacked_once() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let empty = layer(&[]);
        let a = layer(&[("a", b"a")]);
        add_to_layout(
            &layout,
            None,
            &[
                (empty.clone(), Comp::None),
                (a, Comp::None),
                (empty, Comp::None),
            ],
        );
        let s = store(t.path());
        let image = import(
            &s,
            &Reference::OciLayout {
                dir: layout,
                name: None,
            },
            &quiet,
        )
        .unwrap();
        let Rootfs::Layers(dirs) = &image.rootfs else {
            panic!()
        };
        assert_eq!(dirs.len(), 2, "{dirs:?}");
    }

    #[test]
    fn not_enough_space_is_one_line_before_anything_is_written() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        add_to_layout(&layout, None, &[(layer(&[("a", b"a")]), Comp::None)]);
        let s = store(t.path());
        let e = s
            .check_space("oci:/x", u64::MAX / 2)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("not enough space in the image store"), "{e}");
        assert!(
            e.contains("needs about") && e.contains("are free") && !e.contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn missing_engines_and_files_are_one_line_errors() {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let e = import(
            &s,
            &Reference::DockerArchive {
                file: t.path().join("none.tar"),
                name: None,
            },
            &quiet,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cannot open") && !e.contains('\n'), "{e}");
        let e = import(
            &s,
            &Reference::OciLayout {
                dir: t.path().to_path_buf(),
                name: None,
            },
            &quiet,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not an OCI image layout"), "{e}");
        let e = save_with(
            "berth-no-such-tool",
            "x save",
            &["save", "-o", "x"],
            "dockerd://x",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("berth-no-such-tool is not installed"), "{e}");
        let e = save_with(
            "sh",
            "sh save",
            &["-c", "echo 'Error: boom' >&2; exit 3"],
            "podman://x",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "podman://x: sh save failed: boom");
    }
}
