//! packaging/rbac.yaml against what the daemon really asks for: every API request the real
//! binary makes through a pod's whole life (create, run, delete) is allowed by the ClusterRole.

use crate::daemon_support;

use std::time::Duration;

use daemon_support::{running_with_vm, World};
use vk_cocoon::sandbox::demo_pod;
use yaml_rust2::{Yaml, YamlLoader};

/// (resources, verbs) of each rule of the ClusterRole in packaging/rbac.yaml.
fn cluster_role_rules() -> Vec<(Vec<String>, Vec<String>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/rbac.yaml");
    let text = std::fs::read_to_string(path).expect("packaging/rbac.yaml");
    let docs = YamlLoader::load_from_str(&text).expect("rbac.yaml is YAML");
    let role = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("ClusterRole"))
        .expect("a ClusterRole");
    let strings = |y: &Yaml| -> Vec<String> {
        y.as_vec()
            .map(|v| {
                v.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    role["rules"]
        .as_vec()
        .expect("rules")
        .iter()
        .map(|r| (strings(&r["resources"]), strings(&r["verbs"])))
        .collect()
}

#[test]
fn the_cluster_role_allows_every_request_of_a_pod_lifecycle() {
    let rules = cluster_role_rules();
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "rbac", "clone", "base"))
        .expect("create pod");
    w.wait("pod rbac Running", Duration::from_secs(30), || {
        running_with_vm(&w, "rbac")
    });
    w.api
        .delete_pod("default", "rbac", Some(0))
        .expect("delete pod");
    w.wait("pod rbac gone", Duration::from_secs(30), || {
        w.pod("rbac").is_none().then_some(())
    });

    // The fake API server logs a request after applying it, and Events go out at the lane's
    // lowest priority: wait (bounded) until every resource shows in the log.
    let needed = ["nodes", "leases", "pods", "pods/status", "events"];
    let asked_now = || -> std::collections::BTreeSet<(String, String)> {
        w.api
            .requests()
            .into_iter()
            .filter(|r| r.user == "system:node:cocoon-sandbox" && !r.resource.is_empty())
            .map(|r| (r.resource, r.verb))
            .collect()
    };
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let asked = loop {
        let asked = asked_now();
        let all = needed.iter().all(|n| asked.iter().any(|(res, _)| res == n));
        if all || std::time::Instant::now() > end {
            break asked;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for needed in needed {
        assert!(
            asked.iter().any(|(res, _)| res == needed),
            "the daemon never touched {needed}: {asked:?}"
        );
    }
    for (resource, verb) in &asked {
        let allowed = rules.iter().any(|(resources, verbs)| {
            resources.iter().any(|r| r == resource) && verbs.iter().any(|v| v == verb || v == "*")
        });
        assert!(allowed, "rbac.yaml does not allow {verb} {resource}");
    }
}
