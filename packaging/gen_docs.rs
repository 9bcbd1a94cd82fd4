//! Writes berth's shell completions and man pages, generated from the command line itself so
//! they never drift from it: `cargo run --example gen-docs -- OUT_DIR` makes
//! `OUT_DIR/completions/{berth.bash,_berth,berth.fish}` and `OUT_DIR/man/berth*.1` (one page
//! for berth and one per verb and sub-verb, `berth-images-ls.1`, as git and podman do; an
//! alias's page, `berth-pull.1`, sources its verb's).
//! packaging/build.sh runs it and puts the files in the packages.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

fn main() {
    let Some(out) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("gen-docs: usage: gen-docs OUT_DIR");
        std::process::exit(2);
    };
    if let Err(e) = generate(&out) {
        eprintln!("gen-docs: writing into {}: {e}", out.display());
        std::process::exit(1);
    }
}

fn generate(out: &Path) -> std::io::Result<()> {
    let completions = out.join("completions");
    std::fs::create_dir_all(&completions)?;
    for (shell, name) in [
        (Shell::Bash, "berth.bash"),
        (Shell::Zsh, "_berth"),
        (Shell::Fish, "berth.fish"),
    ] {
        let mut file = std::fs::File::create(completions.join(name))?;
        clap_complete::generate(shell, &mut berth::cli::Cli::command(), "berth", &mut file);
    }
    let man = out.join("man");
    std::fs::create_dir_all(&man)?;
    let mut cmd = berth::cli::Cli::command();
    cmd.build();
    pages(&cmd, "berth", &man)
}

/// The page of `cmd` (named `name`) and, recursively, of each of its visible subcommands.
fn pages(cmd: &clap::Command, name: &str, dir: &Path) -> std::io::Result<()> {
    let mut page = Vec::new();
    // clap names commands with 'static strings; this runs once, so leaking them is fine.
    let title: &'static str = Box::leak(name.to_string().into_boxed_str());
    clap_mangen::Man::new(cmd.clone().name(title)).render(&mut page)?;
    std::fs::write(dir.join(format!("{name}.1")), page)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        pages(sub, &format!("{name}-{}", sub.get_name()), dir)?;
        // A visible alias (`berth pull` for `berth import`) gets a page that is the verb's, as
        // `man podman-pull` and `man git-...` find theirs.
        for alias in sub.get_visible_aliases() {
            std::fs::write(
                dir.join(format!("{name}-{alias}.1")),
                format!(".so man1/{name}-{}.1\n", sub.get_name()),
            )?;
        }
    }
    Ok(())
}
