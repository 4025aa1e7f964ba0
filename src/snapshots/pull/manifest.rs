//! Pull, manifest side: resolve a tag (an index to its image), fetch the small blobs (config)
//! and classify an artifact without pulling it.

use std::collections::BTreeMap;
use std::io::{self, Read};

use oci_spec::image::{Descriptor, ImageManifest};

use crate::snapshots::client::RegistryClient;
use crate::snapshots::format::{self, ArtifactKind, ManifestInfo, SnapshotConfig};
use crate::snapshots::reference::Reference;
use crate::snapshots::TransferError;

use super::*;

/// A resolved single-image manifest.
pub(super) struct Resolved {
    pub(super) reference: Reference,
    pub(super) head: format::ManifestHead,
    pub(super) body: Vec<u8>,
    pub(super) kind: ArtifactKind,
    pub(super) was_index: bool,
}

/// GET the manifest; an image index is resolved to its linux/amd64 (or first usable) child.
pub(super) fn resolve_manifest(
    client: &RegistryClient,
    repo: &str,
    tag: &str,
) -> Result<Resolved, TransferError> {
    let reference = client.reference(repo, tag)?;
    let (body, _ctype) = client.get_manifest(&reference)?;
    let what = reference.to_string();
    let head = format::read_head(&body, &what)?;
    let kind = format::classify(&head);
    if kind != ArtifactKind::ImageIndex {
        return Ok(Resolved {
            reference,
            head,
            body,
            kind,
            was_index: false,
        });
    }
    let child = format::pick_index_child(&body, &what)?;
    let child_ref = reference.with_digest(&child);
    let (body, _) = client.get_manifest(&child_ref)?;
    let head = format::read_head(&body, &child_ref.to_string())?;
    let kind = format::classify(&head);
    Ok(Resolved {
        reference: child_ref,
        head,
        body,
        kind,
        was_index: true,
    })
}

/// Reads a whole (small) blob into memory, verified.
fn fetch_small_blob(
    client: &RegistryClient,
    repository: &str,
    desc: &Descriptor,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, TransferError> {
    if desc.size() > limit {
        return Err(TransferError::Format(format!(
            "{what}: blob {} is {} bytes, limit {limit}",
            desc.digest(),
            desc.size()
        )));
    }
    let mut buf = Vec::new();
    fetch_blob_into(client, repository, desc, &mut buf, what)?;
    Ok(buf)
}

/// Reads a whole verified blob into `buf` (cleared first; its allocation is reused).
pub(super) fn fetch_blob_into(
    client: &RegistryClient,
    repository: &str,
    desc: &Descriptor,
    buf: &mut Vec<u8>,
    what: &str,
) -> Result<(), TransferError> {
    let mut r = client.get_blob(repository, desc.digest().as_ref(), desc.size())?;
    buf.clear();
    buf.reserve(desc.size() as usize);
    r.read_to_end(buf).map_err(|e| blob_err(e, what))?;
    Ok(())
}

pub(super) fn blob_err(e: io::Error, what: &str) -> TransferError {
    if e.kind() == io::ErrorKind::InvalidData {
        TransferError::Integrity(format!("{what}: {e}"))
    } else {
        TransferError::Transient(format!("{what}: {e}"))
    }
}

pub(super) fn fetch_config(
    client: &RegistryClient,
    r: &Resolved,
    m: &ImageManifest,
) -> Result<SnapshotConfig, TransferError> {
    let what = format!("{} config", r.reference);
    let cd = m.config();
    if cd.media_type().to_string() != format::SNAPSHOT_CONFIG {
        return Err(TransferError::Format(format!(
            "{what}: config media type {} is not {}",
            cd.media_type(),
            format::SNAPSHOT_CONFIG
        )));
    }
    let bytes = fetch_small_blob(
        client,
        &r.reference.repository,
        cd,
        format::CONFIG_LIMIT,
        &what,
    )?;
    let cfg: SnapshotConfig = serde_json::from_slice(&bytes)
        .map_err(|e| TransferError::Format(format!("{what}: {e}")))?;
    // The id travels into cocoon's import envelope and the daemon's records.
    if !format::valid_snapshot_id(&cfg.snapshot_id) {
        return Err(TransferError::Format(format!(
            "{what}: snapshotId {:?} is not a plain identifier",
            cfg.snapshot_id
        )));
    }
    Ok(cfg)
}

/// Manifest facts for a tag: `Ok(None)` when the tag does not exist (404).
pub fn manifest_info(
    client: &RegistryClient,
    repo: &str,
    tag: &str,
) -> Result<Option<ManifestInfo>, TransferError> {
    let r = match resolve_manifest(client, repo, tag) {
        Ok(r) => r,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    };
    let annotations: BTreeMap<String, String> = r.head.string_annotations();
    let mut info = ManifestInfo {
        kind: r.kind,
        digest: crate::snapshots::client::sha256_digest(&r.body),
        annotations,
        snapshot_id: None,
        config: None,
        layers: Vec::new(),
    };
    if r.kind.is_snapshot() {
        let m = format::parse_manifest(&r.body, &r.reference.to_string())?;
        let cfg = fetch_config(client, &r, &m)?;
        info.layers = m
            .layers()
            .iter()
            .map(|d| format::LayerRef {
                title: title_of(d).unwrap_or_default(),
                digest: d.digest().to_string(),
                size: d.size(),
                media_type: d.media_type().to_string(),
            })
            .collect();
        info.snapshot_id = Some(cfg.snapshot_id.clone());
        info.config = Some(cfg);
    }
    Ok(Some(info))
}
