//! Certificate checks of `check-config`: the kubelet serving certificate's names and dates and
//! the kubeconfig client certificate's dates. Pure over PEM bytes and the time given.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rustls::pki_types::{CertificateDer, ServerName};

use super::Finding;
use crate::kubelet::tls::cert_validity;
use rustls::pki_types::pem::PemObject;

/// Under this much validity left, a certificate is warned about.
pub const RENEW_WITHIN: Duration = Duration::from_secs(30 * 86_400);

/// Why a PEM bundle has no leaf certificate.
#[derive(Debug)]
enum LeafError {
    NotPem(rustls::pki_types::pem::Error),
    Empty,
}

impl std::fmt::Display for LeafError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeafError::NotPem(e) => write!(f, "not a PEM certificate: {e}"),
            LeafError::Empty => f.write_str("no certificate in it"),
        }
    }
}

/// The first certificate of a PEM bundle (the leaf), or why there is none.
fn leaf(pem: &[u8]) -> Result<CertificateDer<'static>, LeafError> {
    match CertificateDer::pem_slice_iter(pem).next() {
        Some(Ok(c)) => Ok(c),
        Some(Err(e)) => Err(LeafError::NotPem(e)),
        None => Err(LeafError::Empty),
    }
}

fn days(d: Duration) -> u64 {
    d.as_secs() / 86_400
}

fn date(t: SystemTime) -> String {
    crate::rfc3339::seconds(t)
}

/// Expired, not yet valid (both fail), expiring within [`RENEW_WITHIN`] (warn), or fine.
pub fn dates(what: &str, der: &[u8], now: SystemTime) -> Finding {
    let Some((not_before, not_after)) = cert_validity(der) else {
        return Finding::fail(format!("{what}: its validity dates cannot be read"));
    };
    if now < not_before {
        return Finding::fail(format!(
            "{what} is not valid yet: from {} (is this host's clock right?)",
            date(not_before)
        ));
    }
    match not_after.duration_since(now) {
        Err(_) => Finding::fail(format!("{what} expired on {}", date(not_after))),
        Ok(left) if left < RENEW_WITHIN => Finding::warn(format!(
            "{what} expires on {} ({} days left): renew it",
            date(not_after),
            days(left)
        )),
        Ok(left) => Finding::pass(format!(
            "{what} valid until {} ({} days)",
            date(not_after),
            days(left)
        )),
    }
}

/// The kubelet serving certificate: dates, then whether its SANs name the node IP (the API
/// server dials the InternalIP, so a miss breaks logs and exec: fail) and the node name (a
/// miss breaks API servers that prefer Hostname addresses: warn).
pub fn serving(
    path: &str,
    pem: &[u8],
    node_name: &str,
    node_ip: Option<IpAddr>,
    now: SystemTime,
) -> Vec<Finding> {
    let what = format!("kubelet serving certificate {path}");
    let cert = match leaf(pem) {
        Ok(c) => c,
        Err(e) => return vec![Finding::fail(format!("{what}: {e}"))],
    };
    let mut out = vec![dates(&what, &cert, now)];
    let ee = match webpki::EndEntityCert::try_from(&cert) {
        Ok(ee) => ee,
        Err(e) => {
            out.push(Finding::fail(format!(
                "{what}: not a usable X.509 certificate: {e:?}"
            )));
            return out;
        }
    };
    match node_ip {
        Some(ip) => {
            let name = ServerName::IpAddress(ip.into());
            match ee.verify_is_valid_for_subject_name(&name) {
                Ok(()) => out.push(Finding::pass(format!("{what} names the node IP {ip}"))),
                Err(_) => out.push(Finding::fail(format!(
                    "{what} does not name the node IP {ip} in its SANs: the API server's \
                     kubectl logs / exec / top to this node fail TLS verification; reissue it \
                     with IP:{ip}"
                ))),
            }
        }
        None => out.push(Finding::warn(format!(
            "{what}: no node IP to check its SANs against"
        ))),
    }
    match ServerName::try_from(node_name.to_string()) {
        Ok(name) => match ee.verify_is_valid_for_subject_name(&name) {
            Ok(()) => out.push(Finding::pass(format!("{what} names the node {node_name}"))),
            Err(_) => out.push(Finding::warn(format!(
                "{what} does not name the node {node_name} in its SANs: API servers that dial \
                 kubelets by host name reject it; reissue it with DNS:{node_name}"
            ))),
        },
        Err(_) => out.push(Finding::warn(format!(
            "{what}: the node name {node_name} is not a DNS name to check"
        ))),
    }
    out
}

/// The kubeconfig's client certificate: its dates (the API server refuses it once expired).
pub fn client(source: &str, pem: &[u8], now: SystemTime) -> Finding {
    let what = format!("kubeconfig client certificate ({source})");
    match leaf(pem) {
        Ok(cert) => dates(&what, &cert, now),
        Err(e) => Finding::fail(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Level;
    use super::*;

    fn cert(sans: &[&str], from_days: i64, to_days: i64) -> Vec<u8> {
        let now = rcgen::date_time_ymd(2026, 6, 1);
        let mut p =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        p.not_before = shifted(now, from_days);
        p.not_after = shifted(now, to_days);
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().pem().into_bytes()
    }

    fn shifted<T>(t: T, days: i64) -> T
    where
        T: std::ops::Add<Duration, Output = T> + std::ops::Sub<Duration, Output = T>,
    {
        let d = Duration::from_secs(days.unsigned_abs() * 86_400);
        if days < 0 {
            t - d
        } else {
            t + d
        }
    }

    fn june_first() -> SystemTime {
        // 2026-06-01T00:00:00Z
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_780_272_000)
    }

    fn levels(f: &[Finding]) -> Vec<Level> {
        f.iter().map(|f| f.level).collect()
    }

    #[test]
    fn a_good_serving_certificate_passes_every_check() {
        let pem = cert(&["node-1", "10.0.0.5"], -1, 365);
        let f = serving(
            "c.crt",
            &pem,
            "node-1",
            Some("10.0.0.5".parse().unwrap()),
            june_first(),
        );
        assert_eq!(levels(&f), [Level::Pass; 3], "{f:?}");
        assert!(f[0].text.contains("365 days"), "{}", f[0].text);
    }

    #[test]
    fn wrong_sans_fail_for_the_ip_and_warn_for_the_name() {
        let pem = cert(&["other", "10.9.9.9"], -1, 365);
        let f = serving(
            "c.crt",
            &pem,
            "node-1",
            Some("10.0.0.5".parse().unwrap()),
            june_first(),
        );
        assert_eq!(levels(&f), [Level::Pass, Level::Fail, Level::Warn], "{f:?}");
        assert!(f[1].text.contains("IP:10.0.0.5"), "{}", f[1].text);
        assert!(f[2].text.contains("DNS:node-1"), "{}", f[2].text);
    }

    #[test]
    fn expiry_soon_warns_expired_and_not_yet_valid_fail() {
        let now = june_first();
        let soon = cert(&["n"], -300, 10);
        assert_eq!(client("kc", &soon, now).level, Level::Warn);
        assert!(client("kc", &soon, now).text.contains("10 days left"));
        let expired = cert(&["n"], -300, -1);
        let f = client("kc", &expired, now);
        assert_eq!(f.level, Level::Fail);
        assert!(f.text.contains("expired on 2026-05-31"), "{}", f.text);
        let future = cert(&["n"], 2, 300);
        let f = client("kc", &future, now);
        assert_eq!(f.level, Level::Fail);
        assert!(f.text.contains("not valid yet"), "{}", f.text);
        assert_eq!(client("kc", b"garbage", now).level, Level::Fail);
    }
}
