//! `berth-fuzz-replay TARGET FILE...`: runs a fuzz target once on each file, on stable Rust
//! without AFL (to replay a crash or hang that afl-fuzz saved, under a debugger or `timeout`).
//!
//! Its unit tests replay every file of `corpus/<target>/` (seeds, inputs kept from fuzzing,
//! regression inputs of fixed crashes) through its target: the unit tier's share of the
//! fuzzing (`cargo test --bins`). A panic fails the test and names the file.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((name, files)) = args.split_first() else {
        eprintln!("usage: berth-fuzz-replay TARGET FILE...");
        std::process::exit(2);
    };
    let Some(target) = berth_fuzz::target(name) else {
        let names: Vec<&str> = berth_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!(
            "berth-fuzz-replay: unknown target '{name}': use one of {}",
            names.join(", ")
        );
        std::process::exit(2);
    };
    for file in files {
        match std::fs::read(file) {
            Ok(data) => {
                target(&data);
                println!("{name}: {file}: ok");
            }
            Err(e) => {
                eprintln!("berth-fuzz-replay: cannot read {file}: {e}");
                std::process::exit(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    fn corpus_dir(target: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(target)
    }

    /// Runs `target` on each file of its corpus; fails on an empty or missing corpus.
    fn replay(name: &str) {
        let target = berth_fuzz::target(name).expect("a target of TARGETS");
        let dir = corpus_dir(name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
            .map(|e| e.expect("a corpus entry").path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "corpus {} is empty", dir.display());
        for file in &files {
            let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let run = std::panic::catch_unwind(|| target(&data));
            assert!(run.is_ok(), "target {name} panicked on {}", file.display());
        }
    }

    #[test]
    fn every_target_has_a_corpus_and_a_test() {
        // A target added to TARGETS without a corpus (or a test below) would never run in CI.
        let tests = include_str!("replay.rs");
        for (name, _) in berth_fuzz::TARGETS {
            assert!(corpus_dir(name).is_dir(), "no corpus for target {name}");
            assert!(
                tests.contains(&format!("=> \"{name}\",")),
                "no replay test for target {name}"
            );
        }
    }

    macro_rules! replay_tests {
        ($($test:ident => $name:literal,)*) => {
            $(#[test]
            fn $test() {
                replay($name);
            })*
        };
    }

    replay_tests! {
        reference => "reference",
        manifest => "manifest",
        image_config => "image_config",
        layer_tar => "layer_tar",
        sif => "sif",
        squashfs => "squashfs",
        netrc => "netrc",
        auth_challenge => "auth_challenge",
        auth_file => "auth_file",
        pyxis_mounts => "pyxis_mounts",
        stage_spec => "stage_spec",
        cdi => "cdi",
        spank_options => "spank_options",
        spank_plugstack => "spank_plugstack",
        spank_created => "spank_created",
        step_request => "step_request",
        berth_toml => "berth_toml",
        cli => "cli",
    }
}
