//! meta.k8s.io/v1 Table rendering of lists for kubectl's server-side printing
//! (`kubectl get`, `-o wide`). Pure formatting of stored objects; no state.

use super::meta::{human_age, parse_rfc3339};
use super::resources::ResourceDef;
use serde_json::{json, Value};
use std::sync::Arc;

/// Whether an Accept header asks for a Table (kubectl sends `as=Table;v=v1;g=meta.k8s.io`).
pub fn wants_table(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            let p: Vec<&str> = part.split(';').map(str::trim).collect();
            p.contains(&"as=Table") && p.contains(&"g=meta.k8s.io") && p.contains(&"v=v1")
        })
    })
}

fn col(name: &str, ty: &str, format: &str, priority: u32, description: &str) -> Value {
    json!({"name": name, "type": ty, "format": format, "description": description, "priority": priority})
}

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn age(v: &Value, pointer: &str) -> String {
    human_age(
        v.pointer(pointer)
            .and_then(Value::as_str)
            .and_then(parse_rfc3339),
    )
}

fn or_none(x: &str) -> String {
    if x.is_empty() {
        "<none>".to_string()
    } else {
        x.to_string()
    }
}

fn pod_columns() -> Vec<Value> {
    vec![
        col("Name", "string", "name", 0, "Name of the pod"),
        col("Ready", "string", "", 0, "Ready containers"),
        col("Status", "string", "", 0, "Pod status reason"),
        col("Restarts", "string", "", 0, "Container restarts"),
        col("Age", "string", "", 0, "Time since creation"),
        col("IP", "string", "", 1, "Pod IP"),
        col("Node", "string", "", 1, "Node the pod is bound to"),
        col("Nominated Node", "string", "", 1, "Nominated node"),
        col("Readiness Gates", "string", "", 1, "Readiness gates"),
    ]
}

fn pod_cells(p: &Value) -> Vec<Value> {
    let total = p
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let statuses = p
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let ready = statuses
        .iter()
        .filter(|c| c.get("ready") == Some(&json!(true)))
        .count();
    let restarts: i64 = statuses
        .iter()
        .filter_map(|c| c.get("restartCount").and_then(Value::as_i64))
        .sum();
    let mut status = s(p, "/status/reason").to_string();
    if status.is_empty() {
        status = s(p, "/status/phase").to_string();
    }
    for c in &statuses {
        let waiting = s(c, "/state/waiting/reason");
        let terminated = s(c, "/state/terminated/reason");
        if !waiting.is_empty() {
            status = waiting.to_string();
        } else if !terminated.is_empty() {
            status = terminated.to_string();
        }
    }
    if p.pointer("/metadata/deletionTimestamp").is_some() {
        status = "Terminating".to_string();
    }
    vec![
        json!(s(p, "/metadata/name")),
        json!(format!("{ready}/{total}")),
        json!(status),
        json!(restarts.to_string()),
        json!(age(p, "/metadata/creationTimestamp")),
        json!(or_none(s(p, "/status/podIP"))),
        json!(or_none(s(p, "/spec/nodeName"))),
        json!(or_none(s(p, "/status/nominatedNodeName"))),
        json!("<none>"),
    ]
}

fn node_columns() -> Vec<Value> {
    vec![
        col("Name", "string", "name", 0, "Name of the node"),
        col("Status", "string", "", 0, "Ready condition"),
        col("Roles", "string", "", 0, "Node roles"),
        col("Age", "string", "", 0, "Time since creation"),
        col("Version", "string", "", 0, "Kubelet version"),
        col("Internal-IP", "string", "", 1, "Internal IP"),
        col("External-IP", "string", "", 1, "External IP"),
        col("OS-Image", "string", "", 1, "OS image"),
        col("Kernel-Version", "string", "", 1, "Kernel version"),
        col("Container-Runtime", "string", "", 1, "Container runtime"),
    ]
}

fn node_cells(n: &Value) -> Vec<Value> {
    let conditions = n
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let ready = conditions
        .iter()
        .find(|c| s(c, "/type") == "Ready")
        .map(|c| s(c, "/status").to_string());
    let mut status = match ready.as_deref() {
        Some("True") => "Ready".to_string(),
        Some(_) => "NotReady".to_string(),
        None => "Unknown".to_string(),
    };
    if n.pointer("/spec/unschedulable") == Some(&json!(true)) {
        status.push_str(",SchedulingDisabled");
    }
    let roles: Vec<String> = n
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|labels| {
            let mut roles: Vec<String> = labels
                .iter()
                .filter_map(|(k, v)| {
                    k.strip_prefix("node-role.kubernetes.io/")
                        .map(str::to_string)
                        .or_else(|| {
                            (k == "kubernetes.io/role")
                                .then(|| v.as_str().unwrap_or("").to_string())
                        })
                })
                .filter(|r| !r.is_empty())
                .collect();
            roles.sort();
            roles.dedup();
            roles
        })
        .unwrap_or_default();
    let address = |ty: &str| {
        n.pointer("/status/addresses")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().find(|x| s(x, "/type") == ty))
            .map(|x| s(x, "/address").to_string())
            .unwrap_or_default()
    };
    vec![
        json!(s(n, "/metadata/name")),
        json!(status),
        json!(if roles.is_empty() {
            "<none>".to_string()
        } else {
            roles.join(",")
        }),
        json!(age(n, "/metadata/creationTimestamp")),
        json!(s(n, "/status/nodeInfo/kubeletVersion")),
        json!(or_none(&address("InternalIP"))),
        json!(or_none(&address("ExternalIP"))),
        json!(or_none(s(n, "/status/nodeInfo/osImage"))),
        json!(or_none(s(n, "/status/nodeInfo/kernelVersion"))),
        json!(or_none(s(n, "/status/nodeInfo/containerRuntimeVersion"))),
    ]
}

fn event_columns() -> Vec<Value> {
    vec![
        col("Last Seen", "string", "", 0, "Time since last occurrence"),
        col("Type", "string", "", 0, "Normal or Warning"),
        col("Reason", "string", "", 0, "Reason"),
        col("Object", "string", "", 0, "Involved object"),
        col("Message", "string", "", 0, "Message"),
        col("Name", "string", "name", 1, "Event name"),
        col("Source", "string", "", 1, "Reporting component"),
        col("Count", "string", "", 1, "Occurrences"),
    ]
}

fn event_cells(e: &Value) -> Vec<Value> {
    let mut last = s(e, "/lastTimestamp");
    if last.is_empty() {
        last = s(e, "/eventTime");
    }
    if last.is_empty() {
        last = s(e, "/metadata/creationTimestamp");
    }
    let object = format!(
        "{}/{}",
        s(e, "/involvedObject/kind").to_lowercase(),
        s(e, "/involvedObject/name")
    );
    let source = [s(e, "/source/component"), s(e, "/source/host")]
        .iter()
        .filter(|x| !x.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    vec![
        json!(human_age(parse_rfc3339(last))),
        json!(s(e, "/type")),
        json!(s(e, "/reason")),
        json!(object),
        json!(s(e, "/message")),
        json!(s(e, "/metadata/name")),
        json!(source),
        json!(e
            .get("count")
            .and_then(Value::as_i64)
            .unwrap_or(1)
            .to_string()),
    ]
}

fn lease_columns() -> Vec<Value> {
    vec![
        col("Name", "string", "name", 0, "Name"),
        col("Holder", "string", "", 0, "Holder identity"),
        col("Age", "string", "", 0, "Time since creation"),
    ]
}

fn namespace_columns() -> Vec<Value> {
    vec![
        col("Name", "string", "name", 0, "Name"),
        col("Status", "string", "", 0, "Phase"),
        col("Age", "string", "", 0, "Time since creation"),
    ]
}

/// A Table for these objects; rows carry PartialObjectMetadata (or the object itself when
/// `include_object` is "Object", "None" omits it), as the API server does.
pub fn table(def: &ResourceDef, items: &[Arc<Value>], rv: u64, include_object: &str) -> Value {
    let columns = match def.plural {
        "pods" => pod_columns(),
        "nodes" => node_columns(),
        "events" => event_columns(),
        "leases" => lease_columns(),
        "namespaces" => namespace_columns(),
        _ => vec![
            col("Name", "string", "name", 0, "Name"),
            col("Age", "string", "", 0, "Time since creation"),
        ],
    };
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let cells = match def.plural {
                "pods" => pod_cells(o),
                "nodes" => node_cells(o),
                "events" => event_cells(o),
                "leases" => vec![
                    json!(s(o, "/metadata/name")),
                    json!(s(o, "/spec/holderIdentity")),
                    json!(age(o, "/metadata/creationTimestamp")),
                ],
                "namespaces" => vec![
                    json!(s(o, "/metadata/name")),
                    json!(s(o, "/status/phase")),
                    json!(age(o, "/metadata/creationTimestamp")),
                ],
                _ => vec![
                    json!(s(o, "/metadata/name")),
                    json!(age(o, "/metadata/creationTimestamp")),
                ],
            };
            let mut row = json!({"cells": cells});
            match include_object {
                "None" => {}
                "Object" => row["object"] = (**o).clone(),
                _ => {
                    row["object"] = json!({
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": o.get("metadata").cloned().unwrap_or(json!({})),
                    })
                }
            }
            row
        })
        .collect();
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv.to_string()},
        "columnDefinitions": columns,
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::apiserver::resources;

    #[test]
    fn kubectl_accept_header_selects_table() {
        assert!(wants_table(Some(
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
        )));
        assert!(!wants_table(Some("application/json")));
        assert!(!wants_table(None));
    }

    #[test]
    fn pod_row_reflects_status() {
        let pod = Arc::new(
            json!({"metadata": {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": "n1", "containers": [{"name": "a"}, {"name": "b"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "containerStatuses": [{"name": "a", "ready": true, "restartCount": 2}]}}),
        );
        let t = table(resources::pods(), &[pod], 7, "");
        let cells = &t["rows"][0]["cells"];
        assert_eq!(cells[1], json!("1/2"));
        assert_eq!(cells[2], json!("Terminating"));
        assert_eq!(cells[3], json!("2"));
        assert_eq!(cells[6], json!("n1"));
        assert_eq!(
            t["rows"][0]["object"]["kind"],
            json!("PartialObjectMetadata")
        );
    }
}
