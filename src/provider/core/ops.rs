//! The state of each pod op kind: its struct, its step enum, and the pairing of both with
//! the `Op` variant that holds them (`OpKind`, `OpStep`). Data only; transitions live per op.

use super::*;

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

/// What the wait for a guest IP waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadyWaitStep {
    /// A lease lookup of the VM's MAC.
    Lease,
    /// The pod timer: the next look.
    Pause,
    /// The Windows renew nudge (`ipconfig /renew` in the guest).
    Nudge,
}

/// The wait for a clone's guest IP, then Ready. `mode` Wake: the follow-up of a wake or
/// restore, whose outcome counts `wake_total`.
#[derive(Debug, Clone)]
pub(super) struct ReadyWaitOp {
    pub(super) uid: String,
    pub(super) vm_id: String,
    pub(super) step: ReadyWaitStep,
    pub(super) until: Instant,
    /// Windows guests: when to send the one `ipconfig /renew` nudge (None = not owed).
    pub(super) nudge_at: Option<Instant>,
    pub(super) mode: PostCloneMode,
}

/// The one step of an API delete: its DELETE runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ApiDeleteStep {
    Delete,
}

/// The grace-0 DELETE of the API object of an incarnation `uid` we do not track.
#[derive(Debug, Clone)]
pub(super) struct ApiDeleteOp {
    pub(super) uid: String,
    pub(super) step: ApiDeleteStep,
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
    ReadyWait => ReadyWaitStep,
    ApiDelete => ApiDeleteStep,
}
