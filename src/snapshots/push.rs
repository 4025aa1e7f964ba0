//! Snapshot push: stream `cocoon snapshot export NAME -o -`, turn tar
//! entries into blobs (v1 raw, v2 chunked / zstd), then config and manifest. Memory bounded.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest as _, Sha256};

use super::client::{sha256_digest, Body, RegistryClient, MAX_PIPELINED_PUSHES};
use super::cocoon_child::CocoonChild;
use super::format::{self, LayerDesc, SnapshotConfig, SnapshotFile};
use super::reference::hex_lower;
use super::tarstream::TarReader;
use super::TransferError;

const MIB: u64 = 1 << 20;
const READ_BUF: usize = 1 << 20;
/// Files at least this big are compressed when zstd is on.
const COMPRESS_MIN: u64 = MIB;
const MAX_CHUNKS: u64 = 1 << 20;
const PROGRESS_STEP: u64 = 1 << 30;
/// Raw files at least this big are streamed into the upload instead of spooled first.
const STREAM_MIN: u64 = 4 * MIB;

/// The SNAPSHOT_* knobs. All-zero zstd and chunk = the exact v1 writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushKnobs {
    /// `SNAPSHOT_ZSTD_LEVEL`; 0 = no compression.
    pub zstd_level: i32,
    /// `SNAPSHOT_CHUNK_SIZE_MIB` in bytes; 0 = no chunking.
    pub chunk_size: u64,
    /// `SNAPSHOT_TRANSFER_CONCURRENCY` (default 8).
    pub concurrency: usize,
    /// `SNAPSHOT_MEMORY_BUDGET_MIB` in bytes (default 9216 MiB).
    pub memory_budget: u64,
}

impl Default for PushKnobs {
    fn default() -> Self {
        PushKnobs {
            zstd_level: 0,
            chunk_size: 0,
            concurrency: 8,
            memory_budget: 9216 * MIB,
        }
    }
}

fn env_nonneg(name: &str) -> Option<u64> {
    // Invalid or negative → 0.
    std::env::var(name)
        .ok()
        .map(|v| v.trim().parse::<i64>().ok().filter(|n| *n > 0).unwrap_or(0) as u64)
}

impl PushKnobs {
    /// Reads the knobs from the environment.
    pub fn from_env() -> Self {
        let d = PushKnobs::default();
        PushKnobs {
            zstd_level: env_nonneg("SNAPSHOT_ZSTD_LEVEL")
                .map(|v| v.min(22) as i32)
                .unwrap_or(0),
            chunk_size: env_nonneg("SNAPSHOT_CHUNK_SIZE_MIB")
                .map(|v| v.min(4096) * MIB)
                .unwrap_or(0),
            concurrency: env_nonneg("SNAPSHOT_TRANSFER_CONCURRENCY")
                .filter(|v| *v > 0)
                .map(|v| v as usize)
                .unwrap_or(d.concurrency),
            memory_budget: env_nonneg("SNAPSHOT_MEMORY_BUDGET_MIB")
                .filter(|v| *v > 0)
                .map(|v| v * MIB)
                .unwrap_or(d.memory_budget),
        }
    }

    /// True when the v2-capable writer is active (the node-wide push gate applies).
    pub fn pipelined(&self) -> bool {
        self.zstd_level > 0 || self.chunk_size > 0
    }

    /// Chunk workers: min(concurrency, floor(budget / (2 × chunk)) − 1), at least 1.
    pub fn workers(&self) -> usize {
        if self.chunk_size == 0 {
            return 1;
        }
        let by_budget = (self.memory_budget / (2 * self.chunk_size)).saturating_sub(1) as usize;
        self.concurrency.min(by_budget).max(1)
    }

    fn validate(&self) -> Result<(), TransferError> {
        if self.chunk_size > 4096 * MIB {
            return Err(TransferError::Invalid(format!(
                "chunk size {} MiB exceeds 4096 MiB",
                self.chunk_size / MIB
            )));
        }
        if self.chunk_size > 0 && 4 * self.chunk_size > self.memory_budget {
            return Err(TransferError::Invalid(format!(
                "chunk size {} MiB needs a memory budget of at least {} MiB (have {} MiB)",
                self.chunk_size / MIB,
                4 * self.chunk_size / MIB,
                self.memory_budget / MIB
            )));
        }
        Ok(())
    }

    /// zstd level the Go library's four speed classes correspond to.
    fn zstd_native_level(&self) -> i32 {
        match self.zstd_level {
            l if l < 3 => 1,
            3..=5 => 3,
            6..=9 => 7,
            _ => 11,
        }
    }
}

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
    let mut envelope: Option<SnapshotConfig> = None;
    let read_result = (|| -> Result<(), TransferError> {
        while let Some(entry) = tar.next_entry().map_err(|e| export_err(&req.name, e))? {
            if entry.name == "snapshot.json" {
                let mut body = Vec::new();
                tar.body()
                    .take(format::CONFIG_LIMIT + 1)
                    .read_to_end(&mut body)
                    .map_err(|e| export_err(&req.name, e))?;
                if body.len() as u64 > format::CONFIG_LIMIT {
                    return Err(TransferError::Format(format!(
                        "export {}: snapshot.json larger than 64 MiB",
                        req.name
                    )));
                }
                envelope = Some(format::config_from_envelope(&body)?);
                continue;
            }
            if !entry.is_regular() {
                continue;
            }
            state.push_file(&entry, &mut tar)?;
        }
        Ok(())
    })();
    drop(tar);
    // A read error wins over the subprocess error.
    if let Err(e) = read_result {
        let stderr = child.kill();
        return Err(match e {
            TransferError::Format(m) if !stderr.is_empty() => {
                TransferError::Format(format!("{m} (cocoon stderr: {stderr})"))
            }
            other => other,
        });
    }
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

fn export_err(name: &str, e: io::Error) -> TransferError {
    TransferError::Format(format!("export {name}: reading tar stream: {e}"))
}

struct PushState<'a> {
    client: &'a RegistryClient,
    repository: String,
    req: &'a PushRequest,
    layers: Vec<LayerDesc>,
    files: BTreeMap<String, SnapshotFile>,
    v2: bool,
    pushed: AtomicU64,
    next_progress: AtomicU64,
}

impl PushState<'_> {
    fn progress(&self, n: u64) {
        let total = self.pushed.fetch_add(n, Ordering::Relaxed) + n;
        let next = self.next_progress.load(Ordering::Relaxed);
        if total >= next
            && self
                .next_progress
                .compare_exchange(
                    next,
                    next + PROGRESS_STEP,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            log::info!("push {}: {} MiB uploaded", self.req.name, total / MIB);
        }
    }

    fn push_file<R: Read>(
        &mut self,
        entry: &super::tarstream::TarEntry,
        tar: &mut TarReader<R>,
    ) -> Result<(), TransferError> {
        let knobs = &self.req.knobs;
        let name = entry.name.clone();
        let mut file = SnapshotFile {
            mode: (entry.mode & 0o7777) as i64,
            ..Default::default()
        };
        if let Some(map) = entry.pax.get(format::SPARSE_MAP) {
            let size = entry
                .pax
                .get(format::SPARSE_SIZE)
                .and_then(|s| s.parse::<i64>().ok());
            let Some(size) = size else {
                return Err(TransferError::Format(format!(
                    "export {}: {name} has a sparse map without a valid sparse size",
                    self.req.name
                )));
            };
            file.sparse_map = map.clone();
            file.sparse_size = size;
        }
        let size = entry.size;
        if knobs.pipelined() {
            file.size = size as i64;
        }
        let base_type = format::media_type_for(&name);
        let compress = knobs.zstd_level > 0 && size >= COMPRESS_MIN;
        let c = knobs.chunk_size;
        if c > 0 && (compress || size > c) {
            let count = size.div_ceil(c).max(1);
            if count > MAX_CHUNKS {
                return Err(TransferError::Invalid(format!(
                    "{name}: {count} chunks exceed the limit of {MAX_CHUNKS}"
                )));
            }
            let media = if compress {
                format!("{base_type}+zstd")
            } else {
                base_type.to_string()
            };
            let descs = self.push_chunked(&name, tar, size, count, &media, compress)?;
            if count > 1 {
                file.chunks = descs.iter().map(|d| d.digest.clone()).collect();
            }
            self.layers.extend(descs);
            self.v2 = true;
        } else {
            let spool = Spool::create(self.req.temp_dir.as_deref())?;
            let mut streamed = false;
            let (digest, blob_size) = if compress {
                self.v2 = true;
                spool.write_compressed(tar, size, self.req.knobs.zstd_native_level(), &name)?
            } else if size >= STREAM_MIN {
                let (d, n, ok) =
                    spool.stream_raw(self.client, &self.repository, tar, size, &name)?;
                streamed = ok;
                (d, n)
            } else {
                spool.write_raw(tar, size, &name)?
            };
            let media = if compress {
                format!("{base_type}+zstd")
            } else {
                base_type.to_string()
            };
            if !streamed {
                self.client.put_blob(
                    &self.repository,
                    &digest,
                    Body::File {
                        file: &spool.file,
                        len: blob_size,
                    },
                )?;
            }
            self.progress(blob_size);
            let mut ann = BTreeMap::new();
            ann.insert(format::TITLE.to_string(), name.clone());
            self.layers.push(LayerDesc {
                media_type: media,
                digest,
                size: blob_size,
                annotations: ann,
            });
        }
        self.files.insert(name, file);
        Ok(())
    }

    /// Chunked path: this thread cuts the body into chunk buffers, a bounded pool compresses,
    /// hashes and uploads them; descriptors keep their index order.
    fn push_chunked<R: Read>(
        &self,
        name: &str,
        tar: &mut TarReader<R>,
        size: u64,
        count: u64,
        media: &str,
        compress: bool,
    ) -> Result<Vec<LayerDesc>, TransferError> {
        let c = self.req.knobs.chunk_size;
        let workers = self.req.knobs.workers().min(count as usize).max(1);
        let level = self.req.knobs.zstd_native_level();
        let results: Mutex<Vec<Option<LayerDesc>>> = Mutex::new(vec![None; count as usize]);
        let failure: Mutex<Option<TransferError>> = Mutex::new(None);
        let (tx, rx) = mpsc::sync_channel::<(usize, Vec<u8>)>(0);
        let rx = Mutex::new(rx);
        // Chunk and compressed buffers are recycled (as on pull): fresh multi-MiB allocations
        // on several threads leave freed memory in glibc's per-thread arenas.
        let pool: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
        let pool = &pool;
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let job = { lock(&rx).recv() };
                    let Ok((idx, raw)) = job else { return };
                    if lock(&failure).is_some() {
                        continue;
                    }
                    match self.upload_chunk(idx, raw, count, media, name, compress, level, pool) {
                        Ok(d) => lock(&results)[idx] = Some(d),
                        Err(e) => {
                            let mut f = lock(&failure);
                            if f.is_none() {
                                *f = Some(e);
                            }
                        }
                    }
                });
            }
            let mut remaining = size;
            for idx in 0..count as usize {
                if lock(&failure).is_some() {
                    break;
                }
                let len = remaining.min(c) as usize;
                let mut buf = lock(pool).pop().unwrap_or_default();
                buf.clear();
                buf.resize(len, 0);
                match tar.read_body_full(&mut buf) {
                    Ok(n) if n == len => {}
                    Ok(n) => {
                        *lock(&failure) = Some(TransferError::Format(format!(
                            "export {}: {name}: body ended after {} of {size} bytes",
                            self.req.name,
                            size - remaining + n as u64
                        )));
                        break;
                    }
                    Err(e) => {
                        *lock(&failure) = Some(export_err(&self.req.name, e));
                        break;
                    }
                }
                remaining -= len as u64;
                if tx.send((idx, buf)).is_err() {
                    break;
                }
            }
            drop(tx);
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
        results
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                d.ok_or_else(|| {
                    TransferError::Format(format!("{name}: chunk {i} missing after upload"))
                })
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn upload_chunk(
        &self,
        idx: usize,
        raw: Vec<u8>,
        count: u64,
        media: &str,
        name: &str,
        compress: bool,
        level: i32,
        pool: &Mutex<Vec<Vec<u8>>>,
    ) -> Result<LayerDesc, TransferError> {
        let blob = if compress {
            // One complete frame per chunk; the content size is pledged so the window never
            // exceeds the chunk.
            let mut enc = zstd::bulk::Compressor::new(level)
                .map_err(|e| TransferError::Io(format!("zstd: {e}")))?;
            let _ = enc.include_contentsize(true);
            let mut out = lock(pool).pop().unwrap_or_default();
            out.clear();
            out.reserve(zstd::zstd_safe::compress_bound(raw.len()));
            let done = enc
                .compress_to_buffer(&raw, &mut out)
                .map_err(|e| TransferError::Io(format!("zstd compress {name} chunk {idx}: {e}")));
            lock(pool).push(raw);
            done?;
            out
        } else {
            raw
        };
        let digest = sha256_digest(&blob);
        self.client
            .put_blob(&self.repository, &digest, Body::Bytes(&blob))?;
        self.progress(blob.len() as u64);
        let mut ann = BTreeMap::new();
        ann.insert(format::TITLE.to_string(), name.to_string());
        if count > 1 {
            ann.insert(format::CHUNK_INDEX.to_string(), idx.to_string());
            ann.insert(format::CHUNK_COUNT.to_string(), count.to_string());
        }
        let size = blob.len() as u64;
        lock(pool).push(blob);
        Ok(LayerDesc {
            media_type: media.to_string(),
            digest,
            size,
            annotations: ann,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why the spool directory cannot be used; the message names the directory.
#[derive(Debug)]
pub struct SpoolDirError {
    pub dir: PathBuf,
    pub problem: SpoolDirProblem,
}

/// What is wrong with the spool directory.
#[derive(Debug)]
pub enum SpoolDirProblem {
    /// Creating, inspecting or narrowing it failed.
    Io(io::Error),
    /// A symlink (never followed) or something other than a directory.
    NotADirectory,
    /// Owned by another user than the daemon's.
    ForeignOwner { uid: u32, ours: u32 },
}

impl fmt::Display for SpoolDirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "spool directory {}: ", self.dir.display())?;
        match &self.problem {
            SpoolDirProblem::Io(e) => write!(f, "{e}"),
            SpoolDirProblem::NotADirectory => {
                f.write_str("is a symlink or not a directory; remove it (vk-cocoon creates it)")
            }
            SpoolDirProblem::ForeignOwner { uid, ours } => write!(
                f,
                "is owned by uid {uid}, not by vk-cocoon's uid {ours}; remove it (vk-cocoon \
                 creates it)"
            ),
        }
    }
}

impl std::error::Error for SpoolDirError {}

/// Makes `dir` the daemon's private spool directory: created with mode 0700 when missing; an
/// existing one must be a real directory (not a symlink) owned by this process's user, and is
/// narrowed to 0700 when it allows more. A snapshot layer passes through the spool: guest memory
/// and disk that no other user of the host may read.
pub fn prepare_spool_dir(dir: &Path) -> Result<(), SpoolDirError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let fail = |problem| SpoolDirError {
        dir: dir.to_path_buf(),
        problem,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(SpoolDirProblem::Io(e))),
    }
    // lstat: a symlink is refused, never followed.
    let meta = std::fs::symlink_metadata(dir).map_err(|e| fail(SpoolDirProblem::Io(e)))?;
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(fail(SpoolDirProblem::NotADirectory));
    }
    let uid = rustix::process::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(fail(SpoolDirProblem::ForeignOwner {
            uid: meta.uid(),
            ours: uid,
        }));
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| fail(SpoolDirProblem::Io(e)))?;
    }
    Ok(())
}

/// An unlinked temporary file (prefix `cocoon-snapshot-`), mode 0600: removed from the
/// directory right after creation, so nothing is left behind whatever happens to the push.
struct Spool {
    file: File,
    /// Where it lives (named in errors: a full disk there fails the push).
    dir: PathBuf,
}

static SPOOL_SEQ: AtomicU64 = AtomicU64::new(0);

impl Spool {
    /// A write to the spool failed (a full disk, most likely).
    fn write_error(&self, name: &str, e: io::Error) -> TransferError {
        TransferError::Io(format!("spool {name} in {}: {e}", self.dir.display()))
    }

    fn create(dir: Option<&Path>) -> Result<Self, TransferError> {
        let dir = dir
            .map(Path::to_path_buf)
            .unwrap_or_else(std::env::temp_dir);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = dir.join(format!(
            "cocoon-snapshot-{}-{}-{nanos}",
            std::process::id(),
            SPOOL_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| TransferError::Io(format!("create spool file {}: {e}", path.display())))?;
        std::fs::remove_file(&path)
            .map_err(|e| TransferError::Io(format!("unlink spool file {}: {e}", path.display())))?;
        Ok(Spool { file, dir })
    }

    /// Raw body straight into one upload (POST, PATCH streaming the tar body, PUT with the
    /// digest computed on the way) while also spooling it, so a failed stream falls back to
    /// the retried file upload. Returns (digest, size, uploaded by the stream).
    fn stream_raw<R: Read>(
        &self,
        client: &RegistryClient,
        repository: &str,
        tar: &mut TarReader<R>,
        size: u64,
        name: &str,
    ) -> Result<(String, u64, bool), TransferError> {
        let mut tee = Tee {
            tar,
            spool: io::BufWriter::with_capacity(READ_BUF, &self.file),
            hasher: Sha256::new(),
            count: 0,
            spool_failed: false,
        };
        let attempt = client
            .begin_upload(repository)
            .and_then(|u| client.patch_upload(repository, u, size, &mut tee));
        // Finish reading the body whatever happened, so the hash and the spool are complete;
        // an export stream error here is the real failure.
        let mut buf = vec![0u8; READ_BUF];
        loop {
            let n = match tee.read(&mut buf) {
                Ok(n) => n,
                Err(e) if tee.spool_failed => return Err(self.write_error(name, e)),
                Err(e) => {
                    return Err(TransferError::Format(format!(
                        "{name}: reading export stream: {e}"
                    )))
                }
            };
            if n == 0 {
                break;
            }
        }
        if tee.count != size {
            return Err(TransferError::Format(format!(
                "{name}: body ended after {} of {size} bytes",
                tee.count
            )));
        }
        tee.spool.flush().map_err(|e| self.write_error(name, e))?;
        let digest = format!("sha256:{}", hex_lower(&tee.hasher.finalize()));
        let uploaded = match attempt.and_then(|u| client.finish_upload(repository, u, &digest)) {
            Ok(()) => true,
            Err(e) => {
                log::info!("{name}: streamed upload failed ({e}); retrying from the spool file");
                false
            }
        };
        Ok((digest, size, uploaded))
    }

    /// Copies the body verbatim while hashing; returns (digest, size).
    fn write_raw<R: Read>(
        &self,
        tar: &mut TarReader<R>,
        size: u64,
        name: &str,
    ) -> Result<(String, u64), TransferError> {
        let mut w = HashingWriter {
            inner: io::BufWriter::with_capacity(READ_BUF, &self.file),
            hasher: Sha256::new(),
            written: 0,
        };
        let copied = copy_body(tar, &mut w, name, self)?;
        if copied != size {
            return Err(TransferError::Format(format!(
                "{name}: body ended after {copied} of {size} bytes"
            )));
        }
        w.inner.flush().map_err(|e| self.write_error(name, e))?;
        Ok((
            format!("sha256:{}", hex_lower(&w.hasher.finalize())),
            w.written,
        ))
    }

    /// Streams the body through one zstd encoder (pledged size) while hashing the output.
    fn write_compressed<R: Read>(
        &self,
        tar: &mut TarReader<R>,
        size: u64,
        level: i32,
        name: &str,
    ) -> Result<(String, u64), TransferError> {
        let w = HashingWriter {
            inner: io::BufWriter::with_capacity(READ_BUF, &self.file),
            hasher: Sha256::new(),
            written: 0,
        };
        let zerr = |e: io::Error| TransferError::Io(format!("zstd {name}: {e}"));
        let mut enc = zstd::stream::write::Encoder::new(w, level).map_err(zerr)?;
        enc.set_pledged_src_size(Some(size)).map_err(zerr)?;
        enc.include_contentsize(true).map_err(zerr)?;
        let copied = copy_body(tar, &mut enc, name, self)?;
        if copied != size {
            return Err(TransferError::Format(format!(
                "{name}: body ended after {copied} of {size} bytes"
            )));
        }
        let mut w = enc.finish().map_err(zerr)?;
        w.inner.flush().map_err(|e| self.write_error(name, e))?;
        Ok((
            format!("sha256:{}", hex_lower(&w.hasher.finalize())),
            w.written,
        ))
    }
}

fn copy_body<R: Read, W: Write>(
    tar: &mut TarReader<R>,
    w: &mut W,
    name: &str,
    spool: &Spool,
) -> Result<u64, TransferError> {
    let mut buf = vec![0u8; READ_BUF];
    let mut total = 0u64;
    loop {
        let n = tar
            .read_body(&mut buf)
            .map_err(|e| TransferError::Format(format!("{name}: reading export stream: {e}")))?;
        if n == 0 {
            return Ok(total);
        }
        w.write_all(&buf[..n])
            .map_err(|e| spool.write_error(name, e))?;
        total += n as u64;
    }
}

/// Reads the current tar body, hashing it and copying it into the spool on the way.
struct Tee<'a, R: Read, W: Write> {
    tar: &'a mut TarReader<R>,
    spool: W,
    hasher: Sha256,
    count: u64,
    /// The spool write failed (not the export stream): the error names the spool.
    spool_failed: bool,
}

impl<R: Read, W: Write> Read for Tee<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.tar.read_body(buf)?;
        if let Err(e) = self.spool.write_all(&buf[..n]) {
            self.spool_failed = true;
            return Err(e);
        }
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

struct HashingWriter<W: Write> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn the_spool_dir_is_private_and_refused_when_not_the_daemons() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("vk-spool");
        prepare_spool_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // Too wide (an earlier install, a hand-made dir of ours): narrowed.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_spool_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // A symlink is never followed, even to a directory of ours.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = prepare_spool_dir(&link).unwrap_err().to_string();
        assert!(e.contains("symlink"), "{e}");
        // Another user's directory is refused (only root can hand one over; tests run as root
        // where they can).
        if rustix::process::geteuid().is_root() {
            let theirs = root.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let e = prepare_spool_dir(&theirs).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }

    #[test]
    fn a_spool_file_is_0600_and_already_unlinked() {
        let root = tempfile::tempdir().unwrap();
        let spool = Spool::create(Some(root.path())).unwrap();
        let meta = spool.file.metadata().unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.nlink(), 0, "unlinked at once");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[test]
    fn knob_arithmetic() {
        let k = PushKnobs {
            zstd_level: 3,
            chunk_size: 64 * MIB,
            concurrency: 8,
            memory_budget: 9216 * MIB,
        };
        assert_eq!(k.workers(), 8);
        let k = PushKnobs {
            chunk_size: 64 * MIB,
            memory_budget: 512 * MIB,
            ..k
        };
        assert_eq!(k.workers(), 3);
        assert!(k.validate().is_ok());
        let k = PushKnobs {
            chunk_size: 256 * MIB,
            memory_budget: 512 * MIB,
            ..k
        };
        assert!(k.validate().is_err());
        assert!(!PushKnobs::default().pipelined());
    }
}
