//! The one blocking cocoon runner, for worker threads (transfers' export / import, short calls
//! such as image pull, snapshot rm and inspect); the loop's children go through the reactor.
//!
//! A [`CocoonCall`] runs as argv (no shell) in its own process group with the parent-death
//! signal, stderr drained on a helper thread; at the call's deadline the group is killed and
//! the child reaped, and the caller gets an [`ErrorKind::TimedOut`] answer, never a hang.

use std::io::Read;
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use super::argv;
use super::call::{CallMode, CallOutcome, CocoonCall, ExitKind};
use super::error::{CocoonError, ErrorKind};
use crate::reactor::process::{self, Process, ProcessSpec, Stdio};

/// Widened size of the streaming pipes: fewer wake-ups per GiB.
const PIPE_SIZE: usize = 8 << 20;

/// Kills the child's process group when its deadline passes before [`Watchdog::stop`].
struct Watchdog {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Watchdog {
    fn start(pgid: i32, deadline: Duration, fired: Arc<AtomicBool>) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("vk-cocoon-deadline".into())
            .spawn(move || {
                if let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(deadline) {
                    fired.store(true, Ordering::SeqCst);
                    // SAFETY: kill(2) on the process group of a child its owner has not reaped
                    // (the owner stops this thread before reaping), so the group id cannot name
                    // another process group; no memory is involved.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                }
            })?;
        Ok(Watchdog { stop, thread })
    }

    fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// A running cocoon call on a worker thread, its stderr drained in the background.
pub struct CocoonChild {
    call: CocoonCall,
    child: Process,
    stderr: Option<JoinHandle<(Vec<u8>, bool)>>,
    watchdog: Option<Watchdog>,
    timed_out: Arc<AtomicBool>,
}

impl CocoonChild {
    /// Spawns `bin` with the call's argv under its deadline. stdin is a pipe when the call
    /// takes one (imports); stdout is a pipe unless the call streams into stdin (an import
    /// answers nothing on stdout). Err is a spawn failure ([`ErrorKind::Spawn`]) or an argv
    /// that is not the contract's.
    pub fn spawn(bin: &Path, call: &CocoonCall) -> Result<Self, CocoonError> {
        let refused = |why: String| CocoonError::new(&call.command_text(), ErrorKind::Spawn(why));
        argv::check(&call.argv).map_err(|e| refused(format!("not run: {e}")))?;
        let full = call.full_argv(&bin.to_string_lossy());
        let stdout_piped = !(call.mode == CallMode::Streaming && call.stdin_pipe);
        let piped = |yes: bool| if yes { Stdio::Piped } else { Stdio::Null };
        // Spawned with the parent-death signal: a daemon killed while this call hangs leaves
        // no cocoon child behind.
        let mut child = process::spawn(&ProcessSpec {
            stdin: piped(call.stdin_pipe),
            stdout: piped(stdout_piped),
            stderr: Stdio::Piped,
            // Own process group: a wrapper (sudo, a script) and its children die together.
            own_group: true,
            ..ProcessSpec::new(full)
        })
        .map_err(|e| refused(format!("{}: {e}", bin.display())))?;
        // Widen the streaming pipes where the kernel permits. Failure (e.g. over
        // /proc/sys/fs/pipe-max-size) is harmless.
        if let Some(s) = child.stdin.as_ref() {
            let _ = rustix::pipe::fcntl_setpipe_size(s, PIPE_SIZE);
        }
        if let Some(s) = child.stdout.as_ref() {
            let _ = rustix::pipe::fcntl_setpipe_size(s, PIPE_SIZE);
        }
        let limit = call.stderr_limit as u64;
        let stderr = child.stderr.take().map(|mut s| {
            std::thread::spawn(move || {
                let mut text = Vec::new();
                let _ = (&mut s).take(limit).read_to_end(&mut text);
                // Keep draining so the child never blocks on a full stderr pipe.
                let more = std::io::copy(&mut s, &mut std::io::sink()).unwrap_or(0);
                (text, more > 0)
            })
        });
        let mut this = CocoonChild {
            call: call.clone(),
            child,
            stderr,
            watchdog: None,
            timed_out: Arc::new(AtomicBool::new(false)),
        };
        if let (Some(d), Ok(pgid)) = (call.deadline, i32::try_from(this.child.id())) {
            match Watchdog::start(pgid, d, this.timed_out.clone()) {
                Ok(w) => this.watchdog = Some(w),
                Err(e) => {
                    this.kill();
                    return Err(refused(format!("no deadline thread: {e}")));
                }
            }
        }
        Ok(this)
    }

    /// The call this child runs.
    pub fn call(&self) -> &CocoonCall {
        &self.call
    }

    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// Whether the deadline passed and the child was killed for it.
    pub fn timed_out(&self) -> bool {
        self.timed_out.load(Ordering::SeqCst)
    }

    /// "killed at its N s deadline" when it was, for messages.
    fn deadline_note(&self) -> String {
        match (self.timed_out(), self.call.deadline) {
            (true, Some(d)) => format!("killed at its {} s deadline", d.as_secs()),
            _ => String::new(),
        }
    }

    /// Waits for the exit without reaping, stops the watchdog, then reaps: the watchdog's
    /// kill can never reach a recycled process group.
    fn reap(&mut self) -> std::io::Result<ExitStatus> {
        use rustix::process::{waitid, WaitId, WaitIdOptions};
        let pid = self.child.pid();
        while let Err(rustix::io::Errno::INTR) = waitid(
            WaitId::Pid(pid),
            WaitIdOptions::EXITED | WaitIdOptions::NOWAIT,
        ) {}
        if let Some(w) = self.watchdog.take() {
            w.stop();
        }
        self.child.wait()
    }

    fn take_stderr(&mut self) -> (Vec<u8>, bool) {
        self.stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }

    /// Reaps the child (stdin closed first) into the finished call; stdout is what the caller
    /// read, if anything. Err only when the wait itself failed.
    fn finish(
        &mut self,
        stdout: Vec<u8>,
        stdout_truncated: bool,
    ) -> Result<CallOutcome, CocoonError> {
        drop(self.child.stdin.take());
        let status = self.reap().map_err(|e| {
            CocoonError::new(
                &self.call.command_text(),
                ErrorKind::Spawn(format!("wait: {e}")),
            )
        })?;
        let (stderr, stderr_truncated) = self.take_stderr();
        let exit = match (
            status.code(),
            std::os::unix::process::ExitStatusExt::signal(&status),
        ) {
            (Some(code), _) => ExitKind::Code(code),
            (None, Some(sig)) => ExitKind::Signal(sig),
            (None, None) => ExitKind::Code(-1),
        };
        Ok(CallOutcome {
            exit,
            stdout,
            stderr,
            stdout_truncated,
            stderr_truncated,
            timed_out: self.timed_out(),
        })
    }

    /// Waits for the exit of a streaming call; a non-zero exit, a signal or the deadline is
    /// the contract's typed error carrying the stderr.
    pub fn wait(mut self) -> Result<(), CocoonError> {
        let out = self.finish(Vec::new(), false)?;
        self.call.check(&out)
    }

    /// SIGKILLs and reaps the child (error paths); returns its stderr for the message, with
    /// the deadline noted when that is why the stream broke.
    pub fn kill(mut self) -> String {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on the process group we created for this child (pgid = its pid,
            // which stays reserved until we reap it below); no memory is involved.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        drop(self.child.stdin.take());
        drop(self.child.stdout.take());
        let _ = self.reap();
        let stderr = String::from_utf8_lossy(&self.take_stderr().0)
            .trim()
            .to_string();
        match self.deadline_note() {
            note if note.is_empty() => stderr,
            note if stderr.is_empty() => format!("cocoon {note}"),
            note => format!("cocoon {note}; {stderr}"),
        }
    }
}

impl Drop for CocoonChild {
    /// A child dropped without `wait` or `kill` (an early return) is killed and reaped.
    fn drop(&mut self) {
        if let Some(w) = self.watchdog.take() {
            if let Ok(pid) = i32::try_from(self.child.id()) {
                // SAFETY: as in `kill`: our own unreaped child's process group.
                unsafe {
                    libc::kill(-pid, libc::SIGKILL);
                }
            }
            w.stop();
            let _ = self.child.wait();
        }
    }
}

/// Runs a short call to its end on the calling thread: stdout captured up to the call's
/// limit (the rest drained), killed and reaped at its deadline. Err only when it could not be
/// started (or reaped); how it ended is the outcome's, classified by [`CocoonCall::check`] and
/// the parsers.
pub fn run(bin: &Path, call: &CocoonCall) -> Result<CallOutcome, CocoonError> {
    let mut child = CocoonChild::spawn(bin, call)?;
    let mut stdout = Vec::new();
    let mut truncated = false;
    if let Some(mut out) = child.take_stdout() {
        let _ = (&mut out)
            .take(call.stdout_limit as u64)
            .read_to_end(&mut stdout);
        truncated = std::io::copy(&mut out, &mut std::io::sink()).unwrap_or(0) > 0;
    }
    child.finish(stdout, truncated)
}

/// [`run`] a call whose output is not read (rm, pull): Ok when it succeeded, else the
/// contract's classification of how it ended.
pub fn run_checked(bin: &Path, call: &CocoonCall) -> Result<(), CocoonError> {
    call.check(&run(bin, call)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{Deadlines, Verb};
    use std::os::unix::fs::PermissionsExt;
    use std::time::Instant;

    /// A "cocoon" that is a script in a temp dir (argv only, no shell on our side).
    fn fake_cocoon(dir: &Path, body: &str) -> std::path::PathBuf {
        let path = dir.join("cocoon");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    fn call(verb: Verb, argv: Vec<String>, deadline: Duration) -> CocoonCall {
        CocoonCall::new(verb, argv, &Deadlines::default()).with_deadline(Some(deadline))
    }

    #[test]
    fn a_hung_cocoon_is_killed_at_its_deadline_and_the_caller_gets_a_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        // The hang holds stdout open, as a wedged image pull does: a plain `.output()` would
        // wait for it for ever.
        let bin = fake_cocoon(dir.path(), "sleep 60");
        let c = call(
            Verb::ImagePull,
            argv::image_pull("ubuntu:24.04", false),
            Duration::from_millis(300),
        );
        let started = Instant::now();
        let out = run(&bin, &c).expect("started");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "killed at the deadline, not waited for: {:?}",
            started.elapsed()
        );
        assert!(out.timed_out);
        let e = c.check(&out).expect_err("a killed call is an error");
        assert_eq!(e.kind, ErrorKind::TimedOut);
        assert!(e.is_transient());
    }

    #[test]
    fn a_finished_call_is_classified_by_its_verb() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = fake_cocoon(
            dir.path(),
            "echo 'Error: inspect: snapshot x: snapshot not found' >&2; exit 1",
        );
        let c = call(
            Verb::SnapshotInspect,
            argv::snapshot_inspect("x"),
            Duration::from_secs(30),
        );
        let out = run(&bin, &c).expect("started");
        let e = crate::vm::parse_snapshot(&c, &out).expect_err("absent");
        assert_eq!(e.kind, ErrorKind::SnapshotNotFound);

        let ok = fake_cocoon(dir.path(), r#"echo '{"id":"S1","name":"x"}'"#);
        let out = run(&ok, &c).expect("started");
        assert_eq!(
            crate::vm::parse_snapshot(&c, &out).expect("parses").id,
            "S1"
        );
    }

    #[test]
    fn a_missing_binary_is_a_spawn_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = call(
            Verb::SnapshotRm,
            argv::snapshot_rm("x"),
            Duration::from_secs(5),
        );
        let e = run(&dir.path().join("absent"), &c).expect_err("cannot start");
        assert!(matches!(e.kind, ErrorKind::Spawn(_)), "{e}");
    }
}
