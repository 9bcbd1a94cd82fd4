//! The caller's job of a connection that comes from this node itself: the ssh client runs in one
//! of the user's jobs here (`srun --jobid=J --overlap ssh node`, or a job's script that sshes to
//! another of its own nodes, which may be this one). pam_slurm_adopt asks the source node's
//! slurmd, which finds the client's socket and the process that holds it; on the same node the
//! module does that itself, without an RPC.
//!
//! sshd's socket for the connection is found among this process's descriptors in
//! /proc/net/tcp{,6}; the client's end is the entry with the two addresses swapped; the job is the
//! one of the user's running jobs (from squeue: nothing here decides which jobs are the user's)
//! whose cgroup holds a process with that socket open. Only the candidate jobs' processes are
//! read, at most `MAX_PIDS` of them and `MAX_FDS` descriptors each: a user's process count cannot
//! make a login slow. A user who moves a process of theirs between their own jobs' cgroups only
//! chooses between jobs that are theirs on this node anyway.

use std::path::{Path, PathBuf};

const MAX_PIDS: usize = 4096;
const MAX_FDS: usize = 4096;
const MAX_DIRS: usize = 4096;

/// One TCP socket of /proc/net/tcp{,6}: both ends as the kernel prints them, and its inode.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Socket {
    local: String,
    remote: String,
    inode: u64,
}

/// The ESTABLISHED sockets (state 01) of one /proc/net/tcp table.
fn parse_table(text: &str) -> Vec<Socket> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().take(10).collect();
            if f.len() < 10 || f[3] != "01" {
                return None;
            }
            Some(Socket {
                local: f[1].to_string(),
                remote: f[2].to_string(),
                inode: f[9].parse().ok()?,
            })
        })
        .collect()
}

/// The socket inodes among a process's descriptors (`/proc/<pid>/fd`), at most `MAX_FDS` read.
fn socket_inodes(fd_dir: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(fd_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .take(MAX_FDS)
        .filter_map(|e| {
            let link = std::fs::read_link(e.path()).ok()?;
            let link = link.to_str()?;
            link.strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// The inode of the client's end of this process's TCP connection, when the client is on this
/// node (its end is in this network namespace's tables).
fn client_socket() -> Option<u64> {
    let mine = socket_inodes(Path::new("/proc/self/fd"));
    let sockets: Vec<Socket> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(t).ok())
        .flat_map(|t| parse_table(&t))
        .collect();
    peer_of(&sockets, &mine)
}

/// The inode of the other end of the first of `mine` found in `sockets`.
fn peer_of(sockets: &[Socket], mine: &[u64]) -> Option<u64> {
    let own = sockets.iter().find(|s| mine.contains(&s.inode))?;
    sockets
        .iter()
        .find(|s| s.local == own.remote && s.remote == own.local && s.inode != 0)
        .map(|s| s.inode)
}

/// The cgroup directories of `job` under the cgroup mount: every cgroup v1 hierarchy's
/// `slurm[_<node>]/uid_<uid>/job_<job>` and cgroup v2's `[<node>_]slurmstepd.scope/job_<job>`.
fn job_dirs(mount: &Path, node: &str, uid: u32, job: u64) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = [
        "slurmstepd.scope".to_string(),
        format!("{node}_slurmstepd.scope"),
    ]
    .iter()
    .map(|scope| {
        mount
            .join("system.slice")
            .join(scope)
            .join(format!("job_{job}"))
    })
    .collect();
    if let Ok(hierarchies) = std::fs::read_dir(mount) {
        let tail = format!("uid_{uid}/job_{job}");
        for h in hierarchies.flatten().take(64) {
            let h = h.path();
            dirs.push(h.join(format!("slurm_{node}")).join(&tail));
            dirs.push(h.join("slurm").join(&tail));
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

/// The processes in `dir` and every cgroup below it, at most `MAX_PIDS`.
fn cgroup_pids(dir: &Path, pids: &mut Vec<u32>) {
    let mut todo = vec![dir.to_path_buf()];
    let mut seen = 0;
    while let Some(d) = todo.pop() {
        seen += 1;
        if seen > MAX_DIRS || pids.len() >= MAX_PIDS {
            return;
        }
        if let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) {
            pids.extend(
                text.lines()
                    .filter_map(|l| l.trim().parse::<u32>().ok())
                    .take(MAX_PIDS.saturating_sub(pids.len())),
            );
        }
        if let Ok(entries) = std::fs::read_dir(&d) {
            todo.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
}

/// Which of `jobs` (the user's running jobs on `node`) holds the ssh client of this process's
/// connection; None when the client is not on this node or in none of them.
pub fn local_caller_job(mount: &Path, node: &str, uid: u32, jobs: &[u64]) -> Option<u64> {
    let peer = client_socket()?;
    jobs.iter().copied().find(|&job| {
        let mut pids = Vec::new();
        for dir in job_dirs(mount, node, uid, job) {
            cgroup_pids(&dir, &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        pids.iter()
            .any(|pid| socket_inodes(&PathBuf::from(format!("/proc/{pid}/fd"))).contains(&peer))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1 0000000000000000 100 0 0 10 0
   1: 0100007F:0016 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 200 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:C350 0100007F:0016 01 00000000:00000000 00:00000000 00000000  1001        0 300 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:C351 0100007F:0016 01 00000000:00000000 00:00000000 00000000  1002        0 400 1 0000000000000000 20 4 30 10 -1
";

    #[test]
    fn the_client_end_is_the_swapped_established_entry() {
        let sockets = parse_table(TABLE);
        assert_eq!(sockets.len(), 3, "the listener is not established");
        assert_eq!(peer_of(&sockets, &[7, 200]), Some(300));
        assert_eq!(peer_of(&sockets, &[300]), Some(200));
        assert_eq!(peer_of(&sockets, &[100]), None);
        assert_eq!(peer_of(&sockets, &[]), None);
    }

    #[test]
    fn this_process_sockets_are_found_and_a_job_without_cgroups_holds_nothing() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let inodes = socket_inodes(Path::new("/proc/self/fd"));
        assert!(inodes.len() >= 3, "{inodes:?}");
        // Both ends are this process's: the peer of one of them is another of them.
        let sockets: Vec<Socket> = ["/proc/net/tcp"]
            .iter()
            .filter_map(|t| std::fs::read_to_string(t).ok())
            .flat_map(|t| parse_table(&t))
            .collect();
        let peer = peer_of(&sockets, &inodes).unwrap();
        assert!(inodes.contains(&peer));
        drop(client);
        let empty = std::env::temp_dir().join(format!("pam-berth-callerid-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        assert!(job_dirs(&empty, "n1", 5, 7).is_empty());
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
