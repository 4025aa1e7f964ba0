//! Blocking HTTP on ureq for the API server and registry clients: agents that speak TLS with the
//! caller's own rustls configuration, and answers split into status failures and transport ones.
//!
//! ureq's own TLS settings cannot carry what these clients verify with: the daemon's clock
//! (`wall_clock::TlsClock`), a kubeconfig's `tls-server-name`, insecure-skip-tls-verify. So the
//! agents are built on ureq's connector interface with a TLS step that uses a prebuilt
//! `rustls::ClientConfig`; ureq's own TLS (rustls, webpki-roots, native-tls) is not compiled in.
//! Every agent answers 4xx / 5xx as responses and reads no proxy from the environment; [`checked`]
//! turns a status of 400 or more into [`CallError::Status`], as callers expect.

use std::fmt;
use std::io::{Read, Write};
use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, StreamOwned};
use ureq::config::ConfigBuilder;
use ureq::typestate::AgentScope;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, Either, LazyBuffers, NextTimeout, TcpConnector,
    Transport, TransportAdapter,
};

/// A response with its streaming body.
pub type Response = ureq::http::Response<ureq::Body>;

/// Why a request did not produce a 1xx–3xx answer.
#[derive(Debug)]
pub enum CallError {
    /// The server answered with this status (400 or more); the response is kept for its headers
    /// and body.
    Status(u16, Box<Response>),
    /// No answer: connection, TLS, timeout, protocol or redirect failure.
    Transport(ureq::Error),
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Status(code, _) => write!(f, "HTTP status {code}"),
            CallError::Transport(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for CallError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CallError::Status(..) => None,
            CallError::Transport(e) => Some(e),
        }
    }
}

/// A status of 400 or more becomes [`CallError::Status`]; a transport error
/// [`CallError::Transport`].
pub fn checked(result: Result<Response, ureq::Error>) -> Result<Response, CallError> {
    match result {
        Ok(resp) if resp.status().as_u16() >= 400 => {
            Err(CallError::Status(resp.status().as_u16(), Box::new(resp)))
        }
        Ok(resp) => Ok(resp),
        Err(e) => Err(CallError::Transport(e)),
    }
}

/// The agent settings every client starts from: statuses are answers, not errors (see
/// [`checked`]), and no proxy is taken from the environment (`HTTPS_PROXY` and friends never
/// applied to these clients).
pub fn config() -> ConfigBuilder<AgentScope> {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
}

/// An agent with `config` whose `https` connections use `tls`. Without `tls` an `https` URL
/// fails to connect (the caller only reaches plain `http` servers).
pub fn agent(config: ureq::config::Config, tls: Option<Arc<ClientConfig>>) -> ureq::Agent {
    let connector = ().chain(TcpConnector::default()).chain(RustlsOver { tls });
    ureq::Agent::with_parts(config, connector, LiteralFirst::default())
}

/// ureq's resolver, except that a host written as an IP address is its own answer.
///
/// Why: with a timeout set (every client here sets one), ureq's resolver starts a thread for
/// each request, pooled connection or not, to look the host up; for `127.0.0.1` or an API
/// server's service IP that thread was a large share of a pod write's CPU. Names still go to
/// ureq's resolver, so what a name resolves to is unchanged.
#[derive(Debug, Default)]
struct LiteralFirst {
    names: DefaultResolver,
}

impl Resolver for LiteralFirst {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        match literal_address(uri) {
            Some(addr)
                if config
                    .ip_family()
                    .keep_wanted(std::iter::once(addr))
                    .count()
                    == 1 =>
            {
                let mut found = self.empty();
                found.push(addr);
                Ok(found)
            }
            // A literal of the family the agent does not want fails as ureq fails it.
            _ => self.names.resolve(uri, config, timeout),
        }
    }
}

/// The socket address of `uri` when its host is an IP address (`[..]` around IPv6), with the
/// scheme's default port when it names none. None for a host name or an unknown scheme.
fn literal_address(uri: &ureq::http::Uri) -> Option<std::net::SocketAddr> {
    let authority = uri.authority()?;
    let host = authority.host();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ip: std::net::IpAddr = host.parse().ok()?;
    let port = match (authority.port_u16(), uri.scheme_str()) {
        (Some(port), _) => port,
        (None, Some("https")) => 443,
        (None, Some("http")) => 80,
        _ => return None,
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// A request of any method to `url` with `headers`, for [`ureq::Agent::run`]. A header named
/// twice keeps its last value (a caller's own value replaces a default it was handed).
pub fn request(method: &str, url: &str, headers: &[(&str, &str)]) -> ureq::http::request::Builder {
    let mut b = ureq::http::Request::builder().method(method).uri(url);
    for (i, (k, v)) in headers.iter().enumerate() {
        let replaced = headers[i + 1..]
            .iter()
            .any(|(later, _)| later.eq_ignore_ascii_case(k));
        if !replaced {
            b = b.header(*k, *v);
        }
    }
    b
}

/// The first value of header `name` that is text.
pub fn header<'a>(resp: &'a Response, name: &str) -> Option<&'a str> {
    resp.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Every value of header `name` that is text, in order.
pub fn header_all<'a>(resp: &'a Response, name: &str) -> Vec<&'a str> {
    resp.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect()
}

/// Wraps the chained TCP connection in TLS with a fixed rustls configuration.
struct RustlsOver {
    tls: Option<Arc<ClientConfig>>,
}

impl fmt::Debug for RustlsOver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RustlsOver")
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl<In: Transport> Connector<In> for RustlsOver {
    type Out = Either<In, TlsTransport>;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<In>,
    ) -> Result<Option<Self::Out>, ureq::Error> {
        let Some(transport) = chained else {
            return Ok(None);
        };
        if !details.needs_tls() || transport.is_tls() {
            return Ok(Some(Either::A(transport)));
        }
        let Some(tls) = &self.tls else {
            return Err(ureq::Error::Tls("https without a TLS configuration"));
        };
        let host = details
            .uri
            .authority()
            .map(|a| a.host())
            .ok_or(ureq::Error::Tls("https URL without a host"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let name = ServerName::try_from(host.to_string())
            .map_err(|_| ureq::Error::Tls("https host is not a valid TLS server name"))?;
        let mut conn = ClientConnection::new(tls.clone(), name)
            .map_err(|e| ureq::Error::Io(std::io::Error::other(e)))?;
        let mut sock = TransportAdapter::new(transport.boxed(), details.current_time.clone());
        sock.set_timeout(details.timeout);
        // A certificate failure arrives as an io::Error wrapping the rustls::Error, which
        // `snapshots::trust::certificate_problem` looks for.
        conn.complete_io(&mut sock)?;
        let buffers = LazyBuffers::new(
            details.config.input_buffer_size(),
            details.config.output_buffer_size(),
        );
        Ok(Some(Either::B(TlsTransport {
            buffers,
            stream: StreamOwned { conn, sock },
        })))
    }
}

/// One TLS connection as a ureq transport.
pub struct TlsTransport {
    buffers: LazyBuffers,
    stream: StreamOwned<ClientConnection, TransportAdapter>,
}

impl fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsTransport").finish()
    }
}

impl Transport for TlsTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        self.stream.get_mut().set_timeout(timeout);
        let output = &self.buffers.output()[..amount];
        self.stream.write_all(output)?;
        Ok(())
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.stream.get_mut().set_timeout(timeout);
        let input = self.buffers.input_append_buf();
        let amount = self.stream.read(input)?;
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        self.stream.get_mut().get_mut().is_open()
    }

    fn is_tls(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_named_twice_keeps_its_last_value() {
        let req = request(
            "PATCH",
            "http://127.0.0.1:1/x",
            &[
                ("Content-Length", "1"),
                ("Accept", "a/b"),
                ("content-length", "2"),
            ],
        )
        .body(())
        .expect("request");
        let lens: Vec<_> = req.headers().get_all("content-length").iter().collect();
        assert_eq!(lens, ["2"]);
        assert_eq!(req.headers()["accept"], "a/b");
        assert_eq!(req.method(), "PATCH");
    }

    #[test]
    fn a_literal_host_is_its_own_address_and_a_name_is_not() {
        let addr = |u: &str| literal_address(&u.parse().expect("uri"));
        assert_eq!(
            addr("https://127.0.0.1:6443/api"),
            Some("127.0.0.1:6443".parse().unwrap())
        );
        assert_eq!(
            addr("https://10.0.0.1/api"),
            Some("10.0.0.1:443".parse().unwrap())
        );
        assert_eq!(addr("http://[::1]/x"), Some("[::1]:80".parse().unwrap()));
        assert_eq!(
            addr("https://[fd00::1]:8443/"),
            Some("[fd00::1]:8443".parse().unwrap())
        );
        assert_eq!(addr("https://localhost:6443/"), None);
        assert_eq!(addr("https://kubernetes.default.svc/"), None);
    }

    #[test]
    fn https_without_a_tls_configuration_does_not_connect() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let agent = agent(config().build(), None);
        let err = checked(agent.get(&format!("https://127.0.0.1:{port}/")).call())
            .expect_err("no TLS configuration");
        assert!(
            err.to_string().contains("without a TLS configuration"),
            "{err}"
        );
    }
}
