//! An op as a machine: its step reads only what `Cx` lends it (the time, the config, the pod's
//! tracked incarnation and latest copy, the ownership ledger), may emit events and metrics, and
//! says what follows as a `Next`.
//!
//! A step of this shape cannot reach another op's state or the provider's tables: what it may
//! change is its own struct, and every effect, hand-over or ending goes through `Next` (the
//! index upkeep and detached calls an answer calls for as `Chore`s in the op's own follow-up).
//! Every op kind steps this way: `create` (with its macOS steps), `delete` (with its start-up
//! routing), `evict`, `check`, `ready_wait`, `hibernate`, `wake`, `confirm_hibernated`,
//! `post_clone`, `macos` (the guest watch), `classify` and `api_delete`. What stays on
//! `Provider` is the routing and the follow-ups that touch its tables (`*_next` in each file).

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
    /// The pod's latest API object, if any (read-only: whether it is still wanted, evict's
    /// grace, delete's checks).
    pub(super) latest: Option<&'a Pod>,
    /// The ownership ledger, read-only (whose namespace a VM or snapshot name is recorded for).
    pub(super) owners: &'a crate::provider::owners::Owners,
    /// The local snapshots that may exist on the node, read-only (`reclaim`).
    pub(super) local_snapshots: &'a LocalSnapshots,
    /// The namespace of the last pod that held each kept VM, read-only (`isolation`).
    pub(super) last_holder_ns: &'a BTreeMap<String, String>,
    /// When each local snapshot was last pulled, read-only (a `force-pull` create's freshness).
    pub(super) pulled_at: &'a BTreeMap<String, Instant>,
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
            owners: &self.owners,
            local_snapshots: &self.local_snapshots,
            last_holder_ns: &self.last_holder_ns,
            pulled_at: &self.pulled_at,
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

/// What an op's answer calls for beyond events and metrics that is not the op's own state: the
/// upkeep of the provider's shared indexes and detached calls. The op names it in its follow-up;
/// the provider carries it out (`Provider::chore`) before what the step decided next.
pub(super) enum Chore {
    /// A `snapshot rm` of this name answered (`Provider::snapshot_removed`).
    SnapshotRemoved(String, Answer),
    /// The source VM of a fork-snapshot flight changed: the flight's snapshot is stale.
    ForkInvalidated(String),
    /// The VM or snapshot of this name is gone: its ownership record goes too.
    ForgetOwner(Owned, String),
    /// A snapshot no op waits on is removed in the background.
    RemoveSnapshot(String),
    /// A cocoon call whose answer no one waits for (a best-effort guest nudge).
    Detached(CocoonCmd),
    /// The VM of this name is known (the VM-name index).
    VmNamed(String, VmInfo),
    /// A bring-up failed: what the shared read facts say about snapshots or images may be
    /// stale (`read_facts`).
    ReadFactsStale,
    /// The pull of this local snapshot by this pod answered: the next puller may go.
    PullReleased(String, PodKey),
    /// This local snapshot was just pulled (now).
    Pulled(String),
}

impl Provider {
    /// Carries out the chore `c` an op's step named.
    pub(super) fn chore(&mut self, c: Chore) {
        match c {
            Chore::SnapshotRemoved(name, r) => self.snapshot_removed(&name, &r),
            Chore::ForkInvalidated(vm) => self.fork_invalidate(&vm),
            Chore::ForgetOwner(kind, name) => self.forget_owner(kind, &name),
            Chore::RemoveSnapshot(name) => self.remove_snapshot_detached(&name),
            Chore::Detached(cmd) => self.fire_and_forget_cocoon(cmd),
            Chore::VmNamed(name, vm) => {
                self.by_name.insert(name, vm);
            }
            Chore::ReadFactsStale => self.read_facts.forget_all(),
            Chore::PullReleased(name, key) => {
                if self.pulls.get(&name) == Some(&key) {
                    self.pulls.remove(&name);
                }
            }
            Chore::Pulled(name) => {
                self.pulled_at.insert(name, self.now);
            }
        }
    }
}
