//! The single mio poll loop: tokens, timers, child processes, signals and the worker-pool waker.
//! It owns no daemon state; it reports readiness and completions as events.
//!
//! # Contract (what every room codes against)
//!
//! ```text
//! Reactor::<M>::new(workers, queue_cap)      one loop; M = message type of worker jobs / notifier posts
//! reactor.registry() / reactor.token()       register your own mio sources under a fresh token;
//!                                            their readiness comes back as Event::Io(IoReady)
//! reactor.now()                              the clock, read once per wake-up of poll()
//! reactor.timer_at(at, key) / timer_after    one-shot timers -> Event::Timer { id, key }; re-arm by
//! reactor.cancel_timer(id)                   arming a new one. A cancelled timer never fires; a timer
//!                                            never fires before its instant; equal instants fire
//!                                            in arming order.
//! reactor.spawn(ChildSpec)                   child with non-blocking registered pipes, forked by a
//!                                            spawner thread (spawn never waits for the exec; a
//!                                            child that cannot start exits with spawn_error); output is
//!                                            captured (bounded) or streamed (Event::ChildOutput);
//!                                            exit -> one Event::ChildExit after the process is reaped
//!                                            AND its pipes reached EOF (so no output is lost), or
//!                                            after EXIT_DRAIN_GRACE if a grandchild keeps a pipe open.
//! reactor.write_stdin / close_stdin          buffered stdin for StdinMode::Pipe
//! reactor.kill(id) / send_signal(id, sig)    SIGKILL (reported killed=true) / any signal
//! reactor.submit(job)                        bounded worker pool; the job's return value comes back
//!                                            as Event::Work(m); Err(QueueFull) when the queue is full
//! reactor.extra_pool(name, n, cap)           another worker pool posting into the same loop
//! reactor.notifier()                         Notifier<M>: post(m) from any thread -> Event::Work(m)
//! reactor.watch_signals(&[SIGTERM, ...])     opt-in: those signals arrive as Event::Signal(n)
//! reactor.poll(&mut out)                     blocks until at least one event was appended to `out`
//! ```
//!
//! Refinements over the first sketch of the contract:
//! * Signals are opt-in through `watch_signals` (the daemon watches SIGTERM, SIGINT and SIGHUP) so
//!   test processes that build reactors keep their default signal behaviour.
//! * A child past its `deadline` gets SIGKILL (the child only, never its process group: cocoon's
//!   hypervisors must outlive a killed CLI call) and is reported with `timed_out = true`. With a
//!   `term_grace` it gets SIGTERM at the deadline and SIGKILL once the grace has run out.
//! * Exit detection uses a pidfd per child (Linux >= 5.3). If `pidfd_open` is unavailable the
//!   reactor falls back to a SIGCHLD self-pipe and sweeps its children with `try_wait`.
//! * Dropping the reactor SIGKILLs and reaps every child still running: no zombies, ever.
//! * Worker jobs must not panic (the release profile aborts on panic).
//! * Reads are bounded per wake-up (`READ_BUDGET` per pipe) so one chatty child cannot starve
//!   the loop; the remainder is read on the next turn without waiting for readiness again.

pub(crate) mod child;
pub mod exec_trampoline;
mod pool;
pub mod priority;
pub mod sd_notify;
mod spawner;
mod timers;

pub use child::{
    ChildExit, ChildId, ChildSpec, OutputMode, SpawnError, StdinMode, Stream, DEFAULT_CAPTURE_LIMIT,
};
pub use mio::{Interest, Registry, Token};
pub use pool::{Notifier, QueueFull};
pub use timers::TimerId;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::unix::pipe::{Receiver, Sender};
use mio::unix::SourceFd;
use mio::{Events, Poll, Waker};
use signal_hook::SigId;

use child::{ChildPart, ChildState, InPipe, OutPipe, ReadOutcome, Starting};
use pool::Pool;
use spawner::{Request, Spawner, Started};
use timers::Timers;

/// After a child is reaped, how long its output pipes may stay open (held by a
/// grandchild that inherited them) before the exit is reported anyway.
pub const EXIT_DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Worker threads made by [`Reactor::extra_pool`].
pub struct WorkerPool<M: Send + 'static>(Pool<M>);

impl<M: Send + 'static> WorkerPool<M> {
    /// Runs a blocking job on this pool; its result arrives as `Event::Work`.
    pub fn submit(&self, job: impl FnOnce() -> M + Send + 'static) -> Result<(), QueueFull> {
        self.0.submit(Box::new(job))
    }
}

/// Readiness of a source registered by a user of the reactor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoReady {
    pub token: Token,
    pub readable: bool,
    pub writable: bool,
    pub error: bool,
    pub read_closed: bool,
    pub write_closed: bool,
}

/// Everything the loop reports.
#[derive(Debug)]
pub enum Event<M> {
    Io(IoReady),
    Timer {
        id: TimerId,
        key: u64,
    },
    ChildOutput {
        id: ChildId,
        stream: Stream,
        data: Vec<u8>,
    },
    ChildExit(ChildExit),
    Signal(i32),
    Work(M),
}

const WAKER: Token = Token(0);
/// Tokens at or above this belong to the reactor itself (child pipes, signal pipes);
/// user tokens count up from 1, so the two ranges never meet.
const INTERNAL_BASE: usize = 1 << (usize::BITS - 1);

#[derive(Clone, Copy, Debug)]
enum Internal {
    Child(ChildId, ChildPart),
    Signal(i32),
    SigChld,
}

#[derive(Clone, Copy, Debug)]
enum TimerKind {
    User(u64),
    Deadline(ChildId),
    Drain(ChildId),
}

struct SignalPipe {
    sig_id: SigId,
    token: Token,
    reader: mio::net::UnixStream,
}

/// The event loop. See the module documentation for the contract.
pub struct Reactor<M: Send + 'static> {
    poll: Poll,
    events: Events,
    ready: Vec<IoReady>,
    timers: Timers<TimerKind>,
    next_user_token: usize,
    next_internal_token: usize,
    internal: HashMap<Token, Internal>,
    children: HashMap<ChildId, ChildState>,
    /// Children handed to the spawner threads and not started yet.
    starting: HashMap<ChildId, Starting>,
    spawner: Spawner,
    next_child: u64,
    /// Output pipes whose read budget ran out: read again without waiting.
    again: Vec<(ChildId, ChildPart)>,
    scratch: Vec<u8>,
    now: Instant,
    notifier: Notifier<M>,
    pool: Pool<M>,
    signals: Vec<SignalPipe>,
    /// Some when exits are detected through SIGCHLD instead of pidfds.
    sigchld: Option<SignalPipe>,
    sweep_exits: bool,
}

impl<M: Send + 'static> Reactor<M> {
    /// A loop with `workers` pool threads and room for `queue_cap` queued jobs.
    pub fn new(workers: usize, queue_cap: usize) -> io::Result<Self> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let notifier = Notifier {
            queue: Arc::new(Mutex::new(VecDeque::new())),
            waker,
        };
        let pool = Pool::new("vk-worker", workers, queue_cap, notifier.clone())?;
        let spawner = Spawner::new(Arc::clone(&notifier.waker));
        Ok(Reactor {
            poll,
            events: Events::with_capacity(256),
            ready: Vec::with_capacity(256),
            timers: Timers::new(),
            next_user_token: 1,
            next_internal_token: INTERNAL_BASE,
            internal: HashMap::new(),
            children: HashMap::new(),
            starting: HashMap::new(),
            spawner,
            next_child: 1,
            again: Vec::new(),
            scratch: vec![0; 64 * 1024],
            now: Instant::now(),
            notifier,
            pool,
            signals: Vec::new(),
            sigchld: None,
            sweep_exits: false,
        })
    }

    /// The mio registry: register your sources here with a token from `token()`.
    pub fn registry(&self) -> &mio::Registry {
        self.poll.registry()
    }

    /// A fresh token, never handed out before.
    pub fn token(&mut self) -> Token {
        let t = Token(self.next_user_token);
        self.next_user_token += 1;
        t
    }

    fn internal_token(&mut self, what: Internal) -> Token {
        let t = Token(self.next_internal_token);
        self.next_internal_token += 1;
        self.internal.insert(t, what);
        t
    }

    /// The clock as read when `poll` last woke up.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Arms a one-shot timer that reports `Event::Timer { id, key }` at or after `at`.
    pub fn timer_at(&mut self, at: Instant, key: u64) -> TimerId {
        self.timers.insert(at, TimerKind::User(key))
    }

    /// Arms a one-shot timer `after` from now (the real clock, not `now()`).
    pub fn timer_after(&mut self, after: Duration, key: u64) -> TimerId {
        self.timer_at(Instant::now() + after, key)
    }

    /// Disarms a timer; true when it was still armed (it will then never fire).
    pub fn cancel_timer(&mut self, id: TimerId) -> bool {
        self.timers.cancel(id)
    }

    /// Number of armed timers (user timers plus the reactor's own deadlines).
    pub fn timers_armed(&self) -> usize {
        self.timers.len()
    }

    /// The process id of a child that has started and not been reported yet (None while a
    /// spawner thread is still starting it).
    pub fn pid(&self, id: ChildId) -> Option<u32> {
        self.children.get(&id).map(|c| c.pid)
    }

    /// Number of children spawned (started or still starting) and not yet reported.
    pub fn children_running(&self) -> usize {
        self.children.len() + self.starting.len()
    }

    /// Runs a blocking job on the worker pool; its result arrives as `Event::Work`.
    pub fn submit(&self, job: impl FnOnce() -> M + Send + 'static) -> Result<(), QueueFull> {
        self.pool.submit(Box::new(job))
    }

    /// Another set of `workers` threads whose jobs' results also arrive as `Event::Work`: for
    /// jobs that must never queue behind the main pool's (multi-GiB transfers there).
    pub fn extra_pool(
        &self,
        name: &str,
        workers: usize,
        queue_cap: usize,
    ) -> io::Result<WorkerPool<M>> {
        Pool::new(name, workers, queue_cap, self.notifier.clone()).map(WorkerPool)
    }

    /// A handle other threads use to post messages into the loop.
    pub fn notifier(&self) -> Notifier<M> {
        self.notifier.clone()
    }

    /// From now on the given signals are caught and reported as `Event::Signal(n)`
    /// (several deliveries between two wake-ups count once).
    pub fn watch_signals(&mut self, signals: &[i32]) -> io::Result<()> {
        for &sig in signals {
            let pipe = self.signal_pipe(sig, Internal::Signal(sig))?;
            self.signals.push(pipe);
        }
        Ok(())
    }

    fn signal_pipe(&mut self, sig: i32, what: Internal) -> io::Result<SignalPipe> {
        let (reader, writer) = std::os::unix::net::UnixStream::pair()?;
        reader.set_nonblocking(true)?;
        writer.set_nonblocking(true)?;
        let sig_id = signal_hook::low_level::pipe::register(sig, writer)?;
        let mut reader = mio::net::UnixStream::from_std(reader);
        let token = self.internal_token(what);
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut reader, token, Interest::READABLE)
        {
            signal_hook::low_level::unregister(sig_id);
            return Err(e);
        }
        Ok(SignalPipe {
            sig_id,
            token,
            reader,
        })
    }

    /// Detect child exits through SIGCHLD instead of pidfds (used automatically
    /// when the kernel lacks pidfd_open; public so tests can exercise it).
    #[doc(hidden)]
    pub fn use_sigchld_for_exits(&mut self) -> io::Result<()> {
        if self.sigchld.is_none() {
            let pipe = self.signal_pipe(libc::SIGCHLD, Internal::SigChld)?;
            self.sigchld = Some(pipe);
            self.sweep_exits = true;
        }
        Ok(())
    }

    /// Starts a child process without waiting for it: a spawner thread forks and execs it, and
    /// its pipes are registered when it comes back. Until then the child is "starting": `kill`,
    /// stdin writes, `close_stdin` and `pause_output` are remembered and applied once it runs,
    /// and its deadline already counts. A child that could not be started (no such program,
    /// resource limits) is reported as a `ChildExit` with `spawn_error`. The only immediate
    /// errors are an empty argv and spawner threads that are gone.
    pub fn spawn(&mut self, spec: ChildSpec) -> io::Result<ChildId> {
        if spec.argv.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty argv"));
        }
        let trampoline = exec_trampoline::wrap(&spec.argv, &spec.env);
        let argv = trampoline.as_deref().unwrap_or(&spec.argv);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        cmd.stdin(match spec.stdin {
            StdinMode::Null => Stdio::null(),
            _ => Stdio::piped(),
        });
        for (mode, is_out) in [(&spec.stdout, true), (&spec.stderr, false)] {
            let stdio = match mode {
                OutputMode::Null => Stdio::null(),
                _ => Stdio::piped(),
            };
            if is_out {
                cmd.stdout(stdio);
            } else {
                cmd.stderr(stdio);
            }
        }
        if trampoline.is_none() {
            child::die_with_parent(&mut cmd);
        }
        let id = ChildId(self.next_child);
        self.spawner.request(Request { id, cmd })?;
        self.next_child += 1;
        let deadline_timer = spec.deadline.map(|d| {
            self.timers
                .insert(Instant::now() + d, TimerKind::Deadline(id))
        });
        let stdin = match &spec.stdin {
            StdinMode::Bytes(b) => b.iter().copied().collect(),
            _ => VecDeque::new(),
        };
        self.starting.insert(
            id,
            Starting {
                close_stdin: matches!(spec.stdin, StdinMode::Bytes(_)),
                spec,
                stdin,
                deadline_timer,
                timed_out: false,
                killed: false,
                paused: false,
            },
        );
        Ok(id)
    }

    /// A spawner thread is back with a child: register its pipes and pidfd and apply what was
    /// asked of it while it was starting.
    fn started(&mut self, started: Started, out: &mut Vec<Event<M>>) {
        let Started { id, result } = started;
        let Some(starting) = self.starting.remove(&id) else {
            // Not ours (cannot happen): leave no process behind.
            if let Ok((mut child, _)) = result {
                let _ = child.kill();
                let _ = child.wait();
            }
            return;
        };
        let (mut child, pidfd) = match result {
            Ok(ok) => ok,
            Err(e) => {
                if let Some(t) = starting.deadline_timer {
                    self.timers.cancel(t);
                }
                out.push(Event::ChildExit(ChildExit {
                    id,
                    pid: 0,
                    status: None,
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                    stdout_truncated: false,
                    stderr_truncated: false,
                    timed_out: starting.timed_out,
                    killed: starting.killed,
                    spawn_error: Some(SpawnError::from(&e)),
                }));
                return;
            }
        };
        let pid = child.id();
        let stdin_pipe = child.stdin.take();
        let stdout_pipe = child.stdout.take();
        let stderr_pipe = child.stderr.take();
        let mut state = ChildState {
            child,
            pid,
            pidfd: None,
            stdin: None,
            stdout: None,
            stderr: None,
            stdout_result: (Vec::new(), false),
            stderr_result: (Vec::new(), false),
            reaped: None,
            timed_out: starting.timed_out,
            killed: starting.killed,
            deadline_timer: starting.deadline_timer,
            term_grace: starting.spec.term_grace,
            drain_timer: None,
        };
        let setup = self.setup_child(
            id,
            &mut state,
            &starting,
            pidfd,
            stdin_pipe,
            stdout_pipe,
            stderr_pipe,
        );
        if let Err(e) = setup {
            // A child the loop cannot watch is not left running unwatched: kill and reap it
            // (a SIGKILLed child is gone at once) and report why it did not start.
            self.release_child_tokens(&mut state);
            let _ = state.child.kill();
            let _ = state.child.wait();
            if let Some(t) = state.deadline_timer.take() {
                self.timers.cancel(t);
            }
            out.push(Event::ChildExit(ChildExit {
                id,
                pid,
                status: None,
                stdout: Vec::new(),
                stderr: Vec::new(),
                stdout_truncated: false,
                stderr_truncated: false,
                timed_out: state.timed_out,
                killed: state.killed,
                spawn_error: Some(SpawnError::from(&e)),
            }));
            return;
        }
        if state.killed || state.timed_out {
            let _ = state.child.kill();
        }
        self.children.insert(id, state);
        if starting.paused {
            self.pause_output(id);
        }
        self.flush_stdin(id);
    }

    #[allow(clippy::too_many_arguments)]
    fn setup_child(
        &mut self,
        id: ChildId,
        state: &mut ChildState,
        starting: &Starting,
        pidfd: io::Result<OwnedFd>,
        stdin_pipe: Option<std::process::ChildStdin>,
        stdout_pipe: Option<std::process::ChildStdout>,
        stderr_pipe: Option<std::process::ChildStderr>,
    ) -> io::Result<()> {
        if self.sigchld.is_none() {
            match pidfd {
                Ok(fd) => {
                    let token = self.internal_token(Internal::Child(id, ChildPart::Exit));
                    self.poll.registry().register(
                        &mut SourceFd(&fd.as_raw_fd()),
                        token,
                        Interest::READABLE,
                    )?;
                    state.pidfd = Some((fd, token));
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    log::warn!("pidfd_open unavailable; detecting child exits through SIGCHLD");
                    self.use_sigchld_for_exits()?;
                }
                Err(e) => return Err(e),
            }
        } else {
            // The child may have exited before this point; the next poll sweeps.
            self.sweep_exits = true;
        }
        if let Some(p) = stdin_pipe {
            let mut pipe = Sender::from(p);
            pipe.set_nonblocking(true)?;
            let token = self.internal_token(Internal::Child(id, ChildPart::Stdin));
            self.poll
                .registry()
                .register(&mut pipe, token, Interest::WRITABLE)?;
            state.stdin = Some(InPipe {
                pipe,
                token,
                buf: starting.stdin.clone(),
                close_when_empty: starting.close_stdin,
            });
        }
        for (p, mode, part) in [
            (
                stdout_pipe.map(Receiver::from),
                &starting.spec.stdout,
                ChildPart::Stdout,
            ),
            (
                stderr_pipe.map(Receiver::from),
                &starting.spec.stderr,
                ChildPart::Stderr,
            ),
        ] {
            let Some(mut pipe) = p else { continue };
            pipe.set_nonblocking(true)?;
            let token = self.internal_token(Internal::Child(id, part));
            self.poll
                .registry()
                .register(&mut pipe, token, Interest::READABLE)?;
            let (stream, limit) = match mode {
                OutputMode::Stream => (true, 0),
                OutputMode::Capture { limit } => (false, *limit),
                OutputMode::Null => (false, 0),
            };
            let out = OutPipe {
                pipe,
                token,
                stream,
                limit,
                kept: Vec::new(),
                truncated: false,
                paused: false,
            };
            if part == ChildPart::Stdout {
                state.stdout = Some(out);
            } else {
                state.stderr = Some(out);
            }
        }
        Ok(())
    }

    fn release_child_tokens(&mut self, state: &mut ChildState) {
        let registry = self.poll.registry();
        if let Some((fd, token)) = state.pidfd.take() {
            let _ = registry.deregister(&mut SourceFd(&fd.as_raw_fd()));
            self.internal.remove(&token);
        }
        if let Some(mut p) = state.stdin.take() {
            let _ = registry.deregister(&mut p.pipe);
            self.internal.remove(&p.token);
        }
        for out in [state.stdout.take(), state.stderr.take()]
            .into_iter()
            .flatten()
        {
            let mut out = out;
            let _ = registry.deregister(&mut out.pipe);
            self.internal.remove(&out.token);
        }
    }

    /// Queues bytes for a child's stdin (`StdinMode::Pipe`); written as the pipe accepts them.
    /// Errors: NotFound when the child is unknown or its stdin is already closed.
    pub fn write_stdin(&mut self, id: ChildId, data: &[u8]) -> io::Result<()> {
        if let Some(starting) = self.starting.get_mut(&id) {
            if starting.spec.stdin != StdinMode::Pipe || starting.close_stdin {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{id}: stdin not open"),
                ));
            }
            starting.stdin.extend(data);
            return Ok(());
        }
        let stdin = self
            .children
            .get_mut(&id)
            .and_then(|c| c.stdin.as_mut())
            .filter(|s| !s.close_when_empty)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("{id}: stdin not open"))
            })?;
        stdin.buf.extend(data);
        self.flush_stdin(id);
        Ok(())
    }

    /// Bytes queued for a child's stdin and not yet taken by the pipe (0 for unknown children
    /// and closed stdin): callers bound their own input with it, the reactor does not.
    pub fn stdin_queued(&self, id: ChildId) -> usize {
        if let Some(starting) = self.starting.get(&id) {
            return starting.stdin.len();
        }
        self.children
            .get(&id)
            .and_then(|c| c.stdin.as_ref())
            .map_or(0, |s| s.buf.len())
    }

    /// Stops reading a streamed child's stdout and stderr: once its pipes are full the child
    /// blocks, which is how a slow consumer slows the producer. Output is still drained when the
    /// child exits (one pipe's worth at most). Unknown children are ignored.
    pub fn pause_output(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.paused = true;
            return;
        }
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        for pipe in [state.stdout.as_mut(), state.stderr.as_mut()]
            .into_iter()
            .flatten()
        {
            if !pipe.paused && pipe.stream {
                pipe.paused = true;
                let _ = self.poll.registry().deregister(&mut pipe.pipe);
            }
        }
    }

    /// Undoes `pause_output`; what waits in the pipes is read on this turn of the loop.
    pub fn resume_output(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.paused = false;
            return;
        }
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        for (pipe, part) in [
            (state.stdout.as_mut(), ChildPart::Stdout),
            (state.stderr.as_mut(), ChildPart::Stderr),
        ] {
            let Some(pipe) = pipe else { continue };
            if !pipe.paused {
                continue;
            }
            pipe.paused = false;
            if self
                .poll
                .registry()
                .register(&mut pipe.pipe, pipe.token, Interest::READABLE)
                .is_ok()
            {
                self.again.push((id, part));
            }
        }
    }

    /// Closes a child's stdin once everything queued has been written.
    pub fn close_stdin(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.close_stdin = true;
            return;
        }
        if let Some(stdin) = self.children.get_mut(&id).and_then(|c| c.stdin.as_mut()) {
            stdin.close_when_empty = true;
            self.flush_stdin(id);
        }
    }

    fn flush_stdin(&mut self, id: ChildId) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        let Some(stdin) = state.stdin.as_mut() else {
            return;
        };
        let close = match stdin.flush() {
            Ok(close) => close,
            Err(e) => {
                log::debug!("{id}: stdin write failed: {e}");
                true
            }
        };
        if close {
            if let Some(mut p) = state.stdin.take() {
                let _ = self.poll.registry().deregister(&mut p.pipe);
                self.internal.remove(&p.token);
            }
        }
    }

    /// Sends SIGKILL to a running child (not its process group). Its exit is
    /// reported as usual, with `killed = true`. Unknown or reaped ids are ignored.
    pub fn kill(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.killed = true;
            return;
        }
        if let Some(state) = self.children.get_mut(&id) {
            if state.reaped.is_none() {
                state.killed = true;
                let _ = state.child.kill();
            }
        }
    }

    /// Sends `sig` to a running child (e.g. SIGTERM before a grace period). A child still
    /// starting is not running yet: NotFound.
    pub fn send_signal(&mut self, id: ChildId, sig: i32) -> io::Result<()> {
        let state = self
            .children
            .get_mut(&id)
            .filter(|s| s.reaped.is_none())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{id}: not running")))?;
        let pid = libc::pid_t::try_from(state.pid)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: kill(2) has no memory-safety preconditions. The pid is our own
        // child and has not been reaped (reaped is None), so it cannot have been recycled.
        if unsafe { libc::kill(pid, sig) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits until at least one event has been appended to `out`.
    pub fn poll(&mut self, out: &mut Vec<Event<M>>) -> io::Result<()> {
        let start = out.len();
        loop {
            let timeout = if !self.again.is_empty() || self.sweep_exits {
                Some(Duration::ZERO)
            } else {
                self.timers
                    .next_deadline()
                    .map(|at| at.saturating_duration_since(Instant::now()))
            };
            match self.poll.poll(&mut self.events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            self.now = Instant::now();
            self.ready.clear();
            for ev in self.events.iter() {
                self.ready.push(IoReady {
                    token: ev.token(),
                    readable: ev.is_readable(),
                    writable: ev.is_writable(),
                    error: ev.is_error(),
                    read_closed: ev.is_read_closed(),
                    write_closed: ev.is_write_closed(),
                });
            }
            let ready = std::mem::take(&mut self.ready);
            for r in &ready {
                self.dispatch(*r, out);
            }
            self.ready = ready;

            for (id, part) in std::mem::take(&mut self.again) {
                self.read_output(id, part, out);
            }
            if self.sweep_exits {
                self.sweep_exits = false;
                self.sweep_children(out);
            }
            while let Some((timer, kind)) = self.timers.pop_due(self.now) {
                match kind {
                    TimerKind::User(key) => out.push(Event::Timer { id: timer, key }),
                    TimerKind::Deadline(id) => {
                        if let Some(starting) = self.starting.get_mut(&id) {
                            // Killed as soon as it runs.
                            starting.deadline_timer = None;
                            starting.timed_out = true;
                        }
                        if let Some(state) = self.children.get_mut(&id) {
                            state.deadline_timer = None;
                            if state.reaped.is_some() {
                                continue;
                            }
                            state.timed_out = true;
                            // Not reaped yet, so the PID is still this child's.
                            let pid = i32::try_from(state.pid)
                                .ok()
                                .and_then(rustix::process::Pid::from_raw);
                            match (state.term_grace.take(), pid) {
                                (Some(grace), Some(pid)) => {
                                    log::debug!(
                                        "{id} (pid {}) passed its deadline; SIGTERM, SIGKILL \
                                         in {grace:?}",
                                        state.pid
                                    );
                                    let term = rustix::process::Signal::Term;
                                    let _ = rustix::process::kill_process(pid, term);
                                    state.deadline_timer = Some(
                                        self.timers
                                            .insert(self.now + grace, TimerKind::Deadline(id)),
                                    );
                                }
                                _ => {
                                    log::debug!(
                                        "{id} (pid {}) passed its deadline; killing",
                                        state.pid
                                    );
                                    let _ = state.child.kill();
                                }
                            }
                        }
                    }
                    TimerKind::Drain(id) => {
                        if let Some(state) = self.children.get_mut(&id) {
                            state.drain_timer = None;
                        }
                        self.read_output(id, ChildPart::Stdout, out);
                        self.read_output(id, ChildPart::Stderr, out);
                        self.close_output(id, ChildPart::Stdout);
                        self.close_output(id, ChildPart::Stderr);
                        self.try_complete(id, out);
                    }
                }
            }
            if out.len() > start {
                return Ok(());
            }
        }
    }

    fn dispatch(&mut self, r: IoReady, out: &mut Vec<Event<M>>) {
        if r.token == WAKER {
            for started in self.spawner.take_started() {
                self.started(started, out);
            }
            out.extend(
                pool::drain(&self.notifier.queue)
                    .into_iter()
                    .map(Event::Work),
            );
            return;
        }
        if r.token.0 < INTERNAL_BASE {
            out.push(Event::Io(r));
            return;
        }
        // Events for internal tokens already released in this batch are dropped.
        let Some(what) = self.internal.get(&r.token).copied() else {
            return;
        };
        match what {
            Internal::Signal(sig) => {
                let pipe = self.signals.iter_mut().find(|p| p.token == r.token);
                if pipe.is_some_and(|p| drain_stream(&mut p.reader)) {
                    out.push(Event::Signal(sig));
                }
            }
            Internal::SigChld => {
                if let Some(p) = self.sigchld.as_mut() {
                    drain_stream(&mut p.reader);
                }
                self.sweep_children(out);
            }
            Internal::Child(id, ChildPart::Stdin) => self.flush_stdin(id),
            Internal::Child(id, part @ (ChildPart::Stdout | ChildPart::Stderr)) => {
                self.read_output(id, part, out)
            }
            Internal::Child(id, ChildPart::Exit) => self.reap(id, out),
        }
    }

    fn sweep_children(&mut self, out: &mut Vec<Event<M>>) {
        let ids: Vec<ChildId> = self
            .children
            .iter()
            .filter(|(_, s)| s.reaped.is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.reap(id, out);
        }
    }

    /// Collects the exit status if the child has exited; then drains what is
    /// left in its pipes and reports it once they are closed.
    fn reap(&mut self, id: ChildId, out: &mut Vec<Event<M>>) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        if state.reaped.is_some() {
            return;
        }
        match state.child.try_wait() {
            Ok(Some(status)) => state.reaped = Some(Some(status)),
            Ok(None) => return,
            Err(e) => {
                log::warn!("{id} (pid {}): exit status lost: {e}", state.pid);
                state.reaped = Some(None);
            }
        }
        if let Some((fd, token)) = state.pidfd.take() {
            let _ = self
                .poll
                .registry()
                .deregister(&mut SourceFd(&fd.as_raw_fd()));
            self.internal.remove(&token);
        }
        if let Some(mut p) = state.stdin.take() {
            let _ = self.poll.registry().deregister(&mut p.pipe);
            self.internal.remove(&p.token);
        }
        if let Some(t) = state.deadline_timer.take() {
            self.timers.cancel(t);
        }
        self.read_output(id, ChildPart::Stdout, out);
        self.read_output(id, ChildPart::Stderr, out);
        if let Some(state) = self.children.get_mut(&id) {
            if state.stdout.is_some() || state.stderr.is_some() {
                let t = self
                    .timers
                    .insert(Instant::now() + EXIT_DRAIN_GRACE, TimerKind::Drain(id));
                state.drain_timer = Some(t);
            }
        }
        self.try_complete(id, out);
    }

    fn read_output(&mut self, id: ChildId, part: ChildPart, out: &mut Vec<Event<M>>) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        let (pipe, stream) = match part {
            ChildPart::Stdout => (state.stdout.as_mut(), Stream::Stdout),
            ChildPart::Stderr => (state.stderr.as_mut(), Stream::Stderr),
            _ => return,
        };
        let Some(pipe) = pipe else { return };
        if pipe.paused && state.reaped.is_none() {
            return;
        }
        let outcome = pipe.read_some(&mut self.scratch, &mut |data| {
            out.push(Event::ChildOutput { id, stream, data });
        });
        match outcome {
            ReadOutcome::Pending => {}
            ReadOutcome::More => self.again.push((id, part)),
            ReadOutcome::Eof => {
                self.close_output(id, part);
                self.try_complete(id, out);
            }
        }
    }

    fn close_output(&mut self, id: ChildId, part: ChildPart) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        let (slot, result) = match part {
            ChildPart::Stdout => (&mut state.stdout, &mut state.stdout_result),
            ChildPart::Stderr => (&mut state.stderr, &mut state.stderr_result),
            _ => return,
        };
        if let Some(mut p) = slot.take() {
            let _ = self.poll.registry().deregister(&mut p.pipe);
            self.internal.remove(&p.token);
            *result = (std::mem::take(&mut p.kept), p.truncated);
        }
    }

    fn try_complete(&mut self, id: ChildId, out: &mut Vec<Event<M>>) {
        let done = self
            .children
            .get(&id)
            .is_some_and(|s| s.reaped.is_some() && s.stdout.is_none() && s.stderr.is_none());
        if !done {
            return;
        }
        let Some(mut state) = self.children.remove(&id) else {
            return;
        };
        for t in [state.deadline_timer.take(), state.drain_timer.take()]
            .into_iter()
            .flatten()
        {
            self.timers.cancel(t);
        }
        self.release_child_tokens(&mut state);
        let (stdout, stdout_truncated) = std::mem::take(&mut state.stdout_result);
        let (stderr, stderr_truncated) = std::mem::take(&mut state.stderr_result);
        out.push(Event::ChildExit(ChildExit {
            id,
            pid: state.pid,
            status: state.reaped.flatten(),
            stdout,
            stderr,
            stdout_truncated,
            stderr_truncated,
            timed_out: state.timed_out,
            killed: state.killed,
            spawn_error: None,
        }));
    }
}

fn drain_stream(reader: &mut mio::net::UnixStream) -> bool {
    let mut buf = [0u8; 64];
    let mut any = false;
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return any,
            Ok(_) => any = true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return any,
        }
    }
}

impl<M: Send + 'static> Drop for Reactor<M> {
    fn drop(&mut self) {
        for started in self.spawner.close() {
            if let Ok((mut child, _)) = started.result {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        for (_, state) in self.children.iter_mut() {
            if state.reaped.is_none() {
                let _ = state.child.kill();
                let _ = state.child.wait();
            }
        }
        for p in self.signals.drain(..).chain(self.sigchld.take()) {
            signal_hook::low_level::unregister(p.sig_id);
        }
    }
}

/// pidfd_open(2): a file descriptor that becomes readable when `pid` exits.
pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is shared.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the syscall just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
