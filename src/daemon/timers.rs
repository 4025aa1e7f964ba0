//! The daemon's own timers: which exist, arming (or moving) one, and what each does when it
//! fires. Their keys are in the daemon's range, so routing hands them here by key alone.

use std::time::Instant;

use crate::provider::Input;
use crate::reactor::{sd_notify, TimerId};

use super::pod_watch::PENDING_HIGH;
use super::{routing, Daemon};

/// The daemon's own reactor timer keys are in its range (see `routing.rs`).
pub(super) const KEY_OWN: u64 = routing::OWN.timer_key(0);

/// The daemon's own timers (key `KEY_OWN | n`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum OwnTimer {
    Provider = 1,
    Watch = 2,
    Node = 3,
    /// The watch stopped at its read budget: read on (see `PodWatch::read_more`).
    WatchRead = 4,
    Startup = 5,
    Watchdog = 6,
    Lane = 7,
    View = 8,
    /// Queued cocoon calls start on the next turn (a slot freed up).
    Cocoon = 9,
}

impl OwnTimer {
    /// The timer a key of the daemon's range names, if any.
    pub(super) fn from_key(key: u64) -> Option<OwnTimer> {
        use OwnTimer::*;
        [
            Provider, Watch, Node, WatchRead, Startup, Watchdog, Lane, View, Cocoon,
        ]
        .into_iter()
        .find(|t| KEY_OWN | *t as u64 == key)
    }
}

impl Daemon {
    /// One of the daemon's own timers fired: acted on unless it was re-armed since.
    pub(super) fn own_timer_fired(&mut self, id: TimerId, key: u64) {
        let Some(which) = OwnTimer::from_key(key) else {
            return;
        };
        if self.timers.get(&which).map(|t| t.0) != Some(id) {
            return;
        }
        self.timers.remove(&which);
        self.fire_own(which);
    }

    /// What each of the daemon's own timers does when it fires.
    pub(super) fn fire_own(&mut self, which: OwnTimer) {
        let now = self.reactor.now();
        match which {
            OwnTimer::Provider => self.pending.push_back(Input::Tick),
            OwnTimer::Watch => {
                let out = self.watch.on_timer(&self.kube, now);
                self.watch_outputs(out);
                self.watch_relist();
            }
            OwnTimer::Node => self.node_tick(),
            OwnTimer::WatchRead if self.pending.len() >= PENDING_HIGH => {
                self.arm(OwnTimer::WatchRead, now);
            }
            OwnTimer::WatchRead => self.watch_read(now),
            OwnTimer::Cocoon => self.start_cocoon_calls(),
            OwnTimer::Startup => self.startup_step(),
            OwnTimer::Watchdog => {
                let _ = sd_notify::notify("WATCHDOG=1");
                if let Some(every) = self.watchdog {
                    self.arm(OwnTimer::Watchdog, now + every);
                }
            }
            OwnTimer::Lane => {}
            OwnTimer::View => self.refresh_view(),
        }
    }

    /// Arms (or moves) one of the daemon's own timers.
    pub(super) fn arm(&mut self, which: OwnTimer, at: Instant) {
        if let Some(&(id, when)) = self.timers.get(&which) {
            if when == at {
                return;
            }
            self.reactor.cancel_timer(id);
        }
        let id = self.reactor.timer_at(at, KEY_OWN | which as u64);
        self.timers.insert(which, (id, at));
    }
}
