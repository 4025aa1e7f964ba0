//! The fake's DHCP mode: it plays cocoon-net and keeps cocoon-net's lease file in step with
//! the VM records. It owns only the lease file; it must not touch VM records or the journal.
//!
//! Selected by `FAKE_COCOON_DHCP=1` with the file at `FAKE_COCOON_LEASES`; the choice is also
//! remembered in `<state>/dhcp_leases` so later invocations without the env (test harness
//! helpers, library calls) behave the same. After every fake invocation (under the state lock)
//! the file is rewritten: one row per NIC of every VM that reads `running`, rows of VMs that
//! are gone or stopped are dropped (rows outside 127.88.0.0/16 are another writer's and stay).
//! A MAC keeps its IP while it holds a lease; new MACs get the
//! next address of 127.88.0.0/16 (loopback only, so the daemon's probes never leave the host).

use super::store::{display_state, rfc3339_at, write_atomic, Store};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The addresses this fake hands out (`Store::next_ip`).
const OWN_RANGE: &str = "127.88.";

/// How long a fresh lease lasts.
const LEASE_TTL: Duration = Duration::from_secs(3600);

/// One row of the lease file, in the shape cocoon-net writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRow {
    pub mac: String,
    pub ip: String,
    pub expiry: String,
}

/// Where the remembered lease-file path lives in a state directory.
pub fn marker_path(state: &Path) -> PathBuf {
    state.join("dhcp_leases")
}

/// The lease file this installation writes, if DHCP mode is on: from the env (remembered in the
/// state dir) or from an earlier invocation's marker.
pub fn configure(state: &Path) -> Result<Option<PathBuf>, String> {
    let on = std::env::var("FAKE_COCOON_DHCP").ok().as_deref() == Some("1");
    if on {
        let path = std::env::var("FAKE_COCOON_LEASES")
            .ok()
            .filter(|p| !p.is_empty())
            .ok_or("fake cocoon: FAKE_COCOON_DHCP=1 needs FAKE_COCOON_LEASES (lease file path)")?;
        let marker = marker_path(state);
        if fs::read_to_string(&marker).ok().as_deref() != Some(path.as_str()) {
            write_atomic(&marker, path.as_bytes())
                .map_err(|e| format!("remember lease path: {e}"))?;
        }
        return Ok(Some(PathBuf::from(path)));
    }
    Ok(remembered(state))
}

/// The lease path remembered in a state directory (no env involved).
pub fn remembered(state: &Path) -> Option<PathBuf> {
    fs::read_to_string(marker_path(state))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// Reads the lease rows (missing file, `null` or garbage read as no rows: the fake owns it).
pub fn read_rows(path: &Path) -> Vec<LeaseRow> {
    fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Option<Vec<LeaseRow>>>(&b).ok())
        .flatten()
        .unwrap_or_default()
}

/// Rewrites the lease file from the VM records. Call with the state lock held.
pub fn sync(store: &Store) -> io::Result<()> {
    let Some(path) = &store.leases else {
        return Ok(());
    };
    let old: BTreeMap<String, LeaseRow> = read_rows(path)
        .into_iter()
        .map(|r| (r.mac.to_ascii_lowercase(), r))
        .collect();
    let expiry = rfc3339_at(SystemTime::now() + LEASE_TTL);
    // Rows outside this fake's range are another writer's (the fake cocoon-macos shares the
    // sandbox's lease file): kept as they are.
    let mut rows: Vec<LeaseRow> = old
        .values()
        .filter(|r| !r.ip.starts_with(OWN_RANGE))
        .cloned()
        .collect();
    for sv in store.load_vms() {
        if display_state(&sv.vm) != "running" {
            continue;
        }
        for nic in &sv.vm.network_configs {
            let mac = nic.mac.trim().to_ascii_lowercase();
            if mac.is_empty() || nic.network.is_some() {
                continue;
            }
            let row = match old.get(&mac) {
                Some(r) => r.clone(),
                None => LeaseRow {
                    mac,
                    ip: store.next_ip(),
                    expiry: expiry.clone(),
                },
            };
            rows.push(row);
        }
    }
    if old.len() == rows.len() && rows.iter().all(|r| old.get(&r.mac) == Some(r)) && path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let bytes = serde_json::to_vec(&rows).map_err(io::Error::other)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, &bytes)?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
    fs::rename(&tmp, path)
}
