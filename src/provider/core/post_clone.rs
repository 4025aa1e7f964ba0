//! Post-clone fix-up: `cocoon vm exec` attempts that repair a clone's guest network within a
//! budget, the post-clone-state / hint / errors annotations, then the wait for the IP.
//!
//! The op is preemptible: a delete or a new incarnation ends it at once; the answer of an
//! attempt still running is then stale and dropped (the child is killed at its deadline, which
//! is never later than the budget's end).

use base64::Engine;

use super::*;
use crate::guest::sac::{self, SacError, SacPlan};
use crate::provider::fixup::{self, Fixup, FixupKind};

/// Total time the attempts of one fix-up may take.
const BUDGET: Duration = Duration::from_secs(180);
/// Pause between a failed attempt and the next.
const ATTEMPT_PAUSE: Duration = Duration::from_secs(3);
/// The post-clone-errors annotation is cut to this many bytes.
const ERRORS_MAX: usize = 4096;

pub(super) const ANN_POST_CLONE_HINT: &str = "vm.cocoonstack.io/post-clone-hint";
pub(super) const ANN_POST_CLONE_ERRORS: &str = "vm.cocoonstack.io/post-clone-errors";

/// What the pod's post-clone-state annotation says, from the latest copy of the pod.
pub(super) fn post_clone_state(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(spec::ANN_POST_CLONE_STATE)
        .map(String::as_str)
}

impl Provider {
    /// The tracked VM of `key` came up as a clone (or woke): run the fix-up it needs, else go
    /// straight to the IP wait. `cloud_image`: the guest came from a cloud image (source
    /// image is an http(s) URL) even if the VM's disks do not say so.
    pub(super) fn post_clone_or_ready_wait(
        &mut self,
        key: &PodKey,
        vm: &VmInfo,
        cloud_image: bool,
        mode: PostCloneMode,
    ) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.as_ref()) else {
            return;
        };
        let (uid, os, name) = (t.uid.clone(), t.spec.os, t.spec.vm_name.clone());
        let Some(kind) = fixup::classify(os, vm) else {
            return self.start_ready_wait_as(key, uid, vm.id.clone(), mode);
        };
        let fix = match fixup::build(kind, &name, vm, cloud_image || vm.cloud_image) {
            Ok(f) => f,
            Err(e) => {
                // Nothing is run with a value that failed its check: the fix-up fails now.
                let fix = Fixup {
                    kind,
                    command: Vec::new(),
                    hint: String::new(),
                };
                return self.post_clone_failed(key, &uid, mode, &fix, 0, &[e.to_string()]);
            }
        };
        let windows_static =
            kind == FixupKind::Windows && vm.nics.iter().any(|n| !n.static_ip.is_empty());
        let sac = if windows_static {
            match SacPlan::from_nics(&sac_nics(vm)) {
                Ok(p) => Some(p),
                Err(e) => {
                    let err = SacError {
                        reason: sac::SET_FAILED,
                        message: e,
                    };
                    return self.sac_failed(key, &uid, mode, &err);
                }
            }
        } else {
            None
        };
        // A wake marks the fix-up in progress: its restart cannot tell a cut-short fix-up
        // from a woken guest's dropped NIC otherwise; so does a pod that carries an earlier
        // marker (a `done` would skip the fix-up after a restart). A clone on a pod with no
        // marker needs no write: a restart with no marker runs whatever the clone needs (the
        // fix-up again), and finds the create in flight from the pod's `creating` or, on a
        // fresh pod, from the ledger's record of its VM for its uid (`ledger_create`).
        let marked = self
            .slots
            .get(key)
            .and_then(|s| s.latest.as_deref())
            .is_some_and(|p| post_clone_state(p).is_some());
        if mode == PostCloneMode::Wake || marked {
            self.write_post_clone_state(key, &uid, "running", BTreeMap::new());
        }
        let mut p = PostCloneOp {
            uid,
            vm_id: vm.id.clone(),
            mode,
            fixup: fix,
            step: PostCloneStep::Exec,
            attempts: 0,
            errors: Vec::new(),
            sac,
            sac_only: false,
            until: self.now + BUDGET,
        };
        self.set_op(key, p.clone());
        self.push_status(key, false);
        let next = p.attempt(&self.cx(key));
        self.post_clone_next(key, p, next)
    }

    /// A Windows guest with a static NIC that needs no NIC reset (booted from an image, or
    /// resumed after its fix-up was done): the SAC pass alone, then the IP wait. Anything
    /// else goes straight to the IP wait.
    pub(super) fn sac_then_ready_wait(&mut self, key: &PodKey, vm: &VmInfo, mode: PostCloneMode) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.as_ref()) else {
            return;
        };
        let uid = t.uid.clone();
        let windows = t.spec.os == Os::Windows;
        if !windows || vm.nics.iter().all(|n| n.static_ip.is_empty()) {
            return self.start_ready_wait_as(key, uid, vm.id.clone(), mode);
        }
        let plan = match SacPlan::from_nics(&sac_nics(vm)) {
            Ok(p) => p,
            Err(e) => {
                let err = SacError {
                    reason: sac::SET_FAILED,
                    message: e,
                };
                return self.sac_failed(key, &uid, mode, &err);
            }
        };
        self.set_op(
            key,
            PostCloneOp {
                uid,
                vm_id: vm.id.clone(),
                mode,
                fixup: Fixup {
                    kind: FixupKind::Windows,
                    command: Vec::new(),
                    hint: String::new(),
                },
                step: PostCloneStep::Sac,
                attempts: 0,
                errors: Vec::new(),
                sac: None,
                sac_only: true,
                until: self.now + BUDGET,
            },
        );
        self.push_status(key, false);
        let vm_id = vm.id.clone();
        let ask = Ask::effect(move |op| Effect::SacPass { op, vm_id, plan });
        self.advance(key, PostCloneStep::Sac, ask);
    }

    /// The pause between attempts is over.
    pub(super) fn post_clone_timer(&mut self, key: &PodKey, p: &PostCloneOp) {
        let mut p = p.clone();
        let next = p.on_timer(&self.cx(key));
        self.post_clone_next(key, p, next)
    }

    /// The answer of an attempt (or of the SAC pass).
    pub(super) fn post_clone_step(&mut self, key: &PodKey, p: &PostCloneOp, res: Res) {
        let mut p = p.clone();
        let next = p.on_answer(&mut self.cx(key), res);
        self.post_clone_next(key, p, next)
    }

    /// One attempt of the fix-up `p` failed (or got an answer it did not expect).
    pub(super) fn post_clone_attempt_failed(
        &mut self,
        key: &PodKey,
        mut p: PostCloneOp,
        err: String,
    ) {
        let next = p.attempt_failed(&mut self.cx(key), err);
        self.post_clone_next(key, p, next)
    }

    /// Carries out what a step of the fix-up `p` decided.
    fn post_clone_next(&mut self, key: &PodKey, p: PostCloneOp, next: Next<PostCloneStep, Fixed>) {
        let Some((p, then)) = self.apply(key, p, next) else {
            return;
        };
        match then {
            Fixed::Succeeded if p.sac_only => self.start_ready_wait_as(key, p.uid, p.vm_id, p.mode),
            Fixed::Succeeded => {
                let kind = p.fixup.kind;
                self.metric(MetricUpdate::PostClone {
                    kind: kind.label(),
                    result: "ok",
                });
                self.metric(MetricUpdate::PostCloneAttempts {
                    result: "ok",
                    attempts: p.attempts,
                });
                self.owe_post_clone_done(key, &p.uid);
                self.event(
                    key,
                    &p.uid,
                    EventType::Normal,
                    "PostCloneSucceeded",
                    &format!("kind={} attempts={}", kind.label(), p.attempts),
                );
                self.start_ready_wait_as(key, p.uid, p.vm_id, p.mode);
            }
            Fixed::SacFailed(e) => self.sac_failed(key, &p.uid, p.mode, &e),
            Fixed::Exhausted => {
                self.post_clone_failed(key, &p.uid, p.mode, &p.fixup, p.attempts, &p.errors)
            }
        }
    }

    /// The static addresses could not be set: the pass's own Warning, then
    /// `WindowsStaticIPFailed`, post-clone-state `failed` and lifecycle `failed`.
    fn sac_failed(&mut self, key: &PodKey, uid: &str, mode: PostCloneMode, e: &SacError) {
        let name = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .map(|t| t.spec.vm_name.clone())
            .unwrap_or_default();
        self.metric(MetricUpdate::PostClone {
            kind: "sac",
            result: "failed",
        });
        self.event(key, uid, EventType::Warning, e.reason, &e.message);
        let msg = format!("{} {name}: {}", mode.word(), e.message);
        self.event(key, uid, EventType::Warning, "WindowsStaticIPFailed", &msg);
        self.write_post_clone_state(key, uid, "failed", BTreeMap::new());
        self.set_lifecycle(key, State::Failed, &msg);
        self.slot(key).finish_op();
        self.push_status(key, false);
        self.reconcile_slot(key);
    }

    /// The fix-up failed for good: counters, post-clone-state `failed` with the hint and the
    /// errors, Warning `PostCloneExecExhausted`, lifecycle `failed`. The VM stays (an operator
    /// repairs it with the hint; a delete removes it).
    fn post_clone_failed(
        &mut self,
        key: &PodKey,
        uid: &str,
        mode: PostCloneMode,
        fix: &Fixup,
        attempts: u32,
        errors: &[String],
    ) {
        let name = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .map(|t| t.spec.vm_name.clone())
            .unwrap_or_default();
        self.metric(MetricUpdate::PostClone {
            kind: fix.kind.label(),
            result: "failed",
        });
        self.metric(MetricUpdate::PostCloneAttempts {
            result: "failed",
            attempts,
        });
        if mode == PostCloneMode::Wake {
            // The wake's outcome: its follow-up failed.
            self.metric(MetricUpdate::Wake { result: "failed" });
        }
        let joined = errors.join("; ");
        let mut extra = BTreeMap::new();
        extra.insert(
            ANN_POST_CLONE_HINT.to_string(),
            Some(base64::engine::general_purpose::STANDARD.encode(&fix.hint)),
        );
        extra.insert(
            ANN_POST_CLONE_ERRORS.to_string(),
            Some(truncate_bytes(&joined, ERRORS_MAX)),
        );
        self.write_post_clone_state(key, uid, "failed", extra);
        let what = format!("{} {name}", mode.word());
        self.event(
            key,
            uid,
            EventType::Warning,
            "PostCloneExecExhausted",
            &format!("{what}: {joined}"),
        );
        let msg = format!(
            "{what}: post-clone network fix-up ({}) failed after {attempts} attempts",
            fix.kind.label()
        );
        self.set_lifecycle(key, State::Failed, &msg);
        self.slot(key).finish_op();
        self.push_status(key, false);
        self.reconcile_slot(key);
    }

    /// Writes post-clone-state (with `extra` annotations in the same patch). A `failed` marker
    /// is never overwritten by `running` or `done`: it stays until an operator clears it.
    fn write_post_clone_state(
        &mut self,
        key: &PodKey,
        uid: &str,
        state: &str,
        mut extra: BTreeMap<String, Option<String>>,
    ) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        if !t.spec.managed {
            return;
        }
        let marked_failed = slot
            .latest
            .as_deref()
            .and_then(post_clone_state)
            .is_some_and(|s| s == "failed");
        if state != "failed" && marked_failed {
            return;
        }
        extra.insert(spec::ANN_POST_CLONE_STATE.to_string(), Some(state.into()));
        self.send_annotations(key, uid, extra, false);
    }

    /// post-clone-state `done` rides on the pod's next annotation patch (normally the
    /// lifecycle `ready` that follows the Ready status; `failed` if the IP wait fails) instead
    /// of a write of its own. A crash before that patch leaves `running`, and the restart runs
    /// the fix-up again: it only sets what it set before (hostname, MAC, addresses).
    fn owe_post_clone_done(&mut self, key: &PodKey, uid: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        let marked_failed = slot
            .latest
            .as_deref()
            .and_then(post_clone_state)
            .is_some_and(|s| s == "failed");
        if !t.spec.managed || marked_failed {
            return;
        }
        let mut owed = BTreeMap::new();
        owed.insert(spec::ANN_POST_CLONE_STATE.to_string(), Some("done".into()));
        self.owe_annotations(key, uid, owed);
    }
}

/// What a step of the fix-up leaves to the provider.
enum Fixed {
    /// The fix-up (and its SAC pass) succeeded: post-clone-state `done` is owed (not after a
    /// SAC pass alone), then the IP wait.
    Succeeded,
    /// The SAC pass could not set the static addresses.
    SacFailed(SacError),
    /// The budget is spent: the fix-up failed for good.
    Exhausted,
}

impl PostCloneOp {
    /// Start the next attempt, or give up when the budget is spent.
    fn attempt(&mut self, cx: &Cx) -> Next<PostCloneStep, Fixed> {
        if cx.now >= self.until {
            return Next::Then(Fixed::Exhausted);
        }
        let cmd = CocoonCmd::VmExec {
            id: self.vm_id.clone(),
            command: self.fixup.command.clone(),
            deadline: self.until.saturating_duration_since(cx.now),
        };
        self.attempts += 1;
        Next::Ask(PostCloneStep::Exec, Ask::Cocoon(cmd))
    }

    fn on_timer(&mut self, cx: &Cx) -> Next<PostCloneStep, Fixed> {
        if self.step == PostCloneStep::Pause {
            return self.attempt(cx);
        }
        Next::Wait
    }

    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> Next<PostCloneStep, Fixed> {
        let step = self.step;
        if step == PostCloneStep::Sac {
            // The SAC pass's outcome: `postclone_total{sac,..}`, then on with the fix-up's
            // success, or its failure.
            return match res {
                Res::Sac(Ok(())) => {
                    cx.metric(MetricUpdate::PostClone {
                        kind: "sac",
                        result: "ok",
                    });
                    Next::Then(Fixed::Succeeded)
                }
                Res::Sac(Err(e)) => Next::Then(Fixed::SacFailed(e)),
                other => Next::Unexpected(step, other),
            };
        }
        let Res::Cocoon(r) = res else {
            return Next::Unexpected(step, res);
        };
        if r.succeeded() {
            if let Some(plan) = self.sac.clone() {
                // The NIC reset worked; the static addresses go in over the console.
                let vm_id = self.vm_id.clone();
                let ask = Ask::effect(move |op| Effect::SacPass { op, vm_id, plan });
                return Next::Ask(PostCloneStep::Sac, ask);
            }
            return Next::Then(Fixed::Succeeded);
        }
        let err = if r.timed_out() {
            "vm exec did not finish within the fix-up's budget".to_string()
        } else {
            r.error_text()
        };
        self.attempt_failed(cx, err)
    }

    /// One attempt failed: Warning, then the next one after the pause (within the budget).
    fn attempt_failed(&mut self, cx: &mut Cx, err: String) -> Next<PostCloneStep, Fixed> {
        let n = self.attempts;
        let msg = format!("attempt {n}: {err}");
        cx.event(
            &self.uid,
            EventType::Warning,
            "PostCloneExecAttemptFailed",
            &msg,
        );
        self.errors.push(msg);
        if cx.now >= self.until {
            return Next::Then(Fixed::Exhausted);
        }
        let at = (cx.now + ATTEMPT_PAUSE).min(self.until);
        Next::Ask(PostCloneStep::Pause, Ask::Timer(at))
    }
}

/// The VM's NICs as the SAC plan takes them: (static IP, prefix, gateway).
fn sac_nics(vm: &VmInfo) -> Vec<(String, u64, String)> {
    vm.nics
        .iter()
        .map(|n| (n.static_ip.clone(), n.prefix, n.gateway.clone()))
        .collect()
}
