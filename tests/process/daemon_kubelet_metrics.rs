//! The kubelet scrape paths of kube-prometheus on the real daemon: `/metrics`, `/metrics/cadvisor`
//! and `/metrics/probes` over HTTPS with a client certificate, checked by promtool and fed to
//! the kubelet recording rules; the restart counter and the certificate expiry gauges.
//!
//! The scraper is curl with a certificate the fake API server's CA issued, as Prometheus holds
//! one; the fake API server answers the daemon's SubjectAccessReviews like RBAC that grants the
//! scraper `get nodes/metrics` and nothing else.

use crate::daemon_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use daemon_support::{kill_hypervisor, World, SETTLE_LIMIT};

/// A client certificate on disk for curl.
struct Identity {
    cert: PathBuf,
    key: PathBuf,
}

fn identity(w: &World, user: &str) -> Identity {
    let (cert, key) = w
        .api
        .issue_client_cert_with_groups(user, &[])
        .expect("client certificate");
    let id = Identity {
        cert: w.path(&format!("{user}.crt")),
        key: w.path(&format!("{user}.key")),
    };
    std::fs::write(&id.cert, cert).expect("write cert");
    std::fs::write(&id.key, key).expect("write key");
    id
}

/// GET `path` on the kubelet port: (HTTP status, body).
fn kubelet_get(w: &World, path: &str, who: Option<&Identity>) -> (u16, String) {
    let out_file = w.path("curl.out");
    let _ = std::fs::remove_file(&out_file);
    let mut cmd = Command::new("curl");
    // The serving certificate is the daemon's self-signed one (VK_TLS_CERT unset).
    cmd.args(["-sk", "--max-time", "10", "-w", "%{http_code}", "-o"])
        .arg(&out_file);
    if let Some(id) = who {
        cmd.arg("--cert").arg(&id.cert).arg("--key").arg(&id.key);
    }
    cmd.arg(format!("https://127.0.0.1:{}{path}", w.kubelet_port));
    let out = cmd.output().expect("run curl");
    let code = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    let body = std::fs::read_to_string(&out_file).unwrap_or_default();
    (code, body)
}

fn scrape(w: &World, path: &str, who: &Identity) -> String {
    let (code, body) = kubelet_get(w, path, Some(who));
    assert_eq!(code, 200, "GET {path}: {body}");
    body
}

/// Runs promtool; None (and a SKIP line) when it is not installed.
fn promtool(args: &[&str], dir: &Path, stdin: Option<&str>) -> Option<(bool, String)> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = match Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(_) => {
            println!(
                "SKIP promtool {args:?}: promtool not installed (Debian package `prometheus`)"
            );
            return None;
        }
    };
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(stdin.unwrap_or("").as_bytes())
        .expect("promtool stdin");
    drop(input);
    let out = child.wait_with_output().expect("promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), text))
}

fn promtool_check_metrics(what: &str, text: &str, dir: &Path) {
    if let Some((ok, out)) = promtool(&["check", "metrics"], dir, Some(text)) {
        assert!(
            ok,
            "promtool check metrics on {what}:\n{out}\n--- text ---\n{text}"
        );
    }
}

/// One sample line of the text format: (name, the label pairs as written, value).
fn samples(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, rest) = match l.find('}') {
                Some(end) => (&l[..=end], &l[end + 1..]),
                None => l.split_at(l.find(' ')?),
            };
            let value = rest.split_whitespace().next()?.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, labels)) => (n, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            Some((name.to_string(), labels.to_string(), value))
        })
        .collect()
}

fn value_of(text: &str, name: &str, needles: &[&str]) -> Option<f64> {
    samples(text)
        .into_iter()
        .find(|(n, l, _)| n == name && needles.iter().all(|x| l.contains(x)))
        .map(|(_, _, v)| v)
}

/// The label value of `key` in a label text `a="x",b="y"` (values without escapes).
fn label<'a>(labels: &'a str, key: &str) -> &'a str {
    let start = format!("{key}=\"");
    labels
        .split_once(&start)
        .and_then(|(_, rest)| rest.split_once('"'))
        .map_or("", |(v, _)| v)
}

/// The kubelet recording rules of kube-prometheus the dashboards read, in the form they join
/// the pod's node from kube-state-metrics' `kube_pod_info` (written for this test).
const RULES: &str = r#"groups:
  - name: k8s.rules.container
    rules:
      - record: node_namespace_pod_container:container_cpu_usage_seconds_total:sum_irate
        expr: |
          sum by (namespace, pod, container) (
            irate(container_cpu_usage_seconds_total{job="kubelet", metrics_path="/metrics/cadvisor", image!=""}[5m])
          ) * on (namespace, pod) group_left(node) topk by (namespace, pod) (
            1, max by (namespace, pod, node) (kube_pod_info{node!=""})
          )
      - record: node_namespace_pod_container:container_memory_working_set_bytes
        expr: |
          container_memory_working_set_bytes{job="kubelet", metrics_path="/metrics/cadvisor", image!=""}
          * on (namespace, pod) group_left(node) topk by (namespace, pod) (
            1, max by (namespace, pod, node) (kube_pod_info{node!=""})
          )
      - record: node_namespace_pod_container:container_memory_rss
        expr: |
          container_memory_rss{job="kubelet", metrics_path="/metrics/cadvisor", image!=""}
          * on (namespace, pod) group_left(node) topk by (namespace, pod) (
            1, max by (namespace, pod, node) (kube_pod_info{node!=""})
          )
      - record: namespace:container_memory_working_set_bytes:sum
        expr: |
          sum by (namespace) (container_memory_working_set_bytes{job="kubelet", metrics_path="/metrics/cadvisor", container!="", image!=""})
"#;

/// Target labels Prometheus adds to every series of the kubelet's cAdvisor job.
const TARGET: &str = r#"job="kubelet",metrics_path="/metrics/cadvisor",node="cocoon-sandbox","#;

/// A `promtool test rules` file: the cAdvisor series of two scrapes 15 s apart, kube_pod_info,
/// and the outputs the rules must give at the second scrape.
fn rules_test(first: &str, second: &str, node: &str, uid: &str) -> String {
    let families = [
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
        "container_memory_rss",
    ];
    let before: BTreeMap<(String, String), f64> = samples(first)
        .into_iter()
        .map(|(n, l, v)| ((n, l), v))
        .collect();
    let mut series = String::new();
    let mut expected: Vec<(&str, String, f64)> = Vec::new();
    let mut namespace_ws: BTreeMap<String, f64> = BTreeMap::new();
    for (name, labels, b) in samples(second) {
        if !families.contains(&name.as_str()) {
            continue;
        }
        let a = before
            .get(&(name.clone(), labels.clone()))
            .copied()
            .unwrap_or_else(|| panic!("{name}{{{labels}}} is not in the first scrape"));
        series.push_str(&format!(
            "      - series: '{name}{{{TARGET}{labels}}}'\n        values: '{a} {b}'\n"
        ));
        let (ns, pod, container) = (
            label(&labels, "namespace"),
            label(&labels, "pod"),
            label(&labels, "container"),
        );
        if label(&labels, "image").is_empty() {
            continue; // pod-level series: the rules leave them out
        }
        let out =
            format!("namespace=\"{ns}\",pod=\"{pod}\",container=\"{container}\",node=\"{node}\"");
        match name.as_str() {
            "container_cpu_usage_seconds_total" => expected.push((
                "node_namespace_pod_container:container_cpu_usage_seconds_total:sum_irate",
                out,
                (b - a) / 15.0,
            )),
            "container_memory_working_set_bytes" => {
                *namespace_ws.entry(ns.to_string()).or_default() += b;
                expected.push((
                    "node_namespace_pod_container:container_memory_working_set_bytes",
                    format!("{TARGET}{labels}"),
                    b,
                ))
            }
            _ => expected.push((
                "node_namespace_pod_container:container_memory_rss",
                format!("{TARGET}{labels}"),
                b,
            )),
        }
    }
    // kube-state-metrics' row for the pod: the rules take its node from there.
    series.push_str(&format!(
        "      - series: 'kube_pod_info{{job=\"kube-state-metrics\",namespace=\"default\",pod=\"web\",node=\"{node}\",uid=\"{uid}\",created_by_kind=\"<none>\"}}'\n        values: '1 1'\n"
    ));
    let mut tests = String::new();
    let mut names: Vec<&str> = expected.iter().map(|(n, _, _)| *n).collect();
    names.dedup();
    for rule in names {
        tests.push_str(&format!(
            "      - expr: {rule}\n        eval_time: 15s\n        exp_samples:\n"
        ));
        for (_, labels, value) in expected.iter().filter(|(n, _, _)| *n == rule) {
            tests.push_str(&format!(
                "          - labels: '{rule}{{{labels}}}'\n            value: {value}\n"
            ));
        }
    }
    for (ns, v) in namespace_ws {
        tests.push_str(&format!(
            "      - expr: namespace:container_memory_working_set_bytes:sum\n        eval_time: 15s\n        exp_samples:\n          - labels: 'namespace:container_memory_working_set_bytes:sum{{namespace=\"{ns}\"}}'\n            value: {v}\n"
        ));
    }
    format!(
        "rule_files:\n  - rules.yaml\nevaluation_interval: 15s\ntests:\n  - interval: 15s\n    input_series:\n{series}    promql_expr_test:\n{tests}"
    )
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[test]
fn prometheus_scrapes_the_kubelet_paths_and_the_kubelet_rules_see_the_pod() {
    let mut w = World::new();
    // RBAC as a cluster grants it: Prometheus may get nodes/metrics; `nobody` nothing; the
    // rest (the API server's own kubelet client) everything.
    let reviews: Arc<Mutex<Vec<(String, String, String)>>> = Arc::default();
    let seen = reviews.clone();
    w.api.set_access_reviewer(move |spec| {
        let user = spec["user"].as_str().unwrap_or("").to_string();
        let attrs = &spec["resourceAttributes"];
        let verb = attrs["verb"].as_str().unwrap_or("").to_string();
        let sub = attrs["subresource"].as_str().unwrap_or("").to_string();
        let allowed = match user.as_str() {
            "prometheus" => verb == "get" && sub == "metrics" && attrs["resource"] == "nodes",
            "nobody" => false,
            _ => true,
        };
        seen.lock().unwrap().push((user, verb, sub));
        (allowed, String::new())
    });
    let (pod, id) = w.run_web_pod();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let prometheus = identity(&w, "prometheus");
    let nobody = identity(&w, "nobody");
    let dir = w.path("promtool");
    std::fs::create_dir_all(&dir).expect("mkdir");

    // Unauthorised callers are refused on every scrape path as on the other kubelet paths;
    // the scraper's rights reach no other subresource.
    for path in ["/metrics", "/metrics/cadvisor", "/metrics/probes"] {
        assert_eq!(kubelet_get(&w, path, None).0, 401, "{path} anonymous");
        assert_eq!(kubelet_get(&w, path, Some(&nobody)).0, 403, "{path} nobody");
    }
    assert_eq!(kubelet_get(&w, "/pods", Some(&prometheus)).0, 403);
    assert_eq!(
        kubelet_get(&w, "/containerLogs/default/web/agent", Some(&prometheus)).0,
        403
    );

    // /metrics/probes: the readiness probe's results for this pod.
    let probes = w.wait("a successful readiness probe counted", SETTLE_LIMIT, || {
        let text = scrape(&w, "/metrics/probes", &prometheus);
        let want = [
            "container=\"agent\"",
            "namespace=\"default\"",
            "pod=\"web\"",
            "probe_type=\"Readiness\"",
            "result=\"successful\"",
        ];
        let uid_label = format!("pod_uid=\"{uid}\"");
        let mut needles = want.to_vec();
        needles.push(&uid_label);
        (value_of(&text, "prober_probe_total", &needles)? >= 1.0).then_some(text)
    });
    assert!(
        probes.contains("# TYPE prober_probe_total counter"),
        "{probes}"
    );
    promtool_check_metrics("/metrics/probes", &probes, &dir);

    // /metrics/cadvisor, twice, two samples apart (the shared sample is re-read every 2 s).
    // The VM is in the cAdvisor text from the first sample taken after it started, which a
    // scrape right after the probe result can precede: wait for it.
    let stamp = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("container_memory_rss{container=\"agent\""))
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_string)
    };
    let first = w.wait("the VM's container series", SETTLE_LIMIT, || {
        let t = scrape(&w, "/metrics/cadvisor", &prometheus);
        stamp(&t).map(|_| t)
    });
    let first_stamp = stamp(&first).unwrap_or_default();
    let second = w.wait("a second cAdvisor sample", SETTLE_LIMIT, || {
        std::thread::sleep(Duration::from_millis(500));
        let t = scrape(&w, "/metrics/cadvisor", &prometheus);
        (stamp(&t)? != first_stamp).then_some(t)
    });
    promtool_check_metrics("/metrics/cadvisor", &second, &dir);
    let vm_labels = [
        "container=\"agent\"",
        "namespace=\"default\"",
        "pod=\"web\"",
        "name=\"vk-default-web\"",
    ];
    let id_label = format!("id=\"/cocoon.slice/vm-{id}.scope\"");
    let mut needles = vm_labels.to_vec();
    needles.push(&id_label);
    let rss = value_of(&second, "container_memory_rss", &needles).expect("container rss");
    assert!(rss > 0.0, "the hypervisor process holds memory: {rss}");
    for name in [
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
        "container_memory_usage_bytes",
        "container_spec_memory_limit_bytes",
        "container_start_time_seconds",
    ] {
        assert!(
            value_of(&second, name, &needles).is_some(),
            "{name}\n{second}"
        );
        let pod_level = [
            "container=\"\"",
            "image=\"\"",
            "name=\"\"",
            "namespace=\"default\"",
            "pod=\"web\"",
        ];
        assert!(
            value_of(&second, name, &pod_level).is_some(),
            "{name} at pod level\n{second}"
        );
    }
    let started = value_of(&second, "container_start_time_seconds", &needles).unwrap_or(0.0);
    assert!(
        started > unix_now() - 600.0 && started <= unix_now(),
        "started {started}"
    );
    assert!(value_of(&second, "machine_cpu_cores", &[]).unwrap_or(0.0) >= 1.0);
    assert!(value_of(&second, "machine_memory_bytes", &[]).unwrap_or(0.0) > rss);

    // The kubelet recording rules over the two scrapes.
    std::fs::write(dir.join("rules.yaml"), RULES).expect("write rules");
    let test = rules_test(&first, &second, &w.node, &uid);
    assert!(
        test.contains("node_namespace_pod_container:container_memory_rss{")
            && test.contains("pod=\"web\""),
        "{test}"
    );
    std::fs::write(dir.join("rules.test.yaml"), &test).expect("write rules test");
    if let Some((ok, out)) = promtool(&["test", "rules", "rules.test.yaml"], &dir, None) {
        assert!(
            ok && !out.contains("FAILED"),
            "promtool test rules:\n{out}\n--- test ---\n{test}"
        );
    }

    // /metrics: the daemon's families, as on 9091, with both certificates' expiry.
    let own = scrape(&w, "/metrics", &prometheus);
    promtool_check_metrics("/metrics", &own, &dir);
    assert!(
        own.contains("# TYPE vk_cocoon_pod_lifecycle_total counter"),
        "{own}"
    );
    let serving = value_of(
        &own,
        "vk_cocoon_certificate_expiry_timestamp_seconds",
        &["certificate=\"kubelet-serving\""],
    )
    .expect("serving certificate expiry");
    let year = 365.0 * 86_400.0;
    assert!(
        serving > unix_now() + 9.0 * year && serving < unix_now() + 11.0 * year,
        "the self-signed certificate is valid ten years: {serving}"
    );
    let kubeconfig = std::fs::read_to_string(w.path("kubeconfig")).expect("kubeconfig");
    let cert_b64 = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("client-certificate-data:"))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("client-certificate-data");
    use base64::Engine as _;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(cert_b64)
        .expect("base64");
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let der = CertificateDer::pem_slice_iter(&pem)
        .next()
        .expect("a certificate")
        .expect("PEM");
    let want = vk_cocoon::kubelet::tls::cert_not_after(&der)
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64())
        .expect("NotAfter");
    assert_eq!(
        value_of(
            &own,
            "vk_cocoon_certificate_expiry_timestamp_seconds",
            &["certificate=\"kube-client\""]
        ),
        Some(want)
    );

    // A hypervisor dies: the daemon starts the VM again and counts the restart for the pod.
    kill_hypervisor(&w, &id);
    let restarts = w.wait("the restart counted", SETTLE_LIMIT, || {
        let text = scrape(&w, "/metrics", &prometheus);
        value_of(
            &text,
            "vk_cocoon_vm_restarts_total",
            &["namespace=\"default\"", "pod=\"web\""],
        )
        .filter(|v| *v >= 1.0)
    });
    assert_eq!(restarts, 1.0);
    assert_eq!(
        daemon_support::metric_value(
            &w.metrics(),
            "vk_cocoon_vm_restarts_total{namespace=\"default\",pod=\"web\"}"
        ),
        Some(1.0),
        "the same counter on 9091"
    );

    // The scrape paths were reviewed as nodes/metrics (the other two paths as nodes/proxy).
    let asked: Vec<(String, String, String)> = reviews
        .lock()
        .unwrap()
        .iter()
        .filter(|(u, _, _)| u == "prometheus")
        .cloned()
        .collect();
    let subresources: std::collections::BTreeSet<&str> =
        asked.iter().map(|(_, _, s)| s.as_str()).collect();
    assert_eq!(
        subresources,
        ["metrics", "proxy"].into_iter().collect(),
        "{asked:?}"
    );
    assert!(asked.iter().all(|(_, v, _)| v == "get"), "{asked:?}");
}
