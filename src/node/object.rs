//! The Node object: labels, conditions, status, the create body and the merge patches.
//! Pure builders; the agent sends what they return.

use std::collections::BTreeMap;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec, NodeStatus,
    NodeSystemInfo, Taint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

use super::{NodeOptions, Resources, CPU_CLASS_LABEL, POOL_LABEL, ROLE_LABEL, TAINT_KEY};

/// Seconds-precision API time.
pub fn api_time(t: SystemTime) -> Time {
    let at = crate::rfc3339::timestamp(t);
    Time(Timestamp::from_second(at.as_second()).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// Microsecond-precision API time (Lease renewTime, Event eventTime).
pub fn api_micro_time(t: SystemTime) -> MicroTime {
    let at = crate::rfc3339::timestamp(t);
    MicroTime(Timestamp::from_microsecond(at.as_microsecond()).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// The labels vk-cocoon asserts (framework defaults plus its own).
pub fn node_labels(o: &NodeOptions) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert("type".into(), "virtual-kubelet".into());
    l.insert("kubernetes.io/role".into(), "agent".into());
    l.insert("kubernetes.io/hostname".into(), o.name.clone());
    l.insert(POOL_LABEL.into(), o.pool.clone());
    l.insert(ROLE_LABEL.into(), String::new());
    if let Some(c) = o.snapshot_cpu_class.as_ref().filter(|c| !c.is_empty()) {
        l.insert(CPU_CLASS_LABEL.into(), c.clone());
    }
    l
}

fn condition(
    kind: &str,
    status: &str,
    reason: &str,
    message: &str,
    heartbeat: &Time,
    since: &Time,
) -> NodeCondition {
    NodeCondition {
        type_: kind.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(heartbeat.clone()),
        last_transition_time: Some(since.clone()),
    }
}

/// The fixed condition set of the Node object. `since` (lastTransitionTime) stays at
/// the agent's start; `heartbeat` is refreshed on every write.
pub fn node_conditions(heartbeat: &Time, since: &Time) -> Vec<NodeCondition> {
    vec![
        condition(
            "Ready",
            "True",
            "KubeletReady",
            "vk-cocoon is ready",
            heartbeat,
            since,
        ),
        condition(
            "DiskPressure",
            "False",
            "KubeletHasNoDiskPressure",
            "vk-cocoon has no disk pressure",
            heartbeat,
            since,
        ),
        condition(
            "MemoryPressure",
            "False",
            "KubeletHasSufficientMemory",
            "vk-cocoon has sufficient memory",
            heartbeat,
            since,
        ),
        condition(
            "PIDPressure",
            "False",
            "KubeletHasSufficientPID",
            "vk-cocoon has sufficient PID available",
            heartbeat,
            since,
        ),
        condition(
            "NetworkUnavailable",
            "False",
            "RouteCreated",
            "NodeController create implicit route",
            heartbeat,
            since,
        ),
    ]
}

/// The node status vk-cocoon publishes.
pub fn node_status(o: &NodeOptions, r: &Resources, now: &Time, since: &Time) -> NodeStatus {
    NodeStatus {
        addresses: Some(vec![
            NodeAddress {
                type_: "InternalIP".into(),
                address: o.ip.to_string(),
            },
            NodeAddress {
                type_: "Hostname".into(),
                address: o.name.clone(),
            },
        ]),
        allocatable: Some(r.allocatable.clone()),
        capacity: Some(r.capacity.clone()),
        conditions: Some(node_conditions(now, since)),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint {
                port: i32::from(o.kubelet_port),
            }),
        }),
        node_info: Some(NodeSystemInfo {
            kubelet_version: o.version.clone(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The full Node for registration.
pub fn build_node(o: &NodeOptions, r: &Resources, now: &Time) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(o.name.clone()),
            labels: Some(node_labels(o)),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            provider_id: o.provider_id.clone().filter(|p| !p.is_empty()),
            taints: Some(vec![provider_taint()]),
            ..Default::default()
        }),
        status: Some(node_status(o, r, now, now)),
    }
}

/// The JSON merge patch (RFC 7386) that brings an existing node's labels and taint to what
/// vk-cocoon asserts, or None when it already has them. Only vk-cocoon's own keys appear in
/// it (the CPU-class label as null when not configured), so labels other actors set, and any
/// field newer than this build's types, are left as the server holds them. A merge patch
/// replaces lists whole: when the provider taint is missing the patch carries every taint
/// read plus ours, and the resourceVersion read, so a taint added meanwhile makes it a 409
/// (read again) instead of being dropped.
pub fn node_patch(node: &Node, o: &NodeOptions) -> Option<serde_json::Value> {
    let current = node.metadata.labels.clone().unwrap_or_default();
    let mut labels = serde_json::Map::new();
    for (k, v) in node_labels(o) {
        if current.get(&k) != Some(&v) {
            labels.insert(k, serde_json::Value::String(v));
        }
    }
    if o.snapshot_cpu_class.as_deref().is_none_or(str::is_empty)
        && current.contains_key(CPU_CLASS_LABEL)
    {
        labels.insert(CPU_CLASS_LABEL.into(), serde_json::Value::Null);
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let taint_missing = !taints.iter().any(|t| t.key == TAINT_KEY);
    if labels.is_empty() && !taint_missing {
        return None;
    }
    let mut patch = serde_json::json!({ "metadata": {} });
    if !labels.is_empty() {
        patch["metadata"]["labels"] = serde_json::Value::Object(labels);
    }
    if taint_missing {
        let mut all = taints;
        all.push(provider_taint());
        patch["spec"] = serde_json::json!({ "taints": all });
        if let Some(rv) = &node.metadata.resource_version {
            patch["metadata"]["resourceVersion"] = serde_json::Value::String(rv.clone());
        }
    }
    Some(patch)
}

fn provider_taint() -> Taint {
    Taint {
        key: TAINT_KEY.into(),
        value: Some("cocoon".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }
}

/// The strategic-merge patch for nodes/<name>/status: the whole desired status (conditions and
/// addresses merge by type on the server).
pub fn status_patch(o: &NodeOptions, r: &Resources, now: &Time, since: &Time) -> serde_json::Value {
    serde_json::json!({ "status": node_status(o, r, now, since) })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::compute_resources;
    use super::super::fixtures::{host, opts};
    use super::*;

    #[test]
    fn node_object_has_every_field() {
        let r = compute_resources(&opts(), &host()).unwrap();
        let now = api_time(SystemTime::now());
        let n = build_node(&opts(), &r, &now);
        let v = serde_json::to_value(&n).unwrap();
        assert_eq!(v["metadata"]["labels"]["cocoonstack.io/pool"], "gpu");
        assert_eq!(
            v["metadata"]["labels"]["node-role.kubernetes.io/cocoon-vm"],
            ""
        );
        assert_eq!(
            v["metadata"]["labels"]["cocoonstack.io/snapshot-cpu-class"],
            "icelake"
        );
        assert_eq!(v["metadata"]["labels"]["type"], "virtual-kubelet");
        assert_eq!(
            v["metadata"]["labels"]["kubernetes.io/hostname"],
            "cocoon-pool"
        );
        assert_eq!(v["spec"]["taints"][0]["key"], TAINT_KEY);
        assert_eq!(v["spec"]["taints"][0]["value"], "cocoon");
        assert_eq!(v["spec"]["taints"][0]["effect"], "NoSchedule");
        assert_eq!(v["spec"]["providerID"], "cocoon://h1");
        assert_eq!(
            v["status"]["addresses"][0],
            serde_json::json!({"type":"InternalIP","address":"10.0.0.5"})
        );
        assert_eq!(
            v["status"]["addresses"][1],
            serde_json::json!({"type":"Hostname","address":"cocoon-pool"})
        );
        assert_eq!(
            v["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"],
            10250
        );
        assert_eq!(v["status"]["nodeInfo"]["kubeletVersion"], "dev");
        let conds = v["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 5);
        assert_eq!(conds[0]["type"], "Ready");
        assert_eq!(conds[0]["status"], "True");
        assert_eq!(conds[0]["reason"], "KubeletReady");
        assert_eq!(conds[0]["message"], "vk-cocoon is ready");
        assert!(conds[1..].iter().all(|c| c["status"] == "False"));
    }

    #[test]
    fn heartbeat_moves_transition_time_stays() {
        let since = api_time(SystemTime::UNIX_EPOCH + Duration::from_secs(100));
        let beat = api_time(SystemTime::UNIX_EPOCH + Duration::from_secs(200));
        let p = status_patch(&opts(), &Resources::default(), &beat, &since);
        for c in p["status"]["conditions"].as_array().unwrap() {
            assert_eq!(c["lastHeartbeatTime"], "1970-01-01T00:03:20Z");
            assert_eq!(c["lastTransitionTime"], "1970-01-01T00:01:40Z");
        }
    }

    #[test]
    fn the_node_patch_names_only_our_labels_and_a_missing_taint() {
        let mut o = opts();
        o.snapshot_cpu_class = None;
        let mut n = Node::default();
        n.metadata.resource_version = Some("41".into());
        n.metadata.labels = Some(BTreeMap::from([
            (CPU_CLASS_LABEL.to_string(), "old".to_string()),
            ("other".to_string(), "kept".to_string()),
            (POOL_LABEL.to_string(), "stale".to_string()),
            ("type".to_string(), "virtual-kubelet".to_string()),
        ]));
        n.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "team".into(),
                value: Some("x".into()),
                effect: "NoExecute".into(),
                time_added: None,
            }]),
            ..Default::default()
        });
        let p = node_patch(&n, &o).expect("a patch");
        let labels = p["metadata"]["labels"].as_object().unwrap();
        assert_eq!(labels[POOL_LABEL], "gpu");
        assert!(labels[CPU_CLASS_LABEL].is_null(), "removed by null");
        assert!(!labels.contains_key("other"), "others' labels untouched");
        assert!(!labels.contains_key("type"), "unchanged labels not sent");
        let taints = p["spec"]["taints"].as_array().unwrap();
        assert_eq!(taints.len(), 2, "the list is replaced whole: theirs kept");
        assert_eq!(taints[0]["key"], "team");
        assert_eq!(taints[1]["key"], TAINT_KEY);
        assert_eq!(p["metadata"]["resourceVersion"], "41");

        // Applied, nothing is left to patch; labels alone need no resourceVersion.
        let mut l = n.metadata.labels.clone().unwrap();
        l.extend(node_labels(&o));
        l.remove(CPU_CLASS_LABEL);
        n.metadata.labels = Some(l.clone());
        n.spec
            .as_mut()
            .unwrap()
            .taints
            .as_mut()
            .unwrap()
            .push(provider_taint());
        assert_eq!(node_patch(&n, &o), None);
        l.insert(POOL_LABEL.into(), "stale".into());
        n.metadata.labels = Some(l);
        let p = node_patch(&n, &o).unwrap();
        assert_eq!(
            p,
            serde_json::json!({"metadata": {"labels": {POOL_LABEL: "gpu"}}})
        );
    }
}
