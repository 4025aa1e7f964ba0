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
        let Some(vm_name) = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .map(|t| t.spec.vm_name.clone())
        else {
            return self.end_op(key);
        };
        let ask = Ask::effect(move |op| Effect::CheckHibernateEvidence { op, vm_name });
        self.advance(key, ClassifyStep::Evidence, ask)
    }

    /// The classification `c` still concerns the pod: it tracks the same incarnation and VM.
    fn classify_live(&self, key: &PodKey, c: &ClassifyOp) -> bool {
        self.slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .is_some_and(|t| t.uid == c.uid && t.vm.as_ref().is_some_and(|v| v.id == c.vm_id))
    }

    /// An answer to the classification `c`.
    pub(super) fn classify_step(&mut self, key: &PodKey, c: ClassifyOp, res: Res) {
        if !self.classify_live(key, &c) {
            return self.end_op(key);
        }
        match (c.step, res) {
            (ClassifyStep::Evidence, Res::Evidence(Ok(found))) => {
                let Some(vm) = self
                    .slots
                    .get(key)
                    .and_then(|s| s.tracked.as_ref())
                    .and_then(|t| t.vm.clone())
                else {
                    return self.end_op(key);
                };
                {
                    let slot = self.slot(key);
                    slot.clear_op();
                }
                if found.is_some() {
                    // Woken: the wake's own follow-up for a VM whose NIC came back hot-added.
                    log::info!("provider: {key}: hibernate evidence found: the IP wait is owed");
                    self.start_ready_wait_as(key, c.uid, c.vm_id, PostCloneMode::Wake)
                } else if c.cloned {
                    log::info!("provider: {key}: no hibernate evidence: the fix-up is owed");
                    self.post_clone_or_ready_wait(key, &vm, false, PostCloneMode::Clone)
                } else {
                    // A booted (not cloned) guest owes no fix-up: the IP wait, as for `done`.
                    self.sac_then_ready_wait(key, &vm, PostCloneMode::Clone)
                }
            }
            (ClassifyStep::Evidence, Res::Evidence(Err(e))) => {
                let vm_name = self
                    .slots
                    .get(key)
                    .and_then(|s| s.tracked.as_ref())
                    .map(|t| t.spec.vm_name.clone())
                    .unwrap_or_default();
                let msg = format!("hibernate evidence of {vm_name}: {e}");
                self.classify_lookup_failed(key, c, msg)
            }
            (step, res) => self.unexpected_answer(key, &step, &res),
        }
    }

    /// A lookup failed: ask again after the backoff, or give up once the budget is spent.
    pub(super) fn classify_lookup_failed(&mut self, key: &PodKey, c: ClassifyOp, msg: String) {
        if !self.classify_live(key, &c) {
            return self.end_op(key);
        }
        let failures = c.failures + 1;
        let at = self.now + retry_delay(failures);
        if at > c.until {
            let text = format!("classify_drop_nic: {msg}; gave up after 30 min");
            log::warn!("provider: {key}: {text}");
            self.event(
                key,
                &c.uid,
                EventType::Warning,
                "ResumeClassifyFailed",
                &text,
            );
            {
                let slot = self.slot(key);
                slot.clear_op();
            }
            // Neither the fix-up nor the IP wait is run on a guess: the pod says why it is
            // stuck, and its VM is kept for an operator.
            self.set_lifecycle(key, State::Failed, &text);
            return self.push_status(key, false);
        }
        log::warn!("provider: {key}: classify_drop_nic: {msg}; asking again");
        if let Some(op) = self.op_of_mut::<ClassifyOp>(key) {
            op.failures = failures;
        }
        self.advance(key, ClassifyStep::Pause, Ask::Timer(at))
    }

    pub(super) fn classify_timer(&mut self, key: &PodKey, c: ClassifyOp) {
        if !self.classify_live(key, &c) {
            return self.end_op(key);
        }
        if c.step == ClassifyStep::Pause {
            self.ask_classify_evidence(key)
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
