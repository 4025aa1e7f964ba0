//! Snapshot and cloud-image pull: manifest, classification, verified blobs,
//! reassembled import tar streamed into cocoon. Any failure imports nothing.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufWriter, Read, Write};
use std::path::PathBuf;
use std::sync::{mpsc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use oci_spec::image::{Descriptor, ImageManifest};

use super::client::{
    BlobCheck, BlobReader, GatePermit, RangeAnswer, RegistryClient, MAX_DOWNLOADS, MAX_V2_PULLS,
};
use super::cocoon_child::{remove_snapshot, CocoonChild};
use super::format::{self, ArtifactKind, ManifestInfo, SnapshotConfig};
use super::reference::Reference;
use super::tarstream::TarWriter;
use super::TransferError;

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

/// A resolved single-image manifest.
struct Resolved {
    reference: Reference,
    head: format::ManifestHead,
    body: Vec<u8>,
    kind: ArtifactKind,
    was_index: bool,
}

/// GET the manifest; an image index is resolved to its linux/amd64 (or first usable) child.
fn resolve_manifest(
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
fn fetch_blob_into(
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

fn blob_err(e: io::Error, what: &str) -> TransferError {
    if e.kind() == io::ErrorKind::InvalidData {
        TransferError::Integrity(format!("{what}: {e}"))
    } else {
        TransferError::Transient(format!("{what}: {e}"))
    }
}

fn fetch_config(
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
        digest: super::client::sha256_digest(&r.body),
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

/// One import-tar entry planned from the layers.
enum PlanEntry {
    Raw {
        title: String,
        desc: Box<Descriptor>,
    },
    Encoded {
        title: String,
        chunks: Vec<Descriptor>,
        compressed: bool,
        size: u64,
    },
}

fn title_of(d: &Descriptor) -> Option<String> {
    d.annotations()
        .as_ref()
        .and_then(|a| a.get(format::TITLE))
        .filter(|t| !t.is_empty())
        .cloned()
}

/// Validation and planning.
fn plan(
    m: &ImageManifest,
    cfg: &SnapshotConfig,
    v2: bool,
    what: &str,
) -> Result<Vec<PlanEntry>, TransferError> {
    if (cfg.schema_version == "v2") != v2 {
        return Err(TransferError::Format(format!(
            "{what}: config schemaVersion {:?} disagrees with the artifactType",
            cfg.schema_version
        )));
    }
    for d in m.layers() {
        let mt = d.media_type().to_string();
        let base = mt.strip_suffix("+zstd").unwrap_or(&mt);
        if !format::SNAPSHOT_LAYER_TYPES.contains(&base) {
            return Err(TransferError::Format(format!(
                "{what}: layer {} has media type {mt}: snapshot needs a newer reader",
                d.digest()
            )));
        }
        if mt.ends_with("+zstd") && !v2 {
            return Err(TransferError::Format(format!(
                "{what}: layer {} is zstd-encoded in a v1 snapshot",
                d.digest()
            )));
        }
        let title = title_of(d).ok_or_else(|| {
            TransferError::Format(format!("{what}: layer {} has no title", d.digest()))
        })?;
        if !format::safe_layer_title(&title) {
            return Err(TransferError::Format(format!(
                "{what}: layer {} has an unsafe title {title:?}",
                d.digest()
            )));
        }
    }
    if !v2 && cfg.files.values().any(|f| !f.chunks.is_empty()) {
        return Err(TransferError::Format(format!(
            "{what}: files[].chunks in a v1 snapshot"
        )));
    }
    let by_digest: HashMap<String, &Descriptor> = m
        .layers()
        .iter()
        .map(|d| (d.digest().to_string(), d))
        .collect();
    let mut out = Vec::new();
    let mut seen_encoded: Vec<String> = Vec::new();
    for d in m.layers() {
        let title = title_of(d).unwrap_or_default();
        let file = cfg.files.get(&title).cloned().unwrap_or_default();
        let zstd = d.media_type().to_string().ends_with("+zstd");
        if file.chunks.is_empty() && !zstd {
            out.push(PlanEntry::Raw {
                title,
                desc: Box::new(d.clone()),
            });
            continue;
        }
        if seen_encoded.contains(&title) {
            continue;
        }
        seen_encoded.push(title.clone());
        if file.size <= 0 {
            return Err(TransferError::Format(format!(
                "{what}: encoded layer missing files[].size for {title}"
            )));
        }
        let chunks = if file.chunks.is_empty() {
            vec![d.clone()]
        } else {
            file.chunks
                .iter()
                .map(|c| {
                    by_digest.get(c).map(|d| (*d).clone()).ok_or_else(|| {
                        TransferError::Format(format!(
                            "{what}: chunk {c} of {title} missing from manifest layers"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        out.push(PlanEntry::Encoded {
            title,
            chunks,
            compressed: zstd,
            size: file.size as u64,
        });
    }
    Ok(out)
}

fn stride(size: u64, n: u64) -> u64 {
    if n <= 1 {
        size
    } else {
        (size - 1) / (n - 1) + 1
    }
}

/// Prefetch window and per-chunk output cap; window < 2 means sequential.
fn window(entries: &[PlanEntry], concurrency: usize, budget: u64) -> (usize, u64) {
    let (mut out_cap, mut in_cap) = (0u64, 0u64);
    for e in entries {
        if let PlanEntry::Encoded {
            chunks,
            compressed,
            size,
            ..
        } = e
        {
            let largest = chunks.iter().map(|c| c.size()).max().unwrap_or(0);
            let o = if *compressed {
                stride(*size, chunks.len() as u64)
            } else {
                largest
            };
            let i = if *compressed { largest } else { 0 };
            out_cap = out_cap.max(o);
            in_cap = in_cap.max(i);
        }
    }
    if out_cap == 0 || out_cap > GIB || in_cap > GIB || budget <= out_cap {
        return (0, out_cap);
    }
    let w = ((budget - out_cap) / (in_cap + out_cap)).min(concurrency as u64);
    // However large the budget, chunks in flight stay within PREFETCH_CAP (peak RSS must not
    // grow with the snapshot or the chunk count); two are enough to keep the pipe busy.
    let by_cap = (PREFETCH_CAP / (in_cap + out_cap)).max(2);
    (w.min(by_cap) as usize, out_cap)
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

struct CountingWriter<W: Write> {
    inner: W,
    count: u64,
}

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

const LONGER_RAW: &str = "longer than its descriptor";
const LONGER_DECODED: &str = "decoded data longer than files[].size";

/// Writes into the current tar member: running past the member's declared size is the
/// source's integrity failure (`what: longer`), any other error is the import pipe's.
fn write_member<W: Write>(
    tar: &mut TarWriter<W>,
    data: &[u8],
    what: &str,
    longer: &str,
    local: &str,
) -> Result<(), TransferError> {
    tar.write_body(data).map_err(|e| {
        if e.kind() == io::ErrorKind::InvalidData {
            TransferError::Integrity(format!("{what}: {longer}"))
        } else {
            pipe_err(local, e)
        }
    })
}

fn pipe_err(local: &str, e: io::Error) -> TransferError {
    TransferError::Cocoon(format!("import {local}: writing stdin: {e}"))
}

#[allow(clippy::too_many_arguments)]
fn write_import_tar<W: Write>(
    client: &RegistryClient,
    repository: &str,
    what: &str,
    cfg: &SnapshotConfig,
    entries: &[PlanEntry],
    local: &str,
    mtime: u64,
    tar: &mut TarWriter<W>,
    win: usize,
    out_cap: u64,
    raw_win: usize,
) -> Result<(), TransferError> {
    let env = format::envelope_for_import(cfg, local);
    tar.begin_entry("snapshot.json", env.len() as u64, 0o644, mtime, &[])
        .map_err(|e| pipe_err(local, e))?;
    tar.write_body(&env).map_err(|e| pipe_err(local, e))?;
    tar.end_entry().map_err(|e| pipe_err(local, e))?;
    let mut buf = vec![0u8; COPY_BUF];
    for e in entries {
        let (title, size) = match e {
            PlanEntry::Raw { title, desc } => (title, desc.size()),
            PlanEntry::Encoded { title, size, .. } => (title, *size),
        };
        let file = cfg.files.get(title).cloned().unwrap_or_default();
        let mode = format::import_mode(file.mode);
        let mut pax = Vec::new();
        if !file.sparse_map.is_empty() {
            if file.sparse_size <= 0 {
                return Err(TransferError::Format(format!(
                    "{what}: {title} has a sparse map without a sparse size"
                )));
            }
            pax.push((format::SPARSE_MAP.to_string(), file.sparse_map.clone()));
            pax.push((
                format::SPARSE_SIZE.to_string(),
                file.sparse_size.to_string(),
            ));
        }
        tar.begin_entry(title, size, mode, mtime, &pax)
            .map_err(|e| pipe_err(local, e))?;
        match e {
            PlanEntry::Raw { desc, .. } => {
                let blob_what = format!("{what}: {title} blob {}", desc.digest());
                let ranged = raw_win >= 2
                    && desc.size() >= RANGE_MIN
                    && ranged_blob(client, repository, desc, &blob_what, raw_win, tar, local)?;
                if !ranged {
                    let r = client.get_blob(repository, desc.digest().as_ref(), desc.size())?;
                    copy_pipelined(r, &blob_what, |data| {
                        write_member(tar, data, &blob_what, LONGER_RAW, local)
                    })?;
                }
            }
            PlanEntry::Encoded {
                chunks, compressed, ..
            } if win >= 2 && chunks.len() >= 2 => {
                parallel_chunks(
                    client,
                    repository,
                    what,
                    title,
                    chunks,
                    *compressed,
                    win.min(chunks.len()),
                    out_cap,
                    tar,
                    local,
                )?;
            }
            PlanEntry::Encoded {
                chunks, compressed, ..
            } => {
                let chain = ChunkChain {
                    client,
                    repository,
                    chunks,
                    next: 0,
                    current: None,
                    what: format!("{what}: {title}"),
                };
                if *compressed {
                    let mut dec = zstd::stream::read::Decoder::new(chain)
                        .map_err(|e| TransferError::Io(format!("zstd: {e}")))?;
                    copy_into(&mut dec, tar, &mut buf, &format!("{what}: {title}"), local)?;
                } else {
                    let mut chain = chain;
                    copy_into(
                        &mut chain,
                        tar,
                        &mut buf,
                        &format!("{what}: {title}"),
                        local,
                    )?;
                }
            }
        }
        tar.end_entry()
            .map_err(|e| TransferError::Integrity(format!("{what}: {title}: {e}")))?;
    }
    Ok(())
}

/// Copies a verified source into the current tar member; source errors are integrity or
/// network errors, sink errors are the import child's.
fn copy_into<R: Read, W: Write>(
    src: &mut R,
    tar: &mut TarWriter<W>,
    buf: &mut [u8],
    what: &str,
    local: &str,
) -> Result<(), TransferError> {
    loop {
        let n = match src.read(buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(blob_err(e, what)),
        };
        write_member(tar, &buf[..n], what, LONGER_DECODED, local)?;
    }
}

/// Copies a blob to `sink` with the network reads on a helper thread and the hashing on this
/// one (before each write into cocoon's pipe), so receive, hash and pipe write overlap; the
/// digest is checked before returning, i.e. before the import stream can end. At most
/// `PIPELINE_DEPTH` + 2 buffers in flight.
fn copy_pipelined(
    src: BlobReader,
    what: &str,
    mut sink: impl FnMut(&[u8]) -> Result<(), TransferError>,
) -> Result<(), TransferError> {
    let (mut src, mut check) = src.split();
    let (tx, rx) = mpsc::sync_channel::<io::Result<Vec<u8>>>(PIPELINE_DEPTH);
    let (back_tx, back_rx) = mpsc::channel::<Vec<u8>>();
    std::thread::scope(|scope| {
        scope.spawn(move || loop {
            let mut buf = back_rx.try_recv().unwrap_or_else(|_| vec![0u8; COPY_BUF]);
            buf.resize(COPY_BUF, 0);
            let mut filled = 0;
            let res = loop {
                match src.read(&mut buf[filled..]) {
                    Ok(0) => break Ok(()),
                    Ok(n) => {
                        filled += n;
                        if filled == buf.len() {
                            break Ok(());
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(e),
                }
            };
            let last = filled < COPY_BUF;
            buf.truncate(filled);
            let failed = res.is_err();
            if tx.send(res.map(|_| buf)).is_err() || failed || last {
                return;
            }
        });
        let result = (|| {
            for msg in rx.iter() {
                let data = msg.map_err(|e| blob_err(e, what))?;
                if !data.is_empty() {
                    check.update(&data);
                    sink(&data)?;
                }
                let _ = back_tx.send(data);
            }
            Ok(())
        })();
        // On a sink error, dropping the receiver stops the reader at its next send.
        drop(rx);
        result
    })?;
    check.finish().map_err(|e| blob_err(e, what))
}

/// Sequential reader over a file's chunk blobs; opens one blob at a time.
struct ChunkChain<'a> {
    client: &'a RegistryClient,
    repository: &'a str,
    chunks: &'a [Descriptor],
    next: usize,
    current: Option<BlobReader>,
    what: String,
}

impl Read for ChunkChain<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.current.is_none() {
                let Some(d) = self.chunks.get(self.next) else {
                    return Ok(0);
                };
                self.next += 1;
                let r = self
                    .client
                    .get_blob(self.repository, d.digest().as_ref(), d.size())
                    .map_err(|e| io::Error::other(format!("{}: {e}", self.what)))?;
                self.current = Some(r);
            }
            if let Some(r) = self.current.as_mut() {
                let n = r.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.current = None;
            }
        }
    }
}

/// Parallel mode: up to `win` chunks fetched and decoded ahead, written in order.
#[allow(clippy::too_many_arguments)]
fn parallel_chunks<W: Write>(
    client: &RegistryClient,
    repository: &str,
    what: &str,
    title: &str,
    chunks: &[Descriptor],
    compressed: bool,
    win: usize,
    out_cap: u64,
    tar: &mut TarWriter<W>,
    local: &str,
) -> Result<(), TransferError> {
    let init = || {
        zstd::bulk::Decompressor::new()
            .map_err(|e| TransferError::Io(format!("zstd: no decoder context: {e}")))
    };
    let fetch = |decoder: &mut zstd::bulk::Decompressor<'static>, idx: usize, pool: &Pool| {
        let d = &chunks[idx];
        let cwhat = format!("{what}: {title} chunk {idx} ({})", d.digest());
        let mut raw = take_buf(pool);
        let res = fetch_blob_into(client, repository, d, &mut raw, &cwhat).and_then(|()| {
            if !compressed {
                return Ok(std::mem::take(&mut raw));
            }
            let mut out = take_buf(pool);
            out.clear();
            out.reserve(out_cap as usize);
            decoder
                .decompress_to_buffer(&raw, &mut out)
                .map_err(|e| TransferError::Integrity(format!("{cwhat}: zstd decode: {e}")))?;
            Ok(out)
        });
        give_buf(pool, raw);
        res
    };
    let ewhat = format!("{what}: {title}");
    ordered_fetch(chunks.len(), win, &ewhat, init, fetch, |data| {
        write_member(tar, data, &ewhat, LONGER_DECODED, local)
    })
}

/// Blob pieces fetched ahead by the ranged path: `RANGE_PIECE` bytes each, so the window of
/// [`MAX_DOWNLOADS`] pieces fits in [`PREFETCH_CAP`].
const RANGE_PIECE: u64 = 8 * MIB;
/// Raw blobs from this size on are fetched as parallel ranges: four pieces, one per download
/// slot, the least that keeps every slot busy. Smaller blobs take under a tenth of a second
/// on one stream, so the extra requests would buy nothing.
const RANGE_MIN: u64 = 4 * RANGE_PIECE;

/// Workers for the ranged path: one per download slot, within the memory cap and the
/// configured concurrency; below two there is nothing to overlap.
fn range_window(concurrency: usize) -> usize {
    MAX_DOWNLOADS
        .min(concurrency)
        .min((PREFETCH_CAP / RANGE_PIECE) as usize)
}

/// Writes a large raw blob into the current tar member from parallel `Range` GETs of
/// [`RANGE_PIECE`] bytes, hashed in order with one digest that is checked (with the
/// length) before returning, i.e. before the entry can end. `Ok(false)` when the registry
/// ignores ranges before any byte was written: the caller streams the blob instead.
#[allow(clippy::too_many_arguments)]
fn ranged_blob<W: Write>(
    client: &RegistryClient,
    repository: &str,
    desc: &Descriptor,
    blob_what: &str,
    win: usize,
    tar: &mut TarWriter<W>,
    local: &str,
) -> Result<bool, TransferError> {
    let size = desc.size();
    let digest = desc.digest().to_string();
    let pieces = size.div_ceil(RANGE_PIECE) as usize;
    let not_partial = std::sync::atomic::AtomicBool::new(false);
    let fetch = |_: &mut (), idx: usize, pool: &Pool| {
        let offset = idx as u64 * RANGE_PIECE;
        let len = RANGE_PIECE.min(size - offset);
        let mut buf = take_buf(pool);
        match client.get_blob_range(repository, &digest, size, offset, len, &mut buf) {
            Ok(RangeAnswer::Partial) => Ok(buf),
            Ok(RangeAnswer::NotPartial) => {
                give_buf(pool, buf);
                not_partial.store(true, std::sync::atomic::Ordering::Relaxed);
                Err(TransferError::Registry(format!(
                    "{blob_what}: registry stopped answering range requests"
                )))
            }
            Err(e) => {
                give_buf(pool, buf);
                Err(e)
            }
        }
    };
    let mut check = BlobCheck::new(&digest, blob_what);
    let mut written = 0u64;
    let res = ordered_fetch(
        pieces,
        win,
        blob_what,
        || Ok(()),
        fetch,
        |data| {
            check.update(data);
            written += data.len() as u64;
            write_member(tar, data, blob_what, LONGER_RAW, local)
        },
    );
    match res {
        Err(_) if written == 0 && not_partial.load(std::sync::atomic::Ordering::Relaxed) => {
            log::info!("{blob_what}: registry ignores Range requests; one stream instead");
            return Ok(false);
        }
        Err(e) => return Err(e),
        Ok(()) => {}
    }
    if written != size {
        return Err(TransferError::Integrity(format!(
            "{blob_what}: got {written} of {size} bytes"
        )));
    }
    check.finish().map_err(|e| blob_err(e, blob_what))?;
    Ok(true)
}

type Pool = Mutex<Vec<Vec<u8>>>;

/// The engine of the parallel paths: `count` numbered pieces fetched by `win` worker threads
/// (each with a state made by `init`), never more than `win` ahead of the writer, handed to
/// `sink` in order on this thread. Piece buffers are recycled: fresh multi-MiB allocations per
/// piece on several threads make glibc keep freed memory in per-thread arenas, which is what
/// inflated peak RSS. The first error stops the workers and is returned.
fn ordered_fetch<S>(
    count: usize,
    win: usize,
    what: &str,
    init: impl Fn() -> Result<S, TransferError> + Sync,
    fetch: impl Fn(&mut S, usize, &Pool) -> Result<Vec<u8>, TransferError> + Sync,
    mut sink: impl FnMut(&[u8]) -> Result<(), TransferError>,
) -> Result<(), TransferError> {
    struct Shared {
        next: usize,
        written: usize,
        stop: bool,
    }
    let shared = Mutex::new(Shared {
        next: 0,
        written: 0,
        stop: false,
    });
    let cv = Condvar::new();
    let pool: Pool = Mutex::new(Vec::new());
    let (tx, rx) = mpsc::channel::<(usize, Result<Vec<u8>, TransferError>)>();
    std::thread::scope(|scope| {
        for _ in 0..win {
            let tx = tx.clone();
            let (shared, cv, pool, init, fetch) = (&shared, &cv, &pool, &init, &fetch);
            scope.spawn(move || {
                let mut state = match init() {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send((usize::MAX, Err(e)));
                        return;
                    }
                };
                loop {
                    let idx = {
                        let mut s = lock_shared(shared);
                        while !s.stop && s.next < count && s.next >= s.written + win {
                            s = cv.wait(s).unwrap_or_else(|p| p.into_inner());
                        }
                        if s.stop || s.next >= count {
                            return;
                        }
                        s.next += 1;
                        s.next - 1
                    };
                    let res = fetch(&mut state, idx, pool);
                    let failed = res.is_err();
                    if tx.send((idx, res)).is_err() || failed {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut pending: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
        let mut want = 0usize;
        let result = (|| -> Result<(), TransferError> {
            while want < count {
                let Ok((idx, res)) = rx.recv() else {
                    return Err(TransferError::Transient(format!(
                        "{what}: fetchers stopped early"
                    )));
                };
                pending.insert(idx, res?);
                while let Some(data) = pending.remove(&want) {
                    let data = ReturnToPool(data, &pool);
                    sink(&data)?;
                    want += 1;
                    lock_shared(&shared).written = want;
                    cv.notify_all();
                }
            }
            Ok(())
        })();
        lock_shared(&shared).stop = true;
        cv.notify_all();
        // Drain so blocked senders finish; the scope joins the fetchers.
        while rx.recv().is_ok() {}
        result
    })
}

fn take_buf(pool: &Pool) -> Vec<u8> {
    lock_shared(pool).pop().unwrap_or_default()
}

fn give_buf(pool: &Pool, buf: Vec<u8>) {
    if buf.capacity() > 0 {
        lock_shared(pool).push(buf);
    }
}

/// A decoded chunk being written; its buffer goes back to the pool afterwards.
struct ReturnToPool<'a>(Vec<u8>, &'a Pool);

impl std::ops::Deref for ReturnToPool<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for ReturnToPool<'_> {
    fn drop(&mut self) {
        give_buf(self.1, std::mem::take(&mut self.0));
    }
}

fn lock_shared<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stride_and_window() {
        assert_eq!(stride(10, 1), 10);
        assert_eq!(stride(10, 3), 5);
        assert_eq!(stride(9, 3), 5);
        let d = |size: u64| {
            Descriptor::new(
                oci_spec::image::MediaType::from("application/vnd.cocoonstack.vm.memory+zstd"),
                size,
                format!("sha256:{}", "a".repeat(64))
                    .parse::<oci_spec::image::Digest>()
                    .unwrap(),
            )
        };
        let e = vec![PlanEntry::Encoded {
            title: "m".into(),
            chunks: vec![d(10 * MIB), d(10 * MIB), d(5 * MIB)],
            compressed: true,
            size: 150 * MIB,
        }];
        // out cap = stride(150 MiB, 3) = 75 MiB, in cap = 10 MiB: (2048-75)/85 = 23 → min(8),
        // then the 32 MiB prefetch cap leaves the minimum of two.
        assert_eq!(window(&e, 8, 2048 * MIB).0, 2);
        assert_eq!(window(&e, 8, 200 * MIB).0, 1);
        // 4 MiB chunks: in cap 4 MiB, out cap stride(1 GiB, 256) just above 4 MiB, so
        // 32 MiB holds 3 chunks in flight, not 8.
        let e = vec![PlanEntry::Encoded {
            title: "m".into(),
            chunks: vec![d(4 * MIB); 256],
            compressed: true,
            size: 1024 * MIB,
        }];
        assert_eq!(window(&e, 8, 2048 * MIB).0, 3);
    }
}
