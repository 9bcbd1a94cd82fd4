//! The flags' value parsers: each value is checked when the command line is parsed, before a
//! config is read, an image fetched or any state touched, so a typo costs nothing and fails with
//! exit 2 and one line. Each returns the typed value the verb uses (or the text, where the
//! library takes text and only the check belongs here), so no verb checks a flag twice.

use crate::spec::{self, parse};

/// A byte size: `--memory`, `--memory-swap`, `images gc --max-size`.
pub fn size(text: &str) -> Result<u64, String> {
    parse::size(text).map_err(|e| e.to_string())
}

/// A CPU count: `--cpus 0.5`.
pub fn cpus(text: &str) -> Result<i64, String> {
    parse::cpus(text, spec::CPU_PERIOD_US).map_err(|e| e.to_string())
}

/// A cgroup CPU list: `--cpuset 0-3,8`.
pub fn cpu_list(text: &str) -> Result<String, String> {
    parse::cpu_list(text).map_err(|e| e.to_string())
}

/// A kernel CPU list with strides (`topo --cpus 0-15:2`).
pub fn cpu_set(text: &str) -> Result<String, String> {
    crate::topology::cpuset::CpuSet::parse(text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string().replace(text, &crate::cli::elide(text)))
}

/// A positive number of tasks: `--pids`.
pub fn pids(text: &str) -> Result<i64, String> {
    match text.parse::<i64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "--pids {}: use a positive number of tasks",
            crate::cli::elide(text)
        )),
    }
}

/// A positive number of seconds: `--timeout`.
pub fn seconds(text: &str) -> Result<std::time::Duration, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .and_then(crate::time::duration_from_secs)
        .ok_or_else(|| {
            format!(
                "--timeout {}: use a positive number of seconds",
                crate::cli::elide(text)
            )
        })
}

/// A duration with a unit: `images gc --unused-for 7d`.
pub fn duration(text: &str) -> Result<std::time::Duration, String> {
    crate::image::store::parse_duration(text)
        .map_err(|e| e.to_string().replace(text, &crate::cli::elide(text)))
}

/// `--mount SRC:DST[:ro|rw]`.
pub fn mount(text: &str) -> Result<String, String> {
    parse::bind_mount(text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string())
}

/// `--env KEY=VAL`, or `KEY` alone (the caller's value, looked up when the verb runs). A
/// KEY with a control character is refused (a value may hold any but NUL: certificates,
/// exported shell functions).
pub fn env(text: &str) -> Result<String, String> {
    if text.contains('=') || text.is_empty() || text.contains('\0') {
        parse::env_pair(text).map_err(|e| e.to_string())?;
    }
    let key = text.split('=').next().unwrap_or_default();
    if berth_sys::text::control_char(key).is_some()
        && let Some(line) = berth_sys::text::refuse_control("--env", text)
    {
        return Err(line);
    }
    Ok(text.to_string())
}

/// `create --name`: not empty, and no control character (`berth ps` shows it in a row).
pub fn name(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("--name: give a name, or leave --name out".into());
    }
    match berth_sys::text::refuse_control("--name", text) {
        Some(line) => Err(line),
        None => Ok(text.to_string()),
    }
}

/// `--workdir`'s parser: [`workdir`] on the argument's bytes.
pub fn workdir_parser() -> impl clap::builder::TypedValueParser<Value = std::path::PathBuf> {
    use clap::builder::TypedValueParser;
    clap::builder::OsStringValueParser::new().try_map(workdir)
}

/// `--workdir`: an absolute path the kernel can take (any bytes, as a path may hold).
pub fn workdir(text: std::ffi::OsString) -> Result<std::path::PathBuf, String> {
    let path = std::path::PathBuf::from(text);
    if path.is_absolute() && path.as_os_str().len() < libc::PATH_MAX as usize {
        Ok(path)
    } else {
        Err(format!(
            "--workdir {}: must be an absolute path, shorter than PATH_MAX",
            crate::cli::elide(&path.to_string_lossy())
        ))
    }
}

/// `--hostname`.
pub fn hostname(text: &str) -> Result<String, String> {
    parse::hostname(text).map_err(|e| e.to_string())
}

/// `--gpus`: all, none, or indexes (ranges), GPU-UUIDs and PCI addresses; whether the node
/// has them is checked when the container is built.
pub fn gpus(text: &str) -> Result<String, String> {
    match text.trim() {
        "all" | "none" | "" => Ok(text.to_string()),
        list => crate::topology::job::parse_gpus("--gpus", list)
            .map(|_| text.to_string())
            .map_err(|e| e.to_string().replace(text, &crate::cli::elide(text))),
    }
}

/// `topo --gpus`: indexes (ranges), GPU-UUIDs and PCI addresses, as Slurm lists them.
pub fn gpu_list(text: &str) -> Result<String, String> {
    crate::topology::job::parse_gpus("--gpus", text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string().replace(text, &crate::cli::elide(text)))
}

/// `--device`: a device node path under /dev, or a CDI name `vendor.com/class=name`.
pub fn device(text: &str) -> Result<String, String> {
    if text.starts_with("/dev/") || crate::topology::cdi::is_qualified(text) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "--device {}: must be a device node under /dev, or a CDI name \
             (vendor.com/class=name)",
            crate::cli::elide(text)
        ))
    }
}

/// `cdi generate --gpu-kind/--hca-kind`: `vendor.com/class`.
pub fn cdi_kind(text: &str) -> Result<String, String> {
    if crate::topology::cdi::is_qualified(&format!("{text}=x")) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "CDI kind '{}': use vendor.com/class",
            crate::cli::elide(text)
        ))
    }
}
