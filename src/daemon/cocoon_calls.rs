//! Cocoon calls of the edge: the provider's calls queued for a slot (VM checks and teardowns
//! ahead), started as reactor children, and their exits turned back into inputs.
//!
//! At most `MAX_COCOON_CALLS` run at once (a burst must not stampede cocoon's lock); the
//! startup and re-sync `vm list`s are started here too and recorded in the child table.

use std::path::PathBuf;

use crate::provider::{Answer, CocoonCmd, Input, OpId};
use crate::reactor::ChildExit;
use crate::vm::{argv, CocoonCall, Deadlines, Verb};

use super::{ChildRole, Daemon};

/// cocoon's JSON answers are small; a `vm list` of a dense host is the largest.
const STDOUT_LIMIT: usize = 16 << 20;
const STDERR_LIMIT: usize = 64 << 10;
/// cocoon calls the provider may have running at once; the rest wait in order.
pub(super) const MAX_COCOON_CALLS: usize = 32;
/// Slots beyond `MAX_COCOON_CALLS` that only the calls of `jumps_the_queue` may take.
const PRIORITY_RESERVE: usize = 4;

/// The cocoon calls that go ahead of queued creates, take the reserved slots and have their
/// answers handled ahead of other inputs: checking (`vm inspect`), restarting (`vm start`) and
/// removing (`vm rm`) a VM. They are short, and a dead VM's pod waits on them.
pub(super) fn jumps_the_queue(verb: Verb) -> bool {
    matches!(verb, Verb::VmInspect | Verb::VmStart | Verb::VmRm)
}

impl Daemon {
    /// `Effect::Cocoon`: the call waits for a slot in order, VM checks and teardowns ahead.
    pub(super) fn queue_cocoon_call(&mut self, op: OpId, cmd: CocoonCmd) {
        let verb = cmd.verb();
        if jumps_the_queue(verb) {
            // A liveness check (is the VM gone?), a restart or a removal must not wait
            // behind a burst of creates: they go ahead of the queue, first-in first-out
            // among them.
            self.cocoon_queue
                .insert(self.cocoon_priority_queued, (op, cmd));
            self.cocoon_priority_queued += 1;
            if self.cocoon_running >= MAX_COCOON_CALLS + PRIORITY_RESERVE {
                // The bench counts the "vm inspect waits for a slot" lines.
                log::debug!(
                    "cocoon op {op}: {} waits for a slot ({} run)",
                    verb.as_str(),
                    self.cocoon_running
                );
            }
        } else {
            self.cocoon_queue.push_back((op, cmd));
        }
        self.start_cocoon_calls();
    }

    /// Starts queued cocoon calls while fewer than `MAX_COCOON_CALLS` run: a burst of pods must
    /// not fork a thousand CLI processes at once (a stampede on cocoon's lock). A call's
    /// deadline counts from its start, not from its queueing.
    /// VM checks, restarts and removals (they lead the queue) may also take `PRIORITY_RESERVE`
    /// slots beyond the limit: a VM-gone check never waits for a burst's clones to finish.
    pub(super) fn start_cocoon_calls(&mut self) {
        loop {
            let limit = if self.cocoon_priority_queued > 0 {
                MAX_COCOON_CALLS + PRIORITY_RESERVE
            } else {
                MAX_COCOON_CALLS
            };
            if self.cocoon_running >= limit {
                return;
            }
            let Some((op, cmd)) = self.cocoon_queue.pop_front() else {
                return;
            };
            self.cocoon_priority_queued = self.cocoon_priority_queued.saturating_sub(1);
            let bin = if cmd.is_macos() {
                self.config.cocoon_macos_bin.clone()
            } else {
                self.cocoon_bin()
            };
            let bin = bin.to_string_lossy().into_owned();
            // The last line of defence: a name that is not the contract's never reaches argv.
            if let Err(e) = argv::check(&cmd.argv()) {
                log::warn!("cocoon op {op}: not run: {e}");
                self.pending.push_back(Input::CocoonDone {
                    op,
                    result: Answer::not_started(format!(
                        "Error: vk-cocoon refused to run {bin}: {e}"
                    )),
                });
                continue;
            }
            log::debug!("cocoon op {op}: {bin} {}", cmd.argv().join(" "));
            let call = cmd.call().with_limits(STDOUT_LIMIT, STDERR_LIMIT);
            let mut spec = call.child_spec(&bin);
            if let CocoonCmd::Macos(m) = &cmd {
                spec.term_grace = m.term_grace();
            }
            spec.env = cmd.child_env(self.config.macos_vnc_password.as_deref());
            // The spawn itself runs on the reactor's spawner threads; a child that cannot be
            // started answers later as a `ChildExit` with its spawn error.
            match self.reactor.spawn(spec) {
                Ok(id) => {
                    let macos = match cmd {
                        CocoonCmd::Macos(m) => Some(m),
                        _ => None,
                    };
                    self.children.insert(id, ChildRole::Op { op, call, macos });
                    self.cocoon_running += 1;
                }
                Err(e) => self.pending.push_back(Input::CocoonDone {
                    op,
                    result: Answer::not_started(format!("Error: run {bin}: {e}")),
                }),
            }
        }
    }

    /// A provider cocoon call ended: its answer is the op's next input (ahead of the backlog
    /// for the calls of `jumps_the_queue`), and its slot goes to the next queued call.
    pub(super) fn cocoon_call_done(
        &mut self,
        op: OpId,
        call: CocoonCall,
        macos: Option<crate::guest::macos::MacosCmd>,
        exit: ChildExit,
    ) {
        self.cocoon_running = self.cocoon_running.saturating_sub(1);
        let answer = crate::vm::Answer::of_exit(&call, &exit);
        let result = match &macos {
            Some(m) => m.classify(answer),
            None => answer,
        };
        let input = Input::CocoonDone { op, result };
        if jumps_the_queue(call.verb) {
            self.urgent_inputs.push_back(input);
        } else {
            self.pending.push_back(input);
        }
        self.start_cocoon_calls();
    }

    /// Starts `cocoon vm list -o json` (startup reconcile or event-stream re-sync).
    pub(super) fn spawn_vm_list(&mut self, role: ChildRole) -> std::io::Result<()> {
        let spec = vm_list_call().child_spec(&self.config.cocoon_bin.to_string_lossy());
        let id = self.reactor.spawn(spec)?;
        self.children.insert(id, role);
        Ok(())
    }

    /// The cocoon binary as an argv prefix.
    pub(super) fn cocoon_bin(&self) -> PathBuf {
        self.config.cocoon_bin.clone()
    }
}

/// The `vm list` of the startup reconcile and the event-stream re-sync: a dense host's list
/// is the largest answer cocoon gives.
pub(super) fn vm_list_call() -> CocoonCall {
    CocoonCall::new(Verb::VmList, argv::vm_list(), &Deadlines::configured())
        .with_limits(64 << 20, 64 << 10)
}
