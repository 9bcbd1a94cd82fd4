//! libpam's side: the few calls the module makes, resolved from the libpam already loaded into
//! the service that dlopens the module.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use crate::login::Joined;

/// libpam's `pam_handle_t`, opaque.
#[repr(C)]
#[derive(Debug)]
pub struct PamHandle {
    _private: [u8; 0],
}

pub const PAM_SUCCESS: c_int = 0;
pub const PAM_SYSTEM_ERR: c_int = 4;
pub const PAM_PERM_DENIED: c_int = 6;
pub const PAM_USER_UNKNOWN: c_int = 10;
pub const PAM_SESSION_ERR: c_int = 14;
pub const PAM_IGNORE: c_int = 25;
pub const PAM_SILENT: c_int = 0x8000;
const PAM_SERVICE: c_int = 1;
const PAM_RHOST: c_int = 4;
const PAM_ERROR_MSG: c_int = 3;
const PAM_TEXT_INFO: c_int = 4;

unsafe extern "C" {
    fn pam_get_user(pamh: *mut PamHandle, user: *mut *const c_char, prompt: *const c_char)
    -> c_int;
    fn pam_get_item(pamh: *const PamHandle, item_type: c_int, item: *mut *const c_void) -> c_int;
    fn pam_set_data(
        pamh: *mut PamHandle,
        name: *const c_char,
        data: *mut c_void,
        cleanup: Option<unsafe extern "C" fn(*mut PamHandle, *mut c_void, c_int)>,
    ) -> c_int;
    fn pam_get_data(pamh: *const PamHandle, name: *const c_char, data: *mut *const c_void)
    -> c_int;
    fn pam_prompt(
        pamh: *mut PamHandle,
        style: c_int,
        response: *mut *mut c_char,
        fmt: *const c_char,
        ...
    ) -> c_int;
    fn pam_syslog(pamh: *const PamHandle, priority: c_int, fmt: *const c_char, ...);
    fn pam_putenv(pamh: *mut PamHandle, name_value: *const c_char) -> c_int;
}

/// The module's view of one PAM handle, valid for one call from libpam.
#[derive(Debug)]
pub struct Pam {
    handle: *mut PamHandle,
}

const JOB_KEY: &CStr = c"pam_berth_job";

impl Pam {
    /// # Safety
    /// `handle` must be the handle libpam passed to the running `pam_sm_*` call.
    pub unsafe fn new(handle: *mut PamHandle) -> Pam {
        Pam { handle }
    }

    fn string_item(&self, item: c_int) -> Option<&str> {
        let mut p: *const c_void = std::ptr::null();
        // SAFETY: the handle is live (Pam::new's contract); libpam writes one pointer.
        let rc = unsafe { pam_get_item(self.handle, item, &raw mut p) };
        if rc != PAM_SUCCESS || p.is_null() {
            return None;
        }
        // SAFETY: string items are NUL-terminated and live as long as the handle.
        unsafe { CStr::from_ptr(p.cast()) }.to_str().ok()
    }

    pub fn service(&self) -> Option<&str> {
        self.string_item(PAM_SERVICE)
    }

    pub fn rhost(&self) -> Option<&str> {
        self.string_item(PAM_RHOST).filter(|h| !h.is_empty())
    }

    pub fn user(&self) -> Option<&str> {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: the handle is live; a null prompt means libpam's default.
        let rc = unsafe { pam_get_user(self.handle, &raw mut p, std::ptr::null()) };
        if rc != PAM_SUCCESS || p.is_null() {
            return None;
        }
        // SAFETY: PAM_USER is a NUL-terminated string owned by the handle.
        unsafe { CStr::from_ptr(p) }.to_str().ok()
    }

    /// Shows `line` to the user as an error (sshd prints it on the client's stderr).
    pub fn error(&self, line: &str) {
        self.prompt(PAM_ERROR_MSG, line);
    }

    /// Shows `line` to the user as information.
    pub fn info(&self, line: &str) {
        self.prompt(PAM_TEXT_INFO, line);
    }

    fn prompt(&self, style: c_int, line: &str) {
        let Ok(text) = CString::new(line.replace('\0', "")) else {
            return;
        };
        // SAFETY: the handle is live; "%s" with one C string argument.
        unsafe {
            pam_prompt(
                self.handle,
                style,
                std::ptr::null_mut(),
                c"%s".as_ptr(),
                text.as_ptr(),
            )
        };
    }

    pub fn log(&self, line: &str) {
        let Ok(text) = CString::new(line.replace('\0', "")) else {
            return;
        };
        // SAFETY: the handle is live; "%s" with one C string argument.
        unsafe { pam_syslog(self.handle, libc::LOG_ERR, c"%s".as_ptr(), text.as_ptr()) };
    }

    /// Sets `NAME=value` in the PAM environment, which sshd gives the session's processes
    /// (over its own defaults, PATH included).
    pub fn putenv(&self, var: &str) -> bool {
        let Ok(text) = CString::new(var) else {
            return false;
        };
        // SAFETY: the handle is live; libpam copies the string.
        unsafe { pam_putenv(self.handle, text.as_ptr()) == PAM_SUCCESS }
    }

    /// Keeps the account stage's job for the session stage of the same handle.
    pub fn set_job(&self, job: Option<Joined>) {
        unsafe extern "C" fn free(_: *mut PamHandle, data: *mut c_void, _: c_int) {
            if !data.is_null() {
                // SAFETY: data is the Box leaked by set_job, freed once by libpam.
                drop(unsafe { Box::from_raw(data.cast::<Option<Joined>>()) });
            }
        }
        let data = Box::into_raw(Box::new(job));
        // SAFETY: the handle is live; libpam owns data from here and calls free on it once.
        let rc = unsafe { pam_set_data(self.handle, JOB_KEY.as_ptr(), data.cast(), Some(free)) };
        if rc != PAM_SUCCESS {
            // SAFETY: libpam did not take data.
            drop(unsafe { Box::from_raw(data) });
        }
    }

    /// The account stage's job: None when that stage did not run on this handle.
    pub fn job(&self) -> Option<Option<Joined>> {
        let mut p: *const c_void = std::ptr::null();
        // SAFETY: the handle is live; libpam writes one pointer.
        let rc = unsafe { pam_get_data(self.handle, JOB_KEY.as_ptr(), &raw mut p) };
        if rc != PAM_SUCCESS || p.is_null() {
            return None;
        }
        // SAFETY: set_job stored an Option<Joined> under this key, alive until the handle ends.
        Some(unsafe { &*p.cast::<Option<Joined>>() }.clone())
    }
}

/// The module arguments libpam passed.
///
/// # Safety
/// `argv` must hold `argc` NUL-terminated strings, as libpam passes them.
pub unsafe fn args<'a>(argc: c_int, argv: *const *const c_char) -> Vec<&'a str> {
    let n = usize::try_from(argc).unwrap_or(0);
    if argv.is_null() {
        return Vec::new();
    }
    (0..n)
        .filter_map(|i| {
            // SAFETY: i < argc, per the contract.
            let p = unsafe { *argv.add(i) };
            // SAFETY: each argument is a NUL-terminated string that outlives the call.
            (!p.is_null())
                .then(|| unsafe { CStr::from_ptr(p) }.to_str().ok())
                .flatten()
        })
        .collect()
}
