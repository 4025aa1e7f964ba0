//! The cocoon calls the provider core asks for, their argv (cocoon-cli.md, N generation), and
//! the parsing/classification of their raw results. Builds and parses only; never runs a child.

use std::time::Duration;

use serde::Deserialize;

use crate::vm::RestoreMode;

/// A cocoon invocation the core wants performed. `argv()` is the argument vector after the
/// binary (`VK_COCOON_BIN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CocoonCmd {
    VmInspect { reference: String },
    VmClone(CloneArgs),
    VmRun(RunArgs),
    VmStart { id: String },
    VmRm { id: String },
    ReconcileStaleCreate { id: String },
    SnapshotInspect { name: String },
    SnapshotSave { name: String, vm_id: String },
    SnapshotRm { name: String },
    ImageInspect { reference: String },
    ImagePull { reference: String, force: bool },
}

/// CPU policy flags shared by clone and run (§5.3); 0 ⇒ flag omitted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuPolicy {
    pub weight: u64,
    pub quota_us: u64,
    pub period_us: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneArgs {
    pub name: String,
    pub network: String,
    pub no_direct_io: bool,
    pub pull: bool,
    /// None for firecracker.
    pub restore_mode: Option<RestoreMode>,
    pub cpu: CpuPolicy,
    pub source: CloneSource,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloneSource {
    Snapshot(String),
    FromDir(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunArgs {
    pub name: String,
    pub cpu_count: u64,
    pub cpu: CpuPolicy,
    /// Bytes, or a verbatim string; empty ⇒ omitted.
    pub memory: String,
    pub storage: String,
    pub network: String,
    pub windows: bool,
    pub firecracker: bool,
    pub no_direct_io: bool,
    pub image: String,
}

fn push_cpu(argv: &mut Vec<String>, cpu: &CpuPolicy) {
    for (flag, v) in [
        ("--cpu-weight", cpu.weight),
        ("--cpu-quota-us", cpu.quota_us),
        ("--cpu-period-us", cpu.period_us),
    ] {
        if v > 0 {
            argv.push(flag.into());
            argv.push(v.to_string());
        }
    }
}

impl CocoonCmd {
    pub fn argv(&self) -> Vec<String> {
        let s = |x: &str| x.to_string();
        match self {
            CocoonCmd::VmInspect { reference } => vec![s("vm"), s("inspect"), reference.clone()],
            CocoonCmd::VmStart { id } => vec![s("vm"), s("start"), id.clone()],
            CocoonCmd::VmRm { id } => vec![s("vm"), s("rm"), s("--force"), id.clone()],
            CocoonCmd::ReconcileStaleCreate { id } => vec![
                s("vm"),
                s("reconcile-stale-create"),
                id.clone(),
                s("-o"),
                s("json"),
            ],
            CocoonCmd::SnapshotInspect { name } => vec![s("snapshot"), s("inspect"), name.clone()],
            CocoonCmd::SnapshotSave { name, vm_id } => vec![
                s("snapshot"),
                s("save"),
                s("--name"),
                name.clone(),
                vm_id.clone(),
            ],
            CocoonCmd::SnapshotRm { name } => vec![s("snapshot"), s("rm"), name.clone()],
            CocoonCmd::ImageInspect { reference } => {
                vec![s("image"), s("inspect"), reference.clone()]
            }
            CocoonCmd::ImagePull { reference, force } => {
                let mut v = vec![s("image"), s("pull")];
                if *force {
                    v.push(s("--force"));
                }
                v.push(reference.clone());
                v
            }
            CocoonCmd::VmClone(a) => {
                let mut v = vec![s("vm"), s("clone"), s("--output"), s("json")];
                if !a.name.is_empty() {
                    v.extend([s("--name"), a.name.clone()]);
                }
                if !a.network.is_empty() {
                    v.extend([s("--network"), a.network.clone()]);
                }
                if a.no_direct_io {
                    v.push(s("--no-direct-io"));
                }
                if a.pull || matches!(a.source, CloneSource::FromDir(_)) {
                    v.push(s("--pull"));
                }
                if let Some(m) = a.restore_mode {
                    v.extend([s("--restore-mode"), s(m.as_str())]);
                }
                push_cpu(&mut v, &a.cpu);
                match &a.source {
                    CloneSource::Snapshot(n) => v.push(n.clone()),
                    CloneSource::FromDir(d) => v.extend([s("--from-dir"), d.clone()]),
                }
                v
            }
            CocoonCmd::VmRun(a) => {
                let mut v = vec![s("vm"), s("run"), s("--output"), s("json")];
                if !a.name.is_empty() {
                    v.extend([s("--name"), a.name.clone()]);
                }
                if a.cpu_count > 0 {
                    v.extend([s("--cpu"), a.cpu_count.to_string()]);
                }
                push_cpu(&mut v, &a.cpu);
                if !a.memory.is_empty() {
                    v.extend([s("--memory"), a.memory.clone()]);
                }
                if !a.storage.is_empty() {
                    v.extend([s("--storage"), a.storage.clone()]);
                }
                if !a.network.is_empty() {
                    v.extend([s("--network"), a.network.clone()]);
                }
                if a.windows {
                    v.push(s("--windows"));
                }
                if a.firecracker {
                    v.push(s("--fc"));
                }
                if a.no_direct_io {
                    v.push(s("--no-direct-io"));
                }
                v.push(a.image.clone());
                v
            }
        }
    }

    /// How long the daemon lets the child run before killing it.
    pub fn deadline(&self) -> Duration {
        match self {
            CocoonCmd::VmClone(_) | CocoonCmd::VmRun(_) | CocoonCmd::ImagePull { .. } => {
                Duration::from_secs(600)
            }
            CocoonCmd::SnapshotSave { .. } => Duration::from_secs(600),
            CocoonCmd::VmRm { .. } | CocoonCmd::VmStart { .. } => Duration::from_secs(120),
            _ => Duration::from_secs(30),
        }
    }
}

/// Raw outcome of a cocoon child, as the daemon saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CocoonResult {
    /// Exit status 0.
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    /// Killed at its deadline.
    pub timed_out: bool,
}

impl CocoonResult {
    pub fn ok(stdout: impl Into<String>) -> Self {
        CocoonResult {
            success: true,
            stdout: stdout.into(),
            ..Default::default()
        }
    }

    pub fn failed(stderr: impl Into<String>) -> Self {
        CocoonResult {
            success: false,
            stderr: stderr.into(),
            ..Default::default()
        }
    }

    /// One-line error text for messages.
    pub fn error_text(&self) -> String {
        if self.timed_out {
            return "cocoon timed out".into();
        }
        let text = if self.stderr.trim().is_empty() {
            self.stdout.trim()
        } else {
            self.stderr.trim()
        };
        let text = text.lines().last().unwrap_or("").trim();
        if text.is_empty() {
            "cocoon failed".into()
        } else {
            crate::provider::truncate_bytes(text, 400)
        }
    }

    fn err_lower(&self) -> String {
        format!("{}\n{}", self.stderr, self.stdout).to_ascii_lowercase()
    }

    /// `vm not found` / `no such vm` (case-insensitive) on a failed call.
    pub fn vm_not_found(&self) -> bool {
        !self.success && {
            let e = self.err_lower();
            e.contains("vm not found") || e.contains("no such vm")
        }
    }

    pub fn snapshot_not_found(&self) -> bool {
        !self.success && {
            let e = self.err_lower();
            e.contains("snapshot not found") || e.contains("no such snapshot")
        }
    }

    pub fn image_not_found(&self) -> bool {
        !self.success && self.err_lower().contains("not found in any backend")
    }

    pub fn name_taken(&self) -> bool {
        !self.success && {
            let e = self.err_lower();
            e.contains("already exists") || e.contains("already in use by")
        }
    }
}

/// One NIC of a VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicInfo {
    pub tap: String,
    pub mac: String,
    /// Static address from inspect's `network.ip`; empty ⇒ DHCP.
    pub static_ip: String,
}

/// The VM record fields the provider uses (cocoon-cli.md §4.1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmInfo {
    pub id: String,
    pub name: String,
    pub hypervisor: String,
    pub state: String,
    pub pid: i64,
    pub nics: Vec<NicInfo>,
}

impl VmInfo {
    pub fn primary_mac(&self) -> String {
        self.nics.first().map(|n| n.mac.clone()).unwrap_or_default()
    }

    /// Primary IP as reported by cocoon (static NIC address), else empty.
    pub fn primary_ip(&self) -> String {
        self.nics
            .first()
            .map(|n| n.static_ip.clone())
            .unwrap_or_default()
    }

    pub fn running(&self) -> bool {
        self.state == "running"
    }

    /// MACs to release after removal: every non-static NIC (trimmed, lower-cased, de-duplicated).
    pub fn lease_macs(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for n in &self.nics {
            let m = n.mac.trim().to_ascii_lowercase();
            if n.static_ip.is_empty() && !m.is_empty() && !out.contains(&m) {
                out.push(m);
            }
        }
        out
    }
}

#[derive(Deserialize, Default)]
struct RawNet {
    #[serde(default)]
    ip: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawNic {
    #[serde(default)]
    tap: Option<String>,
    #[serde(default)]
    mac: Option<String>,
    #[serde(default)]
    network: Option<RawNet>,
}

#[derive(Deserialize, Default)]
struct RawConfig {
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawVm {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    hypervisor: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    pid: Option<i64>,
    #[serde(default)]
    config: Option<RawConfig>,
    #[serde(default)]
    network_configs: Option<Vec<RawNic>>,
}

impl From<RawVm> for VmInfo {
    fn from(r: RawVm) -> Self {
        VmInfo {
            id: r.id.unwrap_or_default(),
            name: r.config.and_then(|c| c.name).unwrap_or_default(),
            hypervisor: r.hypervisor.unwrap_or_default(),
            state: r.state.unwrap_or_default(),
            pid: r.pid.unwrap_or(0),
            nics: r
                .network_configs
                .unwrap_or_default()
                .into_iter()
                .map(|n| NicInfo {
                    tap: n.tap.unwrap_or_default(),
                    mac: n.mac.unwrap_or_default().to_ascii_lowercase(),
                    static_ip: n.network.and_then(|x| x.ip).unwrap_or_default(),
                })
                .collect(),
        }
    }
}

/// Parse one VM object (inspect / clone / run output). Empty id ⇒ error.
pub fn parse_vm(json: &str) -> Result<VmInfo, String> {
    let raw: RawVm =
        serde_json::from_str(json.trim()).map_err(|e| format!("bad VM JSON from cocoon: {e}"))?;
    let vm = VmInfo::from(raw);
    if vm.id.is_empty() {
        return Err("empty VM record in JSON payload".into());
    }
    Ok(vm)
}

/// Parse `vm list -o json`: empty output, `No VMs found.`, or an array (entries without id skipped).
pub fn parse_vm_list(out: &str) -> Result<Vec<VmInfo>, String> {
    let t = out.trim();
    if t.is_empty() || t == "No VMs found." || t == "null" {
        return Ok(Vec::new());
    }
    let raw: Vec<RawVm> =
        serde_json::from_str(t).map_err(|e| format!("bad VM list JSON from cocoon: {e}"))?;
    Ok(raw
        .into_iter()
        .map(VmInfo::from)
        .filter(|v| !v.id.is_empty())
        .collect())
}

/// Parse one event-stream line: `{"event": ..., "vm": {...}}`. Events without id and name are dropped.
pub fn parse_event_line(line: &str) -> Result<Option<(super::VmEventKind, VmInfo)>, String> {
    #[derive(Deserialize)]
    struct Line {
        event: String,
        vm: RawVm,
    }
    let t = line.trim();
    if t.is_empty() {
        return Ok(None);
    }
    let l: Line = serde_json::from_str(t).map_err(|e| format!("bad event line: {e}"))?;
    let kind = match l.event.as_str() {
        "ADDED" => super::VmEventKind::Added,
        "MODIFIED" => super::VmEventKind::Modified,
        "DELETED" => super::VmEventKind::Deleted,
        other => return Err(format!("unknown event kind {other:?}")),
    };
    let vm = VmInfo::from(l.vm);
    if vm.id.is_empty() && vm.name.is_empty() {
        return Ok(None);
    }
    Ok(Some((kind, vm)))
}

/// `snapshot inspect` fields the provider reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct SnapshotInfo {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub image: String,
    #[serde(default)]
    pub image_digest: String,
    #[serde(default)]
    pub image_type: String,
    #[serde(default)]
    pub hypervisor: String,
}

pub fn parse_snapshot(json: &str) -> Result<SnapshotInfo, String> {
    serde_json::from_str(json.trim()).map_err(|e| format!("bad snapshot JSON from cocoon: {e}"))
}

/// `vm reconcile-stale-create` outcome; empty ⇒ error.
pub fn parse_stale_outcome(json: &str) -> Result<String, String> {
    #[derive(Deserialize)]
    struct Out {
        #[serde(default)]
        outcome: String,
    }
    let o: Out = serde_json::from_str(json.trim())
        .map_err(|e| format!("bad reconcile-stale-create JSON: {e}"))?;
    if o.outcome.is_empty() {
        return Err("reconcile-stale-create returned an empty outcome".into());
    }
    Ok(o.outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_argv_follows_the_n_generation_order() {
        let cmd = CocoonCmd::VmClone(CloneArgs {
            name: "vk-ns-demo-0".into(),
            network: "net1".into(),
            no_direct_io: true,
            pull: true,
            restore_mode: Some(RestoreMode::Mmap),
            cpu: CpuPolicy {
                weight: 79,
                quota_us: 200000,
                period_us: 100000,
            },
            source: CloneSource::Snapshot("team/agent:v3".into()),
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm clone --output json --name vk-ns-demo-0 --network net1 --no-direct-io --pull \
             --restore-mode mmap --cpu-weight 79 --cpu-quota-us 200000 --cpu-period-us 100000 team/agent:v3"
        );
    }

    #[test]
    fn clone_from_dir_implies_pull_and_ends_with_the_dir() {
        let cmd = CocoonCmd::VmClone(CloneArgs {
            name: "a".into(),
            network: String::new(),
            no_direct_io: false,
            pull: false,
            restore_mode: None,
            cpu: CpuPolicy {
                weight: 1,
                ..Default::default()
            },
            source: CloneSource::FromDir("/srv/snap".into()),
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm clone --output json --name a --pull --cpu-weight 1 --from-dir /srv/snap"
        );
    }

    #[test]
    fn run_argv_has_flags_before_image() {
        let cmd = CocoonCmd::VmRun(RunArgs {
            name: "v".into(),
            cpu_count: 2,
            cpu: CpuPolicy {
                weight: 79,
                ..Default::default()
            },
            memory: "4294967296".into(),
            storage: String::new(),
            network: String::new(),
            windows: false,
            firecracker: true,
            no_direct_io: false,
            image: "ubuntu:24.04".into(),
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm run --output json --name v --cpu 2 --cpu-weight 79 --memory 4294967296 --fc ubuntu:24.04"
        );
    }

    #[test]
    fn parses_vm_with_static_and_dhcp_nics() {
        let vm = parse_vm(
            r#"{"id":"ABC","hypervisor":"cloud-hypervisor","state":"running","pid":7,
                "config":{"name":"vk-a-b-0"},"network_configs":[
                {"tap":"t0","mac":"02:AA:00:00:00:01"},
                {"tap":"t1","mac":"02:aa:00:00:00:02","network":{"ip":"10.0.0.2","prefix":24}}],
                "unknown":1}"#,
        )
        .unwrap();
        assert_eq!(vm.name, "vk-a-b-0");
        assert_eq!(vm.primary_mac(), "02:aa:00:00:00:01");
        assert_eq!(vm.primary_ip(), "");
        assert_eq!(vm.lease_macs(), vec!["02:aa:00:00:00:01".to_string()]);
        assert!(parse_vm(r#"{"id":""}"#).is_err());
        assert!(parse_vm("not json").is_err());
    }

    #[test]
    fn vm_list_accepts_empty_forms() {
        assert!(parse_vm_list("No VMs found.\n").unwrap().is_empty());
        assert!(parse_vm_list("").unwrap().is_empty());
        let l = parse_vm_list(r#"[{"id":"a","state":"running"},{"state":"x"}]"#).unwrap();
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn classifies_not_found_texts() {
        assert!(CocoonResult::failed("Error: inspect: vm x: VM not found").vm_not_found());
        assert!(!CocoonResult::failed("VM not running").vm_not_found());
        assert!(CocoonResult::failed("inspect: snapshot not found").snapshot_not_found());
        assert!(CocoonResult::failed("image \"x\": Not found in any backend").image_not_found());
        assert!(!CocoonResult::ok("vm not found").vm_not_found());
    }

    #[test]
    fn event_lines_parse_and_drop_anonymous() {
        let (k, vm) = parse_event_line(r#"{"event":"DELETED","vm":{"id":"Q","state":"stopped"}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(k, crate::provider::VmEventKind::Deleted);
        assert_eq!(vm.id, "Q");
        assert!(parse_event_line(r#"{"event":"ADDED","vm":{}}"#)
            .unwrap()
            .is_none());
        assert!(parse_event_line("{").is_err());
    }

    #[test]
    fn stale_outcome_requires_value() {
        assert_eq!(
            parse_stale_outcome(r#"{"id":"a","outcome":"busy"}"#).unwrap(),
            "busy"
        );
        assert!(parse_stale_outcome(r#"{"id":"a"}"#).is_err());
    }
}
