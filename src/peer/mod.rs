//! Peer snapshot transfer between the cluster's nodes: the listener that serves this node's
//! local snapshots, the client that restores a snapshot from the node that pushed it, and the
//! staging directory the client fills.
//!
//! The wire protocol is the Go peers' (plan document, byte slices with a CRC-32C trailer), so
//! mixed clusters keep working. Blocking I/O on its own threads; nothing here touches the loop.

pub mod client;
pub mod housekeeping;
pub mod job;
pub mod server;
pub mod staging;
pub mod store;
pub mod verify;
pub mod wire;

pub use client::{restore, restore_counted, PeerRestore, Staged};
pub use server::{AllowedPeers, PeerServer, Resolver};
