//! The `berth` binary: parse the command line, run the verb, map the result to an exit status.

fn main() {
    let cli = berth::cli::Cli::parse_args();
    // berth.toml is read once: logging takes its [log] (the defaults when it cannot be read;
    // the verb then reports why), the verb the rest.
    let config = cli.load_config();
    berth::log::init(cli.log_setup(config.as_ref().ok()));
    let code = match cli.execute(config) {
        Ok(code) => code,
        Err(failure) => {
            // The last guard: whatever a user, an image or a server put into the message, it is
            // one line of bounded size on stderr (srun, slurmd's log) and in syslog.
            let line = berth_sys::text::one_line(&failure.message);
            berth::log::failure(&line);
            eprintln!("berth: {line}");
            failure.code
        }
    };
    std::process::exit(code);
}
