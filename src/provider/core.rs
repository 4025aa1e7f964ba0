//! The provider state machine: per-pod create / update / delete / status / eviction, VM events
//! and startup reconcile. Pure: `handle(input, now, wall)` returns effects; no I/O here.
//!
//! Shape: one [`Slot`] per pod key holds the latest API copy, the tracked incarnation, the
//! lifecycle intent and at most one running [`Op`] (work is serialised per pod, pods run in
//! parallel). An op waits on one effect result (`awaiting`) or on the slot's timer. When an op
//! ends, the slot is re-evaluated against the latest API copy (`reconcile_slot`), which is where
//! the framework's create/update/delete dispatch lives.
//!
//! Decisions for out-of-scope features (issue 5): fork-from, restore-from-hibernate, managed
//! Windows/macOS guests fail the create clearly (Warning event, ProviderFailed status, counter)
//! without touching cocoon; a hibernate request on a running pod changes nothing and gets a
//! Warning `HibernateUnsupported`. Post-clone fix-ups are not implemented: CH all-DHCP clones
//! (which need none, §14.1) wait for the IP and publish Ready; a clone onto firecracker is
//! refused before cloning; a CH clone that comes up with a static NIC keeps its VM (so delete
//! cleans it) but is marked lifecycle `failed` with a Warning `PostCloneUnsupported`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::chrono::{DateTime, Utc};

use super::cocoon::{
    parse_snapshot, parse_stale_outcome, parse_vm, CloneArgs, CloneSource, CocoonCmd, CocoonResult,
    RunArgs, VmInfo,
};
use super::lifecycle::{self, Intent, State};
use super::spec::{self, Mode, Os, SpecError, VmSpec, ANN_VM_ID, ANN_VM_IP};
use super::status::{self, StatusSummary};
use super::{
    pod_backoff, truncate_bytes, Effect, EventType, EvictReason, Input, KubeError, MetricUpdate,
    OpId, OrphanPolicy, PodKey, ProviderConfig, VmEventKind,
};

const DRIFT_FIRST: Duration = Duration::from_secs(10);
const DRIFT_EVERY: Duration = Duration::from_secs(30);
const LIFECYCLE_EVERY: Duration = Duration::from_secs(15);
const KUBE_RETRY: Duration = Duration::from_millis(500);
const KUBE_ATTEMPTS: u32 = 3;
const IP_POLL: Duration = Duration::from_millis(200);
const IP_WAIT: Duration = Duration::from_secs(45);
const RESTART_COOLDOWN: Duration = Duration::from_secs(30);
const INSPECT_RETRY: Duration = Duration::from_millis(200);
const RECHECK_FIRST: Duration = Duration::from_secs(1);
const RECHECK_MAX: Duration = Duration::from_secs(30);
const RECHECK_BUDGET: Duration = Duration::from_secs(30 * 60);
const STALE_FANOUT: usize = 8;

/// The provider's copy of a pod incarnation it owns.
#[derive(Debug, Clone)]
struct Tracked {
    uid: String,
    /// The API copy this incarnation was last reconciled with, shared with `Slot::latest` (a
    /// dense node holds a thousand of these; copies were most of the daemon's memory).
    pod: Arc<Pod>,
    spec: VmSpec,
    vm: Option<VmInfo>,
    ip: String,
    start_time: Option<Time>,
    /// Latest probe result (ready, message).
    probe: Option<(bool, String)>,
}

#[derive(Debug, Clone)]
enum CreateStep {
    InspectByName,
    RmStaleByName,
    /// §5 step 6: was this VM hibernated (registry tag, or local snapshot without a registry)?
    Evidence,
    RmFork,
    SnapInspect {
        pulled: bool,
    },
    PullSnapshot,
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
    RunInspect,
    Lease,
}

#[derive(Debug, Clone)]
struct CreateOp {
    uid: String,
    spec: VmSpec,
    step: CreateStep,
    started: Instant,
    local_snapshot: String,
    snapshot_image: String,
    vm: Option<VmInfo>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeleteStep {
    ApiFirst,
    Inspect,
    Save { retried: bool },
    RmHolder,
    Push,
    Rm,
    RmSnapshot,
    RmForkSnapshot,
    ApiLast,
}

#[derive(Debug, Clone)]
struct DeleteOp {
    uid: String,
    step: DeleteStep,
    vm_name: String,
    keep: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EvictStep {
    Remove,
    Status,
    Delete,
}

#[derive(Debug, Clone)]
struct EvictOp {
    uid: String,
    reason: EvictReason,
    message: String,
    step: EvictStep,
    attempts: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckStep {
    Inspect {
        attempt: u32,
    },
    Start,
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
struct CheckOp {
    uid: String,
    vm_id: String,
    step: CheckStep,
}

#[derive(Debug, Clone)]
enum Op {
    Create(Box<CreateOp>),
    /// Poll the lease until the VM has an IP, then publish Ready (§14.3). Preemptible.
    ReadyWait {
        uid: String,
        vm_id: String,
        until: Instant,
    },
    Delete(DeleteOp),
    Evict(EvictOp),
    Check(CheckOp),
    /// DELETE of the API object for a pod being deleted that we do not track.
    ApiDelete {
        uid: String,
    },
}

impl Op {
    fn preemptible(&self) -> bool {
        matches!(
            self,
            Op::ReadyWait { .. }
                | Op::Check(CheckOp {
                    step: CheckStep::Deferred { .. },
                    ..
                })
        )
    }
}

#[derive(Debug, Default)]
struct Slot {
    /// Latest copy from the API (None once deleted there).
    latest: Option<Arc<Pod>>,
    tracked: Option<Tracked>,
    intent: Option<Intent>,
    op: Option<Op>,
    awaiting: Option<OpId>,
    /// (due, token); a fired timer whose token differs is stale.
    timer: Option<(Instant, u64)>,
    /// Consecutive failures of create / delete (backoff exponent).
    failures: u32,
    retry_at: Option<Instant>,
    /// The pod copy whose create failed permanently (bad input): retried only when it changes.
    rejected: Option<Arc<Pod>>,
    /// UID whose API object we already asked to delete with grace 0.
    api_deleted: Option<String>,
    /// UID we evicted: never re-created; its graceful deletion is finished with grace 0.
    evicted: Option<String>,
    /// A VM-gone event that arrived while a create was in flight, replayed when it ends.
    vm_event_during_create: Option<(VmEventKind, VmInfo)>,
    last_pushed: Option<StatusSummary>,
    /// The last status written for an incarnation (uid): what the cluster shows, and what the
    /// kubelet view serves without building a copy per pod.
    shown: Option<(String, Arc<PodStatus>)>,
    /// Updates that asked for unsupported changes, so the Warning is emitted once per change.
    warned_hibernate: bool,
}

/// What an outstanding effect result is for.
#[derive(Debug, Clone)]
enum Waiter {
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
    Ignore,
}

#[derive(Debug, Clone)]
enum TimerEntry {
    Pod {
        key: PodKey,
        token: u64,
    },
    Drift,
    Lifecycle,
    Reissue {
        waiter: Waiter,
    },
    StaleWatch {
        vm: VmInfo,
        delay: Duration,
        until: Instant,
    },
}

struct Startup {
    pods: Vec<Pod>,
    vms: Vec<VmInfo>,
    /// Stale `creating` VMs still waiting for the verb.
    queue: Vec<VmInfo>,
    in_flight: usize,
    /// Stale VMs handed to a background watcher (never adopted nor treated as orphans now).
    watched: Vec<VmInfo>,
}

pub struct Provider {
    cfg: ProviderConfig,
    next_op: OpId,
    next_token: u64,
    now: Instant,
    wall: Time,
    out: Vec<Effect>,
    started: bool,
    startup: Option<Startup>,
    buffered: Vec<Input>,
    slots: BTreeMap<PodKey, Slot>,
    waiters: BTreeMap<OpId, Waiter>,
    /// Running shared reads (`pod_cocoon_read`), by argv.
    shared_reads: BTreeMap<Vec<String>, OpId>,
    /// VM-name index: VMs we created, adopted, or orphans kept for adoption.
    by_name: BTreeMap<String, VmInfo>,
    last_restart: BTreeMap<String, Instant>,
    timers: BTreeMap<(Instant, u64), TimerEntry>,
    /// Stale-create watcher state per VM ID: (current delay, budget end).
    stale_watch_state: BTreeMap<String, (Duration, Instant)>,
}

fn to_time(t: SystemTime) -> Time {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = i64::try_from(d.as_secs()).unwrap_or(0);
    Time(DateTime::<Utc>::from_timestamp(secs, d.subsec_nanos()).unwrap_or_default())
}

fn pod_uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

fn deleting(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_some()
}

fn terminal(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded") | Some("Failed")
    )
}

/// Phase Failed with one of the eviction reasons of §11: the status our eviction writes.
fn evicted_by_us(p: &Pod) -> bool {
    let Some(st) = p.status.as_ref() else {
        return false;
    };
    st.phase.as_deref() == Some("Failed")
        && EvictReason::ALL
            .iter()
            .any(|r| st.reason.as_deref() == Some(r.as_str()))
}

/// ID of the tracked VM of a slot ("" when none).
fn vm_id_of(slot: &Slot) -> String {
    slot.tracked
        .as_ref()
        .and_then(|t| t.vm.as_ref())
        .map(|v| v.id.clone())
        .unwrap_or_default()
}

fn restart_never(p: &Pod) -> bool {
    p.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) == Some("Never")
}

/// Framework change detection (§4): containers, init/ephemeral containers,
/// activeDeadlineSeconds, tolerations, labels, annotations.
fn changed(a: &Pod, b: &Pod) -> bool {
    let empty = k8s_openapi::api::core::v1::PodSpec::default();
    let (sa, sb) = (
        a.spec.as_ref().unwrap_or(&empty),
        b.spec.as_ref().unwrap_or(&empty),
    );
    sa.containers != sb.containers
        || sa.init_containers != sb.init_containers
        || sa.ephemeral_containers != sb.ephemeral_containers
        || sa.active_deadline_seconds != sb.active_deadline_seconds
        || sa.tolerations != sb.tolerations
        || a.metadata.labels != b.metadata.labels
        || a.metadata.annotations != b.metadata.annotations
}

fn with_op(effect: &Effect, op: OpId) -> Effect {
    let mut e = effect.clone();
    match &mut e {
        Effect::PatchPodStatus { op: o, .. }
        | Effect::PatchPodAnnotations { op: o, .. }
        | Effect::DeletePod { op: o, .. } => *o = op,
        _ => {}
    }
    e
}

impl Provider {
    pub fn new(cfg: ProviderConfig) -> Self {
        Provider {
            cfg,
            next_op: 1,
            next_token: 1,
            now: Instant::now(),
            wall: to_time(SystemTime::UNIX_EPOCH),
            out: Vec::new(),
            started: false,
            startup: None,
            buffered: Vec::new(),
            slots: BTreeMap::new(),
            waiters: BTreeMap::new(),
            shared_reads: BTreeMap::new(),
            by_name: BTreeMap::new(),
            last_restart: BTreeMap::new(),
            timers: BTreeMap::new(),
            stale_watch_state: BTreeMap::new(),
        }
    }

    /// Feed one input; returns the effects to perform in order.
    pub fn handle(&mut self, input: Input, now: Instant, wall: SystemTime) -> Vec<Effect> {
        self.now = now;
        self.wall = to_time(wall);
        self.dispatch(input);
        std::mem::take(&mut self.out)
    }

    /// Whether the startup reconcile has finished (pod events are buffered until then).
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// When the daemon must feed `Input::Tick` next (None = no timer pending).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.keys().next().map(|(t, _)| *t)
    }

    /// Stop every probe agent (shutdown §25: VMs keep running, nothing else to do).
    pub fn shutdown(&mut self) -> Vec<Effect> {
        self.slots
            .iter()
            .filter(|(_, s)| s.tracked.as_ref().and_then(|t| t.vm.as_ref()).is_some())
            .map(|(k, _)| Effect::StopProbe { key: k.clone() })
            .collect()
    }

    /// The tracked pod copy (GetPod) with its current provider status.
    pub fn get_pod(&self, key: &PodKey) -> Option<Pod> {
        let slot = self.slots.get(key)?;
        let t = slot.tracked.as_ref()?;
        let mut p = (*t.pod).clone();
        p.status = Some(self.compute_status(slot, t));
        Some(p)
    }

    /// Every tracked pod (GetPods / `/runningpods/`): the shared API copy, whose own status is
    /// stale, and the status last written for it (computed when none was written yet).
    pub fn pods(&self) -> Vec<(Arc<Pod>, Arc<PodStatus>)> {
        self.slots
            .values()
            .filter_map(|slot| {
                let t = slot.tracked.as_ref()?;
                let status = match &slot.shown {
                    Some((uid, st)) if *uid == t.uid => st.clone(),
                    _ => Arc::new(self.compute_status(slot, t)),
                };
                Some((t.pod.clone(), status))
            })
            .collect()
    }

    /// The VMs of every tracked pod.
    pub fn tracked_vms(&self) -> impl Iterator<Item = &VmInfo> {
        self.slots
            .values()
            .filter_map(|s| s.tracked.as_ref()?.vm.as_ref())
    }

    /// The VM of a tracked pod (logs, exec, stats).
    pub fn pod_vm(&self, key: &PodKey) -> Option<&VmInfo> {
        self.slots.get(key)?.tracked.as_ref()?.vm.as_ref()
    }

    /// `vm_table_size{namespace}`: tracked VMs per namespace.
    pub fn vm_table_sizes(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (k, s) in &self.slots {
            if s.tracked.as_ref().and_then(|t| t.vm.as_ref()).is_some() {
                *m.entry(k.namespace.clone()).or_insert(0) += 1;
            }
        }
        m
    }

    // ----- plumbing -------------------------------------------------------------------------

    fn op_id(&mut self) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        id
    }

    fn arm(&mut self, at: Instant, entry: TimerEntry) {
        let seq = self.next_token;
        self.next_token += 1;
        self.timers.insert((at, seq), entry);
    }

    fn set_pod_timer(&mut self, key: &PodKey, at: Instant) {
        let token = self.next_token;
        self.next_token += 1;
        if let Some(slot) = self.slots.get_mut(key) {
            slot.timer = Some((at, token));
        }
        self.arm(
            at,
            TimerEntry::Pod {
                key: key.clone(),
                token,
            },
        );
    }

    fn slot(&mut self, key: &PodKey) -> &mut Slot {
        self.slots.entry(key.clone()).or_default()
    }

    fn metric(&mut self, m: MetricUpdate) {
        self.out.push(Effect::Metric(m));
    }

    fn lifecycle_metric(&mut self, op: &'static str, result: &'static str, reason: &'static str) {
        self.metric(MetricUpdate::PodLifecycle { op, result, reason });
    }

    fn event(&mut self, key: &PodKey, uid: &str, t: EventType, reason: &'static str, msg: &str) {
        self.out.push(Effect::Event {
            key: key.clone(),
            uid: uid.to_string(),
            type_: t,
            reason,
            message: truncate_bytes(msg, 512),
        });
    }

    /// Issue a cocoon call the pod's op waits for.
    fn pod_cocoon(&mut self, key: &PodKey, cmd: CocoonCmd) {
        let op = self.op_id();
        self.waiters.insert(op, Waiter::PodStep(key.clone()));
        self.slot(key).awaiting = Some(op);
        self.out.push(Effect::Cocoon { op, cmd });
    }

    /// A read-only cocoon call (an inspect) that pods share: a pod whose identical read is
    /// already running waits for that answer instead of starting another process. The answer
    /// is at most one call older than its own would be; a burst of pods cloned from one
    /// snapshot then costs a few inspects instead of one per pod.
    fn pod_cocoon_read(&mut self, key: &PodKey, cmd: CocoonCmd) {
        let argv = cmd.argv();
        if let Some(&op) = self.shared_reads.get(&argv) {
            if let Some(Waiter::SharedRead { keys, .. }) = self.waiters.get_mut(&op) {
                keys.push(key.clone());
                self.slot(key).awaiting = Some(op);
                return;
            }
        }
        let op = self.op_id();
        self.shared_reads.insert(argv.clone(), op);
        self.waiters.insert(
            op,
            Waiter::SharedRead {
                argv,
                keys: vec![key.clone()],
            },
        );
        self.slot(key).awaiting = Some(op);
        self.out.push(Effect::Cocoon { op, cmd });
    }

    fn pod_effect(&mut self, key: &PodKey, mk: impl FnOnce(OpId) -> Effect) {
        let op = self.op_id();
        self.waiters.insert(op, Waiter::PodStep(key.clone()));
        self.slot(key).awaiting = Some(op);
        let e = mk(op);
        self.out.push(e);
    }

    /// Look the lease up for a tracked pod that has no IP (adoption, drift repair).
    fn refresh_ip(&mut self, key: &PodKey) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.as_ref()) else {
            return;
        };
        let mac = t.vm.as_ref().map(|v| v.primary_mac()).unwrap_or_default();
        if !t.ip.is_empty() || mac.is_empty() {
            return;
        }
        let uid = t.uid.clone();
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::Lease {
                key: key.clone(),
                uid,
            },
        );
        self.out.push(Effect::LookupLease { op, mac });
    }

    fn fire_and_forget_cocoon(&mut self, cmd: CocoonCmd) {
        let op = self.op_id();
        self.waiters.insert(op, Waiter::Ignore);
        self.out.push(Effect::Cocoon { op, cmd });
    }

    fn send_status(&mut self, key: &PodKey, uid: &str, st: PodStatus, ready_publication: bool) {
        let op = self.op_id();
        let st = Arc::new(st);
        self.slot(key).shown = Some((uid.to_string(), st.clone()));
        let effect = Effect::PatchPodStatus {
            op,
            key: key.clone(),
            uid: uid.to_string(),
            status: st,
        };
        self.waiters.insert(
            op,
            Waiter::Status {
                key: key.clone(),
                uid: uid.to_string(),
                ready_publication,
                attempt: 1,
                effect: effect.clone(),
            },
        );
        self.out.push(effect);
    }

    fn send_annotations(
        &mut self,
        key: &PodKey,
        uid: &str,
        ann: BTreeMap<String, Option<String>>,
        lifecycle: bool,
    ) {
        let op = self.op_id();
        let effect = Effect::PatchPodAnnotations {
            op,
            key: key.clone(),
            uid: Some(uid.to_string()),
            annotations: ann,
        };
        self.waiters.insert(
            op,
            Waiter::Annotations {
                key: key.clone(),
                uid: uid.to_string(),
                lifecycle,
                attempt: 1,
                effect: effect.clone(),
            },
        );
        self.out.push(effect);
    }

    fn reissue(&mut self, waiter: Waiter) {
        // §9: a lifecycle flush is retried only while the intent is unchanged; a newer state
        // written meanwhile must not be overwritten by this older one.
        // Other patches that carry the triple (the id/ip write) carry the current one.
        let mut waiter = waiter;
        // A status retry carries the status of its time: once a newer one was sent (its own
        // retries cover its failures) this one would overwrite it with stale content.
        if let Waiter::Status {
            key,
            effect: Effect::PatchPodStatus { status, .. },
            ..
        } = &waiter
        {
            let newest = self.slots.get(key).and_then(|s| s.shown.as_ref());
            if newest.is_some_and(|(_, shown)| !Arc::ptr_eq(shown, status)) {
                return;
            }
        }
        if let Waiter::Annotations {
            key,
            uid,
            lifecycle,
            effect,
            ..
        } = &mut waiter
        {
            if *lifecycle && !self.lifecycle_current(key, uid, effect) {
                return;
            }
            let intent = self.slots.get(key).and_then(|s| s.intent.as_ref());
            if let (false, Effect::PatchPodAnnotations { annotations, .. }) = (*lifecycle, effect) {
                if annotations.contains_key(spec::ANN_LIFECYCLE_STATE) {
                    match intent.filter(|i| i.uid == *uid) {
                        Some(i) => annotations.extend(i.patch()),
                        None => {
                            for k in [
                                spec::ANN_LIFECYCLE_STATE,
                                spec::ANN_LIFECYCLE_GEN,
                                spec::ANN_LIFECYCLE_MSG,
                            ] {
                                annotations.remove(k);
                            }
                        }
                    }
                }
            }
        }
        let op = self.op_id();
        let effect = match &waiter {
            Waiter::Status { effect, .. } | Waiter::Annotations { effect, .. } => {
                with_op(effect, op)
            }
            _ => return,
        };
        self.waiters.insert(op, waiter);
        self.out.push(effect);
    }

    /// Whether a lifecycle patch still says what the pod's intent says (same incarnation).
    fn lifecycle_current(&self, key: &PodKey, uid: &str, effect: &Effect) -> bool {
        let Effect::PatchPodAnnotations { annotations, .. } = effect else {
            return false;
        };
        self.slots
            .get(key)
            .and_then(|s| s.intent.as_ref())
            .map(|i| i.uid == uid && i.patch().iter().all(|(k, v)| annotations.get(k) == Some(v)))
            .unwrap_or(false)
    }

    // ----- dispatch -------------------------------------------------------------------------

    fn dispatch(&mut self, input: Input) {
        if !self.started {
            match input {
                Input::StartupListed { pods, vms } => return self.startup(pods, vms),
                Input::PodUpserted(_) | Input::PodDeleted(_) | Input::PodsRelisted(_) => {
                    self.buffered.push(input);
                    return;
                }
                _ => {}
            }
        }
        match input {
            Input::StartupListed { .. } => {
                log::warn!("provider: StartupListed after startup ignored");
            }
            Input::PodUpserted(pod) => self.pod_upserted(*pod),
            Input::PodDeleted(pod) => self.pod_deleted(&pod),
            Input::PodsRelisted(pods) => self.pods_relisted(pods),
            Input::CocoonDone { op, result } => self.on_result(op, Res::Cocoon(result)),
            Input::LeaseLooked { op, result } => self.on_result(op, Res::Lease(result)),
            Input::KubeDone { op, result } => self.on_result(op, Res::Kube(result)),
            Input::TransferDone { op, result } => self.on_result(op, Res::Transfer(result)),
            Input::HibernateEvidence { op, result } => self.on_result(op, Res::Evidence(result)),
            Input::VmEvent { kind, vm } => self.vm_event(kind, vm),
            Input::Readiness {
                key,
                uid,
                ready,
                message,
                ip,
            } => self.readiness(&key, &uid, ready, message, ip),
            Input::Tick => self.tick(),
        }
    }

    fn pod_upserted(&mut self, pod: Pod) {
        let key = PodKey::of(&pod);
        self.slot(&key).latest = Some(Arc::new(pod));
        self.kick(&key);
    }

    fn pod_deleted(&mut self, pod: &Pod) {
        let key = PodKey::of(pod);
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        // A DELETED for an older incarnation must not hide a newer ADDED we already saw.
        if let Some(l) = &slot.latest {
            if pod_uid(l) != pod_uid(pod) && !pod_uid(pod).is_empty() {
                return;
            }
        }
        slot.latest = None;
        self.kick(&key);
    }

    fn pods_relisted(&mut self, pods: Vec<Pod>) {
        let present: std::collections::HashSet<PodKey> = pods.iter().map(PodKey::of).collect();
        let gone: Vec<PodKey> = self
            .slots
            .iter()
            .filter(|(k, s)| s.latest.is_some() && !present.contains(*k))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            if let Some(s) = self.slots.get_mut(&k) {
                s.latest = None;
            }
            self.kick(&k);
        }
        for p in pods {
            self.pod_upserted(p);
        }
    }

    /// Re-evaluate a pod now unless its op is running (then it re-evaluates when the op ends).
    fn kick(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        match &slot.op {
            None => self.reconcile_slot(key),
            Some(op) if op.preemptible() => {
                let needs = {
                    let latest = slot.latest.as_ref();
                    latest.is_none()
                        || latest.map(|p| deleting(p)).unwrap_or(false)
                        || match (&slot.tracked, latest) {
                            (Some(t), Some(l)) => t.uid != pod_uid(l),
                            _ => false,
                        }
                };
                if needs {
                    self.end_op(key);
                } else {
                    // Updates on a pod with a background wait: apply synchronously.
                    self.maybe_update(key);
                }
            }
            Some(_) => {}
        }
    }

    /// End the current op (if any) and re-evaluate.
    fn end_op(&mut self, key: &PodKey) {
        if let Some(slot) = self.slots.get_mut(key) {
            slot.op = None;
            slot.awaiting = None;
            slot.timer = None;
        }
        self.reconcile_slot(key);
    }

    /// The framework's dispatch for a pod key with no op running.
    fn reconcile_slot(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        if slot.op.is_some() {
            return;
        }
        let latest = slot.latest.clone();
        let tracked_uid = slot.tracked.as_ref().map(|t| t.uid.clone());
        let Some(pod) = latest else {
            // Gone from the API: delete the tracked incarnation (with our copy), else drop.
            if tracked_uid.is_some() {
                self.start_delete(key);
            } else if slot.intent.as_ref().map(|i| i.flushed).unwrap_or(true)
                && slot.timer.is_none()
            {
                self.slots.remove(key);
            }
            return;
        };
        let uid = pod_uid(&pod);
        if let Some(tu) = &tracked_uid {
            if *tu != uid {
                // Same-name recreate (§6.1 step 4): drop the old incarnation; its VM stays in
                // the name index so the new CreatePod adopts it.
                self.forget(key, false);
                return self.reconcile_slot(key);
            }
        }
        if deleting(&pod) {
            if tracked_uid.is_some() {
                return self.start_delete(key);
            }
            if slot.api_deleted.as_deref() != Some(uid.as_str()) {
                return self.start_api_delete(key, &uid);
            }
            return;
        }
        if slot.api_deleted.as_deref() == Some(uid.as_str())
            || slot.evicted.as_deref() == Some(uid.as_str())
        {
            // We deleted this incarnation and wait for its DELETED.
            return;
        }
        if terminal(&pod) {
            // A pod we marked Failed for eviction but never deleted (a restart or an outage
            // between the status write and the delete) is owed its delete: without it the
            // operator never replaces it. Its VM is gone, so grace 0 as for any pod with no
            // running container (§4).
            if evicted_by_us(&pod) {
                return self.start_api_delete(key, &uid);
            }
            return;
        }
        if tracked_uid.is_none() {
            if let Some(rej) = &slot.rejected {
                if pod_uid(rej) == uid && !changed(rej, &pod) {
                    return;
                }
            }
            if let Some(at) = slot.retry_at {
                if at > self.now {
                    return;
                }
            }
            return self.start_create(key, pod);
        }
        self.maybe_update(key);
    }

    /// UpdatePod (§6.1, in-scope part): hibernate is not supported yet (Warning, no change);
    /// a generation bump re-marks the lifecycle state; everything else is a no-op.
    fn maybe_update(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let (Some(t), Some(pod)) = (&slot.tracked, &slot.latest) else {
            return;
        };
        if t.uid != pod_uid(pod) {
            return;
        }
        if !changed(&t.pod, pod) {
            // Only status or bookkeeping moved (our own writes come back as MODIFIED): share
            // the newer copy so the older one is freed instead of kept beside it.
            if !Arc::ptr_eq(&t.pod, pod) {
                let pod = pod.clone();
                if let Some(t) = self.slot(key).tracked.as_mut() {
                    t.pod = pod;
                }
            }
            return;
        }
        let pod = pod.clone();
        let uid = t.uid.clone();
        let old_hib = t.spec.hibernate;
        let parsed = spec::parse(&pod);
        let new_spec = match parsed {
            Ok(s) => s,
            Err(e) => {
                self.lifecycle_metric("update", "failed", e.reason);
                self.event(
                    key,
                    &uid,
                    EventType::Warning,
                    "ProviderUpdateFailed",
                    &e.message,
                );
                if let Some(t) = self.slot(key).tracked.as_mut() {
                    t.pod = pod;
                }
                return;
            }
        };
        if !spec::cpu_class_ok(&new_spec, self.cfg.cpu_class.as_deref()) {
            self.lifecycle_metric("update", "failed", "snapshot_cpu_class_mismatch");
        }
        let hib = new_spec.hibernate;
        let gen = new_spec.generation;
        {
            let slot = self.slot(key);
            if let Some(t) = slot.tracked.as_mut() {
                t.pod = pod;
                t.spec = VmSpec {
                    vm_id: t.spec.vm_id.clone(),
                    vm_ip: t.spec.vm_ip.clone(),
                    ..new_spec
                };
            }
            if !hib {
                slot.warned_hibernate = false;
            }
        }
        if hib && !old_hib && !self.slot(key).warned_hibernate {
            self.slot(key).warned_hibernate = true;
            self.lifecycle_metric("update", "failed", "unsupported");
            self.event(
                key,
                &uid,
                EventType::Warning,
                "HibernateUnsupported",
                "hibernate is not supported yet by this vk-cocoon; the VM keeps running and nothing changed",
            );
            return;
        }
        let cur = self.slot(key).intent.clone();
        if let Some(cur) = cur {
            if cur.uid == uid && gen > cur.generation {
                let msg = cur.message.clone();
                self.set_lifecycle(key, cur.state, &msg);
            }
        }
        self.lifecycle_metric("update", "skipped", "noop");
    }

    // ----- lifecycle triple -----------------------------------------------------------------

    /// Set the lifecycle state (§9) and flush it. Returns whether it was accepted.
    fn set_lifecycle(&mut self, key: &PodKey, state: State, message: &str) -> bool {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.as_ref() else {
            return false;
        };
        let uid = t.uid.clone();
        let gen = spec::generation(&t.pod).max(
            slot.latest
                .as_ref()
                .filter(|p| pod_uid(p) == uid)
                .map(|p| spec::generation(p))
                .unwrap_or(0),
        );
        let Some(next) = lifecycle::apply(slot.intent.as_ref(), &uid, state, gen, message) else {
            return false;
        };
        let unchanged = next.flushed;
        let patch = next.patch();
        slot.intent = Some(next);
        if !unchanged {
            self.send_annotations(key, &uid, patch, true);
        }
        true
    }

    /// markReadyPublished (§8.4): intent `ready` in memory, status patch first, annotation after.
    fn publish_ready(&mut self, key: &PodKey) {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.clone() else {
            return;
        };
        let gen = spec::generation(&t.pod);
        match lifecycle::apply(slot.intent.as_ref(), &t.uid, State::Ready, gen, "") {
            Some(next) => {
                let already = next.flushed;
                slot.intent = Some(next);
                let st = self.compute_status(self.slots.get(key).unwrap_or(&Slot::default()), &t);
                self.slot(key).last_pushed = Some(status::summary(&st));
                if already {
                    self.send_status(key, &t.uid, st, false);
                } else {
                    self.send_status(key, &t.uid, st, true);
                }
            }
            None => self.push_status(key, false),
        }
    }

    // ----- status ---------------------------------------------------------------------------

    fn compute_status(&self, slot: &Slot, t: &Tracked) -> PodStatus {
        if t.vm.is_none() {
            return status::pending(t.start_time.as_ref());
        }
        let lifecycle_ready = slot
            .intent
            .as_ref()
            .map(|i| i.uid == t.uid && i.state == State::Ready)
            .unwrap_or(false);
        let (probe_ready, msg) = match &t.probe {
            Some((r, m)) => (*r, Some(m.as_str())),
            None => (false, None),
        };
        status::running(
            &t.ip,
            probe_ready && lifecycle_ready,
            msg,
            t.start_time.as_ref(),
            &self.wall,
        )
    }

    /// Push the computed status if it differs from the last one pushed (or always when `force`).
    fn push_status(&mut self, key: &PodKey, force: bool) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        let st = self.compute_status(slot, t);
        let sum = status::summary(&st);
        if !force && slot.last_pushed.as_ref() == Some(&sum) {
            return;
        }
        let uid = t.uid.clone();
        self.slot(key).last_pushed = Some(sum);
        self.send_status(key, &uid, st, false);
    }

    // ----- create ---------------------------------------------------------------------------

    fn start_create(&mut self, key: &PodKey, pod: Arc<Pod>) {
        let uid = pod_uid(&pod);
        let spec = match spec::parse(&pod) {
            Ok(s) => s,
            Err(e) => return self.reject(key, &pod, e),
        };
        if !spec::cpu_class_ok(&spec, self.cfg.cpu_class.as_deref()) {
            let e = SpecError {
                reason: "snapshot_cpu_class_mismatch",
                message: format!(
                    "pod {key} requires snapshot CPU class {:?} but node has {:?}",
                    spec.cpu_class,
                    self.cfg.cpu_class.clone().unwrap_or_default()
                ),
            };
            return self.reject(key, &pod, e);
        }
        // Unsupported paths fail before anything is tracked or run.
        let unsupported = if spec.managed && spec.os == Os::Macos {
            Some("managed macOS guests are not supported yet")
        } else if spec.managed && spec.os == Os::Windows {
            Some("managed Windows guests are not supported yet")
        } else if spec.managed && spec.restore_from_hibernate {
            Some("restore-from-hibernate is not supported yet")
        } else if spec.managed && !spec.fork_from.is_empty() {
            Some("fork-from is not supported yet")
        } else if spec.managed
            && spec.mode != Mode::Run
            && spec.clone_from_dir.is_none()
            && spec.firecracker()
        {
            Some("cloning onto firecracker needs the post-clone fix-up, which is not supported yet")
        } else {
            None
        };
        if let Some(msg) = unsupported {
            let e = SpecError {
                reason: "unsupported",
                message: format!("pod {key}: {msg}"),
            };
            return self.reject(key, &pod, e);
        }
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.clone())
            .unwrap_or_else(|| self.wall.clone());
        let failures = {
            let slot = self.slot(key);
            slot.rejected = None;
            slot.tracked = Some(Tracked {
                uid: uid.clone(),
                pod: pod.clone(),
                spec: spec.clone(),
                vm: None,
                ip: String::new(),
                start_time: Some(start_time),
                probe: None,
            });
            slot.failures
        };
        self.set_lifecycle(key, State::Creating, "");
        // Adopt by name (§5 step 5).
        if let Some(vm) = self.by_name.get(&spec.vm_name).cloned() {
            self.slot(key).op = Some(Op::Create(Box::new(CreateOp {
                uid: uid.clone(),
                spec: spec.clone(),
                step: CreateStep::Boot,
                started: self.now,
                local_snapshot: String::new(),
                snapshot_image: String::new(),
                vm: None,
            })));
            self.lifecycle_metric("create", "ok", "adopted");
            return self.vm_up(key, vm, true);
        }
        if !spec.managed {
            if spec.vm_id.is_empty() || spec.vm_ip.is_empty() {
                let msg = format!("unmanaged vm {} missing pre-assigned IP/VMID", spec.vm_name);
                self.slot(key).op = None;
                return self.fail_create(key, &uid, &msg, false);
            }
            let vm = VmInfo {
                id: spec.vm_id.clone(),
                name: spec.vm_name.clone(),
                state: "running".into(),
                ..Default::default()
            };
            self.slot(key).op = Some(Op::Create(Box::new(CreateOp {
                uid,
                spec: spec.clone(),
                step: CreateStep::Boot,
                started: self.now,
                local_snapshot: String::new(),
                snapshot_image: String::new(),
                vm: None,
            })));
            if let Some(t) = self.slot(key).tracked.as_mut() {
                t.ip = spec.vm_ip.clone();
            }
            return self.finish_create(key, vm, false, "");
        }
        let op = CreateOp {
            uid,
            spec: spec.clone(),
            step: if failures > 0 {
                CreateStep::InspectByName
            } else {
                CreateStep::Evidence
            },
            started: self.now,
            local_snapshot: spec::local_snapshot_name(&spec.image),
            snapshot_image: String::new(),
            vm: None,
        };
        let first = op.step.clone();
        self.slot(key).op = Some(Op::Create(Box::new(op)));
        match first {
            // A retry after a failure: a previous attempt may have left a VM (hung clone).
            CreateStep::InspectByName => self.pod_cocoon(
                key,
                CocoonCmd::VmInspect {
                    reference: spec.vm_name.clone(),
                },
            ),
            _ => self.check_evidence(key, &spec.vm_name),
        }
    }

    /// §5 step 6: ask whether the VM was hibernated before booting it fresh. With a registry the
    /// evidence is the tag `<vm>:hibernate`; without one, a local snapshot named after the VM.
    fn check_evidence(&mut self, key: &PodKey, vm_name: &str) {
        if let Some(c) = self.create_op(key) {
            c.step = CreateStep::Evidence;
        }
        let vm_name = vm_name.to_string();
        if self.cfg.registry {
            self.pod_effect(key, |op| Effect::CheckHibernateEvidence { op, vm_name })
        } else {
            self.pod_cocoon(key, CocoonCmd::SnapshotInspect { name: vm_name })
        }
    }

    /// The verdict on the evidence (§5 step 6). No evidence: the fresh bring-up starts (with
    /// the `fork-<vm>` removal of step 7). Evidence fails the create, retried with backoff so
    /// that removing the tag lets the pod boot: a conflicting clone source or image is the
    /// user's to settle, and the restore the Go daemon would do is not built yet; a fresh boot
    /// would silently lose the hibernated state. An unreadable registry fails closed.
    fn evidence_verdict(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        found: Result<Option<String>, String>,
    ) {
        let vm = &c.spec.vm_name;
        let (place, remedy) = if self.cfg.registry {
            (
                format!("registry tag {vm}:hibernate"),
                format!("delete the tag {vm}:hibernate"),
            )
        } else {
            (
                format!("local snapshot {vm}"),
                format!("remove the local snapshot {vm}"),
            )
        };
        let base = match found {
            Ok(None) => {
                if let Some(c) = self.create_op(key) {
                    c.step = CreateStep::RmFork;
                }
                let name = format!("fork-{vm}");
                return self.pod_cocoon(key, CocoonCmd::SnapshotRm { name });
            }
            Err(e) => {
                self.metric(MetricUpdate::HibernateEvidence {
                    verdict: "unavailable",
                });
                let msg = format!("hibernate evidence for vm {vm} unavailable ({place}): {e}");
                self.event(
                    key,
                    &c.uid,
                    EventType::Warning,
                    "HibernateEvidenceUnavailable",
                    &msg,
                );
                return self.fail_create_as(key, &c.uid, "HibernateEvidenceFailed", &msg, true);
            }
            Ok(Some(base)) => base,
        };
        let explicit_source = c.spec.clone_from_dir.is_some() || !c.spec.fork_from.is_empty();
        let (verdict, msg) = if explicit_source {
            (
                "source_conflict",
                format!(
                    "vm {vm} has a hibernate snapshot ({place}) but the pod names an explicit \
                     clone source; {remedy} to boot from that source"
                ),
            )
        } else if !base.is_empty() && base != c.spec.image {
            (
                "image_conflict",
                format!(
                    "vm {vm} has a hibernate snapshot ({place}) of image {base} but the pod asks \
                     for {}; {remedy} to boot the new image",
                    c.spec.image
                ),
            )
        } else {
            let msg = format!(
                "vm {vm} has a hibernate snapshot ({place}); restoring it is not supported yet \
                 by this vk-cocoon and a fresh boot would lose its state; {remedy} to boot fresh"
            );
            self.event(
                key,
                &c.uid,
                EventType::Warning,
                "HibernateSnapshotExists",
                &msg,
            );
            ("restore_unsupported", msg)
        };
        self.metric(MetricUpdate::HibernateEvidence { verdict });
        self.fail_create_as(key, &c.uid, "HibernateEvidenceFailed", &msg, true)
    }

    /// Bad input / unsupported request: failure status + Warning, counter; no VM touched.
    fn reject(&mut self, key: &PodKey, pod: &Arc<Pod>, e: SpecError) {
        let uid = pod_uid(pod);
        let result = if e.reason == "missing_vmname" {
            "skipped"
        } else {
            "failed"
        };
        self.lifecycle_metric("create", result, e.reason);
        self.event(
            key,
            &uid,
            EventType::Warning,
            "ProviderCreateFailed",
            &e.message,
        );
        let st = status::provider_failed(restart_never(pod), &e.message);
        let sum = status::summary(&st);
        let slot = self.slot(key);
        slot.rejected = Some(pod.clone());
        let already = slot.last_pushed.as_ref() == Some(&sum);
        slot.last_pushed = Some(sum);
        if !already {
            self.send_status(key, &uid, st, false);
        }
    }

    fn create_op(&mut self, key: &PodKey) -> Option<&mut CreateOp> {
        match self.slots.get_mut(key)?.op.as_mut()? {
            Op::Create(c) => Some(c),
            _ => None,
        }
    }

    fn create_step(&mut self, key: &PodKey, res: Res) {
        let Some(c) = self.create_op(key) else {
            return;
        };
        let c = c.clone();
        let spec = &c.spec;
        let set_step = |p: &mut Self, step: CreateStep| {
            if let Some(c) = p.create_op(key) {
                c.step = step;
            }
        };
        match (c.step.clone(), res) {
            (CreateStep::InspectByName, Res::Cocoon(r)) => {
                if r.success {
                    if let Ok(vm) = parse_vm(&r.stdout) {
                        if vm.running() {
                            self.lifecycle_metric("create", "ok", "adopted");
                            return self.vm_up(key, vm, true);
                        }
                        set_step(self, CreateStep::RmStaleByName);
                        return self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id });
                    }
                }
                self.check_evidence(key, &spec.vm_name)
            }
            (CreateStep::RmStaleByName, Res::Cocoon(r)) => {
                if !r.success && !r.vm_not_found() {
                    let msg = format!("remove leftover vm {}: {}", spec.vm_name, r.error_text());
                    return self.fail_create(key, &c.uid, &msg, true);
                }
                self.check_evidence(key, &spec.vm_name)
            }
            (CreateStep::Evidence, Res::Evidence(found)) => self.evidence_verdict(key, &c, found),
            (CreateStep::Evidence, Res::Cocoon(r)) => {
                // No registry: a local snapshot named after the VM is the evidence. A failed
                // inspect means there is none; one that hung says nothing, so fail closed.
                let found = if r.success {
                    parse_snapshot(&r.stdout).map(|s| Some(s.image))
                } else if r.timed_out {
                    Err(format!(
                        "snapshot inspect {}: {}",
                        spec.vm_name,
                        r.error_text()
                    ))
                } else {
                    Ok(None)
                };
                self.evidence_verdict(key, &c, found)
            }
            (CreateStep::RmFork, Res::Cocoon(_)) => {
                // Failure only logged (§5 step 7).
                if let Some(dir) = spec.clone_from_dir.clone() {
                    set_step(self, CreateStep::Boot);
                    let args = self.clone_args(spec, CloneSource::FromDir(dir), true);
                    self.pod_cocoon(key, CocoonCmd::VmClone(args))
                } else if spec.mode == Mode::Run {
                    set_step(self, CreateStep::MaterialiseRun);
                    self.materialise(key, &spec.image.clone(), spec.force_pull)
                } else {
                    set_step(self, CreateStep::SnapInspect { pulled: false });
                    self.pod_cocoon_read(
                        key,
                        CocoonCmd::SnapshotInspect {
                            name: c.local_snapshot.clone(),
                        },
                    )
                }
            }
            (CreateStep::SnapInspect { pulled }, Res::Cocoon(r)) => {
                if !r.success {
                    if pulled {
                        self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                        let msg = format!(
                            "snapshot {} still missing after pull: {}",
                            c.local_snapshot,
                            r.error_text()
                        );
                        return self.fail_create(key, &c.uid, &msg, true);
                    }
                    if !self.cfg.registry {
                        self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                        let msg = format!(
                            "snapshot {} not found locally and no registry is configured: {}",
                            c.local_snapshot,
                            r.error_text()
                        );
                        return self.fail_create(key, &c.uid, &msg, true);
                    }
                    let (repo, tag) = spec::split_image(&spec.image);
                    set_step(self, CreateStep::PullSnapshot);
                    let local = c.local_snapshot.clone();
                    return self.pod_effect(key, |op| Effect::PullSnapshot {
                        op,
                        repo,
                        tag,
                        local_name: local,
                    });
                }
                if !pulled {
                    self.metric(MetricUpdate::SnapshotPull { result: "ok" });
                }
                let snap = match parse_snapshot(&r.stdout) {
                    Ok(s) => s,
                    Err(e) => return self.fail_create(key, &c.uid, &e, true),
                };
                let want = if spec.backend.is_empty() {
                    spec::BACKEND_CH
                } else {
                    spec.backend.as_str()
                };
                if !snap.hypervisor.is_empty()
                    && !spec.backend.is_empty()
                    && snap.hypervisor != want
                {
                    let msg = format!(
                        "snapshot {} was taken with {} but CocoonSet requests {}",
                        c.local_snapshot, snap.hypervisor, spec.backend
                    );
                    return self.fail_create(key, &c.uid, &msg, false);
                }
                if snap.hypervisor == spec::BACKEND_FC {
                    let msg = format!(
                        "snapshot {} is a firecracker snapshot; cloning it needs the post-clone fix-up, which is not supported yet",
                        c.local_snapshot
                    );
                    return self.fail_create(key, &c.uid, &msg, false);
                }
                if let Some(c) = self.create_op(key) {
                    c.snapshot_image = snap.image.clone();
                }
                if !snap.image.is_empty()
                    && !spec::is_http_url(&snap.image)
                    && !snap.image_digest.is_empty()
                {
                    set_step(self, CreateStep::ImageInspect);
                    return self.pod_cocoon_read(
                        key,
                        CocoonCmd::ImageInspect {
                            reference: snap.image_digest.clone(),
                        },
                    );
                }
                self.do_clone(key)
            }
            (CreateStep::PullSnapshot, Res::Transfer(r)) => match r {
                Ok(_) => {
                    self.metric(MetricUpdate::SnapshotPull { result: "ok" });
                    set_step(self, CreateStep::SnapInspect { pulled: true });
                    self.pod_cocoon(
                        key,
                        CocoonCmd::SnapshotInspect {
                            name: c.local_snapshot.clone(),
                        },
                    )
                }
                Err(e) => {
                    self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                    let msg = format!("pull snapshot {}: {e}", spec.image);
                    self.fail_create(key, &c.uid, &msg, true)
                }
            },
            (CreateStep::ImageInspect, Res::Cocoon(r)) => {
                if r.success {
                    return self.do_clone(key);
                }
                set_step(self, CreateStep::MaterialiseBase);
                let img = c.snapshot_image.clone();
                self.materialise(key, &img, false)
            }
            (CreateStep::MaterialiseBase, res) => match res.transfer_or_cocoon() {
                Ok(_) => self.do_clone(key),
                Err(e) => {
                    let msg = format!("make base image {} available: {e}", c.snapshot_image);
                    self.fail_create(key, &c.uid, &msg, true)
                }
            },
            (CreateStep::MaterialiseRun, res) => match res.transfer_or_cocoon() {
                Ok(boot) => {
                    let boot = if boot.is_empty() {
                        spec.image.clone()
                    } else {
                        boot
                    };
                    set_step(self, CreateStep::Boot);
                    let r = &spec.resources;
                    let args = RunArgs {
                        name: spec.vm_name.clone(),
                        cpu_count: r.vcpus(),
                        cpu: r.cpu_policy(),
                        memory: r.memory_bytes().map(|b| b.to_string()).unwrap_or_default(),
                        storage: spec
                            .storage_bytes
                            .map(|b| b.to_string())
                            .unwrap_or_default(),
                        network: spec.network.clone(),
                        windows: spec.os == Os::Windows,
                        firecracker: spec.firecracker(),
                        no_direct_io: spec.no_direct_io,
                        image: boot,
                    };
                    self.pod_cocoon(key, CocoonCmd::VmRun(args))
                }
                Err(e) => {
                    let msg = format!("make image {} available: {e}", spec.image);
                    self.fail_create(key, &c.uid, &msg, true)
                }
            },
            (CreateStep::Boot, Res::Cocoon(r)) => {
                if spec.clone_from_dir.is_some() {
                    self.metric(MetricUpdate::CloneFromDir {
                        result: if r.success { "ok" } else { "failed" },
                    });
                }
                if !r.success {
                    let what = if spec.mode == Mode::Run && spec.clone_from_dir.is_none() {
                        "vm run"
                    } else {
                        "vm clone"
                    };
                    // A clone killed at its deadline (or failing half-way) can leave a VM
                    // record behind; if the pod is deleted before the retry, nothing would
                    // ever remove it. Look before reporting the failure.
                    let error = format!("{what} {}: {}", spec.vm_name, r.error_text());
                    set_step(self, CreateStep::BootFailedInspect { error });
                    return self.pod_cocoon(
                        key,
                        CocoonCmd::VmInspect {
                            reference: spec.vm_name.clone(),
                        },
                    );
                }
                let vm = match parse_vm(&r.stdout) {
                    Ok(v) => v,
                    Err(e) => return self.fail_create(key, &c.uid, &e, true),
                };
                self.by_name.insert(spec.vm_name.clone(), vm.clone());
                if spec.mode == Mode::Run
                    && spec.clone_from_dir.is_none()
                    && (!vm.running() || vm.pid == 0)
                {
                    if let Some(c) = self.create_op(key) {
                        c.vm = Some(vm.clone());
                        c.step = CreateStep::RunInspect;
                    }
                    return self.pod_cocoon(key, CocoonCmd::VmInspect { reference: vm.id });
                }
                self.vm_up(key, vm, false)
            }
            (CreateStep::BootFailedInspect { error }, Res::Cocoon(r)) => {
                match (r.success, parse_vm(&r.stdout)) {
                    // The bring-up finished after all (a slow clone past its deadline).
                    (true, Ok(vm)) if vm.running() => {
                        self.by_name.insert(spec.vm_name.clone(), vm.clone());
                        self.vm_up(key, vm, false)
                    }
                    (true, Ok(vm)) => {
                        set_step(self, CreateStep::BootFailedRm { error });
                        self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id })
                    }
                    _ => self.fail_create(key, &c.uid, &error, true),
                }
            }
            (CreateStep::BootFailedRm { error }, Res::Cocoon(r)) => {
                if !r.success && !r.vm_not_found() {
                    log::warn!(
                        "provider: {key}: remove leftover of failed bring-up: {}",
                        r.error_text()
                    );
                }
                self.fail_create(key, &c.uid, &error, true)
            }
            (CreateStep::RunInspect, Res::Cocoon(r)) => {
                let vm = match (r.success, parse_vm(&r.stdout)) {
                    (true, Ok(v)) => v,
                    _ => c.vm.clone().unwrap_or_default(),
                };
                self.vm_up(key, vm, false)
            }
            (CreateStep::Lease, Res::Lease(r)) => {
                let ip = match r {
                    Ok(Some(ip)) => ip,
                    _ => String::new(),
                };
                let vm = c.vm.clone().unwrap_or_default();
                let cloned = !(spec.mode == Mode::Run && spec.clone_from_dir.is_none());
                self.finish_create(key, vm, cloned, &ip)
            }
            (step, res) => {
                log::warn!("provider: {key}: unexpected result {res:?} in create step {step:?}");
            }
        }
    }

    fn clone_args(&self, spec: &VmSpec, source: CloneSource, pull: bool) -> CloneArgs {
        CloneArgs {
            name: spec.vm_name.clone(),
            network: spec.network.clone(),
            no_direct_io: spec.no_direct_io,
            pull,
            restore_mode: if spec.firecracker() {
                None
            } else {
                Some(self.cfg.restore_mode.clone())
            },
            cpu: spec.resources.cpu_policy(),
            source,
        }
    }

    fn do_clone(&mut self, key: &PodKey) {
        let Some(c) = self.create_op(key) else {
            return;
        };
        c.step = CreateStep::Boot;
        let (spec, local, img) = (
            c.spec.clone(),
            c.local_snapshot.clone(),
            c.snapshot_image.clone(),
        );
        let args = self.clone_args(&spec, CloneSource::Snapshot(local), !img.is_empty());
        self.pod_cocoon(key, CocoonCmd::VmClone(args));
    }

    /// §5.2: with a registry and an OCI ref the snapshots room decides (cloud image import,
    /// snapshot artifact refusal, pull fallback); otherwise `cocoon image pull`.
    fn materialise(&mut self, key: &PodKey, image: &str, force: bool) {
        if self.cfg.registry && !spec::is_http_url(image) {
            let image = image.to_string();
            self.pod_effect(key, |op| Effect::MaterialiseImage { op, image, force });
        } else {
            self.pod_cocoon(
                key,
                CocoonCmd::ImagePull {
                    reference: image.to_string(),
                    force,
                },
            );
        }
    }

    /// The VM exists (booted or adopted): resolve its IP, then finish.
    fn vm_up(&mut self, key: &PodKey, vm: VmInfo, adopted: bool) {
        let Some(c) = self.create_op(key) else {
            return;
        };
        let spec = c.spec.clone();
        let started = c.started;
        if !adopted {
            let mode = if spec.mode_raw.is_empty() {
                "clone".to_string()
            } else {
                spec.mode_raw.clone()
            };
            let secs = self.now.saturating_duration_since(started).as_secs_f64();
            self.metric(MetricUpdate::VmBootDuration {
                namespace: key.namespace.clone(),
                mode,
                backend: spec.backend.clone(),
                seconds: secs,
            });
        }
        let cloned = !(adopted || spec.mode == Mode::Run && spec.clone_from_dir.is_none());
        let ip = vm.primary_ip();
        if ip.is_empty() && !vm.primary_mac().is_empty() {
            if let Some(c) = self.create_op(key) {
                c.vm = Some(vm.clone());
                c.step = CreateStep::Lease;
            }
            let mac = vm.primary_mac();
            if adopted {
                // Adoption publishes Ready now (§5 step 5): mark as not cloned.
                if let Some(c) = self.create_op(key) {
                    c.spec.mode = Mode::Run;
                    c.spec.clone_from_dir = None;
                }
            }
            return self.pod_effect(key, |op| Effect::LookupLease { op, mac });
        }
        self.finish_create(key, vm, cloned, &ip)
    }

    /// Steps 10–17 of §5, then the VM event that arrived meanwhile, if any.
    fn finish_create(&mut self, key: &PodKey, vm: VmInfo, cloned: bool, ip: &str) {
        self.settle_create(key, vm, cloned, ip);
        if let Some((kind, vm)) = self.slot(key).vm_event_during_create.take() {
            self.vm_event(kind, vm);
        }
    }

    /// Steps 10–17 of §5: id/ip annotations, track the VM, probe, Running, Ready.
    fn settle_create(&mut self, key: &PodKey, vm: VmInfo, cloned: bool, ip: &str) {
        let Some(c) = self.create_op(key) else {
            return;
        };
        let (uid, spec) = (c.uid.clone(), c.spec.clone());
        let ip = if ip.is_empty() {
            self.slot(key)
                .tracked
                .as_ref()
                .map(|t| t.ip.clone())
                .unwrap_or_default()
        } else {
            ip.to_string()
        };
        let mut ann = BTreeMap::new();
        ann.insert(ANN_VM_ID.to_string(), Some(vm.id.clone()));
        ann.insert(ANN_VM_IP.to_string(), Some(ip.clone()));
        if spec.managed {
            // The id/ip patch carries this attempt's lifecycle triple too, so the API never
            // shows this VM beside an earlier attempt's `failed` that a restart would trust.
            if let Some(intent) = self.slot(key).intent.as_ref().filter(|i| i.uid == uid) {
                ann.extend(intent.patch());
            }
            self.send_annotations(key, &uid, ann, false);
        }
        if spec.managed {
            self.by_name.insert(spec.vm_name.clone(), vm.clone());
        }
        let deleting_now = self
            .slot(key)
            .latest
            .as_ref()
            .map(|p| deleting(p))
            .unwrap_or(false);
        {
            let slot = self.slot(key);
            slot.failures = 0;
            slot.retry_at = None;
            if let Some(t) = slot.tracked.as_mut() {
                t.vm = Some(vm.clone());
                t.ip = ip.clone();
                t.spec.vm_id = vm.id.clone();
                t.spec.vm_ip = ip.clone();
                t.probe = Some(initial_probe(&ip));
            }
        }
        if !deleting_now {
            self.out.push(Effect::StartProbe {
                key: key.clone(),
                uid: uid.clone(),
                vm_id: vm.id.clone(),
                ip: ip.clone(),
                mac: vm.primary_mac(),
                probe_port: spec.probe_port,
            });
        }
        self.event(
            key,
            &uid,
            EventType::Normal,
            "ProviderCreateSuccess",
            "Create pod in provider successfully",
        );
        let needs_fixup = cloned
            && (vm.hypervisor == spec::BACKEND_FC
                || vm.nics.iter().any(|n| !n.static_ip.is_empty()));
        if needs_fixup {
            let kind = if vm.hypervisor == spec::BACKEND_FC {
                "linux_fc"
            } else {
                "linux_static"
            };
            let msg = format!(
                "clone {}: post-clone fix-up (kind={kind}) is not supported yet; the guest network may be stale",
                spec.vm_name
            );
            self.lifecycle_metric("create", "failed", "postclone_unsupported");
            self.event(key, &uid, EventType::Warning, "PostCloneUnsupported", &msg);
            self.set_lifecycle(key, State::Failed, &msg);
            self.slot(key).op = None;
            self.push_status(key, false);
            return self.reconcile_slot(key);
        }
        self.lifecycle_metric("create", "ok", "");
        if cloned {
            if ip.is_empty() {
                // Just looked the lease up: poll again in 200 ms.
                self.slot(key).op = Some(Op::ReadyWait {
                    uid,
                    vm_id: vm.id.clone(),
                    until: self.now + IP_WAIT,
                });
                self.push_status(key, false);
                let at = self.now + IP_POLL;
                return self.set_pod_timer(key, at);
            }
            return self.start_ready_wait(key, uid, vm.id);
        }
        self.slot(key).op = None;
        self.publish_ready(key);
        self.reconcile_slot(key);
    }

    /// Create failed at bring-up: Warning CreateBringUpFailed + lifecycle failed + drop the row;
    /// then the framework's ProviderFailed status + Warning and a backoff retry.
    fn fail_create(&mut self, key: &PodKey, uid: &str, err: &str, retry: bool) {
        self.fail_create_as(key, uid, "CreateBringUpFailed", err, retry)
    }

    /// A failed create: Warning `reason`, lifecycle `failed`, ProviderFailed status, and a
    /// retry with the pod's backoff when `retry`.
    fn fail_create_as(
        &mut self,
        key: &PodKey,
        uid: &str,
        reason: &'static str,
        err: &str,
        retry: bool,
    ) {
        // The retry looks the VM up by name again; an event about it says nothing more.
        self.slot(key).vm_event_during_create = None;
        self.lifecycle_metric("create", "failed", "");
        self.event(
            key,
            uid,
            EventType::Warning,
            reason,
            &format!("create: {err}"),
        );
        self.set_lifecycle(key, State::Failed, err);
        self.event(key, uid, EventType::Warning, "ProviderCreateFailed", err);
        let pod = self.slot(key).tracked.as_ref().map(|t| t.pod.clone());
        let never = pod.as_deref().map(restart_never).unwrap_or(false);
        let st = status::provider_failed(never, err);
        let sum = status::summary(&st);
        let now = self.now;
        let (failures, send) = {
            let slot = self.slot(key);
            slot.tracked = None;
            slot.op = None;
            slot.awaiting = None;
            let send = slot.last_pushed.as_ref() != Some(&sum);
            slot.last_pushed = Some(sum);
            if !retry {
                slot.rejected = pod.clone();
            }
            slot.failures += 1;
            (slot.failures, send)
        };
        if send {
            self.send_status(key, uid, st, false);
        }
        if retry {
            let at = now + pod_backoff(failures - 1);
            self.slot(key).retry_at = Some(at);
            self.set_pod_timer(key, at);
        }
        self.reconcile_slot(key);
    }

    fn ready_wait_poll(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let (Some(Op::ReadyWait { until, uid, vm_id }), Some(t)) = (&slot.op, &slot.tracked) else {
            return;
        };
        let until = *until;
        let vm = t.vm.clone().unwrap_or_default();
        // Only while the pod still tracks the same incarnation and VM (§14.3).
        if *uid != t.uid || *vm_id != vm.id || t.spec.hibernate {
            return self.end_op(key);
        }
        if !t.ip.is_empty() {
            self.metric(MetricUpdate::WakeIpWait {
                namespace: key.namespace.clone(),
                result: "ok",
            });
            self.slot(key).op = None;
            self.publish_ready(key);
            return self.reconcile_slot(key);
        }
        if self.now >= until {
            let (uid, name) = (t.uid.clone(), t.spec.vm_name.clone());
            self.metric(MetricUpdate::WakeIpWait {
                namespace: key.namespace.clone(),
                result: "timeout",
            });
            let msg = format!("clone {name}: dhcp lease not observed within 45s");
            self.event(
                key,
                &uid,
                EventType::Warning,
                "PostCloneIPWaitTimeout",
                &msg,
            );
            self.set_lifecycle(key, State::Failed, &msg);
            self.slot(key).op = None;
            self.push_status(key, false);
            return self.reconcile_slot(key);
        }
        let mac = vm.primary_mac();
        if mac.is_empty() {
            let at = self.now + IP_POLL;
            return self.set_pod_timer(key, at.min(until));
        }
        self.pod_effect(key, |op| Effect::LookupLease { op, mac });
    }

    fn ready_wait_result(&mut self, key: &PodKey, r: Result<Option<String>, String>) {
        if let Ok(Some(ip)) = r {
            if !ip.is_empty() {
                self.set_ip(key, &ip);
                return self.ready_wait_poll(key);
            }
        }
        let until = match self.slots.get(key).and_then(|s| s.op.as_ref()) {
            Some(Op::ReadyWait { until, .. }) => *until,
            _ => return,
        };
        let at = (self.now + IP_POLL).min(until);
        self.set_pod_timer(key, at);
    }

    /// A newly learned IP: remember it, re-write the ip annotation, refresh the probe default.
    fn set_ip(&mut self, key: &PodKey, ip: &str) {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.as_mut() else {
            return;
        };
        if t.ip == ip {
            return;
        }
        t.ip = ip.to_string();
        t.spec.vm_ip = ip.to_string();
        if let Some(vm) = t.vm.as_mut() {
            let _ = vm;
        }
        if matches!(&t.probe, Some((false, m)) if m == "waiting for dhcp lease")
            || t.probe.is_none()
        {
            t.probe = Some(initial_probe(ip));
        }
        let (uid, managed, vm_id) = (
            t.uid.clone(),
            t.spec.managed,
            t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default(),
        );
        if managed {
            let mut ann = BTreeMap::new();
            ann.insert(ANN_VM_ID.to_string(), Some(vm_id));
            ann.insert(ANN_VM_IP.to_string(), Some(ip.to_string()));
            self.send_annotations(key, &uid, ann, false);
        }
    }

    // ----- delete ---------------------------------------------------------------------------

    fn start_api_delete(&mut self, key: &PodKey, uid: &str) {
        let uid = uid.to_string();
        self.slot(key).op = Some(Op::ApiDelete { uid: uid.clone() });
        self.pod_effect(key, |op| Effect::DeletePod {
            op,
            key: key.clone(),
            uid,
            grace: Some(0),
        });
    }

    fn start_delete(&mut self, key: &PodKey) {
        let now = self.now;
        let slot = self.slot(key);
        let Some(t) = slot.tracked.clone() else {
            return;
        };
        if let Some(at) = slot.retry_at {
            if at > now {
                return;
            }
        }
        // keep-snapshot-on-delete refreshed from the latest copy of the same incarnation.
        let latest_same = slot.latest.clone().filter(|p| pod_uid(p) == t.uid);
        let keep = latest_same
            .as_ref()
            .and_then(|p| spec::parse(p).ok())
            .map(|s| s.keep_snapshot_on_delete)
            .unwrap_or(t.spec.keep_snapshot_on_delete);
        let api_first = latest_same
            .as_ref()
            .map(|p| {
                deleting(p)
                    && !status::has_running_container(p.status.as_ref())
                    && slot.api_deleted.as_deref() != Some(t.uid.as_str())
            })
            .unwrap_or(false);
        slot.op = Some(Op::Delete(DeleteOp {
            uid: t.uid.clone(),
            step: DeleteStep::ApiFirst,
            vm_name: t.spec.vm_name.clone(),
            keep,
        }));
        if api_first {
            let uid = t.uid.clone();
            self.slot(key).api_deleted = Some(uid.clone());
            return self.pod_effect(key, |op| Effect::DeletePod {
                op,
                key: key.clone(),
                uid,
                grace: Some(0),
            });
        }
        self.delete_after_api_first(key);
    }

    fn set_delete_step(&mut self, key: &PodKey, step: DeleteStep) {
        if let Some(Op::Delete(d)) = self.slots.get_mut(key).and_then(|s| s.op.as_mut()) {
            d.step = step;
        }
    }

    fn delete_after_api_first(&mut self, key: &PodKey) {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.clone() else {
            return;
        };
        let Some(Op::Delete(d)) = slot.op.clone() else {
            return;
        };
        if !t.spec.managed {
            self.forget(key, true);
            self.lifecycle_metric("delete", "ok", "");
            return self.delete_done(key, &t, &d);
        }
        let Some(vm) = t.vm.clone() else {
            if d.keep {
                self.lifecycle_metric("delete", "skipped", "seat_release");
                self.forget(key, true);
                return self.delete_done(key, &t, &d);
            }
            self.lifecycle_metric("delete", "skipped", "no_vm");
            self.set_delete_step(key, DeleteStep::RmSnapshot);
            return self.pod_cocoon(key, CocoonCmd::SnapshotRm { name: d.vm_name });
        };
        let role = spec::role(&key.namespace, &t.spec.owner_cocoonset, &t.spec.vm_name);
        if self.cfg.registry && spec::should_snapshot(&t.spec.snapshot_policy, role) {
            self.set_delete_step(key, DeleteStep::Inspect);
            return self.pod_cocoon(key, CocoonCmd::VmInspect { reference: vm.id });
        }
        self.set_delete_step(key, DeleteStep::Rm);
        self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id })
    }

    fn delete_step(&mut self, key: &PodKey, res: Res) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let (Some(Op::Delete(d)), Some(t)) = (slot.op.clone(), slot.tracked.clone()) else {
            // Tracking vanished (forgotten): only ApiLast can remain.
            if let Some(Op::Delete(d)) = slot.op.clone() {
                self.api_delete_result(key, d.uid, res);
            }
            return;
        };
        let vm = t.vm.clone().unwrap_or_default();
        match (d.step, res) {
            (DeleteStep::ApiFirst, Res::Kube(r)) => {
                if matches!(r, Err(KubeError::Other(_))) {
                    // Not deleted: the final grace-0 delete after the VM is gone retries it.
                    self.slot(key).api_deleted = None;
                }
                self.delete_after_api_first(key)
            }
            (DeleteStep::Inspect, Res::Cocoon(r)) => {
                if r.vm_not_found() {
                    self.set_delete_step(key, DeleteStep::Rm);
                    return self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id });
                }
                let parsed = if r.success {
                    parse_vm(&r.stdout).ok()
                } else {
                    None
                };
                match parsed {
                    None => self.delete_failed(
                        key,
                        &format!("inspect vm {} before delete: {}", vm.id, r.error_text()),
                    ),
                    Some(v) if v.running() => {
                        self.set_delete_step(key, DeleteStep::Save { retried: false });
                        self.pod_cocoon(
                            key,
                            CocoonCmd::SnapshotSave {
                                name: d.vm_name.clone(),
                                vm_id: vm.id,
                            },
                        )
                    }
                    Some(_) => {
                        self.set_delete_step(key, DeleteStep::Rm);
                        self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id })
                    }
                }
            }
            (DeleteStep::Save { retried }, Res::Cocoon(r)) => {
                if r.success {
                    self.metric(MetricUpdate::SnapshotSave { result: "ok" });
                    self.set_delete_step(key, DeleteStep::Push);
                    let (name, image) = (d.vm_name.clone(), t.spec.image.clone());
                    return self.pod_effect(key, |op| Effect::PushSnapshot {
                        op,
                        local_name: name.clone(),
                        repo: name,
                        tag: "latest".into(),
                        base_image: image,
                    });
                }
                if r.name_taken() && !retried {
                    self.set_delete_step(key, DeleteStep::RmHolder);
                    return self.pod_cocoon(
                        key,
                        CocoonCmd::SnapshotRm {
                            name: d.vm_name.clone(),
                        },
                    );
                }
                self.metric(MetricUpdate::SnapshotSave { result: "failed" });
                self.delete_failed(
                    key,
                    &format!(
                        "snapshot save {} before delete: {}",
                        d.vm_name,
                        r.error_text()
                    ),
                )
            }
            (DeleteStep::RmHolder, Res::Cocoon(_)) => {
                self.set_delete_step(key, DeleteStep::Save { retried: true });
                self.pod_cocoon(
                    key,
                    CocoonCmd::SnapshotSave {
                        name: d.vm_name.clone(),
                        vm_id: vm.id,
                    },
                )
            }
            (DeleteStep::Push, Res::Transfer(r)) => match r {
                Ok(_) => {
                    self.metric(MetricUpdate::SnapshotPush { result: "ok" });
                    self.set_delete_step(key, DeleteStep::Rm);
                    self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id })
                }
                Err(e) => {
                    self.metric(MetricUpdate::SnapshotPush { result: "failed" });
                    self.delete_failed(
                        key,
                        &format!("push snapshot {} before delete: {e}", d.vm_name),
                    )
                }
            },
            (DeleteStep::Rm, Res::Cocoon(r)) => {
                if !r.success && !r.vm_not_found() {
                    return self
                        .delete_failed(key, &format!("vm rm {}: {}", vm.id, r.error_text()));
                }
                self.release_leases(&vm);
                if self
                    .by_name
                    .get(&d.vm_name)
                    .map(|v| v.id == vm.id)
                    .unwrap_or(false)
                {
                    self.by_name.remove(&d.vm_name);
                }
                self.last_restart.remove(&vm.id);
                if d.keep {
                    return self.delete_vm_gone(key, &t, &d);
                }
                self.set_delete_step(key, DeleteStep::RmSnapshot);
                self.pod_cocoon(key, CocoonCmd::SnapshotRm { name: d.vm_name })
            }
            (DeleteStep::RmSnapshot, Res::Cocoon(_)) => {
                self.set_delete_step(key, DeleteStep::RmForkSnapshot);
                self.pod_cocoon(
                    key,
                    CocoonCmd::SnapshotRm {
                        name: format!("fork-{}", d.vm_name),
                    },
                )
            }
            (DeleteStep::RmForkSnapshot, Res::Cocoon(_)) => {
                if t.vm.is_none() {
                    self.forget(key, true);
                    return self.delete_done(key, &t, &d);
                }
                self.delete_vm_gone(key, &t, &d)
            }
            (DeleteStep::ApiLast, res) => self.api_delete_result(key, d.uid, res),
            (step, res) => {
                log::warn!("provider: {key}: unexpected result {res:?} in delete step {step:?}")
            }
        }
    }

    /// VM removed: forget, report Succeeded, count, then delete the API object.
    fn delete_vm_gone(&mut self, key: &PodKey, t: &Tracked, d: &DeleteOp) {
        self.forget(key, true);
        self.lifecycle_metric("delete", "ok", "");
        self.delete_done(key, t, d);
    }

    fn delete_done(&mut self, key: &PodKey, t: &Tracked, d: &DeleteOp) {
        self.event(
            key,
            &t.uid,
            EventType::Normal,
            "ProviderDeleteSuccess",
            "Delete pod in provider successfully",
        );
        self.slot(key).failures = 0;
        self.slot(key).retry_at = None;
        let latest = self.slot(key).latest.clone();
        match latest {
            Some(p) if pod_uid(&p) == d.uid && deleting(&p) => {
                // Terminal status, then delete at once (kubelet-duties §6 fix 3).
                let st = status::succeeded(t.start_time.as_ref(), &self.wall);
                self.send_status(key, &d.uid, st, false);
                if self.slot(key).api_deleted.as_deref() == Some(d.uid.as_str()) {
                    return self.end_op(key);
                }
                self.slot(key).api_deleted = Some(d.uid.clone());
                self.set_delete_step(key, DeleteStep::ApiLast);
                // The op stays until the API answers so the slot is not re-driven meanwhile.
                let uid = d.uid.clone();
                self.slot(key).op = Some(Op::Delete(DeleteOp {
                    step: DeleteStep::ApiLast,
                    ..d.clone()
                }));
                self.pod_effect(key, |op| Effect::DeletePod {
                    op,
                    key: key.clone(),
                    uid,
                    grace: Some(0),
                });
            }
            _ => self.end_op(key),
        }
    }

    /// Answer of a grace-0 DELETE of the pod object: done unless the API failed transiently,
    /// in which case it is retried with the pod's backoff.
    fn api_delete_result(&mut self, key: &PodKey, uid: String, res: Res) {
        let failed = matches!(res, Res::Kube(Err(KubeError::Other(_))));
        let now = self.now;
        let failures = {
            let slot = self.slot(key);
            slot.op = None;
            slot.awaiting = None;
            if failed {
                slot.api_deleted = None;
                slot.failures += 1;
            } else {
                slot.api_deleted = Some(uid);
                slot.failures = 0;
            }
            slot.failures
        };
        if failed {
            let at = now + pod_backoff(failures - 1);
            return self.set_pod_timer(key, at);
        }
        self.reconcile_slot(key);
    }

    /// "VM kept": Warning, counter, unbounded retry with backoff capped at 1000 s.
    fn delete_failed(&mut self, key: &PodKey, err: &str) {
        let uid = self
            .slot(key)
            .tracked
            .as_ref()
            .map(|t| t.uid.clone())
            .unwrap_or_default();
        let msg = format!("{err} (VM kept)");
        self.lifecycle_metric("delete", "failed", "");
        self.event(key, &uid, EventType::Warning, "ProviderDeleteFailed", &msg);
        let now = self.now;
        let failures = {
            let slot = self.slot(key);
            slot.op = None;
            slot.awaiting = None;
            slot.failures += 1;
            slot.failures
        };
        let at = now + pod_backoff(failures - 1);
        self.slot(key).retry_at = Some(at);
        self.set_pod_timer(key, at);
    }

    fn release_leases(&mut self, vm: &VmInfo) {
        if !self.cfg.lease_release {
            return;
        }
        let macs = vm.lease_macs();
        if !macs.is_empty() {
            self.out.push(Effect::ReleaseLeases { macs });
        }
    }

    /// Forget the tracked incarnation (§3): VM row, probe, intent (when `drop_intent`).
    fn forget(&mut self, key: &PodKey, drop_intent: bool) {
        let slot = self.slot(key);
        let had_vm = slot
            .tracked
            .as_ref()
            .map(|t| t.vm.is_some())
            .unwrap_or(false);
        slot.tracked = None;
        slot.last_pushed = None;
        slot.warned_hibernate = false;
        if drop_intent {
            slot.intent = None;
        }
        if had_vm {
            self.out.push(Effect::StopProbe { key: key.clone() });
        }
    }

    // ----- eviction and VM events -----------------------------------------------------------

    fn find_by_vm(&self, vm: &VmInfo) -> Option<PodKey> {
        self.slots
            .iter()
            .find(|(_, s)| {
                let tracked = s
                    .tracked
                    .as_ref()
                    .and_then(|t| t.vm.as_ref())
                    .map(|v| {
                        (!vm.id.is_empty() && v.id == vm.id)
                            || (vm.id.is_empty() && v.name == vm.name && !vm.name.is_empty())
                    })
                    .unwrap_or(false);
                let creating = matches!(&s.op, Some(Op::Create(c))
                    if !vm.name.is_empty() && c.spec.vm_name == vm.name);
                tracked || creating
            })
            .map(|(k, _)| k.clone())
    }

    fn vm_event(&mut self, kind: VmEventKind, vm: VmInfo) {
        match kind {
            VmEventKind::Deleted => {
                if self
                    .by_name
                    .get(&vm.name)
                    .map(|v| v.id == vm.id)
                    .unwrap_or(false)
                {
                    self.by_name.remove(&vm.name);
                }
            }
            VmEventKind::Added | VmEventKind::Modified => {}
        }
        let gone = kind == VmEventKind::Deleted || (kind == VmEventKind::Modified && !vm.running());
        if !gone {
            return;
        }
        let Some(key) = self.find_by_vm(&vm) else {
            return;
        };
        let slot = &self.slots[&key];
        if matches!(slot.op, Some(Op::Create(_))) {
            // The create in flight may be making this very VM: look once it is done.
            self.slot(&key).vm_event_during_create = Some((kind, vm));
            return;
        }
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        if !t.spec.managed || t.spec.hibernate {
            return;
        }
        let (uid, vm_id) = (
            t.uid.clone(),
            t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default(),
        );
        match &slot.op {
            None => {}
            Some(op) if op.preemptible() => {}
            Some(_) => return,
        }
        self.start_check(&key, uid, vm_id, CheckStep::Inspect { attempt: 1 });
    }

    fn start_check(&mut self, key: &PodKey, uid: String, vm_id: String, step: CheckStep) {
        let slot = self.slot(key);
        slot.op = Some(Op::Check(CheckOp {
            uid,
            vm_id: vm_id.clone(),
            step,
        }));
        slot.awaiting = None;
        slot.timer = None;
        self.pod_cocoon(key, CocoonCmd::VmInspect { reference: vm_id });
    }

    /// Start the deferred recheck of §11.4 (1 s doubling to 30 s, 30 min budget).
    fn defer_check(&mut self, key: &PodKey, uid: String, vm_id: String) {
        let step = CheckStep::Deferred {
            delay: RECHECK_FIRST,
            until: self.now + RECHECK_BUDGET,
        };
        let slot = self.slot(key);
        slot.op = Some(Op::Check(CheckOp { uid, vm_id, step }));
        slot.awaiting = None;
        let at = self.now + RECHECK_FIRST;
        self.set_pod_timer(key, at);
    }

    fn set_check_step(&mut self, key: &PodKey, step: CheckStep) {
        if let Some(Op::Check(c)) = self.slots.get_mut(key).and_then(|s| s.op.as_mut()) {
            c.step = step;
        }
    }

    fn check_step(&mut self, key: &PodKey, res: Res) {
        let Some(Op::Check(c)) = self.slots.get(key).and_then(|s| s.op.clone()) else {
            return;
        };
        let Res::Cocoon(r) = res else {
            return;
        };
        match c.step {
            CheckStep::Inspect { attempt } => {
                if r.vm_not_found() {
                    return self.start_evict(
                        key,
                        EvictReason::VmGone,
                        "vm no longer exists",
                        false,
                    );
                }
                let vm = if r.success {
                    parse_vm(&r.stdout).ok()
                } else {
                    None
                };
                match vm {
                    None if attempt < 2 => {
                        self.set_check_step(
                            key,
                            CheckStep::Inspect {
                                attempt: attempt + 1,
                            },
                        );
                        let at = self.now + INSPECT_RETRY * attempt;
                        self.set_pod_timer(key, at);
                    }
                    None => {
                        self.metric(MetricUpdate::VmInspectTransientFail);
                        self.defer_check(key, c.uid, c.vm_id);
                    }
                    Some(vm) => self.check_state(key, &c, vm),
                }
            }
            CheckStep::DeferredInspect { delay, until } => {
                if r.vm_not_found() {
                    return self.start_evict(
                        key,
                        EvictReason::VmGone,
                        "vm no longer exists",
                        false,
                    );
                }
                match if r.success {
                    parse_vm(&r.stdout).ok()
                } else {
                    None
                } {
                    None if self.now >= until => self.start_evict(
                        key,
                        EvictReason::VmInspectTimeout,
                        "vm inspect did not resolve within budget",
                        true,
                    ),
                    None => {
                        let delay = (delay * 2).min(RECHECK_MAX);
                        self.set_check_step(key, CheckStep::Deferred { delay, until });
                        let at = self.now + delay;
                        self.set_pod_timer(key, at);
                    }
                    Some(vm) => self.check_state(key, &c, vm),
                }
            }
            CheckStep::Start => {
                if !r.success {
                    let msg = r.error_text();
                    return self.start_evict(key, EvictReason::RestartFailed, &msg, true);
                }
                self.set_check_step(key, CheckStep::Refresh);
                self.pod_cocoon(
                    key,
                    CocoonCmd::VmInspect {
                        reference: c.vm_id.clone(),
                    },
                );
            }
            CheckStep::Refresh => {
                if let (true, Ok(vm)) = (r.success, parse_vm(&r.stdout)) {
                    if let Some(t) = self.slot(key).tracked.as_mut() {
                        if let Some(v) = t.vm.as_mut() {
                            v.pid = vm.pid;
                            v.nics = vm.nics;
                            v.state = vm.state;
                        }
                    }
                }
                self.check_done(key, &c);
            }
            CheckStep::Deferred { .. } => {}
        }
    }

    /// The VM runs (false alarm or restarted). A check may have preempted the wait for Ready
    /// of a fresh create; the intent still says `creating` then, so the wait resumes.
    fn check_done(&mut self, key: &PodKey, c: &CheckOp) {
        let creating = self
            .slot(key)
            .intent
            .as_ref()
            .map(|i| i.uid == c.uid && i.state == State::Creating)
            .unwrap_or(false);
        if creating {
            return self.start_ready_wait(key, c.uid.clone(), c.vm_id.clone());
        }
        self.end_op(key)
    }

    fn check_state(&mut self, key: &PodKey, c: &CheckOp, vm: VmInfo) {
        if vm.running() {
            if let Some(t) = self.slot(key).tracked.as_mut() {
                if let Some(v) = t.vm.as_mut() {
                    v.state = vm.state;
                    v.pid = vm.pid;
                }
            }
            return self.check_done(key, c);
        }
        let recent = self
            .last_restart
            .get(&c.vm_id)
            .map(|t| self.now.saturating_duration_since(*t) < RESTART_COOLDOWN)
            .unwrap_or(false);
        if recent {
            return self.start_evict(
                key,
                EvictReason::RestartCooldown,
                "restart cooldown not elapsed",
                true,
            );
        }
        self.last_restart.insert(c.vm_id.clone(), self.now);
        self.set_check_step(key, CheckStep::Start);
        self.pod_cocoon(
            key,
            CocoonCmd::VmStart {
                id: c.vm_id.clone(),
            },
        );
    }

    fn start_evict(&mut self, key: &PodKey, reason: EvictReason, message: &str, remove: bool) {
        let Some(t) = self.slot(key).tracked.clone() else {
            return self.end_op(key);
        };
        let vm = t.vm.clone().unwrap_or_default();
        self.slot(key).op = Some(Op::Evict(EvictOp {
            uid: t.uid.clone(),
            reason,
            message: message.to_string(),
            step: EvictStep::Remove,
            attempts: 0,
        }));
        if remove {
            return self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id });
        }
        self.release_leases(&vm);
        self.evict_status(key);
    }

    fn evict_status(&mut self, key: &PodKey) {
        let slot = self.slot(key);
        let (Some(Op::Evict(e)), Some(t)) = (slot.op.clone(), slot.tracked.clone()) else {
            return;
        };
        if let Some(Op::Evict(x)) = slot.op.as_mut() {
            x.step = EvictStep::Status;
        }
        let st = status::evicted(
            e.reason.as_str(),
            &e.message,
            t.start_time.as_ref(),
            &self.wall,
        );
        let st = Arc::new(st);
        let slot = self.slot(key);
        slot.last_pushed = Some(status::summary(&st));
        slot.shown = Some((e.uid.clone(), st.clone()));
        let (uid, k) = (e.uid.clone(), key.clone());
        self.pod_effect(key, |op| Effect::PatchPodStatus {
            op,
            key: k,
            uid,
            status: st,
        });
    }

    fn evict_delete(&mut self, key: &PodKey) {
        let Some(Op::Evict(e)) = self.slot(key).op.clone() else {
            return;
        };
        if let Some(Op::Evict(x)) = self.slot(key).op.as_mut() {
            x.step = EvictStep::Delete;
            x.attempts += 1;
        }
        let uid = e.uid.clone();
        self.pod_effect(key, |op| Effect::DeletePod {
            op,
            key: key.clone(),
            uid,
            grace: None,
        });
    }

    fn evict_step(&mut self, key: &PodKey, res: Res) {
        let Some(Op::Evict(e)) = self.slot(key).op.clone() else {
            return;
        };
        match (e.step, res) {
            (EvictStep::Remove, Res::Cocoon(r)) => {
                if !r.success && !r.vm_not_found() {
                    // §11.3 keeps the pod; the Go daemon then never looks again and the pod
                    // stays Running on a dead VM. Re-check it on the deferred schedule instead:
                    // a later round restarts or removes it.
                    log::warn!(
                        "provider: {key}: vm rm before eviction failed (rechecking): {}",
                        r.error_text()
                    );
                    let vm_id = vm_id_of(self.slot(key));
                    return self.defer_check(key, e.uid, vm_id);
                }
                let vm = self
                    .slot(key)
                    .tracked
                    .as_ref()
                    .and_then(|t| t.vm.clone())
                    .unwrap_or_default();
                self.release_leases(&vm);
                self.evict_status(key)
            }
            (EvictStep::Status, Res::Kube(_)) => self.evict_delete(key),
            (EvictStep::Delete, Res::Kube(r)) => match r {
                Ok(()) | Err(KubeError::NotFound) | Err(KubeError::Conflict) => {
                    let vm = self
                        .slot(key)
                        .tracked
                        .as_ref()
                        .and_then(|t| t.vm.clone())
                        .unwrap_or_default();
                    if self
                        .by_name
                        .get(&vm.name)
                        .map(|v| v.id == vm.id)
                        .unwrap_or(false)
                    {
                        self.by_name.remove(&vm.name);
                    }
                    let uid = e.uid.clone();
                    self.slot(key).evicted = Some(uid);
                    self.forget(key, true);
                    self.end_op(key);
                }
                Err(_) => {
                    self.metric(MetricUpdate::PodEvictFailure);
                    let delay = if e.attempts < 2 {
                        Duration::from_millis(200 * e.attempts as u64)
                    } else {
                        pod_backoff(e.attempts + 6)
                    };
                    let at = self.now + delay;
                    self.slot(key).awaiting = None;
                    self.set_pod_timer(key, at);
                }
            },
            (step, res) => log::warn!("provider: {key}: unexpected {res:?} in evict {step:?}"),
        }
    }

    // ----- readiness ------------------------------------------------------------------------

    fn readiness(
        &mut self,
        key: &PodKey,
        uid: &str,
        ready: bool,
        message: String,
        ip: Option<String>,
    ) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_mut() else {
            return;
        };
        if t.uid != uid || t.vm.is_none() {
            return;
        }
        t.probe = Some((ready, message));
        if let Some(ip) = ip {
            if !ip.is_empty() && ip != t.ip {
                self.set_ip(key, &ip);
                if let Some(Some(Op::ReadyWait { .. })) = self.slots.get(key).map(|s| &s.op) {
                    return self.ready_wait_poll(key);
                }
            }
        }
        self.push_status(key, false);
    }

    // ----- results and timers ---------------------------------------------------------------

    /// Hands a result to the op of the pod that waits on it, unless the op moved on.
    fn pod_step_result(&mut self, key: &PodKey, op: OpId, res: Res) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.awaiting != Some(op) {
            return; // stale (op was preempted)
        }
        slot.awaiting = None;
        match slot.op.clone() {
            Some(Op::Create(_)) => self.create_step(key, res),
            Some(Op::Delete(_)) => self.delete_step(key, res),
            Some(Op::Evict(_)) => self.evict_step(key, res),
            Some(Op::Check(_)) => self.check_step(key, res),
            Some(Op::ReadyWait { .. }) => {
                if let Res::Lease(r) = res {
                    self.ready_wait_result(key, r);
                }
            }
            Some(Op::ApiDelete { uid }) => self.api_delete_result(key, uid, res),
            None => {}
        }
    }

    fn on_result(&mut self, op: OpId, res: Res) {
        let Some(waiter) = self.waiters.remove(&op) else {
            return;
        };
        match waiter {
            Waiter::Ignore => {}
            Waiter::PodStep(key) => self.pod_step_result(&key, op, res),
            Waiter::SharedRead { argv, keys } => {
                self.shared_reads.remove(&argv);
                if let Res::Cocoon(r) = res {
                    for key in keys {
                        self.pod_step_result(&key, op, Res::Cocoon(r.clone()));
                    }
                }
            }
            Waiter::Status {
                key,
                uid,
                ready_publication,
                attempt,
                effect,
            } => {
                let r = match res {
                    Res::Kube(r) => r,
                    _ => return,
                };
                match r {
                    Ok(()) => {
                        if ready_publication {
                            let patch = {
                                let slot = self.slot(&key);
                                match slot.intent.as_ref() {
                                    Some(i) if i.uid == uid && i.state == State::Ready => {
                                        Some(i.patch())
                                    }
                                    _ => None,
                                }
                            };
                            if let Some(p) = patch {
                                self.send_annotations(&key, &uid, p, true);
                            }
                        }
                    }
                    Err(e) if e.superseded() => {}
                    Err(_) if attempt < KUBE_ATTEMPTS => {
                        let at = self.now + KUBE_RETRY;
                        self.arm(
                            at,
                            TimerEntry::Reissue {
                                waiter: Waiter::Status {
                                    key,
                                    uid,
                                    ready_publication,
                                    attempt: attempt + 1,
                                    effect,
                                },
                            },
                        );
                    }
                    Err(_) => {
                        // Let the drift / lifecycle reconcilers re-publish.
                        if let Some(s) = self.slots.get_mut(&key) {
                            s.last_pushed = None;
                        }
                    }
                }
            }
            Waiter::Annotations {
                key,
                uid,
                lifecycle,
                attempt,
                effect,
            } => {
                let r = match res {
                    Res::Kube(r) => r,
                    _ => return,
                };
                let still_current = |p: &Self| p.lifecycle_current(&key, &uid, &effect);
                match r {
                    Ok(()) => {
                        if lifecycle && still_current(self) {
                            if let Some(i) = self.slot(&key).intent.as_mut() {
                                i.flushed = true;
                            }
                        }
                    }
                    Err(e) if e.superseded() => {
                        if lifecycle && still_current(self) {
                            self.slot(&key).intent = None;
                        }
                    }
                    Err(_) if attempt < KUBE_ATTEMPTS && (!lifecycle || still_current(self)) => {
                        let at = self.now + KUBE_RETRY;
                        self.arm(
                            at,
                            TimerEntry::Reissue {
                                waiter: Waiter::Annotations {
                                    key,
                                    uid,
                                    lifecycle,
                                    attempt: attempt + 1,
                                    effect,
                                },
                            },
                        );
                    }
                    Err(_) => {}
                }
            }
            Waiter::Lease { key, uid } => {
                if let Res::Lease(Ok(Some(ip))) = res {
                    let same = self
                        .slots
                        .get(&key)
                        .and_then(|s| s.tracked.as_ref())
                        .map(|t| t.uid == uid && t.vm.is_some())
                        .unwrap_or(false);
                    if same && !ip.is_empty() {
                        self.set_ip(&key, &ip);
                        self.push_status(&key, false);
                    }
                }
            }
            Waiter::StaleCreate { vm, watcher } => self.stale_result(vm, watcher, res),
            Waiter::StaleInspect { vm, watcher } => self.stale_inspect_result(vm, watcher, res),
        }
    }

    fn tick(&mut self) {
        while let Some((&(at, seq), _)) = self.timers.iter().next() {
            if at > self.now {
                break;
            }
            let Some(entry) = self.timers.remove(&(at, seq)) else {
                break;
            };
            match entry {
                TimerEntry::Pod { key, token } => self.pod_timer(&key, token),
                TimerEntry::Drift => self.drift(),
                TimerEntry::Lifecycle => self.lifecycle_reflush(),
                TimerEntry::Reissue { waiter } => self.reissue(waiter),
                TimerEntry::StaleWatch { vm, delay, until } => {
                    self.stale_watch_tick(vm, delay, until)
                }
            }
        }
    }

    fn pod_timer(&mut self, key: &PodKey, token: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.timer.map(|(_, t)| t) != Some(token) {
            return;
        }
        slot.timer = None;
        if slot.retry_at.map(|t| t <= self.now).unwrap_or(false) {
            slot.retry_at = None;
        }
        match slot.op.clone() {
            None => self.reconcile_slot(key),
            Some(Op::ReadyWait { .. }) => self.ready_wait_poll(key),
            Some(Op::Check(c)) => match c.step {
                CheckStep::Inspect { .. } => {
                    self.pod_cocoon(key, CocoonCmd::VmInspect { reference: c.vm_id })
                }
                CheckStep::Deferred { delay, until } => {
                    // Stop if no pod tracks the ID any more.
                    let tracked = self
                        .slots
                        .get(key)
                        .and_then(|s| s.tracked.as_ref())
                        .filter(|t| t.uid == c.uid)
                        .and_then(|t| t.vm.as_ref())
                        .map(|v| v.id == c.vm_id)
                        .unwrap_or(false);
                    if !tracked {
                        return self.end_op(key);
                    }
                    self.set_check_step(key, CheckStep::DeferredInspect { delay, until });
                    self.pod_cocoon(key, CocoonCmd::VmInspect { reference: c.vm_id })
                }
                _ => {}
            },
            Some(Op::Evict(e)) if e.step == EvictStep::Delete => self.evict_delete(key),
            Some(_) => {}
        }
    }

    /// Status reconciler (§8.4): republish drifted statuses and repair the ip annotation.
    fn drift(&mut self) {
        let at = self.now + DRIFT_EVERY;
        self.arm(at, TimerEntry::Drift);
        let keys: Vec<PodKey> = self.slots.keys().cloned().collect();
        for key in keys {
            let slot = &self.slots[&key];
            let (Some(t), Some(api)) = (slot.tracked.as_ref(), slot.latest.as_ref()) else {
                continue;
            };
            if t.uid != pod_uid(api) || t.vm.is_none() || deleting(api) {
                continue;
            }
            if matches!(
                slot.op,
                Some(Op::Create(_)) | Some(Op::Evict(_)) | Some(Op::Delete(_))
            ) {
                continue;
            }
            let computed = status::summary(&self.compute_status(slot, t));
            let current = api.status.as_ref().map(status::summary).unwrap_or_default();
            let ann_ip = api
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANN_VM_IP).cloned());
            let (uid, ip, managed, vm_id) = (
                t.uid.clone(),
                t.ip.clone(),
                t.spec.managed,
                t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default(),
            );
            if managed && ann_ip.as_deref() != Some(ip.as_str()) {
                let mut ann = BTreeMap::new();
                ann.insert(ANN_VM_ID.to_string(), Some(vm_id));
                ann.insert(ANN_VM_IP.to_string(), Some(ip));
                self.send_annotations(&key, &uid, ann, false);
            }
            if computed != current {
                log::info!("provider: {key}: republishing drifted status");
                self.push_status(&key, true);
            }
            self.refresh_ip(&key);
        }
    }

    /// Lifecycle reconciler (§9): re-flush unflushed intents; `ready` redoes status first.
    fn lifecycle_reflush(&mut self) {
        let at = self.now + LIFECYCLE_EVERY;
        self.arm(at, TimerEntry::Lifecycle);
        let keys: Vec<PodKey> = self
            .slots
            .iter()
            .filter(|(_, s)| {
                s.intent.as_ref().map(|i| !i.flushed).unwrap_or(false)
                    && s.tracked
                        .as_ref()
                        .map(|t| Some(&t.uid) == s.intent.as_ref().map(|i| &i.uid))
                        .unwrap_or(false)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let Some(i) = self.slots[&key].intent.clone() else {
                continue;
            };
            if i.state == State::Ready {
                let slot = &self.slots[&key];
                if let Some(t) = slot.tracked.clone() {
                    let st = self.compute_status(slot, &t);
                    self.send_status(&key, &i.uid, st, true);
                }
            } else {
                self.send_annotations(&key, &i.uid, i.patch(), true);
            }
        }
    }

    // ----- startup reconcile ----------------------------------------------------------------

    fn startup(&mut self, pods: Vec<Pod>, vms: Vec<VmInfo>) {
        let (stale, ready): (Vec<VmInfo>, Vec<VmInfo>) =
            vms.into_iter().partition(|v| v.state == "creating");
        self.startup = Some(Startup {
            pods,
            vms: ready,
            queue: stale,
            in_flight: 0,
            watched: Vec::new(),
        });
        self.pump_stale();
    }

    fn pump_stale(&mut self) {
        loop {
            let Some(s) = self.startup.as_mut() else {
                return;
            };
            if s.queue.is_empty() && s.in_flight == 0 {
                return self.finish_startup();
            }
            if s.in_flight >= STALE_FANOUT || s.queue.is_empty() {
                return;
            }
            let vm = s.queue.remove(0);
            s.in_flight += 1;
            let op = self.op_id();
            self.waiters.insert(
                op,
                Waiter::StaleCreate {
                    vm: vm.clone(),
                    watcher: false,
                },
            );
            self.out.push(Effect::Cocoon {
                op,
                cmd: CocoonCmd::ReconcileStaleCreate { id: vm.id },
            });
        }
    }

    fn stale_done(&mut self, vm: Option<VmInfo>, watch: Option<VmInfo>) {
        if let Some(s) = self.startup.as_mut() {
            s.in_flight = s.in_flight.saturating_sub(1);
            if let Some(v) = vm {
                s.vms.push(v);
            }
            if let Some(v) = watch {
                s.watched.push(v.clone());
                let at = self.now + RECHECK_FIRST;
                let until = self.now + RECHECK_BUDGET;
                self.arm(
                    at,
                    TimerEntry::StaleWatch {
                        vm: v,
                        delay: RECHECK_FIRST,
                        until,
                    },
                );
            }
        }
        self.pump_stale();
    }

    fn stale_result(&mut self, vm: VmInfo, watcher: bool, res: Res) {
        let Res::Cocoon(r) = res else {
            return;
        };
        let outcome = if r.success {
            parse_stale_outcome(&r.stdout)
        } else {
            Err(r.error_text())
        };
        let label = outcome.clone().unwrap_or_else(|_| "error".into());
        self.metric(MetricUpdate::StaleCreateReconcile {
            outcome: label.clone(),
        });
        if watcher {
            if label == "collected" || label == "not-found" {
                return;
            }
            return self.stale_inspect(vm, true);
        }
        match label.as_str() {
            "collected" | "not-found" => self.stale_done(None, None),
            "not-creating" => self.stale_inspect(vm, false),
            _ => self.stale_done(None, Some(vm)),
        }
    }

    fn stale_inspect(&mut self, vm: VmInfo, watcher: bool) {
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::StaleInspect {
                vm: vm.clone(),
                watcher,
            },
        );
        self.out.push(Effect::Cocoon {
            op,
            cmd: CocoonCmd::VmInspect { reference: vm.id },
        });
    }

    fn stale_inspect_result(&mut self, vm: VmInfo, watcher: bool, res: Res) {
        let Res::Cocoon(r) = res else {
            return;
        };
        let parsed = if r.success {
            parse_vm(&r.stdout).ok()
        } else {
            None
        };
        enum V {
            Drop,
            Keep(VmInfo),
            Watch,
            Orphan(VmInfo),
        }
        let verdict = if r.vm_not_found() {
            V::Drop
        } else {
            match parsed {
                None => V::Watch,
                Some(v) if v.running() => V::Keep(v),
                Some(v) if v.state == "creating" || v.state == "created" => V::Watch,
                Some(v) => V::Orphan(v),
            }
        };
        if watcher {
            match verdict {
                V::Drop => {}
                V::Keep(v) => {
                    self.by_name.insert(v.name.clone(), v);
                }
                V::Orphan(v) => self.orphan(v),
                V::Watch => self.rearm_stale_watch(vm),
            }
            return;
        }
        match verdict {
            V::Drop => self.stale_done(None, None),
            V::Keep(v) => self.stale_done(Some(v), None),
            V::Watch => self.stale_done(None, Some(vm)),
            V::Orphan(v) => {
                self.orphan(v);
                self.stale_done(None, None)
            }
        }
    }

    fn rearm_stale_watch(&mut self, vm: VmInfo) {
        // The watch entry carries its own delay; the latest one was stored on the vm key.
        if let Some((delay, until)) = self.stale_watch_state.remove(&vm.id) {
            let delay = (delay * 2).min(RECHECK_MAX);
            if self.now + delay > until {
                log::warn!(
                    "provider: stale creating vm {} unresolved after 30 min",
                    vm.id
                );
                return;
            }
            let at = self.now + delay;
            self.arm(at, TimerEntry::StaleWatch { vm, delay, until });
        }
    }

    fn stale_watch_tick(&mut self, vm: VmInfo, delay: Duration, until: Instant) {
        self.stale_watch_state.insert(vm.id.clone(), (delay, until));
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::StaleCreate {
                vm: vm.clone(),
                watcher: true,
            },
        );
        self.out.push(Effect::Cocoon {
            op,
            cmd: CocoonCmd::ReconcileStaleCreate { id: vm.id },
        });
    }

    fn orphan(&mut self, vm: VmInfo) {
        match self.cfg.orphan_policy {
            OrphanPolicy::Destroy => {
                log::warn!("provider: destroying orphan vm {} ({})", vm.name, vm.id);
                self.fire_and_forget_cocoon(CocoonCmd::VmRm { id: vm.id.clone() });
                self.release_leases(&vm);
            }
            OrphanPolicy::Alert => {
                self.metric(MetricUpdate::OrphanVm);
                log::warn!(
                    "provider: orphan vm name={} id={} state={} ip={}",
                    vm.name,
                    vm.id,
                    vm.state,
                    vm.primary_ip()
                );
                if !vm.name.is_empty() {
                    self.by_name.insert(vm.name.clone(), vm);
                }
            }
            OrphanPolicy::Keep => {
                if !vm.name.is_empty() {
                    self.by_name.insert(vm.name.clone(), vm);
                }
            }
        }
    }

    fn finish_startup(&mut self) {
        let Some(s) = self.startup.take() else {
            return;
        };
        self.started = true;
        let by_id: BTreeMap<String, VmInfo> =
            s.vms.iter().map(|v| (v.id.clone(), v.clone())).collect();
        let by_name: BTreeMap<String, VmInfo> = s
            .vms
            .iter()
            .filter(|v| !v.name.is_empty())
            .map(|v| (v.name.clone(), v.clone()))
            .collect();
        let mut claimed: std::collections::HashSet<String> = Default::default();
        let mut adopted = 0usize;
        for pod in s.pods {
            let pod = Arc::new(pod);
            let key = PodKey::of(&pod);
            self.slot(&key).latest = Some(pod.clone());
            if terminal(&pod) {
                continue;
            }
            let Ok(spec) = spec::parse(&pod) else {
                continue;
            };
            let vm = if !spec.vm_id.is_empty() {
                by_id.get(&spec.vm_id).cloned()
            } else {
                let v = by_name.get(&spec.vm_name).cloned();
                if v.is_some() {
                    self.metric(MetricUpdate::ReconcileAdoptByName);
                }
                v
            };
            let vm = match vm {
                Some(v) => v,
                None if !spec.managed && !spec.vm_id.is_empty() && !spec.vm_ip.is_empty() => {
                    VmInfo {
                        id: spec.vm_id.clone(),
                        name: spec.vm_name.clone(),
                        state: "running".into(),
                        ..Default::default()
                    }
                }
                None => continue,
            };
            if claimed.contains(&vm.id) {
                continue;
            }
            claimed.insert(vm.id.clone());
            adopted += 1;
            self.adopt_at_startup(&key, &pod, spec, vm);
        }
        let mut orphans = 0usize;
        for vm in s.vms.iter() {
            if claimed.contains(&vm.id) {
                continue;
            }
            orphans += 1;
            self.orphan(vm.clone());
        }
        log::info!("provider: startup reconcile: {adopted} pods adopted, {orphans} orphan VMs");
        let first = self.now + DRIFT_FIRST;
        self.arm(first, TimerEntry::Drift);
        let lc = self.now + LIFECYCLE_EVERY;
        self.arm(lc, TimerEntry::Lifecycle);
        let keys: Vec<PodKey> = self.slots.keys().cloned().collect();
        for key in keys {
            self.owed_work(&key);
            self.kick(&key);
        }
        for input in std::mem::take(&mut self.buffered) {
            self.dispatch(input);
        }
    }

    fn adopt_at_startup(&mut self, key: &PodKey, pod: &Arc<Pod>, spec: VmSpec, vm: VmInfo) {
        let uid = pod_uid(pod);
        let ann = pod.metadata.annotations.clone().unwrap_or_default();
        let ip = if !vm.primary_ip().is_empty() {
            vm.primary_ip()
        } else {
            spec.vm_ip.clone()
        };
        if spec.managed && (spec.vm_id != vm.id || spec.vm_ip != ip) {
            let mut a = BTreeMap::new();
            a.insert(ANN_VM_ID.to_string(), Some(vm.id.clone()));
            a.insert(ANN_VM_IP.to_string(), Some(ip.clone()));
            self.send_annotations(key, &uid, a, false);
        }
        if spec.managed && !vm.name.is_empty() {
            self.by_name.insert(vm.name.clone(), vm.clone());
        }
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.clone())
            .or_else(|| Some(self.wall.clone()));
        let probe_port = spec.probe_port;
        let slot = self.slot(key);
        slot.intent = Intent::seed(&uid, &ann);
        slot.tracked = Some(Tracked {
            uid: uid.clone(),
            pod: pod.clone(),
            spec,
            vm: Some(vm.clone()),
            ip: ip.clone(),
            start_time,
            probe: Some(initial_probe(&ip)),
        });
        if !deleting(pod) {
            self.out.push(Effect::StartProbe {
                key: key.clone(),
                uid,
                vm_id: vm.id.clone(),
                ip,
                mac: vm.primary_mac(),
                probe_port,
            });
            self.refresh_ip(key);
        }
    }

    /// §12 owed work for in-scope ops: `creating` pods with a VM resume the IP wait (CH all-DHCP)
    /// or fail clearly when they need an unsupported fix-up; `ready` pods get their status pushed.
    fn owed_work(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let (Some(t), Some(pod)) = (slot.tracked.clone(), slot.latest.clone()) else {
            return;
        };
        if deleting(&pod) || t.vm.is_none() {
            return;
        }
        let vm = t.vm.clone().unwrap_or_default();
        if t.spec.managed && !t.spec.hibernate && !vm.running() {
            // Adopted a VM that is not running (its crash event went to the previous process):
            // handle it as §11.2 would (restart, or evict when it is gone).
            return self.start_check(key, t.uid.clone(), vm.id, CheckStep::Inspect { attempt: 1 });
        }
        if t.spec.hibernate && t.spec.managed {
            self.event(
                key,
                &t.uid,
                EventType::Warning,
                "HibernateUnsupported",
                "hibernate is not supported yet by this vk-cocoon; the VM keeps running",
            );
            self.slot(key).warned_hibernate = true;
            return self.push_status(key, false);
        }
        let ann = pod.metadata.annotations.clone().unwrap_or_default();
        let state = ann
            .get(spec::ANN_LIFECYCLE_STATE)
            .cloned()
            .unwrap_or_default();
        let pcs = ann.get(spec::ANN_POST_CLONE_STATE).cloned();
        // Adopted by name (the pod had no VM id): a create made this VM but the daemon stopped
        // before recording it, so a `failed` on the pod is an earlier attempt's and stale.
        let stale_failure = t.spec.vm_id.is_empty() && state == "failed" && pcs.is_none();
        if stale_failure && t.spec.managed {
            self.set_lifecycle(key, State::Creating, "");
        }
        let creating = state == "creating" || (state.is_empty() && pcs.is_some()) || stale_failure;
        if !creating || !t.spec.managed {
            if state.is_empty() && t.spec.managed {
                // Adopted without any lifecycle record: publish Ready as an adoption does.
                return self.publish_ready(key);
            }
            return self.push_status(key, false);
        }
        if pcs.as_deref() == Some("failed") {
            return self.push_status(key, false);
        }
        let cloned = !(t.spec.mode == Mode::Run && t.spec.clone_from_dir.is_none());
        let needs_fixup = cloned
            && (vm.hypervisor == spec::BACKEND_FC
                || vm.nics.iter().any(|n| !n.static_ip.is_empty()));
        if needs_fixup {
            let msg = format!(
                "resume {}: post-clone fix-up is not supported yet",
                t.spec.vm_name
            );
            self.event(
                key,
                &t.uid,
                EventType::Warning,
                "PostCloneUnsupported",
                &msg,
            );
            self.set_lifecycle(key, State::Failed, &msg);
            return self.push_status(key, false);
        }
        self.metric(MetricUpdate::StartupResume { op: "ready_wait" });
        self.event(
            key,
            &t.uid,
            EventType::Normal,
            "ResumedAfterRestart",
            "op=ready_wait",
        );
        self.start_ready_wait(key, t.uid.clone(), vm.id);
    }

    /// Wait for the guest IP, then publish Ready (§14.3).
    fn start_ready_wait(&mut self, key: &PodKey, uid: String, vm_id: String) {
        let until = self.now + IP_WAIT;
        self.slot(key).op = Some(Op::ReadyWait { uid, vm_id, until });
        self.push_status(key, false);
        self.ready_wait_poll(key);
    }
}

fn initial_probe(ip: &str) -> (bool, String) {
    // Until the probe module reports, "IP resolved" stands in (the no-CAP_NET_RAW fallback).
    if ip.is_empty() {
        (false, "waiting for dhcp lease".into())
    } else {
        (true, "ip resolved".into())
    }
}

#[derive(Debug)]
enum Res {
    Cocoon(CocoonResult),
    Lease(Result<Option<String>, String>),
    Kube(Result<(), KubeError>),
    Transfer(Result<String, String>),
    Evidence(Result<Option<String>, String>),
}

impl Res {
    /// For steps that accept either a cocoon `image pull` or a MaterialiseImage transfer.
    fn transfer_or_cocoon(self) -> Result<String, String> {
        match self {
            Res::Transfer(r) => r,
            Res::Cocoon(r) if r.success => Ok(String::new()),
            Res::Cocoon(r) => Err(r.error_text()),
            other => Err(format!("unexpected result {other:?}")),
        }
    }
}
