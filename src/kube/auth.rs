//! Request credentials at run time: static token, rotating token file, basic auth and exec
//! credential plugins (cached until expiry, re-run on 401). Runs plugins by argv, never a shell.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use super::error::KubeError;
use super::kubeconfig::{AuthConfig, ExecConfig};

/// How long an exec plugin may run before it is killed.
const EXEC_TIMEOUT: Duration = Duration::from_secs(30);
/// After a plugin exits, how long its output may take to reach end of file. A background
/// process it left behind can hold the pipe open for ever; what was written by then is used.
const EXEC_EOF_GRACE: Duration = Duration::from_secs(1);
/// Refresh exec credentials this long before they expire.
const EXPIRY_LEEWAY: Duration = Duration::from_secs(10);
/// A token file is re-checked at least this often (it is also re-read whenever it changes).
const TOKEN_FILE_RECHECK: Duration = Duration::from_secs(60);

/// What one request carries: an Authorization header and/or a client certificate (PEM pair).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuthMaterial {
    pub authorization: Option<String>,
    pub client_cert: Option<(Vec<u8>, Vec<u8>)>,
}

#[derive(Default)]
struct TokenFileState {
    token: String,
    stamp: Option<(SystemTime, u64)>,
    checked: Option<Instant>,
}

#[derive(Clone, Debug)]
struct ExecCredential {
    token: Option<String>,
    client_cert: Option<(Vec<u8>, Vec<u8>)>,
    expires: Option<SystemTime>,
}

enum Kind {
    None,
    Header(String),
    TokenFile(PathBuf, Mutex<TokenFileState>),
    Exec(ExecConfig, Mutex<Option<ExecCredential>>),
}

/// The credential source of one Client.
pub struct Credentials {
    kind: Kind,
}

impl Credentials {
    pub fn new(auth: &AuthConfig) -> Credentials {
        use base64::Engine;
        let kind = match auth {
            AuthConfig::None => Kind::None,
            AuthConfig::Token(t) => Kind::Header(format!("Bearer {}", t.trim())),
            AuthConfig::Basic { username, password } => Kind::Header(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"))
            )),
            AuthConfig::TokenFile(p) => {
                Kind::TokenFile(p.clone(), Mutex::new(TokenFileState::default()))
            }
            AuthConfig::Exec(e) => Kind::Exec(e.clone(), Mutex::new(None)),
        };
        Credentials { kind }
    }

    /// Credentials for the next request, refreshing rotated files and expired plugin output.
    pub fn current(&self) -> Result<AuthMaterial, KubeError> {
        match &self.kind {
            Kind::None => Ok(AuthMaterial::default()),
            Kind::Header(h) => Ok(AuthMaterial {
                authorization: Some(h.clone()),
                client_cert: None,
            }),
            Kind::TokenFile(path, state) => {
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                refresh_token_file(path, &mut st)?;
                Ok(AuthMaterial {
                    authorization: Some(format!("Bearer {}", st.token)),
                    client_cert: None,
                })
            }
            Kind::Exec(cfg, cache) => {
                let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                let fresh = match &*c {
                    Some(cred) => cred
                        .expires
                        .is_none_or(|t| crate::wall_clock::now() + EXPIRY_LEEWAY < t),
                    None => false,
                };
                if !fresh {
                    *c = Some(run_exec(cfg)?);
                }
                let cred = c
                    .clone()
                    .ok_or_else(|| KubeError::Credentials("exec plugin gave nothing".into()))?;
                Ok(AuthMaterial {
                    authorization: cred.token.map(|t| format!("Bearer {t}")),
                    client_cert: cred.client_cert,
                })
            }
        }
    }

    /// Forget cached credentials after a 401 so the next call re-reads / re-executes.
    pub fn invalidate(&self) {
        match &self.kind {
            Kind::TokenFile(_, st) => {
                let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
                st.stamp = None;
                st.checked = None;
            }
            Kind::Exec(_, c) => *c.lock().unwrap_or_else(|p| p.into_inner()) = None,
            _ => {}
        }
    }

    /// True when a 401 may be cured by refreshing (so one retry is worth it).
    pub fn refreshable(&self) -> bool {
        matches!(self.kind, Kind::TokenFile(..) | Kind::Exec(..))
    }
}

fn refresh_token_file(path: &Path, st: &mut TokenFileState) -> Result<(), KubeError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| KubeError::Credentials(format!("token file {}: {e}", path.display())))?;
    let stamp = (
        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        meta.len(),
    );
    let stale = st.checked.is_none_or(|t| t.elapsed() >= TOKEN_FILE_RECHECK);
    if st.stamp == Some(stamp) && !stale {
        return Ok(());
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| KubeError::Credentials(format!("token file {}: {e}", path.display())))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(KubeError::Credentials(format!(
            "token file {} is empty",
            path.display()
        )));
    }
    st.token = token.to_string();
    st.stamp = Some(stamp);
    st.checked = Some(Instant::now());
    Ok(())
}

/// The KUBERNETES_EXEC_INFO request object.
fn exec_info(cfg: &ExecConfig) -> String {
    use base64::Engine;
    let mut spec = serde_json::json!({ "interactive": false });
    if cfg.provide_cluster_info {
        let mut cluster = serde_json::json!({ "server": cfg.cluster_server });
        if let Some(ca) = &cfg.cluster_ca_pem {
            cluster["certificate-authority-data"] =
                serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(ca));
        }
        spec["cluster"] = cluster;
    }
    serde_json::json!({
        "apiVersion": cfg.api_version,
        "kind": "ExecCredential",
        "spec": spec,
    })
    .to_string()
}

fn run_exec(cfg: &ExecConfig) -> Result<ExecCredential, KubeError> {
    let fail = |m: String| KubeError::Credentials(format!("exec plugin {}: {m}", cfg.command));
    let mut cmd = Command::new(&cfg.command);
    cmd.args(&cfg.args)
        .env("KUBERNETES_EXEC_INFO", exec_info(cfg))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in &cfg.env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot start: {e}")))?;
    // Drain both pipes on helper threads so a chatty plugin cannot block on a full pipe.
    let out = drain(child.stdout.take(), 1 << 20);
    let err = drain(child.stderr.take(), 64 << 10);
    let deadline = Instant::now() + EXEC_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!("timed out after {EXEC_TIMEOUT:?}")));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(fail(format!("wait: {e}"))),
        }
    };
    let eof_by = Instant::now() + EXEC_EOF_GRACE;
    let (out, out_closed) = out.collect(eof_by);
    let (err, _) = err.collect(eof_by);
    if !out_closed {
        log::warn!(
            "exec plugin {}: its output stayed open after it exited (a background process \
             holds it); using what it wrote",
            cfg.command
        );
    }
    if !status.success() {
        let msg = String::from_utf8_lossy(&err[..err.len().min(512)])
            .trim()
            .to_string();
        return Err(fail(format!("exited with {status}: {msg}")));
    }
    parse_exec_output(&out).map_err(fail)
}

/// A pipe read to EOF (or `limit` bytes) on a helper thread.
struct Drained {
    buf: std::sync::Arc<Mutex<Vec<u8>>>,
    done: std::sync::mpsc::Receiver<()>,
}

fn drain(pipe: Option<impl Read + Send + 'static>, limit: u64) -> Drained {
    let buf = std::sync::Arc::new(Mutex::new(Vec::new()));
    let (tx, done) = std::sync::mpsc::channel();
    let shared = buf.clone();
    std::thread::spawn(move || {
        if let Some(p) = pipe {
            let mut p = p.take(limit);
            let mut chunk = [0u8; 8192];
            while let Ok(n) = p.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                shared
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&chunk[..n]);
            }
        }
        let _ = tx.send(());
    });
    Drained { buf, done }
}

impl Drained {
    /// What was read by EOF, or by `by` if the pipe is still open then (and whether it closed).
    fn collect(self, by: Instant) -> (Vec<u8>, bool) {
        let wait = by.saturating_duration_since(Instant::now());
        let closed = self.done.recv_timeout(wait).is_ok();
        let out = std::mem::take(&mut *self.buf.lock().unwrap_or_else(|e| e.into_inner()));
        (out, closed)
    }
}

/// Parse a plugin's stdout (`ExecCredential` with status.token or client cert/key data).
/// Err is the detail `fail` wraps into the plugin's error.
fn parse_exec_output(out: &[u8]) -> Result<ExecCredential, String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Status {
        #[serde(default)]
        token: Option<String>,
        #[serde(default)]
        client_certificate_data: Option<String>,
        #[serde(default)]
        client_key_data: Option<String>,
        #[serde(default)]
        expiration_timestamp: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Wire {
        #[serde(default)]
        kind: Option<String>,
        #[serde(default)]
        status: Option<Status>,
    }
    let w: Wire =
        serde_json::from_slice(out).map_err(|e| format!("output is not an ExecCredential: {e}"))?;
    if w.kind.as_deref().is_some_and(|k| k != "ExecCredential") {
        return Err(format!("output kind {:?} is not ExecCredential", w.kind));
    }
    let s = w.status.ok_or("ExecCredential has no status")?;
    let expires = match s.expiration_timestamp.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => {
            let at = crate::rfc3339::parse(t)
                .ok_or_else(|| format!("bad expirationTimestamp {t:?}: not RFC 3339"))?;
            // Whole seconds, as before: a fraction never moves a credential's refresh.
            let secs = at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        }
        None => None,
    };
    let client_cert = match (s.client_certificate_data, s.client_key_data) {
        (Some(c), Some(k)) if !c.is_empty() && !k.is_empty() => {
            Some((c.into_bytes(), k.into_bytes()))
        }
        (None, None) => None,
        _ => return Err("clientCertificateData and clientKeyData must be given together".into()),
    };
    let token = s.token.filter(|t| !t.is_empty());
    if token.is_none() && client_cert.is_none() {
        return Err("ExecCredential status has neither token nor client certificate".into());
    }
    Ok(ExecCredential {
        token,
        client_cert,
        expires,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_exec_output_for_test(
        out: &[u8],
    ) -> Result<(Option<String>, bool, Option<SystemTime>), String> {
        parse_exec_output(out).map(|c| (c.token, c.client_cert.is_some(), c.expires))
    }

    #[test]
    fn exec_output_parsing() {
        let (t, cert, exp) = parse_exec_output_for_test(
            br#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"tok","expirationTimestamp":"2030-01-01T00:00:00Z"}}"#,
        )
        .unwrap();
        assert_eq!(t.as_deref(), Some("tok"));
        assert!(!cert);
        assert!(exp.is_some());
        assert!(parse_exec_output_for_test(b"hello").is_err());
        assert!(parse_exec_output_for_test(br#"{"kind":"ExecCredential","status":{}}"#).is_err());
        assert!(parse_exec_output_for_test(
            br#"{"kind":"ExecCredential","status":{"token":"x","expirationTimestamp":"soon"}}"#
        )
        .is_err());
        assert!(parse_exec_output_for_test(
            br#"{"kind":"ExecCredential","status":{"clientCertificateData":"x"}}"#
        )
        .is_err());
    }

    #[test]
    fn token_file_rotation_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        std::fs::write(&p, "one\n").unwrap();
        let c = Credentials::new(&AuthConfig::TokenFile(p.clone()));
        assert_eq!(
            c.current().unwrap().authorization.as_deref(),
            Some("Bearer one")
        );
        std::fs::write(&p, "second-token").unwrap();
        assert_eq!(
            c.current().unwrap().authorization.as_deref(),
            Some("Bearer second-token")
        );
        std::fs::remove_file(&p).unwrap();
        assert!(matches!(c.current(), Err(KubeError::Credentials(_))));
    }

    #[test]
    fn an_exec_plugin_that_leaves_a_child_holding_stdout_does_not_hang() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = dir.path().join("plugin");
        let cred = r#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"tok-1"}}"#;
        std::fs::write(
            &plugin,
            format!("#!/bin/sh\necho '{cred}'\nsleep 30 &\nexit 0\n"),
        )
        .unwrap();
        std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let c = Credentials::new(&AuthConfig::Exec(ExecConfig {
            api_version: "client.authentication.k8s.io/v1".into(),
            command: plugin.display().to_string(),
            args: vec![],
            env: vec![],
            provide_cluster_info: false,
            cluster_server: String::new(),
            cluster_ca_pem: None,
        }));
        let start = Instant::now();
        let m = c.current().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "took {:?}",
            start.elapsed()
        );
        assert_eq!(m.authorization.as_deref(), Some("Bearer tok-1"));
    }

    #[test]
    fn exec_plugin_failure_is_a_credentials_error() {
        let c = Credentials::new(&AuthConfig::Exec(ExecConfig {
            api_version: "client.authentication.k8s.io/v1".into(),
            command: "/nonexistent/plugin".into(),
            args: vec![],
            env: vec![],
            provide_cluster_info: false,
            cluster_server: String::new(),
            cluster_ca_pem: None,
        }));
        let e = c.current().unwrap_err();
        assert!(e.to_string().contains("/nonexistent/plugin"), "{e}");
    }
}
