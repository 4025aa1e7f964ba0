//! The OCI registry client: references, auth, snapshot and cloud-image push and pull.
//! Blocking transfers that run on the worker pool, never on the loop thread.
//!
//! Public entry points (all blocking; call them from worker threads):
//! - [`RegistryClient::new`] / [`RegistryClient::from_env`]: one client per daemon, shared by
//!   reference (`Arc<RegistryClient>`); sessions, tokens and schemes are cached inside.
//! - [`push::push_snapshot`]: `cocoon snapshot export NAME -o -` → blobs + config + manifest.
//! - [`pull::pull_snapshot`]: manifest → verified blobs → `cocoon snapshot import --name N`.
//! - [`pull::pull_cloud_image`]: os-image artifact → `cocoon image import NAME`.
//! - [`pull::manifest_info`]: classification, annotations and config `snapshotId` of a tag.
//! - [`RegistryClient::delete_manifest`]: DELETE a tag (404 counts as success).
//!
//! Metrics: the functions return reports carrying `duration`; the caller (daemon edge)
//! observes `snapshot_push_total` / `snapshot_pull_total` and the duration histograms, so this
//! module does not depend on the metrics room.

pub mod auth;
pub mod client;
pub mod cocoon_child;
pub mod format;
pub mod pull;
pub mod push;
pub mod reference;
pub mod tarstream;
pub mod trust;

use std::fmt;

pub use client::{RegistryClient, RetryPolicy};
pub use format::{ArtifactKind, ManifestInfo};
pub use pull::{
    manifest_info, pull_cloud_image, pull_snapshot, CloudImageRequest, PullReport, PullRequest,
};
pub use push::{push_snapshot, PushKnobs, PushReport, PushRequest};
pub use reference::{Reference, RegistryBase};

/// Every failure of a registry transfer; the message names the reference and digest involved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferError {
    /// The manifest (tag or digest) does not exist: 404 on GET.
    NotFound(String),
    /// The registry or token service refused our credentials.
    Unauthorized(String),
    /// Network failure or a transient status that survived the retries.
    Transient(String),
    /// Any other unexpected HTTP status from the registry.
    Registry(String),
    /// Bytes that do not match their digest or declared size.
    Integrity(String),
    /// A manifest, config, index or tar stream that is malformed or of the wrong kind.
    Format(String),
    /// The artifact exists but is the wrong kind for the request (snapshot vs cloud image).
    WrongArtifact(String),
    /// The cocoon child process failed (spawn, exit status, broken pipe).
    Cocoon(String),
    /// Invalid caller input: references, names, knobs.
    Invalid(String),
    /// Local I/O (temporary files) failed.
    Io(String),
}

impl TransferError {
    /// True for "manifest not found" (e.g. an absent `hibernate` tag is a legitimate state).
    pub fn is_not_found(&self) -> bool {
        matches!(self, TransferError::NotFound(_))
    }

    /// The message without the variant name.
    pub fn message(&self) -> &str {
        match self {
            TransferError::NotFound(m)
            | TransferError::Unauthorized(m)
            | TransferError::Transient(m)
            | TransferError::Registry(m)
            | TransferError::Integrity(m)
            | TransferError::Format(m)
            | TransferError::WrongArtifact(m)
            | TransferError::Cocoon(m)
            | TransferError::Invalid(m)
            | TransferError::Io(m) => m,
        }
    }
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for TransferError {}
