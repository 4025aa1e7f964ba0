//! The per-pod state the core keeps: the tracked incarnation, the running op and its step,
//! what an outstanding effect answer is for, and timers. Data only; transitions live per op.

use super::*;

/// The provider's copy of a pod incarnation it owns.
#[derive(Debug, Clone)]
pub(super) struct Tracked {
    pub(super) uid: String,
    /// The API copy this incarnation was last reconciled with, shared with `Slot::latest` (a
    /// dense node holds a thousand of these; copies were most of the daemon's memory).
    pub(super) pod: Arc<Pod>,
    pub(super) spec: VmSpec,
    pub(super) vm: Option<VmInfo>,
    pub(super) ip: String,
    pub(super) start_time: Option<Time>,
    /// Latest probe result (ready, message).
    pub(super) probe: Option<(bool, String)>,
}

#[derive(Debug, Clone)]
pub(super) enum CreateStep {
    /// An unmanaged pod: `vm inspect <id>`, adopted only on an exact answer.
    UnmanagedInspect,
    InspectByName,
    RmStaleByName,
    /// Hibernate evidence: was this VM hibernated (registry tag, or local snapshot if no registry)?
    Evidence,
    RmFork,
    SnapInspect {
        pulled: bool,
    },
    /// The image's manifest is read (whose snapshot it is) before its pull.
    ImageTag,
    PullSnapshot,
    /// Another pod is pulling this snapshot: look again when the poll timer fires.
    PullWait,
    /// `fork-from`: waiting for the node's fork-snapshot flight of this source (`fork`).
    ForkWait {
        source: String,
    },
    /// The host checks the source the pod names (`source_check`) before the bring-up.
    SourceCheck {
        rule: super::source_check::SourceRule,
    },
    ImageInspect,
    MaterialiseBase,
    MaterialiseRun,
    Boot,
    /// The bring-up failed: look for a record it may have left under the VM name.
    BootFailedInspect {
        error: String,
    },
    /// Removing that leftover before the failure is reported (and retried).
    BootFailedRm {
        error: String,
    },
    /// A clone answered with PID 0 (cocoon reads it back only later): its pid file.
    PidFile,
    RunInspect,
    Lease,
    /// macOS (`cocoon-macos`, see `macos`): is there a VM of this name?
    MacosInspect,
    /// Is the inspected VM's QEMU alive (adopt) or dead (start it)?
    MacosAlive {
        vm: crate::guest::macos::MacosVm,
    },
    /// `vm start` of a VM whose QEMU was dead.
    MacosStart,
    MacosImageInspect,
    MacosImagePull,
    MacosRun,
    /// Inspect after `vm start` / `vm run`: the new QEMU's pid, MAC and disk.
    MacosLaunched,
}

/// How a failed create ends: its Warning reason and lifecycle metric reason, whether it is
/// retried with backoff, and whether the pod fails for good (phase Failed).
#[derive(Debug, Clone, Copy)]
pub(super) struct CreateFailure {
    pub(super) reason: &'static str,
    pub(super) metric_reason: &'static str,
    pub(super) retry: bool,
    pub(super) terminal: bool,
}

#[derive(Debug, Clone)]
pub(super) struct CreateOp {
    pub(super) uid: String,
    pub(super) spec: VmSpec,
    pub(super) step: CreateStep,
    pub(super) started: Instant,
    pub(super) local_snapshot: String,
    pub(super) snapshot_image: String,
    pub(super) vm: Option<VmInfo>,
    /// A VM-gone event that arrived while this create was in flight, looked at once it ends.
    pub(super) vm_event_meanwhile: Option<(VmEventKind, VmInfo)>,
    /// The VM was adopted, not booted by this create (no boot-time guest work is owed).
    pub(super) adopted: bool,
}

impl CreateOp {
    /// A create of `spec` for incarnation `uid`, at its first step.
    pub(super) fn new(uid: String, spec: VmSpec, step: CreateStep, started: Instant) -> Self {
        CreateOp {
            uid,
            spec,
            step,
            started,
            local_snapshot: String::new(),
            snapshot_image: String::new(),
            vm: None,
            vm_event_meanwhile: None,
            adopted: false,
        }
    }
}

/// A fork-snapshot flight's step: ensuring `fork-<source>` exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ForkStep {
    /// Is `fork-<source>` already there (a complete snapshot; pending ones are invisible)?
    Inspect,
    /// The source VM is not in the name index: `vm inspect <source>`.
    FindSource,
    /// An unrecorded `fork-<source>` (an earlier daemon's) is removed before a fresh save.
    RmUnowned,
    /// The owner of `fork-<source>` is being recorded; the save follows.
    Record { retried: bool },
    /// `snapshot save --name fork-<source> <source id>`.
    Save { retried: bool },
    /// The save found the name taken: did another save land it meanwhile?
    TakenInspect { holder: String },
    /// It did not: a half-saved record (an interrupted save) holds the name; remove it.
    RmHolder,
}

/// One fork-snapshot flight per source VM on the node, shared by every pod forking that source.
/// It belongs to no pod: a waiter deleted or failed meanwhile leaves it running for the others.
#[derive(Debug, Clone)]
pub(super) struct ForkFlight {
    pub(super) step: ForkStep,
    pub(super) source_id: String,
    /// The source VM's hypervisor, once known (the saved snapshot records the same).
    pub(super) source_hypervisor: String,
    /// `fork-<source>` was removed meanwhile (the source deleted or booted afresh): what this
    /// flight lands is of a VM that no longer is, and is removed instead of cloned.
    pub(super) invalidated: bool,
    /// The pods waiting for it (each in `CreateStep::ForkWait` of this source when it lands).
    pub(super) waiting: Vec<PodKey>,
    /// The namespace of the pods forking (only pods of the source's namespace may): the label
    /// of the save's duration.
    pub(super) namespace: String,
    /// When the `snapshot save` started (its duration histogram).
    pub(super) save_started: Instant,
}

/// The local snapshots that may exist on the node, so that the removals the contract asks
/// "if it exists" (`fork-<vm>` at a fresh bring-up, `<vm>` and `fork-<vm>` at a delete) cost a
/// cocoon call only when they may: on a dense host each is one more process and one more
/// turn of cocoon's snapshot lock per pod.
#[derive(Debug, Clone, Default)]
pub(super) struct LocalSnapshots {
    /// False until a `snapshot list` answered: until then every such removal runs.
    pub(super) listed: bool,
    /// Every listed name, and every name a save, pull or peer restore was started for since.
    /// A name leaves only when its removal answered and nothing may be creating it again.
    pub(super) may_exist: std::collections::HashSet<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DeleteStep {
    ApiFirst,
    /// No VM known for the pod (untracked, or its create never recorded one): look it up by
    /// name, then by its ID annotation, before the object may go.
    FindVm {
        by_id: bool,
    },
    /// The VM found is still being created: ask cocoon to settle that record (collected when
    /// no create holds it any more, busy while one runs).
    SettleCreating {
        by_id: bool,
    },
    /// A create still runs it (a clone of an earlier process): look again shortly.
    FindVmWait {
        by_id: bool,
    },
    Inspect,
    Save {
        retried: bool,
        /// When the save was asked for (`snapshot_save_duration_seconds`).
        started: Instant,
    },
    RmHolder,
    /// The registry's `<vm>:latest` is read before it is replaced.
    PushCheck,
    Push,
    Rm,
    RmSnapshot,
    RmForkSnapshot,
    ApiLast,
    /// A managed macOS guest: `cocoon-macos vm rm <name>` (no snapshot work).
    MacosRm,
}

#[derive(Debug, Clone)]
pub(super) struct DeleteOp {
    pub(super) uid: String,
    pub(super) step: DeleteStep,
    pub(super) vm_name: String,
    pub(super) keep: bool,
    /// The VM lookup of a delete with no VM known has been done (found nothing).
    pub(super) looked_up: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EvictStep {
    Remove,
    Status,
    Delete,
}

/// Why the core evicts a pod: the `EvictReason` of its Failed status, and (`Display`) the
/// status message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum EvictCause {
    /// The VM is gone (removed, or the VM answering is not the pod's).
    VmGone,
    /// The deferred recheck got no answer within its budget.
    InspectTimeout,
    /// The VM stopped again within the restart cooldown.
    RestartCooldown,
    /// The restart's `vm start` failed: cocoon's error text.
    RestartFailed(String),
}

impl EvictCause {
    pub(super) fn reason(&self) -> EvictReason {
        match self {
            EvictCause::VmGone => EvictReason::VmGone,
            EvictCause::InspectTimeout => EvictReason::VmInspectTimeout,
            EvictCause::RestartCooldown => EvictReason::RestartCooldown,
            EvictCause::RestartFailed(_) => EvictReason::RestartFailed,
        }
    }
}

impl std::fmt::Display for EvictCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvictCause::VmGone => f.write_str("vm no longer exists"),
            EvictCause::InspectTimeout => f.write_str("vm inspect did not resolve within budget"),
            EvictCause::RestartCooldown => f.write_str("restart cooldown not elapsed"),
            EvictCause::RestartFailed(error) => f.write_str(error),
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct EvictOp {
    pub(super) uid: String,
    pub(super) cause: EvictCause,
    pub(super) step: EvictStep,
    pub(super) attempts: u32,
    /// The DELETE went with grace 0 (the pod was being deleted already): it ends the object.
    pub(super) grace0: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CheckStep {
    Inspect {
        attempt: u32,
    },
    Start,
    /// `vm start` gave no answer in time, so it may have started the VM: look before
    /// removing it.
    StartUnanswered {
        error: String,
    },
    Refresh,
    /// Deferred recheck: waiting on the slot timer.
    Deferred {
        delay: Duration,
        until: Instant,
    },
    DeferredInspect {
        delay: Duration,
        until: Instant,
    },
}

#[derive(Debug, Clone)]
pub(super) struct CheckOp {
    pub(super) uid: String,
    pub(super) vm_id: String,
    pub(super) step: CheckStep,
    /// A VM-gone event arrived while this check ran: what the check saw may predate it, so
    /// the VM is inspected once more before the check settles.
    pub(super) gone_meanwhile: bool,
}

/// Why a hibernate or wake failed: the Warning reason and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OpFailure {
    pub(super) reason: &'static str,
    pub(super) message: String,
    /// The `pod_lifecycle_total` reason it is counted under ("" for most).
    pub(super) metric_reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum HibernateStep {
    /// Owed hibernate after a restart found the VM stopped: start it first.
    StartVm,
    /// CH + Windows: guest `ipconfig /release` before the NIC goes (best effort).
    DhcpRelease,
    /// CH + Windows: `vm net --nics 0`.
    NetDrop,
    Save {
        retried: bool,
    },
    /// The snapshot name is taken: remove its holder, retried while cocoon says it is in use.
    RmHolder {
        until: Instant,
    },
    RmHolderWait {
        until: Instant,
    },
    /// The registry's `<vm>:hibernate` is read before it is replaced: another namespace's
    /// is never pushed over.
    PushCheck,
    Push,
    /// Null the id / ip / post-clone-state annotations before the VM goes.
    ClearIds,
    Rm,
    /// Rollback after a failed removal: the pushed tag must not outlive the VM it claims.
    DeleteTag {
        failure: OpFailure,
    },
    /// Rollback: give the VM its NIC back (`vm net --nics 1`).
    RestoreNic {
        failure: OpFailure,
    },
    /// Rollback: re-read the VM's NICs after the resize.
    RestoreInspect {
        failure: OpFailure,
    },
}

#[derive(Debug, Clone)]
pub(super) struct HibernateOp {
    pub(super) uid: String,
    pub(super) vm: VmInfo,
    pub(super) step: HibernateStep,
    /// When the `snapshot save` started (its duration histogram).
    pub(super) save_started: Instant,
    /// The NIC was dropped: the rollback gives it back.
    pub(super) nic_dropped: bool,
    /// The null patch of id / ip landed (else it is sent again once the VM is gone).
    pub(super) ids_cleared: bool,
    /// A VM event about this VM arrived meanwhile: rechecked once the op ends with the VM kept.
    pub(super) vm_event_meanwhile: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum WakeStep {
    /// Is there a local snapshot named after the VM?
    LocalInspect,
    /// Verify the local snapshot (its id) against the registry tag's snapshot id.
    Verify {
        local_id: String,
        local_image: String,
    },
    /// The local copy is stale: remove it, then its fork snapshot.
    RmStale,
    RmStaleFork,
    /// Look the registry tag up (peer restore reads its from-node).
    Tag,
    /// Peer restore: the tag's from-node serves the raw snapshot files into the staging dir.
    Peer,
    /// Registry pull of `<vm>:hibernate` into `<vm>-hibernate-import`.
    Pull,
    /// Inspect the import (its base image decides `--pull`).
    ImportInspect,
    Clone {
        source: String,
    },
    /// The clone failed: look for a record it may have left under the VM name.
    CloneFailedInspect {
        source: String,
        error: String,
    },
    /// Removing that leftover before the failure is reported (and retried).
    CloneFailedRm {
        error: String,
    },
}

#[derive(Debug, Clone)]
pub(super) struct WakeOp {
    pub(super) uid: String,
    pub(super) spec: VmSpec,
    pub(super) step: WakeStep,
    pub(super) started: Instant,
    /// CreatePod's restore (a failure fails the create) rather than UpdatePod's wake.
    pub(super) restore: bool,
    /// The registry tag, once looked up (`None` = not looked up, or absent).
    pub(super) tag: Option<HibernateTag>,
    /// Where the clone comes from, for the `Woken` event.
    pub(super) source_label: String,
}

/// A step of startup's confirmation that a pod with no VM was hibernated (`confirm_hibernated`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ConfirmStep {
    /// Is there a local snapshot named after the VM (and which)?
    LocalInspect,
    /// The registry tag `<vm>:hibernate`; `local_id` is the local snapshot's id, if any.
    Tag { local_id: Option<String> },
    /// A lookup failed: waiting on the slot timer to look again.
    Wait,
}

#[derive(Debug, Clone)]
pub(super) struct ConfirmOp {
    pub(super) uid: String,
    pub(super) step: ConfirmStep,
    /// The backoff before the next lookup after a failed one.
    pub(super) delay: Duration,
    /// The Warning about an unreadable registry or cocoon was emitted (once per op).
    pub(super) warned: bool,
}

/// Why a post-clone fix-up runs: after a clone, or as part of a wake (whose failures count as
/// wake failures and whose IP wait reports `WakeIPWaitTimeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostCloneMode {
    Clone,
    /// Built by the wake path (wake and CreatePod's restore) after the clone.
    Wake,
}

impl PostCloneMode {
    /// The op word of messages: "clone <vm>" / "wake <vm>".
    pub(super) fn word(self) -> &'static str {
        match self {
            PostCloneMode::Clone => "clone",
            PostCloneMode::Wake => "wake",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PostCloneStep {
    /// A `vm exec` attempt runs.
    Exec,
    /// Waiting for the next attempt (the slot timer).
    Pause,
    /// The Windows SAC static-IP pass runs (after the NIC reset succeeded).
    Sac,
}

/// The post-clone fix-up of a tracked VM: `vm exec` attempts within a budget, then the IP wait.
#[derive(Debug, Clone)]
pub(super) struct PostCloneOp {
    pub(super) uid: String,
    pub(super) vm_id: String,
    pub(super) mode: PostCloneMode,
    pub(super) fixup: crate::provider::fixup::Fixup,
    pub(super) step: PostCloneStep,
    pub(super) attempts: u32,
    pub(super) errors: Vec<String>,
    /// Windows guests with a static NIC: the SAC pass that follows a successful attempt.
    pub(super) sac: Option<crate::guest::sac::SacPlan>,
    /// Only the SAC pass runs (no NIC reset was needed): no fix-up counters or marker.
    pub(super) sac_only: bool,
    /// The end of the budget: no attempt starts after it and a running one is killed there.
    pub(super) until: Instant,
}

/// A step of the macOS guest watch (`macos`): the QEMU liveness check that backfills a missing
/// MAC and restarts a dead QEMU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum MacosWatchStep {
    /// Is the tracked QEMU pid alive?
    Alive,
    /// `vm inspect`: the record's pid and MAC (a MAC missing, or the QEMU dead).
    Inspect { dead: bool },
    /// The inspected pid's liveness (the record may name a QEMU started meanwhile).
    InspectAlive { vm: crate::guest::macos::MacosVm },
    /// `vm start` of the dead QEMU.
    Start,
    /// Inspect after the start.
    Refresh,
}

#[derive(Debug, Clone)]
pub(super) struct MacosWatchOp {
    pub(super) uid: String,
    pub(super) step: MacosWatchStep,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClassifyStep {
    /// The registry is asked whether the VM's hibernate tag exists.
    Evidence,
    /// Waiting (the slot timer) to ask again after the registry failed to answer.
    Pause,
}

/// Owed work after a restart for an unmarked CH Windows clone: was it woken from a hibernation
/// that dropped its NIC (hibernate evidence: only the IP wait is owed, its hot-added NIC must
/// not be cycled) or freshly cloned (no evidence: the post-clone fix-up is owed)?
#[derive(Debug, Clone)]
pub(super) struct ClassifyOp {
    pub(super) uid: String,
    pub(super) vm_id: String,
    pub(super) step: ClassifyStep,
    /// The pod clones its VM (not `mode=run`): without evidence, the fix-up its clone needs.
    pub(super) cloned: bool,
    /// Failed lookups so far (the backoff doubles from 1 s to 30 s).
    pub(super) failures: u32,
    /// No lookup starts after this; the op then fails with `ResumeClassifyFailed`.
    pub(super) until: Instant,
}

#[derive(Debug, Clone)]
pub(super) enum Op {
    Create(Box<CreateOp>),
    /// The periodic liveness check of a macOS guest. Preemptible.
    MacosWatch(MacosWatchOp),
    /// Poll the lease until the VM has an IP, then publish Ready. Preemptible.
    ReadyWait(ReadyWaitOp),
    /// Post-clone fix-up of the VM just cloned (or woken). Preemptible.
    PostClone(Box<PostCloneOp>),
    /// Owed-work classification of an unmarked CH Windows clone. Preemptible.
    Classify(ClassifyOp),
    Hibernate(Box<HibernateOp>),
    Wake(Box<WakeOp>),
    /// Startup: is a pod that asks for hibernate, has no VM and records one hibernated?
    ConfirmHibernated(ConfirmOp),
    Delete(DeleteOp),
    Evict(EvictOp),
    Check(CheckOp),
    /// DELETE of the API object for a pod being deleted that we do not track.
    ApiDelete(ApiDeleteOp),
}

/// The wait for a clone's guest IP, then Ready. `mode` Wake: the follow-up of a wake or
/// restore, whose outcome counts `wake_total`.
#[derive(Debug, Clone)]
pub(super) struct ReadyWaitOp {
    pub(super) uid: String,
    pub(super) vm_id: String,
    pub(super) until: Instant,
    /// Windows guests: when to send the one `ipconfig /renew` nudge (None = not owed).
    pub(super) nudge_at: Option<Instant>,
    pub(super) mode: PostCloneMode,
}

/// The grace-0 DELETE of the API object of an incarnation `uid` we do not track.
#[derive(Debug, Clone)]
pub(super) struct ApiDeleteOp {
    pub(super) uid: String,
}

/// The state struct of one op kind, held by exactly one `Op` variant: an op starts from its
/// own struct (`Into<Op>`), and is read back only as its own kind (`of`, `of_mut`), so code
/// written for one op cannot act on another's state.
pub(super) trait OpKind: Sized + Into<Op> {
    /// This kind's state when `op` is of this kind.
    fn of(op: &Op) -> Option<&Self>;
    /// The same, to move it on (its step, its counters).
    fn of_mut(op: &mut Op) -> Option<&mut Self>;
}

/// Pairs each op struct with its `Op` variant (`boxed`: the variant holds it in a `Box`).
macro_rules! op_kinds {
    ($($kind:ident => $ty:ty $(, $boxed:ident)?;)*) => {$(
        impl From<$ty> for Op {
            fn from(o: $ty) -> Op {
                Op::$kind(op_kinds!(@wrap o $(, $boxed)?))
            }
        }
        impl OpKind for $ty {
            fn of(op: &Op) -> Option<&Self> {
                match op {
                    Op::$kind(o) => Some(o),
                    _ => None,
                }
            }
            fn of_mut(op: &mut Op) -> Option<&mut Self> {
                match op {
                    Op::$kind(o) => Some(o),
                    _ => None,
                }
            }
        }
    )*};
    (@wrap $o:ident, boxed) => { Box::new($o) };
    (@wrap $o:ident) => { $o };
}

op_kinds! {
    Create => CreateOp, boxed;
    MacosWatch => MacosWatchOp;
    ReadyWait => ReadyWaitOp;
    PostClone => PostCloneOp, boxed;
    Classify => ClassifyOp;
    Hibernate => HibernateOp, boxed;
    Wake => WakeOp, boxed;
    ConfirmHibernated => ConfirmOp;
    Delete => DeleteOp;
    Evict => EvictOp;
    Check => CheckOp;
    ApiDelete => ApiDeleteOp;
}

impl Op {
    pub(super) fn preemptible(&self) -> bool {
        matches!(
            self,
            Op::ReadyWait(_)
                | Op::PostClone(_)
                | Op::MacosWatch(_)
                | Op::Classify(_)
                | Op::Check(CheckOp {
                    step: CheckStep::Deferred { .. },
                    ..
                })
        )
    }
}

/// The idle sub-state of a pod: what the core settled about one of its incarnations, which
/// decides what the next reconcile may do with it.
#[derive(Debug, Clone, Default)]
pub(super) enum Idle {
    /// Nothing settled: the next reconcile acts on the latest copy.
    #[default]
    Open,
    /// This pod copy's create failed for good (bad input): retried only when the pod changes.
    Rejected(Arc<Pod>),
    /// We asked the API to delete this UID with grace 0 and wait for its DELETED.
    ApiDeleted(String),
    /// We evicted this UID: never re-created; its graceful deletion is finished with grace 0.
    Evicted(String),
}

impl Idle {
    /// We already deleted the API object of `uid` (grace 0).
    pub(super) fn api_deleted(&self, uid: &str) -> bool {
        matches!(self, Idle::ApiDeleted(u) if u == uid)
    }

    /// We ended `uid` ourselves (API delete or eviction) and only its DELETED is owed.
    pub(super) fn ended(&self, uid: &str) -> bool {
        matches!(self, Idle::ApiDeleted(u) | Idle::Evicted(u) if u == uid)
    }

    /// The rejected copy, if the last create failed for good.
    pub(super) fn rejected(&self) -> Option<&Arc<Pod>> {
        match self {
            Idle::Rejected(p) => Some(p),
            _ => None,
        }
    }

    /// Forgets an API delete that did not happen.
    pub(super) fn undo_api_delete(&mut self) {
        if matches!(self, Idle::ApiDeleted(_)) {
            *self = Idle::Open;
        }
    }

    /// Forgets a rejection (a create starts).
    pub(super) fn clear_rejection(&mut self) {
        if matches!(self, Idle::Rejected(_)) {
            *self = Idle::Open;
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Slot {
    /// Latest copy from the API (None once deleted there).
    pub(super) latest: Option<Arc<Pod>>,
    pub(super) tracked: Option<Tracked>,
    pub(super) intent: Option<Intent>,
    /// The running op. Private: it starts, hands over and ends only through the functions of
    /// `impl Slot` below, so what an op's end forgets is decided in one place.
    op: Option<Op>,
    pub(super) awaiting: Option<OpId>,
    /// (due, token); a fired timer whose token differs is stale.
    pub(super) timer: Option<(Instant, u64)>,
    /// Consecutive failures of create / delete (backoff exponent).
    pub(super) failures: u32,
    /// When the next create or delete attempt may start after a failure. Independent of
    /// `idle`: a delete that failed after its API-first DELETE retries with that still known.
    pub(super) retry_at: Option<Instant>,
    /// What the core last settled about an incarnation of this pod while no op runs for it.
    pub(super) idle: Idle,
    /// The call the op makes once the ownership record it waits for (`awaiting`) is on disk.
    pub(super) deferred: Option<super::ledger::Deferred>,
    pub(super) last_pushed: Option<StatusSummary>,
    /// The last status written for an incarnation (uid): what the cluster shows, and what the
    /// kubelet view serves without building a copy per pod.
    pub(super) shown: Option<(String, Arc<PodStatus>)>,
    /// Updates that asked for unsupported changes, so the Warning is emitted once per change.
    pub(super) warned_hibernate: bool,
    /// A failed hibernate / wake is retried: (delay of the next retry, when it is due).
    pub(super) update_retry: Option<(Duration, Instant)>,
    /// Annotations of an incarnation (uid) that ride on its next annotation patch instead of
    /// a write of their own (post-clone-state `done`, see `kube_writes.rs`).
    pub(super) owed_annotations: Option<(String, BTreeMap<String, Option<String>>)>,
    /// The incarnation (uid) whose non-final statuses (Pending, Running not Ready) wait until
    /// its create's hold ends (`STATUS_HOLD`): a fast create writes only its final status.
    pub(super) status_hold: Option<String>,
    /// At a restart: the ledger recorded this pod's uid as its VM's owner before the adoption
    /// (a create of this daemon made the VM), which stands for a `creating` never written.
    pub(super) ledger_create: bool,
}

impl Slot {
    /// The running op, if any.
    pub(super) fn op(&self) -> Option<&Op> {
        self.op.as_ref()
    }

    /// The running op, to move it on (its step, its counters).
    pub(super) fn op_mut(&mut self) -> Option<&mut Op> {
        self.op.as_mut()
    }

    /// Starts `op` on the pod. An op still running is replaced: that is how one op hands the
    /// pod to its follow-up (a create to its restore or to its wait for Ready) keeping what
    /// it waits on.
    pub(super) fn start_op(&mut self, op: impl Into<Op>) {
        self.op = Some(op.into());
    }

    /// Starts `op` in place of the running one, whose outstanding answer and timer are
    /// forgotten: a late answer finds nothing waiting and is dropped.
    pub(super) fn replace_op(&mut self, op: impl Into<Op>) {
        self.forget_waits();
        self.op = Some(op.into());
    }

    /// Ends the running op from its own last answer: nothing is outstanding any more, and a
    /// timer the op armed (a retry) stays armed.
    pub(super) fn finish_op(&mut self) {
        self.op = None;
    }

    /// Ends the running op and forgets the answer it waits on; its timer (a retry the caller
    /// arms, or one still due) stays.
    pub(super) fn drop_op(&mut self) {
        self.op = None;
        self.awaiting = None;
        self.deferred = None;
    }

    /// Ends the running op and forgets everything it waits on: its answer and its timer.
    pub(super) fn clear_op(&mut self) {
        self.op = None;
        self.forget_waits();
    }

    fn forget_waits(&mut self) {
        self.awaiting = None;
        self.deferred = None;
        self.timer = None;
    }
}

/// What an outstanding effect result is for.
#[derive(Debug, Clone)]
pub(super) enum Waiter {
    PodStep(PodKey),
    /// A read-only cocoon call several pods' steps wait on (`pod_cocoon_read`).
    SharedRead {
        argv: Vec<String>,
        keys: Vec<PodKey>,
    },
    Status {
        key: PodKey,
        uid: String,
        ready_publication: bool,
        attempt: u32,
        effect: Effect,
    },
    Annotations {
        key: PodKey,
        uid: String,
        lifecycle: bool,
        attempt: u32,
        effect: Effect,
    },
    /// A background lease lookup for a tracked pod with no IP yet.
    Lease {
        key: PodKey,
        uid: String,
    },
    StaleCreate {
        vm: VmInfo,
        watcher: bool,
    },
    StaleInspect {
        vm: VmInfo,
        watcher: bool,
    },
    /// A cocoon call of the fork-snapshot flight of this source VM.
    Fork {
        source: String,
    },
    /// A step of the local snapshot reclaimer.
    Reclaim(super::reclaim::ReclaimStep),
    /// A write of the ownership ledger; `undo` restores memory if it fails.
    Owners {
        for_: super::ledger::RecordFor,
        undo: Vec<crate::provider::owners::OwnerChange>,
    },
    /// A detached removal of a local snapshot: its record goes once it answers.
    SnapshotRm {
        name: String,
    },
    /// A wake step whose answer ends the life of a peer restore's staging directory: the
    /// restore itself (`dir` None; its answer names the directory) or the clone from `dir`.
    /// The directory is removed once nothing will clone from it, even when the op is gone.
    Staged {
        key: PodKey,
        dir: Option<String>,
    },
    Ignore,
}

#[derive(Debug, Clone)]
pub(super) enum TimerEntry {
    Pod {
        key: PodKey,
        token: u64,
    },
    Drift,
    Lifecycle,
    /// The local snapshot reclaimer's next run.
    Reclaim,
    /// The macOS guests' liveness check (every 10 s while one is tracked).
    MacosWatch,
    Reissue {
        waiter: Waiter,
    },
    StaleWatch {
        vm: VmInfo,
        delay: Duration,
        until: Instant,
    },
    /// The startup adoption's next chunk.
    Adopt,
    /// A create's status hold ends: a status still owed is written (see `status_hold`).
    StatusHold {
        key: PodKey,
        uid: String,
    },
}

pub(super) struct Startup {
    pub(super) pods: Vec<Pod>,
    pub(super) vms: Vec<VmInfo>,
    /// Stale `creating` VMs still waiting for the verb.
    pub(super) queue: Vec<VmInfo>,
    pub(super) in_flight: usize,
    /// Stale VMs handed to a background watcher (never adopted nor treated as orphans now).
    pub(super) watched: Vec<VmInfo>,
}

/// The startup reconcile's adoption between chunks: the pods still to match to VMs, then the
/// pods still to kick. Pod and VM events wait until it ends; the orphan decision is taken
/// only once every pod has claimed its VM.
pub(super) struct Adoption {
    /// Oldest first: a VM shared by name goes back to the pod that had it.
    pub(super) pods: std::collections::VecDeque<Pod>,
    pub(super) vms: Vec<VmInfo>,
    pub(super) watched: Vec<VmInfo>,
    pub(super) by_id: BTreeMap<String, VmInfo>,
    pub(super) by_name: BTreeMap<String, VmInfo>,
    pub(super) claimed: std::collections::HashSet<String>,
    /// VMs a pod adopted: a VM goes to one pod (`claimed` also holds the VMs only named by
    /// pods that may not take them, which stay free for the pod they are recorded for).
    pub(super) taken: std::collections::HashSet<String>,
    pub(super) adopted: usize,
    /// Set once every pod is matched and the orphans handled: the pods still to kick.
    pub(super) kicks: Option<std::collections::VecDeque<PodKey>>,
}

/// The step type of one op kind. Each op kind carries its own step enum, and this is the one
/// place that pairs them: a step reaches only the op of its own kind (`Provider::advance`
/// takes any `OpStep`, and `of` finds that op's step field), so setting a step of another
/// operation on the running one cannot be written.
pub(super) trait OpStep: std::fmt::Debug {
    /// The op kind this step belongs to, for messages.
    const OP: &'static str;
    /// The step field of `op` when `op` is of this step's kind.
    fn of(op: &mut Op) -> Option<&mut Self>;
}

/// Pairs each op kind with its step enum.
macro_rules! op_steps {
    ($($kind:ident => $step:ty,)*) => {$(
        impl OpStep for $step {
            const OP: &'static str = stringify!($kind);
            fn of(op: &mut Op) -> Option<&mut Self> {
                match op {
                    Op::$kind(o) => Some(&mut o.step),
                    _ => None,
                }
            }
        }
    )*};
}

op_steps! {
    Create => CreateStep,
    Delete => DeleteStep,
    Evict => EvictStep,
    Check => CheckStep,
    Hibernate => HibernateStep,
    Wake => WakeStep,
    ConfirmHibernated => ConfirmStep,
    PostClone => PostCloneStep,
    MacosWatch => MacosWatchStep,
    Classify => ClassifyStep,
}

/// What a step waits on: the effect issued when the step is set.
pub(super) enum Ask {
    /// Record these owners in the ledger, then (once on disk) make the call that creates
    /// what they own.
    Recorded(
        Vec<crate::provider::owners::OwnerChange>,
        super::ledger::Deferred,
    ),
    /// A cocoon call of this pod alone.
    Cocoon(CocoonCmd),
    /// A read-only cocoon call that concurrent pods asking the same share.
    SharedRead(CocoonCmd),
    /// Any other effect, built around the op id that will carry its answer.
    Effect(Box<dyn FnOnce(OpId) -> Effect>),
    /// No effect: the pod's timer at this instant (a retry or a deferred recheck).
    Timer(Instant),
    /// No effect of its own: the pod joined a node-wide flight that answers every pod
    /// waiting for it when it lands (the fork-snapshot flight).
    Flight,
}

impl Ask {
    /// An effect other than a cocoon call.
    pub(super) fn effect(mk: impl FnOnce(OpId) -> Effect + 'static) -> Ask {
        Ask::Effect(Box::new(mk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_sub_state_answers_for_its_own_uid_only() {
        let api = Idle::ApiDeleted("u1".into());
        assert!(api.api_deleted("u1") && api.ended("u1"));
        assert!(!api.api_deleted("u2") && !api.ended("u2"));
        let evicted = Idle::Evicted("u1".into());
        assert!(evicted.ended("u1") && !evicted.api_deleted("u1"));
        assert!(evicted.rejected().is_none());

        // Undoing an API delete never forgets an eviction or a rejection, and the reverse.
        let mut s = evicted.clone();
        s.undo_api_delete();
        assert!(s.ended("u1"));
        let mut s = api.clone();
        s.clear_rejection();
        assert!(s.api_deleted("u1"));
        s.undo_api_delete();
        assert!(matches!(s, Idle::Open));
        let mut s = Idle::Rejected(Arc::new(Pod::default()));
        assert!(s.rejected().is_some() && !s.ended(""));
        s.undo_api_delete();
        assert!(s.rejected().is_some());
        s.clear_rejection();
        assert!(matches!(s, Idle::Open));
    }
}
