//! NodeAgent against the fake API server: registration with every field, kubectl sees it Ready,
//! the Lease renews, an existing node is updated (not recreated), an API outage is survived, and
//! the storage allocatable follows the root filesystem's free space.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vk_cocoon::kube::{Client, KubeOptions};
use vk_cocoon::node::{
    compute_resources, storage_allocatable, HostFacts, NodeAgent, NodeOptions, CPU_CLASS_LABEL,
    LEASE_NAMESPACE, STORAGE_REFRESH,
};
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, KubeconfigAuth};

fn node_opts(name: &str) -> NodeOptions {
    NodeOptions {
        name: name.into(),
        ip: "10.20.30.40".parse().unwrap(),
        pool: "pool-a".into(),
        snapshot_cpu_class: Some("skylake".into()),
        provider_id: Some("cocoon://host-1".into()),
        kubelet_port: 10250,
        version: "v0.1.0-test".into(),
        root_dir: PathBuf::from("/"),
        reserve_percent: 20,
        cpu: Some("16".into()),
        mem: None,
        storage: None,
        hugepages: None,
        pods: "256".into(),
    }
}

fn setup() -> (ApiServerHandle, tempfile::TempDir, PathBuf, Client) {
    let api = ApiServer::start(ApiServerOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kc, &KubeconfigAuth::Token("t".into()))
        .unwrap();
    let client = Client::from_env(&KubeOptions {
        kubeconfig: Some(kc.to_string_lossy().into_owned()),
        timeout: Duration::from_secs(2),
        ..KubeOptions::default()
    })
    .unwrap();
    (api, dir, kc, client)
}

fn agent(o: NodeOptions) -> NodeAgent {
    let host = HostFacts::read(Path::new("/")).unwrap();
    let r = compute_resources(&o, &host).unwrap();
    NodeAgent::new(o, r, Instant::now())
}

#[test]
fn registers_node_with_every_field_and_kubectl_sees_it_ready() {
    let (api, _dir, kc, client) = setup();
    let mut a = agent(node_opts("cocoon-1"));
    let t0 = Instant::now();
    assert!(a.next_due() <= t0);
    a.tick(&client, t0);
    assert!(a.registered());
    let n = serde_json::to_value(api.get_node("cocoon-1").expect("node created")).unwrap();
    let l = &n["metadata"]["labels"];
    assert_eq!(l["cocoonstack.io/pool"], "pool-a");
    assert_eq!(l["node-role.kubernetes.io/cocoon-vm"], "");
    assert_eq!(l["cocoonstack.io/snapshot-cpu-class"], "skylake");
    assert_eq!(l["type"], "virtual-kubelet");
    assert_eq!(l["kubernetes.io/role"], "agent");
    assert_eq!(l["kubernetes.io/hostname"], "cocoon-1");
    assert_eq!(
        n["spec"]["taints"][0],
        serde_json::json!({"key":"virtual-kubelet.io/provider","value":"cocoon","effect":"NoSchedule"})
    );
    assert_eq!(n["spec"]["providerID"], "cocoon://host-1");
    let s = &n["status"];
    assert_eq!(s["capacity"]["cpu"], "16");
    assert_eq!(s["allocatable"]["cpu"], "12");
    assert_eq!(s["capacity"]["pods"], "256");
    assert_eq!(s["allocatable"]["pods"], "256");
    assert!(s["capacity"]["memory"]
        .as_str()
        .is_some_and(|m| m.parse::<u64>().unwrap() > 0));
    assert!(s["capacity"]["ephemeral-storage"].is_string());
    assert_eq!(s["daemonEndpoints"]["kubeletEndpoint"]["Port"], 10250);
    assert_eq!(s["nodeInfo"]["kubeletVersion"], "v0.1.0-test");
    let addrs = s["addresses"].as_array().unwrap();
    assert!(addrs.contains(&serde_json::json!({"type":"InternalIP","address":"10.20.30.40"})));
    assert!(addrs.contains(&serde_json::json!({"type":"Hostname","address":"cocoon-1"})));
    let conds = s["conditions"].as_array().unwrap();
    let ready = conds.iter().find(|c| c["type"] == "Ready").unwrap();
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("True"), Some("KubeletReady"))
    );
    for kind in [
        "DiskPressure",
        "MemoryPressure",
        "PIDPressure",
        "NetworkUnavailable",
    ] {
        assert!(
            conds
                .iter()
                .any(|c| c["type"] == kind && c["status"] == "False"),
            "{kind}"
        );
    }
    // The lease exists with its owner reference.
    let lease = serde_json::to_value(
        api.leases()
            .into_iter()
            .find(|l| l.metadata.name.as_deref() == Some("cocoon-1"))
            .expect("lease"),
    )
    .unwrap();
    assert_eq!(lease["metadata"]["namespace"], LEASE_NAMESPACE);
    assert_eq!(lease["spec"]["holderIdentity"], "cocoon-1");
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 40);
    assert_eq!(
        lease["metadata"]["ownerReferences"][0]["uid"],
        n["metadata"]["uid"]
    );

    let kubectl = Path::new("/usr/bin/kubectl");
    if !kubectl.exists() {
        eprintln!("skipping kubectl check: /usr/bin/kubectl is absent");
        return;
    }
    let out = std::process::Command::new(kubectl)
        .args([
            "--kubeconfig",
            &kc.to_string_lossy(),
            "get",
            "node",
            "cocoon-1",
            "--no-headers",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cols: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(cols.first().copied(), Some("cocoon-1"), "{text}");
    assert_eq!(cols.get(1).copied(), Some("Ready"), "{text}");
}

#[test]
fn lease_renews_and_status_refreshes_on_schedule() {
    let (api, _dir, _kc, client) = setup();
    let mut a = agent(node_opts("cocoon-2"));
    let t0 = Instant::now();
    a.tick(&client, t0);
    let renew = |api: &ApiServerHandle| {
        let l = api
            .leases()
            .into_iter()
            .find(|l| l.metadata.name.as_deref() == Some("cocoon-2"))
            .unwrap();
        (
            l.metadata.resource_version.clone(),
            l.spec.and_then(|s| s.renew_time),
        )
    };
    let (rv1, t1) = renew(&api);
    assert_eq!(
        a.next_due(),
        t0 + Duration::from_secs(10),
        "next lease renewal in 10 s"
    );
    std::thread::sleep(Duration::from_millis(5)); // renewTime has microsecond resolution
    a.tick(&client, t0 + Duration::from_secs(10));
    let (rv2, t2) = renew(&api);
    assert_ne!(rv1, rv2);
    assert!(t2 > t1, "renewTime advanced");
    assert_eq!(a.stats.lease_renewals, 2);
    assert_eq!(a.stats.status_updates, 0);
    // Status patch is due 60 s after registration.
    let mut now = t0 + Duration::from_secs(10);
    while now < t0 + Duration::from_secs(61) {
        now = a.next_due();
        a.tick(&client, now);
    }
    assert_eq!(a.stats.status_updates, 1);
    assert_eq!(a.stats.failures, 0);
}

#[test]
fn existing_node_is_updated_not_recreated() {
    let (api, _dir, _kc, client) = setup();
    // A node someone else created, with a stale CPU class label and a foreign label.
    let mut first = agent(node_opts("cocoon-3"));
    first.tick(&client, Instant::now());
    let uid = api.get_node("cocoon-3").unwrap().metadata.uid;
    // Someone else's label and taint, and a field newer than this build's Node type (a
    // whole-object write of the typed Node would drop it), with our taint gone.
    api.edit_object("nodes", "", "cocoon-3", |v| {
        v["metadata"]["labels"]["team"] = "x".into();
        v["spec"]["taints"] =
            serde_json::json!([{"key": "team", "value": "x", "effect": "NoExecute"}]);
        v["spec"]["aFieldFromANewerRelease"] = "kept".into();
    })
    .unwrap();
    api.clear_requests();
    let mut o = node_opts("cocoon-3");
    o.snapshot_cpu_class = None;
    o.pool = "pool-b".into();
    let mut second = agent(o);
    second.tick(&client, Instant::now());
    let n = api.get_node("cocoon-3").unwrap();
    assert_eq!(n.metadata.uid, uid, "same node object");
    let labels = n.metadata.labels.unwrap();
    assert_eq!(
        labels.get("cocoonstack.io/pool").map(String::as_str),
        Some("pool-b")
    );
    assert_eq!(labels.get("team").map(String::as_str), Some("x"));
    assert!(!labels.contains_key(CPU_CLASS_LABEL));
    let v = api.get_object("nodes", "", "cocoon-3").unwrap();
    assert_eq!(v["spec"]["aFieldFromANewerRelease"], "kept");
    let taints: Vec<&str> = v["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["key"].as_str())
        .collect();
    assert_eq!(taints, ["team", "virtual-kubelet.io/provider"]);
    let writes: Vec<(String, Option<String>)> = api
        .requests()
        .into_iter()
        .filter(|r| r.resource == "nodes" && r.method != "GET")
        .map(|r| (r.method, r.content_type))
        .collect();
    assert_eq!(
        writes,
        [(
            "PATCH".to_string(),
            Some("application/merge-patch+json".to_string())
        )],
        "one merge patch, no PUT of the node"
    );
}

#[test]
fn a_taint_added_between_read_and_patch_is_not_lost() {
    let (api, _dir, _kc, client) = setup();
    let mut first = agent(node_opts("cocoon-5"));
    first.tick(&client, Instant::now());
    api.edit_object("nodes", "", "cocoon-5", |v| {
        v["spec"]["taints"] = serde_json::json!([]);
    })
    .unwrap();
    // The first merge patch carries a stale resourceVersion: the server answers 409, the
    // agent reads again and patches with the taint that arrived in between.
    let stale = serde_json::to_value(api.get_node("cocoon-5").unwrap()).unwrap();
    api.edit_object("nodes", "", "cocoon-5", |v| {
        v["spec"]["taints"] = serde_json::json!([{"key": "late", "effect": "NoSchedule"}]);
    })
    .unwrap();
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(stale).unwrap();
    let patch = vk_cocoon::node::node_patch(&node, &node_opts("cocoon-5")).unwrap();
    let err = client.patch_node("cocoon-5", &patch).unwrap_err();
    assert!(err.is_conflict(), "{err}");
    let mut second = agent(node_opts("cocoon-5"));
    second.tick(&client, Instant::now());
    let v = api.get_object("nodes", "", "cocoon-5").unwrap();
    let taints: Vec<&str> = v["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["key"].as_str())
        .collect();
    assert_eq!(taints, ["late", "virtual-kubelet.io/provider"]);
}

#[test]
fn api_outage_of_60_seconds_is_survived() {
    let (api, _dir, _kc, client) = setup();
    let mut a = agent(node_opts("cocoon-4"));
    let t0 = Instant::now();
    a.tick(&client, t0);
    assert!(a.registered());
    api.stop();
    let real = Instant::now();
    // 60 s of the agent's schedule with the API gone: every due call fails fast and backs off.
    let mut now = t0;
    let mut ticks = 0;
    while now < t0 + Duration::from_secs(60) {
        now = a.next_due().max(now);
        a.tick(&client, now);
        ticks += 1;
        assert!(ticks < 1000, "backoff keeps the call rate bounded");
    }
    assert!(a.stats.failures >= 5, "{:?}", a.stats);
    assert!(
        real.elapsed() < Duration::from_secs(30),
        "no call wedged the agent"
    );
    // Backoff is capped (lease renew: 7 s), so the agent comes back within seconds.
    assert!(a.next_due() <= now + Duration::from_secs(7));
    api.restart().unwrap();
    api.clear_requests();
    let before = a.stats.lease_renewals;
    let lease_rv = |api: &ApiServerHandle| {
        api.leases()
            .into_iter()
            .find(|l| l.metadata.name.as_deref() == Some("cocoon-4"))
            .and_then(|l| l.metadata.resource_version)
    };
    let rv_before = lease_rv(&api);
    // The lease is retried within its capped (and jittered) backoff and succeeds.
    let back = now;
    let renewed_at = loop {
        let due = a.next_due().max(now);
        assert!(
            due < back + Duration::from_secs(8),
            "the lease is retried within its 7 s cap: {:?}",
            a.stats
        );
        a.tick(&client, due);
        now = due;
        if a.stats.lease_renewals > before {
            break due;
        }
    };
    // The other items due meanwhile (status refresh retries) succeed too, and the lease stays
    // on its 10 s cadence from that renewal.
    for _ in 0..10 {
        if a.next_due() >= renewed_at + Duration::from_secs(10) {
            break;
        }
        let due = a.next_due().max(now);
        a.tick(&client, due);
        now = due;
    }
    assert_eq!(
        a.stats.lease_renewals,
        before + 1,
        "heartbeats resume: {:?}",
        a.stats
    );
    assert!(
        a.next_due() >= renewed_at + Duration::from_secs(10),
        "back on the normal cadence"
    );
    assert_ne!(lease_rv(&api), rv_before);
    // The server came back with its data: the lease cached before the outage is renewed with
    // the one PUT, no GET first (every node of a fleet would add one at the worst moment).
    let lease_calls: Vec<String> = api
        .requests()
        .iter()
        .filter(|r| r.resource == "leases")
        .map(|r| format!("{} {}", r.verb, r.status))
        .collect();
    assert_eq!(lease_calls, ["update 200"], "lease calls after the outage");
}

fn allocatable(api: &ApiServerHandle, name: &str, key: &str) -> String {
    let n = api.get_node(name).unwrap();
    n.status.unwrap().allocatable.unwrap()[key].0.clone()
}

#[test]
fn storage_allocatable_is_recomputed_every_minute_and_pushed() {
    let (api, _dir, _kc, client) = setup();
    let o = node_opts("cocoon-st");
    // Start from a host that had 1 TiB free: whatever the disk really has now differs.
    let mut host = HostFacts::read(Path::new("/")).unwrap();
    host.fs_avail_bytes = 1 << 40;
    let r = compute_resources(&o, &host).unwrap();
    let t0 = Instant::now();
    let mut a = NodeAgent::new(o.clone(), r, t0);
    a.tick(&client, t0);
    assert_eq!(
        allocatable(&api, "cocoon-st", "ephemeral-storage"),
        (((1u64 << 40) * 80) / 100).to_string()
    );
    assert!(a.next_due() <= t0 + STORAGE_REFRESH);
    let mut now = t0;
    while now < t0 + STORAGE_REFRESH {
        now = a.next_due();
        a.tick(&client, now);
    }
    let fs = rustix::fs::statvfs("/").unwrap();
    let expect: u64 = storage_allocatable(&o, fs.f_bavail * fs.f_bsize)
        .unwrap()
        .0
        .parse()
        .unwrap();
    let got: u64 = allocatable(&api, "cocoon-st", "ephemeral-storage")
        .parse()
        .unwrap();
    // Other processes write to the disk meanwhile: equal to within 1 GiB.
    assert!(
        got.abs_diff(expect) < 1 << 30,
        "got {got}, statfs says {expect}"
    );
    assert_ne!(got, ((1u64 << 40) * 80) / 100);
    // CPU stays at its startup value.
    assert_eq!(allocatable(&api, "cocoon-st", "cpu"), "12");
}

#[test]
fn an_overridden_storage_is_never_recomputed() {
    let mut o = node_opts("cocoon-so");
    o.storage = Some("100Gi".into());
    assert_eq!(storage_allocatable(&o, 5), None);
    let (api, _dir, _kc, client) = setup();
    let mut a = agent(o);
    let t0 = Instant::now();
    a.tick(&client, t0);
    let before = allocatable(&api, "cocoon-so", "ephemeral-storage");
    let mut now = t0;
    while now < t0 + STORAGE_REFRESH * 2 {
        now = a.next_due();
        a.tick(&client, now);
    }
    assert_eq!(allocatable(&api, "cocoon-so", "ephemeral-storage"), before);
    assert_eq!(before, (100u64 * (1 << 30) * 80 / 100).to_string());
}
