//! `pam_berth.so`: sshd lets a user onto a compute node only while one of their Slurm jobs runs
//! there, and the session joins that job's extern step (`PrologFlags=Contain`), so Slurm counts
//! it, confines it to the job's resources and ends it with the job.
//!
//! Stacks: `account` decides (root and `admin_groups` always pass; others need a running job
//! here, from squeue with a deadline: see `jobs`; of several, the one the ssh client runs in,
//! see `callerid`); `session` moves sshd's process for the connection, and with it every process
//! of the session, into the job's extern step cgroups (`adopt`), then, when the job has a berth
//! container of the user's here, into its mount, UTS and IPC namespaces with no_new_privs
//! (`container`). Only the service named by `service=` (sshd) is acted on: under any other the
//! module returns PAM_IGNORE. Arguments: `options`;
//! docs/admin-guide.md, "Node access (ssh)".
//!
//! The pure parts are unit-tested; the libpam glue (`ffi`, the `pam_sm_*` entry points) is tested
//! end to end with a real sshd on a real Slurm (tests/root_pam.rs).

mod adopt;
mod callerid;
pub mod container;
mod error;
pub mod jobs;
pub mod login;
pub mod options;

#[cfg(not(test))]
mod ffi;

pub use error::PamError;

#[cfg(not(test))]
mod entry {
    use std::ffi::{c_char, c_int};
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use crate::ffi::{self, Pam, PamHandle};
    use crate::login::{self, Verdict};
    use crate::options::{self, Options};

    /// Runs a stage, turning a panic into PAM_SYSTEM_ERR: unwinding into sshd's C frames is
    /// undefined behaviour.
    fn guarded(f: impl FnOnce() -> c_int) -> c_int {
        catch_unwind(AssertUnwindSafe(f)).unwrap_or(ffi::PAM_SYSTEM_ERR)
    }

    /// What every stage needs first: the stage's options and the user, or the PAM code to return
    /// now (another service, root, an admin, an unknown user).
    enum Start {
        Done(c_int),
        Go(Box<(Options, login::User, String)>),
    }

    fn start(pam: &Pam, args: &[&str]) -> Start {
        // Cheapest first: another service's stack costs two string compares.
        if pam.service() != Some(options::service_of(args.iter().copied())) {
            return Start::Done(ffi::PAM_IGNORE);
        }
        let Some(name) = pam.user() else {
            return Start::Done(ffi::PAM_USER_UNKNOWN);
        };
        let Some(user) = login::lookup_user(name) else {
            return Start::Done(ffi::PAM_USER_UNKNOWN);
        };
        if user.uid == 0 {
            return Start::Done(ffi::PAM_SUCCESS);
        }
        let opts = match Options::parse(args.iter().copied()) {
            Ok(o) => o,
            Err(e) => {
                pam.log(&e.to_string());
                return Start::Done(ffi::PAM_SYSTEM_ERR);
            }
        };
        if login::in_groups(&user, &opts.admin_groups) {
            return Start::Done(ffi::PAM_SUCCESS);
        }
        let node = opts.nodename.clone().unwrap_or_else(login::short_hostname);
        Start::Go(Box::new((opts, user, node)))
    }

    fn account(pam: &Pam, flags: c_int, args: &[&str]) -> c_int {
        let (opts, user, node) = match start(pam, args) {
            Start::Done(rc) => return rc,
            Start::Go(go) => *go,
        };
        let silent = flags & ffi::PAM_SILENT != 0;
        match login::decide(&opts, &user, &node, pam.rhost()) {
            Verdict::Allow(job) => {
                pam.set_job(job);
                ffi::PAM_SUCCESS
            }
            Verdict::Ignore => ffi::PAM_IGNORE,
            Verdict::Deny(line) => {
                if !silent {
                    pam.error(&line);
                }
                pam.log(&format!("pam_berth: {} refused: {line}", user.name));
                ffi::PAM_PERM_DENIED
            }
            Verdict::Fail { log, user: line } => {
                if !silent {
                    pam.error(&line);
                }
                pam.log(&log);
                ffi::PAM_PERM_DENIED
            }
        }
    }

    fn open_session(pam: &Pam, args: &[&str]) -> c_int {
        let (opts, user, host_node) = match start(pam, args) {
            Start::Done(rc) => return rc,
            Start::Go(go) => *go,
        };
        let job = match pam.job() {
            Some(job) => job,
            // The account stage did not run on this handle (a stack without it): decide now.
            None => match login::decide(&opts, &user, &host_node, pam.rhost()) {
                Verdict::Allow(job) => job,
                Verdict::Ignore => return ffi::PAM_IGNORE,
                Verdict::Deny(line) | Verdict::Fail { log: line, .. } => {
                    pam.log(&line);
                    return ffi::PAM_SESSION_ERR;
                }
            },
        };
        let Some(login::Joined { job, node }) = job else {
            return ffi::PAM_SUCCESS;
        };
        let joined = login::adopt(&opts, &user, &node, job, std::process::id()).and_then(|()| {
            if !opts.container {
                return Ok(None);
            }
            // Everything from the host's paths first: the container's mount namespace has none.
            let want = crate::container::chosen_name(&user.home, user.uid, user.gid);
            let Some(c) = crate::container::find(&opts.state_dir, user.uid, job, want.as_deref())
            else {
                return Ok(None);
            };
            let env = crate::container::environment(&c);
            crate::container::join(&c)?;
            for var in &env {
                pam.putenv(var);
            }
            Ok(Some(c))
        });
        match joined {
            Ok(Some(c)) => {
                pam.info(&format!("berth: job {job}, container {}", c.label()));
                ffi::PAM_SUCCESS
            }
            Ok(None) => ffi::PAM_SUCCESS,
            Err(e) => {
                pam.log(&e.to_string());
                if opts.adopt_failure_allow {
                    ffi::PAM_SUCCESS
                } else {
                    pam.error(&format!(
                        "berth: access denied: joining job {job} on {node} failed"
                    ));
                    ffi::PAM_SESSION_ERR
                }
            }
        }
    }

    /// # Safety
    /// Called by libpam with a live handle and `argc` argument strings.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn pam_sm_acct_mgmt(
        pamh: *mut PamHandle,
        flags: c_int,
        argc: c_int,
        argv: *const *const c_char,
    ) -> c_int {
        guarded(|| {
            // SAFETY: libpam's arguments, per this function's contract.
            let (pam, args) = unsafe { (Pam::new(pamh), ffi::args(argc, argv)) };
            account(&pam, flags, &args)
        })
    }

    /// # Safety
    /// Called by libpam with a live handle and `argc` argument strings.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn pam_sm_open_session(
        pamh: *mut PamHandle,
        _flags: c_int,
        argc: c_int,
        argv: *const *const c_char,
    ) -> c_int {
        guarded(|| {
            // SAFETY: libpam's arguments, per this function's contract.
            let (pam, args) = unsafe { (Pam::new(pamh), ffi::args(argc, argv)) };
            open_session(&pam, &args)
        })
    }

    /// Nothing to undo: the session's processes leave the job's cgroups when they exit.
    #[unsafe(no_mangle)]
    pub extern "C" fn pam_sm_close_session(
        _pamh: *mut PamHandle,
        _flags: c_int,
        _argc: c_int,
        _argv: *const *const c_char,
    ) -> c_int {
        ffi::PAM_SUCCESS
    }
}
