//! Pull, writing: the import tar streamed into cocoon, member by member; a source longer
//! than declared is an integrity failure, any other write error the import pipe's.

use std::io::{self, Read, Write};

use crate::snapshots::client::RegistryClient;
use crate::snapshots::format::{self, SnapshotConfig};
use crate::snapshots::tarstream::TarWriter;
use crate::snapshots::TransferError;

use super::fetch::{parallel_chunks, ranged_blob, ChunkChain, RANGE_MIN};
use super::manifest::blob_err;
use super::plan::PlanEntry;
use super::*;

pub(super) struct CountingWriter<W: Write> {
    pub(super) inner: W,
    pub(super) count: u64,
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

pub(super) const LONGER_RAW: &str = "longer than its descriptor";
pub(super) const LONGER_DECODED: &str = "decoded data longer than files[].size";

/// Writes into the current tar member: running past the member's declared size is the
/// source's integrity failure (`what: longer`), any other error is the import pipe's.
pub(super) fn write_member<W: Write>(
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
pub(super) fn write_import_tar<W: Write>(
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
