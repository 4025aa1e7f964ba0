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
mod tests;
