//! Resolves `--user NAME|UID[:GROUP|GID]` against the host's user database: the container runs
//! as a host identity, with that user's supplementary groups.

use std::ffi::CString;

use nix::unistd::{Gid, Group, Uid, User, getgrouplist};

use crate::{SysError, UserIds};

/// The invoking user (real uid/gid of this process) with the supplementary groups this process
/// holds: what the kernel grants the caller now, not what the group database lists (a group added
/// since the user logged in is not theirs yet). It also spares every `berth run` the group
/// database's walk of all its NSS modules (glibc loads `libnss_systemd` and libcap for it).
pub fn current() -> Result<UserIds, SysError> {
    let uid = Uid::current();
    let user = User::from_uid(uid).ok().flatten();
    let gid = Gid::current();
    let mut ids = with_groups(uid.as_raw(), gid.as_raw(), None);
    // getgroups fails only on a list longer than NGROUPS_MAX; then fewer groups, never more.
    let mut groups: Vec<u32> = nix::unistd::getgroups()
        .unwrap_or_default()
        .into_iter()
        .map(Gid::as_raw)
        .collect();
    if !groups.contains(&ids.gid) {
        groups.insert(0, ids.gid);
    }
    ids.groups = groups;
    if let Some(user) = user {
        ids.name = Some(user.name);
        ids.home = Some(user.dir);
    }
    Ok(ids)
}

/// The identity of a Slurm job: its uid and gid, with the user's groups when the user exists.
pub fn by_id(uid: u32, gid: u32) -> UserIds {
    let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
    with_groups(uid, gid, user)
}

/// Resolves a `--user` value. The user must exist on the host; the group may be a name or a
/// number, defaulting to the user's primary group.
pub fn resolve(spec: &str) -> Result<UserIds, SysError> {
    let (user_part, group_part) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let unknown = || SysError::UnknownUser(user_part.to_string());
    let user = match user_part.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)).ok().flatten(),
        Err(_) => User::from_name(user_part).ok().flatten(),
    }
    .ok_or_else(unknown)?;
    let gid = match group_part {
        None => user.gid.as_raw(),
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => Group::from_name(g)
                .ok()
                .flatten()
                .ok_or_else(|| SysError::UnknownGroup(g.to_string()))?
                .gid
                .as_raw(),
        },
    };
    Ok(with_groups(user.uid.as_raw(), gid, Some(user)))
}

fn with_groups(uid: u32, gid: u32, user: Option<User>) -> UserIds {
    let name = user.as_ref().map(|u| u.name.clone());
    let group_name = Group::from_gid(Gid::from_raw(gid))
        .ok()
        .flatten()
        .map(|g| g.name);
    let (groups, home) = match user {
        Some(user) => {
            let groups = CString::new(user.name.as_bytes())
                .ok()
                .and_then(|name| getgrouplist(&name, Gid::from_raw(gid)).ok())
                .map(|g| g.into_iter().map(Gid::as_raw).collect())
                .unwrap_or_else(|| vec![gid]);
            (groups, Some(user.dir))
        }
        None => (vec![gid], None),
    };
    UserIds {
        uid,
        gid,
        groups,
        home,
        name,
        group_name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_resolves_by_name_and_number() {
        let by_name = resolve("root").unwrap();
        assert_eq!((by_name.uid, by_name.gid), (0, 0));
        assert!(by_name.groups.contains(&0));
        assert_eq!(resolve("0").unwrap().uid, 0);
        assert_eq!(resolve("0:5").unwrap().gid, 5);
    }

    #[test]
    fn the_invoking_user_has_the_groups_this_process_holds() {
        let me = current().unwrap();
        assert_eq!(
            (me.uid, me.gid),
            (Uid::current().as_raw(), Gid::current().as_raw())
        );
        let mut held: Vec<u32> = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(Gid::as_raw)
            .collect();
        held.push(me.gid);
        held.sort_unstable();
        held.dedup();
        let mut got = me.groups.clone();
        got.sort_unstable();
        assert_eq!(got, held);
    }

    #[test]
    fn unknown_users_and_groups_are_errors() {
        let err = resolve("no-such-user-berth").unwrap_err().to_string();
        assert!(err.contains("no-such-user-berth"), "{err}");
        resolve("4000000000").unwrap_err();
        resolve("root:no-such-group-berth").unwrap_err();
    }
}
