//! Startup's confirmation of a hibernation: a pod asking for hibernate, holding no VM, whose
//! record says a VM ran under it, is taken for hibernated only when its snapshot exists.
//!
//! The record alone cannot tell a hibernate whose removal finished (its id-clearing write lost
//! with the restart) from a VM removed from outside mid-hibernate (after a failed push, before
//! the ids were cleared): both leave an id or `hibernating` behind and no VM. The snapshot
//! tells: a finished hibernate pushed `<vm>:hibernate` from the local save it made, so the tag
//! exists and a local `<vm>` still there carries the tag's snapshot id. Without a registry the
//! local snapshot is the evidence, as create and wake take it. No evidence: the VM is lost
//! under the pod, which is evicted `VMGone` as a VM that vanishes at runtime is (its wake would
//! boot a fresh VM and call it woken). An unreadable registry or cocoon decides nothing: the
//! pod stays as it is and the lookup is retried.

use super::hibernate::HIBERNATE_TAG;
use super::*;

/// The first retry of a lookup that failed, doubled per failure up to `CONFIRM_RETRY_MAX`.
const CONFIRM_RETRY_FIRST: Duration = Duration::from_secs(1);
const CONFIRM_RETRY_MAX: Duration = Duration::from_secs(30);
/// `pod_lifecycle_total{startup,failed,<reason>}` of a pod whose VM was lost mid-hibernate.
pub(super) const REASON_VM_LOST: &str = "hibernate_vm_lost";

/// Whether a pod asking for hibernate with no VM at startup records a VM that ran under it:
/// the VM id annotation, or a hibernate that began (`hibernating`, or its failure). A pod
/// recording none (never booted, or settled `hibernated` with its ids cleared) has nothing
/// that could have been lost, and is hibernated without a lookup. macOS guests never
/// hibernate (their VMs are not cocoon's either): never looked up.
pub(super) fn records_a_vm(spec: &VmSpec, intent: Option<&Intent>) -> bool {
    spec.os != Os::Macos
        && (!spec.vm_id.is_empty()
            || intent.is_some_and(|i| {
                i.state == State::Hibernating
                    || (i.state == State::Failed && i.message.starts_with("hibernate: "))
            }))
}

impl Provider {
    /// Owed at startup for a pod of `records_a_vm`: look its snapshot up before deciding.
    pub(super) fn start_confirm_hibernated(&mut self, key: &PodKey) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.clone()) else {
            return;
        };
        log::warn!(
            "provider: {key}: no vm {} at startup; looking for its hibernate snapshot",
            t.spec.vm_name
        );
        self.metric(MetricUpdate::StartupResume {
            op: "confirm_hibernated",
        });
        let slot = self.slot(key);
        slot.awaiting = None;
        slot.timer = None;
        slot.start_op(ConfirmOp {
            uid: t.uid,
            step: ConfirmStep::LocalInspect,
            delay: CONFIRM_RETRY_FIRST,
            warned: false,
        });
        self.confirm_local_inspect(key, &t.spec.vm_name);
    }

    fn confirm_local_inspect(&mut self, key: &PodKey, vm: &str) {
        let (step, ask) = ConfirmOp::local_inspect(vm);
        self.advance(key, step, ask)
    }

    /// An answer to the confirmation `c`.
    pub(super) fn confirm_hibernated_step(&mut self, key: &PodKey, mut c: ConfirmOp, res: Res) {
        let next = c.on_answer(&mut self.cx(key), res);
        self.confirm_next(key, c, next)
    }

    /// An answer the confirmation did not expect: handled as a failed lookup.
    pub(super) fn confirm_hibernated_retry(&mut self, key: &PodKey, mut c: ConfirmOp, why: &str) {
        let mut cx = self.cx(key);
        let next = match c.tracked(&cx) {
            Some(_) => c.unreadable(&mut cx, why),
            None => Next::End,
        };
        self.confirm_next(key, c, next)
    }

    /// The backoff of a failed lookup ran out: look again from the start.
    pub(super) fn confirm_hibernated_timer(&mut self, key: &PodKey, c: ConfirmOp) {
        let next = c.on_timer(&self.cx(key));
        self.confirm_next(key, c, next)
    }

    /// Carries out what a step of the confirmation `c` decided.
    fn confirm_next(&mut self, key: &PodKey, c: ConfirmOp, next: Next<ConfirmStep, Confirmed>) {
        let Some((c, then)) = self.apply(key, c, next) else {
            return;
        };
        let Some(t) = self.tracked_as(key, &c.uid) else {
            return self.end_op(key);
        };
        match then {
            Confirmed::Hibernated => self.confirmed_hibernated(key, &t),
            Confirmed::Lost(why) => self.lost_mid_hibernate(key, &t, &why),
        }
    }

    /// The snapshot exists: the hibernate finished. Stale ids go, the record says `hibernated`.
    fn confirmed_hibernated(&mut self, key: &PodKey, t: &Tracked) {
        log::info!("provider: {key}: hibernate snapshot found; the pod is hibernated");
        if !t.spec.vm_id.is_empty() || !t.spec.vm_ip.is_empty() {
            let mut a = BTreeMap::new();
            for k in [ANN_VM_ID, ANN_VM_IP, spec::ANN_POST_CLONE_STATE] {
                a.insert(k.to_string(), None);
            }
            self.send_annotations(key, &t.uid, a, false);
        }
        if let Some(tr) = self.slot(key).tracked.as_mut() {
            tr.spec.vm_id.clear();
            tr.spec.vm_ip.clear();
        }
        self.settle_hibernated(key, &t.uid);
        self.end_op(key);
    }

    /// No snapshot: the VM was lost under the pod. Reported and evicted as a vanished VM is.
    fn lost_mid_hibernate(&mut self, key: &PodKey, t: &Tracked, why: &str) {
        let vm = &t.spec.vm_name;
        let msg = format!("vm {vm} is gone and was not hibernated: {why}");
        log::error!("provider: {key}: {msg}; evicting the pod");
        self.lifecycle_metric("startup", "failed", REASON_VM_LOST);
        self.event(key, &t.uid, EventType::Warning, "HibernateVMLost", &msg);
        self.start_evict(key, EvictCause::VmGone, false);
    }
}

/// What a confirmation settled.
enum Confirmed {
    /// The snapshot exists: the hibernate finished.
    Hibernated,
    /// No snapshot (or only an older one): the VM was lost under the pod, for this reason.
    Lost(String),
}

impl ConfirmOp {
    /// The pod's tracked incarnation while it is this op's.
    fn tracked<'a>(&self, cx: &Cx<'a>) -> Option<&'a Tracked> {
        cx.tracked.filter(|t| t.uid == self.uid)
    }

    fn local_inspect(vm: &str) -> (ConfirmStep, Ask) {
        let name = vm.to_string();
        let ask = Ask::Cocoon(CocoonCmd::SnapshotInspect { name });
        (ConfirmStep::LocalInspect, ask)
    }

    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> Next<ConfirmStep, Confirmed> {
        let Some(t) = self.tracked(cx) else {
            return Next::End;
        };
        let vm = t.spec.vm_name.clone();
        match (self.step.clone(), res) {
            (ConfirmStep::LocalInspect, Res::Cocoon(r)) => {
                let local_id = if r.succeeded() {
                    // Another snapshot than `<vm>` (an ID-prefix match) is none.
                    match isolation::inspected_snapshot(&r, &vm) {
                        Ok(s) => s.map(|s| s.id),
                        Err(e) => return self.unreadable(cx, &e.to_string()),
                    }
                } else if r.snapshot_not_found() {
                    None
                } else {
                    let msg = format!("inspect local snapshot {vm}: {}", r.error_text());
                    return self.unreadable(cx, &msg);
                };
                if !cx.cfg.registry {
                    return Next::Then(match local_id {
                        Some(_) => Confirmed::Hibernated,
                        None => Confirmed::Lost("no local snapshot of it".into()),
                    });
                }
                let ask = Ask::effect(move |op| Effect::CheckHibernateEvidence { op, vm_name: vm });
                Next::Ask(ConfirmStep::Tag { local_id }, ask)
            }
            (ConfirmStep::Tag { local_id }, Res::Evidence(found)) => match found {
                Ok(None) => {
                    let why = format!("no {vm}:{HIBERNATE_TAG} in the registry");
                    Next::Then(Confirmed::Lost(why))
                }
                // The local save this node made is newer than the tag: its push never landed,
                // and the tag is an earlier hibernation's. Waking from it would bring back an
                // older VM as if it were this one.
                Ok(Some(tag))
                    if local_id.as_ref().is_some_and(|id| {
                        !tag.snapshot_id.is_empty() && *id != tag.snapshot_id
                    }) =>
                {
                    let why = format!(
                        "{vm}:{HIBERNATE_TAG} holds snapshot {} but the last save here is {}: \
                         that save was never pushed",
                        tag.snapshot_id,
                        local_id.unwrap_or_default()
                    );
                    Next::Then(Confirmed::Lost(why))
                }
                Ok(Some(_)) => Next::Then(Confirmed::Hibernated),
                Err(e) => {
                    cx.metric(MetricUpdate::HibernateEvidence {
                        verdict: "unavailable",
                    });
                    let msg = format!("look up {vm}:{HIBERNATE_TAG}: {e}");
                    self.unreadable(cx, &msg)
                }
            },
            (step, res) => Next::Unexpected(step, res),
        }
    }

    /// A lookup failed: nothing is decided on it. The pod stays as it is (no VM, its record
    /// untouched), a Warning says why once, and the lookup starts over after a backoff.
    fn unreadable(&mut self, cx: &mut Cx, why: &str) -> Next<ConfirmStep, Confirmed> {
        let key = cx.key;
        log::warn!("provider: {key}: hibernate snapshot lookup failed (retrying): {why}");
        if !self.warned {
            cx.event(
                &self.uid,
                EventType::Warning,
                "HibernateEvidenceUnavailable",
                &format!("startup: cannot tell whether the vm was hibernated: {why}; retrying"),
            );
        }
        let at = cx.now + self.delay;
        self.delay = (self.delay * 2).min(CONFIRM_RETRY_MAX);
        self.warned = true;
        Next::Ask(ConfirmStep::Wait, Ask::Timer(at))
    }

    fn on_timer(&self, cx: &Cx) -> Next<ConfirmStep, Confirmed> {
        let Some(t) = self.tracked(cx) else {
            return Next::End;
        };
        if self.step != ConfirmStep::Wait {
            return Next::Wait;
        }
        let (step, ask) = Self::local_inspect(&t.spec.vm_name);
        Next::Ask(step, ask)
    }
}
