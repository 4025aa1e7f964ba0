//! The kube lane's scheduler: which queued pod write (or Event) goes to the API server next.
//! Plain data on caller-supplied instants; the daemon and the seeded simulation drive the same one.
//!
//! The loop never sleeps on the rate limiter: it asks [`KubeLane::dispatch`] for the next job,
//! which hands one out only when the token bucket has a token *now* and a worker slot is free,
//! and [`KubeLane::wake_at`] says when to ask again (the next token). So priorities are exact:
//! the next token always goes to the most urgent ready pod.
//!
//! Rules (issue 14):
//! * per pod, writes are applied first-in first-out and at most one is in flight; pods run in
//!   parallel up to the slot limits;
//! * a pod holding the Failed status of a dead VM (an eviction: VM gone, restart failed, ...)
//!   goes before everything: its writes (in their order, the status usually alone) go to the
//!   next free worker with a token taken on credit (up to [`VM_DEATH_CREDIT`] tokens of
//!   debt, which the writes behind it pay), so a backlog of thousands never delays it;
//! * then a pod holding a delete or another failure status (create failed) is served before
//!   pods holding only other status / annotation writes; Events come last;
//! * a newer status of the same pod incarnation replaces a queued older one (it is the core's
//!   whole current view); an annotation patch right behind a queued annotation patch of the
//!   same incarnation merges into it. Order stays the core's: a replaced status moves to the
//!   newer one's place (the front for a dead VM's), and patches merge only when nothing was
//!   queued between them;
//! * every op id of a replaced or merged write rides on the write that carries it, so each
//!   still gets its own `KubeDone` with that write's answer.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PodStatus;

use crate::kube::ratelimit::TokenBucket;
use crate::provider::{Effect, EvictReason, OpId, PodKey};

/// Tokens of debt a dead VM's status may take when the bucket is empty: a few deaths at once
/// go out at once; a host losing every VM still writes them at the client's rate.
pub const VM_DEATH_CREDIT: f64 = 4.0;

/// How soon a queued write must go (ordered: a later variant goes first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Urgency {
    /// Status and annotation writes of live pods.
    Normal,
    /// Deletes and failure statuses other than a dead VM's (a create that failed).
    Urgent,
    /// The Failed status of an eviction: the pod's VM is gone, the cluster must know now.
    VmDeath,
}

/// What one pod write does on the API server.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteKind {
    /// JSON merge patch of pods/status guarded by the uid.
    Status { uid: String, status: Arc<PodStatus> },
    /// Merge patch of `metadata.annotations` (None deletes a key), uid-guarded when Some.
    Annotations {
        uid: Option<String>,
        annotations: BTreeMap<String, Option<String>>,
    },
    /// DELETE with a uid precondition and the grace given.
    Delete { uid: String, grace: Option<i64> },
}

/// One queued or in-flight write of one pod and every op id its answer answers.
#[derive(Clone, Debug, PartialEq)]
pub struct PodWrite {
    pub key: PodKey,
    pub ops: Vec<OpId>,
    pub kind: WriteKind,
    /// When the oldest op folded into this write was queued (for the age gauge).
    pub queued_at: Instant,
}

impl PodWrite {
    /// The write a provider effect asks for; None for effects that are not pod writes.
    pub fn from_effect(effect: &Effect, now: Instant) -> Option<PodWrite> {
        let (op, key, kind) = match effect {
            Effect::PatchPodStatus {
                op,
                key,
                uid,
                status,
            } => (
                *op,
                key,
                WriteKind::Status {
                    uid: uid.clone(),
                    status: status.clone(),
                },
            ),
            Effect::PatchPodAnnotations {
                op,
                key,
                uid,
                annotations,
            } => (
                *op,
                key,
                WriteKind::Annotations {
                    uid: uid.clone(),
                    annotations: annotations.clone(),
                },
            ),
            Effect::DeletePod {
                op,
                key,
                uid,
                grace,
            } => (
                *op,
                key,
                WriteKind::Delete {
                    uid: uid.clone(),
                    grace: *grace,
                },
            ),
            _ => return None,
        };
        Some(PodWrite {
            key: key.clone(),
            ops: vec![op],
            kind,
            queued_at: now,
        })
    }

    /// How soon the write must go: a dead VM's status first, then deletes and failure
    /// statuses, then the rest. An eviction's status carries its reason (`VMGone`, ...).
    pub fn urgency(&self) -> Urgency {
        match &self.kind {
            WriteKind::Delete { .. } => Urgency::Urgent,
            WriteKind::Status { status, .. } if status.phase.as_deref() == Some("Failed") => {
                let evicted = status
                    .reason
                    .as_deref()
                    .is_some_and(|r| EvictReason::ALL.iter().any(|e| e.as_str() == r));
                if evicted {
                    Urgency::VmDeath
                } else {
                    Urgency::Urgent
                }
            }
            WriteKind::Status { .. } | WriteKind::Annotations { .. } => Urgency::Normal,
        }
    }

    /// Deletes and failure statuses (a dead VM's among them) go before other writes.
    pub fn urgent(&self) -> bool {
        self.urgency() >= Urgency::Urgent
    }
}

/// How many jobs may be with the workers at once.
#[derive(Clone, Copy, Debug)]
pub struct LaneLimits {
    /// All jobs in flight (pod writes and Events): the number of lane workers.
    pub slots: usize,
    /// Slots only urgent writes may take, so a pod backlog stuck on a slow API server never
    /// keeps a failure status or a delete waiting for a worker.
    pub urgent_reserve: usize,
    /// Event writes in flight at most (they also count against the non-urgent slots).
    pub event_slots: usize,
}

impl Default for LaneLimits {
    fn default() -> Self {
        LaneLimits {
            slots: 16,
            urgent_reserve: 4,
            event_slots: 2,
        }
    }
}

/// What the caller should do next.
#[derive(Debug, PartialEq)]
pub enum Job {
    /// Perform this write on a worker, then call [`KubeLane::finished`] with its key.
    Write(PodWrite),
    /// Write the oldest queued Event on a worker, then call [`KubeLane::event_finished`].
    Event,
}

#[derive(Default)]
struct PodQueue {
    queued: VecDeque<PodWrite>,
    in_flight: bool,
    /// Bumped whenever the pod leaves the ready lists, so stale entries there are skipped.
    generation: u64,
}

/// Counters for metrics and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaneStats {
    pub dispatched: u64,
    /// Status writes dropped because a newer one replaced them.
    pub statuses_replaced: u64,
    /// Annotation patches folded into the one queued before them.
    pub annotations_merged: u64,
}

/// The scheduler. See the module documentation.
pub struct KubeLane {
    limits: LaneLimits,
    pods: HashMap<PodKey, PodQueue>,
    /// Pods with queued writes and none in flight, in the order they became ready, by the
    /// most urgent write they hold.
    ready_death: VecDeque<(PodKey, u64)>,
    ready_urgent: VecDeque<(PodKey, u64)>,
    ready_normal: VecDeque<(PodKey, u64)>,
    writes_in_flight: usize,
    urgent_in_flight: usize,
    events_in_flight: usize,
    queued_writes: usize,
    pub stats: LaneStats,
}

impl KubeLane {
    pub fn new(limits: LaneLimits) -> KubeLane {
        let slots = limits.slots.max(2);
        KubeLane {
            limits: LaneLimits {
                slots,
                urgent_reserve: limits.urgent_reserve.min(slots - 1),
                event_slots: limits.event_slots.max(1),
            },
            pods: HashMap::new(),
            ready_death: VecDeque::new(),
            ready_urgent: VecDeque::new(),
            ready_normal: VecDeque::new(),
            writes_in_flight: 0,
            urgent_in_flight: 0,
            events_in_flight: 0,
            queued_writes: 0,
            stats: LaneStats::default(),
        }
    }

    /// Pod writes waiting (not in flight).
    pub fn queued(&self) -> usize {
        self.queued_writes
    }

    /// Jobs with the workers (pod writes and Events).
    pub fn in_flight(&self) -> usize {
        self.writes_in_flight + self.events_in_flight
    }

    /// True when nothing is queued or in flight.
    pub fn idle(&self) -> bool {
        self.queued_writes == 0 && self.in_flight() == 0
    }

    /// How long the oldest queued write has waited (O(pods with writes); call it per scrape,
    /// not per write).
    pub fn oldest_queued_age(&self, now: Instant) -> Duration {
        self.pods
            .values()
            .filter_map(|q| q.queued.iter().map(|w| w.queued_at).min())
            .min()
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at))
    }

    /// Queue a write behind the pod's earlier ones, replacing or merging as the rules say.
    pub fn push(&mut self, mut write: PodWrite) {
        let q = self.pods.entry(write.key.clone()).or_default();
        let was = q.queued.iter().map(PodWrite::urgency).max();
        let mut replaced = false;
        match &write.kind {
            WriteKind::Status { uid, .. } => {
                let older = q
                    .queued
                    .iter()
                    .position(|w| matches!(&w.kind, WriteKind::Status { uid: u, .. } if u == uid));
                if let Some(i) = older {
                    if let Some(old) = q.queued.remove(i) {
                        let mut ops = old.ops;
                        ops.append(&mut write.ops);
                        write.ops = ops;
                        write.queued_at = write.queued_at.min(old.queued_at);
                        self.queued_writes -= 1;
                        self.stats.statuses_replaced += 1;
                        replaced = true;
                    }
                }
            }
            WriteKind::Annotations { uid, annotations } => {
                if let Some(WriteKind::Annotations {
                    uid: tail_uid,
                    annotations: tail,
                }) = q.queued.back_mut().map(|w| &mut w.kind)
                {
                    if tail_uid == uid {
                        for (k, v) in annotations {
                            tail.insert(k.clone(), v.clone());
                        }
                        if let Some(back) = q.queued.back_mut() {
                            back.ops.append(&mut write.ops);
                        }
                        self.stats.annotations_merged += 1;
                        return;
                    }
                }
            }
            WriteKind::Delete { .. } => {}
        }
        let key = write.key.clone();
        q.queued.push_back(write);
        self.queued_writes += 1;
        if q.in_flight {
            return;
        }
        let generation = q.generation;
        let most = q.queued.iter().map(PodWrite::urgency).max();
        // A pod already waiting in a less urgent list gets an entry in the more urgent one,
        // which overtakes it (the stale entry is skipped later by its generation); a replaced
        // status may have taken the pod's urgency down, and its entry's validity with it.
        if let Some(most) = most.filter(|m| replaced || was.is_none_or(|was| *m > was)) {
            self.ready_list(most).push_back((key, generation));
        }
    }

    fn ready_list(&mut self, urgency: Urgency) -> &mut VecDeque<(PodKey, u64)> {
        match urgency {
            Urgency::VmDeath => &mut self.ready_death,
            Urgency::Urgent => &mut self.ready_urgent,
            Urgency::Normal => &mut self.ready_normal,
        }
    }

    /// The next job to hand to a worker, if a token and a slot allow one now. Call it until it
    /// answers None, then arm a timer at [`KubeLane::wake_at`].
    pub fn dispatch(
        &mut self,
        now: Instant,
        bucket: &mut TokenBucket,
        events_waiting: bool,
    ) -> Option<Job> {
        let total = self.in_flight();
        if total >= self.limits.slots {
            return None;
        }
        if self.next_ready(Urgency::VmDeath).is_some() {
            // Nothing takes a token before it; when even the credit is spent it waits.
            if !bucket.try_take_on_credit(now, VM_DEATH_CREDIT) {
                return None;
            }
            self.stats.dispatched += 1;
            return self.take(Urgency::VmDeath).map(Job::Write);
        }
        let normal_room = total < self.limits.slots - self.limits.urgent_reserve;
        let urgent = self.next_ready(Urgency::Urgent);
        let normal = if urgent.is_none() && normal_room {
            self.next_ready(Urgency::Normal)
        } else {
            None
        };
        let event = urgent.is_none()
            && normal.is_none()
            && normal_room
            && events_waiting
            && self.events_in_flight < self.limits.event_slots;
        if urgent.is_none() && normal.is_none() && !event {
            return None;
        }
        if !bucket.try_take(now) {
            return None;
        }
        self.stats.dispatched += 1;
        if event {
            self.events_in_flight += 1;
            return Some(Job::Event);
        }
        let from = if urgent.is_some() {
            Urgency::Urgent
        } else {
            Urgency::Normal
        };
        self.take(from).map(Job::Write)
    }

    /// Hands out the front write of the first pod of the `from` list (`next_ready` checked it).
    fn take(&mut self, from: Urgency) -> Option<PodWrite> {
        let (key, _) = self.ready_list(from).pop_front()?;
        let q = self.pods.get_mut(&key)?;
        let write = q.queued.pop_front()?;
        q.in_flight = true;
        q.generation += 1;
        self.queued_writes -= 1;
        self.writes_in_flight += 1;
        if write.urgent() {
            self.urgent_in_flight += 1;
        }
        Some(write)
    }

    /// The first valid entry of a ready list (stale ones are dropped), without taking it. A
    /// dead VM's entry is valid only while the pod still holds that status (a newer status of
    /// the pod may have replaced it).
    fn next_ready(&mut self, urgency: Urgency) -> Option<()> {
        let list = match urgency {
            Urgency::VmDeath => &mut self.ready_death,
            Urgency::Urgent => &mut self.ready_urgent,
            Urgency::Normal => &mut self.ready_normal,
        };
        while let Some((key, generation)) = list.front() {
            let valid = self.pods.get(key).is_some_and(|q| {
                !q.in_flight
                    && q.generation == *generation
                    && !q.queued.is_empty()
                    && (urgency != Urgency::VmDeath
                        || q.queued.iter().any(|w| w.urgency() == Urgency::VmDeath))
            });
            if valid {
                return Some(());
            }
            list.pop_front();
        }
        None
    }

    /// When to call `dispatch` again: None when only a finished job can free work (or there
    /// is none), otherwise the next token's instant.
    pub fn wake_at(
        &mut self,
        now: Instant,
        bucket: &TokenBucket,
        events_waiting: bool,
    ) -> Option<Instant> {
        let total = self.in_flight();
        if total >= self.limits.slots {
            return None;
        }
        if self.next_ready(Urgency::VmDeath).is_some() {
            return Some(bucket.next_credit_at(now, VM_DEATH_CREDIT));
        }
        let normal_room = total < self.limits.slots - self.limits.urgent_reserve;
        let work = self.next_ready(Urgency::Urgent).is_some()
            || (normal_room
                && (self.next_ready(Urgency::Normal).is_some()
                    || (events_waiting && self.events_in_flight < self.limits.event_slots)));
        work.then(|| bucket.next_token_at(now))
    }

    /// The in-flight write of `key` got its answer (whatever it was): the pod's next write may go.
    pub fn finished(&mut self, write: &PodWrite) {
        self.writes_in_flight = self.writes_in_flight.saturating_sub(1);
        if write.urgent() {
            self.urgent_in_flight = self.urgent_in_flight.saturating_sub(1);
        }
        let Some(q) = self.pods.get_mut(&write.key) else {
            return;
        };
        q.in_flight = false;
        if q.queued.is_empty() {
            self.pods.remove(&write.key);
            return;
        }
        let entry = (write.key.clone(), q.generation);
        let most = q.queued.iter().map(PodWrite::urgency).max();
        self.ready_list(most.unwrap_or(Urgency::Normal))
            .push_back(entry);
    }

    /// An Event job came back.
    pub fn event_finished(&mut self) {
        self.events_in_flight = self.events_in_flight.saturating_sub(1);
    }

    /// Urgent writes with the workers (for tests and the reserve's accounting).
    pub fn urgent_in_flight(&self) -> usize {
        self.urgent_in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;

    fn key(n: &str) -> PodKey {
        PodKey::new("ns", n)
    }

    /// Pod `pod`'s write of `kind` for op `op`, queued at `t`.
    fn write(pod: &str, op: OpId, kind: WriteKind, t: Instant) -> PodWrite {
        PodWrite {
            key: key(pod),
            ops: vec![op],
            kind,
            queued_at: t,
        }
    }

    fn status_of(phase: &str, reason: Option<&str>) -> WriteKind {
        WriteKind::Status {
            uid: "u".into(),
            status: Arc::new(PodStatus {
                phase: Some(phase.into()),
                reason: reason.map(str::to_string),
                ..PodStatus::default()
            }),
        }
    }

    fn status(pod: &str, op: OpId, phase: &str, t: Instant) -> PodWrite {
        write(pod, op, status_of(phase, None), t)
    }

    fn annotate(pod: &str, op: OpId, k: &str, v: Option<&str>, t: Instant) -> PodWrite {
        let mut annotations = BTreeMap::new();
        annotations.insert(k.to_string(), v.map(str::to_string));
        let kind = WriteKind::Annotations {
            uid: Some("u".into()),
            annotations,
        };
        write(pod, op, kind, t)
    }

    fn delete(pod: &str, op: OpId, t: Instant) -> PodWrite {
        let kind = WriteKind::Delete {
            uid: "u".into(),
            grace: Some(0),
        };
        write(pod, op, kind, t)
    }

    /// The Failed status an eviction writes (its reason says the VM is gone).
    fn evicted(pod: &str, op: OpId, t: Instant) -> PodWrite {
        let reason = EvictReason::RestartFailed.as_str();
        write(pod, op, status_of("Failed", Some(reason)), t)
    }

    fn unlimited(t: Instant) -> TokenBucket {
        TokenBucket::new(0.0, 1, t)
    }

    fn take(lane: &mut KubeLane, t: Instant, b: &mut TokenBucket) -> Vec<PodWrite> {
        let mut out = Vec::new();
        while let Some(job) = lane.dispatch(t, b, false) {
            match job {
                Job::Write(w) => out.push(w),
                Job::Event => panic!("no events were waiting"),
            }
        }
        out
    }

    fn ops(ws: &[PodWrite]) -> Vec<OpId> {
        ws.iter().flat_map(|w| w.ops.clone()).collect()
    }

    #[test]
    fn one_write_in_flight_per_pod_in_fifo_order_and_pods_in_parallel() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        lane.push(annotate("a", 1, "k1", Some("v"), t));
        lane.push(status("a", 2, "Running", t));
        lane.push(annotate("a", 3, "k2", Some("v"), t));
        lane.push(annotate("b", 4, "k1", Some("v"), t));
        let first = take(&mut lane, t, &mut b);
        assert_eq!(ops(&first), vec![1, 4], "one per pod, both pods at once");
        assert_eq!(lane.queued(), 2);
        assert!(
            take(&mut lane, t, &mut b).is_empty(),
            "a is still in flight"
        );
        lane.finished(&first[0]);
        let second = take(&mut lane, t, &mut b);
        assert_eq!(ops(&second), vec![2]);
        lane.finished(&second[0]);
        lane.finished(&first[1]);
        let third = take(&mut lane, t, &mut b);
        assert_eq!(ops(&third), vec![3]);
        lane.finished(&third[0]);
        assert!(lane.idle());
        assert!(lane.pods.is_empty(), "finished pods leave no state behind");
    }

    #[test]
    fn deletes_and_failure_statuses_overtake_the_backlog() {
        let t = Instant::now();
        let mut b = TokenBucket::new(10.0, 1, t);
        let mut lane = KubeLane::new(LaneLimits::default());
        for i in 0..50 {
            lane.push(status(&format!("p{i}"), i, "Running", t));
        }
        lane.push(status("gone", 100, "Failed", t));
        lane.push(delete("deleted", 101, t));
        // One token now: it goes to the failure status, the next to the delete.
        let got = take(&mut lane, t, &mut b);
        assert_eq!(ops(&got), vec![100]);
        let next = lane
            .wake_at(t, &b, false)
            .expect("more work waits for a token");
        assert!(next > t);
        let got = take(&mut lane, next, &mut b);
        assert_eq!(ops(&got), vec![101]);
        let next = lane.wake_at(next, &b, false).expect("backlog");
        assert_eq!(ops(&take(&mut lane, next, &mut b)), vec![0]);
    }

    #[test]
    fn a_pod_with_an_urgent_write_queued_behind_others_jumps_ahead_but_keeps_its_order() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits {
            slots: 2,
            urgent_reserve: 1,
            event_slots: 1,
        });
        lane.push(annotate("x", 1, "k", Some("v"), t));
        lane.push(annotate("y", 2, "k", Some("v"), t));
        lane.push(annotate("z", 3, "k", Some("v"), t));
        lane.push(status("z", 4, "Failed", t));
        // z now holds a failure status: its annotation (first in its FIFO) goes first, ahead
        // of x and y; the reserve slot is for urgent pods only, so x must then wait.
        let got = take(&mut lane, t, &mut b);
        assert_eq!(ops(&got), vec![3]);
        lane.finished(&got[0]);
        let got = take(&mut lane, t, &mut b);
        assert_eq!(ops(&got), vec![4], "the failure status, before x and y");
    }

    #[test]
    fn urgent_slots_stay_free_while_the_backlog_fills_the_rest() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let limits = LaneLimits {
            slots: 4,
            urgent_reserve: 1,
            event_slots: 1,
        };
        let mut lane = KubeLane::new(limits);
        for i in 0..10 {
            lane.push(status(&format!("p{i}"), i, "Running", t));
        }
        assert_eq!(take(&mut lane, t, &mut b).len(), 3);
        assert!(lane.dispatch(t, &mut b, true).is_none(), "events wait too");
        lane.push(status("dead", 99, "Failed", t));
        assert_eq!(ops(&take(&mut lane, t, &mut b)), vec![99]);
        assert_eq!(lane.urgent_in_flight(), 1);
        assert_eq!(
            lane.wake_at(t, &b, true),
            None,
            "only a finished job frees a slot"
        );
    }

    #[test]
    fn a_newer_status_replaces_the_queued_one_and_answers_both_ops() {
        let t = Instant::now();
        let later = t + Duration::from_secs(1);
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        lane.push(annotate("a", 1, "k", Some("v"), t));
        let first = take(&mut lane, t, &mut b);
        lane.push(status("a", 2, "Pending", t));
        lane.push(annotate("a", 3, "k2", Some("v"), t));
        lane.push(status("a", 4, "Running", later));
        assert_eq!(lane.queued(), 2);
        assert_eq!(lane.stats.statuses_replaced, 1);
        lane.finished(&first[0]);
        let w = take(&mut lane, later, &mut b);
        assert_eq!(
            ops(&w),
            vec![3],
            "the annotation issued before the newer status goes first"
        );
        lane.finished(&w[0]);
        let w = take(&mut lane, later, &mut b);
        assert_eq!(w[0].ops, vec![2, 4]);
        assert_eq!(w[0].queued_at, t, "age counts from the oldest op");
        match &w[0].kind {
            WriteKind::Status { status, .. } => {
                assert_eq!(status.phase.as_deref(), Some("Running"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_status_of_another_incarnation_is_not_replaced() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        lane.push(delete("a", 1, t));
        let first = take(&mut lane, t, &mut b);
        lane.push(status("a", 2, "Running", t));
        let mut other = status("a", 3, "Running", t);
        if let WriteKind::Status { uid, .. } = &mut other.kind {
            *uid = "u2".into();
        }
        lane.push(other);
        assert_eq!(lane.queued(), 2);
        lane.finished(&first[0]);
        assert_eq!(ops(&take(&mut lane, t, &mut b)), vec![2]);
    }

    #[test]
    fn adjacent_annotation_patches_merge_later_values_winning() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        lane.push(delete("a", 1, t));
        let first = take(&mut lane, t, &mut b);
        lane.push(annotate("a", 2, "k1", Some("old"), t));
        lane.push(annotate("a", 3, "k1", Some("new"), t));
        lane.push(annotate("a", 4, "k2", None, t));
        lane.push(status("a", 5, "Running", t));
        lane.push(annotate("a", 6, "k3", Some("v"), t));
        assert_eq!(
            lane.queued(),
            3,
            "the patch after the status does not jump over it"
        );
        assert_eq!(lane.stats.annotations_merged, 2);
        lane.finished(&first[0]);
        let w = take(&mut lane, t, &mut b);
        assert_eq!(w[0].ops, vec![2, 3, 4]);
        match &w[0].kind {
            WriteKind::Annotations { annotations, .. } => {
                assert_eq!(annotations.get("k1"), Some(&Some("new".to_string())));
                assert_eq!(annotations.get("k2"), Some(&None));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_op_is_answered_exactly_once() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        let mut rng = 7u64;
        let mut issued = Vec::new();
        let mut answered = Vec::new();
        for op in 0..2000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let pod = format!("p{}", rng % 20);
            let w = match rng % 5 {
                0 => status(&pod, op, "Running", t),
                1 => status(&pod, op, "Failed", t),
                2 => annotate(&pod, op, &format!("k{}", rng % 3), Some("v"), t),
                3 => evicted(&pod, op, t),
                _ => delete(&pod, op, t),
            };
            issued.push(op);
            lane.push(w);
            if rng.is_multiple_of(3) {
                for w in take(&mut lane, t, &mut b) {
                    answered.extend(w.ops.iter().copied());
                    lane.finished(&w);
                }
            }
        }
        while !lane.idle() {
            for w in take(&mut lane, t, &mut b) {
                answered.extend(w.ops.iter().copied());
                lane.finished(&w);
            }
        }
        answered.sort_unstable();
        assert_eq!(answered, issued);
    }

    #[test]
    fn events_go_last_and_within_their_slots() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits {
            slots: 8,
            urgent_reserve: 2,
            event_slots: 2,
        });
        lane.push(status("a", 1, "Running", t));
        assert!(matches!(
            lane.dispatch(t, &mut b, true),
            Some(Job::Write(_))
        ));
        assert_eq!(lane.dispatch(t, &mut b, true), Some(Job::Event));
        assert_eq!(lane.dispatch(t, &mut b, true), Some(Job::Event));
        assert_eq!(lane.dispatch(t, &mut b, true), None, "two event slots");
        lane.event_finished();
        assert_eq!(lane.dispatch(t, &mut b, true), Some(Job::Event));
        assert_eq!(lane.dispatch(t, &mut b, false), None);
    }

    #[test]
    fn paced_by_tokens_never_faster_than_the_bucket() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(50.0, 5, t0);
        let mut lane = KubeLane::new(LaneLimits::default());
        for i in 0..100 {
            lane.push(status(&format!("p{i}"), i, "Running", t0));
        }
        // Drive it like the loop: dispatch until refused, finish at once, sleep to wake_at.
        let mut now = t0;
        let mut sent = 0;
        while !lane.idle() {
            while let Some(Job::Write(w)) = lane.dispatch(now, &mut b, false) {
                sent += 1;
                lane.finished(&w);
            }
            match lane.wake_at(now, &b, false) {
                Some(at) => {
                    assert!(at > now, "wake_at must move forward when no token is there");
                    now = at;
                }
                None => break,
            }
        }
        assert_eq!(sent, 100);
        // 5 at once (burst), then 95 at 50/s.
        let took = now.duration_since(t0).as_secs_f64();
        assert!((1.85..=1.95).contains(&took), "{took}");
    }

    #[test]
    fn only_an_evictions_failed_status_is_a_vm_death() {
        let t = Instant::now();
        assert_eq!(evicted("a", 1, t).urgency(), Urgency::VmDeath);
        assert_eq!(status("a", 1, "Failed", t).urgency(), Urgency::Urgent);
        assert_eq!(delete("a", 1, t).urgency(), Urgency::Urgent);
        assert_eq!(status("a", 1, "Running", t).urgency(), Urgency::Normal);
    }

    /// The bucket is empty and a thousand creates' writes wait (some urgent): a dead VM's
    /// status is handed out at once, on credit, before any of them; the backlog pays the debt.
    #[test]
    fn a_dead_vms_status_is_taken_before_every_queued_write_without_waiting_for_a_token() {
        let t = Instant::now();
        let mut b = TokenBucket::new(50.0, 1, t);
        let mut lane = KubeLane::new(LaneLimits::default());
        for i in 0..1000 {
            lane.push(annotate(&format!("c{i}"), i, "k", Some("v"), t));
            lane.push(status(&format!("c{i}"), 10_000 + i, "Running", t));
        }
        lane.push(delete("deleted", 20_000, t));
        lane.push(status("create-failed", 20_001, "Failed", t));
        assert_eq!(
            ops(&take(&mut lane, t, &mut b)),
            vec![20_000],
            "the one token"
        );
        lane.push(evicted("dead", 30_000, t));
        let next_token = b.next_token_at(t);
        assert!(next_token > t);
        assert_eq!(
            lane.wake_at(t, &b, false),
            Some(t),
            "the dead VM's status need not wait"
        );
        let got = take(&mut lane, t, &mut b);
        assert_eq!(
            ops(&got),
            vec![30_000],
            "before the other failure and the creates"
        );
        assert!(
            b.next_token_at(t) > next_token,
            "the credit taken is paid by the writes behind it"
        );
        let at = lane.wake_at(t, &b, false).expect("backlog");
        assert_eq!(ops(&take(&mut lane, at, &mut b)), vec![20_001]);
    }

    /// A pod holding a dead VM's status is served first, its writes in their order; the status
    /// folds the pod's queued older status in; the write in flight finishes first.
    #[test]
    fn a_pod_with_a_dead_vms_status_is_served_first_in_its_own_order() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        lane.push(annotate("d", 1, "k0", Some("v"), t));
        let in_flight = take(&mut lane, t, &mut b);
        lane.push(status("other", 10, "Running", t));
        lane.push(annotate("d", 2, "k1", Some("v"), t));
        lane.push(status("d", 3, "Running", t));
        lane.push(evicted("d", 5, t));
        let got = take(&mut lane, t, &mut b);
        assert_eq!(ops(&got), vec![10], "d has a write in flight");
        lane.finished(&got[0]);
        lane.push(status("other", 11, "Running", t));
        lane.finished(&in_flight[0]);
        let got = take(&mut lane, t, &mut b);
        assert_eq!(got[0].ops, vec![2], "d first, its patch before its status");
        lane.finished(&got[0]);
        let got = take(&mut lane, t, &mut b);
        assert_eq!(
            got[0].ops,
            vec![3, 5],
            "the Running status rides on the Failed one"
        );
        assert_eq!(got[0].urgency(), Urgency::VmDeath);
    }

    #[test]
    fn the_credit_of_dead_vms_is_bounded() {
        let t = Instant::now();
        let mut b = TokenBucket::new(10.0, 1, t);
        assert!(b.try_take(t));
        let mut lane = KubeLane::new(LaneLimits::default());
        for i in 0..10 {
            lane.push(evicted(&format!("d{i}"), i, t));
        }
        let got = take(&mut lane, t, &mut b);
        assert_eq!(got.len(), VM_DEATH_CREDIT as usize);
        let at = lane.wake_at(t, &b, false).expect("more deaths wait");
        assert!(at > t);
        assert_eq!(
            take(&mut lane, at, &mut b).len(),
            1,
            "one per token after that"
        );
    }

    /// A newer status of the same incarnation replaces a queued dead VM's status: the pod is
    /// still served (its entry among the dead VMs no longer is valid).
    #[test]
    fn a_replaced_dead_vm_status_leaves_its_pod_served() {
        let t = Instant::now();
        let mut b = unlimited(t);
        let mut lane = KubeLane::new(LaneLimits::default());
        lane.push(evicted("d", 1, t));
        lane.push(status("d", 2, "Running", t));
        let got = take(&mut lane, t, &mut b);
        assert_eq!(ops(&got), vec![1, 2]);
        lane.finished(&got[0]);
        assert!(lane.idle());
    }
}
