//! Typed cocoon failures and their classification by substrings of cocoon's error text.
//! Classifies finished calls; it never retries or decides what the provider does next.

use super::call::{CallMode, CallOutcome, ExitKind, Verb};
use std::fmt;

/// How long a trimmed stderr/output excerpt may get inside an error text.
pub const ERROR_TEXT_LIMIT: usize = 2048;

/// What a failed cocoon call means to the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// `vm not found` / `no such vm`: authoritative absence of the VM.
    VmNotFound,
    /// `snapshot not found` / `no such snapshot`.
    SnapshotNotFound,
    /// `not found in any backend` (image inspect).
    ImageNotFound,
    /// `snapshot save` name collision; `holder` is the ID after `already in use by`/`held by`.
    SnapshotNameTaken { holder: Option<String> },
    /// `snapshot rm`: `is in use by an active` clone/restore/export; retry later.
    SnapshotInUse,
    /// `vm net`: `backend does not support net resize`.
    NetResizeUnsupported,
    /// The installed cocoon does not know the verb (e.g. reconcile-stale-create on old cocoon).
    VerbUnsupported,
    /// `vm exec`: the guest command exited non-zero with this code (no `Error:` line).
    ExecExit(i32),
    /// Killed at the call's deadline.
    TimedOut,
    /// Ended by a signal (other than our deadline kill) — e.g. the child died mid-stream.
    Signalled(i32),
    /// Exit 0 but stdout was not the JSON the verb promises.
    InvalidJson(String),
    /// Exit 0 and JSON, but the record has an empty `id` (`empty VM record in JSON payload`).
    EmptyRecord,
    /// Output exceeded the capture limit, so it cannot be trusted.
    HugeOutput,
    /// Could not start the binary at all.
    Spawn(String),
    /// Anything else: opaque, "inconclusive" for existence questions.
    Other,
}

impl ErrorKind {
    /// Authoritative absence of the object the verb was about.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            ErrorKind::VmNotFound | ErrorKind::SnapshotNotFound | ErrorKind::ImageNotFound
        )
    }
}

/// A failed cocoon call: which command, how it ended, the trimmed stderr, and what it means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CocoonError {
    /// `cocoon <verb args>` as it was run (binary shown as `cocoon`).
    pub command: String,
    /// Exit code if the child exited; `None` for signals, timeouts and spawn failures.
    pub exit: Option<i32>,
    /// stderr (combined mode: stdout+stderr), whitespace-trimmed and capped.
    pub stderr_trimmed: String,
    pub kind: ErrorKind,
    /// `true` when the text came from merged output (combined mode): shown as `(output: ...)`.
    pub combined: bool,
}

impl CocoonError {
    /// Authoritative absence of the object the verb was about.
    pub fn is_not_found(&self) -> bool {
        self.kind.is_not_found()
    }

    /// Anything that is not an authoritative answer (behaviour 19: "inconclusive").
    pub fn is_inconclusive(&self) -> bool {
        !self.is_not_found()
    }

    /// Transient: worth retrying the same call later (deadline, signal, busy lock, bad output).
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::TimedOut
                | ErrorKind::Signalled(_)
                | ErrorKind::SnapshotInUse
                | ErrorKind::InvalidJson(_)
                | ErrorKind::HugeOutput
                | ErrorKind::Spawn(_)
        )
    }

    /// An error that is not about a finished process (spawn failure, parse failure).
    pub fn new(command: &str, kind: ErrorKind) -> CocoonError {
        CocoonError {
            command: command.to_string(),
            exit: None,
            stderr_trimmed: String::new(),
            kind,
            combined: false,
        }
    }
}

impl fmt::Display for CocoonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = if self.combined { "output" } else { "stderr" };
        write!(f, "{}: ", self.command)?;
        match &self.kind {
            ErrorKind::TimedOut => write!(f, "timed out (killed at deadline)")?,
            ErrorKind::Signalled(sig) => write!(f, "killed by signal {sig}")?,
            ErrorKind::InvalidJson(why) => write!(f, "invalid JSON output: {why}")?,
            ErrorKind::EmptyRecord => write!(f, "empty VM record in JSON payload")?,
            ErrorKind::HugeOutput => write!(f, "output exceeded the capture limit")?,
            ErrorKind::Spawn(why) => write!(f, "cannot start: {why}")?,
            _ => match self.exit {
                Some(code) => write!(f, "exit status {code}")?,
                None => write!(f, "failed")?,
            },
        }
        if !self.stderr_trimmed.is_empty() {
            write!(f, " ({label}: {})", self.stderr_trimmed)?;
        }
        Ok(())
    }
}

impl std::error::Error for CocoonError {}

/// Trims whitespace and caps length (on a char boundary) for embedding in an error text.
pub fn trim_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let t = text.trim();
    if t.len() <= ERROR_TEXT_LIMIT {
        return t.to_string();
    }
    let mut end = ERROR_TEXT_LIMIT;
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &t[..end])
}

/// Extracts the holder ID after `already in use by ` or `held by ` (first word, `)` removed).
fn holder_id(text: &str) -> Option<String> {
    for marker in ["already in use by ", "held by "] {
        if let Some(pos) = text.find(marker) {
            let word = text[pos + marker.len()..]
                .split_whitespace()
                .next()
                .unwrap_or("")
                .trim_end_matches(')');
            if !word.is_empty() {
                return Some(word.to_string());
            }
        }
    }
    None
}

/// Classifies the error text of a failed call by the substrings cocoon is known to print (case-insensitive).
/// The verb decides which object a "not found" is about when the text is ambiguous.
pub fn classify(verb: Verb, text: &str) -> ErrorKind {
    let lower = text.to_ascii_lowercase();
    let vm_gone = lower.contains("vm not found") || lower.contains("no such vm");
    let snap_gone = lower.contains("snapshot not found") || lower.contains("no such snapshot");
    let image_gone = lower.contains("not found in any backend");
    let snapshot_first = verb.is_snapshot();
    if snapshot_first && snap_gone {
        return ErrorKind::SnapshotNotFound;
    }
    if vm_gone {
        return ErrorKind::VmNotFound;
    }
    if snap_gone {
        return ErrorKind::SnapshotNotFound;
    }
    if image_gone {
        return ErrorKind::ImageNotFound;
    }
    if lower.contains("is in use by an active") {
        return ErrorKind::SnapshotInUse;
    }
    if lower.contains("already exists") || lower.contains("already in use by") {
        // Keep the original case of the ID.
        return ErrorKind::SnapshotNameTaken {
            holder: holder_id(text),
        };
    }
    if lower.contains("backend does not support net resize") {
        return ErrorKind::NetResizeUnsupported;
    }
    if verb == Verb::VmReconcileStaleCreate
        && (lower.contains("unknown shorthand flag") || lower.contains("unknown command"))
    {
        return ErrorKind::VerbUnsupported;
    }
    ErrorKind::Other
}

/// The error for a call that did not succeed (`None` when it exited 0 and was not truncated).
pub fn failure(
    verb: Verb,
    command: &str,
    mode: CallMode,
    out: &CallOutcome,
) -> Option<CocoonError> {
    let combined = mode == CallMode::Combined;
    let text_bytes: Vec<u8> = if combined {
        let mut t = out.stdout.clone();
        if !t.is_empty() && !out.stderr.is_empty() && !t.ends_with(b"\n") {
            t.push(b'\n');
        }
        t.extend_from_slice(&out.stderr);
        t
    } else {
        out.stderr.clone()
    };
    let stderr_trimmed = trim_text(&text_bytes);
    let make = |exit: Option<i32>, kind: ErrorKind| CocoonError {
        command: command.to_string(),
        exit,
        stderr_trimmed: stderr_trimmed.clone(),
        kind,
        combined,
    };
    if out.timed_out {
        return Some(make(None, ErrorKind::TimedOut));
    }
    match out.exit {
        ExitKind::Signal(sig) => Some(make(None, ErrorKind::Signalled(sig))),
        ExitKind::Code(0) => None,
        ExitKind::Code(code) => {
            let kind = if verb == Verb::VmExec && !is_transport_failure(code, &out.stderr) {
                ErrorKind::ExecExit(code)
            } else {
                classify(verb, &stderr_trimmed)
            };
            Some(make(Some(code), kind))
        }
    }
}

/// `vm exec` transport/setup failures exit 1 with a final `Error: ` line; any other non-zero
/// exit is the guest command's own status.
fn is_transport_failure(code: i32, stderr: &[u8]) -> bool {
    let text = String::from_utf8_lossy(stderr);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    code == 1 && last.starts_with("Error: ")
}
