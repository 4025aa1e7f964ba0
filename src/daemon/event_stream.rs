//! The long-lived `cocoon vm status --event --format json` child: its lines become provider
//! `VmEvent`s, its restarts follow the vm room's supervisor, and a restart owes a re-sync.
//!
//! Events lost while the stream was down are recovered with a `vm list`: a tracked VM missing
//! from it is reported as DELETED, every listed VM as MODIFIED (the provider ignores running
//! ones), so the core needs no second code path for the re-sync.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{ChildRole, Daemon, OwnTimer};
use crate::provider::cocoon::{parse_event_line, parse_vm_list};
use crate::provider::{Input, VmEventKind};
use crate::reactor::{ChildExit, ChildSpec, OutputMode, StdinMode};
use crate::vm::events::{EventStreamSupervisor, LineSplitter, SplitItem, StreamAction};

const RESYNC_DEADLINE: Duration = Duration::from_secs(120);

pub(super) struct EventStream {
    supervisor: EventStreamSupervisor,
    lines: LineSplitter,
}

impl EventStream {
    pub(super) fn new(now: Instant) -> EventStream {
        EventStream {
            supervisor: EventStreamSupervisor::new(now),
            lines: LineSplitter::new(),
        }
    }

    /// Stdout bytes of the stream child: complete lines become inputs.
    pub(super) fn on_output(&mut self, now: Instant, data: &[u8]) -> Vec<Input> {
        let items = self.lines.push(data);
        self.inputs(now, items)
    }

    /// The child ended: flush a final unterminated line and say when to restart.
    pub(super) fn on_exit(&mut self, now: Instant, exit: &ChildExit) -> (Vec<Input>, Instant) {
        let tail: Vec<SplitItem> = self.lines.finish().into_iter().collect();
        let inputs = self.inputs(now, tail);
        let clean = exit.success();
        let stderr = String::from_utf8_lossy(&exit.stderr);
        log::warn!(
            "cocoon event stream ended ({}){}; restarting",
            if clean { "clean exit" } else { "failure" },
            if stderr.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", stderr.trim())
            }
        );
        (inputs, self.supervisor.on_exit(now, clean))
    }

    fn inputs(&mut self, now: Instant, items: Vec<SplitItem>) -> Vec<Input> {
        let mut out = Vec::new();
        for item in items {
            self.supervisor.on_line(now);
            match item {
                SplitItem::Overlong(n) => {
                    log::warn!("cocoon event stream: skipped a line of {n} bytes (over 1 MiB)")
                }
                SplitItem::Line(bytes) => {
                    let line = String::from_utf8_lossy(&bytes);
                    match parse_event_line(&line) {
                        Ok(Some((kind, vm))) => out.push(Input::VmEvent { kind, vm }),
                        Ok(None) => {}
                        Err(e) => log::warn!("cocoon event stream: skipped line: {e}"),
                    }
                }
            }
        }
        out
    }
}

impl Daemon {
    /// Starts the stream child when the supervisor says so (or arms the timer for later).
    pub(super) fn start_event_stream(&mut self) {
        let now = self.reactor.now();
        match self.stream.supervisor.poll(now) {
            StreamAction::Running => {}
            StreamAction::WaitUntil(at) => self.arm(OwnTimer::EventStream, at),
            StreamAction::Spawn => {
                let argv = vec![
                    self.config.cocoon_bin.to_string_lossy().into_owned(),
                    "vm".into(),
                    "status".into(),
                    "--event".into(),
                    "--format".into(),
                    "json".into(),
                ];
                let spec = ChildSpec::new(argv)
                    .stdin(StdinMode::Null)
                    .stdout(OutputMode::Stream)
                    .stderr(OutputMode::Capture { limit: 16 << 10 });
                match self.reactor.spawn(spec) {
                    Ok(id) => {
                        self.stream.supervisor.on_spawned(now);
                        self.children.insert(id, ChildRole::EventStream);
                        if self.stream.supervisor.take_resync() {
                            self.start_resync();
                        }
                    }
                    Err(e) => {
                        let at = self.stream.supervisor.on_spawn_failed(now);
                        log::warn!("cocoon event stream: cannot start: {e}; retrying");
                        self.arm(OwnTimer::EventStream, at);
                    }
                }
            }
        }
    }

    fn start_resync(&mut self) {
        let argv = vec![
            self.config.cocoon_bin.to_string_lossy().into_owned(),
            "vm".into(),
            "list".into(),
            "-o".into(),
            "json".into(),
        ];
        let spec = ChildSpec::new(argv)
            .deadline(RESYNC_DEADLINE)
            .stdin(StdinMode::Null)
            .stdout(OutputMode::Capture { limit: 64 << 20 })
            .stderr(OutputMode::Capture { limit: 16 << 10 });
        match self.reactor.spawn(spec) {
            Ok(id) => {
                self.children.insert(id, ChildRole::Resync);
            }
            Err(e) => log::warn!("cocoon event stream re-sync: cannot list VMs: {e}"),
        }
    }

    /// The re-sync list ended: synthesise the events the stream may have missed.
    pub(super) fn resync_listed(&mut self, exit: ChildExit) {
        let result = super::effects::cocoon_result(&exit);
        let listed = if result.success {
            parse_vm_list(&result.stdout)
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
        let mut missing = Vec::new();
        for pod in self.provider.pods() {
            let key = crate::provider::PodKey::of(&pod);
            if let Some(vm) = self.provider.pod_vm(&key) {
                if !vm.id.is_empty() && !present.contains(vm.id.as_str()) {
                    missing.push(vm.clone());
                }
            }
        }
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
