//! Request accounting of the fake API server: how many requests each authenticated identity
//! made, by verb and resource, in each second since the server started (restarts included).
//!
//! The request log keeps the last requests in full for assertions on what was sent; this keeps
//! only counters, so a fleet bench can count every request of every node for as long as it runs.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{lock, ApiServerHandle};

/// Requests of one identity, verb and resource within one second.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RequestCount {
    /// Whole seconds since `ApiServerHandle::accounting_epoch`.
    pub second: u64,
    /// The authenticated user ("" when the request was refused as unauthenticated).
    pub user: String,
    /// get, list, watch, create, update, patch, delete, ...
    pub verb: String,
    /// "pods", "pods/status", "leases", ... ("" for discovery and health).
    pub resource: String,
    pub count: u64,
}

type Key = (u64, String, String, String);

/// The counters, shared by every connection thread.
pub(crate) struct Tally {
    epoch: Instant,
    counts: Mutex<HashMap<Key, u64>>,
}

impl Tally {
    pub(crate) fn new() -> Tally {
        Tally {
            epoch: Instant::now(),
            counts: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn count(&self, at: Instant, user: &str, verb: &str, resource: &str) {
        let second = at.saturating_duration_since(self.epoch).as_secs();
        let key = (
            second,
            user.to_string(),
            verb.to_string(),
            resource.to_string(),
        );
        *lock(&self.counts).entry(key).or_insert(0) += 1;
    }

    fn snapshot(&self) -> Vec<RequestCount> {
        let mut out: Vec<RequestCount> = lock(&self.counts)
            .iter()
            .map(|((second, user, verb, resource), count)| RequestCount {
                second: *second,
                user: user.clone(),
                verb: verb.clone(),
                resource: resource.clone(),
                count: *count,
            })
            .collect();
        out.sort();
        out
    }
}

impl ApiServerHandle {
    /// The instant second 0 of `request_counts` starts at (the server's first start).
    pub fn accounting_epoch(&self) -> Instant {
        self.shared().tally.epoch
    }

    /// The second of `request_counts` that `at` falls in.
    pub fn accounting_second(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.accounting_epoch())
            .as_secs()
    }

    /// Every request served since the start, counted per second, identity, verb and resource,
    /// sorted by second. Nothing is ever dropped: one counter per busy (second, key).
    pub fn request_counts(&self) -> Vec<RequestCount> {
        self.shared().tally.snapshot()
    }

    /// The counts of the seconds in `[from, to)` only.
    pub fn request_counts_between(&self, from: Instant, to: Instant) -> Vec<RequestCount> {
        let (a, b) = (self.accounting_second(from), self.accounting_second(to));
        let mut all = self.request_counts();
        all.retain(|c| c.second >= a && c.second < b);
        all
    }

    /// How long the accounting has run.
    pub fn accounting_age(&self) -> Duration {
        self.accounting_epoch().elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_second_user_verb_and_resource() {
        let t = Tally::new();
        let at = t.epoch;
        t.count(at, "system:node:a", "update", "leases");
        t.count(
            at + Duration::from_millis(900),
            "system:node:a",
            "update",
            "leases",
        );
        t.count(
            at + Duration::from_millis(1100),
            "system:node:a",
            "update",
            "leases",
        );
        t.count(at, "system:node:b", "list", "pods");
        let s = t.snapshot();
        let find = |second, user: &str, verb: &str| {
            s.iter()
                .find(|c| c.second == second && c.user == user && c.verb == verb)
                .map(|c| c.count)
        };
        assert_eq!(find(0, "system:node:a", "update"), Some(2));
        assert_eq!(find(1, "system:node:a", "update"), Some(1));
        assert_eq!(find(0, "system:node:b", "list"), Some(1));
        assert_eq!(find(1, "system:node:b", "list"), None);
        assert_eq!(s.iter().map(|c| c.count).sum::<u64>(), 4);
    }
}
