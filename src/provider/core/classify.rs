//! Owed work of an unmarked CH Windows clone after a restart: the registry's hibernate evidence
//! tells a VM woken from a hibernation that dropped its NIC from a fresh clone.
//!
//! Such a VM has no post-clone-state marker either way. Woken, it got its NIC back hot-added
//! and owes only the IP wait (a fix-up would cycle that NIC); freshly cloned, it owes the
//! fix-up. The lookup is retried from 1 s doubling to 30 s for 30 minutes, then the op fails
//! with `ResumeClassifyFailed` rather than guess.

use super::*;

/// The first retry of a failed evidence lookup; each next one waits twice as long.
const FIRST_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between lookups.
const MAX_RETRY: Duration = Duration::from_secs(30);
/// No lookup starts this long after the op began.
const CLASSIFY_BUDGET: Duration = Duration::from_secs(30 * 60);

/// The wait before lookup `failures + 1`: 1 s, 2 s, 4 s ... capped at 30 s.
fn retry_delay(failures: u32) -> Duration {
    FIRST_RETRY
        .saturating_mul(1u32 << failures.saturating_sub(1).min(5))
        .min(MAX_RETRY)
}

impl Provider {
    /// Starts the classification of the tracked VM `vm_id` of `key` (the caller counted and
    /// announced the resumed op).
    pub(super) fn start_classify(
        &mut self,
        key: &PodKey,
        uid: String,
        vm_id: String,
        cloned: bool,
    ) {
        let until = self.now + CLASSIFY_BUDGET;
        self.set_op(
            key,
            ClassifyOp {
                uid,
                vm_id,
                cloned,
                step: ClassifyStep::Evidence,
                failures: 0,
                until,
            },
        );
        self.ask_classify_evidence(key);
    }

    fn ask_classify_evidence(&mut self, key: &PodKey) {
        let next: Next<_, Classified> = ClassifyOp::ask_evidence(&self.cx(key));
        if let Next::Ask(step, ask) = next {
            return self.advance(key, step, ask);
        }
        self.end_op(key)
    }

    /// An answer to the classification `c`.
    pub(super) fn classify_step(&mut self, key: &PodKey, mut c: ClassifyOp, res: Res) {
        let next = c.on_answer(&self.cx(key), res);
        self.classify_next(key, c, next)
    }

    /// A lookup failed: ask again after the backoff, or give up once the budget is spent.
    pub(super) fn classify_lookup_failed(&mut self, key: &PodKey, mut c: ClassifyOp, msg: String) {
        let next = c.lookup_failed(&self.cx(key), msg);
        self.classify_next(key, c, next)
    }

    pub(super) fn classify_timer(&mut self, key: &PodKey, c: ClassifyOp) {
        let next = c.on_timer(&self.cx(key));
        self.classify_next(key, c, next)
    }

    /// Carries out what a step of the classification `c` decided.
    fn classify_next(&mut self, key: &PodKey, c: ClassifyOp, next: Next<ClassifyStep, Classified>) {
        let Some((c, then)) = self.apply(key, c, next) else {
            return;
        };
        self.slot(key).clear_op();
        match then {
            // Woken: the wake's own follow-up for a VM whose NIC came back hot-added.
            Classified::Woken => self.start_ready_wait_as(key, c.uid, c.vm_id, PostCloneMode::Wake),
            Classified::Cloned(vm) => {
                self.post_clone_or_ready_wait(key, &vm, false, PostCloneMode::Clone)
            }
            // A booted (not cloned) guest owes no fix-up: the IP wait, as for `done`.
            Classified::Booted(vm) => self.sac_then_ready_wait(key, &vm, PostCloneMode::Clone),
            Classified::GaveUp(text) => {
                self.event(
                    key,
                    &c.uid,
                    EventType::Warning,
                    "ResumeClassifyFailed",
                    &text,
                );
                // Neither the fix-up nor the IP wait is run on a guess: the pod says why it
                // is stuck, and its VM is kept for an operator.
                self.set_lifecycle(key, State::Failed, &text);
                self.push_status(key, false)
            }
        }
    }
}

/// What a classification settled: the work its VM owes, or that it gave up.
enum Classified {
    /// Hibernate evidence: woken, only the IP wait is owed.
    Woken,
    /// No evidence on a clone: the post-clone fix-up is owed.
    Cloned(VmInfo),
    /// No evidence on a booted guest: no fix-up, the IP wait.
    Booted(VmInfo),
    /// The lookups failed for the whole budget: the pod fails with this message.
    GaveUp(String),
}

impl ClassifyOp {
    /// The pod's VM while the pod still tracks this op's incarnation and VM.
    fn live_vm<'a>(&self, cx: &Cx<'a>) -> Option<&'a VmInfo> {
        let t = cx.tracked.filter(|t| t.uid == self.uid)?;
        t.vm.as_ref().filter(|v| v.id == self.vm_id)
    }

    /// Ask the registry for the VM's hibernate tag.
    fn ask_evidence(cx: &Cx) -> Next<ClassifyStep, Classified> {
        let Some(t) = cx.tracked else {
            return Next::End;
        };
        let vm_name = t.spec.vm_name.clone();
        let ask = Ask::effect(move |op| Effect::CheckHibernateEvidence { op, vm_name });
        Next::Ask(ClassifyStep::Evidence, ask)
    }

    fn on_answer(&mut self, cx: &Cx, res: Res) -> Next<ClassifyStep, Classified> {
        let Some(vm) = self.live_vm(cx) else {
            return Next::End;
        };
        let key = cx.key;
        match (self.step, res) {
            (ClassifyStep::Evidence, Res::Evidence(Ok(found))) => Next::Then(if found.is_some() {
                log::info!("provider: {key}: hibernate evidence found: the IP wait is owed");
                Classified::Woken
            } else if self.cloned {
                log::info!("provider: {key}: no hibernate evidence: the fix-up is owed");
                Classified::Cloned(vm.clone())
            } else {
                Classified::Booted(vm.clone())
            }),
            (ClassifyStep::Evidence, Res::Evidence(Err(e))) => {
                let vm_name = cx.tracked.map(|t| t.spec.vm_name.as_str()).unwrap_or("");
                let msg = format!("hibernate evidence of {vm_name}: {e}");
                self.lookup_failed(cx, msg)
            }
            (step, res) => Next::Unexpected(step, res),
        }
    }

    fn lookup_failed(&mut self, cx: &Cx, msg: String) -> Next<ClassifyStep, Classified> {
        if self.live_vm(cx).is_none() {
            return Next::End;
        }
        let key = cx.key;
        let failures = self.failures + 1;
        let at = cx.now + retry_delay(failures);
        if at > self.until {
            let text = format!("classify_drop_nic: {msg}; gave up after 30 min");
            log::warn!("provider: {key}: {text}");
            return Next::Then(Classified::GaveUp(text));
        }
        log::warn!("provider: {key}: classify_drop_nic: {msg}; asking again");
        self.failures = failures;
        Next::Ask(ClassifyStep::Pause, Ask::Timer(at))
    }

    fn on_timer(&self, cx: &Cx) -> Next<ClassifyStep, Classified> {
        if self.live_vm(cx).is_none() {
            return Next::End;
        }
        match self.step {
            ClassifyStep::Pause => Self::ask_evidence(cx),
            ClassifyStep::Evidence => Next::Wait,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_one_second_to_thirty() {
        let secs: Vec<u64> = (1..=8).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 16, 30, 30, 30]);
    }
}
