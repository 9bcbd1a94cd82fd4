//! The seccomp filter of remapped containers (`berth run --remap-root`, Pyxis's
//! `--container-remap-root`), as Enroot's: the ownership and identity calls that cannot succeed
//! in a user namespace mapping one id (chown to another user, setuid/setgid/setgroups to another
//! id) report success without doing anything, so that package managers work: apt's and dpkg's
//! chowns to `_apt` or `man`, and the switches of their sandboxes.
//!
//! Why this is safe: the filter grants nothing. A faked call never reaches the kernel, so it
//! changes no file's owner and no credential; the only effect is that the process is told a
//! call succeeded that would have failed (EPERM/EINVAL). The process keeps exactly the rights
//! it had: the user's own, seen as root in its namespace, without capabilities. Every other call
//! (including every other architecture's and x32's, whose numbers differ) runs as usual; so does
//! `setfsuid(-1)`/`setfsgid(-1)`, the idiom that asks for the current id. A program that drops
//! to another user to protect itself (apt's `_apt` downloader) then keeps the user's own rights,
//! which is no more than the user had anyway. Installed after the container's user and
//! `no_new_privs` are in place (seccomp needs the latter without CAP_SYS_ADMIN; our own
//! setresuid must not be faked), and inherited by everything the command starts; no process
//! can remove it.
//!
//! In berth-sys because both sides install it: berth's init on the command and on processes
//! joining the container, and the SPANK plugin on the Slurm tasks it moves into a remapped
//! container, as Pyxis does.

/// `AUDIT_ARCH_*` from linux/audit.h: EM_X86_64 and EM_AARCH64, 64-bit, little-endian.
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
const AUDIT_ARCH_AARCH64: u32 = 0xC000_00B7;

/// Offsets in `struct seccomp_data` (`nr`, `arch`, the low word of `args[0]` on little-endian).
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARG0_LOW: u32 = 16;

/// One architecture's syscall numbers the filter fakes.
#[derive(Debug)]
pub struct Table {
    /// `seccomp_data.arch` of these numbers; calls of any other architecture run as usual.
    pub arch: u32,
    /// Always reported as successful.
    pub faked: &'static [u32],
    /// setfsuid and setfsgid: reported as successful unless the id is -1 (a query).
    pub fs_ids: &'static [u32],
}

/// x86_64: chown, fchown, lchown, setuid, setgid, setreuid, setregid, setgroups, setresuid,
/// setresgid, fchownat; setfsuid, setfsgid.
pub const X86_64: Table = Table {
    arch: AUDIT_ARCH_X86_64,
    faked: &[92, 93, 94, 105, 106, 113, 114, 116, 117, 119, 260],
    fs_ids: &[122, 123],
};

/// aarch64 (asm-generic numbers, no chown/lchown): fchownat, fchown, setregid, setgid,
/// setreuid, setuid, setresuid, setresgid, setgroups; setfsuid, setfsgid.
pub const AARCH64: Table = Table {
    arch: AUDIT_ARCH_AARCH64,
    faked: &[54, 55, 143, 144, 145, 146, 147, 149, 159],
    fs_ids: &[151, 152],
};

/// `seccomp_data.arch` of the architecture berth is built for.
#[cfg(target_arch = "x86_64")]
const NATIVE_ARCH: Option<u32> = Some(AUDIT_ARCH_X86_64);
#[cfg(target_arch = "aarch64")]
const NATIVE_ARCH: Option<u32> = Some(AUDIT_ARCH_AARCH64);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const NATIVE_ARCH: Option<u32> = None;

/// The table of the architecture berth is built for.
pub fn native() -> Option<&'static Table> {
    [&X86_64, &AARCH64]
        .into_iter()
        .find(|t| Some(t.arch) == NATIVE_ARCH)
}

/// The verdict for a call that runs as usual.
pub const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
/// SECCOMP_RET_ERRNO with errno 0: the call returns 0 without running.
pub const SUCCEED: u32 = libc::SECCOMP_RET_ERRNO;

#[expect(
    clippy::cast_possible_truncation,
    reason = "BPF opcodes are 16-bit; libc declares the BPF_* constants they are built from as u32"
)]
fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

#[expect(
    clippy::cast_possible_truncation,
    reason = "BPF opcodes are 16-bit; libc declares the BPF_* constants they are built from as u32"
)]
fn jeq(k: u32, jt: usize, jf: usize) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        // Programs here are a few dozen instructions: offsets always fit (one that did not
        // would jump past the end, which the kernel refuses: the install fails, nothing is lost).
        jt: u8::try_from(jt).unwrap_or(u8::MAX),
        jf: u8::try_from(jf).unwrap_or(u8::MAX),
        k,
    }
}

/// The BPF program for `table`:
/// ```text
///   load arch; not table.arch -> ALLOW
///   load nr;   one of faked -> SUCCEED; one of fs_ids -> ARG; else ALLOW
///   ARG: load arg0's low word; -1 -> ALLOW; else SUCCEED
/// ```
pub fn program(table: &Table) -> Vec<libc::sock_filter> {
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let ret = libc::BPF_RET | libc::BPF_K;
    // Instruction indices of the targets.
    let allow = 3 + table.faked.len() + table.fs_ids.len();
    let arg = allow + 1;
    let arg_allow = arg + 2;
    let succeed = arg_allow + 1;
    let mut p = Vec::with_capacity(succeed + 1);
    p.push(stmt(load, DATA_ARCH));
    p.push(jeq(table.arch, 0, allow - 2));
    p.push(stmt(load, DATA_NR));
    for &nr in table.faked {
        p.push(jeq(nr, succeed - p.len() - 1, 0));
    }
    for &nr in table.fs_ids {
        p.push(jeq(nr, arg - p.len() - 1, 0));
    }
    p.push(stmt(ret, ALLOW));
    p.push(stmt(load, DATA_ARG0_LOW));
    p.push(jeq(u32::MAX, 0, 1));
    p.push(stmt(ret, ALLOW));
    p.push(stmt(ret, SUCCEED));
    p
}

/// Installs the filter on this process (and so on everything it execs or forks). Needs
/// no_new_privs set first. On an architecture berth has no table for, installs nothing: the
/// calls then fail as they would without the filter.
pub fn install() -> std::io::Result<()> {
    let Some(table) = native() else {
        return Ok(());
    };
    let filter = program(table);
    let prog = libc::sock_fprog {
        len: u16::try_from(filter.len()).map_err(std::io::Error::other)?,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: prctl(PR_SET_SECCOMP) reads the sock_fprog and the instructions it points to,
    // which live until after the call; the kernel copies and checks the program.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::c_ulong::from(libc::SECCOMP_MODE_FILTER),
            &prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `prog` on a call the way the kernel does, for the instructions `program` uses.
    fn verdict(prog: &[libc::sock_filter], arch: u32, nr: u32, arg0: u64) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        data[16..24].copy_from_slice(&arg0.to_le_bytes());
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = prog[pc];
            let code = u32::from(i.code);
            if code == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS {
                let k = i.k as usize;
                acc = u32::from_le_bytes(data[k..k + 4].try_into().unwrap());
                pc += 1;
            } else if code == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K {
                pc += 1 + usize::from(if acc == i.k { i.jt } else { i.jf });
            } else if code == libc::BPF_RET | libc::BPF_K {
                return i.k;
            } else {
                panic!("unexpected instruction {code:#x} at {pc}");
            }
        }
    }

    #[test]
    fn the_decision_table_fakes_only_id_calls_of_the_native_architecture() {
        for table in [&X86_64, &AARCH64] {
            let prog = program(table);
            assert!(prog.len() < 64, "{}", prog.len());
            for &nr in table.faked {
                assert_eq!(verdict(&prog, table.arch, nr, 42), SUCCEED, "nr {nr}");
                assert_eq!(verdict(&prog, table.arch, nr, u64::MAX), SUCCEED);
            }
            for &nr in table.fs_ids {
                assert_eq!(verdict(&prog, table.arch, nr, 42), SUCCEED, "nr {nr}");
                // setfsuid(-1) asks for the current id: it runs.
                assert_eq!(verdict(&prog, table.arch, nr, 0xffff_ffff), ALLOW);
            }
            let listed: Vec<u32> = table.faked.iter().chain(table.fs_ids).copied().collect();
            for nr in 0..600 {
                if !listed.contains(&nr) {
                    assert_eq!(verdict(&prog, table.arch, nr, 42), ALLOW, "nr {nr}");
                }
                // Another architecture's calls (i386's chown32 is 212, x86_64's setuid
                // is 105 = aarch64's init_module...) all run as usual.
                assert_eq!(verdict(&prog, 0x4000_0003, nr, 42), ALLOW, "i386 {nr}");
                let other = if table.arch == AUDIT_ARCH_X86_64 {
                    AUDIT_ARCH_AARCH64
                } else {
                    AUDIT_ARCH_X86_64
                };
                assert_eq!(verdict(&prog, other, nr, 42), ALLOW, "other arch {nr}");
            }
            // x32 numbers carry bit 30 on x86_64's arch value: not faked.
            for &nr in table.faked {
                assert_eq!(verdict(&prog, table.arch, nr | 0x4000_0000, 42), ALLOW);
            }
        }
        // A table without fs-id calls still ends in ALLOW.
        let bare = Table {
            arch: AUDIT_ARCH_X86_64,
            faked: &[92],
            fs_ids: &[],
        };
        let prog = program(&bare);
        assert_eq!(verdict(&prog, AUDIT_ARCH_X86_64, 92, 0), SUCCEED);
        assert_eq!(verdict(&prog, AUDIT_ARCH_X86_64, 93, 0), ALLOW);
    }

    #[test]
    fn the_native_table_has_libcs_numbers() {
        let table = native().expect("a table for this architecture");
        #[cfg(target_arch = "x86_64")]
        let expected = (
            vec![
                libc::SYS_chown,
                libc::SYS_fchown,
                libc::SYS_lchown,
                libc::SYS_setuid,
                libc::SYS_setgid,
                libc::SYS_setreuid,
                libc::SYS_setregid,
                libc::SYS_setgroups,
                libc::SYS_setresuid,
                libc::SYS_setresgid,
                libc::SYS_fchownat,
            ],
            AUDIT_ARCH_X86_64,
        );
        #[cfg(target_arch = "aarch64")]
        let expected = (
            vec![
                libc::SYS_fchownat,
                libc::SYS_fchown,
                libc::SYS_setregid,
                libc::SYS_setgid,
                libc::SYS_setreuid,
                libc::SYS_setuid,
                libc::SYS_setresuid,
                libc::SYS_setresgid,
                libc::SYS_setgroups,
            ],
            AUDIT_ARCH_AARCH64,
        );
        let faked: Vec<libc::c_long> = table.faked.iter().map(|&n| n.into()).collect();
        assert_eq!(faked, expected.0);
        let fs: Vec<libc::c_long> = table.fs_ids.iter().map(|&n| n.into()).collect();
        assert_eq!(fs, vec![libc::SYS_setfsuid, libc::SYS_setfsgid]);
        assert_eq!(table.arch, expected.1);
    }
}
