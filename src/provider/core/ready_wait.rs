//! The wait for Ready: a clone's (or woken VM's) guest IP from its lease, polled within 45 s,
//! then the Ready publication; Windows guests get one `ipconfig /renew` nudge at 30 s.
//!
//! The op is preemptible: a VM event, a delete or a new incarnation ends it at once. Its step
//! reads only the pod's tracked incarnation (`Cx`); recording an IP and the Ready or failed
//! lifecycle are the provider's, asked for through `Waited`.

use super::*;

/// Windows guests get one `ipconfig /renew` this long into the IP wait.
const RENEW_NUDGE_AFTER: Duration = Duration::from_secs(30);

impl Provider {
    /// Wait for the guest IP of a clone, then publish Ready.
    pub(super) fn start_ready_wait(&mut self, key: &PodKey, uid: String, vm_id: String) {
        self.start_ready_wait_as(key, uid, vm_id, PostCloneMode::Clone)
    }

    /// Wait for the guest IP, then publish Ready; Windows guests get a renew nudge at 30 s.
    pub(super) fn start_ready_wait_as(
        &mut self,
        key: &PodKey,
        uid: String,
        vm_id: String,
        mode: PostCloneMode,
    ) {
        let windows = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .is_some_and(|t| t.spec.os == Os::Windows);
        let until = self.now + IP_WAIT;
        let nudge_at = windows.then(|| (self.now + RENEW_NUDGE_AFTER).min(until));
        let w = ReadyWaitOp {
            uid,
            vm_id,
            step: ReadyWaitStep::Pause,
            until,
            nudge_at,
            mode,
        };
        self.set_op(key, w.clone());
        self.push_status(key, false);
        self.ready_wait_poll(key, w);
    }

    /// An answer to the wait for Ready `w`: a lease lookup, or the renew nudge.
    pub(super) fn ready_wait_step(&mut self, key: &PodKey, mut w: ReadyWaitOp, res: Res) {
        let next = w.on_answer(&mut self.cx(key), res);
        self.ready_wait_next(key, w, next)
    }

    /// The wait for Ready `w` looks again (its timer, or an IP learned meanwhile).
    pub(super) fn ready_wait_poll(&mut self, key: &PodKey, mut w: ReadyWaitOp) {
        let next = w.poll(&mut self.cx(key));
        self.ready_wait_next(key, w, next)
    }

    /// Carries out what a step of the wait for Ready `w` decided.
    fn ready_wait_next(&mut self, key: &PodKey, w: ReadyWaitOp, next: Next<ReadyWaitStep, Waited>) {
        let Some((w, then)) = self.apply(key, w, next) else {
            return;
        };
        match then {
            Waited::Ip(ip) => {
                self.set_ip(key, &ip);
                self.ready_wait_poll(key, w)
            }
            Waited::Ready => {
                self.slot(key).finish_op();
                self.publish_ready(key);
                self.reconcile_slot(key)
            }
            Waited::TimedOut(msg) => {
                self.set_lifecycle(key, State::Failed, &msg);
                self.slot(key).finish_op();
                self.push_status(key, false);
                self.reconcile_slot(key)
            }
        }
    }
}

/// What a step of the wait for Ready leaves to the provider.
enum Waited {
    /// A lease answered with this IP: it is recorded, then the wait looks again.
    Ip(String),
    /// The guest has its IP: the op ends and Ready is published.
    Ready,
    /// No IP within the wait: the op ends and the pod fails with this message.
    TimedOut(String),
}

impl ReadyWaitOp {
    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> Next<ReadyWaitStep, Waited> {
        match res {
            Res::Lease(Ok(Some(ip))) if !ip.is_empty() => Next::Then(Waited::Ip(ip)),
            Res::Lease(_) => {
                let at = (cx.now + IP_POLL).min(self.until);
                Next::Ask(ReadyWaitStep::Pause, Ask::Timer(at))
            }
            // The nudge's answer: count it, then look at the lease again.
            Res::Cocoon(r) => {
                let result = if r.succeeded() { "ok" } else { "failed" };
                cx.metric(MetricUpdate::WakeRenewNudge { result });
                self.poll(cx)
            }
            other => Next::Unexpected(self.step, other),
        }
    }

    /// One look: Ready once the pod has an IP, failed once the wait is over, else the nudge
    /// when due or the next lease lookup.
    fn poll(&mut self, cx: &mut Cx) -> Next<ReadyWaitStep, Waited> {
        let Some(t) = cx.tracked else {
            return Next::Wait;
        };
        let key = cx.key;
        let vm = t.vm.clone().unwrap_or_default();
        // Only while the pod still tracks the same incarnation and VM.
        if self.uid != t.uid || self.vm_id != vm.id || t.spec.hibernate {
            return Next::End;
        }
        if !t.ip.is_empty() {
            cx.metric(MetricUpdate::WakeIpWait {
                namespace: key.namespace.clone(),
                result: "ok",
            });
            if self.mode == PostCloneMode::Wake {
                cx.metric(MetricUpdate::Wake { result: "ok" });
            }
            return Next::Then(Waited::Ready);
        }
        if cx.now >= self.until {
            let name = &t.spec.vm_name;
            cx.metric(MetricUpdate::WakeIpWait {
                namespace: key.namespace.clone(),
                result: "timeout",
            });
            let msg = format!(
                "{} {name}: dhcp lease not observed within 45s",
                self.mode.word()
            );
            let reason = match self.mode {
                PostCloneMode::Clone => "PostCloneIPWaitTimeout",
                PostCloneMode::Wake => {
                    cx.metric(MetricUpdate::Wake { result: "failed" });
                    "WakeIPWaitTimeout"
                }
            };
            cx.event(&t.uid, EventType::Warning, reason, &msg);
            return Next::Then(Waited::TimedOut(msg));
        }
        if let Some(nudge) = self.renew_nudge(cx) {
            return nudge;
        }
        let mac = vm.primary_mac();
        if mac.is_empty() {
            let at = (cx.now + IP_POLL).min(self.until);
            return Next::Ask(ReadyWaitStep::Pause, Ask::Timer(at));
        }
        let ask = Ask::effect(move |op| Effect::LookupLease { op, mac });
        Next::Ask(ReadyWaitStep::Lease, ask)
    }

    /// The renew nudge when it is due: `cmd /c ipconfig /renew` in the guest, within what is
    /// left of the wait. None when none is due.
    fn renew_nudge(&mut self, cx: &Cx) -> Option<Next<ReadyWaitStep, Waited>> {
        let at = self.nudge_at?;
        if cx.now < at || cx.now >= self.until {
            return None;
        }
        self.nudge_at = None;
        let cmd = CocoonCmd::VmExec {
            id: self.vm_id.clone(),
            command: ["cmd", "/c", "ipconfig", "/renew"]
                .map(String::from)
                .to_vec(),
            deadline: self.until.saturating_duration_since(cx.now),
        };
        Some(Next::Ask(ReadyWaitStep::Nudge, Ask::Cocoon(cmd)))
    }
}
