//! Fault knobs tests turn at run time: canned error answers for matching requests, added
//! latency, periodic watch drops. Plain state behind a mutex; the server consults it per request.

use super::meta::ApiError;
use std::sync::Mutex;
use std::time::Duration;

/// A canned failure answered instead of serving the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// 409 Conflict (reason Conflict, "the object has been modified").
    Conflict,
    /// HTTP 410 Gone (reason Expired) before any body; for a watch, instead of the stream.
    Gone,
    /// For a watch: a 200 stream whose first line is an ERROR event carrying a 410 Status.
    /// For other verbs this behaves like `Gone`.
    GoneEvent,
    /// 429 TooManyRequests with a Retry-After header of this many seconds.
    TooManyRequests { retry_after_secs: u32 },
    /// 500 InternalError.
    InternalError,
}

/// Which requests a fault applies to. `None` fields match anything.
/// Verbs are the API's: get, list, watch, create, update, patch, delete.
/// Resources are plural names, with "/status" for the subresource ("pods/status", "leases").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultMatch {
    pub verb: Option<String>,
    pub resource: Option<String>,
}

impl FaultMatch {
    pub fn any() -> Self {
        FaultMatch::default()
    }

    pub fn new(verb: &str, resource: &str) -> Self {
        FaultMatch {
            verb: Some(verb.to_string()),
            resource: Some(resource.to_string()),
        }
    }

    pub fn verb(verb: &str) -> Self {
        FaultMatch {
            verb: Some(verb.to_string()),
            resource: None,
        }
    }

    pub fn resource(resource: &str) -> Self {
        FaultMatch {
            verb: None,
            resource: Some(resource.to_string()),
        }
    }

    fn matches(&self, verb: &str, resource: &str) -> bool {
        self.verb.as_deref().is_none_or(|v| v == verb)
            && self.resource.as_deref().is_none_or(|r| r == resource)
    }
}

struct Armed {
    on: FaultMatch,
    fault: Fault,
    remaining: u32,
}

#[derive(Default)]
struct State {
    armed: Vec<Armed>,
    latency: Duration,
    pod_write_latency: Duration,
    drop_watches_every: Option<Duration>,
    injected: u64,
}

#[derive(Default)]
pub struct Faults {
    state: Mutex<State>,
}

impl Faults {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answer the next `count` requests matching `on` with `fault` (queued after earlier arms).
    pub fn fail_next(&self, count: u32, on: FaultMatch, fault: Fault) {
        if count > 0 {
            self.lock().armed.push(Armed {
                on,
                fault,
                remaining: count,
            });
        }
    }

    pub fn clear(&self) {
        let mut s = self.lock();
        s.armed.clear();
        s.latency = Duration::ZERO;
        s.pod_write_latency = Duration::ZERO;
        s.drop_watches_every = None;
    }

    /// Consumes one armed fault matching this request, if any.
    pub fn take(&self, verb: &str, resource: &str) -> Option<Fault> {
        let mut s = self.lock();
        let pos = s.armed.iter().position(|a| a.on.matches(verb, resource))?;
        let fault = s.armed[pos].fault;
        s.armed[pos].remaining -= 1;
        if s.armed[pos].remaining == 0 {
            s.armed.remove(pos);
        }
        s.injected += 1;
        Some(fault)
    }

    /// How many faults have been answered so far.
    pub fn injected(&self) -> u64 {
        self.lock().injected
    }

    pub fn set_latency(&self, d: Duration) {
        self.lock().latency = d;
    }

    pub fn set_pod_write_latency(&self, d: Duration) {
        self.lock().pod_write_latency = d;
    }

    /// The delay before serving a request: the global latency, plus the pod-write latency for
    /// writes (create, update, patch, delete) of pods and their subresources.
    pub fn delay_for(&self, verb: &str, resource: &str) -> Duration {
        let s = self.lock();
        let pod_write = (resource == "pods" || resource.starts_with("pods/"))
            && matches!(verb, "create" | "update" | "patch" | "delete");
        if pod_write {
            s.latency + s.pod_write_latency
        } else {
            s.latency
        }
    }

    pub fn set_drop_watches_every(&self, every: Option<Duration>) {
        self.lock().drop_watches_every = every.filter(|d| !d.is_zero());
    }

    pub fn drop_watches_every(&self) -> Option<Duration> {
        self.lock().drop_watches_every
    }
}

impl Fault {
    /// The error answered for a non-streaming request.
    pub fn error(self, what: &str) -> ApiError {
        match self {
            Fault::Conflict => ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {what}: the object has been modified; \
                     please apply your changes to the latest version and try again (injected)"
                ),
            ),
            Fault::Gone | Fault::GoneEvent => {
                ApiError::expired("too old resource version: injected fault")
            }
            Fault::TooManyRequests { retry_after_secs } => {
                ApiError::too_many_requests(retry_after_secs)
            }
            Fault::InternalError => ApiError::internal("injected internal error"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_consumed_in_order_and_matched() {
        let f = Faults::default();
        f.fail_next(2, FaultMatch::new("patch", "pods/status"), Fault::Conflict);
        f.fail_next(1, FaultMatch::verb("watch"), Fault::GoneEvent);
        assert_eq!(f.take("get", "pods"), None);
        assert_eq!(f.take("watch", "pods"), Some(Fault::GoneEvent));
        assert_eq!(f.take("watch", "pods"), None);
        assert_eq!(f.take("patch", "pods/status"), Some(Fault::Conflict));
        assert_eq!(f.take("patch", "pods/status"), Some(Fault::Conflict));
        assert_eq!(f.take("patch", "pods/status"), None);
        assert_eq!(f.injected(), 3);
    }
}
