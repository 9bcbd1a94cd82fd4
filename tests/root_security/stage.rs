//! Security tests: staging, scratch, the dataset cache and the retention area (issue 13, points
//! 4, 6, 9 and 10b). Root runs the Prolog, the Epilog and `berth stage` as Slurm or an admin
//! would; the attacker (berthtest) prepares the directories and races the paths.

use super::*;

use std::os::unix::fs::MetadataExt;
use std::process::Stdio;

/// A config of this test's own under `w`: the scratch root, the retention area and the dataset
/// cache where the test says (the state in `w` too, the health checks off: only staging is
/// judged).
fn own_config(w: &Path, scratch: &Path, extra: &str) -> PathBuf {
    own_config_with(w, scratch, extra, "")
}

/// [`own_config`] with `in_scratch` added to its `[scratch]` table.
fn own_config_with(w: &Path, scratch: &Path, extra: &str, in_scratch: &str) -> PathBuf {
    let cfg = w.join("berth.toml");
    std::fs::write(
        &cfg,
        format!(
            "{extra}\n[runtime]\nstate_dir = \"{}\"\n[topology]\nepilog_health = false\n\
             [scratch]\n{in_scratch}\nroot = \"{}\"\n",
            w.join("state").display(),
            scratch.display()
        ),
    )
    .unwrap();
    cfg
}

/// `berth --config CFG VERB` as slurmd runs the Prolog/Epilog for `job` of `user`, with the
/// plugin's variables `env`.
fn hook(cfg: &Path, verb: &str, job: &str, user: (u32, u32), env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config")
        .arg(cfg)
        .arg(verb)
        .env("SLURM_JOB_ID", job)
        .env("SLURM_JOB_UID", user.0.to_string())
        .env("SLURM_JOB_GID", user.1.to_string())
        .env_remove("SPANK_BERTH_IMAGE")
        .env_remove("SPANK_BERTH_STAGE_IN")
        .env_remove("SPANK_BERTH_STAGE_OUT")
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    cmd.output().unwrap()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn lchown(p: &Path, (uid, gid): (u32, u32)) {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).unwrap();
}

/// A directory of the attacker's, 0777, with one file: where a user would like root's data to go.
fn attackers_dir(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    give(p, attacker());
    chmod(p, 0o777);
}

/// The two ways another user pre-makes a directory berth relies on: a directory of theirs,
/// 0777, and a symlink of theirs to one. Returns (what to configure, where the attacker looks).
fn premade(w: &Path, name: &str, symlink: bool) -> (PathBuf, PathBuf) {
    let at = w.join(name);
    if symlink {
        let target = w.join(format!("{name}-target"));
        attackers_dir(&target);
        std::os::unix::fs::symlink(&target, &at).unwrap();
        lchown(&at, attacker());
        (at, target)
    } else {
        attackers_dir(&at);
        (at.clone(), at)
    }
}

/// Asserts a one-line refusal of `what` (a directory another user owns or a symlink).
fn refused_in_one_line(o: &Output, what: &Path) {
    let err = stderr(o);
    assert!(!o.status.success(), "not refused: {err}");
    let line = err
        .lines()
        .find(|l| l.contains(&what.display().to_string()))
        .unwrap_or_else(|| panic!("no line names {}: {err}", what.display()));
    assert!(
        line.contains("owned by uid") || line.contains("symlink"),
        "not a refusal of {}: {err}",
        what.display()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_epilog_never_removes_through_a_directory_swapped_for_a_symlink() {
    let w = workdir("stage-epilog-swap");
    let scratch = w.join("scratch");
    let cfg = own_config(&w, &scratch, "");
    // Root's directory elsewhere, which the job's user must never make root empty.
    let precious = w.join("precious");
    std::fs::create_dir(&precious).unwrap();
    for f in ["a", "b", "c"] {
        std::fs::write(precious.join(f), f).unwrap();
    }
    chmod(&precious, 0o755);
    let job = "913001";
    let me = attacker();
    let o = hook(&cfg, "prolog", job, me, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let dir = scratch.join(job);
    // The user's live process (another job) swaps d and l all along.
    let _swap = swapper(&dir.join("d"), &dir.join("l"));
    let start = std::time::Instant::now();
    for i in 0..TRIES {
        if !dir.exists() {
            let o = hook(&cfg, "prolog", job, me, &[]);
            assert!(o.status.success(), "try {i}: {}", stderr(&o));
        }
        let d = dir.join("d");
        let _ = std::fs::create_dir(&d);
        for f in ["x", "y", "z"] {
            let _ = std::fs::write(d.join(f), f);
        }
        let _ = std::os::unix::fs::symlink(&precious, dir.join("l"));
        // Everything in it the user's (-h: the symlink itself, never its target).
        let _ = Command::new("chown")
            .args(["-hR", &format!("{}:{}", me.0, me.1)])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let o = hook(&cfg, "epilog", job, me, &[]);
        assert_eq!(names(&precious), ["a", "b", "c"], "try {i}: {}", stderr(&o));
        assert_eq!(mode(&precious), 0o755, "try {i}");
        assert!(
            o.status.success(),
            "try {i}: the Epilog failed (a drain): {}",
            stderr(&o)
        );
        assert!(!dir.exists(), "try {i}: the scratch is left");
    }
    assert!(start.elapsed().as_secs() < 120);
}

fn a_premade_root_is_refused(name: &str, setup: impl Fn(&Path, &Path, bool) -> Output) {
    for symlink in [false, true] {
        let w = workdir(&format!("{name}-{symlink}"));
        let (at, looked) = premade(&w, name, symlink);
        let o = setup(&w, &at, symlink);
        refused_in_one_line(&o, &at);
        assert_eq!(
            names(&looked),
            Vec::<String>::new(),
            "symlink {symlink}: root put the job's files where the attacker looks"
        );
        assert_eq!(std::fs::metadata(&looked).unwrap().uid(), attacker().0);
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_scratch_root_another_user_made_is_refused() {
    a_premade_root_is_refused("sroot", |w, at, _| {
        let cfg = own_config(w, at, "");
        hook(&cfg, "prolog", "913002", victim(), &[])
    });
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_cache_root_another_user_made_is_refused() {
    a_premade_root_is_refused("cache", |w, at, _| {
        let data = w.join("data");
        std::fs::create_dir_all(data.join("set")).unwrap();
        std::fs::write(data.join("set/secret"), "the victim's dataset").unwrap();
        let cfg = own_config(
            w,
            &w.join("scratch"),
            &format!(
                "[stage]\ncache_dir = \"{}\"\ncache_prefixes = [\"{}\"]\n",
                at.display(),
                data.display()
            ),
        );
        let dest = w.join("dest");
        std::fs::create_dir(&dest).unwrap();
        give(&dest, victim());
        chmod(&dest, 0o700);
        Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(["stage", "in"])
            .arg(format!("{}:ds", data.join("set").display()))
            .arg("--to")
            .arg(&dest)
            .args(["--user", "berthvictim"])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    });
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_retention_area_another_user_made_is_refused() {
    a_premade_root_is_refused("kept", |w, at, symlink| {
        let scratch = w.join("scratch");
        let cfg = own_config_with(
            w,
            &scratch,
            "",
            &format!("retention_dir = \"{}\"", at.display()),
        );
        let job = if symlink { "913014" } else { "913004" };
        let o = hook(&cfg, "prolog", job, victim(), &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::write(scratch.join(job).join("results"), "the victim's results").unwrap();
        // A stage-out that fails: the Epilog keeps the scratch in the retention area.
        hook(
            &cfg,
            "epilog",
            job,
            victim(),
            &[("SPANK_BERTH_STAGE_OUT", "missing:/nonexistent/out")],
        )
    });
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_leftover_job_directory_is_replaced_not_handed_over_nor_a_drain() {
    let w = workdir("stage-leftover");
    let scratch = w.join("scratch");
    let cfg = own_config(&w, &scratch, "");
    std::fs::create_dir(&scratch).unwrap();
    chmod(&scratch, 0o755);
    // Left over from an earlier job of the attacker's: a 0777 directory with a file planted.
    let job = "913005";
    let left = scratch.join(job);
    attackers_dir(&left);
    std::fs::write(left.join("planted"), "x").unwrap();
    give(&left, attacker());
    // And a symlink of the attacker's to a directory of theirs.
    let job2 = "913006";
    let target = w.join("attackers");
    attackers_dir(&target);
    std::fs::write(target.join("keep"), "x").unwrap();
    give(&target, attacker());
    std::os::unix::fs::symlink(&target, scratch.join(job2)).unwrap();
    lchown(&scratch.join(job2), attacker());
    let (vu, vg) = victim();
    for j in [job, job2] {
        let o = hook(&cfg, "prolog", j, victim(), &[]);
        assert!(
            o.status.success(),
            "job {j}: the Prolog failed (a drain): {}",
            stderr(&o)
        );
        let dir = scratch.join(j);
        let m = std::fs::symlink_metadata(&dir).unwrap();
        assert!(m.is_dir(), "job {j}: not a directory");
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o7777),
            (vu, vg, 0o700),
            "job {j}"
        );
        assert_eq!(names(&dir), Vec::<String>::new(), "job {j}: handed over");
        let o = hook(&cfg, "epilog", j, victim(), &[]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert_eq!(names(&target), ["keep"]);
    assert_eq!(
        (mode(&target), std::fs::metadata(&target).unwrap().uid()),
        (0o777, attacker().0)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn staging_into_an_existing_directory_keeps_its_mode() {
    let w = workdir("stage-keep-mode");
    // The user's own stage out into the user's 0751 directory.
    let src = w.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("f"), "result").unwrap();
    chmod(&src, 0o755);
    give(&src, attacker());
    let out = w.join("out");
    std::fs::create_dir(&out).unwrap();
    give(&out, attacker());
    chmod(&out, 0o751);
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config")
        .arg(config())
        .args(["stage", "out"])
        .arg(format!("{}:{}", src.display(), out.display()))
        .env_remove("BERTH_SCRATCH");
    let o = as_uid(&mut cmd, attacker()).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(out.join("f")).unwrap(), "result");
    assert_eq!(
        mode(&out),
        0o751,
        "the user's stage out changed its destination's mode"
    );
    // Root's stage out of a 0700 directory into a root-owned 0755 one (as `stage out /tmp:/`).
    let rsrc = w.join("rsrc");
    std::fs::create_dir(&rsrc).unwrap();
    std::fs::write(rsrc.join("g"), "g").unwrap();
    chmod(&rsrc, 0o700);
    let dest = w.join("rootdir");
    std::fs::create_dir(&dest).unwrap();
    chmod(&dest, 0o755);
    let o = berth(&[
        "stage",
        "out",
        &format!("{}:{}", rsrc.display(), dest.display()),
    ])
    .env_remove("BERTH_SCRATCH")
    .stdin(Stdio::null())
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(dest.join("g")).unwrap(), "g");
    assert_eq!(
        (mode(&dest), std::fs::metadata(&dest).unwrap().uid()),
        (0o755, 0),
        "root's stage out changed its destination's mode"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_non_root_caller_cannot_stage_as_another_user() {
    let w = workdir("stage-as-other");
    let src = w.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("f"), "x").unwrap();
    chmod(&src, 0o755);
    let to = w.join("to");
    attackers_dir(&to);
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config")
        .arg(config())
        .args(["stage", "in"])
        .arg(&src)
        .arg("--to")
        .arg(&to)
        .args(["--user", "berthvictim"]);
    victim();
    let o = as_uid(&mut cmd, attacker()).output().unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "staged as the caller: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("only root"), "{err}");
    assert_eq!(names(&to), Vec::<String>::new());
}
