//! Hand-written bindings to the part of `slurm/spank.h` the plugin uses, and thin safe wrappers.
//! The symbols are resolved at load time from `libslurmfull.so`, which srun, sbatch, salloc,
//! slurmd and slurmstepd already link: the plugin does not link libslurm. The enum values come
//! from the installed headers (build.rs). Not compiled into unit tests, where these symbols do
//! not exist.

#![allow(non_camel_case_types)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use crate::SpankError;

#[allow(dead_code)]
mod abi {
    include!(concat!(env!("OUT_DIR"), "/slurm_abi.rs"));
}
pub use abi::*;

pub type spank_t = *mut c_void;
pub type spank_opt_cb_f = Option<unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int>;

#[repr(C)]
pub struct spank_option {
    pub name: *const c_char,
    pub arginfo: *const c_char,
    pub usage: *const c_char,
    pub has_arg: c_int,
    pub val: c_int,
    pub cb: spank_opt_cb_f,
}

unsafe extern "C" {
    fn spank_option_register(sp: spank_t, opt: *mut spank_option) -> c_int;
    fn spank_get_item(sp: spank_t, item: c_int, ...) -> c_int;
    fn spank_getenv(sp: spank_t, var: *const c_char, buf: *mut c_char, len: c_int) -> c_int;
    fn spank_setenv(sp: spank_t, var: *const c_char, val: *const c_char, overwrite: c_int)
    -> c_int;
    fn spank_unsetenv(sp: spank_t, var: *const c_char) -> c_int;
    fn spank_job_control_setenv(
        sp: spank_t,
        name: *const c_char,
        value: *const c_char,
        overwrite: c_int,
    ) -> c_int;
    fn spank_context() -> c_int;
    fn spank_strerror(err: c_int) -> *const c_char;
    fn slurm_error(fmt: *const c_char, ...);
    fn slurm_info(fmt: *const c_char, ...);
    fn slurm_debug(fmt: *const c_char, ...);
    fn slurm_spank_log(fmt: *const c_char, ...);
}

/// Where the plugin is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// srun
    Local,
    /// slurmstepd
    Remote,
    /// sbatch, salloc
    Allocator,
    Slurmd,
    JobScript,
    Other,
}

pub fn context() -> Context {
    // SAFETY: no arguments; returns an enum value.
    match unsafe { spank_context() } {
        S_CTX_LOCAL => Context::Local,
        S_CTX_REMOTE => Context::Remote,
        S_CTX_ALLOCATOR => Context::Allocator,
        S_CTX_SLURMD => Context::Slurmd,
        S_CTX_JOB_SCRIPT => Context::JobScript,
        _ => Context::Other,
    }
}

/// Text for a spank error code.
pub fn strerror(code: c_int) -> String {
    // SAFETY: spank_strerror returns a static string for any code.
    let p = unsafe { spank_strerror(code) };
    if p.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).expect("NULs replaced")
}

/// An error line: srun shows it as `slurmstepd: error: MSG` (or `srun: error: MSG`).
pub fn log_error(msg: impl std::fmt::Display) {
    let m = cstring(&msg.to_string());
    // SAFETY: "%s" with one valid C string argument.
    unsafe { slurm_error(c"%s".as_ptr(), m.as_ptr()) }
}

/// A line the user sees without the `error:` prefix.
pub fn log_user(msg: impl std::fmt::Display) {
    let m = cstring(&msg.to_string());
    // SAFETY: "%s" with one valid C string argument.
    unsafe { slurm_spank_log(c"%s".as_ptr(), m.as_ptr()) }
}

/// A line for the daemon's log.
pub fn log_info(msg: impl std::fmt::Display) {
    let m = cstring(&msg.to_string());
    // SAFETY: "%s" with one valid C string argument.
    unsafe { slurm_info(c"%s".as_ptr(), m.as_ptr()) }
}

pub fn log_debug(msg: impl std::fmt::Display) {
    let m = cstring(&msg.to_string());
    // SAFETY: "%s" with one valid C string argument.
    unsafe { slurm_debug(c"%s".as_ptr(), m.as_ptr()) }
}

/// Registers one option. The strings must live as long as the process (they are `'static`);
/// the struct is leaked because Slurm may keep a pointer to it.
pub fn register_option(
    sp: spank_t,
    name: &'static CStr,
    arginfo: Option<&'static CStr>,
    usage: &'static CStr,
    val: c_int,
    cb: unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int,
) -> Result<(), SpankError> {
    let opt = Box::leak(Box::new(spank_option {
        name: name.as_ptr(),
        arginfo: arginfo.map_or(std::ptr::null(), |a| a.as_ptr()),
        usage: usage.as_ptr(),
        has_arg: c_int::from(arginfo.is_some()),
        val,
        cb: Some(cb),
    }));
    // SAFETY: a valid handle from Slurm and a valid, never-freed option struct.
    let rc = unsafe { spank_option_register(sp, opt) };
    if rc == ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(SpankError::Slurm(strerror(rc)))
    }
}

/// A `uint32_t`-valued item (S_JOB_ID, S_JOB_STEPID, S_JOB_LOCAL_TASK_COUNT, uid and gid).
pub fn get_u32(sp: spank_t, item: c_int) -> Result<u32, SpankError> {
    let mut v: u32 = 0;
    // SAFETY: every item passed here takes one pointer to a 32-bit integer (uid_t, gid_t and
    // uint32_t are all 32 bits on Linux).
    let rc = unsafe { spank_get_item(sp, item, &mut v as *mut u32) };
    if rc == ESPANK_SUCCESS {
        Ok(v)
    } else {
        Err(SpankError::Slurm(strerror(rc)))
    }
}

/// The job's environment (S_JOB_ENV), copied.
pub fn job_env(sp: spank_t) -> Result<Vec<String>, SpankError> {
    let mut envp: *const *const c_char = std::ptr::null();
    // SAFETY: S_JOB_ENV takes a `char ***`; Slurm fills in its own array, which we only read.
    let rc = unsafe { spank_get_item(sp, S_JOB_ENV, &mut envp as *mut *const *const c_char) };
    if rc != ESPANK_SUCCESS {
        return Err(SpankError::Slurm(strerror(rc)));
    }
    let mut out = Vec::new();
    if envp.is_null() {
        return Ok(out);
    }
    for i in 0.. {
        // SAFETY: a NULL-terminated array of C strings owned by Slurm, read before any call
        // that could change it.
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: each entry is a NUL-terminated string.
        out.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    }
    Ok(out)
}

/// The step's command line (S_JOB_ARGV): for the batch step, the script's path in the spool.
pub fn job_argv(sp: spank_t) -> Result<Vec<String>, SpankError> {
    let mut argc: c_int = 0;
    let mut argv: *const *const c_char = std::ptr::null();
    // SAFETY: S_JOB_ARGV takes an `int *` and a `char ***`; Slurm fills in its own array.
    let rc = unsafe {
        spank_get_item(
            sp,
            S_JOB_ARGV,
            &mut argc as *mut c_int,
            &mut argv as *mut *const *const c_char,
        )
    };
    if rc != ESPANK_SUCCESS {
        return Err(SpankError::Slurm(strerror(rc)));
    }
    let mut out = Vec::new();
    if argv.is_null() {
        return Ok(out);
    }
    for i in 0..usize::try_from(argc).unwrap_or(0) {
        // SAFETY: `argc` entries, each NUL-terminated or NULL.
        let p = unsafe { *argv.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: as above.
        out.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    }
    Ok(out)
}

/// One variable of the job's environment (remote context).
pub fn getenv(sp: spank_t, name: &str) -> Option<String> {
    let n = cstring(name);
    let mut len = 4096usize;
    loop {
        let mut buf = vec![0u8; len];
        // SAFETY: buf has `len` writable bytes; spank_getenv NUL-terminates within them.
        let rc = unsafe {
            spank_getenv(
                sp,
                n.as_ptr(),
                buf.as_mut_ptr().cast::<c_char>(),
                c_int::try_from(len).unwrap_or(c_int::MAX),
            )
        };
        match rc {
            ESPANK_SUCCESS => {
                let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
                return Some(String::from_utf8_lossy(&buf[..end]).into_owned());
            }
            ESPANK_NOSPACE if len < (1 << 24) => len *= 4,
            _ => return None,
        }
    }
}

pub fn setenv(sp: spank_t, name: &str, value: &str) -> Result<(), SpankError> {
    let (n, v) = (cstring(name), cstring(value));
    // SAFETY: valid handle and C strings; Slurm copies them.
    let rc = unsafe { spank_setenv(sp, n.as_ptr(), v.as_ptr(), 1) };
    if rc == ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(SpankError::Slurm(strerror(rc)))
    }
}

pub fn unsetenv(sp: spank_t, name: &str) -> Result<(), SpankError> {
    let n = cstring(name);
    // SAFETY: valid handle and C string.
    let rc = unsafe { spank_unsetenv(sp, n.as_ptr()) };
    if rc == ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(SpankError::Slurm(strerror(rc)))
    }
}

/// Passes NAME=VALUE to the Prolog and Epilog, where it arrives as `SPANK_NAME`.
pub fn job_control_setenv(sp: spank_t, name: &str, value: &str) -> Result<(), SpankError> {
    let (n, v) = (cstring(name), cstring(value));
    // SAFETY: valid handle and C strings; Slurm copies them.
    let rc = unsafe { spank_job_control_setenv(sp, n.as_ptr(), v.as_ptr(), 1) };
    if rc == ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(SpankError::Slurm(strerror(rc)))
    }
}

/// The plugin's arguments from plugstack.conf.
pub fn args(ac: c_int, av: *mut *mut c_char) -> Vec<String> {
    let mut out = Vec::new();
    if av.is_null() {
        return out;
    }
    for i in 0..usize::try_from(ac).unwrap_or(0) {
        // SAFETY: Slurm passes `ac` valid C strings in `av`.
        let p = unsafe { *av.add(i) };
        if !p.is_null() {
            // SAFETY: NUL-terminated.
            out.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    out
}
