//! The rules for sources a pod names that the host itself reaches: the host of an http(s)
//! image URL and a clone-from-dir. Pure functions; the core applies them, the daemon applies
//! them to DNS answers and walks the directory.
//!
//! Why private ranges are refused too: the daemon and cocoon run in the host's network, next to
//! the node's and the cluster's own services (the API server, cocoon-net, internal registries,
//! other nodes' peer listeners). A tenant must not make the host fetch from them; an operator
//! who serves cloud images from an internal mirror names it in `VK_IMAGE_URL_ALLOW_HOSTS`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The setting that lets a host through the image URL rule.
pub const IMAGE_URL_ALLOW_SETTING: &str = "VK_IMAGE_URL_ALLOW_HOSTS";
/// The setting under which clone-from-dir directories must lie.
pub const CLONE_DIR_ROOT_SETTING: &str = "VK_CLONE_FROM_DIR_ROOT";

/// Names of cloud metadata services (GCE, EC2): never fetched from.
const METADATA_NAMES: [&str; 5] = [
    "metadata.google.internal",
    "metadata.goog",
    "metadata",
    "instance-data",
    "instance-data.ec2.internal",
];

/// What the URL rule says about an http(s) image before anything fetches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageUrl {
    /// Fetch it: an allowed host name or a public address literal.
    Allowed,
    /// A host name: every address it resolves to must pass [`check_resolved`].
    Resolve { host: String },
    /// Refused; the message names the rule and the setting that changes it.
    Refused(String),
}

/// Why an address may not be fetched from, or None when it may.
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, d] = ip.octets();
    Some(match (a, b) {
        _ if [a, b, c, d] == [169, 254, 169, 254] => "the cloud metadata address",
        (0, _) => "an unspecified address",
        (127, _) => "a loopback address",
        (169, 254) => "a link-local address",
        (10, _) | (192, 168) => "a private address",
        (172, 16..=31) => "a private address",
        (100, 64..=127) => "a private address (shared address space)",
        (224..=255, _) => "a multicast, reserved or broadcast address",
        _ => return None,
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    let s = ip.segments();
    // NAT64 (64:ff9b::/96) reaches the IPv4 address in its low 32 bits.
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let [_, _, _, _, _, _, hi, lo] = s;
        return forbidden_v4(Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo)));
    }
    Some(match s[0] {
        _ if ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) => {
            "the cloud metadata address"
        }
        _ if ip.is_unspecified() => "an unspecified address",
        _ if ip.is_loopback() => "a loopback address",
        x if x & 0xffc0 == 0xfe80 => "a link-local address",
        x if x & 0xffc0 == 0xfec0 => "a private address (site-local)",
        x if x & 0xfe00 == 0xfc00 => "a private address (unique local)",
        x if x & 0xff00 == 0xff00 => "a multicast address",
        _ => return None,
    })
}

/// The host of an `http://` or `https://` URL, lower-case, without port, brackets or a
/// trailing dot; Err when the authority is not one a reader can trust to name one host (empty,
/// percent-encoded, with spaces or backslashes, or with a port that is not a number).
pub fn url_host(url: &str) -> Result<String, UrlHostError> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or(UrlHostError::NotHttp)?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    // Some parsers read `\` as `/`: a host that depends on the parser is no host to trust.
    if authority
        .bytes()
        .any(|b| b == b'\\' || !b.is_ascii_graphic())
    {
        return Err(UrlHostError::BadCharacters);
    }
    // Userinfo ends at the last `@`, as Go's URL parser (cocoon's) reads it.
    let host_port = authority.rsplit('@').next().unwrap_or("");
    if !host_port
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'[' | b']'))
    {
        return Err(UrlHostError::BadCharacters);
    }
    let (host, port) = match host_port.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or(UrlHostError::UnclosedBracket)?;
            (host, after.strip_prefix(':'))
        }
        None => match host_port.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        },
    };
    if port.is_some_and(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
        return Err(UrlHostError::BadPort);
    }
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if host.is_empty() {
        return Err(UrlHostError::NoHost);
    }
    Ok(host)
}

/// Why a URL names no host to trust; Display completes `image URL "<url>" …`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UrlHostError {
    NotHttp,
    /// Backslashes, spaces, percent-encoding or other characters no host name has.
    BadCharacters,
    UnclosedBracket,
    BadPort,
    NoHost,
}

impl std::fmt::Display for UrlHostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UrlHostError::NotHttp => "is not an http(s) URL",
            UrlHostError::BadCharacters => "has a host with characters no host name has",
            UrlHostError::UnclosedBracket => "has an unclosed [",
            UrlHostError::BadPort => "has a port that is not a number",
            UrlHostError::NoHost => "has no host",
        })
    }
}

impl std::error::Error for UrlHostError {}

/// The image URL rule on the URL alone: allow-listed hosts pass, address literals are judged
/// here, metadata and loopback names are refused, other names must be resolved (off the loop).
pub fn check_image_url(url: &str, allow_hosts: &[String]) -> ImageUrl {
    let host = match url_host(url) {
        Ok(h) => h,
        Err(e) => return ImageUrl::Refused(format!("image URL {url:?} {e}")),
    };
    if allow_hosts.contains(&host) {
        return ImageUrl::Allowed;
    }
    let refused = |what: &str| {
        ImageUrl::Refused(format!(
            "image URL {url:?} refused: its host {host} is {what}; name the host in \
             {IMAGE_URL_ALLOW_SETTING} to allow it"
        ))
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return match forbidden_address(ip) {
            Some(what) => refused(what),
            None => ImageUrl::Allowed,
        };
    }
    if METADATA_NAMES.contains(&host.as_str()) {
        return refused("a cloud metadata service");
    }
    if host == "localhost" || host.ends_with(".localhost") {
        return refused("a loopback name");
    }
    ImageUrl::Resolve { host }
}

/// The rule on the addresses a host name resolved to: every one must be allowed (a name with
/// one public and one internal address would reach the internal one as often as not).
pub fn check_resolved(url: &str, host: &str, addrs: &[IpAddr]) -> Result<(), ResolvedError> {
    if addrs.is_empty() {
        return Err(ResolvedError::NoAddress {
            url: url.to_string(),
            host: host.to_string(),
        });
    }
    match addrs
        .iter()
        .find_map(|ip| forbidden_address(*ip).map(|w| (*ip, w)))
    {
        None => Ok(()),
        Some((ip, what)) => Err(ResolvedError::Forbidden {
            url: url.to_string(),
            host: host.to_string(),
            ip,
            what,
        }),
    }
}

/// Why an image URL's resolved host is not fetched from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedError {
    /// The name resolved to nothing (may change: not a refusal).
    NoAddress { url: String, host: String },
    /// One of its addresses is in a forbidden class (`what`, from `forbidden_address`).
    Forbidden {
        url: String,
        host: String,
        ip: IpAddr,
        what: &'static str,
    },
}

impl std::fmt::Display for ResolvedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResolvedError::NoAddress { url, host } => {
                write!(
                    f,
                    "image URL {url:?}: its host {host} resolves to no address"
                )
            }
            ResolvedError::Forbidden {
                url,
                host,
                ip,
                what,
            } => write!(
                f,
                "image URL {url:?} refused: its host {host} resolves to {ip}, {what}; name the \
                 host in {IMAGE_URL_ALLOW_SETTING} to allow it"
            ),
        }
    }
}

impl std::error::Error for ResolvedError {}

/// The clone-from-dir rule on the path alone: `dir` (absolute and canonical, as the annotation
/// contract checks) lies strictly below `root`, compared component by component (`/srv/snaps-x`
/// is not below `/srv/snaps`). The host then walks it: no symlink below the root.
pub fn check_clone_dir(dir: &str, root: Option<&str>) -> Result<(), String> {
    let Some(root) = root else {
        return Err(format!(
            "clone-from-dir {dir} refused: this node takes clone-from-dir only below              {CLONE_DIR_ROOT_SETTING}, which is not set"
        ));
    };
    let below = std::path::Path::new(dir)
        .strip_prefix(root)
        .is_ok_and(|rest| rest.components().next().is_some());
    if below {
        Ok(())
    } else {
        Err(format!(
            "clone-from-dir {dir} refused: not below {CLONE_DIR_ROOT_SETTING} ({root})"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(url: &str) -> String {
        match check_image_url(url, &[]) {
            ImageUrl::Refused(m) => m,
            other => panic!("{url}: {other:?}"),
        }
    }

    #[test]
    fn forbidden_address_classes() {
        for (ip, want) in [
            ("169.254.169.254", "the cloud metadata address"),
            ("fd00:ec2::254", "the cloud metadata address"),
            ("127.0.0.1", "a loopback address"),
            ("127.9.9.9", "a loopback address"),
            ("::1", "a loopback address"),
            ("0.0.0.0", "an unspecified address"),
            ("::", "an unspecified address"),
            ("169.254.1.1", "a link-local address"),
            ("fe80::1", "a link-local address"),
            ("10.1.2.3", "a private address"),
            ("172.31.0.1", "a private address"),
            ("192.168.0.1", "a private address"),
            (
                "100.100.100.200",
                "a private address (shared address space)",
            ),
            ("fd12::1", "a private address (unique local)"),
            ("::ffff:169.254.169.254", "the cloud metadata address"),
            ("64:ff9b::7f00:1", "a loopback address"),
            (
                "255.255.255.255",
                "a multicast, reserved or broadcast address",
            ),
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(forbidden_address(ip), Some(want), "{ip}");
        }
        for ok in ["8.8.8.8", "172.32.0.1", "2001:4860::8888", "100.128.0.1"] {
            assert_eq!(forbidden_address(ok.parse().unwrap()), None, "{ok}");
        }
    }

    #[test]
    fn hosts_are_read_as_a_url_parser_reads_them() {
        assert_eq!(
            url_host("https://Images.Example.COM./a.qcow2").unwrap(),
            "images.example.com"
        );
        assert_eq!(url_host("http://u:p@10.0.0.1:8080/x").unwrap(), "10.0.0.1");
        assert_eq!(
            url_host("http://ok.example@169.254.169.254/").unwrap(),
            "169.254.169.254"
        );
        assert_eq!(url_host("http://[fe80::1]:80/x").unwrap(), "fe80::1");
        assert_eq!(url_host("https://a.example?x=@b").unwrap(), "a.example");
        for bad in [
            "http:///x",
            "http://%31%32%37.0.0.1/",
            "http://a.example\\@b/",
            "http://a.example:8o/",
            "http://[::1/",
            "ftp://a.example/",
        ] {
            assert!(url_host(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn literal_hosts_are_judged_names_are_resolved_and_the_allow_list_wins() {
        let m = refused("http://169.254.169.254/latest/meta-data/");
        assert!(
            m.contains("the cloud metadata address") && m.contains(IMAGE_URL_ALLOW_SETTING),
            "{m}"
        );
        assert!(refused("http://[::1]:8080/x").contains("loopback"));
        assert!(refused("https://metadata.google.internal/x").contains("metadata service"));
        assert!(refused("http://LOCALHOST/x").contains("loopback name"));
        assert!(refused("http://10.0.0.5/img.qcow2").contains("private"));
        assert_eq!(check_image_url("https://8.8.8.8/x", &[]), ImageUrl::Allowed);
        assert_eq!(
            check_image_url("https://images.example.com/x.qcow2", &[]),
            ImageUrl::Resolve {
                host: "images.example.com".into()
            }
        );
        let allow = vec!["10.0.0.5".to_string(), "mirror.internal".to_string()];
        assert_eq!(
            check_image_url("http://10.0.0.5/img", &allow),
            ImageUrl::Allowed
        );
        assert_eq!(
            check_image_url("http://Mirror.Internal./img", &allow),
            ImageUrl::Allowed
        );
    }

    #[test]
    fn clone_dirs_lie_strictly_below_the_root_by_components() {
        let root = Some("/srv/snaps");
        assert_eq!(check_clone_dir("/srv/snaps/vm-a", root), Ok(()));
        assert_eq!(check_clone_dir("/srv/snaps/team/vm-a", root), Ok(()));
        for bad in [
            "/srv/snaps-evil/vm-a",
            "/srv/snaps",
            "/srv",
            "/var/lib/cocoon/run/x",
        ] {
            let e = check_clone_dir(bad, root).unwrap_err();
            assert!(
                e.contains("not below VK_CLONE_FROM_DIR_ROOT (/srv/snaps)"),
                "{bad}: {e}"
            );
        }
        let e = check_clone_dir("/srv/snaps/vm-a", None).unwrap_err();
        assert!(
            e.contains("VK_CLONE_FROM_DIR_ROOT, which is not set"),
            "{e}"
        );
    }

    #[test]
    fn every_resolved_address_must_pass() {
        let url = "https://img.example/x";
        let public: IpAddr = "93.184.216.34".parse().unwrap();
        let internal: IpAddr = "10.0.0.9".parse().unwrap();
        assert_eq!(check_resolved(url, "img.example", &[public]), Ok(()));
        let e = check_resolved(url, "img.example", &[public, internal])
            .unwrap_err()
            .to_string();
        assert!(e.contains("resolves to 10.0.0.9, a private address"), "{e}");
        assert!(check_resolved(url, "img.example", &[]).is_err());
    }
}
