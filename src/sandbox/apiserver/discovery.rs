//! Discovery documents so kubectl and clients find the served resources: /version, /api,
//! /api/v1, /apis, /apis/<group>[/<version>]. Built from the resource table; no state.

use super::resources::{self, RESOURCES};
use serde_json::{json, Value};

/// The Kubernetes version the fake claims to be.
pub const GIT_VERSION: &str = "v1.32.0-vkcocoon-fake";

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "32",
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.23.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

pub fn core_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

fn group_doc(group: &str, version: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/{version}"), "version": version});
    json!({
        "name": group,
        "versions": [gv.clone()],
        "preferredVersion": gv,
    })
}

/// The resource metrics API, served from the kubelets (see `metrics.rs`), not from the store.
pub const METRICS_GROUP: &str = "metrics.k8s.io";
pub const METRICS_VERSION: &str = "v1beta1";

fn served_groups() -> Vec<(&'static str, &'static str)> {
    let mut groups = resources::groups();
    groups.push((METRICS_GROUP, METRICS_VERSION));
    groups
}

pub fn group_list() -> Value {
    let groups: Vec<Value> = served_groups()
        .into_iter()
        .map(|(g, v)| group_doc(g, v))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// The APIGroup document for one group, if served.
pub fn group(name: &str) -> Option<Value> {
    let (g, v) = served_groups().into_iter().find(|(g, _)| *g == name)?;
    let mut doc = group_doc(g, v);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

/// The APIResourceList for a group/version ("" is core), if served.
pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    if (group, version) == (METRICS_GROUP, METRICS_VERSION) {
        let r = |name: &str, kind: &str, namespaced: bool| {
            json!({"name": name, "singularName": "", "namespaced": namespaced, "kind": kind,
                   "verbs": ["get", "list"]})
        };
        return Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": format!("{METRICS_GROUP}/{METRICS_VERSION}"),
            "resources": [r("nodes", "NodeMetrics", false), r("pods", "PodMetrics", true)],
        }));
    }
    let mut out = Vec::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let mut doc = json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": r.verbs,
        });
        if !r.short_names.is_empty() {
            doc["shortNames"] = json!(r.short_names);
        }
        if matches!(r.plural, "pods" | "events") {
            doc["categories"] = json!(["all"]);
        }
        out.push(doc);
        for sub in r.subresources {
            out.push(json!({
                "name": format!("{}/{}", r.plural, sub),
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if out.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": out,
    }))
}

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// The OpenAPI v3 index: one entry per served group/version.
pub fn openapi_v3_index() -> Value {
    let mut paths = serde_json::Map::new();
    let mut gvs = vec![("", "v1")];
    gvs.extend(resources::groups());
    for (g, v) in gvs {
        let p = gv_path(g, v);
        paths.insert(
            p.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash=fake")}),
        );
    }
    json!({"paths": paths})
}

/// A minimal OpenAPI v3 document for one group/version: no schemas, but PATCH operations
/// tagged with their kind and the `fieldValidation` parameter, which is what kubectl checks
/// before it leaves validation of `create -f` / `apply` to the server.
pub fn openapi_v3_group_version(path: &str) -> Option<Value> {
    let mut paths = serde_json::Map::new();
    for r in RESOURCES.iter() {
        if gv_path(r.group, r.version) != path || !r.verbs.contains(&"patch") {
            continue;
        }
        let base = if r.namespaced {
            format!("/{path}/namespaces/{{namespace}}/{}/{{name}}", r.plural)
        } else {
            format!("/{path}/{}/{{name}}", r.plural)
        };
        paths.insert(
            base,
            json!({"patch": {
                "x-kubernetes-group-version-kind": {"group": r.group, "version": r.version, "kind": r.kind},
                "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}},
            }}),
        );
    }
    if paths.is_empty()
        && !RESOURCES
            .iter()
            .any(|r| gv_path(r.group, r.version) == path)
    {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (vk-cocoon fake)", "version": GIT_VERSION},
        "paths": paths,
        "components": {"schemas": {}},
    }))
}

/// The root document: the paths served.
pub fn root_paths() -> Value {
    let mut paths = vec![
        "/api".to_string(),
        "/api/v1".to_string(),
        "/apis".to_string(),
        "/healthz".to_string(),
        "/livez".to_string(),
        "/readyz".to_string(),
        "/version".to_string(),
    ];
    for (g, v) in resources::groups() {
        paths.push(format!("/apis/{g}"));
        paths.push(format!("/apis/{g}/{v}"));
    }
    json!({"paths": paths})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_name_what_is_served() {
        let core = resource_list("", "v1").unwrap();
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        for want in [
            "pods",
            "pods/status",
            "nodes",
            "nodes/status",
            "events",
            "namespaces",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert!(resource_list("coordination.k8s.io", "v1").is_some());
        assert!(resource_list("apps", "v1").is_none());
        assert!(group("authorization.k8s.io").is_some());
        // Three stored groups and the resource metrics API that `kubectl top` looks for.
        assert_eq!(group_list()["groups"].as_array().unwrap().len(), 4);
        assert!(group(METRICS_GROUP).is_some());
        let metrics = resource_list(METRICS_GROUP, METRICS_VERSION).unwrap();
        assert_eq!(metrics["resources"][1]["kind"], "PodMetrics");
    }
}
