//! The core's view of cocoon: the calls it asks for, mapped onto the vm room's argv builders,
//! deadlines, parsers and error classification (vm alone spells the CLI). Never runs a child.

use std::time::Duration;

use crate::vm::argv;
pub use crate::vm::Snapshot;
pub use crate::vm::{
    Backend, CloneOptions, CloneSource, CpuPolicy, Deadlines, ErrorKind, RunOptions,
    StaleCreateOutcome, Verb, VmState,
};
use crate::vm::{CallMode, CallOutcome, CocoonCall};

/// A cocoon invocation the core wants performed: the core's vocabulary, mapped one to one onto
/// the vm room's argv builders and deadlines (the only place that spells cocoon's argv).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CocoonCmd {
    VmInspect {
        reference: String,
    },
    VmClone(CloneOptions),
    VmRun(RunOptions),
    VmStart {
        id: String,
    },
    VmRm {
        id: String,
    },
    ReconcileStaleCreate {
        id: String,
    },
    SnapshotInspect {
        name: String,
    },
    /// `snapshot save --name <name> <vm_id>`, killed at `deadline` when one is given, else at
    /// the verb's transfer deadline.
    SnapshotSave {
        name: String,
        vm_id: String,
        deadline: Option<Duration>,
    },
    SnapshotRm {
        name: String,
    },
    SnapshotList,
    ImageInspect {
        reference: String,
    },
    ImagePull {
        reference: String,
        force: bool,
    },
    /// `vm net --nics N VMID`: hot-resize the VM's NICs (CH + Windows hibernate and rollback).
    VmNet {
        id: String,
        nics: u32,
    },
    /// `vm exec <id> -- <command>` (post-clone fix-ups): output discarded, killed at
    /// `deadline` (the rest of the fix-up's budget: a hung attempt is abandoned there).
    VmExec {
        id: String,
        command: Vec<String>,
        deadline: Duration,
    },
    /// A `cocoon-macos` call (`VK_COCOON_MACOS_BIN`) of a managed macOS guest.
    Macos(crate::guest::macos::MacosCmd),
}

/// How long a guest command of the core may run (the DHCP release before a NIC drop is best
/// effort and capped at 20 s by the hibernate contract).
pub const GUEST_EXEC_DEADLINE: Duration = Duration::from_secs(20);

impl CocoonCmd {
    /// The cocoon verb, which decides the deadline and the error classification.
    pub fn verb(&self) -> Verb {
        match self {
            CocoonCmd::VmInspect { .. } => Verb::VmInspect,
            CocoonCmd::VmClone(_) => Verb::VmClone,
            CocoonCmd::VmRun(_) => Verb::VmRun,
            CocoonCmd::VmStart { .. } => Verb::VmStart,
            CocoonCmd::VmRm { .. } => Verb::VmRm,
            CocoonCmd::ReconcileStaleCreate { .. } => Verb::VmReconcileStaleCreate,
            CocoonCmd::SnapshotInspect { .. } => Verb::SnapshotInspect,
            CocoonCmd::SnapshotSave { .. } => Verb::SnapshotSave,
            CocoonCmd::SnapshotRm { .. } => Verb::SnapshotRm,
            CocoonCmd::SnapshotList => Verb::SnapshotList,
            CocoonCmd::ImageInspect { .. } => Verb::ImageInspect,
            CocoonCmd::ImagePull { .. } => Verb::ImagePull,
            CocoonCmd::VmNet { .. } => Verb::VmNet,
            CocoonCmd::VmExec { .. } => Verb::VmExec,
            // The cocoon verb of the same meaning: its error classification applies.
            CocoonCmd::Macos(m) => {
                use crate::guest::macos::MacosCmd;
                match m {
                    MacosCmd::Inspect { .. } => Verb::VmInspect,
                    MacosCmd::Start { .. } => Verb::VmStart,
                    MacosCmd::Run(_) => Verb::VmRun,
                    MacosCmd::Rm { .. } => Verb::VmRm,
                    MacosCmd::ImageInspect { .. } => Verb::ImageInspect,
                    MacosCmd::ImagePull { .. } => Verb::ImagePull,
                }
            }
        }
    }

    /// The argument vector after the binary (`VK_COCOON_BIN`, or `VK_COCOON_MACOS_BIN` for
    /// [`CocoonCmd::Macos`]).
    pub fn argv(&self) -> Vec<String> {
        match self {
            CocoonCmd::Macos(m) => m.argv(),
            CocoonCmd::VmInspect { reference } => argv::vm_inspect(reference),
            CocoonCmd::VmClone(o) => argv::vm_clone(o),
            CocoonCmd::VmRun(o) => argv::vm_run(o),
            CocoonCmd::VmStart { id } => argv::vm_start(id),
            CocoonCmd::VmRm { id } => argv::vm_rm(id),
            CocoonCmd::ReconcileStaleCreate { id } => argv::vm_reconcile_stale_create(id),
            CocoonCmd::SnapshotInspect { name } => argv::snapshot_inspect(name),
            CocoonCmd::SnapshotSave { name, vm_id, .. } => argv::snapshot_save(name, vm_id),
            CocoonCmd::SnapshotRm { name } => argv::snapshot_rm(name),
            CocoonCmd::SnapshotList => argv::snapshot_list(),
            CocoonCmd::ImageInspect { reference } => argv::image_inspect(reference),
            CocoonCmd::ImagePull { reference, force } => argv::image_pull(reference, *force),
            CocoonCmd::VmNet { id, nics } => argv::vm_net(id, *nics),
            CocoonCmd::VmExec { id, command, .. } => argv::vm_exec(&crate::vm::ExecOptions {
                vm: id.clone(),
                command: command.clone(),
                ..Default::default()
            }),
        }
    }

    /// Environment the child gets beyond the daemon's: a macOS launch's VNC password, derived
    /// from the configured secret (`COCOON_MACOS_VNC_PASSWORD`) and its VM name.
    pub fn child_env(&self, macos_vnc_secret: Option<&str>) -> Vec<(String, String)> {
        match self {
            CocoonCmd::Macos(m) => m.vnc_env(macos_vnc_secret).into_iter().collect(),
            _ => Vec::new(),
        }
    }

    /// Whether this call runs `VK_COCOON_MACOS_BIN` instead of cocoon.
    pub fn is_macos(&self) -> bool {
        matches!(self, CocoonCmd::Macos(_))
    }

    /// How long the daemon lets the child run before killing it: the contract's per-verb
    /// deadline (every verb the core runs has one).
    pub fn deadline(&self) -> Duration {
        match self {
            CocoonCmd::VmExec { deadline, .. }
            | CocoonCmd::SnapshotSave {
                deadline: Some(deadline),
                ..
            } => return *deadline,
            CocoonCmd::Macos(m) => return m.deadline(),
            _ => {}
        }
        let d = Deadlines::configured();
        d.for_verb(self.verb()).unwrap_or(d.control)
    }

    /// The typed call the daemon runs: verb, argv, this command's deadline, the verb's mode.
    /// The core's `vm exec` (post-clone fix-ups) has its output captured for the error text
    /// and discarded on success, which is the combined mode, not a stream to a client.
    pub fn call(&self) -> CocoonCall {
        let mut call = CocoonCall::new(self.verb(), self.argv(), &Deadlines::configured())
            .with_deadline(Some(self.deadline()));
        if call.mode == CallMode::Streaming {
            call.mode = CallMode::Combined;
        }
        call
    }
}

/// Outcome of a cocoon child, as the daemon saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CocoonResult {
    /// Exit status 0 (and output within the capture limit).
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    /// Killed at its deadline.
    pub timed_out: bool,
    /// What the failure means, classified once by the contract for the verb that ran (the
    /// daemon's results). None on success, and for results made by hand (tests, replays),
    /// which [`CocoonResult::error_kind`] classifies from their text for the verb asked about.
    pub kind: Option<ErrorKind>,
}

impl CocoonResult {
    /// The core's view of a finished call: the contract's classification of it for the verb
    /// that ran ([`CocoonCall::check`]), and output beyond the capture limit as a failure.
    /// Notes for what stderr does not say (a signal, a lost status, truncation) are appended
    /// for the messages.
    pub fn from_outcome(call: &CocoonCall, out: &CallOutcome) -> Self {
        let mut kind = call.check(out).err().map(|e| e.kind);
        let mut stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.stdout_truncated {
            stderr.push_str("\nvk-cocoon: cocoon output exceeded the capture limit");
            kind.get_or_insert(ErrorKind::HugeOutput);
        }
        match kind {
            // `CallOutcome::from_exit`'s stand-in for a status the reactor could not learn.
            Some(ErrorKind::Other) if out.exit == crate::vm::ExitKind::Code(-1) => {
                stderr.push_str("\nvk-cocoon: cocoon exit status unknown")
            }
            Some(ErrorKind::Signalled(sig)) => {
                stderr.push_str(&format!("\nvk-cocoon: cocoon killed by signal {sig}"))
            }
            _ => {}
        }
        CocoonResult {
            success: kind.is_none(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr,
            timed_out: out.timed_out,
            kind,
        }
    }

    /// A call that was never started (refused argv, no process): [`ErrorKind::Spawn`].
    pub fn not_started(why: impl Into<String>) -> Self {
        let why = why.into();
        CocoonResult {
            kind: Some(ErrorKind::Spawn(why.clone())),
            ..CocoonResult::failed(why)
        }
    }

    pub fn ok(stdout: impl Into<String>) -> Self {
        CocoonResult {
            success: true,
            stdout: stdout.into(),
            ..Default::default()
        }
    }

    pub fn failed(stderr: impl Into<String>) -> Self {
        CocoonResult {
            success: false,
            stderr: stderr.into(),
            ..Default::default()
        }
    }

    /// One-line error text for messages.
    pub fn error_text(&self) -> String {
        if self.timed_out {
            return "cocoon timed out".into();
        }
        let text = if self.stderr.trim().is_empty() {
            self.stdout.trim()
        } else {
            self.stderr.trim()
        };
        let text = text.lines().last().unwrap_or("").trim();
        if text.is_empty() {
            "cocoon failed".into()
        } else {
            crate::provider::truncate_bytes(text, 400)
        }
    }

    /// What a failed call means, by the cocoon contract's classification (the error texts are
    /// known only to the vm room); `None` when the call succeeded. A daemon result carries the
    /// classification for the verb that ran; a result made by hand is classified for `verb`.
    pub fn error_kind(&self, verb: Verb) -> Option<ErrorKind> {
        if self.success {
            return None;
        }
        if let Some(kind) = &self.kind {
            return Some(kind.clone());
        }
        if self.timed_out {
            return Some(ErrorKind::TimedOut);
        }
        Some(crate::vm::classify(
            verb,
            &format!("{}\n{}", self.stderr, self.stdout),
        ))
    }

    /// The VM is authoritatively absent (`vm not found` / `no such vm`).
    pub fn vm_not_found(&self) -> bool {
        self.error_kind(Verb::VmInspect) == Some(ErrorKind::VmNotFound)
    }

    /// The snapshot is authoritatively absent.
    pub fn snapshot_not_found(&self) -> bool {
        self.error_kind(Verb::SnapshotInspect) == Some(ErrorKind::SnapshotNotFound)
    }

    /// The image is authoritatively absent.
    pub fn image_not_found(&self) -> bool {
        self.error_kind(Verb::ImageInspect) == Some(ErrorKind::ImageNotFound)
    }

    /// A create or save collided with an existing name.
    pub fn name_taken(&self) -> bool {
        matches!(
            self.error_kind(Verb::SnapshotSave),
            Some(ErrorKind::SnapshotNameTaken { .. })
        )
    }
}

/// One NIC of a VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicInfo {
    pub tap: String,
    pub mac: String,
    /// Static address from inspect's `network.ip`; empty ⇒ DHCP.
    pub static_ip: String,
    /// Prefix length and gateway of the static address (0 / empty when absent).
    pub prefix: u64,
    pub gateway: String,
}

/// The fields of cocoon's VM JSON object that the provider uses.
///
/// Not [`crate::vm::Vm`] on purpose: that is the wire record (every field, as cocoon spells
/// it); this is the core's reading of it, made once: the state parsed, MACs lower-cased,
/// each NIC's static address flattened, a cloud-image overlay recognised, and the disk of a
/// macOS guest, which no cocoon record has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmInfo {
    pub id: String,
    pub name: String,
    pub hypervisor: String,
    pub state: VmState,
    pub pid: i64,
    pub nics: Vec<NicInfo>,
    /// A disk of the VM is a cloud image's qcow2 overlay: the guest runs cloud-init, which
    /// the post-clone fix-up re-runs instead of writing networkd files.
    pub cloud_image: bool,
    /// A macOS guest's disk file (its size is the disk stat); empty for cocoon's VMs.
    pub disk: String,
}

impl VmInfo {
    pub fn primary_mac(&self) -> String {
        self.nics.first().map(|n| n.mac.clone()).unwrap_or_default()
    }

    /// Primary IP as reported by cocoon (static NIC address), else empty.
    pub fn primary_ip(&self) -> String {
        self.nics
            .first()
            .map(|n| n.static_ip.clone())
            .unwrap_or_default()
    }

    pub fn running(&self) -> bool {
        self.state == VmState::Running
    }

    /// MACs to release after removal: every non-static NIC (trimmed, lower-cased, de-duplicated).
    pub fn lease_macs(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for n in &self.nics {
            let m = n.mac.trim().to_ascii_lowercase();
            if n.static_ip.is_empty() && !m.is_empty() && !out.contains(&m) {
                out.push(m);
            }
        }
        out
    }
}

impl From<crate::vm::Vm> for VmInfo {
    fn from(vm: crate::vm::Vm) -> Self {
        let cloud_image = vm
            .storage_configs
            .iter()
            .any(|s| s.path.ends_with("/overlay.qcow2"));
        VmInfo {
            disk: String::new(),
            cloud_image,
            id: vm.id,
            name: vm.config.name,
            hypervisor: vm.hypervisor,
            state: VmState::parse(&vm.state),
            pid: vm.pid,
            nics: vm
                .network_configs
                .into_iter()
                .map(|n| {
                    let addr = n.network.unwrap_or_default();
                    NicInfo {
                        tap: n.tap,
                        mac: n.mac.to_ascii_lowercase(),
                        static_ip: addr.ip,
                        prefix: addr.prefix,
                        gateway: addr.gateway,
                    }
                })
                .collect(),
        }
    }
}

/// The successful output of a `verb` call, as the contract's parsers take it.
fn succeeded(verb: Verb, argv: Vec<String>, stdout: &str) -> (CocoonCall, CallOutcome) {
    let call = CocoonCall::new(verb, argv, &Deadlines::default());
    (call, CallOutcome::ok(stdout.as_bytes()))
}

/// The message of a parse failure, as the provider reports it.
fn parse_failure(what: &str, e: crate::vm::CocoonError) -> String {
    match e.kind {
        ErrorKind::InvalidJson(why) => format!("bad {what} JSON from cocoon: {why}"),
        ErrorKind::EmptyRecord => format!("empty {what} record in JSON payload"),
        _ => e.to_string(),
    }
}

/// Parse one VM object (inspect / clone / run output) with the contract's parser. Empty id ⇒
/// error.
pub fn parse_vm(json: &str) -> Result<VmInfo, String> {
    let (call, out) = succeeded(Verb::VmInspect, argv::vm_inspect("-"), json);
    crate::vm::parse_vm(&call, &out)
        .map(VmInfo::from)
        .map_err(|e| parse_failure("VM", e))
}

/// Parse `vm list -o json` with the contract's parser: empty output, `null`, B's
/// `No VMs found.`, or an array. Every caller concludes from a name's absence (startup evicts
/// or adopts, the re-sync reports a VM gone), so a listing with an entry it could not read is
/// an error: the caller retries rather than take a VM for gone.
pub fn parse_vm_list(out: &str) -> Result<Vec<VmInfo>, String> {
    let (call, out) = succeeded(Verb::VmList, argv::vm_list(), out);
    let listing = crate::vm::parse_vm_list(&call, &out).map_err(|e| parse_failure("VM list", e))?;
    complete(listing, "VM list").map(|vms| vms.into_iter().map(VmInfo::from).collect())
}

/// A listing whose every entry was read, or the error that says how many were not.
fn complete<T>(listing: crate::vm::Listing<T>, what: &str) -> Result<Vec<T>, String> {
    if listing.complete() {
        Ok(listing.items)
    } else {
        Err(format!(
            "{what} from cocoon: {} entries could not be read; a partial listing proves nothing gone",
            listing.skipped
        ))
    }
}

/// Parse `snapshot inspect` with the contract's parser. Empty id ⇒ error.
pub fn parse_snapshot(json: &str) -> Result<Snapshot, String> {
    let (call, out) = succeeded(Verb::SnapshotInspect, argv::snapshot_inspect("-"), json);
    crate::vm::parse_snapshot(&call, &out).map_err(|e| parse_failure("snapshot", e))
}

/// Parse `snapshot list -o json` with the contract's parser, the same rule as `vm list`:
/// empty output, `null` or B's `No snapshots found.` is an empty list, and a listing with an
/// entry it could not read is an error (the reclaimer forgets the owner records of snapshots
/// a listing does not show).
pub fn parse_snapshot_list(out: &str) -> Result<Vec<Snapshot>, String> {
    let (call, out) = succeeded(Verb::SnapshotList, argv::snapshot_list(), out);
    let listing = crate::vm::parse_snapshot_list(&call, &out)
        .map_err(|e| parse_failure("snapshot list", e))?;
    complete(listing, "snapshot list")
}

/// `vm reconcile-stale-create` outcome with the contract's parser; an empty outcome is an
/// error.
pub fn parse_stale_outcome(json: &str) -> Result<StaleCreateOutcome, String> {
    let (call, out) = succeeded(
        Verb::VmReconcileStaleCreate,
        argv::vm_reconcile_stale_create("-"),
        json,
    );
    crate::vm::parse_stale_create_outcome(&call, &out)
        .map_err(|e| parse_failure("reconcile-stale-create", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_argv_follows_the_n_generation_order() {
        let cmd = CocoonCmd::VmClone(CloneOptions {
            name: "vk-ns-demo-0".into(),
            network: "net1".into(),
            no_direct_io: true,
            pull: true,
            restore_mode: Some(crate::vm::RestoreMode::Mmap),
            cpu: CpuPolicy {
                weight: 79,
                quota_us: 200000,
                period_us: 100000,
            },
            ..CloneOptions::from_snapshot("team/agent:v3")
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm clone --output json --name vk-ns-demo-0 --network net1 --no-direct-io --pull \
             --restore-mode mmap --cpu-weight 79 --cpu-quota-us 200000 --cpu-period-us 100000 -- team/agent:v3"
        );
    }

    #[test]
    fn clone_from_dir_implies_pull_and_ends_with_the_dir() {
        let cmd = CocoonCmd::VmClone(CloneOptions {
            name: "a".into(),
            cpu: CpuPolicy {
                weight: 1,
                ..Default::default()
            },
            source: CloneSource::FromDir("/srv/snap".into()),
            ..CloneOptions::from_snapshot("")
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm clone --output json --name a --pull --cpu-weight 1 --from-dir /srv/snap"
        );
    }

    #[test]
    fn run_argv_has_flags_before_image() {
        let cmd = CocoonCmd::VmRun(RunOptions {
            name: "v".into(),
            cpu: 2,
            cpu_policy: CpuPolicy {
                weight: 79,
                ..Default::default()
            },
            memory: "4294967296".into(),
            backend: Backend::Firecracker,
            image: "ubuntu:24.04".into(),
            ..Default::default()
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm run --output json --name v --cpu 2 --cpu-weight 79 --memory 4294967296 --fc -- ubuntu:24.04"
        );
    }

    #[test]
    fn parses_vm_with_static_and_dhcp_nics() {
        let vm = parse_vm(
            r#"{"id":"ABC","hypervisor":"cloud-hypervisor","state":"running","pid":7,
                "config":{"name":"vk-a-b-0"},"network_configs":[
                {"tap":"t0","mac":"02:AA:00:00:00:01"},
                {"tap":"t1","mac":"02:aa:00:00:00:02","network":{"ip":"10.0.0.2","prefix":24}}],
                "unknown":1}"#,
        )
        .unwrap();
        assert_eq!(vm.name, "vk-a-b-0");
        assert_eq!(vm.primary_mac(), "02:aa:00:00:00:01");
        assert_eq!(vm.primary_ip(), "");
        assert_eq!(vm.lease_macs(), vec!["02:aa:00:00:00:01".to_string()]);
        assert!(parse_vm(r#"{"id":""}"#).is_err());
        assert!(parse_vm("not json").is_err());
    }

    #[test]
    fn vm_list_accepts_empty_forms() {
        assert!(parse_vm_list("No VMs found.\n").unwrap().is_empty());
        assert!(parse_vm_list("").unwrap().is_empty());
        let l = parse_vm_list(r#"[{"id":"a","state":"running"},{"id":"b"}]"#).unwrap();
        assert_eq!(l.len(), 2);
        // An entry it cannot read makes the listing prove nothing gone: an error, not a list
        // that would have the daemon take that VM (or snapshot) for gone.
        for partial in [
            r#"[{"id":"a","state":"running"},{"state":"x"}]"#,
            r#"[{"id":"a","state":"running"},42]"#,
        ] {
            let e = parse_vm_list(partial).unwrap_err();
            assert!(e.contains("1 entries could not be read"), "{e}");
        }
        let e = parse_snapshot_list(r#"[{"id":"s1","name":"vk-a"},{"name":"vk-b"}]"#).unwrap_err();
        assert!(e.contains("could not be read"), "{e}");
        assert_eq!(
            parse_snapshot_list(r#"[{"id":"s1","name":"vk-a"}]"#).unwrap()[0].name,
            "vk-a"
        );
    }

    #[test]
    fn classifies_not_found_texts() {
        assert!(CocoonResult::failed("Error: inspect: vm x: VM not found").vm_not_found());
        assert!(!CocoonResult::failed("VM not running").vm_not_found());
        assert!(CocoonResult::failed("inspect: snapshot not found").snapshot_not_found());
        assert!(CocoonResult::failed("image \"x\": Not found in any backend").image_not_found());
        assert!(!CocoonResult::ok("vm not found").vm_not_found());
    }

    #[test]
    fn stale_outcome_requires_value() {
        assert_eq!(
            parse_stale_outcome(r#"{"id":"a","outcome":"busy"}"#).unwrap(),
            StaleCreateOutcome::Busy
        );
        assert!(parse_stale_outcome(r#"{"id":"a"}"#).is_err());
    }
}
