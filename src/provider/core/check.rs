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

    /// The pod timer of a check: its inspect retry, or the deferred recheck's next round.
    pub(super) fn check_timer(&mut self, key: &PodKey, c: CheckOp) {
        let next = c.on_timer(&self.cx(key));
        self.check_next(key, c, next)
    }

    /// An answer to the running check `c`.
    pub(super) fn check_step(&mut self, key: &PodKey, mut c: CheckOp, res: Res) {
        let next = c.on_answer(&mut self.cx(key), res);
        self.check_next(key, c, next)
    }

    /// Carries out what a step of the check `c` decided.
    fn check_next(&mut self, key: &PodKey, c: CheckOp, next: Next<CheckStep, Checked>) {
        let Some((c, then)) = self.apply(key, c, next) else {
            return;
        };
        match then {
            Checked::Evict(cause, remove) => self.start_evict(key, cause, remove),
            Checked::Stopped => {
                let recent = self
                    .last_restart
                    .get(&c.vm_id)
                    .is_some_and(|t| self.now.saturating_duration_since(*t) < RESTART_COOLDOWN);
                if recent {
                    return self.start_evict(key, EvictCause::RestartCooldown, true);
                }
                self.note_restart(&c.vm_id);
                self.metric(MetricUpdate::VmRestart {
                    namespace: key.namespace.clone(),
                    pod: key.name.clone(),
                });
                let start = CocoonCmd::VmStart {
                    id: c.vm_id.clone(),
                };
                self.set_op(key, c);
                self.advance(key, CheckStep::Start, Ask::Cocoon(start));
            }
            Checked::Runs(seen) => {
                let tracked_vm = self.slot(key).tracked.as_mut().and_then(|t| t.vm.as_mut());
                if let (Some(v), Some(seen)) = (tracked_vm, seen) {
                    v.pid = seen.vm.pid;
                    v.state = seen.vm.state;
                    if seen.nics {
                        v.nics = seen.vm.nics;
                    }
                }
                self.check_done(key, &c)
            }
        }
    }

    /// The VM runs (false alarm or restarted). A check may have preempted the wait for Ready
    /// of a fresh create; the intent still says `creating` then, so the wait resumes.
    fn check_done(&mut self, key: &PodKey, c: &CheckOp) {
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

    /// Records a restart of `vm_id` now. Restarts older than the GC age go at the same time:
    /// a VM restarted once and gone since (evicted, removed by hand) leaves no record behind
    /// for long, event-stream restarts or not.
    pub(super) fn note_restart(&mut self, vm_id: &str) {
        self.cooldown_gc();
        self.last_restart.insert(vm_id.to_string(), self.now);
    }
}

/// What a check's step leaves to the provider.
enum Checked {
    /// The pod is evicted for this cause (`true`: its VM is removed first).
    Evict(EvictCause, bool),
    /// The VM is stopped: restarted, unless it was within the restart cooldown.
    Stopped,
    /// The VM runs; what cocoon saw of it, if anything, refreshes the tracked VM.
    Runs(Option<Seen>),
}

/// The VM as the check saw it: its pid and state refresh the tracked VM, its NICs too when
/// `nics` (a VM looked at after a restart).
struct Seen {
    vm: VmInfo,
    nics: bool,
}

impl CheckOp {
    fn on_timer(&self, cx: &Cx) -> Next<CheckStep, Checked> {
        let reference = self.vm_id.clone();
        match self.step {
            CheckStep::Inspect { .. } => Next::Ask(
                self.step.clone(),
                Ask::Cocoon(CocoonCmd::VmInspect { reference }),
            ),
            CheckStep::Deferred { delay, until } => {
                // Stop if no pod tracks the ID any more.
                let tracked = cx
                    .tracked
                    .filter(|t| t.uid == self.uid)
                    .and_then(|t| t.vm.as_ref())
                    .is_some_and(|v| v.id == self.vm_id);
                if !tracked {
                    return Next::End;
                }
                let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
                Next::Ask(CheckStep::DeferredInspect { delay, until }, ask)
            }
            _ => Next::Wait,
        }
    }

    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> Next<CheckStep, Checked> {
        let r = match res {
            Res::Cocoon(r) => r,
            other => return Next::Unexpected(self.step.clone(), other),
        };
        match self.step.clone() {
            CheckStep::Inspect { attempt } => self.inspected(cx, r, attempt),
            CheckStep::DeferredInspect { delay, until } => {
                self.deferred_inspected(cx, r, delay, until)
            }
            CheckStep::Start => self.started(r),
            CheckStep::StartUnanswered { error } => self.start_unanswered(cx, r, error),
            CheckStep::Refresh => self.refreshed(cx, r),
            // Waiting on the timer, not on an answer.
            CheckStep::Deferred { .. } => Next::Unexpected(self.step.clone(), Res::Cocoon(r)),
        }
    }

    /// `Inspect`: the VM an event said was gone or stopped, as cocoon sees it.
    fn inspected(&mut self, cx: &mut Cx, r: Answer, attempt: u32) -> Next<CheckStep, Checked> {
        if r.vm_not_found() {
            return Next::Then(Checked::Evict(EvictCause::VmGone, false));
        }
        let vm = if r.succeeded() { r.vm().ok() } else { None };
        match vm {
            None if attempt < 2 => {
                let at = cx.now + INSPECT_RETRY * attempt;
                let step = CheckStep::Inspect {
                    attempt: attempt + 1,
                };
                Next::Ask(step, Ask::Timer(at))
            }
            None => {
                cx.metric(MetricUpdate::VmInspectTransientFail);
                self.defer(cx)
            }
            Some(vm) if !self.is_ours(cx, &vm) => {
                Next::Then(Checked::Evict(EvictCause::VmGone, false))
            }
            Some(vm) => self.state(vm),
        }
    }

    /// Start the deferred VM recheck (1 s doubling to 30 s, 30 min budget), as
    /// `Provider::defer_check` does.
    fn defer(&mut self, cx: &Cx) -> Next<CheckStep, Checked> {
        self.gone_meanwhile = false;
        let step = CheckStep::Deferred {
            delay: RECHECK_FIRST,
            until: cx.now + RECHECK_BUDGET,
        };
        Next::Ask(step, Ask::Timer(cx.now + RECHECK_FIRST))
    }

    /// `DeferredInspect`: one look of the deferred recheck.
    fn deferred_inspected(
        &mut self,
        cx: &Cx,
        r: Answer,
        delay: Duration,
        until: Instant,
    ) -> Next<CheckStep, Checked> {
        if r.vm_not_found() {
            return Next::Then(Checked::Evict(EvictCause::VmGone, false));
        }
        match if r.succeeded() { r.vm().ok() } else { None } {
            None if cx.now >= until => Next::Then(Checked::Evict(EvictCause::InspectTimeout, true)),
            None => {
                let delay = (delay * 2).min(RECHECK_MAX);
                let at = cx.now + delay;
                Next::Ask(CheckStep::Deferred { delay, until }, Ask::Timer(at))
            }
            Some(vm) if !self.is_ours(cx, &vm) => {
                Next::Then(Checked::Evict(EvictCause::VmGone, false))
            }
            Some(vm) => self.state(vm),
        }
    }

    /// `Start`: the restart's `vm start` answered.
    fn started(&self, r: Answer) -> Next<CheckStep, Checked> {
        let reference = self.vm_id.clone();
        if r.timed_out() {
            let step = CheckStep::StartUnanswered {
                error: r.error_text(),
            };
            return Next::Ask(step, Ask::Cocoon(CocoonCmd::VmInspect { reference }));
        }
        if !r.succeeded() {
            let msg = r.error_text();
            return Next::Then(Checked::Evict(EvictCause::RestartFailed(msg), true));
        }
        let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
        Next::Ask(CheckStep::Refresh, ask)
    }

    /// `StartUnanswered`: the look after a `vm start` that timed out.
    fn start_unanswered(&self, cx: &Cx, r: Answer, error: String) -> Next<CheckStep, Checked> {
        if r.vm_not_found() {
            return Next::Then(Checked::Evict(EvictCause::VmGone, false));
        }
        match if r.succeeded() { r.vm().ok() } else { None } {
            // The start went through after all: the restart succeeded.
            Some(vm) if vm.running() && self.is_ours(cx, &vm) => {
                Next::Then(Checked::Runs(Some(Seen { vm, nics: true })))
            }
            _ => Next::Then(Checked::Evict(EvictCause::RestartFailed(error), true)),
        }
    }

    /// `Refresh`: the restarted VM, as cocoon sees it.
    fn refreshed(&self, cx: &Cx, r: Answer) -> Next<CheckStep, Checked> {
        if r.vm_not_found() {
            // Removed between its restart and this look.
            return Next::Then(Checked::Evict(EvictCause::VmGone, false));
        }
        let vm = r.vm().ok();
        let seen = vm
            .filter(|v| r.succeeded() && self.is_ours(cx, v))
            .map(|vm| Seen { vm, nics: true });
        Next::Then(Checked::Runs(seen))
    }

    /// The inspected VM of the pod: running, or stopped (to restart).
    fn state(&self, vm: VmInfo) -> Next<CheckStep, Checked> {
        if vm.running() {
            return Next::Then(Checked::Runs(Some(Seen { vm, nics: false })));
        }
        Next::Then(Checked::Stopped)
    }

    /// Whether an answer to the check's `vm inspect <vm_id>` is the pod's VM: of that exact
    /// ID, or of the pod's VM name. The reference may be an ID the pod gave (a VM that vanished
    /// across a restart), which cocoon would also resolve as a prefix of another VM's ID.
    fn is_ours(&self, cx: &Cx, vm: &VmInfo) -> bool {
        let name = cx.tracked.map_or("", |t| t.spec.vm_name.as_str());
        (!self.vm_id.is_empty() && vm.id == self.vm_id) || isolation::vm_named(vm, name)
    }
}
