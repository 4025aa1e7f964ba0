//! vk-cocoon entry point: parse the command line, run the daemon or a tool mode.
//! Exit codes: 0 clean stop, 1 runtime failure, 2 configuration error.

use vk_cocoon::config::{self, Config};
use vk_cocoon::{daemon, logging, version};

const HELP: &str = "\
vk-cocoon: a virtual kubelet that turns Kubernetes pods into cocoon MicroVMs.

Usage:
  vk-cocoon [run]              run the daemon (the default)
  vk-cocoon check-config       validate the environment and the kubeconfig, print every problem
  vk-cocoon env                list every environment variable with its default and meaning
  vk-cocoon vnc-password VM    print the VNC password of macOS guest VM (an operator's tool)
  vk-cocoon --version          print version, git revision and build time
  vk-cocoon COMMAND --help     help for one command, without running it

The daemon is configured only through environment variables (OCI_REGISTRY is required; under
systemd, /etc/cocoon/vk-cocoon.env). The sandbox and the fake cocoon are a separate binary,
vk-cocoon-sandbox.

Exit status: 0 clean stop, 1 runtime failure, 2 configuration error.
";

const RUN_HELP: &str = "\
Usage: vk-cocoon [run]

Runs the daemon in the foreground until SIGTERM or SIGINT (the VMs keep running and are
re-adopted at the next start). Configuration comes from the environment only; every invalid
variable is reported at once, at error priority, and the exit status is then 2.
`vk-cocoon env` lists the variables; `vk-cocoon check-config` checks them without starting.
";

const CHECK_HELP: &str = "\
Usage: vk-cocoon check-config [--online]

Shows what the daemon would do with this environment: every setting with its resolved value and
where it came from (env, default, auto-detected, kubeconfig), then one PASS / WARN / FAIL line
per check: every variable (VK_LOG_LEVEL included), the kubeconfig, the kubelet API's TLS files,
the serving certificate's SANs against the node name and IP, the expiry of the serving and the
kubeconfig client certificates (WARN under 30 days, FAIL expired or not yet valid), risky
combinations and placeholder values. Contacts nothing.
  --online   also ask the API server, with one SelfSubjectAccessReview each, whether this
             identity may do every verb on every resource of packaging/rbac.yaml, and ping
             the registry (GET /v2/ with the configured credentials)
Exit status: 0 all good, 2 the configuration fails (the daemon would not start or would break),
1 only an online check failed.
";

const ENV_HELP: &str = "\
Usage: vk-cocoon env

Prints every environment variable the daemon reads, its default and its meaning.
";

const VNC_HELP: &str = "\
Usage: vk-cocoon vnc-password VM-NAME

Prints the VNC password of the macOS guest named VM-NAME (its vm.cocoonstack.io/name), derived
from COCOON_MACOS_VNC_PASSWORD as the daemon derives it, so that an operator can hand a tenant
the password of their own guest and of no other. Run it with the daemon's environment:
  (set -a; . /etc/cocoon/vk-cocoon.env; vk-cocoon vnc-password vk-team-mac-0)
Exit status: 0 printed, 2 COCOON_MACOS_VNC_PASSWORD unset or invalid, or not a VM name.
";

fn main() {
    std::process::exit(real_main());
}

fn real_main() -> i32 {
    // Arguments that are not UTF-8 are passed on lossily rather than panicking.
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let command = args.get(1).map(String::as_str);
    let wants_help = args
        .get(2..)
        .unwrap_or_default()
        .iter()
        .any(|a| matches!(a.as_str(), "-h" | "--help"));
    if command == Some("vnc-password") {
        return match (wants_help, args.get(2..).unwrap_or_default()) {
            (true, _) => print_help(VNC_HELP),
            (false, [vm]) => vnc_password(vm),
            (false, _) => {
                eprintln!(
                    "vk-cocoon: vnc-password takes one VM name; see vk-cocoon vnc-password --help"
                );
                2
            }
        };
    }
    let known = matches!(command, None | Some("run" | "check-config" | "env"));
    let online =
        command == Some("check-config") && args.get(2).map(String::as_str) == Some("--online");
    let extra_at = if online { 3 } else { 2 };
    if let Some(extra) = args.get(extra_at).filter(|_| known && !wants_help) {
        eprintln!("vk-cocoon: unexpected argument {extra:?}; see vk-cocoon --help");
        return 2;
    }
    match (command, wants_help) {
        (None | Some("run"), false) => run_daemon(),
        (Some("run"), true) => print_help(RUN_HELP),
        (Some("check-config"), false) => vk_cocoon::check::run(online),
        (Some("check-config"), true) => print_help(CHECK_HELP),
        (Some("env"), false) => print_variables(),
        (Some("env"), true) => print_help(ENV_HELP),
        (None | Some("-h" | "--help" | "help"), _) => print_help(HELP),
        (Some("-V" | "--version" | "version"), _) => {
            println!("{}", version::long_version());
            0
        }
        (Some(other), _) => {
            eprintln!("vk-cocoon: unknown command {other:?}; see vk-cocoon --help");
            2
        }
    }
}

fn print_help(text: &str) -> i32 {
    print!("{text}");
    0
}

/// `vk-cocoon vnc-password VM`: the guest's password from the configured secret.
fn vnc_password(vm: &str) -> i32 {
    let Some(secret) = std::env::var("COCOON_MACOS_VNC_PASSWORD")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        eprintln!("vk-cocoon: COCOON_MACOS_VNC_PASSWORD is not set: macOS guests have no VNC");
        return 2;
    };
    if let Err(e) = config::macos_vnc_secret_ok(&secret) {
        eprintln!("vk-cocoon: {e}");
        return 2;
    }
    if let Err(e) = vk_cocoon::vm::argv::check_vm_ref(vm) {
        eprintln!("vk-cocoon: {e}");
        return 2;
    }
    println!("{}", vk_cocoon::guest::macos::vnc_password(&secret, vm));
    0
}

fn print_variables() -> i32 {
    for v in config::VARIABLES {
        println!(
            "{}\n    default: {}\n    {}\n",
            v.name, v.default, v.meaning
        );
    }
    0
}

/// VK_LOG_LEVEL and every other variable: the configuration, or every problem with it.
fn read_config() -> Result<Config, Vec<String>> {
    vk_cocoon::check::read_config(&|name| std::env::var(name).ok())
}

/// Installs the logger at VK_LOG_LEVEL, or at the default level when that value is itself
/// invalid (it is then reported with the other configuration errors).
fn init_logging() -> Result<(), i32> {
    let level = std::env::var("VK_LOG_LEVEL").ok();
    let usable = level.as_deref().filter(|l| logging::parse_level(l).is_ok());
    logging::init(usable).map(drop).map_err(|e| {
        eprintln!("log setup: {e}");
        1
    })
}

fn run_daemon() -> i32 {
    if let Err(code) = init_logging() {
        return code;
    }
    log::info!(
        "vk-cocoon {} starting (rev={} built={})",
        version::VERSION,
        version::GIT_REVISION,
        version::build_time()
    );
    let config = match read_config() {
        Ok(c) => c,
        Err(problems) => {
            for p in &problems {
                report_error(&format!("configuration error: {p}"));
            }
            log::info!("vk-cocoon check-config lists the same problems; vk-cocoon env lists every variable");
            return 2;
        }
    };
    for w in &config.warnings {
        log::warn!("{w}");
    }
    for name in unknown_variables() {
        log::warn!("unknown variable {name} is ignored (vk-cocoon env lists the known ones)");
    }
    // The VNC secret stays in the daemon: no child (cocoon, hypervisors, exec sessions)
    // inherits it. Still one thread here, so changing the environment races with nothing.
    std::env::remove_var("COCOON_MACOS_VNC_PASSWORD");
    daemon::run(config)
}

/// A fatal error line: through the logger (error priority under journald), or straight to
/// stderr when VK_LOG_LEVEL=off would swallow the reason the daemon exits.
fn report_error(message: &str) {
    if log::log_enabled!(log::Level::Error) {
        log::error!("{message}");
    } else {
        let priority = if std::env::var_os("JOURNAL_STREAM").is_some() {
            "<3>"
        } else {
            ""
        };
        eprintln!("{priority}vk-cocoon: {message}");
    }
}

fn unknown_variables() -> Vec<String> {
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    config::unknown_vk_variables(names.iter().map(String::as_str))
}
