//! Sets of CPU (or NUMA node) numbers in the kernel's list syntax (`0-55,112-167`), as sysfs,
//! cgroup cpusets, `taskset -c` and Slurm write them, and in the hex mask syntax of
//! `/sys/.../local_cpus` and NCCL's topology files.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::TopologyError;

/// A set of CPU numbers. Displays as a kernel list (`0-3,8`); the empty set displays as "".
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuSet(BTreeSet<u32>);

/// The largest CPU number berth accepts; guards against a list like `0-4294967295`.
const MAX_CPU: u32 = 1 << 16;

impl CpuSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a kernel CPU list: comma-separated numbers and inclusive ranges, possibly with a
    /// `:stride` suffix on ranges (cpuset syntax); whitespace and a trailing newline are ignored.
    pub fn parse(text: &str) -> Result<Self, TopologyError> {
        let mut set = BTreeSet::new();
        let text = text.trim();
        if text.is_empty() {
            return Ok(Self(set));
        }
        for part in text.split(',') {
            let part = part.trim();
            let bad = || {
                TopologyError::Value(format!(
                    "invalid CPU list '{text}': '{part}' is not N or N-M"
                ))
            };
            let (range, stride) = match part.split_once(':') {
                Some((r, s)) => (r, s.parse::<u32>().ok().filter(|s| *s > 0).ok_or_else(bad)?),
                None => (part, 1),
            };
            let (lo, hi) = match range.split_once('-') {
                Some((a, b)) => (
                    a.trim().parse::<u32>().map_err(|_| bad())?,
                    b.trim().parse::<u32>().map_err(|_| bad())?,
                ),
                None => {
                    let n = range.trim().parse::<u32>().map_err(|_| bad())?;
                    (n, n)
                }
            };
            if lo > hi || hi > MAX_CPU {
                return Err(bad());
            }
            set.extend((lo..=hi).step_by(stride as usize));
        }
        Ok(Self(set))
    }

    /// Parses a hex mask as sysfs writes it: 32-bit groups, most significant first, separated by
    /// commas (`00000000,ffffffff`).
    pub fn parse_mask(text: &str) -> Result<Self, TopologyError> {
        let mut set = BTreeSet::new();
        let groups: Vec<&str> = text.trim().split(',').collect();
        for (i, group) in groups.iter().rev().enumerate() {
            let bits = u32::from_str_radix(group.trim(), 16)
                .map_err(|_| TopologyError::Value(format!("invalid CPU mask '{}'", text.trim())))?;
            let base = u32::try_from(i)
                .ok()
                .and_then(|i| i.checked_mul(32))
                .ok_or_else(|| {
                    TopologyError::Value(format!(
                        "invalid CPU mask '{}': too many groups",
                        text.trim()
                    ))
                })?;
            for bit in 0..32 {
                if bits & (1 << bit) != 0 {
                    set.insert(base + bit);
                }
            }
        }
        Ok(Self(set))
    }

    /// The hex mask of this set, sysfs style, at least `min_groups` groups of 32 bits.
    pub fn to_mask(&self, min_groups: usize) -> String {
        let groups = self
            .0
            .last()
            .map(|&max| max as usize / 32 + 1)
            .unwrap_or(1)
            .max(min_groups.max(1));
        let mut words = vec![0u32; groups];
        for &cpu in &self.0 {
            words[cpu as usize / 32] |= 1 << (cpu % 32);
        }
        words
            .iter()
            .rev()
            .map(|w| format!("{w:08x}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn insert(&mut self, cpu: u32) {
        self.0.insert(cpu);
    }

    pub fn contains(&self, cpu: u32) -> bool {
        self.0.contains(&cpu)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    pub fn first(&self) -> Option<u32> {
        self.0.first().copied()
    }

    pub fn union(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.union(&other.0).copied().collect())
    }

    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.intersection(&other.0).copied().collect())
    }

    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.0.is_subset(&other.0)
    }
}

impl FromIterator<u32> for CpuSet {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        CpuSet(iter.into_iter().collect())
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut iter = self.0.iter().copied().peekable();
        while let Some(lo) = iter.next() {
            let mut hi = lo;
            while iter.peek() == Some(&(hi + 1)) {
                hi += 1;
                iter.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

impl Serialize for CpuSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for CpuSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        CpuSet::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_round_trip() {
        for text in ["0-55,112-167", "0", "1,3,5-7", ""] {
            assert_eq!(CpuSet::parse(text).unwrap().to_string(), text);
        }
        assert_eq!(CpuSet::parse("3,1,2\n").unwrap().to_string(), "1-3");
        assert_eq!(CpuSet::parse("0-8:4").unwrap().to_string(), "0,4,8");
    }

    #[test]
    fn bad_lists_are_rejected() {
        for text in ["a", "3-1", "1-", "0-4294967295", "1,,2"] {
            assert!(CpuSet::parse(text).is_err(), "{text}");
        }
    }

    #[test]
    fn masks_round_trip() {
        let set = CpuSet::parse("0-3,32,63").unwrap();
        assert_eq!(set.to_mask(1), "80000001,0000000f");
        assert_eq!(CpuSet::parse_mask("80000001,0000000f").unwrap(), set);
        assert_eq!(CpuSet::new().to_mask(2), "00000000,00000000");
        CpuSet::parse_mask("xyz").unwrap_err();
    }
}
