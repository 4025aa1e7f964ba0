//! Generic readers of one variable: unset or empty means the default, ranges, paths, files.
//! Each names the variable, the value and the rule in its error.

use std::path::PathBuf;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use super::{is_dns_name, is_quantity, ConfigError, ListenAddr};

pub(super) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

pub(super) fn invalid(
    variable: &'static str,
    value: &str,
    allowed: impl Into<String>,
) -> ConfigError {
    ConfigError {
        variable,
        value: Some(value.to_string()),
        allowed: allowed.into(),
    }
}

/// A comma-separated list of host names or IP addresses (IPv6 with or without brackets),
/// lower-cased, trailing dots dropped; empty entries are skipped.
pub(super) fn host_list(env: Lookup, name: &'static str) -> Result<Vec<String>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .map(|h| h.trim().trim_start_matches('[').trim_end_matches(']'))
        .filter(|h| !h.is_empty())
        .map(|h| {
            let host = h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase();
            if is_dns_name(&host) || host.parse::<std::net::IpAddr>().is_ok() {
                Ok(host)
            } else {
                Err(invalid(
                    name,
                    &raw,
                    format!("comma-separated host names or IP addresses ({h:?} is neither)"),
                ))
            }
        })
        .collect()
}

/// An absolute directory without `.`, `..` or empty components (a trailing `/` is dropped).
pub(super) fn dir_root(env: Lookup, name: &'static str) -> Result<Option<String>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(None);
    };
    let dir = raw.trim_end_matches('/');
    let canonical = raw.starts_with('/')
        && !dir.is_empty()
        && dir[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if canonical {
        Ok(Some(dir.to_string()))
    } else {
        Err(invalid(
            name,
            &raw,
            "an absolute directory other than / without . or .. components",
        ))
    }
}

/// The value, or None when unset or empty.
pub(super) fn get(env: Lookup, name: &str) -> Option<String> {
    env(name).filter(|v| !v.is_empty())
}

pub(super) fn string_or(env: Lookup, name: &str, default: &str) -> String {
    get(env, name).unwrap_or_else(|| default.to_string())
}

pub(super) fn path_or(env: Lookup, name: &str, default: &str) -> PathBuf {
    PathBuf::from(string_or(env, name, default))
}

pub(super) fn int_in<T>(
    env: Lookup,
    name: &'static str,
    default: T,
    lo: T,
    hi: T,
    allowed: &str,
) -> Result<T, ConfigError>
where
    T: std::str::FromStr + PartialOrd + Copy,
{
    let Some(raw) = get(env, name) else {
        return Ok(default);
    };
    match raw.trim().parse::<T>() {
        Ok(v) if v >= lo && v <= hi => Ok(v),
        _ => Err(invalid(name, &raw, allowed)),
    }
}

pub(super) fn listen_addr(
    env: Lookup,
    name: &'static str,
    default: &str,
) -> Result<ListenAddr, ConfigError> {
    let raw = string_or(env, name, default);
    ListenAddr::parse(raw.trim())
        .ok_or_else(|| invalid(name, &raw, "host:port, [ipv6]:port or :port (port 0-65535)"))
}

pub(super) fn quantity(env: Lookup, name: &'static str) -> Result<Option<String>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(None);
    };
    let q = raw.trim();
    // Syntax alone lets `1e400` (infinite) and `-5` through; the node capacity would then fail
    // at start-up as a runtime error instead of a configuration one.
    let in_range = is_quantity(q) && crate::node::parse_quantity(q).is_ok_and(|v| v < MAX_QUANTITY);
    if in_range {
        Ok(Some(q.to_string()))
    } else {
        Err(invalid(
            name,
            &raw,
            "a Kubernetes quantity such as 16, 500m, 64Gi or 1e3, not negative and below 2^63",
        ))
    }
}

/// Largest capacity value accepted: what an int64 Kubernetes quantity can hold.
const MAX_QUANTITY: f64 = 9.2e18;

/// VK_STATE_DIR: an absolute path (the daemon creates it at start).
pub(super) fn state_dir(env: Lookup) -> Result<PathBuf, ConfigError> {
    const NAME: &str = "VK_STATE_DIR";
    let dir = path_or(env, NAME, "/var/lib/cocoon/vk-cocoon");
    if !dir.is_absolute() {
        let raw = dir.display().to_string();
        return Err(invalid(NAME, &raw, "an absolute directory path"));
    }
    Ok(dir)
}

/// A CA bundle variable (`VK_CLIENT_CA_FILE`, `OCI_REGISTRY_CA_FILE`) must name a readable PEM
/// file of at least one usable CA certificate: checked here so a bad file is a configuration
/// error, not a failure after start-up.
pub(super) fn ca_bundle_file(
    env: Lookup,
    name: &'static str,
) -> Result<Option<PathBuf>, ConfigError> {
    let Some(raw) = get(env, name) else {
        return Ok(None);
    };
    let allowed = |why: String| {
        invalid(
            name,
            &raw,
            format!("a readable PEM file of CA certificates ({why})"),
        )
    };
    let pem = std::fs::read(&raw).map_err(|e| allowed(format!("cannot read: {e}")))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| allowed(format!("bad PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| allowed(format!("bad certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(allowed("no CERTIFICATE block".into()));
    }
    Ok(Some(PathBuf::from(raw)))
}
