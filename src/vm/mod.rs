//! The cocoon CLI contract, the one place that spells it: argv builders, JSON types, error
//! classification, deadlines, quantities, the event stream, and the one blocking runner.
//!
//! Flow of one call: build argv with [`argv`] (e.g. `argv::vm_clone(&CloneOptions)`), wrap it in
//! [`CocoonCall::new`] (verb → mode, deadline, capture limits), spawn with
//! [`CocoonCall::spawn`]/[`CocoonCall::child_spec`], turn the reactor's `ChildExit` into a
//! [`CallOutcome::from_exit`], then parse with [`parse_vm`], [`parse_vm_list`], [`parse_snapshot`],
//! [`parse_image`], [`parse_stale_create_outcome`] or [`CocoonCall::check`] (combined-mode verbs).
//! Failures are a [`CocoonError`] whose [`ErrorKind`] says not-found / transient / other.
//! The core asks for a [`CocoonCmd`] and gets back one [`Answer`] ([`Answer::of`] classifies
//! the finished call once), which it reads as typed records ([`Answer::vm`], [`VmInfo`]).
//! The event stream is [`EventStream`] (child + [`EventStreamSupervisor`] + [`LineSplitter`]).
//! The loop runs calls as reactor children; worker threads run them with [`blocking::run`] /
//! [`blocking::CocoonChild`], which kill and reap a call at its deadline.

pub mod answer;
pub mod argv;
pub mod blocking;
pub mod call;
pub mod command;
pub mod error;
pub mod events;
pub mod pid_file;
pub mod resources;
pub mod runner;
pub mod types;

pub use answer::{
    read_snapshot, read_snapshot_list, read_stale_outcome, read_vm, read_vm_list, Answer, NicInfo,
    ReadError, VmInfo,
};
pub use argv::{Backend, CloneOptions, CloneSource, ExecOptions, RestoreMode, RunOptions};
pub use call::{
    parse_image, parse_snapshot, parse_snapshot_list, parse_stale_create_outcome, parse_vm,
    parse_vm_list, run_needs_inspect, CallMode, CallOutcome, CocoonCall, Deadlines, DeadlinesError,
    ExitKind, Listing, Verb,
};
pub use command::CocoonCmd;
pub use error::{classify, CocoonError, ErrorKind};
pub use events::{
    parse_event_line, EventLineError, EventStreamSupervisor, LineSplitter, StreamAction,
};
pub use pid_file::{process_alive, read_pid_file, PidFile};
pub use resources::{
    cpu_policy, cpu_weight, memory_arg, parse_milli, parse_quantity, vcpu_count, CpuPolicy,
};
pub use runner::{EventStream, StreamOutput};
pub use types::{
    EventKind, Image, NetworkConfig, NicAddress, Snapshot, SnapshotEnvelope, StaleCreateOutcome,
    StorageConfig, Vm, VmConfig, VmEvent, VmState,
};
