//! The fake API server against the real kubectl: discovery, tables, -o yaml, leases, events,
//! delete. Skipped with a printed reason when /usr/bin/kubectl is missing.

use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, KubeconfigAuth};

const KUBECTL: &str = "/usr/bin/kubectl";

struct Kubectl {
    kubeconfig: PathBuf,
    dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(server: &ApiServerHandle, auth: KubeconfigAuth) -> Option<Kubectl> {
        if !Path::new(KUBECTL).exists() {
            eprintln!("skipping: {KUBECTL} is not installed");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        server.write_kubeconfig(&kubeconfig, &auth).unwrap();
        Some(Kubectl { kubeconfig, dir })
    }

    /// (exit ok, stdout, stderr)
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(KUBECTL)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .arg("--request-timeout=20s")
            .args(args)
            .env("HOME", self.dir.path())
            .env_remove("KUBECONFIG")
            .output()
            .expect("run kubectl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.run(args);
        assert!(ok, "kubectl {args:?} failed:\n{stdout}\n{stderr}");
        stdout
    }
}

fn seed(server: &ApiServerHandle) {
    server
        .create_object(
            "nodes",
            "",
            json!({"metadata": {"name": "cocoon-1", "labels": {"kubernetes.io/role": "agent"}},
                   "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                              "addresses": [{"type": "InternalIP", "address": "10.1.2.3"}],
                              "nodeInfo": {"kubeletVersion": "v1.32.0-vk-cocoon", "osImage": "cocoon", "kernelVersion": "6.1",
                                           "containerRuntimeVersion": "cocoon://1", "architecture": "amd64", "operatingSystem": "linux",
                                           "bootID": "", "machineID": "", "systemUUID": "", "kubeProxyVersion": ""}}}),
        )
        .unwrap();
    server
        .create_object(
            "pods",
            "default",
            json!({"metadata": {"name": "web-1"},
                   "spec": {"nodeName": "cocoon-1", "containers": [{"name": "web", "image": "nginx"}]}}),
        )
        .unwrap();
    server
        .create_object(
            "pods",
            "team-a",
            json!({"metadata": {"name": "job-1"}, "spec": {"containers": [{"name": "job", "image": "busybox"}]}}),
        )
        .unwrap();
    server
        .create_object(
            "leases",
            "kube-node-lease",
            json!({"metadata": {"name": "cocoon-1"},
                   "spec": {"holderIdentity": "cocoon-1", "leaseDurationSeconds": 40, "renewTime": "2026-01-01T00:00:00.000000Z"}}),
        )
        .unwrap();
    server
        .create_object(
            "events",
            "default",
            json!({"metadata": {"name": "web-1.abc"},
                   "involvedObject": {"kind": "Pod", "namespace": "default", "name": "web-1", "uid": "x"},
                   "reason": "Started", "message": "Started cocoon VM", "type": "Normal", "count": 1,
                   "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
                   "source": {"component": "vk-cocoon", "host": "cocoon-1"}}),
        )
        .unwrap();
}

#[test]
fn kubectl_reads_and_deletes_through_the_fake() {
    let server = ApiServer::start(ApiServerOptions::default()).unwrap();
    let Some(k) = Kubectl::new(&server, KubeconfigAuth::Token("kubectl-token".into())) else {
        return;
    };
    seed(&server);

    let out = k.ok(&["get", "nodes,pods", "-A", "-o", "wide"]);
    eprintln!("{out}");
    assert!(out.contains("cocoon-1"), "{out}");
    assert!(out.contains("Ready"), "{out}");
    assert!(out.contains("10.1.2.3"), "{out}");
    assert!(out.contains("web-1") && out.contains("job-1"), "{out}");
    assert!(out.contains("team-a"), "namespace column: {out}");

    let out = k.ok(&["get", "leases", "-n", "kube-node-lease"]);
    assert!(out.contains("cocoon-1"), "{out}");

    let out = k.ok(&["get", "events"]);
    eprintln!("{out}");
    assert!(out.contains("Started cocoon VM"), "{out}");

    let out = k.ok(&["get", "pod", "web-1", "-o", "yaml"]);
    assert!(out.contains("nodeName: cocoon-1"), "{out}");
    assert!(out.contains("uid:"), "{out}");

    let out = k.ok(&["get", "node", "cocoon-1", "-o", "json"]);
    let node: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(node["status"]["conditions"][0]["status"], "True");

    // A bound pod is only marked; kubectl --wait=false returns at once.
    let out = k.ok(&["delete", "pod", "web-1", "--wait=false"]);
    assert!(out.contains("deleted"), "{out}");
    let pod = server.get_pod("default", "web-1").unwrap();
    assert!(pod.metadata.deletion_timestamp.is_some());
    // The unbound one is removed.
    k.ok(&["delete", "pod", "job-1", "-n", "team-a", "--wait=false"]);
    assert!(server.get_pod("team-a", "job-1").is_none());

    let (ok, _, stderr) = k.run(&["get", "pod", "nope"]);
    assert!(!ok);
    assert!(
        stderr.contains("NotFound") || stderr.contains("not found"),
        "{stderr}"
    );
}

#[test]
fn kubectl_with_a_client_certificate() {
    let server = ApiServer::start(ApiServerOptions::default()).unwrap();
    let auth = KubeconfigAuth::ClientCert {
        user: "admin".into(),
        groups: vec!["system:masters".into()],
    };
    let Some(k) = Kubectl::new(&server, auth) else {
        return;
    };
    seed(&server);
    let out = k.ok(&["get", "nodes"]);
    assert!(out.contains("cocoon-1"), "{out}");
    assert!(server.requests().iter().any(|r| r.user == "admin"));
}

#[test]
fn kubectl_create_apply_label_and_watch() {
    let server = ApiServer::start(ApiServerOptions::default()).unwrap();
    let Some(k) = Kubectl::new(&server, KubeconfigAuth::Token("t".into())) else {
        return;
    };
    seed(&server);
    let manifest = k.dir.path().join("pod.yaml");
    let write = |image: &str| {
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: made\nspec:\n  nodeName: cocoon-1\n  containers:\n  - name: c\n    image: {image}\n"
            ),
        )
        .unwrap()
    };
    write("nginx:1");
    let manifest_arg = manifest.to_string_lossy().to_string();
    k.ok(&["create", "-f", &manifest_arg]);
    write("nginx:2");
    k.ok(&["apply", "-f", &manifest_arg]);
    k.ok(&["label", "pod", "made", "tier=web"]);
    k.ok(&["annotate", "pod", "made", "note=hi"]);
    let pod = server.get_pod("default", "made").unwrap();
    assert_eq!(
        pod.spec.unwrap().containers[0].image.as_deref(),
        Some("nginx:2")
    );
    let md = pod.metadata;
    assert_eq!(md.labels.unwrap()["tier"], "web");
    assert_eq!(md.annotations.unwrap()["note"], "hi");

    // get -w prints the header once and a row per change.
    let child = Command::new(KUBECTL)
        .arg("--kubeconfig")
        .arg(&k.kubeconfig)
        .arg("--cache-dir")
        .arg(k.dir.path().join("cache"))
        .args(["get", "pods", "-w", "--request-timeout=3s"])
        .env("HOME", k.dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    assert!(server.wait_for_watches(1, std::time::Duration::from_secs(20)));
    k.ok(&["annotate", "pod", "made", "note=again", "--overwrite"]);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("NAME").count(), 1, "{stdout}");
    assert!(stdout.matches("made").count() >= 2, "{stdout}");
    assert!(stdout.contains("READY"), "table columns in watch: {stdout}");
}
