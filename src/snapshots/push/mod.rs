//! Snapshot push: stream `cocoon snapshot export NAME -o -`, turn tar
//! entries into blobs (v1 raw, v2 chunked / zstd), then config and manifest. Memory bounded.
//!
//! knobs: the SNAPSHOT_* settings; upload: files to blobs (raw, chunked, zstd); spool: the
//! private spool directory and its unlinked files.

use std::collections::BTreeMap;
use std::io::{self, BufReader, Read};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use super::client::{sha256_digest, Body, RegistryClient, MAX_PIPELINED_PUSHES};
use super::cocoon_child::CocoonChild;
use super::format::{self, SnapshotConfig};
use super::tarstream::TarReader;
use super::TransferError;

mod knobs;
mod spool;
mod upload;

pub use knobs::PushKnobs;
pub use spool::{prepare_spool_dir, SpoolDirError, SpoolDirProblem};

use upload::PushState;

const MIB: u64 = 1 << 20;
const READ_BUF: usize = 1 << 20;
/// Files at least this big are compressed when zstd is on.
const COMPRESS_MIN: u64 = MIB;
const MAX_CHUNKS: u64 = 1 << 20;
const PROGRESS_STEP: u64 = 1 << 30;
/// Raw files at least this big are streamed into the upload instead of spooled first.
const STREAM_MIN: u64 = 4 * MIB;

/// What to push.
#[derive(Debug, Clone)]
pub struct PushRequest {
    /// Local snapshot name = repository under OCI_REGISTRY (the VM name).
    pub name: String,
    /// Tag (`latest`, `hibernate`); empty = `latest`.
    pub tag: String,
    /// The cocoon binary (VK_COCOON_BIN).
    pub cocoon_bin: PathBuf,
    /// `cocoonstack.snapshot.baseimage` when known.
    pub base_image: Option<String>,
    /// `cocoonstack.snapshot.from-node` (this node's name).
    pub from_node: Option<String>,
    /// Caller annotations, merged after the generated ones.
    pub annotations: BTreeMap<String, String>,
    pub knobs: PushKnobs,
    /// Spool directory: the daemon's own (see [`prepare_spool_dir`]); None = the system temp
    /// dir (library users and tests).
    pub temp_dir: Option<PathBuf>,
}

/// Outcome of a push.
#[derive(Debug, Clone)]
pub struct PushReport {
    /// `sha256:` of the exact manifest bytes published.
    pub manifest_digest: String,
    /// The pushed snapshot's id (config `snapshotId`, from cocoon's export).
    pub snapshot_id: String,
    /// Sum of layer sizes plus the config size.
    pub total_size: u64,
    pub layers: usize,
    pub v2: bool,
    /// For `snapshot_push_duration_seconds`.
    pub duration: Duration,
}

/// Pushes local snapshot `req.name` to `<OCI_REGISTRY>/<name>:<tag>`. Blocking; run it on a
/// worker thread. The manifest is published only after every blob succeeded.
pub fn push_snapshot(
    client: &RegistryClient,
    req: &PushRequest,
) -> Result<PushReport, TransferError> {
    let started = Instant::now();
    if req.name.is_empty() {
        return Err(TransferError::Invalid(
            "push: snapshot name required".into(),
        ));
    }
    req.knobs.validate()?;
    let reference = client.reference(&req.name, &req.tag)?;
    // Node-wide gate: one zstd/chunked push at a time; plain v1 is not gated.
    let _gate = if req.knobs.pipelined() {
        let gate = client.pipelined_push_gate();
        if gate.in_use() >= MAX_PIPELINED_PUSHES {
            log::info!("push {reference}: waiting for the node-wide zstd/chunked push gate");
        }
        Some(gate.acquire())
    } else {
        None
    };
    let mut child = CocoonChild::spawn(
        &req.cocoon_bin,
        crate::vm::Verb::SnapshotExport,
        &crate::vm::argv::snapshot_export(&req.name),
    )?;
    let Some(stdout) = child.take_stdout() else {
        child.kill();
        return Err(TransferError::Cocoon("export: no stdout pipe".into()));
    };
    let mut tar = TarReader::new(BufReader::with_capacity(READ_BUF, stdout));
    let mut state = PushState {
        client,
        repository: reference.repository.clone(),
        req,
        layers: Vec::new(),
        files: BTreeMap::new(),
        v2: false,
        pushed: AtomicU64::new(0),
        next_progress: AtomicU64::new(PROGRESS_STEP),
    };
    let read_result = read_export(&mut tar, &mut state, &req.name);
    drop(tar);
    // A read error wins over the subprocess error.
    let envelope = match read_result {
        Ok(envelope) => envelope,
        Err(e) => {
            let stderr = child.kill();
            return Err(match e {
                TransferError::Format(m) if !stderr.is_empty() => {
                    TransferError::Format(format!("{m} (cocoon stderr: {stderr})"))
                }
                other => other,
            });
        }
    };
    child.wait()?;
    let mut config = envelope.ok_or_else(|| {
        TransferError::Format(format!(
            "export {}: no snapshot.json in the stream",
            req.name
        ))
    })?;
    config.schema_version = if state.v2 { "v2" } else { "v1" }.to_string();
    config.files = std::mem::take(&mut state.files);
    config.created_at = format::rfc3339_nanos(crate::wall_clock::now());
    let config_bytes =
        serde_json::to_vec(&config).map_err(|e| TransferError::Format(e.to_string()))?;
    let config_digest = sha256_digest(&config_bytes);
    client.put_blob(
        &reference.repository,
        &config_digest,
        Body::Bytes(&config_bytes),
    )?;
    let ann = manifest_annotations(req);
    let manifest = format::build_manifest(
        state.v2,
        &config_digest,
        config_bytes.len() as u64,
        &state.layers,
        &ann,
    )?;
    client.put_manifest(&reference, &manifest, format::MANIFEST_MEDIA_TYPE)?;
    let total = state.layers.iter().map(|l| l.size).sum::<u64>() + config_bytes.len() as u64;
    log::info!(
        "pushed {reference}: {} layers, {total} bytes, {:?}",
        state.layers.len(),
        started.elapsed()
    );
    Ok(PushReport {
        manifest_digest: sha256_digest(&manifest),
        snapshot_id: config.snapshot_id.clone(),
        total_size: total,
        layers: state.layers.len(),
        v2: state.v2,
        duration: started.elapsed(),
    })
}

/// Reads the export stream: pushes every regular file and returns the envelope
/// (`snapshot.json`), if the stream held one.
fn read_export<R: Read>(
    tar: &mut TarReader<R>,
    state: &mut PushState<'_>,
    name: &str,
) -> Result<Option<SnapshotConfig>, TransferError> {
    let mut envelope: Option<SnapshotConfig> = None;
    while let Some(entry) = tar.next_entry().map_err(|e| export_err(name, e))? {
        if entry.name == "snapshot.json" {
            let mut body = Vec::new();
            tar.body()
                .take(format::CONFIG_LIMIT + 1)
                .read_to_end(&mut body)
                .map_err(|e| export_err(name, e))?;
            if body.len() as u64 > format::CONFIG_LIMIT {
                return Err(TransferError::Format(format!(
                    "export {name}: snapshot.json larger than 64 MiB"
                )));
            }
            envelope = Some(format::config_from_envelope(&body)?);
            continue;
        }
        if !entry.is_regular() {
            continue;
        }
        state.push_file(&entry, tar)?;
    }
    Ok(envelope)
}

/// The manifest's annotations: created, base image, the caller's, then from-node.
fn manifest_annotations(req: &PushRequest) -> BTreeMap<String, String> {
    let mut ann = BTreeMap::new();
    ann.insert(
        format::CREATED.to_string(),
        format::rfc3339_seconds(crate::wall_clock::now()),
    );
    if let Some(b) = req.base_image.as_ref().filter(|b| !b.is_empty()) {
        ann.insert(format::BASEIMAGE.to_string(), b.clone());
    }
    for (k, v) in &req.annotations {
        ann.insert(k.clone(), v.clone());
    }
    if let Some(n) = req.from_node.as_ref().filter(|n| !n.is_empty()) {
        ann.insert(format::FROM_NODE.to_string(), n.clone());
    }
    ann
}

fn export_err(name: &str, e: io::Error) -> TransferError {
    TransferError::Format(format!("export {name}: reading tar stream: {e}"))
}
