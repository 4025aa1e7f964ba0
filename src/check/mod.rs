//! `vk-cocoon check-config [--online]`: what the daemon would do with this configuration, and
//! every reason it would fail or misbehave, without starting anything.
//!
//! Prints every setting with its resolved value and source, then one `PASS` / `WARN` / `FAIL`
//! line per check: the variables, the kubeconfig, the kubelet TLS files and the certificates'
//! names and dates, risky combinations; with `--online` also the API server's answer to one
//! SelfSubjectAccessReview per verb and resource the daemon uses, and a registry ping.
//! Exit status: 2 when the configuration itself fails (the daemon would exit 2 or break at
//! once), 1 when only an online check fails, 0 otherwise.

pub mod certs;
pub mod online;
pub mod settings;

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use crate::config::{self, Config, ConfigError};
use crate::kube::{self, KubeOptions};
use crate::{kubelet, logging};

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Pass,
    Warn,
    Fail,
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub level: Level,
    pub text: String,
}

impl Finding {
    pub fn pass(text: impl Into<String>) -> Finding {
        Finding {
            level: Level::Pass,
            text: text.into(),
        }
    }
    pub fn warn(text: impl Into<String>) -> Finding {
        Finding {
            level: Level::Warn,
            text: text.into(),
        }
    }
    pub fn fail(text: impl Into<String>) -> Finding {
        Finding {
            level: Level::Fail,
            text: text.into(),
        }
    }

    /// `PASS text`, `WARN text` or `FAIL text`.
    pub fn line(&self) -> String {
        let tag = match self.level {
            Level::Pass => "PASS",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        format!("{tag} {}", self.text)
    }
}

/// VK_LOG_LEVEL and every other variable: the configuration, or every problem with it.
pub fn read_config(env: &dyn Fn(&str) -> Option<String>) -> Result<Config, Vec<String>> {
    let mut problems = Vec::new();
    if let Err(e) = logging::parse_level(env("VK_LOG_LEVEL").as_deref().unwrap_or("")) {
        problems.push(e.to_string());
    }
    match Config::from_env_all(env) {
        Ok(c) if problems.is_empty() => Ok(c),
        Ok(_) => Err(problems),
        Err(errors) => {
            problems.extend(errors.iter().map(ConfigError::to_string));
            Err(problems)
        }
    }
}

/// Runs every check on the process environment, prints the report, returns the exit status.
pub fn run(online_checks: bool) -> i32 {
    let env = |name: &str| std::env::var(name).ok();
    let now = crate::wall_clock::now();
    let mut offline: Vec<Finding> = Vec::new();
    let config = config_findings(&env, &mut offline);
    let kube_opts = KubeOptions {
        timeout: Duration::from_secs(10),
        ..KubeOptions::from_process_env()
    };
    let cluster = load_cluster(&kube_opts, now, &mut offline);

    let mut detected = settings::Detected::default();
    let node_ip = resolve_node_ip(config.as_ref(), &mut detected, &mut offline);
    if let Some(cluster) = &cluster {
        detected.kubeconfig = Some((
            cluster.source.clone(),
            cluster.server.clone(),
            credentials_of(cluster),
        ));
    }
    if let Some(c) = &config {
        detected.capacity = capacity(c, node_ip);
        offline.extend(settings::advice(c, node_ip));
        offline.extend(files(c, cluster.as_ref(), node_ip, now));
    }

    if let Some(c) = &config {
        println!("Settings (value, then where it came from):");
        for s in settings::resolved(c, &env, &detected) {
            println!("  {} = {}   [{}]", s.name, s.value, s.source);
        }
        println!();
    }
    println!("Checks:");
    for f in &offline {
        println!("{}", f.line());
    }
    let mut online_failed = false;
    if online_checks {
        let found = online_findings(config.as_ref(), cluster.as_ref(), &kube_opts);
        for f in &found {
            println!("{}", f.line());
        }
        online_failed = found.iter().any(|f| f.level == Level::Fail);
    }
    verdict(&offline, online_failed)
}

/// Reads the configuration: its errors, its warnings and unknown `VK_` variables as findings.
fn config_findings(
    env: &dyn Fn(&str) -> Option<String>,
    offline: &mut Vec<Finding>,
) -> Option<Config> {
    let config = match read_config(env) {
        Ok(c) => Some(c),
        Err(problems) => {
            offline.extend(problems.into_iter().map(Finding::fail));
            None
        }
    };
    if let Some(c) = &config {
        offline.extend(c.warnings.iter().cloned().map(Finding::warn));
    }
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    offline.extend(
        config::unknown_vk_variables(names.iter().map(String::as_str))
            .into_iter()
            .map(|n| Finding::warn(format!("unknown variable {n} is ignored"))),
    );
    config
}

/// Loads the kubeconfig: whether it loads, its TLS settings and its client certificate.
fn load_cluster(
    kube_opts: &KubeOptions,
    now: SystemTime,
    offline: &mut Vec<Finding>,
) -> Option<kube::ClusterConfig> {
    match kube::kubeconfig::load(kube_opts) {
        Ok(cluster) => {
            let tls = kube::tls::client_config(&kube::tls::TlsParams {
                ca_pem: cluster.ca_pem.as_deref(),
                insecure_skip_tls_verify: cluster.insecure_skip_tls_verify,
                tls_server_name: cluster.tls_server_name.as_deref(),
                client_cert: cluster
                    .client_cert
                    .as_ref()
                    .map(|(c, k)| (c.as_slice(), k.as_slice())),
            });
            match tls {
                Err(e) => offline.push(Finding::fail(format!(
                    "kubeconfig ({}): {e}",
                    cluster.source
                ))),
                Ok(_) => offline.push(Finding::pass(format!(
                    "{} loads (API server {})",
                    cluster.source, cluster.server
                ))),
            }
            if let Some((cert, _)) = &cluster.client_cert {
                offline.push(certs::client(&cluster.source, cert, now));
            }
            Some(cluster)
        }
        Err(e) => {
            offline.push(Finding::fail(format!("kubeconfig: {e}")));
            None
        }
    }
}

/// The node IP: the configured one, else the detected one (a failure when none is found).
fn resolve_node_ip(
    config: Option<&Config>,
    detected: &mut settings::Detected,
    offline: &mut Vec<Finding>,
) -> Option<IpAddr> {
    match config {
        Some(c) if c.node_ip.is_none() => match crate::node_ip::detect() {
            Some(d) => {
                detected.node_ip = Some((d.ip, d.how.clone()));
                Some(d.ip)
            }
            None => {
                offline.push(Finding::fail(
                    "VK_NODE_IP is unset and no default route or non-loopback IPv4 address was \
                     found: the daemon would stop at start",
                ));
                None
            }
        },
        Some(c) => c.node_ip,
        None => None,
    }
}

/// `--online`: the API server's access reviews and the registry ping.
fn online_findings(
    config: Option<&Config>,
    cluster: Option<&kube::ClusterConfig>,
    kube_opts: &KubeOptions,
) -> Vec<Finding> {
    let mut found = Vec::new();
    match (config, cluster) {
        (Some(_), Some(cluster)) => match kube::Client::from_config(cluster.clone(), kube_opts) {
            Ok(client) => found.extend(online::kubernetes(&client)),
            Err(e) => found.push(Finding::fail(format!("kubeconfig: {e}"))),
        },
        _ => found.push(Finding::fail(
            "online checks skipped: the configuration or the kubeconfig does not load",
        )),
    }
    if let Some(c) = config {
        let host = c.oci_registry.split('/').next().unwrap_or("");
        if settings::placeholder_host(host) {
            found.push(Finding::fail(format!(
                "registry {host}: not pinged, a placeholder (see the WARN above)"
            )));
        } else {
            found.push(online::registry(
                &c.oci_registry,
                c.oci_registry_ca_file.as_deref(),
            ));
        }
    }
    found
}

/// The exit status, with its closing line: 2 for a failed check, 1 for a failed online check.
fn verdict(offline: &[Finding], online_failed: bool) -> i32 {
    let problems = offline.iter().filter(|f| f.level == Level::Fail).count();
    if problems > 0 {
        println!("{problems} problem(s) found");
        2
    } else if online_failed {
        println!("configuration OK, but an online check failed");
        1
    } else {
        println!("configuration OK");
        0
    }
}

/// How the kubeconfig authenticates, without its secrets.
fn credentials_of(cluster: &kube::ClusterConfig) -> String {
    if let Some((cert, _)) = &cluster.client_cert {
        use rustls::pki_types::pem::PemObject;
        let id = rustls::pki_types::CertificateDer::pem_slice_iter(cert)
            .next()
            .and_then(Result::ok)
            .and_then(|der| kubelet::tls::cert_identity(&der));
        if let Some(id) = id {
            return format!(
                "client certificate CN={} O={}",
                id.common_name.unwrap_or_default(),
                id.organizations.join(",")
            );
        }
        return "client certificate".into();
    }
    match &cluster.auth {
        kube::kubeconfig::AuthConfig::None => "none".into(),
        kube::kubeconfig::AuthConfig::Token(_) => "bearer token (inline)".into(),
        kube::kubeconfig::AuthConfig::TokenFile(p) => format!("bearer token file {}", p.display()),
        kube::kubeconfig::AuthConfig::Basic { username, .. } => format!("basic auth as {username}"),
        kube::kubeconfig::AuthConfig::Exec(e) => format!("exec plugin {}", e.command),
    }
}

/// Capacity measured on the host (what the Node would advertise), by resource.
fn capacity(c: &Config, node_ip: Option<std::net::IpAddr>) -> Vec<(String, String)> {
    let opts = crate::node::NodeOptions {
        name: c.node_name.clone(),
        ip: node_ip.unwrap_or(std::net::IpAddr::from([0, 0, 0, 0])),
        pool: c.node_pool.clone(),
        snapshot_cpu_class: c.snapshot_cpu_class.clone(),
        provider_id: c.provider_id.clone(),
        kubelet_port: c.kubelet_port,
        version: crate::version::VERSION.to_string(),
        root_dir: c.cocoon_root_dir.clone(),
        reserve_percent: c.reserve_percent,
        cpu: c.node_cpu.clone(),
        mem: c.node_mem.clone(),
        storage: c.node_storage.clone(),
        hugepages: c.node_hugepages.clone(),
        pods: c.node_pods.clone(),
    };
    let Ok(host) = crate::node::HostFacts::read(&c.cocoon_root_dir) else {
        return Vec::new();
    };
    match crate::node::compute_resources(&opts, &host) {
        Ok(r) => r
            .capacity
            .into_iter()
            .map(|(k, q)| {
                let alloc = r
                    .allocatable
                    .get(&k)
                    .map(|a| a.0.clone())
                    .unwrap_or_default();
                (k, format!("{} (allocatable {alloc})", q.0))
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The files the daemon reads at start: the kubelet TLS pair (and its certificate's names
/// and dates), the client CA, the cocoon binary.
fn files(
    c: &Config,
    cluster: Option<&kube::ClusterConfig>,
    node_ip: Option<std::net::IpAddr>,
    now: std::time::SystemTime,
) -> Vec<Finding> {
    let mut out = Vec::new();
    match crate::snapshots::trust::RegistryTrust::load(c.oci_registry_ca_file.as_deref()) {
        Ok(trust) => out.push(Finding::pass(format!(
            "registry TLS trusts {}",
            trust.source
        ))),
        Err(e) => out.push(Finding::fail(format!("OCI_REGISTRY_CA_FILE: {e}"))),
    }
    if let Some(cluster) = cluster {
        match kubelet::tls_settings(c, node_ip, cluster.ca_pem.clone()) {
            Err(e) => out.push(Finding::fail(format!("kubelet client CA: {e}"))),
            Ok(s) => match kubelet::tls::TlsState::new(s) {
                Err(e) => out.push(Finding::fail(format!("kubelet TLS: {e}"))),
                Ok(state) if *state.source() == kubelet::tls::CertSource::SelfSigned => {
                    // A present but expired certificate is reported by its dates below.
                    if !c.tls_cert.is_file() {
                        out.push(Finding::warn(format!(
                            "kubelet TLS: {} not found; a self-signed certificate would be \
                             used, which API servers that verify kubelets reject",
                            c.tls_cert.display()
                        )));
                    }
                }
                Ok(_) => {}
            },
        }
    }
    if let Ok(pem) = std::fs::read(&c.tls_cert) {
        let path = c.tls_cert.display().to_string();
        out.extend(certs::serving(&path, &pem, &c.node_name, node_ip, now));
    }
    if c.cocoon_bin.is_file() {
        out.push(Finding::pass(format!(
            "cocoon CLI {}",
            c.cocoon_bin.display()
        )));
    } else {
        out.push(Finding::fail(format!(
            "VK_COCOON_BIN: {} does not exist",
            c.cocoon_bin.display()
        )));
    }
    out
}
