//! One loop turn of the edge: poll, route every event to its owner, feed the queued inputs
//! through the core within the turn's budget, then re-arm timers and refresh the kubelet view.

use std::time::{Duration, Instant};

use crate::provider::Effect;
use crate::reactor::Event;

use super::routing::Owner;
use super::timers::OwnTimer;
use super::{cocoon_calls, turn_profile, Daemon};

/// Loop time one turn spends feeding inputs to the provider at most (see `drain_inputs`).
const INPUT_BUDGET: Duration = Duration::from_millis(20);
/// The kubelet view (pods and VMs for logs, exec, stats) trails the provider by at most this.
const VIEW_REFRESH: Duration = Duration::from_millis(200);

impl Daemon {
    /// The loop. Returns the exit status.
    pub fn serve(&mut self) -> i32 {
        self.profile.watch_this_thread();
        // Every pool and spawner thread exists by now and keeps the default weight.
        use crate::reactor::priority;
        match priority::set_thread_nice(priority::LOOP_NICE) {
            Ok(()) => log::debug!("event loop thread at nice {}", priority::LOOP_NICE),
            Err(e) => log::info!(
                "event loop thread left at the default priority ({e}); loop turns may \
                 wait behind busy helpers on a loaded host"
            ),
        }
        if self.watchdog.is_some() {
            self.fire_own(OwnTimer::Watchdog);
        }
        self.arm(OwnTimer::Startup, self.reactor.now());
        let mut events = Vec::new();
        loop {
            events.clear();
            self.profile.clear();
            if let Err(e) = self.reactor.poll(&mut events) {
                log::error!("event loop: {e}");
                return 1;
            }
            // The turn starts when the poll returned: the reactor's own reads count too.
            let turn = self.reactor.now();
            let mut at = self.profile.lap("reactor", turn);
            let n_events = events.len();
            for event in events.drain(..) {
                let io = match &event {
                    Event::Io(ready) => Owner::of_token(ready.token).profile_name(),
                    _ => "",
                };
                let kind = turn_profile::event_kind(&event, io);
                self.route(event);
                at = self.profile.lap(kind, at);
                if self.stopping {
                    self.shutdown();
                    return 0;
                }
            }
            self.drain_inputs();
            at = Instant::now();
            self.after_turn();
            self.profile.lap("after-turn", at);
            let took = turn.elapsed().as_secs_f64();
            if took > self.longest_turn.get() {
                self.longest_turn.set(took);
                if took > 0.01 {
                    log::info!(
                        "longest loop turn so far: {:.1} ms ({:.1} ms on CPU, {:.1} ms \
                         waiting for a CPU), {n_events} events; {}",
                        took * 1000.0,
                        self.profile.cpu().as_secs_f64() * 1000.0,
                        self.profile.run_wait().as_secs_f64() * 1000.0,
                        self.profile.summary()
                    );
                }
            } else if took > 0.05 {
                log::debug!(
                    "event loop turn took {:.1} ms ({:.1} ms on CPU, {:.1} ms waiting for a \
                     CPU), {n_events} events; {}",
                    took * 1000.0,
                    self.profile.cpu().as_secs_f64() * 1000.0,
                    self.profile.run_wait().as_secs_f64() * 1000.0,
                    self.profile.summary()
                );
            }
        }
    }

    /// Feeds queued inputs through the provider and performs the effects, for at most
    /// `INPUT_BUDGET` of loop time: the rest waits for the next turn, which comes at once
    /// (so probes, the kubelet API and /metrics get their turn in between). The budget holds
    /// inside one input's effects too (the startup reconcile of 1,000 pods answers with
    /// thousands): those left are performed first on the next turn, in order, and no later
    /// input is handled before them.
    pub(super) fn drain_inputs(&mut self) {
        let started = Instant::now();
        'turn: loop {
            while let Some(effect) = self.owed_effects.pop_front() {
                let kind = turn_profile::effect_kind(&effect);
                let effect_at = Instant::now();
                self.perform(effect);
                self.profile.lap(kind, effect_at);
                if started.elapsed() >= INPUT_BUDGET {
                    break 'turn;
                }
            }
            if started.elapsed() >= INPUT_BUDGET {
                break;
            }
            let Some(input) = self
                .urgent_inputs
                .pop_front()
                .or_else(|| self.pending.pop_front())
            else {
                break;
            };
            let now = self.reactor.now();
            let kind = turn_profile::input_kind(&input);
            let core_at = Instant::now();
            let effects = self.provider.handle(input, now, crate::wall_clock::now());
            self.profile.lap(kind, core_at);
            if !effects.is_empty() {
                self.view_dirty = true;
            }
            self.owed_effects.extend(effects);
        }
        if let Some(at) = self.provider.poll_timeout() {
            self.arm(OwnTimer::Provider, at);
        }
        // Any input may change a tracked VM or its PID, effects or not (an inspect that learns
        // a new PID answers with none): the pods the inputs touched get their watch checked.
        let changed = self.provider.take_changed_pods();
        if !changed.is_empty() {
            let sync_at = Instant::now();
            for pod in &changed {
                self.hypervisors
                    .sync(&mut self.reactor, pod, self.provider.pod_vm(pod));
            }
            self.profile.lap("hypervisor-sync", sync_at);
        }
    }

    /// Re-arms the watch, node and event timers and refreshes the kubelet view.
    pub(super) fn after_turn(&mut self) {
        if self.startup.is_none() {
            if let Some(at) = self.watch.next_due() {
                self.arm(OwnTimer::Watch, at);
            }
            if let Some(node) = &self.node {
                self.arm(OwnTimer::Node, node.next_due());
            }
        }
        self.pump_lane();
        self.lane_gauges();
        if self.view_dirty && !self.timers.contains_key(&OwnTimer::View) {
            let due = self
                .view_built
                .map_or(self.reactor.now(), |at| at + VIEW_REFRESH);
            self.arm(OwnTimer::View, due);
        }
        if !self.pending.is_empty()
            || !self.urgent_inputs.is_empty()
            || !self.owed_effects.is_empty()
        {
            self.arm(OwnTimer::Provider, self.reactor.now());
        }
        if !self.cocoon_queue.is_empty() && self.cocoon_running < cocoon_calls::MAX_COCOON_CALLS {
            self.arm(OwnTimer::Cocoon, self.reactor.now());
        }
    }

    /// Rebuilds the kubelet view (every pod serialised: O(pods), hence at most once per
    /// `VIEW_REFRESH` however many turns change something during a burst).
    pub(super) fn refresh_view(&mut self) {
        if self.view_dirty {
            self.view_dirty = false;
            self.view_built = Some(self.reactor.now());
            self.kubelet.set_view(self.kubelet_view());
        }
    }

    pub(super) fn shutdown(&mut self) {
        // Stop accepting; in-flight cocoon calls are killed when the reactor drops; VMs live on.
        self.stream.stop(&mut self.reactor);
        if let Some(server) = self.metrics_server.take() {
            server.shutdown(&mut self.reactor);
        }
        let effects = self.provider.shutdown();
        for effect in effects {
            if let Effect::StopProbe { key } = effect {
                self.probes.forget(&mut self.reactor, &key.to_string());
            }
        }
    }
}
