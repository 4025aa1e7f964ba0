//! Benchmark (ignored by default): pod watch decoding throughput, bytes in to typed events out.
//! Run: cargo test --release --test benches kube_bench -- --ignored --nocapture

use std::time::Instant;

use vk_cocoon::kube::watch::{decode_line, KnownPods, PodEvent, StreamDecoder};

/// A realistic bound pod (about 3 KB of JSON), as the API server sends it in watch events.
fn pod_json(i: usize, rv: usize) -> String {
    serde_json::json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": format!("vm-{i}"), "namespace": "tenant-a", "uid": format!("0f6c1b2a-1111-4c4c-9e9e-{i:012}"),
            "resourceVersion": rv.to_string(), "generation": 1, "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "desktop", "cocoonstack.io/pool": "default", "pod-template-hash": "7d9f8c6b5"},
            "annotations": {
                "vm.cocoonstack.io/id": format!("vm-{i:08x}"), "vm.cocoonstack.io/ip": "10.88.1.23",
                "vm.cocoonstack.io/image": "registry.local/win11:2026-01", "cocoonstack.io/hibernate": "false",
                "kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"v1\",\"kind\":\"Pod\"}"
            },
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "desktop-7d9f8c6b5", "uid": "aa-bb-cc", "controller": true, "blockOwnerDeletion": true}],
            "finalizers": ["cocoonstack.io/vm"]
        },
        "spec": {
            "nodeName": "cocoon-pool", "restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
            "serviceAccountName": "default", "schedulerName": "default-scheduler", "priority": 0,
            "containers": [{
                "name": "agent", "image": "registry.local/win11:2026-01", "imagePullPolicy": "IfNotPresent",
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "two"}, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "resources": {"limits": {"cpu": "4", "memory": "8Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}},
                "ports": [{"containerPort": 3389, "protocol": "TCP"}],
                "readinessProbe": {"tcpSocket": {"port": 3389}, "periodSeconds": 5},
                "volumeMounts": [{"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"
            }],
            "tolerations": [
                {"key": "virtual-kubelet.io/provider", "operator": "Equal", "value": "cocoon", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            ],
            "volumes": [{"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [{"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}]
        },
        "status": {
            "phase": "Running", "podIP": "10.88.1.23", "podIPs": [{"ip": "10.88.1.23"}], "hostIP": "10.0.0.5",
            "startTime": "2026-01-01T00:00:01Z", "qosClass": "Burstable",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-01-01T00:00:01Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:09Z"},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-01-01T00:00:09Z"},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ],
            "containerStatuses": [{"name": "agent", "ready": true, "restartCount": 0, "image": "registry.local/win11:2026-01",
                "imageID": "sha256:abc", "containerID": "cocoon://vm-1", "started": true,
                "state": {"running": {"startedAt": "2026-01-01T00:00:05Z"}}}]
        }
    })
    .to_string()
}

#[test]
#[ignore = "benchmark; run with --ignored --nocapture (release build)"]
fn watch_decoding_throughput() {
    const N: usize = 20_000;
    let mut stream = Vec::new();
    for i in 0..N {
        let kind = if i % 4 == 0 { "ADDED" } else { "MODIFIED" };
        let line = format!(
            "{{\"type\":\"{kind}\",\"object\":{}}}\n",
            pod_json(i % 500, i + 1)
        );
        // One chunk per event, as the API server writes them.
        stream.extend_from_slice(format!("{:x}\r\n", line.len()).as_bytes());
        stream.extend_from_slice(line.as_bytes());
        stream.extend_from_slice(b"\r\n");
    }
    let bytes = stream.len();
    // Feed in 16 KiB reads, as a TLS reader hands them over.
    let mut best_decode = f64::MAX;
    let mut best_apply = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let mut dec = StreamDecoder::new(true);
        let mut events = Vec::with_capacity(N);
        for piece in stream.chunks(16 * 1024) {
            dec.feed(piece, &mut |l| events.push(decode_line(l)))
                .unwrap();
        }
        let decode = t.elapsed().as_secs_f64();
        assert_eq!(events.len(), N);
        let mut known = KnownPods::default();
        let mut out = Vec::new();
        for e in events {
            match e.unwrap() {
                PodEvent::Added(p) | PodEvent::Modified(p) => known.upsert(p, &mut out),
                other => panic!("unexpected {other:?}"),
            }
        }
        let total = t.elapsed().as_secs_f64();
        assert_eq!(known.len(), 500);
        best_decode = best_decode.min(decode);
        best_apply = best_apply.min(total);
    }
    println!(
        "watch decode: {N} pod events, {:.1} MB: decode {:.0} events/s ({:.0} MB/s); decode+apply to known set {:.0} events/s",
        bytes as f64 / 1e6,
        N as f64 / best_decode,
        bytes as f64 / 1e6 / best_decode,
        N as f64 / best_apply
    );
    assert!(N as f64 / best_decode > 1000.0);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[test]
#[ignore = "benchmark; run with --ignored --nocapture (needs /usr/bin/curl)"]
fn api_call_latency_vs_curl() {
    use std::time::Duration;
    use vk_cocoon::kube::{Client, KubeOptions};
    use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerOptions, KubeconfigAuth};

    if !std::path::Path::new("/usr/bin/curl").exists() {
        eprintln!("skipping: /usr/bin/curl is absent");
        return;
    }
    const N: usize = 300;
    let api = ApiServer::start(ApiServerOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kc, &KubeconfigAuth::Token("bench".into()))
        .unwrap();
    let client = Client::from_env(&KubeOptions {
        kubeconfig: Some(kc.to_string_lossy().into_owned()),
        timeout: Duration::from_secs(5),
        qps: 0.0,
        ..KubeOptions::default()
    })
    .unwrap();
    let _ = client.get_node("absent");
    // Our client: one kept-alive connection, N GETs of a missing node (404 path, small body).
    let mut ours = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        assert!(client.get_node("absent").unwrap_err().is_not_found());
        ours.push(t.elapsed().as_secs_f64());
    }
    // curl: one process, N URLs on one kept-alive connection, per-transfer time_total.
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, api.ca_pem()).unwrap();
    let url = format!("{}/api/v1/nodes/absent", api.url());
    let mut args: Vec<String> = vec![
        "-s".into(),
        "--cacert".into(),
        ca.to_string_lossy().into_owned(),
        "-H".into(),
        "Authorization: Bearer bench".into(),
        "-H".into(),
        "Accept: application/json".into(),
    ];
    for _ in 0..N + 1 {
        args.extend([
            "-o".into(),
            "/dev/null".into(),
            "-w".into(),
            "%{time_total}\\n".into(),
            url.clone(),
        ]);
    }
    let out = std::process::Command::new("/usr/bin/curl")
        .args(&args)
        .output()
        .unwrap();
    assert!(out.status.success());
    let curl: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1) // the first transfer pays the TLS handshake
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(curl.len(), N);
    let (o, c) = (median(ours) * 1e6, median(curl) * 1e6);
    println!("API GET latency (median of {N}, kept-alive): vk-cocoon client {o:.0} us, curl {c:.0} us, overhead {:.0} us", o - c);
}
