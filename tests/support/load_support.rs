//! How loaded the host is while a test measures: a probe thread's late wake-ups tell whether a
//! latency bar says anything about the code, or only that the host had no CPU to give.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// Wake-up latency of a thread on this host beyond which it is too loaded for the latency
/// bars of a process test to say anything about the daemon: the latest a 1 ms sleep ended
/// (quiet host: about a millisecond; with the sibling tests of a file running on 2 cores,
/// 40 ms, and a 200 ms kubelet answer whose time went to the client's TLS handshake).
pub const LOADED_HOST_WAKEUP: Duration = Duration::from_millis(10);

/// A helper thread measuring how late 1 ms sleeps end (the wait for a CPU any woken thread,
/// the daemon's loop among them, sees here), from `start` to `stop`.
pub struct WakeupProbe {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The latest wake-up so far, in nanoseconds.
    latest: std::sync::Arc<std::sync::atomic::AtomicU64>,
    thread: std::thread::JoinHandle<Duration>,
}

impl WakeupProbe {
    pub fn start() -> WakeupProbe {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let latest = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (flag, seen) = (stop.clone(), latest.clone());
        let thread = std::thread::spawn(move || {
            let mut latest = Duration::ZERO;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                std::thread::sleep(Duration::from_millis(1));
                latest = latest.max(t.elapsed().saturating_sub(Duration::from_millis(1)));
                seen.store(
                    latest.as_nanos() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            latest
        });
        WakeupProbe {
            stop,
            latest,
            thread,
        }
    }

    /// The latest wake-up seen so far.
    pub fn latest(&self) -> Duration {
        Duration::from_nanos(self.latest.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether a latency bar checked now may be judged (see [`quiet_host`]).
    pub fn quiet(&self) -> bool {
        quiet_host(self.latest())
    }

    /// The latest wake-up seen.
    pub fn stop(self) -> Duration {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// Runs `body` under a [`WakeupProbe`]; returns the body's value and the latest wake-up.
pub fn with_wakeup_probe<T>(body: impl FnOnce() -> T) -> (T, Duration) {
    let probe = WakeupProbe::start();
    let out = body();
    (out, probe.stop())
}

/// Whether latency bars may be judged after a measurement during which woken threads waited
/// up to `wakeup` for a CPU; says so when they may not (what load cannot excuse, the test
/// checks either way).
pub fn quiet_host(wakeup: Duration) -> bool {
    let quiet = wakeup <= LOADED_HOST_WAKEUP;
    if !quiet {
        eprintln!(
            "latency bars not judged: woken threads waited up to {wakeup:?} for a CPU (bar \
             {LOADED_HOST_WAKEUP:?})"
        );
    }
    quiet
}
