//! The cocoon CLI contract: argv builders, JSON types, error classification, the event-stream parser.
//! Builds and parses; running the child is the reactor's job.

pub mod argv;
pub mod call;
pub mod error;
pub mod events;
pub mod resources;
pub mod runner;
pub mod types;

pub use argv::{Backend, CloneOptions, CloneSource, ExecOptions, RestoreMode, RunOptions};
pub use call::{
    parse_image, parse_snapshot, parse_snapshot_list, parse_stale_create_outcome, parse_vm,
    parse_vm_list, run_needs_inspect, CallMode, CallOutcome, CocoonCall, Deadlines, ExitKind, Verb,
};
pub use error::{classify, CocoonError, ErrorKind};
pub use events::{
    parse_event_line, EventLineError, EventStreamSupervisor, LineSplitter, StreamAction,
};
pub use resources::{
    cpu_policy, cpu_weight, memory_arg, parse_milli, parse_quantity, vcpu_count, CpuPolicy,
};
pub use runner::{EventStream, StreamOutput};
pub use types::{
    EventKind, Image, NetworkConfig, NicAddress, Snapshot, SnapshotEnvelope, StaleCreateOutcome,
    StorageConfig, Vm, VmConfig, VmEvent, VmState,
};
