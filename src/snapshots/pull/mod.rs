//! Snapshot and cloud-image pull: manifest, classification, verified blobs,
//! reassembled import tar streamed into cocoon. Any failure imports nothing.

mod fetch;
mod import_tar;
mod manifest;
mod plan;

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use oci_spec::image::Descriptor;

use super::client::{GatePermit, RegistryClient, MAX_V2_PULLS};
use super::cocoon_child::{remove_snapshot, CocoonChild};
use super::format::{self, ArtifactKind};
use super::tarstream::TarWriter;
use super::TransferError;

use fetch::{copy_pipelined, range_window};
use import_tar::{write_import_tar, CountingWriter};
pub use manifest::manifest_info;
use manifest::{fetch_config, resolve_manifest, Resolved};
use plan::{plan, title_of, window};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const COPY_BUF: usize = 1 << 20;
/// Buffers queued between the blob reader thread and the pipe writer.
const PIPELINE_DEPTH: usize = 4;
/// Bytes of fetched and decoded chunks in flight during a parallel pull, whatever the budget.
const PREFETCH_CAP: u64 = 32 * MIB;
/// The import tar goes out through a 256 KiB buffer.
const TAR_BUF: usize = 256 << 10;

/// What to pull.
#[derive(Debug, Clone)]
pub struct PullRequest {
    /// Repository name under OCI_REGISTRY (VM name or image repo).
    pub repo: String,
    /// Tag or `sha256:` digest; empty = `latest`.
    pub tag: String,
    /// Local snapshot name passed to `cocoon snapshot import --name`.
    pub local_name: String,
    pub cocoon_bin: PathBuf,
    /// `SNAPSHOT_TRANSFER_CONCURRENCY` (default 8).
    pub concurrency: usize,
    /// `SNAPSHOT_PULL_BUDGET_MIB` in bytes (VK-N default 2048 MiB).
    pub budget: u64,
}

impl PullRequest {
    /// A request with the VK-N defaults (concurrency 8, budget 2048 MiB) or the env values.
    pub fn new(repo: &str, tag: &str, local_name: &str, cocoon_bin: PathBuf) -> Self {
        let env = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|v| *v > 0)
        };
        PullRequest {
            repo: repo.to_string(),
            tag: tag.to_string(),
            local_name: local_name.to_string(),
            cocoon_bin,
            concurrency: env("SNAPSHOT_TRANSFER_CONCURRENCY")
                .map(|v| v as usize)
                .unwrap_or(8),
            budget: env("SNAPSHOT_PULL_BUDGET_MIB")
                .map(|v| v * MIB)
                .unwrap_or(2048 * MIB),
        }
    }
}

/// Outcome of a pull.
#[derive(Debug, Clone)]
pub struct PullReport {
    pub manifest_digest: String,
    pub kind: ArtifactKind,
    pub snapshot_id: String,
    /// Bytes written into cocoon's stdin.
    pub bytes: u64,
    /// For `snapshot_pull_duration_seconds`.
    pub duration: Duration,
}

/// A cloud-image pull: `<OCI_REGISTRY>/<repo>:<tag>` into `cocoon image import <local_name>`.
#[derive(Debug, Clone)]
pub struct CloudImageRequest {
    pub repo: String,
    pub tag: String,
    pub local_name: String,
    pub cocoon_bin: PathBuf,
}

/// Pulls `<OCI_REGISTRY>/<repo>:<tag>` and imports it as `local_name`. Blocking; run it on a
/// worker thread. On any failure the import child is killed and the local name removed.
pub fn pull_snapshot(
    client: &RegistryClient,
    req: &PullRequest,
) -> Result<PullReport, TransferError> {
    let started = Instant::now();
    let r = resolve_manifest(client, &req.repo, &req.tag)?;
    let what = r.reference.to_string();
    if !r.kind.is_snapshot() {
        let msg = format!("{what}: manifest is {}, not a snapshot", r.kind.name());
        return Err(if r.kind == ArtifactKind::CloudImage {
            TransferError::WrongArtifact(msg)
        } else {
            TransferError::Format(msg)
        });
    }
    if r.was_index {
        log::info!("{what}: resolved from an image index");
    }
    let m = format::parse_manifest(&r.body, &what)?;
    let cfg = fetch_config(client, &r, &m)?;
    let entries = plan(&m, &cfg, r.kind == ArtifactKind::SnapshotV2, &what)?;
    let (win, out_cap) = window(&entries, req.concurrency, req.budget);
    if req.local_name.is_empty() {
        return Err(TransferError::Invalid("pull: local name required".into()));
    }
    // Node-wide gate: v2 snapshots and image indexes, taken before the
    // import child starts and held until it has exited.
    let _gate = gate_pull(client, &r, &what);
    remove_snapshot(&req.cocoon_bin, &req.local_name)?;
    let mut child = CocoonChild::spawn(
        &req.cocoon_bin,
        crate::vm::Verb::SnapshotImport,
        &crate::vm::argv::snapshot_import(&req.local_name, None),
    )?;
    let Some(stdin) = child.take_stdin() else {
        child.kill();
        return Err(TransferError::Cocoon("import: no stdin pipe".into()));
    };
    let mtime = crate::wall_clock::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut tar = TarWriter::new(CountingWriter {
        inner: BufWriter::with_capacity(TAR_BUF, stdin),
        count: 0,
    });
    let stream = write_import_tar(
        client,
        &r.reference.repository,
        &what,
        &cfg,
        &entries,
        &req.local_name,
        mtime,
        &mut tar,
        win,
        out_cap,
        range_window(req.concurrency),
    );
    if let Err(e) = stream {
        // Kill before the pipe closes so cocoon never sees an end-of-file it could commit.
        let stderr = child.kill();
        drop(tar);
        cleanup(&req.cocoon_bin, &req.local_name);
        return Err(match e {
            TransferError::Cocoon(m) if !stderr.is_empty() => {
                TransferError::Cocoon(format!("{m} (stderr: {stderr})"))
            }
            other => other,
        });
    }
    let bytes = match tar.finish() {
        Ok(w) => w.count,
        Err(e) => {
            let stderr = child.kill();
            cleanup(&req.cocoon_bin, &req.local_name);
            return Err(TransferError::Cocoon(format!(
                "import {}: writing stdin: {e} (stderr: {stderr})",
                req.local_name
            )));
        }
    };
    // finish() flushed and dropped the writer, closing stdin so cocoon sees the archive end.
    if let Err(e) = child.wait() {
        cleanup(&req.cocoon_bin, &req.local_name);
        return Err(e);
    }
    log::info!(
        "pulled {what} into {} ({bytes} bytes, {:?})",
        req.local_name,
        started.elapsed()
    );
    Ok(PullReport {
        manifest_digest: super::client::sha256_digest(&r.body),
        kind: r.kind,
        snapshot_id: cfg.snapshot_id,
        bytes,
        duration: started.elapsed(),
    })
}

/// Takes the node-wide v2/index pull gate when the artifact needs it (blocks while two such
/// pulls run); `None` for plain v1 snapshots and single-manifest cloud images.
fn gate_pull(client: &RegistryClient, r: &Resolved, what: &str) -> Option<GatePermit> {
    if r.kind != ArtifactKind::SnapshotV2 && !r.was_index {
        return None;
    }
    let gate = client.v2_pull_gate();
    if gate.in_use() >= MAX_V2_PULLS {
        log::info!("{what}: waiting for the node-wide v2 pull gate ({MAX_V2_PULLS} running)");
    }
    Some(gate.acquire())
}

fn cleanup(bin: &std::path::Path, name: &str) {
    if let Err(e) = remove_snapshot(bin, name) {
        log::warn!("removing partially imported snapshot {name}: {e}");
    }
}

/// Pulls an os-image artifact and streams its disk layers (sorted by title, concatenated
/// verbatim) into `cocoon image import <local_name>`. A snapshot artifact is refused with
/// "is a snapshot artifact; use mode=clone instead of mode=run".
pub fn pull_cloud_image(
    client: &RegistryClient,
    req: &CloudImageRequest,
) -> Result<PullReport, TransferError> {
    let started = Instant::now();
    let r = resolve_manifest(client, &req.repo, &req.tag)?;
    let what = r.reference.to_string();
    if r.kind.is_snapshot() {
        return Err(TransferError::WrongArtifact(format!(
            "{what} is a snapshot artifact; use mode=clone instead of mode=run"
        )));
    }
    if r.kind != ArtifactKind::CloudImage {
        return Err(TransferError::WrongArtifact(format!(
            "{what}: manifest is {}, not a cloud image",
            r.kind.name()
        )));
    }
    let m = format::parse_manifest(&r.body, &what)?;
    let mut disks: Vec<(String, Descriptor)> = m
        .layers()
        .iter()
        .filter(|d| format::DISK_LAYER_TYPES.contains(&d.media_type().to_string().as_str()))
        .map(|d| (title_of(d).unwrap_or_default(), d.clone()))
        .collect();
    if disks.is_empty() {
        return Err(TransferError::Format(format!(
            "{what}: cloud image has no disk layer"
        )));
    }
    disks.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let _gate = gate_pull(client, &r, &what);
    let mut child = CocoonChild::spawn(
        &req.cocoon_bin,
        crate::vm::Verb::ImageImport,
        &crate::vm::argv::image_import(&req.local_name),
    )?;
    let Some(stdin) = child.take_stdin() else {
        child.kill();
        return Err(TransferError::Cocoon("image import: no stdin pipe".into()));
    };
    let mut out = CountingWriter {
        inner: BufWriter::with_capacity(TAR_BUF, stdin),
        count: 0,
    };
    let result = (|| -> Result<(), TransferError> {
        for (title, d) in &disks {
            let bwhat = format!("{what}: {title} blob {}", d.digest());
            let rd = client.get_blob(&r.reference.repository, d.digest().as_ref(), d.size())?;
            copy_pipelined(rd, &bwhat, |data| {
                out.write_all(data).map_err(|e| {
                    TransferError::Cocoon(format!(
                        "image import {}: writing stdin: {e}",
                        req.local_name
                    ))
                })
            })?;
        }
        out.flush().map_err(|e| {
            TransferError::Cocoon(format!(
                "image import {}: writing stdin: {e}",
                req.local_name
            ))
        })
    })();
    let bytes = out.count;
    if let Err(e) = result {
        // Kill before the pipe closes: a truncated image must never be imported.
        child.kill();
        drop(out);
        return Err(e);
    }
    drop(out);
    child.wait()?;
    Ok(PullReport {
        manifest_digest: super::client::sha256_digest(&r.body),
        kind: r.kind,
        snapshot_id: String::new(),
        bytes,
        duration: started.elapsed(),
    })
}
