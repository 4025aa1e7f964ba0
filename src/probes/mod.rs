//! Per-pod readiness probe schedules and their bookkeeping.
//! Decides when to probe and what a result means; the pinger and sockets live in network.
//!
//! Two layers:
//! * [`ProbeManager`] (manager) is pure: the caller feeds it starts, forgets, fired timers and
//!   probe results together with the current time, and it answers with [`ProbeAction`]s (arm or
//!   cancel a timer, start or abort a ping / TCP connect, hand a readiness change or an IP
//!   change to the provider). It reads no clock and owns no socket; the only I/O it does is
//!   the lease-file `stat` done before each probe, which is a single syscall per probe.
//! * [`ProbeEngine`] (engine) performs those actions against the loop through the small
//!   [`ProbeHost`] interface (registry, tokens, timers), owns the shared pinger and the TCP
//!   connects, and gives the daemon back only what the provider must see. The daemon routes
//!   events to it.
//!
//! What a probe is aimed at (the target, its IP and port) lives in target.

use std::time::Duration;

mod engine;
mod manager;
mod target;

pub use engine::{probe_timer_key, ProbeEngine, ProbeHost, PROBE_RANGE, PROBE_TIMER_TAG};
pub use manager::{ProbeAction, ProbeEvent, ProbeId, ProbeManager, TimerKey};
pub use target::{parse_probe_port, resolve_ip, ProbeKind, ProbeResult, ProbeTarget, SSH_PORT};

/// `vk_cocoon_probe_duration_seconds` buckets.
pub const PROBE_DURATION_BUCKETS: [f64; 8] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// The histogram the probe manager observes, unregistered; the metrics room registers it.
pub fn probe_duration_histogram() -> prometheus::HistogramVec {
    let opts = prometheus::HistogramOpts::new(
        "vk_cocoon_probe_duration_seconds",
        "Duration of one readiness probe (lease lookup plus ICMP echo or TCP connect).",
    )
    .buckets(PROBE_DURATION_BUCKETS.to_vec());
    // The options are constants that are valid by construction.
    #[allow(clippy::expect_used)]
    prometheus::HistogramVec::new(opts, &["namespace"]).expect("valid histogram options")
}

/// The schedule's numbers. `Default` holds the Go daemon's timings; tests of real sockets
/// may scale them down so that a failure sequence does not take half a minute.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeConfig {
    /// Each probe's timeout (3 s).
    pub timeout: Duration,
    /// First sleep while not ready (100 ms).
    pub first_retry: Duration,
    /// Growth of the not-ready sleep per probe (×1.5).
    pub retry_growth: f64,
    /// Cap of the not-ready sleep (1 s).
    pub max_retry: Duration,
    /// Sleep between probes once ready (5 s).
    pub ready_interval: Duration,
    /// Consecutive failures that flip a ready pod back to not ready (3).
    pub failures_to_unready: u32,
}

impl Default for ProbeConfig {
    fn default() -> ProbeConfig {
        ProbeConfig {
            timeout: Duration::from_secs(3),
            first_retry: Duration::from_millis(100),
            retry_growth: 1.5,
            max_retry: Duration::from_secs(1),
            ready_interval: Duration::from_secs(5),
            failures_to_unready: 3,
        }
    }
}
