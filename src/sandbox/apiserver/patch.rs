//! PATCH bodies: JSON merge patch (RFC 7386), strategic merge patch for the built-in types
//! the fake serves, and JSON patch (RFC 6902). Pure functions over serde_json values.

use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    StrategicMerge,
    Json,
}

impl PatchType {
    /// From a Content-Type header; None for unsupported types (including apply-patch).
    pub fn from_content_type(ct: &str) -> Option<PatchType> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/strategic-merge-patch+json" => Some(PatchType::StrategicMerge),
            "application/json-patch+json" => Some(PatchType::Json),
            _ => None,
        }
    }
}

/// Applies a patch of the given type to `target` in place.
pub fn apply(kind: PatchType, target: &mut Value, patch: &Value) -> Result<(), String> {
    match kind {
        PatchType::Merge => {
            if !patch.is_object() {
                return Err("merge patch must be a JSON object".into());
            }
            merge_patch(target, patch);
            Ok(())
        }
        PatchType::StrategicMerge => strategic_merge_patch(target, patch),
        PatchType::Json => json_patch(target, patch),
    }
}

/// RFC 7386: objects merge recursively, null deletes, everything else (lists too) replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// How a list field merges under strategic merge patch.
enum ListStrategy {
    /// Items are objects merged by this key.
    MergeKey(&'static str),
    /// A list of scalars merged as a set (e.g. finalizers).
    PrimitiveMerge,
    /// Replaced wholly (no patch strategy, e.g. containerStatuses).
    Replace,
}

/// Patch strategies of the built-in types, by field name (the names do not collide for the
/// pod, node, lease, event and namespace schemas the fake serves).
fn list_strategy(field: &str) -> ListStrategy {
    match field {
        "conditions" | "addresses" => ListStrategy::MergeKey("type"),
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "resourceClaims"
        | "schedulingGates" => ListStrategy::MergeKey("name"),
        "volumeMounts" => ListStrategy::MergeKey("mountPath"),
        "volumeDevices" => ListStrategy::MergeKey("devicePath"),
        "ports" => ListStrategy::MergeKey("containerPort"),
        "ownerReferences" => ListStrategy::MergeKey("uid"),
        "podIPs" | "hostIPs" | "hostAliases" => ListStrategy::MergeKey("ip"),
        "finalizers" => ListStrategy::PrimitiveMerge,
        _ => ListStrategy::Replace,
    }
}

/// Strategic merge patch as the API server applies it to built-in types: maps merge, `null`
/// deletes, lists merge by their patch key or replace, with the `$patch`,
/// `$deleteFromPrimitiveList/`, `$setElementOrder/` and `$retainKeys` directives.
pub fn strategic_merge_patch(target: &mut Value, patch: &Value) -> Result<(), String> {
    let Value::Object(p) = patch else {
        return Err("strategic merge patch must be a JSON object".into());
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(t) = target {
        merge_map(t, p)?;
    }
    Ok(())
}

fn merge_map(target: &mut Map<String, Value>, patch: &Map<String, Value>) -> Result<(), String> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            *target = strip_directives(patch);
            return Ok(());
        }
        Some("delete") => {
            target.clear();
            return Ok(());
        }
        Some(other) => return Err(format!("unknown $patch directive {other:?}")),
        None => {}
    }
    if let Some(Value::Array(keep)) = patch.get("$retainKeys") {
        let keep: Vec<&str> = keep.iter().filter_map(Value::as_str).collect();
        target.retain(|k, _| keep.contains(&k.as_str()) || patch.contains_key(k));
    }
    for (k, v) in patch {
        if k.starts_with("$setElementOrder/") || k == "$retainKeys" || k == "$patch" {
            continue;
        }
        if let Some(list) = k.strip_prefix("$deleteFromPrimitiveList/") {
            let Value::Array(remove) = v else {
                return Err(format!("{k} must be a list"));
            };
            if let Some(Value::Array(items)) = target.get_mut(list) {
                items.retain(|i| !remove.contains(i));
            }
            continue;
        }
        match v {
            Value::Null => {
                target.remove(k);
            }
            Value::Object(pm) => {
                if pm.get("$patch").and_then(Value::as_str) == Some("delete") {
                    target.remove(k);
                } else if let Some(Value::Object(tm)) = target.get_mut(k) {
                    merge_map(tm, pm)?;
                } else {
                    let mut fresh = Map::new();
                    merge_map(&mut fresh, pm)?;
                    target.insert(k.clone(), Value::Object(fresh));
                }
            }
            Value::Array(items) => {
                let merged = merge_list(k, target.remove(k), items)?;
                target.insert(k.clone(), merged);
            }
            scalar => {
                target.insert(k.clone(), scalar.clone());
            }
        }
    }
    Ok(())
}

fn merge_list(field: &str, current: Option<Value>, patch: &[Value]) -> Result<Value, String> {
    let replace = patch
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"));
    let mut current = match current {
        Some(Value::Array(items)) if !replace => items,
        _ => Vec::new(),
    };
    match list_strategy(field) {
        ListStrategy::Replace => Ok(Value::Array(patch.iter().map(strip_value).collect())),
        ListStrategy::PrimitiveMerge => {
            for item in patch {
                if !current.contains(item) {
                    current.push(item.clone());
                }
            }
            Ok(Value::Array(current))
        }
        ListStrategy::MergeKey(key) => {
            for item in patch {
                let Value::Object(pm) = item else {
                    return Err(format!("items of {field} must be objects"));
                };
                if pm.get("$patch").and_then(Value::as_str) == Some("replace") {
                    continue;
                }
                let Some(id) = pm.get(key) else {
                    return Err(format!("an item of {field} lacks its merge key {key:?}"));
                };
                let pos = current.iter().position(|c| c.get(key) == Some(id));
                if pm.get("$patch").and_then(Value::as_str) == Some("delete") {
                    if let Some(pos) = pos {
                        current.remove(pos);
                    }
                    continue;
                }
                match pos {
                    Some(pos) => {
                        if let Value::Object(cm) = &mut current[pos] {
                            merge_map(cm, pm)?;
                        }
                    }
                    None => {
                        let mut fresh = Map::new();
                        merge_map(&mut fresh, pm)?;
                        current.push(Value::Object(fresh));
                    }
                }
            }
            Ok(Value::Array(current))
        }
    }
}

/// A patch fragment stored as-is: drop directives and null-valued keys.
fn strip_directives(m: &Map<String, Value>) -> Map<String, Value> {
    m.iter()
        .filter(|(k, v)| !k.starts_with('$') && !v.is_null())
        .map(|(k, v)| (k.clone(), strip_value(v)))
        .collect()
}

fn strip_value(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(strip_directives(m)),
        Value::Array(a) => Value::Array(a.iter().map(strip_value).collect()),
        other => other.clone(),
    }
}

/// RFC 6902 JSON patch: add, remove, replace, move, copy, test. All-or-nothing.
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), String> {
    let Value::Array(ops) = ops else {
        return Err("json patch must be a list of operations".into());
    };
    let mut work = target.clone();
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).ok_or("op missing")?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or("path missing")?;
        match name {
            "add" => add(
                &mut work,
                path,
                op.get("value").cloned().ok_or("value missing")?,
            )?,
            "remove" => {
                remove(&mut work, path)?;
            }
            "replace" => {
                remove(&mut work, path)?;
                add(
                    &mut work,
                    path,
                    op.get("value").cloned().ok_or("value missing")?,
                )?;
            }
            "move" => {
                let from = op
                    .get("from")
                    .and_then(Value::as_str)
                    .ok_or("from missing")?;
                let v = remove(&mut work, from)?;
                add(&mut work, path, v)?;
            }
            "copy" => {
                let from = op
                    .get("from")
                    .and_then(Value::as_str)
                    .ok_or("from missing")?;
                let v = work
                    .pointer(from)
                    .cloned()
                    .ok_or(format!("{from} not found"))?;
                add(&mut work, path, v)?;
            }
            "test" => {
                let want = op.get("value").ok_or("value missing")?;
                if work.pointer(path) != Some(want) {
                    return Err(format!("test failed at {path}"));
                }
            }
            other => return Err(format!("unknown op {other:?}")),
        }
    }
    *target = work;
    Ok(())
}

fn split_pointer(path: &str) -> Result<(String, String), String> {
    let idx = path.rfind('/').ok_or(format!("bad path {path:?}"))?;
    let last = path[idx + 1..].replace("~1", "/").replace("~0", "~");
    Ok((path[..idx].to_string(), last))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    match doc.pointer_mut(&parent) {
        Some(Value::Object(m)) => {
            m.insert(last, value);
            Ok(())
        }
        Some(Value::Array(a)) => {
            if last == "-" {
                a.push(value);
                return Ok(());
            }
            let i: usize = last.parse().map_err(|_| format!("bad index in {path}"))?;
            if i > a.len() {
                return Err(format!("index out of range in {path}"));
            }
            a.insert(i, value);
            Ok(())
        }
        _ => Err(format!("parent of {path} not found")),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, last) = split_pointer(path)?;
    match doc.pointer_mut(&parent) {
        Some(Value::Object(m)) => m.remove(&last).ok_or(format!("{path} not found")),
        Some(Value::Array(a)) => {
            let i: usize = last.parse().map_err(|_| format!("bad index in {path}"))?;
            if i >= a.len() {
                return Err(format!("{path} not found"));
            }
            Ok(a.remove(i))
        }
        _ => Err(format!("{path} not found")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_replaces_lists_and_deletes_nulls() {
        let mut t = json!({"metadata": {"annotations": {"a": "1", "b": "2"}},
                           "status": {"conditions": [{"type": "Ready"}, {"type": "X"}]}});
        merge_patch(
            &mut t,
            &json!({"metadata": {"annotations": {"a": null, "c": "3"}},
                    "status": {"conditions": [{"type": "Y"}]}}),
        );
        assert_eq!(t["metadata"]["annotations"], json!({"b": "2", "c": "3"}));
        assert_eq!(t["status"]["conditions"], json!([{"type": "Y"}]));
    }

    #[test]
    fn strategic_merges_conditions_by_type_and_replaces_container_statuses() {
        let mut t = json!({"status": {
            "conditions": [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "a", "ready": false}, {"name": "b"}]}});
        strategic_merge_patch(
            &mut t,
            &json!({"status": {
                "$setElementOrder/conditions": [{"type": "Ready"}, {"type": "PodScheduled"}],
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}],
                "containerStatuses": [{"name": "a", "ready": true}]}}),
        )
        .unwrap();
        assert_eq!(
            t["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"},
                   {"type": "Initialized", "status": "True"}])
        );
        assert_eq!(
            t["status"]["containerStatuses"],
            json!([{"name": "a", "ready": true}])
        );
    }

    #[test]
    fn strategic_directives() {
        let mut t = json!({"metadata": {"finalizers": ["a", "b"], "labels": {"x": "1"}},
                           "status": {"addresses": [{"type": "InternalIP", "address": "1"}, {"type": "Hostname", "address": "h"}]}});
        strategic_merge_patch(
            &mut t,
            &json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"], "finalizers": ["c"],
                                 "labels": {"$patch": "replace", "y": "2"}},
                    "status": {"addresses": [{"type": "Hostname", "$patch": "delete"}]}}),
        )
        .unwrap();
        assert_eq!(t["metadata"]["finalizers"], json!(["b", "c"]));
        assert_eq!(t["metadata"]["labels"], json!({"y": "2"}));
        assert_eq!(
            t["status"]["addresses"],
            json!([{"type": "InternalIP", "address": "1"}])
        );
        assert!(strategic_merge_patch(
            &mut t,
            &json!({"status": {"conditions": [{"status": "x"}]}})
        )
        .is_err());
    }

    #[test]
    fn json_patch_is_atomic() {
        let mut t = json!({"a": {"b": [1, 2]}});
        json_patch(
            &mut t,
            &json!([{"op": "add", "path": "/a/b/-", "value": 3},
                                   {"op": "replace", "path": "/a/c", "value": 1}]),
        )
        .unwrap_err();
        assert_eq!(t, json!({"a": {"b": [1, 2]}}));
        json_patch(
            &mut t,
            &json!([{"op": "test", "path": "/a/b/0", "value": 1},
                                   {"op": "add", "path": "/a/b/-", "value": 3},
                                   {"op": "remove", "path": "/a/b/0"}]),
        )
        .unwrap();
        assert_eq!(t, json!({"a": {"b": [2, 3]}}));
    }
}
