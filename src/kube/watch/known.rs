//! The known-pod set of the watch: incarnations by UID, and the diff a relist makes, so each pod
//! key comes out as Added, Modified*, Deleted in order.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// What the watch hands to the daemon. Per pod key the sequence is consistent: Added, then
/// Modified*, then Deleted; a new UID under the same name is Deleted(old) + Added(new).
#[derive(Clone, Debug, PartialEq)]
pub enum WatchOutput {
    Added(Box<Pod>),
    Modified(Box<Pod>),
    Deleted(Box<Pod>),
}

fn key_of(p: &Pod) -> String {
    format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or(""),
        p.metadata.name.as_deref().unwrap_or("")
    )
}

fn uid_of(p: &Pod) -> &str {
    p.metadata.uid.as_deref().unwrap_or("")
}

pub(super) fn rv_of(p: &Pod) -> &str {
    p.metadata.resource_version.as_deref().unwrap_or("")
}

/// The set of pods the daemon has been told about, keyed `namespace/name`. Only each pod's
/// identity is kept (namespace, name, uid, resourceVersion): the provider holds the full
/// objects, and a second full copy per pod was a large share of a dense node's memory. A
/// Deleted output synthesised from this set (relist, uid change) carries that identity only.
#[derive(Default, Debug)]
pub struct KnownPods {
    pods: HashMap<String, Identity>,
}

/// What `KnownPods` keeps of a pod: a few strings, not a 2 KiB `Pod` struct with its heap.
#[derive(Debug)]
struct Identity {
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
}

impl Identity {
    fn of(p: &Pod) -> Identity {
        Identity {
            namespace: p.metadata.namespace.clone(),
            name: p.metadata.name.clone(),
            uid: p.metadata.uid.clone(),
            resource_version: p.metadata.resource_version.clone(),
        }
    }

    fn uid(&self) -> &str {
        self.uid.as_deref().unwrap_or("")
    }

    /// The pod a synthesised Deleted carries.
    fn into_pod(self) -> Box<Pod> {
        Box::new(Pod {
            metadata: ObjectMeta {
                namespace: self.namespace,
                name: self.name,
                uid: self.uid,
                resource_version: self.resource_version,
                ..Default::default()
            },
            ..Default::default()
        })
    }
}

impl KnownPods {
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Apply an ADDED or MODIFIED object.
    pub fn upsert(&mut self, pod: Box<Pod>, out: &mut Vec<WatchOutput>) {
        let key = key_of(&pod);
        match self.pods.get(&key) {
            None => {
                self.pods.insert(key, Identity::of(&pod));
                out.push(WatchOutput::Added(pod));
            }
            Some(old) if old.uid() != uid_of(&pod) => {
                let old = self.pods.insert(key, Identity::of(&pod));
                if let Some(old) = old {
                    out.push(WatchOutput::Deleted(old.into_pod()));
                }
                out.push(WatchOutput::Added(pod));
            }
            Some(old)
                if !rv_of(&pod).is_empty()
                    && old.resource_version.as_deref() == Some(rv_of(&pod)) => {}
            Some(_) => {
                self.pods.insert(key, Identity::of(&pod));
                out.push(WatchOutput::Modified(pod));
            }
        }
    }

    /// Apply a DELETED object (carrying the pod's last state).
    pub fn remove(&mut self, pod: Box<Pod>, out: &mut Vec<WatchOutput>) {
        let key = key_of(&pod);
        match self.pods.remove(&key) {
            Some(old) if old.uid() == uid_of(&pod) => out.push(WatchOutput::Deleted(pod)),
            // We held an older incarnation: it is gone too; the deleted one was never delivered.
            Some(old) => out.push(WatchOutput::Deleted(old.into_pod())),
            None => {}
        }
    }

    /// Replace the set with a fresh list and report the difference, so pods that vanished
    /// while the watch was down come out as Deleted.
    pub fn replace(&mut self, list: Vec<Pod>, out: &mut Vec<WatchOutput>) {
        let mut fresh: HashMap<String, Pod> = HashMap::with_capacity(list.len());
        for p in list {
            fresh.insert(key_of(&p), p);
        }
        let mut gone: Vec<String> = self
            .pods
            .keys()
            .filter(|k| !fresh.contains_key(*k))
            .cloned()
            .collect();
        gone.sort();
        for k in gone {
            if let Some(old) = self.pods.remove(&k) {
                out.push(WatchOutput::Deleted(old.into_pod()));
            }
        }
        let mut keys: Vec<String> = fresh.keys().cloned().collect();
        keys.sort();
        for k in keys {
            if let Some(p) = fresh.remove(&k) {
                self.upsert(Box::new(p), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::watch::event::tests::pod_json;

    fn pod(name: &str, uid: &str, rv: &str) -> Box<Pod> {
        Box::new(serde_json::from_str(&pod_json(name, uid, rv)).unwrap())
    }

    fn outs(o: &[WatchOutput]) -> Vec<String> {
        o.iter()
            .map(|w| match w {
                WatchOutput::Added(p) => format!("A {} {}", key_of(p), uid_of(p)),
                WatchOutput::Modified(p) => format!("M {} {}", key_of(p), uid_of(p)),
                WatchOutput::Deleted(p) => format!("D {} {}", key_of(p), uid_of(p)),
            })
            .collect()
    }

    #[test]
    fn incarnations_and_relist_diff() {
        let mut k = KnownPods::default();
        let mut o = Vec::new();
        k.upsert(pod("a", "u1", "1"), &mut o);
        k.upsert(pod("a", "u1", "1"), &mut o); // duplicate: nothing
        k.upsert(pod("a", "u1", "2"), &mut o);
        k.upsert(pod("a", "u2", "3"), &mut o); // new incarnation
        k.upsert(pod("b", "u3", "4"), &mut o);
        k.remove(pod("c", "u4", "5"), &mut o); // never known: nothing
        assert_eq!(
            outs(&o),
            vec![
                "A ns/a u1",
                "M ns/a u1",
                "D ns/a u1",
                "A ns/a u2",
                "A ns/b u3"
            ]
        );
        o.clear();
        // Relist: b vanished while down, a recreated, c new.
        k.replace(vec![*pod("a", "u5", "9"), *pod("c", "u6", "9")], &mut o);
        assert_eq!(
            outs(&o),
            vec!["D ns/b u3", "D ns/a u2", "A ns/a u5", "A ns/c u6"]
        );
        assert_eq!(k.len(), 2);
        o.clear();
        // Deleted for a newer incarnation than we hold: the held one is reported gone.
        k.remove(pod("a", "u7", "10"), &mut o);
        assert_eq!(outs(&o), vec!["D ns/a u5"]);
    }
}
