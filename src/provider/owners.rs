//! The ownership ledger's data: the namespace (and pod) each VM the daemon created and each
//! local snapshot it saved or imported belongs to. Plain data; the daemon keeps it on disk.
//!
//! The core holds the ledger in memory and asks the edge to write each change
//! ([`crate::provider::Effect::RecordOwners`]) before the cocoon call that creates the thing,
//! so a crash leaves a VM or snapshot owned, never ownerless. Entries go when the thing is
//! removed; at start the ledger is trimmed to the VMs cocoon lists, and at each `snapshot
//! list` to the snapshots that may exist.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Who a VM or snapshot belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub namespace: String,
    /// The pod that made it ("" when unknown: adopted from an older daemon).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_uid: String,
}

impl Owner {
    pub fn new(namespace: &str, pod_uid: &str) -> Owner {
        Owner {
            namespace: namespace.to_string(),
            pod_uid: pod_uid.to_string(),
        }
    }
}

/// What a ledger entry names: a cocoon VM or a local snapshot (separate name spaces: a VM and
/// its hibernate snapshot share a name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Owned {
    Vm,
    Snapshot,
}

/// One change to the ledger; the daemon's journal holds one per line, as
/// `{"set":{"kind":"vm","name":..,"owner":{..}}}` or `{"remove":{"kind":"snapshot","name":..}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OwnerChange {
    Set {
        kind: Owned,
        name: String,
        owner: Owner,
    },
    Remove {
        kind: Owned,
        name: String,
    },
}

/// The whole ledger, as the file holds it (`{"vms":{..},"snapshots":{..}}`). Entries are JSON
/// objects so that a field can join `Owner` (with a serde default) without a format change;
/// fields this build does not know are ignored on reading.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owners {
    #[serde(default)]
    pub vms: BTreeMap<String, Owner>,
    #[serde(default)]
    pub snapshots: BTreeMap<String, Owner>,
}

impl Owners {
    fn map(&self, kind: Owned) -> &BTreeMap<String, Owner> {
        match kind {
            Owned::Vm => &self.vms,
            Owned::Snapshot => &self.snapshots,
        }
    }

    fn map_mut(&mut self, kind: Owned) -> &mut BTreeMap<String, Owner> {
        match kind {
            Owned::Vm => &mut self.vms,
            Owned::Snapshot => &mut self.snapshots,
        }
    }

    pub fn get(&self, kind: Owned, name: &str) -> Option<&Owner> {
        self.map(kind).get(name)
    }

    pub fn apply(&mut self, change: &OwnerChange) {
        match change {
            OwnerChange::Set { kind, name, owner } => {
                self.map_mut(*kind).insert(name.clone(), owner.clone());
            }
            OwnerChange::Remove { kind, name } => {
                self.map_mut(*kind).remove(name);
            }
        }
    }

    /// Whether applying `change` would change nothing.
    pub fn holds(&self, change: &OwnerChange) -> bool {
        match change {
            OwnerChange::Set { kind, name, owner } => self.get(*kind, name) == Some(owner),
            OwnerChange::Remove { kind, name } => self.get(*kind, name).is_none(),
        }
    }

    /// The change that undoes `change` on the ledger as it is now.
    pub fn undo_of(&self, change: &OwnerChange) -> OwnerChange {
        let (kind, name) = match change {
            OwnerChange::Set { kind, name, .. } | OwnerChange::Remove { kind, name } => {
                (*kind, name.clone())
            }
        };
        match self.get(kind, &name) {
            Some(owner) => OwnerChange::Set {
                kind,
                name,
                owner: owner.clone(),
            },
            None => OwnerChange::Remove { kind, name },
        }
    }

    /// Entries of `kind` whose name `keep` refuses, to remove.
    pub fn stale(&self, kind: Owned, keep: impl Fn(&str) -> bool) -> Vec<OwnerChange> {
        self.map(kind)
            .keys()
            .filter(|n| !keep(n))
            .map(|n| OwnerChange::Remove {
                kind,
                name: n.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_apply_undo_and_read_back_from_json() {
        let mut o = Owners::default();
        let set = OwnerChange::Set {
            kind: Owned::Vm,
            name: "vk-a-b".into(),
            owner: Owner::new("a", "u1"),
        };
        let undo = o.undo_of(&set);
        assert!(!o.holds(&set));
        o.apply(&set);
        assert!(o.holds(&set));
        assert_eq!(o.get(Owned::Vm, "vk-a-b"), Some(&Owner::new("a", "u1")));
        assert_eq!(o.get(Owned::Snapshot, "vk-a-b"), None, "kinds are apart");
        o.apply(&undo);
        assert_eq!(o, Owners::default());

        o.apply(&set);
        o.apply(&OwnerChange::Set {
            kind: Owned::Snapshot,
            name: "fork-vk-a-b".into(),
            owner: Owner::new("a", ""),
        });
        let text = serde_json::to_string(&o).unwrap();
        assert_eq!(
            text,
            r#"{"vms":{"vk-a-b":{"namespace":"a","pod_uid":"u1"}},"snapshots":{"fork-vk-a-b":{"namespace":"a"}}}"#
        );
        // A field of a later build is ignored, a missing map is empty.
        let later: Owners = serde_json::from_str(
            r#"{"vms":{"vk-a-b":{"namespace":"a","pod_uid":"u1","pushed":"sha256:00"}}}"#,
        )
        .unwrap();
        assert_eq!(later.get(Owned::Vm, "vk-a-b"), Some(&Owner::new("a", "u1")));
        assert!(later.snapshots.is_empty());
        assert_eq!(
            o.stale(Owned::Vm, |n| n != "vk-a-b"),
            vec![OwnerChange::Remove {
                kind: Owned::Vm,
                name: "vk-a-b".into()
            }]
        );
    }
}
