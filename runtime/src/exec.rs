//! The last step in the container: find the command on the container's PATH and exec it,
//! turning failures into the shell's conventions (127 not found, 126 not executable).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, signal, sigprocmask};
use nix::unistd::execve;

use super::SetupError;

/// Where to look for `cmd`: itself when it has a `/`, else each PATH entry (empty = cwd).
pub fn candidates(cmd: &str, path_var: Option<&str>) -> Vec<PathBuf> {
    if cmd.contains('/') {
        return vec![PathBuf::from(cmd)];
    }
    path_var
        .unwrap_or(berth_spec::DEFAULT_PATH)
        .split(':')
        .map(|dir| {
            if dir.is_empty() {
                Path::new(".").join(cmd)
            } else {
                Path::new(dir).join(cmd)
            }
        })
        .collect()
}

/// Execs the command; returns only on failure, with the exit code the shell would give.
pub fn exec(args: &[CString], env: &[CString]) -> SetupError {
    let Some(cmd) = args.first() else {
        return SetupError::with_code(125, "no command given".into());
    };
    // The command gets the signal state any command expects: nothing blocked (berth blocks the
    // signals it forwards) and SIGPIPE at its default, which an exec would otherwise keep
    // ignored from Rust's runtime (then in `yes | head`, `yes` fails with "Broken pipe" instead
    // of ending quietly). Other dispositions stay the caller's, as across any exec:
    // `nohup berth run …` keeps SIGHUP from the command.
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler; no other thread
    // runs in this process between its fork and the exec.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    let cmd_str = cmd.to_string_lossy();
    let path_var = env
        .iter()
        .filter_map(|e| e.to_str().ok())
        .find_map(|e| e.strip_prefix("PATH="));
    let mut denied = None;
    for candidate in candidates(&cmd_str, path_var) {
        let Ok(c_path) = CString::new(candidate.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        match execve::<&CStr, &CStr>(
            &c_path,
            &args.iter().map(|a| a.as_c_str()).collect::<Vec<_>>(),
            &env.iter().map(|e| e.as_c_str()).collect::<Vec<_>>(),
        ) {
            Err(Errno::ENOENT | Errno::ENOTDIR) => {}
            Err(e) => denied = Some((candidate, e)),
            Ok(never) => match never {},
        }
    }
    match denied {
        Some((path, e)) => SetupError::with_code(
            126,
            format!("cannot execute {} in the container: {e}", path.display()),
        ),
        None => SetupError::with_code(
            127,
            format!("command not found in the container: {cmd_str} (check the image's PATH)"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_search_order() {
        assert_eq!(
            candidates("/bin/sh", Some("/x")),
            vec![PathBuf::from("/bin/sh")]
        );
        assert_eq!(candidates("./run", None), vec![PathBuf::from("./run")]);
        assert_eq!(
            candidates("ls", Some("/usr/bin::/bin")),
            vec![
                PathBuf::from("/usr/bin/ls"),
                PathBuf::from("./ls"),
                PathBuf::from("/bin/ls")
            ]
        );
        assert_eq!(candidates("ls", None).len(), 6);
    }
}
