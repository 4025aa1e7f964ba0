//! One exported file to registry blobs: a raw layer, or chunks compressed in parallel.
//! Progress is logged every GiB; memory stays within the knobs' budget.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use super::spool::Spool;
use super::{export_err, PushRequest, COMPRESS_MIN, MAX_CHUNKS, MIB, PROGRESS_STEP, STREAM_MIN};
use crate::snapshots::client::{sha256_digest, Body, RegistryClient};
use crate::snapshots::format::{self, LayerDesc, SnapshotFile};
use crate::snapshots::tarstream::{TarEntry, TarReader};
use crate::snapshots::TransferError;

pub(super) struct PushState<'a> {
    pub(super) client: &'a RegistryClient,
    pub(super) repository: String,
    pub(super) req: &'a PushRequest,
    pub(super) layers: Vec<LayerDesc>,
    pub(super) files: BTreeMap<String, SnapshotFile>,
    pub(super) v2: bool,
    pub(super) pushed: AtomicU64,
    pub(super) next_progress: AtomicU64,
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

    pub(super) fn push_file<R: Read>(
        &mut self,
        entry: &TarEntry,
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
