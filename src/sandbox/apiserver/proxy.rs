//! The kubelet-facing subresources: pods/log, exec, attach, portforward and nodes/proxy are
//! forwarded to the node's kubelet API with the API server's own client certificate.
//!
//! As kube-apiserver does, the node's address and kubelet port come from the Node object, the
//! kubelet's serving certificate is not verified (no kubelet CA is configured), and after the
//! request is sent the bytes flow both ways untouched, so SPDY and WebSocket upgrades, followed
//! logs and plain responses all pass through the same pump.

use super::http::Request;
use super::meta::ApiError;
use super::{resources, Shared};
use crate::percent::encode as enc;
use rustls::{ClientConnection, ServerConnection, StreamOwned};
use serde_json::Value;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// The identity the fake presents to kubelets (kube-apiserver's `--kubelet-client-certificate`).
pub const KUBELET_CLIENT_USER: &str = "kube-apiserver-kubelet-client";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one direction of the pump waits for bytes before looking at the other one.
const PUMP_SLICE: Duration = Duration::from_millis(15);

/// A request path that belongs to a kubelet rather than to the object store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeletTarget {
    /// pods/{log,exec,attach,portforward}: namespace, pod, subresource.
    Pod(String, String, String),
    /// nodes/NAME/proxy/REST: node name and the kubelet path (with its leading slash).
    Node(String, String),
}

/// Recognises the proxied subresources; everything else is served from the store.
pub fn kubelet_target(path: &str) -> Option<KubeletTarget> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match segs.as_slice() {
        ["api", "v1", "namespaces", ns, "pods", name, sub]
            if matches!(*sub, "log" | "exec" | "attach" | "portforward") =>
        {
            Some(KubeletTarget::Pod(
                ns.to_string(),
                name.to_string(),
                sub.to_string(),
            ))
        }
        ["api", "v1", "nodes", name, "proxy", rest @ ..] => Some(KubeletTarget::Node(
            name.to_string(),
            format!("/{}", rest.join("/")),
        )),
        _ => None,
    }
}

impl KubeletTarget {
    /// The (verb, resource) pair as RBAC names it, for the request log and faults.
    pub fn verb_and_resource(&self, method: &str) -> (String, String) {
        let verb = match method {
            "GET" => "get",
            "POST" => "create",
            _ => "unknown",
        };
        let resource = match self {
            KubeletTarget::Pod(_, _, sub) => format!("pods/{sub}"),
            KubeletTarget::Node(..) => "nodes/proxy".to_string(),
        };
        (verb.to_string(), resource)
    }
}

/// Where to send a request and what to ask for: kubelet address and request target.
pub struct Upstream {
    pub addr: SocketAddr,
    pub path_and_query: String,
}

/// Maps the API request onto the kubelet's own paths (containerLogs, exec, attach, portForward).
pub fn resolve(
    shared: &Shared,
    target: &KubeletTarget,
    req: &Request,
) -> Result<Upstream, ApiError> {
    let (node_name, path, query) = match target {
        KubeletTarget::Node(node, rest) => (node.clone(), rest.clone(), req.query.clone()),
        KubeletTarget::Pod(ns, name, sub) => {
            let pod = shared
                .store
                .get(resources::pods(), ns, name)
                .ok_or_else(|| ApiError::not_found("", "pods", name))?;
            let node = pod["spec"]["nodeName"].as_str().unwrap_or("").to_string();
            if node.is_empty() {
                return Err(ApiError::bad_request(format!(
                    "pod {name} does not have a host assigned"
                )));
            }
            let mut query: Vec<(String, String)> = req
                .query
                .iter()
                .filter(|(k, _)| k != "container")
                .cloned()
                .collect();
            let path = if sub == "portforward" {
                format!("/portForward/{}/{}", enc(ns), enc(name))
            } else {
                let container = container_of(&pod, req.query("container"))?;
                let kind = match sub.as_str() {
                    "log" => "containerLogs",
                    other => other,
                };
                if sub != "log" {
                    query.push(("container".into(), container.clone()));
                }
                format!("/{kind}/{}/{}/{}", enc(ns), enc(name), enc(&container))
            };
            (node, path, query)
        }
    };
    let node = shared
        .store
        .get(resources::nodes(), "", &node_name)
        .ok_or_else(|| ApiError::not_found("", "nodes", &node_name))?;
    let addr = kubelet_addr(&node).ok_or_else(|| {
        ApiError::new(
            503,
            "ServiceUnavailable",
            format!("node {node_name:?} publishes no address and kubelet port"),
        )
    })?;
    let mut path_and_query = path;
    if !query.is_empty() {
        let pairs: Vec<String> = query
            .iter()
            .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
            .collect();
        path_and_query = format!("{path_and_query}?{}", pairs.join("&"));
    }
    Ok(Upstream {
        addr,
        path_and_query,
    })
}

/// The container a pod subresource addresses: the one named, the default-container annotation,
/// or the only one; otherwise the API server's own "must be specified" error.
fn container_of(pod: &Value, named: Option<&str>) -> Result<String, ApiError> {
    let names: Vec<&str> = pod["spec"]["containers"]
        .as_array()
        .map(|cs| cs.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    let pod_name = pod["metadata"]["name"].as_str().unwrap_or("");
    if let Some(n) = named.filter(|n| !n.is_empty()) {
        if names.contains(&n) {
            return Ok(n.to_string());
        }
        return Err(ApiError::bad_request(format!(
            "container {n} is not valid for pod {pod_name}"
        )));
    }
    let default = pod["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"]
        .as_str()
        .filter(|d| names.contains(d));
    match (default, names.as_slice()) {
        (Some(d), _) => Ok(d.to_string()),
        (None, [only]) => Ok(only.to_string()),
        _ => Err(ApiError::bad_request(format!(
            "a container name must be specified for pod {pod_name}, choose one of: {names:?}"
        ))),
    }
}

/// InternalIP (else the first address) and status.daemonEndpoints.kubeletEndpoint.Port.
pub fn kubelet_addr(node: &Value) -> Option<SocketAddr> {
    let port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"].as_u64()?;
    let port = u16::try_from(port).ok().filter(|p| *p != 0)?;
    let addrs = node["status"]["addresses"].as_array()?;
    let ip = addrs
        .iter()
        .find(|a| a["type"] == "InternalIP")
        .or_else(|| addrs.first())
        .and_then(|a| a["address"].as_str())?
        .parse()
        .ok()?;
    Some(SocketAddr::new(ip, port))
}

/// Opens a TLS connection to the kubelet with the fake's kubelet client certificate.
pub fn connect(
    config: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
) -> io::Result<StreamOwned<ClientConnection, TcpStream>> {
    let tcp = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let conn = ClientConnection::new(config, name).map_err(io::Error::other)?;
    let mut tls = StreamOwned::new(conn, tcp);
    tls.sock.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// The request head and body sent to the kubelet: the client's headers minus its credentials
/// and framing; upgrades keep their Connection/Upgrade headers, everything else asks to close.
pub fn request_bytes(req: &Request, upstream: &Upstream) -> Vec<u8> {
    let upgrade = req.header("upgrade").is_some();
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {}\r\n",
        req.method, upstream.path_and_query, upstream.addr
    );
    for (k, v) in &req.headers {
        let lower = k.to_ascii_lowercase();
        let dropped = matches!(
            lower.as_str(),
            "host" | "authorization" | "content-length" | "transfer-encoding" | "expect"
        ) || (lower == "connection" && !upgrade)
            || lower.starts_with("impersonate-");
        if !dropped {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    if !upgrade {
        head.push_str("Connection: close\r\n");
    }
    if !req.body.is_empty() {
        head.push_str(&format!("Content-Length: {}\r\n", req.body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(&req.body);
    out
}

fn idle(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Copies bytes both ways until either side closes (or fails). `pending` are bytes the client
/// sent after its request head, already read from the socket.
pub fn pump(
    client: &mut StreamOwned<ServerConnection, TcpStream>,
    kubelet: &mut StreamOwned<ClientConnection, TcpStream>,
    pending: &[u8],
) -> io::Result<()> {
    if !pending.is_empty() {
        kubelet.write_all(pending)?;
    }
    kubelet.flush()?;
    client.sock.set_read_timeout(Some(PUMP_SLICE))?;
    kubelet.sock.set_read_timeout(Some(PUMP_SLICE))?;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match kubelet.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                client.write_all(&buf[..n])?;
                client.flush()?;
                continue;
            }
            Err(e) if idle(&e) => {}
            // A kubelet that closes without close_notify has still said all it had to say.
            Err(_) => break,
        }
        match client.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                kubelet.write_all(&buf[..n])?;
                kubelet.flush()?;
            }
            Err(e) if idle(&e) => {}
            Err(e) => return Err(e),
        }
    }
    kubelet.conn.send_close_notify();
    let _ = kubelet.flush();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn targets_are_recognised() {
        assert_eq!(
            kubelet_target("/api/v1/namespaces/default/pods/p/log"),
            Some(KubeletTarget::Pod(
                "default".into(),
                "p".into(),
                "log".into()
            ))
        );
        assert_eq!(
            kubelet_target("/api/v1/nodes/n1/proxy/stats/summary"),
            Some(KubeletTarget::Node("n1".into(), "/stats/summary".into()))
        );
        assert_eq!(
            kubelet_target("/api/v1/namespaces/default/pods/p/status"),
            None
        );
        assert_eq!(kubelet_target("/api/v1/nodes/n1"), None);
    }

    #[test]
    fn containers_default_like_the_api_server() {
        let one = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "agent"}]}});
        assert_eq!(container_of(&one, None).unwrap(), "agent");
        assert!(container_of(&one, Some("other")).is_err());
        let two = json!({"metadata": {"name": "p", "annotations":
            {"kubectl.kubernetes.io/default-container": "b"}},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(container_of(&two, None).unwrap(), "b");
        let mut plain = two.clone();
        plain["metadata"]["annotations"] = json!({});
        let err = container_of(&plain, None).unwrap_err();
        assert_eq!(err.code, 400);
    }

    #[test]
    fn kubelet_address_comes_from_the_node() {
        let node = json!({"status": {
            "addresses": [{"type": "Hostname", "address": "h"}, {"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}}}});
        assert_eq!(
            kubelet_addr(&node),
            Some("127.0.0.1:10250".parse().unwrap())
        );
        assert_eq!(kubelet_addr(&json!({"status": {}})), None);
    }

    #[test]
    fn requests_drop_credentials_and_keep_upgrades() {
        let req = Request {
            method: "POST".into(),
            headers: vec![
                ("Authorization".into(), "Bearer secret".into()),
                ("Connection".into(), "Upgrade".into()),
                ("Upgrade".into(), "SPDY/3.1".into()),
            ],
            ..Default::default()
        };
        let up = Upstream {
            addr: "127.0.0.1:1".parse().unwrap(),
            path_and_query: "/exec/a/b/c?command=ls".into(),
        };
        let text = String::from_utf8(request_bytes(&req, &up)).unwrap();
        assert!(text.starts_with("POST /exec/a/b/c?command=ls HTTP/1.1\r\n"));
        assert!(!text.contains("secret"));
        assert!(text.contains("Connection: Upgrade\r\n"));
        assert_eq!(enc("a b/c"), "a%20b%2Fc");
    }
}
