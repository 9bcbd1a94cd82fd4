//! Translates an OCI resource request into cgroup v2 interface-file writes, without touching the
//! filesystem. The OCI `LinuxResources` fields were designed for cgroup v1; the conversions follow
//! runc's (opencontainers/cgroups) so a spec behaves the same under berth as under runc.

use oci_spec::runtime::{LinuxBlockIo, LinuxCpu, LinuxMemory, LinuxResources, LinuxThrottleDevice};

use super::{CgroupError, Controller};

/// One write into a cgroup interface file: `value` goes into `<cgroup>/<file>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupWrite {
    pub file: &'static str,
    pub value: String,
}

impl CgroupWrite {
    fn new(file: &'static str, value: impl Into<String>) -> Self {
        CgroupWrite {
            file,
            value: value.into(),
        }
    }
}

/// The kernel's default CFS period, used when a quota comes without one.
const DEFAULT_CPU_PERIOD_US: u64 = 100_000;
/// cpu.max accepts periods in [1 ms, 1 s] and quotas of at least 1 ms.
const MIN_CPU_PERIOD_US: u64 = 1_000;
const MAX_CPU_PERIOD_US: u64 = 1_000_000;
const MIN_CPU_QUOTA_US: i64 = 1_000;
/// Linux device numbers: 12-bit major, 20-bit minor.
const MAX_MAJOR: i64 = (1 << 12) - 1;
const MAX_MINOR: i64 = (1 << 20) - 1;

/// Controllers a resource request needs enabled on the cgroup's parent. Device rules need none:
/// cgroup v2 enforces them with a BPF program.
pub fn required_controllers(res: &LinuxResources) -> Vec<Controller> {
    let mut out = Vec::new();
    if let Some(m) = res.memory()
        && memory_is_set(m)
    {
        out.push(Controller::Memory);
    }
    if let Some(c) = res.cpu() {
        if cpu_is_set(c) {
            out.push(Controller::Cpu);
        }
        if cpuset_is_set(c) {
            out.push(Controller::Cpuset);
        }
    }
    if res.pids().is_some() {
        out.push(Controller::Pids);
    }
    if let Some(b) = res.block_io()
        && block_io_is_set(b)
    {
        out.push(Controller::Io);
    }
    out
}

fn memory_is_set(m: &LinuxMemory) -> bool {
    m.limit().is_some() || m.swap().is_some() || m.reservation().is_some()
}

fn cpu_is_set(c: &LinuxCpu) -> bool {
    c.shares().is_some()
        || c.quota().is_some()
        || c.period().is_some()
        || c.burst().is_some()
        || c.idle().is_some()
}

fn cpuset_is_set(c: &LinuxCpu) -> bool {
    let nonempty = |s: &Option<String>| s.as_deref().is_some_and(|v| !v.trim().is_empty());
    nonempty(c.cpus()) || nonempty(c.mems())
}

fn block_io_is_set(b: &LinuxBlockIo) -> bool {
    let nonempty = |v: &Option<Vec<_>>| v.as_ref().is_some_and(|v| !v.is_empty());
    b.weight().is_some()
        || b.weight_device().as_ref().is_some_and(|v| !v.is_empty())
        || nonempty(b.throttle_read_bps_device())
        || nonempty(b.throttle_write_bps_device())
        || nonempty(b.throttle_read_iops_device())
        || nonempty(b.throttle_write_iops_device())
}

/// The interface-file writes for a resource request, in the order they must be applied.
///
/// Fields that cgroup v2 cannot express (hugepage, rdma, network, realtime, unified) are refused
/// rather than silently dropped; cgroup-v1-only tuning knobs with no v2 meaning (swappiness,
/// kernel memory, OOM-killer toggle, leaf weights) are ignored, as runc does.
pub fn plan_writes(res: &LinuxResources) -> Result<Vec<CgroupWrite>, CgroupError> {
    refuse_unsupported(res)?;
    let mut out = Vec::new();
    if let Some(m) = res.memory() {
        plan_memory(m, &mut out)?;
    }
    if let Some(c) = res.cpu() {
        plan_cpu(c, &mut out)?;
        plan_cpuset(c, &mut out)?;
    }
    if let Some(p) = res.pids() {
        let limit = p.limit();
        let value = if limit <= 0 {
            "max".to_string()
        } else {
            limit.to_string()
        };
        out.push(CgroupWrite::new("pids.max", value));
    }
    if let Some(b) = res.block_io() {
        plan_block_io(b, &mut out)?;
    }
    Ok(out)
}

fn refuse_unsupported(res: &LinuxResources) -> Result<(), CgroupError> {
    let unsupported = |field| Err(CgroupError::UnsupportedResource { field });
    if res
        .hugepage_limits()
        .as_ref()
        .is_some_and(|v| !v.is_empty())
    {
        return unsupported("hugepageLimits");
    }
    if res.rdma().as_ref().is_some_and(|v| !v.is_empty()) {
        return unsupported("rdma");
    }
    if res.unified().as_ref().is_some_and(|v| !v.is_empty()) {
        return unsupported("unified");
    }
    if let Some(n) = res.network()
        && (n.class_id().is_some() || n.priorities().as_ref().is_some_and(|v| !v.is_empty()))
    {
        return unsupported("network");
    }
    if let Some(c) = res.cpu()
        && (c.realtime_runtime().is_some_and(|v| v != 0)
            || c.realtime_period().is_some_and(|v| v != 0))
    {
        return unsupported("cpu.realtimeRuntime/realtimePeriod");
    }
    Ok(())
}

fn invalid(field: &'static str, value: impl ToString, reason: &'static str) -> CgroupError {
    CgroupError::InvalidResource {
        field,
        value: value.to_string(),
        reason,
    }
}

/// OCI limits use -1 for "unlimited" and 0 for "unset".
fn limit_value(field: &'static str, v: i64) -> Result<Option<String>, CgroupError> {
    match v {
        0 => Ok(None),
        -1 => Ok(Some("max".into())),
        v if v < 0 => Err(invalid(field, v, "must be positive, or -1 for unlimited")),
        v => Ok(Some(v.to_string())),
    }
}

fn plan_memory(m: &LinuxMemory, out: &mut Vec<CgroupWrite>) -> Result<(), CgroupError> {
    let limit = m.limit().unwrap_or(0);
    let max = limit_value("memory.limit", limit)?;
    // runc writes memory.swap.max first: lowering memory.max can push pages to swap, which must
    // already be allowed (or forbidden) by then.
    if let Some(swap) = swap_max(m.swap().unwrap_or(0), limit)? {
        out.push(CgroupWrite::new("memory.swap.max", swap));
    }
    if let Some(max) = max {
        out.push(CgroupWrite::new("memory.max", max));
    }
    // The v1 soft limit maps to v2's best-effort protection, as in runc.
    if let Some(r) = m.reservation() {
        match r {
            0 | -1 => {}
            r if r < 0 => {
                return Err(invalid(
                    "memory.reservation",
                    r,
                    "must be positive, or -1 for none",
                ));
            }
            r => out.push(CgroupWrite::new("memory.low", r.to_string())),
        }
    }
    Ok(())
}

/// OCI `swap` is the memory+swap total (a v1 notion); v2's memory.swap.max is swap alone.
/// Same cases as runc's `ConvertMemorySwapToCgroupV2Value`.
fn swap_max(memsw: i64, limit: i64) -> Result<Option<String>, CgroupError> {
    const FIELD: &str = "memory.swap";
    match (memsw, limit) {
        // "Unlimited memory, swap unset" means both unlimited, as on cgroup v1.
        (0, -1) => Ok(Some("max".into())),
        (0, _) => Ok(None),
        (-1, _) => Ok(Some("max".into())),
        (s, _) if s < 0 => Err(invalid(FIELD, s, "must be positive, or -1 for unlimited")),
        (_, 0 | -1) => Err(invalid(
            FIELD,
            memsw,
            "a memory+swap limit needs a memory limit too",
        )),
        (_, l) if l < 0 => Err(invalid(
            "memory.limit",
            l,
            "must be positive, or -1 for unlimited",
        )),
        (s, l) if s < l => Err(invalid(
            FIELD,
            s,
            "it is memory+swap and must be at least the memory limit",
        )),
        (s, l) => Ok(Some((s - l).to_string())),
    }
}

fn plan_cpu(c: &LinuxCpu, out: &mut Vec<CgroupWrite>) -> Result<(), CgroupError> {
    if let Some(shares) = c.shares() {
        let weight = cpu_shares_to_weight(shares);
        if weight != 0 {
            out.push(CgroupWrite::new("cpu.weight", weight.to_string()));
        }
    }
    let quota = c.quota().unwrap_or(0);
    let period = c.period().unwrap_or(0);
    if quota != 0 || period != 0 {
        let period = match period {
            0 => DEFAULT_CPU_PERIOD_US,
            p if !(MIN_CPU_PERIOD_US..=MAX_CPU_PERIOD_US).contains(&p) => {
                return Err(invalid(
                    "cpu.period",
                    p,
                    "must be between 1000 and 1000000 microseconds",
                ));
            }
            p => p,
        };
        let quota = match quota {
            q if q < -1 => {
                return Err(invalid(
                    "cpu.quota",
                    q,
                    "must be positive, or -1 for unlimited",
                ));
            }
            -1 | 0 => "max".to_string(),
            q if q < MIN_CPU_QUOTA_US => {
                return Err(invalid(
                    "cpu.quota",
                    q,
                    "must be at least 1000 microseconds",
                ));
            }
            q => q.to_string(),
        };
        out.push(CgroupWrite::new("cpu.max", format!("{quota} {period}")));
    }
    if let Some(burst) = c.burst() {
        out.push(CgroupWrite::new("cpu.max.burst", burst.to_string()));
    }
    if let Some(idle) = c.idle() {
        if !(0..=1).contains(&idle) {
            return Err(invalid("cpu.idle", idle, "must be 0 or 1"));
        }
        out.push(CgroupWrite::new("cpu.idle", idle.to_string()));
    }
    Ok(())
}

/// cpu.shares [2, 262144] (default 1024) to cpu.weight [1, 10000] (default 100). This is the
/// quadratic fit runc and crun use since 2025 (opencontainers/runc#4785); the older linear
/// formula mapped the default 1024 shares to weight 39, starving containers next to host
/// services at the default 100. Out-of-range shares clamp, as the v1 kernel did.
pub(crate) fn cpu_shares_to_weight(shares: u64) -> u64 {
    match shares {
        0 => 0,
        1..=2 => 1,
        262_144.. => 10_000,
        s => {
            // Exact for every s in range: f64 holds integers up to 2^53.
            #[allow(clippy::cast_precision_loss)]
            let l = (s as f64).log2();
            let exponent = (l * l + 125.0 * l) / 612.0 - 7.0 / 34.0;
            // The result lies in [1, 10000], so the cast cannot truncate or wrap.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let w = 10f64.powf(exponent).ceil() as u64;
            w
        }
    }
}

fn plan_cpuset(c: &LinuxCpu, out: &mut Vec<CgroupWrite>) -> Result<(), CgroupError> {
    for (field, file, value) in [
        ("cpu.cpus", "cpuset.cpus", c.cpus()),
        ("cpu.mems", "cpuset.mems", c.mems()),
    ] {
        let Some(value) = value.as_deref().map(str::trim) else {
            continue;
        };
        if value.is_empty() {
            continue;
        }
        check_cpu_list(field, value)?;
        out.push(CgroupWrite::new(file, value));
    }
    Ok(())
}

/// The kernel's list format, e.g. "0-3,8,10-11". Checked here so a typo is reported as a spec
/// error naming the field instead of an EINVAL from the kernel.
fn check_cpu_list(field: &'static str, list: &str) -> Result<(), CgroupError> {
    let bad = |reason| Err(invalid(field, list, reason));
    for item in list.split(',') {
        let (lo, hi) = match item.split_once('-') {
            Some((lo, hi)) => (lo, hi),
            None => (item, item),
        };
        let parse = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                None
            } else {
                s.parse::<u32>().ok()
            }
        };
        match (parse(lo), parse(hi)) {
            (Some(lo), Some(hi)) if lo <= hi => {}
            (Some(_), Some(_)) => return bad("a range must go from low to high, e.g. 0-3"),
            _ => return bad("expected a list like 0-3,8,10-11"),
        }
    }
    Ok(())
}

/// blkio.weight [10, 1000] to io.weight [1, 10000], as runc converts it.
fn blkio_weight_to_io_weight(field: &'static str, w: u16) -> Result<u64, CgroupError> {
    if !(10..=1000).contains(&w) {
        return Err(invalid(field, w, "must be between 10 and 1000"));
    }
    Ok(1 + (u64::from(w) - 10) * 9999 / 990)
}

fn device_numbers(field: &'static str, major: i64, minor: i64) -> Result<String, CgroupError> {
    if !(0..=MAX_MAJOR).contains(&major) {
        return Err(invalid(field, major, "device major must be 0..=4095"));
    }
    if !(0..=MAX_MINOR).contains(&minor) {
        return Err(invalid(field, minor, "device minor must be 0..=1048575"));
    }
    Ok(format!("{major}:{minor}"))
}

fn plan_block_io(b: &LinuxBlockIo, out: &mut Vec<CgroupWrite>) -> Result<(), CgroupError> {
    if let Some(w) = b.weight() {
        let w = blkio_weight_to_io_weight("blockIO.weight", w)?;
        out.push(CgroupWrite::new("io.weight", format!("default {w}")));
    }
    for d in b.weight_device().iter().flatten() {
        let Some(w) = d.weight() else { continue };
        let dev = device_numbers("blockIO.weightDevice", d.major(), d.minor())?;
        let w = blkio_weight_to_io_weight("blockIO.weightDevice", w)?;
        out.push(CgroupWrite::new("io.weight", format!("{dev} {w}")));
    }
    let throttles: [(
        &'static str,
        &'static str,
        &Option<Vec<LinuxThrottleDevice>>,
    ); 4] = [
        (
            "blockIO.throttleReadBpsDevice",
            "rbps",
            b.throttle_read_bps_device(),
        ),
        (
            "blockIO.throttleWriteBpsDevice",
            "wbps",
            b.throttle_write_bps_device(),
        ),
        (
            "blockIO.throttleReadIOPSDevice",
            "riops",
            b.throttle_read_iops_device(),
        ),
        (
            "blockIO.throttleWriteIOPSDevice",
            "wiops",
            b.throttle_write_iops_device(),
        ),
    ];
    for (field, key, devices) in throttles {
        for d in devices.iter().flatten() {
            let dev = device_numbers(field, d.major(), d.minor())?;
            // A zero rate removes the limit; the kernel would otherwise stall all I/O.
            let rate = match d.rate() {
                0 => "max".to_string(),
                r => r.to_string(),
            };
            out.push(CgroupWrite::new("io.max", format!("{dev} {key}={rate}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use oci_spec::runtime::{
        LinuxBlockIoBuilder, LinuxCpuBuilder, LinuxHugepageLimitBuilder, LinuxMemoryBuilder,
        LinuxPidsBuilder, LinuxResourcesBuilder, LinuxThrottleDeviceBuilder,
        LinuxWeightDeviceBuilder,
    };

    /// Which controller owns an interface file, from its name prefix.
    fn controller_of(file: &str) -> Option<Controller> {
        let prefix = file.split('.').next()?;
        Controller::ALL.into_iter().find(|c| c.name() == prefix)
    }

    fn w(file: &'static str, value: &str) -> CgroupWrite {
        CgroupWrite::new(file, value)
    }

    fn mem(limit: Option<i64>, swap: Option<i64>) -> LinuxResources {
        let mut m = LinuxMemoryBuilder::default();
        if let Some(l) = limit {
            m = m.limit(l);
        }
        if let Some(s) = swap {
            m = m.swap(s);
        }
        LinuxResourcesBuilder::default()
            .memory(m.build().unwrap())
            .build()
            .unwrap()
    }

    fn cpu(c: LinuxCpuBuilder) -> LinuxResources {
        LinuxResourcesBuilder::default()
            .cpu(c.build().unwrap())
            .build()
            .unwrap()
    }

    #[test]
    fn empty_request_plans_nothing_and_needs_nothing() {
        let r = LinuxResources::default();
        assert_eq!(plan_writes(&r).unwrap(), vec![]);
        assert_eq!(required_controllers(&r), vec![]);
    }

    #[test]
    fn memory_limit_alone() {
        assert_eq!(
            plan_writes(&mem(Some(1 << 30), None)).unwrap(),
            vec![w("memory.max", "1073741824")]
        );
    }

    #[test]
    fn memory_unlimited_without_swap_means_both_unlimited() {
        assert_eq!(
            plan_writes(&mem(Some(-1), None)).unwrap(),
            vec![w("memory.swap.max", "max"), w("memory.max", "max")]
        );
    }

    #[test]
    fn swap_is_the_memory_plus_swap_total() {
        assert_eq!(
            plan_writes(&mem(Some(200), Some(500))).unwrap(),
            vec![w("memory.swap.max", "300"), w("memory.max", "200")]
        );
        // memory+swap == memory: no swap at all.
        assert_eq!(
            plan_writes(&mem(Some(1000), Some(1000))).unwrap(),
            vec![w("memory.swap.max", "0"), w("memory.max", "1000")]
        );
        assert_eq!(
            plan_writes(&mem(Some(1000), Some(-1))).unwrap(),
            vec![w("memory.swap.max", "max"), w("memory.max", "1000")]
        );
        // -1 swap with no memory limit is still "unlimited swap" (runc's table).
        assert_eq!(
            plan_writes(&mem(None, Some(-1))).unwrap(),
            vec![w("memory.swap.max", "max")]
        );
    }

    #[test]
    fn bad_swap_values_are_errors() {
        for (limit, swap) in [
            (Some(300), Some(200)), // total below memory
            (None, Some(500)),      // swap without a memory limit
            (Some(-1), Some(500)),  // swap with unlimited memory
            (Some(100), Some(-2)),  // nonsense negative
            (Some(-5), Some(100)),  // nonsense memory
        ] {
            let err = plan_writes(&mem(limit, swap)).unwrap_err();
            assert!(
                matches!(err, CgroupError::InvalidResource { .. }),
                "{limit:?} {swap:?}: {err}"
            );
        }
    }

    #[test]
    fn negative_memory_limit_is_an_error() {
        let err = plan_writes(&mem(Some(-7), None)).unwrap_err();
        assert!(err.to_string().contains("memory.limit = -7"), "{err}");
    }

    #[test]
    fn memory_reservation_maps_to_memory_low() {
        let r = LinuxResourcesBuilder::default()
            .memory(
                LinuxMemoryBuilder::default()
                    .reservation(4096)
                    .build()
                    .unwrap(),
            )
            .build()
            .unwrap();
        assert_eq!(plan_writes(&r).unwrap(), vec![w("memory.low", "4096")]);
        assert_eq!(required_controllers(&r), vec![Controller::Memory]);
    }

    #[test]
    fn half_a_cpu() {
        let r = cpu(LinuxCpuBuilder::default().quota(50_000).period(100_000u64));
        assert_eq!(plan_writes(&r).unwrap(), vec![w("cpu.max", "50000 100000")]);
        assert_eq!(required_controllers(&r), vec![Controller::Cpu]);
    }

    #[test]
    fn quota_without_period_uses_the_kernel_default_period() {
        let r = cpu(LinuxCpuBuilder::default().quota(250_000));
        assert_eq!(
            plan_writes(&r).unwrap(),
            vec![w("cpu.max", "250000 100000")]
        );
    }

    #[test]
    fn unlimited_quota_keeps_the_period() {
        let r = cpu(LinuxCpuBuilder::default().quota(-1).period(50_000u64));
        assert_eq!(plan_writes(&r).unwrap(), vec![w("cpu.max", "max 50000")]);
        let r = cpu(LinuxCpuBuilder::default().period(20_000u64));
        assert_eq!(plan_writes(&r).unwrap(), vec![w("cpu.max", "max 20000")]);
    }

    #[test]
    fn bad_cpu_bandwidth_is_an_error() {
        for c in [
            LinuxCpuBuilder::default().quota(-2),
            LinuxCpuBuilder::default().quota(500),
            LinuxCpuBuilder::default().quota(50_000).period(10u64),
            LinuxCpuBuilder::default()
                .quota(50_000)
                .period(2_000_000u64),
            LinuxCpuBuilder::default().idle(3),
        ] {
            assert!(matches!(
                plan_writes(&cpu(c)),
                Err(CgroupError::InvalidResource { .. })
            ));
        }
    }

    #[test]
    fn shares_convert_like_runc() {
        // opencontainers/cgroups utils_test.go table.
        for (shares, weight) in [
            (0, 0),
            (1, 1),
            (2, 1),
            (3, 2),
            (1024, 100),
            (262_143, 10_000),
            (262_144, 10_000),
            (262_145, 10_000),
        ] {
            assert_eq!(cpu_shares_to_weight(shares), weight, "shares {shares}");
        }
        let r = cpu(LinuxCpuBuilder::default().shares(1024u64));
        assert_eq!(plan_writes(&r).unwrap(), vec![w("cpu.weight", "100")]);
    }

    #[test]
    fn shares_to_weight_is_monotonic_and_in_range() {
        let mut prev = 1;
        for s in (2..=262_144).step_by(97) {
            let w = cpu_shares_to_weight(s);
            assert!((1..=10_000).contains(&w) && w >= prev, "shares {s} -> {w}");
            prev = w;
        }
    }

    #[test]
    fn cpuset_lists_pass_through_after_validation() {
        let r = cpu(LinuxCpuBuilder::default().cpus("0-3,8").mems(" 0 "));
        assert_eq!(
            plan_writes(&r).unwrap(),
            vec![w("cpuset.cpus", "0-3,8"), w("cpuset.mems", "0")]
        );
        assert_eq!(required_controllers(&r), vec![Controller::Cpuset]);
    }

    #[test]
    fn empty_cpuset_is_unset() {
        let r = cpu(LinuxCpuBuilder::default().cpus(""));
        assert_eq!(plan_writes(&r).unwrap(), vec![]);
        assert_eq!(required_controllers(&r), vec![]);
    }

    #[test]
    fn malformed_cpuset_is_an_error() {
        for bad in ["0-", "3-1", "a", "0,,1", "1 2", "-1", "0-3;4"] {
            let r = cpu(LinuxCpuBuilder::default().cpus(bad));
            let err = plan_writes(&r).unwrap_err();
            assert!(err.to_string().contains("cpu.cpus"), "{bad}: {err}");
        }
    }

    #[test]
    fn pids_limit() {
        let p = |n| {
            LinuxResourcesBuilder::default()
                .pids(LinuxPidsBuilder::default().limit(n).build().unwrap())
                .build()
                .unwrap()
        };
        assert_eq!(plan_writes(&p(64)).unwrap(), vec![w("pids.max", "64")]);
        assert_eq!(plan_writes(&p(0)).unwrap(), vec![w("pids.max", "max")]);
        assert_eq!(plan_writes(&p(-1)).unwrap(), vec![w("pids.max", "max")]);
        assert_eq!(required_controllers(&p(64)), vec![Controller::Pids]);
    }

    #[test]
    fn block_io_weights_and_throttles() {
        let b = LinuxBlockIoBuilder::default()
            .weight(1000u16)
            .weight_device(vec![
                LinuxWeightDeviceBuilder::default()
                    .major(8)
                    .minor(0)
                    .weight(10u16)
                    .build()
                    .unwrap(),
            ])
            .throttle_read_bps_device(vec![
                LinuxThrottleDeviceBuilder::default()
                    .major(8)
                    .minor(16)
                    .rate(1_048_576u64)
                    .build()
                    .unwrap(),
            ])
            .throttle_write_iops_device(vec![
                LinuxThrottleDeviceBuilder::default()
                    .major(8)
                    .minor(16)
                    .rate(0u64)
                    .build()
                    .unwrap(),
            ])
            .build()
            .unwrap();
        let r = LinuxResourcesBuilder::default()
            .block_io(b)
            .build()
            .unwrap();
        assert_eq!(
            plan_writes(&r).unwrap(),
            vec![
                w("io.weight", "default 10000"),
                w("io.weight", "8:0 1"),
                w("io.max", "8:16 rbps=1048576"),
                w("io.max", "8:16 wiops=max"),
            ]
        );
        assert_eq!(required_controllers(&r), vec![Controller::Io]);
    }

    #[test]
    fn bad_block_io_is_an_error() {
        let b = LinuxBlockIoBuilder::default().weight(5u16).build().unwrap();
        let r = LinuxResourcesBuilder::default()
            .block_io(b)
            .build()
            .unwrap();
        plan_writes(&r).unwrap_err();
        let b = LinuxBlockIoBuilder::default()
            .throttle_read_bps_device(vec![
                LinuxThrottleDeviceBuilder::default()
                    .major(-8)
                    .minor(0)
                    .rate(1u64)
                    .build()
                    .unwrap(),
            ])
            .build()
            .unwrap();
        let r = LinuxResourcesBuilder::default()
            .block_io(b)
            .build()
            .unwrap();
        plan_writes(&r).unwrap_err();
    }

    #[test]
    fn unsupported_fields_are_refused_not_dropped() {
        let r = LinuxResourcesBuilder::default()
            .hugepage_limits(vec![
                LinuxHugepageLimitBuilder::default()
                    .page_size("2MB")
                    .limit(1i64 << 21)
                    .build()
                    .unwrap(),
            ])
            .build()
            .unwrap();
        assert!(matches!(
            plan_writes(&r),
            Err(CgroupError::UnsupportedResource {
                field: "hugepageLimits"
            })
        ));
        let r = cpu(LinuxCpuBuilder::default().realtime_runtime(950_000));
        assert!(matches!(
            plan_writes(&r),
            Err(CgroupError::UnsupportedResource { .. })
        ));
    }

    #[test]
    fn full_request_needs_every_controller_in_order() {
        let r = LinuxResourcesBuilder::default()
            .memory(
                LinuxMemoryBuilder::default()
                    .limit(1 << 20)
                    .build()
                    .unwrap(),
            )
            .cpu(
                LinuxCpuBuilder::default()
                    .shares(512u64)
                    .cpus("0")
                    .build()
                    .unwrap(),
            )
            .pids(LinuxPidsBuilder::default().limit(10).build().unwrap())
            .block_io(
                LinuxBlockIoBuilder::default()
                    .weight(500u16)
                    .build()
                    .unwrap(),
            )
            .devices(vec![])
            .build()
            .unwrap();
        assert_eq!(
            required_controllers(&r),
            vec![
                Controller::Memory,
                Controller::Cpu,
                Controller::Cpuset,
                Controller::Pids,
                Controller::Io
            ]
        );
    }

    /// Every planned file belongs to a controller that required_controllers asked for: the two
    /// functions cannot drift apart.
    #[test]
    fn planned_files_are_covered_by_required_controllers() {
        let requests = [
            mem(Some(100), Some(300)),
            mem(Some(-1), None),
            cpu(LinuxCpuBuilder::default()
                .shares(2u64)
                .quota(2000)
                .burst(10u64)
                .idle(1)
                .mems("0")),
            LinuxResourcesBuilder::default()
                .pids(LinuxPidsBuilder::default().limit(1).build().unwrap())
                .block_io(
                    LinuxBlockIoBuilder::default()
                        .weight(10u16)
                        .build()
                        .unwrap(),
                )
                .build()
                .unwrap(),
        ];
        for r in &requests {
            let needed = required_controllers(r);
            for write in plan_writes(r).unwrap() {
                let c = controller_of(write.file).expect(write.file);
                assert!(needed.contains(&c), "{} needs {c}", write.file);
            }
        }
    }
}
