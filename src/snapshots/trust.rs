//! Which certificate authorities the registry client trusts: `OCI_REGISTRY_CA_FILE` on top of
//! the host's trust store, and how a certificate failure is told apart from other TLS errors.
//!
//! The host's store is found as Go's crypto/x509 finds it on Linux, which the Go daemon relied
//! on: `SSL_CERT_FILE`, else the first distribution bundle that exists; plus every file in the
//! `SSL_CERT_DIR` directories (colon-separated), or the distribution's certificate directories
//! when no bundle file was found. The built-in Mozilla roots serve only when none of these
//! yields a certificate (a minimal container without a CA package).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

/// The bundles Go looks for, in its order (Debian/Ubuntu first).
const BUNDLE_FILES: [&str; 6] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
];
/// Directories of one-certificate files, read only when no bundle file exists.
const CERT_DIRS: [&str; 2] = ["/etc/ssl/certs", "/etc/pki/tls/certs"];

/// The registry client's TLS configuration and where its roots came from (for the log).
#[derive(Clone)]
pub struct RegistryTrust {
    pub tls: Arc<ClientConfig>,
    /// E.g. `/etc/ssl/certs/ca-certificates.crt (146 certificates) + OCI_REGISTRY_CA_FILE ...`.
    pub source: String,
}

impl RegistryTrust {
    /// The host's trust store plus, when given, every certificate of the PEM bundle `ca_file`.
    /// A `ca_file` that cannot be read or holds no usable certificate is an error (the daemon
    /// exits 2); an unreadable host store only falls back to the built-in roots.
    pub fn load(ca_file: Option<&Path>) -> Result<RegistryTrust, CaFileError> {
        let (mut roots, mut source) = host_roots_from_env();
        if let Some(path) = ca_file {
            let added = add_ca_file(&mut roots, path)?;
            source.push_str(&format!(
                " + OCI_REGISTRY_CA_FILE {} ({added} certificates)",
                path.display()
            ));
        }
        Ok(RegistryTrust {
            tls: tls_config(roots),
            source,
        })
    }

    /// The host's trust store alone (no `OCI_REGISTRY_CA_FILE`).
    pub fn host() -> RegistryTrust {
        let (roots, source) = host_roots_from_env();
        RegistryTrust {
            tls: tls_config(roots),
            source,
        }
    }
}

/// [`host_roots`] with `SSL_CERT_FILE` and `SSL_CERT_DIR` of the process environment.
fn host_roots_from_env() -> (RootCertStore, String) {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    host_roots(
        env("SSL_CERT_FILE").map(PathBuf::from),
        env("SSL_CERT_DIR").map(|d| d.to_string_lossy().into_owned()),
    )
}

/// Why a CA bundle file (`OCI_REGISTRY_CA_FILE`) added no trust; each names the file.
#[derive(Debug)]
pub enum CaFileError {
    Unreadable(PathBuf, std::io::Error),
    Pem(PathBuf, crate::kube::tls::PemError),
    /// A certificate the root store refused.
    Unusable(PathBuf, String),
}

impl std::fmt::Display for CaFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CaFileError::Unreadable(path, e) => write!(f, "cannot read {}: {e}", path.display()),
            CaFileError::Pem(path, e) => write!(f, "{}: {e}", path.display()),
            CaFileError::Unusable(path, e) => {
                write!(f, "{}: unusable certificate: {e}", path.display())
            }
        }
    }
}

impl std::error::Error for CaFileError {}

/// Reads every certificate of a PEM CA bundle into `roots`; how many were added.
pub fn add_ca_file(roots: &mut RootCertStore, path: &Path) -> Result<usize, CaFileError> {
    let pem = std::fs::read(path).map_err(|e| CaFileError::Unreadable(path.into(), e))?;
    let certs =
        crate::kube::tls::parse_certs(&pem).map_err(|e| CaFileError::Pem(path.into(), e))?;
    let mut added = 0;
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| CaFileError::Unusable(path.into(), e.to_string()))?;
        added += 1;
    }
    Ok(added)
}

/// The host's roots from `ssl_cert_file` / `ssl_cert_dir` (the environment's values) or the
/// distribution's places, else the built-in roots; with a description of the source.
pub fn host_roots(
    ssl_cert_file: Option<PathBuf>,
    ssl_cert_dir: Option<String>,
) -> (RootCertStore, String) {
    let mut roots = RootCertStore::empty();
    let mut sources = Vec::new();
    let files: Vec<PathBuf> = match ssl_cert_file {
        Some(f) => vec![f],
        None => BUNDLE_FILES.iter().map(PathBuf::from).collect(),
    };
    let mut bundle_found = false;
    for file in files {
        let Ok(pem) = std::fs::read(&file) else {
            continue;
        };
        bundle_found = true;
        let n = add_parsable(&mut roots, &pem);
        sources.push(format!("{} ({n} certificates)", file.display()));
        break;
    }
    let dirs: Vec<PathBuf> = match ssl_cert_dir {
        Some(d) => d
            .split(':')
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .collect(),
        None if bundle_found => Vec::new(),
        None => CERT_DIRS.iter().map(PathBuf::from).collect(),
    };
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut n = 0;
        for entry in entries.flatten() {
            if let Ok(pem) = std::fs::read(entry.path()) {
                n += add_parsable(&mut roots, &pem);
            }
        }
        sources.push(format!("{} ({n} certificates)", dir.display()));
    }
    if roots.is_empty() {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        sources = vec!["built-in Mozilla roots (no system trust store found)".to_string()];
    }
    (roots, sources.join(" + "))
}

/// Adds what parses of a PEM text; a bad block in a system bundle is skipped, as Go does.
fn add_parsable(roots: &mut RootCertStore, pem: &[u8]) -> usize {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    added
}

/// HTTP/1.1 client configuration (no ALPN) verifying against `roots` on the daemon's clock.
fn tls_config(roots: RootCertStore) -> Arc<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        ClientConfig::builder_with_details(provider, Arc::new(crate::wall_clock::TlsClock))
            .with_safe_default_protocol_versions()
            // The ring provider always offers the safe versions; the fallback is the same
            // provider chosen by the crate features.
            .unwrap_or_else(|_| ClientConfig::builder());
    Arc::new(builder.with_root_certificates(roots).with_no_client_auth())
}

/// The certificate problem behind a failed request, when that is what failed (the server
/// speaks TLS but its certificate is not trusted, expired or for another name).
pub fn certificate_problem(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return is_certificate(tls).then(|| tls.to_string());
        }
        // rustls errors reach ureq inside an io::Error, whose `source` skips the inner error;
        // ureq's own error has no `source` at all.
        let io = match e.downcast_ref::<ureq::Error>() {
            Some(ureq::Error::Io(io)) => Some(io),
            _ => e.downcast_ref::<std::io::Error>(),
        };
        if let Some(inner) = io
            .and_then(|io| io.get_ref())
            .and_then(|i| i.downcast_ref::<rustls::Error>())
        {
            return is_certificate(inner).then(|| inner.to_string());
        }
        cur = e.source();
    }
    None
}

fn is_certificate(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::tls::PemError;

    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["ca".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn ssl_cert_file_replaces_the_bundles_and_ssl_cert_dir_adds() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("one.pem");
        std::fs::write(&file, ca_pem()).unwrap();
        let (roots, source) = host_roots(Some(file.clone()), None);
        assert_eq!(roots.len(), 1, "{source}");
        assert!(source.contains("one.pem (1 certificates)"), "{source}");

        let certs = dir.path().join("certs");
        std::fs::create_dir(&certs).unwrap();
        std::fs::write(certs.join("a.pem"), ca_pem()).unwrap();
        std::fs::write(certs.join("b.pem"), ca_pem() + &ca_pem()).unwrap();
        std::fs::write(certs.join("junk"), "not a certificate").unwrap();
        let (roots, source) = host_roots(
            Some(file),
            Some(format!("{}:/nonexistent", certs.display())),
        );
        assert_eq!(roots.len(), 4, "{source}");
    }

    #[test]
    fn no_store_at_all_falls_back_to_the_built_in_roots() {
        let (roots, source) = host_roots(
            Some("/nonexistent/bundle.pem".into()),
            Some("/nonexistent".into()),
        );
        assert_eq!(roots.len(), webpki_roots::TLS_SERVER_ROOTS.len());
        assert!(source.starts_with("built-in"), "{source}");
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.pem");
        std::fs::write(&bad, "hello").unwrap();
        let err = RegistryTrust::load(Some(&bad)).err().unwrap();
        assert!(
            matches!(err, CaFileError::Pem(_, PemError::NoCertificate)),
            "{err:?}"
        );
        assert!(err.to_string().contains("no certificate"), "{err}");
        let err = RegistryTrust::load(Some(&dir.path().join("missing.pem")))
            .err()
            .unwrap();
        assert!(matches!(err, CaFileError::Unreadable(..)), "{err:?}");
        assert!(err.to_string().contains("cannot read"), "{err}");
        let good = dir.path().join("good.pem");
        std::fs::write(&good, ca_pem()).unwrap();
        let trust = RegistryTrust::load(Some(&good)).unwrap();
        assert!(
            trust.source.contains("OCI_REGISTRY_CA_FILE"),
            "{}",
            trust.source
        );
    }
}
