//! A finished cocoon call as the core reads it: succeeded with its output, or failed with one
//! classified [`ErrorKind`]; and the core's typed readings of that output (VM, listings).
//! Classifies and parses; never runs a child.

use std::fmt;

use super::call::{CallOutcome, CocoonCall, Deadlines, ExitKind, Listing, Verb};
use super::error::{classify, CocoonError, ErrorKind};
use super::types::{Snapshot, StaleCreateOutcome, VmState};
use super::{argv, Vm};
use crate::reactor::ChildExit;

/// How long the one-line error text of a failed call may get, in bytes.
const ERROR_LINE_LIMIT: usize = 400;

/// The answer to one cocoon call: its stdout and, when it failed, what the failure means.
/// Made once per finished call by [`Answer::of`]; the core matches on [`Answer::kind`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    /// What the call printed (a JSON verb's record on success), read by [`Answer::vm`] and
    /// its siblings.
    pub stdout: String,
    /// `None`: the call succeeded.
    failure: Option<Failure>,
}

/// Why a call failed: the contract's classification, and cocoon's stderr (with the daemon's
/// notes for what stderr does not say) for the messages.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    kind: ErrorKind,
    stderr: String,
}

impl Answer {
    /// The one classification of a finished call: the contract's for the verb that ran
    /// ([`CocoonCall::check`]), output beyond the capture limit a failure. Notes for what
    /// stderr does not say (a signal, a lost status, truncation) are appended for the messages.
    pub fn of(call: &CocoonCall, out: &CallOutcome) -> Self {
        let mut kind = call.check(out).err().map(|e| e.kind);
        let mut stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.stdout_truncated {
            stderr.push_str("\nvk-cocoon: cocoon output exceeded the capture limit");
            kind.get_or_insert(ErrorKind::HugeOutput);
        }
        match kind {
            // `CallOutcome::from_exit`'s stand-in for a status the reactor could not learn.
            Some(ErrorKind::Other) if out.exit == ExitKind::Code(-1) => {
                stderr.push_str("\nvk-cocoon: cocoon exit status unknown")
            }
            Some(ErrorKind::Signalled(sig)) => {
                stderr.push_str(&format!("\nvk-cocoon: cocoon killed by signal {sig}"))
            }
            _ => {}
        }
        Answer {
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            failure: kind.map(|kind| Failure { kind, stderr }),
        }
    }

    /// The answer of a call the reactor ran: [`Answer::of`] its exit, or
    /// [`ErrorKind::Spawn`] when the child could not be started.
    pub fn of_exit(call: &CocoonCall, exit: &ChildExit) -> Self {
        if let Some(e) = &exit.spawn_error {
            return Answer::not_started(format!("Error: run cocoon: {e}"));
        }
        Answer::of(call, &CallOutcome::from_exit(exit.clone()))
    }

    /// A call that succeeded with this output.
    pub fn ok(stdout: impl Into<String>) -> Self {
        Answer {
            stdout: stdout.into(),
            failure: None,
        }
    }

    /// A call that failed of `kind`, with this stderr.
    pub fn failure(kind: ErrorKind, stderr: impl Into<String>) -> Self {
        Answer {
            stdout: String::new(),
            failure: Some(Failure {
                kind,
                stderr: stderr.into(),
            }),
        }
    }

    /// A call that failed with this stderr, classified by the error texts cocoon prints (a
    /// replayed or scripted answer: the daemon's own are made by [`Answer::of`]).
    pub fn failed(stderr: impl Into<String>) -> Self {
        let stderr = stderr.into();
        Answer::failure(classify(Verb::VmInspect, &stderr), stderr)
    }

    /// A call that was never started (refused argv, no process): [`ErrorKind::Spawn`].
    pub fn not_started(why: impl Into<String>) -> Self {
        let why = why.into();
        Answer::failure(ErrorKind::Spawn(why.clone()), why)
    }

    /// A call killed at its deadline.
    pub fn timed_out_call() -> Self {
        Answer::failure(ErrorKind::TimedOut, "")
    }

    /// The same failure read by another contract's rule (cocoon-macos words a missing VM its
    /// own way): its kind replaced, its text kept. A success stays one.
    pub fn reclassified(mut self, kind: ErrorKind) -> Self {
        if let Some(f) = self.failure.as_mut() {
            f.kind = kind;
        }
        self
    }

    pub fn succeeded(&self) -> bool {
        self.failure.is_none()
    }

    /// What the failure means; `None` when the call succeeded.
    pub fn kind(&self) -> Option<&ErrorKind> {
        self.failure.as_ref().map(|f| &f.kind)
    }

    /// Killed at its deadline.
    pub fn timed_out(&self) -> bool {
        self.kind() == Some(&ErrorKind::TimedOut)
    }

    /// cocoon's stderr of a failed call (empty on success).
    pub fn stderr(&self) -> &str {
        self.failure.as_ref().map_or("", |f| f.stderr.as_str())
    }

    /// One-line error text for messages.
    pub fn error_text(&self) -> String {
        if self.timed_out() {
            return "cocoon timed out".into();
        }
        let text = if self.stderr().trim().is_empty() {
            self.stdout.trim()
        } else {
            self.stderr().trim()
        };
        let text = text.lines().last().unwrap_or("").trim();
        if text.is_empty() {
            return "cocoon failed".into();
        }
        let mut end = text.len().min(ERROR_LINE_LIMIT);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text[..end].to_string()
    }

    /// The VM is authoritatively absent (`vm not found` / `no such vm`).
    pub fn vm_not_found(&self) -> bool {
        self.kind() == Some(&ErrorKind::VmNotFound)
    }

    /// The snapshot is authoritatively absent.
    pub fn snapshot_not_found(&self) -> bool {
        self.kind() == Some(&ErrorKind::SnapshotNotFound)
    }

    /// The image is authoritatively absent.
    pub fn image_not_found(&self) -> bool {
        self.kind() == Some(&ErrorKind::ImageNotFound)
    }

    /// A create or save collided with an existing name.
    pub fn name_taken(&self) -> bool {
        matches!(self.kind(), Some(ErrorKind::SnapshotNameTaken { .. }))
    }

    /// The output as one VM object (inspect / clone / run).
    pub fn vm(&self) -> Result<VmInfo, ReadError> {
        read_vm(&self.stdout)
    }

    /// The output as a snapshot record (`snapshot inspect`).
    pub fn snapshot(&self) -> Result<Snapshot, ReadError> {
        read_snapshot(&self.stdout)
    }

    /// The output as a complete snapshot listing (`snapshot list`).
    pub fn snapshot_list(&self) -> Result<Vec<Snapshot>, ReadError> {
        read_snapshot_list(&self.stdout)
    }

    /// The output as a `vm reconcile-stale-create` outcome.
    pub fn stale_outcome(&self) -> Result<StaleCreateOutcome, ReadError> {
        read_stale_outcome(&self.stdout)
    }
}

/// Why a call's output could not be read as the record the verb promises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// Not the JSON the verb promises.
    InvalidJson { what: &'static str, why: String },
    /// A record with an empty `id`.
    EmptyRecord { what: &'static str },
    /// A listing with entries it could not read: it proves nothing gone.
    Partial { what: &'static str, skipped: usize },
    /// Any other failure the contract's parser reports.
    Contract(CocoonError),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::InvalidJson { what, why } => write!(f, "bad {what} JSON from cocoon: {why}"),
            ReadError::EmptyRecord { what } => write!(f, "empty {what} record in JSON payload"),
            ReadError::Partial { what, skipped } => write!(
                f,
                "{what} from cocoon: {skipped} entries could not be read; a partial listing proves nothing gone"
            ),
            ReadError::Contract(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ReadError {}

impl ReadError {
    fn of(what: &'static str, e: CocoonError) -> Self {
        match e.kind {
            ErrorKind::InvalidJson(why) => ReadError::InvalidJson { what, why },
            ErrorKind::EmptyRecord => ReadError::EmptyRecord { what },
            _ => ReadError::Contract(e),
        }
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
/// Not [`Vm`] on purpose: that is the wire record (every field, as cocoon spells it); this is
/// the core's reading of it, made once: the state parsed, MACs lower-cased, each NIC's static
/// address flattened, a cloud-image overlay recognised, and the disk of a macOS guest, which
/// no cocoon record has.
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

impl From<Vm> for VmInfo {
    fn from(vm: Vm) -> Self {
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

/// Reads one VM object (inspect / clone / run output) with the contract's parser. Empty id ⇒
/// error.
pub fn read_vm(json: &str) -> Result<VmInfo, ReadError> {
    let (call, out) = succeeded(Verb::VmInspect, argv::vm_inspect("-"), json);
    super::parse_vm(&call, &out)
        .map(VmInfo::from)
        .map_err(|e| ReadError::of("VM", e))
}

/// Reads `vm list -o json` with the contract's parser: empty output, `null`, B's
/// `No VMs found.`, or an array. Every caller concludes from a name's absence (startup evicts
/// or adopts, the re-sync reports a VM gone), so a listing with an entry it could not read is
/// an error: the caller retries rather than take a VM for gone.
pub fn read_vm_list(out: &str) -> Result<Vec<VmInfo>, ReadError> {
    let (call, out) = succeeded(Verb::VmList, argv::vm_list(), out);
    let listing = super::parse_vm_list(&call, &out).map_err(|e| ReadError::of("VM list", e))?;
    complete(listing, "VM list").map(|vms| vms.into_iter().map(VmInfo::from).collect())
}

/// A listing whose every entry was read, or the error that says how many were not.
fn complete<T>(listing: Listing<T>, what: &'static str) -> Result<Vec<T>, ReadError> {
    if listing.complete() {
        Ok(listing.items)
    } else {
        Err(ReadError::Partial {
            what,
            skipped: listing.skipped,
        })
    }
}

/// Reads `snapshot inspect` with the contract's parser. Empty id ⇒ error.
pub fn read_snapshot(json: &str) -> Result<Snapshot, ReadError> {
    let (call, out) = succeeded(Verb::SnapshotInspect, argv::snapshot_inspect("-"), json);
    super::parse_snapshot(&call, &out).map_err(|e| ReadError::of("snapshot", e))
}

/// Reads `snapshot list -o json` with the contract's parser, the same rule as `vm list`:
/// empty output, `null` or B's `No snapshots found.` is an empty list, and a listing with an
/// entry it could not read is an error (the reclaimer forgets the owner records of snapshots
/// a listing does not show).
pub fn read_snapshot_list(out: &str) -> Result<Vec<Snapshot>, ReadError> {
    let (call, out) = succeeded(Verb::SnapshotList, argv::snapshot_list(), out);
    let listing =
        super::parse_snapshot_list(&call, &out).map_err(|e| ReadError::of("snapshot list", e))?;
    complete(listing, "snapshot list")
}

/// Reads a `vm reconcile-stale-create` outcome with the contract's parser; an empty outcome
/// is an error.
pub fn read_stale_outcome(json: &str) -> Result<StaleCreateOutcome, ReadError> {
    let (call, out) = succeeded(
        Verb::VmReconcileStaleCreate,
        argv::vm_reconcile_stale_create("-"),
        json,
    );
    super::parse_stale_create_outcome(&call, &out)
        .map_err(|e| ReadError::of("reconcile-stale-create", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vm_with_static_and_dhcp_nics() {
        let vm = read_vm(
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
        assert!(read_vm(r#"{"id":""}"#).is_err());
        assert!(read_vm("not json").is_err());
    }

    #[test]
    fn vm_list_accepts_empty_forms() {
        assert!(read_vm_list("No VMs found.\n").unwrap().is_empty());
        assert!(read_vm_list("").unwrap().is_empty());
        let l = read_vm_list(r#"[{"id":"a","state":"running"},{"id":"b"}]"#).unwrap();
        assert_eq!(l.len(), 2);
        // An entry it cannot read makes the listing prove nothing gone: an error, not a list
        // that would have the daemon take that VM (or snapshot) for gone.
        for partial in [
            r#"[{"id":"a","state":"running"},{"state":"x"}]"#,
            r#"[{"id":"a","state":"running"},42]"#,
        ] {
            let e = read_vm_list(partial).unwrap_err().to_string();
            assert!(e.contains("1 entries could not be read"), "{e}");
        }
        let e = read_snapshot_list(r#"[{"id":"s1","name":"vk-a"},{"name":"vk-b"}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("could not be read"), "{e}");
        assert_eq!(
            read_snapshot_list(r#"[{"id":"s1","name":"vk-a"}]"#).unwrap()[0].name,
            "vk-a"
        );
    }

    #[test]
    fn classifies_not_found_texts() {
        assert!(Answer::failed("Error: inspect: vm x: VM not found").vm_not_found());
        assert!(!Answer::failed("VM not running").vm_not_found());
        assert!(Answer::failed("inspect: snapshot not found").snapshot_not_found());
        assert!(Answer::failed("image \"x\": Not found in any backend").image_not_found());
        assert!(!Answer::ok("vm not found").vm_not_found());
    }

    #[test]
    fn stale_outcome_requires_value() {
        assert_eq!(
            read_stale_outcome(r#"{"id":"a","outcome":"busy"}"#).unwrap(),
            StaleCreateOutcome::Busy
        );
        assert!(read_stale_outcome(r#"{"id":"a"}"#).is_err());
    }
}
