//! Listen addresses in Go's `host:port` notation (`:9091` is every interface).
//! Parsing, display and the socket addresses to bind.

use std::fmt;
use std::net::IpAddr;

use super::is_dns_name;

/// A `host:port` listen address in Go's notation: `:9091` means every interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenAddr {
    /// Empty for "every interface"; an IP literal (brackets removed) or a host name.
    pub host: String,
    pub port: u16,
}

impl ListenAddr {
    /// Parses `host:port`, `[v6]:port` or `:port`.
    pub fn parse(text: &str) -> Option<ListenAddr> {
        let (host, port) = text.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let host = if let Some(inner) = host.strip_prefix('[') {
            let inner = inner.strip_suffix(']')?;
            inner.parse::<std::net::Ipv6Addr>().ok()?;
            inner
        } else {
            if host.contains(':') || host.contains(']') {
                return None;
            }
            host
        };
        if !host.is_empty() && host.parse::<IpAddr>().is_err() && !is_dns_name(host) {
            return None;
        }
        Some(ListenAddr {
            host: host.to_string(),
            port,
        })
    }

    /// The socket addresses to bind: every interface (0.0.0.0) for an empty host,
    /// otherwise the IP literal or what the host name resolves to.
    pub fn socket_addrs(&self) -> std::io::Result<Vec<std::net::SocketAddr>> {
        use std::net::ToSocketAddrs;
        if self.host.is_empty() {
            return Ok(vec![std::net::SocketAddr::from(([0, 0, 0, 0], self.port))]);
        }
        if let Ok(ip) = self.host.parse::<IpAddr>() {
            return Ok(vec![std::net::SocketAddr::new(ip, self.port)]);
        }
        Ok((self.host.as_str(), self.port).to_socket_addrs()?.collect())
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addr_forms() {
        assert_eq!(
            ListenAddr::parse(":80"),
            Some(ListenAddr {
                host: "".into(),
                port: 80
            })
        );
        assert_eq!(
            ListenAddr::parse("localhost:80").map(|a| a.host),
            Some("localhost".into())
        );
        assert_eq!(
            ListenAddr::parse("[::]:80").map(|a| a.host),
            Some("::".into())
        );
        for bad in [
            "", "80", "[::1:80", "[zz]:80", "a:b:80", "host:", "host:-1", ":65536",
        ] {
            assert_eq!(ListenAddr::parse(bad), None, "{bad}");
        }
    }
}
