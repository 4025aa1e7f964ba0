//! Readiness routing of the edge: which subscriber an `Event::Io` token belongs to, and the one
//! match that hands the event to it. Each subscriber owns the tokens it registered.
//!
//! Every token comes from the reactor's one counter, so no two subscribers ever own the same
//! token: the owner of an event does not depend on the order in which they are asked, and
//! adding a subscriber is one variant, one ownership question and one arm of `route_io`.
//! A token nobody owns (a connection closed earlier in the same poll batch) goes to the
//! metrics server, which ignores tokens it does not know, exactly as the other owners would.

use crate::provider::{Input, VmEventKind};
use crate::reactor::{IoReady, Token};

use super::Daemon;

/// The subscriber that registered a token with the reactor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IoOwner {
    /// ICMP pinger and TCP connect probes.
    Probes,
    /// pidfds of the hypervisor processes of running VMs.
    Hypervisor,
    /// The pod watch stream.
    Watch,
    /// The kubelet API listener and its connections.
    Kubelet,
    /// The metrics listener and its connections (and tokens nobody owns any more).
    Metrics,
}

impl IoOwner {
    /// The name the turn profile gives the owner's I/O.
    pub(super) fn profile_name(self) -> &'static str {
        match self {
            IoOwner::Hypervisor => "io:hypervisor",
            IoOwner::Watch => "io:watch",
            IoOwner::Kubelet => "io:kubelet",
            IoOwner::Probes | IoOwner::Metrics => "io:probes/metrics/stream",
        }
    }
}

impl Daemon {
    /// Who registered `token`.
    pub(super) fn io_owner(&self, token: Token) -> IoOwner {
        if self.probes.owns_token(token) {
            IoOwner::Probes
        } else if self.hypervisors.owns(token) {
            IoOwner::Hypervisor
        } else if token == self.watch.token() {
            IoOwner::Watch
        } else if self.kubelet.owns_token(token) {
            IoOwner::Kubelet
        } else {
            IoOwner::Metrics
        }
    }

    /// Hands one readiness event to the subscriber that owns its token.
    pub(super) fn route_io(&mut self, ready: IoReady) {
        match self.io_owner(ready.token) {
            IoOwner::Probes => {
                let now = self.reactor.now();
                let out = self.probes.on_io(&mut self.reactor, ready.token, now);
                self.probe_events(out);
            }
            IoOwner::Hypervisor => {
                if let Some(vm) = self.hypervisors.exited(&mut self.reactor, ready.token) {
                    // Ahead of the backlog: the pod of a dead VM is failed in milliseconds.
                    self.urgent_inputs.push_back(Input::VmEvent {
                        kind: VmEventKind::Modified,
                        vm,
                    });
                }
            }
            IoOwner::Watch => self.watch_read(self.reactor.now()),
            IoOwner::Kubelet => {
                self.kubelet.on_io(&mut self.reactor, ready);
                self.kubelet_auth();
            }
            IoOwner::Metrics => {
                if let Some(server) = self.metrics_server.as_mut() {
                    server.handle_io(&mut self.reactor, &ready);
                }
            }
        }
    }
}
