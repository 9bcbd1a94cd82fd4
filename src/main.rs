//! The `berth` binary: parse the command line, run the verb, map the result to an exit status.

fn main() {
    let cli = berth::cli::Cli::parse_args();
    berth::log::init(&cli);
    let code = match cli.execute() {
        Ok(code) => code,
        Err(failure) => {
            berth::log::failure(&failure.message);
            eprintln!("berth: {}", failure.message);
            failure.code
        }
    };
    std::process::exit(code);
}
