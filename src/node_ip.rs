//! Auto-detection of the node's InternalIP (`VK_NODE_IP` unset): the address of the interface
//! the default route leaves by. Reads /proc/net/route, /proc/net/ipv6_route and the interfaces.
//!
//! The Go daemon took the first non-loopback IPv4 address of any interface, which on a VM host
//! is often a bridge, a container network or a tunnel rather than the address peers and the
//! API server reach. The order here: the IPv4 default route's interface and its IPv4 address
//! (lowest metric first); else the IPv6 default route's interface and its global IPv6
//! address; else, on a host without a default route, the Go daemon's rule.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The detected address and how it was found (shown by `vk-cocoon check-config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    pub ip: IpAddr,
    pub how: String,
}

/// Detects the node IP from the running system; None when no usable address exists.
pub fn detect() -> Option<Detected> {
    let route4 = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    let route6 = std::fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
    choose(&route4, &route6, &interface_addresses())
}

/// The pure choice over the routing tables' text and the interfaces' addresses.
pub fn choose(route4: &str, route6: &str, addrs: &[(String, IpAddr)]) -> Option<Detected> {
    if let Some(iface) = default_route_v4(route4) {
        let found = addrs.iter().find_map(|(name, ip)| match ip {
            IpAddr::V4(v4) if *name == iface && usable_v4(v4) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = found {
            return Some(Detected {
                ip,
                how: format!("IPv4 default route via {iface}"),
            });
        }
    }
    if let Some(iface) = default_route_v6(route6) {
        let found = addrs.iter().find_map(|(name, ip)| match ip {
            IpAddr::V6(v6) if *name == iface && usable_v6(v6) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = found {
            return Some(Detected {
                ip,
                how: format!("IPv6 default route via {iface}"),
            });
        }
    }
    addrs.iter().find_map(|(name, ip)| match ip {
        IpAddr::V4(v4) if usable_v4(v4) => Some(Detected {
            ip: *ip,
            how: format!("no default route: first non-loopback IPv4 ({name})"),
        }),
        _ => None,
    })
}

fn usable_v4(ip: &Ipv4Addr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && !ip.is_link_local()
}

fn usable_v6(ip: &Ipv6Addr) -> bool {
    let link_local = (ip.segments()[0] & 0xffc0) == 0xfe80;
    !ip.is_loopback() && !ip.is_unspecified() && !link_local && !ip.is_multicast()
}

const RTF_UP: u32 = 0x0001;
const RTF_REJECT: u32 = 0x0200;

/// The interface of the IPv4 default route (destination and mask 0, up, not a reject route)
/// with the lowest metric, from /proc/net/route.
pub fn default_route_v4(text: &str) -> Option<String> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (iface, dest, flags, metric, mask) =
                (f.first()?, f.get(1)?, f.get(3)?, f.get(6)?, f.get(7)?);
            let flags = u32::from_str_radix(flags, 16).ok()?;
            let default = u32::from_str_radix(dest, 16).ok()? == 0
                && u32::from_str_radix(mask, 16).ok()? == 0;
            let up = flags & RTF_UP != 0 && flags & RTF_REJECT == 0;
            (default && up && *iface != "lo")
                .then(|| Some((metric.parse::<u32>().ok()?, iface.to_string())))
                .flatten()
        })
        .min()
        .map(|(_, iface)| iface)
}

/// The interface of the IPv6 default route (`::/0`, up, not a reject route, not `lo`) with
/// the lowest metric, from /proc/net/ipv6_route (hex fields; the device name last).
pub fn default_route_v6(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                return None;
            }
            let default = f[0].bytes().all(|b| b == b'0') && f[1] == "00";
            let metric = u32::from_str_radix(f[5], 16).ok()?;
            let flags = u32::from_str_radix(f[8], 16).ok()?;
            let up = flags & RTF_UP != 0 && flags & RTF_REJECT == 0;
            (default && up && f[9] != "lo").then(|| (metric, f[9].to_string()))
        })
        .min()
        .map(|(_, iface)| iface)
}

/// Every interface's IPv4 and IPv6 addresses, in the kernel's order.
pub fn interface_addresses() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifap` with a list we only read (each address is read as the
    // sockaddr type its family names) and free once with freeifaddrs; no safe API in the
    // dependency set lists interface addresses.
    unsafe {
        if libc::getifaddrs(&mut ifap) != 0 {
            return out;
        }
        let mut cur = ifap;
        while !cur.is_null() {
            let addr = (*cur).ifa_addr;
            let name = if (*cur).ifa_name.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr((*cur).ifa_name)
                    .to_string_lossy()
                    .into_owned()
            };
            if !addr.is_null() {
                match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(addr as *const libc::sockaddr_in);
                        let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                        out.push((name, IpAddr::V4(ip)));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(addr as *const libc::sockaddr_in6);
                        out.push((name, IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(ifap);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // A VM host: docker0 and a bridge come before the uplink in the interface list.
    const ROUTE: &str = "\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
wlan0\t00000000\t0101A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0
bond0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0
bond0\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
";
    const ROUTE6: &str = "\
00000000000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000002 00000000 00000003     eth1
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";

    fn addrs() -> Vec<(String, IpAddr)> {
        [
            ("lo", "127.0.0.1"),
            ("docker0", "172.17.0.1"),
            ("br-cocoon", "10.88.0.1"),
            ("wlan0", "192.168.1.7"),
            ("bond0", "10.0.0.5"),
            ("eth1", "fe80::1"),
            ("eth1", "fd00::5"),
        ]
        .iter()
        .map(|(n, ip)| (n.to_string(), ip.parse().unwrap()))
        .collect()
    }

    #[test]
    fn the_default_route_with_the_lowest_metric_names_the_interface() {
        assert_eq!(default_route_v4(ROUTE).as_deref(), Some("bond0"));
        let d = choose(ROUTE, ROUTE6, &addrs()).unwrap();
        assert_eq!(d.ip, "10.0.0.5".parse::<IpAddr>().unwrap(), "not docker0's");
        assert_eq!(d.how, "IPv4 default route via bond0");
    }

    #[test]
    fn ipv6_default_route_when_there_is_no_ipv4_one() {
        let only_local =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                          docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        assert_eq!(default_route_v4(only_local), None);
        assert_eq!(
            default_route_v6(ROUTE6).as_deref(),
            Some("eth1"),
            "lo's reject route skipped"
        );
        let d = choose(only_local, ROUTE6, &addrs()).unwrap();
        assert_eq!(
            d.ip,
            "fd00::5".parse::<IpAddr>().unwrap(),
            "not the link-local one"
        );
        assert_eq!(d.how, "IPv6 default route via eth1");
    }

    #[test]
    fn without_any_default_route_the_go_rule_applies() {
        let d = choose("", "", &addrs()).unwrap();
        assert_eq!(d.ip, "172.17.0.1".parse::<IpAddr>().unwrap());
        assert!(d.how.starts_with("no default route"), "{}", d.how);
        // A down or reject default route does not count; garbage lines are skipped.
        let down = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
                    bond0\t00000000\t0100000A\t0002\t0\t0\t0\t00000000\n\
                    garbage\n\
                    eth9\tzz\t0\t0003\t0\t0\t0\t00000000\n";
        assert_eq!(default_route_v4(down), None);
        assert_eq!(choose("", "", &[]), None);
    }
}
