#!/usr/bin/env python3
"""Writes the seed corpora of fuzz/corpus/<target>/ (run from the repository root; rerunning
rewrites the seeds and leaves other files, such as regression inputs, alone).

Seeds are real inputs: the reference forms and messages berth's own tests use, the OCI spec's
example manifest/index/config (as oci-spec ships them), layers written by Python's tarfile in
every format berth meets (ustar, GNU long names, PAX with xattrs, whiteouts, links, devices),
sylabs/sif's test images (shared/testdata/sif), squashfs images made by mksquashfs with each
compressor, and the CDI, berth.toml, plugstack and step-request shapes the docs show.
"""
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


D = "sha256:" + "a" * 64
D2 = "sha256:" + "b" * 64

# --- reference -----------------------------------------------------------------------------
refs = [
    "ubuntu", "ubuntu:22.04", "busybox:1.36", "library/ubuntu:24.04",
    "nvcr.io#nvidia/pytorch:24.01-py3", "alice@nvcr.io#nvidia/pytorch@" + D,
    "$oauthtoken@nvcr.io#nvidia/cuda:12.3.1-base", "127.0.0.1:5000#test/busybox:1",
    "[::1]:5000#x:y", "docker://127.0.0.1:5000/test/busybox@" + D,
    "docker://bob@nvcr.io/nvidia/cuda:12.3@" + D, "docker://localhost/a",
    "ghcr.io/owner/repo/img:v1.2.3", "a__b/c-d--e.f_g:T_1.x-",
    "./a.sqsh", "/home/u/work/a.squashfs", "../x/./y//a.sqsh", "/b.sif", "img.sif",
    "oci:/x/layout", "oci:rel:tag", "oci-archive:/x/a.tar:v1",
    "docker-archive:/x/d.tar:busybox:latest", "podman://localhost/img:1", "dockerd://busybox",
    "linux/arm64/v8", "amd64", D,
]
for i, r in enumerate(refs):
    put("reference", f"seed-{i:02}", r)

# --- manifest (body, NUL, content type) -----------------------------------------------------
oci = glob.glob(os.path.expanduser(
    "~/.cargo/registry/src/*/oci-spec-0.10.*/test/data"))
if oci:
    for name in ["manifest.json", "index.json", "artifact_manifest.json"]:
        p = os.path.join(oci[0], name)
        if os.path.exists(p):
            put("manifest", "oci-spec-" + name, open(p, "rb").read())
    p = os.path.join(oci[0], "config.json")
    if os.path.exists(p):
        put("image_config", "oci-spec-config.json", open(p, "rb").read())
docker_list = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
    "manifests": [
        {"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "size": 528,
         "digest": D, "platform": {"architecture": "amd64", "os": "linux"}},
        {"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "size": 528,
         "digest": D2, "platform": {"architecture": "arm", "os": "linux", "variant": "v7"}},
        {"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "size": 528,
         "digest": D2, "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"}},
    ],
}
put("manifest", "docker-list.json", json.dumps(docker_list, indent=3))
docker_v2 = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
    "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1457,
               "digest": D},
    "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                "size": 2152262, "digest": D2}],
}
put("manifest", "docker-v2.json", json.dumps(docker_v2, indent=3))
put("manifest", "no-media-type",
    b'{"schemaVersion":2,"config":{"digest":"' + D.encode() + b'","size":2},"layers":[]}'
    b"\0application/vnd.oci.image.manifest.v1+json; charset=utf-8")
put("manifest", "schema1", b'{"schemaVersion":1,"fsLayers":[]}')

# --- image_config ---------------------------------------------------------------------------
cfg = {
    "architecture": "amd64", "os": "linux", "created": "2024-01-01T00:00:00Z",
    "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                       "NVIDIA_VISIBLE_DEVICES=all", "EMPTY=", "NOEQ"],
               "Entrypoint": ["/opt/nvidia/nvidia_entrypoint.sh"], "Cmd": ["bash"],
               "WorkingDir": "/workspace", "User": "1000:1000",
               "Labels": {"maintainer": "x"}},
    "rootfs": {"type": "layers", "diff_ids": [D, D2]},
    "history": [{"created_by": "/bin/sh -c #(nop) ADD file:x in /"}],
}
put("image_config", "cuda-like.json", json.dumps(cfg))
put("image_config", "minimal.json",
    '{"architecture":"arm64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}')

# --- layer_tar ------------------------------------------------------------------------------
def tar_bytes(fmt, add):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        add(t)
    return buf.getvalue()


def file(t, name, data=b"hello\n", mode=0o644, **kw):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mode = mode
    ti.uid = kw.get("uid", 0)
    ti.gid = kw.get("gid", 0)
    if "pax" in kw:
        ti.pax_headers = kw["pax"]
    t.addfile(ti, io.BytesIO(data))


def entry(t, name, typ, **kw):
    ti = tarfile.TarInfo(name)
    ti.type = typ
    for k, v in kw.items():
        setattr(ti, k, v)
    t.addfile(ti)


def basic(t):
    entry(t, "etc", tarfile.DIRTYPE, mode=0o755)
    file(t, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    entry(t, "bin", tarfile.DIRTYPE, mode=0o755)
    file(t, "bin/sh", b"\x7fELF", mode=0o755)
    entry(t, "bin/ash", tarfile.SYMTYPE, linkname="sh")
    entry(t, "bin/busybox", tarfile.LNKTYPE, linkname="bin/sh")
    file(t, "usr/bin/sudo", b"x", mode=0o4755)


def whiteouts(t):
    entry(t, "etc", tarfile.DIRTYPE, mode=0o755)
    file(t, "etc/.wh.passwd", b"")
    entry(t, "opt", tarfile.DIRTYPE, mode=0o755)
    file(t, "opt/.wh..wh..opq", b"")
    file(t, "opt/new", b"n")


def special(t):
    entry(t, "dev", tarfile.DIRTYPE, mode=0o755)
    entry(t, "dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
    entry(t, "dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0, mode=0o660)
    entry(t, "run/fifo", tarfile.FIFOTYPE, mode=0o600)
    entry(t, "abs", tarfile.SYMTYPE, linkname="/etc/passwd")
    entry(t, "up", tarfile.SYMTYPE, linkname="../../etc/shadow")
    file(t, "../escape", b"x")
    file(t, "/absolute", b"x")


def long_names(t):
    file(t, "d/" + "x" * 150 + "/" + "y" * 120, b"long")
    entry(t, "l" * 120, tarfile.SYMTYPE, linkname="t" * 130)


def pax(t):
    file(t, "caps", b"x", pax={"SCHILY.xattr.security.capability": "\x01\x00\x00\x02",
                              "SCHILY.xattr.user.note": "n", "mtime": "1700000000.5",
                              "uid": "123456789", "path": "caps-renamed"})
    file(t, "big-ids", b"y", uid=2**21 - 1, gid=2**21 - 1)


for name, fmt, fn in [
    ("ustar-basic.tar", tarfile.USTAR_FORMAT, basic),
    ("gnu-whiteouts.tar", tarfile.GNU_FORMAT, whiteouts),
    ("gnu-special.tar", tarfile.GNU_FORMAT, special),
    ("gnu-long-names.tar", tarfile.GNU_FORMAT, long_names),
    ("pax-xattrs.tar", tarfile.PAX_FORMAT, pax),
    ("pax-long-names.tar", tarfile.PAX_FORMAT, long_names),
]:
    put("layer_tar", name, tar_bytes(fmt, fn))
put("layer_tar", "empty.tar", b"\0" * 1024)

# --- sif ------------------------------------------------------------------------------------
here = os.path.dirname(os.path.abspath(__file__))
for cand in [os.path.join(here, "../shared/testdata/sif"),
             os.path.join(here, "../../shared/testdata/sif"), "/work/shared/testdata/sif"]:
    if os.path.isdir(cand):
        for name in ["empty.sif", "one-group.sif", "one-object-oci-root-index.sif",
                     "one-group-signed-pgp.sif"]:
            put("sif", name, open(os.path.join(cand, name), "rb").read())
        break

# --- squashfs -------------------------------------------------------------------------------
if shutil.which("mksquashfs"):
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(os.path.join(src, "etc"))
        with open(os.path.join(src, "etc/hostname"), "w") as f:
            f.write("x\n")
        for comp in ["gzip", "xz", "zstd", "lzo", "lz4"]:
            out = os.path.join(tmp, comp + ".sqsh")
            r = subprocess.run(["mksquashfs", src, out, "-comp", comp, "-noappend", "-quiet",
                                "-no-progress"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            if r.returncode == 0:
                put("squashfs", comp + ".sqsh", open(out, "rb").read()[:512])

# --- netrc / auth_challenge -----------------------------------------------------------------
put("netrc", "enroot.credentials",
    "machine nvcr.io login $oauthtoken password nvapi-xyz\n"
    "machine auth.docker.io login alice password s3cret\n"
    "machine 127.0.0.1:5000 login bob password pw account acct\n")
put("netrc", "default-macdef", "default login anon password x\nmacdef init\ncd /\n\n"
    "machine ghcr.io login u password p\n")
put("netrc", "one-line", "machine a login b password c machine d login e")
put("auth_challenge", "bearer",
    'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
    'scope="repository:library/ubuntu:pull"')
put("auth_challenge", "bearer-error",
    'bearer realm=http://127.0.0.1:1/t, error="invalid_token"')
put("auth_challenge", "basic", 'Basic realm="Registry Realm"')
put("auth_challenge", "escaped", 'Bearer realm="https://h/t?a=\\"b\\"",scope="x,y"')

# --- auth_file: docker config.json / podman auth.json ----------------------------------------
put("auth_file", "docker-config.json", json.dumps({
    "auths": {
        "https://index.docker.io/v1/": {"auth": "aHViOmh1Yi1wYXNzd29yZA=="},
        "127.0.0.1:5000": {"auth": "YWxpY2U6czNjcmV0LXB3", "email": "a@example.org"},
        "ghcr.io": {"identitytoken": "refresh-token-value"},
    },
    "credsStore": "desktop",
    "credHelpers": {"gcr.io": "gcloud"},
    "HttpHeaders": {"User-Agent": "x"},
}, indent="\t"))
put("auth_file", "podman-auth.json", json.dumps({
    "auths": {
        "docker.io": {"auth": "dXNlcjpwYXNzOndpdGg6Y29sb25z"},
        "quay.io/namespace": {"auth": "bzpw"},
        "bad.example": {"auth": "not base64!"},
        "old.example": {"username": "u", "password": "p"},
    }
}))
put("auth_file", "empty.json", "{}")
put("auth_file", "wrong-types.json", '{"auths": {"h": {"auth": 3, "identitytoken": null}}, "credsStore": 1}')

# --- pyxis_mounts / stage_spec --------------------------------------------------------------
for i, m in enumerate([
    "/data:/data", "/scratch:/scratch:ro", "/a:/b:rbind+ro+nosuid,/c:/d:private",
    "tmpfs:/tmp", "/host/file:/etc/file:ro+rprivate", "/x", "/a:/b:,",
]):
    put("pyxis_mounts", f"seed-{i}", m)
for i, s in enumerate(["/data/a:in/a,/data/f", "/abs:/out", "../r:/out", "out:/shared/out",
                       "/a:../x"]):
    put("stage_spec", f"seed-{i}", s)

# --- cdi (first byte: even = JSON, odd = YAML) ----------------------------------------------
NVIDIA_YAML = """---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/null
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/null
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidiactl
    type: c
    major: 195
    minor: 255
    permissions: rw
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-ctk
    args: [nvidia-ctk, hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
  mounts:
  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
    options: [ro, nosuid, bind]
  additionalGids: [44]
"""
put("cdi", "nvidia.yaml", b"\x01" + NVIDIA_YAML.encode())
put("cdi", "vendor.json", b"\x00" + json.dumps({
    "cdiVersion": "0.6.0", "kind": "vendor.com/hca",
    "devices": [{"name": "mlx5_0", "annotations": {"a": "b"},
                 "containerEdits": {"env": ["X=1"],
                                    "deviceNodes": [{"path": "/dev/infiniband/uverbs0"}]}}],
    "containerEdits": {"mounts": [{"hostPath": "/sys", "containerPath": "/sys",
                                   "type": "bind", "options": ["ro"]}]}}).encode())

# --- spank_options (lines of "INDEX VALUE") / plugstack / created ---------------------------
put("spank_options", "image-mounts", "0 /data:/data,/x:/y:ro\n1 ubuntu:22.04\n2 /work\n")
put("spank_options", "all-indexes", "".join(f"{i} v{i}\n" for i in range(20)))
put("spank_options", "stage", "15 /data/in:in\n16 out:/data/out\n12 closest\n")
put("spank_plugstack", "all-keys",
    "berth=/usr/bin/berth config=/etc/berth/berth.toml runtime_path=/run/berth "
    "execute_entrypoint=1 container_scope=global sbatch_support=0 debug_request_dir=/tmp/r")
put("spank_plugstack", "scratch-toml", '[scratch]\nroot = "/local/scratch"\n')
created = ('{"id": "c0ffee123456", "pid": 4242, "namespaces": {"mnt": "/proc/4242/ns/mnt", '
           '"uts": "/proc/4242/ns/uts", "ipc": "/proc/4242/ns/ipc", "cgroup": '
           '"/proc/4242/ns/cgroup", "net": "/proc/4242/ns/net", "user": "/proc/4242/ns/user"}, '
           '"env": ["PATH=/usr/bin:/bin", "SLURM_JOB_ID=12", "EMPTY="], "cwd": "/workdir"')
put("spank_created", "plain", created + "}\ntrailing log line\n")
put("spank_created", "bind", created + ', "bind": {"memory_policy": "preferred", "ranks": ['
    '{"rank": 0, "cpus": [2, 3], "mems": [1], "env": ["CUDA_VISIBLE_DEVICES=1"]}, '
    '{"rank": 1, "cpus": [0], "mems": [0], "env": ["NCCL_IB_HCA==mlx5_0"]}]}}')
put("spank_created", "stderr", "berth: error: image 'x' not found: check the name\n")

# --- step_request ---------------------------------------------------------------------------
put("step_request", "full", json.dumps({
    "job_id": 12, "step_id": 0, "uid": 1000, "gid": 1000, "local_task_count": 2,
    "options": {"container-image": "/img", "container-mount-home": True,
                "container-env": "LANG", "container-unshare": "net",
                "container-mounts": "/data:/data:ro,/x:/y", "container-name": "c1:create",
                "container-workdir": "/w", "container-bind": "closest"},
    "plugin": {"container_scope": "global", "execute_entrypoint": False,
               "sbatch_support": True},
    "job_env": ["SLURM_JOB_ID=12", "SLURM_JOB_GPUS=2,3", "SLURM_TASKS_PER_NODE=8",
                "SLURM_LOCALID=1", "CUDA_VISIBLE_DEVICES=0", "LANG=en_US"]}))
put("step_request", "minimal", '{"job_id":1,"step_id":0,"uid":0,"gid":0}')

# --- berth_toml -----------------------------------------------------------------------------
shipped = os.path.join(here, "../configs/berth.toml")
if os.path.exists(shipped):
    put("berth_toml", "shipped.toml", open(shipped, "rb").read())
put("berth_toml", "small.toml",
    '[store]\nroot = "/var/lib/berth"\n[squashfs]\ncompression = "zstd"\nlevel = 3\n'
    '[topology]\nbind = "closest"\nexclude_nics = ["mlx5_4"]\n')

# --- cli (NUL-separated arguments) ----------------------------------------------------------
for i, args in enumerate([
    ["run", "--memory", "4G", "--cpus", "1.5", "--cpuset-cpus", "0-3,8",
     "--mount", "/data:/data:ro", "--env", "A=B", "--hostname", "h1", "ubuntu", "true"],
    ["--config", "/etc/berth/berth.toml", "-vv", "import", "nvcr.io#nvidia/cuda:12.3"],
    ["images", "ls"], ["stage", "/src", "--to", "/dst"], ["step", "destroy", "--job-id", "1",
                                                         "--step-id", "2"],
    ["run", "--timeout", "99999999999999999999999999", "x"], ["--help"], ["gc"],
]):
    put("cli", f"seed-{i}", "\0".join(args))
print("seeded", ROOT)
