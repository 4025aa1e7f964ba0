//! The local snapshot reclaimer: at start and every 10 minutes, removes the node's `vk-`
//! snapshots that no tracked pod needs and that the registry no longer vouches for.
//!
//! One run at a time: `snapshot list`, then per candidate a removal (wake imports, tagged base
//! snapshots) or a registry check of `<name>:hibernate` (stale: remove it and `fork-<name>`;
//! the check failing: keep). Names are checked against the pods again just before removal.
//! Its listings also feed the record of which local snapshots may exist (`LocalSnapshots`).

use super::*;
use crate::provider::owners::OwnerChange;

/// How often the reclaimer runs after the first run at start.
pub(super) const RECLAIM_EVERY: Duration = Duration::from_secs(600);
/// The suffix of the local snapshot a registry wake imports into.
const IMPORT_SUFFIX: &str = "-hibernate-import";

/// What an outstanding reclaimer answer is for.
#[derive(Debug, Clone)]
pub(super) enum ReclaimStep {
    List,
    /// The registry's hibernate snapshot id of local snapshot `name` (whose id is `local_id`).
    Verify {
        name: String,
        local_id: String,
    },
}

/// A run in progress: candidates still to verify against the registry, one at a time.
#[derive(Debug, Clone, Default)]
pub(super) struct ReclaimRun {
    pub(super) verify: Vec<(String, String)>,
}

impl Provider {
    /// The timer fired: start a run unless one is in progress, and arm the next.
    pub(super) fn reclaim_tick(&mut self) {
        let next = self.now + RECLAIM_EVERY;
        self.arm(next, TimerEntry::Reclaim);
        if self.reclaim.is_some() {
            return;
        }
        self.reclaim = Some(ReclaimRun::default());
        let op = self.op_id();
        self.waiters.insert(op, Waiter::Reclaim(ReclaimStep::List));
        self.out.push(Effect::Cocoon {
            op,
            cmd: CocoonCmd::SnapshotList,
        });
    }

    /// Names a tracked pod or a running op needs: VM names and local clone-snapshot names.
    fn snapshots_in_use(&self) -> std::collections::HashSet<String> {
        let mut used = std::collections::HashSet::new();
        for slot in self.slots.values() {
            if let Some(t) = &slot.tracked {
                used.insert(t.spec.vm_name.clone());
                if !t.spec.image.is_empty() {
                    used.insert(spec::local_snapshot_name(&t.spec.image));
                }
            }
            if let Some(c) = slot.op().and_then(CreateOp::of) {
                used.insert(c.spec.vm_name.clone());
                used.insert(c.local_snapshot.clone());
            }
        }
        used.extend(self.pulls.keys().cloned());
        used.remove("");
        used
    }

    fn in_use(&self, name: &str) -> bool {
        name_in(&self.snapshots_in_use(), name)
    }

    /// Removes a snapshot the caller found in use by nobody.
    fn reclaim_remove(&mut self, name: &str, why: &str) {
        log::info!("snapshot reclaimer: removing local snapshot {name} ({why})");
        self.remove_snapshot_detached(name);
    }

    /// `snapshot rm <name>` that no op waits for; the snapshot's records go once it answers.
    pub(super) fn remove_snapshot_detached(&mut self, name: &str) {
        let op = self.op_id();
        let name = name.to_string();
        self.waiters
            .insert(op, Waiter::SnapshotRm { name: name.clone() });
        self.out.push(Effect::Cocoon {
            op,
            cmd: CocoonCmd::SnapshotRm { name },
        });
    }

    pub(super) fn reclaim_answer(&mut self, step: ReclaimStep, res: Res) {
        match (step, res) {
            (ReclaimStep::List, Res::Cocoon(r)) => {
                let listed = if r.succeeded() {
                    r.snapshot_list().map_err(|e| e.to_string())
                } else {
                    Err(r.error_text())
                };
                let snaps = match listed {
                    Ok(s) => s,
                    Err(e) => {
                        log::warn!("snapshot reclaimer: snapshot list: {e}");
                        self.reclaim = None;
                        return;
                    }
                };
                self.local_snapshots.listed = true;
                self.local_snapshots
                    .may_exist
                    .extend(snaps.iter().map(|s| s.name.clone()));
                self.trim_snapshot_owners();
                // One set for the whole listing: a node lists hundreds of snapshots, and the
                // set walks every pod.
                let used = self.snapshots_in_use();
                let mut verify = Vec::new();
                for s in snaps {
                    let base = s.name.strip_suffix(IMPORT_SUFFIX).unwrap_or(&s.name);
                    if !base.starts_with("vk-") || name_in(&used, &s.name) {
                        continue;
                    }
                    if s.name.ends_with(IMPORT_SUFFIX) {
                        self.reclaim_remove(&s.name, "a finished wake import");
                    } else if s.name.contains(':') {
                        self.reclaim_remove(&s.name, "a tagged base snapshot no pod uses");
                    } else if self.cfg.registry {
                        verify.push((s.name.clone(), s.id.clone()));
                    }
                }
                self.reclaim = Some(ReclaimRun { verify });
                self.reclaim_next();
            }
            (ReclaimStep::Verify { name, local_id }, Res::Evidence(r)) => {
                let recorded = self
                    .owner_of(Owned::Snapshot, &name)
                    .map(|o| o.namespace.clone());
                let stale = match r {
                    // Another snapshot id, or the tag now another namespace's than the copy's.
                    Ok(Some(tag)) => {
                        tag.snapshot_id != local_id
                            || (!tag.owner_namespace.is_empty()
                                && recorded.is_some_and(|ns| ns != tag.owner_namespace))
                    }
                    Ok(None) => true,
                    Err(e) => {
                        log::warn!("snapshot reclaimer: keeping {name}: cannot verify it: {e}");
                        false
                    }
                };
                // A pod that started using the name meanwhile keeps it and its fork.
                let fork = spec::fork_snapshot_name(&name);
                if stale && !self.in_use(&name) {
                    self.reclaim_remove(&name, "stale: the registry's hibernate tag differs");
                    if !self.in_use(&fork) {
                        self.reclaim_remove(&fork, "fork of a stale snapshot");
                    }
                }
                self.reclaim_next();
            }
            (step, res) => {
                log::warn!(
                    "snapshot reclaimer: unexpected {} answer at {step:?}",
                    res.kind()
                );
                self.reclaim = None;
            }
        }
    }

    /// Records the names of the snapshots this input's effects may create (saves, pulls, peer
    /// restores, and the ownership records written just before those), the moment they are
    /// started: a listing running meanwhile may miss them, and must not trim their owners.
    pub(super) fn note_snapshot_writes(&mut self) {
        for e in &self.out {
            let names: Vec<&String> = match e {
                Effect::Cocoon {
                    cmd: CocoonCmd::SnapshotSave { name, .. },
                    ..
                } => vec![name],
                Effect::PullSnapshot { local_name, .. }
                | Effect::PeerRestore { local_name, .. } => vec![local_name],
                Effect::RecordOwners { changes, .. } => changes
                    .iter()
                    .filter_map(|c| match c {
                        OwnerChange::Set {
                            kind: Owned::Snapshot,
                            name,
                            ..
                        } => Some(name),
                        _ => None,
                    })
                    .collect(),
                _ => continue,
            };
            for name in names {
                self.local_snapshots.may_exist.insert(name.clone());
            }
        }
    }

    /// A removal of local snapshot `name` answered. Gone (or never there) leaves the record
    /// unless a fork flight or a pull may be creating it again.
    pub(super) fn snapshot_removed(&mut self, name: &str, r: &Answer) {
        let recreating = self.pulls.contains_key(name)
            || name
                .strip_prefix("fork-")
                .is_some_and(|source| self.forks.contains_key(source));
        if (r.succeeded() || r.snapshot_not_found()) && !recreating {
            self.local_snapshots.may_exist.remove(name);
            self.pulled_at.remove(name);
            self.forget_owner(Owned::Snapshot, name);
        }
    }

    /// Verifies the next candidate, or ends the run.
    fn reclaim_next(&mut self) {
        let next = self.reclaim.as_mut().and_then(|r| r.verify.pop());
        let Some((name, local_id)) = next else {
            if self.reclaim.take().is_some() {
                log::info!("snapshot reclaimer: run done");
            }
            return;
        };
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::Reclaim(ReclaimStep::Verify {
                name: name.clone(),
                local_id,
            }),
        );
        self.out
            .push(Effect::CheckHibernateEvidence { op, vm_name: name });
    }
}

/// Is `name` (or the VM an import of that name is for) among the names in use?
fn name_in(used: &std::collections::HashSet<String>, name: &str) -> bool {
    used.contains(name) || used.contains(name.strip_suffix(IMPORT_SUFFIX).unwrap_or(name))
}
