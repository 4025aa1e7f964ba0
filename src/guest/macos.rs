//! The `cocoon-macos` CLI contract (`VK_COCOON_MACOS_BIN`), the one place that spells it: the
//! argv of every command run for managed macOS guests, its inspect JSON, and the VNC port rules.
//!
//! macOS guests are QEMU/KVM VMs of a separate binary. Its VMs are named by the pod's VM name,
//! get the ID `qemu-<name>` and the hypervisor tag `qemu`, and never appear in `cocoon vm list`
//! or cocoon's event stream. The VNC password never enters the core or any command line: the
//! core asks for a display, and the daemon gives the child that VM's own password (derived from
//! `COCOON_MACOS_VNC_PASSWORD` and the VM name) in its environment, which `/proc/<pid>/environ`
//! shows only to the same user and root, unlike `/proc/<pid>/cmdline`.

use std::time::Duration;

use serde::Deserialize;

use crate::vm::{Answer, ErrorKind};

/// The first VNC port (display 0); displays 0–99 map onto 5900–5999.
pub const VNC_FIRST_PORT: u16 = 5900;
pub const VNC_LAST_PORT: u16 = 5999;
/// The hypervisor tag of macOS VMs.
pub const HYPERVISOR: &str = "qemu";
/// vCPUs when the pod asks for none (QEMU's macOS guests want an even count).
pub const DEFAULT_CPUS: u64 = 4;
pub const DEFAULT_MEMORY_MIB: u64 = 8192;
/// `vm run`, `vm start` and `image pull` launch or fetch: they may take minutes.
pub const LAUNCH_DEADLINE: Duration = Duration::from_secs(5 * 60);
/// `vm inspect`, `vm rm`, `image inspect`: bounded like cocoon's control calls.
pub const CONTROL_DEADLINE: Duration = Duration::from_secs(90);
/// A control call past its deadline is stopped with SIGTERM, then SIGKILL after this grace.
pub const CONTROL_TERM_GRACE: Duration = Duration::from_secs(90);
/// The child's environment variable that carries its VM's VNC password (`vm run` and
/// `vm start` with `--vnc`). cocoon-macos must read it there; see the README.
pub const VNC_PASSWORD_ENV: &str = "COCOON_MACOS_VNC_PASSWORD";

/// The VNC password of one VM: HMAC-SHA256 keyed with the configured secret over the VM name,
/// its first 48 bits as 8 URL-safe base64 characters (VNC authentication reads 8 at most). A
/// guest's password tells nothing about another's or about the secret.
pub fn vnc_password(secret: &str, vm_name: &str) -> String {
    use base64::Engine;
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let tag = ring::hmac::sign(&key, vm_name.as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&tag.as_ref()[..6])
}

/// The VM ID of a macOS guest.
pub fn vm_id(name: &str) -> String {
    format!("qemu-{name}")
}

/// The VNC port of a display, when it is one of the reserved range.
pub fn port_of_display(display: u16) -> Option<u16> {
    let port = VNC_FIRST_PORT.checked_add(display)?;
    (port <= VNC_LAST_PORT).then_some(port)
}

/// The display of a reserved VNC port.
pub fn display_of_port(port: u16) -> Option<u16> {
    (VNC_FIRST_PORT..=VNC_LAST_PORT)
        .contains(&port)
        .then(|| port - VNC_FIRST_PORT)
}

/// vCPUs for `--cpus`: the pod's count rounded up to even, the default when it asks for none.
pub fn even_cpus(requested: u64) -> u64 {
    match requested {
        0 => DEFAULT_CPUS,
        n => n + n % 2,
    }
}

/// MiB for `--memory`: the pod's bytes rounded up to whole MiB, the default when it asks none.
pub fn memory_mib(bytes: Option<u64>) -> u64 {
    match bytes {
        Some(b) if b > 0 => b.div_ceil(1 << 20),
        _ => DEFAULT_MEMORY_MIB,
    }
}

/// A VM name or image reference that may go on `cocoon-macos`'s command line: it cannot read
/// as an option and carries no whitespace, control character or shell-special text.
pub fn argument_ok(value: &str) -> bool {
    !value.is_empty()
        && !value.starts_with('-')
        && value.len() <= 512
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/' | '@'))
}

/// Options of `vm run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MacosRun {
    pub name: String,
    pub cpus: u64,
    pub memory_mib: u64,
    /// VNC display; `None` = no VNC (no password configured).
    pub vnc_display: Option<u16>,
    /// Disk size in bytes; `None` = the image's.
    pub storage_bytes: Option<u64>,
    pub image: String,
}

/// One `cocoon-macos` invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MacosCmd {
    /// `vm inspect -- <name>` ⇒ `{"name","pid","mac","tap","disk","vnc"}`.
    Inspect {
        name: String,
    },
    /// `vm start [--vnc <display> --vnc-password <pw>] -- <name>`: relaunch a dead QEMU.
    Start {
        name: String,
        vnc_display: Option<u16>,
    },
    Run(MacosRun),
    /// `vm rm -- <name>`.
    Rm {
        name: String,
    },
    ImageInspect {
        image: String,
    },
    ImagePull {
        image: String,
    },
}

impl MacosCmd {
    /// The arguments after the binary. A VNC display goes on the command line; its password
    /// never does (see [`MacosCmd::vnc_env`]).
    pub fn argv(&self) -> Vec<String> {
        let s = |v: &str| v.to_string();
        let vnc = |display: Option<u16>| -> Vec<String> {
            display
                .map(|d| vec![s("--vnc"), d.to_string()])
                .unwrap_or_default()
        };
        match self {
            MacosCmd::Inspect { name } => vec![s("vm"), s("inspect"), s("--"), s(name)],
            MacosCmd::Start { name, vnc_display } => {
                let mut a = vec![s("vm"), s("start")];
                a.extend(vnc(*vnc_display));
                a.extend([s("--"), s(name)]);
                a
            }
            MacosCmd::Run(o) => {
                let mut a = vec![
                    s("vm"),
                    s("run"),
                    s("--name"),
                    s(&o.name),
                    s("--cpus"),
                    o.cpus.to_string(),
                    s("--memory"),
                    o.memory_mib.to_string(),
                ];
                a.extend(vnc(o.vnc_display));
                if let Some(b) = o.storage_bytes {
                    a.extend([s("--storage"), b.to_string()]);
                }
                a.extend([
                    s("--exit-on-reboot"),
                    s("--random-smbios"),
                    s("--net"),
                    s("cni"),
                    s("--"),
                    s(&o.image),
                ]);
                a
            }
            MacosCmd::Rm { name } => vec![s("vm"), s("rm"), s("--"), s(name)],
            MacosCmd::ImageInspect { image } => {
                vec![s("image"), s("inspect"), s("--"), s(image)]
            }
            MacosCmd::ImagePull { image } => vec![s("image"), s("pull"), s("--"), s(image)],
        }
    }

    /// The environment entry with the VM's own VNC password for a launch with a display, given
    /// the configured secret; None for every other call and without a secret.
    pub fn vnc_env(&self, secret: Option<&str>) -> Option<(String, String)> {
        let (name, display) = match self {
            MacosCmd::Start { name, vnc_display } => (name, vnc_display),
            MacosCmd::Run(o) => (&o.name, &o.vnc_display),
            _ => return None,
        };
        display
            .and(secret)
            .map(|secret| (VNC_PASSWORD_ENV.to_string(), vnc_password(secret, name)))
    }

    /// How long a control call that passed its deadline gets between SIGTERM and SIGKILL
    /// (cocoon-macos may be stopping a QEMU). Launches are detached: their QEMU outlives the
    /// call, which is killed at its deadline.
    pub fn term_grace(&self) -> Option<Duration> {
        match self {
            MacosCmd::Start { .. } | MacosCmd::Run(_) | MacosCmd::ImagePull { .. } => None,
            _ => Some(CONTROL_TERM_GRACE),
        }
    }

    /// Launches and pulls get minutes; the rest are control calls.
    pub fn deadline(&self) -> Duration {
        match self {
            MacosCmd::Start { .. } | MacosCmd::Run(_) | MacosCmd::ImagePull { .. } => {
                LAUNCH_DEADLINE
            }
            _ => CONTROL_DEADLINE,
        }
    }
}

/// `vm inspect` output. `vnc` is the display number (absent, null or negative = no VNC).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MacosVm {
    pub name: String,
    pub pid: i64,
    pub mac: String,
    pub tap: String,
    pub disk: String,
    pub vnc_display: Option<u16>,
}

#[derive(Deserialize)]
struct RawVm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    pid: i64,
    #[serde(default)]
    mac: String,
    #[serde(default)]
    tap: String,
    #[serde(default)]
    disk: String,
    #[serde(default)]
    vnc: Option<serde_json::Value>,
}

/// Why a `vm inspect` output is no VM record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InspectError {
    BadJson(String),
    NoName,
}

impl std::fmt::Display for InspectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InspectError::BadJson(e) => write!(f, "cocoon-macos vm inspect: bad JSON: {e}"),
            InspectError::NoName => f.write_str("cocoon-macos vm inspect: record without a name"),
        }
    }
}

impl std::error::Error for InspectError {}

/// Parses `vm inspect`'s JSON; a display given as a number or a decimal string (`"3"`, `":3"`).
pub fn parse_inspect(stdout: &str) -> Result<MacosVm, InspectError> {
    let raw: RawVm =
        serde_json::from_str(stdout.trim()).map_err(|e| InspectError::BadJson(e.to_string()))?;
    if raw.name.is_empty() {
        return Err(InspectError::NoName);
    }
    let vnc_display = match raw.vnc {
        Some(serde_json::Value::Number(n)) => n.as_u64().and_then(|d| u16::try_from(d).ok()),
        Some(serde_json::Value::String(s)) => s.trim().trim_start_matches(':').parse().ok(),
        _ => None,
    }
    .filter(|d| port_of_display(*d).is_some());
    Ok(MacosVm {
        name: raw.name,
        pid: raw.pid.max(0),
        mac: raw.mac.trim().to_ascii_lowercase(),
        tap: raw.tap,
        disk: raw.disk,
        vnc_display,
    })
}

/// `cocoon-macos` says the VM does not exist (any "not found" / "no such vm" error text).
fn not_found(stderr: &str) -> bool {
    let t = stderr.to_ascii_lowercase();
    t.contains("not found") || t.contains("no such vm")
}

impl MacosCmd {
    /// The answer of this call as cocoon-macos's contract reads it: a `vm inspect` or `vm rm`
    /// that failed (in time) with any "not found" text is the VM's absence,
    /// [`ErrorKind::VmNotFound`], whatever cocoon's own rule made of the words.
    pub fn classify(&self, answer: Answer) -> Answer {
        let about_the_vm = matches!(self, MacosCmd::Inspect { .. } | MacosCmd::Rm { .. });
        if about_the_vm && !answer.succeeded() && !answer.timed_out() && not_found(answer.stderr())
        {
            answer.reclassified(ErrorKind::VmNotFound)
        } else {
            answer
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(vnc: Option<u16>, storage: Option<u64>) -> MacosCmd {
        MacosCmd::Run(MacosRun {
            name: "vk-ns-mac-0".into(),
            cpus: 4,
            memory_mib: 8192,
            vnc_display: vnc,
            storage_bytes: storage,
            image: "ghcr.io/org/sonoma:14".into(),
        })
    }

    #[test]
    fn run_argv_is_the_contract_order_and_never_carries_the_password() {
        let with = run(Some(3), Some(64 << 30));
        assert_eq!(
            with.argv().join(" "),
            "vm run --name vk-ns-mac-0 --cpus 4 --memory 8192 --vnc 3 \
             --storage 68719476736 --exit-on-reboot --random-smbios --net cni -- ghcr.io/org/sonoma:14"
        );
        let (key, pw) = with
            .vnc_env(Some("s3cret"))
            .expect("a password with a display");
        assert_eq!(key, VNC_PASSWORD_ENV);
        assert_eq!(pw, vnc_password("s3cret", "vk-ns-mac-0"));
        assert!(!with
            .argv()
            .iter()
            .any(|a| a.contains(&pw) || a == "--vnc-password"));
        assert_eq!(with.vnc_env(None), None, "no secret, no password");
        let no_display = run(None, None);
        assert!(!no_display.argv().iter().any(|a| a.starts_with("--vnc")));
        assert_eq!(no_display.vnc_env(Some("s3cret")), None);
    }

    #[test]
    fn each_vm_has_its_own_password_of_eight_printable_characters() {
        let a = vnc_password("s3cret", "vk-ns-mac-0");
        let b = vnc_password("s3cret", "vk-ns-mac-1");
        let c = vnc_password("other", "vk-ns-mac-0");
        assert_eq!(a, vnc_password("s3cret", "vk-ns-mac-0"), "stable");
        assert!(a != b && a != c && b != c);
        for p in [&a, &b, &c] {
            assert_eq!(p.len(), 8);
            assert!(p.bytes().all(|x| x.is_ascii_graphic()), "{p}");
        }
    }

    #[test]
    fn start_puts_the_name_last_and_gets_the_password_in_its_environment() {
        let cmd = MacosCmd::Start {
            name: "m".into(),
            vnc_display: Some(0),
        };
        assert_eq!(cmd.argv(), ["vm", "start", "--vnc", "0", "--", "m"]);
        assert_eq!(
            cmd.vnc_env(Some("s3cret")),
            Some((VNC_PASSWORD_ENV.to_string(), vnc_password("s3cret", "m")))
        );
        assert_eq!(
            MacosCmd::Rm { name: "m".into() }.argv(),
            ["vm", "rm", "--", "m"]
        );
        assert_eq!(
            MacosCmd::Rm { name: "m".into() }.vnc_env(Some("s3cret")),
            None
        );
        assert_eq!(cmd.deadline(), LAUNCH_DEADLINE);
        assert_eq!(
            MacosCmd::Inspect { name: "m".into() }.deadline(),
            CONTROL_DEADLINE
        );
        assert_eq!(cmd.term_grace(), None, "a launch is killed at its deadline");
        assert_eq!(
            MacosCmd::Rm { name: "m".into() }.term_grace(),
            Some(CONTROL_TERM_GRACE)
        );
    }

    #[test]
    fn vnc_ports_map_to_displays_inside_the_range_only() {
        assert_eq!(port_of_display(0), Some(5900));
        assert_eq!(port_of_display(99), Some(5999));
        assert_eq!(port_of_display(100), None);
        assert_eq!(port_of_display(u16::MAX), None);
        assert_eq!(display_of_port(5907), Some(7));
        assert_eq!(display_of_port(5899), None);
        assert_eq!(display_of_port(6000), None);
    }

    #[test]
    fn cpus_are_even_and_memory_whole_mib_with_defaults() {
        assert_eq!(even_cpus(0), 4);
        assert_eq!(even_cpus(3), 4);
        assert_eq!(even_cpus(6), 6);
        assert_eq!(memory_mib(None), 8192);
        assert_eq!(memory_mib(Some(0)), 8192);
        assert_eq!(memory_mib(Some((4 << 30) + 1)), 4097);
    }

    #[test]
    fn inspect_parses_numbers_strings_and_rejects_garbage() {
        let vm = parse_inspect(
            r#"{"name":"m","pid":42,"mac":"02:AA:00:00:00:01","tap":"tap0","disk":"/d/m.qcow2","vnc":3}"#,
        )
        .unwrap();
        assert_eq!(vm.pid, 42);
        assert_eq!(vm.mac, "02:aa:00:00:00:01");
        assert_eq!(vm.vnc_display, Some(3));
        let s = parse_inspect(r#"{"name":"m","vnc":":7"}"#).unwrap();
        assert_eq!(s.vnc_display, Some(7));
        let out = parse_inspect(r#"{"name":"m","vnc":4000,"pid":-5}"#).unwrap();
        assert_eq!((out.vnc_display, out.pid), (None, 0));
        assert!(parse_inspect("{not json").is_err());
        assert_eq!(
            parse_inspect(r#"{"pid":1}"#),
            Err(InspectError::NoName),
            "a record without a name"
        );
    }

    #[test]
    fn arguments_that_could_read_as_options_or_carry_spaces_are_refused() {
        assert!(argument_ok("ghcr.io/org/sonoma:14"));
        assert!(argument_ok("vk-ns-mac-0"));
        for bad in ["", "-x", "--vnc", "a b", "a;b", "a\nb", "$(x)"] {
            assert!(!argument_ok(bad), "{bad:?}");
        }
        assert!(not_found("Error: vm not found: m"));
        assert!(!not_found("Error: qemu crashed"));
        let rm = MacosCmd::Rm { name: "m".into() };
        let gone = rm.classify(Answer::failure(ErrorKind::Other, "Error: m: not found"));
        assert!(
            gone.vm_not_found(),
            "cocoon-macos's own words for a missing VM"
        );
        assert!(!rm
            .classify(Answer::failed("Error: qemu crashed"))
            .vm_not_found());
        assert!(!rm.classify(Answer::timed_out_call()).vm_not_found());
        let pull = MacosCmd::ImagePull { image: "i".into() };
        let other = pull.classify(Answer::failure(ErrorKind::Other, "Error: i: not found"));
        assert_eq!(other.kind(), Some(&ErrorKind::Other), "not about the VM");
    }
}
