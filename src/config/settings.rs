//! Readers of the variables that have a rule of their own (beyond a default or a range).
//! One function per variable; a few push a warning instead of failing, as the Go daemon did.

use std::net::IpAddr;
use std::path::PathBuf;

use super::values::{get, int_in, invalid, string_or, Lookup};
use super::{is_dns_name, is_label_value, ConfigError, KubeletAuth, OrphanPolicy, RestoreMode};

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

const LABEL_RULE: &str =
    "a Kubernetes label value (at most 63 characters, alphanumeric at both ends, '-', '_' or '.' inside)";

/// OCI_REGISTRY: required, a registry reference without spaces.
pub(super) fn oci_registry(env: Lookup) -> Result<String, ConfigError> {
    let oci_registry = get(env, "OCI_REGISTRY")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    if oci_registry.is_empty() {
        return Err(ConfigError {
            variable: "OCI_REGISTRY",
            value: None,
            allowed:
                "the registry base for snapshots and cloud images, e.g. registry.example.com/cocoon"
                    .into(),
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
    Ok(oci_registry)
}

/// VK_NODE_NAME: an RFC 1123 name (the Node object's name).
pub(super) fn node_name(env: Lookup) -> Result<String, ConfigError> {
    let node_name = string_or(env, "VK_NODE_NAME", "cocoon-pool");
    if !is_dns_name(&node_name) {
        return Err(invalid(
            "VK_NODE_NAME",
            &node_name,
            "a lowercase RFC 1123 name (a-z, 0-9, '-', '.'; at most 253 characters)",
        ));
    }
    Ok(node_name)
}

/// VK_NODE_IP: an IP address, or unset for auto-detection.
pub(super) fn node_ip(env: Lookup) -> Result<Option<IpAddr>, ConfigError> {
    Ok(match get(env, "VK_NODE_IP") {
        None => None,
        Some(raw) => Some(raw.trim().parse::<IpAddr>().map_err(|_| {
            invalid(
                "VK_NODE_IP",
                &raw,
                "an IP address such as 10.0.0.5, or unset for auto",
            )
        })?),
    })
}

/// VK_NODE_POOL: a label value (the pool label).
pub(super) fn node_pool(env: Lookup) -> Result<String, ConfigError> {
    let node_pool = string_or(env, "VK_NODE_POOL", "default");
    if !is_label_value(&node_pool) {
        return Err(invalid("VK_NODE_POOL", &node_pool, LABEL_RULE));
    }
    Ok(node_pool)
}

/// VK_SNAPSHOT_CPU_CLASS: a label value when set.
pub(super) fn snapshot_cpu_class(env: Lookup) -> Result<Option<String>, ConfigError> {
    let snapshot_cpu_class = get(env, "VK_SNAPSHOT_CPU_CLASS");
    if let Some(c) = &snapshot_cpu_class {
        if !is_label_value(c) {
            return Err(invalid("VK_SNAPSHOT_CPU_CLASS", c, LABEL_RULE));
        }
    }
    Ok(snapshot_cpu_class)
}

/// COCOON_MACOS_VNC_PASSWORD: a valid secret; a short one is warned about.
pub(super) fn macos_vnc_password(
    env: Lookup,
    warnings: &mut Vec<String>,
) -> Result<Option<String>, ConfigError> {
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
    Ok(macos_vnc_password)
}

/// VK_ORPHAN_POLICY: destroy (default), alert or keep.
pub(super) fn orphan_policy(env: Lookup) -> Result<OrphanPolicy, ConfigError> {
    Ok(match get(env, "VK_ORPHAN_POLICY") {
        None => OrphanPolicy::Destroy,
        Some(raw) => match raw.trim().to_ascii_lowercase().as_str() {
            "destroy" => OrphanPolicy::Destroy,
            "alert" => OrphanPolicy::Alert,
            "keep" => OrphanPolicy::Keep,
            _ => return Err(invalid("VK_ORPHAN_POLICY", &raw, "destroy, alert or keep")),
        },
    })
}

/// VK_RESTORE_MODE: mmap (default), copy or ondemand.
pub(super) fn restore_mode(env: Lookup) -> Result<RestoreMode, ConfigError> {
    Ok(match get(env, "VK_RESTORE_MODE") {
        None => RestoreMode::Mmap,
        Some(raw) => match raw.trim().to_ascii_lowercase().as_str() {
            "copy" => RestoreMode::Copy,
            "ondemand" => RestoreMode::OnDemand,
            "mmap" => RestoreMode::Mmap,
            _ => return Err(invalid("VK_RESTORE_MODE", &raw, "copy, ondemand or mmap")),
        },
    })
}

/// VK_KUBELET_PORT: a malformed port falls back to 10250 with a warning (as in Go).
pub(super) fn kubelet_port(env: Lookup, warnings: &mut Vec<String>) -> u16 {
    match get(env, "VK_KUBELET_PORT") {
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
    }
}

/// VK_KUBELET_AUTH: on (default) or off, which is warned about.
pub(super) fn kubelet_auth(
    env: Lookup,
    warnings: &mut Vec<String>,
) -> Result<KubeletAuth, ConfigError> {
    Ok(match get(env, "VK_KUBELET_AUTH") {
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
    })
}

/// COCOON_K8S_QPS: a malformed value falls back to 50 with a warning (as in Go).
pub(super) fn k8s_qps(env: Lookup, warnings: &mut Vec<String>) -> f64 {
    match get(env, "COCOON_K8S_QPS") {
        None => 50.0,
        Some(raw) => match raw.trim().parse::<f64>() {
            Ok(q) if q.is_finite() && q > 0.0 => q,
            // As the client reads it: no rate limit at all (what tests and benches want).
            Ok(0.0) => {
                warnings
                    .push("COCOON_K8S_QPS=0: Kubernetes API requests are not rate limited".into());
                0.0
            }
            _ => {
                warnings.push(format!(
                    "COCOON_K8S_QPS={raw:?} is not a number >= 0; using 50"
                ));
                50.0
            }
        },
    }
}

/// COCOON_K8S_BURST: a malformed value falls back to 100 with a warning (as in Go).
pub(super) fn k8s_burst(env: Lookup, warnings: &mut Vec<String>) -> u32 {
    match get(env, "COCOON_K8S_BURST") {
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
    }
}

/// VK_COCOON_NET_CONTROL_SOCKET: set but empty disables lease release.
pub(super) fn net_control_socket(env: Lookup) -> Option<PathBuf> {
    match env("VK_COCOON_NET_CONTROL_SOCKET") {
        None => Some(PathBuf::from("/run/cocoon-net/control.sock")),
        Some(v) if v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
    }
}

/// COCOON_CGROUP_PARENT: a cgroup path without `..` or control characters.
pub(super) fn cgroup_parent(env: Lookup) -> Result<String, ConfigError> {
    let cocoon_cgroup_parent = string_or(env, "COCOON_CGROUP_PARENT", "cocoon.slice");
    if cocoon_cgroup_parent.contains("..") || cocoon_cgroup_parent.chars().any(|c| c.is_control()) {
        return Err(invalid(
            "COCOON_CGROUP_PARENT",
            &cocoon_cgroup_parent,
            "a cgroup path below /sys/fs/cgroup without '..'",
        ));
    }
    Ok(cocoon_cgroup_parent)
}

/// VK_COCOON_DEADLINES: class=seconds pairs over the defaults.
pub(super) fn deadlines(env: Lookup) -> Result<crate::vm::Deadlines, ConfigError> {
    Ok(match get(env, "VK_COCOON_DEADLINES") {
        None => crate::vm::Deadlines::default(),
        Some(raw) => crate::vm::Deadlines::parse(&raw).map_err(|why| {
            invalid(
                "VK_COCOON_DEADLINES",
                &raw,
                format!("class=seconds pairs, classes query, control, create, transfer ({why})"),
            )
        })?,
    })
}

/// VK_RESERVE_PERCENT: the share of the host held back from allocatable.
pub(super) fn reserve_percent(env: Lookup) -> Result<u8, ConfigError> {
    int_in(
        env,
        "VK_RESERVE_PERCENT",
        20u8,
        0,
        100,
        "an integer from 0 to 100",
    )
}

/// SNAPSHOT_ZSTD_LEVEL: 0 (off) or a zstd level.
pub(super) fn snapshot_zstd_level(env: Lookup) -> Result<i32, ConfigError> {
    int_in(
        env,
        "SNAPSHOT_ZSTD_LEVEL",
        0i32,
        0,
        22,
        "0 (off) or a zstd level 1-22",
    )
}

/// SNAPSHOT_CHUNK_SIZE_MIB: 0 (off) or a chunk size.
pub(super) fn snapshot_chunk_size_mib(env: Lookup) -> Result<u64, ConfigError> {
    int_in(
        env,
        "SNAPSHOT_CHUNK_SIZE_MIB",
        0u64,
        0,
        1 << 20,
        "0 (off) or a chunk size in MiB up to 1048576",
    )
}

/// SNAPSHOT_TRANSFER_CONCURRENCY: parallel layer transfers.
pub(super) fn snapshot_transfer_concurrency(env: Lookup) -> Result<usize, ConfigError> {
    int_in(
        env,
        "SNAPSHOT_TRANSFER_CONCURRENCY",
        8usize,
        1,
        256,
        "an integer from 1 to 256",
    )
}

/// SNAPSHOT_MEMORY_BUDGET_MIB: memory for snapshot transfers.
pub(super) fn snapshot_memory_budget_mib(env: Lookup) -> Result<u64, ConfigError> {
    int_in(
        env,
        "SNAPSHOT_MEMORY_BUDGET_MIB",
        9216u64,
        1,
        u64::MAX >> 20,
        "a positive number of MiB",
    )
}

/// SNAPSHOT_PULL_BUDGET_MIB: memory for snapshot pulls.
pub(super) fn snapshot_pull_budget_mib(env: Lookup) -> Result<u64, ConfigError> {
    int_in(
        env,
        "SNAPSHOT_PULL_BUDGET_MIB",
        2048u64,
        1,
        u64::MAX >> 20,
        "a positive number of MiB",
    )
}
