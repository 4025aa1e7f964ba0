//! The snapshots room's view of the vm room's blocking runner: the export / import children
//! of transfers and `snapshot rm`, their failures as [`TransferError`]s.
//! Spawning, deadlines and classification are the vm room's; nothing here spells cocoon.

use std::path::Path;
use std::process::{ChildStdin, ChildStdout};

use super::TransferError;
use crate::vm::blocking::{self, run_checked};
use crate::vm::{argv, CocoonCall, CocoonError, Deadlines, ErrorKind, Verb};

/// A failed cocoon call as a transfer failure (its text names the command and the stderr).
pub fn transfer_error(e: CocoonError) -> TransferError {
    TransferError::Cocoon(e.to_string())
}

/// A running export / import child of a transfer (the vm room's runner, under the verb's
/// configured deadline).
pub struct CocoonChild(blocking::CocoonChild);

impl CocoonChild {
    /// Spawns `bin args...` (`args` from the vm room's argv builders for `verb`); the verb
    /// decides which side streams (an import's stdin, an export's stdout).
    pub fn spawn(bin: &Path, verb: Verb, args: &[String]) -> Result<Self, TransferError> {
        let call = CocoonCall::new(verb, args.to_vec(), &Deadlines::configured());
        blocking::CocoonChild::spawn(bin, &call)
            .map(CocoonChild)
            .map_err(transfer_error)
    }

    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.0.take_stdin()
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.0.take_stdout()
    }

    /// Waits for exit; a non-zero exit (or the deadline) is an error carrying the stderr.
    pub fn wait(self) -> Result<(), TransferError> {
        self.0.wait().map_err(transfer_error)
    }

    /// SIGKILLs and reaps the child (error paths); returns its stderr for the message.
    pub fn kill(self) -> String {
        self.0.kill()
    }
}

/// `cocoon snapshot rm NAME`, treating "not found" as success.
pub fn remove_snapshot(bin: &Path, name: &str) -> Result<(), TransferError> {
    let call = CocoonCall::new(
        Verb::SnapshotRm,
        argv::snapshot_rm(name),
        &Deadlines::configured(),
    );
    match run_checked(bin, &call) {
        Ok(()) => Ok(()),
        Err(e) if e.kind == ErrorKind::SnapshotNotFound => Ok(()),
        Err(e) => Err(transfer_error(e)),
    }
}
