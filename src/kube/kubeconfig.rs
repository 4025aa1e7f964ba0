//! Where the API server and credentials come from: KUBECONFIG path list merged as kubectl does,
//! then ~/.kube/config, then in-cluster. Parses and resolves files; performs no network I/O.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Default in-cluster service-account paths.
pub const SA_TOKEN_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
pub const SA_CA_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// Everything the client needs from the process environment, already read.
/// `from_process_env` is a convenience; the daemon's config may fill this itself.
#[derive(Clone, Debug)]
pub struct KubeOptions {
    /// Raw KUBECONFIG value (colon-separated path list); None or empty = unset.
    pub kubeconfig: Option<String>,
    /// Home directory for ~/.kube/config.
    pub home: Option<PathBuf>,
    /// KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT.
    pub service_host: Option<String>,
    pub service_port: Option<String>,
    pub sa_token_path: PathBuf,
    pub sa_ca_path: PathBuf,
    /// Client-side rate limit (COCOON_K8S_QPS / COCOON_K8S_BURST); qps 0 disables.
    pub qps: f64,
    pub burst: u32,
    /// Timeout of every non-watch call, connect included.
    pub timeout: Duration,
}

impl Default for KubeOptions {
    fn default() -> Self {
        KubeOptions {
            kubeconfig: None,
            home: None,
            service_host: None,
            service_port: None,
            sa_token_path: PathBuf::from(SA_TOKEN_PATH),
            sa_ca_path: PathBuf::from(SA_CA_PATH),
            qps: 50.0,
            burst: 100,
            timeout: Duration::from_secs(10),
        }
    }
}

impl KubeOptions {
    /// Read KUBECONFIG, HOME, KUBERNETES_SERVICE_HOST/PORT and COCOON_K8S_QPS/BURST
    /// (malformed rate values fall back to the defaults, as the Go loader does).
    pub fn from_process_env() -> KubeOptions {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut o = KubeOptions {
            kubeconfig: var("KUBECONFIG"),
            home: var("HOME").map(PathBuf::from),
            service_host: var("KUBERNETES_SERVICE_HOST"),
            service_port: var("KUBERNETES_SERVICE_PORT"),
            ..KubeOptions::default()
        };
        if let Some(q) = var("COCOON_K8S_QPS").and_then(|v| v.trim().parse::<f64>().ok()) {
            // 0 turns rate limiting off, as the configuration table says.
            if q >= 0.0 && q.is_finite() {
                o.qps = q;
            }
        }
        if let Some(b) = var("COCOON_K8S_BURST").and_then(|v| v.trim().parse::<u32>().ok()) {
            o.burst = if b == 0 { o.burst } else { b };
        }
        o
    }
}

/// Why no usable configuration was found. The daemon exits with status 2 on these.
#[derive(Debug)]
pub enum KubeConfigError {
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    Parse {
        path: PathBuf,
        message: String,
    },
    Invalid(String),
    NoConfig,
}

impl fmt::Display for KubeConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KubeConfigError::Read { path, error } => {
                write!(f, "kubeconfig {}: cannot read: {error}", path.display())
            }
            KubeConfigError::Parse { path, message } => {
                write!(f, "kubeconfig {}: malformed: {message}", path.display())
            }
            KubeConfigError::Invalid(m) => write!(f, "kubeconfig: {m}"),
            KubeConfigError::NoConfig => write!(
                f,
                "no Kubernetes configuration: KUBECONFIG unset or missing, no ~/.kube/config, \
                 and not in a cluster (KUBERNETES_SERVICE_HOST/PORT unset)"
            ),
        }
    }
}

impl std::error::Error for KubeConfigError {}

/// How requests authenticate (besides a client certificate, which lives in the TLS config).
#[derive(Clone, Debug, PartialEq)]
pub enum AuthConfig {
    None,
    Token(String),
    /// Re-read whenever the file changes (service-account projected tokens rotate).
    TokenFile(PathBuf),
    Basic {
        username: String,
        password: String,
    },
    Exec(ExecConfig),
}

/// An exec credential plugin (client.authentication.k8s.io/v1 or v1beta1).
#[derive(Clone, Debug, PartialEq)]
pub struct ExecConfig {
    pub api_version: String,
    pub command: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub provide_cluster_info: bool,
    /// Server and CA passed in KUBERNETES_EXEC_INFO when provideClusterInfo is set.
    pub cluster_server: String,
    pub cluster_ca_pem: Option<Vec<u8>>,
}

/// One resolved cluster + user: what the client connects to and how it authenticates.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterConfig {
    pub server: String,
    pub ca_pem: Option<Vec<u8>>,
    pub insecure_skip_tls_verify: bool,
    pub tls_server_name: Option<String>,
    /// Client certificate and key, PEM.
    pub client_cert: Option<(Vec<u8>, Vec<u8>)>,
    pub auth: AuthConfig,
    pub namespace: Option<String>,
    /// Human description of where this came from, for logs.
    pub source: String,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(rename_all = "kebab-case")]
struct RawKubeconfig {
    #[serde(default)]
    clusters: Option<Vec<Named<RawCluster>>>,
    #[serde(default)]
    users: Option<Vec<Named<RawUser>>>,
    #[serde(default)]
    contexts: Option<Vec<Named<RawContext>>>,
    #[serde(default)]
    current_context: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
struct Named<T> {
    name: String,
    #[serde(alias = "cluster", alias = "user", alias = "context")]
    #[serde(default = "Option::default")]
    value: Option<T>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(rename_all = "kebab-case")]
struct RawCluster {
    #[serde(default)]
    server: Option<String>,
    #[serde(default)]
    certificate_authority: Option<String>,
    #[serde(default)]
    certificate_authority_data: Option<String>,
    #[serde(default)]
    insecure_skip_tls_verify: Option<bool>,
    #[serde(default)]
    tls_server_name: Option<String>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(rename_all = "kebab-case")]
struct RawUser {
    #[serde(default)]
    client_certificate: Option<String>,
    #[serde(default)]
    client_certificate_data: Option<String>,
    #[serde(default)]
    client_key: Option<String>,
    #[serde(default)]
    client_key_data: Option<String>,
    #[serde(default)]
    token: Option<String>,
    #[serde(default, rename = "tokenFile")]
    token_file: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    exec: Option<RawExec>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(rename_all = "camelCase")]
struct RawExec {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    command: Option<String>,
    #[serde(default)]
    args: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<RawEnv>>,
    #[serde(default)]
    provide_cluster_info: Option<bool>,
}

#[derive(Deserialize, Default, Debug, Clone)]
struct RawEnv {
    name: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize, Default, Debug, Clone)]
struct RawContext {
    #[serde(default)]
    cluster: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
}

/// Convert a YAML document into JSON so serde does the typed decoding.
fn yaml_to_json(y: &yaml_rust2::Yaml) -> serde_json::Value {
    use serde_json::Value;
    use yaml_rust2::Yaml;
    match y {
        Yaml::Real(s) => s
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .unwrap_or_else(|| Value::String(s.clone())),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Array(a) => Value::Array(a.iter().map(yaml_to_json).collect()),
        Yaml::Hash(h) => {
            let mut m = serde_json::Map::new();
            for (k, v) in h {
                let key = match k {
                    Yaml::String(s) | Yaml::Real(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    _ => continue,
                };
                m.insert(key, yaml_to_json(v));
            }
            Value::Object(m)
        }
        Yaml::Alias(_) | Yaml::Null | Yaml::BadValue => Value::Null,
    }
}

/// Largest kubeconfig accepted (real ones, certificates inlined, are tens of KiB).
pub const MAX_KUBECONFIG_BYTES: usize = 4 << 20;
/// Nodes a kubeconfig may hold once its aliases are expanded; the YAML loader copies the
/// anchored node for every alias, so nested aliases ("billion laughs") grow exponentially.
pub const MAX_YAML_NODES: u64 = 100_000;
/// Deepest nesting accepted: the JSON conversion and the tree's drop are recursive.
pub const MAX_YAML_DEPTH: usize = 64;

/// Walks the parser's events and sizes the document as the loader would build it, aliases
/// expanded, without building it: refuses bombs and deep nests before they cost memory or stack.
/// Err is the detail `parse_err` wraps into the kubeconfig's error.
fn check_yaml_budget(text: &str) -> Result<(), String> {
    use yaml_rust2::parser::{Event, Parser};
    let mut parser = Parser::new_from_str(text);
    // Per anchor id: nodes in the anchored subtree (aliases inside counted expanded).
    let mut anchored: std::collections::HashMap<usize, u64> = std::collections::HashMap::new();
    // Open collections: (anchor id, nodes so far).
    let mut open: Vec<(usize, u64)> = Vec::new();
    let mut total: u64 = 0;
    loop {
        let (event, mark) = parser.next_token().map_err(|e| e.to_string())?;
        let leaf = match event {
            Event::StreamEnd => return Ok(()),
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                if open.len() >= MAX_YAML_DEPTH {
                    return Err(format!(
                        "nested deeper than {MAX_YAML_DEPTH} levels (line {})",
                        mark.line()
                    ));
                }
                open.push((anchor, 1));
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let Some((anchor, nodes)) = open.pop() else {
                    continue;
                };
                if anchor > 0 {
                    anchored.insert(anchor, nodes);
                }
                nodes
            }
            Event::Scalar(_, _, anchor, _) => {
                if anchor > 0 {
                    anchored.insert(anchor, 1);
                }
                1
            }
            Event::Alias(id) => anchored.get(&id).copied().unwrap_or(1),
            _ => continue,
        };
        let into = match open.last_mut() {
            Some((_, nodes)) => nodes,
            None => &mut total,
        };
        *into = into.saturating_add(leaf);
        if *into > MAX_YAML_NODES {
            return Err(format!(
                "more than {MAX_YAML_NODES} nodes once aliases are expanded (line {}); \
                 refusing a YAML alias bomb",
                mark.line()
            ));
        }
    }
}

fn parse_file(path: &Path, text: &str) -> Result<RawKubeconfig, KubeConfigError> {
    let parse_err = |message: String| KubeConfigError::Parse {
        path: path.to_path_buf(),
        message,
    };
    if text.len() > MAX_KUBECONFIG_BYTES {
        return Err(parse_err(format!(
            "{} bytes; at most {MAX_KUBECONFIG_BYTES} are accepted",
            text.len()
        )));
    }
    check_yaml_budget(text).map_err(parse_err)?;
    let docs = yaml_rust2::YamlLoader::load_from_str(text).map_err(|e| parse_err(e.to_string()))?;
    let Some(doc) = docs.first() else {
        return Ok(RawKubeconfig::default());
    };
    let json = yaml_to_json(doc);
    if json.is_null() {
        return Ok(RawKubeconfig::default());
    }
    let mut raw: RawKubeconfig =
        serde_json::from_value(json).map_err(|e| parse_err(e.to_string()))?;
    // Relative file references are relative to the file that names them (kubectl rule).
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let fix = |p: &mut Option<String>| {
        if let Some(v) = p.as_mut() {
            if !v.is_empty() && Path::new(v.as_str()).is_relative() {
                *v = dir.join(v.as_str()).to_string_lossy().into_owned();
            }
        }
    };
    for c in raw.clusters.iter_mut().flatten() {
        if let Some(v) = c.value.as_mut() {
            fix(&mut v.certificate_authority);
        }
    }
    for u in raw.users.iter_mut().flatten() {
        if let Some(v) = u.value.as_mut() {
            fix(&mut v.client_certificate);
            fix(&mut v.client_key);
            fix(&mut v.token_file);
            if let Some(e) = v.exec.as_mut() {
                // Only a command with a path separator is relative to the file; a bare name uses PATH.
                if e.command.as_deref().is_some_and(|c| c.contains('/')) {
                    fix(&mut e.command);
                }
            }
        }
    }
    Ok(raw)
}

/// Merge files as kubectl does: the first file to define a name (or current-context) wins.
fn merge(files: Vec<RawKubeconfig>) -> RawKubeconfig {
    fn add<T>(into: &mut Vec<Named<T>>, from: Option<Vec<Named<T>>>) {
        for item in from.into_iter().flatten() {
            if !into.iter().any(|e| e.name == item.name) {
                into.push(item);
            }
        }
    }
    let mut clusters = Vec::new();
    let mut users = Vec::new();
    let mut contexts = Vec::new();
    let mut current = None;
    for f in files {
        add(&mut clusters, f.clusters);
        add(&mut users, f.users);
        add(&mut contexts, f.contexts);
        if current.is_none() {
            current = f.current_context.filter(|c| !c.is_empty());
        }
    }
    RawKubeconfig {
        clusters: Some(clusters),
        users: Some(users),
        contexts: Some(contexts),
        current_context: current,
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, KubeConfigError> {
    std::fs::read(path).map_err(|error| KubeConfigError::Read {
        path: path.to_path_buf(),
        error,
    })
}

fn decode_b64(what: &str, data: &str) -> Result<Vec<u8>, KubeConfigError> {
    use base64::Engine;
    let cleaned: String = data.chars().filter(|c| !c.is_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(cleaned)
        .map_err(|e| KubeConfigError::Invalid(format!("{what}: not valid base64: {e}")))
}

fn find<T: Clone>(list: &Option<Vec<Named<T>>>, name: &str) -> Option<Named<T>> {
    list.iter().flatten().find(|e| e.name == name).cloned()
}

fn resolve(raw: RawKubeconfig, source: String) -> Result<ClusterConfig, KubeConfigError> {
    let current = raw
        .current_context
        .clone()
        .ok_or_else(|| KubeConfigError::Invalid(format!("{source}: no current-context")))?;
    let ctx: Named<RawContext> = find(&raw.contexts, &current).ok_or_else(|| {
        KubeConfigError::Invalid(format!("{source}: context {current:?} not found"))
    })?;
    let ctx = ctx.value.unwrap_or_default();
    let cluster_name = ctx.cluster.clone().unwrap_or_default();
    let cluster: Named<RawCluster> = find(&raw.clusters, &cluster_name).ok_or_else(|| {
        KubeConfigError::Invalid(format!("{source}: cluster {cluster_name:?} not found"))
    })?;
    let cluster = cluster.value.unwrap_or_default();
    let user = match ctx.user.as_deref().filter(|u| !u.is_empty()) {
        Some(name) => {
            let u: Named<RawUser> = find(&raw.users, name).ok_or_else(|| {
                KubeConfigError::Invalid(format!("{source}: user {name:?} not found"))
            })?;
            u.value.unwrap_or_default()
        }
        None => RawUser::default(),
    };
    let server = cluster
        .server
        .clone()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            KubeConfigError::Invalid(format!("{source}: cluster {cluster_name:?} has no server"))
        })?;
    let ca_pem = match (
        &cluster.certificate_authority_data,
        &cluster.certificate_authority,
    ) {
        (Some(d), _) if !d.is_empty() => Some(decode_b64("certificate-authority-data", d)?),
        (_, Some(p)) if !p.is_empty() => Some(read_file(Path::new(p))?),
        _ => None,
    };
    let cert = match (&user.client_certificate_data, &user.client_certificate) {
        (Some(d), _) if !d.is_empty() => Some(decode_b64("client-certificate-data", d)?),
        (_, Some(p)) if !p.is_empty() => Some(read_file(Path::new(p))?),
        _ => None,
    };
    let key = match (&user.client_key_data, &user.client_key) {
        (Some(d), _) if !d.is_empty() => Some(decode_b64("client-key-data", d)?),
        (_, Some(p)) if !p.is_empty() => Some(read_file(Path::new(p))?),
        _ => None,
    };
    let client_cert = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            return Err(KubeConfigError::Invalid(format!(
                "{source}: client certificate and client key must be given together"
            )))
        }
    };
    let auth = if let Some(e) = user.exec {
        let command = e.command.filter(|c| !c.is_empty()).ok_or_else(|| {
            KubeConfigError::Invalid(format!("{source}: exec plugin has no command"))
        })?;
        let api_version = e
            .api_version
            .unwrap_or_else(|| "client.authentication.k8s.io/v1".to_string());
        if api_version != "client.authentication.k8s.io/v1"
            && api_version != "client.authentication.k8s.io/v1beta1"
        {
            return Err(KubeConfigError::Invalid(format!(
                "{source}: exec plugin apiVersion {api_version:?} not supported"
            )));
        }
        AuthConfig::Exec(ExecConfig {
            api_version,
            command,
            args: e.args.unwrap_or_default(),
            env: e
                .env
                .unwrap_or_default()
                .into_iter()
                .map(|v| (v.name, v.value))
                .collect(),
            provide_cluster_info: e.provide_cluster_info.unwrap_or(false),
            cluster_server: server.clone(),
            cluster_ca_pem: ca_pem.clone(),
        })
    } else if let Some(t) = user.token.filter(|t| !t.is_empty()) {
        AuthConfig::Token(t)
    } else if let Some(p) = user.token_file.filter(|t| !t.is_empty()) {
        AuthConfig::TokenFile(PathBuf::from(p))
    } else if let (Some(username), Some(password)) = (user.username, user.password) {
        AuthConfig::Basic { username, password }
    } else {
        AuthConfig::None
    };
    Ok(ClusterConfig {
        server: server.trim_end_matches('/').to_string(),
        ca_pem,
        insecure_skip_tls_verify: cluster.insecure_skip_tls_verify.unwrap_or(false),
        tls_server_name: cluster.tls_server_name.filter(|s| !s.is_empty()),
        client_cert,
        auth,
        namespace: ctx.namespace,
        source: format!("{source} context {current:?}"),
    })
}

/// Reads at most one byte past `MAX_KUBECONFIG_BYTES` (a device or huge file cannot fill memory;
/// `parse_file` then refuses the oversize text).
fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_KUBECONFIG_BYTES as u64 + 1)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// Load and merge the given kubeconfig files (missing ones are skipped, as kubectl does).
/// Returns None when none of them exists.
pub fn load_files(paths: &[PathBuf]) -> Result<Option<ClusterConfig>, KubeConfigError> {
    let mut parsed = Vec::new();
    let mut names = Vec::new();
    for p in paths {
        let text = match read_bounded(p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => {
                return Err(KubeConfigError::Read {
                    path: p.clone(),
                    error,
                })
            }
        };
        parsed.push(parse_file(p, &text)?);
        names.push(p.display().to_string());
    }
    if parsed.is_empty() {
        return Ok(None);
    }
    resolve(merge(parsed), format!("kubeconfig {}", names.join(":"))).map(Some)
}

/// In-cluster configuration from the service-account mount.
pub fn in_cluster(opts: &KubeOptions) -> Result<Option<ClusterConfig>, KubeConfigError> {
    let (Some(host), Some(port)) = (&opts.service_host, &opts.service_port) else {
        return Ok(None);
    };
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    let ca_pem = match std::fs::read(&opts.sa_ca_path) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => {
            return Err(KubeConfigError::Read {
                path: opts.sa_ca_path.clone(),
                error,
            })
        }
    };
    Ok(Some(ClusterConfig {
        server: format!("https://{host}:{port}"),
        ca_pem,
        insecure_skip_tls_verify: false,
        tls_server_name: None,
        client_cert: None,
        auth: AuthConfig::TokenFile(opts.sa_token_path.clone()),
        namespace: None,
        source: "in-cluster service account".to_string(),
    }))
}

/// The lookup order: KUBECONFIG list, then ~/.kube/config, then in-cluster.
pub fn load(opts: &KubeOptions) -> Result<ClusterConfig, KubeConfigError> {
    if let Some(list) = opts.kubeconfig.as_deref().filter(|s| !s.is_empty()) {
        let paths: Vec<PathBuf> = list
            .split(':')
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
        if let Some(c) = load_files(&paths)? {
            return Ok(c);
        }
        log::warn!(
            "KUBECONFIG={list}: no listed file exists; trying ~/.kube/config and in-cluster"
        );
    }
    if let Some(home) = &opts.home {
        if let Some(c) = load_files(&[home.join(".kube").join("config")])? {
            return Ok(c);
        }
    }
    in_cluster(opts)?.ok_or(KubeConfigError::NoConfig)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = r#"
apiVersion: v1
kind: Config
current-context: a
clusters:
- name: c1
  cluster:
    server: https://127.0.0.1:6443/
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
    tls-server-name: kubernetes
- name: shared
  cluster:
    server: https://first.example:1
contexts:
- name: a
  context:
    cluster: c1
    user: u1
    namespace: ns1
users:
- name: u1
  user:
    token: abc
"#;

    const B: &str = r#"
current-context: b
clusters:
- name: shared
  cluster:
    server: https://second.example:2
    insecure-skip-tls-verify: true
contexts:
- name: b
  context: {cluster: shared, user: u2}
users:
- name: u2
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1beta1
      command: ./plugin.sh
      args: ["--x", "1"]
      env: [{name: FOO, value: bar}]
      provideClusterInfo: true
- name: u3
  user:
    tokenFile: tok
"#;

    #[test]
    fn merges_first_wins_and_resolves_current_context() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        let b = dir.path().join("b.yaml");
        std::fs::write(&a, A).unwrap();
        std::fs::write(&b, B).unwrap();
        let missing = dir.path().join("missing");
        let c = load_files(&[missing.clone(), a.clone(), b.clone()])
            .unwrap()
            .unwrap();
        assert_eq!(c.server, "https://127.0.0.1:6443");
        assert_eq!(c.auth, AuthConfig::Token("abc".into()));
        assert_eq!(c.tls_server_name.as_deref(), Some("kubernetes"));
        assert_eq!(
            c.ca_pem.as_deref(),
            Some(&b"-----BEGIN CERTIFICATE-----\n"[..])
        );
        assert_eq!(c.namespace.as_deref(), Some("ns1"));

        // b first: current-context b, and the shared cluster from b wins.
        let c = load_files(&[b.clone(), a.clone()]).unwrap().unwrap();
        assert_eq!(c.server, "https://second.example:2");
        assert!(c.insecure_skip_tls_verify);
        match c.auth {
            AuthConfig::Exec(e) => {
                assert_eq!(e.api_version, "client.authentication.k8s.io/v1beta1");
                assert_eq!(Path::new(&e.command), dir.path().join("plugin.sh"));
                assert_eq!(e.args, vec!["--x", "1"]);
                assert_eq!(e.env, vec![("FOO".to_string(), "bar".to_string())]);
                assert!(e.provide_cluster_info);
            }
            other => panic!("expected exec auth, got {other:?}"),
        }
        // a first: the shared cluster from a would win, but the context is a's.
        assert_eq!(load_files(&[missing]).unwrap(), None);
    }

    #[test]
    fn bad_files_give_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad");
        std::fs::write(&p, "clusters: [unclosed").unwrap();
        assert!(matches!(
            load_files(std::slice::from_ref(&p)),
            Err(KubeConfigError::Parse { .. })
        ));
        std::fs::write(&p, "clusters: 5\n").unwrap();
        assert!(matches!(
            load_files(std::slice::from_ref(&p)),
            Err(KubeConfigError::Parse { .. })
        ));
        // Nine levels of ten aliases each: a billion nodes if the loader expanded them.
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (prev, name) in ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
            .windows(2)
            .map(|w| (w[0], w[1]))
        {
            let refs = vec![format!("*{prev}"); 10].join(", ");
            bomb.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        bomb.push_str("clusters: []\n");
        std::fs::write(&p, &bomb).unwrap();
        let e = load_files(std::slice::from_ref(&p)).unwrap_err();
        assert!(e.to_string().contains("alias bomb"), "{e}");
        std::fs::write(&p, format!("x: {}1{}\n", "[".repeat(200), "]".repeat(200))).unwrap();
        let e = load_files(std::slice::from_ref(&p)).unwrap_err();
        assert!(e.to_string().contains("nested deeper"), "{e}");
        std::fs::write(&p, "x".repeat(MAX_KUBECONFIG_BYTES + 10)).unwrap();
        let e = load_files(std::slice::from_ref(&p)).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        // Aliases within budget still load (kubeconfigs use them for shared users).
        let shared = A.to_string() + "extra: &u {name: u}\nmore: [*u, *u]\n";
        std::fs::write(&p, shared).unwrap();
        assert!(load_files(std::slice::from_ref(&p)).is_ok());
        std::fs::write(&p, "current-context: nope\ncontexts: []\n").unwrap();
        let e = load_files(std::slice::from_ref(&p)).unwrap_err();
        assert!(e.to_string().contains("context \"nope\" not found"), "{e}");
        let text = A.replace(
            "certificate-authority-data: LS0t",
            "certificate-authority-data: not*base64",
        );
        std::fs::write(&p, text).unwrap();
        assert!(matches!(load_files(&[p]), Err(KubeConfigError::Invalid(_))));
    }

    #[test]
    fn lookup_order_falls_back_to_home_then_in_cluster() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".kube")).unwrap();
        std::fs::write(dir.path().join(".kube/config"), A).unwrap();
        let mut o = KubeOptions {
            kubeconfig: Some(dir.path().join("nothere").to_string_lossy().into_owned()),
            home: Some(dir.path().to_path_buf()),
            ..KubeOptions::default()
        };
        assert_eq!(load(&o).unwrap().server, "https://127.0.0.1:6443");
        o.home = None;
        assert!(matches!(load(&o), Err(KubeConfigError::NoConfig)));
        o.service_host = Some("fd00::1".into());
        o.service_port = Some("443".into());
        o.sa_token_path = dir.path().join("token");
        o.sa_ca_path = dir.path().join("ca.crt");
        let c = load(&o).unwrap();
        assert_eq!(c.server, "https://[fd00::1]:443");
        assert_eq!(c.auth, AuthConfig::TokenFile(dir.path().join("token")));
        assert_eq!(c.ca_pem, None);
    }
}
