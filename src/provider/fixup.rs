//! The post-clone network fix-up's decisions: which clones need one, and the guest command that
//! re-applies hostname, MACs and addresses. Pure; every value embedded in a command is checked.
//!
//! A clone resumes its source's memory, so the guest still believes it has the source's
//! hostname, MACs and addresses. Windows guests re-detect their NICs when the devices are
//! disabled and enabled again; Firecracker guests also need their MACs set by hand (the
//! hypervisor does not change them on restore); Cloud Hypervisor guests with a static address
//! need networkd (or cloud-init) to write the new one. All-DHCP Cloud Hypervisor guests re-DHCP
//! on their own and need nothing.

use std::fmt;
use std::net::IpAddr;

use super::spec::{Os, BACKEND_FC};
use crate::vm::VmInfo;

/// What a clone needs fixed; also the `kind` label of `postclone_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FixupKind {
    Windows,
    LinuxFc,
    LinuxStatic,
}

impl FixupKind {
    pub fn label(self) -> &'static str {
        match self {
            FixupKind::Windows => "windows",
            FixupKind::LinuxFc => "linux_fc",
            FixupKind::LinuxStatic => "linux_static",
        }
    }
}

/// Whether a cloned VM needs a fix-up, and which: Windows always, Firecracker always, Cloud
/// Hypervisor only with at least one static NIC (inspect reported a non-empty `network.ip`).
pub fn classify(os: Os, vm: &VmInfo) -> Option<FixupKind> {
    if os == Os::Windows {
        Some(FixupKind::Windows)
    } else if vm.hypervisor == BACKEND_FC {
        Some(FixupKind::LinuxFc)
    } else if vm.nics.iter().any(|n| !n.static_ip.is_empty()) {
        Some(FixupKind::LinuxStatic)
    } else {
        None
    }
}

/// The command that fixes a guest, and the text an operator runs by hand when it fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fixup {
    pub kind: FixupKind,
    /// The guest argv after `cocoon vm exec <id> --`.
    pub command: Vec<String>,
    /// The manual repair text (the post-clone-hint annotation carries it base64-encoded).
    pub hint: String,
}

/// The PowerShell script that makes Windows re-detect its NICs (and so take the new MACs and
/// ask DHCP again). It embeds no value from the pod.
const WINDOWS_SCRIPT: &str = "$d = Get-PnpDevice -Class Net -PresentOnly; \
$d | Disable-PnpDevice -Confirm:$false; $d | Enable-PnpDevice -Confirm:$false";

/// A value of the VM's record that failed its check: nothing is built from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FixupError {
    /// The VM name is not fit for `/etc/hostname`.
    Hostname(String),
    /// A NIC (by index) with a value that failed its check.
    Nic { index: usize, error: NicError },
}

/// The NIC value that failed its check, as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicError {
    Mac(String),
    StaticIp(String),
    Gateway(String),
}

impl fmt::Display for FixupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FixupError::Hostname(name) => write!(f, "VM name {name:?} is not a valid hostname"),
            FixupError::Nic { index, error } => write!(f, "nic {index}: {error}"),
        }
    }
}

impl fmt::Display for NicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NicError::Mac(raw) => write!(f, "MAC {raw:?} is not six hex pairs"),
            NicError::StaticIp(ip) => write!(f, "static IP {ip:?} is not an IP address"),
            NicError::Gateway(gw) => write!(f, "gateway {gw:?} is not an IP address"),
        }
    }
}

impl std::error::Error for FixupError {}

/// Builds the fix-up for a clone of `kind`. `cloud_image`: the guest came from a cloud image,
/// so cloud-init rewrites the network instead of networkd files. Err names the value that
/// failed its check; nothing is built from it.
pub fn build(
    kind: FixupKind,
    vm_name: &str,
    vm: &VmInfo,
    cloud_image: bool,
) -> Result<Fixup, FixupError> {
    if kind == FixupKind::Windows {
        return Ok(Fixup {
            kind,
            command: vec![
                "powershell".into(),
                "-nop".into(),
                "-c".into(),
                WINDOWS_SCRIPT.into(),
            ],
            hint: format!("powershell -nop -c '{WINDOWS_SCRIPT}'"),
        });
    }
    let script = linux_script(kind == FixupKind::LinuxFc, vm_name, vm, cloud_image)?;
    Ok(Fixup {
        kind,
        command: vec!["sh".into(), "-c".into(), script.clone()],
        hint: script,
    })
}

/// The Linux script, one step per line (run as `sh -c <script>`).
fn linux_script(
    firecracker: bool,
    vm_name: &str,
    vm: &VmInfo,
    cloud_image: bool,
) -> Result<String, FixupError> {
    let host = hostname(vm_name)?;
    let mut nics = Vec::with_capacity(vm.nics.len());
    for (i, n) in vm.nics.iter().enumerate() {
        let nic_error = |error| FixupError::Nic { index: i, error };
        let mac = mac(&n.mac).map_err(nic_error)?;
        let addr = if n.static_ip.is_empty() {
            None
        } else {
            Some(static_address(&n.static_ip, n.prefix, &n.gateway).map_err(nic_error)?)
        };
        nics.push((mac, addr));
    }
    let mut lines = vec![
        "echo 3 > /proc/sys/vm/drop_caches".to_string(),
        format!("echo '{host}' > /etc/hostname"),
    ];
    if firecracker {
        for (i, (mac, _)) in nics.iter().enumerate() {
            lines.push(format!("ip link set eth{i} down"));
            lines.push(format!("ip link set eth{i} address {mac}"));
            lines.push(format!("ip link set eth{i} up"));
        }
    }
    lines.push("rm -f /etc/systemd/network/10-*.network".into());
    if cloud_image {
        lines.push(
            "cloud-init clean --logs --seed --configs network && cloud-init init --local && cloud-init init"
                .into(),
        );
        lines.push("cloud-init modules --mode=config && systemctl restart systemd-networkd".into());
    } else {
        for (mac, addr) in &nics {
            let network = match addr {
                Some((ip, prefix, gw)) => {
                    let mut s = format!("[Network]\\nAddress={ip}/{prefix}\\n");
                    if let Some(gw) = gw {
                        s.push_str(&format!("Gateway={gw}\\n"));
                    }
                    s
                }
                None => "[Network]\\nDHCP=ipv4\\n\\n[DHCPv4]\\nClientIdentifier=mac\\n".into(),
            };
            lines.push(format!(
                "printf '[Match]\\nMACAddress={mac}\\n\\n{network}' > /etc/systemd/network/10-{}.network",
                mac.replace(':', "")
            ));
        }
        lines.push("systemctl restart systemd-networkd".into());
    }
    Ok(lines.join("\n"))
}

/// A VM name fit for `/etc/hostname` and for a single-quoted shell word: letters, digits, `-`,
/// `.` and `_`, at most 253 bytes, not starting with `-`.
fn hostname(name: &str) -> Result<&str, FixupError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if ok {
        Ok(name)
    } else {
        Err(FixupError::Hostname(name.to_string()))
    }
}

/// A MAC as six colon-separated hex pairs, lower-cased.
fn mac(raw: &str) -> Result<String, NicError> {
    let parts: Vec<&str> = raw.split(':').collect();
    let ok = parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok {
        Ok(raw.to_ascii_lowercase())
    } else {
        Err(NicError::Mac(raw.to_string()))
    }
}

type Address = (IpAddr, u64, Option<IpAddr>);

/// A static address: the IP and gateway must parse (they are written back in their canonical
/// form, never as received); a prefix outside 1..=32 (1..=128 for IPv6) means the usual /24
/// (/64), as the SAC pass does for Windows.
fn static_address(ip: &str, prefix: u64, gateway: &str) -> Result<Address, NicError> {
    let ip: IpAddr = ip
        .trim()
        .parse()
        .map_err(|_| NicError::StaticIp(ip.to_string()))?;
    let (max, usual) = if ip.is_ipv4() { (32, 24) } else { (128, 64) };
    let prefix = if (1..=max).contains(&prefix) {
        prefix
    } else {
        usual
    };
    let gw = if gateway.trim().is_empty() {
        None
    } else {
        let gw: IpAddr = gateway
            .trim()
            .parse()
            .map_err(|_| NicError::Gateway(gateway.to_string()))?;
        Some(gw)
    };
    Ok((ip, prefix, gw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::NicInfo;

    fn nic(mac: &str, ip: &str, prefix: u64, gw: &str) -> NicInfo {
        NicInfo {
            tap: "t".into(),
            mac: mac.into(),
            static_ip: ip.into(),
            prefix,
            gateway: gw.into(),
        }
    }

    fn vm(hv: &str, nics: Vec<NicInfo>) -> VmInfo {
        VmInfo {
            id: "id".into(),
            name: "vk-ns-a".into(),
            hypervisor: hv.into(),
            nics,
            ..Default::default()
        }
    }

    #[test]
    fn classification_follows_guest_backend_and_static_nics() {
        let dhcp = vm(
            "cloud-hypervisor",
            vec![nic("02:00:00:00:00:01", "", 0, "")],
        );
        let fixed = vm(
            "cloud-hypervisor",
            vec![
                nic("02:00:00:00:00:01", "", 0, ""),
                nic("02:00:00:00:00:02", "10.1.0.5", 24, "10.1.0.1"),
            ],
        );
        let fc = vm(BACKEND_FC, vec![nic("02:00:00:00:00:01", "", 0, "")]);
        assert_eq!(classify(Os::Linux, &dhcp), None);
        assert_eq!(classify(Os::Linux, &fixed), Some(FixupKind::LinuxStatic));
        assert_eq!(classify(Os::Linux, &fc), Some(FixupKind::LinuxFc));
        assert_eq!(classify(Os::Windows, &dhcp), Some(FixupKind::Windows));
        assert_eq!(classify(Os::Windows, &fc), Some(FixupKind::Windows));
    }

    #[test]
    fn static_linux_script_writes_networkd_files_per_nic() {
        let v = vm(
            "cloud-hypervisor",
            vec![
                nic("02:AA:00:00:00:01", "10.1.0.5", 24, "10.1.0.1"),
                nic("02:00:00:00:00:02", "", 0, ""),
            ],
        );
        let f = build(FixupKind::LinuxStatic, "vk-ns-a", &v, false).unwrap();
        assert_eq!(f.command[..2], ["sh".to_string(), "-c".to_string()]);
        let lines: Vec<&str> = f.command[2].lines().collect();
        assert_eq!(
            lines,
            [
                "echo 3 > /proc/sys/vm/drop_caches",
                "echo 'vk-ns-a' > /etc/hostname",
                "rm -f /etc/systemd/network/10-*.network",
                "printf '[Match]\\nMACAddress=02:aa:00:00:00:01\\n\\n[Network]\\nAddress=10.1.0.5/24\\nGateway=10.1.0.1\\n' > /etc/systemd/network/10-02aa00000001.network",
                "printf '[Match]\\nMACAddress=02:00:00:00:00:02\\n\\n[Network]\\nDHCP=ipv4\\n\\n[DHCPv4]\\nClientIdentifier=mac\\n' > /etc/systemd/network/10-020000000002.network",
                "systemctl restart systemd-networkd",
            ]
        );
        assert_eq!(f.hint, f.command[2]);
    }

    #[test]
    fn firecracker_script_reapplies_macs_and_cloud_images_rerun_cloud_init() {
        let v = vm(
            BACKEND_FC,
            vec![
                nic("02:00:00:00:00:01", "", 0, ""),
                nic("02:00:00:00:00:02", "", 0, ""),
            ],
        );
        let f = build(FixupKind::LinuxFc, "vk-ns-a", &v, true).unwrap();
        let s = &f.command[2];
        for l in [
            "ip link set eth0 down\nip link set eth0 address 02:00:00:00:00:01\nip link set eth0 up",
            "ip link set eth1 address 02:00:00:00:00:02",
            "cloud-init clean --logs --seed --configs network && cloud-init init --local && cloud-init init\ncloud-init modules --mode=config && systemctl restart systemd-networkd",
        ] {
            assert!(s.contains(l), "{l} missing from {s}");
        }
        assert!(!s.contains("printf"), "cloud images get no networkd files");
        // A CH clone never touches links.
        let ch = build(FixupKind::LinuxStatic, "vk-ns-a", &v, true).unwrap();
        assert!(!ch.command[2].contains("ip link"));
    }

    #[test]
    fn windows_line_is_fixed_text_and_its_hint_single_quotes_it() {
        let v = vm("cloud-hypervisor", vec![]);
        let f = build(FixupKind::Windows, "anything", &v, false).unwrap();
        assert_eq!(
            f.command[..3],
            ["powershell", "-nop", "-c"].map(String::from)
        );
        assert!(f.command[3].contains("Get-PnpDevice -Class Net -PresentOnly"));
        assert!(f.command[3].contains("Disable-PnpDevice -Confirm:$false"));
        assert!(f.command[3].contains("Enable-PnpDevice -Confirm:$false"));
        assert_eq!(f.hint, format!("powershell -nop -c '{}'", f.command[3]));
    }

    #[test]
    fn values_that_could_break_the_script_are_refused() {
        let good = nic("02:00:00:00:00:01", "10.0.0.2", 24, "10.0.0.1");
        for (name, n, want) in [
            ("vk-ns-a'; reboot; '", good.clone(), "hostname"),
            ("-x", good.clone(), "hostname"),
            ("", good.clone(), "hostname"),
            ("vk-ns-a", nic("02:00:00:00:00:01'", "", 0, ""), "MAC"),
            ("vk-ns-a", nic("02:00:00:00:01", "", 0, ""), "MAC"),
            (
                "vk-ns-a",
                nic("02:00:00:00:00:01", "10.0.0.2;id", 24, ""),
                "static IP",
            ),
            (
                "vk-ns-a",
                nic("02:00:00:00:00:01", "10.0.0.2", 24, "$(id)"),
                "gateway",
            ),
        ] {
            let v = vm("cloud-hypervisor", vec![n]);
            let err = build(FixupKind::LinuxStatic, name, &v, false)
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{name}: {err}");
        }
    }

    #[test]
    fn a_missing_or_impossible_prefix_means_slash_24() {
        for p in [0, 33, 99] {
            let v = vm(
                "cloud-hypervisor",
                vec![nic("02:00:00:00:00:01", "10.0.0.2", p, "")],
            );
            let f = build(FixupKind::LinuxStatic, "vk", &v, false).unwrap();
            assert!(f.command[2].contains("Address=10.0.0.2/24\\n' >"), "{p}");
        }
    }
}
