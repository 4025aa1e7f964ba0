//! The fake API server through real HTTPS: list/watch, bookmarks, 410, 409, UID preconditions,
//! patch types, graceful deletion, auth, faults, stop/restart.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::time::{Duration, Instant};
use vk_cocoon::http_client;
use vk_cocoon::sandbox::apiserver::{
    ApiServer, ApiServerHandle, ApiServerOptions, Fault, FaultMatch, TokenPolicy,
};

fn tls_config(ca_pem: &str, client: Option<(String, String)>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let certs: Vec<_> = CertificateDer::pem_slice_iter(cert.as_bytes())
                .map(|c| c.unwrap())
                .collect();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
    };
    Arc::new(config)
}

struct Client {
    agent: ureq::Agent,
    base: String,
    token: Option<String>,
}

impl Client {
    fn new(server: &ApiServerHandle) -> Client {
        Client::with(server, Some("test-token".into()), None)
    }

    fn with(
        server: &ApiServerHandle,
        token: Option<String>,
        cert: Option<(String, String)>,
    ) -> Client {
        let agent = http_client::agent(
            http_client::config()
                .timeout_global(Some(Duration::from_secs(20)))
                .build(),
            Some(tls_config(&server.ca_pem(), cert)),
        );
        Client {
            agent,
            base: server.url(),
            token,
        }
    }

    fn req(&self, method: &str, path: &str) -> ureq::http::request::Builder {
        let r = http_client::request(method, &format!("{}{}", self.base, path), &[]);
        match &self.token {
            Some(t) => r.header("Authorization", format!("Bearer {t}")),
            None => r,
        }
    }

    /// Sends a request without a body.
    fn send(&self, r: ureq::http::request::Builder) -> Result<http_client::Response, ureq::Error> {
        self.agent.run(r.body(()).expect("request"))
    }

    /// (status, body, Retry-After) of a request, errors included.
    fn call(
        &self,
        method: &str,
        path: &str,
        ct: Option<&str>,
        body: Option<&Value>,
    ) -> (u16, Value, Option<String>) {
        let mut r = self.req(method, path);
        if let Some(ct) = ct {
            r = r.header("Content-Type", ct);
        }
        let res = match body {
            Some(b) => self.agent.run(r.body(b.to_string()).expect("request")),
            None => self.send(r),
        };
        // Statuses are answers (the agent does not turn them into errors).
        let resp = match res {
            Ok(r) => r,
            Err(e) => panic!("{method} {path}: transport error {e}"),
        };
        let status = resp.status().as_u16();
        let retry = http_client::header(&resp, "Retry-After").map(str::to_string);
        let text = resp.into_body().read_to_string().unwrap();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, v, retry)
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let (s, v, _) = self.call("GET", path, None, None);
        (s, v)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, v, _) = self.call("POST", path, Some("application/json"), Some(body));
        (s, v)
    }

    fn put(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, v, _) = self.call("PUT", path, Some("application/json"), Some(body));
        (s, v)
    }

    fn patch(&self, path: &str, ct: &str, body: &Value) -> (u16, Value) {
        let (s, v, _) = self.call("PATCH", path, Some(ct), Some(body));
        (s, v)
    }

    fn delete(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, v, _) = self.call("DELETE", path, Some("application/json"), Some(body));
        (s, v)
    }

    fn watch(&self, path: &str) -> Watch {
        let resp = self.send(self.req("GET", path)).expect("watch request");
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(
            http_client::header(&resp, "Content-Type"),
            Some("application/json")
        );
        Watch {
            reader: BufReader::new(Box::new(resp.into_body().into_reader())),
        }
    }
}

struct Watch {
    reader: BufReader<Box<dyn Read + Send + Sync>>,
}

impl Watch {
    /// The next event line, or None at end of stream.
    fn next(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(serde_json::from_str(&line).expect("one JSON object per line")),
        }
    }

    /// The next non-BOOKMARK event.
    fn next_change(&mut self) -> Value {
        loop {
            let ev = self.next().expect("stream ended");
            if ev["type"] != "BOOKMARK" {
                return ev;
            }
        }
    }
}

fn start() -> ApiServerHandle {
    ApiServer::start(ApiServerOptions::default()).expect("start fake apiserver")
}

fn pod(name: &str, node: Option<&str>) -> Value {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "demo"}},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    });
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    p
}

const PODS: &str = "/api/v1/namespaces/default/pods";

fn rv_of(v: &Value) -> u64 {
    v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn list_and_watch_with_field_selector_and_bookmarks() {
    let server = start();
    server.set_bookmark_interval(Duration::from_millis(100));
    let c = Client::new(&server);
    assert_eq!(c.post(PODS, &pod("a", Some("n1"))).0, 201);
    assert_eq!(c.post(PODS, &pod("b", Some("n2"))).0, 201);
    assert_eq!(c.post(PODS, &pod("a", Some("n1"))).0, 409, "AlreadyExists");

    let (s, list) = c.get("/api/v1/pods?fieldSelector=spec.nodeName%3Dn1");
    assert_eq!(s, 200);
    assert_eq!(list["kind"], "PodList");
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["metadata"]["name"], "a");
    assert_eq!(items[0]["status"]["phase"], "Pending");
    let list_rv = rv_of(&list);

    let mut w = c.watch(&format!(
        "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1&watch=1&resourceVersion={list_rv}&allowWatchBookmarks=true&timeoutSeconds=30"
    ));
    // b is on n2: invisible. c on n1: ADDED.
    c.post(PODS, &pod("c", Some("n1")));
    let ev = w.next_change();
    assert_eq!(ev["type"], "ADDED");
    assert_eq!(ev["object"]["metadata"]["name"], "c");
    assert_eq!(ev["object"]["kind"], "Pod");
    let c_rv = rv_of(&ev["object"]);
    assert!(c_rv > list_rv);

    // A status write is MODIFIED, in order after the add.
    let (s, st) = c.patch(
        &format!("{PODS}/c/status"),
        "application/merge-patch+json",
        &json!({"status": {"phase": "Running"}}),
    );
    assert_eq!(s, 200, "{st}");
    let ev = w.next_change();
    assert_eq!(ev["type"], "MODIFIED");
    assert_eq!(ev["object"]["status"]["phase"], "Running");
    assert!(rv_of(&ev["object"]) > c_rv);

    // A bookmark arrives while idle and carries only the version.
    let bm = loop {
        let ev = w.next().expect("stream open");
        if ev["type"] == "BOOKMARK" {
            break ev;
        }
    };
    assert_eq!(bm["object"]["kind"], "Pod");
    assert!(rv_of(&bm["object"]) >= rv_of(&st));
    assert!(bm["object"].get("spec").is_none());

    // Deletion of an unscheduled-equivalent (grace 0) is DELETED with the last state.
    let (s, _) = c.delete(&format!("{PODS}/c"), &json!({"gracePeriodSeconds": 0}));
    assert_eq!(s, 200);
    let ev = w.next_change();
    assert_eq!(ev["type"], "DELETED");
    assert_eq!(ev["object"]["status"]["phase"], "Running");
}

#[test]
fn watch_without_version_starts_with_current_state_and_times_out() {
    let server = start();
    let c = Client::new(&server);
    c.post(PODS, &pod("x", Some("n1")));
    c.post(PODS, &pod("y", Some("n1")));
    let mut w = c.watch("/api/v1/namespaces/default/pods?watch=true&timeoutSeconds=1");
    let names: Vec<Value> = (0..2)
        .map(|_| w.next_change()["object"]["metadata"]["name"].clone())
        .collect();
    assert_eq!(names, vec![json!("x"), json!("y")]);
    let started = Instant::now();
    assert!(w.next().is_none(), "stream ends at timeoutSeconds");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn selector_exit_and_entry_are_deleted_and_added() {
    let server = start();
    let c = Client::new(&server);
    let (_, created) = c.post(PODS, &pod("m", None));
    let rv = rv_of(&created);
    let mut w = c.watch(&format!(
        "/api/v1/pods?watch=1&resourceVersion={rv}&labelSelector=app%3Ddemo"
    ));
    c.patch(
        &format!("{PODS}/m"),
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"app": "other"}}}),
    );
    let ev = w.next_change();
    assert_eq!(ev["type"], "DELETED");
    assert_eq!(ev["object"]["metadata"]["labels"]["app"], "demo");
    c.patch(
        &format!("{PODS}/m"),
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"app": "demo"}}}),
    );
    assert_eq!(w.next_change()["type"], "ADDED");
}

#[test]
fn too_old_resource_version_gets_410() {
    let server = start();
    let c = Client::new(&server);
    let (_, p) = c.post(PODS, &pod("old", Some("n1")));
    let old_rv = rv_of(&p);
    c.patch(
        &format!("{PODS}/old"),
        "application/merge-patch+json",
        &json!({"metadata": {"annotations": {"k": "v"}}}),
    );
    server.compact_history();

    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={old_rv}"));
    let ev = w.next().unwrap();
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["kind"], "Status");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");
    assert!(ev["object"]["message"]
        .as_str()
        .unwrap()
        .starts_with("too old resource version"));
    assert!(w.next().is_none());

    // A watch from the current version is fine, and an injected HTTP 410 is a plain status.
    server.fail_next(1, FaultMatch::verb("watch"), Fault::Gone);
    let (s, body) = c.get(&format!(
        "/api/v1/pods?watch=1&resourceVersion={}",
        server.resource_version()
    ));
    assert_eq!(s, 410);
    assert_eq!(body["reason"], "Expired");

    // Bounded history: with a limit of 2 changes, a watch three changes back is too old.
    server.set_history_limit(2);
    let start_rv = server.resource_version();
    for i in 0..3 {
        c.patch(
            &format!("{PODS}/old"),
            "application/merge-patch+json",
            &json!({"metadata": {"annotations": {"i": i.to_string()}}}),
        );
    }
    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={start_rv}"));
    assert_eq!(w.next().unwrap()["object"]["code"], 410);
}

#[test]
fn conflicts_and_uid_preconditions() {
    let server = start();
    let c = Client::new(&server);
    let (_, p) = c.post(PODS, &pod("p", Some("n1")));
    let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
    assert_eq!(uid.len(), 36);

    // Stale resourceVersion on PUT.
    let mut stale = p.clone();
    c.patch(
        &format!("{PODS}/p"),
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"x": "1"}}}),
    );
    stale["metadata"]["annotations"] = json!({"a": "b"});
    let (s, body) = c.put(&format!("{PODS}/p"), &stale);
    assert_eq!(s, 409);
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["reason"], "Conflict");
    assert_eq!(body["details"]["name"], "p");
    assert_eq!(body["details"]["kind"], "pods");

    // Status PUT with a wrong uid: 409; with the right one and current RV: 200.
    let (_, cur) = c.get(&format!("{PODS}/p"));
    let mut body = cur.clone();
    body["metadata"]["uid"] = json!("00000000-0000-4000-8000-000000000000");
    body["status"]["phase"] = json!("Running");
    let (s, err) = c.put(&format!("{PODS}/p/status"), &body);
    assert_eq!(s, 409);
    assert!(err["message"]
        .as_str()
        .unwrap()
        .contains("UID in precondition"));
    body["metadata"]["uid"] = json!(uid);
    body["metadata"]["resourceVersion"] = json!("0");
    let (s, err) = c.put(&format!("{PODS}/p/status"), &body);
    assert_eq!(
        (s, err["reason"].as_str()),
        (422, Some("Invalid")),
        "RV \"0\" is rejected"
    );
    body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
    body["spec"]["nodeName"] = json!("elsewhere");
    let (s, updated) = c.put(&format!("{PODS}/p/status"), &body);
    assert_eq!(s, 200);
    assert_eq!(updated["status"]["phase"], "Running");
    assert_eq!(
        updated["spec"]["nodeName"], "n1",
        "status writes ignore spec"
    );

    // Main-resource PUT ignores status and bumps generation on spec change.
    let mut main = updated.clone();
    main["status"]["phase"] = json!("Failed");
    main["spec"]["containers"][0]["image"] = json!("busybox:2");
    let (s, out) = c.put(&format!("{PODS}/p"), &main);
    assert_eq!(s, 200, "{out}");
    assert_eq!(out["status"]["phase"], "Running");
    assert_eq!(out["metadata"]["generation"], 2);

    // Patch with a uid precondition that does not match.
    let (s, _) = c.patch(
        &format!("{PODS}/p/status"),
        "application/strategic-merge-patch+json",
        &json!({"metadata": {"uid": "other"}, "status": {"phase": "Succeeded"}}),
    );
    assert_eq!(s, 409);

    // Delete with a mismatched uid precondition: 409 and the pod stays.
    let (s, err) = c.delete(&format!("{PODS}/p"), &json!({"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0, "preconditions": {"uid": "nope"}}));
    assert_eq!(s, 409);
    assert_eq!(err["reason"], "Conflict");
    assert!(server.get_pod("default", "p").is_some());
    let (s, _) = c.delete(
        &format!("{PODS}/p"),
        &json!({"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}),
    );
    assert_eq!(s, 200);
    assert!(server.get_pod("default", "p").is_none());
    let (s, err) = c.get(&format!("{PODS}/p"));
    assert_eq!(s, 404);
    assert_eq!(err["reason"], "NotFound");
    assert_eq!(err["message"], "pods \"p\" not found");
}

#[test]
fn graceful_delete_of_bound_pod_waits_for_grace_zero() {
    let server = start();
    let c = Client::new(&server);
    c.post(PODS, &pod("bound", Some("n1")));
    c.post(PODS, &pod("loose", None));
    let rv = server.resource_version();
    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={rv}"));

    let (s, marked) = c.delete(&format!("{PODS}/bound?gracePeriodSeconds=30"), &json!({}));
    assert_eq!(s, 200);
    assert!(marked["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(marked["metadata"]["deletionGracePeriodSeconds"], 30);
    let ev = w.next_change();
    assert_eq!(ev["type"], "MODIFIED");
    assert!(ev["object"]["metadata"]["deletionTimestamp"].is_string());
    assert!(server.get_pod("default", "bound").is_some());

    // The unscheduled pod goes at once even with a grace period.
    let (s, _) = c.delete(&format!("{PODS}/loose"), &json!({"gracePeriodSeconds": 30}));
    assert_eq!(s, 200);
    let ev = w.next_change();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("loose"))
    );

    // The kubelet confirms with grace 0.
    let (s, _) = c.delete(&format!("{PODS}/bound"), &json!({"gracePeriodSeconds": 0}));
    assert_eq!(s, 200);
    let ev = w.next_change();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("bound"))
    );
    assert!(server.pods().is_empty());
}

#[test]
fn patch_types_follow_the_api() {
    let server = start();
    let c = Client::new(&server);
    let mut p = pod("q", Some("n1"));
    p["metadata"]["annotations"] = json!({"keep": "1", "drop": "2"});
    c.post(PODS, &p);
    let path = format!("{PODS}/q/status");

    // Strategic merge: conditions merge by type, containerStatuses replace, null deletes.
    let (s, out) = c.patch(&path, "application/strategic-merge-patch+json", &json!({
        "metadata": {"annotations": {"drop": null, "new": "3"}},
        "status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}],
                   "containerStatuses": [{"name": "main", "ready": false, "restartCount": 0, "image": "busybox", "imageID": ""}]}}));
    assert_eq!(s, 200, "{out}");
    assert_eq!(
        out["metadata"]["annotations"],
        json!({"keep": "1", "new": "3"})
    );
    let (_, out) = c.patch(&path, "application/strategic-merge-patch+json", &json!({
        "status": {"conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0, "image": "busybox", "imageID": ""}]}}));
    let conds = out["status"]["conditions"].as_array().unwrap();
    assert_eq!(conds.len(), 2);
    assert_eq!(conds[0], json!({"type": "Ready", "status": "True"}));
    assert_eq!(out["status"]["containerStatuses"][0]["ready"], true);

    // Merge patch: lists replace wholly.
    let (_, out) = c.patch(
        &path,
        "application/merge-patch+json",
        &json!({"status": {"conditions": [{"type": "Initialized", "status": "True"}]}}),
    );
    assert_eq!(out["status"]["conditions"].as_array().unwrap().len(), 1);

    // JSON patch with a failing test op changes nothing.
    let before = server.resource_version();
    let (s, _) = c.patch(
        &path,
        "application/json-patch+json",
        &json!([{"op": "test", "path": "/status/phase", "value": "Nope"}]),
    );
    assert_eq!(s, 422);
    assert_eq!(server.resource_version(), before);

    // Unsupported patch type.
    let (s, body) = c.patch(&path, "application/apply-patch+yaml", &json!({}));
    assert_eq!(s, 415);
    assert_eq!(body["kind"], "Status");

    // A patch that changes nothing does not bump the version.
    let (_, again) = c.patch(
        &path,
        "application/merge-patch+json",
        &json!({"metadata": {"annotations": {"keep": "1"}}}),
    );
    assert_eq!(rv_of(&again), server.resource_version());
    assert_eq!(server.resource_version(), before);
}

#[test]
fn nodes_leases_events_and_namespaces() {
    let server = start();
    let c = Client::new(&server);
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {"type": "virtual-kubelet"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                   "capacity": {"cpu": "4", "pods": "110"}}});
    let (s, created) = c.post("/api/v1/nodes", &node);
    assert_eq!(s, 201);
    assert_eq!(
        created["status"]["capacity"]["pods"], "110",
        "nodes accept status on create"
    );
    let node_uid = created["metadata"]["uid"].as_str().unwrap().to_string();
    let (s, out) = c.patch(
        "/api/v1/nodes/n1/status",
        "application/strategic-merge-patch+json",
        &json!({
        "metadata": {"labels": {"extra": "x"}},
        "status": {"$setElementOrder/conditions": [{"type": "Ready"}, {"type": "DiskPressure"}],
                   "conditions": [{"type": "DiskPressure", "status": "False"}]}}),
    );
    assert_eq!(s, 200);
    assert_eq!(out["status"]["conditions"].as_array().unwrap().len(), 2);
    assert_eq!(out["metadata"]["labels"]["extra"], "x");
    assert_eq!(
        server.get_node("n1").unwrap().metadata.labels.unwrap()["extra"],
        "x"
    );

    let leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases";
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "n1", "namespace": "kube-node-lease",
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": node_uid}]},
        "spec": {"holderIdentity": "n1", "leaseDurationSeconds": 40, "renewTime": "2026-01-01T00:00:00Z"}});
    let (s, l) = c.post(leases, &lease);
    assert_eq!(s, 201, "{l}");
    assert_eq!(l["spec"]["renewTime"], "2026-01-01T00:00:00.000000Z");
    let mut renew = l.clone();
    renew["spec"]["renewTime"] = json!("2026-01-01T00:00:10.123456Z");
    let (s, l2) = c.put(&format!("{leases}/n1"), &renew);
    assert_eq!(s, 200);
    let (s, _) = c.put(&format!("{leases}/n1"), &renew);
    assert_eq!(s, 409, "the lease PUT with the old version conflicts");
    let stored = server.lease("n1").unwrap().spec.unwrap().renew_time;
    assert_eq!(
        serde_json::to_value(stored).unwrap(),
        json!("2026-01-01T00:00:10.123456Z")
    );
    assert_eq!(rv_of(&l2), server.resource_version());
    let mut bad = lease.clone();
    bad["metadata"]["name"] = json!("n2");
    bad["metadata"]["ownerReferences"][0]["uid"] = json!("");
    let (s, err) = c.post(leases, &bad);
    assert_eq!(s, 422);
    assert_eq!(err["reason"], "Invalid");

    let ev = json!({"metadata": {"name": "p.1", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": "p", "uid": "u"},
        "reason": "Started", "message": "hi", "type": "Normal", "count": 1,
        "source": {"component": "vk-cocoon", "host": "n1"}});
    assert_eq!(c.post("/api/v1/namespaces/default/events", &ev).0, 201);
    let (s, out) = c.patch(
        "/api/v1/namespaces/default/events/p.1",
        "application/strategic-merge-patch+json",
        &json!({"count": 2, "lastTimestamp": "2026-01-01T00:00:00Z"}),
    );
    assert_eq!(s, 200);
    assert_eq!(out["count"], 2);
    assert_eq!(server.events().len(), 1);
    let mut wrong_ns = ev.clone();
    wrong_ns["metadata"]["name"] = json!("p.2");
    wrong_ns["involvedObject"]["namespace"] = json!("other");
    assert_eq!(
        c.post("/api/v1/namespaces/default/events", &wrong_ns).0,
        422
    );

    // Namespaces appear implicitly.
    c.post("/api/v1/namespaces/team-a/pods", &pod("t", None));
    let (_, nss) = c.get("/api/v1/namespaces");
    let names: Vec<&str> = nss["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["metadata"]["name"].as_str())
        .collect();
    for want in ["default", "kube-node-lease", "team-a"] {
        assert!(names.contains(&want), "{names:?}");
    }
}

#[test]
fn reviews_answer_as_configured() {
    let server = start();
    server.add_token_user(
        "good",
        vk_cocoon::sandbox::apiserver::ReviewUser {
            username: "alice".into(),
            uid: "1".into(),
            groups: vec!["dev".into()],
        },
    );
    server.set_access_reviewer(|spec| {
        let allowed = spec["user"] == "alice";
        (allowed, format!("user {}", spec["user"]))
    });
    let c = Client::new(&server);
    let (s, tr) = c.post("/apis/authentication.k8s.io/v1/tokenreviews", &json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "good"}}));
    assert_eq!(s, 201);
    assert_eq!(tr["status"]["authenticated"], true);
    assert_eq!(tr["status"]["user"]["username"], "alice");
    let (_, tr) = c.post(
        "/apis/authentication.k8s.io/v1/tokenreviews",
        &json!({"spec": {"token": "bad"}}),
    );
    assert_eq!(tr["status"]["authenticated"], false);
    let (_, sar) = c.post(
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        &json!({"spec": {"user": "bob", "resourceAttributes": {"verb": "get"}}}),
    );
    assert_eq!(sar["status"]["allowed"], false);
    let (_, sar) = c.post(
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        &json!({"spec": {"user": "alice"}}),
    );
    assert_eq!(sar["status"]["allowed"], true);
}

#[test]
fn authentication_by_token_and_client_certificate() {
    let server = ApiServer::start(ApiServerOptions {
        tokens: TokenPolicy::Only(vec!["s3cret".into()]),
        ..Default::default()
    })
    .unwrap();
    let anon = Client::with(&server, None, None);
    let (s, body) = anon.get("/api/v1/pods");
    assert_eq!((s, body["reason"].as_str()), (401, Some("Unauthorized")));
    assert_eq!(anon.get("/version").0, 200, "/version is open");
    assert_eq!(
        Client::with(&server, Some("wrong".into()), None)
            .get("/api/v1/pods")
            .0,
        401
    );
    assert_eq!(
        Client::with(&server, Some("s3cret".into()), None)
            .get("/api/v1/pods")
            .0,
        200
    );
    let cert = server
        .issue_client_cert_with_groups("system:node:n1", &["system:nodes"])
        .unwrap();
    let by_cert = Client::with(&server, None, Some(cert));
    assert_eq!(by_cert.get("/api/v1/nodes").0, 200);
    let last = server.requests().pop().unwrap();
    assert_eq!(last.user, "system:node:n1");
    assert_eq!(last.verb, "list");
    assert_eq!(last.resource, "nodes");
    server.set_token_policy(TokenPolicy::Reject);
    assert_eq!(
        Client::with(&server, Some("s3cret".into()), None)
            .get("/api/v1/pods")
            .0,
        401
    );
}

#[test]
fn injected_errors_and_latency() {
    let server = start();
    let c = Client::new(&server);
    server.fail_next(
        1,
        FaultMatch::new("list", "pods"),
        Fault::TooManyRequests {
            retry_after_secs: 3,
        },
    );
    server.fail_next(1, FaultMatch::new("create", "pods"), Fault::InternalError);
    server.fail_next(1, FaultMatch::resource("pods/status"), Fault::Conflict);
    let (s, body, retry) = c.call("GET", "/api/v1/pods", None, None);
    assert_eq!((s, retry.as_deref()), (429, Some("3")));
    assert_eq!(body["reason"], "TooManyRequests");
    assert_eq!(c.get("/api/v1/pods").0, 200, "only the next one");
    let (s, body) = c.post(PODS, &pod("f", None));
    assert_eq!((s, body["reason"].as_str()), (500, Some("InternalError")));
    assert!(server.pods().is_empty(), "a failed create stored nothing");
    assert_eq!(c.post(PODS, &pod("f", None)).0, 201);
    let (s, body) = c.patch(
        &format!("{PODS}/f/status"),
        "application/merge-patch+json",
        &json!({}),
    );
    assert_eq!((s, body["reason"].as_str()), (409, Some("Conflict")));
    assert_eq!(server.faults_injected(), 3);

    server.set_latency(Duration::from_millis(200));
    let t = Instant::now();
    c.get("/version");
    assert!(t.elapsed() >= Duration::from_millis(200));
    server.clear_faults();
}

#[test]
fn watch_drops_and_injected_error_event() {
    let server = start();
    let c = Client::new(&server);
    c.post(PODS, &pod("w", Some("n1")));
    let rv = server.resource_version();
    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={rv}"));
    assert!(server.wait_for_watches(1, Duration::from_secs(5)));
    server.drop_watches();
    assert!(w.next().is_none(), "dropped watch ends");

    server.drop_watches_every(Some(Duration::from_millis(200)));
    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={rv}"));
    let t = Instant::now();
    assert!(w.next().is_none());
    assert!(t.elapsed() >= Duration::from_millis(150));
    server.drop_watches_every(None);

    server.fail_next(1, FaultMatch::new("watch", "pods"), Fault::GoneEvent);
    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={rv}"));
    let ev = w.next().unwrap();
    assert_eq!(
        (ev["type"].as_str(), ev["object"]["code"].as_i64()),
        (Some("ERROR"), Some(410))
    );
}

#[test]
fn stop_and_restart_keep_data_and_port() {
    let server = start();
    let c = Client::new(&server);
    c.post(PODS, &pod("keep", Some("n1")));
    let rv = server.resource_version();
    let mut w = c.watch(&format!("/api/v1/pods?watch=1&resourceVersion={rv}"));
    assert!(server.wait_for_watches(1, Duration::from_secs(5)));
    server.stop();
    assert!(w.next().is_none(), "stop cuts open watches");
    let refused = c.send(c.req("GET", "/version"));
    assert!(refused.is_err(), "nothing listens while stopped");
    server.restart().unwrap();
    let (s, p) = c.get(&format!("{PODS}/keep"));
    assert_eq!(s, 200);
    assert_eq!(p["metadata"]["name"], "keep");
    assert_eq!(server.resource_version(), rv);
}

#[test]
fn paging_with_limit_and_continue() {
    let server = start();
    let c = Client::new(&server);
    for i in 0..5 {
        c.post(PODS, &pod(&format!("p{i}"), None));
    }
    let (_, first) = c.get(&format!("{PODS}?limit=2"));
    assert_eq!(first["items"].as_array().unwrap().len(), 2);
    assert_eq!(first["metadata"]["remainingItemCount"], 3);
    let mut names: Vec<String> = Vec::new();
    let mut page = first;
    loop {
        names.extend(
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["metadata"]["name"].as_str().unwrap().to_string()),
        );
        let Some(token) = page["metadata"]["continue"].as_str().map(str::to_string) else {
            break;
        };
        page = c.get(&format!("{PODS}?limit=2&continue={token}")).1;
    }
    assert_eq!(names, vec!["p0", "p1", "p2", "p3", "p4"]);
}

#[test]
fn the_rbac_knob_forbids_requests_and_answers_self_subject_access_reviews() {
    let server = start();
    let c = Client::new(&server);
    assert_eq!(c.post(PODS, &pod("a", Some("n1"))).0, 201);
    server.deny("patch", "pods/status");
    let (s, body) = c.patch(
        &format!("{PODS}/a/status"),
        "application/merge-patch+json",
        &json!({"status": {"phase": "Running"}}),
    );
    assert_eq!(s, 403, "{body}");
    assert_eq!(body["reason"], "Forbidden");
    let msg = body["message"].as_str().unwrap();
    assert!(
        msg.contains("cannot patch resource \"pods/status\"")
            && msg.contains("namespace \"default\""),
        "{msg}"
    );
    // Other verbs and the main resource are untouched.
    let (s, _) = c.patch(
        &format!("{PODS}/a"),
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"x": "y"}}}),
    );
    assert_eq!(s, 200);
    let review = |verb: &str, sub: &str| {
        let (s, v) = c.post(
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            &json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": {"verb": verb, "resource": "pods", "subresource": sub}}}),
        );
        assert_eq!(s, 201, "{v}");
        assert_eq!(v["kind"], "SelfSubjectAccessReview");
        v["status"]["allowed"].as_bool().unwrap()
    };
    assert!(!review("patch", "status"));
    assert!(review("get", "status"));
    assert!(review("patch", ""));
}
