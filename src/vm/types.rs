//! Serde types for cocoon's JSON: VM, NICs, disks, snapshots, images, events.
//! Tolerant on read (unknown fields ignored, `null` read as empty); it never runs or parses processes.

use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

/// Reads `null` as the type's default, so a Go `nil` slice or map never fails a parse.
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

/// A Go "set" serialised as `{"<key>":{}}`; values are kept opaque.
pub type StringSet = BTreeMap<String, serde_json::Value>;

/// A VM object as printed by `vm inspect`, `vm list`, `vm clone`, `vm run` and inside events (4.1).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Vm {
    #[serde(deserialize_with = "null_default")]
    pub id: String,
    #[serde(deserialize_with = "null_default")]
    pub hypervisor: String,
    /// Raw state text; use [`Vm::state_kind`] for the typed view.
    #[serde(deserialize_with = "null_default")]
    pub state: String,
    #[serde(deserialize_with = "null_default")]
    pub config: VmConfig,
    /// Hypervisor PID; 0 when not running (and in B clone output).
    #[serde(deserialize_with = "null_default")]
    pub pid: i64,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub socket_path: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub vsock_socket: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub net_backend: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub netns_path: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub net_bridge_dev: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub network_configs: Vec<NetworkConfig>,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub storage_configs: Vec<StorageConfig>,
    #[serde(deserialize_with = "null_default")]
    pub first_booted: bool,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub snapshot_ids: StringSet,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub transition_generation: u64,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub last_transition_reason: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_transition_at: Option<String>,
    #[serde(deserialize_with = "null_default")]
    pub created_at: String,
    #[serde(deserialize_with = "null_default")]
    pub updated_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<String>,
    /// N, inspect only; kept opaque.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attached_devices: Option<serde_json::Value>,
    /// N, clone output only.
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub hints: Vec<String>,
}

/// The typed view of a VM's `state` text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmState {
    Creating,
    Created,
    Running,
    Stopped,
    /// Display-only: stored `running` but the hypervisor PID is dead.
    StoppedStale,
    Error,
    /// Any text cocoon may add later; treated like a non-running state.
    Other(String),
}

/// No state text at all (a record that has not said yet).
impl Default for VmState {
    fn default() -> Self {
        VmState::Other(String::new())
    }
}

impl VmState {
    pub fn parse(text: &str) -> VmState {
        match text {
            "creating" => VmState::Creating,
            "created" => VmState::Created,
            "running" => VmState::Running,
            "stopped" => VmState::Stopped,
            "stopped (stale)" => VmState::StoppedStale,
            "error" => VmState::Error,
            other => VmState::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            VmState::Creating => "creating",
            VmState::Created => "created",
            VmState::Running => "running",
            VmState::Stopped => "stopped",
            VmState::StoppedStale => "stopped (stale)",
            VmState::Error => "error",
            VmState::Other(s) => s,
        }
    }
}

impl Vm {
    pub fn state_kind(&self) -> VmState {
        VmState::parse(&self.state)
    }

    pub fn is_running(&self) -> bool {
        self.state == "running"
    }

    /// The VM name from `config.name` (may be empty).
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The first NIC, which vk-cocoon treats as the primary one (IP, MAC).
    pub fn primary_nic(&self) -> Option<&NetworkConfig> {
        self.network_configs.first()
    }

    /// The statically assigned IP of the first NIC, if cocoon reports one.
    pub fn primary_ip(&self) -> Option<&str> {
        self.primary_nic()
            .and_then(|n| n.network.as_ref())
            .map(|n| n.ip.as_str())
            .filter(|ip| !ip.is_empty())
    }

    pub fn is_firecracker(&self) -> bool {
        self.hypervisor == "firecracker"
    }

    /// Run-dir component: `firecracker` for FC, `cloudhypervisor` for anything else.
    pub fn backend_dir(&self) -> &'static str {
        if self.is_firecracker() {
            "firecracker"
        } else {
            "cloudhypervisor"
        }
    }

    /// The path of the COW disk (`role` = `cow`), if any.
    pub fn cow_disk(&self) -> Option<&str> {
        self.storage_configs
            .iter()
            .find(|s| s.role == "cow")
            .map(|s| s.path.as_str())
    }
}

/// `config` of a VM (4.1a).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmConfig {
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub cpu: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub memory: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub storage: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub queue_size: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub disk_queue_size: u64,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub image: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub image_digest: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub image_type: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub network: String,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub no_direct_io: bool,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub windows: bool,
    #[serde(deserialize_with = "null_default")]
    pub name: String,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub cpu_weight: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub cpu_quota_us: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub cpu_period_us: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub cpu_burst_us: u64,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub cpuset_cpus: String,
}

/// One NIC (4.2).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NetworkConfig {
    #[serde(deserialize_with = "null_default")]
    pub tap: String,
    #[serde(deserialize_with = "null_default")]
    pub mac: String,
    #[serde(deserialize_with = "null_default")]
    pub num_queues: u64,
    #[serde(deserialize_with = "null_default")]
    pub queue_size: u64,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub backend: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub bridge_dev: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub netns_path: String,
    /// Absent means DHCP / no static address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NicAddress>,
}

/// Static address of a NIC (4.2 `network`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NicAddress {
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub ip: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub gateway: String,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub prefix: u64,
}

/// One disk (4.3).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StorageConfig {
    #[serde(deserialize_with = "null_default")]
    pub path: String,
    #[serde(deserialize_with = "null_default")]
    pub ro: bool,
    #[serde(deserialize_with = "null_default")]
    pub serial: String,
    #[serde(deserialize_with = "null_default")]
    pub role: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub mount_point: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub fstype: String,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub direct_io: bool,
}

/// A snapshot record as printed by `snapshot inspect` (4.5); also the envelope `config`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Snapshot {
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub cpu: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub memory: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub storage: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub queue_size: u64,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub disk_queue_size: u64,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub image: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub image_digest: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub image_type: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub network: String,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub no_direct_io: bool,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub windows: bool,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub id: String,
    #[serde(deserialize_with = "null_default")]
    pub name: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub image_blob_ids: StringSet,
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub hypervisor: String,
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_zero_u64")]
    pub nics: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
}

/// `snapshot.json`, the first member of a snapshot archive or `--from-dir` directory (4.6).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotEnvelope {
    pub config: Snapshot,
    pub version: u32,
}

/// An image record as printed by `image inspect` (4.7).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Image {
    #[serde(deserialize_with = "null_default")]
    pub id: String,
    #[serde(deserialize_with = "null_default")]
    pub name: String,
    /// `oci` or `cloudimg`.
    #[serde(rename = "type", deserialize_with = "null_default")]
    pub kind: String,
    #[serde(deserialize_with = "null_default")]
    pub size: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
}

/// Kind of an event line (4.4).
///
/// The wire kind, unknown kinds kept so the caller can log them; the provider's
/// `VmEventKind` is on purpose a different type: only the three kinds it acts on, `Copy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    Added,
    Modified,
    Deleted,
    /// Anything else; carried so the caller can log it.
    Other(String),
}

impl EventKind {
    pub fn parse(text: &str) -> EventKind {
        match text {
            "ADDED" => EventKind::Added,
            "MODIFIED" => EventKind::Modified,
            "DELETED" => EventKind::Deleted,
            other => EventKind::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            EventKind::Added => "ADDED",
            EventKind::Modified => "MODIFIED",
            EventKind::Deleted => "DELETED",
            EventKind::Other(s) => s,
        }
    }
}

/// The wire form of one event line: `{"event":"...","vm":{...}}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EventLine {
    #[serde(deserialize_with = "null_default")]
    pub event: String,
    #[serde(deserialize_with = "null_default")]
    pub vm: Vm,
}

/// A parsed VM event handed to the provider.
#[derive(Debug, Clone, PartialEq)]
pub struct VmEvent {
    pub kind: EventKind,
    pub vm: Vm,
}

/// Outcome of `vm reconcile-stale-create` (3.19).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StaleCreateOutcome {
    /// Ownerless placeholder removed; the name is free.
    Collected,
    /// An in-flight create/clone holds the VM's ops lock; nothing done.
    Busy,
    /// The record is no longer `creating`.
    NotCreating,
    /// No such record.
    NotFound,
    /// A non-empty outcome this build does not know; treat as "leave alone".
    Other(String),
}

impl StaleCreateOutcome {
    pub fn parse(text: &str) -> StaleCreateOutcome {
        match text {
            "collected" => StaleCreateOutcome::Collected,
            "busy" => StaleCreateOutcome::Busy,
            "not-creating" => StaleCreateOutcome::NotCreating,
            "not-found" => StaleCreateOutcome::NotFound,
            other => StaleCreateOutcome::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            StaleCreateOutcome::Collected => "collected",
            StaleCreateOutcome::Busy => "busy",
            StaleCreateOutcome::NotCreating => "not-creating",
            StaleCreateOutcome::NotFound => "not-found",
            StaleCreateOutcome::Other(s) => s,
        }
    }
}

/// The wire form of `vm reconcile-stale-create -o json` output.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StaleCreateReport {
    #[serde(
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub id: String,
    #[serde(deserialize_with = "null_default")]
    pub outcome: String,
}
