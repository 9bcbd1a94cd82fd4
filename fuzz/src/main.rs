//! `berth-fuzz TARGET`: runs one fuzz target of the library under AFL++ (built with
//! `cargo afl build -p berth-fuzz --features afl`, run by bench/fuzz/run.sh). Outside afl-fuzz
//! it runs the target once on stdin, which replays a crash: `berth-fuzz TARGET < FILE`.

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(target) = berth_fuzz::target(&name) else {
        let names: Vec<&str> = berth_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!(
            "berth-fuzz: unknown target '{name}': use one of {}",
            names.join(", ")
        );
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| {
        target(data);
    });
}
