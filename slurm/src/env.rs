//! The environment of a containerized task, by Pyxis's rule: the job's environment overlaid by
//! the image's, except for the variables the user named in `--container-env`, which keep the
//! job's value.

/// Merges `job` and `image` (both `KEY=VALUE` pairs in order) into the task's environment.
pub fn merge(
    job: &[(String, String)],
    image: &[(String, String)],
    keep_from_job: &[String],
) -> Vec<(String, String)> {
    // Linear (a map per lookup, not a scan): an image with 100k variables took minutes.
    let mut out = berth_spec::env::EnvBuilder::with_capacity(job.len() + image.len());
    for (k, v) in job {
        out.set(k, v);
    }
    let in_job: std::collections::HashSet<&str> = job.iter().map(|(k, _)| k.as_str()).collect();
    let keep: std::collections::HashSet<&str> = keep_from_job.iter().map(String::as_str).collect();
    for (k, v) in image {
        if !keep.contains(k.as_str()) || !in_job.contains(k.as_str()) {
            out.set(k, v);
        }
    }
    out.into_pairs()
}

/// The locale variables of the submitting shell, which Pyxis leaves out of the container unless
/// `--container-env` names them: the image rarely has that locale, and perl, python and others
/// then warn "Setting locale failed" on every start.
pub const LOCALE_VARS: [&str; 3] = ["LANG", "LANGUAGE", "LC_ALL"];

/// The job's `KEY=VALUE` pairs the container gets: all but [`LOCALE_VARS`] not in `keep`.
pub fn job_pairs(list: &[String], keep: &[String]) -> Vec<(String, String)> {
    pairs(list)
        .into_iter()
        .filter(|(k, _)| !LOCALE_VARS.contains(&k.as_str()) || keep.iter().any(|n| n == k))
        .collect()
}

/// Splits `KEY=VALUE` strings, dropping malformed ones.
pub fn pairs(list: &[String]) -> Vec<(String, String)> {
    list.iter()
        .filter_map(|e| e.split_once('='))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(list: &[&str]) -> Vec<(String, String)> {
        pairs(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn image_wins_unless_named() {
        let job = p(&[
            "PATH=/host/bin",
            "SLURM_JOB_ID=7",
            "LANG=en_US",
            "PMIX_RANK=0",
        ]);
        let image = p(&["PATH=/usr/bin", "LANG=C.UTF-8", "CUDA_HOME=/usr/local/cuda"]);
        let merged = merge(&job, &image, &["LANG".to_string()]);
        assert_eq!(
            merged,
            p(&[
                "PATH=/usr/bin",
                "SLURM_JOB_ID=7",
                "LANG=en_US",
                "PMIX_RANK=0",
                "CUDA_HOME=/usr/local/cuda"
            ])
        );
    }

    #[test]
    fn a_named_variable_missing_from_the_job_comes_from_the_image() {
        let merged = merge(&[], &p(&["A=1"]), &["A".to_string()]);
        assert_eq!(merged, p(&["A=1"]));
    }

    #[test]
    fn the_submitting_shells_locale_stays_out_unless_named() {
        let job: Vec<String> = [
            "LANG=de_DE.UTF-8",
            "LC_ALL=de_DE.UTF-8",
            "LANGUAGE=de",
            "LC_TIME=C",
            "A=1",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(job_pairs(&job, &[]), p(&["LC_TIME=C", "A=1"]));
        assert_eq!(
            job_pairs(&job, &["LANG".to_string()]),
            p(&["LANG=de_DE.UTF-8", "LC_TIME=C", "A=1"])
        );
        // The image's own value stays.
        let merged = merge(&job_pairs(&job, &[]), &p(&["LANG=C.UTF-8"]), &[]);
        assert!(merged.contains(&("LANG".into(), "C.UTF-8".into())));
        assert!(!merged.iter().any(|(k, _)| k == "LC_ALL"));
    }

    #[test]
    fn malformed_entries_are_dropped() {
        assert_eq!(p(&["novalue", "=x", "K=v=w"]), p(&["K=v=w"]));
    }
}
