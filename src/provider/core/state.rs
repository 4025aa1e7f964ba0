//! The per-pod state the core keeps: the tracked incarnation, the slot holding the running op
//! (its kinds are in `ops`), what an outstanding effect answer is for, and timers. Data only.

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

impl LocalSnapshots {
    /// Whether local snapshot `name` may exist (every name does until a listing answered).
    pub(super) fn may_hold(&self, name: &str) -> bool {
        !self.listed || self.may_exist.contains(name)
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
