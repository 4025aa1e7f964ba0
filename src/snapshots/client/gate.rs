//! Counting semaphores of the registry client: open downloads and the node-wide transfer
//! gates. A permit is a held slot, released when it drops.

use std::sync::{Arc, Condvar, Mutex};

use super::lock;

/// Counting semaphore (open downloads, the node-wide transfer gates).
pub struct Gate {
    open: Mutex<usize>,
    cv: Condvar,
    max: usize,
    /// Most permits ever held at once (observability for tests and logs).
    peak: Mutex<usize>,
}

impl Gate {
    pub(super) fn new(max: usize) -> Arc<Gate> {
        Arc::new(Gate {
            open: Mutex::new(0),
            cv: Condvar::new(),
            max: max.max(1),
            peak: Mutex::new(0),
        })
    }

    /// Blocks until a slot is free; the slot is released when the permit drops.
    pub fn acquire(self: &Arc<Self>) -> GatePermit {
        {
            let mut n = lock(&self.open);
            while *n >= self.max {
                n = self.cv.wait(n).unwrap_or_else(|p| p.into_inner());
            }
            *n += 1;
            let mut peak = lock(&self.peak);
            *peak = (*peak).max(*n);
        }
        GatePermit { gate: self.clone() }
    }

    /// Permits held right now.
    pub fn in_use(&self) -> usize {
        *lock(&self.open)
    }

    /// Most permits held at once since the client was created.
    pub fn peak(&self) -> usize {
        *lock(&self.peak)
    }
}

/// A held download slot; released on drop.
pub struct GatePermit {
    gate: Arc<Gate>,
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        let mut n = lock(&self.gate.open);
        *n -= 1;
        self.gate.cv.notify_one();
    }
}
