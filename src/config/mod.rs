//! Every environment variable the daemon reads: defaults, validation, clear errors.
//! Owns parsing only; never touches the network, the runtime or the clock.
//!
//! `Config::from_env(&lookup)` takes the lookup as a function so tests never touch the
//! process environment. Rules (those of the Go daemon): an empty value counts as unset, except
//! `VK_COCOON_NET_CONTROL_SOCKET`, where set-but-empty disables lease release. An invalid value
//! is a `ConfigError` naming the variable, the value and what is allowed (main exits 2).
//! `VK_KUBELET_PORT`, `COCOON_K8S_QPS` and `COCOON_K8S_BURST` fall back to their defaults on a
//! malformed value as the Go daemon does, with a warning in `Config::warnings`.
//! `VK_LOG_LEVEL` is validated by `logging`; main reports it with these errors (exit 2).
//! Beyond the Go daemon: `VK_KUBELET_AUTH` and `VK_CLIENT_CA_FILE` (the kubelet API is authenticated,
//! unlike the Go daemon's), and `OCI_REGISTRY_CA_FILE` (the Go daemon trusted only the host's
//! store, which a private registry CA had to be installed into). The virtual-kubelet CLI's environment knobs (`KUBELET_PORT`,
//! `DEFAULT_NODE_NAME`, `VKUBELET_TAINT_*`, `APISERVER_*_LOCATION`) belong to the
//! virtual-kubelet CLI, which the Go vk-cocoon never used, so they are not read.
//!
//! variables: the documented table; values: the generic readers (defaults, ranges, files);
//! settings: one reader per variable with a rule of its own; syntax: Kubernetes name and
//! quantity syntax; listen: listen addresses.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

mod listen;
mod settings;
mod syntax;
mod values;
mod variables;

pub use listen::ListenAddr;
pub use settings::macos_vnc_secret_ok;
pub use syntax::{is_dns_name, is_label_value, is_quantity};
pub use variables::{Variable, VARIABLES};

use settings::{
    cgroup_parent, deadlines, k8s_burst, k8s_qps, kubelet_auth, kubelet_port, macos_vnc_password,
    net_control_socket, node_ip, node_name, node_pool, oci_registry, orphan_policy,
    reserve_percent, restore_mode, snapshot_chunk_size_mib, snapshot_cpu_class,
    snapshot_memory_budget_mib, snapshot_pull_budget_mib, snapshot_transfer_concurrency,
    snapshot_zstd_level,
};
use values::{
    ca_bundle_file, dir_root, get, host_list, listen_addr, path_or, quantity, state_dir, string_or,
};

/// What to do with VMs that have no pod at startup reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrphanPolicy {
    Destroy,
    Alert,
    Keep,
}

/// How `cocoon` restores a snapshot's memory: the cocoon contract's own type.
pub use crate::vm::RestoreMode;

/// Whether the kubelet API checks who is calling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeletAuth {
    /// Client certificates / bearer tokens required (default).
    On,
    /// Anyone who reaches the port may read logs and exec (the Go daemon's behaviour).
    Off,
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub kubeconfig: Option<String>,
    /// Raw `VK_LOG_LEVEL` (validated by `logging::parse_level`).
    pub log_level: String,
    pub node_name: String,
    /// None = auto-detect (node room).
    pub node_ip: Option<IpAddr>,
    pub node_pool: String,
    pub snapshot_cpu_class: Option<String>,
    pub provider_id: Option<String>,
    pub oci_registry: String,
    /// Extra CA bundle for registry TLS; None = the host's trust store alone.
    pub oci_registry_ca_file: Option<PathBuf>,
    pub google_application_credentials: Option<PathBuf>,
    pub leases_path: PathBuf,
    /// None = lease release disabled (variable set but empty).
    pub cocoon_net_control_socket: Option<PathBuf>,
    pub cocoon_bin: PathBuf,
    pub cocoon_macos_bin: PathBuf,
    pub macos_vnc_password: Option<String>,
    pub orphan_policy: OrphanPolicy,
    pub restore_mode: RestoreMode,
    /// VK_IMAGE_URL_ALLOW_HOSTS, lower-case, without trailing dots or brackets.
    pub image_url_allow_hosts: Vec<String>,
    /// VK_CLONE_FROM_DIR_ROOT: absolute, canonical, no trailing `/`; None = clone-from-dir refused.
    pub clone_from_dir_root: Option<String>,
    pub staging_dir: PathBuf,
    /// VK_STATE_DIR: the daemon's state directory (the ownership ledger).
    pub state_dir: PathBuf,
    pub peer_addr: ListenAddr,
    pub cocoon_snapshot_dir: PathBuf,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    pub kubelet_port: u16,
    pub kubelet_auth: KubeletAuth,
    /// CA bundle for kubelet API client certificates; None = the kubeconfig's cluster CA.
    pub client_ca_file: Option<PathBuf>,
    pub metrics_addr: ListenAddr,
    pub reserve_percent: u8,
    /// Kubernetes quantity strings, syntax-checked; None = auto.
    pub node_cpu: Option<String>,
    pub node_mem: Option<String>,
    pub node_storage: Option<String>,
    pub node_hugepages: Option<String>,
    pub node_pods: String,
    pub cocoon_root_dir: PathBuf,
    pub cocoon_cgroup_parent: String,
    pub snapshot_zstd_level: i32,
    pub snapshot_chunk_size_mib: u64,
    pub snapshot_transfer_concurrency: usize,
    pub snapshot_memory_budget_mib: u64,
    pub snapshot_pull_budget_mib: u64,
    pub k8s_qps: f64,
    pub k8s_burst: u32,
    /// `VK_TEST_WALL_CLOCK_OFFSET_FILE` (tests only).
    pub test_wall_clock_offset_file: Option<PathBuf>,
    /// `VK_COCOON_DEADLINES` over the defaults.
    pub cocoon_deadlines: crate::vm::Deadlines,
    /// Non-fatal findings (malformed values that fell back to defaults) for the log.
    pub warnings: Vec<String>,
}

/// An invalid or missing variable. Displays as one line: variable, value, what is allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub variable: &'static str,
    /// None when the variable is missing; secrets are shown redacted.
    pub value: Option<String>,
    pub allowed: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            None => write!(f, "{} must be set: {}", self.variable, self.allowed),
            Some(v) => write!(
                f,
                "{}={:?} is invalid: allowed {}",
                self.variable, v, self.allowed
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// The snapshot push spool: `vk-spool` beside VK_STAGING_DIR (by default
    /// /var/lib/cocoon/vk-spool), a directory only the daemon's user may enter.
    pub fn spool_dir(&self) -> PathBuf {
        self.staging_dir
            .parent()
            .unwrap_or_else(|| std::path::Path::new("/"))
            .join("vk-spool")
    }

    /// Reads and validates every variable through `env` (for the daemon: `std::env::var(..).ok()`).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let mut warnings = Vec::new();
        // A fixed order: the first invalid variable is the error, and from_env_all lists
        // them in this order.
        let oci_registry = oci_registry(env)?;
        let node_name = node_name(env)?;
        let node_ip = node_ip(env)?;
        let node_pool = node_pool(env)?;
        let snapshot_cpu_class = snapshot_cpu_class(env)?;
        let macos_vnc_password = macos_vnc_password(env, &mut warnings)?;
        let orphan_policy = orphan_policy(env)?;
        let restore_mode = restore_mode(env)?;
        let kubelet_port = kubelet_port(env, &mut warnings);
        let kubelet_auth = kubelet_auth(env, &mut warnings)?;
        let k8s_qps = k8s_qps(env, &mut warnings);
        let k8s_burst = k8s_burst(env, &mut warnings);
        let cocoon_net_control_socket = net_control_socket(env);
        let cocoon_cgroup_parent = cgroup_parent(env)?;
        let cocoon_deadlines = deadlines(env)?;

        Ok(Config {
            kubeconfig: get(env, "KUBECONFIG"),
            log_level: string_or(env, "VK_LOG_LEVEL", "info"),
            node_name,
            node_ip,
            node_pool,
            snapshot_cpu_class,
            provider_id: get(env, "VK_PROVIDER_ID"),
            oci_registry,
            oci_registry_ca_file: ca_bundle_file(env, "OCI_REGISTRY_CA_FILE")?,
            google_application_credentials: get(env, "GOOGLE_APPLICATION_CREDENTIALS")
                .map(PathBuf::from),
            leases_path: path_or(env, "VK_LEASES_PATH", "/var/lib/cocoon/net/leases.json"),
            cocoon_net_control_socket,
            cocoon_bin: path_or(env, "VK_COCOON_BIN", "/usr/local/bin/cocoon"),
            cocoon_macos_bin: path_or(env, "VK_COCOON_MACOS_BIN", "/usr/local/bin/cocoon-macos"),
            macos_vnc_password,
            orphan_policy,
            restore_mode,
            image_url_allow_hosts: host_list(env, "VK_IMAGE_URL_ALLOW_HOSTS")?,
            clone_from_dir_root: dir_root(env, "VK_CLONE_FROM_DIR_ROOT")?,
            staging_dir: path_or(env, "VK_STAGING_DIR", "/var/lib/cocoon/vk-staging"),
            state_dir: state_dir(env)?,
            peer_addr: listen_addr(env, "VK_PEER_ADDR", ":12501")?,
            cocoon_snapshot_dir: path_or(
                env,
                "VK_COCOON_SNAPSHOT_DIR",
                "/var/lib/cocoon/snapshot/localfile",
            ),
            tls_cert: path_or(env, "VK_TLS_CERT", "/etc/cocoon/vk/tls/vk-kubelet.crt"),
            tls_key: path_or(env, "VK_TLS_KEY", "/etc/cocoon/vk/tls/vk-kubelet.key"),
            kubelet_port,
            kubelet_auth,
            client_ca_file: ca_bundle_file(env, "VK_CLIENT_CA_FILE")?,
            metrics_addr: listen_addr(env, "VK_METRICS_ADDR", ":9091")?,
            reserve_percent: reserve_percent(env)?,
            node_cpu: quantity(env, "VK_NODE_CPU")?,
            node_mem: quantity(env, "VK_NODE_MEM")?,
            node_storage: quantity(env, "VK_NODE_STORAGE")?,
            node_hugepages: quantity(env, "VK_NODE_HUGEPAGES")?,
            node_pods: quantity(env, "VK_NODE_PODS")?.unwrap_or_else(|| "256".to_string()),
            cocoon_root_dir: path_or(env, "COCOON_ROOT_DIR", "/var/lib/cocoon"),
            cocoon_cgroup_parent,
            snapshot_zstd_level: snapshot_zstd_level(env)?,
            snapshot_chunk_size_mib: snapshot_chunk_size_mib(env)?,
            snapshot_transfer_concurrency: snapshot_transfer_concurrency(env)?,
            snapshot_memory_budget_mib: snapshot_memory_budget_mib(env)?,
            snapshot_pull_budget_mib: snapshot_pull_budget_mib(env)?,
            k8s_qps,
            k8s_burst,
            cocoon_deadlines,
            test_wall_clock_offset_file: get(env, "VK_TEST_WALL_CLOCK_OFFSET_FILE")
                .map(PathBuf::from),
            warnings,
        })
    }

    /// Reads the real process environment.
    pub fn from_process_env() -> Result<Config, ConfigError> {
        Config::from_env(&|name| std::env::var(name).ok())
    }

    /// Like [`Config::from_env`], but finds every invalid variable, not just the first: each
    /// one found is read as unset (a missing required one as a placeholder) and the rest
    /// validated again, so an operator fixes the whole file in one go.
    pub fn from_env_all(env: &dyn Fn(&str) -> Option<String>) -> Result<Config, Vec<ConfigError>> {
        let mut errors: Vec<ConfigError> = Vec::new();
        // Each round masks one more variable, so this ends within one round per variable.
        for _ in 0..=VARIABLES.len() {
            let masked = |name: &str| match errors.iter().find(|e| e.variable == name) {
                Some(_) if name == "OCI_REGISTRY" => Some("placeholder.invalid".to_string()),
                Some(_) => None,
                None => env(name),
            };
            match Config::from_env(&masked) {
                Ok(c) if errors.is_empty() => return Ok(c),
                Ok(_) => break,
                Err(e) if errors.iter().any(|seen| seen.variable == e.variable) => break,
                Err(e) => errors.push(e),
            }
        }
        Err(errors)
    }
}

/// Names starting with `VK_` that this daemon does not know (typos, removed settings),
/// for a warning at startup.
pub fn unknown_vk_variables<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    names
        .into_iter()
        .filter(|n| n.starts_with("VK_") && !VARIABLES.iter().any(|v| v.name == *n))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_env(&move |k| map.get(k).cloned())
    }

    fn ok(pairs: &[(&str, &str)]) -> Config {
        let mut all = vec![("OCI_REGISTRY", "registry.example.test/cocoon")];
        all.extend_from_slice(pairs);
        with(&all).unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        let mut all = vec![("OCI_REGISTRY", "registry.example.test/cocoon")];
        all.extend_from_slice(pairs);
        match with(&all) {
            Ok(c) => panic!("accepted {pairs:?}: {c:?}"),
            Err(e) => {
                let line = e.to_string();
                assert!(!line.contains('\n'), "one line: {line}");
                line
            }
        }
    }

    #[test]
    fn every_invalid_variable_is_reported_at_once() {
        let env: HashMap<&str, &str> = [
            ("VK_NODE_NAME", "Bad_Name"),
            ("VK_RESTORE_MODE", "mmap   # copy, ondemand or mmap"),
            ("VK_ORPHAN_POLICY", "sometimes"),
            ("VK_RESERVE_PERCENT", "200"),
        ]
        .into_iter()
        .collect();
        let errors = Config::from_env_all(&|k| env.get(k).map(|v| v.to_string())).unwrap_err();
        let names: Vec<&str> = errors.iter().map(|e| e.variable).collect();
        for want in [
            "OCI_REGISTRY",
            "VK_NODE_NAME",
            "VK_RESTORE_MODE",
            "VK_ORPHAN_POLICY",
            "VK_RESERVE_PERCENT",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert_eq!(names.len(), 5, "{names:?}");
        let good =
            Config::from_env_all(&|k| (k == "OCI_REGISTRY").then(|| "r.example".to_string()));
        assert!(good.is_ok());
    }

    #[test]
    fn every_default() {
        let c = ok(&[]);
        assert_eq!(c.kubeconfig, None);
        assert_eq!(c.log_level, "info");
        assert_eq!(c.node_name, "cocoon-pool");
        assert_eq!(c.node_ip, None);
        assert_eq!(c.node_pool, "default");
        assert_eq!(c.snapshot_cpu_class, None);
        assert_eq!(c.provider_id, None);
        assert_eq!(c.oci_registry, "registry.example.test/cocoon");
        assert_eq!(c.google_application_credentials, None);
        assert_eq!(
            c.leases_path,
            PathBuf::from("/var/lib/cocoon/net/leases.json")
        );
        assert_eq!(
            c.cocoon_net_control_socket,
            Some(PathBuf::from("/run/cocoon-net/control.sock"))
        );
        assert_eq!(c.cocoon_bin, PathBuf::from("/usr/local/bin/cocoon"));
        assert_eq!(
            c.cocoon_macos_bin,
            PathBuf::from("/usr/local/bin/cocoon-macos")
        );
        assert_eq!(c.macos_vnc_password, None);
        assert_eq!(c.orphan_policy, OrphanPolicy::Destroy);
        assert_eq!(c.restore_mode, RestoreMode::Mmap);
        assert_eq!(c.staging_dir, PathBuf::from("/var/lib/cocoon/vk-staging"));
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/cocoon/vk-cocoon"));
        assert_eq!(c.spool_dir(), PathBuf::from("/var/lib/cocoon/vk-spool"));
        assert_eq!(
            c.peer_addr,
            ListenAddr {
                host: String::new(),
                port: 12501
            }
        );
        assert_eq!(
            c.cocoon_snapshot_dir,
            PathBuf::from("/var/lib/cocoon/snapshot/localfile")
        );
        assert_eq!(
            c.tls_cert,
            PathBuf::from("/etc/cocoon/vk/tls/vk-kubelet.crt")
        );
        assert_eq!(
            c.tls_key,
            PathBuf::from("/etc/cocoon/vk/tls/vk-kubelet.key")
        );
        assert_eq!(c.kubelet_port, 10250);
        assert_eq!(c.kubelet_auth, KubeletAuth::On);
        assert_eq!(c.client_ca_file, None);
        assert_eq!(
            c.metrics_addr,
            ListenAddr {
                host: String::new(),
                port: 9091
            }
        );
        assert_eq!(c.reserve_percent, 20);
        assert_eq!(
            (c.node_cpu, c.node_mem, c.node_storage, c.node_hugepages),
            (None, None, None, None)
        );
        assert_eq!(c.node_pods, "256");
        assert_eq!(c.cocoon_root_dir, PathBuf::from("/var/lib/cocoon"));
        assert_eq!(c.cocoon_cgroup_parent, "cocoon.slice");
        assert_eq!(c.snapshot_zstd_level, 0);
        assert_eq!(c.snapshot_chunk_size_mib, 0);
        assert_eq!(c.snapshot_transfer_concurrency, 8);
        assert_eq!(c.snapshot_memory_budget_mib, 9216);
        assert_eq!(c.snapshot_pull_budget_mib, 2048);
        assert_eq!(c.k8s_qps, 50.0);
        assert_eq!(c.k8s_burst, 100);
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn empty_values_count_as_unset() {
        let names: Vec<&str> = VARIABLES
            .iter()
            .map(|v| v.name)
            .filter(|n| *n != "OCI_REGISTRY" && *n != "VK_COCOON_NET_CONTROL_SOCKET")
            .collect();
        let pairs: Vec<(&str, &str)> = names.iter().map(|n| (*n, "")).collect();
        assert_eq!(ok(&pairs), ok(&[]));
    }

    #[test]
    fn set_values_are_taken() {
        let c = ok(&[
            ("KUBECONFIG", "/a:/b"),
            ("VK_NODE_NAME", "host-7.pool"),
            ("VK_NODE_IP", "10.1.2.3"),
            ("VK_NODE_POOL", "gpu_a-1"),
            ("VK_SNAPSHOT_CPU_CLASS", "epyc-9004"),
            ("VK_PROVIDER_ID", "gce://p/z/n"),
            ("VK_ORPHAN_POLICY", "  Alert "),
            ("VK_RESTORE_MODE", "ONDEMAND"),
            ("VK_PEER_ADDR", "[::1]:8000"),
            ("VK_METRICS_ADDR", "127.0.0.1:0"),
            ("VK_KUBELET_PORT", "11250"),
            ("VK_RESERVE_PERCENT", "0"),
            ("VK_NODE_CPU", "15500m"),
            ("VK_NODE_MEM", "64Gi"),
            ("VK_NODE_STORAGE", "1e12"),
            ("VK_NODE_HUGEPAGES", "0"),
            ("VK_NODE_PODS", "110"),
            ("COCOON_MACOS_VNC_PASSWORD", "s3cret!"),
            ("SNAPSHOT_ZSTD_LEVEL", "19"),
            ("SNAPSHOT_TRANSFER_CONCURRENCY", "1"),
            ("COCOON_K8S_QPS", "7.5"),
            ("COCOON_K8S_BURST", "9"),
        ]);
        assert_eq!(c.kubeconfig.as_deref(), Some("/a:/b"));
        assert_eq!(c.node_name, "host-7.pool");
        assert_eq!(c.node_ip, Some("10.1.2.3".parse().unwrap()));
        assert_eq!(c.node_pool, "gpu_a-1");
        assert_eq!(c.snapshot_cpu_class.as_deref(), Some("epyc-9004"));
        assert_eq!(c.orphan_policy, OrphanPolicy::Alert);
        assert_eq!(c.restore_mode, RestoreMode::OnDemand);
        assert_eq!(
            c.peer_addr,
            ListenAddr {
                host: "::1".into(),
                port: 8000
            }
        );
        assert_eq!(c.peer_addr.to_string(), "[::1]:8000");
        assert_eq!(
            c.metrics_addr.socket_addrs().unwrap(),
            vec!["127.0.0.1:0".parse().unwrap()]
        );
        assert_eq!(c.kubelet_port, 11250);
        assert_eq!(c.reserve_percent, 0);
        assert_eq!(c.node_cpu.as_deref(), Some("15500m"));
        assert_eq!(c.node_mem.as_deref(), Some("64Gi"));
        assert_eq!(c.node_storage.as_deref(), Some("1e12"));
        assert_eq!(c.node_pods, "110");
        assert_eq!(c.macos_vnc_password.as_deref(), Some("s3cret!"));
        assert_eq!(c.snapshot_zstd_level, 19);
        assert_eq!(c.snapshot_transfer_concurrency, 1);
        assert_eq!((c.k8s_qps, c.k8s_burst), (7.5, 9));
        assert_eq!(
            ok(&[("VK_ORPHAN_POLICY", "keep")]).orphan_policy,
            OrphanPolicy::Keep
        );
        assert_eq!(
            ok(&[("VK_RESTORE_MODE", "copy")]).restore_mode,
            RestoreMode::Copy
        );
    }

    #[test]
    fn control_socket_set_but_empty_disables_lease_release() {
        assert_eq!(
            ok(&[("VK_COCOON_NET_CONTROL_SOCKET", "")]).cocoon_net_control_socket,
            None
        );
        assert_eq!(
            ok(&[("VK_COCOON_NET_CONTROL_SOCKET", "/tmp/x.sock")]).cocoon_net_control_socket,
            Some(PathBuf::from("/tmp/x.sock"))
        );
    }

    #[test]
    fn oci_registry_is_required() {
        for value in [None, Some(""), Some("   ")] {
            let map: HashMap<&str, &str> = value.map(|v| ("OCI_REGISTRY", v)).into_iter().collect();
            let e = Config::from_env(&|k| map.get(k).map(|v| v.to_string())).unwrap_err();
            assert_eq!(e.variable, "OCI_REGISTRY");
            assert!(e.to_string().starts_with("OCI_REGISTRY must be set"), "{e}");
        }
        assert_eq!(
            err(&[("OCI_REGISTRY", "reg istry")]),
            "OCI_REGISTRY=\"reg istry\" is invalid: allowed a registry reference without spaces"
        );
    }

    #[test]
    fn every_validation_error_names_variable_value_and_rule() {
        let cases: &[(&str, &str, &str)] = &[
            ("VK_NODE_NAME", "Bad_Name", "a lowercase RFC 1123 name"),
            ("VK_NODE_NAME", "-x", "a lowercase RFC 1123 name"),
            ("VK_NODE_IP", "10.0.0", "an IP address"),
            ("VK_NODE_POOL", "-bad", "a Kubernetes label value"),
            (
                "VK_SNAPSHOT_CPU_CLASS",
                &"x".repeat(64),
                "a Kubernetes label value",
            ),
            ("VK_SNAPSHOT_CPU_CLASS", "a b", "a Kubernetes label value"),
            ("VK_ORPHAN_POLICY", "nuke", "destroy, alert or keep"),
            ("VK_RESTORE_MODE", "lazy", "copy, ondemand or mmap"),
            ("VK_PEER_ADDR", "12501", "host:port"),
            ("VK_PEER_ADDR", ":99999", "host:port"),
            ("VK_METRICS_ADDR", "::1:9091", "host:port"),
            ("VK_METRICS_ADDR", "bad host:1", "host:port"),
            ("VK_KUBELET_AUTH", "maybe", "on or off"),
            ("VK_RESERVE_PERCENT", "101", "an integer from 0 to 100"),
            ("VK_RESERVE_PERCENT", "-1", "an integer from 0 to 100"),
            ("VK_RESERVE_PERCENT", "ten", "an integer from 0 to 100"),
            ("VK_NODE_CPU", "lots", "a Kubernetes quantity"),
            ("VK_NODE_MEM", "64GB", "a Kubernetes quantity"),
            ("VK_NODE_STORAGE", "1.2.3", "a Kubernetes quantity"),
            ("VK_NODE_HUGEPAGES", "e3", "a Kubernetes quantity"),
            ("VK_NODE_PODS", "many", "a Kubernetes quantity"),
            ("VK_NODE_PODS", "-5", "a Kubernetes quantity"),
            ("VK_NODE_MEM", "1e400", "a Kubernetes quantity"),
            ("VK_NODE_CPU", "1e19", "a Kubernetes quantity"),
            (
                "VK_CLIENT_CA_FILE",
                "/nonexistent/ca.crt",
                "a readable PEM file of CA certificates (cannot read",
            ),
            ("COCOON_CGROUP_PARENT", "../escape", "a cgroup path"),
            ("SNAPSHOT_ZSTD_LEVEL", "23", "0 (off) or a zstd level 1-22"),
            (
                "SNAPSHOT_CHUNK_SIZE_MIB",
                "x",
                "0 (off) or a chunk size in MiB",
            ),
            (
                "SNAPSHOT_TRANSFER_CONCURRENCY",
                "0",
                "an integer from 1 to 256",
            ),
            (
                "SNAPSHOT_MEMORY_BUDGET_MIB",
                "0",
                "a positive number of MiB",
            ),
            ("SNAPSHOT_PULL_BUDGET_MIB", "-5", "a positive number of MiB"),
        ];
        for (name, value, rule) in cases {
            let line = err(&[(name, value)]);
            let want_prefix = format!("{name}={value:?} is invalid: allowed {rule}");
            assert!(
                line.starts_with(&want_prefix),
                "got {line:?}, want prefix {want_prefix:?}"
            );
        }
    }

    #[test]
    fn the_state_dir_must_be_absolute() {
        let line = err(&[("VK_STATE_DIR", "var/lib/vk")]);
        assert!(line.starts_with("VK_STATE_DIR="), "{line}");
        assert!(line.contains("absolute"), "{line}");
        let c = ok(&[("VK_STATE_DIR", "/srv/vk")]);
        assert_eq!(c.state_dir, PathBuf::from("/srv/vk"));
    }

    #[test]
    fn ca_bundle_files_must_hold_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(
            &garbage,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let missing = dir.path().join("missing.pem");
        for name in ["VK_CLIENT_CA_FILE", "OCI_REGISTRY_CA_FILE"] {
            for (path, why) in [
                (&empty, "no CERTIFICATE block"),
                (&garbage, "bad certificate"),
                (&missing, "cannot read"),
            ] {
                let p = path.display().to_string();
                let line = err(&[(name, p.as_str())]);
                assert!(line.starts_with(&format!("{name}=")), "{line}");
                assert!(line.contains(why), "{line}");
            }
        }
        let good = dir.path().join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["ca".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        std::fs::write(&good, params.self_signed(&key).unwrap().pem()).unwrap();
        let p = good.display().to_string();
        let c = ok(&[("VK_CLIENT_CA_FILE", p.as_str())]);
        assert_eq!(c.client_ca_file.as_deref(), Some(good.as_path()));
        assert_eq!(c.oci_registry_ca_file, None);
        let c = ok(&[("OCI_REGISTRY_CA_FILE", p.as_str())]);
        assert_eq!(c.oci_registry_ca_file.as_deref(), Some(good.as_path()));
    }

    #[test]
    fn the_clone_dir_root_is_an_absolute_canonical_directory() {
        assert_eq!(ok(&[]).clone_from_dir_root, None);
        let c = ok(&[("VK_CLONE_FROM_DIR_ROOT", "/srv/snaps/")]);
        assert_eq!(c.clone_from_dir_root.as_deref(), Some("/srv/snaps"));
        for bad in ["srv/snaps", "/", "/srv/../etc", "/srv//snaps", "/srv/./x"] {
            let line = err(&[("VK_CLONE_FROM_DIR_ROOT", bad)]);
            assert!(line.starts_with("VK_CLONE_FROM_DIR_ROOT="), "{bad}: {line}");
        }
    }

    #[test]
    fn image_url_allow_hosts_are_a_normalised_list_of_names_and_addresses() {
        let c = ok(&[(
            "VK_IMAGE_URL_ALLOW_HOSTS",
            " Mirror.Internal. ,10.0.0.5,,[fd00::1], images.example",
        )]);
        assert_eq!(
            c.image_url_allow_hosts,
            ["mirror.internal", "10.0.0.5", "fd00::1", "images.example"]
        );
        assert!(ok(&[]).image_url_allow_hosts.is_empty());
        for bad in [
            "http://x.example",
            "x.example:8080",
            "a b",
            "x.example/path",
        ] {
            let line = err(&[("VK_IMAGE_URL_ALLOW_HOSTS", bad)]);
            assert!(line.starts_with("VK_IMAGE_URL_ALLOW_HOSTS="), "{line}");
        }
    }

    #[test]
    fn vnc_secret_errors_never_echo_the_secret_and_short_ones_are_warned() {
        let long = "x".repeat(257);
        for bad in [long.as_str(), "ab\u{7}c"] {
            let line = err(&[("COCOON_MACOS_VNC_PASSWORD", bad)]);
            assert!(
                line.starts_with("COCOON_MACOS_VNC_PASSWORD=\"<redacted"),
                "{line}"
            );
            assert!(!line.contains(bad), "{line}");
            assert!(line.contains("1-256 bytes without control characters"));
        }
        // The Go daemon's 8-byte passwords stay valid secrets, with a warning.
        let short = ok(&[("COCOON_MACOS_VNC_PASSWORD", "12345678")]);
        assert!(
            short.warnings.iter().any(|w| w.contains("8 bytes")),
            "{:?}",
            short.warnings
        );
        assert!(!short.warnings.iter().any(|w| w.contains("12345678")));
        let strong = ok(&[("COCOON_MACOS_VNC_PASSWORD", "k3J9-vQ2xLm8pR4t")]);
        assert!(strong.warnings.is_empty(), "{:?}", strong.warnings);
    }

    #[test]
    fn malformed_port_and_rate_limits_fall_back_with_a_warning() {
        let c = ok(&[
            ("VK_KUBELET_PORT", "0"),
            ("COCOON_K8S_QPS", "fast"),
            ("COCOON_K8S_BURST", "-1"),
        ]);
        assert_eq!((c.kubelet_port, c.k8s_qps, c.k8s_burst), (10250, 50.0, 100));
        assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
        assert!(c.warnings[0].contains("VK_KUBELET_PORT=\"0\""));
        // 0 is no limit, as the Kubernetes client reads it, and said so.
        let unlimited = ok(&[("COCOON_K8S_QPS", "0")]);
        assert_eq!(unlimited.k8s_qps, 0.0);
        assert!(unlimited.warnings[0].contains("not rate limited"));
        assert_eq!(ok(&[("VK_KUBELET_PORT", "70000")]).kubelet_port, 10250);
        let off = ok(&[("VK_KUBELET_AUTH", "OFF")]);
        assert_eq!(off.kubelet_auth, KubeletAuth::Off);
        assert!(off
            .warnings
            .iter()
            .any(|w| w.contains("VK_KUBELET_AUTH=off")));
    }

    #[test]
    fn unknown_vk_variables_are_reported() {
        let names = [
            "VK_NODE_NAME",
            "VK_NODE_NMAE",
            "HOME",
            "VK_SSH_PASSWORD",
            "OCI_REGISTRY",
        ];
        assert_eq!(
            unknown_vk_variables(names),
            vec!["VK_NODE_NMAE", "VK_SSH_PASSWORD"]
        );
    }
}
