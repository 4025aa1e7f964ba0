//! DHCP lease release through cocoon-net's control socket: `DELETE /v1/leases/<mac>`.
//! Blocking with a 5 s deadline, so the daemon runs it on the worker pool; never on the loop.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use socket2::{Domain, SockAddr, Socket, Type};

use super::leases::normalize_mac;

/// cocoon-net's control socket when `VK_COCOON_NET_CONTROL_SOCKET` is unset.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/cocoon-net/control.sock";
/// Dial plus request deadline.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// Error bodies are quoted in the error up to this many bytes.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

#[derive(Debug)]
pub enum ReleaseError {
    /// `VK_COCOON_NET_CONTROL_SOCKET` is set but empty.
    Disabled,
    /// Not a 48-bit MAC.
    InvalidMac(String),
    /// Connecting, writing or reading failed (including the deadline).
    Io { socket: PathBuf, error: io::Error },
    /// The answer was not HTTP.
    BadResponse(String),
    /// cocoon-net answered with something other than 204.
    Status { code: u16, body: String },
}

impl fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReleaseError::Disabled => f.write_str("lease release disabled"),
            ReleaseError::InvalidMac(m) => write!(f, "invalid MAC {m:?}"),
            ReleaseError::Io { socket, error } => {
                write!(f, "cocoon-net control socket {}: {error}", socket.display())
            }
            ReleaseError::BadResponse(m) => write!(f, "cocoon-net: malformed response: {m}"),
            ReleaseError::Status { code, body } => {
                write!(
                    f,
                    "cocoon-net: release returned status {code}: {}",
                    body.trim()
                )
            }
        }
    }
}

impl std::error::Error for ReleaseError {}

/// Releases leases through one control socket (or does nothing when disabled).
#[derive(Debug, Clone)]
pub struct LeaseReleaser {
    socket: Option<PathBuf>,
    timeout: Duration,
}

impl LeaseReleaser {
    /// `socket: None` disables release.
    pub fn new(socket: Option<PathBuf>) -> LeaseReleaser {
        LeaseReleaser {
            socket,
            timeout: RELEASE_TIMEOUT,
        }
    }

    /// `VK_COCOON_NET_CONTROL_SOCKET`: unset ⇒ the default path; set but empty ⇒ disabled.
    pub fn from_env() -> LeaseReleaser {
        match std::env::var_os("VK_COCOON_NET_CONTROL_SOCKET") {
            None => LeaseReleaser::new(Some(PathBuf::from(DEFAULT_CONTROL_SOCKET))),
            Some(v) if v.is_empty() => LeaseReleaser::new(None),
            Some(v) => LeaseReleaser::new(Some(PathBuf::from(v))),
        }
    }

    /// A different deadline (tests).
    pub fn with_timeout(mut self, timeout: Duration) -> LeaseReleaser {
        self.timeout = timeout;
        self
    }

    pub fn enabled(&self) -> bool {
        self.socket.is_some()
    }

    pub fn socket(&self) -> Option<&Path> {
        self.socket.as_deref()
    }

    /// Release one MAC. 204 is success (cocoon-net answers 204 for unknown MACs too).
    pub fn release(&self, mac: &str) -> Result<(), ReleaseError> {
        let Some(socket) = &self.socket else {
            return Err(ReleaseError::Disabled);
        };
        let mac = normalize_mac(mac).ok_or_else(|| ReleaseError::InvalidMac(mac.to_string()))?;
        let io_err = |error| ReleaseError::Io {
            socket: socket.clone(),
            error,
        };
        let deadline = Instant::now() + self.timeout;
        let mut stream = dial(socket, self.timeout).map_err(io_err)?;
        let request = format!(
            "DELETE /v1/leases/{mac} HTTP/1.1\r\nHost: cocoon-net\r\nUser-Agent: vk-cocoon\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream
            .set_write_timeout(Some(remaining(deadline).map_err(io_err)?))
            .map_err(io_err)?;
        stream.write_all(request.as_bytes()).map_err(io_err)?;
        let mut response = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            stream
                .set_read_timeout(Some(remaining(deadline).map_err(io_err)?))
                .map_err(io_err)?;
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    response.extend_from_slice(&buf[..n]);
                    if response.len() > MAX_RESPONSE_BYTES || complete(&response) {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(e)),
            }
        }
        let (code, body) = parse_response(&response)?;
        if code == 204 {
            Ok(())
        } else {
            Err(ReleaseError::Status { code, body })
        }
    }

    /// Release each MAC in turn; every failure is reported, none stops the others.
    pub fn release_all(&self, macs: &[String]) -> Vec<(String, Result<(), ReleaseError>)> {
        macs.iter().map(|m| (m.clone(), self.release(m))).collect()
    }
}

/// The MACs to release for a removed VM: every non-static NIC's MAC, trimmed,
/// lower-cased and de-duplicated in NIC order; the primary MAC when the VM has no NIC list.
/// `nics` yields `(mac, has_static_ip)`.
pub fn macs_to_release<'a>(
    nics: impl IntoIterator<Item = (&'a str, bool)>,
    primary_mac: Option<&str>,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut any_nic = false;
    for (mac, is_static) in nics {
        any_nic = true;
        let mac = mac.trim().to_ascii_lowercase();
        if is_static || mac.is_empty() || out.contains(&mac) {
            continue;
        }
        out.push(mac);
    }
    if !any_nic {
        if let Some(mac) = primary_mac.map(|m| m.trim().to_ascii_lowercase()) {
            if !mac.is_empty() {
                out.push(mac);
            }
        }
    }
    out
}

fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "lease release deadline passed",
        ))
    } else {
        Ok(left)
    }
}

fn dial(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.connect_timeout(&SockAddr::unix(path)?, timeout)?;
    Ok(UnixStream::from(std::os::fd::OwnedFd::from(socket)))
}

/// Headers complete and, when a Content-Length is given, the whole body read.
fn complete(response: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut parsed = httparse::Response::new(&mut headers);
    match parsed.parse(response) {
        Ok(httparse::Status::Complete(head)) => match content_length(parsed.headers) {
            Some(len) => response.len() - head >= len,
            None => parsed.code == Some(204) || parsed.code == Some(304),
        },
        _ => false,
    }
}

fn content_length(headers: &[httparse::Header<'_>]) -> Option<usize> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())
}

fn parse_response(response: &[u8]) -> Result<(u16, String), ReleaseError> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut parsed = httparse::Response::new(&mut headers);
    match parsed.parse(response) {
        Ok(httparse::Status::Complete(head)) => {
            let code = parsed.code.unwrap_or(0);
            let mut body = &response[head..];
            if let Some(len) = content_length(parsed.headers) {
                body = &body[..len.min(body.len())];
            }
            Ok((code, String::from_utf8_lossy(body).into_owned()))
        }
        Ok(httparse::Status::Partial) if response.is_empty() => Err(ReleaseError::BadResponse(
            "connection closed without a response".into(),
        )),
        Ok(httparse::Status::Partial) => Err(ReleaseError::BadResponse(
            "response headers incomplete".into(),
        )),
        Err(e) => Err(ReleaseError::BadResponse(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_selection_rule() {
        let nics = [
            (" 02:00:0A:00:00:05 ", false),
            ("02:00:0a:00:00:06", true),
            ("02:00:0a:00:00:05", false),
            ("", false),
            ("02:00:0a:00:00:07", false),
        ];
        assert_eq!(
            macs_to_release(nics, Some("02:00:0a:00:00:99")),
            vec!["02:00:0a:00:00:05", "02:00:0a:00:00:07"]
        );
        assert_eq!(
            macs_to_release([], Some(" 02:00:0A:00:00:99")),
            vec!["02:00:0a:00:00:99"]
        );
        assert!(macs_to_release([], None).is_empty());
        // Only static NICs: nothing to release, and the primary MAC is not used either.
        assert!(
            macs_to_release([("02:00:0a:00:00:06", true)], Some("02:00:0a:00:00:06")).is_empty()
        );
    }

    #[test]
    fn response_parsing() {
        assert_eq!(
            parse_response(b"HTTP/1.1 204 No Content\r\n\r\n")
                .unwrap()
                .0,
            204
        );
        let (code, body) =
            parse_response(b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nboomtrailing").unwrap();
        assert_eq!((code, body.as_str()), (500, "boom"));
        assert!(matches!(
            parse_response(b""),
            Err(ReleaseError::BadResponse(_))
        ));
        assert!(matches!(
            parse_response(b"SSH-2.0\r\n\r\n"),
            Err(ReleaseError::BadResponse(_))
        ));
        assert!(complete(b"HTTP/1.1 204 No Content\r\n\r\n"));
        assert!(!complete(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot"
        ));
    }

    #[test]
    fn disabled_and_invalid_mac_never_dial() {
        let off = LeaseReleaser::new(None);
        assert!(!off.enabled());
        assert!(matches!(
            off.release("02:00:0a:00:00:05"),
            Err(ReleaseError::Disabled)
        ));
        let on = LeaseReleaser::new(Some("/nonexistent/sock".into()));
        assert!(matches!(on.release("zz"), Err(ReleaseError::InvalidMac(_))));
        assert!(matches!(
            on.release("02:00:0a:00:00:05"),
            Err(ReleaseError::Io { .. })
        ));
    }
}
