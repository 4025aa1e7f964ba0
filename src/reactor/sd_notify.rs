//! systemd notifications (READY=1, STOPPING=1, WATCHDOG=1) over $NOTIFY_SOCKET, without libsystemd.
//! Owns only the datagram send; when to notify is the daemon's decision.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// Sends `state` (e.g. `READY=1`) to the socket named by `NOTIFY_SOCKET`.
/// Returns Ok(false) when not running under a notify-aware supervisor.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(path) => notify_to(&path.to_string_lossy(), state).map(|()| true),
        None => Ok(false),
    }
}

/// `systemctl status` shows `text` (one line) as what the daemon is doing: `READY=1` alone
/// says nothing while a large host reconciles, nor why a start keeps retrying.
pub fn status(text: &str) -> io::Result<bool> {
    notify(&status_line(text))
}

/// `STATUS=<text>` with line breaks folded: a notify message is newline-separated fields.
pub fn status_line(text: &str) -> String {
    format!("STATUS={}", text.replace(['\n', '\r'], " "))
}

/// Sends `state` to a notify socket path; a leading `@` names an abstract socket.
pub fn notify_to(socket: &str, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    if let Some(name) = socket.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), socket)?;
    }
    Ok(())
}

/// How often to send WATCHDOG=1: half of `WATCHDOG_USEC`, when it is set for this
/// process (`WATCHDOG_PID` absent or equal to our pid). None = no watchdog.
pub fn watchdog_interval(usec: Option<&str>, pid: Option<&str>) -> Option<Duration> {
    if let Some(p) = pid {
        if p.trim().parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    Some(Duration::from_micros(usec / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_is_one_field() {
        assert_eq!(status_line("serving 3 pods"), "STATUS=serving 3 pods");
        assert_eq!(status_line("a\nREADY=1\rb"), "STATUS=a READY=1 b");
    }

    #[test]
    fn sends_datagrams_to_path_and_abstract_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        notify_to(path.to_str().unwrap(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("vk-cocoon-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(&format!("@{name}"), "WATCHDOG=1").unwrap();
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"WATCHDOG=1");
    }

    #[test]
    fn watchdog_interval_is_half_the_timeout_for_this_pid() {
        let me = std::process::id().to_string();
        assert_eq!(
            watchdog_interval(Some("30000000"), None),
            Some(Duration::from_secs(15))
        );
        assert_eq!(
            watchdog_interval(Some("30000000"), Some(&me)),
            Some(Duration::from_secs(15))
        );
        assert_eq!(watchdog_interval(Some("30000000"), Some("1")), None);
        assert_eq!(watchdog_interval(Some("x"), None), None);
        assert_eq!(watchdog_interval(Some("0"), None), None);
        assert_eq!(watchdog_interval(None, None), None);
    }
}
