//! Check: what a VM event or a recheck finds (inspect, restart, refresh), the cooldown and
//! the deferred rechecks of transient errors; eviction starts from here.

use super::*;

impl Provider {
    pub(super) fn vm_event(&mut self, kind: VmEventKind, vm: VmInfo) {
        match kind {
            VmEventKind::Deleted => {
                if self
                    .by_name
                    .get(&vm.name)
                    .map(|v| v.id == vm.id)
                    .unwrap_or(false)
                {
                    self.by_name.remove(&vm.name);
                }
                self.last_restart.remove(&vm.id);
            }
            VmEventKind::Added | VmEventKind::Modified => {}
        }
        let gone = kind == VmEventKind::Deleted || (kind == VmEventKind::Modified && !vm.running());
        if !gone {
            return;
        }
        let Some(key) = self.find_by_vm(&vm) else {
            return;
        };
        if let Some(c) = self.op_of_mut::<CreateOp>(&key) {
            // The create in flight may be making this very VM: look once it is done.
            c.vm_event_meanwhile = Some((kind, vm));
            return;
        }
        // A hibernate removes the VM itself: its events are looked at once the op ends, and
        // only when the VM was kept (a failed hibernate). Outside a hibernate op a pod asking
        // for hibernate is handled like any other: a VM that dies under it is restarted or
        // the pod evicted (a stopped VM cannot be hibernated anyway).
        if self.hibernate_saw_vm_event(&key) {
            return;
        }
        let slot = &self.slots[&key];
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        if !t.spec.managed {
            return;
        }
        let (uid, vm_id) = (
            t.uid.clone(),
            t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default(),
        );
        match slot.op() {
            None => {}
            Some(op) if op.preemptible() => {}
            Some(Op::Check(_)) => {
                // A restart or inspect in flight may have looked before this event's change
                // (a VM removed right after its `vm start`): dropping the event would leave
                // the pod Running on a VM that is gone, with no later event to notice it.
                if let Some(c) = self.op_of_mut::<CheckOp>(&key) {
                    c.gone_meanwhile = true;
                }
                return;
            }
            Some(_) => return,
        }
        self.start_check(&key, uid, vm_id, CheckStep::Inspect { attempt: 1 });
    }

    pub(super) fn start_check(
        &mut self,
        key: &PodKey,
        uid: String,
        vm_id: String,
        step: CheckStep,
    ) {
        let slot = self.slot(key);
        slot.start_op(CheckOp {
            uid,
            vm_id: vm_id.clone(),
            step,
            gone_meanwhile: false,
        });
        slot.awaiting = None;
        slot.timer = None;
        self.pod_cocoon(key, CocoonCmd::VmInspect { reference: vm_id });
    }

    /// Start the deferred VM recheck (1 s doubling to 30 s, 30 min budget).
    pub(super) fn defer_check(&mut self, key: &PodKey, uid: String, vm_id: String) {
        let step = CheckStep::Deferred {
            delay: RECHECK_FIRST,
            until: self.now + RECHECK_BUDGET,
        };
        let slot = self.slot(key);
        slot.start_op(CheckOp {
            uid,
            vm_id,
            step,
            gone_meanwhile: false,
        });
        slot.awaiting = None;
        let at = self.now + RECHECK_FIRST;
        self.set_pod_timer(key, at);
    }

    /// An answer to the running check `c`.
    /// The pod timer of a check: its inspect retry, or the deferred recheck's next round.
    pub(super) fn check_timer(&mut self, key: &PodKey, c: CheckOp) {
        match c.step {
            CheckStep::Inspect { .. } => {
                self.pod_cocoon(key, CocoonCmd::VmInspect { reference: c.vm_id })
            }
            CheckStep::Deferred { delay, until } => {
                // Stop if no pod tracks the ID any more.
                let tracked = self
                    .slots
                    .get(key)
                    .and_then(|s| s.tracked.as_ref())
                    .filter(|t| t.uid == c.uid)
                    .and_then(|t| t.vm.as_ref())
                    .map(|v| v.id == c.vm_id)
                    .unwrap_or(false);
                if !tracked {
                    return self.end_op(key);
                }
                self.advance(
                    key,
                    CheckStep::DeferredInspect { delay, until },
                    Ask::Cocoon(CocoonCmd::VmInspect { reference: c.vm_id }),
                )
            }
            _ => {}
        }
    }

    pub(super) fn check_step(&mut self, key: &PodKey, c: CheckOp, res: Res) {
        let r = match res {
            Res::Cocoon(r) => r,
            other => return self.unexpected_answer(key, &c.step, &other),
        };
        match c.step.clone() {
            CheckStep::Inspect { attempt } => self.check_inspected(key, c, r, attempt),
            CheckStep::DeferredInspect { delay, until } => {
                self.check_deferred_inspected(key, c, r, delay, until)
            }
            CheckStep::Start => self.check_started(key, c, r),
            CheckStep::StartUnanswered { error } => self.check_start_unanswered(key, c, r, error),
            CheckStep::Refresh => self.check_refreshed(key, c, r),
            // Waiting on the timer, not on an answer.
            CheckStep::Deferred { .. } => self.unexpected_answer(key, &c.step, &Res::Cocoon(r)),
        }
    }

    /// `Inspect`: the VM an event said was gone or stopped, as cocoon sees it.
    fn check_inspected(&mut self, key: &PodKey, c: CheckOp, r: Answer, attempt: u32) {
        if r.vm_not_found() {
            return self.start_evict(key, EvictCause::VmGone, false);
        }
        let vm = if r.succeeded() { r.vm().ok() } else { None };
        match vm {
            None if attempt < 2 => {
                let at = self.now + INSPECT_RETRY * attempt;
                let step = CheckStep::Inspect {
                    attempt: attempt + 1,
                };
                self.advance(key, step, Ask::Timer(at));
            }
            None => {
                self.metric(MetricUpdate::VmInspectTransientFail);
                self.defer_check(key, c.uid, c.vm_id);
            }
            Some(vm) if !self.checked_vm_is_ours(key, &c, &vm) => {
                self.start_evict(key, EvictCause::VmGone, false)
            }
            Some(vm) => self.check_state(key, &c, vm),
        }
    }

    /// `DeferredInspect`: one look of the deferred recheck.
    fn check_deferred_inspected(
        &mut self,
        key: &PodKey,
        c: CheckOp,
        r: Answer,
        delay: Duration,
        until: Instant,
    ) {
        if r.vm_not_found() {
            return self.start_evict(key, EvictCause::VmGone, false);
        }
        match if r.succeeded() { r.vm().ok() } else { None } {
            None if self.now >= until => self.start_evict(key, EvictCause::InspectTimeout, true),
            None => {
                let delay = (delay * 2).min(RECHECK_MAX);
                let at = self.now + delay;
                self.advance(key, CheckStep::Deferred { delay, until }, Ask::Timer(at));
            }
            Some(vm) if !self.checked_vm_is_ours(key, &c, &vm) => {
                self.start_evict(key, EvictCause::VmGone, false)
            }
            Some(vm) => self.check_state(key, &c, vm),
        }
    }

    /// `Start`: the restart's `vm start` answered.
    fn check_started(&mut self, key: &PodKey, c: CheckOp, r: Answer) {
        if r.timed_out() {
            let step = CheckStep::StartUnanswered {
                error: r.error_text(),
            };
            let inspect = CocoonCmd::VmInspect {
                reference: c.vm_id.clone(),
            };
            return self.advance(key, step, Ask::Cocoon(inspect));
        }
        if !r.succeeded() {
            let msg = r.error_text();
            return self.start_evict(key, EvictCause::RestartFailed(msg), true);
        }
        self.advance(
            key,
            CheckStep::Refresh,
            Ask::Cocoon(CocoonCmd::VmInspect {
                reference: c.vm_id.clone(),
            }),
        );
    }

    /// `StartUnanswered`: the look after a `vm start` that timed out.
    fn check_start_unanswered(&mut self, key: &PodKey, c: CheckOp, r: Answer, error: String) {
        if r.vm_not_found() {
            return self.start_evict(key, EvictCause::VmGone, false);
        }
        match if r.succeeded() { r.vm().ok() } else { None } {
            // The start went through after all: the restart succeeded.
            Some(vm) if vm.running() && self.checked_vm_is_ours(key, &c, &vm) => {
                if let Some(v) = self.slot(key).tracked.as_mut().and_then(|t| t.vm.as_mut()) {
                    v.pid = vm.pid;
                    v.nics = vm.nics;
                    v.state = vm.state;
                }
                self.check_done(key, &c)
            }
            _ => self.start_evict(key, EvictCause::RestartFailed(error), true),
        }
    }

    /// `Refresh`: the restarted VM, as cocoon sees it.
    fn check_refreshed(&mut self, key: &PodKey, c: CheckOp, r: Answer) {
        if r.vm_not_found() {
            // Removed between its restart and this look.
            return self.start_evict(key, EvictCause::VmGone, false);
        }
        let vm = r.vm().ok();
        if let Some(vm) = vm.filter(|v| r.succeeded() && self.checked_vm_is_ours(key, &c, v)) {
            if let Some(t) = self.slot(key).tracked.as_mut() {
                if let Some(v) = t.vm.as_mut() {
                    v.pid = vm.pid;
                    v.nics = vm.nics;
                    v.state = vm.state;
                }
            }
        }
        self.check_done(key, &c);
    }

    /// The VM runs (false alarm or restarted). A check may have preempted the wait for Ready
    /// of a fresh create; the intent still says `creating` then, so the wait resumes.
    pub(super) fn check_done(&mut self, key: &PodKey, c: &CheckOp) {
        // `c` is the op as its answer found it; an event may have marked the live one since.
        let gone_meanwhile = self.op_of::<CheckOp>(key).is_some_and(|c| c.gone_meanwhile);
        if gone_meanwhile {
            return self.start_check(
                key,
                c.uid.clone(),
                c.vm_id.clone(),
                CheckStep::Inspect { attempt: 1 },
            );
        }
        let intent = self.slot(key).intent.clone().filter(|i| i.uid == c.uid);
        if intent.as_ref().is_some_and(|i| i.state == State::Creating) {
            return self.start_ready_wait(key, c.uid.clone(), c.vm_id.clone());
        }
        if intent.is_none() && self.tracked_managed(key, &c.uid) {
            // Adopted at startup with no lifecycle record on a VM that was stopped: the owed
            // work ran this check instead of publishing Ready, which is owed all the same.
            self.publish_ready(key);
        }
        self.end_op(key)
    }

    /// Whether `key` tracks incarnation `uid` of a managed pod.
    fn tracked_managed(&self, key: &PodKey, uid: &str) -> bool {
        self.slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .is_some_and(|t| t.uid == uid && t.spec.managed)
    }

    /// Forgets restarts older than `RESTART_COOLDOWN_GC_AGE` (they no longer hold a cooldown),
    /// so VMs restarted once and later removed by hand do not accumulate.
    pub(super) fn cooldown_gc(&mut self) {
        let now = self.now;
        self.last_restart
            .retain(|_, t| now.saturating_duration_since(*t) < RESTART_COOLDOWN_GC_AGE);
    }

    /// Whether an answer to the check's `vm inspect <vm_id>` is the pod's VM: of that exact
    /// ID, or of the pod's VM name. The reference may be an ID the pod gave (a VM that vanished
    /// across a restart), which cocoon would also resolve as a prefix of another VM's ID.
    fn checked_vm_is_ours(&self, key: &PodKey, c: &CheckOp, vm: &VmInfo) -> bool {
        let name = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .map_or("", |t| t.spec.vm_name.as_str());
        (!c.vm_id.is_empty() && vm.id == c.vm_id) || isolation::vm_named(vm, name)
    }

    /// Records a restart of `vm_id` now. Restarts older than the GC age go at the same time:
    /// a VM restarted once and gone since (evicted, removed by hand) leaves no record behind
    /// for long, event-stream restarts or not.
    pub(super) fn note_restart(&mut self, vm_id: &str) {
        self.cooldown_gc();
        self.last_restart.insert(vm_id.to_string(), self.now);
    }

    pub(super) fn check_state(&mut self, key: &PodKey, c: &CheckOp, vm: VmInfo) {
        if vm.running() {
            if let Some(t) = self.slot(key).tracked.as_mut() {
                if let Some(v) = t.vm.as_mut() {
                    v.state = vm.state;
                    v.pid = vm.pid;
                }
            }
            return self.check_done(key, c);
        }
        let recent = self
            .last_restart
            .get(&c.vm_id)
            .map(|t| self.now.saturating_duration_since(*t) < RESTART_COOLDOWN)
            .unwrap_or(false);
        if recent {
            return self.start_evict(key, EvictCause::RestartCooldown, true);
        }
        self.note_restart(&c.vm_id);
        self.metric(MetricUpdate::VmRestart {
            namespace: key.namespace.clone(),
            pod: key.name.clone(),
        });
        self.advance(
            key,
            CheckStep::Start,
            Ask::Cocoon(CocoonCmd::VmStart {
                id: c.vm_id.clone(),
            }),
        );
    }
}
