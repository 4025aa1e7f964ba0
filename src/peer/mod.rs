//! Peer snapshot transfer between the cluster's nodes: the listener that serves this node's
//! local snapshots, the client that restores a snapshot from the node that pushed it, and the
//! staging directory the client fills.
//!
//! The wire protocol is the Go peers' (plan document, byte slices with a CRC-32C trailer), but
//! over TLS with node client certificates and the tag's manifest digest named, which Go peers
//! do not speak: between them and this daemon, restores fall back to the registry. Blocking
//! I/O on its own threads; nothing here touches the loop.

pub mod client;
pub mod housekeeping;
pub mod job;
pub mod nodes;
pub mod pushed;
pub mod server;
pub mod staging;
pub mod store;
pub mod verify;
pub mod wire;

pub use client::{restore, restore_counted, PeerRestore, RestoreError, Staged};
pub use nodes::{ClusterNodes, NodeLookup};
pub use pushed::PushedSnapshots;
pub use server::{NotANodeCert, PeerServer, Resolver, Serving};
