//! The device rules' meaning in plain Rust: the reference the BPF program is tested against.
//! Nothing outside tests calls it.

use super::rules::Rule;

/// One access check as the kernel asks it (the fields of `struct bpf_cgroup_dev_ctx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    /// `DEV_BLOCK` or `DEV_CHAR`.
    pub dev_type: u32,
    pub major: u32,
    pub minor: u32,
    /// `ACC_*` bits; an open(O_RDWR) asks for read and write at once.
    pub access: u32,
}

impl Rule {
    pub fn matches(&self, req: &Request) -> bool {
        let device = self.dev_type.is_none_or(|t| t == req.dev_type)
            && self.major.is_none_or(|m| m == req.major)
            && self.minor.is_none_or(|m| m == req.minor);
        // Allow grants only what it lists; deny refuses any request touching what it lists.
        // Either way, a request can never get more than the last matching rule permits.
        let access = if self.allow {
            req.access & self.access == req.access
        } else {
            req.access & self.access != 0
        };
        device && access
    }
}

/// Last matching rule wins; no match denies.
pub(crate) fn is_allowed(rules: &[Rule], req: &Request) -> bool {
    rules
        .iter()
        .rev()
        .find(|r| r.matches(req))
        .is_some_and(|r| r.allow)
}

#[cfg(test)]
mod tests {
    use super::super::rules::tests::oci;
    use super::super::rules::{ACC_MKNOD, ACC_READ, ACC_WRITE, DEV_BLOCK, DEV_CHAR, parse};
    use super::*;

    fn rules(texts: &[&str]) -> Vec<Rule> {
        let oci: Vec<_> = texts.iter().map(|t| oci(t)).collect();
        parse(&oci).unwrap()
    }

    fn chr(major: u32, minor: u32, access: u32) -> Request {
        Request {
            dev_type: DEV_CHAR,
            major,
            minor,
            access,
        }
    }

    const RW: u32 = ACC_READ | ACC_WRITE;

    #[test]
    fn no_rules_deny_everything() {
        assert!(!is_allowed(&[], &chr(1, 3, ACC_READ)));
    }

    #[test]
    fn berth_style_allow_list() {
        let r = rules(&["deny a *:* rwm", "allow c 1:3 rwm", "allow c 1:5 r"]);
        assert!(is_allowed(&r, &chr(1, 3, RW)));
        assert!(is_allowed(&r, &chr(1, 3, ACC_MKNOD)));
        assert!(is_allowed(&r, &chr(1, 5, ACC_READ)));
        assert!(!is_allowed(&r, &chr(1, 5, RW)), "write not granted");
        assert!(!is_allowed(&r, &chr(1, 7, ACC_READ)));
        let block = Request {
            dev_type: DEV_BLOCK,
            ..chr(1, 3, ACC_READ)
        };
        assert!(!is_allowed(&r, &block), "type must match");
    }

    #[test]
    fn later_rules_override_earlier_ones() {
        let r = rules(&["allow c *:* rwm", "deny c 10:200 rwm"]);
        assert!(!is_allowed(&r, &chr(10, 200, ACC_READ)));
        assert!(is_allowed(&r, &chr(10, 201, ACC_READ)));
        let r = rules(&["deny c 10:200 rwm", "allow c *:* rwm"]);
        assert!(is_allowed(&r, &chr(10, 200, ACC_READ)));
    }

    #[test]
    fn partial_deny_blocks_requests_touching_it() {
        let r = rules(&["allow a *:* rwm", "deny c 1:3 w"]);
        assert!(is_allowed(&r, &chr(1, 3, ACC_READ)));
        assert!(!is_allowed(&r, &chr(1, 3, ACC_WRITE)));
        assert!(
            !is_allowed(&r, &chr(1, 3, RW)),
            "rw must not slip past a w deny"
        );
    }

    #[test]
    fn wildcards() {
        let r = rules(&["allow c 195:* rw", "allow b *:0 m"]);
        assert!(is_allowed(&r, &chr(195, 255, RW)));
        assert!(!is_allowed(&r, &chr(196, 0, ACC_READ)));
        let b = |major, minor| Request {
            dev_type: DEV_BLOCK,
            major,
            minor,
            access: ACC_MKNOD,
        };
        assert!(is_allowed(&r, &b(8, 0)));
        assert!(!is_allowed(&r, &b(8, 1)));
    }
}
