//! The core's view of cocoon: the calls it asks for, mapped onto the vm room's argv builders,
//! deadlines, parsers and error classification (vm alone spells the CLI). Never runs a child.

use std::time::Duration;

use crate::vm::argv;
pub use crate::vm::{
    Backend, CloneOptions, CloneSource, CpuPolicy, Deadlines, ErrorKind, RunOptions,
    StaleCreateOutcome, Verb, VmState,
};
use crate::vm::{CallOutcome, CocoonCall};

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
}

/// Raw outcome of a cocoon child, as the daemon saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CocoonResult {
    /// Exit status 0.
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    /// Killed at its deadline.
    pub timed_out: bool,
}

impl CocoonResult {
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

    /// What a failed call means, by the cocoon contract's classification for `verb` (the
    /// error texts are known only to the vm room); `None` when the call succeeded.
    pub fn error_kind(&self, verb: Verb) -> Option<ErrorKind> {
        if self.success {
            return None;
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
        ErrorKind::EmptyRecord => "empty VM record in JSON payload".into(),
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
/// `No VMs found.`, or an array (entries without id, or undecodable, skipped).
pub fn parse_vm_list(out: &str) -> Result<Vec<VmInfo>, String> {
    let (call, out) = succeeded(Verb::VmList, argv::vm_list(), out);
    crate::vm::parse_vm_list(&call, &out)
        .map(|vms| vms.into_iter().map(VmInfo::from).collect())
        .map_err(|e| parse_failure("VM list", e))
}

/// `snapshot inspect` fields the provider reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: String,
    pub name: String,
    pub image: String,
    pub image_digest: String,
    pub image_type: String,
    pub hypervisor: String,
}

/// Parse `snapshot inspect` with the contract's types.
pub fn parse_snapshot(json: &str) -> Result<SnapshotInfo, String> {
    let s: crate::vm::Snapshot = serde_json::from_str(json.trim())
        .map_err(|e| format!("bad snapshot JSON from cocoon: {e}"))?;
    Ok(SnapshotInfo {
        id: s.id,
        name: s.name,
        image: s.image,
        image_digest: s.image_digest,
        image_type: s.image_type,
        hypervisor: s.hypervisor,
    })
}

/// Parse `snapshot list -o json`: an array of snapshot objects; B's `No snapshots found.` text
/// (or nothing) is an empty list.
pub fn parse_snapshot_list(out: &str) -> Result<Vec<SnapshotInfo>, String> {
    let t = out.trim();
    if t.is_empty() || t.starts_with("No snapshots") {
        return Ok(Vec::new());
    }
    let list: Vec<crate::vm::Snapshot> =
        serde_json::from_str(t).map_err(|e| format!("bad snapshot list JSON from cocoon: {e}"))?;
    Ok(list
        .into_iter()
        .map(|s| SnapshotInfo {
            id: s.id,
            name: s.name,
            image: s.image,
            image_digest: s.image_digest,
            image_type: s.image_type,
            hypervisor: s.hypervisor,
        })
        .collect())
}

/// `vm reconcile-stale-create` outcome as the contract's type; an empty outcome is an error.
pub fn parse_stale_outcome(json: &str) -> Result<StaleCreateOutcome, String> {
    let report: crate::vm::types::StaleCreateReport = serde_json::from_str(json.trim())
        .map_err(|e| format!("bad reconcile-stale-create JSON: {e}"))?;
    if report.outcome.is_empty() {
        return Err("reconcile-stale-create returned an empty outcome".into());
    }
    Ok(StaleCreateOutcome::parse(&report.outcome))
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
        let l = parse_vm_list(r#"[{"id":"a","state":"running"},{"state":"x"}]"#).unwrap();
        assert_eq!(l.len(), 1);
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
