//! vk-cocoon entry point: parse the command line, run the daemon or a tool mode.
//! Exit codes: 0 clean stop, 1 runtime failure, 2 configuration error.

use vk_cocoon::config::{self, Config};
use vk_cocoon::{daemon, logging, version};

const HELP: &str = "\
vk-cocoon: a virtual kubelet that turns Kubernetes pods into cocoon MicroVMs.

Usage:
  vk-cocoon [run]              run the daemon (the default)
  vk-cocoon --version          print version, git revision and build time
  vk-cocoon --help             print this help

The daemon is configured only through environment variables (OCI_REGISTRY is required);
see the configuration table in README.md or packaging/vk-cocoon.env.example.
The sandbox and the fake cocoon are a separate binary, vk-cocoon-sandbox.

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
