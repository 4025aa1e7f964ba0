//! The fake cocoon's state directory: records as JSON files, the file lock, the change journal,
//! fault files, generated IDs/MACs/IPs and VM backing processes. No command-line parsing here.

use crate::vm::types::{Image, Snapshot, Vm};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// A stored VM: the record cocoon prints plus what only the fake needs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StoredVm {
    pub vm: Vm,
    /// PID of the cocoon process that wrote a `creating` placeholder (for reconcile-stale-create).
    pub owner_pid: u32,
}

/// Injected misbehaviour for one verb (see the module doc of `fake_cocoon`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VerbFault {
    /// Fail this many of the next calls with `Error: <fail_message>` and `fail_exit`.
    pub fail_count: u64,
    pub fail_message: String,
    /// Exit status of injected failures (default 1).
    pub fail_exit: i32,
    /// Print `garbage` on stdout instead of the real output for this many calls (exit 0).
    pub garbage_count: u64,
    pub garbage: String,
    /// Sleep forever (until killed), every call.
    pub hang: bool,
    /// Hang (as `hang`) on this many of the next calls, then behave.
    pub hang_count: u64,
    /// Sleep this long before doing the work (clone/run: after writing the placeholder).
    pub slow_ms: u64,
    /// vm status --event: end the stream after this long (0 = never).
    pub exit_after_ms: u64,
    /// vm status --event: exit status when ending because of `exit_after_ms`.
    pub exit_code: i32,
    /// clone/run: write the `creating` placeholder, then die with exit 1 (a crashed create).
    pub placeholder_only: bool,
    /// run: print the pre-start record (`created`, pid 0) to exercise the fallback inspect.
    pub print_created: bool,
    /// vm status --event: the first N refreshes after start see a failed (empty) listing, so
    /// every VM is reported `DELETED` and then `ADDED` again, as cocoon's event stream does.
    pub blank_lists: u64,
    /// snapshot export: the stream stops after this many bytes and the command fails, like a
    /// cocoon that died mid-export (0 = off).
    pub truncate_after: u64,
}

/// The contents of `<state>/faults.json`: verb (`"vm clone"`, `"vm status"`, ...) to fault.
pub type FaultFile = BTreeMap<String, VerbFault>;

/// Paths and switches of one fake installation.
#[derive(Debug, Clone)]
pub struct Store {
    pub state: PathBuf,
    pub root: PathBuf,
    pub log_dir: PathBuf,
    /// Generation B quirks (`No VMs found.`, no reconcile-stale-create, B error texts).
    pub gen_b: bool,
    /// Back each running VM with a sleeping process (off with FAKE_COCOON_NO_PROCESS=1).
    pub spawn_process: bool,
    /// VM name prefix backed by a process even when `spawn_process` is off
    /// (`FAKE_COCOON_PROCESS_NAMES`): a bench's few killable hypervisors among thousands.
    pub process_names: Option<String>,
    /// DHCP mode (`FAKE_COCOON_DHCP=1`): NICs get no static address and this lease file is kept
    /// like cocoon-net would (see `dhcp`).
    pub leases: Option<PathBuf>,
}

/// An exclusive `flock` on `<state>/lock`, released when dropped.
pub struct LockGuard {
    _file: File,
}

/// Why a ref did not resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefError {
    NotFound,
    Ambiguous,
}

impl Store {
    /// Whether the VM named `name` runs as a process of its own.
    pub fn backs_with_process(&self, name: &str) -> bool {
        self.spawn_process
            || self
                .process_names
                .as_deref()
                .is_some_and(|prefix| name.starts_with(prefix))
    }

    pub fn vms_dir(&self) -> PathBuf {
        self.state.join("vms")
    }

    pub fn snaps_dir(&self) -> PathBuf {
        self.state.join("snapshots")
    }

    pub fn images_dir(&self) -> PathBuf {
        self.state.join("images")
    }

    pub fn journal_path(&self) -> PathBuf {
        self.state.join("journal")
    }

    pub fn faults_path(&self) -> PathBuf {
        self.state.join("faults.json")
    }

    pub fn exec_log_path(&self) -> PathBuf {
        self.state.join("exec.log")
    }

    pub fn vm_path(&self, id: &str) -> PathBuf {
        self.vms_dir().join(format!("{id}.json"))
    }

    /// `<state>/vm-names/<hex of the name>`: the ID of the VM with that name. An index, so a
    /// lookup by name reads one record instead of every VM's (a dense host has thousands).
    fn vm_name_path(&self, name: &str) -> PathBuf {
        let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
        self.state.join("vm-names").join(hex)
    }

    pub fn snap_path(&self, id: &str) -> PathBuf {
        self.snaps_dir().join(format!("{id}.json"))
    }

    pub fn snap_data_dir(&self, id: &str) -> PathBuf {
        self.snaps_dir().join(id)
    }

    /// `<root>/run/<cloudhypervisor|firecracker>/<ID>`.
    pub fn run_dir(&self, vm: &Vm) -> PathBuf {
        self.root.join("run").join(vm.backend_dir()).join(&vm.id)
    }

    /// `<log_dir>/<backend dir>/<ID>/<cloud-hypervisor|firecracker>.log`.
    pub fn console_log(&self, vm: &Vm) -> PathBuf {
        let file = if vm.is_firecracker() {
            "firecracker.log"
        } else {
            "cloud-hypervisor.log"
        };
        self.log_dir.join(vm.backend_dir()).join(&vm.id).join(file)
    }

    /// Creates the directory skeleton.
    pub fn init(&self) -> io::Result<()> {
        for d in [
            self.vms_dir(),
            self.snaps_dir(),
            self.images_dir(),
            self.state.join("vm-names"),
        ] {
            fs::create_dir_all(d)?;
        }
        Ok(())
    }

    pub fn lock(&self) -> io::Result<LockGuard> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(self.state.join("lock"))?;
        loop {
            // SAFETY: flock on a file descriptor we own for the duration of the call; no memory
            // is shared with the kernel. std has no advisory-lock API on stable for our MSRV.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(LockGuard { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }

    /// Appends one change line; the event stream watches this file's size.
    pub fn journal(&self, event: &str, id: &str) {
        let line = format!("{} {} {}\n", now_rfc3339(), event, id);
        if let Ok(mut f) = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.journal_path())
        {
            let _ = f.write_all(line.as_bytes());
        }
    }

    pub fn load_vms(&self) -> Vec<StoredVm> {
        let mut out: Vec<StoredVm> = read_dir_json(&self.vms_dir());
        out.sort_by(|a, b| {
            (a.vm.created_at.as_str(), a.vm.id.as_str())
                .cmp(&(b.vm.created_at.as_str(), b.vm.id.as_str()))
        });
        out
    }

    pub fn save_vm(&self, v: &StoredVm) -> io::Result<()> {
        write_atomic(&self.vm_path(&v.vm.id), &to_json(v)?)?;
        if !v.vm.config.name.is_empty() {
            fs::create_dir_all(self.state.join("vm-names"))?;
            write_atomic(&self.vm_name_path(&v.vm.config.name), v.vm.id.as_bytes())?;
        }
        Ok(())
    }

    pub fn delete_vm(&self, id: &str) {
        if let Some(v) = self.load_vm(id) {
            if self.vm_id_by_name(&v.vm.config.name).as_deref() == Some(id) {
                let _ = fs::remove_file(self.vm_name_path(&v.vm.config.name));
            }
        }
        let _ = fs::remove_file(self.vm_path(id));
    }

    pub fn load_vm(&self, id: &str) -> Option<StoredVm> {
        if id.is_empty() || id.contains('/') || id.starts_with('.') {
            return None;
        }
        let bytes = fs::read(self.vm_path(id)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn vm_id_by_name(&self, name: &str) -> Option<String> {
        fs::read_to_string(self.vm_name_path(name)).ok()
    }

    /// The VM named `name` (through the index; a stale entry counts as absent).
    pub fn vm_by_name(&self, name: &str) -> Option<StoredVm> {
        let id = self.vm_id_by_name(name)?;
        self.load_vm(&id).filter(|v| v.vm.config.name == name)
    }

    pub fn load_snapshots(&self) -> Vec<Snapshot> {
        let mut out: Vec<Snapshot> = read_dir_json(&self.snaps_dir());
        out.sort_by(|a, b| (&a.created_at, &a.id).cmp(&(&b.created_at, &b.id)));
        out
    }

    pub fn save_snapshot(&self, s: &Snapshot) -> io::Result<()> {
        write_atomic(&self.snap_path(&s.id), &to_json(s)?)
    }

    pub fn load_images(&self) -> Vec<Image> {
        read_dir_json(&self.images_dir())
    }

    pub fn save_image(&self, i: &Image) -> io::Result<()> {
        let hex = i.id.trim_start_matches("sha256:");
        write_atomic(&self.images_dir().join(format!("{hex}.json")), &to_json(i)?)
    }

    /// VM ref resolution: exact ID, exact name, or an ID prefix of at least 3 characters.
    pub fn resolve_vm(&self, r: &str) -> Result<StoredVm, RefError> {
        if let Some(v) = self.load_vm(r).filter(|v| v.vm.id == r) {
            return Ok(v);
        }
        if let Some(v) = self.vm_by_name(r) {
            return Ok(v);
        }
        // Only a possible ID prefix needs the scan (IDs are upper-case base32), and it reads
        // file names, not records: a not-found inspect on a host of thousands of VMs would
        // otherwise parse every record, which cocoon's own index never does.
        let id_like = r.len() >= 3 && r.bytes().all(|b| matches!(b, b'A'..=b'Z' | b'2'..=b'7'));
        if !id_like {
            return Err(RefError::NotFound);
        }
        let vms: Vec<StoredVm> = self
            .vm_ids()
            .into_iter()
            .filter(|id| id.starts_with(r))
            .filter_map(|id| self.load_vm(&id))
            .collect();
        resolve(vms, r, |v| (&v.vm.id, &v.vm.config.name))
    }

    /// The IDs of all stored VMs, from the record file names.
    fn vm_ids(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(self.vms_dir()) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_suffix(".json").map(str::to_string)
            })
            .collect()
    }

    pub fn resolve_snapshot(&self, r: &str) -> Result<Snapshot, RefError> {
        resolve(self.load_snapshots(), r, |s| (&s.id, &s.name))
    }

    pub fn resolve_image(&self, r: &str) -> Option<Image> {
        self.load_images()
            .into_iter()
            .find(|i| i.name == r || i.id == r || i.id.trim_start_matches("sha256:") == r)
    }

    /// Reads and consumes the fault for `verb` under the lock (counts are decremented).
    pub fn take_fault(&self, verb: &str) -> VerbFault {
        let path = self.faults_path();
        if !path.exists() {
            return VerbFault::default();
        }
        let Ok(_guard) = self.lock() else {
            return VerbFault::default();
        };
        let mut file: FaultFile = match fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
        {
            Some(f) => f,
            None => return VerbFault::default(),
        };
        let Some(fault) = file.get_mut(verb) else {
            return VerbFault::default();
        };
        let seen = fault.clone();
        let mut changed = false;
        if fault.fail_count > 0 {
            fault.fail_count -= 1;
            changed = true;
        }
        if fault.garbage_count > 0 {
            fault.garbage_count -= 1;
            changed = true;
        }
        if fault.hang_count > 0 {
            fault.hang_count -= 1;
            changed = true;
        }
        if changed {
            if let Ok(bytes) = serde_json::to_vec_pretty(&file) {
                let _ = write_atomic(&path, &bytes);
            }
        }
        seen
    }

    /// Allocates the next static IP from 127.88.0.0/16 (under the caller's lock). Loopback on
    /// purpose: the daemon pings guest IPs, and a fake guest must never send traffic off the host.
    pub fn next_ip(&self) -> String {
        let path = self.state.join("next_ip");
        let mut n: u32 = fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(2);
        while n & 0xff == 0 || n & 0xff == 0xff || n & 0xffff == 1 {
            n += 1;
        }
        let _ = write_atomic(&path, (n + 1).to_string().as_bytes());
        format!("127.88.{}.{}", (n >> 8) & 0xff, n & 0xff)
    }
}

fn resolve<T>(
    items: Vec<T>,
    r: &str,
    key: impl Fn(&T) -> (&String, &String),
) -> Result<T, RefError> {
    if r.is_empty() {
        return Err(RefError::NotFound);
    }
    let mut prefix_hits = Vec::new();
    let mut name_hit = None;
    for item in items {
        let (id, name) = key(&item);
        if id == r {
            return Ok(item);
        }
        if name == r {
            name_hit = Some(item);
        } else if r.len() >= 3 && id.starts_with(r) {
            prefix_hits.push(item);
        }
    }
    if let Some(n) = name_hit {
        return Ok(n);
    }
    match prefix_hits.len() {
        0 => Err(RefError::NotFound),
        1 => Ok(prefix_hits.remove(0)),
        _ => Err(RefError::Ambiguous),
    }
}

fn read_dir_json<T: for<'de> Deserialize<'de>>(dir: &Path) -> Vec<T> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        if let Some(v) = fs::read(&p)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
        {
            out.push(v);
        }
    }
    out
}

fn to_json<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    serde_json::to_vec_pretty(v).map_err(io::Error::other)
}

/// Writes via a temporary sibling and rename, so readers never see half a record.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
    }
    fs::rename(&tmp, path)
}

/// Random bytes from the kernel.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    if let Ok(mut f) = File::open("/dev/urandom") {
        if f.read_exact(&mut buf).is_ok() {
            return buf;
        }
    }
    // Fallback: time and pid mixed (still unique enough for a fake).
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
        ^ ((std::process::id() as u128) << 64);
    let mut x = seed as u64 | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    buf
}

/// A 26-character ID from the base32 alphabet `A-Z2-7`, like cocoon's VM IDs.
pub fn new_id() -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    random_bytes(26)
        .into_iter()
        .map(|b| ALPHABET[(b & 31) as usize] as char)
        .collect()
}

/// A locally administered unicast MAC, lower-case colon hex.
pub fn new_mac() -> String {
    let b = random_bytes(5);
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[0], b[1], b[2], b[3], b[4]
    )
}

/// `tap<first 8 ID chars>-<index>`, cocoon's TAP device names.
pub fn tap_name(id: &str, index: usize) -> String {
    let head: String = id.chars().take(8).collect();
    format!("tap{head}-{index}")
}

/// Whether a PID names a live (non-zombie) process.
pub fn pid_alive(pid: i64) -> bool {
    if pid <= 0 {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // State is the first field after the parenthesised command name.
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next())
                .unwrap_or("");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// The state cocoon shows: stored `running` with a dead PID reads `stopped (stale)`.
/// A running VM with pid 0 (process backing disabled) counts as alive.
pub fn display_state(vm: &Vm) -> String {
    if vm.state == "running" && vm.pid > 0 && !pid_alive(vm.pid) {
        "stopped (stale)".to_string()
    } else {
        vm.state.clone()
    }
}

/// SIGKILLs a VM's backing process (if any).
pub fn kill_pid(pid: i64) {
    if pid > 0 && pid <= i32::MAX as i64 {
        // SAFETY: kill(2) with a PID we recorded ourselves; no memory is involved.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
}

/// RFC 3339 UTC timestamp with nanoseconds, like Go's `time.RFC3339Nano`.
pub fn now_rfc3339() -> String {
    rfc3339_at(SystemTime::now())
}

/// RFC 3339 UTC timestamp of `t` with nanoseconds.
pub use crate::rfc3339::nanos_fixed as rfc3339_at;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_macs_taps() {
        let id = new_id();
        assert_eq!(id.len(), 26);
        assert!(id
            .chars()
            .all(|c| c.is_ascii_uppercase() || ('2'..='7').contains(&c)));
        assert_ne!(new_id(), id);
        let mac = new_mac();
        assert_eq!(mac.len(), 17);
        assert!(mac.starts_with("02:"));
        assert_eq!(tap_name("Q3MZ5T2XKJ7A4LW6PDNB2RVHEY", 0), "tapQ3MZ5T2X-0");
        let t = now_rfc3339();
        assert_eq!(t.len(), 30);
        assert!(t.ends_with('Z'));
        assert!(pid_alive(std::process::id() as i64));
        assert!(!pid_alive(0));
    }

    #[test]
    fn vms_resolve_by_id_name_index_and_id_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store {
            state: dir.path().join("state"),
            root: dir.path().join("root"),
            log_dir: dir.path().join("log"),
            gen_b: false,
            spawn_process: false,
            process_names: None,
            leases: None,
        };
        store.init().unwrap();
        let mk = |id: &str, name: &str| {
            let mut vm = Vm {
                id: id.into(),
                ..Default::default()
            };
            vm.config.name = name.into();
            StoredVm { vm, owner_pid: 0 }
        };
        store.save_vm(&mk("ABCDEF234", "vk-a")).unwrap();
        store.save_vm(&mk("QRSTUV567", "vk-b")).unwrap();
        let id = |r: &str| store.resolve_vm(r).map(|v| v.vm.id);
        assert_eq!(id("ABCDEF234").as_deref(), Ok("ABCDEF234"));
        assert_eq!(id("vk-b").as_deref(), Ok("QRSTUV567"));
        assert_eq!(id("QRS").as_deref(), Ok("QRSTUV567"));
        assert_eq!(id("vk-c"), Err(RefError::NotFound));
        assert_eq!(id("../x"), Err(RefError::NotFound));
        assert_eq!(id("QRSTUV567ZZ"), Err(RefError::NotFound));
        store.save_vm(&mk("ABCXYZ222", "vk-c2")).unwrap();
        assert_eq!(id("ABC"), Err(RefError::Ambiguous));
        assert_eq!(id("ABCX").as_deref(), Ok("ABCXYZ222"));
        store.delete_vm("QRSTUV567");
        assert_eq!(id("vk-b"), Err(RefError::NotFound));
        assert!(store.vm_by_name("vk-b").is_none());
        // A stale index entry (its VM gone, or renamed) is not trusted.
        write_atomic(&store.vm_name_path("vk-z"), b"ABCDEF234").unwrap();
        assert_eq!(id("vk-z"), Err(RefError::NotFound));
        assert_eq!(id("vk-a").as_deref(), Ok("ABCDEF234"));
    }
}
