//! Security tests: container state, listing, naming. A container's state holds its environment
//! (tokens, keys) and its owner's names and labels: no other user may read them, list them, or
//! find and act on the container; the state directory is root's alone.

#[allow(unused_imports)]
use super::*;

use std::process::Stdio;

/// A held container (`berth create`), removed by root when the test ends, failed or not.
struct Held {
    id: String,
}

/// The state directory as an older berth left it (0755: anyone could list it); berth must close
/// it again before it keeps anything there.
fn state_dir_as_an_older_berth_left_it() {
    std::fs::create_dir_all(state_dir()).unwrap();
    chmod(&state_dir(), 0o755);
}

impl Held {
    /// `berth create --rootfs <busybox> ARGS...` as root, as Slurm's plugin would.
    fn create(args: &[&str]) -> Held {
        let rootfs = rootfs().to_str().unwrap().to_string();
        let mut all = vec!["create", "--rootfs", &rootfs];
        all.extend_from_slice(args);
        let out = ok(berth(&all).stdin(Stdio::null()).output().unwrap());
        Held {
            id: out.trim().to_string(),
        }
    }

    /// The container's line in `berth ps` output, split into columns.
    fn row<'a>(&self, ps: &'a str) -> Option<Vec<&'a str>> {
        ps.lines()
            .find(|l| l.starts_with(&self.id))
            .map(|l| l.split_whitespace().collect())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = berth(&["rm", &self.id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// `cmd` run as uid:gid with no other group, waited for.
fn run_as(cmd: &mut Command, who: (u32, u32)) -> Output {
    as_uid(cmd, who).output().unwrap()
}

/// berth (test config) as `who`.
fn berth_as(who: (u32, u32), args: &[&str]) -> Output {
    run_as(&mut berth(args), who)
}

/// `sh -c SCRIPT` as the attacker.
fn attacker_script(script: &str) -> Output {
    run_as(Command::new("/bin/sh").args(["-c", script]), attacker())
}

fn user_name(who: (u32, u32)) -> &'static str {
    if who == attacker() {
        "berthtest"
    } else {
        "berthvictim"
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_container_environment_cannot_be_read_or_listed() {
    state_dir_as_an_older_berth_left_it();
    let secret = format!("s3cr3t-{}", std::process::id());
    let env = format!("TOKEN={secret}");
    let held = Held::create(&[
        "--user",
        user_name(victim()),
        "--env",
        &env,
        "--name",
        "victims-private-box",
    ]);
    // Root sees it: the container is up and its state is there.
    assert!(ok(berth(&["ps"]).output().unwrap()).contains(&held.id));
    let state = state_dir();
    let state = state.to_str().unwrap();
    // Everything a user on the node can try: read, search, list the state; ask berth.
    let o = attacker_script(&format!(
        "cat {state}/*/config.json {state}/*/state.json {state}/{id}/config.json \
         {state}/{id}/state.json {state}/users/*/* 2>&1; \
         grep -r . {state} 2>&1; ls -laR {state} 2>&1; find {state} 2>&1",
        id = held.id
    ));
    let seen = stdout(&o) + &stderr(&o);
    let ps = berth_as(attacker(), &["ps"]);
    let ps_json = berth_as(attacker(), &["ps", "--json"]);
    let berth_seen = stdout(&ps) + &stderr(&ps) + &stdout(&ps_json) + &stderr(&ps_json);
    for (what, text) in [("the shell", &seen), ("berth ps", &berth_seen)] {
        assert!(
            !text.contains(&secret),
            "the attacker read the victim's environment through {what}:\n{text}"
        );
        assert!(
            !text.contains("victims-private-box"),
            "the attacker saw the victim's container name through {what}:\n{text}"
        );
    }
    assert!(
        !berth_seen.contains(&held.id),
        "berth ps listed the victim's container to the attacker:\n{berth_seen}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn ps_shows_each_user_their_own_containers_with_the_uid_they_run_as() {
    state_dir_as_an_older_berth_left_it();
    let mine = Held::create(&["--user", user_name(attacker()), "--name", "attackers-box"]);
    let theirs = Held::create(&["--user", user_name(victim()), "--name", "victims-box"]);
    let o = berth_as(attacker(), &["ps"]);
    let ps = ok(o);
    let row = mine
        .row(&ps)
        .unwrap_or_else(|| panic!("the attacker's own container is missing from her ps:\n{ps}"));
    assert_eq!(
        row[1],
        attacker().0.to_string(),
        "UID of the attacker's container:\n{ps}"
    );
    assert!(row.contains(&"attackers-box"), "{ps}");
    assert!(
        !ps.contains(&theirs.id) && !ps.contains("victims-box"),
        "the attacker's ps shows the victim's container:\n{ps}"
    );
    // The victim sees hers only.
    let ps = ok(berth_as(victim(), &["ps"]));
    assert_eq!(
        theirs.row(&ps).map(|r| r[1].to_string()),
        Some(victim().0.to_string()),
        "{ps}"
    );
    assert!(!ps.contains(&mine.id), "{ps}");
    // Root sees both, each with the uid its command runs as (not root's who created them).
    let ps = ok(berth(&["ps"]).output().unwrap());
    for (held, who) in [(&mine, attacker()), (&theirs, victim())] {
        let row = held
            .row(&ps)
            .unwrap_or_else(|| panic!("missing in root's ps:\n{ps}"));
        assert_eq!(row[1], who.0.to_string(), "UID column:\n{ps}");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_named_container_is_never_found() {
    state_dir_as_an_older_berth_left_it();
    let theirs = Held::create(&["--user", user_name(victim()), "--name", "victims-named"]);
    let pid_before = ok(berth(&["exec", &theirs.id, "--", "sh", "-c", "echo $$"])
        .output()
        .unwrap());
    // What a missing container gets; another user's must get exactly the same.
    let missing = |key: &str| format!("berth: no container '{key}' (see berth ps)\n");
    for key in ["victims-named", theirs.id.as_str()] {
        for args in [
            vec!["exec", key, "--", "id"],
            vec!["exec", key, "--", "sh", "-c", "echo pwned > /tmp/pwned"],
            vec!["rm", key],
        ] {
            let o = berth_as(attacker(), &args);
            assert!(!o.status.success(), "{args:?} succeeded for the attacker");
            assert_eq!(
                stderr(&o),
                missing(key),
                "{args:?}: the attacker was not told 'no container' (stdout: {})",
                stdout(&o)
            );
            assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
        }
    }
    // The victim's container is untouched.
    let o = ok(
        berth(&["exec", &theirs.id, "--", "sh", "-c", "ls /tmp; echo up"])
            .output()
            .unwrap(),
    );
    assert!(o.ends_with("up\n") && !o.contains("pwned"), "{o}");
    assert!(!pid_before.trim().is_empty());
    assert!(ok(berth(&["ps"]).output().unwrap()).contains(&theirs.id));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_state_dir_another_user_could_change_is_refused() {
    let dir = workdir("state-dir");
    // A /tmp-like parent (root's, 1777) where the attacker made the state directory first, or a
    // symlink to a directory of hers; and a root-owned state directory in a parent anyone can
    // change (0777 without the sticky bit).
    let sticky = dir.join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    chmod(&sticky, 0o1777);
    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    std::fs::create_dir(open.join("state")).unwrap();
    let o = attacker_script(&format!(
        "mkdir -m 777 {s}/state {s}/hers && ln -s {s}/hers {s}/link",
        s = sticky.display()
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let base = std::fs::read_to_string(config()).unwrap();
    let configured = format!("state_dir = \"{}\"", state_dir().display());
    assert!(base.contains(&configured), "{base}");
    for (state, watched) in [
        (sticky.join("state"), sticky.join("state")),
        (sticky.join("link"), sticky.join("hers")),
        (open.join("state"), open.join("state")),
    ] {
        let cfg = dir.join("berth.toml");
        std::fs::write(
            &cfg,
            base.replace(&configured, &format!("state_dir = \"{}\"", state.display())),
        )
        .unwrap();
        let rootfs = rootfs().to_str().unwrap();
        let o = Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(["run", "--rootfs", rootfs, "--", "true"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = stderr(&o);
        assert!(
            !o.status.success(),
            "berth ran with the state directory {}",
            state.display()
        );
        assert_eq!(err.lines().count(), 1, "not one line: {err}");
        // It names the directory refused (the state directory, or the parent that others can change).
        assert!(err.contains(dir.to_str().unwrap()), "{err}");
        let left: Vec<_> = std::fs::read_dir(&watched)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(
            left.is_empty(),
            "root wrote into {}: {left:?}",
            watched.display()
        );
    }
}
