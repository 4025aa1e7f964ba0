//! Callers of the peer snapshot listener for its tests: one GET over TLS (with or without a
//! client certificate) or in plain HTTP, from a chosen loopback source address, the whole
//! response back as text.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, StreamOwned};

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A TCP connection to `addr` from `source`.
pub fn connect_from(addr: SocketAddr, source: &str) -> TcpStream {
    connect_with(addr, source, None)
}

/// A TCP connection to `addr` from `source`, with a receive buffer of `recv_buffer` bytes
/// when given (a reader that holds the server up without the kernel queueing megabytes).
pub fn connect_with(addr: SocketAddr, source: &str, recv_buffer: Option<usize>) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    if let Some(n) = recv_buffer {
        s.set_recv_buffer_size(n).unwrap();
    }
    s.bind(&SocketAddr::new(ip(source), 0).into()).unwrap();
    s.connect(&addr.into()).unwrap();
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// TLS that presents no client certificate and accepts any server certificate.
pub fn without_certificate() -> Arc<ClientConfig> {
    vk_cocoon::kube::tls::client_config(&vk_cocoon::kube::tls::TlsParams {
        ca_pem: None,
        insecure_skip_tls_verify: true,
        tls_server_name: None,
        client_cert: None,
    })
    .unwrap()
}

/// TLS presenting the client certificate `(cert PEM, key PEM)`.
pub fn with_certificate(pair: &(String, String)) -> Arc<ClientConfig> {
    vk_cocoon::peer::client::client_tls(pair.0.as_bytes(), pair.1.as_bytes()).unwrap()
}

/// A TLS connection to `addr` from `source` whose request `target` has gone out.
pub fn tls_request(
    addr: SocketAddr,
    source: &str,
    tls: &Arc<ClientConfig>,
    target: &str,
) -> std::io::Result<StreamOwned<ClientConnection, TcpStream>> {
    tls_request_over(connect_from(addr, source), tls, target)
}

/// The request `target` over TLS on the connection `sock`.
pub fn tls_request_over(
    sock: TcpStream,
    tls: &Arc<ClientConfig>,
    target: &str,
) -> std::io::Result<StreamOwned<ClientConnection, TcpStream>> {
    let addr = sock.peer_addr()?;
    let conn = ClientConnection::new(tls.clone(), ServerName::IpAddress(addr.ip().into())).unwrap();
    let mut s = StreamOwned::new(conn, sock);
    write!(s, "GET {target} HTTP/1.1\r\nHost: x\r\n\r\n")?;
    s.flush()?;
    Ok(s)
}

/// One GET over TLS; the response as text (lossy), or `TLS error: …` when the connection
/// failed before a response.
pub fn tls_get(addr: SocketAddr, source: &str, tls: &Arc<ClientConfig>, target: &str) -> String {
    let mut out = Vec::new();
    let r = tls_request(addr, source, tls, target).and_then(|mut s| s.read_to_end(&mut out));
    match r {
        Err(e) if out.is_empty() => format!("TLS error: {e}"),
        _ => String::from_utf8_lossy(&out).into_owned(),
    }
}

/// One GET in plain HTTP; the whole response as text (lossy).
pub fn plain_get(addr: SocketAddr, source: &str, target: &str) -> String {
    let mut s = connect_from(addr, source);
    let mut out = Vec::new();
    if write!(s, "GET {target} HTTP/1.1\r\nHost: x\r\n\r\n").is_ok() {
        let _ = s.read_to_end(&mut out);
    }
    String::from_utf8_lossy(&out).into_owned()
}
