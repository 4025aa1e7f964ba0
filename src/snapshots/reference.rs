//! Registry references: `<OCI_REGISTRY>/<repo>:<tag>` and `@sha256:` digests.
//! Pure parsing and formatting; no network, no auth.

use std::fmt;

/// A registry base (`host[:port]` plus optional path prefix) as given in `OCI_REGISTRY`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryBase {
    /// `host[:port]`.
    pub host: String,
    /// Path prefix inside the registry without leading or trailing `/` (may be empty).
    pub prefix: String,
}

/// A fully resolved reference: registry host, repository path and tag or digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]` of the registry.
    pub host: String,
    /// Repository path inside the registry (prefix plus name).
    pub repository: String,
    /// Tag or `sha256:<hex>` digest.
    pub target: Target,
}

/// What a reference points at inside its repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tag(String),
    Digest(String),
}

impl Target {
    /// The string used in `/v2/<repo>/manifests/<this>`.
    pub fn as_str(&self) -> &str {
        match self {
            Target::Tag(t) | Target::Digest(t) => t,
        }
    }
}

/// Why a reference or registry base was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefError(pub String);

impl fmt::Display for RefError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RefError {}

impl RegistryBase {
    /// Parses `OCI_REGISTRY`: `host[:port][/prefix...]`, an optional `http://` / `https://`
    /// scheme is tolerated and dropped (the scheme is chosen by the ping).
    pub fn parse(raw: &str) -> Result<Self, RefError> {
        let trimmed = raw.trim();
        let no_scheme = trimmed
            .strip_prefix("https://")
            .or_else(|| trimmed.strip_prefix("http://"))
            .unwrap_or(trimmed);
        let no_scheme = no_scheme.trim_end_matches('/');
        let (host, prefix) = match no_scheme.split_once('/') {
            Some((h, p)) => (h, p),
            None => (no_scheme, ""),
        };
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err(RefError(format!(
                "invalid registry {raw:?}: empty or malformed host"
            )));
        }
        if !prefix.is_empty() && !valid_repository(prefix) {
            return Err(RefError(format!(
                "invalid registry {raw:?}: bad path prefix {prefix:?}"
            )));
        }
        Ok(RegistryBase {
            host: host.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// Repository path for a VM name / image repo under this base.
    pub fn repository(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}/{}", self.prefix, name)
        }
    }

    /// `<base>/<name>:<tag>` (or `@digest` when `tag` is a digest), validated.
    pub fn reference(&self, name: &str, tag: &str) -> Result<Reference, RefError> {
        let repository = self.repository(name);
        if !valid_repository(&repository) {
            return Err(RefError(format!("invalid repository name {repository:?}")));
        }
        let target = if tag.starts_with("sha256:") {
            if !valid_digest(tag) {
                return Err(RefError(format!("invalid digest {tag:?}")));
            }
            Target::Digest(tag.to_string())
        } else {
            let tag = if tag.is_empty() { "latest" } else { tag };
            if !valid_tag(tag) {
                return Err(RefError(format!("invalid tag {tag:?}")));
            }
            Target::Tag(tag.to_string())
        };
        Ok(Reference {
            host: self.host.clone(),
            repository,
            target,
        })
    }
}

impl Reference {
    /// Same repository, another target (used to fetch an index child by digest).
    pub fn with_digest(&self, digest: &str) -> Reference {
        Reference {
            host: self.host.clone(),
            repository: self.repository.clone(),
            target: Target::Digest(digest.to_string()),
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.target {
            Target::Tag(t) => write!(f, "{}/{}:{}", self.host, self.repository, t),
            Target::Digest(d) => write!(f, "{}/{}@{}", self.host, self.repository, d),
        }
    }
}

/// The one image-reference splitter: `repo[:tag]` or `repo@sha256:<hex>` into the repository
/// and the tag (or the digest, which [`RegistryBase::reference`] recognises by its `sha256:`).
/// The tag is the part after the last `:` that follows the last `/`, so a registry port is
/// never a tag; no tag, an empty tag or an empty name part means `latest`. For the
/// registry-relative refs `IsRelativeRef` admits (no port, one colon at most) this is the same
/// split as `ParseRef`'s first colon.
pub fn split_image_ref(s: &str) -> (String, String) {
    if let Some((name, digest)) = s.split_once('@') {
        if !name.is_empty() && !digest.is_empty() {
            return (name.to_string(), digest.to_string());
        }
    }
    let slash = s.rfind('/').map_or(0, |i| i + 1);
    match s[slash..].rfind(':') {
        Some(i) if slash + i > 0 => {
            let tag = &s[slash + i + 1..];
            let tag = if tag.is_empty() { "latest" } else { tag };
            (s[..slash + i].to_string(), tag.to_string())
        }
        _ => (s.to_string(), "latest".to_string()),
    }
}

/// `IsRelativeRef`: repo matches the lower-case component grammar and the tag the tag grammar.
pub fn is_relative_ref(s: &str) -> bool {
    let Some((name, tag)) = s.split_once(':') else {
        return valid_repository(s);
    };
    valid_repository(name) && valid_tag(tag)
}

/// Repository grammar: components `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*` joined by `/`, 2..255 chars.
pub fn valid_repository(s: &str) -> bool {
    if s.len() > 255 || s.is_empty() {
        return false;
    }
    s.split('/').all(valid_component)
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() {
        return false;
    }
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator run: `.`, `_`, `__` or one or more `-`.
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// Tag grammar `^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`.
pub fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    if b.is_empty() || b.len() > 128 {
        return false;
    }
    let first_ok = b[0].is_ascii_alphanumeric() || b[0] == b'_';
    first_ok
        && b[1..]
            .iter()
            .all(|&x| x.is_ascii_alphanumeric() || x == b'_' || x == b'.' || x == b'-')
}

/// `sha256:` followed by 64 lower-case hex digits.
pub fn valid_digest(d: &str) -> bool {
    match d.strip_prefix("sha256:") {
        Some(hex) => {
            hex.len() == 64
                && hex
                    .bytes()
                    .all(|x| x.is_ascii_digit() || (b'a'..=b'f').contains(&x))
        }
        None => false,
    }
}

/// Local snapshot name for a clone-mode image ref: `repo` when the tag
/// is empty or `latest`, else `repo:tag`; names over 63 chars become 50 chars + `-` + 12 hex.
pub fn local_snapshot_name(repo: &str, tag: &str) -> String {
    use sha2::{Digest, Sha256};
    let full = if tag.is_empty() || tag == "latest" {
        repo.to_string()
    } else {
        format!("{repo}:{tag}")
    };
    if full.len() <= 63 {
        return full;
    }
    let hex = hex_lower(&Sha256::digest(full.as_bytes()));
    let mut cut = 50;
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{}", &full[..cut], &hex[..12])
}

/// Lower-case hex of bytes.
pub fn hex_lower(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

/// True for hosts where plain HTTP may be tried: `localhost[:*]`, `*.localhost`,
/// `127.0.0.1`, `::1`, and RFC 1918 IPv4 literals.
pub fn allows_plain_http(host_port: &str) -> bool {
    let host = strip_port(host_port);
    if host == "localhost" || host.ends_with(".localhost") || host == "::1" {
        return true;
    }
    match host.parse::<std::net::Ipv4Addr>() {
        Ok(ip) => ip == std::net::Ipv4Addr::LOCALHOST || ip.is_private(),
        Err(_) => false,
    }
}

/// Host part of `host[:port]`, tolerating `[v6]:port`.
pub fn strip_port(host_port: &str) -> &str {
    if let Some(rest) = host_port.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host_port.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host_port,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_and_reference() {
        let b = RegistryBase::parse("asia-docker.pkg.dev/proj/repo").unwrap();
        assert_eq!(b.host, "asia-docker.pkg.dev");
        let r = b.reference("vk-ns-set-0", "hibernate").unwrap();
        assert_eq!(r.repository, "proj/repo/vk-ns-set-0");
        assert_eq!(
            r.to_string(),
            "asia-docker.pkg.dev/proj/repo/vk-ns-set-0:hibernate"
        );
        let d = format!("sha256:{}", "a".repeat(64));
        let r = b.reference("x1", &d).unwrap();
        assert_eq!(
            r.to_string(),
            format!("asia-docker.pkg.dev/proj/repo/x1@{d}")
        );
        assert!(b.reference("UPPER", "t").is_err());
        assert!(b.reference("ok", "bad tag").is_err());
        assert!(b.reference("ok", "sha256:zz").is_err());
        assert_eq!(
            b.reference("ok", "").unwrap().target,
            Target::Tag("latest".into())
        );
        let local = RegistryBase::parse("127.0.0.1:5000").unwrap();
        assert_eq!(local.host, "127.0.0.1:5000");
        assert_eq!(local.prefix, "");
    }

    #[test]
    fn relative_refs() {
        let split = |s: &str| split_image_ref(s);
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(split("team/agent:v3"), pair("team/agent", "v3"));
        assert_eq!(split("team/agent"), pair("team/agent", "latest"));
        assert_eq!(split("team/agent:"), pair("team/agent", "latest"));
        assert_eq!(split(":x"), pair(":x", "latest"));
        // A registry port is not a tag; the tag follows the last `/`.
        assert_eq!(
            split("reg:5000/os/ubuntu:24.04"),
            pair("reg:5000/os/ubuntu", "24.04")
        );
        assert_eq!(
            split("reg:5000/os/ubuntu"),
            pair("reg:5000/os/ubuntu", "latest")
        );
        assert_eq!(split("ubuntu"), pair("ubuntu", "latest"));
        // A digest reference keeps its `sha256:` so the registry client fetches by digest.
        let digest = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            split(&format!("reg:5000/os/ubuntu@{digest}")),
            pair("reg:5000/os/ubuntu", &digest)
        );
        assert_eq!(split("@x"), pair("@x", "latest"));
        assert!(is_relative_ref("team/agent:v3"));
        assert!(is_relative_ref("a__b/c-d--e.f"));
        assert!(!is_relative_ref("a:b:c"));
        assert!(!is_relative_ref("Team/agent"));
        assert!(!is_relative_ref("host:5000/x"));
        assert!(!is_relative_ref("a:"));
        assert!(!is_relative_ref("a___b"));
    }

    #[test]
    fn local_names() {
        assert_eq!(local_snapshot_name("team/agent", "latest"), "team/agent");
        assert_eq!(local_snapshot_name("team/agent", "v3"), "team/agent:v3");
        let long = "a".repeat(70);
        let n = local_snapshot_name(&long, "");
        assert_eq!(n.len(), 63);
        assert!(n.starts_with(&"a".repeat(50)));
    }

    #[test]
    fn plain_http_hosts() {
        for h in [
            "localhost:5000",
            "x.localhost",
            "127.0.0.1:1",
            "10.1.2.3",
            "192.168.0.1:80",
            "172.16.9.9",
            "[::1]:5000",
        ] {
            assert!(allows_plain_http(h), "{h}");
        }
        for h in [
            "gcr.io",
            "8.8.8.8:5000",
            "172.32.0.1",
            "127.0.0.2",
            "example.com:5000",
        ] {
            assert!(!allows_plain_http(h), "{h}");
        }
    }
}
