//! The provider state machine: per-pod create / update / delete / status / eviction, VM events
//! and startup reconcile. Pure: `handle(input, now, wall)` returns effects; no I/O here.
//!
//! Shape: one `Slot` per pod key holds the latest API copy, the tracked incarnation, the
//! lifecycle intent and at most one running `Op` (work is serialised per pod, pods run in
//! parallel). An op waits on one effect result (`awaiting`) or on the slot's timer. When an op
//! ends, the slot is re-evaluated against the latest API copy (`reconcile_slot`), which is where
//! the framework's create/update/delete dispatch lives.
//!
//! Files: this one holds the provider's tables, the input dispatch, the per-pod helpers
//! (`advance` sets a step with the effect it waits on) and the slot reconcile; `state` the
//! per-pod slot (tracked incarnation, idle sub-state, waiters, timers); `ops` each op kind's
//! state struct and step enum; `machine` the narrow context (`Cx`) and outcome (`Next`) of an
//! op's step; `answers` routes each effect's answer to the op that waits and handles answers
//! no step expects. One file per operation holds its transitions: `create` (up to clone /
//! run), `bring_up` (the VM exists: settle, IP, Ready), `ready_wait` (the wait for a guest IP
//! before Ready), `delete`, `check` (VM events and rechecks), `evict`, `startup` (reconcile
//! and adoption), `stale_creates` (the `creating` records startup finds),
//! `fork` (the node-wide `fork-<source>` snapshot flight of fork-from) and `kube_writes`
//! (status / annotation patches, drift). A new transition touches its operation's file and,
//! for a new step, the step enum in `ops`.
//!
//! An op starts, hands over and ends only through `Slot`'s functions (`start_op`,
//! `replace_op`, `finish_op`, `drop_op`, `clear_op`; `Provider::set_op`): what an ending
//! forgets is chosen there. Each op kind has its own state struct (`OpKind` in `ops`: it
//! starts from that struct and is read back only as that kind, `op_of`) and its own step enum
//! (`OpStep`), so `advance` can only set a step on the op of its kind. `answers` holds the one
//! match on the op kind for answers and for timers: each op's step and timer functions take
//! their own op struct. A step function only routes an answer to the function of its stage; a
//! stage that grows gets a function of its own.
//!
//! UpdatePod lives in `update` (the decision table and the op retry), hibernating a VM in
//! `hibernate`, waking one (and CreatePod's restore) in `wake`; `confirm_hibernated` is the
//! owed lookup after a restart that tells a finished hibernate from a VM lost mid-hibernate.
//! Clones that need a post-clone network fix-up (Windows, Firecracker, Cloud Hypervisor with a
//! static NIC) get it from `post_clone` before the IP wait.
//!
//! Managed macOS guests run through `cocoon-macos` on the same create and delete ops (their
//! steps are in `macos`), plus a periodic liveness watch that restarts a dead QEMU.
//! `source_check` is the gate of a fresh bring-up on a source the host would reach (an http(s)
//! image URL): a broken rule fails the pod for good before anything fetches it.
//!
//! Ownership (issue 17): a VM belongs to at most one live pod. A create whose VM name, or
//! unmanaged VM id, another tracked pod holds is refused for good (phase Failed, Warning,
//! `pod_lifecycle_total{reason=vm_owned_by_another_pod}`).
//!
//! Tenant isolation (`isolation`, `ledger`): a pod's VM name is one of its namespace's, a
//! tracked pod keeps it, cocoon answers to lookups by a pod's value count only when exact, and
//! every VM and VM snapshot is read, adopted or pushed over only for the namespace the
//! ownership ledger (or a manifest's owner annotation, or the name itself) ties it to.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::lifecycle::{self, Intent, State};
use super::owners::{Owned, Owner};
use super::spec::{self, Mode, Os, SpecError, VmSpec, ANN_VM_ID, ANN_VM_IP};
use super::status::{self, StatusSummary};
use super::{
    pod_backoff, truncate_bytes, Effect, EventType, EvictReason, HibernateTag, Input, KubeError,
    MetricUpdate, OpId, OrphanPolicy, PodKey, ProviderConfig, SourceCheck, SourceVerdict,
    VmEventKind,
};
use super::{LeaseError, TransferError};
use crate::vm::{
    Answer, CloneOptions, CloneSource, CocoonCmd, RunOptions, StaleCreateOutcome, VmInfo, VmState,
};

mod answers;
mod bring_up;
mod check;
mod classify;
mod confirm_hibernated;
mod create;
mod delete;
mod evict;
mod fork;
mod hibernate;
mod isolation;
mod kube_writes;
mod ledger;
mod machine;
mod macos;
mod ops;
mod post_clone;
mod read_facts;
mod ready_wait;
mod reclaim;
mod slots;
mod source_check;
mod stale_creates;
mod startup;
mod state;
#[cfg(test)]
mod tests;
mod update;
mod wake;

use self::answers::Res;
use self::ledger::{Deferred, RecordFor};
use self::machine::{Cx, Next};
use self::ops::*;
use self::state::*;

const DRIFT_FIRST: Duration = Duration::from_secs(10);
const DRIFT_EVERY: Duration = Duration::from_secs(30);
const LIFECYCLE_EVERY: Duration = Duration::from_secs(15);
const KUBE_RETRY: Duration = Duration::from_millis(500);
const KUBE_ATTEMPTS: u32 = 3;
const IP_POLL: Duration = Duration::from_millis(200);
const IP_WAIT: Duration = Duration::from_secs(45);
/// How long a create holds its non-final statuses (Pending, Running not Ready): one that is
/// Ready by then writes only its Ready status; a slower one shows its progress after it.
const STATUS_HOLD: Duration = Duration::from_secs(8);
const RESTART_COOLDOWN: Duration = Duration::from_secs(30);
/// Restart records older than this are dropped on every event-stream restart.
const RESTART_COOLDOWN_GC_AGE: Duration = Duration::from_secs(60);
const INSPECT_RETRY: Duration = Duration::from_millis(200);
const RECHECK_FIRST: Duration = Duration::from_secs(1);
const RECHECK_MAX: Duration = Duration::from_secs(30);
const RECHECK_BUDGET: Duration = Duration::from_secs(30 * 60);
const STALE_FANOUT: usize = 8;
/// Pods the startup reconcile adopts (then kicks) per input: a restart with 1,000 pods is
/// spread over many short loop turns instead of one long one.
const ADOPT_CHUNK: usize = 64;
/// The next adoption chunk is due this long after the current one: any instant after `now`
/// makes it wait for the next `Tick` (a timer due now would run in this very tick), so the
/// edge handles other inputs in between.
const ADOPT_PAUSE: Duration = Duration::from_micros(1);
/// How often a pod waiting for another pod's pull of its snapshot looks whether it landed.
const PULL_WAIT_POLL: Duration = Duration::from_millis(500);

pub struct Provider {
    cfg: ProviderConfig,
    next_op: OpId,
    next_token: u64,
    now: Instant,
    wall: Time,
    out: Vec<Effect>,
    started: bool,
    startup: Option<Startup>,
    /// The startup reconcile's adoption, while it runs chunk by chunk.
    adoption: Option<Box<Adoption>>,
    buffered: Vec<Input>,
    slots: slots::Slots,
    waiters: BTreeMap<OpId, Waiter>,
    /// Running shared reads (`pod_cocoon_read`), by argv.
    shared_reads: BTreeMap<Vec<String>, OpId>,
    /// Snapshot and image answers later creates reuse (`read_facts`: what drops them).
    read_facts: read_facts::ReadFacts,
    /// VM-name index: VMs we created, adopted, or orphans kept for adoption.
    by_name: BTreeMap<String, VmInfo>,
    /// Namespace of the last pod that held each VM of `by_name` (ownership: a kept VM goes
    /// back only to that namespace, or to the one its name is made for).
    last_holder_ns: BTreeMap<String, String>,
    last_restart: BTreeMap<String, Instant>,
    /// The snapshot reclaimer's run in progress.
    reclaim: Option<reclaim::ReclaimRun>,
    timers: BTreeMap<(Instant, u64), TimerEntry>,
    /// Snapshot pulls running, by local snapshot name: the pod pulling. One pull per snapshot
    /// at a time on the node: each pull replaces the local snapshot, so two would race.
    pulls: BTreeMap<String, PodKey>,
    /// When each local snapshot was last pulled: a `force-pull` create clones a copy pulled
    /// after it began, and pulls one otherwise.
    pulled_at: BTreeMap<String, Instant>,
    /// Fork-snapshot flights running, by source VM name (`fork`).
    forks: BTreeMap<String, ForkFlight>,
    /// The local snapshots that may exist on the node (`reclaim`).
    local_snapshots: LocalSnapshots,
    /// Stale-create watcher state per VM ID: (current delay, budget end).
    stale_watch_state: BTreeMap<String, (Duration, Instant)>,
    /// The ownership ledger (`ledger`): who each VM and local snapshot belongs to.
    owners: crate::provider::owners::Owners,
    /// VNC ports (5900–5999) reserved for macOS guests, node-unique, by the pod holding each.
    vnc_ports: BTreeMap<u16, PodKey>,
    /// The macOS watch timer is armed.
    macos_watch_armed: bool,
}

fn to_time(t: SystemTime) -> Time {
    Time(crate::rfc3339::timestamp(t))
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

/// Phase Failed with one of our eviction reasons: the status our eviction writes.
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

/// The lifecycle annotations only this daemon writes. They report what it did and are never
/// input: counting them as a change would make every write of ours a new reason to act (a
/// rejected pod re-created, re-rejected and re-written forever).
const OWN_ANNOTATIONS: [&str; 3] = [
    spec::ANN_LIFECYCLE_STATE,
    spec::ANN_LIFECYCLE_GEN,
    spec::ANN_LIFECYCLE_MSG,
];

/// The pod's annotations without our own lifecycle ones.
fn input_annotations(p: &Pod) -> impl Iterator<Item = (&String, &String)> {
    p.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| !OWN_ANNOTATIONS.contains(&k.as_str()))
}

/// Framework change detection: containers, init/ephemeral containers,
/// activeDeadlineSeconds, tolerations, labels, annotations (but not our own lifecycle ones).
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
        || !input_annotations(a).eq(input_annotations(b))
}

/// A Kubernetes event about incarnation `uid` of `key` (its message cut to 512 bytes).
fn event_effect(key: &PodKey, uid: &str, t: EventType, reason: &'static str, msg: &str) -> Effect {
    Effect::Event {
        key: key.clone(),
        uid: uid.to_string(),
        type_: t,
        reason,
        message: truncate_bytes(msg, 512),
    }
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
            adoption: None,
            buffered: Vec::new(),
            slots: slots::Slots::default(),
            waiters: BTreeMap::new(),
            shared_reads: BTreeMap::new(),
            read_facts: Default::default(),
            by_name: BTreeMap::new(),
            last_holder_ns: BTreeMap::new(),
            last_restart: BTreeMap::new(),
            reclaim: None,
            timers: BTreeMap::new(),
            stale_watch_state: BTreeMap::new(),
            pulls: BTreeMap::new(),
            pulled_at: BTreeMap::new(),
            forks: BTreeMap::new(),
            local_snapshots: LocalSnapshots::default(),
            vnc_ports: BTreeMap::new(),
            macos_watch_armed: false,
            owners: Default::default(),
        }
    }

    /// Feed one input; returns the effects to perform in order.
    pub fn handle(&mut self, input: Input, now: Instant, wall: SystemTime) -> Vec<Effect> {
        self.now = now;
        self.wall = to_time(wall);
        self.read_facts.note_input(&input, now);
        self.dispatch(input);
        self.note_snapshot_writes();
        self.read_facts.note_effects(&self.out);
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

    /// Stop every probe agent (shutdown: VMs keep running, nothing else to do).
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

    /// The pods whose slot (and so tracked VM) may have changed since the last call: the edge
    /// re-checks these pods' hypervisor watches instead of every tracked VM after each input.
    pub fn take_changed_pods(&mut self) -> std::collections::BTreeSet<PodKey> {
        self.slots.take_changed()
    }

    /// The VM of a tracked pod (logs, exec, stats).
    pub fn pod_vm(&self, key: &PodKey) -> Option<&VmInfo> {
        self.slots.get(key)?.tracked.as_ref()?.vm.as_ref()
    }

    /// VMs with a restart on record (the cooldown's memory).
    pub fn restart_records(&self) -> usize {
        self.last_restart.len()
    }

    /// How many records each of the provider's tables holds: what a soak or the simulation
    /// checks against the pods and VMs alive (memory must follow them, not the pods ever seen).
    pub fn table_sizes(&self) -> BTreeMap<&'static str, usize> {
        BTreeMap::from([
            ("slots", self.slots.len()),
            ("waiters", self.waiters.len()),
            ("shared_reads", self.shared_reads.len()),
            ("read_facts", self.read_facts.len()),
            ("by_name", self.by_name.len()),
            ("last_holder_ns", self.last_holder_ns.len()),
            ("last_restart", self.last_restart.len()),
            ("timers", self.timers.len()),
            ("pulls", self.pulls.len()),
            ("forks", self.forks.len()),
            ("local_snapshots", self.local_snapshots.may_exist.len()),
            ("stale_watch_state", self.stale_watch_state.len()),
            ("vnc_ports", self.vnc_ports.len()),
            ("buffered", self.buffered.len()),
        ])
    }

    /// `vm_table_size{namespace}`: tracked VMs per namespace.
    pub fn vm_table_sizes(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (k, s) in self.slots.iter() {
            if s.tracked.as_ref().and_then(|t| t.vm.as_ref()).is_some() {
                *m.entry(k.namespace.clone()).or_insert(0) += 1;
            }
        }
        m
    }

    /// The pods on whose behalf the effect of `op` was issued, while it waits for its answer:
    /// the pod of a step, every pod sharing a read, the pods waiting on a fork flight. Empty
    /// for node-wide work (startup, the reclaimer, detached removals) and for unknown ops.
    /// The simulation's tenant-isolation invariant reads it as each effect is issued.
    pub fn op_pods(&self, op: OpId) -> Vec<PodKey> {
        let flight = |source: &str| {
            self.forks
                .get(source)
                .map(|f| f.waiting.clone())
                .unwrap_or_default()
        };
        match self.waiters.get(&op) {
            Some(
                Waiter::PodStep(key)
                | Waiter::Status { key, .. }
                | Waiter::Annotations { key, .. }
                | Waiter::Lease { key, .. }
                | Waiter::Staged { key, .. },
            ) => vec![key.clone()],
            Some(Waiter::SharedRead { keys, .. }) => keys.clone(),
            Some(Waiter::Fork { source }) => flight(source),
            Some(Waiter::Owners { for_, .. }) => match for_ {
                RecordFor::Pod(key) => vec![key.clone()],
                RecordFor::Fork(source) => flight(source),
                RecordFor::Nobody => Vec::new(),
            },
            _ => Vec::new(),
        }
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
        self.slots.slot(key)
    }

    fn metric(&mut self, m: MetricUpdate) {
        self.out.push(Effect::Metric(m));
    }

    fn lifecycle_metric(&mut self, op: &'static str, result: &'static str, reason: &'static str) {
        self.metric(MetricUpdate::PodLifecycle { op, result, reason });
    }

    fn event(&mut self, key: &PodKey, uid: &str, t: EventType, reason: &'static str, msg: &str) {
        self.out.push(event_effect(key, uid, t, reason, msg));
    }

    /// Issue a cocoon call the pod's op waits for.
    /// Moves the pod's op to `step` and issues the effect that step waits on, in one call: a
    /// step is never set without its question, nor a question asked for a step not set.
    fn advance<S: OpStep>(&mut self, key: &PodKey, step: S, ask: Ask) {
        match self.slot(key).op_mut().and_then(S::of) {
            Some(s) => *s = step,
            // A bug, not an input: the op of this step's kind has ended. The question is
            // still asked: whichever op its answer then reaches fails through
            // `unexpected_answer` with a retry instead of stalling.
            None => log::warn!(
                "provider: {key}: step {step:?} set with no {} op running",
                S::OP
            ),
        }
        match ask {
            Ask::Recorded(changes, then) => self.pod_record_then(key, changes, then),
            Ask::Cocoon(cmd) => self.pod_cocoon(key, cmd),
            Ask::SharedRead(cmd) => self.pod_cocoon_read(key, cmd),
            Ask::Effect(mk) => self.pod_effect(key, mk),
            Ask::Timer(at) => self.set_pod_timer(key, at),
            Ask::Flight => {}
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
    /// An inspect of a snapshot or an image is answered from `read_facts` when an earlier
    /// answer still stands (no change of it since): a create then costs no inspect at all.
    fn pod_cocoon_read(&mut self, key: &PodKey, cmd: CocoonCmd) {
        if let Some(answer) = self.read_facts.answer(&cmd, self.now, &self.out) {
            let op = self.op_id();
            self.slot(key).awaiting = Some(op);
            return self.pod_step_result(key, op, Res::Cocoon(answer));
        }
        let argv = cmd.argv();
        if let Some(&op) = self.shared_reads.get(&argv) {
            if let Some(Waiter::SharedRead { keys, .. }) = self.waiters.get_mut(&op) {
                keys.push(key.clone());
                self.slot(key).awaiting = Some(op);
                return;
            }
        }
        let op = self.op_id();
        self.read_facts.read_issued(&cmd, self.now);
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
                Input::StartupListed { pods, vms, owners } => {
                    self.owners = owners;
                    return self.startup(pods, vms);
                }
                // A VM event too: it may tell of a VM the startup listing still shows (removed
                // or stopped while a stale create is settled, or adopted by a later chunk);
                // with its pod not tracked yet it would be dropped, leaving the adopted pod
                // Running on a VM that is gone.
                Input::PodUpserted(_)
                | Input::PodDeleted(_)
                | Input::PodsRelisted(_)
                | Input::VmEvent { .. } => {
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
            Input::SacDone { op, result } => self.on_result(op, Res::Sac(result)),
            Input::OwnersRecorded { op, result } => self.on_result(op, Res::Owners(result)),
            Input::PidChecked { op, alive } => self.on_result(op, Res::Pid(alive)),
            Input::VmPidRead { op, pid } => self.on_result(op, Res::VmPid(pid)),
            Input::SourceChecked { op, verdict } => self.on_result(op, Res::Source(verdict)),
            Input::VmEvent { kind, vm } => self.vm_event(kind, vm),
            Input::Readiness {
                key,
                uid,
                ready,
                message,
                ip,
            } => self.readiness(&key, &uid, ready, message, ip),
            Input::Tick => self.tick(),
            Input::EventStreamRestarted => self.cooldown_gc(),
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
        let needs = {
            let latest = slot.latest.as_ref();
            latest.is_none()
                || latest.map(|p| deleting(p)).unwrap_or(false)
                || match (&slot.tracked, latest) {
                    (Some(t), Some(l)) => t.uid != pod_uid(l),
                    _ => false,
                }
        };
        match slot.op() {
            None => self.reconcile_slot(key),
            Some(Op::Hibernate(_) | Op::Wake(_))
                if slot.latest.as_ref().is_none_or(|l| {
                    deleting(l) || slot.tracked.as_ref().is_some_and(|t| t.uid != pod_uid(l))
                }) =>
            {
                // A pod deleted (or replaced) mid-hibernate or mid-wake: its delete must not
                // wait for a save or clone that may hang for its whole deadline. The delete
                // looks the VM up by name, so whatever the op made or kept is removed; a late
                // answer finds the op gone and is dropped.
                self.end_op(key);
            }
            // Startup's hibernate confirmation decides nothing a delete or a wake has to wait
            // for: the pod has no VM, a delete looks one up by name, and a wake resolves its
            // source with the same lookups. Its lookup may be retried for as long as the
            // registry is down.
            Some(Op::ConfirmHibernated(_))
                if needs
                    || slot
                        .latest
                        .as_ref()
                        .is_some_and(|l| spec::parse(l).is_ok_and(|s| !s.hibernate)) =>
            {
                self.end_op(key)
            }
            Some(op) if op.preemptible() => {
                if needs {
                    self.end_op(key);
                } else {
                    // Updates on a pod with a background wait: apply synchronously.
                    self.maybe_update(key);
                }
            }
            // A create waiting on the node's fork-snapshot flight has run nothing of its own
            // yet: a delete need not wait for a save that may take long; the flight goes on
            // for the pods still waiting.
            Some(Op::Create(c)) if needs && matches!(c.step, CreateStep::ForkWait { .. }) => {
                self.end_op(key)
            }
            Some(_) => {}
        }
    }

    /// Starts `op` on the pod (see `Slot::start_op`): the one setter of every op kind.
    fn set_op(&mut self, key: &PodKey, op: impl Into<Op>) {
        self.slot(key).start_op(op);
    }

    /// The pod's tracked incarnation when it is `uid`: an op's answer concerns only the
    /// incarnation it runs for.
    fn tracked_as(&self, key: &PodKey, uid: &str) -> Option<Tracked> {
        let t = self.slots.get(key)?.tracked.as_ref()?;
        (t.uid == uid).then(|| t.clone())
    }

    /// The pod's running op when it is of kind `K`.
    fn op_of<K: OpKind>(&self, key: &PodKey) -> Option<&K> {
        self.slots.get(key)?.op().and_then(K::of)
    }

    /// The pod's running op when it is of kind `K`, to move it on.
    fn op_of_mut<K: OpKind>(&mut self, key: &PodKey) -> Option<&mut K> {
        self.slots.get_mut(key)?.op_mut().and_then(K::of_mut)
    }

    /// End the current op (if any) and re-evaluate.
    fn end_op(&mut self, key: &PodKey) {
        if let Some(slot) = self.slots.get_mut(key) {
            slot.clear_op();
        }
        self.reconcile_slot(key);
    }

    /// The framework's dispatch for a pod key with no op running.
    fn reconcile_slot(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        if slot.op().is_some() {
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
                // Same-name recreate: drop the old incarnation; its VM stays in
                // the name index so the new CreatePod adopts it.
                self.forget(key, false);
                return self.reconcile_slot(key);
            }
        }
        if deleting(&pod) {
            if tracked_uid.is_some() {
                return self.start_delete(key);
            }
            if slot.idle.api_deleted(&uid) {
                return;
            }
            if self.track_for_delete(key, &pod) {
                return self.start_delete(key);
            }
            return self.start_api_delete(key, &uid);
        }
        if slot.idle.ended(&uid) {
            // We deleted this incarnation and wait for its DELETED.
            return;
        }
        if terminal(&pod) {
            // A pod we marked Failed for eviction but never deleted (a restart or an outage
            // between the status write and the delete) is owed its delete: without it the
            // operator never replaces it. Its VM is gone, so grace 0 as for any pod with no
            // running container (the framework's deletion rule).
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

    /// Forget the tracked incarnation: VM row, probe, intent (when `drop_intent`).
    fn forget(&mut self, key: &PodKey, drop_intent: bool) {
        let slot = self.slot(key);
        let held = slot.tracked.as_ref().and_then(|t| t.vm.as_ref());
        let had_vm = held.is_some();
        let held_name = held.map(|v| v.name.clone()).filter(|n| !n.is_empty());
        slot.tracked = None;
        slot.last_pushed = None;
        slot.status_hold = None;
        slot.warned_hibernate = false;
        slot.update_retry = None;
        if drop_intent {
            slot.intent = None;
        }
        self.vnc_ports.retain(|_, holder| holder != key);
        if had_vm {
            self.out.push(Effect::StopProbe { key: key.clone() });
        }
        if let Some(name) = held_name {
            let by_name = &self.by_name;
            self.last_holder_ns.retain(|n, _| by_name.contains_key(n));
            self.last_holder_ns.insert(name, key.namespace.clone());
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
                    // macOS guests are not cocoon's: its events never concern them.
                    .filter(|v| v.hypervisor != crate::guest::macos::HYPERVISOR)
                    .map(|v| {
                        (!vm.id.is_empty() && v.id == vm.id)
                            || (vm.id.is_empty() && v.name == vm.name && !vm.name.is_empty())
                    })
                    .unwrap_or(false);
                let creating = s
                    .op()
                    .and_then(CreateOp::of)
                    .is_some_and(|c| !vm.name.is_empty() && c.spec.vm_name == vm.name);
                tracked || creating
            })
            .map(|(k, _)| k.clone())
    }
}

fn initial_probe(ip: &str) -> (bool, String) {
    // Not ready until the probe module reports a probe that succeeded: an IP alone says
    // nothing about the guest answering on it.
    if ip.is_empty() {
        (false, "waiting for dhcp lease".into())
    } else {
        (false, "waiting for the first probe".into())
    }
}
