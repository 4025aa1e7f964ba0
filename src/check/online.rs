//! `check-config --online`: asks the API server whether the kubeconfig's identity may do what
//! the daemon does (one SelfSubjectAccessReview per verb and resource), and pings the registry.
//!
//! The verbs and resources are those of packaging/rbac.yaml, compiled in: the file a process
//! test checks against every request the daemon makes, so the two cannot drift apart.

use serde_json::{json, Value};
use yaml_rust2::YamlLoader;

use super::Finding;
use crate::kube::client::CT_JSON;
use crate::kube::Client;
use crate::snapshots::RegistryClient;

const RBAC_YAML: &str = include_str!("../../packaging/rbac.yaml");

/// One rule of the ClusterRole: API group, resource (`pods/status`) and its verbs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Needed {
    pub group: String,
    pub resource: String,
    pub verbs: Vec<String>,
}

/// Every (group, resource) the shipped ClusterRole grants, with its verbs.
pub fn needed() -> Vec<Needed> {
    let docs = YamlLoader::load_from_str(RBAC_YAML).unwrap_or_default();
    let strings = |y: &yaml_rust2::Yaml| -> Vec<String> {
        y.as_vec()
            .map(|v| {
                v.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for doc in docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some("ClusterRole"))
    {
        for rule in doc["rules"].as_vec().into_iter().flatten() {
            let verbs = strings(&rule["verbs"]);
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    out.push(Needed {
                        group: group.clone(),
                        resource,
                        verbs: verbs.clone(),
                    });
                }
            }
        }
    }
    out
}

/// The namespace a review names: the node Lease lives in kube-node-lease; pods and events
/// are in every namespace (empty = all).
fn namespace_of(resource: &str) -> &'static str {
    if resource == "leases" {
        crate::node::LEASE_NAMESPACE
    } else {
        ""
    }
}

/// Whether the API server allows `verb` on `n`: Ok(None) allowed, Ok(Some(reason)) denied.
fn review(client: &Client, n: &Needed, verb: &str) -> Result<Option<String>, String> {
    let (resource, sub) = n.resource.split_once('/').unwrap_or((&n.resource, ""));
    let body = json!({
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {
            "group": n.group,
            "resource": resource,
            "subresource": sub,
            "verb": verb,
            "namespace": namespace_of(&n.resource),
        }},
    });
    let bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
    let out = client
        .request(
            "POST",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            &[],
            Some((CT_JSON, &bytes)),
        )
        .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&out)
        .map_err(|e| format!("the SelfSubjectAccessReview answer is not JSON: {e}"))?;
    if v.pointer("/status/allowed").and_then(Value::as_bool) == Some(true) {
        return Ok(None);
    }
    let reason = v
        .pointer("/status/reason")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
        .unwrap_or("no reason given");
    Ok(Some(reason.to_string()))
}

/// The API server's answer to the daemon's identity: reachable, then one line per resource.
pub fn kubernetes(client: &Client) -> Vec<Finding> {
    let server = client.server().to_string();
    match client.request("GET", "/version", &[], None) {
        Ok(body) => {
            let version = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v["gitVersion"].as_str().map(str::to_string))
                .unwrap_or_else(|| "version unknown".into());
            let mut out = vec![Finding::pass(format!(
                "API server {server} answers ({version})"
            ))];
            out.extend(access(client));
            out
        }
        Err(e) => vec![Finding::fail(format!(
            "API server {server}: {e} (check its address, the CA and the credentials in the \
             kubeconfig)"
        ))],
    }
}

fn access(client: &Client) -> Vec<Finding> {
    let mut out = Vec::new();
    for n in needed() {
        let what = if n.group.is_empty() {
            n.resource.clone()
        } else {
            format!("{}.{}", n.resource, n.group)
        };
        let mut denied = Vec::new();
        let mut failed = None;
        for verb in &n.verbs {
            match review(client, &n, verb) {
                Ok(None) => {}
                Ok(Some(reason)) => denied.push(format!("{verb} ({reason})")),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        out.push(match (failed, denied.is_empty()) {
            (Some(e), _) => Finding::fail(format!(
                "RBAC {what}: the SelfSubjectAccessReview failed: {e}"
            )),
            (None, true) => Finding::pass(format!("RBAC {what}: {}", n.verbs.join(", "))),
            (None, false) => Finding::fail(format!(
                "RBAC {what}: denied {}; packaging/rbac.yaml grants it (kubectl apply -f \
                 packaging/rbac.yaml, and check the binding's subject matches this identity)",
                denied.join(", ")
            )),
        });
    }
    out
}

/// `GET /v2/` on the configured registry with its credentials.
pub fn registry(oci_registry: &str, ca_file: Option<&std::path::Path>) -> Finding {
    let client = match RegistryClient::from_env(oci_registry, ca_file) {
        Ok(c) => c,
        Err(e) => return Finding::fail(format!("registry {oci_registry}: {e}")),
    };
    // A repository of the configured base for the token's scope: pull only, never created.
    let repository = match client.reference("vk-cocoon-check", "latest") {
        Ok(r) => r.repository,
        Err(e) => return Finding::fail(format!("registry {oci_registry}: {e}")),
    };
    match client.check_access(&repository) {
        Ok(how) => Finding::pass(format!("registry {}: {how}", client.base.host)),
        Err(e) => Finding::fail(format!(
            "registry {}: {e} (credentials come from the docker config of the daemon's user, \
             credential helpers or GOOGLE_APPLICATION_CREDENTIALS)",
            client.base.host
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_cluster_role_is_read() {
        let n = needed();
        let find = |g: &str, r: &str| n.iter().find(|x| x.group == g && x.resource == r);
        assert_eq!(
            find("", "pods/status").map(|x| x.verbs.clone()),
            Some(vec!["get".to_string(), "update".into(), "patch".into()])
        );
        assert!(find("coordination.k8s.io", "leases").is_some());
        assert!(find("authorization.k8s.io", "subjectaccessreviews").is_some());
        assert_eq!(namespace_of("leases"), "kube-node-lease");
    }
}
