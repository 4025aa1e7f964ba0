//! One argv builder per cocoon command vk-cocoon runs, and [`check`], the last look at every
//! name and reference in such an argv before it is spawned. No shell, ever.
//!
//! Every builder returns the arguments after the binary and puts `--` before its positional
//! arguments: cocoon parses its command line with cobra, which reads anything starting with `-`
//! as a flag until `--` ends the flags, so a value such as `--all` stays a value.

use super::resources::CpuPolicy;

/// The hypervisor backend a VM runs on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Backend {
    #[default]
    CloudHypervisor,
    Firecracker,
}

impl Backend {
    /// The JSON `hypervisor` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::CloudHypervisor => "cloud-hypervisor",
            Backend::Firecracker => "firecracker",
        }
    }

    /// From a JSON `hypervisor` value; anything but `firecracker` is cloud-hypervisor.
    pub fn from_hypervisor(text: &str) -> Backend {
        if text == "firecracker" {
            Backend::Firecracker
        } else {
            Backend::CloudHypervisor
        }
    }
}

/// `--restore-mode` of N clones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreMode {
    Copy,
    OnDemand,
    Mmap,
}

impl RestoreMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RestoreMode::Copy => "copy",
            RestoreMode::OnDemand => "ondemand",
            RestoreMode::Mmap => "mmap",
        }
    }
}

/// Where a clone restores from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloneSource {
    /// A snapshot ref (ID, name or ID prefix): the positional FROM.
    Snapshot(String),
    /// An unpacked snapshot directory: `--from-dir DIR` (implies `--pull`).
    FromDir(String),
}

/// Options of `vm clone` (N, 3.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneOptions {
    pub source: CloneSource,
    /// Empty = let cocoon choose (`cocoon-clone-<id8>`).
    pub name: String,
    /// CNI conflist name; empty = omitted.
    pub network: String,
    pub no_direct_io: bool,
    /// Requested when the snapshot records a base image.
    pub pull: bool,
    /// Omitted for firecracker.
    pub restore_mode: Option<RestoreMode>,
    /// `Some(0)` is emitted as `--nics 0`; omitted for firecracker.
    pub nics: Option<u32>,
    pub cpu: CpuPolicy,
    pub backend: Backend,
}

impl CloneOptions {
    /// A clone from a snapshot ref with every optional flag off.
    pub fn from_snapshot(snapshot: &str) -> CloneOptions {
        CloneOptions {
            source: CloneSource::Snapshot(snapshot.to_string()),
            name: String::new(),
            network: String::new(),
            no_direct_io: false,
            pull: false,
            restore_mode: None,
            nics: None,
            cpu: CpuPolicy::default(),
            backend: Backend::CloudHypervisor,
        }
    }
}

/// Options of `vm run` (N, 3.2).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOptions {
    pub image: String,
    pub name: String,
    /// vCPUs; 0 = omitted.
    pub cpu: u64,
    pub cpu_policy: CpuPolicy,
    /// Byte count (or verbatim unparsable quantity); empty = omitted.
    pub memory: String,
    /// Byte count (or verbatim unparsable quantity); empty = omitted.
    pub storage: String,
    pub network: String,
    pub windows: bool,
    pub backend: Backend,
    pub no_direct_io: bool,
}

/// Options of `vm exec` (N, 3.16).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    pub vm: String,
    /// Forward the caller's stdin (`-i`).
    pub interactive: bool,
    /// Environment; emitted as `-e K=V` sorted by key.
    pub env: Vec<(String, String)>,
    pub command: Vec<String>,
}

fn strs(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

fn push_cpu_policy(argv: &mut Vec<String>, cpu: &CpuPolicy) {
    for (flag, v) in [
        ("--cpu-weight", cpu.weight),
        ("--cpu-quota-us", cpu.quota_us),
        ("--cpu-period-us", cpu.period_us),
    ] {
        if v > 0 {
            argv.push(flag.to_string());
            argv.push(v.to_string());
        }
    }
}

/// `vm clone --output json [--name] [--network] [--no-direct-io] [--pull] [--restore-mode]
/// [--nics] [--cpu-weight] [--cpu-quota-us] [--cpu-period-us] (-- FROM | --from-dir DIR)`.
pub fn vm_clone(o: &CloneOptions) -> Vec<String> {
    let mut a = strs(&["vm", "clone", "--output", "json"]);
    if !o.name.is_empty() {
        a.extend(["--name".into(), o.name.clone()]);
    }
    if !o.network.is_empty() {
        a.extend(["--network".into(), o.network.clone()]);
    }
    if o.no_direct_io {
        a.push("--no-direct-io".into());
    }
    let from_dir = matches!(o.source, CloneSource::FromDir(_));
    if o.pull || from_dir {
        a.push("--pull".into());
    }
    let fc = o.backend == Backend::Firecracker;
    if let (Some(mode), false) = (o.restore_mode, fc) {
        a.extend(["--restore-mode".into(), mode.as_str().into()]);
    }
    if let (Some(n), false) = (o.nics, fc) {
        a.extend(["--nics".into(), n.to_string()]);
    }
    push_cpu_policy(&mut a, &o.cpu);
    match &o.source {
        CloneSource::Snapshot(from) => a.extend(["--".into(), from.clone()]),
        CloneSource::FromDir(dir) => a.extend(["--from-dir".into(), dir.clone()]),
    }
    a
}

/// `vm run --output json [--name] [--cpu] [--cpu-weight] [--cpu-quota-us] [--cpu-period-us]
/// [--memory] [--storage] [--network] [--windows] [--fc] [--no-direct-io] -- IMAGE`.
pub fn vm_run(o: &RunOptions) -> Vec<String> {
    let mut a = strs(&["vm", "run", "--output", "json"]);
    if !o.name.is_empty() {
        a.extend(["--name".into(), o.name.clone()]);
    }
    if o.cpu > 0 {
        a.extend(["--cpu".into(), o.cpu.to_string()]);
    }
    push_cpu_policy(&mut a, &o.cpu_policy);
    if !o.memory.is_empty() {
        a.extend(["--memory".into(), o.memory.clone()]);
    }
    if !o.storage.is_empty() {
        a.extend(["--storage".into(), o.storage.clone()]);
    }
    if !o.network.is_empty() {
        a.extend(["--network".into(), o.network.clone()]);
    }
    if o.windows {
        a.push("--windows".into());
    }
    if o.backend == Backend::Firecracker {
        a.push("--fc".into());
    }
    if o.no_direct_io {
        a.push("--no-direct-io".into());
    }
    a.extend(["--".into(), o.image.clone()]);
    a
}

/// `vm inspect -- REF`.
pub fn vm_inspect(vm_ref: &str) -> Vec<String> {
    strs(&["vm", "inspect", "--", vm_ref])
}

/// `vm list -o json`.
pub fn vm_list() -> Vec<String> {
    strs(&["vm", "list", "-o", "json"])
}

/// `vm rm --force -- VMID`.
pub fn vm_rm(vm_id: &str) -> Vec<String> {
    strs(&["vm", "rm", "--force", "--", vm_id])
}

/// `vm start -- VMID`.
pub fn vm_start(vm_id: &str) -> Vec<String> {
    strs(&["vm", "start", "--", vm_id])
}

/// `vm exec [-i] [-e K=V]... -- VMID -- ARGV...` with env sorted by key. cocoon takes its
/// first positional as the VM and the rest as the command, less one leading `--`: the second
/// `--` is that one, so a command that itself starts with `--` reaches the guest whole.
pub fn vm_exec(o: &ExecOptions) -> Vec<String> {
    let mut a = strs(&["vm", "exec"]);
    if o.interactive {
        a.push("-i".into());
    }
    let mut env = o.env.clone();
    env.sort();
    for (k, v) in env {
        a.push("-e".into());
        a.push(format!("{k}={v}"));
    }
    a.extend(["--".into(), o.vm.clone(), "--".into()]);
    a.extend(o.command.iter().cloned());
    a
}

/// `vm logs [--tail N] [-f] -- VMID` (`--tail` only when N > 0; `-f` only when following, as the
/// kubelet API's `follow=true` asks).
pub fn vm_logs(vm_id: &str, tail: u64, follow: bool) -> Vec<String> {
    let mut a = strs(&["vm", "logs"]);
    if tail > 0 {
        a.extend(["--tail".into(), tail.to_string()]);
    }
    if follow {
        a.push("-f".into());
    }
    a.extend(["--".into(), vm_id.into()]);
    a
}

/// `vm net --nics N -- VMID` (cloud-hypervisor only).
pub fn vm_net(vm_id: &str, nics: u32) -> Vec<String> {
    let nics = nics.to_string();
    strs(&["vm", "net", "--nics", &nics, "--", vm_id])
}

/// `vm reconcile-stale-create -o json -- VMID`.
pub fn vm_reconcile_stale_create(vm_id: &str) -> Vec<String> {
    strs(&["vm", "reconcile-stale-create", "-o", "json", "--", vm_id])
}

/// `vm status --event --format json` (the long-lived event stream).
pub fn vm_status_events() -> Vec<String> {
    strs(&["vm", "status", "--event", "--format", "json"])
}

/// `snapshot save --name NAME -- VMREF`.
pub fn snapshot_save(name: &str, vm_ref: &str) -> Vec<String> {
    strs(&["snapshot", "save", "--name", name, "--", vm_ref])
}

/// `snapshot inspect -- REF`.
pub fn snapshot_inspect(snapshot_ref: &str) -> Vec<String> {
    strs(&["snapshot", "inspect", "--", snapshot_ref])
}

/// `snapshot rm -- REF`.
pub fn snapshot_rm(snapshot_ref: &str) -> Vec<String> {
    strs(&["snapshot", "rm", "--", snapshot_ref])
}

/// `snapshot import --name NAME [--description D]`; the archive goes to stdin.
pub fn snapshot_import(name: &str, description: Option<&str>) -> Vec<String> {
    let mut a = strs(&["snapshot", "import", "--name", name]);
    if let Some(d) = description.filter(|d| !d.is_empty()) {
        a.extend(["--description".into(), d.into()]);
    }
    a
}

/// `snapshot export -o - -- NAME`; the tar stream comes on stdout.
pub fn snapshot_export(name: &str) -> Vec<String> {
    strs(&["snapshot", "export", "-o", "-", "--", name])
}

/// `snapshot list -o json` (listed in behaviour 19; the JSON form mirrors `vm list`).
pub fn snapshot_list() -> Vec<String> {
    strs(&["snapshot", "list", "-o", "json"])
}

/// `image pull [--force] -- IMAGE`.
pub fn image_pull(image: &str, force: bool) -> Vec<String> {
    let mut a = strs(&["image", "pull"]);
    if force {
        a.push("--force".into());
    }
    a.push("--".into());
    a.push(image.into());
    a
}

/// `image inspect -- REF`.
pub fn image_inspect(image: &str) -> Vec<String> {
    strs(&["image", "inspect", "--", image])
}

/// `image import -- NAME`; the payload goes to stdin.
pub fn image_import(name: &str) -> Vec<String> {
    strs(&["image", "import", "--", name])
}

/// The longest VM or snapshot name cocoon accepts.
pub const NAME_MAX: usize = 63;
/// The longest image reference (an OCI reference or a cloud-image URL) put on a command line.
const IMAGE_REF_MAX: usize = 4096;

/// Why an argv was not spawned: a name or reference outside the contract's character set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgvError(pub String);

impl std::fmt::Display for ArgvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a slot of a cocoon command line holds, with the contract's rule for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// A VM name or ID: `[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}` (IDs are 26 base32 characters).
    Vm,
    /// A snapshot name or ID: `[a-zA-Z0-9][a-zA-Z0-9._:/-]{0,62}`.
    Snapshot,
    /// An image reference or URL: printable ASCII without spaces, not starting with `-`.
    Image,
}

impl Slot {
    fn check(self, value: &str) -> Result<(), ArgvError> {
        let (what, ok) = match self {
            Slot::Vm => (
                "VM name or ID",
                name_ok(value, |c| matches!(c, '.' | '_' | '-')),
            ),
            Slot::Snapshot => (
                "snapshot name or ID",
                name_ok(value, |c| matches!(c, '.' | '_' | ':' | '/' | '-')),
            ),
            Slot::Image => (
                "image reference",
                !value.is_empty()
                    && !value.starts_with('-')
                    && value.len() <= IMAGE_REF_MAX
                    && value.bytes().all(|b| b.is_ascii_graphic()),
            ),
        };
        if ok {
            return Ok(());
        }
        let rule = match self {
            Slot::Vm => "letters, digits, '.', '_', '-', starting with a letter or digit, at most 63",
            Slot::Snapshot => {
                "letters, digits, '.', '_', ':', '/', '-', starting with a letter or digit, at most 63"
            }
            Slot::Image => "printable ASCII without spaces, not starting with '-'",
        };
        Err(ArgvError(format!(
            "{:?} is not a cocoon {what} ({rule})",
            value.chars().take(80).collect::<String>()
        )))
    }
}

/// `[a-zA-Z0-9]` first, then letters, digits and `extra`, at most [`NAME_MAX`] characters.
fn name_ok(value: &str, extra: impl Fn(char) -> bool) -> bool {
    let mut chars = value.chars();
    value.len() <= NAME_MAX
        && chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || extra(c))
}

/// Checks a VM name or ID against the contract's character set.
pub fn check_vm_ref(value: &str) -> Result<(), ArgvError> {
    Slot::Vm.check(value)
}

/// The last look before a cocoon (or cocoon-macos) argv from this room's builders is spawned:
/// every positional after `--` and every `--name` value must follow the contract's rule for
/// what that command takes there, and a command that takes a positional must have its `--`.
/// One place knows every name slot of every builder; the spawners call it, and a refusal is an
/// error answer, never a panic.
pub fn check(args: &[String]) -> Result<(), ArgvError> {
    let word = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    let (positional, name): (Option<Slot>, Option<Slot>) = match (word(0), word(1)) {
        ("vm", "clone") => (Some(Slot::Snapshot), Some(Slot::Vm)),
        ("vm", "run") => (Some(Slot::Image), Some(Slot::Vm)),
        ("vm", "inspect" | "rm" | "start" | "logs" | "net" | "reconcile-stale-create") => {
            (Some(Slot::Vm), None)
        }
        // Only the first positional is the VM; the rest is the guest's command.
        ("vm", "exec") => (Some(Slot::Vm), None),
        ("snapshot", "save") => (Some(Slot::Vm), Some(Slot::Snapshot)),
        ("snapshot", "import") => (None, Some(Slot::Snapshot)),
        ("snapshot", "inspect" | "rm" | "export") => (Some(Slot::Snapshot), None),
        ("image", "pull" | "inspect" | "import") => (Some(Slot::Image), None),
        _ => (None, None),
    };
    let dash = args.iter().position(|a| a == "--");
    let flags = &args[..dash.unwrap_or(args.len())];
    let mut values = flags.iter().skip(2);
    while let Some(a) = values.next() {
        if a == "--name" {
            let v = values.next().map(String::as_str).unwrap_or("");
            name.unwrap_or(Slot::Vm).check(v)?;
        }
    }
    let after: &[String] = dash.map(|d| &args[d + 1..]).unwrap_or(&[]);
    let from_dir = flags.iter().any(|a| a == "--from-dir");
    match (positional, after) {
        (Some(_), []) if !from_dir => Err(ArgvError(format!(
            "{} {}: no argument after --",
            word(0),
            word(1)
        ))),
        (Some(slot), [first, rest @ ..]) => {
            slot.check(first)?;
            if (word(0), word(1)) == ("vm", "exec") {
                return Ok(());
            }
            rest.iter().try_for_each(|v| slot.check(v))
        }
        (None, [_, ..]) => Err(ArgvError(format!(
            "{} {} takes no positional argument",
            word(0),
            word(1)
        ))),
        _ => Ok(()),
    }
}
