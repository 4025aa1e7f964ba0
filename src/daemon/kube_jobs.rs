//! The edge of the kube lane: hands the scheduler's jobs (pod writes, Events, pod lists) and
//! the node agent's tick to worker threads and books their answers when they come back.
//!
//! The loop thread never performs a Kubernetes call and never sleeps on the rate limiter. Pod
//! writes and Events take a token from the client's shared bucket on the loop (`try_take`:
//! the scheduler in `lane.rs` picks who gets it) and run on the lane workers with a client
//! handle that does not wait again. The node Lease and node status run on a thread of their
//! own: the agent moves into the job and comes back with the answer, so one place owns it at
//! a time, and no pod backlog can hold up the heartbeat (its calls reserve tokens ahead of the
//! lane, whose `try_take` then waits for the bucket to refill). Long reads (the startup pod
//! list, relists) run on the lane workers too, outside the scheduler's slots.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Gauge, IntCounter, IntGaugeVec, Opts, Registry};

use super::lane::{Job, PodWrite, WriteKind};
use super::timers::OwnTimer;
use super::{Daemon, Work};
use crate::kube::events::{QueuedEvent, Written};
use crate::kube::{Client, KubeError as ApiError, PodList};
use crate::node::NodeAgent;
use crate::provider::{Input, KubeError};

/// Worker threads of the kube lane: the scheduler's slots plus room for the long reads.
pub(super) const LANE_WORKERS: usize = 18;
/// Event writes wait this long after a transient failure before the next one is tried.
const EVENT_RETRY: Duration = Duration::from_secs(1);

/// The lane's gauges on /metrics.
pub(super) struct LaneMetrics {
    /// Writes waiting, by lane (`pods`, `events`, `node`).
    queued: IntGaugeVec,
    /// Jobs with the workers, by lane.
    in_flight: IntGaugeVec,
    oldest_queued: Gauge,
    events_dropped: IntCounter,
    /// How late the node agent's last tick started after it was due (a stalled heartbeat).
    node_late: Gauge,
}

impl LaneMetrics {
    pub(super) fn register(registry: &Registry) -> prometheus::Result<LaneMetrics> {
        let queued = IntGaugeVec::new(
            Opts::new(
                "vk_cocoon_kube_lane_queued",
                "Kubernetes writes waiting for a token or a worker, by lane (pods, events, node).",
            ),
            &["lane"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "vk_cocoon_kube_lane_in_flight",
                "Kubernetes calls being performed by the lane's workers, by lane.",
            ),
            &["lane"],
        )?;
        let oldest_queued = Gauge::new(
            "vk_cocoon_kube_lane_oldest_queued_seconds",
            "Age of the oldest pod write waiting in the kube lane.",
        )?;
        let events_dropped = IntCounter::new(
            "vk_cocoon_kube_events_dropped_total",
            "Kubernetes Events dropped (oldest first) because the Event queue was full, since start.",
        )?;
        let node_late = Gauge::new(
            "vk_cocoon_node_tick_late_seconds",
            "How late the last node Lease / status tick started after it was due.",
        )?;
        registry.register(Box::new(queued.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(oldest_queued.clone()))?;
        registry.register(Box::new(events_dropped.clone()))?;
        registry.register(Box::new(node_late.clone()))?;
        Ok(LaneMetrics {
            queued,
            in_flight,
            oldest_queued,
            events_dropped,
            node_late,
        })
    }
}

impl Daemon {
    /// Queues a pod write from the provider; it goes out when the scheduler says so.
    pub(super) fn queue_pod_write(&mut self, write: PodWrite) {
        self.lane.push(write);
    }

    /// Hands out every job the scheduler allows now and arms the timer for the next token.
    pub(super) fn pump_lane(&mut self) {
        let now = Instant::now();
        loop {
            let events_waiting =
                self.events.pending() > 0 && self.events_hold.is_none_or(|until| now >= until);
            let lane = &mut self.lane;
            let Some(job) = self
                .kube
                .with_limiter(|bucket| lane.dispatch(now, bucket, events_waiting))
            else {
                break;
            };
            match job {
                Job::Write(write) => self.submit_write(write),
                Job::Event => self.submit_event(),
            }
        }
        let events_waiting =
            self.events.pending() > 0 && self.events_hold.is_none_or(|until| now >= until);
        let lane = &mut self.lane;
        let wake = self
            .kube
            .with_limiter(|bucket| lane.wake_at(now, bucket, events_waiting));
        let wake = match (wake, self.events_hold) {
            (Some(at), _) => Some(at),
            (None, Some(until)) if self.events.pending() > 0 && until > now => Some(until),
            _ => None,
        };
        if let Some(at) = wake {
            self.arm(OwnTimer::Lane, at.max(self.reactor.now()));
        }
    }

    fn submit_write(&mut self, write: PodWrite) {
        if let WriteKind::Status { status, .. } = &write.kind {
            if log::log_enabled!(log::Level::Debug) {
                let s = crate::provider::status::summary(status);
                log::debug!(
                    "kube lane: status of {} (ops {:?}): phase {:?}, ready {:?} {:?}, ip {:?}",
                    write.key,
                    write.ops,
                    s.phase,
                    s.ready,
                    s.ready_message,
                    s.pod_ip
                );
            }
        }
        let kube = self.lane_kube.clone();
        let submitted = self.lane_pool.submit(move || {
            let result = write_pod(&kube, &write);
            Work::PodWritten {
                write: Box::new(write),
                result,
            }
        });
        if submitted.is_err() {
            // Never happens while the pool has more workers than the scheduler has slots; if
            // it does, the core retries a failed write.
            log::warn!("kube lane: worker queue full");
        }
    }

    fn submit_event(&mut self) {
        let Some(event) = self.events.take_next() else {
            self.lane.event_finished();
            return;
        };
        let kube = self.lane_kube.clone();
        let submitted = self.lane_pool.submit(move || {
            let result = event.write(&kube);
            Work::EventWritten {
                event: Box::new(event),
                result: Box::new(result),
            }
        });
        if submitted.is_err() {
            self.lane.event_finished();
            log::warn!("kube lane: worker queue full; an Event is lost");
        }
    }

    /// A pod write came back: every op it carried gets the same answer.
    pub(super) fn pod_written(&mut self, write: PodWrite, result: Result<(), ApiError>) {
        self.lane.finished(&write);
        let what = match write.kind {
            WriteKind::Status { .. } => "patch status",
            WriteKind::Annotations { .. } => "patch annotations",
            WriteKind::Delete { .. } => "delete pod",
        };
        let result = result.map_err(|e| {
            let mapped = map_kube_error(&e);
            if !mapped.superseded() {
                log::warn!("{what} {}: {e}", write.key);
            }
            mapped
        });
        for op in write.ops {
            self.pending.push_back(Input::KubeDone {
                op,
                result: result.clone(),
            });
        }
    }

    pub(super) fn event_written(
        &mut self,
        event: QueuedEvent,
        result: Result<k8s_openapi::api::core::v1::Event, ApiError>,
    ) {
        self.lane.event_finished();
        let now = self.reactor.now();
        if self.events.written(event, result, now) == Written::Retry {
            // Do not spin on an unavailable API server.
            self.events_hold = Some(Instant::now() + EVENT_RETRY);
        } else {
            self.events_hold = None;
        }
    }

    /// Runs the node agent's due calls on the node thread (it is away until `node_ticked`).
    pub(super) fn node_tick(&mut self) {
        let Some(agent) = self.node.take() else {
            return;
        };
        let due = agent.next_due();
        let kube = self.kube.clone();
        let late = self.lane_metrics.node_late.clone();
        let submitted = self.node_pool.submit(move || {
            let mut agent = agent;
            let now = Instant::now();
            late.set(now.saturating_duration_since(due).as_secs_f64());
            agent.tick(&kube, now);
            Work::NodeTicked(agent)
        });
        if submitted.is_err() {
            log::error!("node thread gone: the Lease is no longer renewed");
        }
    }

    pub(super) fn node_ticked(&mut self, agent: Box<NodeAgent>) {
        if agent.registered() && !self.node_registered {
            self.node_registered = true;
            log::info!("node {} registered", self.config.node_name);
        }
        self.node = Some(agent);
        // An exec credential plugin may have handed out a new client certificate.
        super::startup::export_kube_client_expiry(&self.metrics, &self.kube);
    }

    /// Lists the node's pods on a lane worker (startup reconcile or a watch relist).
    pub(super) fn list_pods(&mut self, startup: bool) {
        let kube = self.kube.clone();
        let node = self.config.node_name.clone();
        let submitted = self.lane_pool.submit(move || Work::PodsListed {
            startup,
            result: kube.list_pods_on_node(&node),
        });
        if submitted.is_err() {
            let result = Err(ApiError::Transport("kube lane queue full".into()));
            self.pods_listed(startup, result);
        }
    }

    pub(super) fn pods_listed(&mut self, startup: bool, result: Result<PodList, ApiError>) {
        let now = self.reactor.now();
        if startup {
            return self.startup_pods_listed(result);
        }
        self.relisting = false;
        match self.watch.relisted(result, now) {
            Ok(out) => self.watch_outputs(out),
            Err(e) => log::warn!("pod watch: relist failed: {e}"),
        }
    }

    /// Starts the relist the watch asked for, once.
    pub(super) fn watch_relist(&mut self) {
        if self.watch.wants_relist() && !self.relisting {
            self.relisting = true;
            self.list_pods(false);
        }
    }

    /// Refreshes the lane gauges (the oldest-write age scans the queues: once per second).
    pub(super) fn lane_gauges(&mut self) {
        let m = &self.lane_metrics;
        m.queued
            .with_label_values(&["pods"])
            .set(self.lane.queued() as i64);
        m.queued
            .with_label_values(&["events"])
            .set(self.events.pending() as i64);
        m.queued.with_label_values(&["node"]).set(i64::from(
            self.node
                .as_ref()
                .is_some_and(|n| n.next_due() <= self.reactor.now()),
        ));
        m.in_flight
            .with_label_values(&["pods"])
            .set(self.lane.in_flight() as i64);
        m.in_flight
            .with_label_values(&["node"])
            .set(i64::from(self.node.is_none()));
        // The queue's own count is the truth; the counter catches up to it.
        let dropped = self.events.stats.dropped;
        m.events_dropped
            .inc_by(dropped.saturating_sub(m.events_dropped.get()));
        let now = Instant::now();
        if self
            .lane_gauges_at
            .is_none_or(|at| now.saturating_duration_since(at) >= Duration::from_secs(1))
        {
            self.lane_gauges_at = Some(now);
            m.oldest_queued
                .set(self.lane.oldest_queued_age(now).as_secs_f64());
        }
    }
}

/// The blocking API call of one pod write (lane worker).
fn write_pod(kube: &Arc<Client>, w: &PodWrite) -> Result<(), ApiError> {
    let (ns, name) = (&w.key.namespace, &w.key.name);
    match &w.kind {
        WriteKind::Status { uid, status } => kube.patch_pod_status(ns, name, Some(uid), status),
        WriteKind::Annotations { uid, annotations } => kube.patch_pod(
            ns,
            name,
            &annotation_patch(uid.clone(), annotations.clone()),
        ),
        WriteKind::Delete { uid, grace } => kube.delete_pod(ns, name, *grace, Some(uid)),
    }
}

pub(super) fn map_kube_error(e: &ApiError) -> KubeError {
    match e {
        ApiError::NotFound(_) => KubeError::NotFound,
        ApiError::Conflict(_) => KubeError::Conflict,
        ApiError::Invalid(_) => KubeError::Invalid,
        other => KubeError::Other(other.to_string()),
    }
}

/// `{"metadata":{"uid":..,"annotations":{k: v | null}}}` for a merge of annotations.
pub(super) fn annotation_patch(
    uid: Option<String>,
    annotations: BTreeMap<String, Option<String>>,
) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = annotations
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                v.map_or(serde_json::Value::Null, serde_json::Value::String),
            )
        })
        .collect();
    let mut meta = serde_json::json!({ "annotations": map });
    if let Some(uid) = uid {
        meta["uid"] = uid.into();
    }
    serde_json::json!({ "metadata": meta })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotation_patches_delete_with_null_and_guard_with_uid() {
        let mut a = BTreeMap::new();
        a.insert("vm.cocoonstack.io/id".to_string(), Some("vm-1".to_string()));
        a.insert(
            "vm.cocoonstack.io/lifecycle-state-message".to_string(),
            None,
        );
        let p = annotation_patch(Some("u-1".into()), a);
        assert_eq!(p["metadata"]["uid"], "u-1");
        assert_eq!(p["metadata"]["annotations"]["vm.cocoonstack.io/id"], "vm-1");
        assert!(
            p["metadata"]["annotations"]["vm.cocoonstack.io/lifecycle-state-message"].is_null()
        );
    }
}
