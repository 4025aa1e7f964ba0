//! rustls client configuration for the API server: cluster CA, tls-server-name, client certificates,
//! and insecure-skip-tls-verify (with a warning). Builds configs; opens no connections.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// What the TLS configuration is built from.
pub struct TlsParams<'a> {
    pub ca_pem: Option<&'a [u8]>,
    pub insecure_skip_tls_verify: bool,
    pub tls_server_name: Option<&'a str>,
    /// PEM certificate chain and PEM private key.
    pub client_cert: Option<(&'a [u8], &'a [u8])>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Why PEM data gave no certificate or key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PemError {
    NoCertificate,
    BadCertificate(String),
    NoKey,
    BadKey(String),
}

impl fmt::Display for PemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PemError::NoCertificate => f.write_str("no certificate found in PEM data"),
            PemError::BadCertificate(e) => write!(f, "bad PEM certificate: {e}"),
            PemError::NoKey => f.write_str("no private key found in PEM data"),
            PemError::BadKey(e) => write!(f, "bad PEM private key: {e}"),
        }
    }
}

impl std::error::Error for PemError {}

/// Why a client TLS configuration could not be built; each names the input at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsError {
    /// The cluster CA bundle.
    ClusterCa(PemError),
    /// A cluster CA certificate the root store refused.
    UnusableCa(String),
    /// The client certificate chain, or rustls refusing the certificate and key pair.
    ClientCertificate(String),
    /// The client private key.
    ClientKey(PemError),
    /// `tls-server-name` is not a server name.
    ServerName { name: String, why: String },
    /// rustls refused the protocol versions (`TLS setup`) or the verifier (`TLS verifier`).
    Rustls { stage: &'static str, why: String },
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsError::ClusterCa(e) => write!(f, "cluster CA: {e}"),
            TlsError::UnusableCa(e) => write!(f, "cluster CA: unusable certificate: {e}"),
            TlsError::ClientCertificate(e) => write!(f, "client certificate: {e}"),
            TlsError::ClientKey(e) => write!(f, "client key: {e}"),
            TlsError::ServerName { name, why } => write!(f, "tls-server-name {name:?}: {why}"),
            TlsError::Rustls { stage, why } => write!(f, "{stage}: {why}"),
        }
    }
}

impl std::error::Error for TlsError {}

fn setup_error(e: rustls::Error) -> TlsError {
    TlsError::Rustls {
        stage: "TLS setup",
        why: e.to_string(),
    }
}

/// Parse every certificate in a PEM bundle.
pub fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| PemError::BadCertificate(e.to_string()))?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(certs)
}

/// Parse the first private key (PKCS#8, PKCS#1 or SEC1) in PEM data.
pub fn parse_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        pem::Error::NoItemsFound => PemError::NoKey,
        e => PemError::BadKey(e.to_string()),
    })
}

/// Accepts any server certificate: only for insecure-skip-tls-verify.
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Verifies against the CA but checks the certificate for `tls-server-name` instead of the URL host.
#[derive(Debug)]
struct NameOverride {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NameOverride {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client configuration that presents a client certificate and accepts any server
/// certificate, for callers that verify the peer some other way or, like kube-apiserver
/// talking to kubelets without a kubelet CA, deliberately not at all.
pub fn unverified_client_config(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let certs = parse_certs(cert_pem).map_err(|e| TlsError::ClientCertificate(e.to_string()))?;
    let key = parse_key(key_pem).map_err(TlsError::ClientKey)?;
    let config =
        ClientConfig::builder_with_details(provider.clone(), Arc::new(crate::wall_clock::TlsClock))
            .with_safe_default_protocol_versions()
            .map_err(setup_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_client_auth_cert(certs, key)
            .map_err(|e| TlsError::ClientCertificate(e.to_string()))?;
    Ok(Arc::new(config))
}

/// Build the client TLS configuration (HTTP/1.1 only, no ALPN).
pub fn client_config(p: &TlsParams<'_>) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let builder =
        ClientConfig::builder_with_details(provider.clone(), Arc::new(crate::wall_clock::TlsClock))
            .with_safe_default_protocol_versions()
            .map_err(setup_error)?;
    let builder = if p.insecure_skip_tls_verify {
        log::warn!("insecure-skip-tls-verify is set: the API server's certificate is NOT verified");
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider.clone())))
    } else {
        let mut roots = RootCertStore::empty();
        match p.ca_pem {
            Some(pem) => {
                for c in parse_certs(pem).map_err(TlsError::ClusterCa)? {
                    roots
                        .add(c)
                        .map_err(|e| TlsError::UnusableCa(e.to_string()))?;
                }
            }
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        match p.tls_server_name {
            Some(name) => {
                let name =
                    ServerName::try_from(name.to_string()).map_err(|e| TlsError::ServerName {
                        name: name.to_string(),
                        why: e.to_string(),
                    })?;
                let inner =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| TlsError::Rustls {
                            stage: "TLS verifier",
                            why: e.to_string(),
                        })?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(NameOverride { inner, name }))
            }
            None => builder.with_root_certificates(roots),
        }
    };
    let config = match p.client_cert {
        Some((cert, key)) => {
            let certs =
                parse_certs(cert).map_err(|e| TlsError::ClientCertificate(e.to_string()))?;
            let key = parse_key(key).map_err(TlsError::ClientKey)?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| TlsError::ClientCertificate(e.to_string()))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_with_ca_and_client_cert_and_rejects_garbage() {
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let ca_pem = ca.cert.pem();
        let key_pem = ca.key_pair.serialize_pem();
        let ok = client_config(&TlsParams {
            ca_pem: Some(ca_pem.as_bytes()),
            insecure_skip_tls_verify: false,
            tls_server_name: Some("kubernetes"),
            client_cert: Some((ca_pem.as_bytes(), key_pem.as_bytes())),
        });
        assert!(ok.is_ok(), "{:?}", ok.err());
        let bad = client_config(&TlsParams {
            ca_pem: Some(b"not pem"),
            insecure_skip_tls_verify: false,
            tls_server_name: None,
            client_cert: None,
        });
        let bad = bad.unwrap_err();
        assert!(matches!(bad, TlsError::ClusterCa(_)), "{bad:?}");
        assert!(bad.to_string().starts_with("cluster CA: "), "{bad}");
        let bad = client_config(&TlsParams {
            ca_pem: None,
            insecure_skip_tls_verify: true,
            tls_server_name: None,
            client_cert: Some((ca_pem.as_bytes(), b"nokey")),
        });
        let bad = bad.unwrap_err();
        assert!(
            matches!(bad, TlsError::ClientKey(PemError::NoKey)),
            "{bad:?}"
        );
        assert_eq!(
            bad.to_string(),
            "client key: no private key found in PEM data"
        );
    }
}
