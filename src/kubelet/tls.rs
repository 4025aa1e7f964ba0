//! The kubelet API's TLS: serving certificate from VK_TLS_CERT / VK_TLS_KEY or self-signed,
//! re-read when the files change, optional client-certificate verification against the cluster CA.
//!
//! Also a minimal DER reader for the two facts we need from certificates: the subject (CN → user,
//! O → groups) and NotAfter. Owns no sockets.

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// How often the serving-certificate files are checked for changes.
pub const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub enum TlsError {
    Io(PathBuf, io::Error),
    NoCertificate(PathBuf),
    NoKey(PathBuf),
    BadPem(PathBuf, String),
    Rustls(String),
    Generate(String),
}

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TlsError::Io(p, e) => write!(f, "kubelet TLS: {}: {e}", p.display()),
            TlsError::NoCertificate(p) => {
                write!(f, "kubelet TLS: no certificate in {}", p.display())
            }
            TlsError::NoKey(p) => write!(f, "kubelet TLS: no private key in {}", p.display()),
            TlsError::BadPem(p, e) => write!(f, "kubelet TLS: bad PEM in {}: {e}", p.display()),
            TlsError::Rustls(e) => write!(f, "kubelet TLS: {e}"),
            TlsError::Generate(e) => write!(f, "kubelet TLS: self-signed certificate: {e}"),
        }
    }
}

impl std::error::Error for TlsError {}

/// What the serving side needs to know to build its certificate.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// VK_TLS_CERT (empty = none).
    pub cert_path: PathBuf,
    /// VK_TLS_KEY (empty = none).
    pub key_path: PathBuf,
    /// CN and first DNS SAN of a self-signed certificate.
    pub node_name: String,
    /// IP SAN of a self-signed certificate (besides 127.0.0.1).
    pub node_ip: Option<IpAddr>,
    /// PEM bundle of the cluster CA; when set, client certificates are verified against it
    /// (but not required, so bearer-token callers still complete the handshake).
    pub client_ca_pem: Option<Vec<u8>>,
}

/// Where the serving certificate came from (for the start-up log line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CertSource {
    Disk(PathBuf),
    SelfSigned,
}

/// The current rustls server configuration plus what is needed to notice file changes.
pub struct TlsState {
    settings: TlsSettings,
    /// Callers without a certificate of the client CA fail the handshake (the peer listener).
    require_client_cert: bool,
    config: Arc<ServerConfig>,
    source: CertSource,
    /// NotAfter of the serving certificate in use.
    not_after: Option<SystemTime>,
    stamp: Option<FileStamp>,
    last_check: Option<Instant>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct FileStamp {
    cert: (SystemTime, u64),
    key: (SystemTime, u64),
}

fn stamp_of(cert: &Path, key: &Path) -> Option<FileStamp> {
    let c = fs::metadata(cert).ok()?;
    let k = fs::metadata(key).ok()?;
    Some(FileStamp {
        cert: (c.modified().ok()?, c.len()),
        key: (k.modified().ok()?, k.len()),
    })
}

impl TlsState {
    /// Loads or generates the serving certificate. A present but unreadable or
    /// invalid pair is an error (fatal at start-up); an expired one falls back to self-signed.
    pub fn new(settings: TlsSettings) -> Result<Self, TlsError> {
        Self::build(settings, false)
    }

    /// The same serving certificate, but every caller must present a client certificate
    /// that the client CA of `settings` (required) signed.
    pub fn requiring_client_certs(settings: TlsSettings) -> Result<Self, TlsError> {
        if settings.client_ca_pem.is_none() {
            return Err(TlsError::NoCertificate(PathBuf::from("<client CA>")));
        }
        Self::build(settings, true)
    }

    fn build(settings: TlsSettings, require_client_cert: bool) -> Result<Self, TlsError> {
        let (config, source, not_after) = build_config(&settings, require_client_cert)?;
        let stamp = stamp_of(&settings.cert_path, &settings.key_path);
        Ok(TlsState {
            settings,
            require_client_cert,
            config,
            source,
            not_after,
            stamp,
            last_check: None,
        })
    }

    pub fn config(&self) -> Arc<ServerConfig> {
        self.config.clone()
    }

    pub fn source(&self) -> &CertSource {
        &self.source
    }

    /// NotAfter of the serving certificate in use (None if it could not be read from it).
    pub fn not_after(&self) -> Option<SystemTime> {
        self.not_after
    }

    /// Re-reads the certificate files when their size or mtime changed (checked at most every
    /// RELOAD_CHECK_INTERVAL). A broken new pair is logged and the old configuration kept.
    /// Returns true when the configuration was replaced.
    pub fn maybe_reload(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last_check {
            if now.saturating_duration_since(last) < RELOAD_CHECK_INTERVAL {
                return false;
            }
        }
        self.last_check = Some(now);
        self.reload_if_changed()
    }

    /// Checks the files now, regardless of the interval.
    pub fn reload_if_changed(&mut self) -> bool {
        if self.settings.cert_path.as_os_str().is_empty() {
            return false;
        }
        let stamp = stamp_of(&self.settings.cert_path, &self.settings.key_path);
        if stamp.is_none() || stamp == self.stamp {
            return false;
        }
        match build_config(&self.settings, self.require_client_cert) {
            Ok((config, source, not_after)) => {
                log::info!("kubelet TLS reloaded ({source:?})");
                self.config = config;
                self.source = source;
                self.not_after = not_after;
                self.stamp = stamp;
                true
            }
            Err(e) => {
                log::warn!("kubelet TLS reload failed, keeping the previous certificate: {e}");
                self.stamp = stamp;
                false
            }
        }
    }
}

/// The server configuration, where its certificate came from, and the certificate's NotAfter.
type Built = (Arc<ServerConfig>, CertSource, Option<SystemTime>);

fn build_config(s: &TlsSettings, require_client_cert: bool) -> Result<Built, TlsError> {
    let (chain, key, source) = match load_from_disk(s)? {
        Some((chain, key)) => (chain, key, CertSource::Disk(s.cert_path.clone())),
        None => {
            let (c, k) = self_signed(&s.node_name, s.node_ip)?;
            (vec![c], k, CertSource::SelfSigned)
        }
    };
    let not_after = chain.first().and_then(|c| cert_not_after(c));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        ServerConfig::builder_with_details(provider.clone(), Arc::new(crate::wall_clock::TlsClock))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
    let builder = match &s.client_ca_pem {
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(pem) {
                let c =
                    c.map_err(|e| TlsError::BadPem(PathBuf::from("<cluster CA>"), e.to_string()))?;
                roots.add(c).map_err(|e| TlsError::Rustls(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(TlsError::NoCertificate(PathBuf::from("<cluster CA>")));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if require_client_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier
                .build()
                .map_err(|e| TlsError::Rustls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    // HTTP/1.1 only: exec and attach need the Upgrade mechanism.
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((Arc::new(cfg), source, not_after))
}

type Pair = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn load_from_disk(s: &TlsSettings) -> Result<Option<Pair>, TlsError> {
    if s.cert_path.as_os_str().is_empty() || s.key_path.as_os_str().is_empty() {
        return Ok(None);
    }
    let cert_pem = match fs::read(&s.cert_path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TlsError::Io(s.cert_path.clone(), e)),
    };
    let key_pem = fs::read(&s.key_path).map_err(|e| TlsError::Io(s.key_path.clone(), e))?;
    let mut chain = Vec::new();
    for c in CertificateDer::pem_slice_iter(&cert_pem) {
        chain.push(c.map_err(|e| TlsError::BadPem(s.cert_path.clone(), e.to_string()))?);
    }
    let Some(leaf) = chain.first() else {
        return Err(TlsError::NoCertificate(s.cert_path.clone()));
    };
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey(s.key_path.clone()),
        e => TlsError::BadPem(s.key_path.clone(), e.to_string()),
    })?;
    if let Some(not_after) = cert_not_after(leaf) {
        if not_after < crate::wall_clock::now() {
            log::warn!(
                "kubelet TLS certificate {} has expired; using a self-signed certificate",
                s.cert_path.display()
            );
            return Ok(None);
        }
    }
    Ok(Some((chain, key)))
}

/// ECDSA P-256, serial 1, CN = node name, valid today .. +10 years, digitalSignature +
/// keyEncipherment, serverAuth, SANs node name, localhost, node IP, 127.0.0.1.
pub fn self_signed(
    node_name: &str,
    node_ip: Option<IpAddr>,
) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), TlsError> {
    use rcgen::{
        CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
        KeyUsagePurpose, SanType, SerialNumber,
    };
    let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
    let key = KeyPair::generate().map_err(g)?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, node_name);
    p.distinguished_name = dn;
    p.serial_number = Some(SerialNumber::from_slice(&[1]));
    let (y, m, d) = ymd(crate::wall_clock::now());
    p.not_before = rcgen::date_time_ymd(y, m, d);
    p.not_after = rcgen::date_time_ymd(y + 10, m, d.min(28));
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let mut sans = Vec::new();
    for name in [node_name, "localhost"] {
        if let Ok(n) = name.to_string().try_into() {
            sans.push(SanType::DnsName(n));
        }
    }
    if let Some(ip) = node_ip {
        sans.push(SanType::IpAddress(ip));
    }
    sans.push(SanType::IpAddress(IpAddr::from([127, 0, 0, 1])));
    p.subject_alt_names = sans;
    let cert = p.self_signed(&key).map_err(g)?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    Ok((cert.der().clone(), key_der))
}

fn ymd(t: SystemTime) -> (i32, u8, u8) {
    let days = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u8;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    let y = (yoe + era * 400 + i64::from(m <= 2)) as i32;
    (y, m, d)
}

/// The identity a verified client certificate carries: CN → user, O → groups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertIdentity {
    pub common_name: Option<String>,
    pub organizations: Vec<String>,
}

/// One DER TLV: (tag, contents, rest).
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The TBSCertificate fields up to and including the subject: (validity, subject).
fn tbs_validity_subject(cert: &[u8]) -> Option<(&[u8], &[u8])> {
    let (_, certificate, _) = der(cert)?;
    let (_, tbs, _) = der(certificate)?;
    let (mut tag, mut body, mut rest) = der(tbs)?;
    if tag == 0xa0 {
        (tag, body, rest) = der(rest)?; // serial
    }
    let _ = (tag, body);
    let (_, _, rest) = der(rest)?; // signature algorithm
    let (_, _, rest) = der(rest)?; // issuer
    let (_, validity, rest) = der(rest)?;
    let (_, subject, _) = der(rest)?;
    Some((validity, subject))
}

/// CN and O of a certificate's subject. None when the DER cannot be walked.
pub fn cert_identity(cert: &[u8]) -> Option<CertIdentity> {
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    const O: &[u8] = &[0x55, 0x04, 0x0a];
    let (_, mut subject) = tbs_validity_subject(cert)?;
    let mut id = CertIdentity::default();
    while !subject.is_empty() {
        let (_, set, rest) = der(subject)?;
        subject = rest;
        let mut set = set;
        while !set.is_empty() {
            let (_, atv, rest) = der(set)?;
            set = rest;
            let (_, oid, after) = der(atv)?;
            let (_, value, _) = der(after)?;
            let value = String::from_utf8_lossy(value).into_owned();
            if oid == CN {
                id.common_name = Some(value);
            } else if oid == O {
                id.organizations.push(value);
            }
        }
    }
    Some(id)
}

/// NotAfter of a certificate.
pub fn cert_not_after(cert: &[u8]) -> Option<SystemTime> {
    cert_validity(cert).map(|(_, not_after)| not_after)
}

/// NotBefore and NotAfter of a certificate. None when the DER cannot be walked.
pub fn cert_validity(cert: &[u8]) -> Option<(SystemTime, SystemTime)> {
    let (validity, _) = tbs_validity_subject(cert)?;
    let (before_tag, before, rest) = der(validity)?;
    let (after_tag, after, _) = der(rest)?;
    Some((der_time(before_tag, before)?, der_time(after_tag, after)?))
}

/// A UTCTime (0x17) or GeneralizedTime (0x18) as a SystemTime (before 1970 reads as 1970).
fn der_time(tag: u8, t: &[u8]) -> Option<SystemTime> {
    let s = std::str::from_utf8(t).ok()?;
    let digits = |a: usize, b: usize| -> Option<i64> { s.get(a..b)?.parse().ok() };
    let (year, off) = match tag {
        0x17 => {
            let yy = digits(0, 2)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, 2)
        }
        0x18 => (digits(0, 4)?, 4),
        _ => return None,
    };
    let (mo, d, h, mi, se) = (
        digits(off, off + 2)?,
        digits(off + 2, off + 4)?,
        digits(off + 4, off + 6)?,
        digits(off + 6, off + 8)?,
        digits(off + 8, off + 10)?,
    );
    // days from civil
    let y = if mo <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + se;
    if secs < 0 {
        return Some(UNIX_EPOCH);
    }
    Some(UNIX_EPOCH + Duration::from_secs(secs as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_has_node_identity_and_ten_years() {
        let (cert, _) = self_signed("node-a", Some("10.1.2.3".parse().unwrap())).unwrap();
        let id = cert_identity(&cert).unwrap();
        assert_eq!(id.common_name.as_deref(), Some("node-a"));
        let na = cert_not_after(&cert).unwrap();
        let years = na.duration_since(SystemTime::now()).unwrap().as_secs() / (365 * 86_400);
        assert!((9..=10).contains(&years), "{years}");
    }

    #[test]
    fn der_walker_refuses_garbage() {
        assert_eq!(cert_identity(b""), None);
        assert_eq!(cert_identity(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(cert_not_after(&[0x30, 0x03, 0x30, 0x01, 0x00]), None);
    }

    #[test]
    fn identity_with_organizations() {
        use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "kube-apiserver-kubelet-client");
        dn.push(DnType::OrganizationName, "system:masters");
        p.distinguished_name = dn;
        let c = p.self_signed(&key).unwrap();
        let id = cert_identity(c.der()).unwrap();
        assert_eq!(
            id.common_name.as_deref(),
            Some("kube-apiserver-kubelet-client")
        );
        assert_eq!(id.organizations, vec!["system:masters".to_string()]);
    }

    #[test]
    fn disk_pair_reload_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let (c1, k1) = self_signed("first", None).unwrap();
        let cert_path = dir.path().join("c.pem");
        let key_path = dir.path().join("k.pem");
        let write = |c: &CertificateDer, k: &PrivateKeyDer| {
            let cp = format!(
                "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
                b64(c)
            );
            let kp = format!(
                "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
                b64(k.secret_der())
            );
            fs::write(&cert_path, cp).unwrap();
            fs::write(&key_path, kp).unwrap();
        };
        write(&c1, &k1);
        let settings = TlsSettings {
            cert_path: cert_path.clone(),
            key_path: key_path.clone(),
            node_name: "n".into(),
            node_ip: None,
            client_ca_pem: None,
        };
        let mut st = TlsState::new(settings.clone()).unwrap();
        assert_eq!(st.source(), &CertSource::Disk(cert_path.clone()));
        assert!(!st.reload_if_changed(), "unchanged files are not reloaded");
        let (c2, k2) = self_signed("second-with-longer-name", None).unwrap();
        write(&c2, &k2);
        assert!(st.reload_if_changed());
        // A missing cert file means self-signed; a broken key is an error.
        let missing = TlsSettings {
            cert_path: dir.path().join("none"),
            ..settings.clone()
        };
        assert_eq!(
            TlsState::new(missing).unwrap().source(),
            &CertSource::SelfSigned
        );
        fs::write(&key_path, "not pem").unwrap();
        assert!(TlsState::new(settings).is_err());
    }

    #[test]
    fn requiring_client_certificates_needs_a_client_ca() {
        let settings = TlsSettings {
            cert_path: PathBuf::new(),
            key_path: PathBuf::new(),
            node_name: "n".into(),
            node_ip: None,
            client_ca_pem: None,
        };
        assert!(TlsState::requiring_client_certs(settings.clone()).is_err());
        let (ca, _) = self_signed("ca", None).unwrap();
        let pem = format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            b64(&ca)
        );
        let with_ca = TlsSettings {
            client_ca_pem: Some(pem.into_bytes()),
            ..settings
        };
        assert!(TlsState::requiring_client_certs(with_ca).is_ok());
    }

    fn b64(b: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(b)
    }
}
