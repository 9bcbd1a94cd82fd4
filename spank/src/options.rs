//! The `--container-*` options: the table Slurm shows in `srun --help`, the values a user gave
//! (flags, or their `BERTH_*` / `PYXIS_*` environment equivalents), their validation, and the
//! `options` object of the request to `berth step create`. Names and meanings follow Pyxis 0.24,
//! so a Pyxis user keeps every flag and script. berth's own `--stage-in`/`--stage-out` (env
//! `BERTH_STAGE_IN`/`BERTH_STAGE_OUT`) are job options: they need no container and go to the
//! Prolog and Epilog, not into the step's request.
//!
//! Slurm calls an option's callback once per occurrence on the command line, and slurmstepd may
//! call it twice with the same value; applying a flag is therefore idempotent, and only a
//! *different* second value is an error.

use std::ffi::CStr;

use serde_json::{Map, Value};

use crate::SpankError;

/// One value a user can set: a string, a comma-separated list, or a boolean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Image,
    Mounts,
    Workdir,
    Name,
    Save,
    MountHome,
    RemapRoot,
    Entrypoint,
    EntrypointLog,
    Writable,
    Env,
    Unshare,
    Bind,
    StageIn,
    StageOut,
    Slurm,
    Modules,
    Mpi,
}

impl Key {
    pub const ALL: [Key; 18] = [
        Key::Image,
        Key::Mounts,
        Key::Workdir,
        Key::Name,
        Key::Save,
        Key::MountHome,
        Key::RemapRoot,
        Key::Entrypoint,
        Key::EntrypointLog,
        Key::Writable,
        Key::Env,
        Key::Unshare,
        Key::Bind,
        Key::StageIn,
        Key::StageOut,
        Key::Slurm,
        Key::Modules,
        Key::Mpi,
    ];

    /// The flag name without dashes, which is also the key in the request's `options` object.
    pub fn flag(self) -> &'static str {
        match self {
            Key::Image => "container-image",
            Key::Mounts => "container-mounts",
            Key::Workdir => "container-workdir",
            Key::Name => "container-name",
            Key::Save => "container-save",
            Key::MountHome => "container-mount-home",
            Key::RemapRoot => "container-remap-root",
            Key::Entrypoint => "container-entrypoint",
            Key::EntrypointLog => "container-entrypoint-log",
            Key::Writable => "container-writable",
            Key::Env => "container-env",
            Key::Unshare => "container-unshare",
            Key::Bind => "container-bind",
            Key::StageIn => "stage-in",
            Key::StageOut => "stage-out",
            Key::Slurm => "container-slurm",
            Key::Modules => "container-modules",
            Key::Mpi => "container-mpi",
        }
    }

    /// The suffix of the environment equivalents (`BERTH_` / `PYXIS_` + this).
    fn env_suffix(self) -> &'static str {
        match self {
            Key::Image => "CONTAINER_IMAGE",
            Key::Mounts => "CONTAINER_MOUNTS",
            Key::Workdir => "CONTAINER_WORKDIR",
            Key::Name => "CONTAINER_NAME",
            Key::Save => "CONTAINER_SAVE",
            Key::MountHome => "CONTAINER_MOUNT_HOME",
            Key::RemapRoot => "CONTAINER_REMAP_ROOT",
            Key::Entrypoint => "CONTAINER_ENTRYPOINT",
            Key::EntrypointLog => "CONTAINER_ENTRYPOINT_LOG",
            Key::Writable => "CONTAINER_WRITABLE",
            Key::Env => "CONTAINER_ENV",
            Key::Unshare => "CONTAINER_UNSHARE",
            Key::Bind => "CONTAINER_BIND",
            Key::StageIn => "STAGE_IN",
            Key::StageOut => "STAGE_OUT",
            Key::Slurm => "CONTAINER_SLURM",
            Key::Modules => "CONTAINER_MODULES",
            Key::Mpi => "CONTAINER_MPI",
        }
    }

    /// Whether the key describes the container (and so is ignored without one).
    pub fn is_container(self) -> bool {
        !matches!(self, Key::StageIn | Key::StageOut)
    }

    /// The environment prefixes this key is read with: Pyxis has no staging options.
    fn env_prefixes(self) -> &'static [&'static str] {
        if self.is_container() {
            &ENV_PREFIXES
        } else {
            &ENV_PREFIXES[..1]
        }
    }
}

/// The environment variable prefixes, strongest first: `BERTH_*` wins over `PYXIS_*`.
pub const ENV_PREFIXES: [&str; 2] = ["BERTH_", "PYXIS_"];

/// One row of the option table registered with `spank_option_register`.
#[derive(Debug)]
pub struct Flag {
    /// Long option name (`--NAME`).
    pub name: &'static CStr,
    /// One word describing the argument; `None` for a flag without argument.
    pub arginfo: Option<&'static CStr>,
    /// The `srun --help` text.
    pub usage: &'static CStr,
    pub key: Key,
    /// For argument-less flags: the boolean the flag sets.
    pub sets: bool,
}

/// Every option, in `srun --help` order. The index of a row is the `val` Slurm passes back to
/// the option callback.
pub static FLAGS: [Flag; 24] = [
    Flag {
        name: c"container-image",
        arginfo: Some(c"[USER@][REGISTRY#]IMAGE[:TAG]|PATH"),
        usage: c"[berth] the image of the container: a registry image (enroot URI form), or the path of a squashfs file or of a root filesystem directory on the compute node",
        key: Key::Image,
        sets: false,
    },
    Flag {
        name: c"container-mounts",
        arginfo: Some(c"SRC[:DST[:FLAGS]][,SRC[:DST[:FLAGS]]...]"),
        usage: c"[berth] bind mount(s) inside the container; a relative SRC is the working directory's; flags (Enroot's) are separated with \"+\", e.g. \"ro+rprivate\"; SRC \"tmpfs\" mounts a new tmpfs at DST (flags such as size=1g+mode=700)",
        key: Key::Mounts,
        sets: false,
    },
    Flag {
        name: c"container-workdir",
        arginfo: Some(c"PATH"),
        usage: c"[berth] working directory inside the container",
        key: Key::Workdir,
        sets: false,
    },
    Flag {
        name: c"container-name",
        arginfo: Some(c"NAME[:auto|create|exec|no_exec]"),
        usage: c"[berth] name of the container, kept across the steps of the job (or of the user, with container_scope=global); an existing container of this name is reused and the import is skipped; :create only makes it, :exec only joins it, :no_exec acts as :auto",
        key: Key::Name,
        sets: false,
    },
    Flag {
        name: c"container-save",
        arginfo: Some(c"PATH"),
        usage: c"[berth] save the container's filesystem as a squashfs file at PATH on the compute node when the step ends",
        key: Key::Save,
        sets: false,
    },
    Flag {
        name: c"container-mount-home",
        arginfo: None,
        usage: c"[berth] bind mount the user's home directory",
        key: Key::MountHome,
        sets: true,
    },
    Flag {
        name: c"no-container-mount-home",
        arginfo: None,
        usage: c"[berth] do not bind mount the user's home directory",
        key: Key::MountHome,
        sets: false,
    },
    Flag {
        name: c"container-remap-root",
        arginfo: None,
        usage: c"[berth] be remapped to root inside the container (a user namespace); grants no privilege on the host, despite appearances",
        key: Key::RemapRoot,
        sets: true,
    },
    Flag {
        name: c"no-container-remap-root",
        arginfo: None,
        usage: c"[berth] do not remap to root inside the container",
        key: Key::RemapRoot,
        sets: false,
    },
    Flag {
        name: c"container-entrypoint",
        arginfo: None,
        usage: c"[berth] execute the entrypoint of the container image",
        key: Key::Entrypoint,
        sets: true,
    },
    Flag {
        name: c"no-container-entrypoint",
        arginfo: None,
        usage: c"[berth] do not execute the entrypoint of the container image",
        key: Key::Entrypoint,
        sets: false,
    },
    Flag {
        name: c"container-entrypoint-log",
        arginfo: None,
        usage: c"[berth] print the output of the entrypoint",
        key: Key::EntrypointLog,
        sets: true,
    },
    Flag {
        name: c"container-writable",
        arginfo: None,
        usage: c"[berth] make the container filesystem writable",
        key: Key::Writable,
        sets: true,
    },
    Flag {
        name: c"container-readonly",
        arginfo: None,
        usage: c"[berth] make the container filesystem read-only",
        key: Key::Writable,
        sets: false,
    },
    Flag {
        name: c"container-env",
        arginfo: Some(c"NAME[,NAME...]"),
        usage: c"[berth] environment variables whose value from the job's environment overrides the image's (by default the image's value wins)",
        key: Key::Env,
        sets: false,
    },
    Flag {
        name: c"container-unshare",
        arginfo: Some(c"net|ipc|uts[,...]"),
        usage: c"[berth] namespaces the container does not share with the host, e.g. \"net\" for a network namespace with only loopback",
        key: Key::Unshare,
        sets: false,
    },
    Flag {
        name: c"container-bind",
        arginfo: Some(c"closest|none"),
        usage: c"[berth] closest: pin each task to its GPUs, their closest NICs and a share of the cores and memory of their NUMA node (CUDA_VISIBLE_DEVICES, UCX_NET_DEVICES, NCCL_IB_HCA, CPU affinity, memory policy); none: leave placement to Slurm [default: topology.bind in berth.toml, closest]",
        key: Key::Bind,
        sets: false,
    },
    Flag {
        name: c"stage-in",
        arginfo: Some(c"SRC[:DST][,SRC[:DST]...]"),
        usage: c"[berth] copy SRC (an absolute path on shared storage, read as you) into the job's node-local scratch ($BERTH_SCRATCH, /scratch in containers) at DST (relative; default: SRC's name) before the job's first step",
        key: Key::StageIn,
        sets: false,
    },
    Flag {
        name: c"stage-out",
        arginfo: Some(c"SRC:DST[,SRC:DST...]"),
        usage: c"[berth] when the job ends, copy SRC (relative to the job's scratch) into the directory DST (absolute, on shared storage) as you; if that fails, the scratch is kept and the job's output says where",
        key: Key::StageOut,
        sets: false,
    },
    // After the others: a row's index is its callback's `val`, kept across versions.
    Flag {
        name: c"container-slurm",
        arginfo: None,
        usage: c"[berth] the host's Slurm commands (srun, sbatch, squeue, ...) work inside the container: the client files host_software.slurm_paths in berth.toml names, bound read-only",
        key: Key::Slurm,
        sets: true,
    },
    Flag {
        name: c"no-container-slurm",
        arginfo: None,
        usage: c"[berth] no host Slurm commands inside the container [default: host_software.slurm in berth.toml]",
        key: Key::Slurm,
        sets: false,
    },
    Flag {
        name: c"container-modules",
        arginfo: None,
        usage: c"[berth] Lmod's module command, the site's module trees and their software inside the container (host_software.module_paths in berth.toml, bound read-only), with your MODULEPATH and LMOD_* variables: module load works in bash -l and batch scripts",
        key: Key::Modules,
        sets: true,
    },
    Flag {
        name: c"no-container-modules",
        arginfo: None,
        usage: c"[berth] no Lmod inside the container [default: host_software.modules in berth.toml]",
        key: Key::Modules,
        sets: false,
    },
    Flag {
        name: c"container-mpi",
        arginfo: Some(c"host|image"),
        usage: c"[berth] host: the node's MPI (host_software.mpi_libraries and mpi_paths in berth.toml, bound read-only, first in LD_LIBRARY_PATH) runs the container's MPI programs, after an ABI and glibc check; image: the image's own [default: host_software.mpi in berth.toml]",
        key: Key::Mpi,
        sets: false,
    },
];

/// Where a value came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag => Ok(()),
            Source::Env(var) => write!(f, " (from ${var})"),
        }
    }
}

/// The values the user set; `None` / empty means "not set" (berth applies its default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    pub image: Option<String>,
    pub mounts: Vec<String>,
    pub workdir: Option<String>,
    pub name: Option<String>,
    pub save: Option<String>,
    pub mount_home: Option<bool>,
    pub remap_root: Option<bool>,
    pub entrypoint: Option<bool>,
    pub entrypoint_log: Option<bool>,
    pub writable: Option<bool>,
    pub env: Vec<String>,
    pub unshare: Vec<String>,
    pub bind: Option<String>,
    pub stage_in: Vec<String>,
    pub stage_out: Vec<String>,
    pub slurm: Option<bool>,
    pub modules: Option<bool>,
    pub mpi: Option<String>,
}

impl Options {
    /// Applies flag `FLAGS[index]` with its argument (callback of `--NAME[=ARG]`).
    pub fn apply_flag(&mut self, index: usize, arg: Option<&str>) -> Result<(), SpankError> {
        let Some(flag) = FLAGS.get(index) else {
            return Ok(());
        };
        if flag.arginfo.is_none() {
            return self.set_bool(flag.key, flag.sets);
        }
        self.set_value(flag.key, arg.unwrap_or(""), &Source::Flag)
    }

    /// Fills every value not set by a flag from the environment: `BERTH_CONTAINER_*`, else
    /// `PYXIS_CONTAINER_*`. Empty variables count as unset. `lookup` reads one variable (the
    /// process environment in srun/sbatch, the job's in slurmstepd).
    pub fn apply_env(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<(), SpankError> {
        for key in Key::ALL {
            if self.is_set(key) {
                continue;
            }
            let found = key.env_prefixes().iter().find_map(|prefix| {
                let var = format!("{prefix}{}", key.env_suffix());
                lookup(&var).filter(|v| !v.is_empty()).map(|v| (var, v))
            });
            if let Some((var, value)) = found {
                self.set_from_env(key, &var, &value)?;
            }
        }
        // Pyxis also honours `PYXIS_CONTAINER_READONLY=1` (the negative of WRITABLE).
        if self.writable.is_none() {
            let found = ENV_PREFIXES.iter().find_map(|prefix| {
                let var = format!("{prefix}CONTAINER_READONLY");
                lookup(&var).filter(|v| !v.is_empty()).map(|v| (var, v))
            });
            if let Some((var, value)) = found {
                let readonly = parse_bool(&value).ok_or_else(|| SpankError::NotBool {
                    var: var.clone(),
                    value: shown(&value),
                })?;
                self.writable = Some(!readonly);
            }
        }
        Ok(())
    }

    fn set_from_env(&mut self, key: Key, var: &str, value: &str) -> Result<(), SpankError> {
        match key {
            Key::MountHome
            | Key::RemapRoot
            | Key::Entrypoint
            | Key::EntrypointLog
            | Key::Writable
            | Key::Slurm
            | Key::Modules => {
                let b = parse_bool(value).ok_or_else(|| SpankError::NotBool {
                    var: var.to_string(),
                    value: shown(value),
                })?;
                self.set_bool(key, b)
            }
            _ => self.set_value(key, value, &Source::Env(var.to_string())),
        }
    }

    fn is_set(&self, key: Key) -> bool {
        match key {
            Key::Image => self.image.is_some(),
            Key::Mounts => !self.mounts.is_empty(),
            Key::Workdir => self.workdir.is_some(),
            Key::Name => self.name.is_some(),
            Key::Save => self.save.is_some(),
            Key::MountHome => self.mount_home.is_some(),
            Key::RemapRoot => self.remap_root.is_some(),
            Key::Entrypoint => self.entrypoint.is_some(),
            Key::EntrypointLog => self.entrypoint_log.is_some(),
            Key::Writable => self.writable.is_some(),
            Key::Env => !self.env.is_empty(),
            Key::Unshare => !self.unshare.is_empty(),
            Key::Bind => self.bind.is_some(),
            Key::StageIn => !self.stage_in.is_empty(),
            Key::StageOut => !self.stage_out.is_empty(),
            Key::Slurm => self.slurm.is_some(),
            Key::Modules => self.modules.is_some(),
            Key::Mpi => self.mpi.is_some(),
        }
    }

    fn set_bool(&mut self, key: Key, value: bool) -> Result<(), SpankError> {
        let slot = match key {
            Key::MountHome => &mut self.mount_home,
            Key::RemapRoot => &mut self.remap_root,
            Key::Entrypoint => &mut self.entrypoint,
            Key::EntrypointLog => &mut self.entrypoint_log,
            Key::Writable => &mut self.writable,
            Key::Slurm => &mut self.slurm,
            Key::Modules => &mut self.modules,
            _ => return Ok(()),
        };
        match *slot {
            Some(old) if old != value => {
                let (yes, no) = pair_names(key);
                Err(SpankError::BothWays { yes, no })
            }
            _ => {
                *slot = Some(value);
                Ok(())
            }
        }
    }

    fn set_value(&mut self, key: Key, value: &str, source: &Source) -> Result<(), SpankError> {
        let flag = key.flag();
        if value.is_empty() {
            return Err(SpankError::Empty {
                flag,
                origin: source.clone(),
            });
        }
        let invalid_because = |hint: std::borrow::Cow<'static, str>| SpankError::Invalid {
            flag,
            origin: source.clone(),
            value: shown(value),
            hint,
        };
        let invalid = |hint: &'static str| invalid_because(hint.into());
        // No option needs one, and a name or path with a newline would forge a row of berth ps
        // or a line of the logs.
        if let Some((at, c)) = berth_sys::text::control_char(value) {
            return Err(invalid_because(
                format!(
                    "it has a control character ({}) at byte {at}: give a printable value",
                    c.escape_unicode()
                )
                .into(),
            ));
        }
        match key {
            Key::Image => set_once(&mut self.image, flag, value),
            // A relative one is taken against the container's default working directory on
            // the node (slurm/step.rs), as Pyxis hands it to the container as is.
            Key::Workdir => set_once(&mut self.workdir, flag, value),
            Key::Name => {
                check_name(value).map_err(invalid)?;
                set_once(&mut self.name, flag, value)
            }
            Key::Save => {
                if value.ends_with('/') {
                    return Err(invalid("PATH names a directory: give the path of a file"));
                }
                set_once(&mut self.save, flag, value)
            }
            Key::Mounts => {
                for entry in value.split(',') {
                    check_mount(entry).map_err(invalid_because)?;
                }
                push_unique(&mut self.mounts, value.split(','));
                Ok(())
            }
            Key::Env => {
                for name in value.split(',') {
                    check_env_name(name).map_err(invalid)?;
                }
                push_unique(&mut self.env, value.split(','));
                Ok(())
            }
            Key::Unshare => {
                for ns in value.split(',') {
                    if !matches!(ns, "net" | "ipc" | "uts") {
                        return Err(invalid(
                            "unknown namespace: use net, ipc and uts, comma-separated",
                        ));
                    }
                }
                push_unique(&mut self.unshare, value.split(','));
                Ok(())
            }
            Key::Bind => {
                if !matches!(value, "closest" | "none") {
                    return Err(invalid("use closest or none"));
                }
                set_once(&mut self.bind, flag, value)
            }
            Key::Mpi => {
                if !matches!(value, "host" | "image") {
                    return Err(invalid("use host or image"));
                }
                set_once(&mut self.mpi, flag, value)
            }
            Key::StageIn => {
                for entry in value.split(',') {
                    check_stage_in(entry).map_err(invalid)?;
                }
                push_unique(&mut self.stage_in, value.split(','));
                Ok(())
            }
            Key::StageOut => {
                for entry in value.split(',') {
                    check_stage_out(entry).map_err(invalid)?;
                }
                push_unique(&mut self.stage_out, value.split(','));
                Ok(())
            }
            Key::MountHome
            | Key::RemapRoot
            | Key::Entrypoint
            | Key::EntrypointLog
            | Key::Writable
            | Key::Slurm
            | Key::Modules => Ok(()),
        }
    }

    /// Adds the bind mount of the batch script `path` (a file in slurmd's spool directory) at
    /// the same path, read-only, so slurmstepd can execute it inside the container.
    pub fn add_batch_script(&mut self, path: &str) -> Result<(), SpankError> {
        if !path.starts_with('/') || path.contains([':', ',']) {
            return Err(SpankError::BatchScript(path.to_string()));
        }
        push_unique(
            &mut self.mounts,
            std::iter::once(format!("{path}:{path}:ro").as_str()),
        );
        Ok(())
    }

    /// A container is wanted when an image or a name was given (as in Pyxis).
    pub fn enabled(&self) -> bool {
        self.image.is_some() || self.name.is_some()
    }

    /// Options that have no effect because no container is wanted, one warning line each.
    pub fn ignored(&self) -> Vec<String> {
        if self.enabled() {
            return Vec::new();
        }
        Key::ALL
            .iter()
            .filter(|k| k.is_container() && self.is_set(**k))
            .map(|k| {
                format!(
                    "ignoring --{} because neither --container-image nor --container-name is set",
                    k.flag()
                )
            })
            .collect()
    }

    /// The request's `options` object: only what was set; lists joined with commas; the
    /// writable/read-only pair as two booleans.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut map = Map::new();
        let mut put_str = |key: Key, v: &Option<String>| {
            if let Some(v) = v {
                map.insert(key.flag().into(), Value::String(v.clone()));
            }
        };
        put_str(Key::Image, &self.image);
        put_str(Key::Workdir, &self.workdir);
        put_str(Key::Name, &self.name);
        put_str(Key::Save, &self.save);
        put_str(Key::Bind, &self.bind);
        put_str(Key::Mpi, &self.mpi);
        for (key, list) in [
            (Key::Mounts, &self.mounts),
            (Key::Env, &self.env),
            (Key::Unshare, &self.unshare),
        ] {
            if !list.is_empty() {
                map.insert(key.flag().into(), Value::String(list.join(",")));
            }
        }
        for (key, v) in [
            (Key::MountHome, self.mount_home),
            (Key::RemapRoot, self.remap_root),
            (Key::Entrypoint, self.entrypoint),
            (Key::EntrypointLog, self.entrypoint_log),
            (Key::Slurm, self.slurm),
            (Key::Modules, self.modules),
        ] {
            if let Some(v) = v {
                map.insert(key.flag().into(), Value::Bool(v));
            }
        }
        if let Some(w) = self.writable {
            map.insert("container-writable".into(), Value::Bool(w));
            map.insert("container-readonly".into(), Value::Bool(!w));
        }
        map
    }
}

impl Options {
    /// The staging requests for the Prolog and Epilog, as `spank_job_control_setenv` names
    /// and values (they arrive as `SPANK_BERTH_STAGE_IN` / `SPANK_BERTH_STAGE_OUT`).
    pub fn stage_env(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        for (name, list) in [
            ("BERTH_STAGE_IN", &self.stage_in),
            ("BERTH_STAGE_OUT", &self.stage_out),
        ] {
            if !list.is_empty() {
                out.push((name, list.join(",")));
            }
        }
        out
    }
}

fn pair_names(key: Key) -> (&'static str, &'static str) {
    let mut yes = "";
    let mut no = "";
    for flag in FLAGS.iter().filter(|f| f.key == key) {
        let name = flag.name.to_str().unwrap_or_default();
        if flag.sets {
            yes = name;
        } else {
            no = name;
        }
    }
    (yes, no)
}

fn set_once(slot: &mut Option<String>, flag: &'static str, value: &str) -> Result<(), SpankError> {
    match slot {
        Some(old) if old != value => Err(SpankError::Conflict {
            flag,
            first: old.clone(),
            second: value.to_string(),
        }),
        _ => {
            *slot = Some(value.to_string());
            Ok(())
        }
    }
}

fn push_unique<'a>(list: &mut Vec<String>, items: impl Iterator<Item = &'a str>) {
    for item in items {
        if !list.iter().any(|x| x == item) {
            list.push(item.to_string());
        }
    }
}

/// `SRC[:DST[:FLAGS]]`, every part present non-empty (FLAGS may be empty), checked as the node
/// will (absolute paths, known flags), so that a mistake fails `srun` before the job is queued.
fn check_mount(entry: &str) -> Result<(), std::borrow::Cow<'static, str>> {
    let parts: Vec<&str> = entry.split(':').collect();
    if parts.len() > 3 {
        return Err("a mount is SRC[:DST[:FLAGS]], with FLAGS separated by \"+\"".into());
    }
    if parts[0].is_empty() || parts.get(1).is_some_and(|d| d.is_empty()) {
        return Err("a mount is SRC[:DST[:FLAGS]] with non-empty SRC and DST".into());
    }
    crate::mounts::parse_entry(entry)
        .map(drop)
        .map_err(|e| e.to_string().into())
}

/// A path inside the job's scratch: relative, without `..`.
fn in_scratch(path: &str) -> bool {
    !path.is_empty() && !path.starts_with('/') && !path.split('/').any(|c| c == "..")
}

/// `SRC[:DST]`: SRC absolute (the Prolog runs elsewhere than the submit directory), DST in the
/// scratch.
fn check_stage_in(entry: &str) -> Result<(), &'static str> {
    let (src, dst) = match entry.split_once(':') {
        Some((s, d)) => (s, Some(d)),
        None => (entry, None),
    };
    if !src.starts_with('/') {
        return Err("a stage-in is SRC[:DST] with SRC an absolute path");
    }
    if dst.is_some_and(|d| !in_scratch(d) || d.contains(':')) {
        return Err("DST is a path relative to the job's scratch, without '..'");
    }
    Ok(())
}

/// `SRC:DST`: SRC in the scratch, DST an absolute directory.
fn check_stage_out(entry: &str) -> Result<(), &'static str> {
    let Some((src, dst)) = entry.split_once(':') else {
        return Err("a stage-out is SRC:DST (SRC in the job's scratch, DST an absolute directory)");
    };
    if !in_scratch(src) {
        return Err("SRC is a path relative to the job's scratch, without '..'");
    }
    if !dst.starts_with('/') || dst.contains(':') {
        return Err("DST is an absolute directory");
    }
    Ok(())
}

/// `NAME[:auto|create|exec|no_exec]`.
fn check_name(value: &str) -> Result<(), &'static str> {
    let (name, mode) = value.split_once(':').unwrap_or((value, "auto"));
    if name.is_empty() {
        return Err("the container name is empty");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err("a container name may use letters, digits, '_', '-' and '.'");
    }
    if !matches!(mode, "auto" | "create" | "exec" | "no_exec" | "") {
        return Err("the mode after ':' is auto, create, exec or no_exec");
    }
    Ok(())
}

fn check_env_name(name: &str) -> Result<(), &'static str> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err("variable names are letters, digits and '_', comma-separated");
    }
    Ok(())
}

/// A value as an error line quotes it: elided, control characters escaped.
fn shown(value: &str) -> String {
    berth_sys::text::escape_controls(&berth_sys::text::elide(value)).into_owned()
}

/// Pyxis's boolean spellings.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "y" | "on" => Some(true),
        "0" | "false" | "no" | "n" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn index(name: &str) -> usize {
        FLAGS
            .iter()
            .position(|f| f.name.to_str().unwrap() == name)
            .unwrap_or_else(|| panic!("no flag {name}"))
    }

    fn flag(o: &mut Options, name: &str, arg: Option<&str>) -> Result<(), SpankError> {
        o.apply_flag(index(name), arg)
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn table_has_every_pyxis_flag_once_within_slurm_limits() {
        let names: Vec<&str> = FLAGS.iter().map(|f| f.name.to_str().unwrap()).collect();
        for expected in [
            "container-image",
            "container-mounts",
            "container-workdir",
            "container-name",
            "container-save",
            "container-mount-home",
            "no-container-mount-home",
            "container-remap-root",
            "no-container-remap-root",
            "container-entrypoint",
            "no-container-entrypoint",
            "container-entrypoint-log",
            "container-writable",
            "container-readonly",
            "container-env",
            "container-unshare",
            "container-bind",
            "container-mpi",
            "stage-in",
            "stage-out",
        ] {
            assert_eq!(
                names.iter().filter(|n| **n == expected).count(),
                1,
                "{expected}"
            );
        }
        for f in &FLAGS {
            // SPANK_OPTION_MAXLEN in spank.h.
            assert!(f.name.to_bytes().len() <= 75, "{:?}", f.name);
            assert!(f.usage.to_str().unwrap().starts_with("[berth] "));
            // Every key is reachable from a flag.
        }
        for key in Key::ALL {
            assert!(FLAGS.iter().any(|f| f.key == key), "{key:?} has no flag");
        }
    }

    #[test]
    fn values_with_control_characters_are_refused_in_one_line() {
        for (name, value) in [
            ("container-name", "x\nforged"),
            ("container-save", "/tmp/a\rb"),
            ("container-image", "busybox\u{1b}[2J"),
            ("container-mounts", "/a:/b\n"),
            ("container-workdir", "/w\tx"),
        ] {
            let mut o = Options::default();
            let e = flag(&mut o, name, Some(value)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--{name}")), "{e}");
            assert!(e.contains("control character"), "{e}");
            assert!(!e.chars().any(char::is_control), "{e}");
        }
        let mut o = Options::default();
        let e = o
            .apply_env(env(&[("PYXIS_CONTAINER_NAME", "a\nb")]))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--container-name"), "{e}");
        assert!(
            e.contains("'a\\nb'") && e.contains("control character"),
            "{e}"
        );
        let e = o
            .apply_env(env(&[("PYXIS_CONTAINER_WRITABLE", "1\nforged")]))
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn string_flags_are_idempotent_but_reject_a_second_value() {
        let mut o = Options::default();
        flag(&mut o, "container-image", Some("ubuntu:22.04")).unwrap();
        flag(&mut o, "container-image", Some("ubuntu:22.04")).unwrap();
        assert_eq!(o.image.as_deref(), Some("ubuntu:22.04"));
        let e = flag(&mut o, "container-image", Some("debian")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--container-image given twice with different values ('ubuntu:22.04' and 'debian'): give it once"
        );
        let e = flag(&mut o, "container-workdir", Some("")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--container-workdir: an argument is required"
        );
        let e = flag(&mut o, "container-workdir", None).unwrap_err();
        assert!(matches!(e, SpankError::Empty { .. }));
    }

    #[test]
    fn boolean_pairs_conflict_only_when_opposite() {
        let mut o = Options::default();
        flag(&mut o, "container-mount-home", None).unwrap();
        flag(&mut o, "container-mount-home", None).unwrap();
        assert_eq!(o.mount_home, Some(true));
        let e = flag(&mut o, "no-container-mount-home", None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--container-mount-home and --no-container-mount-home both given: give one of them"
        );
        flag(&mut o, "container-readonly", None).unwrap();
        assert_eq!(o.writable, Some(false));
        let e = flag(&mut o, "container-writable", None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--container-writable and --container-readonly both given: give one of them"
        );
    }

    #[test]
    fn lists_accumulate_across_occurrences_without_duplicates() {
        let mut o = Options::default();
        flag(&mut o, "container-mounts", Some("/a:/a,/b:/c:ro")).unwrap();
        flag(&mut o, "container-mounts", Some("/a:/a,tmpfs:/scratch")).unwrap();
        flag(&mut o, "container-mounts", Some("/a:/a,/b:/c:ro")).unwrap();
        assert_eq!(o.mounts, ["/a:/a", "/b:/c:ro", "tmpfs:/scratch"]);
        flag(&mut o, "container-env", Some("A,B_2")).unwrap();
        flag(&mut o, "container-env", Some("B_2,_C")).unwrap();
        assert_eq!(o.env, ["A", "B_2", "_C"]);
    }

    #[test]
    fn malformed_values_fail_with_a_hint() {
        let mut o = Options::default();
        for (name, value, hint) in [
            ("container-mounts", "/a::ro", "non-empty SRC and DST"),
            ("container-mounts", ":/a", "non-empty SRC and DST"),
            ("container-mounts", "/a:/b:ro:x", "SRC[:DST[:FLAGS]]"),
            ("container-mounts", "/a,,/b", "non-empty SRC and DST"),
            // Checked as the node checks them, before the job is queued.
            ("container-mounts", "data:rel", "must be an absolute path"),
            (
                "container-mounts",
                "tmpfs:/t:size=x",
                "invalid tmpfs option",
            ),
            ("container-mounts", "/a:/b:ro+bogus", "unknown flag 'bogus'"),
            (
                "container-mounts",
                "/a:b",
                "the destination must be an absolute path",
            ),
            ("container-mounts", "/a:/b/../..", "must not contain '..'"),
            (
                "container-name",
                "x:sometimes",
                "auto, create, exec or no_exec",
            ),
            ("container-name", ":exec", "empty"),
            ("container-name", "a/b", "letters, digits"),
            ("container-save", "/out/", "directory"),
            ("container-env", "A,1B", "letters, digits and '_'"),
            ("container-env", "A,", "letters, digits and '_'"),
            ("container-unshare", "net,pid", "net, ipc and uts"),
        ] {
            let e = flag(&mut o, name, Some(value)).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("--{name}: invalid value '{value}': ")),
                "{e}"
            );
            assert!(e.contains(hint), "{e}");
        }
        assert_eq!(o, Options::default(), "a rejected value changes nothing");
        // Pyxis's relative forms and Enroot's flags pass the check.
        flag(
            &mut o,
            "container-mounts",
            Some("./data:/data,out,tmpfs:/t:huge=within_size"),
        )
        .unwrap();
        flag(
            &mut o,
            "container-mounts",
            Some("/a:/a:ro+unbindable+x-create=dir"),
        )
        .unwrap();
        flag(&mut o, "container-workdir", Some("sub/dir")).unwrap();
        flag(&mut o, "container-save", Some("./out.sqsh")).unwrap();
        for ok in ["n", "n:auto", "n:create", "n:exec", "n:no_exec", "a.b-c_1"] {
            let mut o = Options::default();
            flag(&mut o, "container-name", Some(ok)).unwrap();
        }
    }

    #[test]
    fn environment_fills_only_what_flags_left_unset_berth_before_pyxis() {
        let mut o = Options::default();
        flag(&mut o, "container-image", Some("from-flag")).unwrap();
        flag(&mut o, "no-container-entrypoint", None).unwrap();
        o.apply_env(env(&[
            ("BERTH_CONTAINER_IMAGE", "from-berth-env"),
            ("PYXIS_CONTAINER_IMAGE", "from-pyxis-env"),
            ("BERTH_CONTAINER_WORKDIR", "/berth"),
            ("PYXIS_CONTAINER_WORKDIR", "/pyxis"),
            ("PYXIS_CONTAINER_MOUNTS", "/data:/data:ro"),
            ("BERTH_CONTAINER_ENTRYPOINT", "1"),
            ("PYXIS_CONTAINER_MOUNT_HOME", "no"),
            ("BERTH_CONTAINER_NAME", ""),
            ("PYXIS_CONTAINER_NAME", "kept"),
            ("PYXIS_CONTAINER_READONLY", "yes"),
            ("BERTH_CONTAINER_UNSHARE", "net"),
        ]))
        .unwrap();
        assert_eq!(o.image.as_deref(), Some("from-flag"));
        assert_eq!(o.workdir.as_deref(), Some("/berth"));
        assert_eq!(o.mounts, ["/data:/data:ro"]);
        assert_eq!(o.entrypoint, Some(false), "the flag wins over the env");
        assert_eq!(o.mount_home, Some(false));
        assert_eq!(
            o.name.as_deref(),
            Some("kept"),
            "an empty BERTH_ var is unset"
        );
        assert_eq!(o.writable, Some(false));
        assert_eq!(o.unshare, ["net"]);
    }

    #[test]
    fn environment_values_are_validated_and_named_in_errors() {
        let mut o = Options::default();
        let e = o
            .apply_env(env(&[("BERTH_CONTAINER_WRITABLE", "maybe")]))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "$BERTH_CONTAINER_WRITABLE: 'maybe' is not a boolean: use 1 or 0 (also true/false, yes/no, on/off)"
        );
        let e = Options::default()
            .apply_env(env(&[("PYXIS_CONTAINER_NAME", "x:never")]))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--container-name (from $PYXIS_CONTAINER_NAME): invalid value 'x:never': the mode after ':' is auto, create, exec or no_exec"
        );
    }

    #[test]
    fn json_holds_only_what_was_set() {
        let mut o = Options::default();
        assert!(o.to_json().is_empty());
        assert!(!o.enabled());
        flag(&mut o, "container-image", Some("/images/x.sqsh")).unwrap();
        flag(&mut o, "container-mounts", Some("/a:/b")).unwrap();
        flag(&mut o, "container-mounts", Some("/c")).unwrap();
        flag(&mut o, "container-writable", None).unwrap();
        flag(&mut o, "no-container-remap-root", None).unwrap();
        flag(&mut o, "container-env", Some("A,B")).unwrap();
        let json = Value::Object(o.to_json());
        assert_eq!(
            json,
            serde_json::json!({
                "container-image": "/images/x.sqsh",
                "container-mounts": "/a:/b,/c",
                "container-writable": true,
                "container-readonly": false,
                "container-remap-root": false,
                "container-env": "A,B",
            })
        );
        assert!(o.enabled());
    }

    #[test]
    fn options_without_image_or_name_are_reported_as_ignored() {
        let mut o = Options::default();
        flag(&mut o, "container-workdir", Some("/w")).unwrap();
        flag(&mut o, "container-readonly", None).unwrap();
        assert_eq!(
            o.ignored(),
            [
                "ignoring --container-workdir because neither --container-image nor --container-name is set",
                "ignoring --container-writable because neither --container-image nor --container-name is set",
            ]
        );
        flag(&mut o, "container-name", Some("x")).unwrap();
        assert!(o.enabled());
        assert!(o.ignored().is_empty());
    }

    #[test]
    fn batch_script_is_mounted_read_only_at_its_own_path() {
        let mut o = Options::default();
        flag(&mut o, "container-mounts", Some("/data:/data")).unwrap();
        o.add_batch_script("/var/spool/slurmd/job00012/slurm_script")
            .unwrap();
        assert_eq!(
            o.to_json()["container-mounts"],
            "/data:/data,/var/spool/slurmd/job00012/slurm_script:/var/spool/slurmd/job00012/slurm_script:ro"
        );
        for bad in ["relative/slurm_script", "/a:b/slurm_script", "/a,b/x"] {
            assert!(
                o.add_batch_script(bad)
                    .unwrap_err()
                    .to_string()
                    .contains(bad)
            );
        }
    }

    #[test]
    fn container_bind_takes_closest_or_none_from_flag_or_environment() {
        let mut o = Options::default();
        flag(&mut o, "container-bind", Some("none")).unwrap();
        flag(&mut o, "container-bind", Some("none")).unwrap();
        assert_eq!(o.bind.as_deref(), Some("none"));
        let e = flag(&mut o, "container-bind", Some("closest")).unwrap_err();
        assert!(matches!(e, SpankError::Conflict { .. }), "{e}");
        let e = flag(&mut Options::default(), "container-bind", Some("nearest")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--container-bind: invalid value 'nearest': use closest or none"
        );
        let mut o = Options::default();
        o.apply_env(env(&[("BERTH_CONTAINER_BIND", "closest")]))
            .unwrap();
        assert_eq!(o.bind.as_deref(), Some("closest"));
        flag(&mut o, "container-image", Some("x")).unwrap();
        assert_eq!(o.to_json()["container-bind"], "closest");
        // Without a container it does nothing, and says so.
        let mut o = Options::default();
        flag(&mut o, "container-bind", Some("closest")).unwrap();
        assert_eq!(
            o.ignored(),
            [
                "ignoring --container-bind because neither --container-image nor --container-name is set"
            ]
        );
    }

    #[test]
    fn stage_requests_are_checked_and_passed_to_the_prolog_only() {
        let mut o = Options::default();
        flag(&mut o, "stage-in", Some("/data/set1:in/set1,/data/file")).unwrap();
        flag(&mut o, "stage-in", Some("/data/file")).unwrap();
        flag(&mut o, "stage-out", Some("results:/shared/out")).unwrap();
        assert_eq!(o.stage_in, ["/data/set1:in/set1", "/data/file"]);
        // Staging needs no container: nothing is ignored, the request's options stay empty.
        assert!(!o.enabled());
        assert!(o.ignored().is_empty());
        assert!(o.to_json().is_empty());
        assert_eq!(
            o.stage_env(),
            [
                (
                    "BERTH_STAGE_IN",
                    "/data/set1:in/set1,/data/file".to_string()
                ),
                ("BERTH_STAGE_OUT", "results:/shared/out".to_string()),
            ]
        );
        for (name, bad, hint) in [
            ("stage-in", "data/rel", "absolute"),
            ("stage-in", "/data:/abs", "relative to the job's scratch"),
            ("stage-in", "/data:../up", "without '..'"),
            ("stage-in", "/data:", "relative to the job's scratch"),
            ("stage-out", "results", "SRC:DST"),
            ("stage-out", "/abs:/out", "relative to the job's scratch"),
            ("stage-out", "a/../../b:/out", "without '..'"),
            ("stage-out", "results:rel", "absolute directory"),
        ] {
            let e = flag(&mut Options::default(), name, Some(bad))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!("--{name}: invalid value '{bad}': ")),
                "{e}"
            );
            assert!(e.contains(hint), "{e}");
        }
    }

    #[test]
    fn stage_requests_come_from_berth_variables_not_pyxis_ones() {
        let mut o = Options::default();
        o.apply_env(env(&[
            ("BERTH_STAGE_IN", "/d1:x"),
            ("PYXIS_STAGE_OUT", "r:/out"),
        ]))
        .unwrap();
        assert_eq!(o.stage_in, ["/d1:x"]);
        assert!(o.stage_out.is_empty());
        let e = Options::default()
            .apply_env(env(&[("BERTH_STAGE_OUT", "r")]))
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--stage-out (from $BERTH_STAGE_OUT): invalid value 'r'"),
            "{e}"
        );
    }

    #[test]
    fn booleans_parse_like_pyxis() {
        for t in ["1", "true", "YES", "y", "on", " On "] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "false", "No", "n", "off"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        assert_eq!(parse_bool("2"), None);
        assert_eq!(parse_bool(""), None);
    }

    #[test]
    fn host_software_flags_from_flag_or_env_reach_the_request() {
        let mut o = Options::default();
        flag(&mut o, "container-modules", None).unwrap();
        assert_eq!(
            o.to_json().get("container-modules"),
            Some(&Value::Bool(true))
        );
        let mut o = Options::default();
        o.apply_env(env(&[("BERTH_CONTAINER_MODULES", "1")]))
            .unwrap();
        assert_eq!(
            o.to_json().get("container-modules"),
            Some(&Value::Bool(true))
        );
        let mut o = Options::default();
        flag(&mut o, "container-mpi", Some("host")).unwrap();
        assert_eq!(o.to_json()["container-mpi"], "host");
        let e = flag(&mut Options::default(), "container-mpi", Some("mpich")).unwrap_err();
        assert!(e.to_string().contains("use host or image"), "{e}");
        let mut o = Options::default();
        o.apply_env(env(&[("PYXIS_CONTAINER_MPI", "host")]))
            .unwrap();
        assert_eq!(o.to_json()["container-mpi"], "host");
        let mut o = Options::default();
        flag(&mut o, "container-slurm", None).unwrap();
        assert_eq!(o.to_json().get("container-slurm"), Some(&Value::Bool(true)));
        let e = flag(&mut o, "no-container-slurm", None).unwrap_err();
        assert!(e.to_string().contains("--container-slurm"), "{e}");
        let mut o = Options::default();
        o.apply_env(env(&[("PYXIS_CONTAINER_SLURM", "0")])).unwrap();
        assert_eq!(
            o.to_json().get("container-slurm"),
            Some(&Value::Bool(false))
        );
        assert_eq!(
            Options::default().to_json().get("container-slurm"),
            None,
            "unset: the site's host_software.slurm decides"
        );
    }
}
