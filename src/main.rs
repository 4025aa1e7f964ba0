//! vk-cocoon entry point: parse the command line, run the daemon or a tool mode.
//! Exit codes: 0 clean stop, 1 runtime failure, 2 configuration error.

use std::path::Path;

use vk_cocoon::config::{self, Config};
use vk_cocoon::{daemon, logging, sandbox, version};

const HELP: &str = "\
vk-cocoon: a virtual kubelet that turns Kubernetes pods into cocoon MicroVMs.

Usage:
  vk-cocoon [run]              run the daemon (the default)
  vk-cocoon sandbox [ARGS]     run the embedded sandbox (fake API server and fake cocoon)
  vk-cocoon fake-cocoon ARGS   behave as the fake `cocoon` CLI (also when invoked as `cocoon`)
  vk-cocoon --version          print version, git revision and build time
  vk-cocoon --help             print this help

The daemon is configured only through environment variables (OCI_REGISTRY is required);
see the configuration table in README.md or packaging/vk-cocoon.env.example.

Exit status: 0 clean stop, 1 runtime failure (and `log setup: ...`), 2 configuration error.
";

fn main() {
    std::process::exit(real_main());
}

fn real_main() -> i32 {
    // Arguments that are not UTF-8 are passed on lossily rather than panicking.
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let argv0 = args.first().map(String::as_str).unwrap_or("vk-cocoon");
    if Path::new(argv0).file_name().is_some_and(|n| n == "cocoon") {
        return sandbox::fake_cocoon::main_as_cocoon(Path::new(argv0), args[1..].to_vec());
    }
    match args.get(1).map(String::as_str) {
        None | Some("run") => run_daemon(),
        Some("-h" | "--help" | "help") => {
            print!("{HELP}");
            0
        }
        Some("-V" | "--version" | "version") => {
            println!("{}", version::long_version());
            0
        }
        Some("fake-cocoon") => sandbox::fake_cocoon::main(args[2..].to_vec()),
        Some("sandbox") => sandbox::run_sandbox(args[2..].to_vec()),
        Some(other) => {
            eprintln!("vk-cocoon: unknown command {other:?}; see vk-cocoon --help");
            2
        }
    }
}

fn run_daemon() -> i32 {
    let level = std::env::var("VK_LOG_LEVEL").ok();
    if let Err(e) = logging::init(level.as_deref()) {
        eprintln!("log setup: {e}");
        return 1;
    }
    log::info!(
        "vk-cocoon {} starting (rev={} built={})",
        version::VERSION,
        version::GIT_REVISION,
        version::build_time()
    );
    let config = match Config::from_process_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vk-cocoon: configuration error: {e}");
            return 2;
        }
    };
    for w in &config.warnings {
        log::warn!("{w}");
    }
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    for name in config::unknown_vk_variables(names.iter().map(String::as_str)) {
        log::warn!("unknown variable {name} is ignored (see the configuration table in README.md)");
    }
    daemon::run(config)
}
