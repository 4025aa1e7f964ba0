//! The spawner threads: they start the reactor's children so the loop never waits for
//! an exec, and hand each started child (with its pidfd) back through the loop's waker.
//!
//! Why threads: a spawn returns only once the child has exec'd (the spawning thread is
//! suspended until then), and the exec needs the child's own CPU time: up to tens of ms on a
//! loaded host, which the loop thread must not spend waiting.
//!
//! Parent death: every child is spawned with PR_SET_PDEATHSIG (see `process::spawn`), which
//! fires when the *thread* that spawned it ends. The spawner threads therefore live exactly
//! as long as the thread that first spawned through the reactor (the daemon's loop thread): a
//! thread-local guard of that thread closes the request line when the thread ends, the spawner
//! threads then end too, and the kernel kills the children as before. Dropping the reactor also
//! closes the line, after it killed and reaped its children.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread;

use super::child::ChildId;
use super::process::{self, Process, ProcessSpec};

/// Threads starting children at once: a burst's execs overlap instead of queueing behind one.
const SPAWNER_THREADS: usize = 4;

/// A child the loop asked for.
pub(crate) struct Request {
    pub(crate) id: ChildId,
    pub(crate) process: ProcessSpec,
    /// Goes ahead of the requests waiting (behind earlier urgent ones): see `ChildSpec::urgent`.
    pub(crate) urgent: bool,
}

/// What a spawner thread hands back: the running child and its pidfd, or why it did not start.
pub(crate) struct Started {
    pub(crate) id: ChildId,
    pub(crate) result: io::Result<(Process, io::Result<OwnedFd>)>,
}

/// Started children waiting for the loop. `closed` once the reactor is gone: a spawner thread
/// that finishes a spawn after that kills and reaps the child itself, so none is left behind.
#[derive(Default)]
pub(crate) struct Done {
    pub(crate) started: VecDeque<Started>,
    pub(crate) closed: bool,
}

/// The requests waiting for a spawner thread, urgent ones first; `open` until the reactor or
/// the thread that owns it is gone, after which the threads spawn what waits and end.
#[derive(Default)]
struct Waiting {
    requests: VecDeque<Request>,
    urgent: usize,
    open: bool,
}

impl Waiting {
    /// Urgent requests behind the urgent ones waiting, the rest at the back.
    fn push(&mut self, req: Request) {
        if req.urgent {
            self.requests.insert(self.urgent, req);
            self.urgent += 1;
        } else {
            self.requests.push_back(req);
        }
    }
}

/// The request line: the waiting requests and the signal that one arrived (or the line closed).
#[derive(Default)]
struct Queue {
    waiting: Mutex<Waiting>,
    arrived: Condvar,
}

impl Queue {
    fn close(&self) {
        lock(&self.waiting).open = false;
        self.arrived.notify_all();
    }

    /// The next request, waiting for one; None once the line is closed and drained.
    fn next(&self) -> Option<Request> {
        let mut waiting = lock(&self.waiting);
        loop {
            if let Some(req) = waiting.requests.pop_front() {
                waiting.urgent = waiting.urgent.saturating_sub(1);
                return Some(req);
            }
            if !waiting.open {
                return None;
            }
            waiting = match self.arrived.wait(waiting) {
                Ok(w) => w,
                Err(poisoned) => poisoned.into_inner(),
            };
        }
    }
}

type Line = Arc<Queue>;

thread_local! {
    /// The request lines of the reactors whose spawner threads this thread owns; closed when
    /// the thread ends (see the module comment).
    static OWNED_LINES: RefCell<LineGuard> = const { RefCell::new(LineGuard(Vec::new())) };
}

struct LineGuard(Vec<Weak<Queue>>);

impl Drop for LineGuard {
    fn drop(&mut self) {
        for line in self.0.drain(..).filter_map(|w| w.upgrade()) {
            line.close();
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// The loop's end of the spawner threads.
pub(crate) struct Spawner {
    /// None until the first spawn starts the threads.
    line: Option<Line>,
    pub(crate) done: Arc<Mutex<Done>>,
    waker: Arc<mio::Waker>,
}

impl Spawner {
    pub(crate) fn new(waker: Arc<mio::Waker>) -> Self {
        Spawner {
            line: None,
            done: Arc::new(Mutex::new(Done::default())),
            waker,
        }
    }

    /// Hands `req` to a spawner thread; its `Started` comes back through the waker.
    pub(crate) fn request(&mut self, req: Request) -> io::Result<()> {
        let line = match &self.line {
            Some(line) => Arc::clone(line),
            None => {
                let line = self.start()?;
                self.line = Some(Arc::clone(&line));
                line
            }
        };
        let mut waiting = lock(&line.waiting);
        if !waiting.open {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the thread that owns the reactor's spawner threads has ended",
            ));
        }
        waiting.push(req);
        drop(waiting);
        line.arrived.notify_one();
        Ok(())
    }

    /// Starts the threads and ties their life to the calling thread.
    fn start(&self) -> io::Result<Line> {
        let line: Line = Arc::new(Queue::default());
        lock(&line.waiting).open = true;
        for n in 0..SPAWNER_THREADS {
            let line = Arc::clone(&line);
            let done = Arc::clone(&self.done);
            let waker = Arc::clone(&self.waker);
            thread::Builder::new()
                .name(format!("vk-spawn-{n}"))
                .spawn(move || spawner(&line, &done, &waker))?;
        }
        OWNED_LINES.with(|owned| owned.borrow_mut().0.push(Arc::downgrade(&line)));
        Ok(line)
    }

    /// Takes what the spawner threads finished since the last call.
    pub(crate) fn take_started(&self) -> VecDeque<Started> {
        std::mem::take(&mut lock(&self.done).started)
    }

    /// The reactor is going: no more requests; children started from now on are killed by
    /// their spawner thread, and those already handed back but not taken are returned.
    pub(crate) fn close(&mut self) -> VecDeque<Started> {
        if let Some(line) = self.line.take() {
            line.close();
        }
        let mut done = lock(&self.done);
        done.closed = true;
        std::mem::take(&mut done.started)
    }
}

fn spawner(line: &Queue, done: &Mutex<Done>, waker: &mio::Waker) {
    while let Some(req) = line.next() {
        let Request { id, process, .. } = req;
        let result = process::spawn(&process).map(|child| {
            let pidfd = pidfd_open(child.id());
            (child, pidfd)
        });
        let mut queue = lock(done);
        if queue.closed {
            if let Ok((mut child, _)) = result {
                let _ = child.kill();
                let _ = child.wait();
            }
            continue;
        }
        queue.started.push_back(Started { id, result });
        drop(queue);
        let _ = waker.wake();
    }
}

/// pidfd_open(2): a file descriptor that becomes readable when `pid` exits.
fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urgent_requests_go_ahead_of_the_others_in_their_own_order() {
        let mut waiting = Waiting::default();
        for (id, urgent) in [(1, false), (2, false), (3, true), (4, false), (5, true)] {
            waiting.push(Request {
                id: ChildId(id),
                process: ProcessSpec::new(vec!["true".into()]),
                urgent,
            });
        }
        let order: Vec<u64> = waiting.requests.iter().map(|r| r.id.0).collect();
        assert_eq!(order, [3, 5, 1, 2, 4]);
        waiting.open = true;
        let line = Queue {
            waiting: Mutex::new(waiting),
            arrived: Condvar::new(),
        };
        assert_eq!(line.next().map(|r| r.id.0), Some(3));
        assert_eq!(line.next().map(|r| r.id.0), Some(5));
        // The urgent count followed the two taken: the next urgent one leads again.
        lock(&line.waiting).push(Request {
            id: ChildId(6),
            process: ProcessSpec::new(vec!["true".into()]),
            urgent: true,
        });
        line.close();
        let rest: Vec<u64> = std::iter::from_fn(|| line.next()).map(|r| r.id.0).collect();
        assert_eq!(rest, [6, 1, 2, 4], "a closed line is drained, then ends");
    }
}
