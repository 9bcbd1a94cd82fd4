//! OCI device cgroup rules, checked and normalized into the numbers the kernel hands the BPF
//! program (`struct bpf_cgroup_dev_ctx`), so the emulator and the program builder share one
//! validated input.

use oci_spec::runtime::{LinuxDeviceCgroup, LinuxDeviceType};

use crate::CgroupError;

/// `BPF_DEVCG_DEV_*`: the low 16 bits of `access_type`.
pub(crate) const DEV_BLOCK: u32 = 1;
pub(crate) const DEV_CHAR: u32 = 2;
/// `BPF_DEVCG_ACC_*`: the high 16 bits of `access_type`.
pub(crate) const ACC_MKNOD: u32 = 1;
pub(crate) const ACC_READ: u32 = 2;
pub(crate) const ACC_WRITE: u32 = 4;
pub(crate) const ACC_ALL: u32 = ACC_MKNOD | ACC_READ | ACC_WRITE;

/// Linux device numbers: 12-bit major, 20-bit minor. Keeping them in range also keeps them
/// exact as the BPF program's 32-bit signed immediates.
const MAX_MAJOR: i64 = (1 << 12) - 1;
const MAX_MINOR: i64 = (1 << 20) - 1;

/// One validated rule. `None` numbers and `dev_type` are wildcards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rule {
    pub allow: bool,
    /// `Some(DEV_BLOCK | DEV_CHAR)`, or `None` for type `a` (all).
    pub dev_type: Option<u32>,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    /// `ACC_*` bits, never 0.
    pub access: u32,
}

impl Rule {
    /// Matches every request of its kind: an allow-all rule makes every earlier rule moot.
    pub fn is_catch_all(&self) -> bool {
        self.dev_type.is_none()
            && self.major.is_none()
            && self.minor.is_none()
            && self.access == ACC_ALL
    }
}

pub(crate) fn parse(rules: &[LinuxDeviceCgroup]) -> Result<Vec<Rule>, CgroupError> {
    rules.iter().map(parse_one).collect()
}

fn parse_one(r: &LinuxDeviceCgroup) -> Result<Rule, CgroupError> {
    let bad = |reason: String| CgroupError::InvalidDeviceRule {
        rule: format!("{} {r}", if r.allow() { "allow" } else { "deny" }),
        reason,
    };
    let dev_type = match r.typ().unwrap_or_default() {
        LinuxDeviceType::A => None,
        LinuxDeviceType::B => Some(DEV_BLOCK),
        LinuxDeviceType::C => Some(DEV_CHAR),
        other => {
            return Err(bad(format!(
                "type '{}' has no device cgroup meaning",
                other.as_str()
            )));
        }
    };
    // runc's config uses -1 for "any"; the OCI spec uses an absent number.
    let number = |what: &str, v: Option<i64>, max: i64| match v {
        None | Some(-1) => Ok(None),
        Some(n) if (0..=max).contains(&n) => Ok(u32::try_from(n).ok()),
        Some(n) => Err(bad(format!("{what} {n} is out of range 0..={max}"))),
    };
    let major = number("major", r.major(), MAX_MAJOR)?;
    let minor = number("minor", r.minor(), MAX_MINOR)?;
    let access = match r.access().as_deref() {
        // As with v1's devices.allow, no access letters means all of them.
        None | Some("") => ACC_ALL,
        Some(s) => {
            let mut bits = 0;
            for ch in s.chars() {
                bits |= match ch {
                    'r' => ACC_READ,
                    'w' => ACC_WRITE,
                    'm' => ACC_MKNOD,
                    other => return Err(bad(format!("unknown access letter {other:?}"))),
                };
            }
            bits
        }
    };
    Ok(Rule {
        allow: r.allow(),
        dev_type,
        major,
        minor,
        access,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use oci_spec::runtime::LinuxDeviceCgroupBuilder;

    /// Build an OCI rule from runc-style text: "allow c 1:3 rwm", "deny a *:* rwm".
    pub(crate) fn oci(text: &str) -> LinuxDeviceCgroup {
        let parts: Vec<&str> = text.split_whitespace().collect();
        let (allow, typ, nums, access) = (parts[0] == "allow", parts[1], parts[2], parts[3]);
        let (maj, min) = nums.split_once(':').unwrap();
        let mut b = LinuxDeviceCgroupBuilder::default()
            .allow(allow)
            .typ(match typ {
                "a" => LinuxDeviceType::A,
                "b" => LinuxDeviceType::B,
                "c" => LinuxDeviceType::C,
                "u" => LinuxDeviceType::U,
                _ => LinuxDeviceType::P,
            })
            .access(access);
        if maj != "*" {
            b = b.major(maj.parse::<i64>().unwrap());
        }
        if min != "*" {
            b = b.minor(min.parse::<i64>().unwrap());
        }
        b.build().unwrap()
    }

    #[test]
    fn parses_the_usual_rules() {
        let rules = parse(&[
            oci("deny a *:* rwm"),
            oci("allow c 1:3 rw"),
            oci("allow b 8:* m"),
        ])
        .unwrap();
        assert_eq!(
            rules,
            vec![
                Rule {
                    allow: false,
                    dev_type: None,
                    major: None,
                    minor: None,
                    access: ACC_ALL
                },
                Rule {
                    allow: true,
                    dev_type: Some(DEV_CHAR),
                    major: Some(1),
                    minor: Some(3),
                    access: ACC_READ | ACC_WRITE
                },
                Rule {
                    allow: true,
                    dev_type: Some(DEV_BLOCK),
                    major: Some(8),
                    minor: None,
                    access: ACC_MKNOD
                },
            ]
        );
        assert!(rules[0].is_catch_all());
        assert!(!rules[1].is_catch_all());
    }

    #[test]
    fn missing_fields_are_wildcards() {
        let r = LinuxDeviceCgroupBuilder::default()
            .allow(true)
            .build()
            .unwrap();
        let rule = parse_one(&r).unwrap();
        assert!(rule.is_catch_all() && rule.allow);
        let r = oci("allow c -1:-1 r");
        let rule = parse_one(&r).unwrap();
        assert_eq!((rule.major, rule.minor), (None, None));
    }

    #[test]
    fn bad_rules_are_errors_naming_the_rule() {
        for text in [
            "allow c 1:3 rwx",
            "allow u 1:3 rwm",
            "allow p 1:3 rwm",
            "allow c 4096:0 rwm",
            "allow c 1:1048576 rwm",
            "allow c -2:0 rwm",
        ] {
            let err = parse(&[oci(text)]).unwrap_err();
            assert!(
                matches!(err, CgroupError::InvalidDeviceRule { .. }),
                "{text}: {err}"
            );
            assert!(!err.to_string().contains('\n'));
        }
        let err = parse(&[oci("allow c 1:3 rwx")]).unwrap_err().to_string();
        assert!(
            err.contains("'allow c 1:3 rwx'") && err.contains("'x'"),
            "{err}"
        );
    }
}
