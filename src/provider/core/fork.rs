//! fork-from: the node-wide flight that ensures snapshot `fork-<source>` (reuse it, else find
//! the source VM and save it) once for every pod forking that source, and the clone from it.

use super::create::CreateNext;
use super::*;

/// Whose VM a fork source is, for the pod forking it.
enum SourceOwner {
    Own,
    Other,
    Unknown,
}

/// How long the fork save may run before it is killed. The contract gives the save no bound
/// of its own (cocoon's verb class would let it hang for the one-hour transfer deadline, with
/// every forking create waiting Pending all along). A fork save exists only to feed the
/// creates waiting on it, so it gets their bound: the create deadline class of the clone that
/// follows (10 min), past which a create is a failure to report and retry. It is also five
/// times the top bucket of `snapshot_save_duration_seconds` (120 s): a save that long is hung,
/// not slow. The retry finds the killed save's half-saved record and removes it first.
pub(super) const FORK_SAVE_DEADLINE: Duration = Duration::from_secs(600);

/// Why a fork-snapshot flight failed; every pod waiting on it fails its create (retried)
/// with the `Display` text. `name` is the snapshot `fork-<source>`, `source_vm` the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ForkError {
    /// An answer of a kind the flight's step does not wait on.
    Unexpected { name: String, kind: &'static str },
    /// cocoon's answer did not parse (the parser's text).
    Parse(crate::vm::ReadError),
    /// `snapshot inspect fork-<source>` failed.
    Inspect { name: String, error: String },
    /// The removal of an unrecorded `fork-<source>` failed.
    RmUnowned { name: String, error: String },
    /// `fork-<source>` is recorded for another namespace.
    OtherNamespace { name: String, namespace: String },
    /// No VM of that name on this node.
    SourceNotFound { source_vm: String },
    /// `vm inspect <source>` failed.
    SourceInspect { source_vm: String, error: String },
    /// The source VM is not running (its state).
    SourceNotRunning { source_vm: String, state: String },
    /// The owner of `fork-<source>` could not be recorded.
    RecordOwner { name: String, error: String },
    /// `snapshot save` failed.
    Save {
        name: String,
        source_vm: String,
        error: String,
    },
    /// The name is held by an unfinished save whose removal failed.
    HolderNotRemoved { name: String, error: String },
    /// The source was deleted or re-created while it was being forked.
    Invalidated { source_vm: String },
}

impl std::fmt::Display for ForkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ForkError::Unexpected { name, kind } => {
                write!(f, "fork snapshot {name}: unexpected {kind} answer")
            }
            ForkError::Parse(e) => e.fmt(f),
            ForkError::Inspect { name, error } => {
                write!(f, "inspect fork snapshot {name}: {error}")
            }
            ForkError::RmUnowned { name, error } => write!(f, "remove unrecorded {name}: {error}"),
            ForkError::OtherNamespace { name, namespace } => {
                write!(
                    f,
                    "fork-from: {name} is not recorded for namespace {namespace}"
                )
            }
            ForkError::SourceNotFound { source_vm } => {
                write!(f, "fork-from: source vm {source_vm} not found on this node")
            }
            ForkError::SourceInspect { source_vm, error } => {
                write!(f, "fork-from: inspect vm {source_vm}: {error}")
            }
            ForkError::SourceNotRunning { source_vm, state } => {
                write!(
                    f,
                    "fork-from: source vm {source_vm} is {state}, not running"
                )
            }
            ForkError::RecordOwner { name, error } => {
                write!(f, "record the owner of {name}: {error}")
            }
            ForkError::Save {
                name,
                source_vm,
                error,
            } => write!(f, "snapshot save {name} of vm {source_vm}: {error}"),
            ForkError::HolderNotRemoved { name, error } => write!(
                f,
                "snapshot save {name}: the name is held by an unfinished save that could not be \
                 removed: {error}"
            ),
            ForkError::Invalidated { source_vm } => write!(
                f,
                "fork-from: source vm {source_vm} was deleted or re-created while it was being \
                 forked; its fork snapshot is discarded"
            ),
        }
    }
}

impl Provider {
    /// A fresh create with `fork-from` (after the `fork-<own vm>` removal, when it may exist):
    /// join the flight of its source, starting one when none runs. The pod waits in `ForkWait`.
    pub(super) fn fork_begin(&mut self, key: &PodKey, source: &str) {
        let uid = self
            .op_of_mut::<CreateOp>(key)
            .map(|c| c.uid.clone())
            .unwrap_or_default();
        match self.fork_source_owner(key, source) {
            SourceOwner::Own => {}
            SourceOwner::Other => {
                let msg = format!(
                    "pod {key}: fork-from: vm {source} is not a VM of namespace {}; a pod forks \
                     only VMs of its own namespace",
                    key.namespace
                );
                let (event, reason) = (
                    isolation::EVENT_VM_NOT_IN_NS,
                    isolation::REASON_VM_NOT_IN_NS,
                );
                return self.refuse_create(key, event, reason, msg);
            }
            // Not known yet (the source's pod may not be up): the create is retried.
            SourceOwner::Unknown => {
                let msg = format!(
                    "fork-from: vm {source} is not known to be a VM of namespace {}: no pod of \
                     the namespace holds it, none recorded it and its name does not prove it",
                    key.namespace
                );
                return self.fail_create(key, &uid, &msg, true);
            }
        }
        self.advance(
            key,
            CreateStep::ForkWait {
                source: source.to_string(),
            },
            Ask::Flight,
        );
        if let Some(flight) = self.forks.get_mut(source) {
            if !flight.waiting.contains(key) {
                flight.waiting.push(key.clone());
            }
            return;
        }
        self.forks.insert(
            source.to_string(),
            ForkFlight {
                step: ForkStep::Inspect,
                source_id: String::new(),
                source_hypervisor: String::new(),
                invalidated: false,
                waiting: vec![key.clone()],
                namespace: key.namespace.clone(),
                save_started: self.now,
            },
        );
        let name = spec::fork_snapshot_name(source);
        self.fork_cocoon(
            source,
            ForkStep::Inspect,
            CocoonCmd::SnapshotInspect { name },
        );
    }

    /// Ownership: a fork copies the source's memory and disk, so a pod forks only a VM of its
    /// own namespace. A live pod holding the source decides; else the VM's record; else its
    /// name when it proves a namespace. The `vk-<ns>-` prefix alone proves nothing: `team`
    /// shares it with `team-prod`.
    fn fork_source_owner(&self, key: &PodKey, source: &str) -> SourceOwner {
        let holder = self.slots.iter().find_map(|(k, s)| {
            let t = s.tracked.as_ref()?;
            let holds = t.spec.vm_name == source || t.vm.as_ref().is_some_and(|v| v.name == source);
            holds.then_some(k.namespace.as_str())
        });
        let record = self
            .owner_of(Owned::Vm, source)
            .map(|o| o.namespace.as_str());
        let ns = key.namespace.as_str();
        let by_name = crate::provider::naming::owner(source, &[]);
        match holder.or(record) {
            Some(owner) if owner == ns => SourceOwner::Own,
            Some(_) => SourceOwner::Other,
            None if by_name.proves(ns) => SourceOwner::Own,
            None if by_name.admits(ns) => SourceOwner::Unknown,
            None => SourceOwner::Other,
        }
    }

    /// Moves the flight of `source` to `step` and runs the cocoon call that step waits on.
    fn fork_cocoon(&mut self, source: &str, step: ForkStep, cmd: CocoonCmd) {
        if let Some(f) = self.forks.get_mut(source) {
            f.step = step;
        }
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::Fork {
                source: source.to_string(),
            },
        );
        self.out.push(Effect::Cocoon { op, cmd });
    }

    /// The answer to the flight's current cocoon call.
    pub(super) fn fork_flight_step(&mut self, source: &str, res: Res) {
        let Some(flight) = self.forks.get(source) else {
            return;
        };
        let (step, source_id, source_hv) = (
            flight.step.clone(),
            flight.source_id.clone(),
            flight.source_hypervisor.clone(),
        );
        let name = spec::fork_snapshot_name(source);
        let Res::Cocoon(r) = res else {
            let kind = res.kind();
            return self.fork_done(source, Err(ForkError::Unexpected { name, kind }));
        };
        match step {
            ForkStep::Inspect => {
                // Another snapshot than `fork-<source>` (an ID-prefix match) is none.
                let found = r
                    .succeeded()
                    .then(|| isolation::inspected_snapshot(&r, &name));
                match found {
                    Some(Ok(Some(s))) => return self.fork_snapshot_found(source, s.hypervisor),
                    Some(Err(e)) => return self.fork_done(source, Err(ForkError::Parse(e))),
                    Some(Ok(None)) | None => {}
                }
                if !r.succeeded() && !r.snapshot_not_found() {
                    // A hung or failing inspect says nothing: fail, the creates retry.
                    let error = r.error_text();
                    return self.fork_done(source, Err(ForkError::Inspect { name, error }));
                }
                self.fork_find_source(source, false)
            }
            ForkStep::RmUnowned => {
                if !r.succeeded() && !r.snapshot_not_found() {
                    let error = r.error_text();
                    return self.fork_done(source, Err(ForkError::RmUnowned { name, error }));
                }
                self.snapshot_removed(&name, &r);
                self.fork_find_source(source, true)
            }
            ForkStep::FindSource => self.fork_source_inspected(source, r),
            ForkStep::Save { retried } => self.fork_saved(source, r, retried, name, source_hv),
            ForkStep::TakenInspect { holder } => self.fork_taken_inspected(source, r, holder, name),
            // Waiting on the ledger, not on cocoon.
            ForkStep::Record { .. } => {
                let kind = "cocoon";
                self.fork_done(source, Err(ForkError::Unexpected { name, kind }))
            }
            ForkStep::RmHolder => {
                if !r.succeeded() && !r.snapshot_not_found() {
                    self.metric(MetricUpdate::SnapshotSave { result: "failed" });
                    let error = r.error_text();
                    return self
                        .fork_done(source, Err(ForkError::HolderNotRemoved { name, error }));
                }
                self.fork_save(source, source_id, source_hv, true)
            }
        }
    }

    /// `FindSource`: the source VM, as cocoon sees it; a running one is saved.
    fn fork_source_inspected(&mut self, source: &str, r: Answer) {
        if r.vm_not_found() {
            let source_vm = source.to_string();
            return self.fork_done(source, Err(ForkError::SourceNotFound { source_vm }));
        }
        let vm = match (r.succeeded(), r.vm()) {
            (true, Ok(vm)) if isolation::vm_named(&vm, source) => vm,
            // An answer for a VM whose ID the name prefixes is no source VM.
            (true, Ok(_)) => {
                let source_vm = source.to_string();
                return self.fork_done(source, Err(ForkError::SourceNotFound { source_vm }));
            }
            (true, Err(e)) => return self.fork_done(source, Err(ForkError::Parse(e))),
            (false, _) => {
                let (source_vm, error) = (source.to_string(), r.error_text());
                return self.fork_done(source, Err(ForkError::SourceInspect { source_vm, error }));
            }
        };
        if !vm.running() || vm.id.is_empty() {
            let (source_vm, state) = (source.to_string(), vm.state.as_str().to_string());
            return self.fork_done(
                source,
                Err(ForkError::SourceNotRunning { source_vm, state }),
            );
        }
        self.fork_save(source, vm.id, vm.hypervisor, false)
    }

    /// `Save`: the `snapshot save` answered; a name held by an unfinished save is looked at.
    fn fork_saved(
        &mut self,
        source: &str,
        r: Answer,
        retried: bool,
        name: String,
        source_hv: String,
    ) {
        if let Some(f) = self.forks.get(source) {
            let secs = self.now.saturating_duration_since(f.save_started);
            self.metric(MetricUpdate::SnapshotSaveDuration {
                namespace: f.namespace.clone(),
                seconds: secs.as_secs_f64(),
            });
        }
        if r.succeeded() {
            self.metric(MetricUpdate::SnapshotSave { result: "ok" });
            return self.fork_done(source, Ok(source_hv));
        }
        if r.name_taken() && !retried {
            let holder = taken_holder(&r.error_text(), &name);
            return self.fork_cocoon(
                source,
                ForkStep::TakenInspect { holder },
                CocoonCmd::SnapshotInspect { name },
            );
        }
        self.metric(MetricUpdate::SnapshotSave { result: "failed" });
        let (source_vm, error) = (source.to_string(), r.error_text());
        let e = ForkError::Save {
            name,
            source_vm,
            error,
        };
        self.fork_done(source, Err(e))
    }

    /// `TakenInspect`: the snapshot holding the name the save wanted.
    fn fork_taken_inspected(&mut self, source: &str, r: Answer, holder: String, name: String) {
        let found = r
            .succeeded()
            .then(|| isolation::inspected_snapshot(&r, &name));
        match found.and_then(Result::transpose) {
            // Another save (a create of an earlier process) landed it: reuse it.
            Some(Ok(s)) => return self.fork_snapshot_found(source, s.hypervisor),
            Some(Err(e)) => return self.fork_done(source, Err(ForkError::Parse(e))),
            None => {}
        }
        // Invisible but holding the name: the half-saved record of an interrupted
        // save. Removing it is what lets this fork (and any later one) save again.
        log::warn!(
            "provider: fork snapshot {name} is held by an unfinished save ({holder}); removing it"
        );
        self.fork_cocoon(
            source,
            ForkStep::RmHolder,
            CocoonCmd::SnapshotRm { name: holder },
        )
    }

    /// `fork-<source>` exists: handed out when it is recorded for the flight's namespace;
    /// one recorded for another namespace fails the flight; an unrecorded one (an earlier
    /// daemon's) is removed and saved afresh from the source.
    fn fork_snapshot_found(&mut self, source: &str, hypervisor: String) {
        let name = spec::fork_snapshot_name(source);
        let ns = self
            .forks
            .get(source)
            .map(|f| f.namespace.clone())
            .unwrap_or_default();
        match self.owner_of(Owned::Snapshot, &name) {
            Some(o) if o.namespace == ns => self.fork_done(source, Ok(hypervisor)),
            Some(_) => {
                let e = ForkError::OtherNamespace {
                    name,
                    namespace: ns,
                };
                self.fork_done(source, Err(e))
            }
            None => self.fork_cocoon(source, ForkStep::RmUnowned, CocoonCmd::SnapshotRm { name }),
        }
    }

    /// The source VM: from the name index, else `vm inspect <source>`; then the save.
    fn fork_find_source(&mut self, source: &str, retried: bool) {
        match self.by_name.get(source).filter(|v| !v.id.is_empty()) {
            Some(vm) => {
                let (id, hv) = (vm.id.clone(), vm.hypervisor.clone());
                self.fork_save(source, id, hv, retried)
            }
            None => self.fork_cocoon(
                source,
                ForkStep::FindSource,
                CocoonCmd::VmInspect {
                    reference: source.to_string(),
                },
            ),
        }
    }

    fn fork_save(&mut self, source: &str, source_id: String, hypervisor: String, retried: bool) {
        let now = self.now;
        if let Some(f) = self.forks.get_mut(source) {
            f.source_id = source_id.clone();
            f.source_hypervisor = hypervisor;
            f.save_started = now;
        }
        // `fork-<source>` is the source's: its owner goes on record before the save.
        let change = crate::provider::owners::OwnerChange::Set {
            kind: Owned::Snapshot,
            name: spec::fork_snapshot_name(source),
            owner: self.fork_owner(source),
        };
        if self
            .record(vec![change], RecordFor::Fork(source.to_string()))
            .is_some()
        {
            if let Some(f) = self.forks.get_mut(source) {
                f.step = ForkStep::Record { retried };
            }
            return;
        }
        self.fork_save_now(source, retried)
    }

    /// The owner of `fork-<source>`: the source VM's record, else the namespace forking it
    /// (only pods of the source's namespace may) and the pod holding the source.
    fn fork_owner(&self, source: &str) -> Owner {
        if let Some(o) = self.owner_of(Owned::Vm, source) {
            return o.clone();
        }
        let ns = self.forks.get(source).map_or("", |f| f.namespace.as_str());
        let uid = self
            .slots
            .iter()
            .filter(|(k, _)| k.namespace == ns)
            .filter_map(|(_, s)| s.tracked.as_ref())
            .find(|t| t.spec.vm_name == source)
            .map_or("", |t| t.uid.as_str());
        Owner::new(ns, uid)
    }

    /// The record of `fork-<source>`'s owner answered: the save, or the flight fails.
    pub(super) fn fork_owner_recorded(&mut self, source: &str, result: Result<(), String>) {
        let Some(ForkStep::Record { retried }) = self.forks.get(source).map(|f| f.step.clone())
        else {
            return;
        };
        match result {
            Ok(()) => self.fork_save_now(source, retried),
            Err(e) => {
                let name = spec::fork_snapshot_name(source);
                self.fork_done(source, Err(ForkError::RecordOwner { name, error: e }))
            }
        }
    }

    fn fork_save_now(&mut self, source: &str, retried: bool) {
        let Some(source_id) = self.forks.get(source).map(|f| f.source_id.clone()) else {
            return;
        };
        let name = spec::fork_snapshot_name(source);
        self.fork_cocoon(
            source,
            ForkStep::Save { retried },
            CocoonCmd::SnapshotSave {
                name,
                vm_id: source_id,
                deadline: Some(FORK_SAVE_DEADLINE),
            },
        )
    }

    /// `fork-<vm_name>` is being removed (its VM deleted or booted afresh): a flight saving
    /// it must not hand out what it lands.
    pub(super) fn fork_invalidate(&mut self, vm_name: &str) {
        if let Some(f) = self.forks.get_mut(vm_name) {
            f.invalidated = true;
        }
    }

    /// The flight ended: every pod still waiting for it clones (or fails its create).
    /// `Ok` carries the snapshot's hypervisor when known.
    fn fork_done(&mut self, source: &str, result: Result<String, ForkError>) {
        let Some(flight) = self.forks.remove(source) else {
            return;
        };
        let result = match result {
            Ok(_) if flight.invalidated => {
                let name = spec::fork_snapshot_name(source);
                self.remove_snapshot_detached(&name);
                Err(ForkError::Invalidated {
                    source_vm: source.to_string(),
                })
            }
            other => other,
        };
        for key in flight.waiting {
            let waiting = self
                .op_of_mut::<CreateOp>(&key)
                .filter(|c| matches!(&c.step, CreateStep::ForkWait { source: s } if s == source));
            if let Some(c) = waiting.cloned() {
                self.create_step(&key, c, Res::Fork(result.clone()));
            }
        }
    }
}

impl CreateOp {
    /// A waiting pod's answer from the flight: clone from `fork-<source>`.
    pub(super) fn fork_landed(&self, cx: &Cx, r: Result<String, ForkError>) -> CreateNext {
        let hypervisor = match r {
            Ok(hv) => hv,
            Err(e) => return Self::failed(e.to_string(), true),
        };
        let name = spec::fork_snapshot_name(&self.spec.fork_from);
        // The clone's flags follow the pod's backend (a Firecracker clone takes no restore
        // mode), so a source of another hypervisor is refused rather than cloned with the
        // wrong ones. No backend means cloud-hypervisor.
        let want = if self.spec.backend.is_empty() {
            spec::BACKEND_CH
        } else {
            self.spec.backend.as_str()
        };
        if !hypervisor.is_empty() && hypervisor != want {
            let msg = format!(
                "snapshot {name} was taken with {hypervisor} but CocoonSet requests {want}"
            );
            return Self::failed(msg, false);
        }
        // The source runs on this node, so its base image is here: no `--pull`.
        let args = create::clone_args(cx.cfg, &self.spec, CloneSource::Snapshot(name), false);
        self.boot(cx, CocoonCmd::VmClone(args))
    }
}

/// The record holding a taken snapshot name, from cocoon's collision text: the word after
/// `already in use by ` or `held by ` (a trailing `)` dropped), else the name itself. Only a
/// plain ID or name is ever passed on to `snapshot rm`.
fn taken_holder(text: &str, name: &str) -> String {
    let after = ["already in use by ", "held by "]
        .iter()
        .find_map(|m| text.find(m).map(|i| &text[i + m.len()..]));
    let word = after
        .and_then(|a| a.split_whitespace().next())
        .map(|w| w.trim_end_matches(')'))
        .unwrap_or("");
    let plain = word
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric())
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '/'));
    if plain {
        word.to_string()
    } else {
        name.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::{taken_holder, ForkError};

    #[test]
    fn the_holder_of_a_taken_name_is_read_from_cocoons_text_or_is_the_name() {
        let n = "fork-src";
        assert_eq!(
            taken_holder(r#"snapshot name "fork-src" already in use by ABCD234"#, n),
            "ABCD234"
        );
        assert_eq!(
            taken_holder(
                r#"snapshot name "fork-src" already exists (held by XYZ7)"#,
                n
            ),
            "XYZ7"
        );
        assert_eq!(
            taken_holder(r#"snapshot name "fork-src" already exists"#, n),
            n
        );
        // Never a flag or anything odd on an argv.
        assert_eq!(taken_holder("already in use by --force", n), n);
        assert_eq!(taken_holder("already in use by a;b", n), n);
    }

    #[test]
    fn fork_errors_keep_their_messages() {
        let name = || "fork-vk-a-src".to_string();
        let s = || "vk-a-src".to_string();
        let e = |x: &str| x.to_string();
        let cases = [
            (
                ForkError::Unexpected {
                    name: name(),
                    kind: "kube",
                },
                "fork snapshot fork-vk-a-src: unexpected kube answer",
            ),
            (
                ForkError::Parse(crate::vm::ReadError::EmptyRecord { what: "snapshot" }),
                "empty snapshot record in JSON payload",
            ),
            (
                ForkError::Inspect {
                    name: name(),
                    error: e("boom"),
                },
                "inspect fork snapshot fork-vk-a-src: boom",
            ),
            (
                ForkError::RmUnowned {
                    name: name(),
                    error: e("boom"),
                },
                "remove unrecorded fork-vk-a-src: boom",
            ),
            (
                ForkError::OtherNamespace {
                    name: name(),
                    namespace: e("b"),
                },
                "fork-from: fork-vk-a-src is not recorded for namespace b",
            ),
            (
                ForkError::SourceNotFound { source_vm: s() },
                "fork-from: source vm vk-a-src not found on this node",
            ),
            (
                ForkError::SourceInspect {
                    source_vm: s(),
                    error: e("boom"),
                },
                "fork-from: inspect vm vk-a-src: boom",
            ),
            (
                ForkError::SourceNotRunning {
                    source_vm: s(),
                    state: e("stopped"),
                },
                "fork-from: source vm vk-a-src is stopped, not running",
            ),
            (
                ForkError::RecordOwner {
                    name: name(),
                    error: e("disk full"),
                },
                "record the owner of fork-vk-a-src: disk full",
            ),
            (
                ForkError::Save {
                    name: name(),
                    source_vm: s(),
                    error: e("boom"),
                },
                "snapshot save fork-vk-a-src of vm vk-a-src: boom",
            ),
            (
                ForkError::HolderNotRemoved {
                    name: name(),
                    error: e("boom"),
                },
                "snapshot save fork-vk-a-src: the name is held by an unfinished save that could \
                 not be removed: boom",
            ),
            (
                ForkError::Invalidated { source_vm: s() },
                "fork-from: source vm vk-a-src was deleted or re-created while it was being \
                 forked; its fork snapshot is discarded",
            ),
        ];
        for (err, text) in cases {
            assert_eq!(err.to_string(), text);
        }
    }
}
