//! Which user namespace and idmapping a container's Spec asks for; the namespace mechanics are
//! [`berth_sys::userns`], shared with the image export.

pub use berth_sys::userns::*;

/// The job user (uid, gid) whose own the image's root files become in a writable container
/// without a user namespace: the image layers are idmapped with [`layer_map`] of the process's
/// uid and gid, and the overlay's root directory is given to the user, so `touch /newfile` and a
/// `pip install` into the image's system paths work as the user, as under Enroot (whose
/// unpacked root belongs to the user). `None` for a remapped container (its own idmapping), a
/// container run as root, and a read-only one.
///
/// Nothing of the host changes hands: only the image's files appear as the user's, writes land
/// in the container's private tmpfs upper layer, host binds (`--container-mounts`, home, /dev,
/// /proc, /sys) are never idmapped, and the user still runs without capabilities under
/// no_new_privs on a nosuid,nodev overlay (an image's setuid-root binary becomes setuid-user, and
/// is ignored anyway).
///
/// Read-only containers keep the image's owners. Enroot shows every file of an unpacked image as
/// the user's there too, but nothing can be written in them, so the idmap would only widen what
/// a user reads (an image's root-only files: /root, /etc/shadow) and make every container need
/// idmapped mounts, for no gain: a read-only container's root files stay root's (nobody's in its
/// user namespace, which maps the user alone).
pub fn user_layer_ids(spec: &oci_spec::runtime::Spec) -> Option<(u32, u32)> {
    use oci_spec::runtime::LinuxNamespaceType;
    if spec.root().as_ref().and_then(|r| r.readonly()) == Some(true) {
        return None;
    }
    let remapped = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_deref())
        .unwrap_or_default()
        .iter()
        .any(|n| n.typ() == LinuxNamespaceType::User);
    let user = spec.process().as_ref()?.user();
    (!remapped && user.uid() != 0).then(|| (user.uid(), user.gid()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_users_writable_container_without_a_user_namespace_is_idmapped() {
        use oci_spec::runtime::*;
        let spec = |uid: u32, readonly: bool, userns: bool| {
            let user = UserBuilder::default()
                .uid(uid)
                .gid(2000u32)
                .build()
                .unwrap();
            let process = ProcessBuilder::default().user(user).build().unwrap();
            let root = RootBuilder::default().readonly(readonly).build().unwrap();
            let mut namespaces = vec![
                LinuxNamespaceBuilder::default()
                    .typ(LinuxNamespaceType::Mount)
                    .build()
                    .unwrap(),
            ];
            if userns {
                namespaces.push(
                    LinuxNamespaceBuilder::default()
                        .typ(LinuxNamespaceType::User)
                        .build()
                        .unwrap(),
                );
            }
            let linux = LinuxBuilder::default()
                .namespaces(namespaces)
                .build()
                .unwrap();
            SpecBuilder::default()
                .process(process)
                .root(root)
                .linux(linux)
                .build()
                .unwrap()
        };
        assert_eq!(
            user_layer_ids(&spec(1000, false, false)),
            Some((1000, 2000))
        );
        assert_eq!(user_layer_ids(&spec(1000, true, false)), None);
        assert_eq!(user_layer_ids(&spec(1000, false, true)), None);
        assert_eq!(user_layer_ids(&spec(0, false, false)), None);
    }
}
