//! TEMPORARY STUB (not to be committed): the real module comes from the cgroup worktree.
use std::path::{Path, PathBuf};
use oci_spec::runtime::{LinuxDeviceCgroup, LinuxResources};
#[derive(Debug, Clone, Copy)]
pub enum Controller { Cpu, Cpuset, Memory, Pids, Io }
#[derive(Debug, thiserror::Error)]
#[error("cgroup error {0}")]
pub struct CgroupError(String);
pub fn required_controllers(_res: &LinuxResources) -> Vec<Controller> { vec![] }
pub struct CgroupWrite { pub file: &'static str, pub value: String }
pub fn plan_writes(_res: &LinuxResources) -> Result<Vec<CgroupWrite>, CgroupError> { Ok(vec![]) }
pub struct Hierarchy { root: PathBuf }
impl Hierarchy {
    pub fn open(root: &Path, _needed: &[Controller]) -> Result<Hierarchy, CgroupError> { std::fs::create_dir_all(root).map_err(|e| CgroupError(e.to_string()))?; Ok(Hierarchy { root: root.to_path_buf() }) }
    pub fn root(&self) -> &Path { &self.root }
    pub fn create(&self, name: &str) -> Result<Cgroup, CgroupError> { let p = self.root.join(name); std::fs::create_dir(&p).map_err(|e| CgroupError(e.to_string()))?; Ok(Cgroup { path: p }) }
}
pub struct Cgroup { path: PathBuf }
#[derive(Debug, Default)]
pub struct Stats { pub cpu_usage_usec: Option<u64>, pub memory_peak: Option<u64>, pub pids_peak: Option<u64>, pub oom_kills: Option<u64> }
impl Cgroup {
    pub fn at(path: PathBuf) -> Cgroup { Cgroup { path } }
    pub fn path(&self) -> &Path { &self.path }
    pub fn apply(&self, _w: &[CgroupWrite]) -> Result<(), CgroupError> { Ok(()) }
    pub fn open_fd(&self) -> Result<std::os::fd::OwnedFd, CgroupError> { Ok(std::fs::File::open(&self.path).map_err(|e| CgroupError(e.to_string()))?.into()) }
    pub fn add_process(&self, pid: i32) -> Result<(), CgroupError> { std::fs::write(self.path.join("cgroup.procs"), pid.to_string()).map_err(|e| CgroupError(e.to_string())) }
    pub fn is_populated(&self) -> Result<bool, CgroupError> { Ok(std::fs::read_to_string(self.path.join("cgroup.events")).map_err(|e| CgroupError(e.to_string()))?.contains("populated 1")) }
    pub fn kill(&self) -> Result<(), CgroupError> { std::fs::write(self.path.join("cgroup.kill"), "1").map_err(|e| CgroupError(e.to_string())) }
    pub fn wait_empty(&self, _t: std::time::Duration) -> Result<bool, CgroupError> { for _ in 0..1000 { if !self.is_populated()? { return Ok(true) } std::thread::sleep(std::time::Duration::from_millis(1)); } Ok(false) }
    pub fn stats(&self) -> Stats { Stats::default() }
    pub fn remove(&self) -> Result<(), CgroupError> { std::fs::remove_dir(&self.path).map_err(|e| CgroupError(e.to_string())) }
    pub fn set_device_filter(&self, _rules: &[LinuxDeviceCgroup]) -> Result<(), CgroupError> { Ok(()) }
}
