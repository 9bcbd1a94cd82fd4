//! The `berth` binary: parse the command line, run the verb, map the result to an exit status.

use clap::Parser;

fn main() {
    let cli = berth::cli::Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BERTH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .init();
    let code = match cli.execute() {
        Ok(code) => code,
        Err(failure) => {
            eprintln!("berth: {}", failure.message);
            failure.code
        }
    };
    std::process::exit(code);
}
