//! Kubernetes Events on pods: build core/v1 Events, aggregate identical ones (count, lastTimestamp),
//! rate-limit per pod, and queue them (bounded, oldest dropped) for the daemon to write off the loop.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::client::Client;
use super::error::KubeError;
use super::ratelimit::TokenBucket;

pub const SOURCE_COMPONENT: &str = "vk-cocoon";
/// Event messages are cut to this many bytes.
pub const MAX_MESSAGE: usize = 512;
/// An identical event within this window is aggregated into the earlier one.
const AGGREGATE_WINDOW: Duration = Duration::from_secs(10 * 60);
/// Per-pod spam filter, as client-go's: burst 25, then one event per 5 minutes.
const PER_POD_BURST: u32 = 25;
const PER_POD_QPS: f64 = 1.0 / 300.0;
/// Bound on remembered aggregation keys and per-pod buckets.
const MAX_TRACKED: usize = 4096;
/// How many gone pods' UIDs are remembered, so that an event recorded for a pod after it went
/// (the end of an op that was running) is written but leaves nothing behind.
const GONE_REMEMBERED: usize = 1024;
/// Expired aggregation keys are swept at most this often: a lookup already ignores them, so the
/// sweep only bounds memory and must not cost every record a pass over the map.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// The Event type is the core's: its Event effects carry it and the recorder writes it as is,
/// so one type goes from the decision to the wire.
pub use crate::provider::EventType;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct AggKey {
    namespace: String,
    uid: String,
    reason: String,
    /// The type as `EventType::as_str` names it: the key is hashed, and the core's type does
    /// not derive Hash.
    kind: &'static str,
    message: String,
}

#[derive(Clone, Debug)]
struct Pending {
    key: AggKey,
    event: Event,
    /// Server event name when this is an aggregation PATCH of an already-created event.
    existing: Option<String>,
}

#[derive(Clone, Debug)]
struct Sent {
    name: String,
    count: i32,
    first: Time,
    at: Instant,
}

/// Counters for metrics and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventStats {
    pub created: u64,
    pub patched: u64,
    pub rate_limited: u64,
    pub dropped: u64,
    pub failed: u64,
}

/// The recorder. `record` is cheap and never does I/O; `flush` performs the API calls.
///
/// `record` runs for every event of a pod burst, so nothing it does walks the queue or the maps:
/// queued events are found through `queued`, expired aggregation keys are skipped at lookup and
/// swept now and then, and a gone pod's keys are dropped with its entry in `sent`.
pub struct EventRecorder {
    node: String,
    capacity: usize,
    queue: VecDeque<Pending>,
    /// Position number of `queue[0]`; `queue[i]` is number `head + i` (wrapping). Numbers stay
    /// put as the queue pops from the front or gets an event put back in front of it.
    head: u64,
    /// The numbers of the queued events of each key, front first. Mostly one: a second is queued
    /// only when an event put back after a failed write finds a newer one of its key queued.
    queued: HashMap<AggKey, VecDeque<u64>>,
    /// Written events to aggregate into, by pod UID, so that a gone pod's keys go in one removal.
    /// May hold expired ones until the next sweep; `sent_live` tells them apart.
    sent: HashMap<String, HashMap<AggKey, Sent>>,
    /// Number of entries in `sent`, bounded by `MAX_TRACKED`.
    sent_len: usize,
    /// `now` of the latest record that looked up `sent`: entries older than the window then are
    /// as good as gone (the bound and `remembered` count without them).
    looked_up: Option<Instant>,
    /// The instant `sent` was last swept as of.
    swept: Option<Instant>,
    buckets: HashMap<String, TokenBucket>,
    /// UIDs of the pods most recently gone (oldest first), at most `GONE_REMEMBERED`.
    gone: VecDeque<String>,
    /// The same UIDs, to look one up without a scan.
    gone_set: HashSet<String>,
    seq: u64,
    pub stats: EventStats,
}

/// Whether a written event, as of `now`, is still recent enough to aggregate into.
fn sent_live(s: &Sent, now: Instant) -> bool {
    now.saturating_duration_since(s.at) < AGGREGATE_WINDOW
}

/// Cut a message to at most `MAX_MESSAGE` bytes on a character boundary.
pub fn truncate_message(m: &str) -> String {
    if m.len() <= MAX_MESSAGE {
        return m.to_string();
    }
    let mut end = MAX_MESSAGE;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    m[..end].to_string()
}

fn time(t: SystemTime) -> Time {
    crate::node::api_time(t)
}

impl EventRecorder {
    /// `capacity` bounds the queue; when full the oldest pending event is dropped.
    pub fn new(node: &str, capacity: usize) -> EventRecorder {
        EventRecorder {
            node: node.to_string(),
            capacity: capacity.max(1),
            queue: VecDeque::new(),
            head: 0,
            queued: HashMap::new(),
            sent: HashMap::new(),
            sent_len: 0,
            looked_up: None,
            swept: None,
            buckets: HashMap::new(),
            gone: VecDeque::new(),
            gone_set: HashSet::new(),
            seq: 0,
            stats: EventStats::default(),
        }
    }

    /// Events waiting to be written.
    pub fn pending(&self) -> usize {
        self.queue.len()
    }

    /// Queue an event on `pod`. Identical events aggregate; a pod over its rate is dropped.
    pub fn record(
        &mut self,
        pod: &Pod,
        kind: EventType,
        reason: &str,
        message: &str,
        now: Instant,
        wall: SystemTime,
    ) {
        let namespace = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let message = truncate_message(message);
        let key = AggKey {
            namespace: namespace.clone(),
            uid: uid.clone(),
            reason: reason.to_string(),
            kind: kind.as_str(),
            message: message.clone(),
        };
        let ts = time(wall);
        // Same event still queued: bump it in place (the frontmost, should there be two), no
        // extra API call.
        if let Some(p) = self.queued_mut(&key) {
            p.event.count = Some(p.event.count.unwrap_or(1) + 1);
            p.event.last_timestamp = Some(ts);
            return;
        }
        // A gone pod's last events are written, but neither rate-limited nor remembered: its
        // bucket and keys would outlive it.
        let gone = self.gone_set.contains(&uid);
        if !gone {
            if self.buckets.len() >= MAX_TRACKED {
                self.buckets.clear();
            }
            let bucket = self
                .buckets
                .entry(uid.clone())
                .or_insert_with(|| TokenBucket::new(PER_POD_QPS, PER_POD_BURST, now));
            if !bucket.try_take(now) {
                self.stats.rate_limited += 1;
                log::debug!("event {reason} on {namespace}/{name} rate limited");
                return;
            }
        }
        self.looked_up = Some(now);
        if self
            .swept
            .is_none_or(|s| now.saturating_duration_since(s) >= PRUNE_EVERY)
        {
            self.sweep(now);
        }
        let found = self
            .sent
            .get(&key.uid)
            .and_then(|m| m.get(&key))
            .filter(|s| sent_live(s, now));
        let (existing, count, first) = match found {
            Some(s) => (Some(s.name.clone()), s.count + 1, s.first.clone()),
            None => (None, 1, ts.clone()),
        };
        self.seq += 1;
        let nanos = wall
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            + u128::from(self.seq);
        let event = Event {
            metadata: ObjectMeta {
                name: Some(
                    existing
                        .clone()
                        .unwrap_or_else(|| format!("{name}.{nanos:x}")),
                ),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(name),
                namespace: Some(namespace),
                uid: Some(uid),
                resource_version: pod.metadata.resource_version.clone(),
                ..Default::default()
            },
            reason: Some(reason.to_string()),
            message: Some(message),
            type_: Some(kind.as_str().to_string()),
            source: Some(EventSource {
                component: Some(SOURCE_COMPONENT.into()),
                host: Some(self.node.clone()),
            }),
            reporting_component: Some(SOURCE_COMPONENT.into()),
            reporting_instance: Some(self.node.clone()),
            first_timestamp: Some(first),
            last_timestamp: Some(ts),
            count: Some(count),
            ..Default::default()
        };
        if self.queue.len() >= self.capacity {
            if let Some(old) = self.pop_front() {
                self.stats.dropped += 1;
                log::warn!(
                    "event queue full: dropping {} on {}",
                    old.key.reason,
                    old.event.involved_object.name.unwrap_or_default()
                );
            }
        }
        self.push_back(Pending {
            key,
            event,
            existing,
        });
    }

    /// The frontmost queued event of `key`.
    fn queued_mut(&mut self, key: &AggKey) -> Option<&mut Pending> {
        let number = *self.queued.get(key)?.front()?;
        let i = usize::try_from(number.wrapping_sub(self.head)).ok()?;
        let p = self.queue.get_mut(i)?;
        debug_assert!(p.key == *key, "queue index out of step");
        Some(p)
    }

    // Every change to `queue` goes through these three, which keep `queued` and `head` with it.

    fn push_back(&mut self, p: Pending) {
        let number = self.head.wrapping_add(self.queue.len() as u64);
        self.queued
            .entry(p.key.clone())
            .or_default()
            .push_back(number);
        self.queue.push_back(p);
    }

    fn push_front(&mut self, p: Pending) {
        self.head = self.head.wrapping_sub(1);
        self.queued
            .entry(p.key.clone())
            .or_default()
            .push_front(self.head);
        self.queue.push_front(p);
    }

    fn pop_front(&mut self) -> Option<Pending> {
        let p = self.queue.pop_front()?;
        // The front of the queue is the front of its key's numbers.
        if let Some(numbers) = self.queued.get_mut(&p.key) {
            numbers.pop_front();
            if numbers.is_empty() {
                self.queued.remove(&p.key);
            }
        }
        self.head = self.head.wrapping_add(1);
        Some(p)
    }

    /// Drop the entries of `sent` that expired as of `now`.
    fn sweep(&mut self, now: Instant) {
        let mut len = 0;
        self.sent.retain(|_, m| {
            m.retain(|_, s| sent_live(s, now));
            len += m.len();
            !m.is_empty()
        });
        self.sent_len = len;
        self.swept = Some(now);
    }

    /// The pod of `uid` is gone: forget its aggregation keys and its rate-limit bucket, so what
    /// is remembered follows the pods alive, not every pod ever seen. Its events still queued
    /// are written, and not remembered after (see `written`).
    pub fn forget_pod(&mut self, uid: &str) {
        if let Some(m) = self.sent.remove(uid) {
            self.sent_len -= m.len();
        }
        self.buckets.remove(uid);
        if !self.gone_set.contains(uid) {
            if self.gone.len() >= GONE_REMEMBERED {
                if let Some(old) = self.gone.pop_front() {
                    self.gone_set.remove(&old);
                }
            }
            self.gone.push_back(uid.to_string());
            self.gone_set.insert(uid.to_string());
        }
    }

    /// Aggregation keys and rate-limit buckets remembered (for tests and the soak's checks).
    /// Keys expired as of the latest lookup are not counted, swept or not. Walks the keys.
    pub fn remembered(&self) -> (usize, usize) {
        let live = match self.looked_up {
            Some(now) => self
                .sent
                .values()
                .flat_map(|m| m.values())
                .filter(|s| sent_live(s, now))
                .count(),
            None => self.sent_len,
        };
        (live, self.buckets.len())
    }

    /// Write up to `max` queued events (blocking calls bounded by the client's timeout).
    /// Stops at the first transient failure, keeping that event queued. Returns how many were written.
    pub fn flush(&mut self, client: &Client, max: usize, now: Instant) -> usize {
        let mut written = 0;
        while written < max {
            let Some(p) = self.take_next() else {
                break;
            };
            let result = p.write(client);
            match self.written(p, result, now) {
                Written::Ok => written += 1,
                Written::Retry => break,
                Written::Dropped => {}
            }
        }
        written
    }

    /// The oldest queued event, to write off the loop with [`QueuedEvent::write`] and hand back
    /// to [`EventRecorder::written`].
    pub fn take_next(&mut self) -> Option<QueuedEvent> {
        let p = self.pop_front()?;
        self.seq += 1;
        Some(QueuedEvent {
            pending: p,
            fresh_suffix: self.seq,
        })
    }

    /// Book the answer of a written event: remember it for aggregation, or put it back at the
    /// front after a transient failure (the caller waits before trying again).
    pub fn written(
        &mut self,
        q: QueuedEvent,
        result: Result<Event, KubeError>,
        now: Instant,
    ) -> Written {
        let p = q.pending;
        let ns = p.key.namespace.clone();
        match result {
            Ok(ev) => {
                if p.existing.is_some() {
                    self.stats.patched += 1;
                } else {
                    self.stats.created += 1;
                }
                // A pod with no bucket was forgotten (gone) since this event was recorded:
                // nothing will aggregate into it.
                if !self.buckets.contains_key(&p.key.uid) {
                    return Written::Ok;
                }
                if self.sent_len >= MAX_TRACKED {
                    // Keys expired as of the latest lookup count as gone: sweep them before
                    // deciding the map is full, or expired keys would push out live ones.
                    if let Some(then) = self.looked_up {
                        if self.swept != Some(then) {
                            self.sweep(then);
                        }
                    }
                }
                if self.sent_len >= MAX_TRACKED {
                    self.sent.clear();
                    self.sent_len = 0;
                }
                let previous = self.sent.entry(p.key.uid.clone()).or_default().insert(
                    p.key.clone(),
                    Sent {
                        name: ev.metadata.name.unwrap_or_default(),
                        count: p.event.count.unwrap_or(1),
                        first: p
                            .event
                            .first_timestamp
                            .clone()
                            .unwrap_or_else(|| time(crate::wall_clock::now())),
                        at: now,
                    },
                );
                if previous.is_none() {
                    self.sent_len += 1;
                }
                Written::Ok
            }
            Err(e) if e.is_transient() => {
                log::warn!("event {} on {ns}: {e}; will retry", p.key.reason);
                if self.queue.len() >= self.capacity {
                    // Newer events filled the queue meanwhile: this one is now the oldest.
                    self.stats.dropped += 1;
                    return Written::Dropped;
                }
                self.push_front(p);
                Written::Retry
            }
            Err(e) => {
                self.stats.failed += 1;
                log::warn!("event {} on {ns} dropped: {e}", p.key.reason);
                Written::Dropped
            }
        }
    }
}

/// What became of a written event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    Ok,
    /// Transient failure: queued again at the front.
    Retry,
    /// Refused for good (or no room to queue it again); counted.
    Dropped,
}

/// An event taken off the queue for writing.
#[derive(Debug)]
pub struct QueuedEvent {
    pending: Pending,
    /// Makes the name of a re-created event unique.
    fresh_suffix: u64,
}

impl QueuedEvent {
    /// The blocking API call(s): a create, or an aggregation patch that falls back to a create
    /// when the server's copy expired. Runs on a worker thread.
    pub fn write(&self, client: &Client) -> Result<Event, KubeError> {
        let p = &self.pending;
        let ns = &p.key.namespace;
        match &p.existing {
            Some(name) => {
                let patch = serde_json::json!({
                    "count": p.event.count,
                    "lastTimestamp": p.event.last_timestamp,
                });
                match client.patch_event(ns, name, &patch) {
                    Err(KubeError::NotFound(_)) => {
                        // Expired on the server: create it afresh.
                        let mut fresh = p.event.clone();
                        fresh.metadata.name = Some(format!(
                            "{}.{:x}",
                            fresh.involved_object.name.clone().unwrap_or_default(),
                            self.fresh_suffix
                        ));
                        client.create_event(&fresh)
                    }
                    other => other,
                }
            }
            None => client.create_event(&p.event),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, uid: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "7"}
        }))
        .unwrap()
    }

    #[test]
    fn builds_the_event_and_aggregates_queued_duplicates() {
        let mut r = EventRecorder::new("node-1", 10);
        let t = Instant::now();
        // A fraction on the clock: metav1.Time on the wire is whole seconds with `Z`.
        let w = SystemTime::UNIX_EPOCH + Duration::new(1_767_225_600, 750_000_000);
        let p = pod("p", "u1");
        r.record(
            &p,
            EventType::Warning,
            "WakePullFailed",
            &"x".repeat(600),
            t,
            w,
        );
        r.record(
            &p,
            EventType::Warning,
            "WakePullFailed",
            &"x".repeat(700),
            t,
            w + Duration::from_secs(5),
        );
        r.record(&p, EventType::Normal, "Woken", "ok", t, w);
        assert_eq!(r.pending(), 2);
        let e = serde_json::to_value(&r.queue[0].event).unwrap();
        assert_eq!(e["count"], 2);
        assert_eq!(e["message"].as_str().unwrap().len(), 512);
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["reason"], "WakePullFailed");
        assert_eq!(
            e["source"],
            serde_json::json!({"component":"vk-cocoon","host":"node-1"})
        );
        assert_eq!(e["involvedObject"]["uid"], "u1");
        assert_eq!(e["involvedObject"]["kind"], "Pod");
        assert_eq!(e["metadata"]["namespace"], "ns");
        assert_eq!(e["firstTimestamp"], "2026-01-01T00:00:00Z");
        assert_eq!(e["lastTimestamp"], "2026-01-01T00:00:05Z");
    }

    #[test]
    fn per_pod_rate_limit_and_bounded_queue() {
        let mut r = EventRecorder::new("n", 5);
        let t = Instant::now();
        let w = SystemTime::now();
        for i in 0..40 {
            r.record(
                &pod("p", "u1"),
                EventType::Normal,
                "R",
                &format!("m{i}"),
                t,
                w,
            );
        }
        assert_eq!(r.stats.rate_limited, 15);
        assert_eq!(r.pending(), 5);
        assert_eq!(r.stats.dropped, 20);
        // Another pod has its own budget.
        r.record(&pod("q", "u2"), EventType::Normal, "R", "m", t, w);
        assert_eq!(r.stats.rate_limited, 15);
    }

    fn created(q: &QueuedEvent) -> Result<Event, KubeError> {
        let mut e = q.pending.event.clone();
        e.metadata.name = Some(format!("ev-{}", q.fresh_suffix));
        Ok(e)
    }

    /// Takes the next queued event and writes it successfully at `now`; its name.
    fn write_next(r: &mut EventRecorder, now: Instant) -> Option<String> {
        let q = r.take_next().expect("queued");
        let result = created(&q);
        let name = result.as_ref().ok().and_then(|e| e.metadata.name.clone());
        assert_eq!(r.written(q, result, now), Written::Ok);
        name
    }

    /// What the recorder remembers of a pod (aggregation keys, its bucket) goes with the pod,
    /// including an event of it written after it was forgotten.
    #[test]
    fn a_gone_pods_aggregation_keys_and_bucket_are_forgotten() {
        let mut r = EventRecorder::new("n", 10);
        let (t, w) = (Instant::now(), SystemTime::now());
        let mut u2_event = String::new();
        for (name, uid) in [("p", "u1"), ("q", "u2")] {
            r.record(&pod(name, uid), EventType::Normal, "Started", "ok", t, w);
            u2_event = write_next(&mut r, t).unwrap();
        }
        assert_eq!(r.remembered(), (2, 2));
        // u1 goes with an event still queued, and records one more after it went; both are
        // written and neither is remembered.
        r.record(&pod("p", "u1"), EventType::Normal, "Killing", "bye", t, w);
        r.forget_pod("u1");
        assert_eq!(r.remembered(), (1, 1), "u2's key and bucket stay");
        r.record(&pod("p", "u1"), EventType::Normal, "Stopped", "after", t, w);
        for _ in 0..2 {
            write_next(&mut r, t);
        }
        assert_eq!(
            r.remembered(),
            (1, 1),
            "the late events of u1 are not remembered"
        );
        assert_eq!(r.stats.created, 4);
        // u2 still aggregates into its event.
        r.record(&pod("q", "u2"), EventType::Normal, "Started", "ok", t, w);
        let e = serde_json::to_value(&r.queue[0].event).unwrap();
        assert_eq!(e["metadata"]["name"], u2_event.as_str());
        assert_eq!(e["count"], 2);
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        let m = "é".repeat(300);
        let t = truncate_message(&m);
        assert!(t.len() <= 512 && t.len() >= 511);
        assert!(m.starts_with(&t));
    }

    fn counts(r: &EventRecorder) -> Vec<(String, i32)> {
        r.queue
            .iter()
            .map(|p| (p.key.message.clone(), p.event.count.unwrap_or(0)))
            .collect()
    }

    /// An event that left the queue, dropped when it was full or taken to be written, is not
    /// aggregated into any more: the next identical one is queued anew.
    #[test]
    fn a_duplicate_of_an_event_no_longer_queued_is_queued_anew() {
        let mut r = EventRecorder::new("n", 2);
        let (t, w) = (Instant::now(), SystemTime::now());
        let p = pod("p", "u1");
        for m in ["a", "b", "c", "d", "a", "b"] {
            r.record(&p, EventType::Normal, "R", m, t, w);
        }
        // a and b were dropped for c and d, then c and d for a and b again.
        assert_eq!(r.stats.dropped, 4);
        assert_eq!(counts(&r), [("a".into(), 1), ("b".into(), 1)]);
        r.record(&p, EventType::Normal, "R", "b", t, w);
        assert_eq!(counts(&r), [("a".into(), 1), ("b".into(), 2)]);

        let q = r.take_next().expect("queued");
        r.record(&p, EventType::Normal, "R", "a", t, w);
        assert_eq!(
            q.pending.event.count,
            Some(1),
            "the taken one is left alone"
        );
        assert_eq!(counts(&r), [("b".into(), 2), ("a".into(), 1)]);
        r.record(&p, EventType::Normal, "R", "a", t, w);
        assert_eq!(counts(&r), [("b".into(), 2), ("a".into(), 2)]);
    }

    /// An event put back after a failed write, while a newer one of its key is queued, is the
    /// one aggregated into until it is taken again; then the newer one is.
    #[test]
    fn an_event_put_back_is_aggregated_into_before_a_newer_duplicate() {
        let mut r = EventRecorder::new("n", 10);
        let (t, w) = (Instant::now(), SystemTime::now());
        let p = pod("p", "u1");
        r.record(&p, EventType::Normal, "R", "a", t, w);
        let q = r.take_next().expect("queued");
        r.record(&p, EventType::Normal, "R", "b", t, w);
        r.record(&p, EventType::Normal, "R", "a", t, w);
        let down = Err(KubeError::Transport("down".into()));
        assert_eq!(r.written(q, down, t), Written::Retry);
        assert_eq!(
            counts(&r),
            [("a".into(), 1), ("b".into(), 1), ("a".into(), 1)]
        );
        r.record(&p, EventType::Normal, "R", "a", t, w);
        assert_eq!(
            counts(&r),
            [("a".into(), 2), ("b".into(), 1), ("a".into(), 1)]
        );
        let q = r.take_next().expect("queued");
        r.record(&p, EventType::Normal, "R", "a", t, w);
        assert_eq!(counts(&r), [("b".into(), 1), ("a".into(), 2)]);
        let result = created(&q);
        assert_eq!(r.written(q, result, t), Written::Ok);
        // Still queued: aggregated in the queue rather than into the written one.
        r.record(&p, EventType::Normal, "R", "a", t, w);
        assert_eq!(counts(&r), [("b".into(), 1), ("a".into(), 3)]);
    }

    /// A written event older than the window is not aggregated into, whether or not the
    /// remembered events were swept since it expired.
    #[test]
    fn an_expired_event_is_not_aggregated_into_before_a_sweep() {
        let mut r = EventRecorder::new("n", 10);
        let (t, w) = (Instant::now(), SystemTime::now());
        let (p, other) = (pod("p", "u1"), pod("q", "u2"));
        r.record(&p, EventType::Normal, "R", "a", t, w);
        write_next(&mut r, t);
        // Another pod's event half a second before `a` expires: the sweep, if any, is then.
        let before = t + AGGREGATE_WINDOW - Duration::from_millis(500);
        r.record(&other, EventType::Normal, "R", "x", before, w);
        assert_eq!(r.remembered().0, 1);
        // Right at the window's end `a` has expired.
        r.record(&p, EventType::Normal, "R", "a", t + AGGREGATE_WINDOW, w);
        let e = &r.queue[1];
        assert_eq!(e.key.message, "a");
        assert_eq!((e.existing.as_deref(), e.event.count), (None, Some(1)));
        assert_eq!(r.remembered().0, 0);
    }

    /// Expired events do not count toward the bound on remembered ones: a full map of them
    /// does not push out a live one.
    #[test]
    fn expired_events_do_not_fill_the_bound() {
        let mut r = EventRecorder::new("n", 10);
        let (t, w) = (Instant::now(), SystemTime::now());
        for i in 0..MAX_TRACKED - 1 {
            r.record(
                &pod("p", &format!("u{i}")),
                EventType::Normal,
                "R",
                "old",
                t,
                w,
            );
            write_next(&mut r, t);
        }
        let live = pod("l", "live");
        let before = t + AGGREGATE_WINDOW - Duration::from_millis(500);
        r.record(&live, EventType::Normal, "R", "live", before, w);
        let live_event = write_next(&mut r, before);
        assert_eq!(r.remembered().0, MAX_TRACKED);
        // The old ones expire; within a second of the last sweep, one more event is written.
        let after = t + AGGREGATE_WINDOW + Duration::from_millis(100);
        r.record(&pod("y", "y"), EventType::Normal, "R", "y", after, w);
        write_next(&mut r, after);
        assert_eq!(r.remembered().0, 2);
        r.record(&live, EventType::Normal, "R", "live", after, w);
        let e = &r.queue[0];
        assert_eq!(e.existing, live_event);
        assert_eq!(e.event.count, Some(2));
    }

    /// The measured part of `record_cost`, apart so a profiler can read its cost alone.
    #[inline(never)]
    fn record_burst(r: &mut EventRecorder, pods: &[Pod], t: Instant, w: SystemTime) {
        for p in pods {
            r.record(p, EventType::Normal, "Burst", "new", t, w);
        }
        for p in pods {
            r.forget_pod(p.metadata.uid.as_deref().unwrap_or_default());
        }
    }

    /// Cost of a burst on a full recorder: 1,000 records on 1,000 pods with the queue full and
    /// about 4,000 events remembered, then the pods go. Not a check: run it by hand
    /// (`--ignored --nocapture`, or under callgrind) to compare implementations.
    #[test]
    #[ignore]
    fn record_cost() {
        let (t, w) = (Instant::now(), SystemTime::now());
        let pods: Vec<Pod> = (0..1000)
            .map(|i| pod(&format!("p{i}"), &format!("u{i}")))
            .collect();
        let rounds = 20;
        let mut spent = Duration::ZERO;
        for _ in 0..rounds {
            let mut r = EventRecorder::new("n", 1000);
            for m in 0..4 {
                for p in &pods {
                    r.record(p, EventType::Normal, "Sent", &format!("m{m}"), t, w);
                    let q = r.take_next().expect("queued");
                    let result = created(&q);
                    r.written(q, result, t);
                }
            }
            for p in &pods {
                r.record(p, EventType::Normal, "Queued", "q", t, w);
            }
            assert_eq!(r.pending(), 1000);
            let start = Instant::now();
            record_burst(&mut r, &pods, t, w);
            spent += start.elapsed();
            assert_eq!(r.pending(), 1000);
            assert_eq!(r.stats.dropped, 1000);
        }
        println!("record_burst: {:?} per round", spent / rounds);
    }
}
