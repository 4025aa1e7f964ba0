//! The cocoon child processes a transfer streams through (export, import, image import, rm),
//! spawned with argv on the worker thread; stderr collected on a helper thread, bounded.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread::JoinHandle;

use super::TransferError;
use crate::vm::{argv, classify, ErrorKind, Verb};

const STDERR_LIMIT: u64 = 64 << 10;
const PIPE_SIZE: usize = 8 << 20;

/// A running cocoon child with its stderr being drained in the background.
pub struct CocoonChild {
    pub what: String,
    child: Child,
    stderr: Option<JoinHandle<String>>,
}

impl CocoonChild {
    /// Spawns `bin args...` (`args` from the vm room's argv builders); `stdin_piped` /
    /// `stdout_piped` choose the streaming side.
    pub fn spawn(
        bin: &Path,
        args: &[String],
        stdin_piped: bool,
        stdout_piped: bool,
    ) -> Result<Self, TransferError> {
        let what = format!("{} {}", bin.display(), args.join(" "));
        argv::check(args).map_err(|e| TransferError::Invalid(format!("not run: {what}: {e}")))?;
        let mut child = Command::new(bin)
            .args(args)
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
        Ok(CocoonChild {
            what,
            child,
            stderr,
        })
    }

    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// Waits for exit; non-zero exit becomes an error carrying the trimmed stderr.
    pub fn wait(mut self) -> Result<(), TransferError> {
        drop(self.child.stdin.take());
        let status = self
            .child
            .wait()
            .map_err(|e| TransferError::Cocoon(format!("wait {}: {e}", self.what)))?;
        let stderr = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        if status.success() {
            return Ok(());
        }
        Err(TransferError::Cocoon(format!(
            "{}: {status} (stderr: {})",
            self.what,
            stderr.trim()
        )))
    }

    /// SIGKILLs and reaps the child (error paths); returns its stderr for the message.
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
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
            .trim()
            .to_string()
    }
}

/// Runs a short cocoon command to completion, returning combined output on failure.
pub fn run(bin: &Path, args: &[String]) -> Result<(), String> {
    argv::check(args).map_err(|e| format!("vk-cocoon refused to run cocoon: {e}"))?;
    let out = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
    .trim()
    .to_string())
}

/// `cocoon snapshot rm NAME`, treating "not found" as success.
pub fn remove_snapshot(bin: &Path, name: &str) -> Result<(), TransferError> {
    match run(bin, &argv::snapshot_rm(name)) {
        Ok(()) => Ok(()),
        Err(out) => {
            if classify(Verb::SnapshotRm, &out) == ErrorKind::SnapshotNotFound {
                Ok(())
            } else {
                Err(TransferError::Cocoon(format!(
                    "cocoon snapshot rm {name}: {out}"
                )))
            }
        }
    }
}
