//! `vk-cocoon check-config` as operators run it: the resolved settings with their sources,
//! certificate names and dates (rcgen certificates with wrong SANs and short lives), and
//! `--online` against the fake API server with one verb denied and a real registry with
//! basic auth. Traffic goes to loopback only.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::registry_support::Registry;
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, KubeconfigAuth};

const BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon");

/// check-config with a harmless environment under `dir` plus `extra`.
fn check(dir: &Path, args: &[&str], extra: &[(&str, String)]) -> (Option<i32>, String) {
    let cocoon = dir.join("cocoon");
    if !cocoon.exists() {
        std::fs::write(&cocoon, "").unwrap();
    }
    std::fs::create_dir_all(dir.join("root")).unwrap();
    let d = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", d("home"))
        .env("OCI_REGISTRY", "127.0.0.1:1/vk")
        .env("KUBECONFIG", d("kubeconfig"))
        .env("VK_NODE_NAME", "node-1")
        .env("VK_NODE_IP", "10.0.0.5")
        .env("VK_TLS_CERT", d("tls.crt"))
        .env("VK_TLS_KEY", d("tls.key"))
        .env("VK_STATE_DIR", d("state"))
        .env("COCOON_ROOT_DIR", d("root"))
        .env("VK_COCOON_BIN", d("cocoon"))
        .arg("check-config")
        .args(args);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out: Output = cmd.output().expect("the binary runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// A self-signed serving pair valid from `from` to `to` days around now, naming `sans`.
fn write_pair(dir: &Path, sans: &[&str], from: i64, to: i64) {
    let now = std::time::SystemTime::now();
    let at = |days: i64| {
        let d = Duration::from_secs(days.unsigned_abs() * 86_400);
        let t = if days < 0 { now - d } else { now + d };
        let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        rcgen::date_time_ymd(1970, 1, 1) + Duration::from_secs(secs as u64)
    };
    let mut p =
        rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
    p.not_before = at(from);
    p.not_after = at(to);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
}

/// An API server and, in `dir/kubeconfig`, node-1's client-certificate kubeconfig for it.
fn node_kubeconfig(dir: &Path) -> ApiServerHandle {
    let api = ApiServer::start(ApiServerOptions::default()).unwrap();
    api.write_kubeconfig(
        &dir.join("kubeconfig"),
        &KubeconfigAuth::ClientCert {
            user: "system:node:node-1".into(),
            groups: vec!["vk-cocoon:nodes".into()],
        },
    )
    .unwrap();
    api
}

fn line<'a>(out: &'a str, start: &str, needle: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(start) && l.contains(needle))
        .unwrap_or_else(|| panic!("no {start}line with {needle:?} in:\n{out}"))
}

#[test]
fn settings_show_their_source_and_certificates_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let _api = node_kubeconfig(dir.path());
    write_pair(dir.path(), &["node-1", "10.0.0.5"], -1, 200);
    let (code, out) = check(dir.path(), &[], &[("VK_RESERVE_PERCENT", "10".into())]);
    assert_eq!(code, Some(0), "{out}");
    line(&out, "  VK_RESERVE_PERCENT = 10", "[env]");
    line(&out, "  VK_ORPHAN_POLICY = destroy", "[default]");
    line(&out, "  API server = https://127.0.0.1:", "[kubeconfig ");
    line(
        &out,
        "  API credentials = client certificate CN=system:node:node-1",
        "",
    );
    line(
        &out,
        "PASS kubelet serving certificate",
        "names the node IP 10.0.0.5",
    );
    line(
        &out,
        "PASS kubelet serving certificate",
        "names the node node-1",
    );
    line(&out, "PASS kubeconfig client certificate", "valid until");
    // The default node name with the destroy orphan policy is a risky pair.
    let (_, out) = check(dir.path(), &[], &[("VK_NODE_NAME", "cocoon-pool".into())]);
    line(
        &out,
        "WARN VK_NODE_NAME is the default cocoon-pool",
        "destroy",
    );

    // Wrong SANs: the IP fails (exit 2), the name warns.
    write_pair(dir.path(), &["elsewhere", "10.9.9.9"], -1, 200);
    let (code, out) = check(dir.path(), &[], &[]);
    assert_eq!(code, Some(2), "{out}");
    line(
        &out,
        "FAIL kubelet serving certificate",
        "does not name the node IP 10.0.0.5",
    );
    line(
        &out,
        "WARN kubelet serving certificate",
        "does not name the node node-1",
    );
    // Expiring in 10 days warns; expired and not yet valid fail.
    write_pair(dir.path(), &["node-1", "10.0.0.5"], -100, 10);
    let (code, out) = check(dir.path(), &[], &[]);
    assert_eq!(code, Some(0), "{out}");
    line(&out, "WARN kubelet serving certificate", "days left");
    write_pair(dir.path(), &["node-1", "10.0.0.5"], -100, -2);
    let (code, out) = check(dir.path(), &[], &[]);
    assert_eq!(code, Some(2), "{out}");
    line(&out, "FAIL kubelet serving certificate", "expired on");
    write_pair(dir.path(), &["node-1", "10.0.0.5"], 3, 100);
    let (code, out) = check(dir.path(), &[], &[]);
    assert_eq!(code, Some(2), "{out}");
    line(&out, "FAIL kubelet serving certificate", "not valid yet");
}

#[test]
fn the_env_example_placeholder_registry_is_warned() {
    let dir = tempfile::tempdir().unwrap();
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/packaging/vk-cocoon.env.example"
    ))
    .unwrap();
    let registry = example
        .lines()
        .find_map(|l| l.strip_prefix("OCI_REGISTRY="))
        .expect("the example sets OCI_REGISTRY");
    std::fs::write(
        dir.path().join("kubeconfig"),
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
    )
    .unwrap();
    let (code, out) = check(dir.path(), &[], &[("OCI_REGISTRY", registry.into())]);
    assert_eq!(code, Some(0), "a warning, not a failure: {out}");
    line(&out, "WARN OCI_REGISTRY=", "placeholder");
}

#[test]
fn online_reviews_every_rbac_verb_and_pings_the_registry_with_its_credentials() {
    if !Registry::available() || !Path::new("/usr/bin/htpasswd").exists() {
        eprintln!("SKIP: docker-registry or htpasswd missing (.ci/run installs them)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let api = node_kubeconfig(dir.path());
    let entries = Command::new("htpasswd")
        .args(["-Bbn", "alice", "s3cret"])
        .output()
        .unwrap()
        .stdout;
    let registry = Registry::start(Some(dir.path()), Some(&entries));
    let docker = |user: &str, pass: &str| {
        use base64::Engine;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
        let home = dir.path().join("home/.docker");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(
            home.join("config.json"),
            format!(
                r#"{{"auths":{{"{}":{{"auth":"{auth}"}}}}}}"#,
                registry.host()
            ),
        )
        .unwrap();
    };
    let oci = ("OCI_REGISTRY", format!("{}/vk", registry.host()));

    docker("alice", "s3cret");
    let (code, out) = check(dir.path(), &["--online"], std::slice::from_ref(&oci));
    assert_eq!(code, Some(0), "{out}");
    line(&out, "PASS API server https://127.0.0.1:", "answers");
    line(&out, "PASS RBAC pods/status:", "get, update, patch");
    line(&out, "PASS RBAC leases.coordination.k8s.io:", "create");
    line(
        &out,
        "PASS registry 127.0.0.1:",
        "answered 200 (basic challenge answered with Basic(alice)",
    );
    let reviews = api
        .requests()
        .iter()
        .filter(|r| r.resource == "selfsubjectaccessreviews")
        .count();
    assert!(reviews >= 25, "one review per verb and resource: {reviews}");

    // RBAC without patch on pods/status and a wrong password: both fail, exit 1.
    api.deny("patch", "pods/status");
    docker("alice", "wrong");
    let (code, out) = check(dir.path(), &["--online"], &[oci]);
    assert_eq!(code, Some(1), "{out}");
    line(&out, "FAIL RBAC pods/status:", "denied patch");
    line(&out, "PASS RBAC pods:", "patch");
    line(&out, "FAIL registry 127.0.0.1:", "401");
    assert!(
        out.ends_with("configuration OK, but an online check failed\n"),
        "{out}"
    );
}
