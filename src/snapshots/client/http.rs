//! HTTP plumbing of the registry client: re-sendable request bodies, the transport retry
//! policy and what one failed exchange was, before it becomes a TransferError.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::time::{Duration, SystemTime};

use crate::http_client::Response;
use crate::snapshots::TransferError;

use super::RETRY_STATUSES;

/// Attempts and sleeps between them (±10 % jitter is added).
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub delays: Vec<Duration>,
}

impl Default for RetryPolicy {
    /// Three attempts sleeping ≈1 s then ≈3 s.
    fn default() -> Self {
        RetryPolicy {
            delays: vec![Duration::from_secs(1), Duration::from_secs(3)],
        }
    }
}

impl RetryPolicy {
    pub(super) fn sleep(&self, attempt: usize) {
        let Some(base) = self.delays.get(attempt) else {
            return;
        };
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // ±10 % jitter from the clock's sub-second noise (no RNG needed for this).
        let factor = 0.9 + (nanos % 1000) as f64 / 5000.0;
        std::thread::sleep(base.mul_f64(factor));
    }
}

/// Request body that can be re-sent on retry.
#[derive(Clone, Copy)]
pub enum Body<'a> {
    Empty,
    Bytes(&'a [u8]),
    /// The first `len` bytes of a file (read with positional reads; the handle is not moved).
    File {
        file: &'a File,
        len: u64,
    },
}

impl Body<'_> {
    pub(super) fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::Bytes(b) => b.len() as u64,
            Body::File { len, .. } => *len,
        }
    }
}

/// The first `end` bytes of a file as a request body, read with positional reads.
pub(super) struct FileBody<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl<'a> FileBody<'a> {
    pub(super) fn new(file: &'a File, len: u64) -> Self {
        FileBody {
            file,
            pos: 0,
            end: len,
        }
    }
}

impl Read for FileBody<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.end {
            return Ok(0);
        }
        let want = buf.len().min((self.end - self.pos) as usize);
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "spool file shorter than expected",
            ));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

/// What went wrong with one HTTP exchange, before it becomes a [`TransferError`].
pub enum HttpFailure {
    Status(u16, Box<Response>),
    Transport(String),
    Auth(TransferError),
}

impl HttpFailure {
    pub(super) fn is_transient_transport(&self) -> bool {
        match self {
            HttpFailure::Transport(_) => true,
            HttpFailure::Status(code, _) => RETRY_STATUSES.contains(code),
            HttpFailure::Auth(_) => false,
        }
    }

    /// Converts to a typed error whose message starts with `what`.
    pub fn into_error(self, what: &str) -> TransferError {
        match self {
            HttpFailure::Transport(m) => TransferError::Transient(format!("{what}: {m}")),
            HttpFailure::Auth(e) => e,
            HttpFailure::Status(code, resp) => {
                let body = read_error_body(*resp);
                let msg = format!(
                    "{what}: HTTP {code}{}",
                    if body.is_empty() {
                        String::new()
                    } else {
                        format!(": {body}")
                    }
                );
                match code {
                    401 | 403 => TransferError::Unauthorized(msg),
                    404 => TransferError::NotFound(msg),
                    c if RETRY_STATUSES.contains(&c) => TransferError::Transient(msg),
                    _ => TransferError::Registry(msg),
                }
            }
        }
    }
}

fn read_error_body(resp: Response) -> String {
    let mut s = String::new();
    let _ = resp
        .into_body()
        .into_reader()
        .take(4096)
        .read_to_string(&mut s);
    s.trim().chars().take(300).collect()
}
