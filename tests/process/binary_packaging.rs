//! Packaging checks: the systemd unit passes `systemd-analyze verify`, the env example
//! lists every variable with its default, and the README documents every variable.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use vk_cocoon::config::{Config, VARIABLES};

const BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon");

fn repo_file(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn unit_has_the_spec_settings() {
    let unit = repo_file("packaging/vk-cocoon.service");
    for line in [
        "Description=Virtual Kubelet Cocoon provider",
        "Wants=network-online.target",
        "After=network-online.target",
        "AssertPathExists=/etc/cocoon/kubeconfig",
        "StartLimitIntervalSec=0",
        "RestartPreventExitStatus=2",
        "UMask=0027",
        "SystemCallArchitectures=native",
        "Type=notify",
        "User=root",
        "Group=root",
        "WorkingDirectory=/var/lib/cocoon",
        "Environment=KUBECONFIG=/etc/cocoon/kubeconfig",
        "Environment=VK_TLS_CERT=/etc/cocoon/vk/tls/vk-kubelet.crt",
        "Environment=VK_TLS_KEY=/etc/cocoon/vk/tls/vk-kubelet.key",
        "EnvironmentFile=-/etc/cocoon/vk-cocoon.env",
        "ExecStart=/usr/local/bin/vk-cocoon",
        "KillMode=process",
        "Restart=always",
        "RestartSec=5s",
        "LimitNOFILE=65536",
        "CPUWeight=1000",
        "AmbientCapabilities=CAP_NET_RAW",
        "WantedBy=multi-user.target",
    ] {
        assert!(unit.lines().any(|l| l.trim() == line), "unit lacks {line}");
    }
    for forbidden in [
        "ProtectSystem",
        "PrivateTmp",
        "PrivateDevices",
        "SystemCallFilter",
        "MemoryDenyWriteExecute",
        "ProtectClock",
        "DeviceAllow",
        "DevicePolicy",
        "RestrictAddressFamilies",
        "ProtectKernelModules",
    ] {
        assert!(
            !unit.lines().any(|l| l.starts_with(forbidden)),
            "{forbidden} would be inherited by cocoon and its VMs"
        );
    }
}

#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("SKIP: systemd-analyze not installed (apt-get install systemd)");
        return;
    }
    // verify checks that ExecStart exists: point it at the binary just built.
    let dir = tempfile::tempdir().unwrap();
    let unit = repo_file("packaging/vk-cocoon.service").replace("/usr/local/bin/vk-cocoon", BIN);
    let path = dir.path().join("vk-cocoon.service");
    std::fs::write(&path, unit).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Unknown keys are only warnings for systemd, so any output counts as a failure.
    assert!(
        out.status.success() && stderr.trim().is_empty() && stdout.trim().is_empty(),
        "status {:?}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
}

/// `systemd-analyze security` scores the unit's exposure (10 is none of the hardening): the
/// options that are safe for a daemon whose children are hypervisors bring it to 8.8 (9.5
/// without them); dropping one of them fails here.
#[test]
fn systemd_analyze_security_scores_the_unit_no_worse_than_its_hardening_allows() {
    let Ok(out) = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/vk-cocoon.service"))
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
    else {
        println!("SKIP: systemd-analyze not installed (apt-get install systemd)");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let score: f64 = text
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for vk-cocoon.service: ")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no exposure score in:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(
        score <= 8.8,
        "exposure {score} (hardening dropped?)\n{text}"
    );
}

#[test]
fn env_example_lists_every_variable_and_its_active_lines_are_valid() {
    let example = repo_file("packaging/vk-cocoon.env.example");
    for v in VARIABLES {
        let named = example.lines().any(|l| {
            let l = l.trim_start_matches('#');
            l.starts_with(&format!("{}=", v.name))
        });
        assert!(named, "env example lacks {}", v.name);
    }
    // systemd EnvironmentFile: `#` starts a comment only at the beginning of a line.
    let active: HashMap<String, String> = example
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert!(active.contains_key("OCI_REGISTRY"));
    let from_example =
        Config::from_env(&|k| active.get(k).cloned()).unwrap_or_else(|e| panic!("{e}"));
    let defaults =
        Config::from_env(&|k| (k == "OCI_REGISTRY").then(|| active["OCI_REGISTRY"].clone()))
            .unwrap();
    assert_eq!(
        from_example, defaults,
        "the example's active lines are the defaults"
    );
    // Every host needs its own node name: the example must not fix one.
    assert!(!active.contains_key("VK_NODE_NAME"));
    // Uncommenting any line keeps a valid configuration: no comment after a value, which
    // systemd would keep as part of the value.
    for line in example.lines() {
        let Some((k, v)) = line.trim_start_matches('#').split_once('=') else {
            continue;
        };
        if k.contains(' ') {
            continue;
        }
        assert!(!v.contains('#'), "comment after a value: {line:?}");
        let uncommented = |name: &str| match name {
            "OCI_REGISTRY" => Some(active["OCI_REGISTRY"].clone()),
            n if n == k => Some(v.to_string()),
            _ => None,
        };
        if let Err(e) = Config::from_env(&uncommented) {
            panic!("uncommented {line:?} is invalid: {e}");
        }
    }
}

#[test]
fn readme_documents_every_variable_with_its_default() {
    let readme = repo_file("README.md");
    for v in VARIABLES {
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{}` |", v.name)))
            .unwrap_or_else(|| panic!("README configuration table lacks {}", v.name));
        assert!(
            row.contains(v.default),
            "README row of {} lacks default {:?}: {row}",
            v.name,
            v.default
        );
    }
}

#[test]
fn readme_documents_every_pod_annotation_the_daemon_reads_or_writes() {
    let readme = repo_file("README.md");
    let spec = repo_file("src/provider/spec.rs");
    let keys: Vec<&str> = spec
        .lines()
        .filter(|l| l.starts_with("pub const ANN_"))
        .filter_map(|l| l.split('"').nth(1))
        .collect();
    assert!(keys.len() >= 20, "annotation constants not found: {keys:?}");
    for key in keys {
        let row = format!("`{key}`");
        assert!(
            readme
                .lines()
                .any(|l| l.starts_with("| ") && l.contains(&row)),
            "README pod contract lacks {key}"
        );
    }
}

#[test]
fn example_pods_carry_the_required_annotations() {
    for file in ["clone-pod.yaml", "run-pod.yaml"] {
        let text = repo_file(&format!("packaging/examples/{file}"));
        for needed in [
            "vm.cocoonstack.io/name:",
            "cocoonset.cocoonstack.io/mode:",
            "cocoonset.cocoonstack.io/image:",
            "cocoonset.cocoonstack.io/managed: \"true\"",
        ] {
            assert!(text.contains(needed), "{file} lacks {needed}");
        }
    }
}

/// Every metric family name the daemon exports, each with whether it is a histogram (whose
/// series carry `_bucket`, `_sum` and `_count`).
fn exported_families() -> Vec<(String, bool)> {
    use prometheus::core::Collector;
    use vk_cocoon::metrics::{collectors::VmCollector, stats, Metrics, TextSource};

    let m = Metrics::new().unwrap();
    let name = |c: &dyn Collector| c.desc()[0].fq_name.clone();
    let counters: Vec<&dyn Collector> = vec![
        &m.pod_lifecycle_total,
        &m.snapshot_pull_total,
        &m.snapshot_save_total,
        &m.snapshot_push_total,
        &m.snapshot_verify_total,
        &m.snapshot_peer_restore_total,
        &m.clone_from_dir_total,
        &m.wake_total,
        &m.wake_renew_nudge_total,
        &m.lease_release_total,
        &m.orphan_vm_total,
        &m.vm_inspect_transient_fail_total,
        &m.pod_evict_failure_total,
        &m.reconcile_adopt_by_name_total,
        &m.stale_create_reconcile_total,
        &m.startup_resume_total,
        &m.hibernate_evidence_total,
        &m.hibernate_total,
        &m.wake_ip_wait_total,
        &m.postclone_total,
        &m.vm_restarts_total,
        &m.certificate_expiry_timestamp_seconds,
        vk_cocoon::metrics::admission::refused_total(),
    ];
    let histograms: Vec<&dyn Collector> = vec![
        &m.vm_boot_duration_seconds,
        &m.snapshot_save_duration_seconds,
        &m.snapshot_push_duration_seconds,
        &m.snapshot_pull_duration_seconds,
        &m.snapshot_peer_restore_duration_seconds,
        &m.probe_duration_seconds,
        &m.postclone_retry_attempts,
    ];
    let mut out: Vec<(String, bool)> = counters.into_iter().map(|c| (name(c), false)).collect();
    out.extend(histograms.into_iter().map(|h| (name(h), true)));
    // The text sources: process_* and build_info (always written), the per-VM and node families.
    for line in m.encode().lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            let (n, kind) = (words.next().unwrap(), words.next().unwrap());
            out.push((n.to_string(), kind == "histogram"));
        }
    }
    let vms = VmCollector::new(stats::StatsHub::new(stats::StatsPaths::default()));
    out.extend(vms.family_names().into_iter().map(|n| (n, false)));
    let pinger = prometheus::Registry::new();
    vk_cocoon::network::icmp::register_mode_gauge(
        &pinger,
        vk_cocoon::network::icmp::PingerMode::Raw,
    )
    .unwrap();
    out.extend(
        pinger
            .gather()
            .iter()
            .map(|f| (f.name().to_string(), false)),
    );
    // Registered by the daemon itself (private to src/daemon/): each must be spelled there.
    let daemon_src = repo_file("src/daemon/kube_jobs.rs") + &repo_file("src/daemon/wiring.rs");
    for n in [
        "vk_cocoon_kube_lane_queued",
        "vk_cocoon_kube_lane_in_flight",
        "vk_cocoon_kube_lane_oldest_queued_seconds",
        "vk_cocoon_kube_events_dropped_total",
        "vk_cocoon_node_tick_late_seconds",
        "vk_cocoon_loop_longest_turn_seconds",
    ] {
        assert!(
            daemon_src.contains(&format!("\"{n}\",")),
            "{n} is no longer registered in src/daemon/"
        );
        out.push((n.to_string(), false));
    }
    out
}

/// The metric names `text` uses: every `vk_cocoon_*` word, and `process_*` words when asked.
fn series_names(text: &str, with_process: bool) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = Vec::new();
    for (i, _) in text.char_indices() {
        let rest = &text[i..];
        let starts =
            rest.starts_with("vk_cocoon_") || (with_process && rest.starts_with("process_"));
        if starts && !text[..i].ends_with(ident) {
            let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
            names.push(rest[..end].to_string());
        }
    }
    names.sort();
    names.dedup();
    names
}

/// The cAdvisor and prober metric names `text` uses (`container_*`, `machine_*`, `prober_*`).
fn kubelet_series_names(text: &str) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = Vec::new();
    for (i, _) in text.char_indices() {
        let rest = &text[i..];
        let starts = ["container_", "machine_", "prober_"]
            .iter()
            .any(|p| rest.starts_with(p));
        if starts && !text[..i].ends_with(ident) {
            let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
            names.push(rest[..end].to_string());
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Fails naming every series of `names` the daemon does not export.
fn assert_exported(names: &[String], what: &str) {
    let families = exported_families();
    let unknown: Vec<&String> = names
        .iter()
        .filter(|n| {
            !families.iter().any(|(f, histogram)| {
                *n == f
                    || (*histogram
                        && ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|s| **n == format!("{f}{s}")))
            })
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "{what} uses series the daemon does not export: {unknown:?}"
    );
}

fn promtool(args: &[&str]) -> Option<std::process::Output> {
    let Ok(out) = Command::new("promtool")
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/prometheus"))
        .output()
    else {
        println!("SKIP: promtool not installed (apt-get install prometheus)");
        return None;
    };
    Some(out)
}

#[test]
fn promtool_checks_and_unit_tests_the_alerting_rules() {
    for args in [
        ["check", "rules", "vk-cocoon.rules.yaml"],
        ["test", "rules", "vk-cocoon.rules.test.yaml"],
    ] {
        let Some(out) = promtool(&args) else {
            return;
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !stdout.contains("FAILED") && !stderr.contains("FAILED"),
            "promtool {}: {:?}\nstdout: {stdout}\nstderr: {stderr}",
            args.join(" "),
            out.status
        );
    }
}

#[test]
fn alerting_rules_use_only_series_the_daemon_exports() {
    let rules = repo_file("packaging/prometheus/vk-cocoon.rules.yaml");
    let names = series_names(&rules, false);
    assert_exported(&names, "vk-cocoon.rules.yaml");
    for needed in [
        "vk_cocoon_node_tick_late_seconds",
        "vk_cocoon_loop_longest_turn_seconds",
        "vk_cocoon_kube_lane_oldest_queued_seconds",
        "vk_cocoon_kube_events_dropped_total",
        "vk_cocoon_snapshot_push_total",
        "vk_cocoon_snapshot_pull_total",
        "vk_cocoon_orphan_vm_total",
        "vk_cocoon_vm_restarts_total",
        "vk_cocoon_certificate_expiry_timestamp_seconds",
    ] {
        assert!(names.iter().any(|n| n == needed), "no rule over {needed}");
    }
    // The unit tests feed the same series.
    let tests = repo_file("packaging/prometheus/vk-cocoon.rules.test.yaml");
    assert_exported(&series_names(&tests, false), "vk-cocoon.rules.test.yaml");
}

#[test]
fn grafana_dashboard_parses_and_queries_only_exported_series() {
    let text = repo_file("packaging/grafana/vk-cocoon.json");
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        dash["__inputs"][0]["name"], "DS_PROMETHEUS",
        "the datasource is an import input"
    );
    fn queries(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr" | "query" | "definition", serde_json::Value::String(s)) => {
                            out.push(s.clone())
                        }
                        ("datasource", d) => assert!(
                            d.to_string().contains("${DS_PROMETHEUS}"),
                            "datasource other than the input: {d}"
                        ),
                        _ => queries(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
            _ => {}
        }
    }
    let mut exprs = Vec::new();
    queries(&dash, &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let names = series_names(&exprs.join("\n"), true);
    assert_exported(&names, "vk-cocoon.json");
    for needed in [
        "vk_cocoon_pod_lifecycle_total",
        "vk_cocoon_vm_boot_duration_seconds_bucket",
        "vk_cocoon_snapshot_push_total",
        "vk_cocoon_snapshot_pull_total",
        "vk_cocoon_loop_longest_turn_seconds",
        "vk_cocoon_kube_lane_queued",
        "vk_cocoon_node_tick_late_seconds",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "vk_cocoon_vm_cpu_seconds_total",
        "vk_cocoon_vm_memory_rss_bytes",
        "vk_cocoon_vm_restarts_total",
        "vk_cocoon_certificate_expiry_timestamp_seconds",
    ] {
        assert!(names.iter().any(|n| n == needed), "no panel over {needed}");
    }
    // The panels over the kubelet job's paths use only what /metrics/cadvisor and
    // /metrics/probes serve.
    let kubelet_names = kubelet_series_names(&exprs.join("\n"));
    let served: Vec<&str> = vk_cocoon::metrics::cadvisor::FAMILIES
        .iter()
        .copied()
        .chain(["prober_probe_total"])
        .collect();
    let unknown: Vec<&String> = kubelet_names
        .iter()
        .filter(|n| !served.contains(&n.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "vk-cocoon.json uses kubelet series not served: {unknown:?}"
    );
    for needed in [
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
        "container_network_receive_bytes_total",
        "prober_probe_total",
    ] {
        assert!(
            kubelet_names.iter().any(|n| n == needed),
            "no panel over {needed}"
        );
    }
    let exported = exported_families();
    assert!(
        exported
            .iter()
            .any(|(n, _)| n == "process_resident_memory_bytes"),
        "{exported:?}"
    );
}

/// The first-column names (`` `name` ``) of the table under the README heading `heading`.
fn readme_table(heading: &str) -> std::collections::BTreeSet<String> {
    let readme = repo_file("README.md");
    let start = readme
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("README has no {heading:?} section"));
    readme[start + heading.len() + 2..]
        .lines()
        .take_while(|l| !l.starts_with("#"))
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| l.split('`').nth(1).map(str::to_string))
        .collect()
}

#[test]
fn readme_metrics_table_lists_exactly_the_exported_families() {
    let documented = readme_table("### Metrics");
    let mut exported: std::collections::BTreeSet<String> =
        exported_families().into_iter().map(|(n, _)| n).collect();
    // A family added to the registry's struct counts even before exported_families names it.
    let families = repo_file("src/metrics/families.rs");
    for line in families.lines() {
        let Some((field, kind)) = line
            .trim()
            .strip_prefix("pub ")
            .and_then(|l| l.split_once(": "))
        else {
            continue;
        };
        let kind = kind.trim_end_matches(',');
        if ["IntCounter", "IntCounterVec", "Histogram", "HistogramVec"].contains(&kind) {
            exported.insert(format!("vk_cocoon_{field}"));
        }
    }
    let undocumented: Vec<&String> = exported.difference(&documented).collect();
    let stale: Vec<&String> = documented.difference(&exported).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "README metrics table lacks {undocumented:?}; lists what is not exported: {stale:?}"
    );
}

/// Every Kubernetes Event reason the daemon can emit: the capitalised string literals of the
/// provider core and the daemon (outside tests), less the other words spelled that way there.
fn event_reasons_in_code() -> std::collections::BTreeSet<String> {
    // Pod phases, condition types and values, event types, answer names: not reasons.
    const NOT_REASONS: &[&str] = &[
        "ApiDelete",
        "CocoonSet",
        "Failed",
        "False",
        "Initialized",
        "Normal",
        "Pending",
        "ProviderFailed",
        "Ready",
        "ReadyWait",
        "Running",
        "Succeeded",
        "Terminated",
        "True",
        "VM",
        "Warning",
    ];
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() && p.file_name().is_some_and(|n| n != "tests") {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    walk(&root.join("src/provider"), &mut files);
    walk(&root.join("src/daemon"), &mut files);
    let mut out = std::collections::BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for piece in code.split('"').skip(1).step_by(2) {
            let word = piece.len() > 1
                && piece.starts_with(|c: char| c.is_ascii_uppercase())
                && piece.chars().all(|c| c.is_ascii_alphabetic());
            if word && !NOT_REASONS.contains(&piece) {
                out.insert(piece.to_string());
            }
        }
    }
    out
}

#[test]
fn readme_events_table_lists_exactly_the_event_reasons() {
    let documented = readme_table("### Events");
    let emitted = event_reasons_in_code();
    assert!(
        emitted.contains("VMGone") && emitted.contains("Woken"),
        "{emitted:?}"
    );
    let undocumented: Vec<&String> = emitted.difference(&documented).collect();
    let stale: Vec<&String> = documented.difference(&emitted).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "README events table lacks {undocumented:?}; lists reasons the code never emits: {stale:?}"
    );
}
