//! An op as a machine: its step reads only what `Cx` lends it (the time, the config, the pod's
//! tracked incarnation), may emit events and metrics, and says what follows as a `Next`.
//!
//! A step of this shape cannot reach another op's state or the provider's tables: what it may
//! change is its own struct, and every effect, hand-over or ending goes through `Next`.
//! Machines so far: `classify`, `confirm_hibernated`, `evict`, `check`, `macos` (the watch),
//! `ready_wait`, `delete` (the delete and the API delete), `post_clone`; the others still step
//! on `Provider` directly.

use super::*;

/// What an op's step may read of the provider.
pub(super) struct Cx<'a> {
    pub(super) now: Instant,
    pub(super) cfg: &'a ProviderConfig,
    pub(super) key: &'a PodKey,
    /// The pod's tracked incarnation, if any (the op checks it is still its own).
    pub(super) tracked: Option<&'a Tracked>,
    /// The effects of this input so far: a step adds only events and metrics here.
    out: &'a mut Vec<Effect>,
    /// The pod's latest API object, if any (read-only; evict's grace, delete's checks).
    pub(super) latest: Option<&'a Pod>,
}

impl Cx<'_> {
    pub(super) fn event(&mut self, uid: &str, t: EventType, reason: &'static str, msg: &str) {
        let e = event_effect(self.key, uid, t, reason, msg);
        self.out.push(e);
    }

    pub(super) fn metric(&mut self, m: MetricUpdate) {
        self.out.push(Effect::Metric(m));
    }
}

/// What the provider does after an op's step: `S` is the op's step type, `F` the follow-ups
/// only that op has (a hand-over to another op, a failure of its own).
pub(super) enum Next<S, F> {
    /// Move the op to step `S` and ask what it waits on (`Provider::advance`).
    Ask(S, Ask),
    /// Nothing now: the op keeps waiting for what it waits on.
    Wait,
    /// The op has nothing left to do (its pod moved on): end it and reconcile the pod.
    End,
    /// The answer fits no step (`unexpected_answer`).
    Unexpected(S, Res),
    /// The op's own follow-up, carried out by its file.
    Then(F),
}

impl Provider {
    /// The context of a step of the op of `key`.
    pub(super) fn cx<'a>(&'a mut self, key: &'a PodKey) -> Cx<'a> {
        Cx {
            now: self.now,
            cfg: &self.cfg,
            key,
            tracked: self.slots.get(key).and_then(|s| s.tracked.as_ref()),
            out: &mut self.out,
            latest: self.slots.get(key).and_then(|s| s.latest.as_deref()),
        }
    }

    /// Carries out the generic part of `next` for the op `op` of `key` (its state as the step
    /// left it); returns the op's own follow-up, with the op, for its file to carry out.
    pub(super) fn apply<K: OpKind, S: OpStep, F>(
        &mut self,
        key: &PodKey,
        op: K,
        next: Next<S, F>,
    ) -> Option<(K, F)> {
        match next {
            Next::Ask(step, ask) => {
                self.set_op(key, op);
                self.advance(key, step, ask);
                None
            }
            Next::Wait => None,
            Next::End => {
                self.end_op(key);
                None
            }
            Next::Unexpected(step, res) => {
                self.unexpected_answer(key, &step, &res);
                None
            }
            Next::Then(f) => Some((op, f)),
        }
    }
}
