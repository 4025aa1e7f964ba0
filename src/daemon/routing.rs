//! Event routing of the edge: every reactor event goes to the subscriber that owns it, found
//! from the event alone, never by asking the subscribers in turn.
//!
//! Each subscriber draws its I/O tokens and timer keys from a reactor range of its own
//! (`reactor::Range`), so the owner of a token or a timer is its range. The children the daemon
//! starts (cocoon calls, `vm list`s, the event-stream child) are in its child table; any other
//! child is the kubelet server's (exec, logs), which ignores an id it does not know. Adding a
//! subscriber is a range, an `Owner` variant and one arm per kind of event it receives.
//! A token or timer its owner no longer knows (closed earlier in the same poll batch) still
//! reaches that owner, which ignores it; a range nobody owns is dropped.

use std::collections::HashMap;

use crate::provider::{Input, VmEventKind};
use crate::reactor::{ChildExit, ChildId, Event, IoReady, Range, Stream, TimerId, Token};

use super::{ChildRole, Daemon, Work};

/// The daemon's own timers (`OwnTimer`).
pub(super) const OWN: Range = Range(2);
/// The event stream's restart timer (armed and consumed by `vm::runner::EventStream`).
pub(super) const EVENT_STREAM: Range = Range(3);
/// The pod watch's socket.
pub(super) const WATCH: Range = Range(b'w');
/// The pidfds of the running VMs' hypervisors.
pub(super) const HYPERVISORS: Range = Range(b'h');

/// The subscriber an event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Owner {
    /// The daemon itself: its own timers and the cocoon children of its table.
    Daemon,
    /// The cocoon event stream: its restart timer and its child.
    EventStream,
    /// ICMP pinger and TCP connect probes, and their schedule timers.
    Probes,
    /// pidfds of the hypervisor processes of running VMs.
    Hypervisors,
    /// The pod watch stream.
    Watch,
    /// The kubelet API listener, its connections, its timer and its children.
    Kubelet,
    /// The metrics listener, its connections and their timers.
    Metrics,
    /// A range no subscriber draws from.
    Nobody,
}

impl Owner {
    /// The subscriber that draws from `range` (a duplicate range would be an unreachable arm).
    pub(super) fn of_range(range: Range) -> Owner {
        match range {
            OWN => Owner::Daemon,
            EVENT_STREAM => Owner::EventStream,
            WATCH => Owner::Watch,
            HYPERVISORS => Owner::Hypervisors,
            crate::probes::PROBE_RANGE => Owner::Probes,
            crate::kubelet::server::RANGE => Owner::Kubelet,
            crate::metrics::http::RANGE => Owner::Metrics,
            _ => Owner::Nobody,
        }
    }

    /// Who registered `token`.
    pub(super) fn of_token(token: Token) -> Owner {
        Owner::of_range(Range::of_token(token))
    }

    /// Who armed a timer with `key`.
    pub(super) fn of_timer(key: u64) -> Owner {
        Owner::of_range(Range::of_timer_key(key))
    }

    /// Who started child `id`: the daemon's table names its own, the rest are the kubelet's.
    pub(super) fn of_child(children: &HashMap<ChildId, ChildRole>, id: ChildId) -> Owner {
        match children.get(&id) {
            Some(ChildRole::EventStream) => Owner::EventStream,
            Some(_) => Owner::Daemon,
            None => Owner::Kubelet,
        }
    }

    /// The name the turn profile gives the owner's I/O.
    pub(super) fn profile_name(self) -> &'static str {
        match self {
            Owner::Hypervisors => "io:hypervisor",
            Owner::Watch => "io:watch",
            Owner::Kubelet => "io:kubelet",
            _ => "io:probes/metrics/stream",
        }
    }
}

impl Daemon {
    /// Hands one reactor event to its owner.
    pub(super) fn route(&mut self, event: Event<Work>) {
        match event {
            Event::Io(ready) => self.route_io(ready),
            Event::Timer { id, key } => self.route_timer(id, key),
            Event::ChildOutput { id, stream, data } => self.route_child_output(id, stream, data),
            Event::ChildExit(exit) => self.route_child_exit(exit),
            Event::Signal(sig) => self.on_signal(sig),
            Event::Work(work) => self.route_work(work),
        }
    }

    /// Hands one readiness event to the subscriber that owns its token.
    fn route_io(&mut self, ready: IoReady) {
        match Owner::of_token(ready.token) {
            Owner::Probes => {
                let now = self.reactor.now();
                let out = self.probes.on_io(&mut self.reactor, ready.token, now);
                self.probe_events(out);
            }
            Owner::Hypervisors => {
                if let Some(vm) = self.hypervisors.exited(&mut self.reactor, ready.token) {
                    // Ahead of the backlog: the pod of a dead VM is failed in milliseconds.
                    self.urgent_inputs.push_back(Input::VmEvent {
                        kind: VmEventKind::Modified,
                        vm,
                    });
                }
            }
            Owner::Watch => self.watch_read(self.reactor.now()),
            Owner::Kubelet => {
                self.kubelet.on_io(&mut self.reactor, ready);
                self.kubelet_auth();
            }
            Owner::Metrics => {
                if let Some(server) = self.metrics_server.as_mut() {
                    server.handle_io(&mut self.reactor, &ready);
                }
            }
            Owner::Daemon | Owner::EventStream | Owner::Nobody => {}
        }
    }

    /// Hands a fired timer to the subscriber whose range its key is in.
    fn route_timer(&mut self, id: TimerId, key: u64) {
        match Owner::of_timer(key) {
            Owner::Daemon => self.own_timer_fired(id, key),
            Owner::EventStream => self.stream_event(&Event::Timer { id, key }),
            Owner::Probes => {
                if let Some(key) = crate::probes::probe_timer_key(key) {
                    let now = self.reactor.now();
                    let wall = crate::wall_clock::now();
                    let out = self.probes.on_timer(&mut self.reactor, key, now, wall);
                    self.probe_events(out);
                }
            }
            Owner::Kubelet => self.kubelet.on_timer(&mut self.reactor, id),
            Owner::Metrics => {
                if let Some(server) = self.metrics_server.as_mut() {
                    server.handle_timer(&mut self.reactor, id);
                }
            }
            Owner::Hypervisors | Owner::Watch | Owner::Nobody => {}
        }
    }

    /// Streamed output of a child: the event stream's lines, or a kubelet exec / log stream
    /// (the daemon's cocoon calls capture theirs).
    fn route_child_output(&mut self, id: ChildId, stream: Stream, data: Vec<u8>) {
        match Owner::of_child(&self.children, id) {
            Owner::EventStream => self.stream_event(&Event::ChildOutput { id, stream, data }),
            Owner::Kubelet => self
                .kubelet
                .on_child_output(&mut self.reactor, id, stream, &data),
            _ => {}
        }
    }

    /// A child ended: the role the child table gives it says who takes the exit.
    fn route_child_exit(&mut self, exit: ChildExit) {
        match self.children.remove(&exit.id) {
            Some(ChildRole::Op { op, call, macos }) => self.cocoon_call_done(op, call, macos, exit),
            Some(ChildRole::StartupList) => self.startup_listed(exit),
            Some(ChildRole::Resync) => self.resync_listed(exit),
            Some(ChildRole::EventStream) => self.stream_event(&Event::ChildExit(exit)),
            None => self.kubelet.on_child_exit(&mut self.reactor, &exit),
        }
    }

    /// A worker job's answer: most become the next input of the op they answer.
    fn route_work(&mut self, work: Work) {
        match work {
            Work::Transfer { op, result } => {
                self.transfers_running = self.transfers_running.saturating_sub(1);
                self.pending.push_back(Input::TransferDone { op, result });
                self.start_transfers();
            }
            Work::Evidence { op, result } => self
                .pending
                .push_back(Input::HibernateEvidence { op, result }),
            Work::SourceChecked { op, verdict } => {
                self.pending.push_back(Input::SourceChecked { op, verdict })
            }
            Work::Sac { op, result } => self.pending.push_back(Input::SacDone { op, result }),
            Work::LeasesReleased { released, failed } => {
                let family = &self.metrics.lease_release_total;
                family.with_label_values(&["ok"]).inc_by(released as u64);
                family
                    .with_label_values(&["failed"])
                    .inc_by(failed.len() as u64);
                for f in failed {
                    log::warn!("lease release: {f} (cocoon-net's lease expiry is the fallback)");
                }
            }
            Work::KubeletAuth { id, answer } => {
                self.auth_lane.done(id);
                self.kubelet.on_auth_answer(&mut self.reactor, id, answer);
                self.kubelet_auth();
            }
            Work::PodWritten { write, result } => self.pod_written(*write, result),
            Work::EventWritten { event, result } => self.event_written(*event, *result),
            Work::NodeTicked(agent) => self.node_ticked(agent),
            Work::PodsListed { startup, result } => self.pods_listed(startup, result),
            Work::OwnersRecorded { ops, result } => {
                for op in ops {
                    let result = result.clone();
                    self.pending.push_back(Input::OwnersRecorded { op, result });
                }
            }
        }
    }

    /// SIGTERM / SIGINT stop the loop; SIGHUP is logged (settings are read once at start).
    fn on_signal(&mut self, sig: i32) {
        if sig == libc::SIGHUP {
            log::info!(
                "SIGHUP ignored: settings are read at start; restart vk-cocoon to apply changes"
            );
        } else {
            log::info!("signal {sig} received; shutting down (VMs keep running)");
            self.stopping = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::Reactor;

    const OWNED: [(Range, Owner); 7] = [
        (OWN, Owner::Daemon),
        (EVENT_STREAM, Owner::EventStream),
        (WATCH, Owner::Watch),
        (HYPERVISORS, Owner::Hypervisors),
        (crate::probes::PROBE_RANGE, Owner::Probes),
        (crate::kubelet::server::RANGE, Owner::Kubelet),
        (crate::metrics::http::RANGE, Owner::Metrics),
    ];

    #[test]
    fn every_subscriber_has_a_range_of_its_own() {
        for (i, (a, _)) in OWNED.iter().enumerate() {
            assert_ne!(*a, Range::DEFAULT, "the default range is nobody's");
            for (b, _) in &OWNED[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn a_token_a_timer_and_a_child_go_to_their_owner() {
        let mut reactor = Reactor::<()>::new(1, 1).unwrap();
        for (range, owner) in OWNED {
            assert_eq!(Owner::of_token(reactor.token_in(range)), owner);
            assert_eq!(Owner::of_timer(range.timer_key(7)), owner);
        }
        assert_eq!(Owner::of_token(reactor.token()), Owner::Nobody);
        let probe_token = crate::probes::ProbeHost::new_token(&mut reactor);
        assert_eq!(Owner::of_token(probe_token), Owner::Probes);
        // The keys the subscribers really arm.
        let own = super::super::timers::KEY_OWN | super::super::timers::OwnTimer::View as u64;
        assert_eq!(Owner::of_timer(own), Owner::Daemon);
        assert_eq!(
            Owner::of_timer(super::super::KEY_EVENT_STREAM),
            Owner::EventStream
        );
        let probe = crate::probes::PROBE_TIMER_TAG | 5;
        assert_eq!(Owner::of_timer(probe), Owner::Probes);
        let kubelet = crate::kubelet::server::TIMER_KEY;
        assert_eq!(Owner::of_timer(kubelet), Owner::Kubelet);
        assert_eq!(Owner::of_timer(0), Owner::Nobody);

        let mut children = HashMap::new();
        children.insert(ChildId(1), ChildRole::StartupList);
        children.insert(ChildId(2), ChildRole::EventStream);
        children.insert(ChildId(3), ChildRole::Resync);
        assert_eq!(Owner::of_child(&children, ChildId(1)), Owner::Daemon);
        assert_eq!(Owner::of_child(&children, ChildId(2)), Owner::EventStream);
        assert_eq!(Owner::of_child(&children, ChildId(3)), Owner::Daemon);
        assert_eq!(Owner::of_child(&children, ChildId(4)), Owner::Kubelet);
    }
}
