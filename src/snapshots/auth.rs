//! Registry credentials: Google ADC, docker config `auths` / credential helpers,
//! anonymous; plus `WWW-Authenticate` challenge parsing. No HTTP to the registry itself here.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivateKeyDer;

use super::reference::strip_port;
use super::TransferError;
use crate::http_client::{checked, CallError, Response};

const GOOGLE_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";

/// Credentials for one registry host.
#[derive(Clone, PartialEq, Eq)]
pub enum Credential {
    Anonymous,
    Basic {
        username: String,
        password: String,
    },
    /// An OAuth2 refresh token for the bearer POST flow (`identitytoken`).
    IdentityToken {
        username: String,
        token: String,
    },
    /// Used directly as the bearer token (`registrytoken`).
    RegistryToken(String),
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets.
        match self {
            Credential::Anonymous => f.write_str("Anonymous"),
            Credential::Basic { username, .. } => write!(f, "Basic({username})"),
            Credential::IdentityToken { username, .. } => write!(f, "IdentityToken({username})"),
            Credential::RegistryToken(_) => f.write_str("RegistryToken"),
        }
    }
}

impl Credential {
    /// `Authorization` value for a Basic challenge or a realm request, if any.
    pub fn basic_header(&self) -> Option<String> {
        match self {
            Credential::Basic { username, password } => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"))
            )),
            _ => None,
        }
    }
}

/// Where credentials come from. [`AuthSettings::from_env`] mirrors the Go keychain; tests set
/// the fields explicitly so they never touch the real home directory.
#[derive(Debug, Clone, Default)]
pub struct AuthSettings {
    /// Docker config file to read (`None` = no docker config).
    pub docker_config: Option<PathBuf>,
    /// Directory holding `docker-credential-<name>` helpers (`None` = search `PATH`).
    pub helper_dir: Option<PathBuf>,
    /// Service-account / authorized-user JSON (GOOGLE_APPLICATION_CREDENTIALS).
    pub google_credentials: Option<PathBuf>,
    /// Metadata server `host[:port]` (GCE_METADATA_HOST, default `metadata.google.internal`);
    /// `None` disables the metadata fallback.
    pub google_metadata_host: Option<String>,
    /// Use the Google keychain for every host, not only Google registries (tests).
    pub google_all_hosts: bool,
}

impl AuthSettings {
    /// The resolution order of VK-N from the process environment.
    pub fn from_env() -> Self {
        let env = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let home_cfg = env("HOME").map(|h| h.join(".docker").join("config.json"));
        let docker_cfg_dir = env("DOCKER_CONFIG");
        let docker_config = if home_cfg.as_ref().is_some_and(|p| p.exists()) {
            match &docker_cfg_dir {
                Some(d) => Some(d.join("config.json")),
                None => home_cfg,
            }
        } else if let Some(p) = docker_cfg_dir
            .map(|d| d.join("config.json"))
            .filter(|p| p.exists())
        {
            Some(p)
        } else if let Some(p) = env("REGISTRY_AUTH_FILE").filter(|p| p.exists()) {
            Some(p)
        } else {
            env("XDG_RUNTIME_DIR")
                .map(|d| d.join("containers").join("auth.json"))
                .filter(|p| p.exists())
        };
        let metadata = std::env::var("GCE_METADATA_HOST")
            .ok()
            .filter(|s| !s.is_empty());
        AuthSettings {
            docker_config,
            helper_dir: None,
            google_credentials: env("GOOGLE_APPLICATION_CREDENTIALS"),
            google_metadata_host: Some(
                metadata.unwrap_or_else(|| "metadata.google.internal".to_string()),
            ),
            google_all_hosts: false,
        }
    }
}

/// True for the hosts the Google keychain serves: `gcr.io`, `*.gcr.io`, `*.pkg.dev`, `*.google.com`.
pub fn is_google_host(host_port: &str) -> bool {
    let h = strip_port(host_port);
    h == "gcr.io" || h.ends_with(".gcr.io") || h.ends_with(".pkg.dev") || h.ends_with(".google.com")
}

/// Resolves credentials for `host` / `repository`: Google keychain, docker config, anonymous.
/// Keychain failures are logged and fall through to the next source.
pub fn resolve(
    settings: &AuthSettings,
    agent: &ureq::Agent,
    host: &str,
    repository: &str,
) -> Credential {
    if settings.google_all_hosts || is_google_host(host) {
        match google_access_token(settings, agent) {
            Ok(Some(tok)) => {
                return Credential::Basic {
                    username: "_token".into(),
                    password: tok.access_token,
                }
            }
            Ok(None) => {}
            Err(e) => log::warn!("google credentials for {host} unavailable: {e}"),
        }
    }
    if let Some(path) = &settings.docker_config {
        match docker_config_credential(settings, path, host, repository) {
            Ok(c) => return c,
            Err(e) => log::warn!("docker config {} unusable for {host}: {e}", path.display()),
        }
    }
    Credential::Anonymous
}

fn normalize_key(k: &str) -> String {
    let k = k
        .strip_prefix("https://")
        .or_else(|| k.strip_prefix("http://"))
        .unwrap_or(k);
    let k = k.trim_end_matches('/');
    let k = k
        .strip_suffix("/v1")
        .or_else(|| k.strip_suffix("/v2"))
        .unwrap_or(k);
    k.to_string()
}

/// Looks `<host>/<repository>` then `<host>` up in a docker config file.
pub fn docker_config_credential(
    settings: &AuthSettings,
    path: &std::path::Path,
    host: &str,
    repository: &str,
) -> Result<Credential, TransferError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Credential::Anonymous),
        Err(e) => return Err(TransferError::Io(format!("read {}: {e}", path.display()))),
    };
    let cfg: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| TransferError::Invalid(format!("parse {}: {e}", path.display())))?;
    let keys = [format!("{host}/{repository}"), host.to_string()];
    let helpers = cfg.get("credHelpers").and_then(|v| v.as_object());
    let auths = cfg.get("auths").and_then(|v| v.as_object());
    for key in &keys {
        if let Some(helper) = helpers
            .and_then(|h| h.iter().find(|(k, _)| normalize_key(k) == *key))
            .and_then(|(_, v)| v.as_str())
        {
            return run_credential_helper(settings, helper, key);
        }
    }
    if let Some(store) = cfg
        .get("credsStore")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
    {
        for key in &keys {
            let c = run_credential_helper(settings, store, key)?;
            if c != Credential::Anonymous {
                return Ok(c);
            }
        }
    }
    for key in &keys {
        if let Some(entry) = auths
            .and_then(|a| a.iter().find(|(k, _)| normalize_key(k) == *key))
            .map(|(_, v)| v)
        {
            return auth_entry(entry);
        }
    }
    Ok(Credential::Anonymous)
}

fn auth_entry(entry: &serde_json::Value) -> Result<Credential, TransferError> {
    let s = |k: &str| {
        entry
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let (mut user, mut pass) = (s("username"), s("password"));
    let auth = s("auth");
    if !auth.is_empty() {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| TransferError::Invalid("docker config: auth is not base64".into()))?;
        let text = String::from_utf8(raw)
            .map_err(|_| TransferError::Invalid("docker config: auth is not text".into()))?;
        let (u, p) = text
            .split_once(':')
            .ok_or_else(|| TransferError::Invalid("docker config: auth lacks ':'".into()))?;
        user = u.to_string();
        pass = p.to_string();
    }
    let identity = s("identitytoken");
    if !identity.is_empty() {
        return Ok(Credential::IdentityToken {
            username: user,
            token: identity,
        });
    }
    let registry_token = s("registrytoken");
    if !registry_token.is_empty() {
        return Ok(Credential::RegistryToken(registry_token));
    }
    if user.is_empty() && pass.is_empty() {
        return Ok(Credential::Anonymous);
    }
    Ok(Credential::Basic {
        username: user,
        password: pass,
    })
}

/// Runs `docker-credential-<name> get` with the server on stdin (argv only, no shell).
pub fn run_credential_helper(
    settings: &AuthSettings,
    name: &str,
    server: &str,
) -> Result<Credential, TransferError> {
    if name.is_empty() || name.contains('/') {
        return Err(TransferError::Invalid(format!(
            "bad credential helper name {name:?}"
        )));
    }
    let program = match &settings.helper_dir {
        Some(d) => d.join(format!("docker-credential-{name}")),
        None => PathBuf::from(format!("docker-credential-{name}")),
    };
    let mut child = Command::new(&program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| TransferError::Invalid(format!("run {}: {e}", program.display())))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that exits without reading stdin is reported by its output below.
        let _ = stdin.write_all(server.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| TransferError::Invalid(format!("run {}: {e}", program.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let msg = format!(
            "{}{}",
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        if msg.contains("credentials not found") {
            return Ok(Credential::Anonymous);
        }
        return Err(TransferError::Unauthorized(format!(
            "credential helper {name} for {server}: {}",
            msg.chars().take(200).collect::<String>()
        )));
    }
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).map_err(|e| {
        TransferError::Unauthorized(format!(
            "credential helper {name} for {server}: bad output: {e}"
        ))
    })?;
    let user = v
        .get("Username")
        .and_then(|x| x.as_str())
        .unwrap_or("")
        .to_string();
    let secret = v
        .get("Secret")
        .and_then(|x| x.as_str())
        .unwrap_or("")
        .to_string();
    if user == "<token>" {
        return Ok(Credential::IdentityToken {
            username: String::new(),
            token: secret,
        });
    }
    if user.is_empty() && secret.is_empty() {
        return Ok(Credential::Anonymous);
    }
    Ok(Credential::Basic {
        username: user,
        password: secret,
    })
}

/// One parsed `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Lower-case scheme: `basic` or `bearer`.
    pub scheme: String,
    pub params: BTreeMap<String, String>,
}

/// Parses `WWW-Authenticate` values; prefers a Bearer, then a Basic challenge.
pub fn pick_challenge(values: &[&str]) -> Option<Challenge> {
    let parsed: Vec<Challenge> = values.iter().filter_map(|v| parse_challenge(v)).collect();
    parsed
        .iter()
        .find(|c| c.scheme == "bearer")
        .or_else(|| parsed.iter().find(|c| c.scheme == "basic"))
        .cloned()
}

/// `Scheme k="v", k2=v2` → challenge (quoted values may contain commas).
pub fn parse_challenge(v: &str) -> Option<Challenge> {
    let v = v.trim();
    let (scheme, rest) = match v.split_once(char::is_whitespace) {
        Some((s, r)) => (s, r),
        None => (v, ""),
    };
    if scheme.is_empty() {
        return None;
    }
    let mut params = BTreeMap::new();
    let b = rest.as_bytes();
    let mut i = 0;
    while i < b.len() {
        while i < b.len() && (b[i] == b',' || b[i].is_ascii_whitespace()) {
            i += 1;
        }
        let ks = i;
        while i < b.len() && b[i] != b'=' && b[i] != b',' {
            i += 1;
        }
        let key = rest[ks..i].trim().to_ascii_lowercase();
        if i >= b.len() || b[i] != b'=' {
            continue;
        }
        i += 1;
        let mut val = String::new();
        if i < b.len() && b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                val.push(b[i] as char);
                i += 1;
            }
            i += 1;
        } else {
            let vs = i;
            while i < b.len() && b[i] != b',' {
                i += 1;
            }
            val = rest[vs..i].trim().to_string();
        }
        if !key.is_empty() {
            params.insert(key, val);
        }
    }
    Some(Challenge {
        scheme: scheme.to_ascii_lowercase(),
        params,
    })
}

/// An OAuth2 access token with its expiry.
#[derive(Clone)]
pub struct AccessToken {
    pub access_token: String,
    pub expires_at: SystemTime,
}

/// Application Default Credentials: the key file first, else the metadata server.
/// `Ok(None)` when neither source is configured or reachable.
pub fn google_access_token(
    settings: &AuthSettings,
    agent: &ureq::Agent,
) -> Result<Option<AccessToken>, TransferError> {
    if let Some(path) = &settings.google_credentials {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TransferError::Io(format!("read {}: {e}", path.display())))?;
        let key: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| TransferError::Invalid(format!("parse {}: {e}", path.display())))?;
        return google_token_from_key(&key, agent).map(Some);
    }
    let Some(host) = &settings.google_metadata_host else {
        return Ok(None);
    };
    let url = format!("http://{host}/computeMetadata/v1/instance/service-accounts/default/token?scopes={GOOGLE_SCOPE}");
    let call = agent
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .config()
        .timeout_global(Some(Duration::from_secs(3)))
        .build()
        .call();
    match checked(call) {
        Ok(resp) => parse_token_response(resp, "metadata server").map(Some),
        Err(CallError::Transport(_)) => Ok(None),
        Err(CallError::Status(code, _)) => Err(TransferError::Unauthorized(format!(
            "metadata server token: HTTP {code}"
        ))),
    }
}

fn parse_token_response(resp: Response, what: &str) -> Result<AccessToken, TransferError> {
    let v: serde_json::Value = resp
        .into_body()
        .read_json()
        .map_err(|e| TransferError::Unauthorized(format!("{what}: bad token response: {e}")))?;
    let tok = v
        .get("access_token")
        .or_else(|| v.get("token"))
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            TransferError::Unauthorized(format!("{what}: token response lacks access_token"))
        })?;
    let expires_in = v.get("expires_in").and_then(|e| e.as_u64()).unwrap_or(3600);
    Ok(AccessToken {
        access_token: tok.to_string(),
        expires_at: crate::wall_clock::now() + Duration::from_secs(expires_in),
    })
}

/// Exchanges a service-account key (JWT bearer grant, RS256) or an authorized-user refresh
/// token at the key's `token_uri`.
pub fn google_token_from_key(
    key: &serde_json::Value,
    agent: &ureq::Agent,
) -> Result<AccessToken, TransferError> {
    let s = |k: &str| {
        key.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let kind = s("type");
    let token_uri = {
        let t = s("token_uri");
        if t.is_empty() {
            "https://oauth2.googleapis.com/token".to_string()
        } else {
            t
        }
    };
    let resp = match kind.as_str() {
        "service_account" => {
            let assertion = service_account_jwt(key, &token_uri)?;
            agent.post(&token_uri).send_form([
                ("grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer"),
                ("assertion", &assertion),
            ])
        }
        "authorized_user" => agent.post(&token_uri).send_form([
            ("grant_type", "refresh_token"),
            ("refresh_token", &s("refresh_token")),
            ("client_id", &s("client_id")),
            ("client_secret", &s("client_secret")),
        ]),
        other => {
            return Err(TransferError::Invalid(format!(
                "google credentials type {other:?} not supported"
            )))
        }
    };
    match checked(resp) {
        Ok(r) => parse_token_response(r, &token_uri),
        Err(CallError::Status(code, _)) => Err(TransferError::Unauthorized(format!(
            "token exchange at {token_uri}: HTTP {code}"
        ))),
        Err(e) => Err(TransferError::Transient(format!(
            "token exchange at {token_uri}: {e}"
        ))),
    }
}

/// The signed JWT assertion for a service-account key.
pub fn service_account_jwt(
    key: &serde_json::Value,
    token_uri: &str,
) -> Result<String, TransferError> {
    let s = |k: &str| {
        key.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let email = s("client_email");
    let pem = s("private_key");
    if email.is_empty() || pem.is_empty() {
        return Err(TransferError::Invalid(
            "service-account key lacks client_email or private_key".into(),
        ));
    }
    let der = match PrivateKeyDer::from_pem_slice(pem.as_bytes()) {
        Ok(PrivateKeyDer::Pkcs8(k)) => k.secret_pkcs8_der().to_vec(),
        Ok(PrivateKeyDer::Pkcs1(k)) => k.secret_pkcs1_der().to_vec(),
        _ => {
            return Err(TransferError::Invalid(
                "service-account private_key is not a PEM RSA key".into(),
            ))
        }
    };
    let pair = ring::signature::RsaKeyPair::from_pkcs8(&der)
        .or_else(|_| ring::signature::RsaKeyPair::from_der(&der))
        .map_err(|e| {
            TransferError::Invalid(format!("service-account private_key unusable: {e}"))
        })?;
    let now = crate::wall_clock::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut header = serde_json::json!({"alg": "RS256", "typ": "JWT"});
    let kid = s("private_key_id");
    if !kid.is_empty() {
        header["kid"] = serde_json::Value::String(kid);
    }
    let claims = serde_json::json!({
        "iss": email, "scope": GOOGLE_SCOPE, "aud": token_uri, "iat": now, "exp": now + 3600,
    });
    let signing_input = format!(
        "{}.{}",
        b64.encode(header.to_string()),
        b64.encode(claims.to_string())
    );
    let mut sig = vec![0u8; pair.public().modulus_len()];
    pair.sign(
        &ring::signature::RSA_PKCS1_SHA256,
        &ring::rand::SystemRandom::new(),
        signing_input.as_bytes(),
        &mut sig,
    )
    .map_err(|_| TransferError::Invalid("RS256 signing failed".into()))?;
    Ok(format!("{signing_input}.{}", b64.encode(sig)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        let c = parse_challenge(r#"Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push""#).unwrap();
        assert_eq!(c.scheme, "bearer");
        assert_eq!(c.params["realm"], "https://auth.example/token");
        assert_eq!(c.params["scope"], "repository:a/b:pull,push");
        let picked = pick_challenge(&[r#"Basic realm="x""#, r#"Bearer realm="y""#]).unwrap();
        assert_eq!(picked.scheme, "bearer");
        let b = parse_challenge("Basic realm=registry").unwrap();
        assert_eq!(b.params["realm"], "registry");
    }

    #[test]
    fn docker_config_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("bob:s3cret");
        std::fs::write(
            &p,
            format!(r#"{{"auths":{{"https://reg.example:5000":{{"auth":"{auth}"}},"reg.example:5000/team/app":{{"username":"rep","password":"pw"}},"tok.example":{{"registrytoken":"T"}}}}}}"#),
        )
        .unwrap();
        let s = AuthSettings {
            docker_config: Some(p.clone()),
            ..Default::default()
        };
        let c = docker_config_credential(&s, &p, "reg.example:5000", "other").unwrap();
        assert_eq!(
            c,
            Credential::Basic {
                username: "bob".into(),
                password: "s3cret".into()
            }
        );
        let c = docker_config_credential(&s, &p, "reg.example:5000", "team/app").unwrap();
        assert_eq!(
            c,
            Credential::Basic {
                username: "rep".into(),
                password: "pw".into()
            }
        );
        assert_eq!(
            docker_config_credential(&s, &p, "tok.example", "x").unwrap(),
            Credential::RegistryToken("T".into())
        );
        assert_eq!(
            docker_config_credential(&s, &p, "nope", "x").unwrap(),
            Credential::Anonymous
        );
        std::fs::write(&p, "{not json").unwrap();
        assert!(docker_config_credential(&s, &p, "nope", "x").is_err());
    }

    #[test]
    fn google_hosts() {
        assert!(is_google_host("gcr.io"));
        assert!(is_google_host("eu.gcr.io"));
        assert!(is_google_host("asia-docker.pkg.dev"));
        assert!(!is_google_host("127.0.0.1:5000"));
        assert!(!is_google_host("evilgcr.io"));
    }
}
