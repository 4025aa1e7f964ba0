//! In-memory object store: objects by resource/namespace/name, one global resourceVersion,
//! and a bounded change history that watches read. Owns all API state; knows no HTTP.

use super::meta::{self, ApiError};
use super::resources::{self, ResourceDef};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

/// One write, as a watch sees it. `prev` is the state before (None for an add).
#[derive(Clone, Debug)]
pub struct Change {
    pub rv: u64,
    pub change: ChangeType,
    pub resource: &'static ResourceDef,
    pub object: Arc<Value>,
    pub prev: Option<Arc<Value>>,
}

/// What a mutation closure decided to do with the current object.
pub enum Mutation {
    /// Store this as the new state (no write happens when it equals the current state).
    Replace(Value),
    /// Remove the object; the value is its final state, as DELETED events carry it.
    Remove(Value),
}

/// What a waiting watch got.
pub enum WaitOutcome {
    /// Changes for the resource after the cursor; `cursor` is the version seen up to.
    Changes { changes: Vec<Change>, cursor: u64 },
    /// Nothing for this resource before the deadline; the watch is current up to `cursor`.
    Idle { cursor: u64 },
    /// The cursor is older than the retained history.
    TooOld { oldest: u64 },
    /// Watches were dropped (fault knob or stop).
    Dropped,
}

type ObjectKey = (String, String);

struct Inner {
    rv: u64,
    objects: HashMap<String, BTreeMap<ObjectKey, Arc<Value>>>,
    history: VecDeque<Change>,
    /// Versions at or below this are gone from history: watching from older ones gets 410.
    compacted_rv: u64,
    history_limit: usize,
    watch_epoch: u64,
}

pub struct Store {
    inner: Mutex<Inner>,
    changed: Condvar,
}

pub fn obj_name(obj: &Value) -> &str {
    obj.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
}
pub fn obj_namespace(obj: &Value) -> &str {
    obj.pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("")
}
pub fn obj_uid(obj: &Value) -> &str {
    obj.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or("")
}
pub fn obj_rv(obj: &Value) -> &str {
    obj.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Mutable access to `metadata`, creating it if absent. The caller guarantees `obj` is an object.
pub fn metadata_mut(obj: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        _ => unreachable!("metadata was just made an object"),
    }
}

fn set_rv(obj: &mut Value, rv: u64) {
    metadata_mut(obj).insert("resourceVersion".into(), json!(rv.to_string()));
}

impl Store {
    pub fn new(history_limit: usize) -> Self {
        Store {
            inner: Mutex::new(Inner {
                rv: 1,
                objects: HashMap::new(),
                history: VecDeque::new(),
                compacted_rv: 0,
                history_limit,
                watch_epoch: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    /// The oldest version a watch may still start from.
    pub fn compacted_rv(&self) -> u64 {
        self.lock().compacted_rv
    }

    pub fn set_history_limit(&self, limit: usize) {
        let mut g = self.lock();
        g.history_limit = limit;
        g.trim();
    }

    /// Forget all history: a watch from any version before now gets 410 Gone.
    pub fn compact(&self) {
        let mut g = self.lock();
        g.history.clear();
        g.compacted_rv = g.rv;
        drop(g);
        self.changed.notify_all();
    }

    /// A new watch cache, as after an API server restart: the version moves on by one and all
    /// history before it is forgotten, so every watch resumed from any earlier version gets
    /// 410 Gone, while a relist answers the new version, from which watches start fine.
    pub fn new_watch_cache(&self) {
        let mut g = self.lock();
        g.rv += 1;
        g.history.clear();
        g.compacted_rv = g.rv;
        drop(g);
        self.changed.notify_all();
    }

    /// Wakes waiting watches without changing anything (they re-read their settings).
    pub fn compact_noop_wake(&self) {
        self.changed.notify_all();
    }

    pub fn watch_epoch(&self) -> u64 {
        self.lock().watch_epoch
    }

    /// Ends every open watch (they notice within their wait).
    pub fn drop_watches(&self) {
        self.lock().watch_epoch += 1;
        self.changed.notify_all();
    }

    pub fn get(&self, def: &ResourceDef, namespace: &str, name: &str) -> Option<Arc<Value>> {
        let g = self.lock();
        g.objects
            .get(&def.key())?
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Objects of a resource (in one namespace, or all) sorted by namespace/name, and the
    /// resourceVersion the snapshot is current at.
    pub fn list(&self, def: &ResourceDef, namespace: Option<&str>) -> (Vec<Arc<Value>>, u64) {
        let g = self.lock();
        let items = match g.objects.get(&def.key()) {
            None => Vec::new(),
            Some(map) => map
                .iter()
                .filter(|((ns, _), _)| namespace.is_none_or(|want| want == ns))
                .map(|(_, v)| v.clone())
                .collect(),
        };
        (items, g.rv)
    }

    /// Stores a new object. The caller has set kind/apiVersion and defaults; the store assigns
    /// name (from generateName), namespace, uid, creationTimestamp, generation, resourceVersion.
    pub fn create(
        &self,
        def: &'static ResourceDef,
        namespace: &str,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request("object must be a JSON object"));
        }
        let mut g = self.lock();
        let map_key = def.key();
        let mut name = obj_name(&obj).to_string();
        if name.is_empty() {
            let prefix = obj
                .pointer("/metadata/generateName")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    def.kind,
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            loop {
                name = format!("{prefix}{}", meta::name_suffix());
                let taken = g
                    .objects
                    .get(&map_key)
                    .is_some_and(|m| m.contains_key(&(namespace.to_string(), name.clone())));
                if !taken {
                    break;
                }
            }
        }
        let key = (namespace.to_string(), name.clone());
        if g.objects
            .get(&map_key)
            .is_some_and(|m| m.contains_key(&key))
        {
            return Err(ApiError::already_exists(def.group, def.plural, &name));
        }
        if def.namespaced {
            g.ensure_namespace(namespace);
        }
        let md = metadata_mut(&mut obj);
        md.insert("name".into(), json!(name));
        if def.namespaced {
            md.insert("namespace".into(), json!(namespace));
        } else {
            md.remove("namespace");
        }
        md.insert("uid".into(), json!(meta::new_uid()));
        md.insert("creationTimestamp".into(), json!(meta::now_rfc3339()));
        md.insert("generation".into(), json!(1));
        md.remove("deletionTimestamp");
        md.remove("deletionGracePeriodSeconds");
        md.remove("managedFields");
        let obj = g.write(def, key, None, Some(obj));
        drop(g);
        self.changed.notify_all();
        Ok(obj.map(|o| (*o).clone()).unwrap_or(Value::Null))
    }

    /// Reads the current object and applies `f` atomically. NotFound when absent. Returns the
    /// object as now stored, or its final state when removed.
    pub fn mutate(
        &self,
        def: &'static ResourceDef,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&Value) -> Result<Mutation, ApiError>,
    ) -> Result<Value, ApiError> {
        let mut g = self.lock();
        let key = (namespace.to_string(), name.to_string());
        let current = g
            .objects
            .get(&def.key())
            .and_then(|m| m.get(&key))
            .cloned()
            .ok_or_else(|| ApiError::not_found(def.group, def.plural, name))?;
        let outcome = match f(&current)? {
            Mutation::Replace(mut new) => {
                set_rv(&mut new, obj_rv(&current).parse().unwrap_or(0));
                if new == *current {
                    return Ok((*current).clone());
                }
                let stored = g.write(def, key, Some(current), Some(new));
                stored.map(|o| (*o).clone()).unwrap_or(Value::Null)
            }
            Mutation::Remove(last) => g.remove(def, key, current, last),
        };
        drop(g);
        self.changed.notify_all();
        Ok(outcome)
    }

    /// Waits until there are changes to `def` after `cursor`, the deadline passes, or watches
    /// are dropped (the epoch moved past `epoch`).
    pub fn wait_changes(
        &self,
        def: &'static ResourceDef,
        cursor: u64,
        epoch: u64,
        until: Instant,
    ) -> WaitOutcome {
        let mut g = self.lock();
        loop {
            if g.watch_epoch != epoch {
                return WaitOutcome::Dropped;
            }
            if cursor < g.compacted_rv {
                return WaitOutcome::TooOld {
                    oldest: g.compacted_rv + 1,
                };
            }
            let start = g.history.partition_point(|c| c.rv <= cursor);
            let changes: Vec<Change> = g
                .history
                .iter()
                .skip(start)
                .filter(|c| std::ptr::eq(c.resource, def))
                .cloned()
                .collect();
            if !changes.is_empty() {
                return WaitOutcome::Changes {
                    changes,
                    cursor: g.rv,
                };
            }
            let now = Instant::now();
            if now >= until {
                return WaitOutcome::Idle { cursor: g.rv };
            }
            g = match self.changed.wait_timeout(g, until - now) {
                Ok((g, _)) => g,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

impl Inner {
    fn trim(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.compacted_rv = old.rv;
            }
        }
        if self.history_limit == 0 {
            self.compacted_rv = self.rv;
        }
    }

    /// Writes `new` (an add when `prev` is None) with the next resourceVersion and records it.
    fn write(
        &mut self,
        def: &'static ResourceDef,
        key: ObjectKey,
        prev: Option<Arc<Value>>,
        new: Option<Value>,
    ) -> Option<Arc<Value>> {
        let mut new = new?;
        self.rv += 1;
        set_rv(&mut new, self.rv);
        let new = Arc::new(new);
        self.objects
            .entry(def.key())
            .or_default()
            .insert(key, new.clone());
        let change = if prev.is_some() {
            ChangeType::Modified
        } else {
            ChangeType::Added
        };
        self.record(def, change, new.clone(), prev);
        Some(new)
    }

    fn remove(
        &mut self,
        def: &'static ResourceDef,
        key: ObjectKey,
        current: Arc<Value>,
        mut last: Value,
    ) -> Value {
        self.rv += 1;
        set_rv(&mut last, self.rv);
        if let Some(m) = self.objects.get_mut(&def.key()) {
            m.remove(&key);
        }
        let last = Arc::new(last);
        self.record(def, ChangeType::Deleted, last.clone(), Some(current));
        (*last).clone()
    }

    fn record(
        &mut self,
        def: &'static ResourceDef,
        change: ChangeType,
        object: Arc<Value>,
        prev: Option<Arc<Value>>,
    ) {
        self.history.push_back(Change {
            rv: self.rv,
            change,
            resource: def,
            object,
            prev,
        });
        self.trim();
    }

    /// Namespaces are implicit: the first object in one creates its Namespace object.
    fn ensure_namespace(&mut self, namespace: &str) {
        let def = resources::namespaces();
        let key = (String::new(), namespace.to_string());
        if self
            .objects
            .get(&def.key())
            .is_some_and(|m| m.contains_key(&key))
        {
            return;
        }
        let ns = json!({
            "kind": "Namespace",
            "apiVersion": "v1",
            "metadata": {
                "name": namespace,
                "uid": meta::new_uid(),
                "creationTimestamp": meta::now_rfc3339(),
                "labels": {"kubernetes.io/metadata.name": namespace},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        });
        self.write(def, key, None, Some(ns));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pod(name: &str) -> Value {
        json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"name": name}, "spec": {}})
    }

    #[test]
    fn versions_increase_and_history_is_bounded() {
        let store = Store::new(3);
        let pods = resources::pods();
        let a = store.create(pods, "default", pod("a")).unwrap();
        let rv_a: u64 = obj_rv(&a).parse().unwrap();
        let b = store.create(pods, "default", pod("b")).unwrap();
        assert!(obj_rv(&b).parse::<u64>().unwrap() > rv_a);
        assert!(store.create(pods, "default", pod("a")).is_err());
        for i in 0..5 {
            store
                .mutate(pods, "default", "a", |cur| {
                    let mut n = cur.clone();
                    n["spec"]["i"] = json!(i);
                    Ok(Mutation::Replace(n))
                })
                .unwrap();
        }
        let deadline = Instant::now();
        let epoch = store.watch_epoch();
        assert!(matches!(
            store.wait_changes(pods, rv_a, epoch, deadline),
            WaitOutcome::TooOld { .. }
        ));
        let now = store.current_rv();
        match store.wait_changes(pods, now - 1, epoch, deadline) {
            WaitOutcome::Changes { changes, cursor } => {
                assert_eq!(changes.len(), 1);
                assert_eq!(cursor, now);
            }
            _ => panic!("expected one change"),
        }
    }

    #[test]
    fn identical_replace_is_not_a_write() {
        let store = Store::new(100);
        let pods = resources::pods();
        store.create(pods, "ns1", pod("a")).unwrap();
        let before = store.current_rv();
        store
            .mutate(pods, "ns1", "a", |cur| Ok(Mutation::Replace(cur.clone())))
            .unwrap();
        assert_eq!(store.current_rv(), before);
        // The implicit namespace exists.
        assert!(store.get(resources::namespaces(), "", "ns1").is_some());
    }

    #[test]
    fn drop_wakes_waiters() {
        let store = Arc::new(Store::new(100));
        let epoch = store.watch_epoch();
        let s2 = store.clone();
        let t = std::thread::spawn(move || {
            matches!(
                s2.wait_changes(
                    resources::pods(),
                    s2.current_rv(),
                    epoch,
                    Instant::now() + Duration::from_secs(30)
                ),
                WaitOutcome::Dropped
            )
        });
        // Whether the drop lands before or during the wait, the waiter must see it.
        store.drop_watches();
        assert!(t.join().unwrap());
    }
}
