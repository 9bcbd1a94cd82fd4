//! Building a container's environment in time linear in its size, and the bounds on it
//! (`store.max_env_entries`, `store.max_env_bytes`): an image config, a command line or a step
//! with a million variables costs one refusal, not minutes of CPU before the container starts.

use std::collections::HashMap;

/// An environment being assembled: setting a key again replaces its value and keeps its first
/// position (docker's and Pyxis's rule), found through a map, not a scan.
#[derive(Debug, Default)]
pub struct EnvBuilder {
    pairs: Vec<(String, String)>,
    index: HashMap<String, usize>,
}

impl EnvBuilder {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            pairs: Vec::with_capacity(n),
            index: HashMap::with_capacity(n),
        }
    }

    pub fn set(&mut self, key: &str, value: &str) {
        match self.index.get(key) {
            Some(&i) => value.clone_into(&mut self.pairs[i].1),
            None => {
                self.index.insert(key.to_string(), self.pairs.len());
                self.pairs.push((key.to_string(), value.to_string()));
            }
        }
    }

    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    pub fn into_pairs(self) -> Vec<(String, String)> {
        self.pairs
    }
}

/// The bounds on an environment, from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvLimits {
    pub max_entries: usize,
    pub max_bytes: u64,
}

/// `store.max_env_entries`'s default: far above any real job's environment, far below what
/// makes merging or checking it costly.
pub const DEFAULT_MAX_ENTRIES: usize = 65536;
/// `store.max_env_bytes`'s default (1 MiB): a quarter of the usual 4 MiB of execve arguments.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 20;

impl EnvLimits {
    /// Checks `entries` (`KEY=VALUE` strings or pairs, anything that says its length) against
    /// the bounds; the error is one line naming `what`, the limit and the key to raise it.
    pub fn check<I, E>(&self, what: &str, entries: I) -> Result<(), crate::SpecError>
    where
        I: IntoIterator<Item = E>,
        E: EnvLen,
    {
        let mut count = 0usize;
        let mut bytes = 0u64;
        for e in entries {
            count += 1;
            // `KEY=VALUE` and its terminating NUL, as execve counts it.
            bytes = bytes.saturating_add(e.env_len() as u64 + 1);
            if count > self.max_entries {
                return Err(crate::SpecError::EnvLimit(format!(
                    "{what} has more than {} environment variables (store.max_env_entries); \
                     use fewer or raise the limit in berth.toml",
                    self.max_entries
                )));
            }
            if bytes > self.max_bytes {
                return Err(crate::SpecError::EnvLimit(format!(
                    "{what} has more than {} bytes of environment variables \
                     (store.max_env_bytes); use less or raise the limit in berth.toml",
                    self.max_bytes
                )));
            }
        }
        Ok(())
    }
}

impl Default for EnvLimits {
    fn default() -> Self {
        Self {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }
}

/// The length of one environment entry as `KEY=VALUE`.
pub trait EnvLen {
    fn env_len(&self) -> usize;
}

impl EnvLen for &String {
    fn env_len(&self) -> usize {
        self.len()
    }
}

impl EnvLen for &(String, String) {
    fn env_len(&self) -> usize {
        self.0.len() + 1 + self.1.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_values_win_and_keep_the_first_position() {
        let mut env = EnvBuilder::default();
        env.set("A", "1");
        env.set("B", "2");
        env.set("A", "3");
        assert!(env.contains("B") && !env.contains("C"));
        assert_eq!(
            env.into_pairs(),
            vec![("A".into(), "3".into()), ("B".into(), "2".into())]
        );
    }

    #[test]
    fn a_million_distinct_keys_are_linear() {
        // Quadratic merging took > 10 minutes for this; linear takes well under a second.
        let mut env = EnvBuilder::with_capacity(1_000_000);
        for i in 0..1_000_000 {
            env.set(&format!("K{i}"), "v");
        }
        assert_eq!(env.into_pairs().len(), 1_000_000);
    }

    #[test]
    fn limits_name_the_key() {
        let limits = EnvLimits {
            max_entries: 2,
            max_bytes: 10,
        };
        let pairs = [("A".to_string(), "1".to_string())];
        limits.check("x", &pairs).unwrap();
        let three = ["A=1".to_string(), "B=2".to_string(), "C=3".to_string()];
        let e = limits
            .check("the image's config", &three)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("store.max_env_entries") && e.contains("more than 2"),
            "{e}"
        );
        let big = ["A=123456789".to_string()];
        let e = limits.check("--env", &big).unwrap_err().to_string();
        assert!(e.contains("store.max_env_bytes"), "{e}");
        assert_eq!(EnvLimits::default().max_entries, 65536);
        assert_eq!(EnvLimits::default().max_bytes, 1 << 20);
    }
}
