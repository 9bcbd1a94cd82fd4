//! Compiles device rules into a `BPF_PROG_TYPE_CGROUP_DEVICE` program. Pure: the output is the
//! instruction array `bpf(BPF_PROG_LOAD)` takes.
//!
//! Layout: a prologue loads the request into registers (r2 type, r3 access, r4 major, r5 minor),
//! then one block per rule from the last rule to the first; a block falls through to the next
//! on any mismatch and otherwise returns the rule's verdict; the end returns deny. Reversing the
//! order makes "first block to match" equal "last rule to match".

use super::rules::{ACC_ALL, Rule};

/// One eBPF instruction, laid out as the kernel's `struct bpf_insn` (little-endian bitfields:
/// destination register in the low nibble of `regs`, source in the high one).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Insn {
    pub code: u8,
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
}

const _: () = assert!(std::mem::size_of::<Insn>() == 8);

// Instruction classes, sizes, modes, operations and sources (include/uapi/linux/bpf_common.h).
pub(crate) const BPF_LDX: u8 = 0x01;
pub(crate) const BPF_ALU: u8 = 0x04;
pub(crate) const BPF_JMP: u8 = 0x05;
pub(crate) const BPF_ALU64: u8 = 0x07;
pub(crate) const BPF_W: u8 = 0x00;
pub(crate) const BPF_MEM: u8 = 0x60;
pub(crate) const BPF_K: u8 = 0x00;
pub(crate) const BPF_X: u8 = 0x08;
pub(crate) const BPF_AND: u8 = 0x50;
pub(crate) const BPF_RSH: u8 = 0x70;
pub(crate) const BPF_MOV: u8 = 0xb0;
pub(crate) const BPF_JEQ: u8 = 0x10;
pub(crate) const BPF_JNE: u8 = 0x50;
pub(crate) const BPF_EXIT: u8 = 0x90;

const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R5: u8 = 5;

/// Offsets of the fields of `struct bpf_cgroup_dev_ctx`.
const CTX_ACCESS_TYPE: i16 = 0;
const CTX_MAJOR: i16 = 4;
const CTX_MINOR: i16 = 8;

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | (dst & 0x0f),
        off,
        imm,
    }
}

/// `dst = *(u32 *)(src + off)`
fn load_u32(dst: u8, src: u8, off: i16) -> Insn {
    insn(BPF_LDX | BPF_MEM | BPF_W, dst, src, off, 0)
}

/// 32-bit `dst op= imm` (zero-extends into the upper half).
fn alu32_imm(op: u8, dst: u8, imm: i32) -> Insn {
    insn(BPF_ALU | op | BPF_K, dst, 0, 0, imm)
}

fn mov64_reg(dst: u8, src: u8) -> Insn {
    insn(BPF_ALU64 | BPF_MOV | BPF_X, dst, src, 0, 0)
}

fn mov64_imm(dst: u8, imm: i32) -> Insn {
    insn(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)
}

/// `if dst op imm goto pc + 1 + off`
fn jmp_imm(op: u8, dst: u8, imm: i32, off: i16) -> Insn {
    insn(BPF_JMP | op | BPF_K, dst, 0, off, imm)
}

/// `if dst op src goto pc + 1 + off`
fn jmp_reg(op: u8, dst: u8, src: u8, off: i16) -> Insn {
    insn(BPF_JMP | op | BPF_X, dst, src, off, 0)
}

fn exit() -> Insn {
    insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)
}

/// A conditional jump whose target ("the next block") is patched in once the block is complete.
enum Pending {
    Done(Insn),
    SkipImm { op: u8, dst: u8, imm: i32 },
    SkipReg { op: u8, dst: u8, src: u8 },
}

/// Numbers here fit: rules.rs keeps majors, minors and access bits far below `i32::MAX`.
fn imm(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

fn rule_block(rule: &Rule) -> Vec<Insn> {
    let mut body = Vec::new();
    if let Some(t) = rule.dev_type {
        body.push(Pending::SkipImm {
            op: BPF_JNE,
            dst: R2,
            imm: imm(t),
        });
    }
    if rule.allow {
        // All requested bits must be granted: (access & granted) == access.
        if rule.access != ACC_ALL {
            body.push(Pending::Done(mov64_reg(R1, R3)));
            body.push(Pending::Done(alu32_imm(BPF_AND, R1, imm(rule.access))));
            body.push(Pending::SkipReg {
                op: BPF_JNE,
                dst: R1,
                src: R3,
            });
        }
    } else {
        // Any requested bit among the denied ones: (access & denied) != 0.
        body.push(Pending::Done(mov64_reg(R1, R3)));
        body.push(Pending::Done(alu32_imm(BPF_AND, R1, imm(rule.access))));
        body.push(Pending::SkipImm {
            op: BPF_JEQ,
            dst: R1,
            imm: 0,
        });
    }
    if let Some(m) = rule.major {
        body.push(Pending::SkipImm {
            op: BPF_JNE,
            dst: R4,
            imm: imm(m),
        });
    }
    if let Some(m) = rule.minor {
        body.push(Pending::SkipImm {
            op: BPF_JNE,
            dst: R5,
            imm: imm(m),
        });
    }
    body.push(Pending::Done(mov64_imm(R0, i32::from(rule.allow))));
    body.push(Pending::Done(exit()));

    let len = body.len();
    body.into_iter()
        .enumerate()
        .map(|(i, p)| {
            // Jump past the rest of this block; blocks are a handful of instructions.
            let skip = i16::try_from(len - 1 - i).unwrap_or(i16::MAX);
            match p {
                Pending::Done(insn) => insn,
                Pending::SkipImm { op, dst, imm } => jmp_imm(op, dst, imm, skip),
                Pending::SkipReg { op, dst, src } => jmp_reg(op, dst, src, skip),
            }
        })
        .collect()
}

/// The program for `rules`, evaluated last-match-wins over a default deny.
pub(crate) fn build(rules: &[Rule]) -> Vec<Insn> {
    let mut prog = vec![
        load_u32(R2, R1, CTX_ACCESS_TYPE),
        alu32_imm(BPF_AND, R2, 0xffff),
        load_u32(R3, R1, CTX_ACCESS_TYPE),
        alu32_imm(BPF_RSH, R3, 16),
        load_u32(R4, R1, CTX_MAJOR),
        load_u32(R5, R1, CTX_MINOR),
    ];
    for rule in rules.iter().rev() {
        prog.extend(rule_block(rule));
        // An allow-all rule always returns: what would follow is unreachable, and the verifier
        // rejects unreachable instructions.
        if rule.allow && rule.is_catch_all() {
            return prog;
        }
    }
    prog.push(mov64_imm(R0, 0));
    prog.push(exit());
    prog
}

#[cfg(test)]
mod tests {
    use super::super::emulator::{Request, is_allowed};
    use super::super::rules::tests::oci;
    use super::super::rules::{ACC_ALL, DEV_BLOCK, DEV_CHAR, parse};
    use super::*;

    /// Runs a program on one request: just enough eBPF for the opcodes `build` emits; anything
    /// else fails the test. Returns r0 at exit.
    fn run(prog: &[Insn], req: &Request) -> u64 {
        let ctx: [u32; 3] = [(req.access << 16) | req.dev_type, req.major, req.minor];
        let mut regs = [0u64; 11];
        regs[1] = 0xc7c7_0000; // a fake ctx pointer: only loads relative to it are legal
        let ctx_ptr = regs[1];
        let mut pc = 0usize;
        for _ in 0..100_000 {
            let i = prog[pc];
            let (dst, src) = (usize::from(i.regs & 0x0f), usize::from(i.regs >> 4));
            let imm64 = i64::from(i.imm).cast_unsigned();
            let mut next = pc + 1;
            match i.code {
                c if c == BPF_LDX | BPF_MEM | BPF_W => {
                    assert_eq!(regs[src], ctx_ptr, "load from a non-ctx pointer at {pc}");
                    let off = usize::try_from(i.off).expect("negative ctx offset");
                    assert!(off % 4 == 0 && off < 12, "bad ctx offset {off}");
                    regs[dst] = u64::from(ctx[off / 4]);
                }
                c if c == BPF_ALU | BPF_AND | BPF_K => {
                    regs[dst] &= u64::from(i.imm.cast_unsigned());
                }
                c if c == BPF_ALU | BPF_RSH | BPF_K => {
                    regs[dst] = (regs[dst] & 0xffff_ffff) >> i.imm.cast_unsigned();
                }
                c if c == BPF_ALU64 | BPF_MOV | BPF_X => regs[dst] = regs[src],
                c if c == BPF_ALU64 | BPF_MOV | BPF_K => regs[dst] = imm64,
                c if c & 0x07 == BPF_JMP && c & 0xf0 != BPF_EXIT => {
                    let rhs = if c & BPF_X != 0 { regs[src] } else { imm64 };
                    let taken = match c & 0xf0 {
                        BPF_JEQ => regs[dst] == rhs,
                        BPF_JNE => regs[dst] != rhs,
                        op => panic!("unsupported jump op {op:#x} at {pc}"),
                    };
                    if taken {
                        next = usize::try_from(i64::try_from(pc).unwrap() + 1 + i64::from(i.off))
                            .unwrap();
                    }
                }
                c if c == BPF_JMP | BPF_EXIT => return regs[0],
                c => panic!("unsupported opcode {c:#x} at {pc}"),
            }
            assert!(next < prog.len(), "jump out of the program at {pc}");
            pc = next;
        }
        panic!("program did not terminate");
    }

    /// Every request shape that can distinguish the rules below.
    fn requests() -> Vec<Request> {
        let mut out = Vec::new();
        for dev_type in [DEV_BLOCK, DEV_CHAR] {
            for major in [0, 1, 5, 8, 10, 195, 4095] {
                for minor in [0, 1, 3, 5, 200, 1_048_575] {
                    for access in 0..=ACC_ALL {
                        out.push(Request {
                            dev_type,
                            major,
                            minor,
                            access,
                        });
                    }
                }
            }
        }
        out
    }

    fn assert_same_verdicts(texts: &[&str]) {
        let oci: Vec<_> = texts.iter().map(|t| oci(t)).collect();
        let rules = parse(&oci).unwrap();
        let prog = build(&rules);
        check_structure(&prog);
        for req in requests() {
            let want = is_allowed(&rules, &req);
            let got = run(&prog, &req);
            assert_eq!(got, u64::from(want), "rules {texts:?}, request {req:?}");
        }
    }

    /// What the verifier would insist on: every jump lands inside the program, every
    /// instruction is reachable, and control cannot run off the end.
    fn check_structure(prog: &[Insn]) {
        let mut reachable = vec![false; prog.len()];
        let mut stack = vec![0usize];
        while let Some(pc) = stack.pop() {
            if std::mem::replace(&mut reachable[pc], true) {
                continue;
            }
            let i = prog[pc];
            if i.code == BPF_JMP | BPF_EXIT {
                continue;
            }
            assert!(pc + 1 < prog.len(), "falls off the end at {pc}");
            stack.push(pc + 1);
            if i.code & 0x07 == BPF_JMP {
                let target = i64::try_from(pc).unwrap() + 1 + i64::from(i.off);
                let target = usize::try_from(target).unwrap();
                assert!(target < prog.len(), "jump out at {pc}");
                stack.push(target);
            }
        }
        assert!(reachable.iter().all(|&r| r), "unreachable instructions");
    }

    #[test]
    fn empty_rules_deny_everything() {
        let prog = build(&[]);
        assert_eq!(prog.len(), 8, "prologue + r0 = 0 + exit");
        assert_same_verdicts(&[]);
    }

    #[test]
    fn instruction_encoding() {
        // r2 = *(u32 *)(r1 + 0) is 0x61 with dst 2, src 1.
        assert_eq!(
            load_u32(R2, R1, 0),
            Insn {
                code: 0x61,
                regs: 0x12,
                off: 0,
                imm: 0
            }
        );
        assert_eq!(jmp_imm(BPF_JNE, R4, 1, 3).code, 0x55);
        assert_eq!(jmp_reg(BPF_JNE, R1, R3, 1).code, 0x5d);
        assert_eq!(jmp_imm(BPF_JEQ, R1, 0, 1).code, 0x15);
        assert_eq!(mov64_imm(R0, 1).code, 0xb7);
        assert_eq!(mov64_reg(R1, R3).code, 0xbf);
        assert_eq!(alu32_imm(BPF_AND, R2, 0xffff).code, 0x54);
        assert_eq!(alu32_imm(BPF_RSH, R3, 16).code, 0x74);
        assert_eq!(exit().code, 0x95);
    }

    #[test]
    fn allow_block_shape() {
        // c 1:3 r: type check, 3 access insns, major, minor, verdict, exit.
        let rules = parse(&[oci("allow c 1:3 r")]).unwrap();
        let block = rule_block(&rules[0]);
        assert_eq!(block.len(), 8);
        assert_eq!(block[0], jmp_imm(BPF_JNE, R2, 2, 7));
        assert_eq!(block[5], jmp_imm(BPF_JNE, R5, 3, 2));
        assert_eq!(block[6], mov64_imm(R0, 1));
    }

    #[test]
    fn allow_all_stops_the_program() {
        let rules = parse(&[oci("allow c 1:3 r"), oci("allow a *:* rwm")]).unwrap();
        let prog = build(&rules);
        // Prologue, then just "r0 = 1; exit".
        assert_eq!(prog.len(), 8);
        assert_eq!(prog[6], mov64_imm(R0, 1));
        assert_same_verdicts(&["allow c 1:3 r", "allow a *:* rwm"]);
    }

    #[test]
    fn berth_default_device_list() {
        assert_same_verdicts(&[
            "deny a *:* rwm",
            "allow c 1:3 rwm",
            "allow c 1:5 rwm",
            "allow c 1:7 rwm",
            "allow c 1:8 rwm",
            "allow c 1:9 rwm",
            "allow c 5:0 rwm",
            "allow c 5:1 rwm",
            "allow c 5:2 rwm",
            "allow c 136:* rwm",
            "allow c 195:* rw",
            "allow c 10:200 rwm",
        ]);
    }

    #[test]
    fn overrides_and_partial_access() {
        assert_same_verdicts(&["allow a *:* rwm", "deny c 1:3 w", "deny b 8:* m"]);
        assert_same_verdicts(&["allow c *:* rw", "deny c 1:* r", "allow c 1:5 rwm"]);
        assert_same_verdicts(&["deny a *:* rwm", "allow b *:0 m", "allow a 10:* r"]);
        assert_same_verdicts(&["allow c 4095:1048575 w", "deny a *:* rwm"]);
    }

    /// Pseudo-random rule lists (fixed seed) over the same small number space as the requests.
    #[test]
    fn random_rule_lists_match_the_emulator() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| -> usize {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            usize::try_from((seed >> 33) % n).unwrap()
        };
        let types = ["a", "b", "c"];
        let majors = ["*", "1", "8", "10"];
        let minors = ["*", "0", "3", "5"];
        let accesses = ["r", "w", "m", "rw", "rm", "wm", "rwm"];
        for _ in 0..300 {
            let n = next(6);
            let texts: Vec<String> = (0..n)
                .map(|_| {
                    format!(
                        "{} {} {}:{} {}",
                        if next(2) == 0 { "allow" } else { "deny" },
                        types[next(3)],
                        majors[next(4)],
                        minors[next(4)],
                        accesses[next(7)],
                    )
                })
                .collect();
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            assert_same_verdicts(&refs);
        }
    }
}
