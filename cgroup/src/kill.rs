//! Emptying a cgroup: killing everything in it and waiting until the kernel reports it
//! unpopulated. `cgroup.kill` (Linux 5.14) kills a whole subtree atomically, forks included;
//! older kernels get the freeze-then-SIGKILL fallback.

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::group::{child_dirs, parse_populated};
use super::{Cgroup, CgroupError, files};

/// Without a freezer, processes can fork between reading cgroup.procs and the kill; repeat.
const UNFROZEN_KILL_ROUNDS: u32 = 20;
const UNFROZEN_ROUND_DELAY: Duration = Duration::from_millis(5);
/// Upper bound on one sleep while waiting: a missed cgroup.events notification costs at most this.
const MAX_POLL_SLICE: Duration = Duration::from_millis(100);

impl Cgroup {
    /// Kill every process in this cgroup and its descendants with `cgroup.kill`; on kernels
    /// without it, freeze the subtree and SIGKILL each pid ([`Cgroup::kill_by_signal`]). A cgroup
    /// that no longer exists has nothing to kill. Returns before the processes are gone: use
    /// [`Cgroup::wait_empty`].
    pub fn kill(&self) -> Result<(), CgroupError> {
        match files::write(&self.path().join("cgroup.kill"), "1") {
            Ok(()) => Ok(()),
            Err(CgroupError::Write { source, .. }) if files::is_not_found(&source) => {
                if self.path().exists() {
                    self.kill_by_signal()
                } else {
                    Ok(())
                }
            }
            Err(e) => Err(e),
        }
    }

    /// The fallback behind [`Cgroup::kill`] for kernels before 5.14: freeze the subtree (so
    /// nothing forks or exits while the pids are read), SIGKILL every pid in every
    /// cgroup.procs, then thaw so the kills take effect. Without `cgroup.freeze` (before 5.2)
    /// it repeats the sweep until no pid is left or the rounds run out.
    pub fn kill_by_signal(&self) -> Result<(), CgroupError> {
        let freeze = self.path().join("cgroup.freeze");
        let frozen = match files::write(&freeze, "1") {
            Ok(()) => true,
            Err(CgroupError::Write { source, .. }) if files::is_not_found(&source) => false,
            Err(e) => return Err(e),
        };
        let swept = if frozen {
            sweep(self.path()).map(|_| ())
        } else {
            (|| {
                for _ in 0..UNFROZEN_KILL_ROUNDS {
                    if sweep(self.path())? == 0 {
                        break;
                    }
                    sleep(UNFROZEN_ROUND_DELAY);
                }
                Ok(())
            })()
        };
        let thawed = if frozen && self.path().exists() {
            files::write(&freeze, "0")
        } else {
            Ok(())
        };
        swept.and(thawed)
    }

    /// Wait until nothing runs in this cgroup, at most `timeout`. `Ok(true)` when it is empty
    /// (or gone), `Ok(false)` on timeout. Sleeps in poll(2) on cgroup.events, which the kernel
    /// signals with POLLPRI when `populated` changes.
    pub fn wait_empty(&self, timeout: Duration) -> Result<bool, CgroupError> {
        let deadline = berth_sys::time::deadline_after(timeout);
        let path = self.path().join("cgroup.events");
        let mut file = match files::open(&path) {
            Ok(f) => f,
            Err(e) if files::is_not_found(&e) && !self.path().exists() => return Ok(true),
            Err(e) => {
                return Err(CgroupError::io(
                    "open",
                    path,
                    e,
                    "check the cgroup is a cgroup v2 directory",
                ));
            }
        };
        let mut content = String::new();
        loop {
            content.clear();
            // kernfs re-generates the file on each read from offset 0; reading also re-arms
            // the poll notification.
            let read = file
                .seek(SeekFrom::Start(0))
                .and_then(|_| file.read_to_string(&mut content));
            match read {
                Ok(_) => {}
                // The cgroup was removed while we waited: nothing can run in it.
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) || files::is_not_found(&e) => {
                    return Ok(true);
                }
                Err(e) => {
                    return Err(CgroupError::io(
                        "read",
                        path,
                        e,
                        "check the cgroup still exists",
                    ));
                }
            }
            match parse_populated(&content) {
                Some(false) => return Ok(true),
                Some(true) => {}
                None => {
                    return Err(CgroupError::io(
                        "parse",
                        path,
                        std::io::Error::new(std::io::ErrorKind::InvalidData, "no 'populated' line"),
                        "this does not look like a cgroup v2 directory",
                    ));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let slice = (deadline - now).min(MAX_POLL_SLICE);
            let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLPRI)];
            let ms = PollTimeout::try_from(slice).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, ms) {
                Ok(_) | Err(Errno::EINTR) => {}
                // poll on cgroupfs unsupported (never seen, but cheap to survive): short sleeps.
                Err(_) => sleep(slice.min(Duration::from_millis(10))),
            }
        }
    }
}

/// One SIGKILL pass over the subtree at `dir`. Returns how many pids were signalled.
fn sweep(dir: &Path) -> Result<usize, CgroupError> {
    let mut count = 0;
    let mut stack: Vec<PathBuf> = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        stack.extend(child_dirs(&d)?);
        let Some(procs) = files::read_optional(&d.join("cgroup.procs")) else {
            continue;
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            if pid <= 0 {
                continue;
            }
            match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                Ok(()) => count += 1,
                // Exited since the read.
                Err(Errno::ESRCH) => {}
                Err(e) => {
                    return Err(CgroupError::Signal {
                        pid,
                        path: d.clone(),
                        source: e.into(),
                    });
                }
            }
        }
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_of_a_missing_cgroup_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        Cgroup::at(dir.path().join("gone")).kill().unwrap();
    }

    #[test]
    fn wait_empty_on_a_missing_cgroup_is_immediately_true() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            Cgroup::at(dir.path().join("gone"))
                .wait_empty(Duration::from_secs(5))
                .unwrap()
        );
    }

    #[test]
    fn wait_empty_reads_populated_and_times_out() {
        // A regular file stands in for cgroup.events: poll returns at once on it, so this
        // exercises the re-read loop and the deadline.
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("cgroup.events");
        std::fs::write(&events, "populated 0\nfrozen 0\n").unwrap();
        let cg = Cgroup::at(dir.path().to_path_buf());
        assert!(cg.wait_empty(Duration::from_secs(5)).unwrap());
        std::fs::write(&events, "populated 1\nfrozen 0\n").unwrap();
        let start = Instant::now();
        assert!(!cg.wait_empty(Duration::from_millis(50)).unwrap());
        assert!(start.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn sweep_of_an_empty_tree_signals_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("child")).unwrap();
        std::fs::write(dir.path().join("cgroup.procs"), "").unwrap();
        std::fs::write(dir.path().join("child/cgroup.procs"), "\n").unwrap();
        assert_eq!(sweep(dir.path()).unwrap(), 0);
    }
}
