//! Running cocoon calls and the event stream on the reactor: ChildSpec for a call, CallOutcome from a
//! ChildExit, and the event-stream child driven by `EventStreamSupervisor`. Owns no daemon state.

use super::call::{CallMode, CallOutcome, CocoonCall, ExitKind};
use super::events::{
    parse_event_line, EventLineError, EventStreamSupervisor, LineSplitter, SplitItem, StreamAction,
};
use super::types::VmEvent;
use super::Verb;
use crate::reactor::{
    ChildExit, ChildId, ChildSpec, Event, OutputMode, Reactor, StdinMode, Stream, TimerId,
};
use std::io;
use std::time::Instant;

/// stderr kept from the event-stream child (only used in log lines).
const STREAM_STDERR_LIMIT: usize = 64 << 10;

impl CocoonCall {
    /// The reactor spec for this call: argv with the binary first, capture limits, deadline,
    /// a stdin pipe for imports/interactive exec, stdout streamed for export/logs/exec.
    pub fn child_spec(&self, bin: &str) -> ChildSpec {
        ChildSpec {
            argv: self.full_argv(bin),
            env: Vec::new(),
            stdin: if self.stdin_pipe {
                StdinMode::Pipe
            } else {
                StdinMode::Null
            },
            stdout: match self.mode {
                CallMode::Json | CallMode::Combined => OutputMode::Capture {
                    limit: self.stdout_limit,
                },
                CallMode::Streaming => OutputMode::Stream,
            },
            stderr: OutputMode::Capture {
                limit: self.stderr_limit,
            },
            deadline: self.deadline,
            term_grace: None,
            // A VM check is short, starts nothing, and a pod's status waits on it (is the VM
            // gone?): ahead of a burst's clones and at the loop's priority.
            urgent: self.verb == Verb::VmInspect,
        }
    }

    /// Spawns this call on the reactor.
    pub fn spawn<M: Send + 'static>(
        &self,
        reactor: &mut Reactor<M>,
        bin: &str,
    ) -> io::Result<ChildId> {
        reactor.spawn(self.child_spec(bin))
    }
}

impl CallOutcome {
    /// Converts the reactor's exit report (takes the captured bytes).
    pub fn from_exit(exit: ChildExit) -> CallOutcome {
        let kind = match (exit.code(), exit.signal()) {
            (Some(code), _) => ExitKind::Code(code),
            (None, Some(sig)) => ExitKind::Signal(sig),
            // Never ran, or status lost (reaped elsewhere): an opaque failure.
            (None, None) => ExitKind::Code(-1),
        };
        let mut stderr = exit.stderr;
        if let Some(e) = &exit.spawn_error {
            stderr.extend_from_slice(format!("cannot run cocoon: {e}").as_bytes());
        }
        CallOutcome {
            exit: kind,
            stdout: exit.stdout,
            stderr,
            stdout_truncated: exit.stdout_truncated,
            stderr_truncated: exit.stderr_truncated,
            timed_out: exit.timed_out,
        }
    }
}

/// What one reactor event meant for the event stream.
#[derive(Debug, Default)]
pub struct StreamOutput {
    /// Parsed events, in order.
    pub events: Vec<VmEvent>,
    /// Lines that were skipped; log each one.
    pub skipped: Vec<EventLineError>,
    /// The child ended (exit status, trimmed stderr); a restart is scheduled at `restart_at`.
    pub ended: Option<(ExitKind, String)>,
    pub restart_at: Option<Instant>,
    /// A spawn attempt failed with this error.
    pub spawn_error: Option<String>,
    /// The stream (re)connected after a restart: run a `vm list` and reconcile.
    pub resync: bool,
}

/// The long-lived `cocoon vm status --event --format json` child on the reactor, restarted by the
/// supervisor's policy. Feed it every reactor event with [`EventStream::handle`].
pub struct EventStream {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    timer_key: u64,
    supervisor: EventStreamSupervisor,
    splitter: LineSplitter,
    child: Option<ChildId>,
    timer: Option<TimerId>,
}

impl EventStream {
    /// A stream running `bin vm status --event --format json`; `timer_key` is the reactor timer
    /// key reserved for its restarts.
    pub fn new(bin: &str, env: Vec<(String, String)>, timer_key: u64, now: Instant) -> EventStream {
        let call = super::argv::vm_status_events();
        let mut argv = vec![bin.to_string()];
        argv.extend(call);
        EventStream {
            argv,
            env,
            timer_key,
            supervisor: EventStreamSupervisor::new(now),
            splitter: LineSplitter::new(),
            child: None,
            timer: None,
        }
    }

    pub fn child(&self) -> Option<ChildId> {
        self.child
    }

    pub fn supervisor(&self) -> &EventStreamSupervisor {
        &self.supervisor
    }

    /// Spawns the child if the supervisor says so, else arms the restart timer.
    pub fn start<M: Send + 'static>(&mut self, reactor: &mut Reactor<M>) -> StreamOutput {
        let mut out = StreamOutput::default();
        self.drive(reactor, &mut out);
        out
    }

    fn drive<M: Send + 'static>(&mut self, reactor: &mut Reactor<M>, out: &mut StreamOutput) {
        let now = reactor.now().max(Instant::now());
        match self.supervisor.poll(now) {
            StreamAction::Running => {}
            StreamAction::WaitUntil(at) => {
                if self.timer.is_none() {
                    self.timer = Some(reactor.timer_at(at, self.timer_key));
                }
                out.restart_at = Some(at);
            }
            StreamAction::Spawn => {
                let spec = ChildSpec {
                    argv: self.argv.clone(),
                    env: self.env.clone(),
                    stdin: StdinMode::Null,
                    stdout: OutputMode::Stream,
                    stderr: OutputMode::Capture {
                        limit: STREAM_STDERR_LIMIT,
                    },
                    deadline: None,
                    term_grace: None,
                    urgent: false,
                };
                match reactor.spawn(spec) {
                    Ok(id) => {
                        self.child = Some(id);
                        self.splitter = LineSplitter::new();
                        self.supervisor.on_spawned(now);
                        out.resync |= self.supervisor.take_resync();
                    }
                    Err(e) => {
                        let at = self.supervisor.on_spawn_failed(now);
                        out.spawn_error = Some(e.to_string());
                        self.timer = Some(reactor.timer_at(at, self.timer_key));
                        out.restart_at = Some(at);
                    }
                }
            }
        }
    }

    fn absorb(&mut self, items: Vec<SplitItem>, out: &mut StreamOutput, now: Instant) {
        for item in items {
            match item {
                SplitItem::Overlong(n) => out.skipped.push(EventLineError::TooLong(n)),
                SplitItem::Line(line) => {
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    self.supervisor.on_line(now);
                    match parse_event_line(&line) {
                        Ok(Some(ev)) => out.events.push(ev),
                        Ok(None) => {}
                        Err(e) => out.skipped.push(e),
                    }
                }
            }
        }
    }

    /// Handles one reactor event; `None` when it does not concern the stream.
    pub fn handle<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        event: &Event<M>,
    ) -> Option<StreamOutput> {
        let now = reactor.now();
        match event {
            Event::ChildOutput {
                id,
                stream: Stream::Stdout,
                data,
            } if Some(*id) == self.child => {
                let mut out = StreamOutput::default();
                let items = self.splitter.push(data);
                self.absorb(items, &mut out, now);
                Some(out)
            }
            Event::ChildExit(exit) if Some(exit.id) == self.child => {
                let mut out = StreamOutput::default();
                if let Some(item) = self.splitter.finish() {
                    self.absorb(vec![item], &mut out, now);
                }
                self.child = None;
                let kind = CallOutcome::from_exit(exit.clone()).exit;
                let clean = kind == ExitKind::Code(0);
                let stderr = super::error::trim_text(&exit.stderr);
                let at = self.supervisor.on_exit(now, clean);
                self.timer = Some(reactor.timer_at(at, self.timer_key));
                out.ended = Some((kind, stderr));
                out.restart_at = Some(at);
                Some(out)
            }
            Event::Timer { key, .. } if *key == self.timer_key => {
                self.timer = None;
                let mut out = StreamOutput::default();
                self.drive(reactor, &mut out);
                Some(out)
            }
            _ => None,
        }
    }

    /// Kills the child and cancels the restart timer (shutdown).
    pub fn stop<M: Send + 'static>(&mut self, reactor: &mut Reactor<M>) {
        if let Some(t) = self.timer.take() {
            reactor.cancel_timer(t);
        }
        if let Some(id) = self.child.take() {
            reactor.kill(id);
        }
    }
}
