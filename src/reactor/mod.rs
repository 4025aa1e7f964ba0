//! The single mio poll loop: tokens, timers, child processes, signals and the worker-pool waker.
//! It owns no daemon state; it reports readiness and completions as events.
//!
//! # Contract (what every room codes against)
//!
//! ```text
//! Reactor::<M>::new(workers, queue_cap)      one loop; M = message type of worker jobs / notifier posts
//! reactor.registry() / reactor.token()       register your own mio sources under a fresh token;
//!                                            their readiness comes back as Event::Io(IoReady)
//! reactor.token_in(range)                    a fresh token of an owner's range (`ranges.rs`):
//!                                            Range::of_token / of_timer_key name the owner
//! reactor.now()                              the clock, read once per wake-up of poll()
//! reactor.timer_at(at, key) / timer_after    one-shot timers -> Event::Timer { id, key }; re-arm by
//! reactor.cancel_timer(id)                   arming a new one. A cancelled timer never fires; a timer
//!                                            never fires before its instant; equal instants fire
//!                                            in arming order.
//! reactor.spawn(ChildSpec)                   child with non-blocking registered pipes, started by a
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
mod children;
mod pool;
pub mod priority;
pub(crate) mod process;
mod ranges;
pub mod sd_notify;
mod signals;
mod spawner;
mod timers;

pub use child::{
    ChildExit, ChildId, ChildSpec, OutputMode, SpawnError, StdinMode, Stream, DEFAULT_CAPTURE_LIMIT,
};
pub use mio::{Interest, Registry, Token};
pub use pool::{Notifier, QueueFull};
pub use ranges::Range;
pub use timers::TimerId;

thread_local! {
    /// Set on the thread that polls a reactor: blocking helpers assert they never run there.
    static LOOP_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread runs a reactor's loop (it has called `poll`). Debug assertions
/// in blocking helpers (name lookups) use it to prove they stay off the loop.
pub fn on_loop_thread() -> bool {
    LOOP_THREAD.with(|on| on.get())
}

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::{Events, Poll, Waker};

use child::{ChildPart, ChildState, Starting};
use pool::Pool;
use signals::SignalPipe;
use spawner::Spawner;
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
/// user tokens stay below it whatever their owner range, so the two never meet.
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

/// The event loop. See the module documentation for the contract.
pub struct Reactor<M: Send + 'static> {
    poll: Poll,
    events: Events,
    ready: Vec<IoReady>,
    timers: Timers<TimerKind>,
    /// The next user token of each owner range (see `ranges.rs`).
    next_user_token: Vec<usize>,
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
            next_user_token: ranges::counters(),
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

    /// A fresh token of the default range, never handed out before.
    pub fn token(&mut self) -> Token {
        self.token_in(Range::DEFAULT)
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

    /// Waits until at least one event has been appended to `out`.
    pub fn poll(&mut self, out: &mut Vec<Event<M>>) -> io::Result<()> {
        LOOP_THREAD.with(|on| on.set(true));
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
                    TimerKind::Deadline(id) => self.deadline_passed(id),
                    TimerKind::Drain(id) => self.drain_ended(id, out),
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
            Internal::Signal(sig) => self.signal_ready(r.token, sig, out),
            Internal::SigChld => self.sigchld_ready(out),
            Internal::Child(id, ChildPart::Stdin) => self.flush_stdin(id),
            Internal::Child(id, part @ (ChildPart::Stdout | ChildPart::Stderr)) => {
                self.read_output(id, part, out)
            }
            Internal::Child(id, ChildPart::Exit) => self.reap(id, out),
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
        self.unregister_signals();
    }
}
