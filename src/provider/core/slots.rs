//! The per-pod slot table, which remembers every pod whose slot was handed out for change, so
//! the edge re-checks only those pods' VMs (the hypervisor watch) instead of every tracked VM.
//!
//! Reads go through `Deref` to the map; the only ways to change a slot (`get_mut`, `slot`,
//! `remove`) record its key. A change that skipped the record would need a `&mut` to the map,
//! which nothing outside this file can get.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;

use super::state::Slot;
use crate::provider::PodKey;

#[derive(Default)]
pub(super) struct Slots {
    map: BTreeMap<PodKey, Slot>,
    changed: BTreeSet<PodKey>,
}

impl Deref for Slots {
    type Target = BTreeMap<PodKey, Slot>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl Slots {
    pub(super) fn get_mut(&mut self, key: &PodKey) -> Option<&mut Slot> {
        let slot = self.map.get_mut(key)?;
        mark(&mut self.changed, key);
        Some(slot)
    }

    /// The slot of `key`, made empty when there is none.
    pub(super) fn slot(&mut self, key: &PodKey) -> &mut Slot {
        mark(&mut self.changed, key);
        self.map.entry(key.clone()).or_default()
    }

    pub(super) fn remove(&mut self, key: &PodKey) -> Option<Slot> {
        mark(&mut self.changed, key);
        self.map.remove(key)
    }

    /// The pods whose slots may have changed since the last call (removed ones included).
    pub(super) fn take_changed(&mut self) -> BTreeSet<PodKey> {
        std::mem::take(&mut self.changed)
    }
}

fn mark(changed: &mut BTreeSet<PodKey>, key: &PodKey) {
    if !changed.contains(key) {
        changed.insert(key.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> PodKey {
        PodKey::new("default", name)
    }

    #[test]
    fn every_way_to_change_a_slot_records_its_pod_and_reads_do_not() {
        let mut slots = Slots::default();
        slots.slot(&key("a"));
        slots.slot(&key("b"));
        assert_eq!(slots.take_changed(), BTreeSet::from([key("a"), key("b")]));

        assert!(slots.get(&key("a")).is_some());
        assert!(slots.values().count() == 2 && slots.contains_key(&key("b")));
        assert!(slots.take_changed().is_empty(), "reads record nothing");

        slots.get_mut(&key("a")).expect("present").failures += 1;
        assert!(slots.get_mut(&key("missing")).is_none());
        assert_eq!(slots.take_changed(), BTreeSet::from([key("a")]));

        slots.remove(&key("b"));
        assert_eq!(slots.take_changed(), BTreeSet::from([key("b")]));
        assert_eq!(slots.len(), 1);
    }
}
