//! UpdatePod: the decision table for a tracked pod whose API copy changed (hibernate, wake,
//! lifting a hibernate failure, generation re-marks) and the retry of a failed hibernate / wake.

use super::*;

/// The first retry of a failed hibernate or wake, doubled per failure up to `UPDATE_RETRY_MAX`.
pub(super) const UPDATE_RETRY_FIRST: Duration = Duration::from_secs(15);
pub(super) const UPDATE_RETRY_MAX: Duration = Duration::from_secs(5 * 60);

impl Provider {
    /// UpdatePod for a tracked pod with no op running (or a preemptible one). Work is
    /// serialised per pod by the slot's single op. The hibernate / wake decision is taken from
    /// the pod's current wish and the VM we track, so a retry, a restart or an event that
    /// arrives mid-op all converge on what the annotation asks.
    pub(super) fn maybe_update(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let (Some(t), Some(pod)) = (&slot.tracked, &slot.latest) else {
            return;
        };
        if t.uid != pod_uid(pod) {
            return;
        }
        let changed = changed(&t.pod, pod);
        let pod = pod.clone();
        let uid = t.uid.clone();
        let tracked_name = t.spec.vm_name.clone();
        if !changed {
            // Only status or bookkeeping moved (our own writes come back as MODIFIED): share
            // the newer copy so the older one is freed instead of kept beside it.
            if !Arc::ptr_eq(&t.pod, &pod) {
                if let Some(t) = self.slot(key).tracked.as_mut() {
                    t.pod = pod;
                }
            }
            return self.update_decide(key, false);
        }
        let new_spec = match spec::parse(&pod) {
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
        // A tracked pod keeps its VM: hibernate and delete act on the tracked name only.
        self.keep_vm_name(key, &uid, &tracked_name, &new_spec.vm_name);
        if !self.update_cpu_class_gate(key, &pod, &new_spec) {
            return;
        }
        if let Some(t) = self.slot(key).tracked.as_mut() {
            t.pod = pod;
            t.spec = VmSpec {
                vm_name: tracked_name,
                vm_id: t.spec.vm_id.clone(),
                vm_ip: t.spec.vm_ip.clone(),
                ..new_spec
            };
        }
        self.update_decide(key, true)
    }

    /// The decision's first step: the snapshot CPU-class gate. A refused update applies
    /// nothing (hibernate included); the refused copy is kept as the tracked one so the same
    /// change is not refused and reported again on every MODIFIED.
    fn update_cpu_class_gate(&mut self, key: &PodKey, pod: &Arc<Pod>, spec: &VmSpec) -> bool {
        let Err(msg) = self.cpu_class_gate(key, spec) else {
            return true;
        };
        let uid = pod_uid(pod);
        self.lifecycle_metric("update", "failed", create::REASON_CPU_CLASS);
        self.event(key, &uid, EventType::Warning, "ProviderUpdateFailed", &msg);
        if let Some(t) = self.slot(key).tracked.as_mut() {
            t.pod = pod.clone();
        }
        false
    }

    /// Apply the update: hibernate a live VM the pod asks to hibernate, wake a hibernated one
    /// the pod no longer asks to, lift a hibernate failure, else a no-op. `changed`: the pod's
    /// input changed (a framework update); otherwise only a due retry acts.
    fn update_decide(&mut self, key: &PodKey, changed: bool) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        let (uid, spec, has_vm) = (t.uid.clone(), t.spec.clone(), t.vm.is_some());
        if deleting(&t.pod) {
            return;
        }
        if !spec.managed {
            if changed {
                self.lifecycle_metric("update", "skipped", "noop");
            }
            return;
        }
        if spec.os == Os::Macos {
            return self.update_macos(key, &uid, &spec, changed);
        }
        if spec.hibernate && !has_vm {
            return self.settle_hibernated(key, &uid);
        }
        let wants_hibernate = spec.hibernate && has_vm;
        let wants_wake = !spec.hibernate && !has_vm;
        if wants_hibernate || wants_wake {
            // A failed hibernate / wake waits for its retry unless the pod itself changed.
            if let Some((_, due)) = slot.update_retry {
                if due > self.now && !changed {
                    if slot.timer.is_none() {
                        self.set_pod_timer(key, due);
                    }
                    return;
                }
            }
            if wants_hibernate {
                // A VM known stopped (an owed hibernate whose start failed) is started first.
                let stopped = t.vm.as_ref().is_some_and(|v| !v.running());
                return self.start_hibernate(key, stopped);
            }
            return self.start_wake(key, false);
        }
        let intent = slot.intent.clone();
        // A hibernate that failed, or that a restart interrupted, and is no longer asked for.
        let hibernate_left = intent.as_ref().is_some_and(|i| {
            i.uid == uid
                && (i.state == State::Hibernating
                    || (i.state == State::Failed && i.message.starts_with("hibernate: ")))
        });
        let vm_running = t.vm.as_ref().is_some_and(|v| v.running());
        if !spec.hibernate && hibernate_left && vm_running {
            // The user gave up on hibernating: the VM never stopped running.
            self.slot(key).update_retry = None;
            self.set_lifecycle(key, State::Creating, "");
            self.publish_ready(key);
            self.update_succeeded(key, &uid);
            return;
        }
        if !changed {
            return;
        }
        if let Some(cur) = intent {
            if cur.uid == uid && spec.generation > cur.generation {
                let msg = cur.message.clone();
                self.set_lifecycle(key, cur.state, &msg);
            }
        }
        self.lifecycle_metric("update", "skipped", "noop");
    }

    /// A pod asking for hibernate with no VM is hibernated, whatever its record says: a wake
    /// that failed (or was interrupted by a restart) before its clone, then withdrawn, leaves
    /// `failed` or `creating` behind, and nothing else would ever settle it.
    pub(super) fn settle_hibernated(&mut self, key: &PodKey, uid: &str) {
        let slot = self.slot(key);
        slot.update_retry = None;
        let settled = slot
            .intent
            .as_ref()
            .is_some_and(|i| i.uid == uid && i.state == State::Hibernated);
        if !settled {
            // Through `hibernating`: a sticky `failed` only gives way to a new attempt.
            self.set_lifecycle(key, State::Hibernating, "");
            self.set_lifecycle(key, State::Hibernated, "");
        }
        self.push_status(key, false);
    }

    /// Managed macOS guests cannot hibernate: the request is a failure the pod shows until it
    /// is withdrawn.
    fn update_macos(&mut self, key: &PodKey, uid: &str, spec: &VmSpec, changed: bool) {
        if !changed {
            return;
        }
        if spec.hibernate {
            if self.slot(key).warned_hibernate {
                return;
            }
            self.slot(key).warned_hibernate = true;
            let msg = format!(
                "hibernate: macOS guest {} does not support hibernate",
                spec.vm_name
            );
            self.lifecycle_metric("update", "failed", "");
            self.event(key, uid, EventType::Warning, "HibernateUnsupported", &msg);
            self.set_lifecycle(key, State::Failed, &msg);
            return;
        }
        if self.slot(key).warned_hibernate {
            self.slot(key).warned_hibernate = false;
            self.set_lifecycle(key, State::Creating, "");
            self.publish_ready(key);
        }
    }

    /// An update the pod asked for is done (hibernated, woken, a hibernate withdrawn): the
    /// counter and the Normal `ProviderUpdateSuccess` the Go daemon's framework emits.
    pub(super) fn update_succeeded(&mut self, key: &PodKey, uid: &str) {
        self.lifecycle_metric("update", "ok", "");
        self.event(
            key,
            uid,
            EventType::Normal,
            "ProviderUpdateSuccess",
            "Update pod in provider successfully",
        );
    }

    /// A hibernate or wake failed: counter, Warning `reason` with "update: <err>", lifecycle
    /// `failed`, and a retry of the whole update (15 s, doubling to 5 min). The pod keeps
    /// whatever VM it has.
    pub(super) fn update_failed(
        &mut self,
        key: &PodKey,
        uid: &str,
        reason: &'static str,
        err: &str,
    ) {
        self.update_failed_as(key, uid, reason, "", err)
    }

    /// `update_failed` counted under `metric_reason`.
    pub(super) fn update_failed_as(
        &mut self,
        key: &PodKey,
        uid: &str,
        reason: &'static str,
        metric_reason: &'static str,
        err: &str,
    ) {
        log::warn!("provider: {key}: {err}");
        self.lifecycle_metric("update", "failed", metric_reason);
        self.event(
            key,
            uid,
            EventType::Warning,
            reason,
            &format!("update: {err}"),
        );
        self.set_lifecycle(key, State::Failed, err);
        let now = self.now;
        let due = {
            let slot = self.slot(key);
            slot.drop_op();
            let delay = match slot.update_retry {
                Some((d, _)) => (d * 2).min(UPDATE_RETRY_MAX),
                None => UPDATE_RETRY_FIRST,
            };
            slot.update_retry = Some((delay, now + delay));
            now + delay
        };
        self.set_pod_timer(key, due);
        self.push_status(key, false);
    }
}
