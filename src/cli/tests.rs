//! The command line's parsing: positional images, aliases, values refused in one line, which
//! verbs need root.

use super::*;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    let mut cli = Cli::try_parse_from(std::iter::once("berth").chain(args.iter().copied()))?;
    match &mut cli.command {
        Command::Run(a) => a.take_positional_image(),
        Command::Create(a) => a.take_positional_image(),
        _ => {}
    }
    Ok(cli)
}

fn run_args(args: &[&str]) -> run::RunArgs {
    match parse(args).unwrap().command {
        Command::Run(a) => *a,
        other => panic!("{other:?}"),
    }
}

#[test]
fn run_takes_the_first_positional_as_image_only_without_image_or_rootfs() {
    let a = run_args(&["run", "ubuntu:24.04", "ls", "-l", "--memory", "1G"]);
    assert_eq!(a.container.image.as_deref(), Some("ubuntu:24.04"));
    assert_eq!(a.command, ["ls", "-l", "--memory", "1G"]);
    assert_eq!(a.container.memory, None);
    let a = run_args(&["run", "--memory", "1G", "--", "ubuntu", "true"]);
    assert_eq!(a.container.image.as_deref(), Some("ubuntu"));
    assert_eq!(a.command, ["true"]);
    // With --image or --rootfs every positional is the command, `--` or not.
    for args in [
        &["run", "--image", "ubuntu", "--", "echo", "hi"][..],
        &["run", "--image", "ubuntu", "echo", "hi"][..],
    ] {
        let a = run_args(args);
        assert_eq!(a.container.image.as_deref(), Some("ubuntu"));
        assert_eq!(a.command, ["echo", "hi"]);
    }
    let a = run_args(&["run", "--rootfs", "/r", "--", "echo", "-n", "hi"]);
    assert_eq!((a.container.image, a.command.len()), (None, 3));
    let a = run_args(&["run", "--rootfs", "/r", "echo", "-n", "hi"]);
    assert_eq!(a.command, ["echo", "-n", "hi"]);
    // An image alone: its Entrypoint + Cmd.
    let a = run_args(&["run", "--entrypoint", "--arch", "arm64", "ubuntu"]);
    assert_eq!(a.container.image.as_deref(), Some("ubuntu"));
    assert!(a.command.is_empty() && a.container.entrypoint);
    parse(&["run", "--rootfs", "/r", "--image", "x", "--", "true"]).unwrap_err();
    let Command::Create(c) = parse(&["create", "--name", "n", "ubuntu"]).unwrap().command else {
        panic!()
    };
    assert_eq!(c.container.image.as_deref(), Some("ubuntu"));
    parse(&["create", "--image", "a", "b"]).unwrap_err();
}

#[test]
fn pull_is_import() {
    let Command::Import(a) = parse(&["pull", "--arch", "arm64", "busybox"])
        .unwrap()
        .command
    else {
        panic!("pull is not import")
    };
    assert_eq!(
        (a.reference.as_str(), a.arch.as_deref()),
        ("busybox", Some("arm64"))
    );
}

#[test]
fn the_parser_refuses_bad_values_in_one_line() {
    use clap::error::ErrorKind;
    for (args, line) in [
        (
            &["run", "--memory", "5Q", "img"][..],
            "--memory: invalid size '5Q'",
        ),
        (
            &["run", "--memory-swap", "0", "img"][..],
            "--memory-swap: invalid size",
        ),
        (
            &["run", "--cpus=-1", "img"][..],
            "--cpus: invalid CPU count",
        ),
        (
            &["run", "--cpus", "0.0001", "img"][..],
            "--cpus: invalid CPU count",
        ),
        (
            &["run", "--cpuset", "3-1", "img"][..],
            "--cpuset: invalid CPU list",
        ),
        (&["run", "--pids", "-5", "img"][..], "--pids "),
        (
            &["cdi", "generate", "--stdout", "--gpu-kind", "gpu"][..],
            "--gpu-kind: CDI kind 'gpu': use vendor.com/class",
        ),
        (&["run", "--pids", "x", "img"][..], "--pids "),
        (
            &["run", "--timeout", "0", "img"][..],
            "--timeout 0: use a positive number of seconds",
        ),
        (
            &["run", "--mount", "rel:/x", "img"][..],
            "--mount: invalid mount",
        ),
        (
            &["run", "--mount", "/a:/", "img"][..],
            "--mount: invalid mount",
        ),
        (
            &["run", "--env", "=v", "img"][..],
            "--env: invalid environment variable",
        ),
        (
            &["run", "--hostname", "a b", "img"][..],
            "--hostname: invalid hostname",
        ),
        (
            &["run", "--workdir", "rel", "img"][..],
            "--workdir rel: must be an absolute",
        ),
        (&["run", "--gpus", "3-1", "img"][..], "--gpus"),
        (
            &["run", "--device", "/etc/passwd", "img"][..],
            "--device /etc/passwd: must be a device node",
        ),
        (
            &["create", "--memory", "1X", "--rootfs", "/"][..],
            "--memory: invalid size",
        ),
        (
            &["images", "gc", "--max-size", "lots"][..],
            "--max-size: invalid size",
        ),
        (
            &["images", "gc", "--unused-for", "7y"][..],
            "--unused-for: invalid duration",
        ),
        (
            &["topo", "plan", "--cpus", "x"][..],
            "--cpus: invalid CPU list",
        ),
        (&["topo", "plan", "--gpus", "all"][..], "--gpus"),
        (&["stage", "in", "--workers=-1", "a"][..], "--workers"),
        (&["health", "--expect-gpus", "many"][..], "--expect-gpus"),
        (
            &["run", "-e", "A\nB=1", "img"][..],
            "--env 'A\\nB=1': has a control character",
        ),
        (
            &["run", "-e", "A\u{1b}[2J", "img"][..],
            "--env 'A\\u{1b}[2J': has a control character",
        ),
        (
            &["exec", "-e", "A\rB=1", "c", "--", "true"][..],
            "--env 'A\\rB=1': has a control character",
        ),
        (
            &["create", "--name", "x\nforged", "--rootfs", "/"][..],
            "--name 'x\\nforged': has a control character (\\u{a}) at byte 1",
        ),
        (
            &["create", "--name", "", "--rootfs", "/"][..],
            "--name: give a name",
        ),
    ] {
        let e = parse(args).expect_err(&format!("{args:?} was accepted"));
        assert_eq!(e.kind(), ErrorKind::ValueValidation, "{args:?}");
        assert_eq!(e.exit_code(), 2);
        let text = value_error_line(&e);
        assert!(text.starts_with(line), "{args:?}: {text}");
        assert!(!text.contains('\n'), "{args:?}: {text}");
    }
    let long = format!("{}Q", "9".repeat(100_000));
    let e = parse(&["run", "--memory", &long, "img"]).unwrap_err();
    assert!(elide_words(&value_error_line(&e)).len() < 300);
    // What the parsers accept, the verbs get unchanged.
    let a = run_args(&[
        "run",
        "--memory",
        "512M",
        "--memory-swap",
        "1g",
        "--cpus",
        "0.5",
        "--cpuset",
        "0-3,8",
        "--pids",
        "64",
        "--timeout",
        "1.5",
        "--mount",
        "/a:/b:ro",
        "-e",
        "K=V",
        "-e",
        "HOME",
        "--hostname",
        "h.x",
        "--gpus",
        "0,2",
        "--device",
        "/dev/null",
        "--device",
        "nvidia.com/gpu=0",
        "img",
    ]);
    // Parsed once, by clap: the verb gets the values, not the text to check again.
    assert_eq!(a.container.memory, Some(512 << 20));
    assert_eq!(a.container.cpus, Some(50_000));
    assert_eq!(a.container.cpuset.as_deref(), Some("0-3,8"));
    assert_eq!(a.container.pids, Some(64));
    assert_eq!(a.timeout, Some(std::time::Duration::from_millis(1500)));
    assert_eq!(a.container.env, ["K=V", "HOME"]);
    // A value may hold newlines (a certificate, an exported shell function); a name may hold
    // any printable character.
    let cert = run_args(&["run", "-e", "CERT=-----BEGIN\nabc\n-----END", "img"]);
    assert_eq!(cert.container.env, ["CERT=-----BEGIN\nabc\n-----END"]);
    let Command::Create(c) = parse(&["create", "--name", "my box-ü", "--rootfs", "/"])
        .unwrap()
        .command
    else {
        panic!("not create")
    };
    assert_eq!(c.name.as_deref(), Some("my box-ü"));
    assert_eq!(a.container.devices.len(), 2);
    for gpus in [
        "all",
        "none",
        "GPU-8f6c0b2e-0000-0000-0000-000000000000",
        "0000:3b:00.0",
    ] {
        run_args(&["run", "--gpus", gpus, "img"]);
    }
}

#[test]
fn verbs_that_need_root_say_so_and_others_do_not() {
    let refused = |args: &[&str]| needs_root(&parse(args).unwrap().command, 1000);
    for (args, verb) in [
        (&["run", "img", "true"][..], "run needs root"),
        (&["create", "--rootfs", "/"][..], "create needs root"),
        (&["gc"][..], "gc needs root"),
        (&["import", "busybox"][..], "import needs root"),
        (&["images", "ls"][..], "images ls needs root"),
        (&["images", "gc"][..], "images gc needs root"),
        (
            &["export", "c1", "-o", "/tmp/x.sqsh"][..],
            "export needs root",
        ),
        (&["health", "--job-end"][..], "health --job-end needs root"),
        (&["cdi", "generate"][..], "cdi generate needs root"),
        (
            &[
                "lazy",
                "serve",
                "--index",
                "ab",
                "--uid",
                "1000",
                "docker://r/a:1",
            ][..],
            "lazy serve needs root",
        ),
    ] {
        let line = refused(args).unwrap_or_else(|| panic!("{args:?} allowed"));
        assert!(line.starts_with(verb), "{line}");
        assert!(line.contains("uid 1000") && !line.contains('\n'), "{line}");
        assert!(needs_root(&parse(args).unwrap().command, 0).is_none());
    }
    for args in [
        &["ps"][..],
        &["ps", "--json"][..],
        &["topo"][..],
        &["health", "--all-xids"][..],
        &["cdi", "list"][..],
        &["cdi", "generate", "--stdout"][..],
        &["cdi", "generate", "--dir", "/home/u/cdi"][..],
        &["stage", "status", "/tmp"][..],
        &["export", "--rootfs", "/r", "-o", "/tmp/x.sqsh"][..],
        &["export", "/home/u/x.sqsh", "-o", "/tmp/y.sif"][..],
        &[
            "lazy",
            "publish",
            "/home/u/x.sqsh",
            "docker://r.example/a:1",
        ][..],
    ] {
        assert_eq!(refused(args), None, "{args:?}");
    }
}

#[test]
fn gc_and_images_gc_say_which_cleans_what() {
    use clap::CommandFactory;
    let mut cli = Cli::command();
    let gc = cli.find_subcommand_mut("gc").unwrap();
    let about = gc.get_about().unwrap().to_string();
    let long = gc.render_long_help().to_string();
    let long = long.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        about.contains("containers") && about.contains("scratch"),
        "{about}"
    );
    assert!(long.contains("never removes an image") && long.contains("berth images gc"));
    let images = cli.find_subcommand_mut("images").unwrap();
    let igc = images.find_subcommand_mut("gc").unwrap();
    let about = igc.get_about().unwrap().to_string();
    assert!(about.starts_with("Clean the image store"), "{about}");
    assert!(about.contains("`berth gc`'s"), "{about}");
}

#[test]
fn version_names_the_commit() {
    let e = parse(&["--version"]).unwrap_err();
    let text = e.render().to_string();
    assert!(text.starts_with(&format!("berth {} (commit ", env!("CARGO_PKG_VERSION"))));
    assert_eq!(text.trim_end(), format!("berth {VERSION}"));
}

#[test]
fn elide_keeps_short_values_and_cuts_long_ones() {
    assert_eq!(elide("/tmp:/"), "/tmp:/");
    let long = "é".repeat(50_000);
    let e = elide(&long);
    assert!(e.len() < 250, "{e}");
    assert!(e.contains("bytes]"));
    let ascii = "a".repeat(1000) + "END";
    assert!(elide(&ascii).ends_with("END"));
    let line = format!(
        "error: invalid value '{}' for '--net'\n",
        "x".repeat(100_000)
    );
    let short = elide_words(&line);
    assert!(short.len() < 250 && short.ends_with("'--net'\n"), "{short}");
}
