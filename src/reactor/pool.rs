//! The bounded worker pool and the cross-thread notifier that wakes the loop.
//! Owns the worker threads and the result queue; it never touches daemon state.

use std::collections::VecDeque;
use std::fmt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread;

/// A job for the worker pool: blocking work whose result comes back as `Event::Work`.
pub type Job<M> = Box<dyn FnOnce() -> M + Send + 'static>;

/// The worker queue was full (or the pool has stopped); the job was not accepted.
/// The caller decides whether to retry later or fail the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

impl fmt::Display for QueueFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("worker queue full")
    }
}

impl std::error::Error for QueueFull {}

/// Posts messages into the loop from any thread and wakes it. Clone + Send.
/// Messages arrive as `Event::Work(m)` in posting order.
pub struct Notifier<M> {
    pub(crate) queue: Arc<Mutex<VecDeque<M>>>,
    pub(crate) waker: Arc<mio::Waker>,
}

impl<M> Clone for Notifier<M> {
    fn clone(&self) -> Self {
        Notifier {
            queue: Arc::clone(&self.queue),
            waker: Arc::clone(&self.waker),
        }
    }
}

impl<M> Notifier<M> {
    /// Queues `message` for the loop and wakes it. Never blocks for long: the
    /// lock is held only to push. A wake error (the loop is gone) is ignored
    /// because nobody is left to receive the message.
    pub fn post(&self, message: M) {
        match self.queue.lock() {
            Ok(mut q) => q.push_back(message),
            Err(poisoned) => poisoned.into_inner().push_back(message),
        }
        let _ = self.waker.wake();
    }
}

pub(crate) fn drain<M>(queue: &Mutex<VecDeque<M>>) -> VecDeque<M> {
    match queue.lock() {
        Ok(mut q) => std::mem::take(&mut *q),
        Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
    }
}

/// A fixed set of threads fed from a bounded queue. Dropping the pool closes
/// the queue; idle workers exit, busy ones finish their job first (they are
/// detached so a long blob transfer cannot hold up shutdown).
pub(crate) struct Pool<M> {
    sender: Option<SyncSender<Job<M>>>,
}

impl<M: Send + 'static> Pool<M> {
    pub(crate) fn new(
        name: &str,
        workers: usize,
        queue_cap: usize,
        notifier: Notifier<M>,
    ) -> std::io::Result<Self> {
        let (sender, receiver) = sync_channel::<Job<M>>(queue_cap);
        let receiver = Arc::new(Mutex::new(receiver));
        for n in 0..workers {
            let receiver = Arc::clone(&receiver);
            let notifier = notifier.clone();
            thread::Builder::new()
                .name(format!("{name}-{n}"))
                .spawn(move || worker(&receiver, &notifier))?;
        }
        Ok(Pool {
            sender: if workers == 0 { None } else { Some(sender) },
        })
    }

    pub(crate) fn submit(&self, job: Job<M>) -> Result<(), QueueFull> {
        let sender = self.sender.as_ref().ok_or(QueueFull)?;
        sender.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) | TrySendError::Disconnected(_) => QueueFull,
        })
    }
}

fn worker<M>(receiver: &Mutex<Receiver<Job<M>>>, notifier: &Notifier<M>) {
    loop {
        let job = {
            let guard = match receiver.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            match guard.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        notifier.post(job());
    }
}
