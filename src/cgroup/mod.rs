//! cgroup
