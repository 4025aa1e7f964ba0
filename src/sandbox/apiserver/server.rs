//! Transport: the accept thread, one thread per TLS connection (blocking rustls StreamOwned),
//! authentication, fault injection, request logging, and stop/restart of the listener.

use super::handlers::{self, Reply, Target};
use super::http::{self, HttpError, Response};
use super::meta::ApiError;
use super::tls::CertIdentity;
use super::watch::{self, WatchEnd};
use super::{proxy, RequestRecord, Shared, TokenPolicy};
use rustls::{ServerConnection, StreamOwned};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Idle keep-alive connections are closed after this long (Go's client idles out at 90 s).
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// A peer that stops reading a response for this long is cut off.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// A running accept loop.
pub struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    pub fn start(shared: Arc<Shared>, addr: SocketAddr) -> io::Result<Listener> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("fake-apiserver-accept".into())
            .spawn(move || accept_loop(listener, shared, stop2))?;
        Ok(Listener {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting; returns once the listening socket is closed.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept() with a throwaway connection.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let tcp = match stream {
            Ok(s) => s,
            Err(e) => {
                log::debug!("fake apiserver: accept failed: {e}");
                // Out of descriptors and similar: do not spin.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("fake-apiserver-conn".into())
            .spawn(move || {
                let id = shared.register_conn(&tcp);
                if let Err(e) = serve_connection(&shared, tcp) {
                    log::debug!("fake apiserver: connection ended: {e}");
                }
                shared.unregister_conn(id);
            });
        if let Err(e) = spawned {
            log::warn!("fake apiserver: cannot spawn connection thread: {e}");
        }
    }
}

fn serve_connection(shared: &Shared, tcp: TcpStream) -> io::Result<()> {
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(IDLE_TIMEOUT))?;
    tcp.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let conn = ServerConnection::new(shared.tls.clone()).map_err(io::Error::other)?;
    let mut tls = StreamOwned::new(conn, tcp);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    let cert_identity = tls
        .conn
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|der| shared.authority.identity_of(der.as_ref()));

    let mut buf = Vec::new();
    loop {
        let req = match http::read_request(&mut tls, &mut buf) {
            Ok(r) => r,
            Err(HttpError::Closed) => break,
            Err(HttpError::Io(e)) => return Err(e),
            Err(HttpError::Bad(msg)) => {
                let resp = Response::json(400, &ApiError::bad_request(msg).status());
                http::write_response(&mut tls, &resp, false)?;
                break;
            }
            Err(HttpError::TooLarge) => {
                let err = ApiError::new(413, "RequestEntityTooLarge", "request is too large");
                http::write_response(&mut tls, &Response::json(413, &err.status()), false)?;
                break;
            }
        };
        if let Some(target) = proxy::kubelet_target(&req.path) {
            // The connection belongs to the kubelet exchange from here on (upgrades included).
            return serve_kubelet(shared, tls, &req, &buf, &target, cert_identity.as_ref());
        }
        let keep_alive = !req.wants_close();
        match dispatch(shared, &req, cert_identity.as_ref()) {
            Reply::Response(resp) => {
                http::write_response(&mut tls, &resp, keep_alive)?;
                if !keep_alive {
                    break;
                }
            }
            Reply::Watch(spec) => {
                let sock = tls.sock.try_clone()?;
                match watch::serve(shared, &mut tls, &sock, spec)? {
                    // The body is complete, so the connection is reusable, as with the API
                    // server's HTTP stack; the client pooled it (the head did not say close),
                    // and closing it here would fail the client's next request on it.
                    WatchEnd::Clean if keep_alive => {}
                    WatchEnd::Clean => break,
                    WatchEnd::Abrupt => return Ok(()),
                }
            }
        }
    }
    tls.conn.send_close_notify();
    let _ = tls.flush();
    let _ = tls.sock.shutdown(Shutdown::Both);
    Ok(())
}

/// Forwards a pods/log, exec, attach, portforward or nodes/proxy request to the kubelet and
/// pumps bytes until either side is done; errors before that get an API Status answer.
fn serve_kubelet(
    shared: &Shared,
    mut tls: StreamOwned<ServerConnection, TcpStream>,
    req: &http::Request,
    pending: &[u8],
    target: &proxy::KubeletTarget,
    cert: Option<&CertIdentity>,
) -> io::Result<()> {
    let started = Instant::now();
    let (verb, resource) = target.verb_and_resource(&req.method);
    let user = authenticate(shared, req, cert);
    let upstream = match &user {
        None => Err(ApiError::unauthorized()),
        Some(_) => proxy::resolve(shared, target, req),
    };
    let connected = upstream.and_then(|up| {
        let unavailable = |e: String| ApiError::new(503, "ServiceUnavailable", e);
        let config = shared.kubelet_client().map_err(unavailable)?;
        let mut kubelet = proxy::connect(config, up.addr)
            .map_err(|e| unavailable(format!("error dialing kubelet {}: {e}", up.addr)))?;
        kubelet
            .write_all(&proxy::request_bytes(req, &up))
            .map_err(|e| unavailable(format!("kubelet {}: {e}", up.addr)))?;
        Ok(kubelet)
    });
    let status = match connected {
        Ok(mut kubelet) => {
            if let Err(e) = proxy::pump(&mut tls, &mut kubelet, pending) {
                log::debug!("fake apiserver: kubelet proxy ended: {e}");
            }
            // The kubelet's status line went to the client unread; 101 and 200 are the usual.
            if req.header("upgrade").is_some() {
                101
            } else {
                200
            }
        }
        Err(e) => {
            let resp = Response::json(e.code, &e.status());
            http::write_response(&mut tls, &resp, false)?;
            e.code
        }
    };
    shared.record(RequestRecord {
        method: req.method.clone(),
        path: req.path.clone(),
        query: req.query.clone(),
        verb,
        resource,
        user: user.unwrap_or_default(),
        status,
        content_type: req.header("content-type").map(str::to_string),
        user_agent: req.header("user-agent").map(str::to_string),
        duration: started.elapsed(),
    });
    tls.conn.send_close_notify();
    let _ = tls.flush();
    let _ = tls.sock.shutdown(Shutdown::Both);
    Ok(())
}

/// The authenticated user, or None when the request must get 401.
fn authenticate(
    shared: &Shared,
    req: &http::Request,
    cert: Option<&CertIdentity>,
) -> Option<String> {
    let auth = shared.auth();
    if let Some(c) = cert.filter(|_| auth.client_certs) {
        return Some(c.user.clone());
    }
    if let Some(token) = req
        .header("authorization")
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::trim)
    {
        let accepted = match &auth.tokens {
            TokenPolicy::Any => !token.is_empty(),
            TokenPolicy::Only(set) => set.iter().any(|t| t == token),
            TokenPolicy::Reject => false,
        };
        if !accepted {
            return None;
        }
        let user = shared
            .token_user(token)
            .map(|u| u.username)
            .unwrap_or_else(|| "token-user".to_string());
        return Some(user);
    }
    auth.anonymous.then(|| "system:anonymous".to_string())
}

/// RBAC's refusal, worded as kube-apiserver words it.
fn forbidden(user: &str, verb: &str, rp: &handlers::ResourcePath) -> ApiError {
    let what = match &rp.name {
        Some(n) => format!("{} \"{n}\"", rp.def.plural),
        None => rp.def.plural.to_string(),
    };
    let scope = match &rp.namespace {
        Some(ns) => format!(" in the namespace \"{ns}\""),
        None => " at the cluster scope".to_string(),
    };
    ApiError::new(
        403,
        "Forbidden",
        format!(
            "{what} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\"{scope}",
            rp.resource_name(),
            rp.def.group
        ),
    )
}

fn error_reply(e: &ApiError) -> Reply {
    let mut resp = Response::json(e.code, &e.status());
    if let Some(secs) = e.retry_after {
        resp.headers.push(("Retry-After".into(), secs.to_string()));
    }
    Reply::Response(resp)
}

/// Authenticates, applies latency and faults, serves, and records the request.
fn dispatch(shared: &Shared, req: &http::Request, cert: Option<&CertIdentity>) -> Reply {
    let started = Instant::now();
    let target = handlers::parse_target(&req.path);
    let (verb, resource) = match &target {
        Ok(Target::Resource(rp)) => (rp.verb(req).to_string(), rp.resource_name()),
        _ => ("get".to_string(), String::new()),
    };
    let latency = shared.faults.delay_for(&verb, &resource);
    if !latency.is_zero() {
        std::thread::sleep(latency);
    }
    let open = matches!(target, Ok(Target::Health | Target::Version));
    let metrics = super::metrics::metrics_target(&req.path);
    let user = authenticate(shared, req, cert);
    let reply = match (&target, &user, &metrics) {
        (_, None, _) if !open => error_reply(&ApiError::unauthorized()),
        // metrics.k8s.io is computed from the kubelets, not kept in the store.
        (_, _, Some(m)) => Reply::Response(super::metrics::handle(shared, req, m)),
        (Err(e), _, _) => error_reply(e),
        (Ok(Target::Resource(rp)), Some(u), _) if shared.denies(&verb, &resource) => {
            error_reply(&forbidden(u, &verb, rp))
        }
        (Ok(Target::Resource(rp)), _, _) => match shared.faults.take(&verb, &resource) {
            Some(fault) if verb == "watch" => {
                match handlers::handle_resource(shared, req, rp, &verb) {
                    Ok(Reply::Watch(mut spec)) => match watch::injected(&mut spec, fault) {
                        None => Reply::Watch(spec),
                        Some(e) => error_reply(&e),
                    },
                    Ok(other) => other,
                    Err(e) => error_reply(&e),
                }
            }
            Some(fault) => error_reply(&fault.error(&resource)),
            None => match handlers::handle_resource(shared, req, rp, &verb) {
                Ok(r) => r,
                Err(e) => error_reply(&e),
            },
        },
        (Ok(t), _, _) => match handlers::handle_meta(shared, t) {
            Ok(r) => r,
            Err(e) => error_reply(&e),
        },
    };
    let status = match &reply {
        Reply::Response(r) => r.status,
        Reply::Watch(_) => 200,
    };
    shared.record(RequestRecord {
        method: req.method.clone(),
        path: req.path.clone(),
        query: req.query.clone(),
        verb,
        resource,
        user: user.unwrap_or_default(),
        status,
        content_type: req.header("content-type").map(str::to_string),
        user_agent: req.header("user-agent").map(str::to_string),
        duration: started.elapsed(),
    });
    reply
}
