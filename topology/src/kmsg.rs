//! NVIDIA XID events from the kernel log (`/dev/kmsg`). The driver logs each one as
//! `NVRM: Xid (PCI:0000:1b:00): 79, pid=..., GPU has fallen off the bus.`; reading the log works
//! across processes, so a Prolog can note where the log stood and the Epilog report the XIDs
//! that came during the job. A regular file in the same record format serves tests.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::Serialize;

use super::TopologyError;

/// One kernel log record: `prio,seq,usec,flags;text`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    /// Microseconds since boot (CLOCK_MONOTONIC).
    pub usec: u64,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Xid {
    pub seq: u64,
    /// The GPU as the driver names it: `0000:1b:00` (no function).
    pub slot: String,
    pub code: u32,
    pub text: String,
}

pub fn parse_record(line: &str) -> Option<Record> {
    let (head, text) = line.split_once(';')?;
    let mut f = head.split(',');
    let _prio = f.next()?;
    let seq = f.next()?.parse().ok()?;
    let usec = f.next()?.parse().ok()?;
    Some(Record {
        seq,
        usec,
        text: text.to_string(),
    })
}

/// The XID in a log message, if it is one.
pub fn parse_xid(seq: u64, text: &str) -> Option<Xid> {
    let rest = &text[text.find("Xid (PCI:")? + "Xid (PCI:".len()..];
    let (slot, rest) = rest.split_once(')')?;
    let rest = rest.trim_start_matches(':').trim_start();
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    Some(Xid {
        seq,
        slot: slot.trim().to_lowercase(),
        code: digits.parse().ok()?,
        text: text.trim().to_string(),
    })
}

/// Every record the log holds now. The kernel hands out one record per read and answers EAGAIN
/// at the end (EPIPE when records were overwritten while reading, which only skips them).
pub fn read(path: &Path) -> Result<Vec<Record>, TopologyError> {
    let err = |source| TopologyError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(err)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let mut carry = String::new();
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                carry.push_str(&String::from_utf8_lossy(&buf[..n]));
                while let Some(i) = carry.find('\n') {
                    let line: String = carry.drain(..=i).collect();
                    // Continuation lines (" SUBSYSTEM=pci") belong to the record before.
                    if !line.starts_with(' ')
                        && let Some(r) = parse_record(line.trim_end())
                    {
                        out.push(r);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(err(e)),
        }
    }
    if let Some(r) = parse_record(carry.trim_end()) {
        out.push(r);
    }
    Ok(out)
}

/// The XIDs among `records` after sequence number `after` (all when `None`).
pub fn xids(records: &[Record], after: Option<u64>) -> Vec<Xid> {
    records
        .iter()
        .filter(|r| after.is_none_or(|a| r.seq > a))
        .filter_map(|r| parse_xid(r.seq, &r.text))
        .collect()
}

/// The sequence number of the newest record (where the log stands now).
pub fn last_seq(records: &[Record]) -> Option<u64> {
    records.iter().map(|r| r.seq).max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xids_are_found_in_driver_messages() {
        let x = parse_xid(
            7,
            "NVRM: Xid (PCI:0000:1B:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        )
        .unwrap();
        assert_eq!((x.slot.as_str(), x.code), ("0000:1b:00", 79));
        assert!(parse_xid(1, "usb 1-1: new device").is_none());
        assert!(parse_xid(1, "NVRM: Xid (PCI:0000:1b:00): x").is_none());
    }

    #[test]
    fn the_log_is_read_record_by_record_and_filtered_by_sequence() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("kmsg");
        std::fs::write(
            &log,
            "6,100,5000,-;Linux version 6.1\n SUBSYSTEM=pci\n4,101,6000,-;NVRM: Xid (PCI:0000:1b:00): 48, pid=1, DBE\n4,102,7000,-;NVRM: Xid (PCI:0000:43:00): 13, pid=2, Graphics Exception\ngarbage\n",
        )
        .unwrap();
        let records = read(&log).unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(last_seq(&records), Some(102));
        let all: Vec<u32> = xids(&records, None).iter().map(|x| x.code).collect();
        assert_eq!(all, [48, 13]);
        let later: Vec<u32> = xids(&records, Some(101)).iter().map(|x| x.code).collect();
        assert_eq!(later, [13]);
    }

    #[test]
    fn the_live_kernel_log_reads_without_blocking() {
        // /dev/kmsg needs root (or dmesg_restrict=0); elsewhere the error names the path.
        match read(Path::new("/dev/kmsg")) {
            Ok(records) => assert!(!records.is_empty()),
            Err(e) => assert!(e.to_string().contains("/dev/kmsg"), "{e}"),
        }
    }
}
