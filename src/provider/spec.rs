//! Pod → VMSpec: the operator's pod annotation contract, its validation, roles, local snapshot
//! names and the resources → VM/cgroup flag maths. Pure functions only.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use sha2::{Digest, Sha256};

use super::naming::NAME_MAX;
use crate::snapshots::reference::split_image_ref;

pub const ANN_VM_NAME: &str = "vm.cocoonstack.io/name";
pub const ANN_IMAGE: &str = "cocoonset.cocoonstack.io/image";
pub const ANN_MODE: &str = "cocoonset.cocoonstack.io/mode";
pub const ANN_OS: &str = "cocoonset.cocoonstack.io/os";
pub const ANN_STORAGE: &str = "cocoonset.cocoonstack.io/storage";
pub const ANN_NETWORK: &str = "cocoonset.cocoonstack.io/network";
pub const ANN_SNAPSHOT_POLICY: &str = "cocoonset.cocoonstack.io/snapshot-policy";
pub const ANN_MANAGED: &str = "cocoonset.cocoonstack.io/managed";
pub const ANN_FORCE_PULL: &str = "cocoonset.cocoonstack.io/force-pull";
pub const ANN_GENERATION: &str = "cocoonset.cocoonstack.io/generation";
pub const ANN_BACKEND: &str = "vm.cocoonstack.io/backend";
pub const ANN_NO_DIRECT_IO: &str = "vm.cocoonstack.io/no-direct-io";
pub const ANN_PROBE_PORT: &str = "vm.cocoonstack.io/probe-port";
pub const ANN_FORK_FROM: &str = "vm.cocoonstack.io/fork-from";
pub const ANN_CLONE_FROM_DIR: &str = "vm.cocoonstack.io/clone-from-dir";
pub const ANN_HIBERNATE: &str = "vm.cocoonstack.io/hibernate";
pub const ANN_RESTORE: &str = "vm.cocoonstack.io/restore-from-hibernate";
pub const ANN_KEEP_SNAPSHOT: &str = "vm.cocoonstack.io/keep-snapshot-on-delete";
pub const ANN_VM_ID: &str = "vm.cocoonstack.io/id";
pub const ANN_VM_IP: &str = "vm.cocoonstack.io/ip";
pub const ANN_POST_CLONE_STATE: &str = "vm.cocoonstack.io/post-clone-state";
pub const ANN_LIFECYCLE_STATE: &str = "vm.cocoonstack.io/lifecycle-state";
pub const ANN_LIFECYCLE_GEN: &str = "vm.cocoonstack.io/lifecycle-observed-generation";
pub const ANN_LIFECYCLE_MSG: &str = "vm.cocoonstack.io/lifecycle-state-message";
pub const SELECTOR_CPU_CLASS: &str = "cocoonstack.io/snapshot-cpu-class";
/// Appended to the Failed message of a pod that lacks the annotations, for the user who wrote it.
pub const CONTRACT_HINT: &str = "(the pod annotations vk-cocoon reads are listed in its README; packaging/examples has working pods)";

pub const BACKEND_CH: &str = "cloud-hypervisor";
pub const BACKEND_FC: &str = "firecracker";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Clone,
    Run,
    Static,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Clone => "clone",
            Mode::Run => "run",
            Mode::Static => "static",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Os {
    Linux,
    Windows,
    Android,
    Macos,
}

/// What the provider needs to know about a pod, parsed and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct VmSpec {
    pub vm_name: String,
    pub image: String,
    pub mode: Mode,
    /// Raw mode annotation (metric label).
    pub mode_raw: String,
    pub os: Os,
    /// Storage size in bytes (run only).
    pub storage_bytes: Option<u64>,
    pub network: String,
    pub snapshot_policy: String,
    pub managed: bool,
    pub force_pull: bool,
    pub generation: i64,
    /// Verbatim backend annotation (may be empty = cloud-hypervisor).
    pub backend: String,
    pub no_direct_io: bool,
    pub probe_port: Option<u16>,
    pub fork_from: String,
    pub clone_from_dir: Option<String>,
    pub hibernate: bool,
    pub restore_from_hibernate: bool,
    pub keep_snapshot_on_delete: bool,
    /// Pre-assigned / previously written `vm.cocoonstack.io/id` and `ip`.
    pub vm_id: String,
    pub vm_ip: String,
    /// nodeSelector `cocoonstack.io/snapshot-cpu-class`.
    pub cpu_class: String,
    pub owner_cocoonset: String,
    pub resources: Resources,
    /// Values that did not parse and were read as the Go daemon reads them (a Warning each).
    pub fallbacks: Vec<Fallback>,
}

impl VmSpec {
    /// The VM boots fresh from an image (`cocoon vm run`): mode `run` with no explicit clone
    /// source (`clone-from-dir` and `fork-from` take precedence over the mode).
    pub fn fresh_boot(&self) -> bool {
        self.mode == Mode::Run && self.clone_from_dir.is_none() && self.fork_from.is_empty()
    }

    pub fn firecracker(&self) -> bool {
        self.backend == BACKEND_FC
    }

    /// The backend as the cocoon contract's type.
    pub fn backend_kind(&self) -> crate::vm::Backend {
        if self.firecracker() {
            crate::vm::Backend::Firecracker
        } else {
            crate::vm::Backend::CloudHypervisor
        }
    }
}

/// First container's resources, parsed (they size the VM and its cgroup).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_limit_milli: Option<u64>,
    pub cpu_request_milli: Option<u64>,
    pub mem_request_bytes: Option<u64>,
    pub mem_limit_bytes: Option<u64>,
}

impl Resources {
    /// `--cpu` for run: ceil(milli(limit else request)/1000); 0 ⇒ omitted.
    pub fn vcpus(&self) -> u64 {
        crate::vm::vcpu_count(self.cpu_request_milli, self.cpu_limit_milli)
    }

    /// `--memory` for run: request, else limit.
    pub fn memory_bytes(&self) -> Option<u64> {
        self.mem_request_bytes.or(self.mem_limit_bytes)
    }

    /// CPU policy for every clone and run path (saturating: a huge limit cannot overflow).
    pub fn cpu_policy(&self) -> crate::vm::CpuPolicy {
        crate::vm::cpu_policy(self.cpu_request_milli, self.cpu_limit_milli)
    }
}

/// Why a pod cannot become a VM (bad input); carries a metric reason and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    /// `pod_lifecycle_total` reason label.
    pub reason: &'static str,
    pub message: String,
}

impl SpecError {
    fn new(reason: &'static str, message: String) -> Self {
        SpecError { reason, message }
    }
}

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn annotations(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata.annotations.clone().unwrap_or_default()
}

fn is_true(a: &BTreeMap<String, String>, k: &str) -> bool {
    a.get(k).map(|v| v == "true").unwrap_or(false)
}

/// Parse and validate a pod's VM spec: what makes a spec unusable is bad input, refused once.
pub fn parse(pod: &Pod) -> Result<VmSpec, SpecError> {
    let a = annotations(pod);
    let get = |k: &str| a.get(k).cloned().unwrap_or_default();
    let key = format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    );
    let vm_name = get(ANN_VM_NAME);
    if vm_name.is_empty() {
        return Err(SpecError::new(
            "missing_vmname",
            format!("pod {key} missing {ANN_VM_NAME} annotation {CONTRACT_HINT}"),
        ));
    }
    let mut fallbacks = Vec::new();
    let (mode, mode_raw) = read_mode(&get(ANN_MODE), &mut fallbacks);
    let os = read_os(&get(ANN_OS), &mut fallbacks);
    let backend = read_backend(&get(ANN_BACKEND), &mut fallbacks);
    let storage_bytes = read_storage(&get(ANN_STORAGE), &mut fallbacks);
    let probe_port = read_probe_port(&get(ANN_PROBE_PORT), &mut fallbacks);
    let fork_from = get(ANN_FORK_FROM);
    if !fork_from.is_empty() {
        validate_fork_source(&fork_from, &vm_name).map_err(|e| {
            SpecError::new(
                "bad_fork_from",
                format!("pod {key}: {ANN_FORK_FROM} {fork_from:?} {e}"),
            )
        })?;
    }
    let clone_from_dir = match a.get(ANN_CLONE_FROM_DIR).map(|d| d.trim().to_string()) {
        None => None,
        Some(d) if d.is_empty() => None,
        Some(d) => {
            validate_clone_dir(&d).map_err(|e| {
                SpecError::new(
                    "bad_clone_from_dir",
                    format!("pod {key}: {ANN_CLONE_FROM_DIR} {d:?} {e}"),
                )
            })?;
            if mode == Mode::Run {
                return Err(SpecError::new(
                    "conflicting_annotations",
                    format!("pod {key}: {ANN_CLONE_FROM_DIR} is incompatible with mode=run"),
                ));
            }
            if !fork_from.is_empty() {
                return Err(SpecError::new(
                    "conflicting_annotations",
                    format!("pod {key}: {ANN_CLONE_FROM_DIR} is incompatible with fork-from"),
                ));
            }
            Some(d)
        }
    };
    let resources = parse_resources(pod)
        .map_err(|e| SpecError::new("bad_quantity", format!("pod {key}: {e}")))?;
    let owner_cocoonset = owner_cocoonset(pod);
    let cpu_class = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .and_then(|s| s.get(SELECTOR_CPU_CLASS).cloned())
        .unwrap_or_default();
    Ok(VmSpec {
        vm_name,
        image: get(ANN_IMAGE),
        mode,
        mode_raw,
        os,
        storage_bytes,
        network: get(ANN_NETWORK),
        snapshot_policy: get(ANN_SNAPSHOT_POLICY),
        managed: is_true(&a, ANN_MANAGED),
        force_pull: is_true(&a, ANN_FORCE_PULL),
        generation: generation(pod),
        backend,
        no_direct_io: is_true(&a, ANN_NO_DIRECT_IO),
        probe_port,
        fork_from,
        clone_from_dir,
        hibernate: is_true(&a, ANN_HIBERNATE),
        restore_from_hibernate: is_true(&a, ANN_RESTORE),
        keep_snapshot_on_delete: is_true(&a, ANN_KEEP_SNAPSHOT),
        vm_id: get(ANN_VM_ID),
        vm_ip: get(ANN_VM_IP),
        cpu_class,
        owner_cocoonset,
        resources,
        fallbacks,
    })
}

/// The name of the CocoonSet owning the pod, empty when none does.
fn owner_cocoonset(pod: &Pod) -> String {
    pod.metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.iter().find(|r| r.kind == "CocoonSet"))
        .map(|r| r.name.clone())
        .unwrap_or_default()
}

/// The spec of a pod whose annotations no longer parse but whose VM (`vm_name`, `vm_id`) the
/// daemon runs: every annotation that still reads keeps its meaning, the others take their
/// defaults. The running daemon keeps such a pod tracked with a Warning when an update does not
/// parse; a restart must do the same, not drop the pod and destroy its VM as an orphan.
pub fn salvage(pod: &Pod, vm_name: &str, vm_id: &str) -> VmSpec {
    let a = annotations(pod);
    let get = |k: &str| a.get(k).cloned().unwrap_or_default();
    let mut fallbacks = Vec::new();
    let (mode, mode_raw) = read_mode(&get(ANN_MODE), &mut fallbacks);
    let os = read_os(&get(ANN_OS), &mut fallbacks);
    let backend = read_backend(&get(ANN_BACKEND), &mut fallbacks);
    let storage_bytes = read_storage(&get(ANN_STORAGE), &mut fallbacks);
    let probe_port = read_probe_port(&get(ANN_PROBE_PORT), &mut fallbacks);
    let owner_cocoonset = owner_cocoonset(pod);
    VmSpec {
        vm_name: vm_name.to_string(),
        image: get(ANN_IMAGE),
        mode,
        mode_raw,
        os,
        storage_bytes,
        network: get(ANN_NETWORK),
        snapshot_policy: get(ANN_SNAPSHOT_POLICY),
        managed: is_true(&a, ANN_MANAGED),
        force_pull: is_true(&a, ANN_FORCE_PULL),
        generation: generation(pod),
        backend,
        no_direct_io: is_true(&a, ANN_NO_DIRECT_IO),
        probe_port,
        // Never reaches a command line unless it is a valid fork source.
        fork_from: Some(get(ANN_FORK_FROM))
            .filter(|f| validate_fork_source(f, vm_name).is_ok())
            .unwrap_or_default(),
        clone_from_dir: None,
        hibernate: is_true(&a, ANN_HIBERNATE),
        restore_from_hibernate: is_true(&a, ANN_RESTORE),
        keep_snapshot_on_delete: is_true(&a, ANN_KEEP_SNAPSHOT),
        vm_id: vm_id.to_string(),
        vm_ip: get(ANN_VM_IP),
        cpu_class: String::new(),
        owner_cocoonset,
        resources: parse_resources(pod).unwrap_or_default(),
        fallbacks,
    }
}

/// A value of an annotation that did not parse, read the way the Go daemon reads it (or, where
/// the Go daemon would put it on a command line, ignored): the pod runs, with a Warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    pub annotation: &'static str,
    pub value: String,
    /// What this daemon does with it.
    pub taken_as: &'static str,
    /// What the Go daemon does with it.
    pub go: &'static str,
    /// The metric reason.
    pub reason: &'static str,
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value: String = self.value.chars().take(64).collect();
        write!(
            f,
            "{} {value:?} does not parse: {} (the Go daemon: {})",
            self.annotation, self.taken_as, self.go
        )
    }
}

/// `cocoonset.cocoonstack.io/mode`, compared lower-cased: anything but `run` and `static` is
/// the clone path, as in the Go daemon. Returns the mode and its metric label (the raw value
/// when it parses, `clone` otherwise: a label never takes a tenant's arbitrary text).
fn read_mode(raw: &str, fallbacks: &mut Vec<Fallback>) -> (Mode, String) {
    match raw.to_ascii_lowercase().as_str() {
        "" | "clone" => (Mode::Clone, raw.to_string()),
        "run" => (Mode::Run, raw.to_string()),
        "static" => (Mode::Static, raw.to_string()),
        _ => {
            fallbacks.push(Fallback {
                annotation: ANN_MODE,
                value: raw.to_string(),
                taken_as: "brought up as clone",
                go: "brought up as clone",
                reason: "bad_mode",
            });
            (Mode::Clone, "clone".to_string())
        }
    }
}

/// `cocoonset.cocoonstack.io/os`: an unknown guest OS is Linux, as in the Go daemon.
fn read_os(raw: &str, fallbacks: &mut Vec<Fallback>) -> Os {
    match raw.to_ascii_lowercase().as_str() {
        "" | "linux" => Os::Linux,
        "windows" => Os::Windows,
        "android" => Os::Android,
        "macos" => Os::Macos,
        _ => {
            fallbacks.push(Fallback {
                annotation: ANN_OS,
                value: raw.to_string(),
                taken_as: "a Linux guest",
                go: "a Linux guest",
                reason: "bad_os",
            });
            Os::Linux
        }
    }
}

/// `vm.cocoonstack.io/backend`: an unknown hypervisor is the default, cloud-hypervisor. (The
/// Go daemon keeps the text, which only ever differs from both backends' names, so it too
/// boots cloud-hypervisor, or refuses a snapshot that records a hypervisor.)
fn read_backend(raw: &str, fallbacks: &mut Vec<Fallback>) -> String {
    if raw.is_empty() || raw == BACKEND_CH || raw == BACKEND_FC {
        return raw.to_string();
    }
    fallbacks.push(Fallback {
        annotation: ANN_BACKEND,
        value: raw.to_string(),
        taken_as: "cloud-hypervisor",
        go: "cloud-hypervisor, or a clone refused when the snapshot records a hypervisor",
        reason: "bad_backend",
    });
    String::new()
}

/// `cocoonset.cocoonstack.io/storage` (run mode): a Kubernetes quantity. One that does not
/// parse is ignored (cocoon's default size): the Go daemon hands the text to cocoon's command
/// line as it is, and no annotation value reaches a command line unchecked here.
fn read_storage(raw: &str, fallbacks: &mut Vec<Fallback>) -> Option<u64> {
    if raw.is_empty() {
        return None;
    }
    let bytes = quantity_bytes(raw).ok();
    if bytes.is_none() {
        fallbacks.push(Fallback {
            annotation: ANN_STORAGE,
            value: raw.to_string(),
            taken_as: "ignored, cocoon's default size",
            go: "passed to cocoon's --storage as it is",
            reason: "bad_storage",
        });
    }
    bytes
}

/// `vm.cocoonstack.io/probe-port`: a TCP port 1-65535; anything else probes by ping. (The Go
/// daemon dials the text as a port, which never connects, so the pod never turns Ready.)
fn read_probe_port(raw: &str, fallbacks: &mut Vec<Fallback>) -> Option<u16> {
    if raw.is_empty() {
        return None;
    }
    let port = raw.parse::<u16>().ok().filter(|p| *p > 0);
    if port.is_none() {
        fallbacks.push(Fallback {
            annotation: ANN_PROBE_PORT,
            value: raw.to_string(),
            taken_as: "readiness by ping",
            go: "a TCP probe that never connects; the pod never turns Ready",
            reason: "bad_probe_port",
        });
    }
    port
}

/// `cocoonset.cocoonstack.io/generation` (missing/garbage ⇒ 0).
pub fn generation(pod: &Pod) -> i64 {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANN_GENERATION))
        .and_then(|g| g.parse().ok())
        .unwrap_or(0)
}

/// Absolute and already canonical: starts with `/`, no `.`/`..` components, no `//`, no
/// trailing `/` (the root `/` itself is canonical). Checked purely on the string.
pub fn validate_clone_dir(dir: &str) -> Result<(), CloneDirError> {
    if !dir.starts_with('/') {
        return Err(CloneDirError::NotAbsolute);
    }
    if dir == "/" {
        return Ok(());
    }
    if dir.ends_with('/') || dir.contains("//") {
        return Err(CloneDirError::StraySlash);
    }
    if dir[1..].split('/').any(|c| c == "." || c == "..") {
        return Err(CloneDirError::DotComponent);
    }
    Ok(())
}

/// Why a `clone-from-dir` value is refused; Display completes `<annotation> "<dir>" …`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneDirError {
    NotAbsolute,
    /// A trailing or doubled `/`.
    StraySlash,
    /// A `.` or `..` component.
    DotComponent,
}

impl std::fmt::Display for CloneDirError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CloneDirError::NotAbsolute => "must be an absolute path",
            CloneDirError::StraySlash => "must be canonical (no trailing or doubled /)",
            CloneDirError::DotComponent => "must be canonical (no . or .. components)",
        })
    }
}

impl std::error::Error for CloneDirError {}

/// Snapshot CPU-class gate: a non-empty selector requires the node's class to be equal.
pub fn cpu_class_ok(spec: &VmSpec, node_class: Option<&str>) -> bool {
    spec.cpu_class.is_empty() || node_class == Some(spec.cpu_class.as_str())
}

/// The snapshot CPU-class gate with the contract's messages: a pod whose nodeSelector asks for a
/// snapshot compatibility class runs only on a node configured with that very class (a snapshot
/// restored on another CPU class may fault in the guest). `pod` is `<namespace>/<name>`.
pub fn cpu_class_gate(
    spec: &VmSpec,
    pod: &str,
    node_name: &str,
    node_class: Option<&str>,
) -> Result<(), String> {
    if cpu_class_ok(spec, node_class) {
        return Ok(());
    }
    let want = &spec.cpu_class;
    Err(match node_class {
        None => format!(
            "pod {pod} requires snapshot compatibility class {want:?} but node {node_name} is unclassified"
        ),
        Some(have) => format!(
            "pod {pod} requires snapshot compatibility class {want:?} but node {node_name} provides {have:?}"
        ),
    })
}

/// A `fork-from` value names a VM on this host and reaches cocoon's argv (`vm inspect <source>`,
/// `snapshot save --name fork-<source>`): it must be a cocoon VM name
/// (`[a-zA-Z0-9][a-zA-Z0-9._-]*`), short enough that `fork-<source>` is a legal snapshot name,
/// and not the pod's own VM.
pub fn validate_fork_source(source: &str, own_vm: &str) -> Result<(), ForkSourceError> {
    let mut chars = source.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        return Err(ForkSourceError::NotAVmName);
    }
    if fork_snapshot_name(source).len() > NAME_MAX {
        return Err(ForkSourceError::TooLong);
    }
    if source == own_vm {
        return Err(ForkSourceError::OwnVm);
    }
    Ok(())
}

/// Why a `fork-from` value is refused; Display completes `<annotation> "<source>" …`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkSourceError {
    NotAVmName,
    /// `fork-<source>` would pass `NAME_MAX`.
    TooLong,
    OwnVm,
}

impl std::fmt::Display for ForkSourceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ForkSourceError::NotAVmName => f.write_str(
                "is not a VM name (letters, digits, '.', '_', '-'; starting with a letter or digit)",
            ),
            ForkSourceError::TooLong => write!(
                f,
                "is too long: its fork snapshot name would exceed {NAME_MAX} characters"
            ),
            ForkSourceError::OwnVm => f.write_str("names the pod's own VM"),
        }
    }
}

impl std::error::Error for ForkSourceError {}

/// The local snapshot a fork of `source` clones from (shared by every pod forking it).
pub fn fork_snapshot_name(source: &str) -> String {
    format!("fork-{source}")
}

/// Snapshot-before-delete wanted, from the pod's snapshot policy and role.
pub fn should_snapshot(policy: &str, role: &str) -> bool {
    match policy {
        "never" => false,
        "main-only" => role == "main",
        _ => true,
    }
}

/// Tag-aware local snapshot name (default clone path): repo when the tag is empty or `latest`, else
/// `repo:tag`; longer than 63 chars ⇒ first 50 chars + `-` + 12 hex of SHA-256(full name).
pub fn local_snapshot_name(image: &str) -> String {
    let (repo, tag) = split_image_ref(image);
    let full = if tag.is_empty() || tag == "latest" {
        repo
    } else {
        format!("{repo}:{tag}")
    };
    if full.len() <= 63 {
        return full;
    }
    let digest = Sha256::digest(full.as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    let mut cut = 50;
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{}", &full[..cut], hex)
}

pub fn is_http_url(image: &str) -> bool {
    image.starts_with("http://") || image.starts_with("https://")
}

/// The first container's resources, or None when one of them does not parse (such a pod
/// never gets a VM).
pub fn pod_resources(pod: &Pod) -> Option<Resources> {
    parse_resources(pod).ok()
}

fn parse_resources(pod: &Pod) -> Result<Resources, ResourceError> {
    let Some(c) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return Ok(Resources::default());
    };
    let Some(r) = c.resources.as_ref() else {
        return Ok(Resources::default());
    };
    let get =
        |m: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
         k: &str| m.as_ref().and_then(|m| m.get(k)).map(|q| q.0.clone());
    let milli = |v: Option<String>, what: &'static str| -> Result<Option<u64>, ResourceError> {
        v.map(|raw| quantity_milli(&raw).map_err(|_| ResourceError { what, raw }))
            .transpose()
    };
    let bytes = |v: Option<String>, what: &'static str| -> Result<Option<u64>, ResourceError> {
        v.map(|raw| quantity_bytes(&raw).map_err(|_| ResourceError { what, raw }))
            .transpose()
    };
    Ok(Resources {
        cpu_limit_milli: milli(get(&r.limits, "cpu"), "cpu limit")?,
        cpu_request_milli: milli(get(&r.requests, "cpu"), "cpu request")?,
        mem_request_bytes: bytes(get(&r.requests, "memory"), "memory request")?,
        mem_limit_bytes: bytes(get(&r.limits, "memory"), "memory limit")?,
    })
}

/// A container resource quantity that does not parse: `<what> "<raw>": not a Kubernetes …`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ResourceError {
    /// `cpu limit`, `memory request`, …
    what: &'static str,
    raw: String,
}

impl std::fmt::Display for ResourceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}: {BadQuantity}", self.what, self.raw)
    }
}

/// Not a Kubernetes quantity, or one too large for a u64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadQuantity;

impl std::fmt::Display for BadQuantity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not a Kubernetes quantity (or too large)")
    }
}

impl std::error::Error for BadQuantity {}

/// Quantity in milli-units (CPU), rounded up: the vm room's one quantity parser.
pub fn quantity_milli(q: &str) -> Result<u64, BadQuantity> {
    crate::vm::parse_milli(q).ok_or(BadQuantity)
}

/// Quantity as a whole count (bytes), rounded up: the vm room's one quantity parser.
pub fn quantity_bytes(q: &str) -> Result<u64, BadQuantity> {
    crate::vm::parse_quantity(q).ok_or(BadQuantity)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    pub fn pod_with(ann: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some("p".into()),
                uid: Some("u1".into()),
                annotations: Some(
                    ann.iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "agent".into(),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_and_verbatim_fields() {
        let s = parse(&pod_with(&[
            (ANN_VM_NAME, "vk-ns-a-0"),
            (ANN_MODE, "CLONE"),
        ]))
        .unwrap();
        assert_eq!(s.mode, Mode::Clone);
        assert_eq!(s.os, Os::Linux);
        assert_eq!(s.backend, "");
        assert!(!s.managed);
        assert_eq!(s.generation, 0);
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[], "missing_vmname"),
            (
                &[(ANN_VM_NAME, "v"), (ANN_CLONE_FROM_DIR, "snap/dir")],
                "bad_clone_from_dir",
            ),
            (
                &[(ANN_VM_NAME, "v"), (ANN_CLONE_FROM_DIR, "/a/../b")],
                "bad_clone_from_dir",
            ),
            (
                &[
                    (ANN_VM_NAME, "v"),
                    (ANN_CLONE_FROM_DIR, "/a/b"),
                    (ANN_MODE, "run"),
                ],
                "conflicting_annotations",
            ),
            (
                &[
                    (ANN_VM_NAME, "v"),
                    (ANN_CLONE_FROM_DIR, "/a/b"),
                    (ANN_FORK_FROM, "x"),
                ],
                "conflicting_annotations",
            ),
        ];
        for (ann, reason) in cases {
            let e = parse(&pod_with(ann)).unwrap_err();
            assert_eq!(e.reason, *reason, "{ann:?}: {e}");
        }
        let e = parse(&pod_with(&[])).unwrap_err();
        assert_eq!(
            e.message,
            format!("pod ns/p missing vm.cocoonstack.io/name annotation {CONTRACT_HINT}")
        );
    }

    /// Every annotation value the contract allows for the enumerated annotations, and what a
    /// value outside it becomes: the Go daemon's reading, never a refusal.
    #[test]
    fn every_enumerated_annotation_value_and_its_fallback() {
        let read = |k: &str, v: &str| parse(&pod_with(&[(ANN_VM_NAME, "v"), (k, v)])).unwrap();
        for (v, mode) in [
            ("", Mode::Clone),
            ("clone", Mode::Clone),
            ("Clone", Mode::Clone),
            ("run", Mode::Run),
            ("RUN", Mode::Run),
            ("static", Mode::Static),
        ] {
            let s = read(ANN_MODE, v);
            assert_eq!(
                (s.mode, s.mode_raw.as_str(), s.fallbacks.len()),
                (mode, v, 0)
            );
        }
        for (v, os) in [
            ("", Os::Linux),
            ("linux", Os::Linux),
            ("Windows", Os::Windows),
            ("android", Os::Android),
            ("macos", Os::Macos),
        ] {
            let s = read(ANN_OS, v);
            assert_eq!((s.os, s.fallbacks.len()), (os, 0), "{v}");
        }
        for v in ["", BACKEND_CH, BACKEND_FC] {
            let s = read(ANN_BACKEND, v);
            assert_eq!((s.backend.as_str(), s.fallbacks.len()), (v, 0));
        }
        for (v, bytes) in [("20Gi", 20u64 << 30), ("1G", 1_000_000_000), ("512", 512)] {
            let s = read(ANN_STORAGE, v);
            assert_eq!(
                (s.storage_bytes, s.fallbacks.len()),
                (Some(bytes), 0),
                "{v}"
            );
        }
        for (v, port) in [("22", 22u16), ("65535", 65535)] {
            let s = read(ANN_PROBE_PORT, v);
            assert_eq!((s.probe_port, s.fallbacks.len()), (Some(port), 0), "{v}");
        }
        // Outside the contract: read as the Go daemon reads it, with one Fallback each.
        let s = read(ANN_MODE, "teleport");
        assert_eq!((s.mode, s.mode_raw.as_str()), (Mode::Clone, "clone"));
        assert_eq!(read(ANN_OS, "plan9").os, Os::Linux);
        assert_eq!(read(ANN_BACKEND, "qemu").backend, "");
        assert_eq!(read(ANN_STORAGE, "20Gx").storage_bytes, None);
        assert_eq!(read(ANN_STORAGE, "--all").storage_bytes, None);
        for v in ["0", "http", "70000", "-1"] {
            assert_eq!(read(ANN_PROBE_PORT, v).probe_port, None, "{v}");
        }
        for (k, v, reason) in [
            (ANN_MODE, "teleport", "bad_mode"),
            (ANN_OS, "plan9", "bad_os"),
            (ANN_BACKEND, "qemu", "bad_backend"),
            (ANN_STORAGE, "20Gx", "bad_storage"),
            (ANN_PROBE_PORT, "http", "bad_probe_port"),
        ] {
            let f = read(k, v).fallbacks;
            assert_eq!(f.len(), 1, "{k}={v}");
            assert_eq!(
                (f[0].annotation, f[0].value.as_str(), f[0].reason),
                (k, v, reason)
            );
            assert!(f[0].to_string().contains("the Go daemon"), "{}", f[0]);
        }
        // The salvage path reads through the same rules.
        let pod = pod_with(&[(ANN_VM_NAME, "v"), (ANN_MODE, "RUN"), (ANN_STORAGE, "2Gi")]);
        let salvaged = salvage(&pod, "v", "id");
        assert_eq!(
            (salvaged.mode, salvaged.storage_bytes),
            (Mode::Run, Some(2 << 30))
        );
    }

    #[test]
    fn clone_dir_canonical_rules() {
        assert!(validate_clone_dir("/srv/snap").is_ok());
        assert!(validate_clone_dir("/").is_ok());
        for bad in ["srv", "/srv/", "/srv//x", "/srv/./x", "/srv/..", ""] {
            assert!(validate_clone_dir(bad).is_err(), "{bad}");
        }
        let s = parse(&pod_with(&[
            (ANN_VM_NAME, "v"),
            (ANN_CLONE_FROM_DIR, " /a/b "),
        ]))
        .unwrap();
        assert_eq!(s.clone_from_dir.as_deref(), Some("/a/b"));
    }

    #[test]
    fn quantities() {
        assert_eq!(quantity_bytes("20Gi").unwrap(), 20 << 30);
        assert_eq!(quantity_bytes("100G").unwrap(), 100_000_000_000);
        assert_eq!(quantity_bytes("1.5Ki").unwrap(), 1536);
        assert_eq!(quantity_bytes("1e3").unwrap(), 1000);
        assert_eq!(quantity_milli("500m").unwrap(), 500);
        assert_eq!(quantity_milli("2").unwrap(), 2000);
        assert_eq!(quantity_milli("0.1").unwrap(), 100);
        for bad in ["", "abc", "1.2.3", "-1", "5X", "Gi"] {
            assert!(quantity_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_weight_examples_from_the_spec() {
        let r = |req: Option<u64>, lim: Option<u64>| Resources {
            cpu_request_milli: req,
            cpu_limit_milli: lim,
            ..Default::default()
        };
        assert_eq!(r(Some(2000), None).cpu_policy().weight, 79);
        assert_eq!(r(Some(500), None).cpu_policy().weight, 20);
        assert_eq!(r(None, None).cpu_policy().weight, 1);
        let p = r(None, Some(1500)).cpu_policy();
        assert_eq!((p.quota_us, p.period_us), (150_000, 100_000));
        assert_eq!(r(None, Some(5)).cpu_policy().quota_us, 1000);
        assert_eq!(r(Some(500), Some(1500)).vcpus(), 2);
    }

    #[test]
    fn container_resources_are_parsed_and_validated() {
        let mut pod = pod_with(&[(ANN_VM_NAME, "v")]);
        let c = &mut pod.spec.as_mut().unwrap().containers[0];
        c.resources = Some(ResourceRequirements {
            limits: Some([("cpu".to_string(), Quantity("2".into()))].into()),
            requests: Some([("memory".to_string(), Quantity("4Gi".into()))].into()),
            ..Default::default()
        });
        let s = parse(&pod).unwrap();
        assert_eq!(s.resources.vcpus(), 2);
        assert_eq!(s.resources.memory_bytes(), Some(4 << 30));
        let c = &mut pod.spec.as_mut().unwrap().containers[0];
        c.resources.as_mut().unwrap().limits =
            Some([("cpu".to_string(), Quantity("two".into()))].into());
        assert_eq!(parse(&pod).unwrap_err().reason, "bad_quantity");
    }

    #[test]
    fn fork_sources_are_vm_names_whose_fork_snapshot_name_fits() {
        assert!(validate_fork_source("vk-ns-main-0", "vk-ns-sub-0").is_ok());
        assert!(validate_fork_source("a.b_c-9", "x").is_ok());
        let longest = "v".repeat(58);
        assert!(validate_fork_source(&longest, "x").is_ok());
        assert!(validate_fork_source(&format!("{longest}v"), "x")
            .unwrap_err()
            .to_string()
            .contains("too long"));
        for bad in ["", "-x", ".x", "a b", "a/b", "a:b", "a;b", "é"] {
            assert!(validate_fork_source(bad, "x").is_err(), "{bad:?}");
        }
        assert!(validate_fork_source("x", "x")
            .unwrap_err()
            .to_string()
            .contains("own VM"));
        let pod = pod_with(&[(ANN_VM_NAME, "v"), (ANN_FORK_FROM, "--rm")]);
        assert_eq!(parse(&pod).unwrap_err().reason, "bad_fork_from");
        // Salvage never keeps an invalid one.
        assert_eq!(salvage(&pod, "v", "ID").fork_from, "");
        let pod = pod_with(&[(ANN_VM_NAME, "v"), (ANN_FORK_FROM, "main")]);
        assert_eq!(parse(&pod).unwrap().fork_from, "main");
        assert!(!parse(&pod).unwrap().fresh_boot());
    }

    #[test]
    fn the_cpu_class_gate_says_what_the_node_lacks() {
        let mut s = parse(&pod_with(&[(ANN_VM_NAME, "v")])).unwrap();
        assert!(super::cpu_class_gate(&s, "ns/p", "n1", None).is_ok());
        s.cpu_class = "x86-v3".into();
        assert_eq!(
            super::cpu_class_gate(&s, "ns/p", "n1", None).unwrap_err(),
            r#"pod ns/p requires snapshot compatibility class "x86-v3" but node n1 is unclassified"#
        );
        assert_eq!(
            super::cpu_class_gate(&s, "ns/p", "n1", Some("x86-v4")).unwrap_err(),
            r#"pod ns/p requires snapshot compatibility class "x86-v3" but node n1 provides "x86-v4""#
        );
        assert!(super::cpu_class_gate(&s, "ns/p", "n1", Some("x86-v3")).is_ok());
    }

    #[test]
    fn snapshot_policy_and_owner_set() {
        assert!(should_snapshot("", "toolbox"));
        assert!(should_snapshot("weird", "toolbox"));
        assert!(!should_snapshot("never", "main"));
        assert!(should_snapshot("main-only", "main"));
        assert!(!should_snapshot("main-only", "sub-agent"));
        let mut pod = pod_with(&[(ANN_VM_NAME, "vk-ns-demo-0")]);
        pod.metadata.owner_references = Some(vec![OwnerReference {
            kind: "CocoonSet".into(),
            name: "demo".into(),
            ..Default::default()
        }]);
        assert_eq!(parse(&pod).unwrap().owner_cocoonset, "demo");
    }

    #[test]
    fn local_snapshot_names_are_tag_aware_and_bounded() {
        assert_eq!(local_snapshot_name("team/agent"), "team/agent");
        assert_eq!(local_snapshot_name("team/agent:latest"), "team/agent");
        assert_eq!(local_snapshot_name("team/agent:v3"), "team/agent:v3");
        let long = format!("{}:v1", "r".repeat(70));
        let n = local_snapshot_name(&long);
        assert_eq!(n.len(), 63);
        assert!(n.starts_with(&"r".repeat(50)));
        let hex: String = Sha256::digest(long.as_bytes())
            .iter()
            .take(6)
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(&n[51..], hex);
    }

    #[test]
    fn cpu_class_gate() {
        let mut s = parse(&pod_with(&[(ANN_VM_NAME, "v")])).unwrap();
        assert!(cpu_class_ok(&s, None));
        s.cpu_class = "x86-v3".into();
        assert!(!cpu_class_ok(&s, None));
        assert!(!cpu_class_ok(&s, Some("x86-v4")));
        assert!(cpu_class_ok(&s, Some("x86-v3")));
    }
}
