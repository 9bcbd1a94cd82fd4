//! The one-way channel from the container's init (and the command, until it execs) to berth:
//! setup timings and the one error that stopped the start. One line per message.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// The longest line sent: the few messages of one start stay far below a pipe's capacity, so
/// no writer ever blocks on a reader that waits for the end (see [`receive_all`]).
const LINE_LIMIT: usize = 4096;

#[derive(Debug, PartialEq, Eq)]
pub enum Message {
    Timing(&'static str, Duration),
    Error(i32, String),
}

impl Message {
    fn encode(&self) -> String {
        match self {
            Message::Timing(stage, d) => format!("T {stage} {}\n", d.as_micros()),
            Message::Error(code, msg) => format!("E {code} {}\n", msg.replace('\n', " ")),
        }
    }
}

/// A message as the parent reads it back (stage names become owned strings).
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    Timing(String, Duration),
    Error(i32, String),
}

/// Writes one message; best effort, as the reader may be gone.
pub fn send(fd: &OwnedFd, msg: &Message) {
    let mut line = msg.encode();
    if line.len() > LINE_LIMIT {
        let mut end = LINE_LIMIT - 4;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push_str("...\n");
    }
    // SAFETY: write(2) from a valid buffer to an fd we hold; a short write of these small lines
    // cannot happen on a pipe (PIPE_BUF atomicity) unless the message is huge.
    let _ = unsafe { libc::write(fd.as_raw_fd(), line.as_ptr().cast(), line.len()) };
}

/// Reads messages until every writer has closed the pipe.
pub fn receive_all(fd: OwnedFd) -> Vec<Received> {
    // Sleep until the last writer is gone, not once per message: a poll for hang-up alone (an
    // empty event mask) is not woken by the writes, so init's timing line does not wake berth
    // to compete with init for a CPU on the way to the command's exec. The messages wait in the
    // pipe (LINE_LIMIT keeps them within its capacity).
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::empty())];
    while let Err(Errno::EINTR) = poll(&mut fds, PollTimeout::NONE) {}
    let mut text = String::new();
    let _ = std::fs::File::from(fd).read_to_string(&mut text);
    parse(&text)
}

pub fn parse(text: &str) -> Vec<Received> {
    text.lines()
        .filter_map(|line| {
            let (kind, rest) = line.split_once(' ')?;
            let (a, b) = rest.split_once(' ').unwrap_or((rest, ""));
            match kind {
                "T" => Some(Received::Timing(
                    a.to_string(),
                    Duration::from_micros(b.parse().ok()?),
                )),
                "E" => Some(Received::Error(a.parse().ok()?, b.to_string())),
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let text = [
            Message::Timing("mounts", Duration::from_micros(1234)).encode(),
            Message::Error(127, "command not found\nin the container: x".into()).encode(),
        ]
        .concat();
        assert_eq!(
            parse(&text),
            vec![
                Received::Timing("mounts".into(), Duration::from_micros(1234)),
                Received::Error(127, "command not found in the container: x".into()),
            ]
        );
        assert!(parse("garbage\nT x notanumber\n").is_empty());
    }

    #[test]
    fn a_huge_message_is_cut_so_the_writer_never_blocks() {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        // Larger than a pipe's capacity, with a multi-byte character at the cut.
        let message = "é".repeat(100_000);
        send(&w, &Message::Error(126, message));
        send(&w, &Message::Timing("mounts", Duration::from_micros(7)));
        drop(w);
        let got = receive_all(r);
        let Received::Error(126, text) = &got[0] else {
            panic!("{got:?}")
        };
        assert!(
            text.len() < LINE_LIMIT && text.ends_with("..."),
            "{}",
            text.len()
        );
        assert_eq!(
            got[1],
            Received::Timing("mounts".into(), Duration::from_micros(7))
        );
    }
}
