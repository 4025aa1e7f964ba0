//! The cocoon event stream as the provider sees it: the vm room's `EventStream` runs the
//! `cocoon vm status --event --format json` child and its restarts; this turns its events into
//! provider inputs and performs the re-sync a restart owes.
//!
//! Events lost while the stream was down are recovered with a `vm list`: a tracked VM missing
//! from it is reported as DELETED, every listed VM as MODIFIED (the provider ignores running
//! ones), so the core needs no second code path for the re-sync.

use std::collections::HashSet;

use super::{ChildRole, Daemon, Work};
use crate::provider::{Input, VmEventKind};
use crate::reactor::{ChildExit, Event};
use crate::vm::runner::StreamOutput;
use crate::vm::types::EventKind;
use crate::vm::{read_vm_list, VmInfo};

impl Daemon {
    /// Starts the stream (after the startup reconcile).
    pub(super) fn start_stream(&mut self) {
        let out = self.stream.start(&mut self.reactor);
        self.stream_output(out);
        self.adopt_stream_child();
    }

    /// Hands the stream one of its events: its restart timer, its child's output or exit.
    pub(super) fn stream_event(&mut self, event: &Event<Work>) {
        if let Some(out) = self.stream.handle(&mut self.reactor, event) {
            self.stream_output(out);
        }
        self.adopt_stream_child();
    }

    /// Enters the child the stream (re)started in the child table, which routes its output
    /// and exit back here.
    fn adopt_stream_child(&mut self) {
        if let Some(id) = self.stream.child() {
            self.children.entry(id).or_insert(ChildRole::EventStream);
        }
    }

    /// What one reactor event meant for the stream: events for the provider, logs, a re-sync.
    pub(super) fn stream_output(&mut self, out: StreamOutput) {
        for skipped in out.skipped {
            log::warn!("cocoon event stream: skipped a line: {skipped}");
        }
        for event in out.events {
            let kind = match event.kind {
                EventKind::Added => VmEventKind::Added,
                EventKind::Modified => VmEventKind::Modified,
                EventKind::Deleted => VmEventKind::Deleted,
                EventKind::Other(other) => {
                    log::warn!("cocoon event stream: unknown event {other:?} skipped");
                    continue;
                }
            };
            let vm = VmInfo::from(event.vm);
            if kind == VmEventKind::Deleted || !vm.running() {
                log::debug!(
                    "cocoon event stream: vm {} ({}) {kind:?}, {:?}",
                    vm.id,
                    vm.name,
                    vm.state
                );
            }
            self.pending.push_back(Input::VmEvent { kind, vm });
        }
        if let Some((exit, stderr)) = out.ended {
            log::warn!(
                "cocoon event stream ended ({exit:?}){}; restart at {:?}",
                if stderr.is_empty() {
                    String::new()
                } else {
                    format!(": {stderr}")
                },
                out.restart_at
                    .map(|at| at.saturating_duration_since(self.reactor.now()))
            );
        }
        if let Some(e) = out.spawn_error {
            log::warn!("cocoon event stream: cannot start: {e}");
        }
        if out.resync {
            self.pending.push_back(Input::EventStreamRestarted);
            self.start_resync();
        }
    }

    fn start_resync(&mut self) {
        if let Err(e) = self.spawn_vm_list(ChildRole::Resync) {
            log::warn!("cocoon event stream re-sync: cannot list VMs: {e}");
        }
    }

    /// The re-sync list ended: synthesise the events the stream may have missed.
    pub(super) fn resync_listed(&mut self, exit: ChildExit) {
        let result = crate::vm::Answer::of_exit(&super::cocoon_calls::vm_list_call(), &exit);
        let listed = if result.succeeded() {
            read_vm_list(&result.stdout).map_err(|e| e.to_string())
        } else {
            Err(result.error_text())
        };
        let listed = match listed {
            Ok(l) => l,
            Err(e) => {
                log::warn!("cocoon event stream re-sync: vm list failed: {e}");
                return;
            }
        };
        let present: HashSet<&str> = listed.iter().map(|v| v.id.as_str()).collect();
        let missing: Vec<VmInfo> = self
            .provider
            .tracked_vms()
            .filter(|vm| !vm.id.is_empty() && !present.contains(vm.id.as_str()))
            .cloned()
            .collect();
        for vm in missing {
            self.pending.push_back(Input::VmEvent {
                kind: VmEventKind::Deleted,
                vm,
            });
        }
        for vm in listed {
            self.pending.push_back(Input::VmEvent {
                kind: VmEventKind::Modified,
                vm,
            });
        }
    }
}
