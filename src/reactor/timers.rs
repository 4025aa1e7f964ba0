//! The timer wheel of the reactor: a min-heap of deadlines with cancel by id.
//! Owns only deadlines and ids; it never reads the clock itself (callers pass `now`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

/// Identifies one armed timer. Ids are never reused, so cancelling a fired or
/// unknown id is harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId(pub u64);

/// A min-heap of `(deadline, id)` with lazy deletion: cancel removes the id from
/// the live map; the stale heap entry is skipped when it reaches the top. The heap
/// is compacted when stale entries outnumber live ones, so memory stays bounded
/// under cancel-heavy use (probe schedules re-armed every few seconds).
#[derive(Debug)]
pub struct Timers<T> {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    live: HashMap<u64, T>,
    next_id: u64,
}

impl<T> Default for Timers<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Timers<T> {
    pub fn new() -> Self {
        Timers {
            heap: BinaryHeap::new(),
            live: HashMap::new(),
            next_id: 1,
        }
    }

    /// Arms a timer that fires at `at` carrying `payload`.
    pub fn insert(&mut self, at: Instant, payload: T) -> TimerId {
        let id = self.next_id;
        self.next_id += 1;
        self.heap.push(Reverse((at, id)));
        self.live.insert(id, payload);
        TimerId(id)
    }

    /// Disarms a timer. Returns true when the timer was still armed.
    pub fn cancel(&mut self, id: TimerId) -> bool {
        let was_live = self.live.remove(&id.0).is_some();
        if self.heap.len() > 64 && self.heap.len() > 2 * self.live.len() {
            let live = &self.live;
            self.heap.retain(|Reverse((_, id))| live.contains_key(id));
        }
        was_live
    }

    /// The earliest armed deadline, skipping cancelled entries.
    pub fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(Reverse((at, id))) = self.heap.peek() {
            if self.live.contains_key(id) {
                return Some(*at);
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns the earliest timer whose deadline is at or before `now`.
    /// Timers come out in deadline order; equal deadlines in arming order.
    pub fn pop_due(&mut self, now: Instant) -> Option<(TimerId, T)> {
        loop {
            let Reverse((at, id)) = *self.heap.peek()?;
            if !self.live.contains_key(&id) {
                self.heap.pop();
                continue;
            }
            if at > now {
                return None;
            }
            self.heap.pop();
            let payload = self.live.remove(&id)?;
            return Some((TimerId(id), payload));
        }
    }

    /// Number of armed timers.
    pub fn len(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn pops_in_deadline_order_and_skips_cancelled() {
        let base = Instant::now();
        let mut timers = Timers::new();
        let c = timers.insert(base + Duration::from_millis(30), "c");
        let _a = timers.insert(base + Duration::from_millis(10), "a");
        let b = timers.insert(base + Duration::from_millis(20), "b");
        let _a2 = timers.insert(base + Duration::from_millis(10), "a2");
        assert!(timers.cancel(b));
        assert!(!timers.cancel(b));
        assert_eq!(
            timers.next_deadline(),
            Some(base + Duration::from_millis(10))
        );
        assert!(timers.pop_due(base).is_none());
        let later = base + Duration::from_millis(40);
        let order: Vec<_> = std::iter::from_fn(|| timers.pop_due(later).map(|(_, p)| p)).collect();
        assert_eq!(order, vec!["a", "a2", "c"]);
        assert!(!timers.cancel(c));
        assert_eq!(timers.len(), 0);
    }

    #[test]
    fn heavy_cancel_keeps_heap_bounded() {
        let base = Instant::now();
        let mut timers = Timers::new();
        for i in 0..10_000u64 {
            let id = timers.insert(base + Duration::from_secs(i), i);
            timers.cancel(id);
        }
        assert!(timers.heap.len() <= 130, "heap len {}", timers.heap.len());
        assert_eq!(timers.next_deadline(), None);
    }
}
