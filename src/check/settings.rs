//! What `check-config` shows of the configuration: every setting's resolved value and where it
//! came from, and the advice on risky combinations and placeholder values. Pure over inputs.
//!
//! Sources: `env` (the variable is set), `default`, `auto-detected` (the node IP, capacity
//! measured on the host) and `kubeconfig` (what the loaded kubeconfig supplies).

use std::net::IpAddr;

use crate::config::{Config, KubeletAuth, OrphanPolicy, VARIABLES};

use super::Finding;

/// One resolved setting: `NAME = value (source)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub name: String,
    pub value: String,
    pub source: String,
}

/// What was detected or loaded beside the environment.
#[derive(Clone, Debug, Default)]
pub struct Detected {
    /// The auto-detected node IP and how it was found (when VK_NODE_IP is unset).
    pub node_ip: Option<(IpAddr, String)>,
    /// Capacity measured on the host, by resource (cpu, memory, ephemeral-storage, ...).
    pub capacity: Vec<(String, String)>,
    /// Where the kubeconfig came from, its API server and how it authenticates.
    pub kubeconfig: Option<(String, String, String)>,
}

/// Every variable of [`VARIABLES`] with its resolved value and source, then what the
/// kubeconfig supplies.
pub fn resolved(c: &Config, env: &dyn Fn(&str) -> Option<String>, d: &Detected) -> Vec<Setting> {
    let mut out = Vec::new();
    for v in VARIABLES {
        let raw = env(v.name);
        // An empty value counts as unset, except for the lease-release socket.
        let set = match raw.as_deref() {
            Some("") => v.name == "VK_COCOON_NET_CONTROL_SOCKET",
            Some(_) => true,
            None => false,
        };
        let value = value_of(c, v.name).unwrap_or_else(|| raw.clone().unwrap_or_default());
        let mut source = if set { "env" } else { "default" }.to_string();
        let mut value = if !set && value.is_empty() {
            v.default.to_string()
        } else {
            value
        };
        if set && fell_back(v.name, raw.as_deref().unwrap_or(""), &value) {
            source = format!(
                "default (the value {:?} is malformed)",
                raw.unwrap_or_default()
            );
        }
        match v.name {
            "VK_NODE_IP" if !set => {
                if let Some((ip, how)) = &d.node_ip {
                    value = ip.to_string();
                    source = format!("auto-detected: {how}");
                }
            }
            "VK_NODE_CPU" | "VK_NODE_MEM" | "VK_NODE_STORAGE" | "VK_NODE_HUGEPAGES" if !set => {
                let resource = match v.name {
                    "VK_NODE_CPU" => "cpu",
                    "VK_NODE_MEM" => "memory",
                    "VK_NODE_STORAGE" => "ephemeral-storage",
                    _ => "hugepages-",
                };
                let found: Vec<String> = d
                    .capacity
                    .iter()
                    .filter(|(k, _)| k.starts_with(resource))
                    .map(|(k, q)| {
                        if k == resource {
                            q.clone()
                        } else {
                            format!("{k}={q}")
                        }
                    })
                    .collect();
                if !found.is_empty() {
                    value = found.join(", ");
                    source = "auto-detected from the host".into();
                }
            }
            "KUBECONFIG" if !set => {
                if let Some((from, _, _)) = &d.kubeconfig {
                    value = from.clone();
                    source = "default search (KUBECONFIG unset)".into();
                }
            }
            _ => {}
        }
        out.push(Setting {
            name: v.name.to_string(),
            value,
            source,
        });
    }
    if let Some((from, server, auth)) = &d.kubeconfig {
        let kc = |name: &str, value: String| Setting {
            name: name.into(),
            value,
            source: from.clone(),
        };
        out.push(kc("API server", server.clone()));
        out.push(kc("API credentials", auth.clone()));
        if c.client_ca_file.is_none() && c.kubelet_auth == KubeletAuth::On {
            out.push(kc(
                "kubelet API client CA",
                "the cluster CA of the kubeconfig (VK_CLIENT_CA_FILE unset)".into(),
            ));
        }
    }
    out
}

/// VK_KUBELET_PORT, COCOON_K8S_QPS and COCOON_K8S_BURST fall back to their defaults on a
/// malformed value: the resolved value then differs from what was set.
fn fell_back(name: &str, raw: &str, value: &str) -> bool {
    let raw = raw.trim();
    match name {
        "VK_KUBELET_PORT" | "COCOON_K8S_BURST" => raw != value,
        "COCOON_K8S_QPS" => raw.parse::<f64>().ok() != value.parse::<f64>().ok(),
        _ => false,
    }
}

/// The value the daemon will use, from the parsed configuration (None: shown as set).
fn value_of(c: &Config, name: &str) -> Option<String> {
    let path = |p: &std::path::Path| p.display().to_string();
    let opt = |o: &Option<String>| o.clone().unwrap_or_default();
    Some(match name {
        "OCI_REGISTRY" => c.oci_registry.clone(),
        "VK_LOG_LEVEL" => c.log_level.clone(),
        "VK_NODE_NAME" => c.node_name.clone(),
        "VK_NODE_IP" => c.node_ip.map(|ip| ip.to_string()).unwrap_or_default(),
        "VK_NODE_POOL" => c.node_pool.clone(),
        "VK_SNAPSHOT_CPU_CLASS" => opt(&c.snapshot_cpu_class),
        "VK_PROVIDER_ID" => opt(&c.provider_id),
        "VK_LEASES_PATH" => path(&c.leases_path),
        "VK_COCOON_NET_CONTROL_SOCKET" => match &c.cocoon_net_control_socket {
            Some(p) => path(p),
            None => "(lease release disabled)".into(),
        },
        "VK_COCOON_BIN" => path(&c.cocoon_bin),
        "VK_COCOON_MACOS_BIN" => path(&c.cocoon_macos_bin),
        // A secret: its length only.
        "COCOON_MACOS_VNC_PASSWORD" => match &c.macos_vnc_password {
            Some(p) => format!("(set, {} bytes)", p.len()),
            None => String::new(),
        },
        "VK_ORPHAN_POLICY" => match c.orphan_policy {
            OrphanPolicy::Destroy => "destroy",
            OrphanPolicy::Alert => "alert",
            OrphanPolicy::Keep => "keep",
        }
        .into(),
        "VK_RESTORE_MODE" => c.restore_mode.as_str().into(),
        "VK_CLONE_FROM_DIR_ROOT" => opt(&c.clone_from_dir_root),
        "VK_IMAGE_URL_ALLOW_HOSTS" => c.image_url_allow_hosts.join(","),
        "VK_STAGING_DIR" => path(&c.staging_dir),
        "VK_STATE_DIR" => path(&c.state_dir),
        "VK_PEER_ADDR" => c.peer_addr.to_string(),
        "VK_COCOON_SNAPSHOT_DIR" => path(&c.cocoon_snapshot_dir),
        "VK_TLS_CERT" => path(&c.tls_cert),
        "VK_TLS_KEY" => path(&c.tls_key),
        "VK_KUBELET_PORT" => c.kubelet_port.to_string(),
        "VK_KUBELET_AUTH" => match c.kubelet_auth {
            KubeletAuth::On => "on",
            KubeletAuth::Off => "off",
        }
        .into(),
        "VK_CLIENT_CA_FILE" => c.client_ca_file.as_deref().map(path).unwrap_or_default(),
        "VK_METRICS_ADDR" => c.metrics_addr.to_string(),
        "VK_RESERVE_PERCENT" => c.reserve_percent.to_string(),
        "VK_NODE_CPU" => opt(&c.node_cpu),
        "VK_NODE_MEM" => opt(&c.node_mem),
        "VK_NODE_STORAGE" => opt(&c.node_storage),
        "VK_NODE_HUGEPAGES" => opt(&c.node_hugepages),
        "VK_NODE_PODS" => c.node_pods.clone(),
        "COCOON_ROOT_DIR" => path(&c.cocoon_root_dir),
        "COCOON_CGROUP_PARENT" => c.cocoon_cgroup_parent.clone(),
        "SNAPSHOT_ZSTD_LEVEL" => c.snapshot_zstd_level.to_string(),
        "SNAPSHOT_CHUNK_SIZE_MIB" => c.snapshot_chunk_size_mib.to_string(),
        "SNAPSHOT_TRANSFER_CONCURRENCY" => c.snapshot_transfer_concurrency.to_string(),
        "SNAPSHOT_MEMORY_BUDGET_MIB" => c.snapshot_memory_budget_mib.to_string(),
        "SNAPSHOT_PULL_BUDGET_MIB" => c.snapshot_pull_budget_mib.to_string(),
        "COCOON_K8S_QPS" => c.k8s_qps.to_string(),
        "COCOON_K8S_BURST" => c.k8s_burst.to_string(),
        "VK_COCOON_DEADLINES" => {
            let d = &c.cocoon_deadlines;
            format!(
                "query={},control={},create={},transfer={}",
                d.query.as_secs(),
                d.control.as_secs(),
                d.create.as_secs(),
                d.transfer.as_secs()
            )
        }
        _ => return None,
    })
}

/// Hosts reserved for documentation and tests (RFC 2606, RFC 6761): a registry there is a
/// placeholder left from an example file, never a real one.
pub fn placeholder_host(host: &str) -> bool {
    let h = host
        .split(':')
        .next()
        .unwrap_or("")
        .trim_end_matches('.')
        .to_ascii_lowercase();
    [
        "example.com",
        "example.net",
        "example.org",
        "example",
        "invalid",
        "test",
    ]
    .iter()
    .any(|d| h == *d || h.ends_with(&format!(".{d}")))
}

/// Risky combinations and placeholder values: warnings (a listener clash fails the start).
pub fn advice(c: &Config, node_ip: Option<IpAddr>) -> Vec<Finding> {
    let mut out = Vec::new();
    let registry_host = c.oci_registry.split('/').next().unwrap_or("");
    if placeholder_host(registry_host) {
        out.push(Finding::warn(format!(
            "OCI_REGISTRY={} is a placeholder (a documentation domain, as in the env example): \
             every snapshot push and pull will fail until it names the real registry",
            c.oci_registry
        )));
    }
    if c.node_name == "cocoon-pool" && c.orphan_policy == OrphanPolicy::Destroy {
        out.push(Finding::warn(
            "VK_NODE_NAME is the default cocoon-pool and VK_ORPHAN_POLICY is destroy: a second \
             host left at the default registers the same Node, sees the other host's pods as \
             VM-less and its own VMs as orphans, and destroys them at start; give each host its \
             own VK_NODE_NAME (or use VK_ORPHAN_POLICY=alert)",
        ));
    } else if c.node_name == "cocoon-pool" {
        out.push(Finding::warn(
            "VK_NODE_NAME is the default cocoon-pool: every host needs a name of its own",
        ));
    }
    if c.kubelet_auth == KubeletAuth::Off && c.kubelet_port != 0 {
        out.push(Finding::warn(format!(
            "VK_KUBELET_AUTH=off with the kubelet API on port {} of every interface: anyone \
             who reaches it can read every guest's console and exec into it",
            c.kubelet_port
        )));
    }
    if let Some(ip) = node_ip.filter(IpAddr::is_loopback) {
        out.push(Finding::warn(format!(
            "the node IP {ip} is a loopback address: the API server cannot reach the kubelet \
             API (logs, exec) and peers cannot reach the snapshot listener"
        )));
    }
    if c.cocoon_net_control_socket.is_none() {
        out.push(Finding::warn(
            "VK_COCOON_NET_CONTROL_SOCKET is set but empty: DHCP leases of removed VMs are not \
             released and stay taken until they expire",
        ));
    }
    if c.reserve_percent == 0 && c.node_cpu.is_none() && c.node_mem.is_none() {
        out.push(Finding::warn(
            "VK_RESERVE_PERCENT=0 with measured capacity: the scheduler may hand every CPU and \
             byte of memory to guests, leaving nothing for the host, cocoon and this daemon",
        ));
    }
    for host in &c.image_url_allow_hosts {
        if matches!(
            host.as_str(),
            "169.254.169.254" | "fd00:ec2::254" | "metadata.google.internal" | "metadata"
        ) {
            out.push(Finding::warn(format!(
                "VK_IMAGE_URL_ALLOW_HOSTS names the cloud metadata service {host}: a pod's image \
                 URL can then make the host fetch its credentials"
            )));
        }
    }
    if c.test_wall_clock_offset_file.is_some() {
        out.push(Finding::warn(
            "VK_TEST_WALL_CLOCK_OFFSET_FILE is set: it is for tests only and shifts the \
             daemon's clock on a real host",
        ));
    }
    // Listeners that cannot all bind: the daemon would stop at start.
    let ports = [
        ("VK_KUBELET_PORT", Some(c.kubelet_port)),
        ("VK_METRICS_ADDR", Some(c.metrics_addr.port)),
        ("VK_PEER_ADDR", Some(c.peer_addr.port)),
    ];
    for (i, (a, pa)) in ports.iter().enumerate() {
        for (b, pb) in &ports[i + 1..] {
            if pa == pb && pa.is_some_and(|p| p != 0) {
                out.push(Finding::fail(format!(
                    "{a} and {b} use the same port {}: the second listener cannot bind",
                    pa.unwrap_or_default()
                )));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> (Config, HashMap<String, String>) {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let c = Config::from_env(&|k| env.get(k).cloned()).unwrap();
        (c, env)
    }

    fn find<'a>(s: &'a [Setting], name: &str) -> &'a Setting {
        s.iter().find(|x| x.name == name).unwrap()
    }

    #[test]
    fn every_variable_shows_its_value_and_source() {
        let (c, env) = config(&[
            ("OCI_REGISTRY", "reg.local/cocoon"),
            ("VK_KUBELET_PORT", "nope"),
            ("VK_RESERVE_PERCENT", "10"),
            ("COCOON_MACOS_VNC_PASSWORD", "0123456789abcdef0123"),
        ]);
        let d = Detected {
            node_ip: Some((
                "10.0.0.5".parse().unwrap(),
                "IPv4 default route via bond0".into(),
            )),
            capacity: vec![
                ("cpu".into(), "16".into()),
                ("hugepages-2Mi".into(), "0".into()),
            ],
            kubeconfig: Some((
                "/etc/cocoon/kubeconfig".into(),
                "https://api:6443".into(),
                "client certificate CN=system:node:n1".into(),
            )),
        };
        let s = resolved(&c, &|k| env.get(k).cloned(), &d);
        assert_eq!(s.len(), VARIABLES.len() + 3);
        let oci = find(&s, "OCI_REGISTRY");
        assert_eq!(
            (oci.value.as_str(), oci.source.as_str()),
            ("reg.local/cocoon", "env")
        );
        let r = find(&s, "VK_RESERVE_PERCENT");
        assert_eq!((r.value.as_str(), r.source.as_str()), ("10", "env"));
        let p = find(&s, "VK_KUBELET_PORT");
        assert_eq!(p.value, "10250");
        assert!(p.source.contains("malformed"), "{}", p.source);
        let ip = find(&s, "VK_NODE_IP");
        assert_eq!(ip.value, "10.0.0.5");
        assert_eq!(ip.source, "auto-detected: IPv4 default route via bond0");
        assert_eq!(find(&s, "VK_NODE_CPU").value, "16");
        assert_eq!(find(&s, "VK_NODE_HUGEPAGES").value, "hugepages-2Mi=0");
        let o = find(&s, "VK_ORPHAN_POLICY");
        assert_eq!(
            (o.value.as_str(), o.source.as_str()),
            ("destroy", "default")
        );
        let secret = find(&s, "COCOON_MACOS_VNC_PASSWORD");
        assert_eq!(secret.value, "(set, 20 bytes)", "never the secret itself");
        let kc = find(&s, "KUBECONFIG");
        assert_eq!(kc.value, "/etc/cocoon/kubeconfig");
        assert_eq!(find(&s, "API server").source, "/etc/cocoon/kubeconfig");
    }

    #[test]
    fn risky_pairs_and_placeholders_are_warned() {
        let (c, _) = config(&[("OCI_REGISTRY", "registry.example.com/cocoon")]);
        let text: Vec<String> = advice(&c, None).iter().map(|f| f.text.clone()).collect();
        assert!(text.iter().any(|t| t.contains("placeholder")), "{text:?}");
        assert!(
            text.iter()
                .any(|t| t.contains("cocoon-pool") && t.contains("destroy")),
            "{text:?}"
        );
        let (c, _) = config(&[
            ("OCI_REGISTRY", "reg.local/cocoon"),
            ("VK_NODE_NAME", "host-1"),
            ("VK_METRICS_ADDR", ":10250"),
            ("VK_IMAGE_URL_ALLOW_HOSTS", "169.254.169.254"),
        ]);
        let found = advice(&c, Some("127.0.0.1".parse().unwrap()));
        assert!(found
            .iter()
            .any(|f| f.level == super::super::Level::Fail && f.text.contains("same port 10250")));
        assert!(found.iter().any(|f| f.text.contains("loopback")));
        assert!(found.iter().any(|f| f.text.contains("metadata")));
        assert!(!found.iter().any(|f| f.text.contains("placeholder")));
        let (c, _) = config(&[("OCI_REGISTRY", "reg.local/cocoon"), ("VK_NODE_NAME", "h2")]);
        assert!(advice(&c, Some("10.0.0.5".parse().unwrap())).is_empty());
    }
}
