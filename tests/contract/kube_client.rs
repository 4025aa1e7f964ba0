//! The blocking kube client against the fake API server: every credential kind, error
//! classification, and the pod / event / review calls vk-cocoon makes.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use vk_cocoon::kube::{Client, EventRecorder, EventType, KubeError, KubeOptions};
use vk_cocoon::sandbox::apiserver::{
    ApiServer, ApiServerHandle, ApiServerOptions, Fault, FaultMatch, KubeconfigAuth, ReviewUser,
    TokenPolicy,
};

fn opts_for(kubeconfig: &Path) -> KubeOptions {
    KubeOptions {
        kubeconfig: Some(kubeconfig.to_string_lossy().into_owned()),
        timeout: Duration::from_secs(5),
        qps: 0.0,
        ..KubeOptions::default()
    }
}

fn start(tokens: TokenPolicy) -> ApiServerHandle {
    ApiServer::start(ApiServerOptions {
        tokens,
        ..ApiServerOptions::default()
    })
    .expect("start fake API server")
}

fn client_with(api: &ApiServerHandle, dir: &Path, auth: KubeconfigAuth) -> Client {
    let path = dir.join("kubeconfig");
    api.write_kubeconfig(&path, &auth).unwrap();
    Client::from_env(&opts_for(&path)).unwrap()
}

fn pod(name: &str, node: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default", "annotations": {"a": "1"}},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "img"}]}
    }))
    .unwrap()
}

#[test]
fn client_certificate_auth() {
    let api = start(TokenPolicy::Reject);
    let dir = tempfile::tempdir().unwrap();
    let c = client_with(
        &api,
        dir.path(),
        KubeconfigAuth::ClientCert {
            user: "system:node:n1".into(),
            groups: vec!["system:nodes".into()],
        },
    );
    assert!(c.get_node("absent").unwrap_err().is_not_found());
    // Same server, no credentials at all: refused.
    let none = client_with(&api, dir.path(), KubeconfigAuth::None);
    assert!(
        matches!(none.get_node("absent"), Err(KubeError::Unauthorized(_))),
        "{:?}",
        none.get_node("absent")
    );
}

#[test]
fn bearer_token_auth() {
    let api = start(TokenPolicy::Only(vec!["good".into()]));
    let dir = tempfile::tempdir().unwrap();
    let c = client_with(&api, dir.path(), KubeconfigAuth::Token("good".into()));
    assert!(c.get_node("absent").unwrap_err().is_not_found());
    let bad = client_with(&api, dir.path(), KubeconfigAuth::Token("bad".into()));
    assert!(matches!(
        bad.get_node("absent"),
        Err(KubeError::Unauthorized(_))
    ));
}

#[test]
fn token_file_rotation() {
    let api = start(TokenPolicy::Only(vec!["t1".into()]));
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t1\n").unwrap();
    let c = client_with(&api, dir.path(), KubeconfigAuth::TokenFile(token.clone()));
    assert!(c.get_node("absent").unwrap_err().is_not_found());
    // Rotate: the server now only accepts the new token; the client picks up the new file.
    api.set_token_policy(TokenPolicy::Only(vec!["t2-rotated".into()]));
    std::fs::write(&token, "t2-rotated\n").unwrap();
    assert!(c.get_node("absent").unwrap_err().is_not_found());
    // A token file that vanished is a credentials error, not a panic.
    std::fs::remove_file(&token).unwrap();
    assert!(matches!(
        c.get_node("absent"),
        Err(KubeError::Credentials(_))
    ));
}

/// Write an exec plugin (run directly by argv via its #! line) that counts its runs and prints
/// token `<prefix><run>` with the given expiry; `first_token` overrides the token of run 1.
fn write_plugin(
    dir: &Path,
    api_version: &str,
    expiry: &str,
    first_token: Option<&str>,
) -> std::path::PathBuf {
    let script = dir.join("plugin.sh");
    let count = dir.join("count");
    let first = first_token.unwrap_or("");
    let body = format!(
        "#!/bin/sh\nn=$(cat '{c}' 2>/dev/null || echo 0)\nn=$((n+1))\necho $n > '{c}'\n\
         tok=\"tok$n\"\nif [ $n = 1 ] && [ -n '{first}' ]; then tok='{first}'; fi\n\
         case \"$KUBERNETES_EXEC_INFO\" in *ExecCredential*) ;; *) exit 3;; esac\n\
         printf '{{\"apiVersion\":\"{api_version}\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"%s\",\"expirationTimestamp\":\"{expiry}\"}}}}' \"$tok\"\n",
        c = count.display()
    );
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn exec_kubeconfig(
    api: &ApiServerHandle,
    dir: &Path,
    plugin: &Path,
    api_version: &str,
) -> std::path::PathBuf {
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(api.ca_pem());
    let text = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\n\
         contexts:\n- name: x\n  context: {{cluster: c, user: u}}\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: {api_version}\n      command: {}\n      args: [\"--flag\"]\n      provideClusterInfo: true\n",
        api.url(),
        plugin.display()
    );
    let path = dir.join("kubeconfig");
    std::fs::write(&path, text).unwrap();
    path
}

fn runs(dir: &Path) -> u32 {
    std::fs::read_to_string(dir.join("count"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn exec_plugin_cached_until_expiry_v1() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let plugin = write_plugin(
        dir.path(),
        "client.authentication.k8s.io/v1",
        "2099-01-01T00:00:00Z",
        None,
    );
    let c = Client::from_env(&opts_for(&exec_kubeconfig(
        &api,
        dir.path(),
        &plugin,
        "client.authentication.k8s.io/v1",
    )))
    .unwrap();
    for _ in 0..3 {
        assert!(c.get_node("absent").unwrap_err().is_not_found());
    }
    assert_eq!(
        runs(dir.path()),
        1,
        "a credential valid until 2099 is cached"
    );
}

#[test]
fn exec_plugin_expired_credentials_rerun_v1beta1() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let plugin = write_plugin(
        dir.path(),
        "client.authentication.k8s.io/v1beta1",
        "2000-01-01T00:00:00Z",
        None,
    );
    let c = Client::from_env(&opts_for(&exec_kubeconfig(
        &api,
        dir.path(),
        &plugin,
        "client.authentication.k8s.io/v1beta1",
    )))
    .unwrap();
    for _ in 0..3 {
        assert!(c.get_node("absent").unwrap_err().is_not_found());
    }
    assert_eq!(
        runs(dir.path()),
        3,
        "an expired credential is fetched again for every call"
    );
}

#[test]
fn exec_plugin_rerun_after_401() {
    let api = start(TokenPolicy::Only(vec!["tok2".into()]));
    let dir = tempfile::tempdir().unwrap();
    let plugin = write_plugin(
        dir.path(),
        "client.authentication.k8s.io/v1",
        "2099-01-01T00:00:00Z",
        Some("rejected"),
    );
    let c = Client::from_env(&opts_for(&exec_kubeconfig(
        &api,
        dir.path(),
        &plugin,
        "client.authentication.k8s.io/v1",
    )))
    .unwrap();
    assert!(c.get_node("absent").unwrap_err().is_not_found());
    assert_eq!(runs(dir.path()), 2);
}

#[test]
fn failing_exec_plugin_is_a_credentials_error() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("fail.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\necho 'no credentials for you' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let c = Client::from_env(&opts_for(&exec_kubeconfig(
        &api,
        dir.path(),
        &script,
        "client.authentication.k8s.io/v1",
    )))
    .unwrap();
    let e = c.get_node("x").unwrap_err();
    assert!(
        matches!(&e, KubeError::Credentials(m) if m.contains("no credentials for you")),
        "{e}"
    );
}

#[test]
fn wrong_ca_is_a_transport_error_and_insecure_skip_works() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let other = rcgen::generate_simple_self_signed(vec!["x".into()])
        .unwrap()
        .cert
        .pem();
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let kc = |cluster_extra: &str| {
        format!(
            "current-context: x\nclusters:\n- name: c\n  cluster:\n    server: {}\n{cluster_extra}contexts:\n- name: x\n  context: {{cluster: c, user: u}}\nusers:\n- name: u\n  user: {{token: t}}\n",
            api.url()
        )
    };
    let p = dir.path().join("kc");
    std::fs::write(
        &p,
        kc(&format!(
            "    certificate-authority-data: {}\n",
            b64(&other)
        )),
    )
    .unwrap();
    let c = Client::from_env(&opts_for(&p)).unwrap();
    assert!(matches!(c.get_node("x"), Err(KubeError::Transport(_))));
    std::fs::write(&p, kc("    insecure-skip-tls-verify: true\n")).unwrap();
    let c = Client::from_env(&opts_for(&p)).unwrap();
    assert!(c.get_node("x").unwrap_err().is_not_found());
}

#[test]
fn errors_are_classified() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let c = client_with(&api, dir.path(), KubeconfigAuth::Token("t".into()));
    api.fail_next(
        1,
        FaultMatch::new("get", "nodes"),
        Fault::TooManyRequests {
            retry_after_secs: 2,
        },
    );
    match c.get_node("x") {
        Err(KubeError::TooManyRequests { retry_after, .. }) => {
            assert_eq!(retry_after, Some(Duration::from_secs(2)))
        }
        other => panic!("expected 429, got {other:?}"),
    }
    api.fail_next(1, FaultMatch::new("get", "nodes"), Fault::InternalError);
    assert!(matches!(c.get_node("x"), Err(KubeError::Server(_))));
    api.fail_next(1, FaultMatch::new("get", "nodes"), Fault::Gone);
    assert!(matches!(c.get_node("x"), Err(KubeError::Gone(_))));
    api.fail_next(1, FaultMatch::new("get", "nodes"), Fault::Conflict);
    assert!(c.get_node("x").unwrap_err().is_conflict());
    let e = c.get_node("x").unwrap_err();
    assert!(
        e.status().is_some_and(|s| s.message.contains('x')),
        "Status message kept: {e}"
    );
    // Nothing listening: transport error within the timeout.
    let addr = api.addr();
    api.stop();
    let t = std::time::Instant::now();
    assert!(matches!(c.get_node("x"), Err(KubeError::Transport(_))));
    assert!(t.elapsed() < Duration::from_secs(6));
    let _ = addr;
}

#[test]
fn pod_calls() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let c = client_with(&api, dir.path(), KubeconfigAuth::Token("t".into()));
    let created = api.create_pod(&pod("p1", "n1")).unwrap();
    api.create_pod(&pod("p2", "n2")).unwrap();
    let uid = created.metadata.uid.clone().unwrap();

    let list = c.list_pods_on_node("n1").unwrap();
    assert_eq!(list.items.len(), 1);
    assert!(!list.resource_version.is_empty());
    assert_eq!(
        c.get_pod("default", "p1").unwrap().metadata.uid.as_deref(),
        Some(uid.as_str())
    );

    // Strategic-merge annotations patch, guarded by UID.
    c.patch_pod(
        "default",
        "p1",
        &serde_json::json!({"metadata": {"uid": uid, "annotations": {"b": "2"}}}),
    )
    .unwrap();
    let ann = c
        .get_pod("default", "p1")
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert_eq!(
        (
            ann.get("a").map(String::as_str),
            ann.get("b").map(String::as_str)
        ),
        (Some("1"), Some("2"))
    );
    let stale = c.patch_pod(
        "default",
        "p1",
        &serde_json::json!({"metadata": {"uid": "other", "annotations": {"c": "3"}}}),
    );
    assert!(
        matches!(stale, Err(KubeError::Conflict(_) | KubeError::Invalid(_))),
        "{stale:?}"
    );

    // Merge patch on pods/status with a UID guard.
    let status = PodStatus {
        phase: Some("Running".into()),
        pod_ip: Some("10.1.0.9".into()),
        ..Default::default()
    };
    c.patch_pod_status("default", "p1", Some(&uid), &status)
        .unwrap();
    let p = c.get_pod("default", "p1").unwrap();
    assert_eq!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Running")
    );
    assert!(c
        .patch_pod_status("default", "p1", Some("other-uid"), &status)
        .is_err());

    // PUT pods/status with the fresh resourceVersion.
    let mut fresh = c.get_pod("default", "p1").unwrap();
    fresh.status.get_or_insert_with(Default::default).phase = Some("Succeeded".into());
    let p = c.update_pod_status(&fresh).unwrap();
    assert_eq!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded"));
    assert!(
        c.update_pod_status(&fresh).unwrap_err().is_conflict(),
        "stale resourceVersion conflicts"
    );

    // Delete with a wrong UID precondition: 409; right one: gone.
    assert!(c
        .delete_pod("default", "p1", Some(0), Some("other"))
        .unwrap_err()
        .is_conflict());
    c.delete_pod("default", "p1", Some(0), Some(&uid)).unwrap();
    assert!(api.get_pod("default", "p1").is_none());
    assert!(c
        .delete_pod("default", "p1", Some(0), None)
        .unwrap_err()
        .is_not_found());
}

#[test]
fn events_are_created_then_aggregated() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let c = client_with(&api, dir.path(), KubeconfigAuth::Token("t".into()));
    let p = api.create_pod(&pod("p1", "n1")).unwrap();
    let mut r = EventRecorder::new("n1", 100);
    let now = std::time::Instant::now();
    let wall = std::time::SystemTime::now();
    r.record(
        &p,
        EventType::Warning,
        "WakePullFailed",
        "pull failed",
        now,
        wall,
    );
    assert_eq!(r.flush(&c, 10, now), 1);
    r.record(
        &p,
        EventType::Warning,
        "WakePullFailed",
        "pull failed",
        now,
        wall + Duration::from_secs(3),
    );
    assert_eq!(r.flush(&c, 10, now), 1);
    let evs = api.events();
    assert_eq!(evs.len(), 1, "{evs:?}");
    let e = &evs[0];
    assert_eq!(e.count, Some(2));
    assert_eq!(e.reason.as_deref(), Some("WakePullFailed"));
    assert_eq!(e.involved_object.uid, p.metadata.uid);
    assert_eq!(
        e.source.as_ref().and_then(|s| s.component.as_deref()),
        Some("vk-cocoon")
    );
    assert_eq!(
        e.source.as_ref().and_then(|s| s.host.as_deref()),
        Some("n1")
    );
    assert!(e.last_timestamp > e.first_timestamp);
    // API down: the event stays queued and goes out once the API is back.
    api.stop();
    r.record(&p, EventType::Normal, "Woken", "ok", now, wall);
    assert_eq!(r.flush(&c, 10, now), 0);
    assert_eq!(r.pending(), 1);
    api.restart().unwrap();
    assert_eq!(r.flush(&c, 10, now), 1);
    assert_eq!(api.events().len(), 2);
}

#[test]
fn token_and_access_reviews() {
    let api = start(TokenPolicy::Any);
    let dir = tempfile::tempdir().unwrap();
    let c = client_with(&api, dir.path(), KubeconfigAuth::Token("t".into()));
    api.add_token_user(
        "metrics-token",
        ReviewUser {
            username: "system:serviceaccount:kube-system:metrics-server".into(),
            uid: "u".into(),
            groups: vec!["system:serviceaccounts".into()],
        },
    );
    let tr = c
        .create_token_review(&TokenReview {
            spec: TokenReviewSpec {
                token: "metrics-token".into(),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
    let st = tr.status.unwrap_or_default();
    assert_eq!(st.authenticated, Some(true));
    assert_eq!(
        st.user.and_then(|u| u.username).as_deref(),
        Some("system:serviceaccount:kube-system:metrics-server")
    );
    api.set_access_reviewer(|spec| {
        (
            spec.pointer("/resourceAttributes/subresource")
                .and_then(|v| v.as_str())
                == Some("stats"),
            "by test".into(),
        )
    });
    let sar = |sub: &str| SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some("u".into()),
            resource_attributes: Some(ResourceAttributes {
                resource: Some("nodes".into()),
                subresource: Some(sub.into()),
                verb: Some("get".into()),
                ..Default::default()
            }),
            extra: Some(BTreeMap::new()),
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(
        c.create_subject_access_review(&sar("stats"))
            .unwrap()
            .status
            .map(|s| s.allowed),
        Some(true)
    );
    assert_eq!(
        c.create_subject_access_review(&sar("proxy"))
            .unwrap()
            .status
            .map(|s| s.allowed),
        Some(false)
    );
}
