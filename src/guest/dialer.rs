//! Runs a [`SacPass`] against a VM's console socket with blocking I/O, on a worker thread (the
//! pass takes minutes of mostly waiting; the event loop must not hold it).
//!
//! A worker thread rather than the loop: the pass is a short-lived conversation of sleeps and
//! reads with per-read deadlines that a thread expresses directly, it runs at most once per
//! Windows clone, and its only result is one outcome handed back like a blob transfer's.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use super::sac::{Event, Io, SacError, SacPass, SacPlan};

/// Dials `socket` and runs the pass to its end.
pub fn run(socket: &Path, plan: SacPlan) -> Result<(), SacError> {
    let (mut pass, mut io) = SacPass::start(plan, Instant::now());
    let mut conn: Option<UnixStream> = None;
    let mut chunk = [0u8; 4096];
    loop {
        let ev = match io {
            Io::Finished(r) => return r,
            // Connecting to a Unix socket does not wait for the peer: it is accepted or refused
            // at once, so the dial timeout needs no separate deadline here.
            Io::Connect => match UnixStream::connect(socket) {
                Ok(s) => {
                    conn = Some(s);
                    Event::Connected
                }
                Err(e) => Event::ConnectFailed(format!("{}: {e}", socket.display())),
            },
            Io::Write(bytes) => match conn.as_mut().map(|c| c.write_all(&bytes)) {
                Some(Ok(())) => Event::Written,
                Some(Err(e)) => Event::WriteFailed(e.to_string()),
                None => Event::WriteFailed("not connected".into()),
            },
            Io::Read { until } => {
                let left = until.saturating_duration_since(Instant::now());
                match conn.as_mut() {
                    None => Event::Closed("not connected".into()),
                    Some(_) if left.is_zero() => Event::ReadTimeout,
                    Some(c) => {
                        let _ = c.set_read_timeout(Some(left));
                        match c.read(&mut chunk) {
                            Ok(0) => Event::Closed("console closed".into()),
                            Ok(n) => Event::Read(chunk[..n].to_vec()),
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    ErrorKind::WouldBlock | ErrorKind::TimedOut
                                ) =>
                            {
                                Event::ReadTimeout
                            }
                            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                            Err(e) => Event::Closed(e.to_string()),
                        }
                    }
                }
            }
            Io::Sleep { until } => {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
                Event::Slept
            }
        };
        io = pass.on(ev, Instant::now());
    }
}
