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
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread;

use super::child::ChildId;
use super::process::{self, Process, ProcessSpec};

/// Threads starting children at once: a burst's execs overlap instead of queueing behind one.
const SPAWNER_THREADS: usize = 4;

/// A child the loop asked for.
pub(crate) struct Request {
    pub(crate) id: ChildId,
    pub(crate) process: ProcessSpec,
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

type Line = Arc<Mutex<Option<Sender<Request>>>>;

thread_local! {
    /// The request lines of the reactors whose spawner threads this thread owns; closed when
    /// the thread ends (see the module comment).
    static OWNED_LINES: RefCell<LineGuard> = const { RefCell::new(LineGuard(Vec::new())) };
}

struct LineGuard(Vec<Weak<Mutex<Option<Sender<Request>>>>>);

impl Drop for LineGuard {
    fn drop(&mut self) {
        for line in self.0.drain(..).filter_map(|w| w.upgrade()) {
            lock(&line).take();
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
        let guard = lock(&line);
        let sender = guard.as_ref().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the thread that owns the reactor's spawner threads has ended",
            )
        })?;
        sender
            .send(req)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "spawner threads are gone"))
    }

    /// Starts the threads and ties their life to the calling thread.
    fn start(&self) -> io::Result<Line> {
        let (sender, receiver) = channel::<Request>();
        let receiver = Arc::new(Mutex::new(receiver));
        for n in 0..SPAWNER_THREADS {
            let receiver = Arc::clone(&receiver);
            let done = Arc::clone(&self.done);
            let waker = Arc::clone(&self.waker);
            thread::Builder::new()
                .name(format!("vk-spawn-{n}"))
                .spawn(move || spawner(&receiver, &done, &waker))?;
        }
        let line: Line = Arc::new(Mutex::new(Some(sender)));
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
            lock(&line).take();
        }
        let mut done = lock(&self.done);
        done.closed = true;
        std::mem::take(&mut done.started)
    }
}

fn spawner(receiver: &Mutex<Receiver<Request>>, done: &Mutex<Done>, waker: &mio::Waker) {
    loop {
        let req = match lock(receiver).recv() {
            Ok(req) => req,
            Err(_) => return,
        };
        let Request { id, process } = req;
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
