//! Pull, fetching: blob bytes in order with reads, hashing and pipe writes overlapped
//! (pipelined copy, parallel chunks, ranged pieces), within a bounded buffer pool.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::sync::{mpsc, Condvar, Mutex};

use oci_spec::image::Descriptor;

use crate::snapshots::client::{BlobCheck, BlobReader, RangeAnswer, RegistryClient, MAX_DOWNLOADS};
use crate::snapshots::tarstream::TarWriter;
use crate::snapshots::TransferError;

use super::import_tar::{write_member, LONGER_DECODED, LONGER_RAW};
use super::manifest::{blob_err, fetch_blob_into};
use super::*;

/// Copies a blob to `sink` with the network reads on a helper thread and the hashing on this
/// one (before each write into cocoon's pipe), so receive, hash and pipe write overlap; the
/// digest is checked before returning, i.e. before the import stream can end. At most
/// `PIPELINE_DEPTH` + 2 buffers in flight.
pub(super) fn copy_pipelined(
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
pub(super) struct ChunkChain<'a> {
    pub(super) client: &'a RegistryClient,
    pub(super) repository: &'a str,
    pub(super) chunks: &'a [Descriptor],
    pub(super) next: usize,
    pub(super) current: Option<BlobReader>,
    pub(super) what: String,
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
pub(super) fn parallel_chunks<W: Write>(
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
pub(super) const RANGE_MIN: u64 = 4 * RANGE_PIECE;

/// Workers for the ranged path: one per download slot, within the memory cap and the
/// configured concurrency; below two there is nothing to overlap.
pub(super) fn range_window(concurrency: usize) -> usize {
    MAX_DOWNLOADS
        .min(concurrency)
        .min((PREFETCH_CAP / RANGE_PIECE) as usize)
}

/// Writes a large raw blob into the current tar member from parallel `Range` GETs of
/// [`RANGE_PIECE`] bytes, hashed in order with one digest that is checked (with the
/// length) before returning, i.e. before the entry can end. `Ok(false)` when the registry
/// ignores ranges before any byte was written: the caller streams the blob instead.
#[allow(clippy::too_many_arguments)]
pub(super) fn ranged_blob<W: Write>(
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
