//! The pure lifecycle core: pod events, cocoon results, VM events and timers in; effects out.
//! It never reads a clock, a file or a socket; the daemon performs its effects.
//!
//! # Protocol (what the daemon must do)
//!
//! Build one [`Provider`] with [`ProviderConfig`]. Every input goes through
//! [`Provider::handle`]`(input, now, wall)` which returns the effects to perform, in order.
//! `now` is the loop's monotonic clock; `wall` the wall clock (used only for status
//! timestamps). After every call, re-arm one reactor timer at [`Provider::poll_timeout`] and
//! feed [`Input::Tick`] when it fires: the core keeps all its own timers (backoffs, drift
//! republish, lifecycle re-flush, IP waits, deferred rechecks, restart cooldowns).
//!
//! Inputs, who sends them:
//! * [`Input::StartupListed`] once, after listing pods (`spec.nodeName=<node>`) and
//!   `cocoon vm list -o json` (read with [`crate::vm::read_vm_list`]), with the ownership
//!   ledger as the daemon loaded it ([`owners::Owners`]). Pod events that arrive before it are
//!   buffered. A provider restart = a new `Provider` fed a fresh `StartupListed`.
//! * [`Input::PodUpserted`] / [`Input::PodDeleted`] from the watch (ADDED/MODIFIED, DELETED).
//!   After a watch re-list send [`Input::PodsRelisted`] with the whole list: pods that vanished
//!   meanwhile are handled as deleted (relist tombstones count as deletions).
//! * [`Input::VmEvent`] for each parsed line of `cocoon vm status --event --format json`;
//!   [`Input::EventStreamRestarted`] each time that stream is started again.
//! * [`Input::Readiness`] from the probe module (key, uid, ready, message, resolved ip).
//!
//! Effects and the result each one owes back (same `op` id):
//! * [`Effect::Cocoon`] `{op, cmd}`: run `cocoon` with `cmd.argv()` (deadline `cmd.deadline()`),
//!   answer [`Input::CocoonDone`] `{op, result}` with the vm room's [`Answer`] of the finished
//!   call ([`Answer::of`]); the core matches on its error kind and reads its records. A
//!   [`CocoonCmd::Macos`] call runs `VK_COCOON_MACOS_BIN` instead, with the VM's VNC
//!   password in the child's environment (`cmd.child_env(secret)`), never on its argv.
//! * [`Effect::CheckPid`] `{op, pid}`: is that process alive (not a zombie)? Answer
//!   [`Input::PidChecked`] (a macOS guest's QEMU).
//! * [`Effect::ReadVmPid`] `{op, vm_id, firecracker}`: read the hypervisor's PID from the
//!   VM's pid file in cocoon's run dir; answer [`Input::VmPidRead`] (a live PID, a dead one,
//!   no file, or no run directory where the daemon looks).
//! * [`Effect::CheckSource`] `{op, check}`: check a source the pod names on the host, off the
//!   loop (resolve an http(s) image URL's host and judge every address with
//!   [`sources::check_resolved`]; walk a clone-from-dir below its root with lstat: no symlink);
//!   answer [`Input::SourceChecked`] with a [`SourceVerdict`].
//! * [`Effect::LookupLease`] `{op, mac}`: look the MAC up in the cocoon-net lease file, answer
//!   [`Input::LeaseLooked`] (a [`LeaseError`] when the file cannot answer).
//! * [`Effect::PatchPodStatus`], [`Effect::PatchPodAnnotations`], [`Effect::DeletePod`]: kube
//!   calls (status: JSON merge patch on pods/status with `{"metadata":{"uid":..},"status":..}`;
//!   annotations: merge patch of `metadata.annotations` (None = null = delete) carrying
//!   `metadata.uid` when `uid` is Some; delete: with `preconditions.uid` and the grace given).
//!   Answer [`Input::KubeDone`] `{op, result}` mapping 404/409/422 to [`KubeError`] variants.
//!   The daemon performs no retries itself; the core retries.
//! * [`Effect::PullSnapshot`], [`Effect::PushSnapshot`], [`Effect::MaterialiseImage`]: worker
//!   pool jobs (snapshots room); answer [`Input::TransferDone`] (a [`TransferError`] on failure).
//! * [`Effect::PeerRestore`]: a worker job (peer room) fetching `<vm_name>:hibernate`'s raw
//!   files from node `from_node`; answer [`Input::TransferDone`] with the staged directory for
//!   `vm clone --from-dir`, or an error.
//! * [`Effect::CheckHibernateEvidence`] `{op, vm_name}`: look the registry tag
//!   `<vm_name>:hibernate` up (a worker job); answer [`Input::HibernateEvidence`].
//! * [`Effect::ReadSnapshotTag`] `{op, repo, tag}`: the same lookup for any tag; answer
//!   [`Input::HibernateEvidence`].
//! * [`Effect::DeleteSnapshotTag`] `{op, repo, tag}`: delete that manifest (404 = done);
//!   answer [`Input::TransferDone`].
//! * [`Effect::RecordOwners`] `{op, changes}`: apply the changes to the ownership ledger on
//!   disk (atomically, in the order asked), answer [`Input::OwnersRecorded`] once they are
//!   durable. The core waits for it before the cocoon call that creates what it records.
//! * [`Effect::SacPass`] `{op, vm_id, plan}`: run the Windows SAC static-IP pass on the VM's
//!   console socket (a thread of its own); answer [`Input::SacDone`].
//! * Fire-and-forget (no answer): [`Effect::Event`], [`Effect::StartProbe`],
//!   [`Effect::StopProbe`], [`Effect::ReleaseLeases`], [`Effect::RemoveStagedDir`],
//!   [`Effect::Metric`].

pub mod core;
pub mod fixup;
pub mod lifecycle;
pub mod naming;
pub mod owners;
pub mod sources;
pub mod spec;
pub mod status;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodStatus};

pub use self::core::Provider;
pub use crate::vm::{Answer, CocoonCmd, VmInfo};

/// `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl PodKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        PodKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// Key of a pod object (empty strings when metadata is missing).
    pub fn of(pod: &Pod) -> Self {
        PodKey::new(
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        )
    }
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Correlates an effect with the input that answers it. Unique for the provider's lifetime.
pub type OpId = u64;

/// What the orphan policy (VK_ORPHAN_POLICY) does with a VM no pod claims at startup; the
/// configuration parses it, the core reads it.
pub use crate::config::OrphanPolicy;
/// Why the lease file could not answer a lookup (the network room's typed error).
pub use crate::network::leases::LeaseError;
/// Why a registry transfer or question failed (the snapshots room's typed error).
pub use crate::snapshots::TransferError;
/// `--restore-mode` of CH clones (VK_RESTORE_MODE), the cocoon contract's type.
pub use crate::vm::RestoreMode;

#[derive(Debug, Clone)]
pub struct ProviderConfig {
    pub node_name: String,
    /// VK_SNAPSHOT_CPU_CLASS; None when unset.
    pub cpu_class: Option<String>,
    /// Whether an OCI registry is configured (snapshot pull/push, image materialisation).
    pub registry: bool,
    pub orphan_policy: OrphanPolicy,
    /// VK_RESTORE_MODE (`mmap` default); passed as `--restore-mode` on CH clones.
    pub restore_mode: RestoreMode,
    /// Whether lease release is enabled (VK_COCOON_NET_CONTROL_SOCKET not set-but-empty).
    pub lease_release: bool,
    /// COCOON_MACOS_VNC_PASSWORD is set: macOS guests get a VNC display (the secret stays with
    /// the daemon, which gives each `cocoon-macos` launch its VM's password in the environment).
    pub macos_vnc: bool,
    /// VK_IMAGE_URL_ALLOW_HOSTS: hosts http(s) image URLs may name whatever they resolve to.
    pub image_url_allow_hosts: Vec<String>,
    /// VK_CLONE_FROM_DIR_ROOT: clone-from-dir only below it; None = refused.
    pub clone_from_dir_root: Option<String>,
}

impl Default for ProviderConfig {
    fn default() -> Self {
        ProviderConfig {
            node_name: "cocoon-pool".into(),
            cpu_class: None,
            registry: false,
            orphan_policy: OrphanPolicy::Destroy,
            restore_mode: RestoreMode::Mmap,
            lease_release: true,
            macos_vnc: false,
            image_url_allow_hosts: Vec::new(),
            clone_from_dir_root: None,
        }
    }
}

/// A source a pod names that the host would reach, checked on the host before it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceCheck {
    /// Resolve `host`, the host of http(s) image `url`: every address must be allowed.
    ImageHost { url: String, host: String },
    /// Walk clone-from-dir `dir` from `root` down: no symlink, and a directory at the end.
    CloneDir { dir: String, root: String },
}

/// The daemon's answer to [`Effect::CheckSource`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceVerdict {
    Allowed,
    /// The source breaks a rule: the pod fails for good; the message names the rule and the
    /// setting that changes it.
    Refused(String),
    /// The host could not tell (a resolver error): the create fails and is retried.
    Unavailable(String),
}

/// What a registry tag's manifest says (`<vm>:hibernate`, or any tag read with
/// [`Effect::ReadSnapshotTag`]); each field empty when absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HibernateTag {
    /// Manifest annotation `cocoonstack.snapshot.baseimage`.
    pub base_image: String,
    /// The config blob's `snapshotId`: the local snapshot this tag was pushed from.
    pub snapshot_id: String,
    /// Manifest annotation `cocoonstack.snapshot.from-node`.
    pub from_node: String,
    /// Manifest annotations `cocoonstack.snapshot.owner-namespace` / `owner-pod-uid`: whose
    /// VM snapshot this is (empty for a base image, or a snapshot pushed before owners were).
    pub owner_namespace: String,
    pub owner_pod_uid: String,
    /// `sha256:` digest of the manifest as read: a pull of exactly what was checked.
    pub digest: String,
}

/// Kubernetes API failure classes the core distinguishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeError {
    /// 404.
    NotFound,
    /// 409 (includes a failed uid precondition).
    Conflict,
    /// 422.
    Invalid,
    /// Anything else (429, 5xx, transport); retried by the core.
    Other(String),
}

impl KubeError {
    /// NotFound / Conflict / Invalid mean "the object is gone or another incarnation": never retried.
    pub fn superseded(&self) -> bool {
        !matches!(self, KubeError::Other(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// One event line of `cocoon vm status --event --format json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmEventKind {
    Added,
    Modified,
    Deleted,
}

/// Metric movements; the daemon applies them to the metrics registry (which adds the prefix).
#[derive(Debug, Clone, PartialEq)]
pub enum MetricUpdate {
    /// `pod_lifecycle_total{op,result,reason}`.
    PodLifecycle {
        op: &'static str,
        result: &'static str,
        reason: &'static str,
    },
    /// `vm_boot_duration_seconds{namespace,mode,backend}`.
    VmBootDuration {
        namespace: String,
        mode: String,
        backend: String,
        seconds: f64,
    },
    /// `orphan_vm_total`.
    OrphanVm,
    /// `vm_inspect_transient_fail_total`.
    VmInspectTransientFail,
    /// `pod_evict_failure_total`.
    PodEvictFailure,
    /// `reconcile_adopt_by_name_total`.
    ReconcileAdoptByName,
    /// `stale_create_reconcile_total{outcome}`.
    StaleCreateReconcile { outcome: String },
    /// `startup_resume_total{op}`.
    StartupResume { op: &'static str },
    /// `snapshot_pull_total{result}`.
    SnapshotPull { result: &'static str },
    /// `snapshot_save_total{result}`.
    SnapshotSave { result: &'static str },
    /// `snapshot_push_total{result}`.
    SnapshotPush { result: &'static str },
    /// `hibernate_evidence_total{verdict}`.
    HibernateEvidence { verdict: &'static str },
    /// `snapshot_verify_total{result}`: a local hibernate snapshot checked against the tag.
    SnapshotVerify { result: &'static str },
    /// `snapshot_save_duration_seconds{namespace}`.
    SnapshotSaveDuration { namespace: String, seconds: f64 },
    /// `hibernate_total{namespace,phase,result}`.
    Hibernate {
        namespace: String,
        phase: &'static str,
        result: &'static str,
    },
    /// `wake_total{result}`.
    Wake { result: &'static str },
    /// `clone_from_dir_total{result}`.
    CloneFromDir { result: &'static str },
    /// `lease_release_total{result}` is counted by whoever performs ReleaseLeases.
    /// `wake_ip_wait_total{namespace,result}`.
    WakeIpWait {
        namespace: String,
        result: &'static str,
    },
    /// `postclone_total{kind,result}`.
    PostClone {
        kind: &'static str,
        result: &'static str,
    },
    /// `postclone_retry_attempts{result}` observes the attempts a fix-up took.
    PostCloneAttempts { result: &'static str, attempts: u32 },
    /// `wake_renew_nudge_total{result}`.
    WakeRenewNudge { result: &'static str },
    /// `vm_restarts_total{namespace,pod}`: the pod's stopped VM is being started again.
    VmRestart { namespace: String, pod: String },
}

/// Why a pod was evicted; also the terminated container's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictReason {
    VmGone,
    RestartCooldown,
    RestartFailed,
    VmInspectTimeout,
}

impl EvictReason {
    pub const ALL: [EvictReason; 4] = [
        EvictReason::VmGone,
        EvictReason::RestartCooldown,
        EvictReason::RestartFailed,
        EvictReason::VmInspectTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EvictReason::VmGone => "VMGone",
            EvictReason::RestartCooldown => "RestartCooldown",
            EvictReason::RestartFailed => "RestartFailed",
            EvictReason::VmInspectTimeout => "VMInspectTimeout",
        }
    }
}

/// Everything that happens to the provider.
#[derive(Debug, Clone)]
pub enum Input {
    /// Startup reconcile material: all pods bound to this node and `cocoon vm list`.
    StartupListed {
        pods: Vec<Pod>,
        vms: Vec<VmInfo>,
        /// The ownership ledger as the daemon loaded it.
        owners: owners::Owners,
    },
    /// Watch ADDED / MODIFIED.
    PodUpserted(Box<Pod>),
    /// Watch DELETED.
    PodDeleted(Box<Pod>),
    /// Full list after a watch re-list; tracked pods missing from it are treated as deleted.
    PodsRelisted(Vec<Pod>),
    CocoonDone {
        op: OpId,
        result: Answer,
    },
    LeaseLooked {
        op: OpId,
        /// Ok(None) = no (unexpired) lease; Err = the lease file could not be read.
        result: Result<Option<String>, LeaseError>,
    },
    KubeDone {
        op: OpId,
        result: Result<(), KubeError>,
    },
    TransferDone {
        op: OpId,
        /// For MaterialiseImage: Ok(boot reference to pass to `vm run`). Others: Ok(String::new()).
        result: Result<String, TransferError>,
    },
    /// Answer to [`Effect::CheckHibernateEvidence`]: Ok(None) = no `hibernate` tag (404),
    /// Ok(Some(tag)) = the tag exists, Err = registry error.
    HibernateEvidence {
        op: OpId,
        result: Result<Option<HibernateTag>, TransferError>,
    },
    /// Answer to [`Effect::SacPass`].
    SacDone {
        op: OpId,
        result: Result<(), crate::guest::sac::SacError>,
    },
    /// Answer of [`Effect::RecordOwners`]: Ok once the changes are on disk; Err is the
    /// writer's failure text, which the core reports as it is.
    OwnersRecorded {
        op: OpId,
        result: Result<(), String>,
    },
    /// Answer of [`Effect::CheckPid`]: the process exists and is not a zombie.
    PidChecked {
        op: OpId,
        alive: bool,
    },
    /// Answer of [`Effect::ReadVmPid`]: what the hypervisor's PID file says.
    VmPidRead {
        op: OpId,
        pid: crate::vm::PidFile,
    },
    /// Answer of [`Effect::CheckSource`].
    SourceChecked {
        op: OpId,
        verdict: SourceVerdict,
    },
    VmEvent {
        kind: VmEventKind,
        vm: VmInfo,
    },
    /// A probe result change from the probe module.
    Readiness {
        key: PodKey,
        uid: String,
        ready: bool,
        message: String,
        /// The IP the probe resolved (lease may move); None = unchanged / unknown.
        ip: Option<String>,
    },
    /// The timer armed at `poll_timeout()` fired.
    Tick,
    /// The cocoon event stream was restarted (after it ended or failed to start).
    EventStreamRestarted,
}

/// Everything the provider asks the daemon to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    Cocoon {
        op: OpId,
        cmd: CocoonCmd,
    },
    /// Is process `pid` alive (signal 0 / `/proc/<pid>`)? The macOS guests' QEMU liveness
    /// check; answered with [`Input::PidChecked`].
    CheckPid {
        op: OpId,
        pid: i64,
    },
    /// The hypervisor PID of a VM just cloned, from `<root>/run/<backend dir>/<vm_id>/`
    /// `ch.pid` (`fc.pid` for Firecracker): a file read instead of a `vm inspect` process.
    ReadVmPid {
        op: OpId,
        vm_id: String,
        firecracker: bool,
    },
    /// Check a source the pod names on the host, off the event loop (a DNS lookup); answered
    /// with [`Input::SourceChecked`].
    CheckSource {
        op: OpId,
        check: SourceCheck,
    },
    LookupLease {
        op: OpId,
        mac: String,
    },
    /// JSON merge patch on pods/status: `{"metadata":{"uid":uid},"status":status}`.
    PatchPodStatus {
        op: OpId,
        key: PodKey,
        uid: String,
        /// Shared with the provider's record of what the pod shows (the kubelet view).
        status: std::sync::Arc<PodStatus>,
    },
    /// Merge patch of `metadata.annotations` (None ⇒ null ⇒ delete the key); the body also
    /// carries `metadata.uid` when `uid` is Some.
    PatchPodAnnotations {
        op: OpId,
        key: PodKey,
        uid: Option<String>,
        annotations: BTreeMap<String, Option<String>>,
    },
    /// DELETE the pod object with `preconditions.uid`; `grace` = gracePeriodSeconds (None = omit).
    DeletePod {
        op: OpId,
        key: PodKey,
        uid: String,
        grace: Option<i64>,
    },
    /// A core/v1 Event on the pod (message already ≤512 bytes).
    Event {
        key: PodKey,
        uid: String,
        type_: EventType,
        reason: &'static str,
        message: String,
    },
    /// Start (or replace) the readiness probe agent of a pod.
    StartProbe {
        key: PodKey,
        uid: String,
        vm_id: String,
        ip: String,
        mac: String,
        /// TCP port from `vm.cocoonstack.io/probe-port`; None = ICMP.
        probe_port: Option<u16>,
    },
    StopProbe {
        key: PodKey,
    },
    /// Remove a staging directory a peer restore filled (`dir`, as its `TransferDone` named
    /// it) once the clone from it has answered; the daemon removes only entries directly
    /// under `VK_STAGING_DIR`.
    RemoveStagedDir {
        dir: String,
    },
    /// Release these DHCP leases with cocoon-net (best effort; count lease_release_total).
    ReleaseLeases {
        macs: Vec<String>,
    },
    /// Pull `repo:tag` from the registry and import it as local snapshot `local_name`.
    PullSnapshot {
        op: OpId,
        repo: String,
        tag: String,
        local_name: String,
    },
    /// Push local snapshot `local_name` as `repo:tag` (annotations on the manifest: the base
    /// image, this node, and `owner` as `cocoonstack.snapshot.owner-namespace` /
    /// `owner-pod-uid`).
    PushSnapshot {
        op: OpId,
        local_name: String,
        repo: String,
        tag: String,
        base_image: String,
        owner: owners::Owner,
    },
    /// Make `image` available to `cocoon vm run` (with a registry); answer with the
    /// boot reference.
    MaterialiseImage {
        op: OpId,
        image: String,
        force: bool,
    },
    /// Fetch the raw snapshot files of `<vm_name>:hibernate` from the peer listener of node
    /// `from_node` (the manifest's `cocoonstack.snapshot.from-node`, not this node) into the
    /// staging directory, checked against the registry's `snapshotId`. At most 2 run node-wide.
    PeerRestore {
        op: OpId,
        namespace: String,
        vm_name: String,
        from_node: String,
        /// The snapshot name written into the staged `snapshot.json`.
        local_name: String,
    },
    /// Does the registry hold `<vm_name>:hibernate` (hibernate evidence, and the wake
    /// source's verification)? Only with a registry.
    CheckHibernateEvidence {
        op: OpId,
        vm_name: String,
    },
    /// Read the manifest of `repo:tag` (its owner, before a pull reads or a push replaces
    /// it); answer [`Input::HibernateEvidence`] (`Ok(None)` when the tag does not exist).
    ReadSnapshotTag {
        op: OpId,
        repo: String,
        tag: String,
    },
    /// DELETE the registry manifest `repo:tag` (a 404 counts as done); answer `TransferDone`.
    DeleteSnapshotTag {
        op: OpId,
        repo: String,
        tag: String,
    },
    /// Write these changes to the ownership ledger; answer [`Input::OwnersRecorded`].
    RecordOwners {
        op: OpId,
        changes: Vec<owners::OwnerChange>,
    },
    /// Set the static addresses of a Windows guest over SAC on the console socket of `vm_id`
    /// (a worker thread); answer [`Input::SacDone`].
    SacPass {
        op: OpId,
        vm_id: String,
        plan: crate::guest::sac::SacPlan,
    },
    Metric(MetricUpdate),
}

/// Truncate to at most `max` bytes on a char boundary.
pub fn truncate_bytes(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// Per-pod retry backoff of failed create/update, as the framework's queue: 5 ms × 2^failures,
/// capped at 1000 s.
pub fn pod_backoff(failures: u32) -> Duration {
    let ms = 5u64.saturating_mul(1u64 << failures.min(30));
    Duration::from_millis(ms.min(1_000_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_5ms_and_caps_at_1000s() {
        assert_eq!(pod_backoff(0), Duration::from_millis(5));
        assert_eq!(pod_backoff(1), Duration::from_millis(10));
        assert_eq!(pod_backoff(10), Duration::from_millis(5120));
        assert_eq!(pod_backoff(40), Duration::from_secs(1000));
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate_bytes("héllo", 2), "h");
        assert_eq!(truncate_bytes("abc", 10), "abc");
    }
}
