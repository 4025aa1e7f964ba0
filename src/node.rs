//! The virtual Node object: labels, taints, capacity and allocatable, Lease heartbeat, node status.
//! Builds objects and schedules; the API calls go through kube.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec, NodeStatus,
    NodeSystemInfo, Taint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;

use crate::backoff::{salt, Backoff, Jitter};
use crate::kube::{Client, KubeError};
use crate::metrics::stats::{cow_allocated_bytes, StatsHub};

pub const LEASE_NAMESPACE: &str = "kube-node-lease";
pub const LEASE_DURATION_SECONDS: i32 = 40;
pub const LEASE_RENEW: Duration = Duration::from_secs(10);
pub const STATUS_INTERVAL: Duration = Duration::from_secs(60);
/// How often the storage allocatable is recomputed from statfs(`COCOON_ROOT_DIR`).
pub const STORAGE_REFRESH: Duration = Duration::from_secs(60);
pub const TAINT_KEY: &str = "virtual-kubelet.io/provider";
pub const POOL_LABEL: &str = "cocoonstack.io/pool";
pub const CPU_CLASS_LABEL: &str = "cocoonstack.io/snapshot-cpu-class";
pub const ROLE_LABEL: &str = "node-role.kubernetes.io/cocoon-vm";

/// Node settings, already parsed and validated by config.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub name: String,
    /// VK_NODE_IP, or `node_ip::detect()` when it is `auto`.
    pub ip: IpAddr,
    pub pool: String,
    pub snapshot_cpu_class: Option<String>,
    pub provider_id: Option<String>,
    pub kubelet_port: u16,
    /// nodeInfo.kubeletVersion (build version, `dev` when not injected).
    pub version: String,
    pub root_dir: PathBuf,
    pub reserve_percent: u8,
    /// VK_NODE_* overrides as Kubernetes quantity strings.
    pub cpu: Option<String>,
    pub mem: Option<String>,
    pub storage: Option<String>,
    pub hugepages: Option<String>,
    pub pods: String,
}

// ------------------------------------------------------------------------------------------
// Quantities and capacity.
// ------------------------------------------------------------------------------------------

/// Parse a Kubernetes quantity ("16", "500m", "64Gi", "1e3") into its numeric value.
pub fn parse_quantity(s: &str) -> Result<f64, NotAQuantity> {
    crate::vm::resources::parse_quantity_f64(s).ok_or_else(|| NotAQuantity(s.to_string()))
}

/// The text given where a Kubernetes quantity belongs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotAQuantity(pub String);

impl std::fmt::Display for NotAQuantity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} is not a Kubernetes quantity", self.0)
    }
}

impl std::error::Error for NotAQuantity {}

/// A capacity override (`VK_NODE_CPU`, …) that is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityError {
    /// The setting's name.
    pub setting: &'static str,
    pub value: NotAQuantity,
}

impl std::fmt::Display for CapacityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.setting, self.value)
    }
}

impl std::error::Error for CapacityError {}

/// What the host would not tell at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostFactsError {
    /// /proc/meminfo unreadable: the reader's message.
    Meminfo(String),
    /// statvfs of the cocoon root failed.
    Statfs {
        dir: PathBuf,
        errno: rustix::io::Errno,
    },
}

impl std::fmt::Display for HostFactsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostFactsError::Meminfo(e) => write!(f, "/proc/meminfo: {e}"),
            HostFactsError::Statfs { dir, errno } => write!(f, "statfs {}: {errno}", dir.display()),
        }
    }
}

impl std::error::Error for HostFactsError {}

/// A byte count as the shortest exact binary quantity ("2Mi", "1Gi", else plain bytes).
pub fn binary_quantity(bytes: u64) -> String {
    for (suffix, shift) in [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// What the host offers, read once at startup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    pub cpus: u64,
    pub mem_total_bytes: u64,
    /// HugePages_Total (count) and Hugepagesize (bytes); 0 when absent.
    pub hugepages_total: u64,
    pub hugepage_size_bytes: u64,
    pub fs_total_bytes: u64,
    pub fs_avail_bytes: u64,
}

impl HostFacts {
    /// Read CPU count, /proc/meminfo and statvfs(root_dir).
    pub fn read(root_dir: &Path) -> Result<HostFacts, HostFactsError> {
        use procfs::Current;
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u64)
            .unwrap_or(1);
        let mem = procfs::Meminfo::current().map_err(|e| HostFactsError::Meminfo(e.to_string()))?;
        let fs = rustix::fs::statvfs(root_dir).map_err(|errno| HostFactsError::Statfs {
            dir: root_dir.to_path_buf(),
            errno,
        })?;
        Ok(HostFacts {
            cpus,
            mem_total_bytes: mem.mem_total,
            hugepages_total: mem.hugepages_total.unwrap_or(0),
            hugepage_size_bytes: mem.hugepagesize.unwrap_or(0),
            fs_total_bytes: fs.f_blocks.saturating_mul(fs.f_bsize),
            fs_avail_bytes: fs.f_bavail.saturating_mul(fs.f_bsize),
        })
    }
}

/// Capacity and allocatable, as the Node carries them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resources {
    pub capacity: BTreeMap<String, Quantity>,
    pub allocatable: BTreeMap<String, Quantity>,
}

fn reduce(v: f64, reserve: u8) -> u64 {
    let keep = u128::from(100 - reserve.min(100));
    if v.fract() == 0.0 && (0.0..9.0e18).contains(&v) {
        // Whole numbers (bytes, cores) in exact integer arithmetic.
        return (v as u128 * keep / 100) as u64;
    }
    (v * keep as f64 / 100.0 + 1e-9).floor().max(0.0) as u64
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 && v < 1e18 {
        format!("{}", v as u64)
    } else {
        format!("{}m", (v * 1000.0).round() as u64)
    }
}

/// Compute capacity/allocatable at startup: overrides win, allocatable is
/// reduced by the reserve percentage (rounded down), pods are copied unreduced.
pub fn compute_resources(o: &NodeOptions, h: &HostFacts) -> Result<Resources, CapacityError> {
    let q = |s: String| Quantity(s);
    let mut r = Resources::default();
    let reserve = o.reserve_percent.min(100);
    let named = |setting: &'static str, v: &str| {
        parse_quantity(v).map_err(|value| CapacityError { setting, value })
    };
    // cpu
    let (cpu_cap, cpu_val) = match &o.cpu {
        Some(s) => (s.trim().to_string(), named("VK_NODE_CPU", s)?),
        None => (h.cpus.to_string(), h.cpus as f64),
    };
    r.capacity.insert("cpu".into(), q(cpu_cap));
    r.allocatable
        .insert("cpu".into(), q(reduce(cpu_val, reserve).to_string()));
    // memory
    let (mem_cap, mem_val) = match &o.mem {
        Some(s) => (s.trim().to_string(), named("VK_NODE_MEM", s)?),
        None => (h.mem_total_bytes.to_string(), h.mem_total_bytes as f64),
    };
    r.capacity.insert("memory".into(), q(mem_cap));
    r.allocatable
        .insert("memory".into(), q(reduce(mem_val, reserve).to_string()));
    // ephemeral-storage: allocatable from the available bytes, not the total
    let (st_cap, st_avail) = match &o.storage {
        Some(s) => (s.trim().to_string(), named("VK_NODE_STORAGE", s)?),
        None => (h.fs_total_bytes.to_string(), h.fs_avail_bytes as f64),
    };
    r.capacity.insert("ephemeral-storage".into(), q(st_cap));
    r.allocatable.insert(
        "ephemeral-storage".into(),
        q(reduce(st_avail, reserve).to_string()),
    );
    // hugepages
    let huge = match &o.hugepages {
        Some(s) => {
            let size = if h.hugepage_size_bytes > 0 {
                h.hugepage_size_bytes
            } else {
                2 << 20
            };
            Some((size, s.trim().to_string(), named("VK_NODE_HUGEPAGES", s)?))
        }
        None if h.hugepages_total > 0 && h.hugepage_size_bytes > 0 => {
            let total = h.hugepages_total.saturating_mul(h.hugepage_size_bytes);
            Some((h.hugepage_size_bytes, total.to_string(), total as f64))
        }
        None => None,
    };
    if let Some((size, cap, val)) = huge {
        let name = format!("hugepages-{}", binary_quantity(size));
        r.capacity.insert(name.clone(), q(cap));
        r.allocatable
            .insert(name, q(reduce(val, reserve).to_string()));
    }
    // pods
    let pods = named("VK_NODE_PODS", &o.pods)?;
    r.capacity.insert("pods".into(), q(fmt_num(pods)));
    r.allocatable.insert("pods".into(), q(fmt_num(pods)));
    Ok(r)
}

/// The ephemeral-storage allocatable for `avail_bytes` free on the root filesystem (less the
/// reserve); None when VK_NODE_STORAGE fixes it (available = total = the override).
pub fn storage_allocatable(o: &NodeOptions, avail_bytes: u64) -> Option<Quantity> {
    if o.storage.is_some() {
        return None;
    }
    Some(Quantity(
        reduce(avail_bytes as f64, o.reserve_percent.min(100)).to_string(),
    ))
}

// ------------------------------------------------------------------------------------------
// The Node object.
// ------------------------------------------------------------------------------------------

/// Seconds-precision API time.
pub fn api_time(t: SystemTime) -> Time {
    let at = crate::rfc3339::timestamp(t);
    Time(Timestamp::from_second(at.as_second()).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// Microsecond-precision API time (Lease renewTime, Event eventTime).
pub fn api_micro_time(t: SystemTime) -> MicroTime {
    let at = crate::rfc3339::timestamp(t);
    MicroTime(Timestamp::from_microsecond(at.as_microsecond()).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// The labels vk-cocoon asserts (framework defaults plus its own).
pub fn node_labels(o: &NodeOptions) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert("type".into(), "virtual-kubelet".into());
    l.insert("kubernetes.io/role".into(), "agent".into());
    l.insert("kubernetes.io/hostname".into(), o.name.clone());
    l.insert(POOL_LABEL.into(), o.pool.clone());
    l.insert(ROLE_LABEL.into(), String::new());
    if let Some(c) = o.snapshot_cpu_class.as_ref().filter(|c| !c.is_empty()) {
        l.insert(CPU_CLASS_LABEL.into(), c.clone());
    }
    l
}

fn condition(
    kind: &str,
    status: &str,
    reason: &str,
    message: &str,
    heartbeat: &Time,
    since: &Time,
) -> NodeCondition {
    NodeCondition {
        type_: kind.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(heartbeat.clone()),
        last_transition_time: Some(since.clone()),
    }
}

/// The fixed condition set of the Node object. `since` (lastTransitionTime) stays at
/// the agent's start; `heartbeat` is refreshed on every write.
pub fn node_conditions(heartbeat: &Time, since: &Time) -> Vec<NodeCondition> {
    vec![
        condition(
            "Ready",
            "True",
            "KubeletReady",
            "vk-cocoon is ready",
            heartbeat,
            since,
        ),
        condition(
            "DiskPressure",
            "False",
            "KubeletHasNoDiskPressure",
            "vk-cocoon has no disk pressure",
            heartbeat,
            since,
        ),
        condition(
            "MemoryPressure",
            "False",
            "KubeletHasSufficientMemory",
            "vk-cocoon has sufficient memory",
            heartbeat,
            since,
        ),
        condition(
            "PIDPressure",
            "False",
            "KubeletHasSufficientPID",
            "vk-cocoon has sufficient PID available",
            heartbeat,
            since,
        ),
        condition(
            "NetworkUnavailable",
            "False",
            "RouteCreated",
            "NodeController create implicit route",
            heartbeat,
            since,
        ),
    ]
}

/// The node status vk-cocoon publishes.
pub fn node_status(o: &NodeOptions, r: &Resources, now: &Time, since: &Time) -> NodeStatus {
    NodeStatus {
        addresses: Some(vec![
            NodeAddress {
                type_: "InternalIP".into(),
                address: o.ip.to_string(),
            },
            NodeAddress {
                type_: "Hostname".into(),
                address: o.name.clone(),
            },
        ]),
        allocatable: Some(r.allocatable.clone()),
        capacity: Some(r.capacity.clone()),
        conditions: Some(node_conditions(now, since)),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint {
                port: i32::from(o.kubelet_port),
            }),
        }),
        node_info: Some(NodeSystemInfo {
            kubelet_version: o.version.clone(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The full Node for registration.
pub fn build_node(o: &NodeOptions, r: &Resources, now: &Time) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(o.name.clone()),
            labels: Some(node_labels(o)),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            provider_id: o.provider_id.clone().filter(|p| !p.is_empty()),
            taints: Some(vec![provider_taint()]),
            ..Default::default()
        }),
        status: Some(node_status(o, r, now, now)),
    }
}

/// The JSON merge patch (RFC 7386) that brings an existing node's labels and taint to what
/// vk-cocoon asserts, or None when it already has them. Only vk-cocoon's own keys appear in
/// it (the CPU-class label as null when not configured), so labels other actors set, and any
/// field newer than this build's types, are left as the server holds them. A merge patch
/// replaces lists whole: when the provider taint is missing the patch carries every taint
/// read plus ours, and the resourceVersion read, so a taint added meanwhile makes it a 409
/// (read again) instead of being dropped.
pub fn node_patch(node: &Node, o: &NodeOptions) -> Option<serde_json::Value> {
    let current = node.metadata.labels.clone().unwrap_or_default();
    let mut labels = serde_json::Map::new();
    for (k, v) in node_labels(o) {
        if current.get(&k) != Some(&v) {
            labels.insert(k, serde_json::Value::String(v));
        }
    }
    if o.snapshot_cpu_class.as_deref().is_none_or(str::is_empty)
        && current.contains_key(CPU_CLASS_LABEL)
    {
        labels.insert(CPU_CLASS_LABEL.into(), serde_json::Value::Null);
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let taint_missing = !taints.iter().any(|t| t.key == TAINT_KEY);
    if labels.is_empty() && !taint_missing {
        return None;
    }
    let mut patch = serde_json::json!({ "metadata": {} });
    if !labels.is_empty() {
        patch["metadata"]["labels"] = serde_json::Value::Object(labels);
    }
    if taint_missing {
        let mut all = taints;
        all.push(provider_taint());
        patch["spec"] = serde_json::json!({ "taints": all });
        if let Some(rv) = &node.metadata.resource_version {
            patch["metadata"]["resourceVersion"] = serde_json::Value::String(rv.clone());
        }
    }
    Some(patch)
}

fn provider_taint() -> Taint {
    Taint {
        key: TAINT_KEY.into(),
        value: Some("cocoon".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }
}

/// The strategic-merge patch for nodes/<name>/status: the whole desired status (conditions and
/// addresses merge by type on the server).
pub fn status_patch(o: &NodeOptions, r: &Resources, now: &Time, since: &Time) -> serde_json::Value {
    serde_json::json!({ "status": node_status(o, r, now, since) })
}

/// The Lease object (coordination.k8s.io/v1) as sent on the wire.
pub fn build_lease(node: &str, node_uid: &str, now: SystemTime) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.into()),
            namespace: Some(LEASE_NAMESPACE.into()),
            owner_references: Some(vec![owner_ref(node, node_uid)]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.into()),
            lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
            renew_time: Some(api_micro_time(now)),
            ..Default::default()
        }),
    }
}

fn owner_ref(node: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node.into(),
        uid: uid.into(),
        ..Default::default()
    }
}

/// Renew a lease read from the server: new renewTime, our holder and duration, owner re-added.
pub fn renew_lease(mut l: Lease, node: &str, node_uid: &str, now: SystemTime) -> Lease {
    let spec = l.spec.get_or_insert_with(Default::default);
    spec.holder_identity = Some(node.into());
    spec.lease_duration_seconds = Some(LEASE_DURATION_SECONDS);
    spec.renew_time = Some(api_micro_time(now));
    let owners = l.metadata.owner_references.get_or_insert_with(Vec::new);
    if !owners.iter().any(|r| r.kind == "Node" && r.uid == node_uid) {
        owners.retain(|r| r.kind != "Node");
        owners.push(owner_ref(node, node_uid));
    }
    l
}

// ------------------------------------------------------------------------------------------
// The agent: registration, lease renewals and status refreshes on a pure schedule.
// ------------------------------------------------------------------------------------------

/// What `tick` did, for logs, metrics and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeAgentStats {
    pub registrations: u64,
    pub lease_renewals: u64,
    pub status_updates: u64,
    pub failures: u64,
}

/// Node registration, Lease heartbeat and status refresh. `tick` performs the due blocking calls
/// (each bounded by the client's timeout); failures back off and never stop the schedule.
pub struct NodeAgent {
    opts: NodeOptions,
    resources: Resources,
    node_uid: Option<String>,
    lease: Option<Lease>,
    next_register: Instant,
    next_lease: Instant,
    next_status: Instant,
    next_storage: Instant,
    /// lastTransitionTime of the fixed conditions: when this agent started.
    since: Time,
    register_backoff: Backoff,
    lease_backoff: Backoff,
    status_backoff: Backoff,
    /// Reports wall-clock steps (the agent reads both clocks on every tick).
    clock_steps: crate::wall_clock::StepWatch,
    /// The tracked VMs whose COW disks count as storage the node still offers (see
    /// `refresh_storage`); None counts free bytes only.
    cow_of: Option<StatsHub>,
    pub stats: NodeAgentStats,
}

impl NodeAgent {
    pub fn new(opts: NodeOptions, resources: Resources, now: Instant) -> NodeAgent {
        let jitter = Jitter::new(salt(&opts.name));
        NodeAgent {
            opts,
            resources,
            node_uid: None,
            lease: None,
            next_register: now,
            next_lease: now,
            next_status: now + STATUS_INTERVAL,
            next_storage: now + STORAGE_REFRESH,
            since: api_time(crate::wall_clock::now()),
            register_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            // Jittered: after an API server outage the fleet's renewals come back spread out.
            lease_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(7))
                .with_jitter(jitter),
            status_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            clock_steps: crate::wall_clock::StepWatch::default(),
            cow_of: None,
            stats: NodeAgentStats::default(),
        }
    }

    pub fn options(&self) -> &NodeOptions {
        &self.opts
    }

    /// Counts the COW disks of `hub`'s tracked VMs into the storage allocatable from now on.
    pub fn count_cow_of(&mut self, hub: StatsHub) {
        self.cow_of = Some(hub);
    }

    /// Allocated bytes of the tracked VMs' COW disks (stat calls only; on the node thread).
    fn tracked_cow_bytes(&self) -> u64 {
        self.cow_of.as_ref().map_or(0, |hub| {
            hub.vms()
                .iter()
                .map(|vm| cow_allocated_bytes(hub.paths(), vm))
                .fold(0u64, u64::saturating_add)
        })
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    /// The server node's UID once registered.
    pub fn node_uid(&self) -> Option<&str> {
        self.node_uid.as_deref()
    }

    pub fn registered(&self) -> bool {
        self.node_uid.is_some()
    }

    /// Replace capacity/allocatable (e.g. storage recomputed) and push status at the next tick.
    pub fn set_resources(&mut self, r: Resources, now: Instant) {
        if r != self.resources {
            self.resources = r;
            self.next_status = self.next_status.min(now);
        }
    }

    /// Ask for a status write at the next tick.
    pub fn push_status(&mut self, now: Instant) {
        self.next_status = self.next_status.min(now);
    }

    /// When `tick` must next run.
    pub fn next_due(&self) -> Instant {
        if self.node_uid.is_none() {
            self.next_register
        } else {
            self.next_lease.min(self.next_status).min(self.next_storage)
        }
    }

    /// Recomputes the storage allocatable from the root filesystem's free space plus what the
    /// tracked VMs' COW disks already hold (a guest writing into its own disk takes nothing from
    /// what the scheduler may still place); a change is pushed with the next status write, at
    /// once. CPU, memory, hugepages and pods stay fixed.
    pub fn refresh_storage(&mut self, avail_bytes: u64, now: Instant) {
        let offered = avail_bytes.saturating_add(self.tracked_cow_bytes());
        let Some(q) = storage_allocatable(&self.opts, offered) else {
            return;
        };
        if self.resources.allocatable.get("ephemeral-storage") != Some(&q) {
            let mut r = self.resources.clone();
            r.allocatable.insert("ephemeral-storage".into(), q);
            self.set_resources(r, now);
        }
    }

    /// Do whatever is due at `now`: register, renew the lease, refresh status.
    pub fn tick(&mut self, client: &Client, now: Instant) {
        let wall = crate::wall_clock::now();
        if let Some(step) = self.clock_steps.look(now, wall) {
            log::warn!(
                "node {}: the wall clock stepped by {step:+} s; Lease, status and Event times \
                 follow it, renewals, timeouts and cooldowns keep their monotonic schedule",
                self.opts.name
            );
        }
        if self.node_uid.is_none() {
            if now < self.next_register {
                return;
            }
            match self.register(client, wall) {
                Ok(uid) => {
                    log::info!("node {} registered (uid {uid})", self.opts.name);
                    self.node_uid = Some(uid);
                    self.stats.registrations += 1;
                    self.register_backoff.reset();
                    self.next_lease = now;
                    self.next_status = now + STATUS_INTERVAL;
                }
                Err(e) => {
                    self.stats.failures += 1;
                    let d = self.register_backoff.fail();
                    log::warn!(
                        "node {}: registration failed: {e}; retrying in {d:?}",
                        self.opts.name
                    );
                    self.next_register = now + d;
                    return;
                }
            }
        }
        if now >= self.next_lease {
            match self.renew(client, wall) {
                Ok(()) => {
                    self.stats.lease_renewals += 1;
                    self.lease_backoff.reset();
                    self.next_lease = now + LEASE_RENEW;
                }
                Err(e) => {
                    self.stats.failures += 1;
                    let d = self.lease_backoff.fail();
                    log::warn!(
                        "node {}: lease renewal failed: {e}; retrying in {d:?}",
                        self.opts.name
                    );
                    self.next_lease = now + d;
                }
            }
        }
        if now >= self.next_storage {
            self.next_storage = now + STORAGE_REFRESH;
            match rustix::fs::statvfs(&self.opts.root_dir) {
                Ok(fs) => self.refresh_storage(fs.f_bavail.saturating_mul(fs.f_bsize), now),
                Err(e) => log::warn!(
                    "node {}: statfs {}: {e}; storage allocatable kept",
                    self.opts.name,
                    self.opts.root_dir.display()
                ),
            }
        }
        if now >= self.next_status && self.node_uid.is_some() {
            let patch = status_patch(&self.opts, &self.resources, &api_time(wall), &self.since);
            match client.patch_node_status(&self.opts.name, &patch) {
                Ok(_) => {
                    self.stats.status_updates += 1;
                    self.status_backoff.reset();
                    self.next_status = now + STATUS_INTERVAL;
                }
                Err(e) => {
                    self.stats.failures += 1;
                    let d = self.status_backoff.fail();
                    log::warn!(
                        "node {}: status update failed: {e}; retrying in {d:?}",
                        self.opts.name
                    );
                    self.next_status = now + d;
                    if e.is_not_found() {
                        // Deleted under us: register again (create) rather than log forever.
                        self.node_uid = None;
                        self.lease = None;
                        self.next_register = now;
                    }
                }
            }
        }
    }

    /// Create a missing node, or bring an existing one up to date: labels and taint by a merge
    /// patch of those keys only (never a whole-object write, which would drop what others
    /// added meanwhile or fields newer than this build), then status.
    fn register(&mut self, client: &Client, wall: SystemTime) -> Result<String, KubeError> {
        let now = api_time(wall);
        for _ in 0..5 {
            match client.get_node(&self.opts.name) {
                Err(e) if e.is_not_found() => {
                    let node = build_node(&self.opts, &self.resources, &now);
                    match client.create_node(&node) {
                        Ok(n) => return uid_of(&n),
                        Err(e) if e.is_already_exists() => continue,
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
                Ok(mut existing) => {
                    if let Some(patch) = node_patch(&existing, &self.opts) {
                        match client.patch_node(&self.opts.name, &patch) {
                            Ok(n) => existing = n,
                            Err(e) if e.is_conflict() => continue,
                            Err(e) => return Err(e),
                        }
                    }
                    let n = client.patch_node_status(
                        &self.opts.name,
                        &status_patch(&self.opts, &self.resources, &now, &self.since),
                    )?;
                    return uid_of(&n).or_else(|_| uid_of(&existing));
                }
            }
        }
        Err(KubeError::Transport(
            "node registration kept conflicting".into(),
        ))
    }

    /// One lease renewal: optimistic PUT of the cached lease, else GET / create, then PUT.
    fn renew(&mut self, client: &Client, wall: SystemTime) -> Result<(), KubeError> {
        let uid = self.node_uid.clone().unwrap_or_default();
        let name = self.opts.name.clone();
        if let Some(cached) = self.lease.take() {
            match client.update_lease(&renew_lease(cached.clone(), &name, &uid, wall)) {
                Ok(l) => {
                    self.lease = Some(l);
                    return Ok(());
                }
                // Nothing came back: keep the cached lease, so that a server back with its data
                // takes the one PUT again, and do not GET from a server that is not there.
                Err(KubeError::Transport(e)) => {
                    self.lease = Some(cached);
                    return Err(KubeError::Transport(e));
                }
                Err(_) => {}
            }
        }
        for _ in 0..5 {
            match client.get_lease(LEASE_NAMESPACE, &name) {
                Err(e) if e.is_not_found() => {
                    match client.create_lease(&build_lease(&name, &uid, wall)) {
                        Ok(l) => {
                            self.lease = Some(l);
                            return Ok(());
                        }
                        Err(e) if e.is_already_exists() => continue,
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
                Ok(l) => match client.update_lease(&renew_lease(l, &name, &uid, wall)) {
                    Ok(l) => {
                        self.lease = Some(l);
                        return Ok(());
                    }
                    Err(e) if e.is_conflict() => continue,
                    Err(e) => return Err(e),
                },
            }
        }
        Err(KubeError::Transport("lease update kept conflicting".into()))
    }
}

fn uid_of(n: &Node) -> Result<String, KubeError> {
    n.metadata
        .uid
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| KubeError::Decode("node has no metadata.uid".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_and_api_times_have_the_api_servers_wire_form() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_767_225_600, 123_456_789);
        let lease = serde_json::to_value(build_lease("n", "u", t)).unwrap();
        // metav1.MicroTime: six digits always, truncated, UTC `Z`.
        assert_eq!(lease["spec"]["renewTime"], "2026-01-01T00:00:00.123456Z");
        let whole = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let lease = serde_json::to_value(build_lease("n", "u", whole)).unwrap();
        assert_eq!(lease["spec"]["renewTime"], "2026-01-01T00:00:00.000000Z");
        // metav1.Time: whole seconds, and the value itself holds no fraction, so what is
        // compared in memory is what the server echoes back.
        assert_eq!(
            serde_json::to_value(api_time(t)).unwrap(),
            "2026-01-01T00:00:00Z"
        );
        let echoed: Time = serde_json::from_value("2026-01-01T00:00:00Z".into()).unwrap();
        assert_eq!(api_time(t), echoed);
        let echoed: MicroTime =
            serde_json::from_value("2026-01-01T00:00:00.123456Z".into()).unwrap();
        assert_eq!(api_micro_time(t), echoed);
        // A clock before the epoch reads as the epoch.
        let early = SystemTime::UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(
            serde_json::to_value(api_micro_time(early)).unwrap(),
            "1970-01-01T00:00:00.000000Z"
        );
    }

    fn opts() -> NodeOptions {
        NodeOptions {
            name: "cocoon-pool".into(),
            ip: "10.0.0.5".parse().unwrap(),
            pool: "gpu".into(),
            snapshot_cpu_class: Some("icelake".into()),
            provider_id: Some("cocoon://h1".into()),
            kubelet_port: 10250,
            version: "dev".into(),
            root_dir: PathBuf::from("/"),
            reserve_percent: 20,
            cpu: None,
            mem: None,
            storage: None,
            hugepages: None,
            pods: "256".into(),
        }
    }

    fn host() -> HostFacts {
        HostFacts {
            cpus: 16,
            mem_total_bytes: 64 << 30,
            hugepages_total: 512,
            hugepage_size_bytes: 2 << 20,
            fs_total_bytes: 1000,
            fs_avail_bytes: 500,
        }
    }

    fn get(m: &BTreeMap<String, Quantity>, k: &str) -> String {
        m.get(k).map(|q| q.0.clone()).unwrap_or_default()
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("3100m").unwrap(), 3.1);
        assert_eq!(parse_quantity("64Gi").unwrap(), 68719476736.0);
        assert_eq!(parse_quantity("1e3").unwrap(), 1000.0);
        assert_eq!(parse_quantity("2k").unwrap(), 2000.0);
        assert!(parse_quantity("12 cores").is_err());
        assert!(parse_quantity("").is_err());
        assert_eq!(binary_quantity(2 << 20), "2Mi");
        assert_eq!(binary_quantity(1 << 30), "1Gi");
        assert_eq!(binary_quantity(1000), "1000");
    }

    #[test]
    fn capacity_and_allocatable_from_host() {
        let r = compute_resources(&opts(), &host()).unwrap();
        assert_eq!(get(&r.capacity, "cpu"), "16");
        assert_eq!(get(&r.allocatable, "cpu"), "12");
        assert_eq!(get(&r.capacity, "memory"), (64u64 << 30).to_string());
        assert_eq!(
            get(&r.allocatable, "memory"),
            ((64u64 << 30) * 80 / 100).to_string()
        );
        assert_eq!(get(&r.capacity, "ephemeral-storage"), "1000");
        assert_eq!(get(&r.allocatable, "ephemeral-storage"), "400");
        assert_eq!(
            get(&r.capacity, "hugepages-2Mi"),
            (512u64 << 21).to_string()
        );
        assert_eq!(
            get(&r.allocatable, "hugepages-2Mi"),
            ((512u64 << 21) * 8 / 10).to_string()
        );
        assert_eq!(get(&r.capacity, "pods"), "256");
        assert_eq!(get(&r.allocatable, "pods"), "256");
    }

    #[test]
    fn overrides_win_and_round_down() {
        let mut o = opts();
        o.cpu = Some("3100m".into());
        o.mem = Some("10Gi".into());
        o.storage = Some("100".into());
        o.hugepages = Some("1Gi".into());
        o.reserve_percent = 20;
        let mut h = host();
        h.hugepages_total = 0;
        h.hugepage_size_bytes = 0;
        let r = compute_resources(&o, &h).unwrap();
        assert_eq!(get(&r.capacity, "cpu"), "3100m");
        assert_eq!(get(&r.allocatable, "cpu"), "2");
        assert_eq!(get(&r.capacity, "memory"), "10Gi");
        assert_eq!(
            get(&r.allocatable, "memory"),
            (8u64 * 1024 * 1024 * 1024).to_string()
        );
        assert_eq!(get(&r.allocatable, "ephemeral-storage"), "80");
        assert_eq!(get(&r.capacity, "hugepages-2Mi"), "1Gi");
        o.mem = Some("lots".into());
        assert!(compute_resources(&o, &h)
            .unwrap_err()
            .to_string()
            .contains("VK_NODE_MEM"));
        // No hugepages on the host and no override: no hugepages resource.
        o.mem = None;
        o.hugepages = None;
        let r = compute_resources(&o, &h).unwrap();
        assert!(!r.capacity.keys().any(|k| k.starts_with("hugepages-")));
    }

    #[test]
    fn node_object_has_every_field() {
        let r = compute_resources(&opts(), &host()).unwrap();
        let now = api_time(SystemTime::now());
        let n = build_node(&opts(), &r, &now);
        let v = serde_json::to_value(&n).unwrap();
        assert_eq!(v["metadata"]["labels"]["cocoonstack.io/pool"], "gpu");
        assert_eq!(
            v["metadata"]["labels"]["node-role.kubernetes.io/cocoon-vm"],
            ""
        );
        assert_eq!(
            v["metadata"]["labels"]["cocoonstack.io/snapshot-cpu-class"],
            "icelake"
        );
        assert_eq!(v["metadata"]["labels"]["type"], "virtual-kubelet");
        assert_eq!(
            v["metadata"]["labels"]["kubernetes.io/hostname"],
            "cocoon-pool"
        );
        assert_eq!(v["spec"]["taints"][0]["key"], TAINT_KEY);
        assert_eq!(v["spec"]["taints"][0]["value"], "cocoon");
        assert_eq!(v["spec"]["taints"][0]["effect"], "NoSchedule");
        assert_eq!(v["spec"]["providerID"], "cocoon://h1");
        assert_eq!(
            v["status"]["addresses"][0],
            serde_json::json!({"type":"InternalIP","address":"10.0.0.5"})
        );
        assert_eq!(
            v["status"]["addresses"][1],
            serde_json::json!({"type":"Hostname","address":"cocoon-pool"})
        );
        assert_eq!(
            v["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"],
            10250
        );
        assert_eq!(v["status"]["nodeInfo"]["kubeletVersion"], "dev");
        let conds = v["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 5);
        assert_eq!(conds[0]["type"], "Ready");
        assert_eq!(conds[0]["status"], "True");
        assert_eq!(conds[0]["reason"], "KubeletReady");
        assert_eq!(conds[0]["message"], "vk-cocoon is ready");
        assert!(conds[1..].iter().all(|c| c["status"] == "False"));
    }

    #[test]
    fn heartbeat_moves_transition_time_stays() {
        let since = api_time(SystemTime::UNIX_EPOCH + Duration::from_secs(100));
        let beat = api_time(SystemTime::UNIX_EPOCH + Duration::from_secs(200));
        let p = status_patch(&opts(), &Resources::default(), &beat, &since);
        for c in p["status"]["conditions"].as_array().unwrap() {
            assert_eq!(c["lastHeartbeatTime"], "1970-01-01T00:03:20Z");
            assert_eq!(c["lastTransitionTime"], "1970-01-01T00:01:40Z");
        }
    }

    #[test]
    fn the_node_patch_names_only_our_labels_and_a_missing_taint() {
        let mut o = opts();
        o.snapshot_cpu_class = None;
        let mut n = Node::default();
        n.metadata.resource_version = Some("41".into());
        n.metadata.labels = Some(BTreeMap::from([
            (CPU_CLASS_LABEL.to_string(), "old".to_string()),
            ("other".to_string(), "kept".to_string()),
            (POOL_LABEL.to_string(), "stale".to_string()),
            ("type".to_string(), "virtual-kubelet".to_string()),
        ]));
        n.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "team".into(),
                value: Some("x".into()),
                effect: "NoExecute".into(),
                time_added: None,
            }]),
            ..Default::default()
        });
        let p = node_patch(&n, &o).expect("a patch");
        let labels = p["metadata"]["labels"].as_object().unwrap();
        assert_eq!(labels[POOL_LABEL], "gpu");
        assert!(labels[CPU_CLASS_LABEL].is_null(), "removed by null");
        assert!(!labels.contains_key("other"), "others' labels untouched");
        assert!(!labels.contains_key("type"), "unchanged labels not sent");
        let taints = p["spec"]["taints"].as_array().unwrap();
        assert_eq!(taints.len(), 2, "the list is replaced whole: theirs kept");
        assert_eq!(taints[0]["key"], "team");
        assert_eq!(taints[1]["key"], TAINT_KEY);
        assert_eq!(p["metadata"]["resourceVersion"], "41");

        // Applied, nothing is left to patch; labels alone need no resourceVersion.
        let mut l = n.metadata.labels.clone().unwrap();
        l.extend(node_labels(&o));
        l.remove(CPU_CLASS_LABEL);
        n.metadata.labels = Some(l.clone());
        n.spec
            .as_mut()
            .unwrap()
            .taints
            .as_mut()
            .unwrap()
            .push(provider_taint());
        assert_eq!(node_patch(&n, &o), None);
        l.insert(POOL_LABEL.into(), "stale".into());
        n.metadata.labels = Some(l);
        let p = node_patch(&n, &o).unwrap();
        assert_eq!(
            p,
            serde_json::json!({"metadata": {"labels": {POOL_LABEL: "gpu"}}})
        );
    }

    #[test]
    fn lease_shape_and_renewal() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_767_225_600_123_456);
        let l = build_lease("n1", "uid-1", t);
        let v = serde_json::to_value(&l).unwrap();
        assert_eq!(v["metadata"]["namespace"], "kube-node-lease");
        assert_eq!(v["spec"]["holderIdentity"], "n1");
        assert_eq!(v["spec"]["leaseDurationSeconds"], 40);
        assert_eq!(v["spec"]["renewTime"], "2026-01-01T00:00:00.123456Z");
        assert_eq!(
            v["metadata"]["ownerReferences"][0],
            serde_json::json!({"apiVersion":"v1","kind":"Node","name":"n1","uid":"uid-1"})
        );
        let mut stripped = l.clone();
        stripped.metadata.owner_references = None;
        let r = renew_lease(stripped, "n1", "uid-2", t + Duration::from_secs(10));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "uid-2");
        assert_eq!(v["spec"]["renewTime"], "2026-01-01T00:00:10.123456Z");
    }

    #[test]
    fn host_facts_are_read() {
        let h = HostFacts::read(Path::new("/")).unwrap();
        assert!(h.cpus >= 1 && h.mem_total_bytes > 0 && h.fs_total_bytes > 0);
    }

    #[test]
    fn storage_allocatable_adds_back_what_the_tracked_vms_cow_disks_hold() {
        use crate::metrics::stats::{StatsPaths, TrackedVm};
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let disk = |backend: &str, id: &str, file: &str, bytes: usize| {
            let d = run.join(backend).join(id);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(file), vec![7u8; bytes]).unwrap();
            let f = std::fs::File::open(d.join(file)).unwrap();
            f.sync_all().unwrap();
            f.metadata().unwrap().blocks() * 512
        };
        let ch = disk("cloudhypervisor", "CH1", "overlay.qcow2", 3 << 20);
        let fc = disk("firecracker", "FC1", "cow.raw", 1 << 20);
        // Not tracked: another VM's disk and a macOS guest's (its disk is not a COW overlay).
        disk("cloudhypervisor", "OTHER", "cow.raw", 2 << 20);
        disk("cloudhypervisor", "MAC1", "cow.raw", 2 << 20);
        let vm = |id: &str, backend: &str| TrackedVm {
            vm_id: id.into(),
            vm_name: format!("vk-ns-{id}"),
            namespace: "ns".into(),
            pod: id.into(),
            pod_uid: "u".into(),
            pid: 1,
            tap: None,
            backend: backend.into(),
            disk: None,
        };
        let hub = StatsHub::new(StatsPaths {
            proc_root: dir.path().join("proc"),
            cgroup_root: dir.path().join("cg"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: dir.path().to_path_buf(),
        });
        hub.set_vms(vec![
            vm("CH1", "cloud-hypervisor"),
            vm("FC1", "firecracker"),
            vm("MAC1", "qemu"),
        ]);
        assert!(ch >= 3 << 20 && fc >= 1 << 20, "the disks hold blocks");
        let now = Instant::now();
        let free = 10u64 << 30;
        let reduced = |bytes: u64| Quantity(reduce(bytes as f64, 20).to_string());

        let mut agent = NodeAgent::new(opts(), compute_resources(&opts(), &host()).unwrap(), now);
        agent.refresh_storage(free, now);
        assert_eq!(
            agent.resources().allocatable.get("ephemeral-storage"),
            Some(&reduced(free)),
            "free bytes only until VMs are counted"
        );
        agent.count_cow_of(hub);
        agent.refresh_storage(free, now);
        assert_eq!(
            agent.resources().allocatable.get("ephemeral-storage"),
            Some(&reduced(free + ch + fc))
        );
    }
}
