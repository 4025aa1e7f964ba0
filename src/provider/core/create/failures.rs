//! A create refused or failed: the ownership and CPU-class gates, a pod rejected before
//! anything is tracked, and a failed create with its Warning, status and backoff retry.

use super::*;

impl Provider {
    /// The snapshot CPU-class gate of this node for a pod (create, update and startup).
    pub(in crate::provider::core) fn cpu_class_gate(
        &self,
        key: &PodKey,
        spec: &VmSpec,
    ) -> Result<(), String> {
        spec::cpu_class_gate(
            spec,
            &key.to_string(),
            &self.cfg.node_name,
            self.cfg.cpu_class.as_deref(),
        )
    }

    /// Ownership: a VM belongs to at most one live pod. Refuses a pod whose VM name, or (for
    /// an unmanaged pod) pre-assigned VM id, is held by another tracked pod, or whose id names
    /// a known VM of another name. The message names no other pod: it lands in the
    /// requester's namespace.
    pub(in crate::provider::core) fn vm_claimed_elsewhere(
        &self,
        key: &PodKey,
        uid: &str,
        spec: &VmSpec,
    ) -> Option<String> {
        let held = self.slots.iter().any(|(k, s)| {
            let Some(t) = s.tracked.as_ref().filter(|_| k != key) else {
                return false;
            };
            if t.uid == uid && !uid.is_empty() {
                return false;
            }
            let tracked_id = t.vm.as_ref().map(|v| v.id.as_str()).unwrap_or("");
            t.spec.vm_name == spec.vm_name
                || (!spec.managed
                    && !spec.vm_id.is_empty()
                    && (tracked_id == spec.vm_id || t.spec.vm_id == spec.vm_id))
        });
        if held {
            return Some(format!(
                "vm {} is owned by another pod; a VM belongs to one pod at a time",
                spec.vm_name
            ));
        }
        if !spec.managed && !spec.vm_id.is_empty() {
            let other = self
                .by_name
                .values()
                .any(|v| v.id == spec.vm_id && v.name != spec.vm_name);
            if other {
                return Some(format!(
                    "vm id {} belongs to a vm other than {}",
                    spec.vm_id, spec.vm_name
                ));
            }
        }
        None
    }

    /// A Warning `AnnotationFallback` and `{create,lenient,<reason>}` for each annotation value
    /// that did not parse and was read as the Go daemon reads it.
    pub(super) fn warn_fallbacks(&mut self, key: &PodKey, uid: &str, spec: &VmSpec) {
        for f in &spec.fallbacks {
            self.lifecycle_metric("create", "lenient", f.reason);
            let message = format!("pod {key}: {f}");
            self.event(key, uid, EventType::Warning, "AnnotationFallback", &message);
        }
    }

    /// Bad input / unsupported request: failure status + Warning, counter; no VM touched.
    pub(in crate::provider::core) fn reject(&mut self, key: &PodKey, pod: &Arc<Pod>, e: SpecError) {
        // A VM held by another pod is a conflict no retry settles: the pod fails for good.
        let terminal = restart_never(pod) || e.reason == REASON_VM_OWNED;
        self.reject_as(key, pod, "ProviderCreateFailed", e, terminal)
    }

    /// A pod refused before anything is tracked: Warning `event_reason`, the counter, the
    /// failure status (phase Failed when `terminal`); retried only when the pod changes.
    pub(in crate::provider::core) fn reject_as(
        &mut self,
        key: &PodKey,
        pod: &Arc<Pod>,
        event_reason: &'static str,
        e: SpecError,
        terminal: bool,
    ) {
        let uid = pod_uid(pod);
        let result = if e.reason == "missing_vmname" {
            "skipped"
        } else {
            "failed"
        };
        self.lifecycle_metric("create", result, e.reason);
        self.event(key, &uid, EventType::Warning, event_reason, &e.message);
        let st = status::provider_failed(terminal, &e.message);
        let sum = status::summary(&st);
        let slot = self.slot(key);
        slot.idle = Idle::Rejected(pod.clone());
        let already = slot.last_pushed.as_ref() == Some(&sum);
        slot.last_pushed = Some(sum);
        if !already {
            self.send_status(key, &uid, st, false);
        }
    }

    /// Create failed at bring-up: Warning CreateBringUpFailed + lifecycle failed + drop the row;
    /// then the framework's ProviderFailed status + Warning and a backoff retry.
    pub(in crate::provider::core) fn fail_create(
        &mut self,
        key: &PodKey,
        uid: &str,
        err: &str,
        retry: bool,
    ) {
        self.fail_create_as(key, uid, "CreateBringUpFailed", err, retry)
    }

    /// A failed create: Warning `reason`, lifecycle `failed`, ProviderFailed status, and a
    /// retry with the pod's backoff when `retry`.
    pub(in crate::provider::core) fn fail_create_as(
        &mut self,
        key: &PodKey,
        uid: &str,
        reason: &'static str,
        err: &str,
        retry: bool,
    ) {
        let how = CreateFailure {
            reason,
            metric_reason: "",
            retry,
            terminal: false,
        };
        self.fail_create_with(key, uid, err, how)
    }

    /// A failed create as `how` says; `terminal` fails the pod (phase Failed) whatever its
    /// restart policy: a refusal no retry settles.
    pub(in crate::provider::core) fn fail_create_with(
        &mut self,
        key: &PodKey,
        uid: &str,
        err: &str,
        how: CreateFailure,
    ) {
        let CreateFailure {
            reason,
            metric_reason,
            retry,
            terminal,
        } = how;
        // The retry looks the VM up by name again; an event about it says nothing more (it
        // ends with the op).
        self.lifecycle_metric("create", "failed", metric_reason);
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
        let never = terminal || pod.as_deref().map(restart_never).unwrap_or(false);
        let st = status::provider_failed(never, err);
        let sum = status::summary(&st);
        let now = self.now;
        let (failures, send) = {
            let slot = self.slot(key);
            slot.tracked = None;
            slot.drop_op();
            let send = slot.last_pushed.as_ref() != Some(&sum);
            slot.last_pushed = Some(sum);
            if !retry {
                match pod.clone() {
                    Some(p) => slot.idle = Idle::Rejected(p),
                    None => slot.idle.clear_rejection(),
                }
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
}
