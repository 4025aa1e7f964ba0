//! The node's Lease (kube-node-lease): the heartbeat object and its renewal.
//! Pure builders; the agent sends what they return.

use std::time::SystemTime;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::{api_micro_time, LEASE_DURATION_SECONDS, LEASE_NAMESPACE};

/// The Lease object (coordination.k8s.io/v1) as sent on the wire.
pub fn build_lease(node: &str, node_uid: &str, now: SystemTime) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.into()),
            namespace: Some(LEASE_NAMESPACE.into()),
            owner_references: Some(vec![owner_ref(node, node_uid)]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.into()),
            lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
            renew_time: Some(api_micro_time(now)),
            ..Default::default()
        }),
    }
}

fn owner_ref(node: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node.into(),
        uid: uid.into(),
        ..Default::default()
    }
}

/// Renew a lease read from the server: new renewTime, our holder and duration, owner re-added.
pub fn renew_lease(mut l: Lease, node: &str, node_uid: &str, now: SystemTime) -> Lease {
    let spec = l.spec.get_or_insert_with(Default::default);
    spec.holder_identity = Some(node.into());
    spec.lease_duration_seconds = Some(LEASE_DURATION_SECONDS);
    spec.renew_time = Some(api_micro_time(now));
    let owners = l.metadata.owner_references.get_or_insert_with(Vec::new);
    if !owners.iter().any(|r| r.kind == "Node" && r.uid == node_uid) {
        owners.retain(|r| r.kind != "Node");
        owners.push(owner_ref(node, node_uid));
    }
    l
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};

    use super::super::api_time;
    use super::*;

    #[test]
    fn lease_and_api_times_have_the_api_servers_wire_form() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_767_225_600, 123_456_789);
        let lease = serde_json::to_value(build_lease("n", "u", t)).unwrap();
        // metav1.MicroTime: six digits always, truncated, UTC `Z`.
        assert_eq!(lease["spec"]["renewTime"], "2026-01-01T00:00:00.123456Z");
        let whole = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let lease = serde_json::to_value(build_lease("n", "u", whole)).unwrap();
        assert_eq!(lease["spec"]["renewTime"], "2026-01-01T00:00:00.000000Z");
        // metav1.Time: whole seconds, and the value itself holds no fraction, so what is
        // compared in memory is what the server echoes back.
        assert_eq!(
            serde_json::to_value(api_time(t)).unwrap(),
            "2026-01-01T00:00:00Z"
        );
        let echoed: Time = serde_json::from_value("2026-01-01T00:00:00Z".into()).unwrap();
        assert_eq!(api_time(t), echoed);
        let echoed: MicroTime =
            serde_json::from_value("2026-01-01T00:00:00.123456Z".into()).unwrap();
        assert_eq!(api_micro_time(t), echoed);
        // A clock before the epoch reads as the epoch.
        let early = SystemTime::UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(
            serde_json::to_value(api_micro_time(early)).unwrap(),
            "1970-01-01T00:00:00.000000Z"
        );
    }

    #[test]
    fn lease_shape_and_renewal() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_767_225_600_123_456);
        let l = build_lease("n1", "uid-1", t);
        let v = serde_json::to_value(&l).unwrap();
        assert_eq!(v["metadata"]["namespace"], "kube-node-lease");
        assert_eq!(v["spec"]["holderIdentity"], "n1");
        assert_eq!(v["spec"]["leaseDurationSeconds"], 40);
        assert_eq!(v["spec"]["renewTime"], "2026-01-01T00:00:00.123456Z");
        assert_eq!(
            v["metadata"]["ownerReferences"][0],
            serde_json::json!({"apiVersion":"v1","kind":"Node","name":"n1","uid":"uid-1"})
        );
        let mut stripped = l.clone();
        stripped.metadata.owner_references = None;
        let r = renew_lease(stripped, "n1", "uid-2", t + Duration::from_secs(10));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "uid-2");
        assert_eq!(v["spec"]["renewTime"], "2026-01-01T00:00:10.123456Z");
    }
}
