//! The documented table of every variable the daemon reads: name, default, meaning.
//! What the README table and the unknown-variable warning are checked against.

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
