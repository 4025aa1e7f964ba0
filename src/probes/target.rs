//! What a probe is aimed at: the pod's VM, the IP to probe and the kind of probe.
//! Resolves the IP through the lease file and validates the probe-port annotation.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Instant, SystemTime};

use crate::network::leases::LeaseFile;

/// The port of the SSH probe of macOS guests without a `probe-port`.
pub const SSH_PORT: u16 = 22;

/// What the provider knows about a pod's VM, as far as probing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub namespace: String,
    /// The pod's UID, echoed in every [`ProbeEvent`](super::ProbeEvent) so late events for an
    /// older incarnation can be dropped by the provider.
    pub uid: String,
    /// The VM the probe is for; echoed in [`ProbeEvent::IpChanged`](super::ProbeEvent::IpChanged)
    /// so the provider can drop the update if the pod tracks another VM by then.
    pub vm_id: String,
    /// The tracked IP (from `cocoon vm inspect`, a static NIC, or an earlier lease).
    pub ip: Option<Ipv4Addr>,
    /// The primary (first NIC's) MAC, used to look the lease up.
    pub mac: Option<String>,
    /// The first NIC has a static IP: the lease file is not consulted.
    pub static_ip: bool,
    /// The `vm.cocoonstack.io/probe-port` annotation, verbatim (validated here).
    pub probe_port: Option<String>,
    /// The port must greet with an SSH banner (`SSH-`), not only accept: the probe of a macOS
    /// guest with no probe-port (its port is then [`SSH_PORT`]).
    pub ssh_banner: bool,
}

impl ProbeTarget {
    /// From the provider's `Effect::StartProbe` fields: `ip` and `mac` empty (or, for `ip`,
    /// unparseable) mean unknown; `probe_port` is already validated there. A VM whose first
    /// NIC is static should be given with an empty `mac` (or `static_ip` set afterwards).
    pub fn from_parts(
        namespace: &str,
        uid: &str,
        vm_id: &str,
        ip: &str,
        mac: &str,
        probe_port: Option<u16>,
    ) -> ProbeTarget {
        let mac = mac.trim();
        ProbeTarget {
            namespace: namespace.to_string(),
            uid: uid.to_string(),
            vm_id: vm_id.to_string(),
            ip: ip.trim().parse().ok(),
            mac: (!mac.is_empty()).then(|| mac.to_string()),
            static_ip: false,
            probe_port: probe_port.map(|p| p.to_string()),
            ssh_banner: false,
        }
    }
}

/// The stored result of the latest probe (what GetPodStatus reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    pub ready: bool,
    pub message: String,
    pub at: Instant,
}

/// Which network probe to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    Ping(Ipv4Addr),
    Tcp(SocketAddrV4),
    /// Connect and read the greeting: ready only when it starts with `SSH-`.
    SshBanner(SocketAddrV4),
}

/// Which IP to probe: the lease file's, else the tracked one. Returns the IP to probe and,
/// when the lease file could not answer, a short note for the not-ready message. Lease-file errors are logged once per file version.
pub fn resolve_ip(
    target: &ProbeTarget,
    leases: Option<&mut LeaseFile>,
    wall: SystemTime,
) -> (Option<Ipv4Addr>, Option<String>) {
    if target.static_ip {
        return (target.ip, None);
    }
    let (Some(mac), Some(leases)) = (target.mac.as_deref(), leases) else {
        return (target.ip, None);
    };
    if mac.trim().is_empty() {
        return (target.ip, None);
    }
    match leases.lookup(mac, wall) {
        Ok(Some(lease)) => (Some(lease.ip), None),
        Ok(None) => (None, None),
        // The Go daemon keeps the tracked IP when the file cannot be read: a guest that
        // answers on it is still up. Without a tracked IP the pod stays not ready.
        Err(e) => {
            if leases.should_log(&e) {
                log::warn!("{e}");
            }
            (target.ip, Some(e.to_string()))
        }
    }
}

/// The probe-port annotation: a decimal port 1..=65535 (surrounding spaces tolerated).
pub fn parse_probe_port(raw: &str) -> Option<u16> {
    let raw = raw.trim();
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    raw.parse::<u16>().ok().filter(|p| *p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_port_parsing() {
        assert_eq!(parse_probe_port("22"), Some(22));
        assert_eq!(parse_probe_port(" 65535 "), Some(65535));
        for bad in ["", "0", "65536", "-1", "+22", "22a", "ssh", "2 2"] {
            assert_eq!(parse_probe_port(bad), None, "{bad:?}");
        }
    }
}
