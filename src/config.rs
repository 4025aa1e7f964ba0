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

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// One documented variable: name, default as shown to operators, meaning.
pub struct Variable {
    pub name: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

const fn var(name: &'static str, default: &'static str, meaning: &'static str) -> Variable {
    Variable {
        name,
        default,
        meaning,
    }
}

/// Every variable the daemon reads, in the order of the README table.
pub const VARIABLES: &[Variable] = &[
    var("OCI_REGISTRY", "(required)", "Registry base for snapshots and cloud images, e.g. `registry.example.com/cocoon`."),
    var("OCI_REGISTRY_CA_FILE", "unset (system trust store)", "PEM bundle of CA certificates the registry client trusts in addition to the host's trust store (`SSL_CERT_FILE`, `SSL_CERT_DIR`, the distribution bundle), for a registry with a private CA."),
    var("KUBECONFIG", "unset", "Kubeconfig path list; falls back to `~/.kube/config`, then in-cluster config."),
    var("VK_LOG_LEVEL", "info", "`trace`, `debug`, `info`, `warn`, `error` or `off`."),
    var("VK_NODE_NAME", "cocoon-pool", "Name of the virtual Node (RFC 1123 subdomain)."),
    var("VK_NODE_IP", "auto", "Node InternalIP; auto = the address of the interface the default route leaves by (IPv4 route, else IPv6; with no default route, the first non-loopback IPv4)."),
    var("VK_NODE_POOL", "default", "Value of node label `cocoonstack.io/pool`."),
    var("VK_SNAPSHOT_CPU_CLASS", "unset", "CPU class label for snapshot compatibility (a label value)."),
    var("VK_PROVIDER_ID", "unset", "Copied to `node.spec.providerID` when set."),
    var("GOOGLE_APPLICATION_CREDENTIALS", "unset", "GCP credentials file for registry auth."),
    var("VK_LEASES_PATH", "/var/lib/cocoon/net/leases.json", "cocoon-net lease file."),
    var("VK_COCOON_NET_CONTROL_SOCKET", "/run/cocoon-net/control.sock", "cocoon-net control socket; set but empty disables lease release."),
    var("VK_COCOON_BIN", "/usr/local/bin/cocoon", "The cocoon CLI."),
    var("VK_COCOON_MACOS_BIN", "/usr/local/bin/cocoon-macos", "cocoon CLI for managed `os=macos` pods."),
    var("COCOON_MACOS_VNC_PASSWORD", "unset (VNC off)", "Secret each macOS guest's own VNC password is derived from (8 characters of HMAC-SHA256 over the VM name; `vk-cocoon vnc-password VM` prints one), given to cocoon-macos in its environment, never on its command line: 1-256 bytes, no control characters; 16 or more random bytes recommended."),
    var("VK_ORPHAN_POLICY", "destroy", "What to do with VMs that have no pod at startup: `destroy`, `alert` or `keep`."),
    var("VK_RESTORE_MODE", "mmap", "Snapshot restore mode: `copy`, `ondemand` or `mmap`."),
    var("VK_CLONE_FROM_DIR_ROOT", "unset (refused)", "Absolute directory below which `vm.cocoonstack.io/clone-from-dir` may name snapshot directories (none may be a symlink below it; it should be writable only by the operator); unset = every clone-from-dir pod fails (CloneFromDirRefused)."),
    var("VK_IMAGE_URL_ALLOW_HOSTS", "unset (none)", "Comma-separated host names or IP addresses that http(s) image URLs may name although they are loopback, link-local, private or cloud metadata hosts (or resolve to such addresses); any other such URL fails its pod (ImageURLRefused)."),
    var("VK_STAGING_DIR", "/var/lib/cocoon/vk-staging", "Peer-restore staging directory; the snapshot push spool is `vk-spool` beside it (mode 0700, the daemon's own)."),
    var("VK_STATE_DIR", "/var/lib/cocoon/vk-cocoon", "The daemon's own state (absolute path, made mode 0700): the ownership ledger `owners.json` and `peer-pushed.json`, the manifest digest of every snapshot this node pushed, which peers must name."),
    var("VK_PEER_ADDR", ":12501", "Peer snapshot listener (`host:port`, TLS with node client certificates only); its port is dialled on peers."),
    var("VK_COCOON_SNAPSHOT_DIR", "/var/lib/cocoon/snapshot/localfile", "Snapshot store served to peers."),
    var("VK_TLS_CERT", "/etc/cocoon/vk/tls/vk-kubelet.crt", "Kubelet API serving certificate."),
    var("VK_TLS_KEY", "/etc/cocoon/vk/tls/vk-kubelet.key", "Kubelet API serving key."),
    var("VK_KUBELET_PORT", "10250", "Kubelet API port (listen and advertised); malformed = default."),
    var("VK_KUBELET_AUTH", "on", "`on`: kubelet API requires client certificates / tokens; `off`: open API like the Go daemon (warned)."),
    var("VK_CLIENT_CA_FILE", "unset (cluster CA)", "CA bundle that verifies kubelet API client certificates; unset = the cluster CA of the kubeconfig."),
    var("VK_METRICS_ADDR", ":9091", "Plain-HTTP `/metrics` listener (`host:port`)."),
    var("VK_RESERVE_PERCENT", "20", "Share of host resources kept back from allocatable, 0-100."),
    var("VK_NODE_CPU", "auto", "Override node CPU capacity (Kubernetes quantity)."),
    var("VK_NODE_MEM", "auto", "Override node memory capacity (Kubernetes quantity)."),
    var("VK_NODE_STORAGE", "auto", "Override node ephemeral-storage capacity (Kubernetes quantity)."),
    var("VK_NODE_HUGEPAGES", "auto", "Override node hugepages capacity (Kubernetes quantity)."),
    var("VK_NODE_PODS", "256", "Node pod capacity (Kubernetes quantity)."),
    var("COCOON_ROOT_DIR", "/var/lib/cocoon", "cocoon root: statfs for storage, run directories of VMs."),
    var("COCOON_CGROUP_PARENT", "cocoon.slice", "cgroup v2 slice holding per-VM scopes."),
    var("SNAPSHOT_ZSTD_LEVEL", "0", "zstd level for pushed snapshot layers, 0 = off, 1-22."),
    var("SNAPSHOT_CHUNK_SIZE_MIB", "0", "Snapshot chunk size in MiB, 0 = no chunking."),
    var("SNAPSHOT_TRANSFER_CONCURRENCY", "8", "Parallel blob transfers, 1-256."),
    var("SNAPSHOT_MEMORY_BUDGET_MIB", "9216", "Push buffer cap in MiB (at least 1)."),
    var("SNAPSHOT_PULL_BUDGET_MIB", "2048", "Pull prefetch cap in MiB (at least 1)."),
    var("COCOON_K8S_QPS", "50", "Kubernetes client requests per second; 0 = no limit; malformed = default."),
    var("COCOON_K8S_BURST", "100", "Kubernetes client burst; 0 or malformed = default."),
    var("VK_TEST_WALL_CLOCK_OFFSET_FILE", "unset", "Tests only, never on a host: a file of signed seconds added to the daemon's wall clock (re-read every 100 ms), so process tests can step the clock without stepping the machine's."),
    var("VK_COCOON_DEADLINES", "query=30,control=120,create=600,transfer=3600", "Seconds after which a cocoon call is killed, per class: `query` (inspect, list of snapshots), `control` (vm list, rm, start, net, snapshot rm), `create` (clone, run), `transfer` (snapshot save, import, export, image pull, import); any subset, comma-separated."),
];

/// What to do with VMs that have no pod at startup reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrphanPolicy {
    Destroy,
    Alert,
    Keep,
}

/// How `cocoon` restores a snapshot's memory: the cocoon contract's own type.
pub use crate::vm::RestoreMode;

/// A `host:port` listen address in Go's notation: `:9091` means every interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenAddr {
    /// Empty for "every interface"; an IP literal (brackets removed) or a host name.
    pub host: String,
    pub port: u16,
}

impl ListenAddr {
    /// Parses `host:port`, `[v6]:port` or `:port`.
    pub fn parse(text: &str) -> Option<ListenAddr> {
        let (host, port) = text.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let host = if let Some(inner) = host.strip_prefix('[') {
            let inner = inner.strip_suffix(']')?;
            inner.parse::<std::net::Ipv6Addr>().ok()?;
            inner
        } else {
            if host.contains(':') || host.contains(']') {
                return None;
            }
            host
        };
        if !host.is_empty() && host.parse::<IpAddr>().is_err() && !is_dns_name(host) {
            return None;
        }
        Some(ListenAddr {
            host: host.to_string(),
            port,
        })
    }

    /// The socket addresses to bind: every interface (0.0.0.0) for an empty host,
    /// otherwise the IP literal or what the host name resolves to.
    pub fn socket_addrs(&self) -> std::io::Result<Vec<std::net::SocketAddr>> {
        use std::net::ToSocketAddrs;
        if self.host.is_empty() {
            return Ok(vec![std::net::SocketAddr::from(([0, 0, 0, 0], self.port))]);
        }
        if let Ok(ip) = self.host.parse::<IpAddr>() {
            return Ok(vec![std::net::SocketAddr::new(ip, self.port)]);
        }
        Ok((self.host.as_str(), self.port).to_socket_addrs()?.collect())
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

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

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn invalid(variable: &'static str, value: &str, allowed: impl Into<String>) -> ConfigError {
    ConfigError {
        variable,
        value: Some(value.to_string()),
        allowed: allowed.into(),
    }
}

/// The macOS VNC secret's limits (the Go daemon's 8-byte passwords stay valid secrets).
const VNC_SECRET_MAX: usize = 256;
const VNC_SECRET_RECOMMENDED: usize = 16;

/// COCOON_MACOS_VNC_PASSWORD: an error that never echoes the secret.
pub fn macos_vnc_secret_ok(secret: &str) -> Result<(), ConfigError> {
    if secret.is_empty() || secret.len() > VNC_SECRET_MAX || secret.chars().any(char::is_control) {
        return Err(ConfigError {
            variable: "COCOON_MACOS_VNC_PASSWORD",
            value: Some(format!("<redacted, {} bytes>", secret.len())),
            allowed: format!("1-{VNC_SECRET_MAX} bytes without control characters"),
        });
    }
    Ok(())
}

/// A comma-separated list of host names or IP addresses (IPv6 with or without brackets),
/// lower-cased, trailing dots dropped; empty entries are skipped.
fn host_list(env: Lookup, name: &'static str) -> Result<Vec<String>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .map(|h| h.trim().trim_start_matches('[').trim_end_matches(']'))
        .filter(|h| !h.is_empty())
        .map(|h| {
            let host = h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase();
            if is_dns_name(&host) || host.parse::<std::net::IpAddr>().is_ok() {
                Ok(host)
            } else {
                Err(invalid(
                    name,
                    &raw,
                    format!("comma-separated host names or IP addresses ({h:?} is neither)"),
                ))
            }
        })
        .collect()
}

/// An absolute directory without `.`, `..` or empty components (a trailing `/` is dropped).
fn dir_root(env: Lookup, name: &'static str) -> Result<Option<String>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(None);
    };
    let dir = raw.trim_end_matches('/');
    let canonical = raw.starts_with('/')
        && !dir.is_empty()
        && dir[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if canonical {
        Ok(Some(dir.to_string()))
    } else {
        Err(invalid(
            name,
            &raw,
            "an absolute directory other than / without . or .. components",
        ))
    }
}

/// The value, or None when unset or empty.
fn get(env: Lookup, name: &str) -> Option<String> {
    env(name).filter(|v| !v.is_empty())
}

fn string_or(env: Lookup, name: &str, default: &str) -> String {
    get(env, name).unwrap_or_else(|| default.to_string())
}

fn path_or(env: Lookup, name: &str, default: &str) -> PathBuf {
    PathBuf::from(string_or(env, name, default))
}

fn int_in<T>(
    env: Lookup,
    name: &'static str,
    default: T,
    lo: T,
    hi: T,
    allowed: &str,
) -> Result<T, ConfigError>
where
    T: std::str::FromStr + PartialOrd + Copy,
{
    let Some(raw) = get(env, name) else {
        return Ok(default);
    };
    match raw.trim().parse::<T>() {
        Ok(v) if v >= lo && v <= hi => Ok(v),
        _ => Err(invalid(name, &raw, allowed)),
    }
}

fn listen_addr(env: Lookup, name: &'static str, default: &str) -> Result<ListenAddr, ConfigError> {
    let raw = string_or(env, name, default);
    ListenAddr::parse(raw.trim())
        .ok_or_else(|| invalid(name, &raw, "host:port, [ipv6]:port or :port (port 0-65535)"))
}

fn quantity(env: Lookup, name: &'static str) -> Result<Option<String>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(None);
    };
    let q = raw.trim();
    // Syntax alone lets `1e400` (infinite) and `-5` through; the node capacity would then fail
    // at start-up as a runtime error instead of a configuration one.
    let in_range = is_quantity(q) && crate::node::parse_quantity(q).is_ok_and(|v| v < MAX_QUANTITY);
    if in_range {
        Ok(Some(q.to_string()))
    } else {
        Err(invalid(
            name,
            &raw,
            "a Kubernetes quantity such as 16, 500m, 64Gi or 1e3, not negative and below 2^63",
        ))
    }
}

/// Largest capacity value accepted: what an int64 Kubernetes quantity can hold.
const MAX_QUANTITY: f64 = 9.2e18;

/// VK_STATE_DIR: an absolute path (the daemon creates it at start).
fn state_dir(env: Lookup) -> Result<PathBuf, ConfigError> {
    const NAME: &str = "VK_STATE_DIR";
    let dir = path_or(env, NAME, "/var/lib/cocoon/vk-cocoon");
    if !dir.is_absolute() {
        let raw = dir.display().to_string();
        return Err(invalid(NAME, &raw, "an absolute directory path"));
    }
    Ok(dir)
}

/// A CA bundle variable (`VK_CLIENT_CA_FILE`, `OCI_REGISTRY_CA_FILE`) must name a readable PEM
/// file of at least one usable CA certificate: checked here so a bad file is a configuration
/// error, not a failure after start-up.
fn ca_bundle_file(env: Lookup, name: &'static str) -> Result<Option<PathBuf>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(None);
    };
    let allowed = |why: String| {
        invalid(
            name,
            &raw,
            format!("a readable PEM file of CA certificates ({why})"),
        )
    };
    let pem = std::fs::read(&raw).map_err(|e| allowed(format!("cannot read: {e}")))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| allowed(format!("bad PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| allowed(format!("bad certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(allowed("no CERTIFICATE block".into()));
    }
    Ok(Some(PathBuf::from(raw)))
}

/// Kubernetes resource.Quantity syntax: signed decimal number with an optional
/// binary (Ki..Ei), decimal (n, u, m, k, M..E) or exponent (e3, E-2) suffix.
pub fn is_quantity(s: &str) -> bool {
    let body = s.strip_prefix(['+', '-']).unwrap_or(s);
    let digits_end = body
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(body.len());
    let (number, suffix) = body.split_at(digits_end);
    let mut parts = number.splitn(2, '.');
    let int = parts.next().unwrap_or("");
    let frac = parts.next();
    if frac.is_some_and(|f| f.contains('.')) || (int.is_empty() && frac.is_none_or(str::is_empty)) {
        return false;
    }
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        s if s.starts_with(['e', 'E']) => {
            let exp = &s[1..];
            let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            !exp.is_empty() && exp.bytes().all(|b| b.is_ascii_digit())
        }
        _ => false,
    }
}

/// A Kubernetes label value: at most 63 characters, alphanumeric at both ends,
/// `-`, `_` and `.` inside. The empty string is valid.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() {
        return true;
    }
    b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// An RFC 1123 subdomain (what Kubernetes requires of node names).
pub fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

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

        let oci_registry = get(env, "OCI_REGISTRY")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        if oci_registry.is_empty() {
            return Err(ConfigError {
                variable: "OCI_REGISTRY",
                value: None,
                allowed: "the registry base for snapshots and cloud images, e.g. registry.example.com/cocoon".into(),
            });
        }
        if oci_registry
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                "OCI_REGISTRY",
                &oci_registry,
                "a registry reference without spaces",
            ));
        }

        let node_name = string_or(env, "VK_NODE_NAME", "cocoon-pool");
        if !is_dns_name(&node_name) {
            return Err(invalid(
                "VK_NODE_NAME",
                &node_name,
                "a lowercase RFC 1123 name (a-z, 0-9, '-', '.'; at most 253 characters)",
            ));
        }

        let node_ip = match get(env, "VK_NODE_IP") {
            None => None,
            Some(raw) => Some(raw.trim().parse::<IpAddr>().map_err(|_| {
                invalid(
                    "VK_NODE_IP",
                    &raw,
                    "an IP address such as 10.0.0.5, or unset for auto",
                )
            })?),
        };

        const LABEL_RULE: &str =
            "a Kubernetes label value (at most 63 characters, alphanumeric at both ends, '-', '_' or '.' inside)";
        let node_pool = string_or(env, "VK_NODE_POOL", "default");
        if !is_label_value(&node_pool) {
            return Err(invalid("VK_NODE_POOL", &node_pool, LABEL_RULE));
        }
        let snapshot_cpu_class = get(env, "VK_SNAPSHOT_CPU_CLASS");
        if let Some(c) = &snapshot_cpu_class {
            if !is_label_value(c) {
                return Err(invalid("VK_SNAPSHOT_CPU_CLASS", c, LABEL_RULE));
            }
        }

        let macos_vnc_password = get(env, "COCOON_MACOS_VNC_PASSWORD");
        if let Some(p) = &macos_vnc_password {
            macos_vnc_secret_ok(p)?;
            if p.len() < VNC_SECRET_RECOMMENDED {
                warnings.push(format!(
                    "COCOON_MACOS_VNC_PASSWORD has {} bytes: a tenant who knows their own VM's VNC \
                     password can search for a short secret offline and derive every other \
                     guest's; use {VNC_SECRET_RECOMMENDED} or more random bytes",
                    p.len()
                ));
            }
        }

        let orphan_policy = match get(env, "VK_ORPHAN_POLICY") {
            None => OrphanPolicy::Destroy,
            Some(raw) => match raw.trim().to_ascii_lowercase().as_str() {
                "destroy" => OrphanPolicy::Destroy,
                "alert" => OrphanPolicy::Alert,
                "keep" => OrphanPolicy::Keep,
                _ => return Err(invalid("VK_ORPHAN_POLICY", &raw, "destroy, alert or keep")),
            },
        };
        let restore_mode = match get(env, "VK_RESTORE_MODE") {
            None => RestoreMode::Mmap,
            Some(raw) => match raw.trim().to_ascii_lowercase().as_str() {
                "copy" => RestoreMode::Copy,
                "ondemand" => RestoreMode::OnDemand,
                "mmap" => RestoreMode::Mmap,
                _ => return Err(invalid("VK_RESTORE_MODE", &raw, "copy, ondemand or mmap")),
            },
        };

        let kubelet_port = match get(env, "VK_KUBELET_PORT") {
            None => 10250,
            Some(raw) => match raw.trim().parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => {
                    warnings.push(format!(
                        "VK_KUBELET_PORT={raw:?} is not a port 1-65535; using 10250"
                    ));
                    10250
                }
            },
        };
        let kubelet_auth = match get(env, "VK_KUBELET_AUTH") {
            None => KubeletAuth::On,
            Some(raw) => match raw.trim().to_ascii_lowercase().as_str() {
                "on" => KubeletAuth::On,
                "off" => {
                    warnings.push(
                        "VK_KUBELET_AUTH=off: the kubelet API (logs, exec) is open to anyone who can reach it".into(),
                    );
                    KubeletAuth::Off
                }
                _ => return Err(invalid("VK_KUBELET_AUTH", &raw, "on or off")),
            },
        };

        let k8s_qps = match get(env, "COCOON_K8S_QPS") {
            None => 50.0,
            Some(raw) => match raw.trim().parse::<f64>() {
                Ok(q) if q.is_finite() && q > 0.0 => q,
                // As the client reads it: no rate limit at all (what tests and benches want).
                Ok(0.0) => {
                    warnings.push(
                        "COCOON_K8S_QPS=0: Kubernetes API requests are not rate limited".into(),
                    );
                    0.0
                }
                _ => {
                    warnings.push(format!(
                        "COCOON_K8S_QPS={raw:?} is not a number >= 0; using 50"
                    ));
                    50.0
                }
            },
        };
        let k8s_burst = match get(env, "COCOON_K8S_BURST") {
            None => 100,
            Some(raw) => match raw.trim().parse::<u32>() {
                Ok(b) if b > 0 => b,
                _ => {
                    warnings.push(format!(
                        "COCOON_K8S_BURST={raw:?} is not a positive integer; using 100"
                    ));
                    100
                }
            },
        };

        let cocoon_net_control_socket = match env("VK_COCOON_NET_CONTROL_SOCKET") {
            None => Some(PathBuf::from("/run/cocoon-net/control.sock")),
            Some(v) if v.is_empty() => None,
            Some(v) => Some(PathBuf::from(v)),
        };

        let cocoon_cgroup_parent = string_or(env, "COCOON_CGROUP_PARENT", "cocoon.slice");
        if cocoon_cgroup_parent.contains("..")
            || cocoon_cgroup_parent.chars().any(|c| c.is_control())
        {
            return Err(invalid(
                "COCOON_CGROUP_PARENT",
                &cocoon_cgroup_parent,
                "a cgroup path below /sys/fs/cgroup without '..'",
            ));
        }

        let cocoon_deadlines = match get(env, "VK_COCOON_DEADLINES") {
            None => crate::vm::Deadlines::default(),
            Some(raw) => crate::vm::Deadlines::parse(&raw).map_err(|why| {
                invalid(
                    "VK_COCOON_DEADLINES",
                    &raw,
                    format!(
                        "class=seconds pairs, classes query, control, create, transfer ({why})"
                    ),
                )
            })?,
        };

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
            reserve_percent: int_in(
                env,
                "VK_RESERVE_PERCENT",
                20u8,
                0,
                100,
                "an integer from 0 to 100",
            )?,
            node_cpu: quantity(env, "VK_NODE_CPU")?,
            node_mem: quantity(env, "VK_NODE_MEM")?,
            node_storage: quantity(env, "VK_NODE_STORAGE")?,
            node_hugepages: quantity(env, "VK_NODE_HUGEPAGES")?,
            node_pods: quantity(env, "VK_NODE_PODS")?.unwrap_or_else(|| "256".to_string()),
            cocoon_root_dir: path_or(env, "COCOON_ROOT_DIR", "/var/lib/cocoon"),
            cocoon_cgroup_parent,
            snapshot_zstd_level: int_in(
                env,
                "SNAPSHOT_ZSTD_LEVEL",
                0i32,
                0,
                22,
                "0 (off) or a zstd level 1-22",
            )?,
            snapshot_chunk_size_mib: int_in(
                env,
                "SNAPSHOT_CHUNK_SIZE_MIB",
                0u64,
                0,
                1 << 20,
                "0 (off) or a chunk size in MiB up to 1048576",
            )?,
            snapshot_transfer_concurrency: int_in(
                env,
                "SNAPSHOT_TRANSFER_CONCURRENCY",
                8usize,
                1,
                256,
                "an integer from 1 to 256",
            )?,
            snapshot_memory_budget_mib: int_in(
                env,
                "SNAPSHOT_MEMORY_BUDGET_MIB",
                9216u64,
                1,
                u64::MAX >> 20,
                "a positive number of MiB",
            )?,
            snapshot_pull_budget_mib: int_in(
                env,
                "SNAPSHOT_PULL_BUDGET_MIB",
                2048u64,
                1,
                u64::MAX >> 20,
                "a positive number of MiB",
            )?,
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

    #[test]
    fn quantity_syntax() {
        for q in [
            "1", "0", "+1.5", "-2", ".5", "5.", "500m", "64Gi", "1Ki", "2k", "3M", "1e3", "1E-2",
            "7n", "9u",
        ] {
            assert!(is_quantity(q), "{q}");
        }
        for q in [
            "", "Gi", ".", "1..2", "1.2.3", "64GB", "1e", "1e+", "1 Gi", "--1", "0x10", "1ki",
        ] {
            assert!(!is_quantity(q), "{q}");
        }
    }

    #[test]
    fn listen_addr_forms() {
        assert_eq!(
            ListenAddr::parse(":80"),
            Some(ListenAddr {
                host: "".into(),
                port: 80
            })
        );
        assert_eq!(
            ListenAddr::parse("localhost:80").map(|a| a.host),
            Some("localhost".into())
        );
        assert_eq!(
            ListenAddr::parse("[::]:80").map(|a| a.host),
            Some("::".into())
        );
        for bad in [
            "", "80", "[::1:80", "[zz]:80", "a:b:80", "host:", "host:-1", ":65536",
        ] {
            assert_eq!(ListenAddr::parse(bad), None, "{bad}");
        }
    }
}
