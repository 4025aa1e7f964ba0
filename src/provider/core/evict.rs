//! Evict: remove the VM, write the Failed status with the eviction reason, delete the pod.
//! One op per pod, retried on the pod's backoff.

use super::*;

impl Provider {
    pub(super) fn start_evict(&mut self, key: &PodKey, cause: EvictCause, remove: bool) {
        let Some(t) = self.slot(key).tracked.clone() else {
            return self.end_op(key);
        };
        let vm = t.vm.clone().unwrap_or_default();
        self.set_op(
            key,
            EvictOp {
                uid: t.uid.clone(),
                cause,
                step: EvictStep::Remove,
                attempts: 0,
                grace0: false,
            },
        );
        if remove {
            return self.pod_cocoon(key, CocoonCmd::VmRm { id: vm.id });
        }
        self.release_leases(&vm);
        self.evict_status(key);
    }

    pub(super) fn evict_status(&mut self, key: &PodKey) {
        let slot = self.slot(key);
        let (Some(e), Some(t)) = (
            slot.op().and_then(EvictOp::of).cloned(),
            slot.tracked.clone(),
        ) else {
            return;
        };
        let st = status::evicted(
            e.cause.reason().as_str(),
            &e.cause.to_string(),
            t.start_time.as_ref(),
            &self.wall,
        );
        let st = Arc::new(st);
        let slot = self.slot(key);
        slot.last_pushed = Some(status::summary(&st));
        slot.shown = Some((e.uid.clone(), st.clone()));
        let (uid, k) = (e.uid.clone(), key.clone());
        let ask = Ask::effect(move |op| Effect::PatchPodStatus {
            op,
            key: k,
            uid,
            status: st,
        });
        self.advance(key, EvictStep::Status, ask);
    }

    /// The pod timer of an eviction: its DELETE is retried.
    pub(super) fn evict_timer(&mut self, key: &PodKey, e: EvictOp) {
        if e.step == EvictStep::Delete {
            self.evict_delete(key, e)
        }
    }

    pub(super) fn evict_delete(&mut self, key: &PodKey, e: EvictOp) {
        let grace0 = self
            .slot(key)
            .latest
            .as_deref()
            .is_some_and(|p| pod_uid(p) == e.uid && deleting(p));
        if let Some(x) = self.op_of_mut::<EvictOp>(key) {
            x.attempts += 1;
            x.grace0 = grace0;
        }
        // A pod already being deleted (its delete waited on a push when the VM went) ends
        // with grace 0, as any delete of ours does: a DELETE with no grace only restates the
        // deletion it is in, and the object would stay terminating.
        let grace = grace0.then_some(0);
        let (uid, k) = (e.uid.clone(), key.clone());
        let ask = Ask::effect(move |op| Effect::DeletePod {
            op,
            key: k,
            uid,
            grace,
        });
        self.advance(key, EvictStep::Delete, ask);
    }

    /// An answer to the running eviction `e`.
    pub(super) fn evict_step(&mut self, key: &PodKey, e: EvictOp, res: Res) {
        match (e.step, res) {
            (EvictStep::Remove, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    // Remove-then-evict keeps it; the Go daemon then never looks again and the pod
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
                if !vm.name.is_empty() {
                    self.forget_owner(Owned::Vm, &vm.name);
                }
                self.evict_status(key)
            }
            (EvictStep::Status, Res::Kube(_)) => self.evict_delete(key, e),
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
                    // The VM is gone with its pod: so is its restart cooldown.
                    self.last_restart.remove(&vm.id);
                    let uid = e.uid.clone();
                    // A pod that was being deleted went with grace 0: like any grace-0
                    // delete of ours, only its DELETED is owed (no second delete of it).
                    self.slot(key).idle = if e.grace0 {
                        Idle::ApiDeleted(uid)
                    } else {
                        Idle::Evicted(uid)
                    };
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
            (step, res) => self.unexpected_answer(key, &step, &res),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evict_causes_keep_their_reasons_and_messages() {
        let cases = [
            (EvictCause::VmGone, "VMGone", "vm no longer exists"),
            (
                EvictCause::InspectTimeout,
                "VMInspectTimeout",
                "vm inspect did not resolve within budget",
            ),
            (
                EvictCause::RestartCooldown,
                "RestartCooldown",
                "restart cooldown not elapsed",
            ),
            (
                EvictCause::RestartFailed("vm start: exit 1".into()),
                "RestartFailed",
                "vm start: exit 1",
            ),
        ];
        for (cause, reason, message) in cases {
            assert_eq!(cause.reason().as_str(), reason);
            assert_eq!(cause.to_string(), message);
        }
    }
}
