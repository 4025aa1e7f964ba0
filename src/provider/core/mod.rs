//! The provider state machine: per-pod create / update / delete / status / eviction, VM events
//! and startup reconcile. Pure: `handle(input, now, wall)` returns effects; no I/O here.
//!
//! Shape: one [`Slot`] per pod key holds the latest API copy, the tracked incarnation, the
//! lifecycle intent and at most one running [`Op`] (work is serialised per pod, pods run in
//! parallel). An op waits on one effect result (`awaiting`) or on the slot's timer. When an op
//! ends, the slot is re-evaluated against the latest API copy (`reconcile_slot`), which is where
//! the framework's create/update/delete dispatch lives.
//!
//! Files: this one holds the provider's tables, the input dispatch, the per-pod helpers and the
//! routing of answers to the op that waits; [`state`] the per-pod state types; one file per
//! operation holds its transitions: `create` (up to clone / run), `bring_up` (the VM exists:
//! settle, IP, Ready), `delete`, `check` (VM events and rechecks), `evict`, `startup`
//! (reconcile and adoption) and `kube_writes` (status / annotation patches, drift).
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
    parse_snapshot, parse_stale_outcome, parse_vm, CloneOptions, CloneSource, CocoonCmd,
    CocoonResult, RunOptions, StaleCreateOutcome, VmInfo, VmState,
};
use super::lifecycle::{self, Intent, State};
use super::spec::{self, Mode, Os, SpecError, VmSpec, ANN_VM_ID, ANN_VM_IP};
use super::status::{self, StatusSummary};
use super::{
    pod_backoff, truncate_bytes, Effect, EventType, EvictReason, Input, KubeError, MetricUpdate,
    OpId, OrphanPolicy, PodKey, ProviderConfig, VmEventKind,
};
use super::{LeaseError, TransferError};

mod bring_up;
mod check;
mod create;
mod delete;
mod evict;
mod kube_writes;
mod startup;
mod state;
#[cfg(test)]
mod tests;

use self::state::*;

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
    /// Moves the pod's op to `step` and issues the effect that step waits on, in one call: a
    /// step is never set without its question, nor a question asked for a step not set.
    fn advance(&mut self, key: &PodKey, step: impl Into<Step>, ask: Ask) {
        let step = step.into();
        let set = match (self.slot(key).op.as_mut(), step) {
            (Some(Op::Create(c)), Step::Create(s)) => {
                c.step = s;
                true
            }
            (Some(Op::Delete(d)), Step::Delete(s)) => {
                d.step = s;
                true
            }
            (Some(Op::Evict(e)), Step::Evict(s)) => {
                e.step = s;
                true
            }
            (Some(Op::Check(c)), Step::Check(s)) => {
                c.step = s;
                true
            }
            (_, step) => {
                log::warn!("provider: {key}: step {step:?} does not belong to the running op");
                false
            }
        };
        if !set {
            return;
        }
        match ask {
            Ask::Cocoon(cmd) => self.pod_cocoon(key, cmd),
            Ask::SharedRead(cmd) => self.pod_cocoon_read(key, cmd),
            Ask::Effect(mk) => self.pod_effect(key, mk),
            Ask::Timer(at) => self.set_pod_timer(key, at),
        }
    }

    /// An answer the pod's op does not expect at its step (a mixed-up effect, or a bug): never
    /// a silent stall. A Warning `UnexpectedAnswer`, and the op fails the way that retries it:
    /// a create or delete on the pod's backoff, a check or eviction by a deferred recheck, a
    /// wait for Ready by its next poll.
    fn unexpected_answer(&mut self, key: &PodKey, step: &dyn std::fmt::Debug, res: &Res) {
        let Some(op) = self.slots.get(key).and_then(|s| s.op.clone()) else {
            return;
        };
        let msg = format!(
            "step {step:?} got an unexpected {} answer; retrying",
            res.kind()
        );
        log::warn!("provider: {key}: {msg}");
        let warn = |p: &mut Self, uid: &str| {
            p.event(key, uid, EventType::Warning, "UnexpectedAnswer", &msg);
        };
        match op {
            Op::Create(c) => self.fail_create_as(key, &c.uid, "UnexpectedAnswer", &msg, true),
            Op::Delete(d) => {
                warn(self, &d.uid);
                self.delete_failed(key, &msg)
            }
            Op::Evict(EvictOp { uid, .. }) | Op::Check(CheckOp { uid, .. }) => {
                warn(self, &uid);
                let vm_id = vm_id_of(self.slot(key));
                self.defer_check(key, uid, vm_id)
            }
            Op::ReadyWait { uid, .. } => {
                warn(self, &uid);
                self.ready_wait_poll(key)
            }
            Op::ApiDelete { uid } => {
                warn(self, &uid);
                let failed = Res::Kube(Err(KubeError::Other(msg.clone())));
                self.api_delete_result(key, uid, failed)
            }
        }
    }

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
            if !slot.idle.api_deleted(&uid) {
                return self.start_api_delete(key, &uid);
            }
            return;
        }
        if slot.idle.ended(&uid) {
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
            if let Some(rej) = slot.idle.rejected() {
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
            Some(Op::ReadyWait { .. }) => match res {
                Res::Lease(r) => self.ready_wait_result(key, r),
                other => self.unexpected_answer(key, &"ReadyWait", &other),
            },
            Some(Op::ApiDelete { .. }) if !matches!(res, Res::Kube(_)) => {
                self.unexpected_answer(key, &"ApiDelete", &res)
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
                    self.advance(
                        key,
                        CheckStep::DeferredInspect { delay, until },
                        Ask::Cocoon(CocoonCmd::VmInspect { reference: c.vm_id }),
                    )
                }
                _ => {}
            },
            Some(Op::Evict(e)) if e.step == EvictStep::Delete => self.evict_delete(key),
            Some(_) => {}
        }
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
    Lease(Result<Option<String>, LeaseError>),
    Kube(Result<(), KubeError>),
    Transfer(Result<String, TransferError>),
    Evidence(Result<Option<String>, TransferError>),
}

impl Res {
    /// Which kind of answer this is, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Res::Cocoon(_) => "cocoon",
            Res::Lease(_) => "lease lookup",
            Res::Kube(_) => "Kubernetes API",
            Res::Transfer(_) => "registry transfer",
            Res::Evidence(_) => "hibernate evidence",
        }
    }

    /// For steps that accept either a cocoon `image pull` or a MaterialiseImage transfer.
    fn transfer_or_cocoon(self) -> Result<String, String> {
        match self {
            Res::Transfer(r) => r.map_err(|e| e.to_string()),
            Res::Cocoon(r) if r.success => Ok(String::new()),
            Res::Cocoon(r) => Err(r.error_text()),
            other => Err(format!("unexpected result {other:?}")),
        }
    }
}
