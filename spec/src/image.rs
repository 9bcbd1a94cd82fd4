//! What an image's config contributes to a container: environment, command line, working
//! directory and user. Docker's and Pyxis's rules, as pure functions.

use std::path::PathBuf;

use oci_spec::image::ImageConfiguration;

/// The parts of an image config that shape a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageDefaults {
    pub env: Vec<(String, String)>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub workdir: Option<PathBuf>,
    /// `User` as the image wrote it: `name`, `uid`, `name:group` or `uid:gid`.
    pub user: Option<String>,
}

impl ImageDefaults {
    pub fn from_config(config: &ImageConfiguration) -> Self {
        let Some(c) = config.config() else {
            return Self::default();
        };
        let env = c
            .env()
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter_map(|e| e.split_once('='))
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self {
            env,
            entrypoint: c.entrypoint().clone().unwrap_or_default(),
            cmd: c.cmd().clone().unwrap_or_default(),
            workdir: c
                .working_dir()
                .as_deref()
                .filter(|w| w.starts_with('/'))
                .map(PathBuf::from),
            user: c.user().clone().filter(|u| !u.is_empty()),
        }
    }

    /// The command line: with no arguments, Entrypoint + Cmd; with arguments, the arguments,
    /// after the Entrypoint when `use_entrypoint` (Pyxis's `--container-entrypoint`).
    pub fn command_line(&self, args: &[String], use_entrypoint: bool) -> Vec<String> {
        match (args.is_empty(), use_entrypoint) {
            (true, _) => self.entrypoint.iter().chain(&self.cmd).cloned().collect(),
            (false, true) => self.entrypoint.iter().chain(args).cloned().collect(),
            (false, false) => args.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> ImageConfiguration {
        serde_json::from_str(json).unwrap()
    }

    fn defaults() -> ImageDefaults {
        ImageDefaults::from_config(&config(
            r#"{"architecture":"amd64","os":"linux",
                "config":{"Env":["PATH=/opt/bin:/bin","LANG=C.UTF-8","BAD"],
                          "Entrypoint":["/entry.sh"],"Cmd":["serve","--port","80"],
                          "WorkingDir":"/app","User":"1000:1000"},
                "rootfs":{"type":"layers","diff_ids":[]}}"#,
        ))
    }

    #[test]
    fn config_fields_are_taken() {
        let d = defaults();
        assert_eq!(
            d.env,
            vec![
                ("PATH".into(), "/opt/bin:/bin".into()),
                ("LANG".into(), "C.UTF-8".into())
            ]
        );
        assert_eq!(d.workdir, Some(PathBuf::from("/app")));
        assert_eq!(d.user.as_deref(), Some("1000:1000"));
    }

    #[test]
    fn command_line_rules() {
        let d = defaults();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            d.command_line(&[], false),
            s(&["/entry.sh", "serve", "--port", "80"])
        );
        assert_eq!(d.command_line(&s(&["ls"]), false), s(&["ls"]));
        assert_eq!(d.command_line(&s(&["ls"]), true), s(&["/entry.sh", "ls"]));
        assert!(ImageDefaults::default().command_line(&[], false).is_empty());
    }

    #[test]
    fn missing_config_means_no_defaults() {
        let c = config(
            r#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#,
        );
        assert_eq!(ImageDefaults::from_config(&c), ImageDefaults::default());
    }
}
