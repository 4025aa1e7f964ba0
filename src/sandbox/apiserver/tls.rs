//! The fake's certificate authority: CA, serving certificate and issued client certificates,
//! and the rustls server configuration. Owns key material only; no sockets.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};

/// Who a verified client certificate belongs to (CN = user, O = groups, as Kubernetes reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertIdentity {
    pub user: String,
    pub groups: Vec<String>,
}

pub struct Authority {
    ca_cert: rcgen::Certificate,
    ca_key: KeyPair,
    serving_cert: CertificateDer<'static>,
    serving_key_der: Vec<u8>,
    /// DER of every client certificate we issued, to map a presented certificate to its identity.
    issued: Mutex<HashMap<Vec<u8>, CertIdentity>>,
}

fn tls_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("fake apiserver tls: {e}"))
}

impl Authority {
    /// A fresh CA and a serving certificate for 127.0.0.1, ::1 and localhost.
    pub fn generate() -> io::Result<Self> {
        let ca_key = KeyPair::generate().map_err(tls_err)?;
        let mut ca_params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "vk-cocoon-fake-apiserver-ca");
        ca_params.distinguished_name = dn;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).map_err(tls_err)?;

        let serving_key = KeyPair::generate().map_err(tls_err)?;
        let mut params = CertificateParams::new(vec![
            "127.0.0.1".to_string(),
            "::1".to_string(),
            "localhost".to_string(),
        ])
        .map_err(tls_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "kube-apiserver");
        params.distinguished_name = dn;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving = params
            .signed_by(&serving_key, &ca_cert, &ca_key)
            .map_err(tls_err)?;

        Ok(Authority {
            serving_cert: serving.der().clone(),
            serving_key_der: serving_key.serialize_der(),
            ca_cert,
            ca_key,
            issued: Mutex::new(HashMap::new()),
        })
    }

    pub fn ca_pem(&self) -> String {
        self.ca_cert.pem()
    }

    /// Issues a client certificate (CN = user, one O per group) signed by the CA.
    /// Returns (certificate PEM, private key PEM).
    pub fn issue_client_cert(&self, user: &str, groups: &[&str]) -> io::Result<(String, String)> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, user);
        for g in groups {
            dn.push(DnType::OrganizationName, *g);
        }
        params.distinguished_name = dn;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.ca_cert, &self.ca_key)
            .map_err(tls_err)?;
        let identity = CertIdentity {
            user: user.to_string(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        };
        if let Ok(mut issued) = self.issued.lock() {
            issued.insert(cert.der().to_vec(), identity);
        }
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// The identity of a verified client certificate; certificates from an extra client CA
    /// (not issued here) map to a generic user.
    pub fn identity_of(&self, der: &[u8]) -> CertIdentity {
        self.issued
            .lock()
            .ok()
            .and_then(|m| m.get(der).cloned())
            .unwrap_or_else(|| CertIdentity {
                user: "external-client-cert".to_string(),
                groups: vec!["system:authenticated".to_string()],
            })
    }

    /// Server config: our serving cert; client certificates optional but verified against our CA
    /// (plus `extra_client_ca_pems`) when presented; ALPN http/1.1 so Go clients skip HTTP/2.
    pub fn server_config(&self, extra_client_ca_pems: &[String]) -> io::Result<Arc<ServerConfig>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        roots.add(self.ca_cert.der().clone()).map_err(tls_err)?;
        for pem in extra_client_ca_pems {
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                roots.add(cert.map_err(tls_err)?).map_err(tls_err)?;
            }
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .allow_unauthenticated()
                .build()
                .map_err(tls_err)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.serving_key_der.clone()));
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.serving_cert.clone()], key)
            .map_err(tls_err)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}
