//! Evict: remove the VM, write the Failed status with the eviction reason, delete the pod.
//! One op per pod, retried on the pod's backoff.

use super::*;

impl Provider {
    pub(super) fn start_evict(&mut self, key: &PodKey, cause: EvictCause, remove: bool) {
        let Some(t) = self.slot(key).tracked.clone() else {
            return self.end_op(key);
        };
        let e = EvictOp {
            uid: t.uid.clone(),
            cause,
            step: EvictStep::Remove,
            attempts: 0,
            grace0: false,
        };
        let next = if remove {
            let id = t.vm.map(|v| v.id).unwrap_or_default();
            Next::Ask(EvictStep::Remove, Ask::Cocoon(CocoonCmd::VmRm { id }))
        } else {
            Next::Then(Evicting::Removed { by_us: false })
        };
        self.set_op(key, e.clone());
        self.evict_next(key, e, next)
    }

    /// An answer to the running eviction `e`.
    pub(super) fn evict_step(&mut self, key: &PodKey, mut e: EvictOp, res: Res) {
        let next = e.on_answer(&mut self.cx(key), res);
        self.evict_next(key, e, next)
    }

    /// The pod timer of an eviction: its DELETE is retried.
    pub(super) fn evict_timer(&mut self, key: &PodKey, mut e: EvictOp) {
        let next = e.on_timer(&self.cx(key));
        self.evict_next(key, e, next)
    }

    /// Carries out what a step of the eviction `e` decided.
    fn evict_next(&mut self, key: &PodKey, e: EvictOp, next: Next<EvictStep, Evicting>) {
        let Some((e, then)) = self.apply(key, e, next) else {
            return;
        };
        let vm = || {
            let t = self.slots.get(key).and_then(|s| s.tracked.as_ref());
            t.and_then(|t| t.vm.clone()).unwrap_or_default()
        };
        match then {
            // Remove-then-evict keeps it; the Go daemon then never looks again and the pod
            // stays Running on a dead VM. Re-check it on the deferred schedule instead: a
            // later round restarts or removes it.
            Evicting::Recheck => {
                let vm_id = vm_id_of(self.slot(key));
                self.defer_check(key, e.uid, vm_id)
            }
            Evicting::Removed { by_us } => {
                let vm = vm();
                self.release_leases(&vm);
                if by_us && !vm.name.is_empty() {
                    self.forget_owner(Owned::Vm, &vm.name);
                }
                let Some(t) = self.slot(key).tracked.clone() else {
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
            Evicting::Deleted => {
                let vm = vm();
                if self.by_name.get(&vm.name).is_some_and(|v| v.id == vm.id) {
                    self.by_name.remove(&vm.name);
                }
                // The VM is gone with its pod: so is its restart cooldown.
                self.last_restart.remove(&vm.id);
                // A pod that was being deleted went with grace 0: like any grace-0 delete of
                // ours, only its DELETED is owed (no second delete of it).
                self.slot(key).idle = if e.grace0 {
                    Idle::ApiDeleted(e.uid)
                } else {
                    Idle::Evicted(e.uid)
                };
                self.forget(key, true);
                self.end_op(key);
            }
        }
    }
}

/// What an eviction's step leaves to the provider.
enum Evicting {
    /// `vm rm` failed: the VM is rechecked on the deferred schedule instead.
    Recheck,
    /// The VM is gone (`by_us`: this eviction removed it, so its name's owner goes too): its
    /// leases are released and the Failed status is written.
    Removed { by_us: bool },
    /// The pod's DELETE landed: the VM's indexes and the pod are forgotten.
    Deleted,
}

impl EvictOp {
    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> Next<EvictStep, Evicting> {
        let key = cx.key;
        match (self.step, res) {
            (EvictStep::Remove, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    log::warn!(
                        "provider: {key}: vm rm before eviction failed (rechecking): {}",
                        r.error_text()
                    );
                    return Next::Then(Evicting::Recheck);
                }
                Next::Then(Evicting::Removed { by_us: true })
            }
            (EvictStep::Status, Res::Kube(_)) => self.ask_delete(cx),
            (EvictStep::Delete, Res::Kube(r)) => match r {
                Ok(()) | Err(KubeError::NotFound) | Err(KubeError::Conflict) => {
                    Next::Then(Evicting::Deleted)
                }
                Err(_) => {
                    cx.metric(MetricUpdate::PodEvictFailure);
                    let delay = if self.attempts < 2 {
                        Duration::from_millis(200 * self.attempts as u64)
                    } else {
                        pod_backoff(self.attempts + 6)
                    };
                    Next::Ask(EvictStep::Delete, Ask::Timer(cx.now + delay))
                }
            },
            (step, res) => Next::Unexpected(step, res),
        }
    }

    fn on_timer(&mut self, cx: &Cx) -> Next<EvictStep, Evicting> {
        if self.step == EvictStep::Delete {
            return self.ask_delete(cx);
        }
        Next::Wait
    }

    /// The pod's DELETE (again).
    fn ask_delete(&mut self, cx: &Cx) -> Next<EvictStep, Evicting> {
        let grace0 = cx
            .latest
            .is_some_and(|p| pod_uid(p) == self.uid && deleting(p));
        self.attempts += 1;
        self.grace0 = grace0;
        // A pod already being deleted (its delete waited on a push when the VM went) ends
        // with grace 0, as any delete of ours does: a DELETE with no grace only restates the
        // deletion it is in, and the object would stay terminating.
        let grace = grace0.then_some(0);
        let (uid, key) = (self.uid.clone(), cx.key.clone());
        let ask = Ask::effect(move |op| Effect::DeletePod {
            op,
            key,
            uid,
            grace,
        });
        Next::Ask(EvictStep::Delete, ask)
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
