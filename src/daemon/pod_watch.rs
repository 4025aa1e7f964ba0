//! The pod watch as the provider sees it: reading what its socket holds within the turn's
//! budget, and turning its outputs into provider inputs.

use std::time::Instant;

use crate::kube::watch::WatchOutput;
use crate::provider::Input;

use super::timers::OwnTimer;
use super::Daemon;

/// The watch reads on only while fewer provider inputs than this wait: a burst stays in the
/// socket rather than piling up here as decoded pods.
pub(super) const PENDING_HIGH: usize = 256;

impl Daemon {
    /// Reads what the watch socket holds, up to the watch's budget; the rest on a later turn.
    pub(super) fn watch_read(&mut self, now: Instant) {
        let out = self.watch.on_ready(&self.kube, now);
        self.watch_outputs(out);
        self.watch_relist();
        if self.watch.read_more() {
            self.arm(OwnTimer::WatchRead, now);
        }
    }

    /// Pod watch outputs become provider inputs; before the startup reconcile they are dropped
    /// (the reconcile's own list is the starting point and the watch resumes from it).
    pub(super) fn watch_outputs(&mut self, out: Vec<WatchOutput>) {
        if !out.is_empty() {
            self.view_dirty = true;
        }
        for o in out {
            self.pending.push_back(match o {
                WatchOutput::Added(p) | WatchOutput::Modified(p) => Input::PodUpserted(p),
                WatchOutput::Deleted(p) => {
                    // Nothing more is recorded of a pod once it is gone.
                    self.events
                        .forget_pod(p.metadata.uid.as_deref().unwrap_or_default());
                    Input::PodDeleted(p)
                }
            });
        }
    }
}
