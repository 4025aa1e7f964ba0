//! The edge: wires the reactor, the kube client and the provider core, and performs effects.
//! The only place where decisions meet I/O.
//!
//! Current state (foundation): the loop serves `/metrics`, keeps the systemd watchdog fed,
//! and stops on SIGTERM/SIGINT (exit 0, well within 2 s; VMs are never touched). SIGHUP is
//! logged and ignored: every setting is read once at start, so a restart applies changes.
//! Requirement for what is added here later: the loop must keep answering `/metrics` and
//! signals while the API server is unreachable (kube calls stay off the loop or bounded).

use std::time::Duration;

use crate::config::Config;
use crate::metrics::http::MetricsServer;
use crate::metrics::Metrics;
use crate::reactor::{sd_notify, Event, Reactor, TimerId};

/// Messages worker jobs send back to the loop.
#[derive(Debug)]
pub enum Work {}

/// Worker threads for blocking jobs (blob transfers) and their queue bound.
const WORKERS: usize = 4;
const WORK_QUEUE: usize = 256;

/// Runs the daemon until SIGTERM/SIGINT. Returns the process exit status.
pub fn run(config: Config) -> i32 {
    raise_open_file_limit();
    let mut reactor: Reactor<Work> = match Reactor::new(WORKERS, WORK_QUEUE) {
        Ok(r) => r,
        Err(e) => {
            log::error!("event loop: {e}");
            return 1;
        }
    };
    if let Err(e) = reactor.watch_signals(&[libc::SIGTERM, libc::SIGINT, libc::SIGHUP]) {
        log::error!("signal handling: {e}");
        return 1;
    }
    let metrics = match Metrics::new() {
        Ok(m) => m,
        Err(e) => {
            log::error!("metrics registry: {e}");
            return 1;
        }
    };
    let server = match MetricsServer::bind(&config.metrics_addr, metrics.clone(), &mut reactor) {
        Ok(s) => s,
        Err(e) => {
            log::error!("metrics listener on {}: {e}", config.metrics_addr);
            return 1;
        }
    };
    log::info!(
        "metrics listening on http://{}/metrics",
        server.local_addr()
    );

    match sd_notify::notify("READY=1") {
        Ok(true) => log::debug!("notified systemd: READY=1"),
        Ok(false) => {}
        Err(e) => log::warn!("sd_notify READY=1: {e}"),
    }
    let watchdog = sd_notify::watchdog_interval(
        std::env::var("WATCHDOG_USEC").ok().as_deref(),
        std::env::var("WATCHDOG_PID").ok().as_deref(),
    );
    let mut watchdog_timer = watchdog.map(|every| arm_watchdog(&mut reactor, every));

    let status = serve(&mut reactor, server, watchdog, &mut watchdog_timer);
    let _ = sd_notify::notify("STOPPING=1");
    log::info!("vk-cocoon stopped");
    status
}

fn arm_watchdog(reactor: &mut Reactor<Work>, every: Duration) -> TimerId {
    let _ = sd_notify::notify("WATCHDOG=1");
    reactor.timer_after(every, 0)
}

fn serve(
    reactor: &mut Reactor<Work>,
    mut server: MetricsServer,
    watchdog: Option<Duration>,
    watchdog_timer: &mut Option<TimerId>,
) -> i32 {
    let mut events = Vec::new();
    loop {
        events.clear();
        if let Err(e) = reactor.poll(&mut events) {
            log::error!("event loop: {e}");
            return 1;
        }
        for event in events.drain(..) {
            match event {
                Event::Io(ready) => {
                    if !server.handle_io(reactor, &ready) {
                        log::debug!("readiness for unknown token {:?}", ready.token);
                    }
                }
                Event::Timer { id, .. } => {
                    if Some(id) == *watchdog_timer {
                        *watchdog_timer = watchdog.map(|every| arm_watchdog(reactor, every));
                    } else {
                        server.handle_timer(reactor, id);
                    }
                }
                Event::Signal(sig) if sig == libc::SIGHUP => {
                    log::info!("SIGHUP ignored: settings are read at start; restart vk-cocoon to apply changes");
                }
                Event::Signal(sig) => {
                    log::info!("signal {sig} received; shutting down (VMs keep running)");
                    server.shutdown(reactor);
                    return 0;
                }
                Event::ChildOutput { .. } | Event::ChildExit(_) => {}
                Event::Work(never) => match never {},
            }
        }
    }
}

/// Lifts the soft open-file limit to the hard one: the daemon holds a socket or
/// pipe per VM, probe, client and child (the unit also sets LimitNOFILE=65536).
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                log::debug!(
                    "could not raise RLIMIT_NOFILE: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}
