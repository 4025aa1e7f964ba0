//! Pod status builders (running, failure and terminal statuses) and the drift equality of
//! status publication. Pure: the caller passes the wall-clock time.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, PodCondition,
    PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

pub const CONTAINER_NAME: &str = "agent";

fn condition(type_: &str, status: bool, message: Option<String>, now: &Time) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        message,
        last_transition_time: Some(now.clone()),
        ..Default::default()
    }
}

/// No VM tracked (creation not finished, hibernated): `{phase: Pending, startTime}` only.
pub fn pending(start_time: Option<&Time>) -> PodStatus {
    PodStatus {
        phase: Some("Pending".into()),
        start_time: start_time.cloned(),
        ..Default::default()
    }
}

/// A tracked VM: Running with Ready then Initialized, container `agent`, podIP.
/// `message` is the latest probe message (None when no probe result exists).
pub fn running(
    ip: &str,
    ready: bool,
    message: Option<&str>,
    start_time: Option<&Time>,
    now: &Time,
) -> PodStatus {
    PodStatus {
        phase: Some("Running".into()),
        start_time: start_time.cloned(),
        pod_ip: Some(ip.to_string()),
        conditions: Some(vec![
            condition(
                "Ready",
                ready,
                Some(message.unwrap_or("").to_string()).filter(|m| !m.is_empty()),
                now,
            ),
            condition("Initialized", true, None, now),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: CONTAINER_NAME.into(),
            ready,
            restart_count: 0,
            state: Some(ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(now.clone()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// Eviction status: Failed, container `agent` terminated exit 1 with reason/message.
pub fn evicted(reason: &str, message: &str, start_time: Option<&Time>, now: &Time) -> PodStatus {
    PodStatus {
        phase: Some("Failed".into()),
        start_time: start_time.cloned(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        container_statuses: Some(vec![ContainerStatus {
            name: CONTAINER_NAME.into(),
            ready: false,
            restart_count: 0,
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 1,
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                    finished_at: Some(now.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// After a successful DeletePod: phase Succeeded, container terminated (exit 0).
pub fn succeeded(start_time: Option<&Time>, now: &Time) -> PodStatus {
    PodStatus {
        phase: Some("Succeeded".into()),
        start_time: start_time.cloned(),
        container_statuses: Some(vec![ContainerStatus {
            name: CONTAINER_NAME.into(),
            ready: false,
            restart_count: 0,
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 0,
                    reason: Some("Terminated".into()),
                    finished_at: Some(now.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// The framework's provider-error status: Pending (Failed with restartPolicy Never),
/// reason ProviderFailed, message = error text.
pub fn provider_failed(restart_never: bool, message: &str) -> PodStatus {
    PodStatus {
        phase: Some(if restart_never { "Failed" } else { "Pending" }.into()),
        reason: Some("ProviderFailed".into()),
        message: Some(message.into()),
        ..Default::default()
    }
}

/// The fields that count for drift plus pod-level reason/message (so a ProviderFailed
/// status is replaced once the pod recovers).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusSummary {
    pub phase: Option<String>,
    pub pod_ip: Option<String>,
    pub ready: Option<String>,
    pub initialized: Option<String>,
    pub ready_message: Option<String>,
    /// (present, ready, which state) for container `agent`.
    pub agent: Option<(bool, &'static str)>,
    pub reason: Option<String>,
}

pub fn summary(s: &PodStatus) -> StatusSummary {
    let cond = |t: &str| {
        s.conditions
            .as_ref()
            .and_then(|c| c.iter().find(|c| c.type_ == t))
    };
    let agent = s
        .container_statuses
        .as_ref()
        .and_then(|c| c.iter().find(|c| c.name == CONTAINER_NAME))
        .map(|c| {
            let which = match &c.state {
                Some(st) if st.running.is_some() => "running",
                Some(st) if st.terminated.is_some() => "terminated",
                Some(st) if st.waiting.is_some() => "waiting",
                _ => "none",
            };
            (c.ready, which)
        });
    StatusSummary {
        phase: s.phase.clone(),
        pod_ip: s.pod_ip.clone().filter(|i| !i.is_empty()),
        ready: cond("Ready").map(|c| c.status.clone()),
        initialized: cond("Initialized").map(|c| c.status.clone()),
        ready_message: cond("Ready").and_then(|c| c.message.clone().filter(|m| !m.is_empty())),
        agent,
        reason: s.reason.clone(),
    }
}

/// Whether a pod "has a running container" for the deletion flow:
/// some container status is neither waiting nor terminated.
pub fn has_running_container(s: Option<&PodStatus>) -> bool {
    s.and_then(|s| s.container_statuses.as_ref())
        .map(|cs| {
            cs.iter().any(|c| match &c.state {
                None => true,
                Some(st) => st.waiting.is_none() && st.terminated.is_none(),
            })
        })
        .unwrap_or(false)
}

/// JSON for the wire: k8s-openapi always serialises the required `image` / `imageID` of a
/// container status; ours have none, so empty ones are removed here. Use this for the
/// body of the pods/status patch.
pub fn to_wire_json(s: &PodStatus) -> serde_json::Value {
    let mut v = serde_json::to_value(s).unwrap_or(serde_json::Value::Null);
    if let Some(cs) = v
        .get_mut("containerStatuses")
        .and_then(|c| c.as_array_mut())
    {
        for c in cs {
            if let Some(o) = c.as_object_mut() {
                for k in ["image", "imageID"] {
                    if o.get(k).and_then(|x| x.as_str()) == Some("") {
                        o.remove(k);
                    }
                }
            }
        }
    }
    v
}

pub fn is_ready(s: &PodStatus) -> bool {
    summary(s).ready.as_deref() == Some("True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn t(sec: i64) -> Time {
        Time(Timestamp::from_second(sec).unwrap())
    }

    #[test]
    fn running_shape_is_exact() {
        let s = running("10.0.0.5", true, Some("ping ok"), Some(&t(1)), &t(2));
        let v = to_wire_json(&s);
        assert_eq!(v["phase"], "Running");
        assert_eq!(v["podIP"], "10.0.0.5");
        assert_eq!(v["startTime"], "1970-01-01T00:00:01Z");
        let conds = v["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 2);
        assert_eq!(conds[0]["type"], "Ready");
        assert_eq!(conds[0]["status"], "True");
        assert_eq!(conds[0]["message"], "ping ok");
        assert!(conds[0].get("reason").is_none());
        assert_eq!(conds[1]["type"], "Initialized");
        let cs = v["containerStatuses"].as_array().unwrap();
        assert_eq!(cs.len(), 1);
        assert_eq!(cs[0]["name"], "agent");
        assert_eq!(cs[0]["ready"], true);
        assert_eq!(cs[0]["restartCount"], 0);
        assert!(cs[0]["state"]["running"]["startedAt"].is_string());
        assert!(cs[0].get("image").is_none());
        assert!(cs[0].get("imageID").is_none());
        assert!(v.get("hostIP").is_none());
        assert!(v.get("podIPs").is_none());
    }

    #[test]
    fn status_times_go_out_in_whole_seconds_with_z() {
        // The provider stamps statuses with the full-precision instant; metav1.Time on the
        // wire is second precision in UTC, as the API server writes it back.
        let start = Time(Timestamp::new(1_767_225_600, 987_654_321).unwrap());
        let now = Time(Timestamp::new(1_767_225_601, 1).unwrap());
        let v = to_wire_json(&running("10.0.0.5", true, None, Some(&start), &now));
        assert_eq!(v["startTime"], "2026-01-01T00:00:00Z");
        assert_eq!(
            v["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:01Z"
        );
        let back: PodStatus = serde_json::from_value(v).unwrap();
        assert_eq!(
            back.start_time,
            Some(Time(Timestamp::from_second(1_767_225_600).unwrap()))
        );
    }

    #[test]
    fn pending_has_only_phase_and_start_time() {
        let v = serde_json::to_value(pending(Some(&t(5)))).unwrap();
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(v["phase"], "Pending");
    }

    #[test]
    fn drift_summary_ignores_timestamps_but_not_readiness() {
        let a = running(
            "1.2.3.4",
            false,
            Some("waiting for dhcp lease"),
            None,
            &t(1),
        );
        let b = running(
            "1.2.3.4",
            false,
            Some("waiting for dhcp lease"),
            None,
            &t(99),
        );
        assert_eq!(summary(&a), summary(&b));
        let c = running("1.2.3.4", true, Some("waiting for dhcp lease"), None, &t(1));
        assert_ne!(summary(&a), summary(&c));
        let d = running("1.2.3.4", false, Some("ping ok"), None, &t(1));
        assert_ne!(summary(&a), summary(&d));
        assert!(!is_ready(&a));
        assert!(is_ready(&c));
    }

    #[test]
    fn evicted_status_terminates_agent_with_exit_1() {
        let v =
            serde_json::to_value(evicted("VMGone", "vm no longer exists", None, &t(3))).unwrap();
        assert_eq!(v["phase"], "Failed");
        let term = &v["containerStatuses"][0]["state"]["terminated"];
        assert_eq!(term["exitCode"], 1);
        assert_eq!(term["reason"], "VMGone");
        assert!(!has_running_container(Some(&evicted(
            "x",
            "y",
            None,
            &t(1)
        ))));
        assert!(has_running_container(Some(&running(
            "",
            false,
            None,
            None,
            &t(1)
        ))));
        assert!(!has_running_container(Some(&pending(None))));
        assert!(!has_running_container(None));
    }

    #[test]
    fn provider_failed_phase_depends_on_restart_policy() {
        assert_eq!(
            provider_failed(false, "x").phase.as_deref(),
            Some("Pending")
        );
        assert_eq!(provider_failed(true, "x").phase.as_deref(), Some("Failed"));
        assert_eq!(
            provider_failed(false, "x").reason.as_deref(),
            Some("ProviderFailed")
        );
    }
}
