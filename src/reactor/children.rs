//! Child-process lifecycle of the reactor: spawn through the spawner threads, pipes and pidfd,
//! stdin, deadlines, output reads, reaping, and the one ChildExit report per child.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Instant;

use mio::unix::pipe::{Receiver, Sender};
use mio::unix::SourceFd;
use mio::Interest;

use super::child::{ChildPart, ChildState, InPipe, OutPipe, ReadOutcome, Starting};
use super::process::{ProcessSpec, Stdio};
use super::spawner::{Request, Started};
use super::*;

impl<M: Send + 'static> Reactor<M> {
    /// The process id of a child that has started and not been reported yet (None while a
    /// spawner thread is still starting it).
    pub fn pid(&self, id: ChildId) -> Option<u32> {
        self.children.get(&id).map(|c| c.pid)
    }

    /// Number of children spawned (started or still starting) and not yet reported.
    pub fn children_running(&self) -> usize {
        self.children.len() + self.starting.len()
    }

    /// Starts a child process without waiting for it: a spawner thread starts it (see
    /// `process`), and its pipes are registered when it comes back. Until then the child is
    /// "starting": `kill`, stdin writes, `close_stdin` and `pause_output` are remembered and
    /// applied once it runs, and its deadline already counts. A child that could not be started (no such program,
    /// resource limits) is reported as a `ChildExit` with `spawn_error`. The only immediate
    /// errors are an empty argv and spawner threads that are gone.
    pub fn spawn(&mut self, spec: ChildSpec) -> io::Result<ChildId> {
        if spec.argv.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty argv"));
        }
        let piped_unless_null = |null: bool| if null { Stdio::Null } else { Stdio::Piped };
        let process = ProcessSpec {
            argv: spec.argv.clone(),
            env: spec.env.clone(),
            stdin: piped_unless_null(spec.stdin == StdinMode::Null),
            stdout: piped_unless_null(spec.stdout == OutputMode::Null),
            stderr: piped_unless_null(spec.stderr == OutputMode::Null),
            own_group: false,
            nice: spec.urgent.then_some(super::priority::LOOP_NICE),
        };
        let id = ChildId(self.next_child);
        self.spawner.request(Request {
            id,
            process,
            urgent: spec.urgent,
        })?;
        self.next_child += 1;
        let deadline_timer = spec.deadline.map(|d| {
            self.timers
                .insert(Instant::now() + d, TimerKind::Deadline(id))
        });
        let stdin = match &spec.stdin {
            StdinMode::Bytes(b) => b.iter().copied().collect(),
            _ => VecDeque::new(),
        };
        self.starting.insert(
            id,
            Starting {
                close_stdin: matches!(spec.stdin, StdinMode::Bytes(_)),
                spec,
                stdin,
                deadline_timer,
                timed_out: false,
                killed: false,
                paused: false,
            },
        );
        Ok(id)
    }

    /// A spawner thread is back with a child: register its pipes and pidfd and apply what was
    /// asked of it while it was starting.
    pub(super) fn started(&mut self, started: Started, out: &mut Vec<Event<M>>) {
        let Started { id, result } = started;
        let Some(starting) = self.starting.remove(&id) else {
            // Not ours (cannot happen): leave no process behind.
            if let Ok((mut child, _)) = result {
                let _ = child.kill();
                let _ = child.wait();
            }
            return;
        };
        let (mut child, pidfd) = match result {
            Ok(ok) => ok,
            Err(e) => {
                if let Some(t) = starting.deadline_timer {
                    self.timers.cancel(t);
                }
                out.push(Event::ChildExit(ChildExit {
                    id,
                    pid: 0,
                    status: None,
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                    stdout_truncated: false,
                    stderr_truncated: false,
                    timed_out: starting.timed_out,
                    killed: starting.killed,
                    spawn_error: Some(SpawnError::from(&e)),
                }));
                return;
            }
        };
        let pid = child.id();
        let stdin_pipe = child.stdin.take();
        let stdout_pipe = child.stdout.take();
        let stderr_pipe = child.stderr.take();
        let mut state = ChildState {
            child,
            pid,
            pidfd: None,
            stdin: None,
            stdout: None,
            stderr: None,
            stdout_result: (Vec::new(), false),
            stderr_result: (Vec::new(), false),
            reaped: None,
            timed_out: starting.timed_out,
            killed: starting.killed,
            deadline_timer: starting.deadline_timer,
            term_grace: starting.spec.term_grace,
            drain_timer: None,
        };
        let setup = self.setup_child(
            id,
            &mut state,
            &starting,
            pidfd,
            stdin_pipe,
            stdout_pipe,
            stderr_pipe,
        );
        if let Err(e) = setup {
            // A child the loop cannot watch is not left running unwatched: kill and reap it
            // (a SIGKILLed child is gone at once) and report why it did not start.
            self.release_child_tokens(&mut state);
            let _ = state.child.kill();
            let _ = state.child.wait();
            if let Some(t) = state.deadline_timer.take() {
                self.timers.cancel(t);
            }
            out.push(Event::ChildExit(ChildExit {
                id,
                pid,
                status: None,
                stdout: Vec::new(),
                stderr: Vec::new(),
                stdout_truncated: false,
                stderr_truncated: false,
                timed_out: state.timed_out,
                killed: state.killed,
                spawn_error: Some(SpawnError::from(&e)),
            }));
            return;
        }
        if state.killed || state.timed_out {
            let _ = state.child.kill();
        }
        self.children.insert(id, state);
        if starting.paused {
            self.pause_output(id);
        }
        self.flush_stdin(id);
    }

    #[allow(clippy::too_many_arguments)]
    fn setup_child(
        &mut self,
        id: ChildId,
        state: &mut ChildState,
        starting: &Starting,
        pidfd: io::Result<OwnedFd>,
        stdin_pipe: Option<std::process::ChildStdin>,
        stdout_pipe: Option<std::process::ChildStdout>,
        stderr_pipe: Option<std::process::ChildStderr>,
    ) -> io::Result<()> {
        if self.sigchld.is_none() {
            match pidfd {
                Ok(fd) => {
                    let token = self.internal_token(Internal::Child(id, ChildPart::Exit));
                    self.poll.registry().register(
                        &mut SourceFd(&fd.as_raw_fd()),
                        token,
                        Interest::READABLE,
                    )?;
                    state.pidfd = Some((fd, token));
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    log::warn!("pidfd_open unavailable; detecting child exits through SIGCHLD");
                    self.use_sigchld_for_exits()?;
                }
                Err(e) => return Err(e),
            }
        } else {
            // The child may have exited before this point; the next poll sweeps.
            self.sweep_exits = true;
        }
        if let Some(p) = stdin_pipe {
            let mut pipe = Sender::from(p);
            pipe.set_nonblocking(true)?;
            let token = self.internal_token(Internal::Child(id, ChildPart::Stdin));
            self.poll
                .registry()
                .register(&mut pipe, token, Interest::WRITABLE)?;
            state.stdin = Some(InPipe {
                pipe,
                token,
                buf: starting.stdin.clone(),
                close_when_empty: starting.close_stdin,
            });
        }
        for (p, mode, part) in [
            (
                stdout_pipe.map(Receiver::from),
                &starting.spec.stdout,
                ChildPart::Stdout,
            ),
            (
                stderr_pipe.map(Receiver::from),
                &starting.spec.stderr,
                ChildPart::Stderr,
            ),
        ] {
            let Some(mut pipe) = p else { continue };
            pipe.set_nonblocking(true)?;
            let token = self.internal_token(Internal::Child(id, part));
            self.poll
                .registry()
                .register(&mut pipe, token, Interest::READABLE)?;
            let (stream, limit) = match mode {
                OutputMode::Stream => (true, 0),
                OutputMode::Capture { limit } => (false, *limit),
                OutputMode::Null => (false, 0),
            };
            let out = OutPipe {
                pipe,
                token,
                stream,
                limit,
                kept: Vec::new(),
                truncated: false,
                paused: false,
            };
            if part == ChildPart::Stdout {
                state.stdout = Some(out);
            } else {
                state.stderr = Some(out);
            }
        }
        Ok(())
    }

    fn release_child_tokens(&mut self, state: &mut ChildState) {
        let registry = self.poll.registry();
        if let Some((fd, token)) = state.pidfd.take() {
            let _ = registry.deregister(&mut SourceFd(&fd.as_raw_fd()));
            self.internal.remove(&token);
        }
        if let Some(mut p) = state.stdin.take() {
            let _ = registry.deregister(&mut p.pipe);
            self.internal.remove(&p.token);
        }
        for out in [state.stdout.take(), state.stderr.take()]
            .into_iter()
            .flatten()
        {
            let mut out = out;
            let _ = registry.deregister(&mut out.pipe);
            self.internal.remove(&out.token);
        }
    }

    /// Queues bytes for a child's stdin (`StdinMode::Pipe`); written as the pipe accepts them.
    /// Errors: NotFound when the child is unknown or its stdin is already closed.
    pub fn write_stdin(&mut self, id: ChildId, data: &[u8]) -> io::Result<()> {
        if let Some(starting) = self.starting.get_mut(&id) {
            if starting.spec.stdin != StdinMode::Pipe || starting.close_stdin {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{id}: stdin not open"),
                ));
            }
            starting.stdin.extend(data);
            return Ok(());
        }
        let stdin = self
            .children
            .get_mut(&id)
            .and_then(|c| c.stdin.as_mut())
            .filter(|s| !s.close_when_empty)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("{id}: stdin not open"))
            })?;
        stdin.buf.extend(data);
        self.flush_stdin(id);
        Ok(())
    }

    /// Bytes queued for a child's stdin and not yet taken by the pipe (0 for unknown children
    /// and closed stdin): callers bound their own input with it, the reactor does not.
    pub fn stdin_queued(&self, id: ChildId) -> usize {
        if let Some(starting) = self.starting.get(&id) {
            return starting.stdin.len();
        }
        self.children
            .get(&id)
            .and_then(|c| c.stdin.as_ref())
            .map_or(0, |s| s.buf.len())
    }

    /// Stops reading a streamed child's stdout and stderr: once its pipes are full the child
    /// blocks, which is how a slow consumer slows the producer. Output is still drained when the
    /// child exits (one pipe's worth at most). Unknown children are ignored.
    pub fn pause_output(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.paused = true;
            return;
        }
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        for pipe in [state.stdout.as_mut(), state.stderr.as_mut()]
            .into_iter()
            .flatten()
        {
            if !pipe.paused && pipe.stream {
                pipe.paused = true;
                let _ = self.poll.registry().deregister(&mut pipe.pipe);
            }
        }
    }

    /// Undoes `pause_output`; what waits in the pipes is read on this turn of the loop.
    pub fn resume_output(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.paused = false;
            return;
        }
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        for (pipe, part) in [
            (state.stdout.as_mut(), ChildPart::Stdout),
            (state.stderr.as_mut(), ChildPart::Stderr),
        ] {
            let Some(pipe) = pipe else { continue };
            if !pipe.paused {
                continue;
            }
            pipe.paused = false;
            if self
                .poll
                .registry()
                .register(&mut pipe.pipe, pipe.token, Interest::READABLE)
                .is_ok()
            {
                self.again.push((id, part));
            }
        }
    }

    /// Closes a child's stdin once everything queued has been written.
    pub fn close_stdin(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.close_stdin = true;
            return;
        }
        if let Some(stdin) = self.children.get_mut(&id).and_then(|c| c.stdin.as_mut()) {
            stdin.close_when_empty = true;
            self.flush_stdin(id);
        }
    }

    pub(super) fn flush_stdin(&mut self, id: ChildId) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        let Some(stdin) = state.stdin.as_mut() else {
            return;
        };
        let close = match stdin.flush() {
            Ok(close) => close,
            Err(e) => {
                log::debug!("{id}: stdin write failed: {e}");
                true
            }
        };
        if close {
            if let Some(mut p) = state.stdin.take() {
                let _ = self.poll.registry().deregister(&mut p.pipe);
                self.internal.remove(&p.token);
            }
        }
    }

    /// Sends SIGKILL to a running child (not its process group). Its exit is
    /// reported as usual, with `killed = true`. Unknown or reaped ids are ignored.
    pub fn kill(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            starting.killed = true;
            return;
        }
        if let Some(state) = self.children.get_mut(&id) {
            if state.reaped.is_none() {
                state.killed = true;
                let _ = state.child.kill();
            }
        }
    }

    /// Sends `sig` to a running child (e.g. SIGTERM before a grace period). A child still
    /// starting is not running yet: NotFound.
    pub fn send_signal(&mut self, id: ChildId, sig: i32) -> io::Result<()> {
        let state = self
            .children
            .get_mut(&id)
            .filter(|s| s.reaped.is_none())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{id}: not running")))?;
        let pid = libc::pid_t::try_from(state.pid)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: kill(2) has no memory-safety preconditions. The pid is our own
        // child and has not been reaped (reaped is None), so it cannot have been recycled.
        if unsafe { libc::kill(pid, sig) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A child's deadline timer fired: SIGKILL it, or SIGTERM first when it has a grace
    /// period (the grace then arms the deadline again). A child still starting is killed
    /// as soon as it runs.
    pub(super) fn deadline_passed(&mut self, id: ChildId) {
        if let Some(starting) = self.starting.get_mut(&id) {
            // Killed as soon as it runs.
            starting.deadline_timer = None;
            starting.timed_out = true;
        }
        if let Some(state) = self.children.get_mut(&id) {
            state.deadline_timer = None;
            if state.reaped.is_some() {
                return;
            }
            state.timed_out = true;
            // Not reaped yet, so the PID is still this child's.
            let pid = i32::try_from(state.pid)
                .ok()
                .and_then(rustix::process::Pid::from_raw);
            match (state.term_grace.take(), pid) {
                (Some(grace), Some(pid)) => {
                    log::debug!(
                        "{id} (pid {}) passed its deadline; SIGTERM, SIGKILL \
                         in {grace:?}",
                        state.pid
                    );
                    let term = rustix::process::Signal::TERM;
                    let _ = rustix::process::kill_process(pid, term);
                    state.deadline_timer = Some(
                        self.timers
                            .insert(self.now + grace, TimerKind::Deadline(id)),
                    );
                }
                _ => {
                    log::debug!("{id} (pid {}) passed its deadline; killing", state.pid);
                    let _ = state.child.kill();
                }
            }
        }
    }

    /// A reaped child's pipes stayed open past EXIT_DRAIN_GRACE (a grandchild holds them):
    /// take what is there, close them and report the exit.
    pub(super) fn drain_ended(&mut self, id: ChildId, out: &mut Vec<Event<M>>) {
        if let Some(state) = self.children.get_mut(&id) {
            state.drain_timer = None;
        }
        self.read_output(id, ChildPart::Stdout, out);
        self.read_output(id, ChildPart::Stderr, out);
        self.close_output(id, ChildPart::Stdout);
        self.close_output(id, ChildPart::Stderr);
        self.try_complete(id, out);
    }

    pub(super) fn sweep_children(&mut self, out: &mut Vec<Event<M>>) {
        let ids: Vec<ChildId> = self
            .children
            .iter()
            .filter(|(_, s)| s.reaped.is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.reap(id, out);
        }
    }

    /// Collects the exit status if the child has exited; then drains what is
    /// left in its pipes and reports it once they are closed.
    pub(super) fn reap(&mut self, id: ChildId, out: &mut Vec<Event<M>>) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        if state.reaped.is_some() {
            return;
        }
        match state.child.try_wait() {
            Ok(Some(status)) => state.reaped = Some(Some(status)),
            Ok(None) => return,
            Err(e) => {
                log::warn!("{id} (pid {}): exit status lost: {e}", state.pid);
                state.reaped = Some(None);
            }
        }
        if let Some((fd, token)) = state.pidfd.take() {
            let _ = self
                .poll
                .registry()
                .deregister(&mut SourceFd(&fd.as_raw_fd()));
            self.internal.remove(&token);
        }
        if let Some(mut p) = state.stdin.take() {
            let _ = self.poll.registry().deregister(&mut p.pipe);
            self.internal.remove(&p.token);
        }
        if let Some(t) = state.deadline_timer.take() {
            self.timers.cancel(t);
        }
        self.read_output(id, ChildPart::Stdout, out);
        self.read_output(id, ChildPart::Stderr, out);
        if let Some(state) = self.children.get_mut(&id) {
            if state.stdout.is_some() || state.stderr.is_some() {
                let t = self
                    .timers
                    .insert(Instant::now() + EXIT_DRAIN_GRACE, TimerKind::Drain(id));
                state.drain_timer = Some(t);
            }
        }
        self.try_complete(id, out);
    }

    pub(super) fn read_output(&mut self, id: ChildId, part: ChildPart, out: &mut Vec<Event<M>>) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        let (pipe, stream) = match part {
            ChildPart::Stdout => (state.stdout.as_mut(), Stream::Stdout),
            ChildPart::Stderr => (state.stderr.as_mut(), Stream::Stderr),
            _ => return,
        };
        let Some(pipe) = pipe else { return };
        if pipe.paused && state.reaped.is_none() {
            return;
        }
        let outcome = pipe.read_some(&mut self.scratch, &mut |data| {
            out.push(Event::ChildOutput { id, stream, data });
        });
        match outcome {
            ReadOutcome::Pending => {}
            ReadOutcome::More => self.again.push((id, part)),
            ReadOutcome::Eof => {
                self.close_output(id, part);
                self.try_complete(id, out);
            }
        }
    }

    fn close_output(&mut self, id: ChildId, part: ChildPart) {
        let Some(state) = self.children.get_mut(&id) else {
            return;
        };
        let (slot, result) = match part {
            ChildPart::Stdout => (&mut state.stdout, &mut state.stdout_result),
            ChildPart::Stderr => (&mut state.stderr, &mut state.stderr_result),
            _ => return,
        };
        if let Some(mut p) = slot.take() {
            let _ = self.poll.registry().deregister(&mut p.pipe);
            self.internal.remove(&p.token);
            *result = (std::mem::take(&mut p.kept), p.truncated);
        }
    }

    fn try_complete(&mut self, id: ChildId, out: &mut Vec<Event<M>>) {
        let done = self
            .children
            .get(&id)
            .is_some_and(|s| s.reaped.is_some() && s.stdout.is_none() && s.stderr.is_none());
        if !done {
            return;
        }
        let Some(mut state) = self.children.remove(&id) else {
            return;
        };
        for t in [state.deadline_timer.take(), state.drain_timer.take()]
            .into_iter()
            .flatten()
        {
            self.timers.cancel(t);
        }
        self.release_child_tokens(&mut state);
        let (stdout, stdout_truncated) = std::mem::take(&mut state.stdout_result);
        let (stderr, stderr_truncated) = std::mem::take(&mut state.stderr_result);
        out.push(Event::ChildExit(ChildExit {
            id,
            pid: state.pid,
            status: state.reaped.flatten(),
            stdout,
            stderr,
            stdout_truncated,
            stderr_truncated,
            timed_out: state.timed_out,
            killed: state.killed,
            spawn_error: None,
        }));
    }
}
