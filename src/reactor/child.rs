//! Child-process types of the reactor: what to spawn, how its pipes are handled, what it reported.
//! Owns per-child pipe buffers; registration, reaping and reporting live in `children.rs`.

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::process::ExitStatus;
use std::time::Duration;

use mio::unix::pipe::{Receiver, Sender};
use mio::Token;

use super::process::Process;
use super::timers::TimerId;

/// Identifies one spawned child for its whole life (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChildId(pub u64);

impl fmt::Display for ChildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "child#{}", self.0)
    }
}

/// What the child reads on stdin.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StdinMode {
    /// /dev/null.
    #[default]
    Null,
    /// These bytes, then end of file. Written as the pipe accepts them.
    Bytes(Vec<u8>),
    /// A pipe the caller feeds with `Reactor::write_stdin` and ends with `close_stdin`.
    Pipe,
}

/// What happens to one of the child's output streams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputMode {
    /// /dev/null.
    Null,
    /// Kept in memory up to `limit` bytes and delivered in `ChildExit`; the rest is
    /// read and discarded (so the child never blocks on a full pipe) and the
    /// `*_truncated` flag is set.
    Capture { limit: usize },
    /// Delivered as `Event::ChildOutput` chunks as they arrive; nothing is kept.
    Stream,
}

impl Default for OutputMode {
    fn default() -> Self {
        OutputMode::Capture {
            limit: DEFAULT_CAPTURE_LIMIT,
        }
    }
}

/// Capture limit used by `ChildSpec::new` and `OutputMode::default()`: 1 MiB.
pub const DEFAULT_CAPTURE_LIMIT: usize = 1 << 20;

/// A process to run. Nothing goes through a shell: `argv[0]` is the program
/// (looked up in PATH when it has no slash), the rest its arguments. `env`
/// entries are added to (or override) the daemon's own environment.
#[derive(Clone, Debug, Default)]
pub struct ChildSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub stdin: StdinMode,
    pub stdout: OutputMode,
    pub stderr: OutputMode,
    /// After this long from spawn the child gets SIGKILL and is reported with `timed_out`.
    pub deadline: Option<Duration>,
    /// With a deadline: the child gets SIGTERM at the deadline and SIGKILL only this long
    /// after, for programs that must tidy up (cocoon-macos stopping its QEMU).
    pub term_grace: Option<Duration>,
    /// Started ahead of the children waiting for a spawner thread, and at the loop thread's
    /// priority (`priority::LOOP_NICE`) where the daemon may raise it: for short calls a pod's
    /// status waits on, such as checking whether a VM is gone while a burst's creates keep
    /// the CPUs busy. Never for a call that leaves processes behind (a VM start): they would
    /// inherit the priority.
    pub urgent: bool,
}

impl ChildSpec {
    /// `argv` with stdin from /dev/null, stdout and stderr captured up to 1 MiB, no deadline.
    pub fn new<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        ChildSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            ..ChildSpec::default()
        }
    }

    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    pub fn term_grace(mut self, grace: Duration) -> Self {
        self.term_grace = Some(grace);
        self
    }

    pub fn stdin(mut self, stdin: StdinMode) -> Self {
        self.stdin = stdin;
        self
    }

    pub fn stdout(mut self, mode: OutputMode) -> Self {
        self.stdout = mode;
        self
    }

    pub fn stderr(mut self, mode: OutputMode) -> Self {
        self.stderr = mode;
        self
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// Which output stream a `ChildOutput` chunk came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The final report of a child: delivered once, after the process is reaped and
/// its output pipes reached end of file (or the drain grace ran out).
#[derive(Clone, Debug)]
pub struct ChildExit {
    pub id: ChildId,
    pub pid: u32,
    /// None only when the status could not be collected (someone else reaped it).
    pub status: Option<ExitStatus>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// Killed because its deadline passed.
    pub timed_out: bool,
    /// Killed through `Reactor::kill` (or reactor drop).
    pub killed: bool,
    /// Some when the child never ran: it could not be started (no such program, resource
    /// limits) or its pipes could not be watched. `status` is then None.
    pub spawn_error: Option<SpawnError>,
}

/// Why a child never ran: the spawn error's kind and text (an `io::Error` is not `Clone`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpawnError {
    pub kind: io::ErrorKind,
    pub message: String,
}

impl From<&io::Error> for SpawnError {
    fn from(e: &io::Error) -> Self {
        SpawnError {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl ChildExit {
    /// The exit code; None when the child died from a signal.
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }

    /// The signal that ended the child, if any.
    pub fn signal(&self) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        self.status.and_then(|s| s.signal())
    }

    /// Exit status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// Which part of a child an internal token belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChildPart {
    Stdin,
    Stdout,
    Stderr,
    Exit,
}

pub(crate) struct InPipe {
    pub(crate) pipe: Sender,
    pub(crate) token: Token,
    pub(crate) buf: VecDeque<u8>,
    pub(crate) close_when_empty: bool,
}

impl InPipe {
    /// Writes as much buffered data as the pipe takes. Returns Ok(true) when the
    /// pipe should now be closed (all written and close requested).
    pub(crate) fn flush(&mut self) -> io::Result<bool> {
        while !self.buf.is_empty() {
            let (front, _) = self.buf.as_slices();
            match self.pipe.write(front) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.buf.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(self.close_when_empty)
    }
}

pub(crate) struct OutPipe {
    pub(crate) pipe: Receiver,
    pub(crate) token: Token,
    pub(crate) stream: bool,
    pub(crate) limit: usize,
    pub(crate) kept: Vec<u8>,
    pub(crate) truncated: bool,
    /// Deregistered by `Reactor::pause_output`: the child blocks on a full pipe until resumed.
    pub(crate) paused: bool,
}

/// What one bounded read pass found.
pub(crate) enum ReadOutcome {
    /// Would block: wait for the next readiness event.
    Pending,
    /// The per-pass budget ran out with data still there: read again soon.
    More,
    /// End of file (or a read error, treated as the end).
    Eof,
}

/// Bytes read per pipe per wake-up before other sources get their turn.
pub(crate) const READ_BUDGET: usize = 1 << 20;
/// The same for streamed output, smaller: it is the most a consumer that paused the child
/// (`Reactor::pause_output`) can still receive in the pass that made it pause.
pub(crate) const STREAM_READ_BUDGET: usize = 256 << 10;

impl OutPipe {
    /// Reads up to `READ_BUDGET` bytes. Captured data is kept up to the limit;
    /// streamed chunks are handed to `emit`.
    pub(crate) fn read_some(
        &mut self,
        scratch: &mut [u8],
        emit: &mut dyn FnMut(Vec<u8>),
    ) -> ReadOutcome {
        let mut total = 0;
        loop {
            if total
                >= if self.stream {
                    STREAM_READ_BUDGET
                } else {
                    READ_BUDGET
                }
            {
                return ReadOutcome::More;
            }
            match self.pipe.read(scratch) {
                Ok(0) => return ReadOutcome::Eof,
                Ok(n) => {
                    total += n;
                    let data = &scratch[..n];
                    if self.stream {
                        emit(data.to_vec());
                    } else {
                        let room = self.limit.saturating_sub(self.kept.len());
                        if data.len() > room {
                            self.truncated = true;
                        }
                        self.kept.extend_from_slice(&data[..room.min(data.len())]);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::Pending,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return ReadOutcome::Eof,
            }
        }
    }
}

/// A child handed to a spawner thread and not back yet, with what was asked of it meanwhile.
pub(crate) struct Starting {
    pub(crate) spec: ChildSpec,
    /// Stdin bytes to write once it runs (`StdinMode::Bytes`, or `write_stdin` meanwhile).
    pub(crate) stdin: VecDeque<u8>,
    pub(crate) close_stdin: bool,
    pub(crate) deadline_timer: Option<TimerId>,
    pub(crate) timed_out: bool,
    pub(crate) killed: bool,
    pub(crate) paused: bool,
}

pub(crate) struct ChildState {
    pub(crate) child: Process,
    pub(crate) pid: u32,
    /// pidfd registered for exit readiness; None in SIGCHLD-fallback mode.
    pub(crate) pidfd: Option<(OwnedFd, Token)>,
    pub(crate) stdin: Option<InPipe>,
    pub(crate) stdout: Option<OutPipe>,
    pub(crate) stderr: Option<OutPipe>,
    pub(crate) stdout_result: (Vec<u8>, bool),
    pub(crate) stderr_result: (Vec<u8>, bool),
    /// Some once reaped: the inner Option is None when the status was lost (ECHILD).
    pub(crate) reaped: Option<Option<ExitStatus>>,
    pub(crate) timed_out: bool,
    pub(crate) killed: bool,
    pub(crate) deadline_timer: Option<TimerId>,
    /// The SIGTERM grace still to give at the deadline (taken when SIGTERM is sent).
    pub(crate) term_grace: Option<Duration>,
    pub(crate) drain_timer: Option<TimerId>,
}
