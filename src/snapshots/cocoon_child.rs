//! The cocoon children worker threads run (transfers' export / import, short calls such as
//! image pull, snapshot rm and inspect): argv, own process group, the parent-death signal,
//! stderr drained on a helper thread, and the verb's deadline, after which the group is killed.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use super::TransferError;
use crate::vm::{argv, classify, Deadlines, ErrorKind, Verb};

const STDERR_LIMIT: u64 = 64 << 10;
/// stdout kept by [`run`] (one JSON record; the rest is drained).
const STDOUT_LIMIT: u64 = 1 << 20;
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

/// A running cocoon child with its stderr being drained in the background.
pub struct CocoonChild {
    pub what: String,
    child: Child,
    stderr: Option<JoinHandle<String>>,
    deadline: Option<Duration>,
    watchdog: Option<Watchdog>,
    timed_out: Arc<AtomicBool>,
}

impl CocoonChild {
    /// Spawns `bin args...` (`args` from the vm room's argv builders for `verb`, whose
    /// configured deadline applies); `stdin_piped` / `stdout_piped` choose the streaming side.
    pub fn spawn(
        bin: &Path,
        verb: Verb,
        args: &[String],
        stdin_piped: bool,
        stdout_piped: bool,
    ) -> Result<Self, TransferError> {
        let what = format!("{} {}", bin.display(), args.join(" "));
        argv::check(args).map_err(|e| TransferError::Invalid(format!("not run: {what}: {e}")))?;
        let mut full = vec![bin.to_string_lossy().into_owned()];
        full.extend(args.iter().cloned());
        // The daemon's children go through its exec trampoline, which sets the parent-death
        // signal: a daemon killed while this call hangs leaves no cocoon child behind.
        let trampoline = crate::reactor::exec_trampoline::wrap(&full, &[]);
        let argv = trampoline.as_deref().unwrap_or(&full);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        if trampoline.is_none() {
            crate::reactor::child::die_with_parent(&mut cmd);
        }
        let mut child = cmd
            // Own process group: a wrapper (sudo, a script) and its children die together.
            .process_group(0)
            .stdin(if stdin_piped {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(if stdout_piped {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| TransferError::Cocoon(format!("spawn {what}: {e}")))?;
        // Widen the streaming pipes to 8 MiB where the kernel permits; fewer
        // wake-ups per GiB. Failure (e.g. over /proc/sys/fs/pipe-max-size) is harmless.
        if let Some(s) = child.stdin.as_ref() {
            let _ = rustix::pipe::fcntl_setpipe_size(s, PIPE_SIZE);
        }
        if let Some(s) = child.stdout.as_ref() {
            let _ = rustix::pipe::fcntl_setpipe_size(s, PIPE_SIZE);
        }
        let stderr = child.stderr.take().map(|mut s| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = (&mut s).take(STDERR_LIMIT).read_to_string(&mut text);
                // Keep draining so the child never blocks on a full stderr pipe.
                let _ = std::io::copy(&mut s, &mut std::io::sink());
                text
            })
        });
        let deadline = Deadlines::configured().for_verb(verb);
        let timed_out = Arc::new(AtomicBool::new(false));
        let mut this = CocoonChild {
            what,
            child,
            stderr,
            deadline,
            watchdog: None,
            timed_out,
        };
        if let (Some(d), Ok(pgid)) = (deadline, i32::try_from(this.child.id())) {
            match Watchdog::start(pgid, d, this.timed_out.clone()) {
                Ok(w) => this.watchdog = Some(w),
                Err(e) => {
                    this.kill();
                    return Err(TransferError::Cocoon(format!(
                        "no deadline thread for cocoon {}: {e}",
                        args.join(" ")
                    )));
                }
            }
        }
        Ok(this)
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
        match (self.timed_out(), self.deadline) {
            (true, Some(d)) => format!("killed at its {} s deadline", d.as_secs()),
            _ => String::new(),
        }
    }

    /// Waits for the exit without reaping, stops the watchdog, then reaps: the watchdog's
    /// kill can never reach a recycled process group.
    fn reap(&mut self) -> std::io::Result<ExitStatus> {
        use rustix::process::{waitid, Pid, WaitId, WaitidOptions};
        let pid = Pid::from_child(&self.child);
        while let Err(rustix::io::Errno::INTR) = waitid(
            WaitId::Pid(pid),
            WaitidOptions::EXITED | WaitidOptions::NOWAIT,
        ) {}
        if let Some(w) = self.watchdog.take() {
            w.stop();
        }
        self.child.wait()
    }

    fn take_stderr(&mut self) -> String {
        self.stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// Waits for exit; non-zero exit (or the deadline) becomes an error carrying the stderr.
    pub fn wait(mut self) -> Result<(), TransferError> {
        drop(self.child.stdin.take());
        let status = self
            .reap()
            .map_err(|e| TransferError::Cocoon(format!("wait {}: {e}", self.what)))?;
        let stderr = self.take_stderr();
        if status.success() {
            return Ok(());
        }
        let note = self.deadline_note();
        let status = if note.is_empty() {
            status.to_string()
        } else {
            note
        };
        Err(TransferError::Cocoon(format!(
            "{}: {status} (stderr: {stderr})",
            self.what
        )))
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
        let stderr = self.take_stderr();
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

/// A short cocoon call run to its end on the calling thread.
#[derive(Debug, Clone, Default)]
pub struct Finished {
    pub success: bool,
    pub stdout: Vec<u8>,
    pub stderr: String,
    /// Killed at the verb's deadline.
    pub timed_out: bool,
}

impl Finished {
    /// The failure as one line: stderr, else stdout, with the deadline noted.
    pub fn error_text(&self) -> String {
        let text = if self.stderr.trim().is_empty() {
            String::from_utf8_lossy(&self.stdout).trim().to_string()
        } else {
            self.stderr.trim().to_string()
        };
        match (self.timed_out, text.is_empty()) {
            (true, true) => "killed at its deadline".into(),
            (true, false) => format!("killed at its deadline; {text}"),
            (false, _) => text,
        }
    }

    /// Whether cocoon said the object of `verb` is absent (never for a killed call).
    pub fn not_found(&self, verb: Verb) -> bool {
        !self.success && !self.timed_out && classify(verb, &self.stderr).is_not_found()
    }
}

/// Runs `bin args...` (a `verb` call, under its configured deadline) to completion on the
/// calling thread. Err only when it could not be started.
pub fn run(bin: &Path, verb: Verb, args: &[String]) -> Result<Finished, String> {
    let mut child = CocoonChild::spawn(bin, verb, args, false, true).map_err(|e| e.to_string())?;
    let mut stdout = Vec::new();
    if let Some(mut out) = child.take_stdout() {
        let _ = (&mut out).take(STDOUT_LIMIT).read_to_end(&mut stdout);
        let _ = std::io::copy(&mut out, &mut std::io::sink());
    }
    let status = child
        .reap()
        .map_err(|e| format!("wait {}: {e}", child.what))?;
    Ok(Finished {
        success: status.success() && !child.timed_out(),
        stdout,
        stderr: child.take_stderr(),
        timed_out: child.timed_out(),
    })
}

/// `cocoon snapshot rm NAME`, treating "not found" as success.
pub fn remove_snapshot(bin: &Path, name: &str) -> Result<(), TransferError> {
    let done =
        run(bin, Verb::SnapshotRm, &argv::snapshot_rm(name)).map_err(TransferError::Cocoon)?;
    if done.success
        || (!done.timed_out
            && classify(Verb::SnapshotRm, &done.error_text()) == ErrorKind::SnapshotNotFound)
    {
        return Ok(());
    }
    Err(TransferError::Cocoon(format!(
        "cocoon snapshot rm {name}: {}",
        done.error_text()
    )))
}
