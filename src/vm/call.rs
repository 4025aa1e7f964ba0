//! One cocoon invocation as data: verb, argv, deadline, capture limits, mode; and its parsed result.
//! Describes and parses calls; the reactor runs them. Never panics on child output.

use super::error::{failure, CocoonError, ErrorKind};
use super::types::{Image, Snapshot, StaleCreateOutcome, StaleCreateReport, Vm};
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Every cocoon command vk-cocoon runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    VmClone,
    VmRun,
    VmInspect,
    VmList,
    VmRm,
    VmStart,
    VmExec,
    VmLogs,
    VmNet,
    VmReconcileStaleCreate,
    VmStatusEvents,
    SnapshotSave,
    SnapshotInspect,
    SnapshotRm,
    SnapshotImport,
    SnapshotExport,
    SnapshotList,
    ImagePull,
    ImageInspect,
    ImageImport,
}

impl Verb {
    pub const ALL: [Verb; 20] = [
        Verb::VmClone,
        Verb::VmRun,
        Verb::VmInspect,
        Verb::VmList,
        Verb::VmRm,
        Verb::VmStart,
        Verb::VmExec,
        Verb::VmLogs,
        Verb::VmNet,
        Verb::VmReconcileStaleCreate,
        Verb::VmStatusEvents,
        Verb::SnapshotSave,
        Verb::SnapshotInspect,
        Verb::SnapshotRm,
        Verb::SnapshotImport,
        Verb::SnapshotExport,
        Verb::SnapshotList,
        Verb::ImagePull,
        Verb::ImageInspect,
        Verb::ImageImport,
    ];

    /// The command words, e.g. `vm clone`, `snapshot save` (also the metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::VmClone => "vm clone",
            Verb::VmRun => "vm run",
            Verb::VmInspect => "vm inspect",
            Verb::VmList => "vm list",
            Verb::VmRm => "vm rm",
            Verb::VmStart => "vm start",
            Verb::VmExec => "vm exec",
            Verb::VmLogs => "vm logs",
            Verb::VmNet => "vm net",
            Verb::VmReconcileStaleCreate => "vm reconcile-stale-create",
            Verb::VmStatusEvents => "vm status",
            Verb::SnapshotSave => "snapshot save",
            Verb::SnapshotInspect => "snapshot inspect",
            Verb::SnapshotRm => "snapshot rm",
            Verb::SnapshotImport => "snapshot import",
            Verb::SnapshotExport => "snapshot export",
            Verb::SnapshotList => "snapshot list",
            Verb::ImagePull => "image pull",
            Verb::ImageInspect => "image inspect",
            Verb::ImageImport => "image import",
        }
    }

    /// The verb of an argv built by [`super::argv`] (the two leading words).
    pub fn of_argv(argv: &[String]) -> Option<Verb> {
        let words = format!(
            "{} {}",
            argv.first().map(String::as_str).unwrap_or(""),
            argv.get(1).map(String::as_str).unwrap_or("")
        );
        Verb::ALL.into_iter().find(|v| v.as_str() == words)
    }

    pub fn is_snapshot(self) -> bool {
        self.as_str().starts_with("snapshot ")
    }

    /// How vk-cocoon captures this verb's output.
    pub fn mode(self) -> CallMode {
        match self {
            Verb::VmClone
            | Verb::VmRun
            | Verb::VmInspect
            | Verb::VmList
            | Verb::VmReconcileStaleCreate
            | Verb::SnapshotInspect
            | Verb::SnapshotList
            | Verb::ImageInspect => CallMode::Json,
            Verb::VmRm
            | Verb::VmStart
            | Verb::VmNet
            | Verb::SnapshotSave
            | Verb::SnapshotRm
            | Verb::ImagePull => CallMode::Combined,
            Verb::VmStatusEvents
            | Verb::SnapshotExport
            | Verb::SnapshotImport
            | Verb::ImageImport
            | Verb::VmExec
            | Verb::VmLogs => CallMode::Streaming,
        }
    }

    /// Whether the call takes a data stream on stdin (imports; exec decides per call).
    pub fn wants_stdin(self) -> bool {
        matches!(self, Verb::SnapshotImport | Verb::ImageImport)
    }
}

/// Capture mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallMode {
    /// stdout and stderr captured separately; stdout parsed as JSON on success.
    Json,
    /// stdout+stderr merged into the error text; output ignored on success.
    Combined,
    /// stdout (or stdin) is a stream handed through chunk by chunk; stderr captured for errors.
    Streaming,
}

/// Per-verb deadlines. cocoon itself has none; these stop a hung child from wedging the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// inspect, snapshot/image inspect, snapshot list, reconcile-stale-create.
    pub query: Duration,
    /// vm list, rm (Windows guests can take ~30 s to stop), start, net, snapshot rm, logs.
    pub control: Duration,
    /// clone and run.
    pub create: Duration,
    /// snapshot save / import / export, image pull / import (big data).
    pub transfer: Duration,
    /// vm exec: `None` = the caller (kubectl exec) decides when to stop.
    pub exec: Option<Duration>,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            query: Duration::from_secs(30),
            control: Duration::from_secs(120),
            create: Duration::from_secs(600),
            transfer: Duration::from_secs(3600),
            exec: None,
        }
    }
}

/// The deadlines `VK_COCOON_DEADLINES` set, fixed once at the daemon's start.
static CONFIGURED: std::sync::OnceLock<Deadlines> = std::sync::OnceLock::new();

impl Deadlines {
    /// Makes `d` the deadlines of every later cocoon call of this process (the daemon's
    /// configuration; the first call wins).
    pub fn configure(d: Deadlines) {
        let _ = CONFIGURED.set(d);
    }

    /// The configured deadlines, or the defaults when none were configured.
    pub fn configured() -> Deadlines {
        CONFIGURED.get().copied().unwrap_or_default()
    }

    /// Parses `class=seconds[,class=seconds...]` over the defaults (`VK_COCOON_DEADLINES`):
    /// classes `query`, `control`, `create`, `transfer`; seconds a whole number from 1.
    pub fn parse(text: &str) -> Result<Deadlines, DeadlinesError> {
        let mut d = Deadlines::default();
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (class, secs) = item
                .split_once('=')
                .ok_or_else(|| DeadlinesError::NotClassSeconds(item.to_string()))?;
            let secs: u64 = secs
                .trim()
                .parse()
                .ok()
                .filter(|s| (1..=7 * 86_400).contains(s))
                .ok_or_else(|| DeadlinesError::BadSeconds(item.to_string()))?;
            let slot = match class.trim() {
                "query" => &mut d.query,
                "control" => &mut d.control,
                "create" => &mut d.create,
                "transfer" => &mut d.transfer,
                other => return Err(DeadlinesError::UnknownClass(other.to_string())),
            };
            *slot = Duration::from_secs(secs);
        }
        Ok(d)
    }

    /// The deadline for a verb; `None` for the event stream (it runs until killed).
    pub fn for_verb(&self, verb: Verb) -> Option<Duration> {
        match verb {
            Verb::VmInspect
            | Verb::SnapshotInspect
            | Verb::SnapshotList
            | Verb::ImageInspect
            | Verb::VmReconcileStaleCreate => Some(self.query),
            // `vm list` of a dense host can take a while; it is still bounded.
            Verb::VmList
            | Verb::VmRm
            | Verb::VmStart
            | Verb::VmNet
            | Verb::SnapshotRm
            | Verb::VmLogs => Some(self.control),
            Verb::VmClone | Verb::VmRun => Some(self.create),
            Verb::SnapshotSave
            | Verb::SnapshotImport
            | Verb::SnapshotExport
            | Verb::ImagePull
            | Verb::ImageImport => Some(self.transfer),
            Verb::VmExec => self.exec,
            Verb::VmStatusEvents => None,
        }
    }
}

/// Why a `VK_COCOON_DEADLINES` value was refused; each names the offending item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadlinesError {
    /// An item that is not `class=seconds`.
    NotClassSeconds(String),
    /// Seconds that are not a whole number 1-604800.
    BadSeconds(String),
    /// A class other than query, control, create or transfer.
    UnknownClass(String),
}

impl std::fmt::Display for DeadlinesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeadlinesError::NotClassSeconds(item) => write!(f, "{item:?} is not class=seconds"),
            DeadlinesError::BadSeconds(item) => {
                write!(f, "{item:?}: seconds must be a whole number 1-604800")
            }
            DeadlinesError::UnknownClass(class) => write!(
                f,
                "unknown class {class:?} (query, control, create or transfer)"
            ),
        }
    }
}

impl std::error::Error for DeadlinesError {}

/// stdout capture limit for a list (hundreds of VMs at a few KiB each).
pub const LIST_CAPTURE_LIMIT: usize = 32 << 20;
/// stdout capture limit for one JSON record.
pub const RECORD_CAPTURE_LIMIT: usize = 1 << 20;
/// Capture limit for combined-mode output and for stderr.
pub const TEXT_CAPTURE_LIMIT: usize = 256 << 10;

/// A cocoon call to run: everything the reactor needs besides the binary path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CocoonCall {
    pub verb: Verb,
    /// Arguments after the binary.
    pub argv: Vec<String>,
    pub deadline: Option<Duration>,
    /// stdout bytes kept (Json/Combined); streaming calls do not capture stdout.
    pub stdout_limit: usize,
    pub stderr_limit: usize,
    pub mode: CallMode,
    /// The caller will stream data to stdin (imports, interactive exec).
    pub stdin_pipe: bool,
}

impl CocoonCall {
    /// A call with the verb's default mode, deadline and limits.
    pub fn new(verb: Verb, argv: Vec<String>, deadlines: &Deadlines) -> CocoonCall {
        let mode = verb.mode();
        let stdout_limit = match (verb, mode) {
            (Verb::VmList | Verb::SnapshotList, _) => LIST_CAPTURE_LIMIT,
            (_, CallMode::Json) => RECORD_CAPTURE_LIMIT,
            (_, CallMode::Combined) => TEXT_CAPTURE_LIMIT,
            (_, CallMode::Streaming) => 0,
        };
        let stdin_pipe = verb.wants_stdin()
            || (verb == Verb::VmExec && argv.iter().take_while(|a| *a != "--").any(|a| a == "-i"));
        CocoonCall {
            verb,
            argv,
            deadline: deadlines.for_verb(verb),
            stdout_limit,
            stderr_limit: TEXT_CAPTURE_LIMIT,
            mode,
            stdin_pipe,
        }
    }

    /// Replaces the deadline (e.g. a configured clone budget).
    pub fn with_deadline(mut self, deadline: Option<Duration>) -> CocoonCall {
        self.deadline = deadline;
        self
    }

    /// Replaces the capture limits (the caller's budget for stdout and stderr).
    pub fn with_limits(mut self, stdout_limit: usize, stderr_limit: usize) -> CocoonCall {
        self.stdout_limit = stdout_limit;
        self.stderr_limit = stderr_limit;
        self
    }

    /// `cocoon <args>` for logs and error texts.
    pub fn command_text(&self) -> String {
        let mut s = String::from("cocoon");
        for a in &self.argv {
            s.push(' ');
            s.push_str(a);
        }
        s
    }

    /// The full argv to exec: the binary, then the arguments.
    pub fn full_argv(&self, bin: &str) -> Vec<String> {
        let mut v = Vec::with_capacity(self.argv.len() + 1);
        v.push(bin.to_string());
        v.extend(self.argv.iter().cloned());
        v
    }

    /// Ok when the call exited 0 in time; the typed error otherwise.
    pub fn check(&self, out: &CallOutcome) -> Result<(), CocoonError> {
        match failure(self.verb, &self.command_text(), self.mode, out) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn error(&self, kind: ErrorKind) -> CocoonError {
        CocoonError::new(&self.command_text(), kind)
    }
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    Code(i32),
    Signal(i32),
}

/// What came back from a finished call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallOutcome {
    pub exit: ExitKind,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// Killed at its deadline.
    pub timed_out: bool,
}

impl CallOutcome {
    /// A clean exit 0 with this stdout (handy for tests and replays).
    pub fn ok(stdout: &[u8]) -> CallOutcome {
        CallOutcome {
            exit: ExitKind::Code(0),
            stdout: stdout.to_vec(),
            stderr: Vec::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            timed_out: false,
        }
    }

    /// A non-zero exit with this stderr.
    pub fn failed(code: i32, stderr: &[u8]) -> CallOutcome {
        CallOutcome {
            exit: ExitKind::Code(code),
            stdout: Vec::new(),
            stderr: stderr.to_vec(),
            stdout_truncated: false,
            stderr_truncated: false,
            timed_out: false,
        }
    }
}

/// Checks exit and size, then decodes stdout as `T`.
fn parse_json<T: DeserializeOwned>(call: &CocoonCall, out: &CallOutcome) -> Result<T, CocoonError> {
    call.check(out)?;
    if out.stdout_truncated {
        return Err(call.error(ErrorKind::HugeOutput));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| call.error(ErrorKind::InvalidJson(e.to_string())))
}

/// A single VM record (clone, run, inspect). Empty `id` is [`ErrorKind::EmptyRecord`].
pub fn parse_vm(call: &CocoonCall, out: &CallOutcome) -> Result<Vm, CocoonError> {
    let vm: Vm = parse_json(call, out)?;
    if vm.id.is_empty() {
        return Err(call.error(ErrorKind::EmptyRecord));
    }
    Ok(vm)
}

/// After `vm run`: the record needs one follow-up `vm inspect` (state not running or pid 0).
pub fn run_needs_inspect(vm: &Vm) -> bool {
    !vm.is_running() || vm.pid == 0
}

/// A list answer (`vm list`, `snapshot list`): the entries that decoded, and how many could not
/// be read (undecodable, or without an id) and were skipped. Those name what exists; only a
/// complete listing also proves what does not.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing<T> {
    pub items: Vec<T>,
    pub skipped: usize,
}

impl<T> Listing<T> {
    /// Every entry was read: an absent name is really absent.
    pub fn complete(&self) -> bool {
        self.skipped == 0
    }
}

impl<T> std::ops::Deref for Listing<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.items
    }
}

impl<T> IntoIterator for Listing<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

/// Decodes a JSON array leniently: entries that are not objects of `T`, or whose `id(entry)`
/// is empty, are skipped and counted.
fn parse_listing<T: DeserializeOwned>(
    call: &CocoonCall,
    out: &CallOutcome,
    empty_line: &str,
    id: fn(&T) -> &str,
) -> Result<Listing<T>, CocoonError> {
    call.check(out)?;
    if out.stdout_truncated {
        return Err(call.error(ErrorKind::HugeOutput));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let t = text.trim();
    // A Go nil slice prints `null`.
    if t.is_empty() || t == empty_line || t == "null" {
        return Ok(Listing {
            items: Vec::new(),
            skipped: 0,
        });
    }
    let values: Vec<serde_json::Value> =
        serde_json::from_str(t).map_err(|e| call.error(ErrorKind::InvalidJson(e.to_string())))?;
    let mut listing = Listing {
        items: Vec::with_capacity(values.len()),
        skipped: 0,
    };
    for v in values {
        match serde_json::from_value::<T>(v) {
            Ok(item) if !id(&item).is_empty() => listing.items.push(item),
            Ok(_) => {
                log::warn!("{}: skipping an entry without an id", call.command_text());
                listing.skipped += 1;
            }
            Err(e) => {
                log::warn!("{}: skipping undecodable entry: {e}", call.command_text());
                listing.skipped += 1;
            }
        }
    }
    Ok(listing)
}

/// `vm list -o json`: an array, empty output, or B's `No VMs found.`; entries without `id` skipped.
pub fn parse_vm_list(call: &CocoonCall, out: &CallOutcome) -> Result<Listing<Vm>, CocoonError> {
    parse_listing(call, out, "No VMs found.", |v: &Vm| &v.id)
}

/// `snapshot inspect`: one snapshot; an empty `id` is [`ErrorKind::EmptyRecord`].
pub fn parse_snapshot(call: &CocoonCall, out: &CallOutcome) -> Result<Snapshot, CocoonError> {
    let s: Snapshot = parse_json(call, out)?;
    if s.id.is_empty() {
        return Err(call.error(ErrorKind::EmptyRecord));
    }
    Ok(s)
}

/// `snapshot list -o json`: an array, empty output or `No snapshots found.`.
pub fn parse_snapshot_list(
    call: &CocoonCall,
    out: &CallOutcome,
) -> Result<Listing<Snapshot>, CocoonError> {
    parse_listing(call, out, "No snapshots found.", |s: &Snapshot| &s.id)
}

/// `image inspect` (metadata read): one image; an empty `id` is [`ErrorKind::EmptyRecord`].
pub fn parse_image(call: &CocoonCall, out: &CallOutcome) -> Result<Image, CocoonError> {
    let i: Image = parse_json(call, out)?;
    if i.id.is_empty() {
        return Err(call.error(ErrorKind::EmptyRecord));
    }
    Ok(i)
}

/// `vm reconcile-stale-create -o json`: the outcome; an empty outcome is an error.
/// Old cocoon without the verb yields [`ErrorKind::VerbUnsupported`].
pub fn parse_stale_create_outcome(
    call: &CocoonCall,
    out: &CallOutcome,
) -> Result<StaleCreateOutcome, CocoonError> {
    let r: StaleCreateReport = parse_json(call, out)?;
    if r.outcome.is_empty() {
        return Err(call.error(ErrorKind::InvalidJson("empty outcome".into())));
    }
    Ok(StaleCreateOutcome::parse(&r.outcome))
}

#[cfg(test)]
mod deadline_tests {
    use super::*;

    #[test]
    fn deadlines_parse_over_the_defaults_and_reject_what_they_cannot_read() {
        let d = Deadlines::parse("create=5, transfer=7").unwrap();
        assert_eq!(d.create, Duration::from_secs(5));
        assert_eq!(d.transfer, Duration::from_secs(7));
        assert_eq!(d.query, Deadlines::default().query);
        assert_eq!(Deadlines::parse("").unwrap(), Deadlines::default());
        for bad in ["create", "create=0", "create=x", "slow=3", "query=-1"] {
            assert!(Deadlines::parse(bad).is_err(), "{bad}");
        }
    }
}
