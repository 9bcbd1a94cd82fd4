//! The default host software of `[host_software]`: where the usual Linux distributions put
//! Slurm's client, Lmod and Open MPI (berth_slurm's hostsw and mpi modules bind what is found).

/// The Slurm client files of the usual layouts (Debian/Ubuntu, RHEL); the ones missing on a
/// node are skipped.
pub fn default_slurm_paths() -> Vec<String> {
    let mut paths: Vec<String> = [
        "srun", "sbatch", "salloc", "squeue", "scancel", "sinfo", "scontrol", "sacct",
    ]
    .iter()
    .map(|b| format!("/usr/bin/{b}"))
    .collect();
    paths.extend(
        [
            "/usr/lib/*-linux-gnu/slurm-wlm",
            "/usr/lib/*-linux-gnu/libmunge.so.2",
            "/usr/lib64/slurm",
            "/usr/lib64/libmunge.so.2",
            "/etc/slurm",
            "/run/munge",
        ]
        .map(String::from),
    );
    paths
}

/// Lmod as Debian/Ubuntu install it (its Lua 5.3 interpreter and modules, which images lack),
/// its configuration and the usual module trees; sites add their software trees (`/opt/hpcx`).
pub fn default_module_paths() -> Vec<String> {
    [
        "/usr/share/lmod",
        "/usr/lib/lmod",
        "/etc/lmod",
        "/etc/profile.d/lmod.sh",
        "/usr/share/modulefiles",
        "/opt/modulefiles",
        "/usr/bin/lua5.3",
        "/usr/lib/*-linux-gnu/liblua5.3*.so*",
        // lua5.3 links readline, Lmod's tcl2lua.so (loaded at every start) Tcl: images rarely
        // have them.
        "/usr/lib/*-linux-gnu/libreadline.so.8",
        "/usr/lib/*-linux-gnu/libtcl8.6.so",
        "/usr/share/tcltk/tcl8.6",
        "/usr/lib/*-linux-gnu/lua",
        "/usr/share/lua",
    ]
    .map(String::from)
    .to_vec()
}

/// The host's Open MPI as Debian/Ubuntu install it (openmpi-bin, libopenmpi3), with the PMIx,
/// hwloc, libevent, UCX, libfabric and verbs libraries it loads; missing ones are skipped.
pub fn default_mpi_libraries() -> Vec<String> {
    [
        "libmpi.so.40*",
        "libopen-pal.so.40*",
        "libopen-rte.so.40*",
        "libmca_common_*.so.40*",
        "libpmix.so.2*",
        "libmunge.so.2*",
        "libhwloc.so.15*",
        "libevent_core-2.1.so.7*",
        "libevent_pthreads-2.1.so.7*",
        "libucp.so.0*",
        "libuct.so.0*",
        "libucs.so.0*",
        "libucm.so.0*",
        "libucs_signal.so.0*",
        "libfabric.so.1*",
        "libibverbs.so.1*",
        "librdmacm.so.1*",
        "libefa.so.1*",
        "libpsm2.so.2*",
        "libpsm_infinipath.so.1*",
        "libnl-3.so.200*",
        "libnl-route-3.so.200*",
    ]
    .iter()
    .map(|l| format!("/usr/lib/*-linux-gnu/{l}"))
    .collect()
}

/// Open MPI's, PMIx's, UCX's, hwloc's and verbs' plugin trees (looked up at the paths they were
/// built with), Open MPI's configuration and help texts, the verbs drivers' configuration.
pub fn default_mpi_paths() -> Vec<String> {
    [
        "/usr/lib/*-linux-gnu/openmpi",
        "/usr/lib/*-linux-gnu/pmix2",
        "/usr/lib/*-linux-gnu/ucx",
        "/usr/lib/*-linux-gnu/hwloc",
        "/usr/lib/*-linux-gnu/libibverbs",
        "/usr/lib/*-linux-gnu/libfabric",
        "/etc/openmpi",
        "/usr/share/openmpi",
        "/etc/libibverbs.d",
    ]
    .map(String::from)
    .to_vec()
}
