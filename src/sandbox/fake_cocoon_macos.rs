//! A fake `cocoon-macos` CLI: macOS guests as JSON records under a state directory, each
//! "QEMU" a real `sleep` process, so liveness checks, kills and restarts are real.
//!
//! Run when `vk-cocoon-sandbox` is invoked as `cocoon-macos` (its argv 0) or as
//! `vk-cocoon-sandbox fake-cocoon-macos ...`. It parses its command line as cocoon-macos's
//! cobra does (flags anywhere, `--` ends them, an argument starting with `-` before `--` is a
//! flag) and takes the commands the daemon's `guest::macos` builds: `vm inspect NAME`,
//! `vm run --name N --cpus C --memory MiB [--vnc D] [--storage BYTES] --exit-on-reboot
//! --random-smbios --net cni IMAGE`, `vm start [--vnc D] NAME`, `vm rm NAME`,
//! `image inspect|pull REF`. A `--vnc` display's password comes from `--vnc-password` or the
//! environment variable `COCOON_MACOS_VNC_PASSWORD` (how the daemon passes it).
//! JSON on stdout, `Error: <msg>` on stderr with exit 1; a missing VM is `Error: vm not found:
//! <name>`.
//!
//! # Environment
//! - `FAKE_COCOON_MACOS_STATE`: the state directory; without it, a `fake-cocoon-macos-state`
//!   directory beside a `cocoon-macos` symlink is used.
//! - `FAKE_COCOON_MACOS_LEASES`: a cocoon-net lease file to keep in step (one row per guest,
//!   IP `127.89.0.<n>` on loopback), so the daemon finds the guest's address. As with
//!   cocoon-net, a guest keeps its lease while its QEMU is down; `vm rm` drops it.
//!   Rows of other MACs (not this fake's `02:00:4d:ac:` prefix) are kept as they are.
//!
//! # State directory
//! `vms/<name>.json` (`name, pid, mac, tap, disk, vnc, vnc_password, ip`), `disks/<name>.img`
//! (sparse, `--storage` bytes or 1 GiB), `images/<hex of ref>`, `calls.log` (one line per call:
//! `<unix ms> <argv with the password redacted>`), `lock`.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::fake_cocoon::cli::{self, flag, val, val_s, Flag, Parsed};
use super::fake_cocoon::store::{kill_pid, pid_alive, rfc3339_at, write_atomic};

/// One macOS guest record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MacosRecord {
    pub name: String,
    pub pid: i64,
    pub mac: String,
    pub tap: String,
    pub disk: String,
    /// VNC display, absent without VNC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vnc: Option<u16>,
    /// The password the VM was launched with (a test checks the daemon passed it through).
    #[serde(default)]
    pub vnc_password: String,
    pub ip: String,
    pub image: String,
    pub cpus: u64,
    pub memory_mib: u64,
}

/// The state directory in use for this invocation.
fn state_dir(program: Option<&Path>) -> Result<PathBuf, String> {
    if let Ok(d) = std::env::var("FAKE_COCOON_MACOS_STATE") {
        if !d.is_empty() {
            return Ok(PathBuf::from(d));
        }
    }
    program
        .and_then(Path::parent)
        .map(|d| d.join("fake-cocoon-macos-state"))
        .filter(|d| d.is_dir())
        .ok_or_else(|| "fake cocoon-macos: set FAKE_COCOON_MACOS_STATE".to_string())
}

/// Entry point when run through a `cocoon-macos` symlink.
pub fn main_as_cocoon_macos(program: &Path, args: Vec<String>) -> i32 {
    finish(state_dir(Some(program)).and_then(|s| run(&s, &args)))
}

/// Entry point of `vk-cocoon-sandbox fake-cocoon-macos <args>`.
pub fn main(args: Vec<String>) -> i32 {
    finish(state_dir(None).and_then(|s| run(&s, &args)))
}

fn finish(r: Result<String, String>) -> i32 {
    match r {
        Ok(out) => {
            if !out.is_empty() {
                println!("{out}");
            }
            0
        }
        Err(msg) => {
            eprintln!("Error: {msg}");
            1
        }
    }
}

/// An exclusive `flock` on `<state>/lock` for a read-modify-write, released when dropped.
struct Lock(#[allow(dead_code)] File);

fn lock(state: &Path) -> Result<Lock, String> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(state.join("lock"))
        .map_err(|e| format!("open lock: {e}"))?;
    loop {
        // SAFETY: flock on a descriptor we own for the duration of the call; no memory is
        // shared with the kernel. std's file locks need a newer toolchain than the MSRV.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if rc == 0 {
            return Ok(Lock(file));
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("lock: {err}"));
        }
    }
}

fn vm_path(state: &Path, name: &str) -> PathBuf {
    state.join("vms").join(format!("{name}.json"))
}

fn image_path(state: &Path, image: &str) -> PathBuf {
    let hex: String = image.bytes().map(|b| format!("{b:02x}")).collect();
    state.join("images").join(hex)
}

fn load(state: &Path, name: &str) -> Result<MacosRecord, String> {
    let bytes = fs::read(vm_path(state, name)).map_err(|_| format!("vm not found: {name}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("record of {name}: {e}"))
}

fn save(state: &Path, r: &MacosRecord) -> Result<(), String> {
    let bytes = serde_json::to_vec(r).map_err(|e| e.to_string())?;
    write_atomic(&vm_path(state, &r.name), &bytes).map_err(|e| format!("save {}: {e}", r.name))
}

/// Every record (unreadable ones skipped).
pub fn records(state: &Path) -> Vec<MacosRecord> {
    let Ok(dir) = fs::read_dir(state.join("vms")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect()
}

/// The persistent flag of cocoon-macos's `vm` commands.
const GLOBAL: &[Flag] = &[val("state-dir")];
/// The VM flags of `vm run` (cocoon-macos's `addVMFlags` and run's own).
const RUN_FLAGS: &[Flag] = &[
    val_s("name", 'n'),
    val("cpus"),
    val("memory"),
    val("vnc"),
    val("vnc-password"),
    val("ssh-port"),
    val("storage"),
    val("net"),
    val("tap"),
    val("opencore"),
    val("ovmf-code"),
    val("ovmf-vars"),
    val("data-disk"),
    flag("hugepages"),
    flag("exit-on-reboot"),
    flag("random-smbios"),
];
const START_FLAGS: &[Flag] = &[val("vnc"), val("vnc-password"), flag("exit-on-reboot")];

/// The command line of one command, as cobra parses it: `--` ends the flags, an argument that
/// starts with `-` before it is a flag; `want` is the number of positionals the command takes.
fn parse(args: &[String], flags: &[Flag], want: usize) -> Result<Parsed, String> {
    let p = cli::parse_with(args, flags, GLOBAL)?;
    if p.positionals.len() != want {
        return Err(format!(
            "accepts {want} arg(s), received {}",
            p.positionals.len()
        ));
    }
    Ok(p)
}

/// The VNC flags of `vm run` / `vm start`: a display needs a password of at most 8 bytes,
/// from `--vnc-password` or, as the daemon passes it, from `COCOON_MACOS_VNC_PASSWORD` in the
/// environment.
struct Vnc {
    display: Option<u16>,
    password: Option<String>,
}

impl Vnc {
    fn of(p: &Parsed) -> Result<Vnc, String> {
        let display = match p.get("vnc") {
            None => None,
            Some(d) => Some(d.parse().map_err(|_| format!("bad --vnc {d:?}"))?),
        };
        let from_env = || {
            std::env::var(crate::guest::macos::VNC_PASSWORD_ENV)
                .ok()
                .filter(|v| !v.is_empty())
        };
        let vnc = Vnc {
            display,
            password: p
                .get("vnc-password")
                .map(String::from)
                .or_else(|| display.and_then(|_| from_env())),
        };
        match (&vnc.display, &vnc.password) {
            (None, None) => Ok(vnc),
            (Some(d), Some(pw)) if *d <= 99 && !pw.is_empty() && pw.len() <= 8 => Ok(vnc),
            (Some(_), Some(_)) => {
                Err("--vnc needs a display 0-99 and a password of 1-8 bytes".into())
            }
            _ => Err("--vnc and --vnc-password go together".into()),
        }
    }
}

fn run(state: &Path, args: &[String]) -> Result<String, String> {
    for d in ["vms", "disks", "images"] {
        fs::create_dir_all(state.join(d)).map_err(|e| format!("state dir: {e}"))?;
    }
    log_call(state, args);
    let _guard = lock(state)?;
    let (group, verb) = (
        args.first().map(String::as_str).unwrap_or(""),
        args.get(1).map(String::as_str).unwrap_or(""),
    );
    let rest = args.get(2..).unwrap_or(&[]);
    let out = match (group, verb) {
        ("vm", "inspect") => {
            let p = parse(rest, &[], 1)?;
            inspect_json(&load(state, &p.positionals[0])?)
        }
        ("vm", "rm") => {
            let p = parse(rest, &[flag("force")], 1)?;
            let name = &p.positionals[0];
            let r = load(state, name)?;
            kill_pid(r.pid);
            let _ = fs::remove_file(&r.disk);
            fs::remove_file(vm_path(state, name)).map_err(|e| format!("rm {name}: {e}"))?;
            String::new()
        }
        ("vm", "start") => start(state, &parse(rest, START_FLAGS, 1)?)?,
        ("vm", "run") => run_vm(state, &parse(rest, RUN_FLAGS, 1)?)?,
        ("image", "inspect") => {
            let p = parse(rest, &[], 1)?;
            let image = &p.positionals[0];
            if !image_path(state, image).exists() {
                return Err(format!("image not found: {image}"));
            }
            format!(r#"{{"name":{}}}"#, serde_json::Value::from(image.as_str()))
        }
        ("image", "pull") => {
            let p = parse(rest, &[], 1)?;
            let image = &p.positionals[0];
            write_atomic(&image_path(state, image), image.as_bytes())
                .map_err(|e| format!("pull {image}: {e}"))?;
            String::new()
        }
        _ => return Err(format!("unknown command: {}", args.join(" "))),
    };
    sync_leases(state);
    Ok(out)
}

fn inspect_json(r: &MacosRecord) -> String {
    serde_json::json!({
        "name": r.name, "pid": r.pid, "mac": r.mac, "tap": r.tap, "disk": r.disk, "vnc": r.vnc,
    })
    .to_string()
}

fn start(state: &Path, p: &Parsed) -> Result<String, String> {
    let vnc = Vnc::of(p)?;
    let mut r = load(state, &p.positionals[0])?;
    if pid_alive(r.pid) {
        return Ok(String::new());
    }
    r.pid = spawn_qemu()?;
    r.vnc = vnc.display;
    r.vnc_password = vnc.password.unwrap_or_default();
    save(state, &r)?;
    Ok(String::new())
}

fn run_vm(state: &Path, p: &Parsed) -> Result<String, String> {
    let vnc = Vnc::of(p)?;
    let image = p.positionals[0].clone();
    let name = p
        .get("name")
        .ok_or("vm run: --name is required")?
        .to_string();
    let number = |flag: &str| -> Result<u64, String> {
        p.get(flag)
            .unwrap_or("0")
            .parse()
            .map_err(|_| format!("bad --{flag}"))
    };
    let (cpus, memory) = (number("cpus")?, number("memory")?);
    let storage = p.get("storage").map(|_| number("storage")).transpose()?;
    if cpus == 0 || cpus % 2 != 0 || memory == 0 {
        return Err("vm run: --cpus must be even and --memory set".into());
    }
    if !(p.has("exit-on-reboot") && p.has("random-smbios") && p.get("net") == Some("cni")) {
        return Err("vm run: --exit-on-reboot --random-smbios --net cni are required".into());
    }
    if !image_path(state, &image).exists() {
        return Err(format!("image not found: {image}"));
    }
    if vm_path(state, &name).exists() {
        return Err(format!("vm {name} already exists"));
    }
    // The lowest guest number no record holds: its MAC, tap and address stay unique.
    let taken: Vec<String> = records(state).into_iter().map(|r| r.tap).collect();
    let n = (1u64..)
        .find(|n| !taken.contains(&format!("qtap{n}")))
        .unwrap_or(1);
    let disk = state.join("disks").join(format!("{name}.img"));
    let f = File::create(&disk).map_err(|e| format!("create disk: {e}"))?;
    f.set_len(storage.unwrap_or(1 << 30))
        .map_err(|e| format!("size disk: {e}"))?;
    let r = MacosRecord {
        name: name.clone(),
        pid: spawn_qemu()?,
        mac: format!("{MAC_PREFIX}{:02x}:{:02x}", (n >> 8) & 0xff, n & 0xff),
        tap: format!("qtap{n}"),
        disk: disk.to_string_lossy().into_owned(),
        vnc: vnc.display,
        vnc_password: vnc.password.unwrap_or_default(),
        ip: format!("127.89.{}.{}", (n >> 8) & 0xff, (n & 0xff).max(1)),
        image,
        cpus,
        memory_mib: memory,
    };
    save(state, &r)?;
    Ok(String::new())
}

/// The guest's "QEMU": a real process in its own process group that outlives this call.
fn spawn_qemu() -> Result<i64, String> {
    let child = Command::new("sleep")
        .arg("infinity")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("start qemu: {e}"))?;
    Ok(i64::from(child.id()))
}

fn log_call(state: &Path, args: &[String]) {
    let mut redacted = Vec::with_capacity(args.len());
    let mut hide = false;
    for a in args {
        redacted.push(if hide { "<redacted>" } else { a.as_str() });
        hide = a == "--vnc-password";
    }
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    if let Ok(mut f) = OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.join("calls.log"))
    {
        let _ = writeln!(f, "{ms} {}", redacted.join(" "));
    }
}

/// The MAC prefix of this fake's guests: its lease rows are the ones it rewrites.
const MAC_PREFIX: &str = "02:00:4d:ac:";

/// Rewrites this fake's rows of the lease file (if one is configured): a row per guest (a
/// dead QEMU's guest keeps its lease, as cocoon-net's leases outlive a guest reboot); other
/// rows stay.
fn sync_leases(state: &Path) {
    let Some(path) = std::env::var_os("FAKE_COCOON_MACOS_LEASES").filter(|p| !p.is_empty()) else {
        return;
    };
    let expiry = rfc3339_at(SystemTime::now() + Duration::from_secs(3600));
    let mut rows: Vec<serde_json::Value> = fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Option<Vec<serde_json::Value>>>(&b).ok())
        .flatten()
        .unwrap_or_default();
    rows.retain(|r| !r["mac"].as_str().unwrap_or("").starts_with(MAC_PREFIX));
    rows.extend(
        records(state)
            .iter()
            .map(|r| serde_json::json!({"mac": r.mac, "ip": r.ip, "expiry": expiry})),
    );
    if let Ok(bytes) = serde_json::to_vec(&rows) {
        let _ = write_atomic(Path::new(&path), &bytes);
    }
}
